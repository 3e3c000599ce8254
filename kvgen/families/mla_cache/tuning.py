"""What a tuning trial of the MLA cache store runs: the bench's rotated sets, launched with the
candidate's meta-parameters, checked byte for byte against the reference."""

from __future__ import annotations

import torch

from kvgen import _dtypes
from kvgen.codegen import load


def store_problem(spec, bucket, device):
    from kvgen.bench.store import mla_cache_cases
    from kvgen.formats import mla_cache

    dtype = _dtypes.TORCH[spec.in_dtype]
    case = next(mla_cache_cases(device, (bucket["num_tokens"],), spec.fmt, dtype))
    launch = load(spec).launch
    scale = torch.tensor([0.05], device=device)

    def as_launched(cache):
        return cache if spec.fmt == "auto" else cache.view(torch.uint8)

    def run(i, meta):
        kv, pe, cache, slots = case.data[i]
        launch(kv, pe, as_launched(cache), slots, scale, **meta)

    def check(meta):
        kv, pe, cache, slots = case.data[0]
        kv, pe = torch.randn_like(kv), torch.randn_like(pe)
        cache.zero_()
        launch(kv, pe, as_launched(cache), slots, scale, **meta)
        want = torch.zeros_like(cache, device="cpu")
        mla_cache.store(kv.cpu(), pe.cpu(), want, slots.cpu(), spec.fmt, scale.cpu())
        return torch.equal(cache.cpu(), want)

    return run, check, case.n_sets
