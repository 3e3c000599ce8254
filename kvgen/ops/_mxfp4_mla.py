"""The MXFP4 MLA latent store (vLLM's ``store_mxfp4_mla``) and its reader."""

from __future__ import annotations

from functools import cache

import torch

from kvgen import _dtypes, runtime
from kvgen.codegen import load
from kvgen.families.mxfp4_mla import (
    GROUPS,
    ROPES,
    GatherMXFP4MLASpec,
    GatherMXFP4RopeMLASpec,
    StoreMXFP4MLASpec,
    StoreMXFP4RopeMLASpec,
)
from kvgen.formats import MXFP4
from kvgen.ops import _checks as check
from kvgen.ops._library import define, nothing

GROUP_SIZE = MXFP4.default_group
_FLOATS = (torch.bfloat16, torch.float16, torch.float32)


def mxfp4_row_bytes(latent: int, group: int = GROUP_SIZE, rope_dim: int = 0) -> int:
    """Bytes of one MXFP4 cache row: ``latent / 2`` packed elements + ``latent / group`` scales,
    then ``rope_dim`` RoPE channels as bf16 (``store_mxfp4_mla(..., k_pe=)``; 0: none)."""
    check.int_arg("latent", latent)
    check.int_arg("rope_dim", rope_dim)
    _check_group(latent, group)
    _check_rope(latent, group, rope_dim)
    return MXFP4.row_bytes(latent, group) + 2 * rope_dim


def _check_rope(latent: int, group: int, rope: int) -> None:
    if rope == 0:
        return
    if rope not in ROPES:
        raise ValueError(f"rope_dim (k_pe's width) must be 0 or one of {ROPES}, got {rope}")
    if (latent // group) % 2:
        raise ValueError(
            f"rows with a RoPE part need an even number of scale bytes: latent={latent} / "
            f"group={group} is odd (the bf16 RoPE channels would not be 2-byte aligned)"
        )


def _check_group(latent: int, group: int) -> None:
    check.int_arg("group", group)
    if group not in GROUPS:
        raise ValueError(f"group must be one of {GROUPS}, got {group}")
    if latent <= 0 or latent % group or latent % 16:
        raise ValueError(
            f"latent width {latent} must be a positive multiple of 16 divisible by group={group}"
        )


def _cache_geometry(cache: torch.Tensor, pitch: int) -> tuple[str, int, int, int]:
    """(layout, num_slots, block_size, block_stride in bytes) of a cache, or a clear error."""
    check.dtype("cache", cache, (torch.uint8,))
    if cache.ndim == 3:
        num_blocks, block_size, s0 = check.paged_rows("paged cache", cache, pitch, "byte")
        return "paged", _slot_count(num_blocks * block_size), block_size, s0
    if not cache.is_contiguous():
        raise ValueError(
            f"cache of shape {tuple(cache.shape)} must be the 3-D paged view or contiguous"
        )
    if cache.numel() % pitch:
        raise ValueError(
            f"cache of {cache.numel()} bytes is not a whole number of {pitch}-byte rows"
        )
    num_slots = _slot_count(cache.numel() // pitch)
    return "flat", num_slots, num_slots, num_slots * pitch


def _slot_count(num_slots: int) -> int:
    # Slots are 32-bit inside the kernels (byte offsets are 64-bit): 2^31 slots of MXFP4 rows
    # would be hundreds of GB per layer, far past any real cache.
    if num_slots >= 2**31:
        raise ValueError(f"cache has {num_slots} slots; kvgen supports fewer than 2^31")
    return num_slots


@cache
def _store_launcher(dt, latent, group, layout, device, rope=0):
    arch, target = runtime.target_of(device)
    if rope:
        spec = StoreMXFP4RopeMLASpec(group, latent, _dtypes.NAME[dt], layout, arch, target, rope)
    else:
        spec = StoreMXFP4MLASpec(group, latent, _dtypes.NAME[dt], layout, arch, target)
    return spec, load(spec).launch


@cache
def _gather_launcher(dt, latent, group, layout, device, rope=0):
    arch, target = runtime.target_of(device)
    if rope:
        spec = GatherMXFP4RopeMLASpec(group, latent, _dtypes.NAME[dt], layout, arch, target, rope)
    else:
        spec = GatherMXFP4MLASpec(group, latent, _dtypes.NAME[dt], layout, arch, target)
    return spec, load(spec).launch


def _slots(name: str, slots: object, n: int | None) -> torch.Tensor:
    slots = check.tensor(name, slots)
    check.dtype(name, slots, (torch.int32, torch.int64))
    check.ndim(name, slots, 1, "[num_tokens]")
    if n is not None and slots.shape[0] != n:
        raise ValueError(f"{name} has {slots.shape[0]} entries but kv_c_normed has {n} tokens")
    return slots


def _check_store(x, slots, cache, group, k_pe=None):
    """Every check of ``store_mxfp4_mla`` that needs no data: the cache geometry, or an error."""
    check.dtype("kv_c_normed", x, _FLOATS)
    check.ndim("kv_c_normed", x, 2, "[num_tokens, latent]")
    num_tokens, latent = x.shape
    _slots("slot_mapping", slots, num_tokens)
    _check_group(latent, group)
    rope = 0
    if k_pe is not None:
        k_pe = check.tensor("k_pe", k_pe)
        check.ndim("k_pe", k_pe, 2, "[num_tokens, rope_dim]")
        if k_pe.dtype != x.dtype:
            raise TypeError(f"k_pe must have kv_c_normed's dtype {x.dtype}, got {k_pe.dtype}")
        if k_pe.shape[0] != num_tokens:
            raise ValueError(f"k_pe has {k_pe.shape[0]} tokens but kv_c_normed has {num_tokens}")
        if k_pe.shape[1] > 1 and k_pe.stride(1) != 1:
            raise ValueError(
                f"k_pe must be contiguous in its last dimension; strides {k_pe.stride()}"
            )
        rope = k_pe.shape[1]
        _check_rope(latent, group, rope)
        device = check.same_device(kv_c_normed=x, k_pe=k_pe, slot_mapping=slots, cache=cache)
    else:
        device = check.same_device(kv_c_normed=x, slot_mapping=slots, cache=cache)
    return device, _cache_geometry(cache, MXFP4.row_bytes(latent, group) + 2 * rope)


def _run_store(checked, x, slots, cache, group, k_pe=None):
    device, (layout, num_slots, block_size, block_stride) = checked
    num_tokens, latent = x.shape
    if num_tokens == 0 or num_slots == 0:  # (no slot: every token is skipped)
        return
    rope = 0 if k_pe is None else k_pe.shape[1]
    spec, launch = _store_launcher(x.dtype, latent, group, layout, device, rope)
    meta = runtime.meta_params(spec, num_tokens=num_tokens)
    tensors = (x, slots) if k_pe is None else (x, k_pe, slots)
    if layout == "paged":
        launch(*tensors, cache, num_slots, block_size, block_stride, **meta)
    else:
        launch(*tensors, cache, num_slots, **meta)


_store_op = define(
    "store_mxfp4_mla(Tensor kv_c_normed, Tensor slot_mapping, Tensor(a!) cache, int group, "
    "Tensor? k_pe=None) -> ()",
    _check_store,
    _run_store,
    nothing,
)


def store_mxfp4_mla(
    kv_c_normed: torch.Tensor,
    slot_mapping: torch.Tensor,
    cache: torch.Tensor,
    group: int = GROUP_SIZE,
    k_pe: torch.Tensor | None = None,
) -> None:
    """Quantize the MLA latent to MXFP4 and write it into the paged cache.

    Args:
        kv_c_normed: ``[num_tokens, latent]`` bf16, fp16 or fp32, the post-RMSNorm latent;
            rows may be strided.
        slot_mapping: ``[num_tokens]`` int32 or int64 global slot indices; negative entries
            (``PAD_SLOT_ID``) and slots past the end of the cache are skipped.
        cache: ``uint8``, either the paged ``[num_blocks, block_size, row_bytes(latent)]`` layer
            view, whose block stride may exceed ``block_size`` rows when other layers' pages sit
            between blocks, or any contiguous tensor viewable as ``[num_slots, row_bytes]``.
        group: number of latent elements sharing one E8M0 scale (16, 32 or 64).
        k_pe: ``None`` (vLLM's op: rope-free rows of ``mxfp4_row_bytes(latent, group)`` bytes),
            or ``[num_tokens, rope_dim]`` of kv_c_normed's dtype (rope_dim 16, 32, 64 or 128):
            each row then carries the RoPE part as bf16 after its scales (bf16 bit for bit,
            fp16 / fp32 rounded to nearest even), rows of
            ``mxfp4_row_bytes(latent, group, rope_dim)`` bytes (576 / 512: 400), the rows
            ``flash_mla_with_kvcache`` reads as ``kv_format="mxfp4"``.

    Every argument is checked before the cache is touched: a bad one raises ``TypeError`` or
    ``ValueError`` naming it. The op is ``torch.ops.kvgen.store_mxfp4_mla`` (``cache``
    mutated).
    """
    _store_op(kv_c_normed, slot_mapping, cache, group, k_pe)


def _check_gather(cache, slots, latent, group, out_dtype, rope_dim=0):
    _slots("slots", slots, None)
    _check_group(latent, group)
    _check_rope(latent, group, rope_dim)
    if out_dtype not in _FLOATS:
        raise TypeError(f"out_dtype must be one of {_FLOATS}, got {out_dtype}")
    device = check.same_device(cache=cache, slots=slots)
    return device, _cache_geometry(cache, MXFP4.row_bytes(latent, group) + 2 * rope_dim)


def _run_gather(checked, cache, slots, latent, group, out_dtype, rope_dim=0):
    device, (layout, num_slots, block_size, block_stride) = checked
    out = torch.empty(slots.shape[0], latent + rope_dim, dtype=out_dtype, device=device)
    if slots.shape[0] == 0:
        return out
    if num_slots == 0:  # no slot: every row reads as zeros
        return out.zero_()
    spec, launch = _gather_launcher(out_dtype, latent, group, layout, device, rope_dim)
    meta = runtime.meta_params(spec, num_tokens=slots.shape[0])
    if layout == "paged":
        launch(cache, slots, out, num_slots, block_size, block_stride, **meta)
    else:
        launch(cache, slots, out, num_slots, **meta)
    return out


def _fake_gather(checked, cache, slots, latent, group, out_dtype, rope_dim=0):
    return torch.empty(slots.shape[0], latent + rope_dim, dtype=out_dtype, device=checked[0])


_gather_op = define(
    "gather_mxfp4_mla(Tensor cache, Tensor slots, int latent, int group, ScalarType out_dtype, "
    "int rope_dim=0) -> Tensor",
    _check_gather,
    _run_gather,
    _fake_gather,
)


def gather_mxfp4_mla(
    cache: torch.Tensor,
    slots: torch.Tensor,
    latent: int,
    group: int = GROUP_SIZE,
    out_dtype: torch.dtype = torch.bfloat16,
    rope_dim: int = 0,
) -> torch.Tensor:
    """Read and dequantize the MXFP4 rows of ``slots`` from ``cache``.

    Returns ``[len(slots), latent + rope_dim]`` of ``out_dtype`` (bf16, fp16 or fp32); a row
    whose slot is negative or past the end of the cache is all zeros. ``cache`` takes the
    layouts :func:`store_mxfp4_mla` takes. ``rope_dim``: the rows' RoPE channels (the rows
    ``store_mxfp4_mla(..., k_pe=)`` writes, read back after the latent exactly as the bf16
    stored; 0: rope-free rows). The op is ``torch.ops.kvgen.gather_mxfp4_mla``.
    """
    if not isinstance(out_dtype, torch.dtype):
        raise TypeError(f"out_dtype must be a torch.dtype, got {type(out_dtype).__name__}")
    return _gather_op(cache, slots, latent, group, out_dtype, rope_dim)
