"""Compile a study's candidates in parallel before it times them one by one.

Timing must be serial (one kernel on the GPU at a time), but compiling is CPU work: Triton
compiles each meta-parameter set once and keeps the binary in its on-disk cache, which every
process on the machine shares. ``precompile`` runs the trial problem's correctness check (which
compiles and launches) for many candidates in ``jobs`` worker processes; the tuning process then
finds them compiled. Results are identical with or without it: only the wall time changes.
"""

from __future__ import annotations

import json
import multiprocessing
import sys
import time
from collections.abc import Callable


def _one_thread() -> None:
    """Many compile processes at once: one CPU thread each for torch (the reference checks),
    or their thread pools oversubscribe the cores and everything crawls."""
    import torch

    torch.set_num_threads(1)


def _worker(spec, bucket, metas: list[dict], stop: float | None = None) -> dict[str, str]:
    import torch

    from kvgen.tune import problems

    run, check, _ = problems.problem(spec, bucket, torch.device("cuda"))
    del run
    out = {}
    for meta in metas:
        if stop is not None and time.time() >= stop:  # the rest compiles when a trial needs it
            break
        key = json.dumps(meta, sort_keys=True)
        try:
            out[key] = "ok" if check(meta) else "wrong result"
        except Exception as exc:  # compile errors are the tuner's to record, not ours
            out[key] = f"{type(exc).__name__}: {exc}"[:200]
    torch.cuda.synchronize()
    return out


def precompile(
    spec,
    bucket: dict[str, int],
    metas: list[dict],
    jobs: int,
    progress: Callable[[str], None] | None = None,
    stop: float | None = None,
) -> dict[str, str]:
    """Compile and check ``metas`` for ``spec`` at ``bucket`` in ``jobs`` processes (spawned,
    each with its own CUDA context on the current GPU), none started after ``stop`` (a
    time.time()). Returns ``{json(meta): outcome}``."""
    if jobs <= 1 or not metas:
        return {}
    jobs = min(jobs, len(metas))
    chunks = [metas[i::jobs] for i in range(jobs)]
    if progress:
        progress(f"compiling {len(metas)} candidates of {spec.name} in {jobs} processes")
    ctx = multiprocessing.get_context("spawn")
    t0 = time.monotonic()
    outcome: dict[str, str] = {}
    with ctx.Pool(jobs, initializer=_one_thread) as pool:
        for part in pool.starmap(_worker, [(spec, bucket, c, stop) for c in chunks]):
            outcome.update(part)
    bad = sum(v != "ok" for v in outcome.values())
    if progress:
        progress(
            f"  compiled {len(outcome)} ({bad} failed or wrong) in {time.monotonic() - t0:.1f} s"
        )
    sys.stderr.flush()
    return outcome
