"""Paged GQA decode attention: ``flash_attn_with_kvcache`` over the per-token-head caches."""

from __future__ import annotations

from functools import cache

import torch

from kvgen import _dtypes, configs, runtime
from kvgen._math import cdiv
from kvgen.families.gqa_decode import (
    INT4_GROUPS,
    ROWS_OFFERED,
    VARIANTS,
    GQADecodeSpec,
    available,
    sizes_problem,
    spec_for,
)
from kvgen.families.per_token_head import row_align
from kvgen.ops import _checks as check
from kvgen.ops._library import define
from kvgen.ops._mla_choice import module, spec_or_none, tuned_winner

#: cache code dtype -> format (kvgen.formats' names); uint8 is packed int4
_FORMATS = {dt: fmt for fmt, dt in _dtypes.CACHE.items()}


def _cache_format(q: torch.Tensor, k: torch.Tensor) -> str:
    if k.dtype == q.dtype:
        return "auto"
    if k.dtype in _FORMATS:
        return _FORMATS[k.dtype]
    raise TypeError(
        f"k_cache has dtype {k.dtype}: a cache is q's dtype {q.dtype} (no scales), int8, "
        "float8_e4m3fn or float8_e5m2 (fp32 scale caches) or uint8 (packed int4, fp16 scales)"
    )


def _check_paged(name, t, like=None):
    check.ndim(name, t, 4, "[num_blocks, block_size, num_kv_heads, head]")
    if t.shape[0] < 1 or t.shape[1] < 1:
        raise ValueError(
            f"{name} needs at least one block (dim 0) of at least one row (dim 1); got "
            f"{tuple(t.shape)}"
        )
    if t.shape[3] > 1 and t.stride(3) != 1:
        raise ValueError(f"{name} must have a unit stride in its last dimension")
    if like is not None and t.shape[:3] != like.shape[:3]:
        raise ValueError(
            f"{name} has [num_blocks, block_size, num_kv_heads] {tuple(t.shape[:3])} but k_cache "
            f"has {tuple(like.shape[:3])}"
        )


def _check_scale(name, s, like, groups: int | None, dtype):
    if s is None:
        raise ValueError(f"{name} is needed for a {like.dtype} cache (its scales)")
    check.tensor(name, s)
    if s.dtype != dtype:
        raise TypeError(f"{name} must have dtype {dtype} for a {like.dtype} cache; got {s.dtype}")
    want = (*like.shape[:3], *(() if groups is None else (groups,)))
    if tuple(s.shape) != want:
        raise ValueError(f"{name} must have shape {want}; got {tuple(s.shape)}")


def _check_decode(q, k, v, sl, bt, softmax_scale, causal, ks, vs):
    """Every check that needs no data: (device, format, head_size_v, int4 group)."""
    check.dtype("q", q, (torch.bfloat16, torch.float16))
    check.ndim("q", q, 4, "[batch, seq_len_q, num_heads_q, head_size]")
    batch, s_q, h_q, d = q.shape
    if q.stride(3) != 1 or q.stride(2) != d or q.stride(1) != h_q * d:
        raise ValueError("q must be contiguous in its last three dimensions")
    _check_paged("k_cache", k)
    _check_paged("v_cache", v, like=k)
    fmt = _cache_format(q, k)
    if v.dtype != k.dtype:
        raise TypeError(f"v_cache must have k_cache's dtype {k.dtype}; got {v.dtype}")
    h_kv = k.shape[2]
    if h_kv < 1 or h_q % h_kv:
        raise ValueError(
            f"num_kv_heads (k_cache's dim 2, {h_kv}) must divide num_heads_q ({h_q}): query "
            "head h reads KV head h // (num_heads_q // num_kv_heads)"
        )
    group = 0
    if fmt == "int4":
        if k.shape[3] != cdiv(d, 2):
            raise ValueError(
                f"a packed int4 k_cache holds ceil(head_size / 2) = {cdiv(d, 2)} bytes a head "
                f"for q's head_size {d}; got {k.shape[3]}"
            )
        dv = 2 * v.shape[3]
        if ks is None:
            raise ValueError("k_scale_cache is needed for a uint8 (int4) cache (its scales)")
        check.ndim("k_scale_cache", ks, 4, "[num_blocks, block_size, num_kv_heads, groups]")
        group = next((c for c in INT4_GROUPS if cdiv(d, c) == ks.shape[3]), 0)
        if not group:
            raise ValueError(
                f"k_scale_cache has {ks.shape[3]} scales a head: head_size {d} has "
                + ", ".join(f"{cdiv(d, c)} at {c} channels a scale" for c in INT4_GROUPS)
            )
        _check_scale("k_scale_cache", ks, k, cdiv(d, group), torch.float16)
        _check_scale("v_scale_cache", vs, v, cdiv(dv, group), torch.float16)
    else:
        if k.shape[3] != d:
            raise ValueError(f"head_size mismatch: q has {d}, k_cache has {k.shape[3]}")
        dv = v.shape[3]
        if fmt == "auto":
            for name, s in (("k_scale_cache", ks), ("v_scale_cache", vs)):
                if s is not None:
                    raise ValueError(f"{name} must be None for a {k.dtype} cache (it has none)")
        else:
            _check_scale("k_scale_cache", ks, k, None, torch.float32)
            _check_scale("v_scale_cache", vs, v, None, torch.float32)
    why = sizes_problem(d, dv)
    if why:
        raise ValueError(why)
    check.table_and_lengths(bt, sl, batch)
    if bt.shape[1] > 0 and bt.stride(1) != 1:
        raise ValueError("block_table must have a unit stride in its last dimension")
    tensors = dict(q=q, k_cache=k, v_cache=v, cache_seqlens=sl, block_table=bt)
    if fmt != "auto":
        tensors |= dict(k_scale_cache=ks, v_scale_cache=vs)
    return check.same_device(**tensors), fmt, dv, group


@cache
def num_sms(device: torch.device) -> int:
    """The device's SMs (the interpreter: 8, so that small batches are split too)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 8


def bucket(spec, rows: int, align: int) -> dict[str, int]:
    """The sizes ``spec``'s tuned entries are keyed by: ``rows`` (query rows a KV head); for the
    rows variant also ``align``, a row_align (the caches' own: ``row_align(k, v)``; vLLM's
    inline-scale rows have configs of their own)."""
    return {"rows": rows, "row_align": align} if spec.variant == "rows" else {"rows": rows}


#: the row_align the variants' tuned times are compared at (``GQADecodeSpec.compared_at``):
#: 16-byte rows, where every variant is tuned (the portable variant has no row_align bucket:
#: its times are of separate scale caches, and a rows variant's inline-row time is not
#: comparable to them)
COMPARED_ALIGN = GQADecodeSpec.compared_at["row_align"]


def choose(q, k, v, bt, fmt, dv, group, arch, target, rows, ks=None, vs=None):
    """Of the variants that apply to this call, the one tuning measured fastest at ``rows``; the
    Hopper variant (rows) only where kvgen offers it for the format (``ROWS_OFFERED``), it has
    been tuned on this arch (tuning checks every candidate against the reference on the GPU),
    its spec exists and its launcher accepts the
    tensors (``accepts``: up to 8 queries a sequence, at most 16 query rows a KV head, rows at
    multiples of 4 bytes, an int4 form's scale caches ``ks``, ``vs``, ...); the portable one
    otherwise."""
    fields = (q.shape[3], dv, _dtypes.NAME[q.dtype], fmt, group)

    def compared(spec):
        return bucket(spec, rows, COMPARED_ALIGN)

    portable = spec_or_none(GQADecodeSpec, *fields, "portable", arch, target)
    if portable is None:  # (the checks ran: say why in the spec's words)
        spec_for(*fields, arch, target)
    others = [
        spec
        for variant in VARIANTS
        if variant != "portable" and available(variant, arch, target)
        if variant != "rows" or fmt in ROWS_OFFERED
        for spec in [spec_or_none(GQADecodeSpec, *fields, variant, arch, target)]
        # (untuned: never chosen, so its module is not even loaded)
        if spec is not None and configs.tuned_time(spec, **compared(spec)) is not None
        if module(spec).accepts(q, k, v, bt, ks, vs) is None
    ]
    return tuned_winner(portable, others, rows, compared)


def chosen_spec(q, k_cache, v_cache, *, cache_seqlens, block_table, k_scale_cache=None,
                v_scale_cache=None):  # fmt: skip
    """The spec (variant) ``flash_attn_with_kvcache`` runs for these arguments (after the same
    checks): e.g. for ``kvgen bench`` to say which variant it timed."""
    checked = _check_decode(q, k_cache, v_cache, cache_seqlens, block_table, None, False,
                            k_scale_cache, v_scale_cache)  # fmt: skip
    device, fmt, dv, group = checked
    arch, target = runtime.target_of(device)
    rows = q.shape[1] * q.shape[2] // k_cache.shape[2]
    return choose(q, k_cache, v_cache, block_table, fmt, dv, group, arch, target, rows,
                  k_scale_cache, v_scale_cache)  # fmt: skip


def _run(checked, q, k, v, sl, bt, softmax_scale, causal, ks, vs):
    device, fmt, dv, group = checked
    batch, s_q, h_q, d = q.shape
    rows = s_q * h_q // k.shape[2]
    arch, target = runtime.target_of(device)
    spec = choose(q, k, v, bt, fmt, dv, group, arch, target, rows, ks, vs)
    meta_p = runtime.meta_params(spec, **bucket(spec, rows, row_align(k, v)))
    scale = softmax_scale if softmax_scale is not None else d**-0.5
    launch = module(spec).launch
    return launch(q, k, v, ks, vs, bt, sl, scale, causal, num_sms=num_sms(device), **meta_p)


def _fake(checked, q, k, v, *rest):
    _, _, dv, _ = checked
    batch, s_q, h_q, _ = q.shape
    return q.new_empty(batch, s_q, h_q, dv), q.new_empty(batch, h_q, s_q, dtype=torch.float32)


_decode_op = define(
    "flash_attn_with_kvcache(Tensor q, Tensor k_cache, Tensor v_cache, Tensor cache_seqlens, "
    "Tensor block_table, float? softmax_scale, bool causal, Tensor? k_scale_cache, "
    "Tensor? v_scale_cache) -> (Tensor, Tensor)",
    _check_decode,
    _run,
    _fake,
)


def flash_attn_with_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    *,
    cache_seqlens: torch.Tensor,
    block_table: torch.Tensor,
    softmax_scale: float | None = None,
    causal: bool = False,
    return_softmax_lse: bool = False,
    k_scale_cache: torch.Tensor | None = None,
    v_scale_cache: torch.Tensor | None = None,
):
    """Paged decode attention over a per-token-head cache, with FlashAttention's names.

    Args:
        q: [batch, seq_len_q, num_heads_q, head_size] bf16 or fp16.
        k_cache: [num_blocks, block_size, num_kv_heads, head_size], v_cache: [...,
            head_size_v], as kvgen's per-token-head stores write them: q's dtype (no scales);
            int8, float8_e4m3fn or float8_e5m2 codes with fp32 scale caches; uint8 packed int4
            ([..., ceil(head_size / 2)]) with fp16 group scales. Any strides with a unit last
            stride: NHD, HND as a permuted view, vLLM's inline-scale rows as
            ``cache[..., :head_size]`` views. num_kv_heads divides num_heads_q; query head h
            reads KV head h // (num_heads_q // num_kv_heads).
        cache_seqlens: [batch] int32, the keys of each sequence.
        block_table: [batch, max_num_blocks_per_seq] int32.
        softmax_scale: default 1 / sqrt(head_size).
        causal: the seq_len_q queries are the sequence's last positions (speculative decoding).
        return_softmax_lse: also return lse.
        k_scale_cache, v_scale_cache: int8 / fp8: fp32 [num_blocks, block_size, num_kv_heads];
            int4: fp16 [..., ceil(head_size / C)] (C, the channels a scale, 16 / 32 / 64 / 128,
            follows from the shape); None for a cache in q's dtype.

    Returns:
        out [batch, seq_len_q, num_heads_q, head_size_v] (q's dtype), and with
        ``return_softmax_lse`` also lse [batch, num_heads_q, seq_len_q] fp32 (natural log). A
        query that sees no key gets out 0 and lse +inf. A sequence whose block table names a
        page outside the cache, or that is longer than its table row holds, is not read past
        it: its out and lse are NaN.

    The format follows from the caches' dtypes and the scales' shapes; K and V are dequantized
    on chip. Each sequence's keys are cut into as many pieces as the shapes call for to fill
    the GPU (from the batch, heads and the block table's width: no host sync, and a CUDA graph
    replays right for any lengths), merged by a second kernel. The op is
    ``torch.ops.kvgen.flash_attn_with_kvcache``.
    """
    for name, t in (("k_scale_cache", k_scale_cache), ("v_scale_cache", v_scale_cache)):
        if t is not None and not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor or None, got {type(t).__name__}")
    if softmax_scale is not None:
        softmax_scale = float(softmax_scale)
    out, lse = _decode_op(
        q,
        k_cache,
        v_cache,
        cache_seqlens,
        block_table,
        softmax_scale,
        bool(causal),
        k_scale_cache,
        v_scale_cache,
    )
    return (out, lse) if return_softmax_lse else out
