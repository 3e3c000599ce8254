"""Run generated variants against the pure-torch references: what ``kvgen verify`` does.

Inputs are built to hit every corner of the format (midpoint ties, -0, all-zero groups, huge,
tiny and subnormal magnitudes, per-group scales across a wide range); caches are poisoned with
0xFF and surrounded by guard regions that must come back untouched.
"""

from __future__ import annotations

import dataclasses
import math
import warnings

import torch

from kvgen import _dtypes
from kvgen.codegen.spec import VariantSpec
from kvgen.formats import mxfp4
from kvgen.formats.per_token_head import INT4_BOUNDARIES

GUARD_BYTES = 4096
POISON = 0xFF


def torch_dtype(name: str) -> torch.dtype:
    return _dtypes.TORCH[name]


def edge_case_latents(
    tokens: int, latent: int, group: int, dtype: torch.dtype, seed: int = 0
) -> torch.Tensor:
    """``[tokens, latent]`` of ``dtype``: random rows plus rows built on the format's edges."""
    gen = torch.Generator().manual_seed(seed)
    groups = latent // group
    x = torch.randn(tokens, groups, group, generator=gen)
    # Per-group magnitudes over a wide range of powers of two, so scale bytes vary widely.
    finfo = torch.finfo(dtype)
    span = 8 if finfo.bits == 16 and finfo.max < 1e5 else 20  # fp16 overflows past 2^15
    x *= torch.exp2(torch.randint(-span, span + 1, (tokens, groups, 1), generator=gen).float())
    mids = torch.tensor(mxfp4.E2M1_MIDPOINTS)
    specials = []
    # Exact midpoints (ties go to the smaller magnitude), both signs, in a group whose peak is 6
    # (X = 127) and in one scaled by 2^5.
    tie = torch.zeros(group)
    tie[0] = 6.0
    ties = torch.cat([mids, -mids, mids + 2**-10, mids - 2**-10])
    tie[1 : 1 + min(group - 1, ties.numel())] = ties[: group - 1]
    specials += [tie, tie * 32.0, tie * 2.0**-9]
    # -0.0, tiny negatives that round to -0, tiny positives, at peak 6.
    signs = torch.tensor([6.0, -0.0, -0.1, 0.1, -0.2, 0.0, -6.0, 0.25, -0.25])
    specials.append(torch.cat([signs, torch.zeros(group)])[:group])
    specials.append(torch.zeros(group))  # all-zero group: scale byte 127
    specials.append(-torch.zeros(group))  # all -0.0: codes 0, scale 127
    big = finfo.max
    specials.append(torch.linspace(-1.0, 1.0, group) * big)  # huge magnitudes, up to the max
    tiny = finfo.smallest_normal
    specials.append(torch.linspace(-4, 4, group) * tiny)  # smallest normals
    sub = tiny * 2.0 ** -(finfo.bits // 8)  # subnormal inputs
    specials.append(torch.arange(group).float() * sub * (-1) ** torch.arange(group))
    # amax / 6 not a power of two; elements exactly on scaled midpoints
    odd = torch.zeros(group)
    odd[0] = 7.0
    odd[1 : min(group, 8)] = mids[: min(group, 8) - 1] * 2.0
    specials.append(odd)
    specials.append(torch.full((group,), 6.0 * 2.0**-126))  # q at the smallest normal

    flat = x.reshape(-1, group)
    for i, s in enumerate(specials):
        if i < flat.shape[0]:
            flat[i] = s
    x = flat.reshape(tokens, latent)
    return x.to(dtype)


@dataclasses.dataclass
class GuardedCache:
    """A cache view inside a larger poisoned buffer: guards before, after and between blocks."""

    backing: torch.Tensor  # uint8, 1-D
    view: torch.Tensor

    def rebuild(self, backing: torch.Tensor) -> torch.Tensor:
        """The same view into another backing buffer (a clone, or a copy on another device)."""
        return backing.view(self.view.dtype).as_strided(
            self.view.shape, self.view.stride(), self.view.storage_offset()
        )

    def fresh_copy(self) -> GuardedCache:
        backing = self.backing.clone()
        return GuardedCache(backing, self.rebuild(backing))


def make_cache(
    layout: str,
    num_slots: int,
    pitch: int,
    device: torch.device | str,
    block_size: int = 16,
    gap_rows: int = 3,
) -> GuardedCache:
    """A poisoned cache: ``paged`` has ``gap_rows`` of other layers' rows between blocks."""
    if layout == "paged":
        blocks = math.ceil(num_slots / block_size)
        stride_rows = block_size + gap_rows
        size = GUARD_BYTES * 2 + blocks * stride_rows * pitch
        backing = torch.full((size,), POISON, dtype=torch.uint8, device=device)
        view = backing.as_strided(
            (blocks, block_size, pitch), (stride_rows * pitch, pitch, 1), GUARD_BYTES
        )
    else:
        backing = torch.full(
            (GUARD_BYTES * 2 + num_slots * pitch,), POISON, dtype=torch.uint8, device=device
        )
        view = backing[GUARD_BYTES : GUARD_BYTES + num_slots * pitch].view(num_slots, pitch)
    return GuardedCache(backing, view)


def num_slots_of(cache: torch.Tensor, pitch: int) -> int:
    return cache.shape[0] * cache.shape[1] if cache.ndim == 3 else cache.numel() // pitch


def make_slots(tokens: int, num_slots: int, device, dtype=torch.int64, seed: int = 0):
    """Distinct random slots, with PAD_SLOT_ID (-1) and out-of-range entries mixed in."""
    gen = torch.Generator().manual_seed(seed)
    slots = torch.randperm(num_slots, generator=gen)[:tokens].to(torch.int64)
    if tokens >= 4:
        slots[1] = -1
        slots[tokens // 2] = num_slots  # one past the end
        slots[-1] = num_slots + 12345
    return slots.to(dtype).to(device)


@dataclasses.dataclass
class Result:
    name: str
    passed: bool
    mismatched: int  # bytes (stores) or elements (readers) that differ from the reference
    max_error: float  # max |kernel - reference| in dequantized values
    detail: str = ""


def verify_store_mxfp4(spec: VariantSpec, device, tokens: int = 48, seed: int = 0) -> Result:
    from kvgen.ops import store_mxfp4_mla

    pitch = mxfp4.row_bytes(spec.latent, spec.group)
    x = edge_case_latents(tokens, spec.latent, spec.group, torch_dtype(spec.in_dtype), seed)
    x = x.to(device)
    num_slots = tokens * 2 + 5
    cache = make_cache(spec.layout, num_slots, pitch, device)
    slots = make_slots(tokens, num_slots_of(cache.view, pitch), device, seed=seed)
    expected = cache.fresh_copy()
    mxfp4.store(x, slots, expected.view, spec.group)
    store_mxfp4_mla(x, slots, cache.view, spec.group)
    diff = cache.backing != expected.backing
    mismatched = int(diff.sum())
    max_error = 0.0
    if mismatched:
        got = mxfp4.gather(cache.view, slots, spec.latent, spec.group)
        want = mxfp4.gather(expected.view, slots, spec.latent, spec.group)
        max_error = float((got - want).abs().nan_to_num(math.inf).max())
    return Result(spec.name, mismatched == 0, mismatched, max_error)


def verify_gather_mxfp4(spec: VariantSpec, device, tokens: int = 48, seed: int = 0) -> Result:
    from kvgen.ops import gather_mxfp4_mla

    pitch = mxfp4.row_bytes(spec.latent, spec.group)
    x = edge_case_latents(tokens, spec.latent, spec.group, torch.float32, seed)
    num_slots = tokens * 2 + 5
    cache = make_cache(spec.layout, num_slots, pitch, "cpu")
    slots = make_slots(tokens, num_slots_of(cache.view, pitch), "cpu", seed=seed)
    mxfp4.store(x, slots, cache.view, spec.group)
    want = mxfp4.gather(cache.view, slots, spec.latent, spec.group)
    dev_cache = cache.fresh_copy()
    dev_cache = GuardedCache(dev_cache.backing.to(device), None)  # type: ignore[arg-type]
    view = dev_cache.backing.as_strided(
        cache.view.shape, cache.view.stride(), cache.view.storage_offset()
    )
    out_dtype = torch_dtype(spec.out_dtype)
    got = gather_mxfp4_mla(view, slots.to(device), spec.latent, spec.group, out_dtype).cpu()
    want = want.to(out_dtype)
    same = (got == want) | (got.isnan() & want.isnan())
    mismatched = int((~same).sum())
    err = (got.float() - want.float()).abs().nan_to_num(math.inf)
    max_error = float(err.max()) if err.numel() else 0.0
    untouched = bool((dev_cache.backing.cpu() == cache.backing).all())
    return Result(
        spec.name,
        mismatched == 0 and untouched,
        mismatched,
        max_error,
        "" if untouched else "cache modified by a reader",
    )


def guarded(mem_shape, dtype, device, perm=None) -> GuardedCache:
    """A poisoned (0xFF bytes) tensor of memory shape ``mem_shape``, viewed through ``perm``."""
    n = math.prod(mem_shape) * dtype.itemsize
    backing = torch.full((2 * GUARD_BYTES + n,), POISON, dtype=torch.uint8, device=device)
    mem = backing[GUARD_BYTES : GUARD_BYTES + n].view(dtype).view(mem_shape)
    return GuardedCache(backing, mem.permute(perm) if perm else mem)


KV_LAYOUTS = ("nhd", "hnd", "kv_split")


def make_kv_caches(spec, num_blocks, block_size, heads, device, layout="nhd", joint_scales=False):
    """Poisoned, guarded caches for a per-token-head spec, as vLLM lays them out.

    ``nhd``: [num_blocks, block_size, heads, head]; ``hnd``: memory [num_blocks, heads,
    block_size, head] passed as a permuted view; ``kv_split``: K and V as the two halves of one
    [num_blocks, 2, block_size, heads, head] allocation (needs equal K and V widths).
    ``joint_scales``: both scale caches as strided views into one allocation.
    Returns (key_cache, value_cache, k_scales, v_scales) as GuardedCache objects.
    """
    from kvgen.families.per_token_head import _FMT

    int4 = spec.family == "store_kv_int4_per_token_head"
    if int4:
        dtype = torch.uint8
        widths = (-(-spec.head_size // 2), -(-spec.head_size_v // 2))
        groups = (-(-spec.head_size // spec.channels), -(-spec.head_size_v // spec.channels))
        scale_dtype = torch.float16
    else:
        dtype = getattr(torch, _FMT[spec.fmt][0])
        widths = (spec.head_size, spec.head_size_v)
        groups = None
        scale_dtype = torch.float32
    nb, bs, h = num_blocks, block_size, heads
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
    ]
    for i, row in enumerate(specials):
        if i < rows.shape[0]:
            rows[i] = row[:d]
    return x.to(dtype)


def verify_store_kv(spec, device, tokens: int = 24, heads: int = 3, seed: int = 0) -> Result:
    from kvgen.formats import per_token_head as ref
    from kvgen.ops import (
        triton_reshape_and_cache_flash_int4_per_token_head,
        triton_reshape_and_cache_flash_per_token_head_quant,
    )

    op = (
        triton_reshape_and_cache_flash_int4_per_token_head
        if spec.family == "store_kv_int4_per_token_head"
        else triton_reshape_and_cache_flash_per_token_head_quant
    )
    dt = torch_dtype(spec.in_dtype)
    key = edge_case_heads(tokens, heads, spec.head_size, dt, seed)
    value = edge_case_heads(tokens, heads, spec.head_size_v, dt, seed + 1)
    block_size = 8
    caches = make_kv_caches(spec, -(-2 * tokens // block_size), block_size, heads, device)
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
    # Pages of 16 keys, or the smallest size above that the variant's launcher accepts (the tma
    # variant's tiles never cross a page).
    page = next(
        p
        for p in (16, math.lcm(16, meta_p["block_n"]))
        if _accepts(module, torch.empty(1, p, 1, spec.head_dim, dtype=dtype), meta_p)
    )
    need = [-(-n // page) for n in seqlens]
    blocks = sum(need) + 2
    k = torch.randn(blocks, page, 1, spec.head_dim, generator=gen).to(dtype)
    pages = torch.randperm(blocks, generator=gen).to(torch.int32)
    table = torch.zeros(len(seqlens), max(need), dtype=torch.int32)
    i = 0
    for b, nb in enumerate(need):
        table[b, :nb] = pages[i : i + nb]
        i += nb
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
    rel = float((out.cpu().double() - ref_out).norm() / ref_out.norm())
    finite = torch.isfinite(ref_lse)
    lse_err = float((lse.cpu().double()[finite] - ref_lse[finite]).abs().max())
    empty_ok = bool((lse.cpu()[~finite] == -math.inf).all())
    passed = rel < 1e-2 and lse_err < 1e-3 and empty_ok
    return Result(
        spec.name,
        passed,
        0 if passed else 1,
        rel,
        "" if passed else f"lse error {lse_err:.2e}, empty rows ok: {empty_ok}",
    )


def _accepts(module, k_cache, meta_p) -> bool:
    try:
        module.check_cache(k_cache, meta_p["block_n"])
    except ValueError:
        return False
    return True


VERIFIERS = {
    "mla_decode": verify_mla_decode,
    "store_kv_per_token_head": verify_store_kv,
    "store_kv_int4_per_token_head": verify_store_kv,
    "store_mxfp4_mla": verify_store_mxfp4,
    "gather_mxfp4_mla": verify_gather_mxfp4,
}


def verify(spec: VariantSpec, device) -> Result:
    try:
        with warnings.catch_warnings():
            # numpy, under the interpreter, warns on the overflow the huge-magnitude rows are
            # there to cause (dequantized 6 * 2^126 is inf in fp32, as the reference agrees).
            warnings.simplefilter("ignore", RuntimeWarning)
            return VERIFIERS[spec.family](spec, device)
    except Exception as exc:  # a crash is a failed variant, reported, not a dead table
        return Result(spec.name, False, -1, math.inf, f"{type(exc).__name__}: {exc}")


def accuracy_table(rows: int = 2048, width: int = 512, seed: int = 0) -> list[dict]:
    """SNR (dB) and max error of quantize -> dequantize for every format, on three data sets.

    Runs the pure-torch references, which every kernel matches byte for byte (the tests show
    it). "max err / amax" is the largest |x - x_hat| over the absolute maximum of its row.
    """
    from kvgen.formats import mxfp4
    from kvgen.formats import per_token_head as pth

    gen = torch.Generator().manual_seed(seed)
    gauss = torch.randn(rows, width, generator=gen)
    t3 = torch.distributions.StudentT(3.0).sample((rows, width))
    outliers = torch.randn(rows, width, generator=gen)
    cols = torch.randint(0, width, (rows, 4), generator=gen)
    outliers.scatter_(1, cols, outliers.gather(1, cols).sign() * 50.0)
    datasets = {"gaussian": gauss, "student-t(3)": t3, "50x outlier channels": outliers}

    formats = {}
    for dtype, name in (
        (torch.int8, "int8"),
        (torch.float8_e4m3fn, "fp8 e4m3"),
        (torch.float8_e5m2, "fp8 e5m2"),
    ):
        formats[f"{name} per token-head"] = lambda x, d=dtype: pth.dequantize_per_token_head(
            *pth.quantize_per_token_head(x, d)
        )
    for c in pth.INT4_CHANNELS:
        formats[f"int4 levels, {c} ch/scale"] = lambda x, c=c: pth.dequantize_int4(
            *pth.quantize_int4(x, c), x.shape[-1]
        )
    for g in (16, 32, 64):
        formats[f"mxfp4, group {g}"] = lambda x, g=g: mxfp4.dequantize_rows(
            mxfp4.quantize_rows(x, g), x.shape[-1], g
        )
    table = []
    for fmt, roundtrip in formats.items():
        for data_name, x in datasets.items():
            xh = roundtrip(x)
            err = x - xh
            snr = 10 * math.log10(float((x**2).sum()) / max(float((err**2).sum()), 1e-30))
            rel = float((err.abs() / x.abs().amax(-1, keepdim=True)).max())
            table.append({"format": fmt, "data": data_name, "snr_db": snr, "max_err_amax": rel})
    return table
