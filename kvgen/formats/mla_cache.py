"""The MLA decode cache rows, as docs/formats.md defines them: one row per token holding the
latent (512 channels for DeepSeek, also V) and the RoPE part (64 channels), in one of four
encodings.

- ``auto``: the 576 channels in the input's 16-bit dtype.
- ``fp8_ds_mla`` (656 bytes, FlashMLA's "FP8 with scale" record): 512 e4m3fn latent codes, four
  little-endian fp32 scales (one per 128 latent channels, powers of two), 64 bf16 RoPE channels.
- ``fp8`` (per tensor): 576 e4m3fn codes, latent then RoPE, one fp32 ``k_scale`` for the tensor.
- ``mxfp4``: the MXFP4 latent row (``kvgen.formats.mxfp4``), then the RoPE part as bf16.

``quantize_*`` take ``kv_c [n, latent]`` and ``k_pe [n, rope]`` (any float dtype) and return
rows ``[n, row_bytes]`` of uint8; ``dequantize_*`` return fp32 ``[n, latent + rope]``, what the
decode attends over (K = the whole row, V = its latent part).
"""

from __future__ import annotations

import torch

from kvgen.formats import mxfp4

E4M3_MAX = 448.0
DS_MLA_TILE = 128  # latent channels per fp8_ds_mla scale
DS_MLA_MIN_Q = 1e-4  # the least q = amax / 448 (as its fp32 value)


def _bytes(x: torch.Tensor) -> torch.Tensor:
    """The bytes of ``x`` [n, k] (any dtype), little-endian: [n, k * itemsize] uint8."""
    return x.contiguous().view(torch.uint8).reshape(x.shape[0], x.shape[1] * x.element_size())


def _from_bytes(b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    width = b.shape[1] // torch.empty(0, dtype=dtype).element_size()
    return b.contiguous().view(dtype).reshape(b.shape[0], width)


def rope_bf16(k_pe: torch.Tensor) -> torch.Tensor:
    """The RoPE part as bf16: a bf16 input bit for bit, fp16 / fp32 rounded to nearest even."""
    return k_pe.to(torch.bfloat16)


def ds_mla_row_bytes(latent: int = 512, rope: int = 64) -> int:
    return latent + 4 * (latent // DS_MLA_TILE) + 2 * rope


def quantize_fp8_ds_mla(kv_c: torch.Tensor, k_pe: torch.Tensor) -> torch.Tensor:
    """``fp8_ds_mla`` rows. Per 128-channel tile t: q = max(amax_t / 448, 1e-4) (fp32, correctly
    rounded), E = ceil(log2(q)) from q's bits (exactly as MXFP4's), scale_t = 2^E, codes
    e4m3fn_rne(x * 2^-E) (exact scaling; |x| * 2^-E <= 448, so nothing saturates). A tile holding
    NaN or an infinity stores a NaN scale and codes 0 (it dequantizes to NaN)."""
    n, latent = kv_c.shape
    tiles = kv_c.float().reshape(n, latent // DS_MLA_TILE, DS_MLA_TILE)
    amax = tiles.abs().amax(dim=-1)
    q = torch.clamp(amax / E4M3_MAX, min=DS_MLA_MIN_Q)  # (the bound as its fp32 value)
    exponent = mxfp4.ceil_log2_exact(q)
    scaled = tiles * torch.exp2(-exponent.double()).float()[..., None]  # a power of two: exact
    codes = scaled.to(torch.float8_e4m3fn)  # torch's fp32 -> e4m3fn cast rounds to nearest even
    scales = torch.exp2(exponent.double()).float()
    bad = ~torch.isfinite(tiles).all(dim=-1)  # NaN / inf in the tile: NaN scale, codes 0
    scales = torch.where(bad, torch.tensor(float("nan")), scales)
    codes = torch.where(bad[..., None], torch.zeros_like(codes), codes)
    parts = (codes.reshape(n, latent), scales, rope_bf16(k_pe))
    return torch.cat([_bytes(p) for p in parts], dim=1)


def dequantize_fp8_ds_mla(rows: torch.Tensor, latent: int = 512) -> torch.Tensor:
    n = rows.shape[0]
    tiles = latent // DS_MLA_TILE
    codes = _from_bytes(rows[:, :latent], torch.float8_e4m3fn).float()
    scales = _from_bytes(rows[:, latent : latent + 4 * tiles], torch.float32)
    rope = _from_bytes(rows[:, latent + 4 * tiles :], torch.bfloat16).float()
    lat = (codes.reshape(n, tiles, DS_MLA_TILE) * scales[..., None]).reshape(n, latent)
    return torch.cat([lat, rope], dim=1)


def quantize_fp8_per_tensor(
    kv_c: torch.Tensor, k_pe: torch.Tensor, k_scale: torch.Tensor
) -> torch.Tensor:
    """``fp8`` rows: e4m3fn_rne(clamp(x / k_scale, -448, 448)) of the latent then the RoPE
    channels (a correctly rounded fp32 division). A NaN or infinite element stores e4m3fn's
    NaN code, 0x7F, or 0xFF when negative (the format has no infinity)."""
    x = torch.cat([kv_c.float(), k_pe.float()], dim=1)
    y = (x / k_scale.float().reshape(())).clamp(-E4M3_MAX, E4M3_MAX)
    codes = _bytes(torch.where(torch.isfinite(x), y, 0.0).to(torch.float8_e4m3fn))
    negative = (x.view(torch.int32) < 0).to(torch.uint8)  # the sign bit (NaN's too)
    nan_codes = 0x7F | (negative << 7)
    return torch.where(torch.isfinite(x), codes, nan_codes)


def dequantize_fp8_per_tensor(rows: torch.Tensor, k_scale: torch.Tensor) -> torch.Tensor:
    return _from_bytes(rows, torch.float8_e4m3fn).float() * k_scale.float().reshape(())


def mxfp4_rope_row_bytes(latent: int = 512, group: int = 32, rope: int = 64) -> int:
    return mxfp4.row_bytes(latent, group) + 2 * rope


def quantize_mxfp4_rope(kv_c: torch.Tensor, k_pe: torch.Tensor, group: int = 32) -> torch.Tensor:
    """The MXFP4 latent row, then the RoPE part as bf16: its first bytes are the rope-free row."""
    return torch.cat([mxfp4.quantize_rows(kv_c, group), _bytes(rope_bf16(k_pe))], dim=1)


def store_mxfp4_rope(kv_c, k_pe, slot_mapping, cache, group: int = 32) -> None:
    """Reference of ``store_mxfp4_mla(..., k_pe=)``: token i's row (``quantize_mxfp4_rope``)
    into slot ``slot_mapping[i]`` of ``cache`` (the layouts ``mxfp4.store`` takes); negative
    slots and slots past the end are skipped."""
    pitch = mxfp4_rope_row_bytes(kv_c.shape[1], group, k_pe.shape[1])
    rows, valid, index = mxfp4._slot_index(cache, slot_mapping, pitch)
    encoded = quantize_mxfp4_rope(kv_c.cpu(), k_pe.cpu(), group)[valid]
    rows[tuple(i.to(cache.device) for i in index)] = encoded.to(cache.device)


def gather_mxfp4_rope(cache, slots, latent: int = 512, group: int = 32, rope: int = 64):
    """Reference of ``gather_mxfp4_mla(..., rope_dim=)``: fp32 [len(slots), latent + rope] on
    the CPU (``dequantize_mxfp4_rope`` of each slot's row); rows of invalid slots are zeros."""
    pitch = mxfp4_rope_row_bytes(latent, group, rope)
    rows, valid, index = mxfp4._slot_index(cache, slots, pitch)
    out = torch.zeros(slots.shape[0], latent + rope)
    picked = rows[tuple(i.to(cache.device) for i in index)].cpu()
    out[valid] = dequantize_mxfp4_rope(picked.reshape(-1, pitch), latent, group)
    return out


def dequantize_mxfp4_rope(rows: torch.Tensor, latent: int = 512, group: int = 32) -> torch.Tensor:
    pitch = mxfp4.row_bytes(latent, group)
    lat = mxfp4.dequantize_rows(rows[:, :pitch], latent, group)
    rope = _from_bytes(rows[:, pitch:], torch.bfloat16).float()
    return torch.cat([lat, rope], dim=1)


def encode(kv_c, k_pe, kv_cache_dtype: str, k_scale=None, cache_dtype=None) -> torch.Tensor:
    """The rows ``concat_and_cache_mla`` writes, as bytes [n, row_bytes]: ``"auto"`` the 576
    channels in ``cache_dtype`` (the input's 16-bit dtype), ``"fp8"`` / ``"fp8_e4m3"`` per
    tensor with ``k_scale``, ``"fp8_ds_mla"`` the 656-byte record."""
    if kv_cache_dtype == "auto":
        return _bytes(torch.cat([kv_c, k_pe], dim=1).to(cache_dtype or kv_c.dtype))
    if kv_cache_dtype in ("fp8", "fp8_e4m3"):
        return quantize_fp8_per_tensor(kv_c, k_pe, k_scale)
    if kv_cache_dtype == "fp8_ds_mla":
        return quantize_fp8_ds_mla(kv_c, k_pe)
    raise ValueError(f"unknown kv_cache_dtype {kv_cache_dtype!r}")


def store(kv_c, k_pe, kv_cache, slot_mapping, kv_cache_dtype: str, k_scale=None) -> None:
    """Reference of ``concat_and_cache_mla``: the row of token i into slot ``slot_mapping[i]``
    of ``kv_cache`` [num_blocks, block_size, row] (any block stride); negative slots and slots
    past the end are skipped."""
    block_size = kv_cache.shape[1]
    slots = slot_mapping.to(torch.int64).cpu()
    valid = (slots >= 0) & (slots < kv_cache.shape[0] * block_size)
    rows = encode(kv_c.cpu()[valid], k_pe.cpu()[valid], kv_cache_dtype, k_scale, kv_cache.dtype)
    s = slots[valid]
    dst = kv_cache.view(torch.uint8) if kv_cache.dtype != torch.uint8 else kv_cache
    dst[s // block_size, s % block_size] = rows.to(kv_cache.device)
