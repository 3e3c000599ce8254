"""Several tuning workers sharing studies (``kvgen tune --gpus N``, several hosts on one
database), with a fake timer in real worker processes: every trial runs once, the results equal
a single process's, a killed worker loses only its running trial, a re-run resumes."""

import importlib.util
import json
import os
import pickle
import re
import subprocess
import sys
import time
import uuid
from collections import Counter
from pathlib import Path

import pytest
import torch

optuna = pytest.importorskip("optuna")

from kvgen.families.mxfp4_mla import StoreMXFP4MLASpec  # noqa: E402
from kvgen.space import load_space  # noqa: E402
from kvgen.tune import parallel, tuner  # noqa: E402

HERE = Path(__file__).parent
_spec = importlib.util.spec_from_file_location("_fake_tuning", HERE / "_fake_tuning.py")
fake = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fake)
ENV = fake.environment()

SPEC = StoreMXFP4MLASpec(32, 512, "bf16", "paged", "sm90", "gpu")
SPACE = load_space(SPEC.template)
BUCKETS = [{"num_tokens": 16}, {"num_tokens": 65536}]
FAKE = "_fake_tuning:evaluator"


def _env(log, sleep=0.02, die_at=0, fault_at=0, build_fault="", build_oom="", trial_oom="",
         trap="", oom_config="", trap_only=""):  # fmt: skip
    return {
        "KVGEN_FAKE_TRAP_ONLY": trap_only,
        "KVGEN_FAKE_OOM_CONFIG": oom_config,
        "KVGEN_FAKE_TRAP": trap,
        "KVGEN_FAKE_BUILD_OOM": build_oom,
        "KVGEN_FAKE_TRIAL_OOM": trial_oom,
        "KVGEN_TUNE_OOM_WAIT_S": "0.05",
        "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]),
        "KVGEN_FAKE_LOG": str(log),
        "KVGEN_FAKE_SLEEP": str(sleep),
        "KVGEN_FAKE_DIE_AT": str(die_at),
        "KVGEN_FAKE_FAULT_AT": str(fault_at),
        "KVGEN_FAKE_BUILD_FAULT": build_fault,
    }


def _prepare(storage, sampler, n_trials):
    store = tuner.storage_from(storage, Path(storage))
    for b in BUCKETS:
        tuner.open_study(SPEC, b, SPACE, storage=store, sampler=sampler, n_trials=n_trials)
    return store


def _run(storage, sampler, n_trials, log, workers=3, stop=None, jobs=None, **env):
    store = _prepare(storage, sampler, n_trials)
    plan = parallel.Plan(
        jobs=jobs or [(SPEC, b) for b in BUCKETS],
        storage=storage,
        sampler=sampler,
        n_trials=n_trials,
        evaluator=FAKE,
        stop=stop,
    )
    lines = []
    exits = parallel.run_workers(
        plan, [f"fake{i}" for i in range(workers)], log=lines.append, env=_env(log, **env)
    )
    return store, exits, lines


def _evaluations(log):
    """[(pid, study, params-json)] in the order the workers ran them."""
    return [tuple(line.split(" ", 2)) for line in Path(log).read_text().splitlines()]


def _study(store, bucket):
    return optuna.load_study(study_name=tuner.study_name(SPEC, bucket), storage=store)


def _single_process(tmp_path, sampler, n_trials):
    store = tuner.storage_from(str(tmp_path / "single.journal"), tmp_path / "x")
    return [
        tuner.run_study(
            SPEC, b, SPACE, fake.cost, storage=store, sampler=sampler, n_trials=n_trials
        )
        for b in BUCKETS
    ]


def _check_shared_grid(tmp_path, storage):
    log = tmp_path / "evals.log"
    store, exits, lines = _run(storage, "grid", 1000, log, workers=3)
    assert [e.returncode for e in exits] == [0, 0, 0], lines
    evals = _evaluations(log)
    feasible = [json.dumps(m, sort_keys=True) for m in SPACE.feasible(SPEC)]
    for b in BUCKETS:
        ran = [p for _, s, p in evals if s == f"{SPEC.name}@{b['num_tokens']}"]
        assert sorted(ran) == sorted(feasible)  # every feasible point once, none twice
        study = _study(store, b)
        assert len(tuner.counted(study.trials)) == len(SPACE.points())
        assert not study.get_trials(states=(optuna.trial.TrialState.RUNNING,))
    assert len({pid for pid, _, _ in evals}) >= 2  # the trials were spread over the workers
    # the same results as one process running the same grid
    single = _single_process(tmp_path, "grid", 1000)
    shared = [tuner.load_result(SPEC, b, store) for b in BUCKETS]
    for one, many in zip(single, shared, strict=True):
        assert (many.meta, many.time_us, many.trials, many.failed) == (
            one.meta,
            one.time_us,
            one.trials,
            one.failed,
        )
    # and the same JSON entries, but for what the study cost (tune_s): the workers recorded
    # their time on the studies, the one process none
    a = tuner.write_results(tmp_path / "a", "sm90", SPEC.family, single, ENV, "grid", 1000)
    b = tuner.write_results(tmp_path / "b", "sm90", SPEC.family, shared, ENV, "grid", 1000)
    one_entries = json.loads(a.read_text())["entries"][SPEC.name]
    many_entries = json.loads(b.read_text())["entries"][SPEC.name]
    assert all("tune_s" not in e for e in one_entries.values())
    assert all(many_entries[k].pop("tune_s") > 0 for k in many_entries)
    assert one_entries == many_entries


def test_workers_share_a_grid_study_and_match_one_process(tmp_path):
    _check_shared_grid(tmp_path, str(tmp_path / "tune.journal"))


def test_workers_share_a_tpe_study_each_trial_once(tmp_path):
    log = tmp_path / "evals.log"
    store, exits, lines = _run(str(tmp_path / "tune.journal"), "tpe", 14, log, workers=3)
    assert all(e.returncode == 0 for e in exits), lines
    evals = _evaluations(log)
    for b in BUCKETS:
        study = _study(store, b)
        trials = tuner.counted(study.trials)
        assert len(trials) == 14  # surplus trials (never run) do not count
        complete = [t for t in trials if t.state == optuna.trial.TrialState.COMPLETE]
        ran = [p for _, s, p in evals if s == f"{SPEC.name}@{b['num_tokens']}"]
        assert len(ran) == len(complete)  # each complete trial evaluated by exactly one worker
        assert trials[0].params == SPEC.default_meta(**b)  # the default went first
        for t in complete:
            assert t.value == fake.cost(t.params)
        assert tuner.load_result(SPEC, b, store).time_us == min(t.value for t in complete)


def test_workers_share_a_local_search_that_the_stop_rule_ends(tmp_path):
    """The local search on 3 workers with patience 3: each study stops once 3 finished trials
    in a row gained nothing, every trial that counts ran once, the rule holds in storage, and
    later trials (taken while the last ones ran) are surplus, never evaluated; the larger
    bucket started from the smaller one's best (warm start)."""
    log = tmp_path / "evals.log"
    stop = tuner.StopRule(patience=3)
    store, exits, lines = _run(str(tmp_path / "tune.journal"), "local", 19, log, workers=3,
                               stop=stop)  # fmt: skip
    assert all(e.returncode == 0 for e in exits), lines
    # each worker says where its time went (the evaluator's split) and why a study ended
    assert any(" s timing)" in line and "stopped: no more gain" in line for line in lines), lines
    evals = _evaluations(log)
    for b in BUCKETS:
        study = _study(store, b)
        trials = tuner.counted(study.trials)
        assert stop.met(study.trials) and len(trials) < 19
        ran = [p for _, s, p in evals if s == f"{SPEC.name}@{b['num_tokens']}"]
        # each trial that counts ran once (two workers that sample the same point at the same
        # moment may both run it: see tuner.NeighbourhoodSampler)
        assert len(ran) == len([t for t in trials if t.state.is_finished()])
        assert not study.get_trials(states=(optuna.trial.TrialState.RUNNING,))
        surplus = [t for t in study.trials if t.user_attrs.get("surplus")]
        assert all(t.state == optuna.trial.TrialState.FAIL for t in surplus)
        result = tuner.load_result(SPEC, b, store, stop)
        assert result.stopped_early and result.time_us == min(t.value for t in trials
                                                              if t.value is not None)  # fmt: skip
        # the workers that worked on it recorded their time on it (the progress line's ETA)
        spent = {k: v for k, v in study.user_attrs.items() if k.startswith("wall_s:")}
        assert spent and all(v > 0 for v in spent.values())
        assert tuner.wall_time(study) == pytest.approx(sum(spent.values()))
    # a worker that reached the second study took the first one's best so far as a start
    timed_first = [t.params for t in _study(store, BUCKETS[0]).trials if t.value is not None]
    warm = [t for t in _study(store, BUCKETS[1]).trials if "warm_start" in t.user_attrs]
    assert len(warm) <= 1 and all(t.params in timed_first for t in warm)


def test_killed_worker_loses_only_its_trial_and_a_rerun_resumes(tmp_path):
    journal = str(tmp_path / "tune.journal")
    log = tmp_path / "evals.log"
    store, exits, lines = _run(journal, "tpe", 10, log, workers=3, die_at=5)
    dead = [e for e in exits if e.deaths]
    assert len(dead) == 1 and dead[0].deaths == [-9] and dead[0].failed_trials == 1, lines
    assert all(e.returncode == 0 for e in exits), lines  # a fresh worker took the GPU
    assert any("died (signal 9)" in line for line in lines)
    failed = []
    for b in BUCKETS:  # the others went on: both studies hold their 10 trials
        study = _study(store, b)
        assert len(tuner.counted(study.trials)) == 10
        assert not study.get_trials(states=(optuna.trial.TrialState.RUNNING,))
        failed += [t for t in study.trials if "died" in tuner.failure(study, t)]
    assert len(failed) == 1
    first = {
        tuner.study_name(SPEC, b): [t.params for t in _study(store, b).trials] for b in BUCKETS
    }
    # a re-run with a larger budget continues the same studies
    store, exits, lines = _run(journal, "tpe", 16, log, workers=2)
    assert all(e.returncode == 0 for e in exits), lines
    for b in BUCKETS:
        trials = _study(store, b).trials
        assert len(tuner.counted(trials)) == 16
        before = first[tuner.study_name(SPEC, b)]
        assert [t.params for t in trials[: len(before)]] == before  # the same trials, then more


@pytest.mark.parametrize("workers", [3, 1])
def test_a_gpu_fault_ends_only_that_worker_and_a_fresh_one_takes_its_gpu(tmp_path, workers):
    """A broken CUDA context (every later trial of that process would fail): the worker fails
    its trial and exits, a fresh worker takes its GPU, and the studies finish, on one GPU as on
    several: the faulting candidate is one failed trial."""
    log = tmp_path / "evals.log"
    store, exits, lines = _run(
        str(tmp_path / "tune.journal"), "tpe", 10, log, workers=workers, fault_at=4
    )
    assert [e.deaths for e in exits if e.deaths] == [[parallel.EXIT_FAULT]], lines
    assert all(e.returncode == 0 for e in exits), lines
    assert any("GPU fault, this worker stops" in line for line in lines)
    assert any("died (a GPU fault)" in line and "a fresh worker takes the GPU" in line
               for line in lines)  # fmt: skip
    assert len({pid for pid, _, _ in _evaluations(log)}) >= 2  # the trials after it: another
    failed = []
    for b in BUCKETS:
        study = _study(store, b)
        assert len(tuner.counted(study.trials)) == 10
        assert not study.get_trials(states=(optuna.trial.TrialState.RUNNING,))
        failed += [t for t in study.trials if "worker fault" in tuner.failure(study, t)]
    assert len(failed) == 1


def test_a_gpu_fault_while_building_a_study_s_inputs_fails_no_trial(tmp_path):
    """A CUDA error raised while a worker builds a study's inputs (kernels that write a
    quantized cache, say) is that phase's: the worker says so and exits, a fresh one builds the
    inputs again and runs the study, and no trial is failed for it."""
    log = tmp_path / "evals.log"
    store, exits, lines = _run(str(tmp_path / "tune.journal"), "tpe", 10, log, workers=1,
                               build_fault="65536")  # fmt: skip
    assert [e.deaths for e in exits if e.deaths] == [[parallel.EXIT_FAULT]], lines
    assert all(e.returncode == 0 for e in exits), lines
    assert any("num_tokens=65536: GPU fault while building its inputs, this worker stops"
               in line for line in lines), lines  # fmt: skip
    for b in BUCKETS:
        study = _study(store, b)
        assert len(tuner.counted(study.trials)) == 10
        assert not any(tuner.failure(study, t) for t in study.trials if not
                       t.user_attrs.get("surplus"))  # fmt: skip


@pytest.mark.parametrize("ooms", [1, parallel.OOM_RETRIES])
def test_no_gpu_memory_for_a_study_s_inputs_is_waited_out_and_fails_no_trial(tmp_path, ooms):
    """CUDA out of memory while a worker builds a study's inputs (the compile pool's processes
    or another job holding the GPU's memory): the worker frees its cache, waits and tries again
    (OOM_RETRIES tries); after as many failures it exits for a fresh worker, which builds the
    inputs and runs the study. No trial is failed for it, and every study runs its budget."""
    log = tmp_path / "evals.log"
    store, exits, lines = _run(str(tmp_path / "tune.journal"), "tpe", 10, log, workers=1,
                               build_oom=f"65536:{ooms}")  # fmt: skip
    tries = [line for line in lines if "out of GPU memory building its inputs" in line]
    assert all(e.returncode == 0 for e in exits), lines
    if ooms < parallel.OOM_RETRIES:
        assert [e.deaths for e in exits] == [[]], lines
        assert len(tries) == ooms and "trying again" in tries[0], lines
    else:
        assert [e.deaths for e in exits] == [[parallel.EXIT_MEMORY]], lines
        assert len(tries) == ooms and "this worker stops" in tries[-1], lines
        assert any("died (out of GPU memory)" in line and "a fresh worker takes the GPU" in line
                   for line in lines), lines  # fmt: skip
    for b in BUCKETS:
        study = _study(store, b)
        assert len(tuner.counted(study.trials)) == 10
        assert not any(tuner.failure(study, t) for t in study.trials if not
                       t.user_attrs.get("surplus"))  # fmt: skip


@pytest.mark.parametrize("sampler", ["local", "tpe"])
@pytest.mark.parametrize("ooms", [1, parallel.OOM_RETRIES])
def test_no_gpu_memory_for_a_trial_is_waited_out_and_fails_no_config(tmp_path, ooms, sampler):
    """CUDA out of memory in a trial (the compile pool's processes holding the GPU's memory:
    the config is not at fault) is the environment's, not the config's: the worker frees its
    cache, waits and runs the trial again (OOM_RETRIES tries). After as many failures the trial
    is lost: it counts as none (surplus, marked lost) and its point is queued again, which the
    worker runs as the study's next trial. No trial fails, no worker dies, and every study
    runs its budget."""
    log = tmp_path / "evals.log"
    store, exits, lines = _run(str(tmp_path / "tune.journal"), sampler, 10, log, workers=1,
                               trial_oom=f"65536:{ooms}")  # fmt: skip
    ran_out = (tmp_path / "evals.log.trial-oom").read_text().splitlines()
    assert len(ran_out) == ooms and len({p for _, p in (x.split(" ", 1) for x in ran_out)}) == 1
    point = json.loads(ran_out[0].split(" ", 1)[1])
    tries = [line for line in lines if "out of GPU memory in a trial" in line]
    assert len(tries) == min(ooms, parallel.OOM_RETRIES - 1), lines
    assert all(e.returncode == 0 for e in exits), lines
    study = _study(store, BUCKETS[1])
    lost = [t for t in study.trials if t.user_attrs.get("lost")]
    assert [e.deaths for e in exits] == [[]], lines
    if ooms < parallel.OOM_RETRIES:
        assert lost == []
    else:
        assert any("a trial lost, its point queued again" in line for line in lines), lines
        assert len(lost) == 1 and lost[0].params == point
        assert "out of GPU memory in 3 tries" in lost[0].user_attrs["lost"]
        assert lost[0].user_attrs.get("surplus") and lost[0] not in tuner.counted(study.trials)
        again = [t for t in study.trials if t.user_attrs.get("retry_of") == lost[0].number]
        assert len(again) == 1 and again[0].params == point
        assert again[0].state == optuna.trial.TrialState.COMPLETE
    for b in BUCKETS:
        study = _study(store, b)
        trials = tuner.counted(study.trials)
        assert len(trials) == 10
        assert all(t.state == optuna.trial.TrialState.COMPLETE for t in trials)
        assert len({json.dumps(t.params, sort_keys=True) for t in trials}) == 10


def test_a_config_that_needs_more_memory_than_the_gpu_has_fails_its_trial(tmp_path):
    """A config that runs out of GPU memory whatever the other processes hold: its trial is
    lost once, and its retry, out of memory again, is a failed trial (the config's own need);
    the study goes on in the same worker and every study ends."""
    default = SPEC.default_meta(**BUCKETS[1])
    # (a feasible neighbour of the default in both studies, which the search visits first)
    near = tuner.NeighbourhoodSampler(SPACE, SPACE.feasible(SPEC, BUCKETS[1])).neighbours(default)
    hungry = min(near, key=fake.cost)
    log = tmp_path / "evals.log"
    store, exits, lines = _run(str(tmp_path / "tune.journal"), "local", 12, log, workers=1,
                               oom_config=json.dumps(hungry))  # fmt: skip
    assert [e.returncode for e in exits] == [0], lines
    assert [e.deaths for e in exits] == [[]], lines
    for b in BUCKETS:
        study = _study(store, b)
        of_it = [t for t in study.trials if t.params == hungry]
        lost = [t for t in of_it if t.user_attrs.get("lost")]
        failed = [t for t in tuner.counted(study.trials) if t.params == hungry]
        assert len(lost) == 1 and len(failed) == 1, (b, of_it)
        assert failed[0].state == optuna.trial.TrialState.FAIL
        assert "(a second time)" in failed[0].user_attrs["failure"]
        assert len(tuner.counted(study.trials)) == 12
        assert tuner.summarize(SPEC, b, study, default).meta != hungry


def test_the_local_search_s_second_pass_takes_a_later_neighbour_s_best(tmp_path):
    """The first bucket's study ends at a local optimum (the default) before the second bucket
    has a result; once the second study has found its best, the worker's second pass runs that
    config in the first study, where it is best of all, and the walk goes on around it."""
    other = min(SPACE.feasible(SPEC, BUCKETS[1]), key=fake.cost)
    default = SPEC.default_meta(**BUCKETS[0])
    assert sum(other[k] != default[k] for k in other) >= 2  # not a neighbour of the default
    log = tmp_path / "evals.log"
    stop = tuner.StopRule(patience=3, local=True)
    store, exits, lines = _run(str(tmp_path / "tune.journal"), "local", 40, log, workers=1,
                               stop=stop, trap=f"16:{json.dumps(other)}")  # fmt: skip
    assert [e.returncode for e in exits] == [0], lines
    evals = _evaluations(log)
    name = f"{SPEC.name}@16"
    key = json.dumps(other, sort_keys=True)
    at = next(i for i, (_, s, p) in enumerate(evals) if s == name and p == key)
    assert any(s == f"{SPEC.name}@65536" for _, s, _ in evals[:at])  # after the other study
    first = _study(store, BUCKETS[0])
    trial = next(t for t in first.trials if t.params == other)
    assert trial.user_attrs.get("revisit") == "num_tokens=65536" and trial.value == 1.0
    near = tuner.NeighbourhoodSampler(SPACE, SPACE.feasible(SPEC, BUCKETS[0])).neighbours(other)
    tried = {json.dumps(t.params, sort_keys=True) for t in first.trials if t.params}
    assert {json.dumps(q, sort_keys=True) for q in near} <= tried  # the walk went on
    bound = stop.for_study(SPEC, BUCKETS[0], SPACE)
    assert tuner.summarize(SPEC, BUCKETS[0], first, default, bound).meta == other
    # resumed: both passes find every study done and nothing new to take; no trial runs
    ran = len(_evaluations(log))
    _, exits, lines = _run(str(tmp_path / "tune.journal"), "local", 40, log, workers=1,
                           stop=stop, trap=f"16:{json.dumps(other)}")  # fmt: skip
    assert [e.returncode for e in exits] == [0], lines
    assert len(_evaluations(log)) == ran


def test_the_second_pass_takes_a_later_sibling_variant_s_best(tmp_path):
    """Two variants of one template at one bucket: the first one's study ends at a local
    optimum (the default) before the second one's has run; the second pass runs the second
    variant's best in the first study (marked with that variant's name), where it is best of
    all. The first pass gave the second study the first one's best as a start point."""
    sibling = StoreMXFP4MLASpec(32, 512, "fp16", "paged", "sm90", "gpu")
    bucket = BUCKETS[0]
    theirs = min(SPACE.feasible(sibling, bucket), key=fake.cost)
    default = SPEC.default_meta(**bucket)
    assert sum(theirs[k] != default[k] for k in theirs) >= 2  # not a neighbour of the default
    log = tmp_path / "evals.log"
    stop = tuner.StopRule(patience=3, local=True)
    journal = str(tmp_path / "tune.journal")
    # (kvgen tune prepares every study of its plan; _run prepares SPEC's)
    tuner.open_study(sibling, bucket, SPACE, storage=tuner.storage_from(journal, Path(journal)),
                     sampler="local", n_trials=40)  # fmt: skip
    store, exits, lines = _run(journal, "local", 40, log, workers=1,
                               stop=stop, jobs=[(SPEC, bucket), (sibling, bucket)],
                               trap=f"16:{json.dumps(theirs)}", trap_only=SPEC.name)  # fmt: skip
    assert [e.returncode for e in exits] == [0], lines
    evals = _evaluations(log)
    key = json.dumps(theirs, sort_keys=True)
    at = next(i for i, (_, s, p) in enumerate(evals) if s == f"{SPEC.name}@16" and p == key)
    assert any(s == f"{sibling.name}@16" for _, s, _ in evals[:at])  # after the sibling's study
    mine = _study(store, bucket)
    trial = next(t for t in mine.trials if t.params == theirs)
    assert trial.user_attrs.get(tuner.SIBLING_REVISIT) == sibling.name and trial.value == 1.0
    bound = stop.for_study(SPEC, bucket, SPACE)
    assert tuner.summarize(SPEC, bucket, mine, default, bound).meta == theirs
    started = optuna.load_study(study_name=tuner.study_name(sibling, bucket), storage=store)
    assert [t.user_attrs.get(tuner.SIBLING_START_ATTR) for t in started.trials[:2]] == [
        None,
        None,
    ]  # the first study's best was the default: nothing to queue beside it
    assert started.trials[0].params == sibling.default_meta(**bucket)
    # resumed: both passes find both studies done and nothing new to take; no trial runs
    ran = len(_evaluations(log))
    _, exits, lines = _run(journal, "local", 40, log, workers=1, stop=stop,
                           jobs=[(SPEC, bucket), (sibling, bucket)],
                           trap=f"16:{json.dumps(theirs)}", trap_only=SPEC.name)  # fmt: skip
    assert [e.returncode for e in exits] == [0], lines
    assert len(_evaluations(log)) == ran


def test_a_gpu_whose_memory_stays_taken_gets_few_fresh_workers(tmp_path):
    """Out of GPU memory for a study's inputs in every try (another process holds the memory):
    MAX_MEMORY_RESTARTS fresh workers try, then the GPU's worker stays dead and the rest of
    its studies wait for a later run, instead of MAX_RESTARTS rounds of waiting."""
    log = tmp_path / "evals.log"
    store, exits, lines = _run(str(tmp_path / "tune.journal"), "tpe", 10, log, workers=1,
                               build_oom="65536:1000")  # fmt: skip
    assert parallel.MAX_MEMORY_RESTARTS < parallel.MAX_RESTARTS
    assert exits[0].returncode == parallel.EXIT_MEMORY, lines
    assert exits[0].deaths == [parallel.EXIT_MEMORY] * parallel.MAX_MEMORY_RESTARTS, lines
    tries = [line for line in lines if "out of GPU memory building its inputs" in line]
    assert len(tries) == parallel.OOM_RETRIES * (parallel.MAX_MEMORY_RESTARTS + 1), lines
    assert any("died (out of GPU memory)" in line and "the others go on" in line
               for line in lines), lines  # fmt: skip
    assert len(tuner.counted(_study(store, BUCKETS[0]).trials)) == 10  # the first study ran
    assert tuner.finished(_study(store, BUCKETS[1]).trials) == []  # its inputs never built


def test_a_worker_s_exit_status_names_what_it_died_of():
    """The coordinator's lines and `kvgen tune`'s final error name a dead worker's cause."""
    assert parallel.death(parallel.EXIT_FAULT) == "a GPU fault"
    assert parallel.death(parallel.EXIT_MEMORY) == "out of GPU memory"
    assert parallel.death(-9) == "signal 9" and parallel.death(1) == "exit status 1"


def test_restarts_are_bounded(tmp_path):
    """With no restarts left, a faulted worker stays dead: its GPU's share of the studies waits
    for a later run."""
    store = _prepare(str(tmp_path / "tune.journal"), "tpe", 10)
    plan = parallel.Plan(jobs=[(SPEC, b) for b in BUCKETS], storage=str(tmp_path / "tune.journal"),
                         sampler="tpe", n_trials=10, evaluator=FAKE)  # fmt: skip
    lines = []
    exits = parallel.run_workers(plan, ["fake0"], log=lines.append, max_restarts=0,
                                 env=_env(tmp_path / "evals.log", fault_at=2))  # fmt: skip
    assert exits[0].returncode == parallel.EXIT_FAULT and not exits[0].deaths, lines
    assert any("the others go on" in line for line in lines)
    assert len(tuner.counted(_study(store, BUCKETS[0]).trials)) < 10


def test_a_tune_on_one_gpu_survives_a_faulting_candidate(tmp_path, two_fake_gpus, monkeypatch):
    """`kvgen tune` on one GPU whose third candidate breaks the CUDA context: the tune goes on
    in a fresh worker and writes the JSON, with that trial failed."""
    monkeypatch.setenv("KVGEN_FAKE_WORKERS", "1")
    monkeypatch.setenv("KVGEN_FAKE_FAULT_AT", "3")
    result = _kvgen(*_tune_args(tmp_path, "16", "1"))
    assert result.exit_code == 0, result.output
    assert "a fresh worker takes the GPU" in result.output
    assert "1 replaced after a fault or crash" in result.output
    doc = json.loads((tmp_path / "out" / "sm90" / f"{SPEC.family}.json").read_text())
    entry = doc["entries"][SPEC.name]["num_tokens=16"]
    assert entry["trials"] == len(SPACE.points()) and entry["failed_trials"] == 1


def test_a_tune_whose_worker_dies_for_good_writes_what_is_done_and_exits_1(
    tmp_path, two_fake_gpus, monkeypatch
):
    """`kvgen tune` whose only worker dies of a Python error (not replaced: it would repeat)
    while building the second study's inputs: the JSON holds the first study, and the command
    exits with status 1, saying how many studies are left for the same command to resume."""
    monkeypatch.setenv("KVGEN_FAKE_WORKERS", "1")
    monkeypatch.setenv("KVGEN_FAKE_BUILD_ERROR", "65536")
    result = _kvgen(*_tune_args(tmp_path, "16,65536", "1"))
    assert result.exit_code == 1, result.output
    assert "died (exit status 1); 0 running trial(s) failed; the others go on" in result.output
    assert (
        "tune incomplete: the worker of 1 GPU(s) died (GPU fake0: exit status 1); 1 of 2 "
        "studies are not done" in " ".join(result.output.split())
    ), result.output
    doc = json.loads((tmp_path / "out" / "sm90" / f"{SPEC.family}.json").read_text())
    assert list(doc["entries"][SPEC.name]) == ["num_tokens=16"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_a_tune_on_a_real_gpu_survives_a_kernel_that_faults(tmp_path, monkeypatch):
    """`kvgen tune` on this machine's first GPU, each trial a real kernel launch, the third one
    an illegal address: the CUDA context of that worker breaks, a fresh worker takes the GPU,
    the tune writes its JSON with that trial failed."""
    for k, v in _env(tmp_path / "evals.log", sleep=0.0, fault_at=3).items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("KVGEN_FAKE_CUDA", "1")
    monkeypatch.setenv("KVGEN_TUNE_EVALUATOR", FAKE)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    monkeypatch.syspath_prepend(str(HERE))
    result = _kvgen(*_tune_args(tmp_path, "16", "1"))
    assert result.exit_code == 0, result.output
    assert "illegal memory access" in result.output, result.output
    assert "GPU fault, this worker stops" in result.output, result.output
    assert "a fresh worker takes the GPU" in result.output, result.output
    doc = json.loads((tmp_path / "out" / "sm90" / f"{SPEC.family}.json").read_text())
    entry = doc["entries"][SPEC.name]["num_tokens=16"]
    assert entry["trials"] == len(SPACE.points()) and entry["failed_trials"] == 1


def _a_worker_killed_at_its_third_trial(storage: str, log: Path, tmp_path: Path) -> None:
    """A worker process of an 8-trial TPE plan over BUCKETS, on ``storage``, that dies by
    SIGKILL in its third trial (as its whole host would), leaving that trial RUNNING."""
    _prepare(storage, "tpe", 8)
    plan = parallel.Plan(jobs=[(SPEC, b) for b in BUCKETS], storage=storage, sampler="tpe",
                         n_trials=8, evaluator=FAKE)  # fmt: skip
    plan_file = tmp_path / "plan.pkl"
    plan_file.write_bytes(pickle.dumps(plan))
    p = subprocess.run(
        [sys.executable, "-m", "kvgen.tune.worker", str(plan_file)],
        env={**os.environ, **_env(log, die_at=3)},
        capture_output=True,
    )
    assert p.returncode == -9, p.stdout


def test_a_worker_of_a_dead_run_is_failed_on_resume(tmp_path):
    """Killed with its coordinator (the whole host went down): the next run fails its trial."""
    journal = str(tmp_path / "tune.journal")
    log = tmp_path / "evals.log"
    _a_worker_killed_at_its_third_trial(journal, log, tmp_path)
    store = tuner.storage_from(journal, Path(journal))
    study = _study(store, BUCKETS[0])
    assert len(study.get_trials(states=(optuna.trial.TrialState.RUNNING,))) == 1
    store, exits, lines = _run(journal, "tpe", 8, log, workers=2)
    assert all(e.returncode == 0 for e in exits), lines
    _check_dead_worker(_study(store, BUCKETS[0]), log, 8)


def _check_dead_worker(study, log, n_trials):
    """The worker that wrote the third evaluation died in it: of its trials, that one alone
    failed; the study holds its budget with nothing left running."""
    dead_pid = _evaluations(log)[2][0]
    assert len(tuner.counted(study.trials)) == n_trials
    assert not study.get_trials(states=(optuna.trial.TrialState.RUNNING,))
    mine = [t for t in study.trials if t.user_attrs.get("worker", "").endswith(f":{dead_pid}")]
    assert mine[-1].state == optuna.trial.TrialState.FAIL
    for t in mine[:-1]:  # its earlier trials ran to the end (or broke a constraint)
        assert t.state == optuna.trial.TrialState.COMPLETE or tuner.failure(study, t).startswith(
            "constraints"
        )
    others = {t.user_attrs.get("worker") for t in study.trials} - {mine[0].user_attrs["worker"]}
    assert len(others) >= 1  # the next run's workers took the rest


# --- several hosts: one PostgreSQL database --------------------------------------------------
# `.ci/run` starts Debian's PostgreSQL server on this machine and sets KVGEN_TEST_POSTGRES_URL
# (a role that may create databases); each test gets a fresh database.


@pytest.fixture
def postgres_url():
    base = os.environ.get("KVGEN_TEST_POSTGRES_URL")
    if not base:
        pytest.skip("KVGEN_TEST_POSTGRES_URL is not set (.ci/run starts a server and sets it)")
    psycopg = pytest.importorskip("psycopg")
    name = f"kvgen_{uuid.uuid4().hex[:12]}"
    admin = psycopg.connect(base, autocommit=True)
    admin.execute(f"CREATE DATABASE {name}")
    yield base.rsplit("/", 1)[0] + "/" + name
    admin.execute(f"DROP DATABASE {name} WITH (FORCE)")
    admin.close()


def test_postgres_workers_share_a_grid_study(tmp_path, postgres_url):
    _check_shared_grid(tmp_path, postgres_url)


def test_postgres_dead_host_trial_failed_by_heartbeat(tmp_path, postgres_url, monkeypatch):
    """A worker on "another host" (no coordinator here to see it die) is killed mid-trial; the
    workers of the next run fail its trial once its heartbeat is older than the grace period,
    and the study completes."""
    monkeypatch.setattr(tuner, "GRACE_S", 2)
    monkeypatch.setattr(tuner, "HEARTBEAT_S", 1)
    monkeypatch.setenv("KVGEN_TUNE_GRACE_S", "2")  # for the worker processes
    monkeypatch.setenv("KVGEN_TUNE_HEARTBEAT_S", "1")
    log = tmp_path / "evals.log"
    _a_worker_killed_at_its_third_trial(postgres_url, log, tmp_path)
    time.sleep(3)  # the grace period passes
    store, exits, lines = _run(postgres_url, "tpe", 8, log, workers=2)
    assert all(e.returncode == 0 for e in exits), lines
    _check_dead_worker(_study(store, BUCKETS[0]), log, 8)


@pytest.fixture
def two_fake_gpus(tmp_path, monkeypatch):
    """`kvgen tune` as on a machine with two GPUs, whose workers time with the fake timer."""

    import kvgen.runtime
    from kvgen.bench import harness

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(kvgen.runtime, "local_target", lambda: ("sm90", "gpu"))
    monkeypatch.setattr(harness, "environment", lambda commit=None: dict(ENV))
    monkeypatch.setattr(parallel, "visible_devices", lambda: ["fake0", "fake1"])
    for k, v in _env(tmp_path / "evals.log", sleep=0.01).items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("KVGEN_TUNE_EVALUATOR", FAKE)
    monkeypatch.syspath_prepend(str(HERE))  # the coordinator re-times the best configs itself
    # Both workers take part whatever their start-up times (a loaded machine once let the first
    # worker run every trial before the second had imported torch).
    monkeypatch.setenv("KVGEN_FAKE_WORKERS", "2")


def _kvgen(*args):
    from typer.testing import CliRunner

    import kvgen.cli

    return CliRunner().invoke(kvgen.cli.app, list(args))


def _tune_args(tmp_path, buckets: str, gpus: str) -> list[str]:
    """`kvgen tune SPEC` on a grid, at ``buckets``, on ``gpus`` fake GPUs, into tmp_path."""
    return [
        "tune",
        SPEC.name,
        "--arch",
        "sm90",
        "--sampler",
        "grid",
        "--buckets",
        buckets,
        "--storage",
        str(tmp_path / "t.journal"),
        "--out",
        str(tmp_path / "out"),
        "--jobs",
        "1",
        "--gpus",
        gpus,
    ]


def test_tune_command_on_two_gpus_writes_the_json_once(tmp_path, two_fake_gpus):
    """`kvgen tune --gpus 2` end to end, with the GPU faked: two workers, one JSON."""
    args = _tune_args(tmp_path, "16,65536", "2")
    result = _kvgen(*args)
    assert result.exit_code == 0, result.output
    assert "on 2 GPU(s)" in result.output and "[gpu fake1]" in result.output
    doc = json.loads((tmp_path / "out" / "sm90" / f"{SPEC.family}.json").read_text())
    best = min(SPACE.feasible(SPEC), key=fake.cost)
    for b in ("num_tokens=16", "num_tokens=65536"):
        entry = doc["entries"][SPEC.name][b]
        assert entry["time_us"] == fake.cost(entry["meta"]) == fake.cost(best)
        assert entry["trials"] == len(SPACE.points())
        assert entry["confirm_rounds"] == 3
    evals = _evaluations(tmp_path / "evals.log")
    workers = {pid for pid, _, _ in evals} - {str(os.getpid())}
    assert len(workers) == 2
    _assert_retimed_in_a_worker(evals, (16, 65536))
    result = _kvgen(*args[:-1], "3")
    assert result.exit_code == 2 and "2 GPU(s) are visible" in result.output


def _assert_retimed_in_a_worker(evals, buckets) -> None:
    """Each study's 3 best configs within CONFIRM_MARGIN of its best (and the default, were it
    within) were re-timed 3 times each, by one worker, after every trial of the study (the
    grid's points each once), and none in this process (the coordinator)."""
    assert all(pid != str(os.getpid()) for pid, _, _ in evals)
    for n in buckets:
        name = f"{SPEC.name}@{n}"
        mine = [(pid, p) for pid, s, p in evals if s == name]
        feasible = sorted(SPACE.feasible(SPEC, {"num_tokens": n}), key=fake.cost)
        trials = len(feasible)  # (the grid's other points break a constraint: never timed)
        assert len({p for _, p in mine[:trials]}) == trials  # the trials: each point once
        retimed = mine[trials:]
        assert len({pid for pid, _ in retimed}) == 1
        near = [m for m in feasible if fake.cost(m) <= fake.cost(feasible[0]) * 1.10]
        assert tuner.CONFIRM_MARGIN == 0.10 and len(near) >= 2
        default = SPEC.default_meta(num_tokens=n)
        want = near[:3] + ([default] if default in near[3:] else [])
        timed = Counter(p for _, p in retimed)
        assert timed == {json.dumps(m, sort_keys=True): 3 for m in want}


def test_tune_command_on_one_gpu_runs_its_trials_in_a_worker(tmp_path, two_fake_gpus):
    """One GPU is one worker of the same path: no trial runs in the command's own process (a
    candidate that broke the GPU context would take the command with it), and neither does the
    confirmation's re-timing: the worker does it after each study, with its inputs."""
    args = _tune_args(tmp_path, "16", "1")
    os.environ["KVGEN_FAKE_WORKERS"] = "1"  # (the fixture's monkeypatch restores it)
    result = _kvgen(*args)
    assert result.exit_code == 0, result.output
    assert "on 1 GPU(s)" in result.output and "[gpu fake0]" in result.output
    assert "re-timed in" in result.output
    # the line names each re-timed config's median beside its trial's reading, best first
    line = next(x for x in result.output.splitlines() if "re-timed in" in x)
    medians = [float(m) for m in re.findall(r"([\d.]+) us \{", line)]
    assert len(medians) >= 2 and medians == sorted(medians)
    assert line.count("(trial ") == len(medians)
    # each study's time in the worker from end to end, and its part before the trials
    in_all = re.findall(r"@ num_tokens=\d+: ([\d.]+) s in all \(([\d.]+) s opening", result.output)
    assert len(in_all) == 1 and all(float(a) >= float(o) for a, o in in_all)  # (one bucket)
    evals = _evaluations(tmp_path / "evals.log")
    workers = {pid for pid, _, _ in evals}
    assert len(workers) == 1  # every trial and re-timing in one worker process
    _assert_retimed_in_a_worker(evals, (16,))
    doc = json.loads((tmp_path / "out" / "sm90" / f"{SPEC.family}.json").read_text())
    entry = doc["entries"][SPEC.name]["num_tokens=16"]
    assert entry["trials"] == len(SPACE.points()) and entry["confirm_rounds"] == 3


def test_tune_command_compiles_the_start_points_and_their_neighbours_first(
    tmp_path, two_fake_gpus, monkeypatch
):
    """`kvgen tune --jobs 2 --compile-first` with the local search: before any trial, one pool
    compiles, for each class of buckets Triton specialises alike (1 token, 4 tokens, 16 and
    65536), the class's start points (defaults, tuned configs) and the points within
    COMPILE_RADIUS steps of them at one bucket of the class; not the whole space (with TPE,
    which may go anywhere: the whole space, at one bucket of each class)."""
    from kvgen.tune import precompile

    monkeypatch.setenv("KVGEN_FAKE_WORKERS", "1")
    monkeypatch.setenv("KVGEN_TUNE_COMPILE_CHECKER", "_fake_tuning:compile_checker")
    args = [*_tune_args(tmp_path, "1,4,16,65536", "1"), "--compile-first"]
    args[args.index("grid")] = "local"
    args[args.index("--jobs") + 1] = "2"
    result = _kvgen(*args, "--trials", "6")
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    first = next(i for i, x in enumerate(lines) if x.startswith("compiling "))
    assert "of 1 variants at 3 buckets in 2 processes" in lines[first]
    took = next(i for i, x in enumerate(lines) if x.startswith("compiling ahead took"))
    assert first < took < next(i for i, x in enumerate(lines) if "[gpu fake0]" in x)
    # the compile checks' lines name variant#bucket; the trials' variant@bucket
    compiled = [
        (s.split("#")[1], m) for _, s, m in _evaluations(tmp_path / "evals.log") if "#" in s
    ]
    assert len(compiled) == len(set(compiled))  # each once at a bucket
    for cls, at in (([1], 1), ([4], 4), ([16, 65536], 65536)):
        seeds = [SPEC.default_meta(num_tokens=t) for t in cls]
        seeds += [m for t in cls if (m := tuner.incumbent(SPEC, {"num_tokens": t}))]
        rings = SPACE.compile_rings(SPEC, seeds, precompile.COMPILE_RADIUS)
        want = {(f"num_tokens={at}", json.dumps(m, sort_keys=True)) for r in rings for m in r}
        assert want == {c for c in compiled if c[0] == f"num_tokens={at}"}
    assert {b for b, _ in compiled} == {"num_tokens=1", "num_tokens=4", "num_tokens=65536"}
    assert len({m for _, m in compiled}) < len(SPACE.compile_points(SPEC))  # not everything

    (tmp_path / "evals.log").unlink()
    args[args.index("local")] = "tpe"
    args[args.index("--storage") + 1] = str(tmp_path / "tpe.journal")
    assert _kvgen(*args, "--trials", "6").exit_code == 0
    compiled = [
        (s.split("#")[1], m) for _, s, m in _evaluations(tmp_path / "evals.log") if "#" in s
    ]
    # TPE may propose any point: every one, at a bucket of each class (the TPE run of an H100
    # compiled 1439 store kernels in its trials where the pool compiled at one bucket a variant)
    every = sorted(json.dumps(m, sort_keys=True) for m in SPACE.compile_points(SPEC))
    for at in (1, 4, 65536):
        assert sorted(m for b, m in compiled if b == f"num_tokens={at}") == every
    assert len(compiled) == 3 * len(every)


def test_tune_command_compiles_beside_the_workers_and_stops_with_them(
    tmp_path, two_fake_gpus, monkeypatch
):
    """`kvgen tune --jobs 3` (the default --compile-beside): the workers start at once, while
    a pool of 2 processes whose Triton launches compile only compiles the start points and
    ring after ring around them, out to every point of the space (its cores are idle
    otherwise); once the workers are done the pool is ended, whatever it has left, and the
    JSON is written as without it."""
    monkeypatch.setenv("KVGEN_FAKE_WORKERS", "1")
    monkeypatch.setenv("KVGEN_TUNE_COMPILER", "_fake_tuning:compiler")
    monkeypatch.setenv("KVGEN_FAKE_COMPILE_S", "120")  # (a process's first: at once)
    args = _tune_args(tmp_path, "16", "1")
    args[args.index("grid")] = "local"
    args[args.index("--jobs") + 1] = "3"
    t0 = time.monotonic()
    result = _kvgen(*args, "--trials", "6")
    took = time.monotonic() - t0
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    beside = next(i for i, x in enumerate(lines) if x.startswith("compiling beside the workers"))
    assert "in 2 processes" in lines[beside + 1]
    assert not any(x.startswith("compiling ahead took") for x in lines)
    assert any("[gpu fake0]" in x for x in lines)
    assert any("not compiled: the trials ended first" in x for x in lines), result.output
    compiles = (tmp_path / "evals.log.compiles").read_text().splitlines()
    assert compiles and all(c.endswith(" True") for c in compiles)  # compile only, no launch
    # below the workers' CPU priority
    assert all(int(c.split("nice=")[1].split()[0]) >= 10 for c in compiles)
    planned = int(lines[beside + 1].split()[1])  # "compiling N candidates of ..."
    assert planned == len(SPACE.compile_points(SPEC))  # one class of buckets: all of them
    assert len(compiles) < planned and took < 120  # (cut short, not waited for)
    assert (tmp_path / "out" / "sm90" / f"{SPEC.family}.json").exists()


def test_a_study_finished_without_a_confirmation_is_confirmed_by_the_command(
    tmp_path, two_fake_gpus, monkeypatch
):
    """A study whose worker did not re-time it (here: a run with --confirm 0; also a worker
    that died while re-timing, or ran out of time) is re-timed by the command after its
    workers, which find the study done and build no inputs."""
    args = _tune_args(tmp_path, "16", "1")
    monkeypatch.setenv("KVGEN_FAKE_WORKERS", "1")
    assert _kvgen(*args, "--confirm", "0").exit_code == 0
    log = tmp_path / "evals.log"
    before = len(_evaluations(log))
    result = _kvgen(*args)
    assert result.exit_code == 0, result.output
    retimed = _evaluations(log)[before:]
    assert retimed and {pid for pid, _, _ in retimed} == {str(os.getpid())}
    doc = json.loads((tmp_path / "out" / "sm90" / f"{SPEC.family}.json").read_text())
    assert doc["entries"][SPEC.name]["num_tokens=16"]["confirm_rounds"] == 3


def test_one_claim_wins_a_study_s_confirmation_and_it_is_kept_until_trials_are_added(tmp_path):
    """Workers finishing a study at once each claim its re-timing: the lowest-numbered claim
    wins, claims count as no trial, and the stored confirmation holds until the study gets
    another trial that a re-timing would look at (here: a resumed run with a larger budget
    whose trial reads as fast as the best)."""
    store = _prepare(str(tmp_path / "t.journal"), "grid", 4)
    bucket = BUCKETS[0]
    tuner.run_study(SPEC, bucket, SPACE, fake.cost, storage=store, sampler="tpe", n_trials=4)
    study = _study(store, bucket)
    before = tuner.load_result(SPEC, bucket, store)
    wins = [tuner.claim_confirmation(study, w, "key") for w in ("a", "b", "a")]
    assert wins == [True, False, True]  # "a" holds the lowest claim
    assert tuner.claim_confirmation(study, "b", "another run")
    after = tuner.load_result(SPEC, bucket, store)
    assert (after.trials, after.failed, after.meta) == (before.trials, before.failed, before.meta)
    assert tuner.budget_taken(study, 4) and not tuner.budget_taken(study, 5)
    assert tuner.stored_confirmation(SPEC, bucket, store) is None
    c = tuner.confirm(SPEC, bucket, store, fake.cost, top=3, record=True)
    kept = tuner.stored_confirmation(SPEC, bucket, store)
    assert kept == c and kept.meta == before.meta
    as_fast = lambda meta: before.time_us  # noqa: E731
    tuner.run_study(SPEC, bucket, SPACE, as_fast, storage=store, sampler="tpe", n_trials=5)
    assert tuner.stored_confirmation(SPEC, bucket, store) is None


def test_ctrl_c_stops_the_workers_and_a_rerun_resumes(tmp_path):
    """Ctrl-C in a terminal reaches the coordinator and its workers: no worker is left
    running, no trial is left RUNNING, and the same command resumes."""
    import signal

    journal = str(tmp_path / "tune.journal")
    log = tmp_path / "evals.log"
    store = _prepare(journal, "tpe", 12)
    # What a worker interrupted between taking a trial and naming itself on it leaves behind
    # (CI saw one): a RUNNING trial that no worker's name finds.
    orphan = _study(store, BUCKETS[0])
    orphan._storage.create_new_trial(orphan._study_id)
    plan = parallel.Plan(
        jobs=[(SPEC, b) for b in BUCKETS],
        storage=journal,
        sampler="tpe",
        n_trials=12,
        evaluator=FAKE,
    )
    (tmp_path / "plan.pkl").write_bytes(pickle.dumps(plan))
    script = tmp_path / "coordinator.py"
    script.write_text(
        "import pickle, sys\n"
        "from kvgen.tune import parallel\n"
        "plan = pickle.load(open(sys.argv[1], 'rb'))\n"
        "parallel.run_workers(plan, ['a', 'b'], log=lambda s: print(s, flush=True))\n"
    )
    env = {**os.environ, **_env(log, sleep=0.3)}
    p = subprocess.Popen(
        [sys.executable, str(script), str(tmp_path / "plan.pkl")],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        # as in a terminal: SIGINT not ignored (a test run started in the background of a
        # non-interactive shell inherits an ignored SIGINT, which would outlive exec)
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and (not log.exists() or len(_evaluations(log)) < 3):
        time.sleep(0.1)
    os.killpg(p.pid, signal.SIGINT)  # what a terminal does on Ctrl-C
    out, _ = p.communicate(timeout=60)
    assert p.returncode != 0 and "interrupted: the workers are stopped" in out, out
    pids = {int(pid) for pid, _, _ in _evaluations(log)}
    for pid in pids:  # every worker is gone
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    store = tuner.storage_from(journal, Path(journal))
    for b in BUCKETS:
        assert not _study(store, b).get_trials(states=(optuna.trial.TrialState.RUNNING,))
    store, exits, lines = _run(journal, "tpe", 12, log, workers=2)
    assert all(e.returncode == 0 for e in exits), lines
    for b in BUCKETS:
        assert len(tuner.counted(_study(store, b).trials)) == 12


def test_a_budget_spent_before_any_trial_writes_no_json(tmp_path, two_fake_gpus):
    """--timeout spent before a trial ran: no tuned file is written (none with no entries,
    nor one that would replace the package's), and the output says to re-run."""
    result = _kvgen(*_tune_args(tmp_path, "16", "1"), "--timeout", "0")
    assert result.exit_code == 0, result.output
    assert "nothing written" in result.output
    assert not (tmp_path / "out" / "sm90" / f"{SPEC.family}.json").exists()


def test_wall_clock_budget_stops_the_workers(tmp_path):
    """A deadline: the workers start no trial after it; the studies keep what ran, and a later
    run without one completes them."""
    journal = str(tmp_path / "tune.journal")
    log = tmp_path / "evals.log"
    store = _prepare(journal, "tpe", 40)
    plan = parallel.Plan(
        jobs=[(SPEC, b) for b in BUCKETS],
        storage=journal,
        sampler="tpe",
        n_trials=40,
        evaluator=FAKE,
        deadline=time.time() + 4.0,
    )
    t0 = time.monotonic()
    lines = []
    exits = parallel.run_workers(plan, ["a", "b"], log=lines.append, env=_env(log, sleep=0.2))
    assert all(e.returncode == 0 for e in exits), lines
    assert time.monotonic() - t0 < 20
    ran = sum(len(tuner.counted(_study(store, b).trials)) for b in BUCKETS)
    full = {str(b): tuner.budget(SPACE, "tpe", 40, SPEC, b) for b in BUCKETS}  # feasible points
    assert 0 < ran < sum(full.values())  # stopped early, kept what it ran
    store, exits, lines = _run(journal, "tpe", 40, log, workers=2)
    for b in BUCKETS:
        assert len(tuner.counted(_study(store, b).trials)) == full[str(b)]


def test_tune_command_bucket_filters(tmp_path, two_fake_gpus):
    """--buckets and --heads pick the studies: one per (num_tokens, num_heads) asked for, at
    each row alignment (separate scale caches and vLLM's inline rows)."""
    name = "store_kv_per_token_head-int8-d128-dv128-bf16-sm90-gpu"
    args = [
        "tune",
        name,
        "--trials",
        "6",
        "--buckets",
        "16,65536",
        "--heads",
        "8",
        "--storage",
        str(tmp_path / "t.journal"),
        "--out",
        str(tmp_path / "out"),
        "--jobs",
        "1",
        "--gpus",
        "2",
    ]
    result = _kvgen(*args)
    assert result.exit_code == 0, result.output
    doc = json.loads((tmp_path / "out" / "sm90" / "store_kv_per_token_head.json").read_text())
    assert sorted(doc["entries"][name]) == [
        "num_tokens=16,num_heads=8,row_align=16",
        "num_tokens=16,num_heads=8,row_align=4",
        "num_tokens=65536,num_heads=8,row_align=16",
        "num_tokens=65536,num_heads=8,row_align=4",
    ]


def test_tune_command_where_filter(tmp_path, two_fake_gpus):
    """--where KEY=V[,V] keeps only the buckets with that size at those values (with
    --buckets: one study per num_tokens, at row_align 4 alone); a malformed one fails before
    anything runs."""
    name = "store_kv_per_token_head-int8-d128-dv128-bf16-sm90-gpu"
    common = ["--storage", str(tmp_path / "t.journal"), "--out", str(tmp_path / "out"),
              "--jobs", "1", "--gpus", "2", "--trials", "6"]  # fmt: skip
    args = ["tune", name, "--buckets", "16,65536", "--heads", "8", "--where", "row_align=4"]
    result = _kvgen(*args, *common)
    assert result.exit_code == 0, result.output
    doc = json.loads((tmp_path / "out" / "sm90" / "store_kv_per_token_head.json").read_text())
    assert sorted(doc["entries"][name]) == [
        "num_tokens=16,num_heads=8,row_align=4",
        "num_tokens=65536,num_heads=8,row_align=4",
    ]
    result = _kvgen("tune", name, "--where", "row_align=5", *common)  # no such bucket
    assert result.exit_code != 0 and "nothing to tune" in result.output, result.output
    for bad in ("row_align", "row_align=four", "=4"):
        result = _kvgen("tune", name, "--where", bad, *common)
        assert result.exit_code != 0 and "--where takes KEY=V" in result.output, result.output


def test_plan_where_leaves_out_buckets_without_the_size():
    """``plan(where=...)``: a bucket without the named size is left out (the GQA portable
    variant has no row_align), one with it kept only at the values named."""
    from kvgen.tune.plan import plan

    studies = plan(None, "sm90", families={"gqa_decode"}, where={"row_align": {4}})
    assert studies and all(s.bucket["row_align"] == 4 for s in studies)
    assert {s.spec.variant for s in studies} == {"rows"}


def test_the_worker_s_guard_keeps_the_evaluator_s_re_timing(monkeypatch):
    """The worker's guard around the evaluator keeps its ``confirm`` (the re-timing with the
    bench's fuller settle, which ``tuner.confirm`` takes over the trial timing), guarded alike:
    a re-timing out of GPU memory is tried again. The guard had dropped it, so a worker
    re-timed with the trials' short settle."""
    monkeypatch.setattr(parallel, "OOM_WAIT_S", 0.0)
    calls = []
    ooms = [torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB.")]

    def evaluate(meta):
        calls.append("trial")
        return 1.0

    def confirm(meta):
        calls.append("confirm")
        if ooms:
            raise ooms.pop()
        return 2.0

    evaluate.confirm = confirm
    guarded = parallel._guarded(evaluate)
    assert guarded({"num_warps": 1}) == 1.0
    assert getattr(guarded, "confirm", guarded)({"num_warps": 1}) == 2.0
    assert calls == ["trial", "confirm", "confirm"]
    assert not hasattr(parallel._guarded(lambda meta: 3.0), "confirm")


def test_a_per_device_tune_writes_its_gpu_models_own_file(tmp_path, two_fake_gpus, monkeypatch):
    """`kvgen tune --per-device` writes <out>/<arch>/<device>/<family>.json, the folder named
    after the GPU the run's environment records, and not the arch's file."""
    from kvgen import configs
    from kvgen.bench import harness

    env = {**ENV, "device": "NVIDIA H200"}
    monkeypatch.setattr(harness, "environment", lambda commit=None: dict(env))
    monkeypatch.setenv("KVGEN_FAKE_WORKERS", "1")
    result = _kvgen(*_tune_args(tmp_path, "16", "1"), "--per-device")
    assert result.exit_code == 0, result.output
    path = tmp_path / "out" / "sm90" / "nvidia-h200" / f"{SPEC.family}.json"
    doc = json.loads(path.read_text())
    assert configs.validate(doc, "sm90", SPEC.family, "nvidia-h200") == []
    assert "num_tokens=16" in doc["entries"][SPEC.name]
    assert not (tmp_path / "out" / "sm90" / f"{SPEC.family}.json").exists()


def test_a_tune_writes_the_gpu_models_folder_where_it_exists_unless_told_otherwise(
    tmp_path, two_fake_gpus, monkeypatch
):
    """Without --per-device / --per-arch a tune writes the GPU model's own file where the out
    folder has that model's folder (the loader reads it first on that model: a fresh tune of
    the arch's file would be shadowed there), else the arch's; --per-arch writes the arch's."""
    from kvgen.bench import harness

    env = {**ENV, "device": "NVIDIA H200"}
    monkeypatch.setattr(harness, "environment", lambda commit=None: dict(env))
    monkeypatch.setenv("KVGEN_FAKE_WORKERS", "1")
    arch_file = tmp_path / "out" / "sm90" / f"{SPEC.family}.json"
    own_file = tmp_path / "out" / "sm90" / "nvidia-h200" / f"{SPEC.family}.json"
    assert _kvgen(*_tune_args(tmp_path, "16", "1")).exit_code == 0
    assert arch_file.exists() and not own_file.exists()  # no model folder: the arch's
    arch_file.unlink()
    own_file.parent.mkdir()
    assert _kvgen(*_tune_args(tmp_path, "16", "1")).exit_code == 0
    assert own_file.exists() and not arch_file.exists()
    assert _kvgen(*_tune_args(tmp_path, "16", "1"), "--per-arch").exit_code == 0
    assert arch_file.exists()
