"""Tuning on several GPUs: one worker process per GPU, all sharing the same Optuna studies.

The coordinator (``kvgen tune --gpus N``) prepares every study (fails the trials a dead run
left RUNNING, enqueues the template defaults), then starts one worker per GPU, each pinned to
its device through ``CUDA_VISIBLE_DEVICES``. Every worker walks the same list of studies and
takes trials from each until the study holds its budget (``tuner.work_on_study``: trial
numbers, handed out atomically by the storage, decide which trials belong to the budget), so
the trials of one study are spread over the GPUs and none is run twice. When all workers have
exited, the coordinator reads the results back from the storage and writes the JSON once.

A worker that dies (killed, or exiting on a GPU fault) loses only its running trial: the
coordinator fails that trial and, where the death was a GPU fault or a crash (SIGSEGV, SIGKILL,
...), starts a fresh worker on that GPU, which goes on with the studies (a candidate that broke
the CUDA context is then one failed trial, on one GPU as on several). A worker that finds no GPU
memory for a study's inputs (other processes on the GPU hold it) waits and tries again, a few
times, then exits for a fresh worker to try; no trial is failed for it. The other workers are
not disturbed, and a later run resumes whatever is left.

Several hosts share studies through a database storage (``--storage postgresql://...``): every
host runs the same ``kvgen tune`` command; heartbeats (``tuner.HEARTBEAT_S``) let any worker
fail the running trial of a worker on a host that died. Each host writes the JSON from the
shared studies when its own workers are done.

The worker's evaluator is named as ``module:function`` (``function(spec, bucket) ->
evaluate``), which is how the tests run this same code with a fake timer and no GPU.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

GPU_EVALUATOR = "kvgen.tune.problems:gpu_evaluator"
# Exit status of a worker that stopped because its GPU context is broken.
EXIT_FAULT = 3
# Exit status of a worker that found no GPU memory for a study's inputs, after waiting
# (OOM_RETRIES tries, OOM_WAIT_S apart): other processes on its GPU held it (the compile
# pool's problems, another user's job); a fresh worker tries the study again.
EXIT_MEMORY = 4
OOM_RETRIES = 3
OOM_WAIT_S = float(os.environ.get("KVGEN_TUNE_OOM_WAIT_S", "10"))
# Deaths after which a fresh worker takes the GPU: a GPU fault, a shortage of GPU memory, or a
# crash signal (an interrupt or a terminate is the user's, and another Python error would only
# repeat).
RESTART_SIGNALS = (signal.SIGSEGV, signal.SIGBUS, signal.SIGILL, signal.SIGFPE, signal.SIGABRT,
                   signal.SIGKILL)  # fmt: skip
MAX_RESTARTS = 8  # fresh workers a GPU at most, in one run
# of which at most this many after a shortage of GPU memory: memory that other processes hold
# (an inference engine's reservation, say) is not freed by trying again
MAX_MEMORY_RESTARTS = 2


@dataclasses.dataclass
class Plan:
    """What every worker runs: pickled to a file that each worker reads."""

    jobs: list[tuple[Any, dict[str, int]]]  # (spec, bucket), in order
    storage: str  # a database URL or a journal file path
    sampler: str
    n_trials: int
    seed: int = 0
    deadline: float | None = None  # time.time() after which no trial starts
    stop: Any = None  # a tuner.StopRule (None: every study runs its whole budget)
    # re-time each study's best configs (tuner.confirm's ``top``) in the worker that claims
    # it, right after its trials, with the inputs that worker built (0: none)
    confirm: int = 0
    # ``module:function``; KVGEN_TUNE_EVALUATOR replaces the GPU one (the tests' fake timer)
    evaluator: str = dataclasses.field(
        default_factory=lambda: os.environ.get("KVGEN_TUNE_EVALUATOR", GPU_EVALUATOR)
    )


@dataclasses.dataclass
class WorkerExit:
    device: str
    returncode: int  # of the device's last worker
    failed_trials: int  # running trials of this device's workers that the coordinator failed
    deaths: list[int] = dataclasses.field(default_factory=list)  # replaced workers' statuses


def death(returncode: int) -> str:
    """What a worker's exit status says it died of."""
    if returncode == EXIT_FAULT:
        return "a GPU fault"
    if returncode == EXIT_MEMORY:
        return "out of GPU memory"
    return f"signal {-returncode}" if returncode < 0 else f"exit status {returncode}"


def _restartable(returncode: int) -> bool:
    return returncode in (EXIT_FAULT, EXIT_MEMORY) or -returncode in RESTART_SIGNALS


def visible_devices() -> list[str]:
    """The GPUs this process may use, as CUDA_VISIBLE_DEVICES entries."""
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        return [d.strip() for d in env.split(",") if d.strip()]
    import torch

    return [str(i) for i in range(torch.cuda.device_count())]


def worker_id(pid: int, host: str | None = None) -> str:
    return f"{host or socket.gethostname()}:{pid}"


def run_workers(
    plan: Plan,
    devices: list[str],
    *,
    log: Callable[[str], None] = print,
    env: dict[str, str] | None = None,
    poll_s: float = 0.2,
    max_restarts: int = MAX_RESTARTS,
    on_poll: Callable[[], None] | None = None,
) -> list[WorkerExit]:
    """Start one worker per device on ``plan`` and wait for all of them. A worker that exits
    with an error has its running trials failed at once; the others are not disturbed. One
    that died of a GPU fault or a crash is replaced by a fresh worker on its device (at most
    ``max_restarts`` times a device, none after the plan's deadline). ``on_poll`` is called
    while they run (a progress display)."""
    from kvgen.tune import tuner

    storage = tuner.storage_from(plan.storage, Path(plan.storage))
    with tempfile.TemporaryDirectory(prefix="kvgen-tune-") as tmp:
        plan_file = Path(tmp) / "plan.pkl"
        plan_file.write_bytes(pickle.dumps(plan))
        procs: dict[str, subprocess.Popen] = {}
        pumps = []
        # The workers import the kvgen this process runs (not one that the working directory
        # would shadow it with: -P).
        import kvgen

        child_env = {**os.environ, **(env or {}), "PYTHONUNBUFFERED": "1"}
        # Each worker checks trials against the reference on the CPU: share the cores out, or
        # every worker's thread pool spans all of them and they thrash.
        threads = str(max(1, (os.cpu_count() or 2) // len(devices)))
        for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
            child_env.setdefault(var, threads)
        paths = [str(Path(kvgen.__file__).parent.parent), child_env.get("PYTHONPATH")]
        child_env["PYTHONPATH"] = os.pathsep.join(x for x in paths if x)

        def start(dev: str) -> None:
            p = subprocess.Popen(
                [sys.executable, "-P", "-m", "kvgen.tune.worker", str(plan_file)],
                env={**child_env, "CUDA_VISIBLE_DEVICES": dev},
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            procs[dev] = p
            t = threading.Thread(target=_pump, args=(p, f"[gpu {dev}] ", log), daemon=True)
            t.start()
            pumps.append(t)

        for dev in devices:
            start(dev)
        log(f"started {len(procs)} workers (pids {', '.join(str(p.pid) for p in procs.values())})")
        exits: dict[str, WorkerExit] = {}
        deaths: dict[str, list[int]] = {dev: [] for dev in devices}
        failed: dict[str, int] = {dev: 0 for dev in devices}
        try:
            while len(exits) < len(procs):
                for dev, p in list(procs.items()):
                    if dev in exits or p.poll() is None:
                        continue
                    if p.returncode != 0:
                        n = _fail_trials_of(plan, storage, worker_id(p.pid))
                        failed[dev] += n
                        why = death(p.returncode)
                        again = (
                            _restartable(p.returncode)
                            and len(deaths[dev]) < max_restarts
                            and (
                                p.returncode != EXIT_MEMORY
                                or deaths[dev].count(EXIT_MEMORY) < MAX_MEMORY_RESTARTS
                            )
                            and (plan.deadline is None or time.time() < plan.deadline)
                        )
                        log(
                            f"worker on GPU {dev} died ({why}); {n} running trial(s) failed; "
                            + ("a fresh worker takes the GPU" if again else "the others go on")
                        )
                        if again:
                            deaths[dev].append(p.returncode)
                            start(dev)
                            continue
                    exits[dev] = WorkerExit(dev, p.returncode, failed[dev], deaths[dev])
                if on_poll is not None:
                    on_poll()
                time.sleep(poll_s)
        except KeyboardInterrupt:
            # Ctrl-C: stop every worker, fail what they were running, and let the caller stop.
            # An interrupt (not a kill) lets a worker leave the journal file's lock it may hold;
            # a killed holder would stall every other process for the lock's grace period.
            for p in procs.values():
                if p.poll() is None:
                    p.send_signal(signal.SIGINT)
            for p in procs.values():
                try:
                    p.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
                _fail_trials_of(plan, storage, worker_id(p.pid))
            # A worker interrupted between taking a trial and naming itself on it leaves a
            # RUNNING trial that no worker's name finds.
            _fail_orphans(plan, storage)
            log("interrupted: the workers are stopped; the same command resumes the studies")
            raise
        for t in pumps:
            t.join(timeout=5)
    _fail_orphans(plan, storage)
    return [exits[d] for d in devices]


def _fail_orphans(plan: Plan, storage) -> None:
    """After every worker of this host has stopped: fail the trials no live process runs."""
    import optuna

    from kvgen.tune import tuner

    for spec, bucket in plan.jobs:
        study = tuner.load_study(spec, bucket, storage)
        if study is None:
            continue
        if tuner.shared_by_hosts(storage):
            # Another host's worker may be running trials: fail only those whose heartbeat
            # has stopped for longer than the grace period.
            with warnings.catch_warnings():  # "experimental" since Optuna 2.9
                warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
                optuna.storages.fail_stale_trials(study)
        else:
            # A journal file is this host's alone: a trial still RUNNING now has no live
            # process (one that died between taking a trial and naming itself on it).
            tuner.fail_running(study, "interrupted: its worker died")


def _pump(proc: subprocess.Popen, prefix: str, log: Callable[[str], None]) -> None:
    assert proc.stdout is not None
    for line in proc.stdout:
        log(prefix + line.rstrip("\n"))


def _fail_trials_of(plan: Plan, storage, worker: str) -> int:
    from kvgen.tune import tuner

    n = 0
    for spec, bucket in plan.jobs:
        study = tuner.load_study(spec, bucket, storage)
        if study is not None:
            n += tuner.fail_running(study, f"interrupted: worker {worker} died", worker=worker)
    return n


def evaluator_factory(plan: Plan):
    """``plan.evaluator`` imported: ``factory(spec, bucket) -> evaluate``."""
    import importlib

    module, _, attr = plan.evaluator.partition(":")
    return getattr(importlib.import_module(module), attr)


def work(plan: Plan, log: Callable[[str], None] = print) -> int:
    """One worker: every study of ``plan`` in order, trials until each holds its budget.
    Returns the process exit status (``EXIT_FAULT`` when the GPU context broke)."""
    from kvgen.space import load_space
    from kvgen.tune import tuner

    factory = evaluator_factory(plan)
    storage = tuner.storage_from(plan.storage, Path(plan.storage))
    stop = plan.stop or tuner.NO_STOP
    me = worker_id(os.getpid())
    deadline = None
    if plan.deadline is not None:
        deadline = time.monotonic() + (plan.deadline - time.time())
    # The local search's second pass: each study tries the best configs its neighbouring
    # buckets and its sibling variants (the same template) at its bucket found after it had
    # run (``tuner.revisit``), and walks on from one that wins.
    passes = [(spec, bucket, False) for spec, bucket in plan.jobs]
    if plan.sampler == "local":
        passes += [(spec, bucket, True) for spec, bucket in plan.jobs]
    for spec, bucket, again in passes:
        t_study = time.monotonic()
        space = load_space(spec.template)
        study = tuner.open_study(
            spec,
            bucket,
            space,
            storage=storage,
            sampler=plan.sampler,
            seed=plan.seed,
            n_trials=plan.n_trials,
            prepare=False,
        )
        label = f"{spec.name} @ {tuner.bucket_key(bucket)}"
        limit = tuner.budget(space, plan.sampler, plan.n_trials, spec, bucket)
        rule = stop.for_study(spec, bucket, space)  # (the local rule: bound once a study)
        neighbours = [b for s, b in plan.jobs if s == spec and b != bucket]
        siblings = tuner.siblings_of(spec, [s for s, b in plan.jobs if b == bucket])
        if again and not tuner.revisit(study, spec, bucket, space, storage, neighbours, limit,
                                       siblings=siblings):  # fmt: skip
            continue  # nothing new from its neighbours and siblings (or not run)
        if tuner.budget_taken(study, limit, rule):
            continue  # taken by other workers (or a finished earlier run): build no inputs
        if plan.sampler != "grid" and not again:
            tuner.warm_start(study, spec, bucket, space, storage, neighbours, limit,
                             siblings=siblings)  # fmt: skip
        t0 = time.monotonic()
        for attempt in range(1, OOM_RETRIES + 1):
            try:
                raw = factory(spec, bucket)
                _wait_for_gpu()  # a fault of the kernels that built the inputs shows here,
                break  # blamed on no trial
            except Exception as exc:
                if not _out_of_memory(exc):
                    if not _sticky(exc):
                        raise
                    log(f"{label}: GPU fault while building its inputs, this worker stops: "
                        f"{_fault(exc)}")  # fmt: skip
                    return EXIT_FAULT
            # out of memory (here, past the except block, the exception and the tensors its
            # frames held are gone)
            _release_memory()
            if attempt == OOM_RETRIES:
                log(f"{label}: out of GPU memory building its inputs, {OOM_RETRIES} tries; "
                    "this worker stops")  # fmt: skip
                return EXIT_MEMORY
            log(f"{label}: out of GPU memory building its inputs (try {attempt} of "
                f"{OOM_RETRIES}); trying again in {OOM_WAIT_S:g} s")  # fmt: skip
            time.sleep(OOM_WAIT_S)
        evaluate = _guarded(raw, lambda line, label=label: log(f"{label}: {line}"))
        setup = time.monotonic() - t0
        ran = []
        try:
            while True:
                try:
                    tuner.work_on_study(
                        study,
                        spec,
                        bucket,
                        space,
                        evaluate,
                        n_trials=plan.n_trials,
                        sampler=plan.sampler,
                        deadline=deadline,
                        worker=me,
                        on_trial=lambda s, ran=ran: ran.append(1),
                        stop=rule,
                    )
                    break
                except tuner.TrialLost as exc:  # (its retry comes next: a point is lost once)
                    log(f"{label}: a trial lost, its point queued again: {exc}")
                    _release_memory()
        except tuner.WorkerFault as exc:
            log(f"{label}: GPU fault, this worker stops: {exc}")
            return EXIT_FAULT
        r = tuner.summarize(spec, bucket, study, spec.default_meta(**bucket), rule)
        best = f"{r.time_us:.2f} us {r.meta}" if r.meta else "none yet"
        split = getattr(raw, "seconds", {})
        counts = getattr(raw, "counts", {})
        log(
            f"{label}: ran {len(ran)} trials in {time.monotonic() - t0:.1f} s "
            f"({setup:.1f} s building inputs"
            + "".join(f", {v:.1f} s {k}" for k, v in split.items())
            + "".join(f", {v} kernels {k}" for k, v in counts.items())
            + (f", {raw.compiling[0]:.1f} s compiling" if hasattr(raw, "compiling") else "")
            + f"); study best so far {best}"
            + ("; stopped: no more gain" if r.stopped_early else "")
        )
        try:
            _confirm_here(
                plan, spec, bucket, study, storage, evaluate, limit, rule, me, deadline, log,
                split,
            )  # fmt: skip
        except tuner.TrialLost as exc:  # (the coordinator re-times the study after the workers)
            log(f"{label}: out of GPU memory while re-timing, left to the coordinator: {exc}")
            _release_memory()
        except tuner.WorkerFault as exc:
            log(f"{label}: GPU fault while re-timing, this worker stops: {exc}")
            return EXIT_FAULT
        tuner.record_wall_time(study, me, time.monotonic() - t0)
        del evaluate, raw
        _release_memory()
        # (what the study cost this worker from end to end: the gaps between these lines and
        # the trials' and re-timing's own are the study's setup, storage and clean-up)
        log(
            f"{label}: {time.monotonic() - t_study:.1f} s in all "
            f"({t0 - t_study:.1f} s opening the study and its warm start)"
        )
        if deadline is not None and time.monotonic() >= deadline:
            log("wall-clock budget spent")
            break
    return 0


CONFIRM_WAIT_S = 300.0  # longest wait for other workers' last trials of a study


def _confirm_here(
    plan, spec, bucket, study, storage, evaluate, limit, stop, me, deadline, log, split=None
) -> None:
    """Re-time the study's best configs in this worker (its inputs are built) when the study
    has taken its budget and this worker wins the claim (``tuner.claim_confirmation``), once
    the other workers' last trials of it have finished; the result is stored on the study,
    where the coordinator reads it. With several GPUs the claims spread the re-timing over
    them, while the other workers go on with the next studies. ``stop``: the study's stop rule
    (``StopRule.for_study``); ``split``: the evaluator's ``seconds`` (where its wall time
    went), whose share of the re-timing the log line shows."""
    from kvgen.tune import tuner

    if plan.confirm <= 0 or (deadline is not None and time.monotonic() >= deadline):
        return
    if not tuner.budget_taken(study, limit, stop):
        return
    if tuner.stored_confirmation(spec, bucket, storage, stop) is not None:
        return
    # (trials the second pass added after a confirmation call for a claim of their own; the
    # trials that count no longer change once the budget is taken, whatever still runs)
    held = len(tuner.counted(study.get_trials(deepcopy=False)))
    key = f"{limit} trials, patience {stop.patience}, min gain {stop.min_gain}, {held} held"
    if not tuner.claim_confirmation(study, me, key):
        return
    t0 = time.monotonic()
    before = dict(split or {})
    if not tuner.wait_until_finished(study, CONFIRM_WAIT_S):
        return  # a trial still running elsewhere: the coordinator confirms after the workers
    r = tuner.confirm(spec, bucket, storage, evaluate, top=plan.confirm, stop=stop, record=True)
    if r is not None and r.confirm_rounds:
        # each re-timed config's median beside its trial's reading: what the choice rests on
        each = [
            f"{med:.2f} us {m}" + (f" (trial {trial:.2f})" if trial is not None else "")
            for m, med, trial in r.retimed
        ]
        spent = "".join(f", {v - before.get(k, 0.0):.1f} s {k}" for k, v in (split or {}).items())
        log(
            f"{spec.name} @ {tuner.bucket_key(bucket)}: re-timed in {time.monotonic() - t0:.1f} s"
            f"{f' ({spent[2:]})' if spent else ''}, best {'; '.join(each)}"
        )


# Errors after which a CUDA context is unusable: every later trial of this process would fail.
_STICKY = (
    "illegal memory access",
    "illegal instruction",
    "unspecified launch failure",
    "misaligned address",
    "device-side assert",
    "uncorrectable ECC",
)


def _guarded(evaluate, log: Callable[[str], None] = lambda line: None):
    """``evaluate`` with the worker's two kinds of environment failure told apart from a
    config's: a CUDA error that breaks the context raises ``tuner.WorkerFault``; CUDA out of
    memory (the compile pool's processes or another job holding the GPU's memory: the config
    is not at fault) frees this process's cache, waits OOM_WAIT_S and runs the trial again,
    OOM_RETRIES tries, then raises ``tuner.TrialLost`` (the trial counts as none and its point
    is queued again; the point's retry, out of memory too, fails as its config's). The
    evaluator's ``confirm`` (the re-timing's fuller settle, which ``tuner.confirm`` takes) is
    guarded alike and kept."""
    from kvgen.tune import tuner

    def guard(fn):
        def run(meta):
            for attempt in range(1, OOM_RETRIES + 1):
                try:
                    return fn(meta)
                except Exception as exc:
                    if _sticky(exc):
                        raise _fault(exc) from exc
                    if not _out_of_memory(exc):
                        raise
                    why = f"{type(exc).__name__}: {exc}"[:200]
                # (past the except block: the exception and the tensors its frames held are
                # gone)
                _release_memory()
                if attempt == OOM_RETRIES:
                    raise tuner.TrialLost(f"out of GPU memory in {OOM_RETRIES} tries: {why}")
                log(f"out of GPU memory in a trial of {meta} (try {attempt} of "
                    f"{OOM_RETRIES}); trying again in {OOM_WAIT_S:g} s")  # fmt: skip
                time.sleep(OOM_WAIT_S)

        return run

    run = guard(evaluate)
    if hasattr(evaluate, "confirm"):
        run.confirm = guard(evaluate.confirm)
    return run


def _sticky(exc: Exception) -> bool:
    """Whether ``exc`` is a CUDA error after which this process's context is unusable."""
    return any(s in str(exc) for s in _STICKY)


def _out_of_memory(exc: Exception) -> bool:
    """Whether ``exc`` is torch's CUDA out-of-memory error (which leaves the context usable)."""
    return type(exc).__name__ == "OutOfMemoryError" or "CUDA out of memory" in str(exc)


def _fault(exc: Exception):
    from kvgen.tune import tuner

    return tuner.WorkerFault(f"{type(exc).__name__}: {exc}"[:300])


def _cuda():
    """``torch.cuda`` where this process has used its GPU, else None."""
    torch = sys.modules.get("torch")
    return torch.cuda if torch is not None and torch.cuda.is_initialized() else None


def _wait_for_gpu() -> None:
    """Wait for the work queued on this process's GPU, where it has one (a CUDA error of that
    work is raised here, not at a later trial's first wait)."""
    if cuda := _cuda():
        cuda.synchronize()


def _release_memory() -> None:
    """Give this process's cached GPU memory back (after collecting what only cycles hold)."""
    if cuda := _cuda():
        import gc

        gc.collect()
        cuda.empty_cache()
