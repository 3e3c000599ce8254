"""``kvgen verify`` for the GQA decode, and the caches its tests, tuning and bench read: the
per-token-head caches in every layout a caller has (NHD, HND as a permuted view, vLLM's rows
with the scale inline in pad bytes), written by kvgen's stores or the formats' references."""

from __future__ import annotations

import math

import torch

from kvgen import _dtypes
from kvgen._math import cdiv
from kvgen.verify import Result, block_table, compare_attention

LAYOUTS = ("nhd", "hnd", "inline")


def alloc_caches(kv, group, shape, d, dv, dtype, device, layout):
    """(k_cache, v_cache, k_scales, v_scales) for ``shape`` = (blocks, page, kv_heads), empty
    (0xFF bytes where quantized: what was never written reads as NaN / -1 codes)."""
    blocks, page, h = shape
    if kv == "auto":
        code_dtype, widths, scale = dtype, (d, dv), None
    elif kv == "int4":
        code_dtype, widths = torch.uint8, (cdiv(d, 2), cdiv(dv, 2))
        scale = (torch.float16, (cdiv(d, group), cdiv(dv, group)))
    else:
        code_dtype, widths = _dtypes.CACHE[kv], (d, dv)
        scale = (torch.float32, (None, None))
    if layout == "inline":  # vLLM: (blocks, 2, page, heads, row) bytes, K and V the two halves
        from kvgen.families.per_token_head.verify import inline_row, inline_views

        if kv == "auto" or d != dv:
            raise ValueError(
                "the inline layout holds quantized caches with head_size_v == head_size"
            )
        groups = scale[1][0]
        _, row = inline_row(widths[0], groups)
        raw = torch.full((blocks, 2, page, h, row), 0xFF, dtype=torch.uint8, device=device)
        return inline_views(raw, widths[0], groups, code_dtype, scale[0])

    def make(width, dt):  # 0xFF bytes, in the layout's memory order
        mem = (blocks, h, page, *width) if layout == "hnd" else (blocks, page, h, *width)
        t = torch.full((math.prod(mem) * dt.itemsize,), 0xFF, dtype=torch.uint8, device=device)
        t = t.view(dt).view(mem)
        return t.permute(0, 2, 1, *range(3, len(mem))) if layout == "hnd" else t

    k, v = make((widths[0],), code_dtype), make((widths[1],), code_dtype)
    if scale is None:
        return k, v, None, None
    sdt, groups = scale
    ks = make(() if groups[0] is None else (groups[0],), sdt)
    vs = make(() if groups[1] is None else (groups[1],), sdt)
    return k, v, ks, vs


def make_caches(kv, group, keys, values, page, device, *, layout="nhd", writer="store",
                dtype=torch.bfloat16, dequantize=True):  # fmt: skip
    """The caches of format ``kv`` (``group``: int4's channels a scale) holding token i of
    ``keys`` [tokens, kv_heads, head_size] / ``values`` [..., head_size_v] at slot i (tokens a
    multiple of ``page``), in ``layout``, written by kvgen's stores (``writer="store"``) or the
    formats' reference stores (``"reference"``, the same bytes); returns ``(k_cache, v_cache,
    k_scales, v_scales, k_deq, v_deq)``, the last two the fp32 caches the decode attends over
    (dequantized from the written bytes; None without ``dequantize``)."""
    from kvgen.formats import per_token_head
    from kvgen.formats.gqa_decode import dequantize_cache

    tokens, h, d = keys.shape
    dv = values.shape[2]
    shape = (tokens // page, page, h)
    k, v, ks, vs = alloc_caches(kv, group, shape, d, dv, dtype, device, layout)
    if kv == "auto":
        k.copy_(keys.reshape(*shape, d).to(dtype))
        v.copy_(values.reshape(*shape, dv).to(dtype))
        if not dequantize:
            return k, v, None, None, None, None
        return k, v, None, None, k.float().cpu(), v.float().cpu()
    slots = torch.arange(tokens, device=device)
    if writer == "store":
        from kvgen.ops import store_kv_int4_per_token_head, store_kv_per_token_head

        store = store_kv_int4_per_token_head if kv == "int4" else store_kv_per_token_head
        store(keys.to(dtype).to(device), values.to(dtype).to(device), k, v, ks, vs, slots)
    else:
        per_token_head.store(keys.to(dtype), values.to(dtype), k, v, ks, vs, slots)
    if not dequantize:
        return k, v, ks, vs, None, None
    k_deq = dequantize_cache(k.cpu(), ks.cpu(), d)
    v_deq = dequantize_cache(v.cpu(), vs.cpu(), dv)
    return k, v, ks, vs, k_deq, v_deq


def verify_gqa_decode(spec, device, seed: int = 0) -> Result:
    """``spec``'s decode over caches of its format written by kvgen's stores, against the
    float64 reference over the dequantized caches, with unequal lengths (0 and 1 included) and
    random page order. The portable variant through the op: causal speculative rows, two query
    heads a KV head. A variant the op takes only where it applies and was tuned (rows: one
    query a sequence) through its own launcher: lengths around its 64-key tiles, four query
    heads a KV head. ``max_error`` is the relative error of ``out``."""
    from kvgen.codegen import load
    from kvgen.formats.gqa_decode import gqa_decode
    from kvgen.ops import flash_attn_with_kvcache

    portable = spec.variant == "portable"
    gen = torch.Generator().manual_seed(seed)
    if portable:
        seqlens, s_q, h_q, h_kv, page = [70, 0, 1, 130], 2, 4, 2, 16
    else:
        seqlens, s_q, h_q, h_kv, page = [70, 0, 1, 130, 64, 257], 1, 8, 2, 16
    blocks, table = block_table(seqlens, page, gen)
    dtype = _dtypes.TORCH[spec.dtype]
    keys = torch.randn(blocks * page, h_kv, spec.head_size, generator=gen)
    values = torch.randn(blocks * page, h_kv, spec.head_size_v, generator=gen)
    # kvgen's stores on a GPU; under the interpreter the reference stores (the same bytes,
    # which the stores' own verification holds them to), to keep the CPU run short
    writer = "store" if torch.device(device).type == "cuda" else "reference"
    k, v, ks, vs, k_deq, v_deq = make_caches(
        spec.kv, spec.group, keys, values, page, device, writer=writer, dtype=dtype
    )
    q = torch.randn(len(seqlens), s_q, h_q, spec.head_size, generator=gen).to(dtype)
    sl = torch.tensor(seqlens, dtype=torch.int32)
    qd, table_d, sl_d = q.to(device), table.to(device), sl.to(device)
    if portable:
        out, lse = flash_attn_with_kvcache(
            qd, k, v, cache_seqlens=sl_d, block_table=table_d, causal=True,
            return_softmax_lse=True, k_scale_cache=ks, v_scale_cache=vs,
        )  # fmt: skip
    else:
        out, lse = load(spec).launch(
            qd, k, v, ks, vs, table_d, sl_d, spec.head_size**-0.5, False,
            **spec.default_meta(rows=h_q // h_kv),
        )  # fmt: skip
    ref_out, ref_lse = gqa_decode(q, k_deq, v_deq, table, sl, causal=portable)
    passed, rel, detail = compare_attention(out, lse, ref_out, ref_lse)
    return Result(spec.name, passed, 0 if passed else 1, rel, detail)
