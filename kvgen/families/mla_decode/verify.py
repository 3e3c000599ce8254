"""``kvgen verify`` for the MLA decode: unequal lengths (0 and 1 included), random page order
and causal rows against the float64 reference, on pages the variant's launcher accepts."""

from __future__ import annotations

import math

import torch

from kvgen import _dtypes
from kvgen.verify import Result, compare_attention
from kvgen.verify import block_table as _block_table


def verify_mla_decode(spec, device, seed: int = 0) -> Result:
    """Decode against the float64 reference: unequal lengths (0 and 1 included), random page
    order, causal speculative rows. ``max_error`` is the relative error of ``out``."""
    from kvgen.codegen import load
    from kvgen.formats.mla_decode import mla_decode
    from kvgen.ops import get_mla_metadata

    gen = torch.Generator().manual_seed(seed)
    seqlens, s_q, h_q = [70, 0, 1, 130], 2, 3
    module, meta_p = load(spec), spec.default_meta(rows=s_q * h_q)
    dtype = _dtypes.TORCH[spec.dtype]
    # Pages of 16 keys, or the smallest size above that the variant's launcher accepts (its
    # check_cache).
    page = next(
        p
        for p in (16, math.lcm(16, meta_p["block_n"]))
        if _accepts(module, torch.empty(1, p, 1, spec.head_dim, dtype=dtype), meta_p)
    )
    blocks, table = _block_table(seqlens, page, gen)
    k = torch.randn(blocks, page, 1, spec.head_dim, generator=gen).to(dtype)
    q = torch.randn(len(seqlens), s_q, h_q, spec.head_dim, generator=gen).to(dtype)
    sl = torch.tensor(seqlens, dtype=torch.int32)
    meta, splits = get_mla_metadata(sl.to(device), s_q * h_q, 1)
    out, lse = module.launch(
        q.to(device),
        k.to(device),
        table.to(device),
        sl.to(device),
        meta,
        splits,
        spec.head_dim**-0.5,
        True,
        **meta_p,
    )
    ref_out, ref_lse = mla_decode(q, k, table, sl, spec.head_dim_v, causal=True)
    return _compare(spec, out, lse, ref_out, ref_lse)  # (no key: lse +inf, FlashMLA's)


def _accepts(module, k_cache, meta_p) -> bool:
    try:
        module.check_cache(k_cache, meta_p["block_n"])
    except ValueError:
        return False
    return True


def verify_quantized_decode(spec, device, seed: int = 0) -> Result:
    """The decode over a quantized cache (``spec``'s kv_format: fp8_ds_mla or per-tensor fp8)
    written by kvgen's store, against the float64 reference over the dequantized cache (as the
    decode reads it: rounded to the queries' dtype): unequal lengths (0 and 1 included), random
    page order, causal rows. ``max_error`` is the relative error of ``out``."""
    from kvgen.formats import mla_cache
    from kvgen.formats.mla_decode import mla_decode
    from kvgen.ops import concat_and_cache_mla, flash_mla_with_kvcache, get_mla_metadata

    fmt = spec.derived()["kv_format"]
    dtype = _dtypes.TORCH[spec.dtype]
    gen = torch.Generator().manual_seed(seed)
    seqlens, s_q, h_q, page = [70, 0, 1, 130], 2, 3, 16
    rows_variant = spec.variant == "rows"  # (one query a sequence, pages of 64: its launcher)
    if rows_variant:
        s_q, page = 1, spec.derived()["tile"]
    blocks, table = _block_table(seqlens, page, gen)
    kv_c = torch.randn(blocks * page, 512, generator=gen).to(dtype)
    k_pe = torch.randn(blocks * page, 64, generator=gen).to(dtype)
    row = mla_cache.ds_mla_row_bytes() if fmt == "fp8_ds_mla" else 576
    cache = torch.zeros(blocks, page, 1, row, dtype=torch.uint8, device=device)
    slots = torch.arange(blocks * page, device=device)
    k_scale = torch.tensor([0.02], device=device)
    concat_and_cache_mla(kv_c.to(device), k_pe.to(device), cache, slots, fmt, k_scale)
    rows = cache.cpu().reshape(-1, row)
    if fmt == "fp8_ds_mla":
        deq = mla_cache.dequantize_fp8_ds_mla(rows)
    else:
        deq = mla_cache.dequantize_fp8_per_tensor(rows, k_scale.cpu())
    deq = deq.to(dtype).reshape(blocks, page, 1, 576)
    q = torch.randn(len(seqlens), s_q, h_q, 576, generator=gen).to(dtype)
    sl = torch.tensor(seqlens, dtype=torch.int32)
    meta, splits = get_mla_metadata(sl.to(device), s_q * h_q, 1)
    scale = k_scale if fmt == "fp8" else None
    if rows_variant:  # the variant itself (the op takes it only where tuned faster)
        from kvgen.codegen import load

        out, lse = load(spec).launch(q.to(device), cache, table.to(device), sl.to(device), meta,
                                     splits, 576**-0.5, True, **spec.default_meta(h_q))  # fmt: skip
    else:
        args = (q.to(device), cache, table.to(device), sl.to(device), 512, meta, splits)
        out, lse = flash_mla_with_kvcache(*args, causal=True, kv_format=fmt, k_scale=scale)
    ref_out, ref_lse = mla_decode(q, deq.double(), table, sl, 512, causal=True)
    return _compare(spec, out, lse, ref_out, ref_lse)


def _compare(spec, out, lse, ref_out, ref_lse) -> Result:
    passed, rel, detail = compare_attention(out, lse, ref_out, ref_lse)
    return Result(spec.name, passed, 0 if passed else 1, rel, detail)


def verify_mxfp4_decode(spec, device, seed: int = 0) -> Result:
    """The decode over MXFP4 rows (the reference quantizer's bytes: kvgen's MXFP4 store writes
    the rope-free row byte for byte) against the float64 reference over the dequantized cache:
    unequal lengths (0 and 1 included), random page order, causal rows."""
    from kvgen.formats import mla_cache, mxfp4
    from kvgen.formats.mla_decode import mla_decode
    from kvgen.ops import flash_mla_with_kvcache, get_mla_metadata

    dtype = _dtypes.TORCH[spec.dtype]
    rope = spec.head_dim - spec.head_dim_v
    gen = torch.Generator().manual_seed(seed)
    seqlens, s_q, h_q, page = [70, 0, 1, 130], 2, 3, 16
    blocks, table = _block_table(seqlens, page, gen)
    kv_c = torch.randn(blocks * page, 512, generator=gen).to(dtype)
    if rope:
        k_pe = torch.randn(blocks * page, rope, generator=gen).to(dtype)
        rows = mla_cache.quantize_mxfp4_rope(kv_c, k_pe)
        deq = mla_cache.dequantize_mxfp4_rope(rows)
    else:
        rows = mxfp4.quantize_rows(kv_c, 32)
        deq = mxfp4.dequantize_rows(rows, 512, 32)
    cache = rows.reshape(blocks, page, 1, -1).to(device)
    deq = deq.to(dtype).reshape(blocks, page, 1, spec.head_dim)
    q = torch.randn(len(seqlens), s_q, h_q, spec.head_dim, generator=gen).to(dtype)
    sl = torch.tensor(seqlens, dtype=torch.int32)
    meta, splits = get_mla_metadata(sl.to(device), s_q * h_q, 1)
    args = (q.to(device), cache, table.to(device), sl.to(device), 512, meta, splits)
    out, lse = flash_mla_with_kvcache(*args, causal=True, kv_format="mxfp4")
    ref_out, ref_lse = mla_decode(q, deq.double(), table, sl, 512, causal=True)
    return _compare(spec, out, lse, ref_out, ref_lse)
