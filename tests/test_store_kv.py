"""Per-token-head KV stores (int8, fp8 e4m3/e5m2, int4) against the reference, byte for byte."""

import pytest
import torch

from kvgen import registry
from kvgen.codegen import load
from kvgen.families.per_token_head import StoreKVInt4Spec, StoreKVPerTokenHeadSpec
from kvgen.families.per_token_head.verify import edge_case_heads, make_kv_caches
from kvgen.formats import per_token_head as ref
from kvgen.ops import (
    gather_kv_per_token_head,
    store_kv_int4_per_token_head,
    store_kv_per_token_head,
    triton_reshape_and_cache_flash_int4_per_token_head,
    triton_reshape_and_cache_flash_per_token_head_quant,
)
from kvgen.runtime import local_target
from kvgen.verify import GUARD_BYTES, POISON, make_slots

ARCH, TARGET = local_target()
VARIANTS = [
    s
    for s in registry.variants(ARCH, TARGET)
    if s.family in ("store_kv_per_token_head", "store_kv_int4_per_token_head")
]
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


def _same(a, b):
    return bool(((a == b) | (a.isnan() & b.isnan())).all())


def _op(spec):
    return registry.family(spec.family).op


def _run_and_compare(
    spec,
    device,
    tokens,
    heads,
    block_size,
    layout="nhd",
    joint=False,
    seed=0,
    num_blocks=None,
    slots=None,
    qkv_offset=None,
    kv=None,
):
    """Store [tokens, heads, d] K and V (``kv``, or edge-case rows) with the kernel and with the
    reference into poisoned, guarded caches; every byte must agree."""
    dt = DTYPES[spec.in_dtype]
    if kv is not None:
        key, value = kv
    else:
        key = edge_case_heads(tokens, heads, spec.head_size, dt, seed)
        value = edge_case_heads(tokens, heads, spec.head_size_v, dt, seed + 1)
    if qkv_offset is not None:
        # K and V as vLLM passes them: strided views into one [tokens, q | k | v] projection,
        # starting qkv_offset elements into each row
        kw, vw = heads * spec.head_size, heads * spec.head_size_v
        qkv = torch.full((tokens, qkv_offset + kw + vw + 3), float("nan"), dtype=dt)
        qkv[:, qkv_offset : qkv_offset + kw] = key.flatten(1)
        qkv[:, qkv_offset + kw : qkv_offset + kw + vw] = value.flatten(1)
        qkv = qkv.to(device)
        key = qkv[:, qkv_offset : qkv_offset + kw].view(tokens, heads, spec.head_size)
        value = qkv[:, qkv_offset + kw : qkv_offset + kw + vw].view(tokens, heads, spec.head_size_v)
        assert not key.is_contiguous()
    num_blocks = num_blocks or -(-2 * tokens // block_size) + 1
    caches = make_kv_caches(spec, num_blocks, block_size, heads, device, layout, joint)
    if slots is None:
        slots = make_slots(tokens, num_blocks * block_size, device, seed=seed)
    # One reference copy per distinct backing buffer (K and V may share one).
    backings = {id(c.backing): c.backing for c in caches}
    expected = {k: b.cpu().clone() for k, b in backings.items()}
    views = [c.rebuild(expected[id(c.backing)]) for c in caches]
    ref.store(key, value, *views, slots.cpu())

    _op(spec)(key.to(device), value.to(device), *[c.view for c in caches], slots)

    for k, b in backings.items():
        got = b.cpu()
        assert (got[:GUARD_BYTES] == POISON).all() and (got[-GUARD_BYTES:] == POISON).all()
        assert torch.equal(got, expected[k]), f"{int((got != expected[k]).sum())} bytes differ"


@pytest.mark.parametrize("spec", VARIANTS, ids=lambda s: s.name)
def test_variant_is_byte_exact(spec, device):
    # 15 rows: the 12 edge rows of edge_case_heads and 3 random ones (the interpreter's time
    # grows with the rows; more rows and layouts are the tests below)
    _run_and_compare(spec, device, tokens=5, heads=3, block_size=4)


LAYOUT_SPECS = [
    StoreKVPerTokenHeadSpec("int8", 128, 128, "bf16", ARCH, TARGET),
    StoreKVPerTokenHeadSpec("fp8e4m3", 128, 128, "fp16", ARCH, TARGET),
    StoreKVPerTokenHeadSpec("fp8e5m2", 96, 96, "fp32", ARCH, TARGET),
    StoreKVInt4Spec(32, 128, 128, "bf16", ARCH, TARGET),
]


@pytest.mark.parametrize("layout", ["nhd", "hnd", "kv_split"])
@pytest.mark.parametrize("spec", LAYOUT_SPECS, ids=lambda s: s.name)
def test_cache_layouts(spec, layout, device):
    _run_and_compare(spec, device, tokens=10, heads=4, block_size=16, layout=layout)


@pytest.mark.parametrize("spec", LAYOUT_SPECS[:3], ids=lambda s: s.name)
def test_scales_as_views_into_one_allocation(spec, device):
    _run_and_compare(spec, device, tokens=10, heads=2, block_size=16, joint=True)


@pytest.mark.parametrize("block_size,heads", [(1, 1), (5, 2), (16, 8), (256, 1), (16, 64)])
@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_block_sizes_and_head_counts(fmt, block_size, heads, device):
    spec = (
        StoreKVInt4Spec(16, 64, 64, "bf16", ARCH, TARGET)
        if fmt == "int4"
        else StoreKVPerTokenHeadSpec("int8", 64, 64, "bf16", ARCH, TARGET)
    )
    # 64 heads: two tokens already make 128 rows (every edge row, spread over heads)
    tokens = 2 if heads >= 64 else 6
    _run_and_compare(spec, device, tokens=tokens, heads=heads, block_size=block_size)


def test_different_head_sizes_not_powers_of_two(device):
    for spec in (
        StoreKVPerTokenHeadSpec("fp8e4m3", 80, 96, "bf16", ARCH, TARGET),
        StoreKVInt4Spec(64, 192, 80, "fp16", ARCH, TARGET),
    ):
        _run_and_compare(spec, device, tokens=5, heads=2, block_size=4)


@pytest.mark.parametrize("offset", [0, 64, 1], ids=["aligned", "offset", "odd-offset"])
@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_key_value_strided_views_of_qkv(fmt, offset, device):
    """K/V slices of a qkv projection: even strides are read in place as element pairs; an odd
    offset (no pairs on word boundaries) still gives the same bytes."""
    spec = (
        StoreKVInt4Spec(32, 128, 64, "bf16", ARCH, TARGET)
        if fmt == "int4"
        else StoreKVPerTokenHeadSpec(fmt, 128, 64, "bf16", ARCH, TARGET)
    )
    _run_and_compare(spec, device, tokens=6, heads=2, block_size=8, qkv_offset=offset)


@pytest.mark.parametrize("d,dv,dt", [(81, 63, "bf16"), (33, 128, "fp32"), (7, 9, "fp16")])
def test_int4_odd_head_sizes(d, dv, dt, device):
    """Odd head sizes: the last byte's high nibble is padding and codes 0."""
    for c in (16, 32):
        _run_and_compare(
            StoreKVInt4Spec(c, d, dv, dt, ARCH, TARGET), device, tokens=5, heads=3, block_size=4
        )


def test_int32_slots_and_aliases(device):
    spec = StoreKVPerTokenHeadSpec("int8", 64, 64, "fp32", ARCH, TARGET)
    slots = make_slots(8, 40, device, dtype=torch.int32, seed=5)
    _run_and_compare(spec, device, tokens=8, heads=2, block_size=8, num_blocks=5, slots=slots)
    assert store_kv_per_token_head is triton_reshape_and_cache_flash_per_token_head_quant
    assert store_kv_int4_per_token_head is triton_reshape_and_cache_flash_int4_per_token_head


def test_64bit_offsets(device):
    """A cache past 2^31 bytes; rows written near its end."""
    heads, d, block_size = 1, 128, 16
    num_blocks = (2**31) // (block_size * d) + 4
    kc = torch.empty(num_blocks, block_size, heads, d, dtype=torch.int8, device=device)
    vc = torch.empty(num_blocks, block_size, heads, d, dtype=torch.int8, device=device)
    ks = torch.zeros(num_blocks, block_size, heads, device=device)
    vs = torch.zeros(num_blocks, block_size, heads, device=device)
    key = torch.randn(3, heads, d, device=device)
    value = torch.randn(3, heads, d, device=device)
    last = num_blocks * block_size
    slots = torch.tensor([last - 1, last - 20, -1], device=device)
    store_kv_per_token_head(key, value, kc, vc, ks, vs, slots)
    q, s = ref.quantize_per_token_head(key.cpu(), torch.int8)
    for i in range(2):
        b, r = int(slots[i]) // block_size, int(slots[i]) % block_size
        assert torch.equal(kc[b, r].cpu(), q[i]) and torch.equal(ks[b, r].cpu(), s[i])


@pytest.mark.parametrize(
    "spec", LAYOUT_SPECS + [StoreKVInt4Spec(16, 80, 64, "fp32", ARCH, TARGET)], ids=lambda s: s.name
)
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_gather_reads_back_the_reference(spec, out_dtype, device):
    tokens, heads, block_size = 9, 2, 4
    dt = DTYPES[spec.in_dtype]
    key = edge_case_heads(tokens, heads, spec.head_size, dt, 7)
    value = edge_case_heads(tokens, heads, spec.head_size_v, dt, 8)
    caches = make_kv_caches(spec, 6, block_size, heads, device, "hnd")
    slots = make_slots(tokens, 24, device, seed=7)
    _op(spec)(key.to(device), value.to(device), *[c.view for c in caches], slots)
    k, v = gather_kv_per_token_head(
        *[c.view for c in caches], slots, spec.head_size, spec.head_size_v, out_dtype
    )
    want_k = ref.gather(caches[0].view.cpu(), caches[2].view.cpu(), slots.cpu(), spec.head_size)
    want_v = ref.gather(caches[1].view.cpu(), caches[3].view.cpu(), slots.cpu(), spec.head_size_v)
    # int4's fp16 scales overflow for |x| > 65504 (inf scale, NaN for level 0): both agree.
    assert _same(k.cpu(), want_k.to(out_dtype)) and _same(v.cpu(), want_v.to(out_dtype))
    assert (k[slots.cpu() < 0] == 0).all()


def test_quantization_error_is_bounded():
    """Round trip through the reference: int8 within half a step of the row's scale; fp8 within
    half an ulp (relative) or half the smallest subnormal step (absolute); int4 within half the
    widest level gap times the group's scale."""
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(64, 4, 128, generator=gen)
    for dtype, rel, sub in (
        (torch.int8, None, None),
        (torch.float8_e4m3fn, 2**-4, 2**-10),
        (torch.float8_e5m2, 2**-3, 2**-17),
    ):
        q, s = ref.quantize_per_token_head(x, dtype)
        err = (ref.dequantize_per_token_head(q, s) - x).abs()
        if rel is None:
            bound = 0.5 * s[..., None] * (1 + 2**-20)
        else:
            bound = torch.maximum(x.abs() * rel, sub * s[..., None]) * (1 + 2**-20)
        assert (err <= bound).all(), dtype
    packed, scales = ref.quantize_int4(x, 32)
    back = ref.dequantize_int4(packed, scales, 128)
    group_amax = x.abs().reshape(64, 4, 4, 32).amax(-1).repeat_interleave(32, -1)
    widest_gap = max(b - a for a, b in zip(ref.INT4_LEVELS, ref.INT4_LEVELS[1:], strict=False))
    assert ((back - x).abs() <= group_amax * (widest_gap / 2 + 1e-3)).all()


QUANT_LAYOUT_SPECS = [s for s in LAYOUT_SPECS if s.family == "store_kv_per_token_head"]


@pytest.mark.parametrize(
    "tokens_per_program,heads_per_program,split_kv", [(4, 2, 0), (8, 1, 1), (2, 4, 0), (1, 1, 1)]
)
@pytest.mark.parametrize("spec", QUANT_LAYOUT_SPECS, ids=lambda s: s.name)
def test_several_tokens_per_program(
    spec, tokens_per_program, heads_per_program, split_kv, device, monkeypatch
):
    """Meta-parameters the tuner may pick: tiles over tokens and heads, ragged at both ends; K and
    V in one program or in two."""
    import kvgen.runtime

    meta = {
        "tokens_per_program": tokens_per_program,
        "heads_per_program": heads_per_program,
        "num_warps": 4,
        "num_stages": 1,
        "split_kv": split_kv,
    }
    monkeypatch.setattr(kvgen.runtime, "meta_params", lambda spec, **size: dict(meta))
    _run_and_compare(spec, device, tokens=5, heads=3, block_size=8, layout="hnd")


INT4_UNIT_SPECS = [
    StoreKVInt4Spec(32, 128, 128, "bf16", ARCH, TARGET),
    StoreKVInt4Spec(32, 576, 512, "bf16", ARCH, TARGET),
    StoreKVInt4Spec(16, 80, 64, "fp32", ARCH, TARGET),
]


@pytest.mark.parametrize("units_per_program,num_warps", [(4, 1), (32, 1), (64, 2), (256, 2)])
@pytest.mark.parametrize("spec", INT4_UNIT_SPECS, ids=lambda s: s.name)
def test_int4_units_per_program(spec, units_per_program, num_warps, device, monkeypatch):
    """Meta-parameters the tuner may pick: programs of many scale groups that cut across heads
    and tokens (576 = 18 groups of 32), ragged at the end; K and V of different widths."""
    import kvgen.runtime

    meta = {"units_per_program": units_per_program, "num_warps": num_warps, "num_stages": 1}
    monkeypatch.setattr(kvgen.runtime, "meta_params", lambda spec, **size: dict(meta))
    _run_and_compare(spec, device, tokens=5, heads=3, block_size=8, layout="hnd")


def test_int4_64bit_unit_indices(device, monkeypatch):
    """The 64-bit unit index path (taken from 2^31 scale groups on) gives the same bytes: the
    threshold is lowered so that a small store takes it."""
    spec = StoreKVInt4Spec(32, 576, 512, "bf16", ARCH, TARGET)
    monkeypatch.setattr(load(spec), "WIDE_UNITS", 1)
    _run_and_compare(spec, device, tokens=7, heads=2, block_size=16, layout="nhd")


def _ulp_step(x: torch.Tensor, k: int) -> torch.Tensor:
    """x (positive, finite) moved k ulps in its own dtype."""
    ints = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}
    return (x.view(ints[x.dtype]) + k).view(x.dtype)


@pytest.mark.parametrize("dt", ["bf16", "fp16", "fp32"])
def test_int4_inputs_next_to_every_level_boundary(dt, device):
    """|x| / scale rounds across a level boundary B_i where |x| crosses scale * M_i (M_i the
    fp32 midpoint above B_i): in every group, the input values nearest to scale * M_i and one
    and two ulps either side, both signs, -0 and 0, with groups of random scales (some below
    the 1e-6 floor). The kernels compare |x| with per-group thresholds, the reference divides:
    the codes must agree everywhere."""
    from kvgen.formats._format import int4_midpoints

    spec = StoreKVInt4Spec(32, 128, 128, dt, ARCH, TARGET)
    dtype = DTYPES[dt]
    gen = torch.Generator().manual_seed(11)
    tokens, heads, groups = 24, 2, 4
    rows = []
    for _ in range(2 * tokens * heads * groups):
        scale = float(
            torch.exp2(torch.empty(()).uniform_(-24 if dt == "fp16" else -30, 12, generator=gen))
        )
        s = torch.tensor(scale).to(dtype)  # the group's peak, exactly representable
        near = []
        for m in int4_midpoints():
            c = torch.tensor(float(s.double()) * m, dtype=torch.float64).to(dtype)
            if c > 0 and torch.isfinite(c):  # the nearest value and 2 ulps each side (if > 0)
                near += [_ulp_step(c, k) for k in (-2, -1, 0, 1, 2) if _ulp_step(c, k) > 0]
        vals = torch.stack(near + [torch.tensor(0.0, dtype=dtype)] * 2).float()
        pick = vals[torch.randint(0, vals.numel(), (31,), generator=gen)]
        sign = torch.where(torch.rand(31, generator=gen) < 0.5, -1.0, 1.0)
        group = torch.cat([s.float().reshape(1) * sign[0], pick * sign])
        rows.append(group[torch.randperm(32, generator=gen)])
    x = torch.stack(rows).view(2, tokens, heads, groups * 32).to(dtype)
    _run_and_compare(spec, device, tokens, heads, block_size=16, seed=3, kv=(x[0], x[1]))
