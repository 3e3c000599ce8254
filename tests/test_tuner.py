"""The tuner's control flow with a fake timer, the config files and the run-time loader."""

import dataclasses
import json
import logging
import os
import subprocess
import sys

import pytest
import torch
import triton

optuna = pytest.importorskip("optuna")  # the tuner is the one part that needs optuna

from kvgen import configs  # noqa: E402
from kvgen.families.mxfp4_mla import StoreMXFP4MLASpec  # noqa: E402
from kvgen.families.per_token_head import StoreKVPerTokenHeadSpec  # noqa: E402
from kvgen.space import SpaceError, evaluate, load_space  # noqa: E402
from kvgen.tune import tuner  # noqa: E402
from kvgen.tune.tuner import NeighbourhoodSampler  # noqa: E402

SPEC = StoreMXFP4MLASpec(32, 512, "bf16", "paged", "sm90", "gpu")
SPACE = load_space(SPEC.template)
BUCKET = {"num_tokens": 65536}
ENV = {
    "cuda": "13.0",
    "device": "fake",
    "kvgen": "0.1.0",
    "torch": torch.__version__,
    "triton": triton.__version__,
}  # the running versions (the loader ignores another Triton's)


def fake_time(meta):
    """A made-up cost with one best point (rows 4, warps 2) and a constraint-free surface."""
    return 10.0 + abs(meta["rows_per_program"] - 4) * 3 + abs(meta["num_warps"] - 2) * 2


class Recorder:
    def __init__(self, broken=None, crash_at=None):
        self.calls = []
        self.broken = broken or {}
        self.crash_at = crash_at

    def __call__(self, meta):
        self.calls.append(dict(meta))
        if self.crash_at is not None and len(self.calls) == self.crash_at:
            raise KeyboardInterrupt  # the process is interrupted mid-trial
        if all(meta.get(k) == v for k, v in self.broken.items()) and self.broken:
            raise tuner.TrialFailed("wrong result")
        return fake_time(meta)


@pytest.fixture
def storage(tmp_path):
    return tuner.storage_from(str(tmp_path / "tune.journal"), tmp_path / "unused")


def test_default_first_trials_recorded_and_best_found(storage):
    rec = Recorder()
    r = tuner.run_study(SPEC, BUCKET, SPACE, rec, storage=storage, n_trials=16)
    assert rec.calls[0] == SPEC.default_meta(**BUCKET)
    assert r.trials == 16
    study = optuna.load_study(study_name=f"{SPEC.name}@num_tokens=65536", storage=storage)
    assert len(study.trials) == 16
    assert r.time_us == min(t.value for t in study.trials if t.value is not None)
    assert r.default_time_us == fake_time(SPEC.default_meta(**BUCKET))


def test_failed_trials_never_win(storage):
    rec = Recorder(broken={"rows_per_program": 4, "num_warps": 2})  # the true optimum is wrong
    r = tuner.run_study(SPEC, BUCKET, SPACE, rec, storage=storage, sampler="grid", n_trials=1000)
    assert r.failed >= 1
    assert r.meta != {"rows_per_program": 4, "num_warps": 2, "num_stages": 1}
    allowed = [
        m
        for m in SPACE.points()
        if not SPACE.violations(SPEC, m) and (m["rows_per_program"], m["num_warps"]) != (4, 2)
    ]
    assert r.time_us == min(fake_time(m) for m in allowed)


def test_constraints_fail_before_compiling(storage):
    big = StoreMXFP4MLASpec(64, 16384, "fp32", "paged", "sm90", "gpu")
    space = load_space(big.template)
    bad = {"rows_per_program": 16, "num_warps": 1, "num_stages": 1}
    assert space.violations(big, bad) == ["values_per_thread"]
    rec = Recorder()
    r = tuner.run_study(big, BUCKET, space, rec, storage=storage, sampler="grid", n_trials=1000)
    assert all(not space.violations(big, m) for m in rec.calls)  # never evaluated
    # reported as skipped, not as failures
    assert r.skipped == len(space.points()) - len(rec.calls) > 0 and r.failed == 0
    # the grid's feasible part (what `kvgen tune --jobs` compiles up front) is what was run
    assert bad not in space.feasible(big)
    assert sorted(map(str, space.feasible(big))) == sorted(map(str, rec.calls))


def test_grid_covers_the_space_once(storage):
    rec = Recorder()
    r = tuner.run_study(SPEC, BUCKET, SPACE, rec, storage=storage, sampler="grid", n_trials=1000)
    points = SPACE.points()
    assert r.trials == len(points)
    assert sorted(map(str, rec.calls)) == sorted(
        str(p) for p in points if not SPACE.violations(SPEC, p)
    )


def test_interrupted_run_resumes_the_same_study(storage):
    rec = Recorder(crash_at=4)
    with pytest.raises(KeyboardInterrupt):
        tuner.run_study(SPEC, BUCKET, SPACE, rec, storage=storage, n_trials=12)
    study = optuna.load_study(study_name=f"{SPEC.name}@num_tokens=65536", storage=storage)
    first = [t.params for t in study.trials]
    assert len(first) == 4
    rec2 = Recorder()
    r = tuner.run_study(SPEC, BUCKET, SPACE, rec2, storage=storage, n_trials=12)
    assert r.trials == 12 and len(rec2.calls) == 8
    study = optuna.load_study(study_name=f"{SPEC.name}@num_tokens=65536", storage=storage)
    assert [t.params for t in study.trials[:4]] == first
    assert study.trials[3].state == optuna.trial.TrialState.FAIL  # the interrupted trial
    assert rec2.calls[0] != SPEC.default_meta(**BUCKET)  # the default is not run twice


def test_a_surplus_trial_from_an_earlier_run_does_not_cost_a_larger_run_a_trial(storage):
    """A worker that asked for a trial after the budget was taken left a surplus trial; a
    re-run with a larger budget still ends with that many trials that count."""
    tuner.run_study(SPEC, BUCKET, SPACE, Recorder(), storage=storage, n_trials=10)
    study = optuna.load_study(study_name=f"{SPEC.name}@num_tokens=65536", storage=storage)
    late = study.ask()  # what a late worker's trial is: number 10, past the budget of 10
    late.set_user_attr(tuner._SURPLUS, True)
    study.tell(late, state=optuna.trial.TrialState.FAIL)
    rec = Recorder()
    r = tuner.run_study(SPEC, BUCKET, SPACE, rec, storage=storage, n_trials=16)
    study = optuna.load_study(study_name=study.study_name, storage=storage)
    assert len(study.trials) == 17  # 16 that count and the surplus one
    assert r.trials == len(tuner.counted(study.trials)) == 16
    assert len(rec.calls) == 6  # trials 11 .. 16, each run


def _tried(study):
    return [t.params for t in tuner.counted(study.trials)]


def _one_step(a, b, space=SPACE):
    """``b`` differs from ``a`` in one parameter, by one step along its values."""
    diff = [k for k in a if a[k] != b[k]]
    if len(diff) != 1:
        return False
    values = list(space.params[diff[0]])
    return abs(values.index(a[diff[0]]) - values.index(b[diff[0]])) == 1


def far_time(meta):
    """A cost with its one minimum away from the default (rows 16, warps 8)."""
    return 10.0 + abs(meta["rows_per_program"] - 16) * 3 + abs(meta["num_warps"] - 8) * 2


def test_local_search_walks_from_the_default_to_the_best(override, storage):
    """Best-first local search: after the default, every trial is an untried feasible point one
    step from a timed point, the best's first; on a surface with one minimum it gets there."""
    rec = Recorder()
    rec_time = lambda meta: (rec(meta), far_time(meta))[1]  # noqa: E731
    r = tuner.run_study(SPEC, BUCKET, SPACE, rec_time, storage=storage, sampler="local",
                        n_trials=10)  # fmt: skip
    assert rec.calls[0] == SPEC.default_meta(**BUCKET)
    keys = [json.dumps(c, sort_keys=True) for c in rec.calls]
    assert len(set(keys)) == len(keys)  # never a point twice
    assert all(not SPACE.violations(SPEC, c, BUCKET) for c in rec.calls)
    walk = tuner.NeighbourhoodSampler(SPACE, SPACE.feasible(SPEC, BUCKET))
    for i, c in enumerate(rec.calls[1:], 1):
        timed = rec.calls[:i]
        assert any(_one_step(t, c) for t in timed), (c, timed)
        # from the best timed point, while it has untried neighbours
        best = min(timed, key=far_time)
        if any(n not in timed for n in walk.neighbours(best)):
            assert _one_step(best, c), (best, c)
    best = min(SPACE.feasible(SPEC, BUCKET), key=far_time)
    assert best != rec.calls[0]
    assert r.meta == best and r.time_us == far_time(best)
    assert r.trials == 10


def test_local_search_never_picks_a_failed_trial_and_climbs_past_it(override, storage):
    rec = Recorder(broken={"rows_per_program": 4, "num_warps": 2})  # the true optimum is wrong
    r = tuner.run_study(SPEC, BUCKET, SPACE, rec, storage=storage, sampler="local", n_trials=20)
    assert {"rows_per_program": 4, "num_warps": 2, "num_stages": 1} in rec.calls
    assert r.failed == 1 and (r.meta["rows_per_program"], r.meta["num_warps"]) != (4, 2)
    timed = [c for c in rec.calls if (c["rows_per_program"], c["num_warps"]) != (4, 2)]
    assert r.time_us == min(fake_time(c) for c in timed)


def test_the_stop_rule_ends_a_study_once_trials_stop_paying(override, storage):
    """Patience 5 over a flat surface: the default is the one gain, five trials without one
    end the study; a resumed run with the same rule runs nothing, one without it goes on."""
    rec = Recorder()
    flat = lambda meta: (rec(meta), 7.0)[1]  # noqa: E731
    stop = tuner.StopRule(patience=5)
    r = tuner.run_study(SPEC, BUCKET, SPACE, flat, storage=storage, sampler="local",
                        n_trials=30, stop=stop)  # fmt: skip
    assert r.trials == 6 and len(rec.calls) == 6 and r.stopped_early
    again = tuner.run_study(SPEC, BUCKET, SPACE, flat, storage=storage, sampler="local",
                            n_trials=30, stop=stop)  # fmt: skip
    assert again.trials == 6 and len(rec.calls) == 6  # resumed: still ended
    more = tuner.run_study(SPEC, BUCKET, SPACE, flat, storage=storage, sampler="local",
                           n_trials=9)  # fmt: skip
    assert more.trials == 9 and not more.stopped_early


def test_the_local_stop_rule_ends_a_study_at_a_local_optimum(override, storage, tmp_path):
    """The walk from the default (4 rows, 2 warps) finds 4 warps by a 0.5 % gain (under
    min_gain), so patience 3 ends the study with 8 warps, beside its best and the true best,
    untried; with ``local`` the study goes on while a neighbour of its best is untried, and
    ends at the true best once its neighbours are tried. A resumed run with the same rule runs
    nothing; the rule must be bound to its study."""
    default = SPEC.default_meta(**BUCKET)
    assert (default["rows_per_program"], default["num_warps"]) == (4, 2)

    def cost(meta):
        return {(4, 2): 10.0, (4, 4): 9.95, (4, 8): 9.0}.get(
            (meta["rows_per_program"], meta["num_warps"]), 10.5
        )

    four, eight = {**default, "num_warps": 4}, {**default, "num_warps": 8}
    rec = Recorder()
    plain = tuner.StopRule(patience=3, min_gain=0.01)
    r = tuner.run_study(SPEC, BUCKET, SPACE, lambda m: (rec(m), cost(m))[1], storage=storage,
                        sampler="local", n_trials=40, stop=plain)  # fmt: skip
    assert r.stopped_early and r.meta == four and r.trials == 4 and eight not in rec.calls

    local = tuner.StopRule(patience=3, min_gain=0.01, local=True)
    other = tuner.storage_from(str(tmp_path / "local.journal"), tmp_path / "unused")
    rec = Recorder()
    r = tuner.run_study(SPEC, BUCKET, SPACE, lambda m: (rec(m), cost(m))[1], storage=other,
                        sampler="local", n_trials=40, stop=local)  # fmt: skip
    assert r.meta == eight and r.time_us == 9.0 and r.stopped_early
    assert rec.calls.index(four) < rec.calls.index(eight) and r.trials < 19
    # it ended once every feasible neighbour of its best (8 warps) was tried
    bound = local.for_study(SPEC, BUCKET)
    tried = [dict(m) for m in rec.calls]
    assert all(q in tried for q in bound.neighbours(eight))
    n = len(rec.calls)
    again = tuner.run_study(SPEC, BUCKET, SPACE, lambda m: (rec(m), cost(m))[1], storage=other,
                            sampler="local", n_trials=40, stop=local)  # fmt: skip
    assert len(rec.calls) == n and again.trials == r.trials and again.meta == eight
    with pytest.raises(RuntimeError, match="for_study"):
        local.met(_trials(10.0, 10.5, 10.5, 10.5))
    assert plain.for_study(SPEC, BUCKET) is plain  # (only a local rule is bound)


def test_a_point_two_workers_sampled_at_once_runs_in_the_lower_trial_only(storage):
    """A trial whose point an earlier trial holds (running, or enqueued and waiting) is
    surplus; the earlier one keeps it; a surplus trial holds nothing."""
    study = optuna.create_study(storage=storage, study_name="taken")
    point = {"rows_per_program": 8, "num_warps": 1, "num_stages": 1}
    dists = {k: optuna.distributions.CategoricalDistribution(list(v))
             for k, v in SPACE.params.items()}  # fmt: skip
    study.enqueue_trial(point)  # trial 0: waiting, its point fixed
    assert tuner._taken_point(study, 1, point) and not tuner._taken_point(study, 0, point)
    running = study.ask(dists)  # trial 0 runs now (its params: the point)
    assert running.number == 0 and running.params == point
    assert tuner._taken_point(study, 1, point)
    assert not tuner._taken_point(study, 1, {**point, "num_warps": 2})
    running.set_user_attr(tuner._SURPLUS, True)
    assert not tuner._taken_point(study, 1, point)


def _trials(*outcomes):
    """Finished trials numbered 0, 1, ...: a float is a time, "fail" a failed trial, "skip" a
    point skipped by a constraint."""
    out = []
    for number, o in enumerate(outcomes):
        if isinstance(o, float):
            t = optuna.trial.create_trial(params={}, distributions={}, value=o)
        else:
            attrs = {tuner._SKIPPED: True} if o == "skip" else {}
            t = optuna.trial.create_trial(
                params={}, distributions={}, state=optuna.trial.TrialState.FAIL, user_attrs=attrs
            )
        t.number = number
        out.append(t)
    return out


def test_the_stop_rule_counts_gains_of_at_least_min_gain_and_failures_as_none():
    rule = tuner.StopRule(patience=3, min_gain=0.01)
    # 10 (a gain), then 9.95 (0.5 %), 9.9, 9.89: three trials without a 1 % gain
    assert rule.met(_trials(10.0, 9.95, 9.9, 9.89))
    assert not rule.met(_trials(10.0, 9.95, 9.9))
    # a 2 % gain in between starts the count again
    assert not rule.met(_trials(10.0, 9.95, 9.7, 9.69))
    # a failed trial is a trial without a gain; a point skipped by a constraint is no trial
    assert rule.met(_trials(10.0, "fail", "fail", "fail"))
    assert not rule.met(_trials(10.0, "skip", "skip", "skip", "skip", 9.99))
    # order is by trial number, whatever order the storage lists them in
    assert rule.met(list(reversed(_trials(10.0, 9.95, 9.9, 9.89))))
    assert not tuner.NO_STOP.met(_trials(1.0, 1.0, 1.0, 1.0, 1.0))


def test_a_fresh_study_starts_from_its_nearest_tuned_buckets(override, storage):
    """Warm start: the best configs of the same variant's nearest finished buckets are trials
    right after the default (and the incumbent), nearest first; never again on a resume, never
    one that breaks the bucket's constraints."""
    near, far = {"num_tokens": 16384}, {"num_tokens": 16}
    small = lambda meta: 10.0 + meta["rows_per_program"] + meta["num_warps"]  # noqa: E731
    rn = tuner.run_study(SPEC, near, SPACE, far_time, storage=storage, sampler="local",
                         n_trials=20)  # fmt: skip
    rf = tuner.run_study(SPEC, far, SPACE, small, storage=storage, sampler="local",
                         n_trials=20)  # fmt: skip
    default = SPEC.default_meta(**BUCKET)
    assert len({json.dumps(m, sort_keys=True) for m in (rn.meta, rf.meta, default)}) == 3
    rec = Recorder()
    tuner.run_study(SPEC, BUCKET, SPACE, rec, storage=storage, sampler="local", n_trials=4,
                    neighbours=[far, near])  # fmt: skip
    assert rec.calls[:3] == [default, rn.meta, rf.meta]  # the nearest bucket's first
    study = optuna.load_study(study_name=tuner.study_name(SPEC, BUCKET), storage=storage)
    assert study.trials[1].user_attrs["warm_start"] == tuner.bucket_key(near)
    rec2 = Recorder()
    tuner.run_study(SPEC, BUCKET, SPACE, rec2, storage=storage, sampler="local", n_trials=8,
                    neighbours=[far, near])  # fmt: skip
    assert len(rec2.calls) == 4 and not any(c in rec.calls for c in rec2.calls)


def test_warm_start_takes_the_nearest_config_the_bucket_allows_for_one_it_rules_out(
    override, storage
):
    """A neighbouring bucket's best that breaks this bucket's constraints (a head tile taller
    than its rows) comes as the allowed config one parameter away from it."""
    other = {"num_tokens": 16384}
    tuner.run_study(SPEC, other, SPACE, far_time, storage=storage, sampler="local", n_trials=12)
    best = tuner.load_result(SPEC, other, storage).meta
    assert best != SPEC.default_meta(**BUCKET)

    class Refusing(type(SPACE)):
        def violations(self, spec, meta, bucket=None):
            return ["ruled out"] if bucket == BUCKET and meta == best else []

    refusing = Refusing(SPACE.template, SPACE.params, SPACE.buckets, SPACE.constraints)
    study = tuner.open_study(SPEC, BUCKET, SPACE, storage=storage, sampler="local", n_trials=6)
    (got,) = tuner.warm_start(study, SPEC, BUCKET, refusing, storage, [other], limit=6)
    assert got != best and not refusing.violations(SPEC, got, BUCKET)
    index = {k: list(v) for k, v in SPACE.params.items()}
    moved = [k for k in best if got[k] != best[k]]
    assert len(moved) == 1
    assert abs(index[moved[0]].index(got[moved[0]]) - index[moved[0]].index(best[moved[0]])) == 1
    assert tuner.warm_start(study, SPEC, BUCKET, SPACE, storage, [other], limit=6) == [best]


def test_a_fresh_study_also_starts_from_its_sibling_variants_bests_at_its_bucket(override, storage):
    """Sibling start: after the neighbouring buckets' bests, the bests of other variants of
    the same template at the same bucket, the variant with the fewest fields apart first, two
    at most; a config queued already is not queued twice; a variant of another template, or
    one with no study at the bucket, gives nothing."""
    near = StoreMXFP4MLASpec(32, 512, "fp16", "paged", "sm90", "gpu")  # one field apart
    far = StoreMXFP4MLASpec(64, 512, "fp32", "paged", "sm90", "gpu")  # two
    farther = StoreMXFP4MLASpec(64, 1024, "fp32", "paged", "sm90", "gpu")  # three
    unrun = StoreMXFP4MLASpec(32, 512, "fp32", "paged", "sm90", "gpu")
    other_template = StoreKVPerTokenHeadSpec("int8", 128, 128, "bf16", "sm90", "gpu")
    assert [tuner.spec_distance(SPEC, s) for s in (near, far, farther)] == [1, 2, 3]
    small = lambda meta: 10.0 + meta["rows_per_program"] + meta["num_warps"]  # noqa: E731

    def middle(meta):
        return 10.0 + abs(meta["rows_per_program"] - 8) + abs(meta["num_warps"] - 4)

    bests = {}
    for spec, cost in ((far, far_time), (near, small), (farther, middle)):
        space = load_space(spec.template)
        bests[spec] = tuner.run_study(spec, BUCKET, space, cost, storage=storage,
                                      sampler="local", n_trials=20).meta  # fmt: skip
    default = SPEC.default_meta(**BUCKET)
    assert len({json.dumps(m, sort_keys=True) for m in [default, *bests.values()]}) == 4
    rec = Recorder()
    tuner.run_study(SPEC, BUCKET, SPACE, rec, storage=storage, sampler="local", n_trials=4,
                    siblings=[other_template, unrun, farther, far, near, SPEC])  # fmt: skip
    assert rec.calls[:3] == [default, bests[near], bests[far]]  # not ``farther``'s: two at most
    study = optuna.load_study(study_name=tuner.study_name(SPEC, BUCKET), storage=storage)
    assert [t.user_attrs.get(tuner.SIBLING_START_ATTR) for t in study.trials[:3]] == [
        None,
        near.name,
        far.name,
    ]
    # beside a neighbouring bucket's best that is the same config: queued once, as the bucket's
    fresh = {"num_tokens": 16384}
    tuner.run_study(SPEC, fresh, SPACE, small, storage=storage, sampler="local", n_trials=20)
    assert tuner.load_result(SPEC, fresh, storage).meta == bests[near]
    other = {"num_tokens": 4096}
    tuner.run_study(near, other, SPACE, small, storage=storage, sampler="local", n_trials=20)
    study = tuner.open_study(SPEC, other, SPACE, storage=storage, sampler="local", n_trials=6)
    got = tuner.warm_start(study, SPEC, other, SPACE, storage, [fresh], 6, siblings=[near])
    assert got == [bests[near]]
    (queued,) = [t for t in study.trials if t.params == bests[near] or
                 t.system_attrs.get("fixed_params") == bests[near]]  # fmt: skip
    assert queued.user_attrs == {tuner.WARM_START_ATTR: tuner.bucket_key(fresh)}


def test_a_sibling_s_best_that_fails_here_never_wins(override, storage):
    """A sibling variant's best queued at the start that is wrong for this variant (its check
    fails here): a failed trial, never the study's result; the study's best is its own."""
    sibling = StoreMXFP4MLASpec(32, 512, "fp16", "paged", "sm90", "gpu")
    tuner.run_study(sibling, BUCKET, SPACE, far_time, storage=storage, sampler="local",
                    n_trials=20)  # fmt: skip
    theirs = tuner.load_result(sibling, BUCKET, storage).meta
    broken = {k: theirs[k] for k in ("rows_per_program", "num_warps")}
    rec = Recorder(broken=broken)
    r = tuner.run_study(SPEC, BUCKET, SPACE, rec, storage=storage, sampler="local", n_trials=6,
                        siblings=[sibling])  # fmt: skip
    assert rec.calls[1] == theirs and r.failed >= 1
    assert r.meta != theirs and fake_time(r.meta) == min(
        fake_time(c) for c in rec.calls if c != theirs
    )
    study = optuna.load_study(study_name=tuner.study_name(SPEC, BUCKET), storage=storage)
    failed = [t for t in study.trials if t.state == optuna.trial.TrialState.FAIL]
    assert [t.user_attrs.get(tuner.SIBLING_START_ATTR) for t in failed] == [sibling.name]


def test_a_study_that_ran_before_its_neighbours_tries_their_bests_and_walks_on(storage):
    """The local search's second pass (``revisit``): a study that ended at a local optimum
    before its neighbouring bucket had a result runs that bucket's best (a queued point runs
    though the stop rule was met), and, as it beats the study's best, the search goes on from
    it: its neighbours are tried. Once tried, the second pass queues nothing more."""
    other = {"num_tokens": 16384}
    default = SPEC.default_meta(**BUCKET)
    feasible = SPACE.feasible(SPEC, BUCKET)
    far = max(feasible, key=lambda m: sum(m[k] != default[k] for k in m))

    def here(meta):  # the default a local optimum; ``far`` (all parameters away) best of all
        return 1.0 if meta == far else 10.0 + 0.5 * sum(meta[k] != default[k] for k in meta)

    rule = tuner.StopRule(patience=3, local=True)
    first = Recorder()
    first_cost = lambda m: first(m) and here(m)  # noqa: E731
    r = tuner.run_study(SPEC, BUCKET, SPACE, first_cost, storage=storage, sampler="local",
                        n_trials=40, stop=rule)  # fmt: skip
    assert r.meta == default and r.stopped_early and far not in first.calls
    # (the study with the local search's sampler, as a worker opens it: optuna.load_study's
    # default TPE proposes tried points, each a surplus trial, hundreds before a fresh one)
    study = tuner.open_study(SPEC, BUCKET, SPACE, storage=storage, sampler="local", n_trials=40,
                             prepare=False)  # fmt: skip
    limit = tuner.budget(SPACE, "local", 40, SPEC, BUCKET)
    bound = rule.for_study(SPEC, BUCKET, SPACE)
    assert tuner.budget_taken(study, limit, bound)
    # the neighbouring bucket's study finds ``far`` (started there)
    theirs = tuner.open_study(SPEC, other, SPACE, storage=storage, sampler="local", n_trials=4)
    theirs.enqueue_trial(far)
    tuner.run_study(SPEC, other, SPACE, here, storage=storage, sampler="local", n_trials=4)
    assert tuner.load_result(SPEC, other, storage).meta == far

    assert tuner.revisit(study, SPEC, BUCKET, SPACE, storage, [other], limit) == [far]
    assert not tuner.budget_taken(study, limit, bound)  # the queued point runs
    again = Recorder()
    tuner.work_on_study(study, SPEC, BUCKET, SPACE, lambda m: again(m) and here(m),
                        n_trials=40, sampler="local", stop=rule)  # fmt: skip
    assert again.calls[0] == far
    near_far = NeighbourhoodSampler(SPACE, feasible).neighbours(far)
    assert len(again.calls) > len(near_far) >= 1
    assert {json.dumps(c, sort_keys=True) for c in near_far} <= {
        json.dumps(t.params, sort_keys=True) for t in study.trials if t.params
    }  # the walk went on from it until its neighbours were all tried
    assert tuner.summarize(SPEC, BUCKET, study, default, bound).meta == far
    assert tuner.revisit(study, SPEC, BUCKET, SPACE, storage, [other], limit) == []


def test_progress_line_counts_studies_names_the_current_one_and_estimates_time_left(
    override, storage
):
    from kvgen.tune.plan import Study
    from kvgen.tune.run import Options, Progress

    studies = [Study(SPEC, SPACE, {"num_tokens": n}) for n in (16, 4096, 65536)]
    tuner.run_study(SPEC, studies[0].bucket, SPACE, fake_time, storage=storage, sampler="local",
                    n_trials=5)  # fmt: skip
    first = optuna.load_study(study_name=tuner.study_name(SPEC, studies[0].bucket),
                              storage=storage).trials  # fmt: skip
    span = max(t.datetime_complete for t in first) - min(t.datetime_start for t in first)
    lines = []
    progress = Progress(studies, storage, Options("sm90", trials=5), 2, lines.append, every_s=0)
    line = progress.line()
    assert line.startswith("progress: 1/3 studies done in ")
    assert f"now {SPEC.name} @ num_tokens=4096" in line
    # the two studies left, each as long as the finished one of the family, over two GPUs
    assert f"about {2 * span.total_seconds() / 2 / 60:.1f} min left" in line
    progress.poll()
    assert len(lines) == 1 and lines[0].startswith("progress: 1/3")
    assert "second pass" not in line
    # every study done while the workers run: the local search's second pass is under way
    for st in studies[1:]:
        tuner.run_study(st.spec, st.bucket, SPACE, fake_time, storage=storage, sampler="local",
                        n_trials=5)  # fmt: skip
    line = progress.line()
    assert line.startswith("progress: 3/3 studies done") and "the second pass" in line
    tpe = Progress(studies, storage, Options("sm90", trials=5, sampler="tpe"), 2, print, 0)
    assert "second pass" not in tpe.line()  # (no second pass with TPE)


def test_progress_estimate_takes_recorded_wall_times_and_the_slowest_family_for_new_ones(
    override, storage, tmp_path
):
    """Where the workers recorded a study's wall time (inputs and re-timing included) the
    estimate uses it; a family with no finished study yet counts as the slowest so far, not
    as the mean of every study (the decodes, whose trials cost the most, come last). The
    monitor writes the variants whose studies are all done for the compile pool to skip."""
    from kvgen.families.per_token_head import StoreKVInt4Spec, StoreKVPerTokenHeadSpec
    from kvgen.tune.plan import Study
    from kvgen.tune.run import Options, Progress

    def study(spec):
        space = load_space(spec.template)
        return Study(spec, space, space.bucket_list()[0])

    kv = StoreKVPerTokenHeadSpec("int8", 128, 128, "bf16", "sm90", "gpu")
    studies = [Study(SPEC, SPACE, {"num_tokens": n}) for n in (16, 4096)]
    studies += [study(kv), study(StoreKVInt4Spec())]
    # finished: the MXFP4 store at 16 tokens (two workers, 60 s in all), the int8 store (6 s)
    for st, wall in ((studies[0], 60.0), (studies[2], 6.0)):
        tuner.run_study(st.spec, st.bucket, st.space, lambda m: 1.0 + len(str(m)) / 100,
                        storage=storage, sampler="local", n_trials=5)  # fmt: skip
        loaded = tuner.load_study(st.spec, st.bucket, storage)
        tuner.record_wall_time(loaded, "w1", wall / 3)
        tuner.record_wall_time(loaded, "w2", 2 * wall / 3)
    from kvgen.tune.precompile import finished_variants

    finished = str(tmp_path / "finished-variants")
    progress = Progress(studies, storage, Options("sm90", trials=5), 1, lambda _: None,
                        finished=finished)  # fmt: skip
    line = progress.line()
    assert line.startswith("progress: 2/4 studies done in ")
    # left: an MXFP4 study (its family's 60 s) and an int4 one (no finished study of its
    # family: the slowest family's 60 s, not the mean of the finished studies' 33 s)
    assert "about 2.0 min left" in line, line
    # the int8 store's one study is done; the MXFP4 store has one of two left
    assert finished_variants(finished) == {kv.name}


def test_progress_estimate_follows_the_recorded_costs_of_the_configs_in_use(override, storage):
    """Where the tuned configs in use recorded what a study cost when they were tuned
    (``tune_s``), a study left counts as that record times this run's pace on the finished
    studies that have one: here the finished study took twice its record, so the two left
    (recorded 30 s and 90 s) count as 60 s and 180 s, over one GPU, though the family's one
    finished study took 20 s."""
    from kvgen.tune.plan import Study
    from kvgen.tune.run import Options, Progress

    studies = [Study(SPEC, SPACE, {"num_tokens": n}) for n in (16, 4096, 65536)]
    tuner.run_study(SPEC, studies[0].bucket, SPACE, lambda m: 1.0 + len(str(m)) / 100,
                    storage=storage, sampler="local", n_trials=5)  # fmt: skip
    tuner.record_wall_time(tuner.load_study(SPEC, studies[0].bucket, storage), "w1", 20.0)
    records = [
        dataclasses.replace(
            _result({"rows_per_program": 1}), bucket=tuner.bucket_key(st.bucket), wall_s=cost
        )
        for st, cost in zip(studies, (10.0, 30.0, 90.0), strict=True)
    ]
    path = tuner.write_results(override, "sm90", SPEC.family, records, ENV, "local", 5)
    entries = json.loads(path.read_text())["entries"][SPEC.name]
    assert entries["num_tokens=4096"]["tune_s"] == 30.0  # (written beside the config)
    configs.reset()
    line = Progress(studies, storage, Options("sm90", trials=5), 1, lambda _: None).line()
    assert "about 4.0 min left" in line, line
    # no record for any study left: the family's finished one (20 s a study)
    for st in studies[1:]:
        del entries[tuner.bucket_key(st.bucket)]
    doc = json.loads(path.read_text())
    doc["entries"][SPEC.name] = entries
    path.write_text(json.dumps(doc))
    configs.reset()
    line = Progress(studies, storage, Options("sm90", trials=5), 1, lambda _: None).line()
    assert "about 0.7 min left" in line, line


def _result(meta, t=5.0):
    return tuner.StudyResult(SPEC.name, "num_tokens=65536", meta, t, 2 * t, 10, 1)


def test_written_json_is_valid_sorted_and_atomic(tmp_path):
    meta = {"rows_per_program": 8, "num_warps": 2, "num_stages": 1}
    path = tuner.write_results(tmp_path, "sm90", SPEC.family, [_result(meta)], ENV, "tpe", 10)
    text = path.read_text()
    doc = json.loads(text)
    assert configs.validate(doc, "sm90", SPEC.family) == []
    assert text == json.dumps(doc, indent=2, sort_keys=True) + "\n"
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temp file left
    # A second run merges into the same file.
    other = tuner.StudyResult(SPEC.name, "num_tokens=1", meta, 1.0, 1.5, 10, 0)
    tuner.write_results(tmp_path, "sm90", SPEC.family, [other], ENV, "tpe", 10)
    entries = json.loads(path.read_text())["entries"][SPEC.name]
    assert set(entries) == {"num_tokens=65536", "num_tokens=1"}
    with pytest.raises(ValueError):
        configs.write(path, {"schema_version": 1})


def test_a_device_folder_is_written_for_its_own_gpu_only(tmp_path):
    meta = {"rows_per_program": 8, "num_warps": 2, "num_stages": 1}
    env = {**ENV, "device": "NVIDIA H100 80GB HBM3"}
    folder = configs.device_folder(env["device"])
    assert folder == "nvidia-h100-80gb-hbm3"
    path = tuner.write_results(tmp_path, "sm90", SPEC.family, [_result(meta)], env, "tpe", 10,
                               folder)  # fmt: skip
    assert path == tmp_path / "sm90" / folder / f"{SPEC.family}.json"
    doc = json.loads(path.read_text())
    assert configs.validate(doc, "sm90", SPEC.family, folder) == []
    assert configs.validate(doc, "sm90", SPEC.family, "nvidia-h200") == [
        "env.device is 'NVIDIA H100 80GB HBM3', the file sits under 'nvidia-h200'"
    ]
    with pytest.raises(ValueError, match="the file sits under 'nvidia-h200'"):
        tuner.write_results(tmp_path, "sm90", SPEC.family, [_result(meta)], env, "tpe", 10,
                            "nvidia-h200")  # fmt: skip
    assert not (tmp_path / "sm90" / "nvidia-h200").exists()


def test_committed_configs_match_the_schema():
    from kvgen import registry
    from kvgen._resources import tuned_configs_dir

    paths = [*tuned_configs_dir().glob("*/*.json"), *tuned_configs_dir().glob("*/*/*.json")]
    assert any(p.parent.parent.name == "sm90" for p in paths)  # a GPU model's own files
    for path in paths:
        doc = json.loads(path.read_text())
        in_device = path.parent.parent.name != tuned_configs_dir().name
        arch = path.parent.parent.name if in_device else path.parent.name
        device = path.parent.name if in_device else None
        assert configs.validate(doc, arch, path.stem, device) == [], path
        for variant, buckets in doc["entries"].items():
            # a GPU variant of this arch and of the file's family
            (spec,) = registry.lookup([variant], arch, "gpu")
            assert (spec.arch, spec.target, spec.family) == (arch, "gpu", path.stem)
            for entry in buckets.values():
                assert isinstance(entry["meta"], dict)


# ---- the run-time loader -------------------------------------------------------------------


def _config(tmp_path, arch="sm90", meta=None, buckets=(1, 65536), **changes):
    meta = meta or {"rows_per_program": 8, "num_warps": 2, "num_stages": 1}
    doc = {
        "schema_version": 1,
        "family": SPEC.family,
        "env": {**ENV, "arch": arch},
        "provenance": {"date": "2026-11-29", "sampler": "tpe", "trials": 10},
        "entries": {
            SPEC.name: {
                f"num_tokens={b}": {
                    "meta": {**meta, "rows_per_program": 2 if b == 1 else meta["rows_per_program"]},
                    "time_us": 1.0,
                    "default_time_us": 2.0,
                }
                for b in buckets
            }
        },
    }
    doc.update(changes)
    path = tmp_path / arch / f"{SPEC.family}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc) if not isinstance(doc, str) else doc)
    return path


@pytest.fixture
def override(tmp_path, monkeypatch):
    """An override folder, and no packaged configs (the committed ones would answer first)."""
    monkeypatch.setenv(configs.OVERRIDE_ENV, str(tmp_path))
    monkeypatch.setattr(configs, "tuned_configs_dir", lambda: tmp_path / "packaged")
    configs.reset()
    yield tmp_path
    configs.reset()


def test_override_folder_and_nearest_bucket(override):
    _config(override)
    assert configs.meta_params(SPEC, num_tokens=50000)["rows_per_program"] == 8
    assert configs.meta_params(SPEC, num_tokens=3)["rows_per_program"] == 2
    assert configs.nearest_bucket(["num_tokens=1", "num_tokens=4096"], {"num_tokens": 100}) == (
        "num_tokens=4096"
    )
    kv = StoreKVPerTokenHeadSpec()
    keys = ["num_heads=1,num_tokens=16", "num_heads=8,num_tokens=16", "num_heads=8,num_tokens=4096"]
    assert configs.nearest_bucket(keys, {"num_tokens": 20, "num_heads": 8}) == keys[1]
    assert configs.nearest_bucket(keys, {"num_tokens": 20}) is None  # other dimensions
    del kv


def test_missing_file_falls_back_with_one_log_line(override, caplog):
    with caplog.at_level(logging.WARNING, logger="kvgen"):
        for n in (1, 16, 4096):
            assert configs.meta_params(SPEC, num_tokens=n) == SPEC.default_meta(num_tokens=n)
    assert len([r for r in caplog.records if "no tuned config" in r.message]) == 1


@pytest.mark.parametrize(
    "breakage",
    ["malformed", "future_schema", "other_arch", "outside_space", "bad_types"],
)
def test_bad_files_warn_and_fall_back(override, caplog, breakage):
    if breakage == "malformed":
        (override / "sm90").mkdir()
        (override / "sm90" / f"{SPEC.family}.json").write_text("{not json")
    elif breakage == "future_schema":
        _config(override, schema_version=2)
    elif breakage == "other_arch":
        p = _config(override, arch="sm80")
        (override / "sm90").mkdir()
        p.rename(override / "sm90" / p.name)  # an sm80 file under sm90/
    elif breakage == "outside_space":
        _config(override, meta={"rows_per_program": 3, "num_warps": 2, "num_stages": 1})
    else:
        _config(override, meta={"rows_per_program": "8", "num_warps": 2, "num_stages": 1})
    with caplog.at_level(logging.WARNING, logger="kvgen"):
        assert configs.meta_params(SPEC, num_tokens=65536) == SPEC.default_meta(num_tokens=65536)
    assert caplog.records, "a bad config must be reported"


def test_a_file_from_another_triton_is_ignored_and_torch_or_cuda_only_warn(
    override, caplog, monkeypatch
):
    import torch
    import triton

    monkeypatch.setattr(triton, "__version__", "3.6.1")  # the same major.minor: used
    monkeypatch.setattr(torch, "__version__", "2.13.0+cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # the warning is for GPUs
    _config(override, env={**ENV, "arch": "sm90", "torch": "2.9.1"})
    with caplog.at_level(logging.WARNING, logger="kvgen"):
        assert configs.meta_params(SPEC, num_tokens=65536)["rows_per_program"] == 8
    assert any(
        "torch 2.9.1" in r.getMessage() and "using it" in r.getMessage() for r in caplog.records
    )
    configs.reset()
    caplog.clear()
    _config(override, env={**ENV, "arch": "sm90", "triton": "3.5.0"})
    with caplog.at_level(logging.WARNING, logger="kvgen"):
        assert configs.meta_params(SPEC, num_tokens=65536) == SPEC.default_meta(num_tokens=65536)
    assert any(
        "ignoring" in r.getMessage() and "Triton 3.5.0" in r.getMessage() for r in caplog.records
    )


def test_files_are_read_once_per_process(override, monkeypatch):
    path = _config(override)
    reads = []
    real = type(path).read_text
    monkeypatch.setattr(
        type(path), "read_text", lambda self, *a, **k: (reads.append(self), real(self, *a, **k))[1]
    )
    for n in range(1, 200):
        configs.meta_params(SPEC, num_tokens=n)
    assert len([p for p in reads if p.name.endswith(".json")]) == 1


def test_packaged_configs_are_used_below_the_override(override, monkeypatch, tmp_path):
    packaged = tmp_path / "packaged"
    _config(packaged, meta={"rows_per_program": 16, "num_warps": 2, "num_stages": 1})
    configs.reset()
    assert configs.meta_params(SPEC, num_tokens=65536)["rows_per_program"] == 16
    _config(override)  # the override folder wins
    configs.reset()
    assert configs.meta_params(SPEC, num_tokens=65536)["rows_per_program"] == 8
    monkeypatch.setattr(configs, "use_tuned", False)  # KVGEN_DISABLE_TUNED=1
    assert configs.meta_params(SPEC, num_tokens=65536) == SPEC.default_meta(num_tokens=65536)


def _device_config(root, device, rows, measured_on=None):
    """A config in ``root/sm90/device/`` (measured on ``measured_on``, default the GPU model
    the folder is named after) whose entries have ``rows_per_program`` ``rows``."""
    names = {"nvidia-h100-80gb-hbm3": "NVIDIA H100 80GB HBM3", "nvidia-h200": "NVIDIA H200"}
    env = {**ENV, "arch": "sm90", "device": measured_on or names[device]}
    path = _config(root / "_new", meta={"rows_per_program": rows, "num_warps": 2,
                                         "num_stages": 1}, env=env)  # fmt: skip
    (root / "sm90" / device).mkdir(parents=True, exist_ok=True)
    return path.rename(root / "sm90" / device / path.name)


def test_a_gpu_models_own_configs_come_before_the_archs(override, monkeypatch, tmp_path):
    packaged = tmp_path / "packaged"
    _config(packaged, meta={"rows_per_program": 16, "num_warps": 2, "num_stages": 1})
    _device_config(packaged, "nvidia-h100-80gb-hbm3", 1)
    _device_config(packaged, "nvidia-h200", 2)

    def rows_on(device):
        monkeypatch.setenv(configs.DEVICE_ENV, device)
        configs.reset()
        return configs.meta_params(SPEC, num_tokens=65536)["rows_per_program"]

    assert rows_on("nvidia-h100-80gb-hbm3") == 1
    assert rows_on("nvidia-h200") == 2
    assert rows_on("nvidia-a100-sxm4-80gb") == 16  # no folder of its own: the arch's
    assert rows_on("") == 16  # none (no GPU)
    monkeypatch.delenv(configs.DEVICE_ENV)
    monkeypatch.setattr(configs, "_gpu_folder", lambda: "nvidia-h200")  # CUDA's device name
    configs.reset()
    assert configs.meta_params(SPEC, num_tokens=65536)["rows_per_program"] == 2
    arch_only = configs.table("sm90", SPEC.family, device="")[SPEC.name]
    assert arch_only["num_tokens=65536"]["meta"]["rows_per_program"] == 16
    # the override folder's arch file comes before the package's device files
    _config(override)
    assert rows_on("nvidia-h200") == 8
    # kvgen show lists every file, each with its device folder
    files = configs.files("sm90")
    assert [(p.parent.name, p.name) for p in files[-3:]] == [
        ("sm90", f"{SPEC.family}.json"),
        ("nvidia-h100-80gb-hbm3", f"{SPEC.family}.json"),
        ("nvidia-h200", f"{SPEC.family}.json"),
    ]
    docs, invalid = configs.summary("sm90", lambda family: None)
    assert invalid == []
    assert [d["device"] for d in docs] == [None, None, "nvidia-h100-80gb-hbm3", "nvidia-h200"]


def test_a_device_folder_holding_another_gpus_file_is_ignored(override, monkeypatch, caplog):
    _config(override, meta={"rows_per_program": 16, "num_warps": 2, "num_stages": 1})
    _device_config(override, "nvidia-h200", 2, measured_on="NVIDIA H100 80GB HBM3")
    monkeypatch.setenv(configs.DEVICE_ENV, "nvidia-h200")
    configs.reset()
    with caplog.at_level(logging.WARNING, logger="kvgen"):
        assert configs.meta_params(SPEC, num_tokens=65536)["rows_per_program"] == 16
    assert any(
        "ignoring" in r.getMessage() and "the file sits under 'nvidia-h200'" in r.getMessage()
        for r in caplog.records
    )


def test_an_entry_that_breaks_a_constraint_of_the_space_is_not_used(override, caplog):
    """A tuned entry whose config breaks one of the space's constraints (a hand-edited file,
    or one tuned before the constraint) gives the template's defaults, with a warning that
    names the constraint."""
    broken = {"rows_per_program": 16, "num_warps": 1, "num_stages": 1}
    assert SPACE.allows(broken) and SPACE.violations(SPEC, broken) == ["values_per_thread"]
    _config(override, meta=broken)
    with caplog.at_level(logging.WARNING, logger="kvgen"):
        got = configs.meta_params(SPEC, num_tokens=65536)
    assert got == SPEC.default_meta(num_tokens=65536)
    assert any("values_per_thread" in r.getMessage() for r in caplog.records)


def test_interpreter_target_reads_the_gpu_twins_tuned_configs(override):
    # The interpreter runs the GPU's kernels: it takes the meta-parameters tuned for them.
    _config(override)
    interp = StoreMXFP4MLASpec(32, 512, "bf16", "paged", "sm90", "interp")
    assert configs.tuned_name(interp) == SPEC.name
    assert configs.meta_params(interp, num_tokens=65536)["rows_per_program"] == 8
    assert configs.meta_params(interp, num_tokens=65536) == configs.meta_params(
        SPEC, num_tokens=65536
    )
    assert configs.tuned_time(interp, num_tokens=65536) == configs.tuned_time(
        SPEC, num_tokens=65536
    )


def test_debug_log_says_which_config_a_call_used(override, caplog):
    _config(override)
    with caplog.at_level(logging.DEBUG, logger="kvgen"):
        for n in (60000, 65536, 70000):  # one bucket: one line
            configs.meta_params(SPEC, num_tokens=n)
        configs.meta_params(StoreMXFP4MLASpec(64, 512), num_tokens=4)  # untuned: defaults
    lines = [r.getMessage() for r in caplog.records if r.levelno == logging.DEBUG]
    tuned = [m for m in lines if m.startswith(f"kvgen: {SPEC.name} ")]
    assert len(tuned) == 1, lines
    assert "tuned" in tuned[0] and "[num_tokens=65536]" in tuned[0] and ".json" in tuned[0]
    assert "rows_per_program" in tuned[0]
    assert any("g64" in m and "template defaults" in m for m in lines), lines


def test_kvgen_log_environment_variable_prints_debug_lines(tmp_path):
    code = (
        "import torch, kvgen.ops as o\n"
        "x = torch.randn(4, 512).to(torch.bfloat16)\n"
        "c = torch.zeros(1, 16, 272, dtype=torch.uint8)\n"
        "o.store_mxfp4_mla(x, torch.arange(4), c)\n"
    )
    env = {
        **os.environ,
        "KVGEN_LOG": "debug",
        "TRITON_INTERPRET": "1",
        "KVGEN_CACHE_DIR": str(tmp_path),
    }
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr
    line = [m for m in out.stderr.splitlines() if "store_mxfp4_mla-g32-l512-bf16-paged" in m]
    assert line and line[0].startswith("DEBUG kvgen:") and "num_tokens=4" in line[0], out.stderr


def test_host_parameters_share_one_compile(tmp_path, monkeypatch):
    """Points that differ only in [host] parameters (a split policy the launcher or the
    scheduler reads) are compiled once; a [host] name that is not a parameter is refused."""
    from kvgen.families.gqa_decode import GQADecodeSpec
    from kvgen.space import Space

    gqa = GQADecodeSpec(128, 128, "bf16", "int8", 0, "portable", "sm90", "gpu")
    space = load_space(gqa.template)
    assert space.host == ("split_factor",)
    compiled = space.compile_points(gqa)
    key = [tuple(v for k, v in m.items() if k != "split_factor") for m in compiled]
    assert len(key) == len(set(key))  # one point for each compiled set
    assert set(key) == {tuple(v for k, v in m.items() if k != "split_factor")
                        for m in space.feasible(gqa)}  # fmt: skip
    assert len(compiled) * len(space.params["split_factor"]) >= len(space.feasible(gqa))
    no_host = Space(space.template, space.params, space.buckets, space.constraints)
    assert no_host.compile_points(gqa) == no_host.feasible(gqa)
    bad = tmp_path / "t.space.toml"
    bad.write_text('[params]\na = [1]\n[buckets]\nn = [1]\n[host]\nparams = ["b"]\n')
    render = sys.modules["kvgen.codegen.render"]  # (the package's render is the function)
    monkeypatch.setattr(render, "template_path", lambda t: tmp_path / "t.py.j2")
    load_space.cache_clear()
    try:
        with pytest.raises(SpaceError, match="not parameters"):
            load_space("t.py.j2")
        # likewise a [compile] per_bucket size that is not a bucket
        bad.write_text('[params]\na = [1]\n[buckets]\nn = [1]\n[compile]\nper_bucket = ["m"]\n')
        load_space.cache_clear()
        with pytest.raises(SpaceError, match="not buckets"):
            load_space("t.py.j2")
        bad.write_text('[params]\na = [1]\n[buckets]\nn = [1]\n[compile]\nper_bucket = ["n"]\n')
        load_space.cache_clear()
        assert load_space("t.py.j2").per_bucket == ("n",)
    finally:
        load_space.cache_clear()


def test_feasible_points_are_remembered_and_handed_out_as_copies():
    """A space answers feasible() once for each (spec, bucket) (a tuner asks at every study);
    a caller that changes a point it got changes no later answer."""
    from kvgen.families.gqa_decode import GQADecodeSpec

    gqa = GQADecodeSpec(128, 128, "bf16", "int8", 0, "portable", "sm90", "gpu")
    space = load_space(gqa.template)
    first = space.feasible(gqa, {"rows": 4})
    want = [m for m in space.points() if not space.violations(gqa, m, {"rows": 4})]
    assert first == want and space.feasible(gqa) != first  # (the bucket's own constraints)
    first[0]["block_h"] = -1
    assert space.feasible(gqa, {"rows": 4}) == want


def test_constraint_language_is_closed():
    assert evaluate("is_pow2(a) and a * 2 <= b", {"a": 4, "b": 8})
    for bad in ("__import__('os')", "a.b", "[1][0]", "open('x')"):
        with pytest.raises(SpaceError):
            evaluate(bad, {"a": 1})


def test_show_and_tune_commands(override):
    from typer.testing import CliRunner

    import kvgen.cli

    _config(override)
    runner = CliRunner()
    result = runner.invoke(kvgen.cli.app, ["show", "sm90"])
    assert result.exit_code == 0, result.output
    assert "rows_per_program=8" in result.output and SPEC.name in result.output
    assert runner.invoke(kvgen.cli.app, ["show", "sm100"]).exit_code == 1
    import torch

    if not torch.cuda.is_available():
        result = runner.invoke(kvgen.cli.app, ["tune", "--arch", "sm90"])
        assert result.exit_code == 2 and "needs a CUDA GPU" in result.output


def test_tpe_proposes_only_fresh_feasible_points(storage):
    """A trial is never spent on a point the study has timed or that breaks a constraint,
    until every feasible point was tried."""
    big = StoreMXFP4MLASpec(32, 1024, "fp32", "paged", "sm90", "gpu")  # has infeasible points
    space = load_space(big.template)
    feasible = space.feasible(big)
    assert 0 < len(feasible) < len(space.points())
    rec = Recorder()
    r = tuner.run_study(big, BUCKET, space, rec, storage=storage, n_trials=len(feasible))
    assert r.failed == 0
    assert sorted(map(str, rec.calls)) == sorted(map(str, feasible))


def test_bucket_constraints_shrink_small_buckets(storage):
    """At one token a program of several rows only masks lanes: TPE's study there times only
    the points that fit the bucket, and its budget is capped at their number."""
    small = {"num_tokens": 1}
    fit = SPACE.feasible(SPEC, small)
    assert fit and all(m["rows_per_program"] == 1 for m in fit)
    assert len(fit) < len(SPACE.feasible(SPEC)) < len(SPACE.points())
    assert SPACE.violations(SPEC, {**fit[0], "rows_per_program": 2}, small) == ["rows_fit"]
    assert SPACE.violations(SPEC, {**fit[0], "rows_per_program": 2}) == []  # static only
    assert tuner.budget(SPACE, "tpe", 40, SPEC, small) == len(fit)
    rec = Recorder()
    r = tuner.run_study(SPEC, small, SPACE, rec, storage=storage, n_trials=40)
    assert r.failed == 0 and len(rec.calls) == len(fit)
    assert sorted(map(str, rec.calls)) == sorted(map(str, fit))


@pytest.mark.parametrize(
    "family",
    [
        "store_mxfp4_mla",
        "gather_mxfp4_mla",
        "store_mxfp4_rope_mla",
        "gather_mxfp4_rope_mla",
        "store_kv_per_token_head",
        "store_kv_int4_per_token_head",
        "concat_and_cache_mla",
        "gather_mla_cache",
    ],
)
def test_tuning_problems_check_candidates(family, device, local_target, monkeypatch):
    """A trial's inputs (the bench's rotated sets) and its reference check, on this machine's
    target: the default and another candidate pass, and a run leaves a set intact for timing.
    The reference is made once for all candidates, so the check poisons what it compares:
    a launch that writes nothing fails it, right after a launch that passed."""
    import sys
    import types

    from kvgen import registry
    from kvgen.codegen import load
    from kvgen.tune import problems

    arch, target = local_target
    spec = next(
        s
        for s in registry.variants(arch, target, family)
        if s.fields().get("in_dtype", s.fields().get("dtype")) == "bf16"
        and s.fields().get("channels", 32) == 32  # (int4's tuning problem: vLLM's 32)
    )
    bucket = {
        "num_tokens": 16,
        **({"num_heads": 2} if "num_heads" in load_space(spec.template).buckets else {}),
    }
    writes = [True]

    def load_switchable(s):
        real = load(s).launch
        return types.SimpleNamespace(launch=lambda *a, **k: real(*a, **k) if writes[0] else None)

    module = type(registry.family(family)).__module__.replace(".family", ".tuning")
    __import__(module)
    monkeypatch.setattr(sys.modules[module], "load", load_switchable)
    run, check, n_sets = problems.problem(spec, bucket, device)
    default = spec.default_meta(**bucket)
    other = {**default, next(iter(default)): 2}  # 2 rows or tokens per program
    assert n_sets >= 1 and check(default) and check(other)
    writes[0] = False
    assert not check(default)
    writes[0] = True
    run(n_sets - 1, other)


def test_incumbent_is_the_second_trial(override, storage):
    """A re-tune (say after a kernel change) measures the tuned JSON's config for the bucket
    right after the default, so the sampler cannot lose a winner it fails to revisit; with no
    entry for the bucket only the default is queued."""
    feasible = SPACE.feasible(SPEC, BUCKET)
    incumbent = next(m for m in reversed(feasible) if m != SPEC.default_meta(**BUCKET))
    _config(override, meta=incumbent, buckets=(65536,))
    rec = Recorder()
    tuner.run_study(SPEC, BUCKET, SPACE, rec, storage=storage, n_trials=6)
    assert rec.calls[0] == SPEC.default_meta(**BUCKET)
    assert rec.calls[1] == incumbent
    rec = Recorder()
    tuner.run_study(SPEC, {"num_tokens": 4096}, SPACE, rec, storage=storage, n_trials=6)
    assert rec.calls[1] != incumbent or rec.calls.count(incumbent) == 1  # sampled, not queued
    assert tuner.incumbent(SPEC, {"num_tokens": 4096}) is None


def test_confirm_retimes_the_best_and_drops_a_lucky_trial(override, storage, tmp_path):
    """One config timed in a lucky moment (2 % under the best) wins the study; re-timing the
    configs within CONFIRM_MARGIN of it in alternated rounds gives the win back to the truly
    fastest config. Configs further from the best are not re-timed: noise cannot reorder
    them."""
    lucky = {"rows_per_program": 8, "num_warps": 4, "num_stages": 1}
    true_best = min(SPACE.feasible(SPEC), key=fake_time)
    seen = []

    def noisy(meta):  # the lucky config reads 2 % under the best the first time only
        seen.append(dict(meta))
        if meta == lucky and seen.count(lucky) == 1:
            return fake_time(true_best) * 0.98
        return fake_time(meta)

    r = tuner.run_study(SPEC, BUCKET, SPACE, noisy, storage=storage, sampler="grid", n_trials=1000)
    assert r.meta == lucky and r.time_us < fake_time(true_best)  # the single trial's verdict
    seen.clear()
    c = tuner.confirm(SPEC, BUCKET, storage, noisy, top=3, rounds=3)
    assert c.meta == true_best and c.time_us == fake_time(true_best)
    assert c.confirm_rounds == 3 and c.trials == r.trials
    default = SPEC.default_meta(**BUCKET)
    assert default == true_best and c.default_time_us == fake_time(default)
    # candidates: the lucky one and the best (the default), the only configs within 10 % of
    # the lucky reading; in rounds forward, backward, forward
    assert tuner.CONFIRM_MARGIN == 0.10
    assert sorted(fake_time(m) for m in SPACE.feasible(SPEC))[1] > fake_time(true_best) * 1.10
    assert seen == [lucky, true_best, true_best, lucky, lucky, true_best]
    # what the choice rests on, fastest median first, beside each config's trial reading
    assert c.retimed == (
        (true_best, fake_time(true_best), fake_time(true_best)),
        (lucky, fake_time(lucky), fake_time(true_best) * 0.98),
    )
    recorded = tuner.confirm(SPEC, BUCKET, storage, noisy, top=3, rounds=3, record=True)
    study = tuner.load_study(SPEC, BUCKET, storage)
    assert study.user_attrs["confirmed"]["retimed"] == [
        {"meta": m, "median_us": med, "trial_us": trial} for m, med, trial in recorded.retimed
    ]
    # the study itself is unchanged, and the JSON records the re-timing
    assert tuner.load_result(SPEC, BUCKET, storage).meta == lucky
    doc_path = tuner.write_results(tmp_path, "sm90", SPEC.family, [c], ENV, "grid", 1000)
    entry = json.loads(doc_path.read_text())["entries"][SPEC.name]["num_tokens=65536"]
    assert entry["confirm_rounds"] == 3 and entry["meta"] == true_best


def test_confirm_retimes_the_incumbent_near_the_best_so_noise_cannot_replace_it(override, storage):
    """The tuned JSON's config for the bucket (the incumbent), whose one trial read 15 % slow,
    is neither among the best three nor within CONFIRM_MARGIN of the best trial; it is re-timed
    beside them all the same (within INCUMBENT_MARGIN), and wins: a re-tune keeps it unless
    another config beats it in the same alternated rounds. Read 30 % slow, it is not re-timed
    (further than noise takes a reading)."""
    true_best = min(SPACE.feasible(SPEC), key=fake_time)
    lucky = sorted(SPACE.feasible(SPEC), key=fake_time)[1:4]  # three configs that read best once
    incumbent = true_best
    _config(override, meta=incumbent, buckets=(65536,))
    configs.reset()
    assert tuner.incumbent(SPEC, BUCKET) == incumbent

    def make(slow):
        seen = []

        def noisy(meta):
            seen.append(dict(meta))
            first = seen.count(meta) == 1
            if meta in lucky and first:  # read under the best, once
                return fake_time(true_best) * (0.95 + 0.01 * lucky.index(meta))
            if meta == incumbent and first:
                return fake_time(meta) * slow
            return fake_time(meta)

        return noisy, seen

    noisy, seen = make(1.15)
    tuner.run_study(SPEC, BUCKET, SPACE, noisy, storage=storage, sampler="grid", n_trials=1000)
    best_read = fake_time(true_best) * 0.95
    assert fake_time(incumbent) * 1.15 > best_read * (1 + tuner.CONFIRM_MARGIN)
    assert fake_time(incumbent) * 1.15 <= best_read * (1 + tuner.INCUMBENT_MARGIN)
    seen.clear()
    c = tuner.confirm(SPEC, BUCKET, storage, noisy, top=3, rounds=3)
    assert c.meta == incumbent and c.time_us == fake_time(incumbent)
    assert seen.count(incumbent) == 3 and all(seen.count(m) == 3 for m in lucky)

    noisy, seen = make(1.30)
    study_storage = tuner.storage_from(str(override / "slow.journal"), override / "unused")
    tuner.run_study(SPEC, BUCKET, SPACE, noisy, storage=study_storage, sampler="grid",
                    n_trials=1000)  # fmt: skip
    seen.clear()
    c = tuner.confirm(SPEC, BUCKET, study_storage, noisy, top=3, rounds=3)
    assert incumbent not in seen and c.meta in lucky


def test_confirm_retimes_with_the_evaluators_confirm_where_it_has_one(override, storage):
    """The GPU evaluator times its trials with a short settle and its re-timings with the
    bench's full one (``evaluate.confirm``): ``confirm`` uses the latter."""
    lucky = {"rows_per_program": 8, "num_warps": 4, "num_stages": 1}
    true_best = min(SPACE.feasible(SPEC), key=fake_time)
    calls = []

    def trial(meta):  # the lucky config reads under the best in its trial
        calls.append("trial")
        return fake_time(true_best) * 0.98 if meta == lucky else fake_time(meta)

    def careful(meta):
        calls.append("confirm")
        return fake_time(meta)

    trial.confirm = careful
    tuner.run_study(SPEC, BUCKET, SPACE, trial, storage=storage, sampler="grid", n_trials=1000)
    calls.clear()
    c = tuner.confirm(SPEC, BUCKET, storage, trial, top=3, rounds=3)
    assert calls == ["confirm"] * 6 and c.meta == true_best


def test_the_gpu_evaluator_settles_a_run_of_retimings_fully_only_before_its_first(monkeypatch):
    """The GPU evaluator's trials settle TRIAL_SETTLE_MS; of a run of re-timings
    (``evaluate.confirm``) the first settles the bench's full SETTLE_MS (what ran before it
    may be another study's load), the others, which follow a timing of the same problem, as
    trials do; a trial between two runs starts a new run."""
    from kvgen.bench import harness
    from kvgen.tune import problems

    monkeypatch.delenv("KVGEN_TUNE_TRIAL_SETTLE_MS", raising=False)
    monkeypatch.setattr(problems, "problem", lambda spec, bucket, device: (
        lambda i, meta: None, lambda meta: meta.get("ok", True), 2))  # fmt: skip
    monkeypatch.setattr(harness, "eager_time_us", lambda step, n_sets, iters=200: 1.0)
    settles = []

    def graph_time_us(step, n_sets, calls=None, replays=20, trials=7, settle_ms=0.0):
        settles.append(settle_ms)
        return 1.0

    monkeypatch.setattr(harness, "graph_time_us", graph_time_us)
    evaluate = problems.gpu_evaluator(SPEC, BUCKET, device="cpu")
    short, full = problems.TRIAL_SETTLE_MS, harness.SETTLE_MS
    assert short < full
    evaluate({})
    for _ in range(3):
        evaluate.confirm({})
    with pytest.raises(tuner.TrialFailed):
        evaluate.confirm({"ok": False})  # (checked, not timed)
    evaluate.confirm({})
    evaluate({})
    evaluate.confirm({})
    evaluate.confirm({})
    assert settles == [short, full, short, short, short, short, full, short]


def test_the_gpu_evaluator_checks_and_sizes_a_config_once(monkeypatch):
    """A config the GPU evaluator has checked and sized (its trial) is re-timed without a
    second check or eager sizing: each re-timing is the graph's timing alone, with the size
    the first timing found; a config whose check failed is checked again (and fails again),
    never timed; ``evaluate.seconds`` holds the sizing apart from the timing."""
    from kvgen.bench import harness
    from kvgen.tune import problems

    checks, sizings, graphs = [], [], []

    def check(meta):
        checks.append(dict(meta))
        return meta.get("ok", True)

    monkeypatch.setattr(problems, "problem", lambda spec, bucket, device: (
        lambda i, meta: None, check, 2))  # fmt: skip

    def eager_time_us(step, n_sets, iters=200):
        sizings.append(1)
        return 100.0

    def graph_time_us(step, n_sets, calls=None, replays=20, trials=7, settle_ms=0.0):
        graphs.append((calls, replays))
        return 1.0

    monkeypatch.setattr(harness, "eager_time_us", eager_time_us)
    monkeypatch.setattr(harness, "graph_time_us", graph_time_us)
    evaluate = problems.gpu_evaluator(SPEC, BUCKET, device="cpu")
    evaluate({"a": 1})
    for _ in range(3):
        evaluate.confirm({"a": 1})
    evaluate.confirm({"a": 2})  # (a config only re-timed: checked and sized at its first)
    evaluate.confirm({"a": 2})
    for _ in range(2):
        with pytest.raises(tuner.TrialFailed):
            evaluate.confirm({"a": 3, "ok": False})
    assert checks == [{"a": 1}, {"a": 2}, {"a": 3, "ok": False}, {"a": 3, "ok": False}]
    assert len(sizings) == 2
    # 100 us a call: max(n_sets, 500 / 100 + 1) calls, 20000 / (6 * 100) + 1 replays
    assert graphs == [(6, 10)] * 6
    assert set(evaluate.seconds) == {"first check", "check", "sizing", "timing"}


def test_confirm_retimes_a_lone_best_and_nothing_its_median_leaves_behind(
    override, storage, tmp_path
):
    """A best trial with no other config within CONFIRM_MARGIN is re-timed alone (its reading
    may be lucky); where every other config read slower than its median, nothing else is
    timed and it stands. A study that timed one config only is not re-timed."""
    tuner.run_study(SPEC, BUCKET, SPACE, fake_time, storage=storage, sampler="grid", n_trials=1000)
    best = min(SPACE.feasible(SPEC), key=fake_time)
    assert sorted(map(fake_time, SPACE.feasible(SPEC)))[1] > fake_time(best) * 1.10
    seen = []
    c = tuner.confirm(SPEC, BUCKET, storage, lambda m: seen.append(m) or fake_time(m), top=3)
    assert c.meta == best and c.confirm_rounds == 3 and seen == [best] * 3
    one = tuner.storage_from(str(tmp_path / "one.journal"), tmp_path / "unused")
    tuner.run_study(SPEC, BUCKET, SPACE, fake_time, storage=one, n_trials=1)
    c = tuner.confirm(SPEC, BUCKET, one, lambda m: pytest.fail("timed"), top=3, rounds=3)
    assert c.confirm_rounds == 0 and c.trials == 1


def test_confirm_retimes_in_a_second_pass_what_a_lucky_best_trial_kept_out(override, storage):
    """A config whose trial read 20 % fast (a microsecond store's trial can, after lighter
    work) leaves the true best outside CONFIRM_MARGIN of the best reading; the first pass
    re-times only the configs near that reading, and its winning median lies above the true
    best's reading, so the second pass re-times the true best beside the first pass's winner,
    and it wins. Without the second pass the lucky config would stand."""
    by_time = sorted(SPACE.feasible(SPEC), key=fake_time)
    true_best, lucky = by_time[0], by_time[3]
    seen = []

    def noisy(meta):  # the lucky config's first reading is 20 % under the true best's time
        seen.append(dict(meta))
        if meta == lucky and seen.count(lucky) == 1:
            return fake_time(true_best) * 0.80
        return fake_time(meta)

    tuner.run_study(SPEC, BUCKET, SPACE, noisy, storage=storage, sampler="grid", n_trials=1000)
    assert fake_time(true_best) > fake_time(true_best) * 0.80 * (1 + tuner.CONFIRM_MARGIN)
    assert fake_time(lucky) > fake_time(true_best)
    seen.clear()
    c = tuner.confirm(SPEC, BUCKET, storage, noisy, top=3, rounds=3)
    assert c.meta == true_best and c.time_us == fake_time(true_best) and c.confirm_rounds == 3
    # the first pass: the lucky config alone (nothing else read within 10 % of it); the
    # second: it again beside the configs that read under its median, best reading first
    later = [m for m in by_time if fake_time(m) < fake_time(lucky)][:3]
    assert seen[:3] == [lucky] * 3 and true_best in later
    assert seen[3:] == [lucky, *later, *reversed(later), lucky, lucky, *later]


def test_a_stored_confirmation_stands_while_the_trials_added_after_it_read_far_slower(
    override, storage
):
    """The second pass (or a resumed run) adds trials to a confirmed study. Where each one
    failed or read more than CONFIRM_MARGIN slower than both the confirmed time and the best
    trial, ``confirm`` would re-time none of them: the confirmation stands and the study is
    not re-timed again. A trial within the margin, or a confirmation stored without the
    number of its last trial, calls for a re-timing."""
    tuner.run_study(SPEC, BUCKET, SPACE, fake_time, storage=storage, sampler="grid", n_trials=4)
    c = tuner.confirm(SPEC, BUCKET, storage, fake_time, top=3, record=True)
    assert c.confirm_rounds == 3 and tuner.stored_confirmation(SPEC, BUCKET, storage) == c
    study = tuner.load_study(SPEC, BUCKET, storage)
    done = study.get_trials(deepcopy=False)
    best = min(t.value for t in done if t.value is not None)
    tried = [t.params for t in done]
    others = [m for m in SPACE.feasible(SPEC) if m not in tried]
    dists = done[0].distributions
    bar = (1 + tuner.CONFIRM_MARGIN) * max(c.time_us, best)

    def add(params, value=None):
        state = optuna.trial.TrialState.COMPLETE if value else optuna.trial.TrialState.FAIL
        study.add_trial(optuna.trial.create_trial(
            params=params, distributions=dists, value=value, state=state))  # fmt: skip

    add(others[0], bar * 1.01)
    add(others[1])  # failed
    kept = tuner.stored_confirmation(SPEC, BUCKET, storage)
    assert kept is not None and (kept.meta, kept.time_us) == (c.meta, c.time_us)
    assert kept.trials == c.trials + 2
    add(others[2], bar * 0.99)  # within the margin: re-timed
    assert tuner.stored_confirmation(SPEC, BUCKET, storage) is None
    # a confirmation stored before its last trial's number was: any trial added re-times
    old = tuner.storage_from(str(override / "old.journal"), override / "unused")
    tuner.run_study(SPEC, BUCKET, SPACE, fake_time, storage=old, sampler="grid", n_trials=4)
    tuner.confirm(SPEC, BUCKET, old, fake_time, top=3, record=True)
    study = tuner.load_study(SPEC, BUCKET, old)
    kept = dict(study.user_attrs["confirmed"])
    del kept["last"]
    study.set_user_attr("confirmed", kept)
    assert tuner.stored_confirmation(SPEC, BUCKET, old) is not None
    add(others[0], bar * 10)
    assert tuner.stored_confirmation(SPEC, BUCKET, old) is None


def test_confirm_drops_a_candidate_that_fails_now(override, storage):
    near = {"rows_per_program": 8, "num_warps": 2, "num_stages": 1}

    def cost(meta):  # fake_time, with one more config 2 % behind the best
        return 10.2 if meta == near else fake_time(meta)

    tuner.run_study(SPEC, BUCKET, SPACE, cost, storage=storage, sampler="grid", n_trials=1000)
    best = min(SPACE.feasible(SPEC), key=cost)
    assert best != near and cost(best) < cost(near) <= cost(best) * 1.10

    def broken_best(meta):
        if meta == best:
            raise tuner.TrialFailed("wrong result")
        return cost(meta)

    c = tuner.confirm(SPEC, BUCKET, storage, broken_best, top=3, rounds=3)
    assert c.meta == near and c.time_us == cost(near) and c.confirm_rounds == 3

    def crashing_best(meta):  # any error is a dropped candidate, as in a trial ...
        if meta == best:
            raise RuntimeError("CUDA error: out of memory")
        return cost(meta)

    c = tuner.confirm(SPEC, BUCKET, storage, crashing_best, top=3, rounds=3)
    assert c.meta == near and c.confirm_rounds == 3

    def broken_gpu(meta):  # ... but a broken GPU context stops the caller
        raise tuner.WorkerFault("illegal memory access")

    with pytest.raises(tuner.WorkerFault):
        tuner.confirm(SPEC, BUCKET, storage, broken_gpu, top=3, rounds=3)
    # top 0: the study's own result, nothing timed
    r = tuner.confirm(SPEC, BUCKET, storage, lambda m: pytest.fail("timed"), top=0)
    assert r.meta == best and r.confirm_rounds == 0
    assert tuner.confirm(SPEC, {"num_tokens": 16}, storage, fake_time) is None  # no study


def test_confirm_retimes_every_config_of_a_small_study(override, storage, monkeypatch):
    """In a small study (few feasible points) every config is re-timed, so the best config
    wins even when its own single trial was unlucky."""
    default = SPEC.default_meta(**BUCKET)

    def cost(meta):  # fake_time, with the default made slow so that it cannot win
        return fake_time(meta) + (50.0 if meta == default else 0.0)

    true_best = min(SPACE.feasible(SPEC), key=cost)
    calls = []

    def unlucky(meta):  # the best config reads 100 us slower the first time only
        calls.append(dict(meta))
        slow = meta == true_best and calls.count(true_best) == 1
        return cost(meta) + (100.0 if slow else 0.0)

    r = tuner.run_study(
        SPEC, BUCKET, SPACE, unlucky, storage=storage, sampler="grid", n_trials=1000
    )
    assert r.meta != true_best
    distinct = len({json.dumps(m, sort_keys=True) for m in calls})
    assert distinct > tuner.CONFIRM_ALL  # so by default only the best 3 (and the default) ...
    calls.clear()
    c = tuner.confirm(SPEC, BUCKET, storage, unlucky, top=3, rounds=3)
    # ... within 10 % of the best trial, of which there are none here, and the configs that
    # read under its re-timed median, of which there are none either (the best's reading was
    # slow): the unlucky best is missed
    assert c.meta != true_best and c.confirm_rounds == 3 and calls == [c.meta] * 3
    monkeypatch.setattr(tuner, "CONFIRM_ALL", distinct)  # a study this small: all re-timed
    calls.clear()
    c = tuner.confirm(SPEC, BUCKET, storage, unlucky, top=3, rounds=3)
    assert c.meta == true_best and c.time_us == cost(true_best)
    assert len(calls) == 3 * distinct


def test_a_nearest_bucket_s_entry_serves_a_call_unless_it_breaks_a_call_constraint(
    override, monkeypatch
):
    """An entry tuned at 65536 tokens serves a call of 1 token although it breaks a bucket
    constraint there (those say what is worth timing at a bucket); one that breaks a call
    constraint at the call's sizes (what the kernel needs to run) gives the defaults."""
    import dataclasses

    import kvgen.configs as cfg

    _config(override, buckets=(65536,))
    configs.reset()
    assert SPACE.violations(SPEC, {"rows_per_program": 8, "num_warps": 2, "num_stages": 1},
                            {"num_tokens": 1})  # fmt: skip
    assert configs.meta_params(SPEC, num_tokens=1)["rows_per_program"] == 8
    strict = dataclasses.replace(SPACE, call_constraints={"fits": "rows_per_program <= num_tokens"})
    monkeypatch.setattr(cfg, "load_space", lambda template: strict)
    configs.reset()
    assert configs.meta_params(SPEC, num_tokens=1) == SPEC.default_meta(num_tokens=1)
    assert configs.meta_params(SPEC, num_tokens=65536)["rows_per_program"] == 8


def test_the_compile_pool_takes_half_the_cpus_by_default(monkeypatch):
    """``--jobs`` 0 (the default) is half the CPUs this process may use: 8 of a 16-CPU GPU
    host (7 compile processes beside its worker), and 1 (no pool) on a 2-CPU machine."""
    from kvgen.tune import run

    for cpus, jobs in ((16, 8), (15, 7), (2, 1), (1, 1)):
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid, n=cpus: set(range(n)))
        assert run.default_compile_jobs() == jobs
