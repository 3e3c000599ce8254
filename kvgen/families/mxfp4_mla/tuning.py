"""What a tuning trial of the MXFP4 store and reader runs: the bench's rotated sets, launched
with the candidate's meta-parameters, checked byte for byte against the reference."""

from __future__ import annotations

import torch

from kvgen import _dtypes
from kvgen.codegen import load


def store_problem(spec, bucket, device):
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


def gather_problem(spec, bucket, device):
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
