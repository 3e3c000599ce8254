"""What a tuning trial of the MLA cache store runs: the bench's rotated sets, launched with the
candidate's meta-parameters, checked byte for byte against the reference."""

from __future__ import annotations

import functools

import torch

from kvgen import _dtypes
from kvgen.codegen import load


def store_problem(spec, bucket, device):
    from kvgen.bench.store import mla_cache_cases, poison
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

    kv0, pe0, cache, slots = case.data[0]
    kv, pe = torch.randn_like(kv0), torch.randn_like(pe0)  # not the timed sets' data

    def reference():
        want = torch.empty_like(cache, device="cpu")
        poison(want)
        mla_cache.store(kv.cpu(), pe.cpu(), want, slots.cpu(), spec.fmt, scale.cpu())
        return want.to(device)

    want = functools.cache(reference)

    def check(meta):
        poison(cache)
        launch(kv, pe, as_launched(cache), slots, scale, **meta)
        return torch.equal(cache.view(torch.uint8), want().view(torch.uint8))

    return run, check, case.n_sets


def gather_problem(spec, bucket, device):
    """The reader over the store's bench sets (caches filled by ``concat_and_cache_mla``), each
    read back by its slots into an output buffer, checked against the reference."""
    from kvgen.bench.store import mla_cache_cases
    from kvgen.families.mla_cache.verify import reference_rows
    from kvgen.ops import concat_and_cache_mla

    t = bucket["num_tokens"]
    dtype = _dtypes.TORCH[spec.dtype]
    case = next(mla_cache_cases(device, (t,), spec.fmt, torch.bfloat16))
    launch = load(spec).launch
    scale = torch.tensor([0.05], device=device)
    sets = []
    for kv, pe, cache, slots in case.data:
        concat_and_cache_mla(kv, pe, cache, slots, spec.fmt, scale)
        out = torch.empty(t, spec.latent + spec.rope, dtype=dtype, device=device)
        sets.append((cache.view(torch.uint8), slots, scale, out))

    def run(i, meta):
        launch(*sets[i], **meta)

    cache, slots, _, out = sets[0]

    @functools.cache
    def want():  # the reference's rows, made once for every candidate (the cache is only read)
        return reference_rows(spec.fmt, cache, slots, scale).to(dtype).to(device)

    def check(meta):
        out.fill_(float("nan"))
        launch(*sets[0], **meta)
        w = want()
        return bool(((out == w) | (out.isnan() & w.isnan())).all())

    return run, check, case.n_sets
