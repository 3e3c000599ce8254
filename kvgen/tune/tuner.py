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
from kvgen.tune import SAMPLERS

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
    stopped_early: bool = False  # ended by its StopRule before its budget
    wall_s: float | None = None  # what the study cost its workers (record_wall_time), if known
    # the configs confirm() re-timed: (meta, median of its re-timings in us, its trial's
    # reading in us or None), fastest median first
    retimed: tuple[tuple[dict[str, Any], float, float | None], ...] = ()


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
    """The sampler of ``spec``'s study at ``bucket``. ``local`` (best-first local search, see
    ``NeighbourhoodSampler``) and ``tpe`` propose only points that break no constraint
    (static, or of the bucket) and that the study has not tried yet (see
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
    if kind == "local":
        return NeighbourhoodSampler(space, space.feasible(spec, bucket), seed)
    if kind == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    raise ValueError(f"unknown sampler {kind!r}; expected {', '.join(SAMPLERS)}")


class NeighbourhoodSampler(optuna.samplers.BaseSampler):
    """Best-first local search over a finite space whose parameters' values are ordered.

    A point's neighbours differ from it in one parameter, by one step along that parameter's
    values (warps 4 -> 2 or 8); where such a step is infeasible or failed, the points one more
    step away along another parameter stand in for it (``repairs``). Each trial takes an
    untried neighbour of the best timed point (a stand-in once the neighbours are all tried);
    once all of those were tried, of the second best, and so on; a random untried feasible
    point where no timed point has any (the start when the enqueued ones all failed). The
    study's first trials (the default, the tuned JSON's config, the neighbouring buckets'
    best: see ``open_study`` and ``warm_start``) are where it starts.

    Kernel timings over such spaces are mostly unimodal along each parameter, with a few
    local optima that a best-first walk leaves by the stand-in steps and by expanding the
    next best points:
    ``benchmarks/compare_samplers.py`` compares it with TPE on grids timed on the H200. The
    choice among a point's untried neighbours goes by the trial number, so workers sampling
    at once take different ones; the points other workers are running count as tried, and a
    point two workers took at once runs in the lower-numbered trial only (the other is
    surplus), unless both sampled before either stored it.
    """

    def __init__(self, space: Space, feasible: list[dict[str, Any]], seed: int = 0):
        self._values = {k: list(v) for k, v in space.params.items()}
        self._dists = {
            k: optuna.distributions.CategoricalDistribution(list(v))
            for k, v in space.params.items()
        }
        self._feasible = {_point_key(p): p for p in feasible}
        self._seed = seed

    def _steps(self, point: dict[str, Any], skip: str | None = None) -> list[dict[str, Any]]:
        """Every point (feasible or not) one step from ``point`` along one parameter."""
        out = []
        for k, values in self._values.items():
            if k == skip:
                continue
            i = values.index(point[k])
            for j in (i - 1, i + 1):
                if 0 <= j < len(values):
                    out.append({**point, k: values[j]})
        return out

    def neighbours(self, point: dict[str, Any]) -> list[dict[str, Any]]:
        """The feasible points one step from ``point`` along one parameter."""
        return [q for q in self._steps(point) if _point_key(q) in self._feasible]

    def repairs(self, point: dict[str, Any], dead: set[str]) -> list[dict[str, Any]]:
        """For each step from ``point`` that is infeasible or in ``dead`` (failed), the feasible
        points one more step away along another parameter (64 rows a program may need 8 warps
        where 4 can go no further)."""
        out = []
        for q in self._steps(point):
            if _point_key(q) in self._feasible and _point_key(q) not in dead:
                continue
            moved = next(k for k in self._values if q[k] != point[k])
            out += [r for r in self._steps(q, skip=moved) if _point_key(r) in self._feasible]
        return out

    def infer_relative_search_space(self, study, trial):
        return dict(self._dists)

    def sample_relative(self, study, trial, search_space):
        if not search_space:
            return {}
        import random

        rng = random.Random(self._seed * 1_000_003 + trial.number)
        trials = [t for t in study.get_trials(deepcopy=False) if t.number != trial.number]
        tried = _tried(trials, trial.number)
        fresh = [p for k, p in self._feasible.items() if k not in tried]
        if not fresh:
            return {}  # every feasible point tried: the study's budget ends it
        timed = sorted(
            (t for t in trials if t.state == optuna.trial.TrialState.COMPLETE and t.params),
            key=lambda t: (t.value, t.number),
        )
        dead = {  # (a surplus trial's point was not run in it: not failed)
            _point_key(t.params)
            for t in trials
            if t.state == optuna.trial.TrialState.FAIL
            and t.params
            and not t.user_attrs.get(_SURPLUS)
        }
        for t in timed:
            if set(t.params) != set(self._values):
                continue
            for moves in (self.neighbours(t.params), self.repairs(t.params, dead)):
                untried = sorted({_point_key(q) for q in moves} - tried)
                if untried:
                    # Workers that sample at once see the same trials; consecutive trial
                    # numbers then take different points.
                    return json.loads(untried[(trial.number + self._seed) % len(untried)])
        return dict(rng.choice(fresh))

    def sample_independent(self, study, trial, param_name, param_distribution):
        import random

        rng = random.Random(self._seed * 1_000_003 + trial.number)
        return rng.choice(list(param_distribution.choices))


def _point_key(params: dict[str, Any]) -> str:
    return json.dumps(params, sort_keys=True)


def _tried(trials, number: int) -> set[str]:
    """The points (``_point_key``) the trials other than ``number`` hold: run, running, or
    enqueued and waiting."""
    out = set()
    for t in trials:
        p = t.params or t.system_attrs.get("fixed_params")
        if t.number != number and p:
            out.add(_point_key(p))
    return out


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

    def infer_relative_search_space(self, study, trial):
        return dict(self._space)

    def sample_relative(self, study, trial, search_space):
        if not search_space:
            return {}
        tried = _tried(study.get_trials(deepcopy=False), trial.number)
        fresh = [p for p in self._feasible if _point_key(p) not in tried]
        if not fresh:
            return self._base.sample_relative(study, trial, search_space)
        complete = study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))
        if len(complete) >= self._n_startup:
            fresh_keys = {_point_key(f) for f in fresh}
            for _ in range(self._tries):
                p = self._base.sample_relative(study, trial, search_space)
                if p and _point_key(p) in fresh_keys:
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
# A trial lost to its environment (``TrialLost``): surplus, with the reason; the trial that
# runs its point again holds the lost one's number under _RETRY.
_LOST = "lost"
_RETRY = "retry_of"


def study_name(spec, bucket: dict[str, int]) -> str:
    return f"{spec.name}@{bucket_key(bucket)}"


def budget(
    space: Space, sampler: str, n_trials: int, spec=None, bucket: dict[str, int] | None = None
) -> int:
    """Trials a study runs in all: ``n_trials``, or the whole grid if that is smaller; for TPE
    and the local search at most the points worth timing at the bucket (``spec`` and
    ``bucket`` given), as they never repeat one."""
    if sampler == "grid":
        return min(n_trials, len(space.points()))
    if sampler in ("tpe", "local") and spec is not None and bucket is not None:
        return min(n_trials, max(1, len(space.feasible(spec, bucket))))
    return n_trials


@dataclasses.dataclass(frozen=True)
class StopRule:
    """When a study ends before its budget: once ``patience`` finished trials in a row (in
    trial-number order) have each failed to beat the best time before them by ``min_gain``
    (relative). A failed trial is a trial without a gain; points skipped by a constraint (never
    compiled or timed) do not count. ``patience`` 0: never (the whole budget runs).

    With ``local`` (the local search's rule) a study also goes on while a feasible neighbour of
    its best config (by trial reading; ``NeighbourhoodSampler.neighbours``) is untried, which
    is what the search tries next: it ends at a local optimum. A best config found late, by a
    gain under ``min_gain``, otherwise ended its study with its own neighbours untried. Such a
    rule is bound to a study with ``for_study`` (its feasible points) before ``met`` is asked.

    The rule reads only the stored trials, so every worker of a shared study, and a resumed
    run, reach the same decision.
    """

    patience: int = 0
    min_gain: float = 0.01
    local: bool = False
    # (``for_study``: the study the rule is bound to, and its feasible neighbours function)
    study: tuple[str, str] | None = dataclasses.field(default=None, compare=False, repr=False)
    neighbours: Callable[[dict[str, Any]], list[dict[str, Any]]] | None = dataclasses.field(
        default=None, compare=False, repr=False
    )

    def for_study(self, spec, bucket: dict[str, int], space: Space | None = None) -> StopRule:
        """This rule for the study of ``spec`` at ``bucket`` (itself unless ``local``)."""
        if not self.local or self.patience <= 0:
            return self
        key = (spec.name, bucket_key(bucket))
        if self.study == key:
            return self
        if space is None:
            from kvgen.space import load_space

            space = load_space(spec.template)
        search = NeighbourhoodSampler(space, space.feasible(spec, bucket))
        return dataclasses.replace(self, study=key, neighbours=search.neighbours)

    def met(self, trials) -> bool:
        if self.patience <= 0:
            return False
        waiting = optuna.trial.TrialState.WAITING
        if any(t.state == waiting for t in counted(trials)):
            return False  # a queued point (a start point, a neighbour's best) always runs
        done = sorted(
            (t for t in finished(trials) if not t.user_attrs.get(_SKIPPED)),
            key=lambda t: t.number,
        )
        best, since = float("inf"), 0
        for t in done:
            value = t.value if t.state == optuna.trial.TrialState.COMPLETE else None
            if value is not None and value < best * (1.0 - self.min_gain):
                since = 0
            else:
                since += 1
            if value is not None:
                best = min(best, value)
        if since < self.patience or not self.local:
            return since >= self.patience
        if self.neighbours is None:
            raise RuntimeError("a local StopRule asked before for_study bound it to a study")
        timed = [t for t in done if t.state == optuna.trial.TrialState.COMPLETE and t.params]
        if not timed:
            return True
        top = min(timed, key=lambda t: (t.value, t.number))
        tried = _tried(trials, -1)
        return all(_point_key(q) in tried for q in self.neighbours(dict(top.params)))


NO_STOP = StopRule()


def budget_taken(study: optuna.Study, limit: int, stop: StopRule = NO_STOP) -> bool:
    """The budget handed out: ``limit`` trials that count (run, running or waiting; surplus
    trials, from this run or an earlier one with a smaller budget, do not), or the study ended
    by ``stop``."""
    trials = study.get_trials(deepcopy=False)
    return len(counted(trials)) >= limit or stop.met(trials)


def _beyond_budget(study: optuna.Study, number: int, limit: int, stop: StopRule) -> bool:
    """Trial ``number`` comes after the budget: ``limit`` trials that count were handed out
    before it, or the trials before it ended the study by ``stop``. A trial below it not yet
    marked surplus counts, which errs towards surplus only where that trial is itself past the
    budget (then so is this one)."""
    trials = study.get_trials(deepcopy=False)
    before = [t for t in trials if t.number < number]
    if len(counted(before)) >= limit:
        return True
    queued = any(t.number == number and t.system_attrs.get("fixed_params") for t in trials)
    return not queued and stop.met(before)  # (a queued point always runs, ``StopRule.met``)


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


class TrialLost(WorkerFault):
    """The trial could not run for a reason that may not be its config's: its GPU's memory was
    taken (by the compile pool's processes or another job) through every wait. The trial
    counts as none (surplus) and its point is queued again as the study's next trial, which
    the worker runs next. A point lost a second time (its retry) is a failed trial: what it
    asks for is more than the GPU has."""


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
    stop: StopRule = NO_STOP,
) -> None:
    """Run trials of ``study`` until it holds its budget of trials (or ``stop`` ends it); any
    number of processes (on any number of hosts, through one storage) may do this on the same
    study at once.

    The storage hands out trial numbers atomically; the first ``budget`` numbers that are not
    surplus are the study's trials, each run by exactly one worker. A worker that asks for a
    trial when the others have taken the budget gets a surplus trial, which it fails at once
    without running it and which no count includes (a later run with a larger budget skips
    it too).
    """
    limit = budget(space, sampler, n_trials, spec, bucket)
    stop = stop.for_study(spec, bucket, space)

    def objective(trial: optuna.Trial) -> float:
        if worker is not None:
            trial.set_user_attr("worker", worker)
        if _beyond_budget(study, trial.number, limit, stop):
            trial.set_user_attr(_SURPLUS, True)
            raise TrialFailed("surplus: the study's budget was already taken")
        meta = {k: trial.suggest_categorical(k, list(v)) for k, v in space.params.items()}
        if _taken_point(study, trial.number, meta):
            trial.set_user_attr(_SURPLUS, True)
            raise TrialFailed("surplus: a worker sharing the study took the same point first")
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
        except TrialLost as exc:
            if _RETRY in trial.user_attrs:  # lost before, and again: the config's own need
                why = f"{exc} (a second time)"[:500]
                trial.set_user_attr("failure", why)
                raise TrialFailed(why) from exc
            trial.set_user_attr(_SURPLUS, True)
            trial.set_user_attr(_LOST, str(exc)[:500])
            study.enqueue_trial(meta, user_attrs={_RETRY: trial.number})
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
        if budget_taken(s, limit, stop):
            s.stop()

    if budget_taken(study, limit, stop) or (deadline is not None and time.monotonic() >= deadline):
        return
    timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
    study.optimize(objective, timeout=timeout, catch=(TrialFailed,), callbacks=[after])


def _taken_point(study: optuna.Study, number: int, meta: dict[str, Any]) -> bool:
    """A trial numbered below ``number`` (not surplus) has the point ``meta``: two workers
    sharing a study sampled it at once, or two hosts that started a run at once both enqueued
    the default; the lower number runs it."""
    return any(
        t.number < number
        and (t.params or t.system_attrs.get("fixed_params")) == meta
        and not t.user_attrs.get(_SURPLUS)
        for t in study.get_trials(deepcopy=False)
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
    stop: StopRule = NO_STOP,
    neighbours: list[dict[str, int]] = (),
    siblings=(),
) -> StudyResult:
    """Run (or resume) the study of ``spec`` at ``bucket`` in this process until it has
    ``n_trials`` trials (the whole grid at most, for ``sampler="grid"``) or ``stop`` ends it;
    a fresh study first runs the best configs of the ``neighbours`` buckets' studies and of
    the ``siblings`` variants' studies at ``bucket`` (see ``warm_start``)."""
    study = open_study(
        spec, bucket, space, storage=storage, sampler=sampler, seed=seed, n_trials=n_trials
    )
    default = spec.default_meta(**bucket)
    stop = stop.for_study(spec, bucket, space)
    if sampler != "grid":
        warm_start(study, spec, bucket, space, storage, neighbours,
                   budget(space, sampler, n_trials, spec, bucket), siblings=siblings)  # fmt: skip
    hook = None
    if on_trial is not None:
        hook = lambda s: on_trial(summarize(spec, bucket, s, default, stop))  # noqa: E731
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
        stop=stop,
    )
    return summarize(spec, bucket, study, default, stop)


# Configs a study takes from its nearest tuned buckets, and as many more from its sibling
# variants at its bucket (at its start, and again in the second pass)
WARM_START = 2


def nearest_feasible(
    meta: dict[str, Any], space: Space, spec, bucket: dict[str, int]
) -> dict[str, Any] | None:
    """``meta`` itself where it breaks none of ``bucket``'s constraints, else the feasible point
    of ``bucket`` that differs from it in the fewest parameters, then by the fewest steps along
    them (another bucket's best with a head tile too tall for this one's rows takes the
    tallest that fits and keeps the rest); None where ``meta`` is not of ``space``."""
    if not space.allows(meta):
        return None
    if not space.violations(spec, meta, bucket):
        return dict(meta)
    index = {k: {v: i for i, v in enumerate(vs)} for k, vs in space.params.items()}

    def distance(q):
        moved = [k for k in q if q[k] != meta[k]]
        return len(moved), sum(abs(index[k][q[k]] - index[k][meta[k]]) for k in moved)

    ranked = sorted(space.feasible(spec, bucket), key=distance)
    return next((q for q in ranked if not space.violations(spec, q, bucket)), None)


def _fitted_best(spec, bucket, space, storage, other_spec, other_bucket):
    """The best config of ``other_spec``'s study at ``other_bucket`` made to fit ``spec`` at
    ``bucket`` (``nearest_feasible``); None where that study has no result."""
    result = load_result(other_spec, other_bucket, storage)
    meta = result.meta if result is not None else None
    return nearest_feasible(meta, space, spec, bucket) if meta is not None else None


def _neighbour_bests(spec, bucket, space, storage, neighbours):
    """``(other bucket's key, its best config made to fit this bucket)`` for the ``neighbours``
    buckets' studies that have a result, nearest bucket first."""
    for other in sorted(neighbours, key=lambda b: configs.bucket_distance(bucket, b)):
        fit = _fitted_best(spec, bucket, space, storage, spec, other) if other != bucket else None
        if fit is not None:
            yield bucket_key(other), fit


_ABSENT = object()


def spec_distance(spec, other) -> int:
    """How many of the two variants' fields differ (a field only one of them has counts)."""
    mine, theirs = spec.fields(), other.fields()
    return sum(mine.get(k, _ABSENT) != theirs.get(k, _ABSENT) for k in mine.keys() | theirs.keys())


def siblings_of(spec, specs) -> list:
    """The variants among ``specs`` that share ``spec``'s template (``spec`` itself left out),
    each once, in their order."""
    return list(dict.fromkeys(s for s in specs if s != spec and s.template == spec.template))


def _sibling_bests(spec, bucket, space, storage, siblings):
    """``(sibling's name, its best config at ``bucket`` made to fit this variant)`` for the
    ``siblings_of`` ``spec`` among ``siblings`` (other variants of the same template: another
    cache format, query dtype, ...) whose study at ``bucket`` has a result, the nearest
    variant first (the fewest fields apart), then in the order given."""
    # (sorted is stable: variants as far apart keep their order)
    for other in sorted(siblings_of(spec, siblings), key=lambda o: spec_distance(spec, o)):
        fit = _fitted_best(spec, bucket, space, storage, other, bucket)
        if fit is not None:
            yield other.name, fit


def warm_start(
    study: optuna.Study,
    spec,
    bucket: dict[str, int],
    space: Space,
    storage,
    neighbours,
    limit: int,
    most: int = WARM_START,
    siblings=(),
) -> list[dict[str, Any]]:
    """Enqueue, in a study no trial of which has started, the best configs of the nearest
    ``neighbours`` (other buckets of the same variant) whose studies have a result, nearest
    first, ``most`` at most: a bucket's best is usually its neighbour's or close to it; then
    the bests of the ``siblings`` (other variants of the same template) at this bucket,
    ``most`` more at most (``_sibling_bests``). A best that breaks this bucket's constraints
    comes as its ``nearest_feasible`` point. Skipped: configs already in the study, and any
    past the budget. Returns the configs enqueued."""
    trials = study.get_trials(deepcopy=False)
    if any(t.state != optuna.trial.TrialState.WAITING for t in counted(trials)):
        return []  # started (or resumed): the sampler has the study's own results
    return _enqueue_bests(study, spec, bucket, space, storage, neighbours, siblings, limit,
                          most, (WARM_START_ATTR, SIBLING_START_ATTR))  # fmt: skip


def revisit(
    study: optuna.Study,
    spec,
    bucket: dict[str, int],
    space: Space,
    storage,
    neighbours,
    limit: int,
    most: int = WARM_START,
    siblings=(),
) -> list[dict[str, Any]]:
    """``warm_start`` for a study that has run: enqueue the nearest ``neighbours``' best configs
    (made to fit) that it has not tried, ``most`` at most, then the ``siblings``' bests at this
    bucket that it has not tried, ``most`` more at most, within its budget. The local search
    runs a variant's studies in order, so the first ones ran before any neighbour had a best:
    the first study of the portable MXFP4 MLA decode (16 rows) ended at the template default,
    its neighbours all slower, while the 32-row study's best, three steps away, is 25 % faster
    there; and the variants of a template in order, so a variant's study ran before its later
    siblings' did. A queued point always runs (``StopRule.met``); one that beats the study's
    best makes the local search go on from it. Returns the configs enqueued."""
    if not finished(study.get_trials(deepcopy=False)):
        return []  # not run yet: the first pass's warm start is the study's
    return _enqueue_bests(study, spec, bucket, space, storage, neighbours, siblings, limit,
                          most, (REVISIT, SIBLING_REVISIT))  # fmt: skip


# The user attributes of queued trials: a neighbouring bucket's best (the bucket's key) or a
# sibling variant's (its name), queued at the study's start or by the second pass.
WARM_START_ATTR = "warm_start"
SIBLING_START_ATTR = "sibling_start"
REVISIT = "revisit"
SIBLING_REVISIT = "sibling_revisit"


def _enqueue_bests(study, spec, bucket, space, storage, neighbours, siblings, limit, most, why):
    """Queue the nearest ``neighbours``' bests (made to fit) that ``study`` does not hold,
    ``most`` at most, then the ``siblings``' bests at ``bucket``, ``most`` more at most, all
    within ``limit`` trials; each trial marked ``why[0]`` = the bucket's key (a neighbour's)
    or ``why[1]`` = the variant's name (a sibling's)."""
    trials = study.get_trials(deepcopy=False)
    have = [t.params or t.system_attrs.get("fixed_params") for t in trials]
    queued = []
    sources = (
        (why[0], _neighbour_bests(spec, bucket, space, storage, neighbours)),
        (why[1], _sibling_bests(spec, bucket, space, storage, siblings)),
    )
    for attr, bests in sources:
        taken = 0
        for source, meta in bests:
            if taken >= most or len(counted(trials)) + len(queued) >= limit:
                break
            if meta in have or meta in queued:
                continue
            study.enqueue_trial(meta, user_attrs={attr: source}, skip_if_exists=True)
            queued.append(meta)
            taken += 1
    return queued


def counted(trials) -> list:
    """The trials that count (surplus ones, never run, do not)."""
    return [t for t in trials if not t.user_attrs.get(_SURPLUS)]


def finished(trials) -> list:
    """The trials that count and have finished."""
    return [t for t in counted(trials) if t.state in _FINISHED]


def done(trials, limit: int, stop: StopRule = NO_STOP) -> bool:
    """A study of these trials has finished ``limit`` of them, or ``stop`` ended it."""
    return len(finished(trials)) >= limit or stop.met(trials)


def study_done(spec, bucket: dict[str, int], storage, limit: int, stop: StopRule = NO_STOP) -> bool:
    """The stored study of ``spec`` at ``bucket`` is ``done`` (False: no study yet)."""
    study = load_study(spec, bucket, storage)
    return study is not None and done(
        study.get_trials(deepcopy=False), limit, stop.for_study(spec, bucket)
    )


def load_result(
    spec, bucket: dict[str, int], storage, stop: StopRule = NO_STOP
) -> StudyResult | None:
    """The stored study's result (None: no such study)."""
    study = load_study(spec, bucket, storage)
    if study is None:
        return None
    return summarize(spec, bucket, study, spec.default_meta(**bucket), stop)


def summarize(
    spec, bucket, study: optuna.Study, default: dict, stop: StopRule = NO_STOP
) -> StudyResult:
    every = study.get_trials(deepcopy=False)
    trials = counted(every)
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
        stopped_early=stop.for_study(spec, bucket).met(every),
        wall_s=wall_time(study),
    )


CONFIRM_ALL = 8  # studies of this many distinct configs or fewer: re-time every one
# In a larger study the configs whose trial read within this much of the best are re-timed
# first. A single timing of a microsecond kernel can read fast after lighter work (a
# per-token-head store's trials up to 16 % under its re-timed median in an H100's cold tune),
# so a second pass re-times the configs whose trial read under the first pass's winning median
# (``confirm``): a lucky best trial cannot keep the configs behind it from being re-timed.
CONFIRM_MARGIN = 0.10
# The config the tuned JSON holds for the bucket (the incumbent, queued as the study's second
# trial) won alternated re-timings when it was tuned: it is re-timed beside the best wherever
# its trial read within this much of the best, so that one unlucky reading (or one lucky
# reading of another config) does not replace it with a slower config.
INCUMBENT_MARGIN = 0.25


def _readings(study: optuna.Study) -> tuple[list[dict[str, Any]], list[float]]:
    """The study's distinct timed configs, best trial first, and each one's best reading."""
    complete = study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))
    configs: list[dict[str, Any]] = []
    values: list[float] = []
    for t in sorted(complete, key=lambda t: (t.value, t.number)):
        if t.params not in configs:
            configs.append(dict(t.params))
            values.append(t.value)
    return configs, values


def confirm_candidates(
    readings: tuple[list[dict[str, Any]], list[float]],
    default: dict[str, Any],
    top: int,
    incumbent: dict[str, Any] | None = None,
) -> list[dict]:
    """The configs ``confirm`` re-times, best trial first: every distinct config of a study of
    at most ``CONFIRM_ALL`` (a small bucket's few feasible points: one unlucky trial must not
    hide the best), else the ``top`` best within ``CONFIRM_MARGIN`` of the best trial's time,
    the default where it was timed within that margin, and the ``incumbent`` (the tuned JSON's
    config for the bucket) where it was timed within ``INCUMBENT_MARGIN``. ``readings``: the
    study's ``_readings``."""
    configs, values = readings
    if len(configs) <= CONFIRM_ALL:
        return configs
    limit = values[0] * (1 + CONFIRM_MARGIN)
    near = [c for c, v in zip(configs, values, strict=True) if v <= limit]
    out = near[:top]
    if default not in out and default in near:
        out.append(dict(default))
    if incumbent is not None and incumbent not in out and incumbent in configs:
        if values[configs.index(incumbent)] <= values[0] * (1 + INCUMBENT_MARGIN):
            out.append(dict(incumbent))
    return out


def confirm(
    spec,
    bucket: dict[str, int],
    storage,
    evaluate: Evaluate,
    *,
    top: int = 3,
    rounds: int = 3,
    stop: StopRule = NO_STOP,
    record: bool = False,
) -> StudyResult | None:
    """Re-time the study's ``confirm_candidates`` ``rounds`` times each in alternated order
    (forward, backward, ...), with ``evaluate.confirm`` where the evaluator has one (the GPU
    evaluator's: the bench's full settle), then, beside the winner again, the configs not yet
    re-timed whose trial read under its median (``top`` at most), and return the result with
    the lowest median: one lucky timing does not pick the config, nor keep a better one from
    being re-timed. ``record``: also store the outcome on the study
    (``stored_confirmation`` reads it back), which is how a worker hands its re-timings to
    the process that writes the JSON.

    The study's trial values are left as they are. A candidate that fails now (a wrong result,
    a crash) is dropped; a ``WorkerFault`` propagates. None when there is no study; the study's
    own result when it has no successful trial, ``top`` is 0 or it timed a single config (a
    best trial with no other config near it is re-timed alone, for the second pass).
    """
    study = load_study(spec, bucket, storage)
    if study is None:
        return None
    default = spec.default_meta(**bucket)
    result = summarize(spec, bucket, study, default, stop)
    configs, values = readings = _readings(study)  # (re-timing adds no trial)
    candidates = (
        confirm_candidates(readings, default, top, incumbent(spec, bucket))
        if top > 0 and rounds > 0
        else []
    )
    if result.meta is None or not candidates or len(configs) < 2:
        final = result
    else:
        # (an evaluator may time its re-timings more carefully than its trials)
        timer = getattr(evaluate, "confirm", evaluate)
        times: dict[int, list[float]] = {i: [] for i in range(len(candidates))}
        _retime(candidates, list(times), rounds, timer, times)
        medians = {i: statistics.median(ts) for i, ts in times.items()}
        if medians:
            # The second pass: the configs not re-timed whose trial read under the winning
            # median (at most ``top`` of them, best reading first), beside the winner again.
            won = min(medians.values())
            later = [
                c for c, v in zip(configs, values, strict=True) if v < won and c not in candidates
            ][:top]
            if later:
                first = min(medians, key=lambda i: (medians[i], i))
                candidates = candidates + later
                added = list(range(len(candidates) - len(later), len(candidates)))
                times |= {i: [] for i in added}
                _retime(candidates, [first, *added], rounds, timer, times)
                medians = {i: statistics.median(ts) for i, ts in times.items() if ts}
        if not medians:
            final = result
        else:
            best = min(medians, key=lambda i: (medians[i], i))  # ties: the study's order
            default_i = next((i for i in medians if candidates[i] == default), None)
            reading = {_point_key(c): v for c, v in zip(configs, values, strict=True)}
            retimed = tuple(
                (candidates[i], medians[i], reading.get(_point_key(candidates[i])))
                for i in sorted(medians, key=lambda i: (medians[i], i))
            )
            final = dataclasses.replace(
                result,
                meta=candidates[best],
                time_us=medians[best],
                default_time_us=(
                    medians[default_i] if default_i is not None else result.default_time_us
                ),
                confirm_rounds=rounds,
                retimed=retimed,
            )
    if record:
        done_now = finished(study.get_trials(deepcopy=False))
        study.set_user_attr(
            _CONFIRMED,
            {
                "finished": len(done_now),
                "last": max((t.number for t in done_now), default=-1),
                "meta": final.meta,
                "time_us": final.time_us,
                "default_time_us": final.default_time_us,
                "confirm_rounds": final.confirm_rounds,
                # what the choice was made from: each re-timed config's median and trial
                "retimed": [
                    {"meta": m, "median_us": med, "trial_us": trial}
                    for m, med, trial in final.retimed
                ],
            },
        )
    return final


def _retime(
    candidates: list[dict], which: list[int], rounds: int, timer, times: dict[int, list[float]]
) -> None:
    """Time ``candidates[i]`` for each ``i`` of ``which``, ``rounds`` times in alternated order
    (forward, backward, ...), appending to ``times[i]``; a candidate that fails now (a wrong
    result, a crash) is dropped from ``times``, as a trial would be; a ``WorkerFault`` (a broken
    GPU context) propagates."""
    for r in range(rounds):
        for i in which if r % 2 == 0 else reversed(which):
            if i in times:
                try:
                    times[i].append(timer(candidates[i]))
                except WorkerFault:  # the GPU context is broken (or its memory taken, TrialLost):
                    raise  # the caller stops
                except Exception:  # wrong now, or a crash: dropped, as a trial would be
                    del times[i]


# The study's user attribute holding a worker's confirmation (see ``confirm(record=True)``).
_CONFIRMED = "confirmed"
# A claim on a study's confirmation: a trial of its own (surplus, so no count includes it).
_CLAIM = "confirm_claim"


def stored_confirmation(
    spec, bucket: dict[str, int], storage, stop: StopRule = NO_STOP
) -> StudyResult | None:
    """The study's result with the confirmation a worker stored, if the study has one that
    its finished trials leave standing (``confirmation_stands``; None otherwise: no study,
    none stored, or trials added since that a re-timing would look at)."""
    study = load_study(spec, bucket, storage)
    if study is None:
        return None
    kept = study.user_attrs.get(_CONFIRMED)
    if not kept or not confirmation_stands(kept, study.get_trials(deepcopy=False)):
        return None
    result = summarize(spec, bucket, study, spec.default_meta(**bucket), stop)
    return dataclasses.replace(
        result,
        meta=kept["meta"],
        time_us=kept["time_us"],
        default_time_us=kept["default_time_us"],
        confirm_rounds=kept["confirm_rounds"],
        retimed=tuple((e["meta"], e["median_us"], e["trial_us"]) for e in kept.get("retimed", ())),
    )


def confirmation_stands(kept: dict[str, Any], trials) -> bool:
    """Whether a stored confirmation ``kept`` still holds for a study of these ``trials``:
    no trial finished since it was made, or every one that did (the second pass's, or a
    resumed run's with a larger budget) failed or read more than ``CONFIRM_MARGIN`` slower
    than both the confirmed time and the best trial before it. ``confirm`` would not re-time
    such a config (it is neither within the margin of the best trial nor under the winning
    median): a re-timing would time again the configs it timed, and pick among them anew
    only by the noise of its timings."""
    done_now = finished(trials)
    if kept["finished"] == len(done_now):
        return True
    last = kept.get("last")  # (a confirmation stored before "last" was: re-time)
    if last is None or kept.get("time_us") is None:
        return False
    old = [t for t in done_now if t.number <= last]
    if len(old) != kept["finished"]:
        return False
    complete = optuna.trial.TrialState.COMPLETE
    before = [t.value for t in old if t.state == complete]
    if not before:
        return False
    bar = (1 + CONFIRM_MARGIN) * max(kept["time_us"], min(before))
    return all(t.value > bar for t in done_now if t.number > last and t.state == complete)


def claim_confirmation(study: optuna.Study, worker: str, key: str) -> bool:
    """Whether ``worker`` is the one to confirm ``study`` (for the run ``key`` names: its
    budget and stop rule): each worker that asks adds a claim trial, and the lowest-numbered
    claim of the key wins. The storage numbers trials atomically, so exactly one worker of
    those that ask wins, whichever host it is on."""
    study.add_trial(
        optuna.trial.create_trial(
            state=optuna.trial.TrialState.FAIL,
            user_attrs={_SURPLUS: True, _CLAIM: key, "worker": worker},
        )
    )
    claims = [t for t in study.get_trials(deepcopy=False) if t.user_attrs.get(_CLAIM) == key]
    return min(claims, key=lambda t: t.number).user_attrs.get("worker") == worker


_WALL = "wall_s:"  # + a worker's name: the seconds that worker spent on a study


def record_wall_time(study: optuna.Study, worker: str, seconds: float) -> None:
    """Store on ``study`` the wall time ``worker`` spent on it (building its inputs, its
    trials, re-timing): what the progress line's estimate of the time left is made of."""
    study.set_user_attr(f"{_WALL}{worker}", round(seconds, 3))


def wall_time(study: optuna.Study) -> float | None:
    """The wall time the workers recorded on ``study`` (``record_wall_time``), summed over
    them; None where none was recorded."""
    spent = [v for k, v in study.user_attrs.items() if k.startswith(_WALL)]
    return sum(spent) if spent else None


def wait_until_finished(study: optuna.Study, timeout_s: float, poll_s: float = 0.2) -> bool:
    """Wait until no trial of ``study`` that counts is running (other workers' last trials);
    False after ``timeout_s``."""
    end = time.monotonic() + timeout_s
    while True:
        running = study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,))
        if not counted(running):
            return True
        if time.monotonic() >= end:
            return False
        time.sleep(poll_s)


def write_results(
    out_dir: Path,
    arch: str,
    family: str,
    results: list[StudyResult],
    env: dict,
    sampler: str,
    n_trials: int,
    device: str = "",
) -> Path:
    """Merge ``results`` into ``out_dir/<arch>/<family>.json``, or with ``device`` (a device
    folder, ``configs.device_folder``) into ``out_dir/<arch>/<device>/<family>.json`` (atomic,
    keys sorted)."""
    path = out_dir / arch / device / f"{family}.json"  # (an empty device adds no folder)
    entries: dict[str, dict] = {}
    if path.exists():
        try:
            old = json.loads(path.read_text())
            if not configs.validate(old, arch, family, device or None):
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
        if r.wall_s is not None:  # (the next tune's progress line estimates from it)
            entry["tune_s"] = round(r.wall_s, 1)
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
    configs.write(path, doc, device or None)
    return path
