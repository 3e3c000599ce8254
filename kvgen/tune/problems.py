"""What a trial runs on the GPU: the family's tuning problem (inputs for a (variant, bucket), a
launch with the candidate's meta-parameters, a check against the reference), timed with CUDA
graphs on rotated buffers."""

from __future__ import annotations

import hashlib

import torch

from kvgen import registry
from kvgen.bench import harness
from kvgen.space import bucket_key
from kvgen.tune.tuner import TrialFailed


def tunable(spec) -> bool:
    """Whether ``spec``'s family has a tuning problem."""
    return registry.family(spec.family).tunable


def problem(spec, bucket, device):
    """``(run(i, meta), check(meta) -> bool, n_sets)``: the family's tuning problem, its random
    inputs (values, slots, sequence lengths) drawn from ``problem_seed(spec, bucket)``, so that
    every process builds the same problem for a (variant, bucket): a worker that resumes a
    study on another host, the compile processes and ``benchmarks/compare_tuned.py`` time the
    inputs the study's trials were timed on. torch's random state is left as it was."""
    device = torch.device(device)
    cuda = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=cuda):
        torch.manual_seed(problem_seed(spec, bucket))
        return registry.family(spec.family).tuning_problem(spec, bucket, device)


def problem_seed(spec, bucket) -> int:
    """The seed of ``spec``'s tuning problem at ``bucket``: from the variant's name and the
    bucket, the same in every process (Python's own hash of a string is not)."""
    digest = hashlib.sha256(f"{spec.name}@{bucket_key(bucket)}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1  # (manual_seed takes up to 2^63 - 1)


# The GPU time a trial's graph replays before it is timed (``harness.graph_time_us``'s
# settle_ms), KVGEN_TUNE_TRIAL_SETTLE_MS to override. A trial follows others of its study (the
# same kernel on the same problem: a like load), and the configs within 10 % of a study's best
# are timed again after it (``evaluate.confirm``, which ``tuner.confirm`` uses): the first of a
# run of re-timings with the bench's full settle, since what ran before it may be anything
# (another study, another process), the ones after it, which follow a timing of the same
# problem, as trials settle. The settle is most of a microsecond store's timing.
TRIAL_SETTLE_MS = 10.0


def gpu_evaluator(spec, bucket, device="cuda"):
    """``evaluate(meta) -> us``: check against the reference, then time with CUDA graphs
    (settling ``TRIAL_SETTLE_MS``); ``evaluate.confirm(meta)`` times the same way, the first of
    a run of such calls with the bench's full settle (``harness.SETTLE_MS``). A config is
    checked and its graph sized once an evaluator: a re-timing of a config this evaluator has
    timed goes straight to its graph's timing.
    ``evaluate.seconds`` adds up where the wall time went:
    ``first check`` (the reference is made there, once a problem), ``check`` (the others: a
    config's first launch in this process compiles, unless compiled ahead, or loads its
    binary), ``sizing`` (an eager timing that sizes the graph), ``timing`` (the graph's
    capture, settle and timed replays)."""
    import os
    import time

    run, check, n_sets = problem(spec, bucket, device)
    seconds = {"first check": 0.0, "check": 0.0, "sizing": 0.0, "timing": 0.0}
    listen_to_compiles()
    drop_ptx_dumps()  # (a failed compile is the trial's failure, ptxas' lines its reason)
    start, start_s = dict(COMPILES), COMPILE_SECONDS[0]
    counts = dict.fromkeys(COMPILES, 0)  # this problem's: kernels compiled / found cached
    compiling = [0.0]  # this problem's seconds of Triton compiling (within check and timing)
    checked = []

    def tally():
        counts.update({k: v - start[k] for k, v in COMPILES.items()})
        compiling[0] = COMPILE_SECONDS[0] - start_s

    trial_settle = float(os.environ.get("KVGEN_TUNE_TRIAL_SETTLE_MS", TRIAL_SETTLE_MS))

    last = ["trial"]  # what this evaluator timed last: a "trial" or a "confirm"
    # the configs this evaluator has checked (right) and sized: point -> (calls, replays); a
    # re-timing of one of them neither checks it again nor sizes its graph again
    sized: dict[tuple, tuple[int, int]] = {}

    def timed(meta, settle_ms):
        point = tuple(sorted(meta.items()))
        t0 = time.perf_counter()
        if point in sized:
            calls, replays = sized[point]
        else:
            ok = check(meta)
            seconds["check" if checked else "first check"] += time.perf_counter() - t0
            checked.append(1)
            tally()
            if not ok:
                raise TrialFailed("wrong result")
            t0 = time.perf_counter()
            # Size the graph to the kernel: at least ~0.5 ms of work per graph and ~20 ms per
            # timed trial, so that a 1 ms decode does not cost seconds per candidate.
            est = harness.eager_time_us(lambda i: run(i, meta), n_sets, iters=max(1, n_sets))
            calls = max(n_sets, min(32, int(500 / max(est, 1e-3)) + 1))
            replays = max(2, min(10, int(20_000 / (calls * max(est, 1e-3))) + 1))
            seconds["sizing"] += time.perf_counter() - t0
            sized[point] = calls, replays
        t1 = time.perf_counter()
        us = harness.graph_time_us(
            lambda i: run(i, meta), n_sets, calls=calls, replays=replays, trials=5,
            settle_ms=settle_ms,
        )  # fmt: skip
        seconds["timing"] += time.perf_counter() - t1
        tally()  # (a timed set's launch may be a binary of its own)
        return us

    def evaluate(meta):
        last[0] = "trial"
        return timed(meta, trial_settle)

    def confirm(meta):
        settle = trial_settle if last[0] == "confirm" else harness.SETTLE_MS
        last[0] = "confirm"
        return timed(meta, settle)

    evaluate.confirm = confirm
    evaluate.seconds = seconds
    evaluate.counts = counts
    evaluate.compiling = compiling
    return evaluate


COMPILES = {"compiled": 0, "cached": 0}  # this process's Triton compiles, once listened to
COMPILE_SECONDS = [0.0]  # and the seconds its compiles (not the cache hits) took


def listen_to_compiles() -> None:
    """Count this process's Triton compiles in ``COMPILES`` from now on (``compiled``: built
    here; ``cached``: found in Triton's cache on disk, e.g. compiled ahead by another process)
    and the seconds the compiles took in ``COMPILE_SECONDS``, through Triton's compilation
    listener (chained to one already set; installed once)."""
    from triton import knobs

    before = knobs.compilation.listener
    if getattr(before, "kvgen_counts", False):
        return

    def listen(*, src, metadata, metadata_group, times, cache_hit):
        COMPILES["cached" if cache_hit else "compiled"] += 1
        if not cache_hit and times is not None:
            COMPILE_SECONDS[0] += times.total / 1e6  # (microseconds)
        if before is not None:
            before(src=src, metadata=metadata, metadata_group=metadata_group, times=times,
                   cache_hit=cache_hit)  # fmt: skip

    listen.kvgen_counts = True
    knobs.compilation.listener = listen


def drop_ptx_dumps() -> None:
    """In this process, Triton's message for a kernel that ptxas cannot assemble (e.g. a
    candidate that needs more registers than its ``maxnreg``) is not printed: it holds the
    kernel's whole PTX, thousands of lines a candidate in a tune's log. The PTXASError raised
    after it still carries ptxas' own lines, which the tuner records as the trial's failure.
    Everything else Triton's CUDA backend prints is printed as before."""
    import builtins

    from triton.backends.nvidia import compiler

    def quiet_print(*args, **kwargs):
        if any("please share the reproducer" in str(a) for a in args):
            return
        builtins.print(*args, **kwargs)

    compiler.print = quiet_print
