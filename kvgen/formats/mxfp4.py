"""MXFP4 (OCP MX: E2M1 elements + one E8M0 shared exponent per group), as docs/formats.md
defines it.

One cache row per slot: ``[latent/2 packed element bytes][latent/group scale bytes]``.

>>> row_bytes(512, 32)
272

A group that holds a NaN or an infinity stores the scale byte 0xFF (OCP MX's NaN scale) and
codes 0, and reads back as NaN in every element; the other groups of its row are unaffected.
"""

from __future__ import annotations

import torch

#: E2M1 magnitudes by 3-bit code m = 0..7.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
#: Midpoints between consecutive magnitudes; m = how many of these |v| is strictly above.
E2M1_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
E8M0_BIAS = 127
ZERO_GROUP_EXPONENT = 127  # the stored scale byte of an all-zero group
NAN_EXPONENT = 0xFF  # the stored scale byte of a group holding a NaN or an infinity


def row_bytes(latent: int, group: int = 32) -> int:
    """Bytes of one cache row: packed nibbles, then one scale byte per group."""
    return latent // 2 + latent // group


def ceil_log2_exact(q: torch.Tensor) -> torch.Tensor:
    """ceil(log2(q)) for non-negative fp32 ``q``, read off its bit pattern (no fp32 log2).

    The unbiased exponent, plus one unless the mantissa bits are all zero (q a power of two).
    """
    bits = q.contiguous().view(torch.int32)
    exponent = ((bits >> 23) & 0xFF) - 127
    mantissa = bits & 0x7FFFFF
    return exponent + (mantissa != 0).to(torch.int32)


def nonfinite_groups(x: torch.Tensor, group: int) -> torch.Tensor:
    """Which groups hold a NaN or an infinity: [tokens, latent/group] bool."""
    groups = x.float().reshape(x.shape[0], x.shape[1] // group, group)
    return ~torch.isfinite(groups).all(dim=-1)


def group_exponents(x: torch.Tensor, group: int) -> torch.Tensor:
    """The biased E8M0 scale byte X of every group: [tokens, latent/group] int32."""
    groups = x.float().reshape(x.shape[0], x.shape[1] // group, group)
    bad = nonfinite_groups(x, group)
    amax = torch.where(bad, 0.0, groups.abs().amax(dim=-1))
    q = amax / 6.0  # fp32 division, IEEE round-to-nearest on the CPU
    x_biased = (ceil_log2_exact(q) + E8M0_BIAS).clamp(1, 254)
    x_biased = torch.where(amax == 0, torch.full_like(x_biased, ZERO_GROUP_EXPONENT), x_biased)
    return torch.where(bad, torch.full_like(x_biased, NAN_EXPONENT), x_biased)


def quantize_rows(x: torch.Tensor, group: int = 32) -> torch.Tensor:
    """Encode ``x`` ([tokens, latent], any float dtype) as cache rows [tokens, row_bytes] uint8."""
    tokens, latent = x.shape
    if latent % group or group % 2:
        raise ValueError(f"group {group} must be even and divide latent {latent}")
    bad = nonfinite_groups(x, group)
    xf = torch.where(bad[..., None], 0.0, x.float().reshape(tokens, latent // group, group))
    x_biased = group_exponents(x, group)

    # v = x * 2^-(X - 127): multiplying by a power of two is exact. (A non-finite group's
    # elements are 0 here: its codes are 0.)
    finite_biased = torch.where(bad, E8M0_BIAS, x_biased)
    v = xf * torch.exp2(-(finite_biased - E8M0_BIAS).double()).float()[..., None]
    mag = torch.zeros_like(v, dtype=torch.int32)
    for midpoint in E2M1_MIDPOINTS:
        mag += (v.abs() > midpoint).to(torch.int32)  # strictly above: ties go down
    sign = (v < 0).to(torch.int32)  # -0.0 is not < 0: encodes as +0; tiny negatives as -0
    codes = (sign << 3 | mag).reshape(tokens, latent)

    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)  # element 2i low nibble, 2i+1 high
    return torch.cat([packed, x_biased], dim=1).to(torch.uint8)


def dequantize_rows(rows: torch.Tensor, latent: int, group: int = 32) -> torch.Tensor:
    """Decode cache rows ([n, row_bytes] uint8) to fp32 [n, latent]: value(code) * 2^(X - 127);
    every element of a group whose scale byte X is 0xFF is NaN."""
    rows = rows.to(torch.int32)
    packed, x_biased = rows[:, : latent // 2], rows[:, latent // 2 : row_bytes(latent, group)]
    codes = torch.stack([packed & 0xF, packed >> 4], dim=-1).reshape(rows.shape[0], latent)
    values = torch.tensor(E2M1_VALUES, device=rows.device)[codes & 7]
    values = torch.where(codes & 8 != 0, -values, values)
    scale = torch.exp2((x_biased - E8M0_BIAS).double()).float()
    scale = torch.where(x_biased == NAN_EXPONENT, float("nan"), scale)
    grouped = values.reshape(rows.shape[0], latent // group, group) * scale[..., None]
    return grouped.reshape(rows.shape[0], latent)


def _slot_index(cache: torch.Tensor, slots: torch.Tensor, pitch: int):
    """Which slots are valid, and a function mapping valid slots to their row views' indices.

    The paged layout ``[num_blocks, block_size, row_bytes]`` may have a block stride larger than
    ``block_size`` rows; slot ``s`` is row ``s % block_size`` of block ``s // block_size``. Any
    other cache is contiguous and slot ``s`` is row ``s`` of ``cache.view(-1, row_bytes)``.
    """
    slots = slots.to(torch.int64).cpu()
    if cache.ndim == 3:
        block_size = cache.shape[1]
        num_slots = cache.shape[0] * block_size
        rows = cache
        index = lambda s: (s // block_size, s % block_size)  # noqa: E731
    else:
        rows = cache.view(-1, pitch)
        num_slots = rows.shape[0]
        index = lambda s: (s,)  # noqa: E731
    valid = (slots >= 0) & (slots < num_slots)
    return rows, valid, index(slots[valid])


def store(
    x: torch.Tensor, slot_mapping: torch.Tensor, cache: torch.Tensor, group: int = 32
) -> None:
    """Reference store: write the encoded row of token i to slot ``slot_mapping[i]`` in place.

    Negative slots (PAD_SLOT_ID) and slots ``>= num_slots`` are skipped.
    """
    pitch = row_bytes(x.shape[1], group)
    rows, valid, index = _slot_index(cache, slot_mapping, pitch)
    encoded = quantize_rows(x.cpu(), group)[valid]
    rows[tuple(i.to(cache.device) for i in index)] = encoded.to(cache.device)


def gather(cache: torch.Tensor, slots: torch.Tensor, latent: int, group: int = 32) -> torch.Tensor:
    """Reference read: fp32 [len(slots), latent] on the CPU; rows of invalid slots are zeros."""
    rows, valid, index = _slot_index(cache, slots, row_bytes(latent, group))
    out = torch.zeros(slots.shape[0], latent)
    out[valid] = dequantize_rows(
        rows[tuple(i.to(cache.device) for i in index)].cpu(), latent, group
    )
    return out
