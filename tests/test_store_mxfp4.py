"""Every generated MXFP4 store and gather variant against the reference, byte for byte."""

import warnings

import pytest
import torch

from kvgen import registry
from kvgen.codegen import load
from kvgen.families.mxfp4_mla.verify import edge_case_latents
from kvgen.formats import mxfp4
from kvgen.ops import gather_mxfp4_mla, mxfp4_row_bytes, store_mxfp4_mla
from kvgen.runtime import local_target
from kvgen.verify import GUARD_BYTES, POISON, make_cache, make_slots

ARCH, TARGET = local_target()
STORES = registry.variants(ARCH, TARGET, "store_mxfp4_mla")
GATHERS = registry.variants(ARCH, TARGET, "gather_mxfp4_mla")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # interpreter overflow noise


def _assert_guards_untouched(cache):
    assert (cache.backing[:GUARD_BYTES] == POISON).all(), "guard before the cache was written"
    assert (cache.backing[-GUARD_BYTES:] == POISON).all(), "guard after the cache was written"


@pytest.mark.parametrize("spec", STORES, ids=lambda s: s.name)
def test_store_variant_is_byte_exact(spec, device):
    tokens = 40
    pitch = mxfp4.row_bytes(spec.latent, spec.group)
    x = edge_case_latents(tokens, spec.latent, spec.group, DTYPES[spec.dtype], seed=3)
    cache = make_cache(spec.layout, 2 * tokens + 7, pitch, device, block_size=16, gap_rows=5)
    num_slots = cache.view.shape[0] * (cache.view.shape[1] if spec.layout == "paged" else 1)
    slots = make_slots(tokens, num_slots, device, seed=3)
    want = _cpu_reference(cache, x, slots, spec.group)

    store_mxfp4_mla(x.to(device), slots, cache.view, spec.group)

    _assert_guards_untouched(cache)
    got = cache.backing.cpu()
    # Everything outside the written rows (skipped slots, gaps between blocks) is still poison,
    # and every written row equals the reference.
    assert torch.equal(got, want), f"{int((got != want).sum())} bytes differ"


@pytest.mark.parametrize("spec", GATHERS, ids=lambda s: s.name)
def test_gather_variant_matches_reference(spec, device):
    tokens = 40
    pitch = mxfp4.row_bytes(spec.latent, spec.group)
    x = edge_case_latents(tokens, spec.latent, spec.group, torch.float32, seed=4)
    cache = make_cache(spec.layout, 2 * tokens + 7, pitch, "cpu", block_size=8, gap_rows=2)
    num_slots = cache.view.shape[0] * (cache.view.shape[1] if spec.layout == "paged" else 1)
    slots = make_slots(tokens, num_slots, "cpu", seed=4)
    mxfp4.store(x, slots, cache.view, spec.group)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        want = mxfp4.gather(cache.view, slots, spec.latent, spec.group).to(DTYPES[spec.dtype])

    backing = cache.backing.to(device)
    view = backing.as_strided(cache.view.shape, cache.view.stride(), cache.view.storage_offset())
    # poison: a value no MXFP4 element has (12345 is no E2M1 value times a power of two)
    out = torch.full((tokens, spec.latent), 12345.0, dtype=DTYPES[spec.dtype], device=device)
    module = load(spec)
    args = [view, slots.to(device), out, num_slots]
    if spec.layout == "paged":
        args += [view.shape[1], view.stride(0)]
    module.launch(*args, **spec.default_meta(tokens))
    got = out.cpu()
    assert not (got == 12345.0).any(), "an output element was left unwritten"
    same = (got == want) | (got.isnan() & want.isnan())
    assert same.all(), f"{int((~same).sum())} elements differ"
    assert torch.equal(backing.cpu(), cache.backing), "the reader wrote into the cache"
    # The public entry point gives the same values.
    public = gather_mxfp4_mla(view, slots.to(device), spec.latent, spec.group, DTYPES[spec.dtype])
    assert torch.equal(public.cpu().nan_to_num(), got.nan_to_num())
    assert torch.equal(public.cpu().isnan(), got.isnan())


@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("col_stride", [1, 2])
def test_strided_rows_and_slot_dtypes(device, slot_dtype, col_stride):
    latent, group, tokens = 512, 32, 24
    wide = torch.randn(tokens, latent * col_stride + 96, device=device).to(torch.bfloat16)
    x = wide[:, : latent * col_stride : col_stride]  # row stride > latent, maybe column stride 2
    assert x.stride() == (latent * col_stride + 96, col_stride)
    cache = make_cache("paged", 64, 272, device, block_size=16, gap_rows=16)
    slots_all = make_slots(2 * tokens, 64, device, dtype=slot_dtype)
    slots = slots_all[::2]  # a non-contiguous slot mapping
    want = _cpu_reference(cache, x, slots, group)
    store_mxfp4_mla(x, slots, cache.view, group)
    assert torch.equal(cache.backing.cpu(), want)
    _assert_guards_untouched(cache)


def _cpu_reference(cache, x, slots, group):
    ref = cache.fresh_copy()
    ref_backing = ref.backing.cpu()
    ref_view = ref_backing.as_strided(
        cache.view.shape, cache.view.stride(), cache.view.storage_offset()
    )
    mxfp4.store(x.cpu(), slots.cpu(), ref_view, group)
    return ref_backing


@pytest.mark.parametrize(
    "block_size,gap_rows", [(1, 0), (1, 3), (5, 2), (16, 0), (24, 0), (64, 64), (256, 1)]
)
def test_paged_block_strides(device, block_size, gap_rows):
    latent, group, tokens = 256, 16, 33
    x = torch.randn(tokens, latent, device=device)
    cache = make_cache("paged", 300, mxfp4.row_bytes(latent, group), device, block_size, gap_rows)
    slots = make_slots(tokens, cache.view.shape[0] * block_size, device, seed=block_size)
    want = _cpu_reference(cache, x, slots, group)
    store_mxfp4_mla(x, slots, cache.view, group)
    assert torch.equal(cache.backing.cpu(), want)


@pytest.mark.parametrize("shape", ["1d", "2d", "4d"])
def test_flat_cache_shapes(device, shape):
    latent, group, tokens = 448, 32, 20
    pitch = mxfp4_row_bytes(latent, group)
    backing = torch.full((2 * GUARD_BYTES + 64 * pitch,), POISON, dtype=torch.uint8, device=device)
    flat = backing[GUARD_BYTES : GUARD_BYTES + 64 * pitch]
    cache = {"1d": flat, "2d": flat.view(64, pitch), "4d": flat.view(4, 2, 8, pitch)}[shape]
    x = torch.randn(tokens, latent, device=device).to(torch.float16)
    slots = make_slots(tokens, 64, device)
    want = backing.cpu().clone()
    mxfp4.store(x.cpu(), slots.cpu(), want[GUARD_BYTES : GUARD_BYTES + 64 * pitch], group)
    store_mxfp4_mla(x, slots, cache, group)
    assert torch.equal(backing.cpu(), want)


def test_zero_tokens_write_nothing(device):
    cache = make_cache("paged", 32, 272, device)
    before = cache.backing.clone()
    store_mxfp4_mla(
        torch.empty(0, 512, device=device),
        torch.empty(0, dtype=torch.int64, device=device),
        cache.view,
    )
    assert torch.equal(cache.backing, before)


def test_64bit_offsets(device):
    """Rows past byte 2^31 of the cache, in both layouts."""
    latent, group = 512, 32
    pitch = mxfp4.row_bytes(latent, group)
    num_slots = (2**31) // pitch + 64
    try:
        cache = torch.empty(num_slots * pitch, dtype=torch.uint8, device=device)
    except (RuntimeError, MemoryError):
        pytest.fail("could not allocate a 2 GiB cache for the 64-bit offset test")
    tail = cache[-80 * pitch :]
    tail.fill_(POISON)
    x = torch.randn(6, latent, device=device).to(torch.bfloat16)
    slots = torch.tensor(
        [num_slots - 1, num_slots - 40, -1, num_slots, num_slots - 50, (2**31) // pitch + 1],
        device=device,
    )
    store_mxfp4_mla(x, slots, cache, group)
    rows = mxfp4.quantize_rows(x.cpu(), group)
    flat = cache.view(-1, pitch)
    for i in (0, 1, 4, 5):
        assert torch.equal(flat[slots[i]].cpu(), rows[i]), f"slot {int(slots[i])}"
    written = {int(s) for s in slots[[0, 1, 4, 5]]}
    for s in range(num_slots - 80, num_slots):
        if s not in written:
            assert (flat[s] == POISON).all(), f"slot {s} was written"

    # The paged view of the same memory: 2 blocks whose second starts past 2^31.
    block_size = 64
    block_stride = (num_slots - block_size) * pitch
    paged = cache.as_strided((2, block_size, pitch), (block_stride, pitch, 1))
    tail.fill_(POISON)
    store_mxfp4_mla(
        x[:2], torch.tensor([block_size + 5, block_size + 63], device=device), paged, group
    )
    assert torch.equal(paged[1, 5].cpu(), rows[0]) and torch.equal(paged[1, 63].cpu(), rows[1])
    del cache


def test_scale_exponent_at_every_boundary(device):
    """Group peaks a few ulps around 1.5 * 2^e and 2^e for every exponent, and subnormals.

    The kernel reads the E8M0 exponent off amax's bits; the reference divides by 6 and takes
    ceil(log2) of the quotient's bits. They must agree everywhere.
    """
    group, latent = 32, 256
    peaks = []
    for e in range(-149, 128):
        for base in (1.0, 1.5):
            center = torch.tensor(base * 2.0**e, dtype=torch.float32).view(torch.int32)
            peaks += (center + torch.arange(-2, 3, dtype=torch.int32)).tolist()
    peaks = torch.tensor(peaks, dtype=torch.int32).view(torch.float32)
    peaks = peaks[torch.isfinite(peaks) & (peaks > 0)]
    peaks = torch.cat([peaks, torch.tensor([2.0**-149, 6 * 2.0**-126])])
    groups_per_row = latent // group
    rows = -(-peaks.numel() // groups_per_row)
    gen = torch.Generator().manual_seed(0)
    x = torch.rand(rows * groups_per_row, group, generator=gen) * 0.99
    padded = torch.ones(rows * groups_per_row)
    padded[: peaks.numel()] = peaks
    x = x * padded[:, None]
    x[:, 0] = padded * torch.where(torch.arange(padded.numel()) % 2 == 0, 1.0, -1.0)
    x = x.nan_to_num(nan=0.0).reshape(rows, latent)
    pitch = mxfp4.row_bytes(latent, group)
    cache = make_cache("flat", rows, pitch, device)
    slots = torch.arange(rows, device=device)
    want = _cpu_reference(cache, x, slots, group)
    store_mxfp4_mla(x.to(device), slots, cache.view, group)
    got = cache.backing.cpu()
    assert torch.equal(got, want), f"{int((got != want).sum())} bytes differ"


def _every_value_groups(dtype: torch.dtype, peak_shifts=(0, 1, 3, 9)) -> torch.Tensor:
    """Rows of 32-element groups holding every finite value of ``dtype``, each group led by a
    peak 2^d times its largest magnitude (d in ``peak_shifts``, capped at the largest finite):
    every input is quantized at several distances below its group's scale."""
    bits = torch.arange(0, 1 << 16, dtype=torch.int32).to(torch.int16)
    vals = bits.view(dtype).float()
    vals = vals[torch.isfinite(vals)]
    vals = vals[vals.abs().argsort(stable=True)]
    vals = torch.cat([vals, vals.new_zeros(-len(vals) % 31)]).view(-1, 31)
    biggest = torch.finfo(dtype).max
    groups = []
    for d in peak_shifts:
        peak = (vals.abs().amax(dim=1, keepdim=True) * 2.0**d).clamp(max=biggest)
        groups.append(torch.cat([peak.to(dtype).float(), vals], dim=1))
    rows = torch.cat(groups).to(dtype)
    rows = torch.cat([rows, rows.new_zeros(-len(rows) % 16, 32)])  # 16 groups = one 512 row
    return rows.view(-1, 512)


@pytest.mark.parametrize("in_dtype", ["bf16", "fp16"])
def test_every_input_value_is_byte_exact(in_dtype, device):
    """Every finite bf16 / fp16 value (both signs, -0, subnormals, the largest), at several
    distances below its group's peak, against the reference."""
    x = _every_value_groups(DTYPES[in_dtype])
    pitch = mxfp4.row_bytes(512, 32)
    cache = make_cache("flat", x.shape[0], pitch, device)
    slots = torch.arange(x.shape[0], device=device)
    want = _cpu_reference(cache, x, slots, 32)
    store_mxfp4_mla(x.to(device), slots, cache.view, 32)
    got = cache.backing.cpu()
    assert torch.equal(got, want), f"{int((got != want).sum())} bytes differ"
