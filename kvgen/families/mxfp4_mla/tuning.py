"""What a tuning trial of the MXFP4 store and reader runs: the bench's rotated sets, launched
with the candidate's meta-parameters, checked byte for byte against the reference over a
prefix of at most ``CHECK_TOKENS`` tokens (the reference runs on the CPU)."""

from __future__ import annotations

import functools

import torch

from kvgen import _dtypes
from kvgen.bench.store import CHECK_TOKENS
from kvgen.codegen import load


def _paged(tensors: tuple, cache: torch.Tensor) -> tuple:
    """A launch's arguments: the tensors, then the paged cache's geometry (slots, block size,
    block stride)."""
    from kvgen.bench.store import BLOCK_SIZE

    return (*tensors, cache.shape[0] * BLOCK_SIZE, BLOCK_SIZE, cache.stride(0))


def _runner(launch, args: list[tuple]):
    def run(i, meta):
        launch(*args[i], **meta)

    return run


def store_problem(spec, bucket, device):
    from kvgen.bench.store import mxfp4_cases
    from kvgen.formats import mxfp4

    dtype = _dtypes.TORCH[spec.dtype]
    case = next(mxfp4_cases(device, (bucket["num_tokens"],), spec.latent, spec.group, dtype))
    launch = load(spec).launch
    # the bench's rotated (latents, slots, cache) sets
    args = [_paged((x, slots, cache), cache) for x, slots, cache in case.data]

    x0, slots, cache = case.data[0]
    x, slots = torch.randn_like(x0[:CHECK_TOKENS]), slots[:CHECK_TOKENS]  # not the timed data

    def reference():
        want = torch.full(cache.shape, 0xFF, dtype=torch.uint8)
        mxfp4.store(x.cpu(), slots.cpu(), want, spec.group)
        return want.to(cache.device)

    want = functools.cache(reference)

    def check(meta):
        cache.fill_(0xFF)
        launch(*_paged((x, slots, cache), cache), **meta)
        return torch.equal(cache, want())

    return _runner(launch, args), check, case.n_sets


def gather_problem(spec, bucket, device):
    from kvgen.bench.store import mxfp4_gather_cases
    from kvgen.formats import mxfp4

    t = bucket["num_tokens"]
    dtype = _dtypes.TORCH[spec.dtype]
    case = next(mxfp4_gather_cases(device, (t,), spec.latent, spec.group, dtype))
    # the bench's rotated (filled cache, slots) sets, each with an output buffer
    args = [
        _paged((cache, slots, torch.empty(t, spec.latent, dtype=dtype, device=device)), cache)
        for cache, slots in case.data
    ]
    launch = load(spec).launch

    cache, slots, out = args[0][:3]
    slots, out = slots[:CHECK_TOKENS], out[:CHECK_TOKENS]
    want = functools.cache(
        lambda: mxfp4.gather(cache.cpu(), slots.cpu(), spec.latent, spec.group).to(dtype).to(device)
    )

    def check(meta):
        out.fill_(float("nan"))
        launch(*_paged((cache, slots, out), cache), **meta)
        return torch.equal(out, want())

    return _runner(launch, args), check, case.n_sets


def store_rope_problem(spec, bucket, device):
    """The store with ``k_pe`` (paged, the bench's block size): rotated (latents, RoPE rows,
    slots, cache) sets, checked byte for byte against the reference."""
    from kvgen._math import cdiv
    from kvgen.bench import harness
    from kvgen.bench.store import BLOCK_SIZE
    from kvgen.formats import MXFP4, mla_cache

    t = bucket["num_tokens"]
    dtype = _dtypes.TORCH[spec.dtype]
    pitch = MXFP4.row_bytes(spec.latent, spec.group) + 2 * spec.rope
    blocks = cdiv(t, BLOCK_SIZE) + 1
    n_sets = harness.sets_for(
        t * (spec.latent + spec.rope) * dtype.itemsize + blocks * BLOCK_SIZE * pitch
    )
    data = [
        (
            torch.randn(t, spec.latent, device=device).to(dtype),
            torch.randn(t, spec.rope, device=device).to(dtype),
            torch.randperm(blocks * BLOCK_SIZE, device=device)[:t],
            torch.zeros(blocks, BLOCK_SIZE, pitch, dtype=torch.uint8, device=device),
        )
        for _ in range(n_sets)
    ]
    launch = load(spec).launch
    args = [_paged(d, d[-1]) for d in data]

    _, _, slots, cache = data[0]
    slots = slots[:CHECK_TOKENS]
    n = slots.shape[0]
    x = torch.randn(n, spec.latent, device=device).to(dtype)  # not the timed sets' data
    pe = torch.randn(n, spec.rope, device=device).to(dtype)

    def reference():
        want = torch.full(cache.shape, 0xFF, dtype=torch.uint8)
        mla_cache.store_mxfp4_rope(x.cpu(), pe.cpu(), slots.cpu(), want, spec.group)
        return want.to(device)

    want = functools.cache(reference)

    def check(meta):
        cache.fill_(0xFF)
        launch(*_paged((x, pe, slots, cache), cache), **meta)
        return torch.equal(cache, want())

    return _runner(launch, args), check, n_sets


def gather_rope_problem(spec, bucket, device):
    """The reader of rows with RoPE: rotated (filled cache, slots, output) sets, the cache
    written by the store with ``k_pe``, checked against the reference."""
    from kvgen._math import cdiv
    from kvgen.bench import harness
    from kvgen.bench.store import BLOCK_SIZE
    from kvgen.formats import MXFP4, mla_cache
    from kvgen.ops import store_mxfp4_mla

    t = bucket["num_tokens"]
    dtype = _dtypes.TORCH[spec.dtype]
    width = spec.latent + spec.rope
    pitch = MXFP4.row_bytes(spec.latent, spec.group) + 2 * spec.rope
    blocks = cdiv(t, BLOCK_SIZE) + 1
    n_sets = harness.sets_for(t * width * dtype.itemsize + blocks * BLOCK_SIZE * pitch)
    args = []
    for _ in range(n_sets):
        cache = torch.zeros(blocks, BLOCK_SIZE, pitch, dtype=torch.uint8, device=device)
        slots = torch.randperm(blocks * BLOCK_SIZE, device=device)[:t]
        x = torch.randn(t, spec.latent, device=device)
        store_mxfp4_mla(x, slots, cache, spec.group, k_pe=torch.randn(t, spec.rope, device=device))
        out = torch.empty(t, width, dtype=dtype, device=device)
        args.append(_paged((cache, slots, out), cache))
    launch = load(spec).launch

    cache, slots, out = args[0][:3]
    slots, out = slots[:CHECK_TOKENS], out[:CHECK_TOKENS]
    want = functools.cache(
        lambda: (
            mla_cache.gather_mxfp4_rope(cache, slots, spec.latent, spec.group, spec.rope)
            .to(dtype)
            .to(device)
        )
    )

    def check(meta):
        out.fill_(float("nan"))
        launch(*_paged((cache, slots, out), cache), **meta)
        return torch.equal(out, want())

    return _runner(launch, args), check, n_sets
