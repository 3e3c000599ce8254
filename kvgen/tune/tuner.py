"""The tuner: one Optuna study per (variant, shape bucket).

A trial picks meta-parameters from the template's search space; the static constraints are
checked before anything compiles; then ``evaluate(meta)`` compiles and runs the candidate,
checks it against the reference and times it. A constraint violation, a compile error or a
wrong result fails the trial, and a failed trial can never be the best. The template's default
config is enqueued as the first trial of every study. Studies live in Optuna storage (by default
a journal file on disk), so an interrupted run resumes where it stopped.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import logging
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
    failed: int


def storage_from(url: str | None, default_path: Path):
    """An Optuna storage: a URL (sqlite:///..., postgresql://...), a journal file path, or the
    default journal file (embedded, on disk, safe for several processes on one host)."""
    if url and "://" in url:
        return url
    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend

    path = Path(url) if url else default_path
    path.parent.mkdir(parents=True, exist_ok=True)
    return JournalStorage(JournalFileBackend(str(path)))


def make_sampler(kind: str, space: Space, seed: int = 0):
    if kind == "grid":
        return optuna.samplers.GridSampler({k: list(v) for k, v in space.params.items()}, seed=seed)
    if kind == "tpe":
        return optuna.samplers.TPESampler(multivariate=True, seed=seed, n_startup_trials=8)
    if kind == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    raise ValueError(f"unknown sampler {kind!r}; expected tpe, grid or random")


def _fail_stale_running(study: optuna.Study) -> None:
    """Trials left RUNNING by a process that died (single-process resume) are failed."""
    for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,)):
        study._storage.set_trial_state_values(t._trial_id, optuna.trial.TrialState.FAIL)


# Trials that count against a study's budget (a RUNNING one left by a dead process does not).
_FINISHED = (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.FAIL,
             optuna.trial.TrialState.PRUNED)  # fmt: skip


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
    """Run (or resume) the study of ``spec`` at ``bucket`` until it has ``n_trials`` trials."""
    name = f"{spec.name}@{bucket_key(bucket)}"
    # kvgen reports trials itself (failures are counted in the result and kept in storage).
    optuna.logging.set_verbosity(logging.ERROR)
    study = optuna.create_study(
        study_name=name, storage=storage, direction="minimize",
        sampler=make_sampler(sampler, space, seed), load_if_exists=True,
    )  # fmt: skip
    _fail_stale_running(study)
    default = spec.default_meta(**bucket)
    done = study.get_trials(deepcopy=False)
    # The template's default is the first trial (a grid visits it anyway, in its own order).
    if sampler != "grid" and space.allows(default) and not any(t.params == default for t in done):
        study.enqueue_trial(default, skip_if_exists=True)

    def objective(trial: optuna.Trial) -> float:
        meta = {k: trial.suggest_categorical(k, list(v)) for k, v in space.params.items()}
        broken = space.violations(spec, meta)
        if broken:
            trial.set_user_attr("failure", f"constraints: {', '.join(broken)}")
            raise TrialFailed(f"violates {broken}")
        try:
            t_us = evaluate(meta)
        except TrialFailed as exc:
            trial.set_user_attr("failure", str(exc))
            raise
        except Exception as exc:  # a compile error or a crash is a failed trial
            trial.set_user_attr("failure", f"{type(exc).__name__}: {exc}"[:500])
            raise TrialFailed(str(exc)) from exc
        trial.set_user_attr("meta", meta)
        return t_us

    remaining = n_trials - len(study.get_trials(deepcopy=False, states=_FINISHED))
    if sampler == "grid":
        remaining = min(remaining, len(space.points()))
    callbacks = []
    if on_trial is not None:
        callbacks.append(lambda s, t: on_trial(summarize(spec, bucket, s, default)))
    if remaining > 0 and (deadline is None or time.monotonic() < deadline):
        timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
        study.optimize(objective, n_trials=remaining, timeout=timeout,
                       catch=(TrialFailed,), callbacks=callbacks)  # fmt: skip
    return summarize(spec, bucket, study, default)


def finished_trials(spec, bucket: dict[str, int], storage) -> int:
    """Trials the stored study of ``spec`` at ``bucket`` has finished (0: no study yet)."""
    name = f"{spec.name}@{bucket_key(bucket)}"
    try:
        study = optuna.load_study(study_name=name, storage=storage)
    except KeyError:
        return 0
    return len(study.get_trials(deepcopy=False, states=_FINISHED))


def summarize(spec, bucket, study: optuna.Study, default: dict) -> StudyResult:
    trials = study.get_trials(deepcopy=False)
    complete = [t for t in trials if t.state == optuna.trial.TrialState.COMPLETE]
    failed = sum(t.state == optuna.trial.TrialState.FAIL for t in trials)
    best = min(complete, key=lambda t: t.value, default=None)
    default_t = next((t.value for t in complete if t.params == default), None)
    return StudyResult(
        spec.name, bucket_key(bucket), dict(best.params) if best else None,
        best.value if best else None, default_t, len(trials), failed,
    )  # fmt: skip


def write_results(
    out_dir: Path, arch: str, family: str, results: list[StudyResult], env: dict,
    sampler: str, n_trials: int,
) -> Path:  # fmt: skip
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
        entry = {"meta": r.meta, "time_us": round(r.time_us, 4), "trials": r.trials,
                 "failed_trials": r.failed}  # fmt: skip
        entry["default_time_us"] = round(r.default_time_us or r.time_us, 4)
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
