"""``kvgen verify`` for the per-token-head stores: edge-case heads into poisoned, guarded caches
laid out as vLLM lays them out, byte for byte against the reference."""

from __future__ import annotations

import math

import torch

from kvgen import _dtypes
from kvgen._math import cdiv
from kvgen.formats.per_token_head import INT4_BOUNDARIES
from kvgen.verify import GuardedCache, Result, guarded, make_slots

KV_LAYOUTS = ("nhd", "hnd", "kv_split")


def make_kv_caches(spec, num_blocks, block_size, heads, device, layout="nhd", joint_scales=False):
    """Poisoned, guarded caches for a per-token-head spec, as vLLM lays them out.

    ``nhd``: [num_blocks, block_size, heads, head]; ``hnd``: memory [num_blocks, heads,
    block_size, head] passed as a permuted view; ``kv_split``: K and V as the two halves of one
    [num_blocks, 2, block_size, heads, head] allocation (needs equal K and V widths);
    ``inline``: vLLM's allocation with the scales in each row's pad bytes, one [num_blocks, 2,
    block_size, heads, codes + scale bytes] byte allocation that all four caches view (needs
    equal K and V widths, and int8 / fp8 codes a multiple of 4 bytes: the fp32 scale follows
    them). ``joint_scales``: both scale caches as strided views into one allocation.
    Returns (key_cache, value_cache, k_scales, v_scales) as GuardedCache objects (with
    ``inline``, all on one backing buffer).
    """
    from kvgen.families.per_token_head import spec_format

    fmt, group = spec_format(spec)
    dtype, scale_dtype = fmt.code_dtype, fmt.scale_dtype
    widths = (fmt.code_bytes(spec.head_size), fmt.code_bytes(spec.head_size_v))
    groups = None
    if fmt.groups:
        groups = (
            fmt.scales_per_row(spec.head_size, group),
            fmt.scales_per_row(spec.head_size_v, group),
        )
    nb, bs, h = num_blocks, block_size, heads
    if layout == "inline":
        return _inline_caches(spec, fmt, widths, groups, (nb, bs, h), device)
    if layout == "kv_split":
        if widths[0] != widths[1]:
            raise ValueError("kv_split needs equal K and V widths")
        both = guarded((nb, 2, bs, h, widths[0]), dtype, device)
        kc = GuardedCache(both.backing, both.view[:, 0])
        vc = GuardedCache(both.backing, both.view[:, 1])
    elif layout == "hnd":
        kc = guarded((nb, h, bs, widths[0]), dtype, device, (0, 2, 1, 3))
        vc = guarded((nb, h, bs, widths[1]), dtype, device, (0, 2, 1, 3))
    else:
        kc = guarded((nb, bs, h, widths[0]), dtype, device)
        vc = guarded((nb, bs, h, widths[1]), dtype, device)
    if groups is None:
        if joint_scales:
            both = guarded((nb, bs, h, 2), scale_dtype, device)
            ks = GuardedCache(both.backing, both.view[..., 0])
            vs = GuardedCache(both.backing, both.view[..., 1])
        else:
            ks = guarded((nb, bs, h), scale_dtype, device)
            vs = guarded((nb, bs, h), scale_dtype, device)
    else:
        ks = guarded((nb, bs, h, groups[0]), scale_dtype, device)
        vs = guarded((nb, bs, h, groups[1]), scale_dtype, device)
    return kc, vc, ks, vs


def inline_row(codes: int, scales: int | None) -> tuple[int, int]:
    """(where the scales start, row bytes) of vLLM's inline-scale rows: ``codes`` bytes of
    codes, then ``scales`` fp16 group scales (int4: the codes padded to an even count), or one
    fp32 scale (``scales`` None: int8 / fp8, whose codes must then be a multiple of 4 bytes)."""
    if scales is None:
        if codes % 4:
            raise ValueError("the inline layout needs int8 / fp8 rows of a multiple of 4 codes")
        return codes, codes + 4
    start = codes + codes % 2
    return start, start + 2 * scales


def inline_views(raw: torch.Tensor, codes: int, scales: int | None, code_dtype, scale_dtype):
    """(k_cache, v_cache, k_scales, v_scales) as views of ``raw``, vLLM's [blocks, 2, page,
    heads, row] byte allocation of inline-scale rows (``inline_row``)."""
    start, _ = inline_row(codes, scales)
    halves = [raw[:, i] for i in (0, 1)]
    caches = [x[..., :codes].view(code_dtype) for x in halves]
    if scales is None:  # one fp32 scale after the codes
        return (*caches, *(x.view(scale_dtype)[..., start // 4] for x in halves))
    return (*caches, *(x.view(scale_dtype)[..., start // 2 :] for x in halves))


def _inline_caches(spec, fmt, widths, groups, shape, device):
    """``make_kv_caches``'s ``inline`` layout: the four caches on one guarded buffer."""
    if spec.head_size != spec.head_size_v:
        raise ValueError("the inline layout needs head_size_v == head_size")
    scales = groups[0] if groups else None
    _, row = inline_row(widths[0], scales)
    raw = guarded((*shape[:1], 2, *shape[1:], row), torch.uint8, device)
    views = inline_views(raw.view, widths[0], scales, fmt.code_dtype, fmt.scale_dtype)
    return tuple(GuardedCache(raw.backing, v) for v in views)


def _with(row: torch.Tensor, values: dict[int, float]) -> torch.Tensor:
    for i, v in values.items():
        row[i] = v
    return row


def edge_case_heads(tokens: int, heads: int, head_size: int, dtype, seed: int = 0):
    """``[tokens, heads, head_size]`` of ``dtype``: random rows and rows on the formats' edges."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, heads, head_size, generator=gen)
    finfo = torch.finfo(dtype)
    span = 8 if finfo.max < 1e5 else 20
    x *= torch.exp2(torch.randint(-span, span + 1, (tokens, heads, 1), generator=gen).float())
    rows = x.view(-1, head_size)
    d = head_size
    specials = [
        torch.zeros(d),  # scale clamps to 1e-6
        torch.cat([torch.tensor([127.0]), torch.arange(d - 1) % 64 - 31.5]),  # int8 ties
        torch.cat([torch.tensor([448.0]), torch.linspace(-1.9375, 1.9375, d - 1) * 8]),
        torch.cat([torch.tensor([448.0]), torch.arange(d - 1) * 2.0**-9]),  # fp8 subnormals
        torch.cat(
            [
                torch.tensor([1.0]),
                torch.tensor(INT4_BOUNDARIES).repeat(d)[: d - 1],
            ]
        ),  # int4 boundaries at scale 1
        torch.randn(d, generator=gen) * torch.where(torch.arange(d) % 17 == 3, 50.0, 1.0),
        torch.randn(d, generator=gen) * finfo.smallest_normal * 4,  # tiny, subnormal products
        -torch.zeros(d),
        _with(torch.randn(d, generator=gen), {d // 2: float("nan")}),  # NaN: the row / group NaN
        _with(torch.randn(d, generator=gen), {0: float("inf")}),
        _with(torch.randn(d, generator=gen), {1: float("nan"), d - 1: -float("inf")}),
        # int4: a group's fp32 scale above fp16's 65504 (saturates); bf16 and fp32 input only
        torch.randn(d, generator=gen) * (2.0**17 if finfo.max > 1e5 else 1.0),
    ]
    for i, row in enumerate(specials):
        if i < rows.shape[0]:
            rows[i] = row[:d]
    return x.to(dtype)


def verify_store_kv(op, spec, device, tokens: int = 5, heads: int = 3, seed: int = 0) -> Result:
    """``op`` (the family's public store) on ``spec``'s kernel against the reference: 15
    (token, head) rows, the 12 edge rows of ``edge_case_heads`` and 3 random ones."""
    from kvgen.formats import per_token_head as ref

    dt = _dtypes.TORCH[spec.in_dtype]
    key = edge_case_heads(tokens, heads, spec.head_size, dt, seed)
    value = edge_case_heads(tokens, heads, spec.head_size_v, dt, seed + 1)
    block_size = 8
    caches = make_kv_caches(spec, cdiv(2 * tokens, block_size), block_size, heads, device)
    slots = make_slots(tokens, caches[0].view.shape[0] * block_size, device, seed=seed)
    expected = [c.backing.cpu().clone() for c in caches]  # nhd: one buffer per cache
    want = [c.rebuild(b) for c, b in zip(caches, expected, strict=True)]
    ref.store(key, value, *want, slots.cpu())
    op(key.to(device), value.to(device), *[c.view for c in caches], slots)
    mismatched = sum(
        int((c.backing.cpu() != w).sum()) for c, w in zip(caches, expected, strict=True)
    )
    max_error = 0.0
    if mismatched:
        for cache_i, scale_i, hs in ((0, 2, spec.head_size), (1, 3, spec.head_size_v)):
            got = ref.gather(
                caches[cache_i].view.cpu(), caches[scale_i].view.cpu(), slots.cpu(), hs
            )
            exp = ref.gather(want[cache_i], want[scale_i], slots.cpu(), hs)
            max_error = max(max_error, float((got - exp).abs().nan_to_num(math.inf).max()))
    return Result(spec.name, mismatched == 0, mismatched, max_error)
