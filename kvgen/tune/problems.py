"""What a trial runs on the GPU: the family's tuning problem (inputs for a (variant, bucket), a
launch with the candidate's meta-parameters, a check against the reference), timed with CUDA
graphs on rotated buffers."""

from __future__ import annotations

import torch

from kvgen import registry
from kvgen.bench import harness
from kvgen.tune.tuner import TrialFailed


def tunable(spec) -> bool:
    """Whether ``spec``'s family has a tuning problem."""
    return registry.family(spec.family).tunable


def problem(spec, bucket, device):
    """``(run(i, meta), check(meta) -> bool, n_sets)``: the family's tuning problem."""
    return registry.family(spec.family).tuning_problem(spec, bucket, torch.device(device))


def gpu_evaluator(spec, bucket, device="cuda"):
    """``evaluate(meta) -> us``: check against the reference, then time with CUDA graphs.
    ``evaluate.seconds`` adds up where the wall time went: ``check`` (the first launch
    compiles, unless compiled ahead), ``timing``."""
    import time

    run, check, n_sets = problem(spec, bucket, device)
    seconds = {"check": 0.0, "timing": 0.0}

    def evaluate(meta):
        t0 = time.perf_counter()
        ok = check(meta)
        t1 = time.perf_counter()
        seconds["check"] += t1 - t0
        if not ok:
            raise TrialFailed("wrong result")
        # Size the graph to the kernel: at least ~0.5 ms of work per graph and ~20 ms per
        # timed trial, so that a 1 ms decode does not cost seconds per candidate.
        est = harness.eager_time_us(lambda i: run(i, meta), n_sets, iters=max(1, n_sets))
        calls = max(n_sets, min(32, int(500 / max(est, 1e-3)) + 1))
        replays = max(2, min(10, int(20_000 / (calls * max(est, 1e-3))) + 1))
        us = harness.graph_time_us(
            lambda i: run(i, meta), n_sets, calls=calls, replays=replays, trials=5
        )
        seconds["timing"] += time.perf_counter() - t1
        return us

    evaluate.seconds = seconds
    return evaluate
