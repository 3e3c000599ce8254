"""Per-token-head KV formats, as docs/formats.md defines them: int8 / fp8 with one fp32 scale per
(token, head), and int4 with Gaussian-friendly levels and one fp16 scale per group of channels.

Tensors here are ``[tokens, heads, head_size]``; caches are ``[num_blocks, block_size, heads,
...]`` views with any strides (vLLM's NHD memory, or HND memory passed as a permuted view).

Non-finite input: a scale group that holds a NaN or an infinity (the (token, head) row of int8
/ fp8, the channel group of int4) stores codes 0 and a NaN scale (fp32 ``0x7FC00000``; int4's
fp16 ``0x7E00``), so that all of it reads back as NaN; the other groups are unaffected. A finite
int4 group whose fp32 scale exceeds fp16's largest value stores the scale 65504 (its codes are
still those of the fp32 scale).
"""

from __future__ import annotations

import torch

from kvgen._math import cdiv

#: cache dtype -> (QMAX, QMIN) of the int8 / fp8 formats
QUANT_RANGE = {
    torch.int8: (127.0, -128.0),
    torch.float8_e4m3fn: (448.0, -448.0),
    torch.float8_e5m2: (57344.0, -57344.0),
}
MIN_SCALE = 1e-6
FP32_NAN_BITS = 0x7FC00000  # the NaN scale of a non-finite int8 / fp8 row
FP16_NAN_BITS = 0x7E00  # the NaN scale of a non-finite int4 group
FP16_MAX = 65504.0

#: int4 magnitudes by code m = 0..7 (code 8 + m is the negative of code m; 8 is -0)
INT4_LEVELS = (0.0, 0.049726, 0.150815, 0.257223, 0.374146, 0.510790, 0.688876, 1.0)
#: midpoints between consecutive levels; m = how many of these |x| / scale is strictly above
INT4_BOUNDARIES = (0.024863, 0.100270, 0.204019, 0.315684, 0.442468, 0.599833, 0.844438)
INT4_CHANNELS = (16, 32, 64, 128)
INT4_DEFAULT_CHANNELS = 32


def _round_half_even(y: torch.Tensor) -> torch.Tensor:
    return torch.round(y)  # torch.round rounds half to even


def quantize_per_token_head(x: torch.Tensor, cache_dtype: torch.dtype):
    """``x`` [..., head_size] -> (q of ``cache_dtype``, fp32 scale [...])."""
    qmax, qmin = QUANT_RANGE[cache_dtype]
    bad = ~torch.isfinite(x.float()).all(dim=-1)  # the row holds a NaN or an infinity
    xf = torch.where(bad[..., None], 0.0, x.float())
    amax = xf.abs().amax(dim=-1)
    scale = torch.clamp(amax / qmax, min=MIN_SCALE)  # fp32 divisions, correctly rounded
    y = xf / scale[..., None]
    if cache_dtype == torch.int8:
        q = torch.clamp(_round_half_even(y), qmin, qmax).to(torch.int8)
    else:
        q = torch.clamp(y, qmin, qmax).to(cache_dtype)  # torch's fp8 cast rounds to nearest even
    nan = torch.tensor(FP32_NAN_BITS, dtype=torch.int32).view(torch.float32)
    return q, torch.where(bad, nan, scale)


def dequantize_per_token_head(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q.float() * scale.float()[..., None]


def int4_groups(head_size: int, channels: int) -> int:
    return cdiv(head_size, channels)


def quantize_int4(x: torch.Tensor, channels: int = INT4_DEFAULT_CHANNELS):
    """``x`` [..., head_size] -> (packed uint8 [..., ceil(head_size / 2)], fp16 scales
    [..., ceil(head_size / channels)])."""
    head_size = x.shape[-1]
    groups = int4_groups(head_size, channels)
    padded = torch.zeros(*x.shape[:-1], groups * channels)
    padded[..., :head_size] = x.float()  # padding lanes are 0 and quantize to code 0
    g = padded.reshape(*x.shape[:-1], groups, channels)
    bad = ~torch.isfinite(g).all(dim=-1)  # the group holds a NaN or an infinity: codes 0
    g = torch.where(bad[..., None], 0.0, g)
    scale = torch.clamp(g.abs().amax(dim=-1), min=MIN_SCALE)  # fp32, before rounding to fp16
    y = g.abs() / scale[..., None]
    m = torch.zeros_like(y, dtype=torch.int32)
    for boundary in torch.tensor(INT4_BOUNDARIES, dtype=torch.float32).tolist():
        m += (y > torch.tensor(boundary, dtype=torch.float32)).to(torch.int32)
    codes = (m | ((g < 0).to(torch.int32) << 3)).reshape(*x.shape[:-1], groups * channels)
    nbytes = cdiv(head_size, 2)
    codes = codes[..., : 2 * nbytes]
    if codes.shape[-1] < 2 * nbytes:  # odd head size: the last high nibble is padding
        codes = torch.cat([codes, torch.zeros_like(codes[..., :1])], dim=-1)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    # fp16 rounding to nearest, saturating at 65504 (a finite group never gets an inf scale)
    scale16 = torch.clamp(scale, max=FP16_MAX).to(torch.float16)
    nan = torch.tensor(FP16_NAN_BITS, dtype=torch.int16).view(torch.float16)
    return packed.to(torch.uint8), torch.where(bad, nan, scale16)


def dequantize_int4(packed: torch.Tensor, scales: torch.Tensor, head_size: int) -> torch.Tensor:
    p = packed.to(torch.int32)
    pairs = torch.stack([p & 0xF, p >> 4], dim=-1)
    codes = pairs.reshape(*packed.shape[:-1], 2 * packed.shape[-1])[..., :head_size]
    levels = torch.tensor(INT4_LEVELS, dtype=torch.float32, device=packed.device)[codes & 7]
    values = torch.where(codes & 8 != 0, -levels, levels)
    groups = scales.shape[-1]
    channels_per_scale = next(c for c in INT4_CHANNELS if int4_groups(head_size, c) == groups)
    s = scales.float().repeat_interleave(channels_per_scale, dim=-1)[..., :head_size]
    return values * s


def _slot_index(cache: torch.Tensor, slots: torch.Tensor):
    block_size = cache.shape[1]
    num_slots = cache.shape[0] * block_size
    slots = slots.to(torch.int64).cpu()
    valid = (slots >= 0) & (slots < num_slots)
    s = slots[valid]
    return valid, (s // block_size).to(cache.device), (s % block_size).to(cache.device)


def store(key, value, key_cache, value_cache, k_scale_cache, v_scale_cache, slot_mapping):
    """Reference of both seed ops: the cache dtype picks int8/fp8; a uint8 cache is int4."""
    valid, blk, row = _slot_index(key_cache, slot_mapping)
    for x, cache, scales in ((key, key_cache, k_scale_cache), (value, value_cache, v_scale_cache)):
        x = x.cpu()[valid]
        if cache.dtype == torch.uint8:
            channels = next(
                c for c in INT4_CHANNELS if int4_groups(x.shape[-1], c) == scales.shape[-1]
            )
            q, s = quantize_int4(x, channels)
        else:
            q, s = quantize_per_token_head(x, cache.dtype)
        cache[blk, row] = q.to(cache.device)
        scales[blk, row] = s.to(scales.device)


def gather(cache, scales, slots, head_size: int) -> torch.Tensor:
    """Dequantized fp32 [len(slots), heads, head_size]; rows of invalid slots are zeros."""
    valid, blk, row = _slot_index(cache, slots)
    out = torch.zeros(slots.shape[0], cache.shape[2], head_size)
    q, s = cache[blk, row].cpu(), scales[blk, row].cpu()
    if cache.dtype == torch.uint8:
        out[valid] = dequantize_int4(q, s, head_size)
    else:
        out[valid] = dequantize_per_token_head(q, s)
    return out
