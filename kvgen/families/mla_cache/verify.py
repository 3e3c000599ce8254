"""``kvgen verify`` for the MLA cache store: edge-case rows into a poisoned, guarded paged cache
whose blocks are further apart than a block's rows, byte for byte against the reference."""

from __future__ import annotations

import torch

from kvgen import _dtypes
from kvgen.families.mla_cache import ConcatAndCacheMLASpec
from kvgen.verify import Result, guarded, make_slots

BLOCK_SIZE = 16
GAP_ROWS = 3  # other layers' rows between blocks


def edge_case_rows(tokens: int, latent: int, rope: int, dtype: torch.dtype, seed: int = 0):
    """(kv_c, k_pe): random rows with tiles over a wide range of magnitudes, an outlier
    channel, an all-zero tile, tiny (subnormal-scaled) values, fp8 rounding ties, a NaN and an
    infinity."""
    gen = torch.Generator().manual_seed(seed)
    kv_c = torch.randn(tokens, latent // 128, 128, generator=gen)
    span = 8 if dtype == torch.float16 else 20
    kv_c *= torch.exp2(torch.randint(-span, span + 1, (tokens, latent // 128, 1), generator=gen))
    kv_c = kv_c.reshape(tokens, latent)
    kv_c[0, 3] *= 300.0  # an outlier
    kv_c[1 % tokens, :128] = 0.0
    kv_c[2 % tokens, 128:256] = -0.0
    # e4m3 ties: 1 + 1/16 lies halfway between 1 and 1.125 (at scale 1: a tile whose peak
    # makes q a power of two)
    kv_c[3 % tokens, :128] = 1.0 + 2.0**-4
    kv_c[3 % tokens, 0] = 448.0 * 2.0**-6
    # non-finite input: the tile's scale NaN and codes 0 (fp8_ds_mla), the NaN code (fp8)
    kv_c[4 % tokens, 130] = float("nan")
    kv_c[5 % tokens, 400] = -float("inf")
    k_pe = torch.randn(tokens, rope, generator=gen) * 3.0
    return kv_c.to(dtype), k_pe.to(dtype)


def make_cache(spec, num_blocks: int, device):
    """A poisoned, guarded [num_blocks, BLOCK_SIZE, row] view with GAP_ROWS between blocks."""
    elem = _dtypes.TORCH[spec.in_dtype] if spec.fmt == "auto" else torch.uint8
    width = spec.row_bytes // elem.itemsize
    mem = guarded((num_blocks, BLOCK_SIZE + GAP_ROWS, width), elem, device)
    mem.view = mem.view[:, :BLOCK_SIZE]
    return mem


def verify_concat_and_cache_mla(spec, device) -> Result:
    from kvgen.formats import mla_cache
    from kvgen.ops import concat_and_cache_mla

    dtype = _dtypes.TORCH[spec.in_dtype]
    tokens, num_blocks = 37, 4
    kv_c, k_pe = edge_case_rows(tokens, spec.latent, spec.rope, dtype)
    # rows with a stride: the latent and RoPE parts of one [tokens, latent + rope] tensor
    both = torch.cat([kv_c, k_pe], dim=1).to(device)
    kv_c, k_pe = both[:, : spec.latent], both[:, spec.latent :]
    cache = make_cache(spec, num_blocks, device)
    want = cache.backing.cpu().clone()
    slots = make_slots(tokens, num_blocks * BLOCK_SIZE, device)
    k_scale = torch.tensor([0.03], device=device)
    concat_and_cache_mla(kv_c, k_pe, cache.view, slots, spec.fmt, k_scale)
    mla_cache.store(
        kv_c.cpu(), k_pe.cpu(), cache.rebuild(want), slots.cpu(), spec.fmt, k_scale.cpu()
    )
    got = cache.backing.cpu()
    mismatched = int((got != want).sum())
    return Result(spec.name, mismatched == 0, mismatched, float(mismatched), "")


def reference_rows(fmt: str, cache, slots, k_scale) -> torch.Tensor:
    """What ``gather_mla_cache`` returns, from the references: fp32 [len(slots), width] on
    the CPU, the rows of negative and out-of-range slots zeros."""
    from kvgen.formats import mla_cache

    cache = cache.cpu()
    num_blocks, block_size, row = cache.shape
    slots = slots.to(torch.int64).cpu()
    valid = (slots >= 0) & (slots < num_blocks * block_size)
    s = slots[valid]
    rows = cache.view(torch.uint8)[s // block_size, s % block_size]
    if fmt == "fp8_ds_mla":
        deq = mla_cache.dequantize_fp8_ds_mla(rows)
    else:
        deq = mla_cache.dequantize_fp8_per_tensor(rows, k_scale.cpu())
    out = torch.zeros(slots.shape[0], deq.shape[1])
    out[valid] = deq
    return out


def verify_gather_mla_cache(spec, device) -> Result:
    """Rows written by the reference store from edge-case rows (NaN and inf tiles, ties,
    zeros) into a guarded cache whose blocks are further apart than their rows, read back by
    slot (with skipped and out-of-range slots) against the reference; the cache untouched."""
    from kvgen.formats import mla_cache
    from kvgen.ops import gather_mla_cache

    tokens, num_blocks = 37, 4
    kv_c, k_pe = edge_case_rows(tokens, spec.latent, spec.rope, torch.float32)
    store = ConcatAndCacheMLASpec(spec.fmt, spec.latent, spec.rope, "fp32")
    cache = make_cache(store, num_blocks, "cpu")
    k_scale = torch.tensor([0.03])
    mla_cache.store(kv_c, k_pe, cache.view, torch.arange(tokens), spec.fmt, k_scale)
    slots = make_slots(tokens, num_blocks * BLOCK_SIZE, "cpu")
    out_dtype = _dtypes.TORCH[spec.dtype]
    want = reference_rows(spec.fmt, cache.view, slots, k_scale).to(out_dtype)
    backing = cache.backing.to(device)
    view = backing.as_strided(cache.view.shape, cache.view.stride(), cache.view.storage_offset())
    got = gather_mla_cache(
        view, slots.to(device), spec.fmt, k_scale.to(device), spec.latent, out_dtype
    ).cpu()
    same = (got == want) | (got.isnan() & want.isnan())
    mismatched = int((~same).sum())
    untouched = bool(torch.equal(backing.cpu(), cache.backing))
    return Result(
        spec.name,
        mismatched == 0 and untouched,
        mismatched,
        float(mismatched),
        "" if untouched else "cache modified by a reader",
    )
