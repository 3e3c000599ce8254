"""What a trial runs on the GPU: inputs for a (variant, bucket), a launch with the candidate's
meta-parameters, a check against the reference, and a CUDA-graph timing on rotated buffers."""

from __future__ import annotations

import torch

from kvgen import _dtypes
from kvgen.bench import harness
from kvgen.codegen import load
from kvgen.tune.tuner import TrialFailed


def _mxfp4_store(spec, bucket, device):
    from kvgen.bench.store import BLOCK_SIZE, mxfp4_cases
    from kvgen.formats import mxfp4

    case = next(
        mxfp4_cases(
            device, (bucket["num_tokens"],), spec.latent, spec.group, _dtypes.TORCH[spec.in_dtype]
        )
    )
    sets = case.data  # the bench's rotated (latents, slots, cache) sets
    launch = load(spec).launch

    def run(i, meta):
        x, slots, cache = sets[i]
        launch(x, slots, cache, cache.shape[0] * BLOCK_SIZE, BLOCK_SIZE, cache.stride(0), **meta)

    def check(meta):
        x, slots, cache = sets[0]
        x = torch.randn_like(x)
        cache.fill_(0xFF)
        launch(x, slots, cache, cache.shape[0] * BLOCK_SIZE, BLOCK_SIZE, cache.stride(0), **meta)
        want = torch.full(cache.shape, 0xFF, dtype=torch.uint8)
        mxfp4.store(x.cpu(), slots.cpu(), want, spec.group)
        return torch.equal(cache.cpu(), want)

    return run, check, case.n_sets


def _mxfp4_gather(spec, bucket, device):
    from kvgen.bench.store import BLOCK_SIZE, mxfp4_gather_cases
    from kvgen.formats import mxfp4

    t = bucket["num_tokens"]
    dtype = _dtypes.TORCH[spec.out_dtype]
    case = next(mxfp4_gather_cases(device, (t,), spec.latent, spec.group, dtype))
    # the bench's rotated (filled cache, slots) sets, each with an output buffer
    sets = [
        (cache, slots, torch.empty(t, spec.latent, dtype=dtype, device=device))
        for cache, slots in case.data
    ]
    launch = load(spec).launch

    def run(i, meta):
        cache, slots, out = sets[i]
        launch(cache, slots, out, cache.shape[0] * BLOCK_SIZE, BLOCK_SIZE, cache.stride(0), **meta)

    def check(meta):
        cache, slots, out = sets[0]
        out.fill_(float("nan"))
        launch(cache, slots, out, cache.shape[0] * BLOCK_SIZE, BLOCK_SIZE, cache.stride(0), **meta)
        want = mxfp4.gather(cache.cpu(), slots.cpu(), spec.latent, spec.group).to(dtype)
        return torch.equal(out.cpu(), want)

    return run, check, case.n_sets


def _kv_store(spec, bucket, device):
    from kvgen.bench.store import kv_cases

    fmt = "int4" if spec.family == "store_kv_int4_per_token_head" else spec.fmt
    if fmt == "int4" and spec.channels != 32:
        raise TrialFailed("the tuning problem builds int4 caches with 32 channels per scale")
    case = next(
        kv_cases(
            device,
            (bucket["num_tokens"],),
            fmt,
            bucket["num_heads"],
            spec.head_size,
            _dtypes.TORCH[spec.in_dtype],
        )
    )
    launch = load(spec).launch
    sets = case.data  # the rotated (k, v, caches, scales, slots) sets

    def run(i, meta):
        launch(*sets[i], **meta)

    def check(meta):
        from kvgen.formats import per_token_head as ref

        k, v, kc, vc, ks, vs, slots = sets[0]
        n = min(k.shape[0], 4096)
        k, v, slots = torch.randn_like(k[:n]), torch.randn_like(v[:n]), slots[:n]
        launch(k, v, kc, vc, ks, vs, slots, **meta)
        want = [x.cpu().clone() for x in (kc, vc, ks, vs)]
        ref.store(k.cpu(), v.cpu(), *want, slots.cpu())
        got = [x.cpu() for x in (kc, vc, ks, vs)]
        return all(
            torch.equal(g.view(torch.uint8), w.view(torch.uint8))
            for g, w in zip(got, want, strict=True)
        )

    return run, check, case.n_sets


def _mla_decode(spec, bucket, device):
    """FlashMLA's headline batch (128 x 4096, page 64) with ``rows`` query heads, and the bench's
    mixed lengths (1 to 16384, the same total KV): a trial's time is the mean of the two, so a
    config that only suits equal lengths does not win. Each trial builds the schedules its
    ``split_factor`` asks for (outside the timed graph)."""
    from kvgen.bench import decode
    from kvgen.formats.mla_decode import mla_decode
    from kvgen.ops._mla_decode import schedule_policy
    from kvgen.ops._mla_metadata import num_sm_parts, schedule

    rows = bucket["rows"]
    equal = [decode.SEQLEN] * decode.BATCH
    mixed = decode.mixed_lengths(sum(equal), decode.BATCH)
    dtype = _dtypes.TORCH[spec.dtype]
    problems = [decode._make(lengths, rows, device, dtype) for lengths in (equal, mixed)]
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    launch = load(spec).launch
    scale = spec.head_dim**-0.5
    q, k, table, sl = problems[0]
    sub = slice(0, 2)  # the float64 reference runs on the CPU: checked on two sequences
    ref, _ = mla_decode(q[sub].cpu(), k.cpu(), table[sub].cpu(), sl[sub].cpu(), spec.head_dim_v)
    schedules = {}

    def sched(m, which, seqlens):
        key = (m["split_factor"], which)
        if key not in schedules:
            parts = num_sm_parts(sms, rows, 1, m["split_factor"])
            schedules[key] = schedule(seqlens, parts, schedule_policy(spec.variant))
        return schedules[key]

    def run(i, m):
        q, k, table, sl = problems[i]
        launch(q, k, table, sl, *sched(m, i, sl), scale, False, **m)

    def check(m):
        for i, (_, _, _, seqlens) in enumerate(problems):
            sched(m, i, seqlens)  # built here, before run() is captured in a graph
        out, _ = launch(
            q[sub], k, table[sub], sl[sub], *sched(m, "check", sl[sub]), scale, False, **m
        )
        return bool((out.cpu().double() - ref).norm() / ref.norm() < 1e-2)

    return run, check, len(problems)


_BUILDERS = {
    "mla_decode": _mla_decode,
    "store_mxfp4_mla": _mxfp4_store,
    "gather_mxfp4_mla": _mxfp4_gather,
    "store_kv_per_token_head": _kv_store,
    "store_kv_int4_per_token_head": _kv_store,
}


def tunable(family: str) -> bool:
    return family in _BUILDERS


def builder(family: str):
    """``build(spec, bucket, device) -> (run(i, meta), check(meta) -> bool, n_sets)``."""
    return _BUILDERS[family]


def gpu_evaluator(spec, bucket, device="cuda"):
    """``evaluate(meta) -> us``: check against the reference, then time with CUDA graphs."""
    run, check, n_sets = _BUILDERS[spec.family](spec, bucket, torch.device(device))

    def evaluate(meta):
        if not check(meta):
            raise TrialFailed("wrong result")
        # Size the graph to the kernel: at least ~0.5 ms of work per graph and ~20 ms per
        # timed trial, so that a 1 ms decode does not cost seconds per candidate.
        est = harness.eager_time_us(lambda i: run(i, meta), n_sets, iters=max(1, n_sets))
        calls = max(n_sets, min(32, int(500 / max(est, 1e-3)) + 1))
        replays = max(2, min(10, int(20_000 / (calls * max(est, 1e-3))) + 1))
        return harness.graph_time_us(
            lambda i: run(i, meta), n_sets, calls=calls, replays=replays, trials=5
        )

    return evaluate
