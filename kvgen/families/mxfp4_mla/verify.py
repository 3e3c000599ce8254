"""``kvgen verify`` for the MXFP4 store and reader: edge-case latents into poisoned, guarded
caches, byte for byte against the reference."""

from __future__ import annotations

import math

import torch

from kvgen import _dtypes
from kvgen.codegen.spec import VariantSpec
from kvgen.formats import MXFP4, mxfp4
from kvgen.verify import GuardedCache, Result, make_cache, make_slots, num_slots_of


def edge_case_latents(
    tokens: int, latent: int, group: int, dtype: torch.dtype, seed: int = 0
) -> torch.Tensor:
    """``[tokens, latent]`` of ``dtype``: random rows plus rows built on the format's edges."""
    gen = torch.Generator().manual_seed(seed)
    groups = latent // group
    x = torch.randn(tokens, groups, group, generator=gen)
    # Per-group magnitudes over a wide range of powers of two, so scale bytes vary widely.
    finfo = torch.finfo(dtype)
    span = 8 if finfo.bits == 16 and finfo.max < 1e5 else 20  # fp16 overflows past 2^15
    x *= torch.exp2(torch.randint(-span, span + 1, (tokens, groups, 1), generator=gen).float())
    mids = torch.tensor(mxfp4.E2M1_MIDPOINTS)
    specials = []
    # Exact midpoints (ties go to the smaller magnitude), both signs, in a group whose peak is 6
    # (X = 127) and in one scaled by 2^5.
    tie = torch.zeros(group)
    tie[0] = 6.0
    ties = torch.cat([mids, -mids, mids + 2**-10, mids - 2**-10])
    tie[1 : 1 + min(group - 1, ties.numel())] = ties[: group - 1]
    specials += [tie, tie * 32.0, tie * 2.0**-9]
    # -0.0, tiny negatives that round to -0, tiny positives, at peak 6.
    signs = torch.tensor([6.0, -0.0, -0.1, 0.1, -0.2, 0.0, -6.0, 0.25, -0.25])
    specials.append(torch.cat([signs, torch.zeros(group)])[:group])
    specials.append(torch.zeros(group))  # all-zero group: scale byte 127
    specials.append(-torch.zeros(group))  # all -0.0: codes 0, scale 127
    big = finfo.max
    specials.append(torch.linspace(-1.0, 1.0, group) * big)  # huge magnitudes, up to the max
    tiny = finfo.smallest_normal
    specials.append(torch.linspace(-4, 4, group) * tiny)  # smallest normals
    sub = tiny * 2.0 ** -(finfo.bits // 8)  # subnormal inputs
    specials.append(torch.arange(group).float() * sub * (-1) ** torch.arange(group))
    # amax / 6 not a power of two; elements exactly on scaled midpoints
    odd = torch.zeros(group)
    odd[0] = 7.0
    odd[1 : min(group, 8)] = mids[: min(group, 8) - 1] * 2.0
    specials.append(odd)
    specials.append(torch.full((group,), 6.0 * 2.0**-126))  # q at the smallest normal
    # non-finite groups: scale byte 0xFF and codes 0, NaN when read
    for bad in ({1: float("nan")}, {0: float("inf")}, {2: -float("inf"), 5: float("nan")}):
        g = torch.randn(group, generator=gen)
        for i, v in bad.items():
            g[i] = v
        specials.append(g)

    flat = x.reshape(-1, group)
    for i, s in enumerate(specials):
        if i < flat.shape[0]:
            flat[i] = s
    x = flat.reshape(tokens, latent)
    return x.to(dtype)


def verify_store_mxfp4(spec: VariantSpec, device, tokens: int = 16, seed: int = 0) -> Result:
    from kvgen.ops import store_mxfp4_mla

    pitch = MXFP4.row_bytes(spec.latent, spec.group)
    x = edge_case_latents(tokens, spec.latent, spec.group, _dtypes.TORCH[spec.dtype], seed)
    x = x.to(device)
    num_slots = tokens * 2 + 5
    cache = make_cache(spec.layout, num_slots, pitch, device)
    slots = make_slots(tokens, num_slots_of(cache.view, pitch), device, seed=seed)
    expected = cache.fresh_copy()
    mxfp4.store(x, slots, expected.view, spec.group)
    store_mxfp4_mla(x, slots, cache.view, spec.group)
    diff = cache.backing != expected.backing
    mismatched = int(diff.sum())
    max_error = 0.0
    if mismatched:
        got = mxfp4.gather(cache.view, slots, spec.latent, spec.group)
        want = mxfp4.gather(expected.view, slots, spec.latent, spec.group)
        max_error = float((got - want).abs().nan_to_num(math.inf).max())
    return Result(spec.name, mismatched == 0, mismatched, max_error)


def verify_store_mxfp4_rope(spec: VariantSpec, device, tokens: int = 16, seed: int = 0) -> Result:
    """The store with ``k_pe``: edge-case latents and RoPE rows (bf16 ties, specials) into a
    poisoned, guarded cache of 400-byte-style rows, byte for byte against the reference."""
    from kvgen.formats import mla_cache
    from kvgen.ops import store_mxfp4_mla

    dtype = _dtypes.TORCH[spec.dtype]
    pitch = MXFP4.row_bytes(spec.latent, spec.group) + 2 * spec.rope
    x = edge_case_latents(tokens, spec.latent, spec.group, dtype, seed).to(device)
    gen = torch.Generator().manual_seed(seed + 1)
    k_pe = torch.randn(tokens, spec.rope, generator=gen) * 3.0
    k_pe[0, :4] = torch.tensor([1.00390625, 1.01171875, -0.0, 65504.0])  # bf16 ties, -0, big
    k_pe = k_pe.to(dtype).to(device)
    num_slots = tokens * 2 + 5
    cache = make_cache(spec.layout, num_slots, pitch, device)
    slots = make_slots(tokens, num_slots_of(cache.view, pitch), device, seed=seed)
    expected = cache.fresh_copy()
    mla_cache.store_mxfp4_rope(x, k_pe, slots, expected.view, spec.group)
    store_mxfp4_mla(x, slots, cache.view, spec.group, k_pe=k_pe)
    mismatched = int((cache.backing != expected.backing).sum())
    return Result(spec.name, mismatched == 0, mismatched, 0.0 if mismatched == 0 else math.inf)


def verify_gather_mxfp4(spec: VariantSpec, device, tokens: int = 48, seed: int = 0) -> Result:
    from kvgen.ops import gather_mxfp4_mla

    pitch = MXFP4.row_bytes(spec.latent, spec.group)
    x = edge_case_latents(tokens, spec.latent, spec.group, torch.float32, seed)
    num_slots = tokens * 2 + 5
    cache = make_cache(spec.layout, num_slots, pitch, "cpu")
    slots = make_slots(tokens, num_slots_of(cache.view, pitch), "cpu", seed=seed)
    mxfp4.store(x, slots, cache.view, spec.group)
    want = mxfp4.gather(cache.view, slots, spec.latent, spec.group)
    dev_cache = cache.fresh_copy()
    dev_cache = GuardedCache(dev_cache.backing.to(device), None)  # type: ignore[arg-type]
    view = dev_cache.backing.as_strided(
        cache.view.shape, cache.view.stride(), cache.view.storage_offset()
    )
    out_dtype = _dtypes.TORCH[spec.dtype]
    got = gather_mxfp4_mla(view, slots.to(device), spec.latent, spec.group, out_dtype).cpu()
    want = want.to(out_dtype)
    same = (got == want) | (got.isnan() & want.isnan())
    mismatched = int((~same).sum())
    err = (got.float() - want.float()).abs().nan_to_num(math.inf)
    max_error = float(err.max()) if err.numel() else 0.0
    untouched = bool((dev_cache.backing.cpu() == cache.backing).all())
    return Result(
        spec.name,
        mismatched == 0 and untouched,
        mismatched,
        max_error,
        "" if untouched else "cache modified by a reader",
    )


def verify_gather_mxfp4_rope(spec: VariantSpec, device, tokens: int = 48, seed: int = 0) -> Result:
    """The reader of rows with RoPE: rows written by the reference store (edge-case latents,
    RoPE rows with specials) read back against the reference reader; the cache untouched."""
    from kvgen.formats import mla_cache
    from kvgen.ops import gather_mxfp4_mla

    pitch = MXFP4.row_bytes(spec.latent, spec.group) + 2 * spec.rope
    x = edge_case_latents(tokens, spec.latent, spec.group, torch.float32, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    k_pe = torch.randn(tokens, spec.rope, generator=gen)
    k_pe[0, :4] = torch.tensor([float("nan"), float("inf"), -0.0, 3.0e38])
    num_slots = tokens * 2 + 5
    cache = make_cache(spec.layout, num_slots, pitch, "cpu")
    slots = make_slots(tokens, num_slots_of(cache.view, pitch), "cpu", seed=seed)
    mla_cache.store_mxfp4_rope(x, k_pe, slots, cache.view, spec.group)
    want = mla_cache.gather_mxfp4_rope(cache.view, slots, spec.latent, spec.group, spec.rope)
    backing = cache.backing.to(device)
    view = backing.as_strided(cache.view.shape, cache.view.stride(), cache.view.storage_offset())
    out_dtype = _dtypes.TORCH[spec.dtype]
    got = gather_mxfp4_mla(
        view, slots.to(device), spec.latent, spec.group, out_dtype, rope_dim=spec.rope
    ).cpu()
    want = want.to(out_dtype)
    same = (got == want) | (got.isnan() & want.isnan())
    mismatched = int((~same).sum())
    err = torch.where(same, 0.0, (got.float() - want.float()).abs().nan_to_num(math.inf))
    untouched = bool((backing.cpu() == cache.backing).all())
    return Result(
        spec.name,
        mismatched == 0 and untouched,
        mismatched,
        float(err.max()) if err.numel() else 0.0,
        "" if untouched else "cache modified by a reader",
    )
