"""Compile candidates in parallel before the trials time them one by one.

Timing must be serial (one kernel on the GPU at a time), but compiling is CPU work: Triton
compiles each meta-parameter set once and keeps the binary in its on-disk cache, which every
process on the machine shares. ``precompile`` runs the trial problem's correctness check (which
compiles and launches) for many candidates in one pool of ``jobs`` processes; the tuning
process then finds them compiled. Results are identical with or without it: only the wall time
changes.

What is compiled ahead is what a local search visits first (``plan``), nearest first, so
that a budget cut leaves every study its nearest points: the start points of a variant's
studies (the template default and the tuned JSON's config of each bucket) and the points
within ``COMPILE_RADIUS`` steps of them (beside the workers: every ring, until they are done),
with the tuned JSON's configs of the variant's siblings (the same template) at its buckets
and no ring around those (``run._precompile``), ``RING_WINDOW`` rings at a time in the order
the studies run (the workers need the first studies' neighbourhoods first, not every study's
start points),
once for each class of buckets whose launches Triton specialises alike (``compile_class``), at
one bucket of the class. A study that walks further compiles the rest in the trial that needs
it. (Compiling every feasible point instead is 3967
compiles for sm90's default studies at one bucket a variant, most of which no study visits,
and the buckets of other classes compile in their trials anyway.)
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import importlib
import json
import multiprocessing
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvgen.space import bucket_key

COMPILE_RADIUS = 2  # steps around the start points of a class of buckets
# Rings a pass over the entries takes, in the entries' (the studies') order: the start points
# and the points one and two steps from them of every entry, then the next three rings, ...
RING_WINDOW = 3
CHUNK = 6  # candidates a pool task: few, so that the order across variants holds
DEFAULT_CHECKER = "kvgen.tune.precompile:cuda_checker"
DEFAULT_COMPILER = "kvgen.tune.precompile:cuda_compiler"  # (compile_only: no launch, no check)


@dataclasses.dataclass(frozen=True)
class Task:
    """Candidates of one variant to compile and check at ``bucket``; ``ring``: their distance
    in steps from the variant's nearest start point."""

    spec: Any
    bucket: dict[str, int]
    metas: tuple[dict, ...]
    ring: int


def plan(entries, chunk: int = CHUNK, window: int = RING_WINDOW, order=None) -> list[Task]:
    """The compile tasks for ``entries``: ``(spec, space, bucket, seeds, radius)`` tuples
    (``bucket`` the one the candidates are checked at, ``seeds`` the start points, ``radius``
    how many steps around them), in the order the studies run (``entries``' order), ``window``
    rings of an entry at a time: rings 0 to ``window - 1`` of every entry, entry after entry,
    then the next ``window`` rings of every entry, ...; in chunks of ``chunk`` candidates. A
    candidate two entries hold at the same bucket comes once, in the nearer ring (of the
    first of them, where the rings are equal). ``order``: another order, a function of (ring,
    entry index) that sorts the (ring, entry) groups (``benchmarks/pool_replay.py`` tries
    some)."""
    ringed: dict[tuple, tuple[int, int, Any, dict, dict]] = {}
    for i, (spec, space, bucket, seeds, radius) in enumerate(entries):
        where = json.dumps(bucket, sort_keys=True)
        for r, ring in enumerate(space.compile_rings(spec, seeds, radius)):
            for meta in ring:
                key = (spec.name, where, json.dumps(meta, sort_keys=True))
                if key not in ringed or r < ringed[key][0]:
                    ringed[key] = (r, i, spec, bucket, meta)
    groups: dict[tuple, list[dict]] = {}  # (ring, entry, variant, bucket): metas, in order
    for (name, where, _), (r, i, spec, bucket, meta) in ringed.items():
        groups.setdefault((r, i, name, where), []).append((spec, bucket, meta))
    tasks = []

    def by_window(ring, entry):
        return ring // window, entry, ring

    key = order or by_window
    for (r, _, _, _), members in sorted(groups.items(), key=lambda kv: key(*kv[0][:2])):
        spec, bucket = members[0][0], members[0][1]
        metas = [m for _, _, m in members]
        for i in range(0, len(metas), chunk):
            tasks.append(Task(spec, bucket, tuple(metas[i : i + chunk]), r))
    return tasks


def compile_class(bucket: dict[str, int], per_bucket: tuple[str, ...] = ()) -> tuple:
    """The class of ``bucket`` whose launches Triton compiles alike, as far as its sizes tell:
    Triton specialises an integer argument by whether it is 1 and whether it is a multiple of
    16, and a pointer by 16-byte alignment, so 1 token, 4 tokens and 16-65536 tokens differ in
    binaries, and so do vLLM's inline-scale rows (``row_align`` 4 or 8) and 16-byte aligned
    ones. The sizes of ``per_bucket`` (a space's ``[compile] per_bucket``: a constexpr of the
    kernels comes from them) count by value. Sizes passed to a kernel as products of the
    bucket's (units = tokens x heads) can still differ within a class: those compile in their
    trials."""
    return tuple(
        (k, v if k in per_bucket else 1 if v == 1 else 16 if v % 16 == 0 else 0)
        for k, v in bucket.items()
    )


def cuda_checker(spec, bucket):
    """``check(meta) -> bool`` of the family's tuning problem on this process's GPU."""
    import torch

    from kvgen.tune import problems

    run, check, _ = problems.problem(spec, bucket, torch.device("cuda"))
    del run
    return check


def cuda_compiler(spec, bucket):
    """``compile(meta) -> True``: every launch a trial of ``meta`` makes (the check's and the
    timed one of each input set) on this process's GPU, with every Triton launch compiling
    only (``compile_only``): the binaries land in Triton's cache on disk, and no kernel runs,
    so that the timings of a worker tuning on the same GPU meanwhile are not disturbed.
    (Triton specialises a launch by its integer arguments and pointers: a decode's check on a
    small batch and its timed sets of other batch sizes are binaries of their own.)"""
    import torch

    from kvgen.tune import problems

    return trial_launches(*problems.problem(spec, bucket, torch.device("cuda")))


def trial_launches(run, check, n_sets):
    """``compile(meta) -> True`` making the launches of a trial of the tuning problem ``(run,
    check, n_sets)``: the check (its verdict, over outputs no kernel wrote, is ignored) and
    ``run(i, meta)`` for each input set ``i``."""

    def compile_(meta):
        check(meta)
        for i in range(n_sets):
            run(i, meta)
        return True

    return compile_


def compile_only() -> None:
    """From now on, in this process, ``kernel[grid](...)`` compiles the kernel for those
    arguments (Triton's warmup: the same specialisation and cache key as a launch) and does not
    launch it."""
    from triton.runtime import jit

    def compile_not_launch(self, grid):
        return lambda *args, **kwargs: self.run(*args, grid=grid, warmup=True, **kwargs)

    jit.KernelInterface.__getitem__ = compile_not_launch


_checks: dict[tuple, Callable] = {}  # per pool process: the last variant's check

# The share of the GPU's memory the pool's processes leave free for the workers: a process
# builds a problem (its inputs on the GPU: up to ~7.5 GiB for an MLA decode's) only while at
# least this share is free, waiting up to POOL_MEMORY_WAIT_S for it, one process at a time
# (``_BUILD_LOCK``), and drops what it built if that took the free share below it, or, before
# each later candidate, once the free share has fallen below it (a worker's trial needs the
# memory: a decode's two timed batches are 2 GiB each); the candidates it leaves compile in
# their trials. (Fifteen processes holding decode problems need more than an 80 GB GPU has;
# eight of them once held 61 GiB of an 80 GB H100 while the worker's trials ran out of it.)
POOL_RESERVE = 0.25
POOL_MEMORY_WAIT_S = 30.0


class NoRoom(RuntimeError):
    """The GPU's free memory is below the pool's reserve: the problem is not built here."""


BUILDING = "building the problem: "  # an outcome's start where the problem was not built
NO_ROOM = f"{BUILDING}{NoRoom.__name__}"  # ... for want of GPU memory: left to the trials


def _free_share() -> float | None:
    """The share of this process's GPU's memory that is free (None: no GPU in use here)."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available():
        return None
    free, total = torch.cuda.mem_get_info()
    return free / total


def _wait_for_room(reserve: float, wait_s: float, poll_s: float = 0.5) -> None:
    """Return once at least ``reserve`` of the GPU's memory is free (at once without a GPU);
    ``NoRoom`` after ``wait_s`` seconds without it."""
    deadline = time.monotonic() + wait_s
    while (share := _free_share()) is not None and share < reserve:
        if time.monotonic() >= deadline:
            raise NoRoom(f"{share:.0%} of the GPU's memory free, under the pool's {reserve:.0%}")
        time.sleep(poll_s)


_BUILD_LOCK = None  # a pool's processes build their problems one at a time (``precompile``)


def _drop_checks() -> None:
    """Forget the process's problem and give its GPU memory back."""
    _checks.clear()
    import gc

    gc.collect()
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        torch.cuda.empty_cache()


def _one_thread(no_launch: bool = False, build_lock=None) -> None:
    """Many compile processes at once: one CPU thread each for torch (the reference checks),
    or their thread pools oversubscribe the cores and everything crawls; kvgen's warnings
    off (the trials' problems give the same in the worker); with ``no_launch``
    (beside the workers), Triton launches compile only (``compile_only``), and the process
    runs at a lower CPU priority than the workers (niceness 10), whose host work (inputs, the
    reference, launches) a trial waits on."""
    import logging
    import os

    import torch

    global _BUILD_LOCK
    _BUILD_LOCK = build_lock

    from kvgen.tune.problems import drop_ptx_dumps

    torch.set_num_threads(1)
    drop_ptx_dumps()
    # (a problem's inputs are made with kvgen's ops, e.g. an fp16 store that no default
    # study tunes: its "no tuned config" warning, once in each of 15 processes, is not news)
    logging.getLogger("kvgen").setLevel(logging.ERROR)
    if no_launch:
        compile_only()
        os.nice(10)


def _check_for(task: Task, checker: str) -> Callable:
    """The check of ``task``'s (variant, bucket), kept until a task of another one comes (one
    problem's inputs a process: a decode's are gigabytes, and 15 processes share the GPU),
    built only where the GPU keeps ``POOL_RESERVE`` of its memory free (``NoRoom`` if not)."""
    key = (task.spec.name, json.dumps(task.bucket, sort_keys=True))
    if key not in _checks:
        if _checks:
            _drop_checks()
        with _BUILD_LOCK if _BUILD_LOCK is not None else contextlib.nullcontext():
            _wait_for_room(POOL_RESERVE, POOL_MEMORY_WAIT_S)
            module, _, attr = checker.partition(":")
            _checks[key] = getattr(importlib.import_module(module), attr)(task.spec, task.bucket)
            if (share := _free_share()) is not None and share < POOL_RESERVE:
                _drop_checks()
                raise NoRoom(f"building it left {share:.0%} of the GPU's memory free, under "
                             f"the pool's {POOL_RESERVE:.0%}")  # fmt: skip
    return _checks[key]


def finished_variants(path: str | None) -> set[str]:
    """The variants named in the file at ``path`` (one a line): those whose studies the
    workers have all finished, which ``kvgen tune``'s progress monitor writes (none: no file)."""
    try:
        return set(Path(path).read_text().split()) if path else set()
    except OSError:
        return set()


def write_finished_variants(path: str, names) -> None:
    """Write ``finished_variants``' file at once (the pool's processes read it any time)."""
    tmp = Path(f"{path}.tmp")
    tmp.write_text("".join(f"{n}\n" for n in sorted(names)))
    tmp.replace(path)


def _run(
    args: tuple[Task, float | None, str, str | None],
) -> tuple[int, dict[str, str] | None, float]:
    task, stop, checker, finished = args
    out: dict[str, str] = {}
    t0 = time.monotonic()
    if stop is not None and time.time() >= stop:  # the rest compiles when a trial needs it
        return task.ring, out, 0.0
    if task.spec.name in finished_variants(finished):  # no trial of it is left to need it
        return task.ring, None, 0.0
    try:
        check = _check_for(task, checker)
    except Exception as exc:  # (out of memory, say): the trials will build it and say so
        why = f"{BUILDING}{type(exc).__name__}: {exc}"[:200]
        return task.ring, {json.dumps(m, sort_keys=True): why for m in task.metas}, 0.0
    for i, meta in enumerate(task.metas):
        if stop is not None and time.time() >= stop:
            break
        name = json.dumps(meta, sort_keys=True)
        # (the first candidate's room was seen right after building)
        if i and (share := _free_share()) is not None and share < POOL_RESERVE:
            _drop_checks()  # a worker needs the memory: the rest compile in their trials
            why = (f"{NO_ROOM}: {share:.0%} of the GPU's memory "
                   f"free, under the pool's {POOL_RESERVE:.0%}: dropped")  # fmt: skip
            out |= {json.dumps(m, sort_keys=True): why for m in task.metas[i:]}
            break
        try:
            out[name] = "ok" if check(meta) else "wrong result"
        except Exception as exc:  # compile errors are the tuner's to record, not ours
            out[name] = f"{type(exc).__name__}: {exc}"[:200]
    return task.ring, out, time.monotonic() - t0


def precompile(
    tasks: list[Task],
    jobs: int,
    progress: Callable[[str], None] | None = None,
    stop: float | None = None,
    checker: str = DEFAULT_CHECKER,
    no_launch: bool = False,
    cancel=None,
    finished: str | None = None,
) -> dict[tuple[str, str], str]:
    """Compile and check the ``tasks``' candidates in one pool of ``jobs`` processes (spawned,
    each with its own CUDA context on the current GPU), taken in order, none started after
    ``stop`` (a time.time()). ``checker``: ``module:function`` giving ``check(meta) -> bool``
    for a (spec, bucket). ``no_launch``: the pool's Triton launches compile only
    (``compile_only``; the checker is then a compiler, e.g. ``cuda_compiler``). ``cancel``: a
    threading.Event whose setting ends the pool (its processes are terminated) once the task
    under way comes back. ``finished``: a file naming variants whose studies are all done
    (``write_finished_variants``), whose tasks are then skipped. Returns ``{(variant, bucket
    key, json(meta)): outcome}``."""
    if jobs <= 1 or not tasks:
        return {}
    jobs = min(jobs, len(tasks))
    total = sum(len(t.metas) for t in tasks)
    rings = sorted({t.ring for t in tasks})
    left = {r: sum(t.ring == r for t in tasks) for r in rings}
    if progress:
        variants = len({t.spec.name for t in tasks})
        places = len({(t.spec.name, json.dumps(t.bucket, sort_keys=True)) for t in tasks})
        progress(
            f"compiling {total} candidates of {variants} variants at {places} buckets in "
            f"{jobs} processes "
            f"(start points and up to {max(rings)} steps around them, the first studies' "
            f"nearest first)"
        )
    t0 = time.monotonic()
    outcome: dict[tuple[str, str, str], str] = {}
    per_ring = dict.fromkeys(rings, 0)
    skipped_ring = dict.fromkeys(rings, 0)  # candidates of variants whose studies were done
    busy: dict[str, list[float]] = {}  # variant: [process seconds, candidates]
    passed = 0  # candidates skipped: their variant's studies were done
    ctx = multiprocessing.get_context("spawn")
    lock = ctx.Lock()
    with ctx.Pool(jobs, initializer=_one_thread, initargs=(no_launch, lock)) as pool:
        work = [(t, stop, checker, finished) for t in tasks]
        done = _results(pool.imap(_run, work), cancel)  # (cancelled: fewer than the tasks)
        for task, (ring, part, seconds) in zip(tasks, done, strict=False):
            if part is None:
                passed += len(task.metas)
                skipped_ring[ring] += len(task.metas)
                part = {}
            where = bucket_key(task.bucket)
            outcome.update({(task.spec.name, where, k): v for k, v in part.items()})
            spent = busy.setdefault(task.spec.name, [0.0, 0])
            spent[0] += seconds
            spent[1] += len(part)
            per_ring[ring] += len(part)
            left[ring] -= 1
            if progress and left[ring] == 0:
                where = "start points" if ring == 0 else f"{ring} step(s) from them"
                gone = skipped_ring[ring]
                progress(
                    f"  {where}: {per_ring[ring]} compiled"
                    + (f", {gone} skipped (their variant's studies were done)" if gone else "")
                    + f", {time.monotonic() - t0:.1f} s so far"
                )
    no_room = sum(v.startswith(NO_ROOM) for v in outcome.values())
    bad = sum(v != "ok" for v in outcome.values()) - no_room
    if progress:
        skipped = total - len(outcome) - passed
        if cancel is not None:
            why = f"; {skipped} not compiled: the trials ended first"
        else:
            why = f"; {skipped} left to the trials: the budget's half was spent"
        after = f"; {passed} skipped: their variant's studies were done" if passed else ""
        if no_room:
            after += f"; {no_room} left to the trials: no GPU memory to spare (POOL_RESERVE)"
        progress(
            f"  compiled {len(outcome) - no_room} ({bad} failed or wrong"
            f"{why if skipped else ''}{after}) in {time.monotonic() - t0:.1f} s"
        )
        slowest = sorted(busy.items(), key=lambda kv: -kv[1][0])[:5]
        progress(
            "  most process time: "
            + "; ".join(f"{name} {s:.0f} s for {n}" for name, (s, n) in slowest if n)
        )
        if bad:
            progress(f"  failed: {failure_kinds(outcome)}")
    sys.stderr.flush()
    return outcome


def failure_kinds(outcome: dict[tuple[str, str, str], str], kinds: int = 4) -> str:
    """The ``outcome``'s failures by kind, the commonest ``kinds`` first, each with the variants
    it hit most: ``"12 wrong result (3 a, 9 b); 5 PTXASError (5 b)"``. A kind is the exception's
    name (``building the problem: `` kept before it), or ``wrong result``; the candidates left to
    the trials for GPU memory (``NoRoom``) are not failures. A candidate the pool failed to
    compile for another reason than its own (out of memory, say) compiles in its trial."""
    counts: dict[str, collections.Counter] = {}
    for (variant, _, _), why in outcome.items():
        if why == "ok" or why.startswith(NO_ROOM):
            continue
        prefix = BUILDING if why.startswith(BUILDING) else ""
        kind = prefix + why[len(prefix) :].split(":", 1)[0]
        counts.setdefault(kind, collections.Counter())[variant] += 1
    order = sorted(counts.items(), key=lambda kv: (-sum(kv[1].values()), kv[0]))[:kinds]
    return "; ".join(
        f"{sum(c.values())} {kind} ("
        + ", ".join(f"{n} {name}" for name, n in c.most_common(2))
        + (", ..." if len(c) > 2 else "")
        + ")"
        for kind, c in order
    )


def _results(results, cancel, poll_s: float = 0.5):
    """The pool's ``results`` (an imap iterator) in order, until ``cancel`` (a threading.Event
    or None) is set: then none more (the pool's block, left, terminates its processes)."""
    while cancel is None or not cancel.is_set():
        try:
            yield results.next(timeout=poll_s)
        except multiprocessing.TimeoutError:
            continue
        except StopIteration:
            return


def compile_all(
    spec,
    bucket: dict[str, int],
    metas: list[dict],
    jobs: int,
    progress: Callable[[str], None] | None = None,
    checker: str = DEFAULT_CHECKER,
) -> dict[tuple[str, str, str], str]:
    """``precompile`` of the given candidates of one variant at one bucket (a benchmark's grid
    or sweep), in that order."""
    chunks = range(0, len(metas), CHUNK)
    tasks = [Task(spec, bucket, tuple(metas[i : i + CHUNK]), 0) for i in chunks]
    return precompile(tasks, jobs, progress=progress, checker=checker)
