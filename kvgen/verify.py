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

    def fresh_copy(self) -> GuardedCache:
        backing = self.backing.clone()
        view = backing.as_strided(self.view.shape, self.view.stride(), self.view.storage_offset())
        return GuardedCache(backing, view)


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


VERIFIERS = {
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
