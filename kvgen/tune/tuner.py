"""The tuner: one Optuna study per (variant, shape bucket).

A trial picks meta-parameters from the template's search space; the static constraints are
checked before anything compiles; then ``evaluate(meta)`` compiles and runs the candidate,
checks it against the reference and times it. A constraint violation, a compile error or a
wrong result fails the trial, and a failed trial can never be the best. The template's default
config is enqueued as the first trial of every study, and the config the tuned JSON holds for
the bucket (the incumbent, if any) as the second, so that a re-tune after a kernel change
measures the old winner again instead of hoping the sampler finds it. Studies live in Optuna
storage (by default a journal file on disk), so an interrupted run resumes where it stopped.

A trial is timed once, so a config that happened to be timed in a faster moment can win by
noise (on the H200, microsecond kernels read up to ~10 % faster for a while after heavy
work). ``confirm`` re-times the best few configs and the
default in alternated rounds and keeps the lowest median; ``kvgen tune`` does this for every
study before it writes the JSON.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import logging
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import optuna

from kvgen import configs
from kvgen.space import Space, bucket_key

Evaluate = Callable[[dict[str, Any]], float]  # meta -> time in us; raises TrialFailed


class TrialFailed(Exception):
    """A candidate that must never win: it broke a constraint, did not compile, or was wrong."""


@dataclasses.dataclass
class StudyResult:
    variant: str
    bucket: str
    meta: dict[str, Any] | None  # None when no trial succeeded
    time_us: float | None
    default_time_us: float | None
    trials: int
    failed: int  # compile errors, wrong results, crashes (not the skipped points)
    skipped: int = 0  # points that break a constraint: failed at once, never compiled or timed
    confirm_rounds: int = 0  # >0: time_us / default_time_us are medians of this many re-timings


# Heartbeats let the workers of several hosts sharing a database fail the running trial of a
# worker that died: a trial whose heartbeat is older than the grace period is failed by the
# next worker that starts a trial of that study (Optuna's RDBStorage does this). The grace
# period must exceed the longest trial; both can be set from the environment.
HEARTBEAT_S = int(os.environ.get("KVGEN_TUNE_HEARTBEAT_S", "30"))
GRACE_S = int(os.environ.get("KVGEN_TUNE_GRACE_S", "120"))


def storage_from(url: str | None, default_path: Path):
    """An Optuna storage: a database URL (sqlite:///..., postgresql://...), a journal file path,
    or the default journal file (embedded, on disk, safe for several processes of one host)."""
    if url and "://" in url:
        import warnings

        from optuna.storages import RDBStorage

        with warnings.catch_warnings():  # heartbeats are "experimental" since Optuna 2.9
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            return RDBStorage(url, heartbeat_interval=HEARTBEAT_S, grace_period=GRACE_S)
    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend

    path = Path(url) if url else default_path
    path.parent.mkdir(parents=True, exist_ok=True)
    return JournalStorage(JournalFileBackend(str(path)))


def shared_by_hosts(storage) -> bool:
    """A database storage may have workers on other hosts; a journal file has this host's only."""
    from optuna.storages import RDBStorage

    return isinstance(storage, RDBStorage)


# TPE's random start-up trials (FreshPointSampler draws its own for as many).
_TPE_STARTUP = 8


def make_sampler(
    kind: str, space: Space, spec, seed: int = 0, bucket: dict[str, int] | None = None
):
    """The sampler of ``spec``'s study at ``bucket``. ``tpe`` proposes only points that break no
    constraint (static, or of the bucket) and that the study has not tried yet (see
    ``FreshPointSampler``)."""
    if kind == "grid":
        # Optuna's grid sampler gives trial number k the k-th point of a seeded shuffle of the
        # grid: workers sharing a study visit every point once, whatever their interleaving.
        return optuna.samplers.GridSampler({k: list(v) for k, v in space.params.items()}, seed=seed)
    if kind == "tpe":
        # The constant liar makes parallel workers avoid the points others are running; with
        # one worker there is never a running trial to lie about, so it changes nothing.
        tpe = optuna.samplers.TPESampler(
            multivariate=True, seed=seed, constant_liar=True, n_startup_trials=_TPE_STARTUP
        )
        return FreshPointSampler(tpe, space, space.feasible(spec, bucket), seed)
    if kind == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    raise ValueError(f"unknown sampler {kind!r}; expected tpe, grid or random")


class FreshPointSampler(optuna.samplers.BaseSampler):
    """TPE restricted to new, feasible points of a finite space.

    Over a small categorical space TPE often proposes a point the study has already timed, or
    one that breaks a static constraint (a failed trial): both spend a trial of the budget on
    nothing. This sampler draws TPE's joint proposal up to ``tries`` times and takes the first
    one that is feasible and untried; failing that (and during TPE's random start-up), a
    uniformly chosen untried feasible point. Once every feasible point was tried it defers to
    TPE. The random choices are seeded by the trial number, so workers sharing a study agree.
    """

    def __init__(
        self,
        base,
        space: Space,
        feasible: list[dict[str, Any]],
        seed: int = 0,
        tries: int = 32,
        n_startup_trials: int = _TPE_STARTUP,
    ):
        self._base = base
        self._space = {
            k: optuna.distributions.CategoricalDistribution(list(v))
            for k, v in space.params.items()
        }
        self._feasible = feasible
        self._seed = seed
        self._tries = tries
        self._n_startup = n_startup_trials

    @staticmethod
    def _key(params: dict[str, Any]) -> str:
        return json.dumps(params, sort_keys=True)

    def infer_relative_search_space(self, study, trial):
        return dict(self._space)

    def sample_relative(self, study, trial, search_space):
        if not search_space:
            return {}
        tried = set()
        for t in study.get_trials(deepcopy=False):
            if t.number == trial.number:
                continue
            p = t.params or t.system_attrs.get("fixed_params") or {}
            if p:
                tried.add(self._key(p))
        fresh = [p for p in self._feasible if self._key(p) not in tried]
        if not fresh:
            return self._base.sample_relative(study, trial, search_space)
        complete = study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))
        if len(complete) >= self._n_startup:
            fresh_keys = {self._key(f) for f in fresh}
            for _ in range(self._tries):
                p = self._base.sample_relative(study, trial, search_space)
                if p and self._key(p) in fresh_keys:
                    return p
        import random

        return dict(random.Random(self._seed * 1_000_003 + trial.number).choice(fresh))

    def sample_independent(self, study, trial, param_name, param_distribution):
        return self._base.sample_independent(study, trial, param_name, param_distribution)

    def before_trial(self, study, trial):
        self._base.before_trial(study, trial)

    def after_trial(self, study, trial, state, values):
        self._base.after_trial(study, trial, state, values)

    def reseed_rng(self) -> None:
        self._base.reseed_rng()


def fail_running(study: optuna.Study, reason: str, worker: str | None = None) -> int:
    """Fail the RUNNING trials of ``study`` (only those of ``worker`` when given): trials whose
    process died. Returns how many were failed."""
    n = 0
    for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,)):
        if worker is not None and t.user_attrs.get("worker") != worker:
            continue
        try:
            study.tell(t.number, state=optuna.trial.TrialState.FAIL)
        except (ValueError, optuna.exceptions.UpdateFinishedTrialError):
            continue  # it finished (or another process failed it) meanwhile
        study.set_user_attr(f"{_FAILURE}:{t.number}", reason)
        n += 1
    return n


_FAILURE = "failure"


def failure(study: optuna.Study, trial) -> str:
    """Why a failed trial failed: set on the trial by the process that ran it, or on the study
    by the one that failed it for a dead process."""
    return trial.user_attrs.get(_FAILURE) or study.user_attrs.get(f"{_FAILURE}:{trial.number}", "")


# Trials that count as run (a RUNNING one left by a dead process is failed before they count).
_FINISHED = (
    optuna.trial.TrialState.COMPLETE,
    optuna.trial.TrialState.FAIL,
    optuna.trial.TrialState.PRUNED,
)
# A trial created after the study's budget was taken by other workers (see ``work_on_study``).
_SURPLUS = "surplus"
# A trial whose point breaks a constraint: failed at once, never compiled or timed.
_SKIPPED = "skipped"


def study_name(spec, bucket: dict[str, int]) -> str:
    return f"{spec.name}@{bucket_key(bucket)}"


def budget(
    space: Space, sampler: str, n_trials: int, spec=None, bucket: dict[str, int] | None = None
) -> int:
    """Trials a study runs in all: ``n_trials``, or the whole grid if that is smaller; for TPE
    at most the points worth timing at the bucket (``spec`` and ``bucket`` given), as it never
    repeats one."""
    if sampler == "grid":
        return min(n_trials, len(space.points()))
    if sampler == "tpe" and spec is not None and bucket is not None:
        return min(n_trials, max(1, len(space.feasible(spec, bucket))))
    return n_trials


def budget_taken(study: optuna.Study, limit: int) -> bool:
    """The budget handed out: ``limit`` trials that count (run, running or waiting; surplus
    trials, from this run or an earlier one with a smaller budget, do not)."""
    return len(counted(study.get_trials(deepcopy=False))) >= limit


def _beyond_budget(study: optuna.Study, number: int, limit: int) -> bool:
    """Trial ``number`` comes after the budget: ``limit`` trials that count were handed out
    before it. A trial below it not yet marked surplus counts, which errs towards surplus only
    where that trial is itself past the budget (then so is this one)."""
    before = [t for t in study.get_trials(deepcopy=False) if t.number < number]
    return len(counted(before)) >= limit


def load_study(spec, bucket: dict[str, int], storage) -> optuna.Study | None:
    """The stored study of ``spec`` at ``bucket`` (None: no such study yet)."""
    try:
        return optuna.load_study(study_name=study_name(spec, bucket), storage=storage)
    except KeyError:
        return None


def open_study(
    spec,
    bucket,
    space: Space,
    *,
    storage,
    sampler: str = "tpe",
    seed: int = 0,
    n_trials: int = 40,
    prepare: bool = True,
) -> optuna.Study:
    """Create or load the study of ``spec`` at ``bucket``. ``prepare`` (the process that starts a
    run, before any worker) fails trials left RUNNING by a dead process (journal files only: in
    a database another host's live worker may own them; heartbeats cover that case) and
    enqueues the template's default as the first trial."""
    # kvgen reports trials itself (failures are counted in the result and kept in storage).
    optuna.logging.set_verbosity(logging.ERROR)
    study = optuna.create_study(
        study_name=study_name(spec, bucket),
        storage=storage,
        direction="minimize",
        sampler=make_sampler(sampler, space, spec, seed, bucket),
        load_if_exists=True,
    )
    if not prepare:
        return study
    if not shared_by_hosts(storage):
        fail_running(study, "interrupted: its process died")
    done = study.get_trials(deepcopy=False)
    # The default is the first trial and the incumbent the second (a grid visits both anyway,
    # in its own order); not again on a resume, and not past the budget.
    if sampler == "grid":
        return study
    queued = 0
    for meta, first in ((spec.default_meta(**bucket), True), (incumbent(spec, bucket), False)):
        if (
            meta is not None
            and space.allows(meta)
            and (first or not space.violations(spec, meta, bucket))
            and len(counted(done)) + queued < budget(space, sampler, n_trials, spec, bucket)
            and not any(
                t.params == meta or t.system_attrs.get("fixed_params") == meta for t in done
            )
        ):
            study.enqueue_trial(meta, skip_if_exists=True)
            queued += 1
    return study


def incumbent(spec, bucket: dict[str, int]) -> dict[str, Any] | None:
    """The meta-parameters the tuned JSON (the one the wrappers load) holds for exactly this
    variant and bucket, or None."""
    entries = configs.table(spec.arch, spec.family, os.environ.get(configs.OVERRIDE_ENV))
    entry = entries.get(spec.name, {}).get(bucket_key(bucket))
    return dict(entry["meta"]) if entry else None


class WorkerFault(Exception):
    """The worker cannot go on (its GPU context is broken): the trial fails, the worker exits."""


def work_on_study(
    study: optuna.Study,
    spec,
    bucket: dict[str, int],
    space: Space,
    evaluate: Evaluate,
    *,
    n_trials: int,
    sampler: str = "tpe",
    deadline: float | None = None,
    worker: str | None = None,
    on_trial: Callable[[optuna.Study], None] | None = None,
) -> None:
    """Run trials of ``study`` until it holds its budget of trials; any number of processes
    (on any number of hosts, through one storage) may do this on the same study at once.

    The storage hands out trial numbers atomically; the first ``budget`` numbers that are not
    surplus are the study's trials, each run by exactly one worker. A worker that asks for a
    trial when the others have taken the budget gets a surplus trial, which it fails at once
    without running it and which no count includes (a later run with a larger budget skips
    it too).
    """
    limit = budget(space, sampler, n_trials, spec, bucket)

    def objective(trial: optuna.Trial) -> float:
        if worker is not None:
            trial.set_user_attr("worker", worker)
        if _beyond_budget(study, trial.number, limit) or _duplicate_default(study, trial):
            trial.set_user_attr(_SURPLUS, True)
            raise TrialFailed("surplus: the study's budget was already taken")
        meta = {k: trial.suggest_categorical(k, list(v)) for k, v in space.params.items()}
        broken = space.violations(spec, meta, bucket)
        if broken:
            trial.set_user_attr(_SKIPPED, True)
            trial.set_user_attr("failure", f"constraints: {', '.join(broken)}")
            raise TrialFailed(f"violates {broken}")
        try:
            t_us = evaluate(meta)
        except TrialFailed as exc:
            trial.set_user_attr("failure", str(exc))
            raise
        except WorkerFault as exc:
            trial.set_user_attr("failure", f"worker fault: {exc}"[:500])
            raise
        except Exception as exc:  # a compile error or a crash is a failed trial
            trial.set_user_attr("failure", f"{type(exc).__name__}: {exc}"[:500])
            raise TrialFailed(str(exc)) from exc
        trial.set_user_attr("meta", meta)
        return t_us

    def after(s: optuna.Study, t) -> None:
        if on_trial is not None:
            on_trial(s)
        if budget_taken(s, limit):
            s.stop()

    if budget_taken(study, limit) or (deadline is not None and time.monotonic() >= deadline):
        return
    timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
    study.optimize(objective, timeout=timeout, catch=(TrialFailed,), callbacks=[after])


def _duplicate_default(study: optuna.Study, trial: optuna.Trial) -> bool:
    """Two hosts that start a run at once may both enqueue the default: run it once."""
    trials = study.get_trials(deepcopy=False)
    fixed = next(
        (t.system_attrs.get("fixed_params") for t in trials if t.number == trial.number), None
    )
    if fixed is None:
        return False
    return any(
        t.number < trial.number and t.system_attrs.get("fixed_params") == fixed for t in trials
    )


def run_study(
    spec,
    bucket: dict[str, int],
    space: Space,
    evaluate: Evaluate,
    *,
    storage,
    sampler: str = "tpe",
    n_trials: int = 40,
    deadline: float | None = None,
    seed: int = 0,
    on_trial: Callable[[StudyResult], None] | None = None,
) -> StudyResult:
    """Run (or resume) the study of ``spec`` at ``bucket`` in this process until it has
    ``n_trials`` trials (the whole grid at most, for ``sampler="grid"``)."""
    study = open_study(
        spec, bucket, space, storage=storage, sampler=sampler, seed=seed, n_trials=n_trials
    )
    default = spec.default_meta(**bucket)
    hook = None
    if on_trial is not None:
        hook = lambda s: on_trial(summarize(spec, bucket, s, default))  # noqa: E731
    work_on_study(
        study,
        spec,
        bucket,
        space,
        evaluate,
        n_trials=n_trials,
        sampler=sampler,
        deadline=deadline,
        on_trial=hook,
    )
    return summarize(spec, bucket, study, default)


def counted(trials) -> list:
    """The trials that count (surplus ones, never run, do not)."""
    return [t for t in trials if not t.user_attrs.get(_SURPLUS)]


def finished_trials(spec, bucket: dict[str, int], storage) -> int:
    """Trials the stored study of ``spec`` at ``bucket`` has finished (0: no study yet)."""
    study = load_study(spec, bucket, storage)
    if study is None:
        return 0
    return len(counted(study.get_trials(deepcopy=False, states=_FINISHED)))


def load_result(spec, bucket: dict[str, int], storage) -> StudyResult | None:
    """The stored study's result (None: no such study)."""
    study = load_study(spec, bucket, storage)
    return None if study is None else summarize(spec, bucket, study, spec.default_meta(**bucket))


def summarize(spec, bucket, study: optuna.Study, default: dict) -> StudyResult:
    trials = counted(study.get_trials(deepcopy=False))
    complete = [t for t in trials if t.state == optuna.trial.TrialState.COMPLETE]
    fails = [t for t in trials if t.state == optuna.trial.TrialState.FAIL]
    skipped = sum(bool(t.user_attrs.get(_SKIPPED)) for t in fails)
    best = min(complete, key=lambda t: t.value, default=None)
    default_t = next((t.value for t in complete if t.params == default), None)
    return StudyResult(
        spec.name,
        bucket_key(bucket),
        dict(best.params) if best else None,
        best.value if best else None,
        default_t,
        len(trials),
        len(fails) - skipped,
        skipped,
    )


CONFIRM_ALL = 8  # studies of this many distinct configs or fewer: re-time every one


def confirm(
    spec,
    bucket: dict[str, int],
    storage,
    evaluate: Evaluate,
    *,
    top: int = 3,
    rounds: int = 3,
) -> StudyResult | None:
    """Re-time the study's ``top`` best distinct configs and the default, ``rounds`` times each
    in alternated order (forward, backward, ...), and return the result with the lowest median.
    A study of at most ``CONFIRM_ALL`` distinct configs (a small bucket's few feasible points)
    has all of them re-timed: one unlucky trial must not hide the best config either.

    The study's trial values are left as they are. A candidate that fails now (a wrong result,
    a crash) is dropped. None when there is no study; the study's own result when it has no
    successful trial or ``top`` is 0.
    """
    study = load_study(spec, bucket, storage)
    if study is None:
        return None
    default = spec.default_meta(**bucket)
    result = summarize(spec, bucket, study, default)
    if result.meta is None or top <= 0 or rounds <= 0:
        return result
    complete = study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))
    candidates: list[dict[str, Any]] = []
    for t in sorted(complete, key=lambda t: t.value):
        if t.params not in candidates:
            candidates.append(dict(t.params))
    if len(candidates) > max(top, CONFIRM_ALL):
        candidates = candidates[:top]
    if default not in candidates and any(t.params == default for t in complete):
        candidates.append(dict(default))
    times: dict[int, list[float]] = {i: [] for i in range(len(candidates))}
    for r in range(rounds):
        order = range(len(candidates)) if r % 2 == 0 else reversed(range(len(candidates)))
        for i in order:
            if i in times:
                try:
                    times[i].append(evaluate(candidates[i]))
                except TrialFailed:
                    del times[i]
    medians = {i: statistics.median(ts) for i, ts in times.items()}
    if not medians:
        return result
    best = min(medians, key=lambda i: (medians[i], i))  # ties: the study's order
    default_i = next((i for i in medians if candidates[i] == default), None)
    return dataclasses.replace(
        result,
        meta=candidates[best],
        time_us=medians[best],
        default_time_us=medians[default_i] if default_i is not None else result.default_time_us,
        confirm_rounds=rounds,
    )


def write_results(
    out_dir: Path,
    arch: str,
    family: str,
    results: list[StudyResult],
    env: dict,
    sampler: str,
    n_trials: int,
) -> Path:
    """Merge ``results`` into ``out_dir/<arch>/<family>.json`` (atomic, keys sorted)."""
    path = out_dir / arch / f"{family}.json"
    entries: dict[str, dict] = {}
    if path.exists():
        try:
            old = json.loads(path.read_text())
            if not configs.validate(old, arch, family):
                entries = old["entries"]
        except ValueError:
            pass
    for r in results:
        if r.meta is None:
            continue
        entry = {
            "meta": r.meta,
            "time_us": round(r.time_us, 4),
            "trials": r.trials,
            "failed_trials": r.failed,
        }
        entry["default_time_us"] = round(r.default_time_us or r.time_us, 4)
        if r.confirm_rounds:
            entry["confirm_rounds"] = r.confirm_rounds
        entries.setdefault(r.variant, {})[r.bucket] = entry
    doc = {
        "schema_version": configs.SCHEMA_VERSION,
        "family": family,
        "env": {**env, "arch": arch},
        "provenance": {
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "sampler": sampler,
            "trials": n_trials,
        },
        "entries": entries,
    }
    configs.write(path, doc)
    return path
