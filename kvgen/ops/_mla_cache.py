"""vLLM's ``concat_and_cache_mla``: the latent and RoPE parts of each token into its MLA cache
row, in the cache's format (``kvgen.formats.mla_cache``); and ``gather_mla_cache``, its
reader."""

from __future__ import annotations

from functools import cache

import torch

from kvgen import _dtypes, runtime
from kvgen.codegen import load
from kvgen.families.mla_cache import ConcatAndCacheMLASpec, GatherMLACacheSpec
from kvgen.ops import _checks as check
from kvgen.ops._library import define, nothing

_FLOATS = (torch.bfloat16, torch.float16, torch.float32)
#: kv_cache_dtype -> the spec's format
FORMAT_OF = {"auto": "auto", "fp8": "fp8", "fp8_e4m3": "fp8", "fp8_ds_mla": "fp8_ds_mla"}


def _rows(name: str, t: torch.Tensor, n: int | None, what: str) -> None:
    check.dtype(name, t, _FLOATS)
    check.ndim(name, t, 2, f"[num_tokens, {what}]")
    if n is not None and t.shape[0] != n:
        raise ValueError(f"{name} has {t.shape[0]} tokens but kv_c has {n}")
    if t.shape[1] > 1 and t.stride(1) != 1:
        raise ValueError(f"{name} must be contiguous in its last dimension (rows may be strided)")


def _check(kv_c, k_pe, kv_cache, slot_mapping, kv_cache_dtype, scale):
    """Every check of ``concat_and_cache_mla`` that needs no data: (spec fields, device)."""
    if kv_cache_dtype not in FORMAT_OF:
        known = ", ".join(map(repr, FORMAT_OF))
        raise ValueError(f"kv_cache_dtype must be one of {known}, got {kv_cache_dtype!r}")
    fmt = FORMAT_OF[kv_cache_dtype]
    _rows("kv_c", kv_c, None, "kv_lora_rank")
    n, latent = kv_c.shape
    _rows("k_pe", k_pe, n, "rope_dim")
    if k_pe.dtype != kv_c.dtype:
        raise TypeError(f"k_pe must have kv_c's dtype {kv_c.dtype}; got {k_pe.dtype}")
    rope = k_pe.shape[1]
    if latent % 128 or not 0 < latent <= 2048:
        raise ValueError(f"kv_c's width {latent} must be a multiple of 128 up to 2048")
    if rope < 16 or rope > 256 or rope & (rope - 1):
        raise ValueError(f"k_pe's width {rope} must be a power of two from 16 to 256")
    check.dtype("slot_mapping", slot_mapping, (torch.int32, torch.int64))
    check.ndim("slot_mapping", slot_mapping, 1, "[num_tokens]")
    if slot_mapping.shape[0] != n:
        raise ValueError(
            f"slot_mapping has {slot_mapping.shape[0]} entries but kv_c has {n} tokens"
        )
    if fmt == "auto":
        if kv_c.dtype == torch.float32:
            raise TypeError("kv_cache_dtype 'auto' stores 16-bit values: kv_c must be bf16 or fp16")
        check.dtype("kv_cache", kv_cache, (kv_c.dtype,))
    elif fmt == "fp8":
        check.dtype("kv_cache", kv_cache, (torch.uint8, torch.float8_e4m3fn))
        check.dtype("scale", scale, (torch.float32,))
        if scale.numel() != 1:
            raise ValueError(
                f"scale must hold one fp32 value (the tensor's k_scale); got {scale.numel()}"
            )
    else:
        check.dtype("kv_cache", kv_cache, (torch.uint8,))
    spec = ConcatAndCacheMLASpec(fmt, latent, rope, _dtypes.NAME[kv_c.dtype])
    width = spec.row_bytes // kv_cache.element_size()
    if kv_cache.ndim == 4 and kv_cache.shape[2] == 1:
        kv_cache = kv_cache[:, :, 0]
    check.ndim("kv_cache", kv_cache, 3, f"[num_blocks, block_size, {width}]")
    unit = "byte" if kv_cache.element_size() == 1 else "element"
    num_blocks, block_size, _ = check.paged_rows("kv_cache", kv_cache, width, unit)
    if num_blocks * block_size >= 2**31:
        raise ValueError("kv_cache has 2^31 slots or more")
    device = check.same_device(
        kv_c=kv_c, k_pe=k_pe, kv_cache=kv_cache, slot_mapping=slot_mapping, scale=scale
    )
    return (fmt, latent, rope, kv_c.dtype), device


@cache
def _launcher(fmt, latent, rope, dtype, device):
    arch, target = runtime.target_of(device)
    spec = ConcatAndCacheMLASpec(fmt, latent, rope, _dtypes.NAME[dtype], arch, target)
    return spec, load(spec).launch


def _run(checked, kv_c, k_pe, kv_cache, slot_mapping, kv_cache_dtype, scale):
    fields, device = checked
    if kv_c.shape[0] == 0 or kv_cache.shape[0] * kv_cache.shape[1] == 0:  # (no slot: skipped)
        return
    spec, launch = _launcher(*fields, device)
    if kv_cache.ndim == 4:
        kv_cache = kv_cache[:, :, 0]
    if spec.fmt != "auto" and kv_cache.dtype != torch.uint8:
        kv_cache = kv_cache.view(torch.uint8)
    meta = runtime.meta_params(spec, num_tokens=kv_c.shape[0])
    launch(kv_c, k_pe, kv_cache, slot_mapping, scale, **meta)


_store_op = define(
    "concat_and_cache_mla(Tensor kv_c, Tensor k_pe, Tensor(a!) kv_cache, Tensor slot_mapping, "
    "str kv_cache_dtype, Tensor scale) -> ()",
    _check,
    _run,
    nothing,
)


def concat_and_cache_mla(
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_cache_dtype: str,
    scale: torch.Tensor,
) -> None:
    """vLLM's ``concat_and_cache_mla``: write token i's latent ``kv_c[i]`` and RoPE part
    ``k_pe[i]`` into slot ``slot_mapping[i]`` of the MLA cache.

    Args:
        kv_c: [num_tokens, kv_lora_rank] (512 for DeepSeek) bf16, fp16 or fp32; rows may be
            strided (a unit last stride).
        k_pe: [num_tokens, rope_dim] (64), kv_c's dtype.
        kv_cache: [num_blocks, block_size, row] (or FlashMLA's [.., 1, row] view); the block
            stride may be any whole number of rows at least block_size. ``kv_cache_dtype``
            picks the row: ``"auto"`` kv_c + k_pe channels in kv_c's 16-bit dtype; ``"fp8"`` /
            ``"fp8_e4m3"`` as many e4m3fn codes (uint8 or float8_e4m3fn cache) of x / scale;
            ``"fp8_ds_mla"`` the 656-byte record (uint8 cache): e4m3fn latent codes, four fp32
            power-of-two scales, bf16 RoPE (docs/formats.md).
        slot_mapping: [num_tokens] int32 or int64; negative and out-of-range slots are skipped.
        scale: a 1-element fp32 tensor, the per-tensor k_scale (read by "fp8" only).

    Every argument is checked before the cache is touched. The op is
    ``torch.ops.kvgen.concat_and_cache_mla`` (``kv_cache`` mutated).
    """
    if not isinstance(kv_cache_dtype, str):
        raise TypeError(f"kv_cache_dtype must be a str, got {type(kv_cache_dtype).__name__}")
    _store_op(kv_c, k_pe, kv_cache, slot_mapping, kv_cache_dtype, scale)


def _check_gather(kv_cache, slots, kv_cache_dtype, scale, latent, out_dtype):
    """Every check of ``gather_mla_cache`` that needs no data: ((fmt, latent, rope), device)."""
    if kv_cache_dtype not in FORMAT_OF:
        known = ", ".join(map(repr, FORMAT_OF))
        raise ValueError(f"kv_cache_dtype must be one of {known}, got {kv_cache_dtype!r}")
    fmt = FORMAT_OF[kv_cache_dtype]
    check.dtype("slots", slots, (torch.int32, torch.int64))
    check.ndim("slots", slots, 1, "[num_rows]")
    if out_dtype not in _FLOATS:
        raise TypeError(f"out_dtype must be one of {_FLOATS}, got {out_dtype}")
    if latent % 128 or not 0 < latent <= 2048:
        raise ValueError(f"latent {latent} must be a multiple of 128 up to 2048")
    if kv_cache.ndim == 4 and kv_cache.shape[2] == 1:
        kv_cache = kv_cache[:, :, 0]
    check.ndim("kv_cache", kv_cache, 3, "[num_blocks, block_size, row]")
    width = kv_cache.shape[2]
    if fmt == "auto":
        check.dtype("kv_cache", kv_cache, (torch.bfloat16, torch.float16))
        rope = width - latent
    elif fmt == "fp8":
        check.dtype("kv_cache", kv_cache, (torch.uint8, torch.float8_e4m3fn))
        if scale is None:
            raise ValueError("scale (the cache's k_scale, one fp32 value) is needed for 'fp8'")
        check.dtype("scale", scale, (torch.float32,))
        if scale.numel() != 1:
            raise ValueError(f"scale must hold one fp32 value (the k_scale); got {scale.numel()}")
        rope = width - latent
    else:
        check.dtype("kv_cache", kv_cache, (torch.uint8,))
        rope = (width - latent - 4 * (latent // 128)) // 2
    if rope < 16 or rope > 256 or rope & (rope - 1):
        raise ValueError(
            f"kv_cache rows of {width} {'bytes' if kv_cache.element_size() == 1 else 'values'} "
            f"are no {fmt} rows of latent {latent} with a RoPE part of 16-256 (a power of two)"
        )
    unit = "byte" if kv_cache.element_size() == 1 else "element"
    num_blocks, block_size, _ = check.paged_rows("kv_cache", kv_cache, width, unit)
    if num_blocks * block_size >= 2**31:
        raise ValueError("kv_cache has 2^31 slots or more")
    tensors = {"kv_cache": kv_cache, "slots": slots}
    if scale is not None:
        tensors["scale"] = scale
    device = check.same_device(**tensors)
    return (fmt, latent, rope), device


@cache
def _gather_launcher(fmt, latent, rope, dtype, device):
    arch, target = runtime.target_of(device)
    spec = GatherMLACacheSpec(fmt, latent, rope, _dtypes.NAME[dtype], arch, target)
    return spec, load(spec).launch


def _run_gather(checked, kv_cache, slots, kv_cache_dtype, scale, latent, out_dtype):
    (fmt, latent, rope), device = checked
    if kv_cache.ndim == 4:
        kv_cache = kv_cache[:, :, 0]
    out = torch.empty(slots.shape[0], latent + rope, dtype=out_dtype, device=device)
    if slots.shape[0] == 0:
        return out
    num_blocks, block_size, _ = kv_cache.shape
    if num_blocks * block_size == 0:  # no slot: every row reads as zeros
        return out.zero_()
    if fmt == "auto":  # the rows hold the values: a copy (no host sync)
        s = slots.to(torch.int64)
        valid = (s >= 0) & (s < num_blocks * block_size)
        s = torch.where(valid, s, 0)
        rows = kv_cache[s // block_size, s % block_size].to(out_dtype)
        return out.copy_(torch.where(valid[:, None], rows, torch.zeros((), dtype=out_dtype)))
    spec, launch = _gather_launcher(fmt, latent, rope, out_dtype, device)
    meta = runtime.meta_params(spec, num_tokens=slots.shape[0])
    k_scale = scale if scale is not None else kv_cache  # (fp8_ds_mla rows carry their scales)
    launch(kv_cache.view(torch.uint8), slots, k_scale, out, **meta)
    return out


def _fake_gather(checked, kv_cache, slots, kv_cache_dtype, scale, latent, out_dtype):
    (_, latent, rope), device = checked
    return torch.empty(slots.shape[0], latent + rope, dtype=out_dtype, device=device)


_gather_op = define(
    "gather_mla_cache(Tensor kv_cache, Tensor slots, str kv_cache_dtype, Tensor? scale, "
    "int latent, ScalarType out_dtype) -> Tensor",
    _check_gather,
    _run_gather,
    _fake_gather,
)


def gather_mla_cache(
    kv_cache: torch.Tensor,
    slots: torch.Tensor,
    kv_cache_dtype: str,
    scale: torch.Tensor | None = None,
    latent: int = 512,
    out_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """The MLA cache rows of ``slots``, dequantized: the reader of what
    :func:`concat_and_cache_mla` writes.

    Args:
        kv_cache: [num_blocks, block_size, row] (or FlashMLA's [.., 1, row] view) in
            ``kv_cache_dtype``'s format ("auto", "fp8" / "fp8_e4m3", "fp8_ds_mla"); the block
            stride may be any whole number of rows at least block_size. The RoPE width is the
            row's rest after the ``latent`` channels (and fp8_ds_mla's scales).
        slots: [num_rows] int32 or int64.
        scale: the per-tensor fp8 cache's 1-element fp32 k_scale (read by "fp8" only).
        latent: the latent width (kv_lora_rank, 512 for DeepSeek).
        out_dtype: bf16, fp16 or fp32.

    Returns ``[num_rows, latent + rope]`` of ``out_dtype``: "fp8" codes * k_scale,
    "fp8_ds_mla" codes * their 128 channels' scale and the bf16 RoPE part, "auto" the values;
    each rounded to ``out_dtype`` once. Rows of negative or out-of-range slots are zeros. The
    op is ``torch.ops.kvgen.gather_mla_cache``.
    """
    if not isinstance(kv_cache_dtype, str):
        raise TypeError(f"kv_cache_dtype must be a str, got {type(kv_cache_dtype).__name__}")
    if not isinstance(out_dtype, torch.dtype):
        raise TypeError(f"out_dtype must be a torch.dtype, got {type(out_dtype).__name__}")
    return _gather_op(kv_cache, slots, kv_cache_dtype, scale, latent, out_dtype)
