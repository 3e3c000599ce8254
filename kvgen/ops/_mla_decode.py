"""FlashMLA-style decode attention: ``flash_mla_with_kvcache`` over kvgen's split-KV schedule."""

from __future__ import annotations

import torch

from kvgen import _dtypes, runtime
from kvgen.families.mla_decode import (
    MLADecodeDSMLASpec,
    MLADecodeFP8Spec,
    MLADecodeMXFP4Spec,
    MLADecodeSpec,
    widths_problem,
)
from kvgen.formats import MXFP4
from kvgen.formats.mla_cache import ds_mla_row_bytes, mxfp4_rope_row_bytes
from kvgen.ops import _checks as check
from kvgen.ops._library import define
from kvgen.ops._mla_choice import choose, module
from kvgen.ops._mla_metadata import METADATA_SIZE, MLASchedMeta

DS_MLA_ROW = ds_mla_row_bytes(512, 64)


MXFP4_GROUPS = MXFP4.groups


def _mxfp4_row(d: int, dv: int, group: int = 32) -> int:
    """Bytes of an MXFP4 row of latent ``dv`` with the RoPE part (d - dv) as bf16."""
    return mxfp4_rope_row_bytes(dv, group, d - dv)


KV_FORMATS = ("auto", "fp8", "fp8_ds_mla", "mxfp4")


def _kv_format(q, k, head_dim_v, kv_format: str, k_scale, mxfp4_group: int = 32) -> str:
    """The cache's format: ``kv_format``, or ("" ) inferred from the cache's dtype and row
    width; a ValueError / TypeError where the cache, the queries or k_scale do not fit it."""
    d = q.shape[3]
    if kv_format == "":
        if k.dtype == q.dtype:
            kv_format = "auto"
        elif k.dtype == torch.uint8 and k.shape[3] == DS_MLA_ROW:
            kv_format = "fp8_ds_mla"
        elif k.dtype == torch.uint8 and k.shape[3] == _mxfp4_row(d, head_dim_v, mxfp4_group):
            kv_format = "mxfp4"
        elif k.dtype == torch.float8_e4m3fn or (k.dtype == torch.uint8 and k.shape[3] == d):
            kv_format = "fp8"
        else:
            raise TypeError(
                f"k_cache {k.dtype} [..., {k.shape[3]}] is no cache format for q {q.dtype} "
                f"head_dim {d}: q's dtype (kv_format 'auto'), uint8 [..., {DS_MLA_ROW}] "
                f"('fp8_ds_mla') or float8_e4m3fn / uint8 [..., {d}] ('fp8', with k_scale)"
            )
    if kv_format not in KV_FORMATS:
        raise ValueError(f"kv_format must be one of {KV_FORMATS}, got {kv_format!r}")
    if kv_format == "mxfp4" and (
        (d, head_dim_v) not in ((576, 512), (512, 512))
        or k.dtype != torch.uint8
        or k.shape[3] != _mxfp4_row(d, head_dim_v, mxfp4_group)
    ):
        raise ValueError(
            f"MXFP4 rows (group {mxfp4_group}) are uint8 "
            f"[..., {_mxfp4_row(d, head_dim_v, mxfp4_group)}] bytes for "
            f"head_dim {d} / head_dim_v {head_dim_v} (576 / 512 with bf16 RoPE, or 512 / 512); "
            f"got k_cache {k.dtype} {tuple(k.shape)} (rows of another group: mxfp4_group=)"
        )
    if kv_format == "auto" and k.dtype != q.dtype:
        raise TypeError(f"k_cache must have q's dtype {q.dtype} (kv_format 'auto'); got {k.dtype}")
    if kv_format == "fp8_ds_mla" and (
        (d, head_dim_v, q.dtype) != (576, 512, torch.bfloat16)
        or k.dtype != torch.uint8
        or k.shape[3] != DS_MLA_ROW
    ):
        raise ValueError(
            f"fp8_ds_mla rows are uint8 [..., {DS_MLA_ROW}] bytes read by bf16 queries of "
            f"head_dim 576 and head_dim_v 512; got k_cache {k.dtype} {tuple(k.shape)}, q "
            f"{q.dtype} head_dim {d}, head_dim_v {head_dim_v}"
        )
    if kv_format == "fp8":
        if k.dtype not in (torch.uint8, torch.float8_e4m3fn) or k.shape[3] != d:
            raise ValueError(
                f"a per-tensor fp8 k_cache is float8_e4m3fn or uint8 [..., {d}]; got "
                f"{k.dtype} {tuple(k.shape)}"
            )
        if k_scale is None:
            raise ValueError("k_scale (the cache's fp32 per-tensor scale) is needed for fp8")
        check.dtype("k_scale", k_scale, (torch.float32,))
        if k_scale.numel() != 1:
            raise ValueError(f"k_scale must hold one value, got {k_scale.numel()}")
    return kv_format


def _check_decode(
    q, k, bt, sl, head_dim_v, meta, ns, scale, causal, pages, kv_format, k_scale, mxfp4_group=32
):
    """Every check of the decode that needs no data: (device, the cache's format), or an error."""
    if mxfp4_group not in MXFP4_GROUPS:
        raise ValueError(f"mxfp4_group must be one of {MXFP4_GROUPS}, got {mxfp4_group}")
    check.dtype("q", q, (torch.bfloat16, torch.float16))
    check.ndim("q", q, 4, "[batch, seq_len_q, num_heads_q, head_dim]")
    batch, s_q, h_q, d = q.shape
    if q.stride(3) != 1 or q.stride(2) != d or q.stride(1) != h_q * d:
        raise ValueError("q must be contiguous in its last three dimensions")
    check.ndim("k_cache", k, 4, "[num_blocks, page_block_size, num_heads_k, head_dim]")
    if k.shape[0] < 1 or k.shape[1] < 1:
        raise ValueError(
            f"k_cache needs at least one page of at least one row; got {tuple(k.shape)}"
        )
    fmt = _kv_format(q, k, head_dim_v, kv_format, k_scale, mxfp4_group)
    h_kv = k.shape[2]
    if h_kv < 1 or h_q % h_kv:
        raise ValueError(
            f"num_heads_k (k_cache's dim 2, {h_kv}) must divide num_heads_q ({h_q}): each "
            "query head reads its group's KV head"
        )
    if k.shape[3] != d and fmt not in ("fp8_ds_mla", "mxfp4"):
        raise ValueError(f"head_dim mismatch: q has {d}, k_cache has {k.shape[3]}")
    if k.stride(3) != 1:
        raise ValueError("k_cache must be contiguous in head_dim")
    if not 0 < head_dim_v <= d:
        raise ValueError(f"head_dim_v must be in 1..{d}, got {head_dim_v}")
    why = widths_problem(d, head_dim_v)
    if why:
        raise ValueError(why)
    check.table_and_lengths(bt, sl, batch)
    check.dtype("tile_scheduler_metadata", meta, (torch.int32,))
    if meta.ndim != 2 or meta.shape[1] != METADATA_SIZE or not meta.is_contiguous():
        raise ValueError(
            f"tile_scheduler_metadata must be a contiguous [num_sm_parts, "
            f"{METADATA_SIZE}] tensor from get_mla_metadata"
        )
    check.dtype("num_splits", ns, (torch.int32,))
    if tuple(ns.shape) != (batch + 1,):
        raise ValueError(
            f"num_splits has shape {tuple(ns.shape)}, not [{batch + 1}]: "
            "was the metadata computed for other seqlens?"
        )
    tensors = dict(
        q=q,
        k_cache=k,
        block_table=bt,
        cache_seqlens=sl,
        tile_scheduler_metadata=meta,
        num_splits=ns,
    )
    if k_scale is not None:
        tensors["k_scale"] = k_scale
    return check.same_device(**tensors), fmt


def _check_pages(k, bt, sl) -> None:
    """check_block_table: every page a sequence uses exists (reads the lengths: a sync)."""
    need = (sl.long() + k.shape[1] - 1) // k.shape[1]
    cols = torch.arange(bt.shape[1], device=bt.device)[None, :]
    used = cols < need[:, None]
    if bool((need > bt.shape[1]).any()):
        raise ValueError("block_table has fewer columns than some sequence needs")
    bad = used & ((bt < 0) | (bt >= k.shape[0]))
    if bool(bad.any()):
        b, c = (int(i) for i in bad.nonzero()[0])
        raise ValueError(
            f"block_table[{b}, {c}] = {int(bt[b, c])} is not a page of k_cache "
            f"(0..{k.shape[0] - 1})"
        )


def _run_decode(
    checked,
    q,
    k,
    bt,
    sl,
    head_dim_v,
    meta,
    ns,
    softmax_scale,
    causal,
    check_pages,
    _,
    k_scale,
    mxfp4_group=32,
):
    device, fmt = checked  # (fmt: the kv_format argument, resolved by the check)
    if check_pages:
        _check_pages(k, bt, sl)
    _, s_q, h_q, d = q.shape
    rows = s_q * h_q // k.shape[2]  # a KV head's query rows
    scale = softmax_scale if softmax_scale is not None else d**-0.5
    arch, target = runtime.target_of(device)
    dt = _dtypes.NAME[q.dtype]
    if fmt == "mxfp4":
        spec = choose(MLADecodeMXFP4Spec, d, head_dim_v, dt, arch, target, k, rows, mxfp4_group,
                      q=q)  # fmt: skip
    else:
        if fmt == "fp8":
            k = k.view(torch.uint8)
        cls = {"fp8_ds_mla": MLADecodeDSMLASpec, "fp8": MLADecodeFP8Spec}.get(fmt, MLADecodeSpec)
        spec = choose(cls, d, head_dim_v, dt, arch, target, k, rows, q=q)
    meta_p = runtime.meta_params(spec, rows=rows)
    if fmt == "fp8":
        meta_p["k_scale"] = k_scale
    return module(spec).launch(q, k, bt, sl, meta, ns, scale, causal, **meta_p)


def _fake_decode(device, q, k, bt, sl, head_dim_v, *rest):
    batch, s_q, h_q, _ = q.shape
    out = q.new_empty(batch, s_q, h_q, head_dim_v)
    return out, q.new_empty(batch, h_q, s_q, dtype=torch.float32)


_decode_op = define(
    "flash_mla_with_kvcache(Tensor q, Tensor k_cache, Tensor block_table, "
    "Tensor cache_seqlens, int head_dim_v, Tensor tile_scheduler_metadata, Tensor num_splits, "
    "float? softmax_scale, bool causal, bool check_block_table, str kv_format, Tensor? k_scale, "
    "int mxfp4_group=32) -> (Tensor, Tensor)",
    _check_decode,
    _run_decode,
    _fake_decode,
)


def flash_mla_with_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    block_table: torch.Tensor,
    cache_seqlens: torch.Tensor,
    head_dim_v: int,
    tile_scheduler_metadata: torch.Tensor | MLASchedMeta,
    num_splits: torch.Tensor | None = None,
    softmax_scale: float | None = None,
    causal: bool = False,
    *,
    check_block_table: bool = False,
    kv_format: str | None = None,
    is_fp8_kvcache: bool = False,
    k_scale: torch.Tensor | None = None,
    mxfp4_group: int = 32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """MLA decode attention with FlashMLA's arguments and results.

    Args:
        q: [batch, seq_len_q, num_heads_q, head_dim] bf16 or fp16.
        k_cache: [num_blocks, page_block_size, num_heads_k, head_dim], q's dtype; its first
            head_dim_v channels are also V. Any page size from 1 to 256; num_heads_k (1 for
            DeepSeek's MLA) divides num_heads_q, and query head h reads KV head
            h // (num_heads_q // num_heads_k).
        block_table: [batch, max_num_blocks_per_seq] int32.
        cache_seqlens: [batch] int32.
        head_dim_v: width of V (512 for DeepSeek's 576-wide cache).
        tile_scheduler_metadata, num_splits: from ``get_mla_metadata(cache_seqlens,
            seq_len_q * num_heads_q // num_heads_k, num_heads_k)``; or, FlashMLA's newer form,
            the ``MLASchedMeta`` of ``get_mla_metadata()`` and None: the first call fills it
            from these lengths and shapes, and later calls reuse it (for the same lengths).
        softmax_scale: default 1 / sqrt(head_dim).
        causal: the seq_len_q queries are the sequence's last positions (speculative decoding).
        check_block_table: also check that every page a sequence uses exists (costs a sync).
        kv_format: the cache's format (docs/formats.md): "auto" (q's dtype), "fp8_ds_mla"
            (uint8, 656-byte rows: 576 / 512, bf16 queries), "fp8" (per tensor: float8_e4m3fn
            or uint8 codes of every channel, with ``k_scale``); default: inferred from the
            cache's dtype and row width. ``is_fp8_kvcache=True`` (FlashMLA's spelling) is
            "fp8_ds_mla". "mxfp4": uint8 MXFP4 rows with the RoPE part as bf16 (group 32: 400
            bytes for 576 / 512, as ``store_mxfp4_mla(..., k_pe=)`` writes them; 272 for the
            rope-free 512 / 512). K and V are dequantized on chip, never written back.
        k_scale: the per-tensor fp8 cache's scale, a 1-element fp32 tensor.
        mxfp4_group: the MXFP4 rows' scale group (16, 32 or 64; default 32).

    Returns:
        out [batch, seq_len_q, num_heads_q, head_dim_v] (q's dtype) and lse [batch,
        num_heads_q, seq_len_q] fp32 (natural log). A query that sees no key (a sequence of
        length 0, or a causal row before its first key) gets out 0 and lse +inf, as FlashMLA's.

    The op is ``torch.ops.kvgen.flash_mla_with_kvcache``.
    """
    if isinstance(tile_scheduler_metadata, MLASchedMeta):
        if num_splits is not None:
            raise ValueError("num_splits must be None with the MLASchedMeta of get_mla_metadata()")
        tile_scheduler_metadata, num_splits = tile_scheduler_metadata.schedule(
            q, k_cache, cache_seqlens, bool(causal)
        )
    elif num_splits is None:
        raise TypeError(
            "num_splits is None: pass get_mla_metadata(cache_seqlens, ...)'s two tensors, or "
            "get_mla_metadata()'s MLASchedMeta"
        )
    if is_fp8_kvcache:
        if kv_format not in (None, "fp8_ds_mla"):
            raise ValueError(f"is_fp8_kvcache=True is kv_format 'fp8_ds_mla', not {kv_format!r}")
        kv_format = "fp8_ds_mla"
    if kv_format is not None and not isinstance(kv_format, str):
        raise TypeError(f"kv_format must be a str, got {type(kv_format).__name__}")
    if k_scale is not None and not isinstance(k_scale, torch.Tensor):
        raise TypeError(f"k_scale must be a torch.Tensor, got {type(k_scale).__name__}")
    if softmax_scale is not None:
        softmax_scale = float(softmax_scale)
    return _decode_op(
        q,
        k_cache,
        block_table,
        cache_seqlens,
        head_dim_v,
        tile_scheduler_metadata,
        num_splits,
        softmax_scale,
        bool(causal),
        bool(check_block_table),
        kv_format or "",
        k_scale,
        mxfp4_group,
    )
