"""store_mxfp4_mla(..., k_pe=): MXFP4 rows with the RoPE part as bf16 after the scales, byte for
byte against the reference in poisoned guarded caches; bad input refused before any write."""

import pytest
import torch

from kvgen import registry
from kvgen.families.mxfp4_mla.verify import verify_store_mxfp4_rope
from kvgen.formats import mla_cache
from kvgen.ops import mxfp4_row_bytes, store_mxfp4_mla
from kvgen.runtime import local_target

ARCH, TARGET = local_target()
VARIANTS = registry.variants(ARCH, TARGET, "store_mxfp4_rope_mla")


def test_the_variants_cover_every_group_dtype_and_layout():
    got = {(s.group, s.dtype, s.layout, s.rope) for s in VARIANTS}
    assert got == {
        (g, d, lay, 64)
        for g in (16, 32, 64)
        for d in ("bf16", "fp16", "fp32")
        for lay in ("paged", "flat")
    }


@pytest.mark.parametrize("spec", VARIANTS, ids=lambda s: s.name)
def test_every_variant_is_byte_exact(spec, device):
    """Edge-case latents and RoPE rows (bf16 ties, -0, values past bf16's precision), skipped
    and out-of-range slots, blocks further apart than their rows: every byte of the backing
    buffer, guards included, equals the reference's."""
    result = verify_store_mxfp4_rope(spec, device)
    assert result.passed, result


def test_the_row_is_the_rope_free_row_then_the_bf16_rope(device):
    """The first 272 bytes are what the seed op writes for the same latent; the last 128 are
    k_pe as bf16, rounded to nearest even from fp32."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(5, 512, generator=gen)
    pe = torch.randn(5, 64, generator=gen)
    pe[0, 0] = 1.0 + 2**-8  # a tie: rounds to even (1.0)
    pe[0, 1] = 1.0 + 3 * 2**-8  # a tie: rounds to even (1.015625)
    with_rope = torch.zeros(5, mxfp4_row_bytes(512, 32, 64), dtype=torch.uint8, device=device)
    seed_rows = torch.zeros(5, mxfp4_row_bytes(512), dtype=torch.uint8, device=device)
    slots = torch.arange(5, device=device)
    store_mxfp4_mla(x.to(device), slots, with_rope, k_pe=pe.to(device))
    store_mxfp4_mla(x.to(device), slots, seed_rows)
    assert with_rope.shape[1] == 400
    assert torch.equal(with_rope[:, :272], seed_rows)
    rope = with_rope[:, 272:].cpu().contiguous().view(torch.bfloat16)
    assert torch.equal(rope, pe.to(torch.bfloat16))
    assert rope[0, 0].item() == 1.0 and rope[0, 1].item() == 1.015625
    assert torch.equal(with_rope.cpu(), mla_cache.quantize_mxfp4_rope(x, pe))


def _good(device):
    x = torch.randn(4, 512, dtype=torch.bfloat16, device=device)
    pe = torch.randn(4, 64, dtype=torch.bfloat16, device=device)
    cache = torch.full((2, 4, 400), 0x5A, dtype=torch.uint8, device=device)
    return x, torch.arange(4, device=device), cache, pe


@pytest.mark.parametrize(
    "change,error,match",
    [
        (lambda a: a | {"k_pe": a["k_pe"].half()}, TypeError, "k_pe must have kv_c_normed's"),
        (lambda a: a | {"k_pe": a["k_pe"][:3]}, ValueError, "k_pe has 3 tokens"),
        (lambda a: a | {"k_pe": a["k_pe"][:, :48]}, ValueError, "rope_dim .* one of"),
        (lambda a: a | {"k_pe": a["k_pe"][0]}, ValueError, "k_pe must be"),
        (
            lambda a: a | {"k_pe": a["k_pe"].t().contiguous().t()},
            ValueError,
            "contiguous in its last",
        ),
        (
            lambda a: a | {"k_pe": a["k_pe"].tolist()},
            TypeError,
            "k_pe must be a torch.Tensor or None",
        ),
        (  # rope-free rows given RoPE: the row width does not match
            lambda a: a | {"cache": a["cache"][..., :272]},
            ValueError,
            "400",
        ),
    ],
)
def test_bad_arguments_raise_before_any_write(change, error, match, device):
    x, slots, cache, pe = _good(device)
    args = change({"x": x, "slots": slots, "cache": cache, "k_pe": pe})
    before = cache.clone()
    with pytest.raises(error, match=match):
        store_mxfp4_mla(args["x"], args["slots"], args["cache"], 32, k_pe=args["k_pe"])
    assert torch.equal(cache, before)


def test_rows_with_rope_need_an_even_scale_count(device):
    """448 / 64 = 7 scale bytes would leave the bf16 RoPE channels on odd addresses."""
    with pytest.raises(ValueError, match="even number of scale bytes"):
        mxfp4_row_bytes(448, 64, 64)
    x = torch.randn(2, 448, dtype=torch.bfloat16, device=device)
    pe = torch.randn(2, 64, dtype=torch.bfloat16, device=device)
    cache = torch.zeros(2, 224 + 7 + 128, dtype=torch.uint8, device=device)
    with pytest.raises(ValueError, match="even number of scale bytes"):
        store_mxfp4_mla(x, torch.arange(2, device=device), cache, 64, k_pe=pe)
    assert not cache.any()


def test_the_torch_op_takes_k_pe(device):
    """torch.ops.kvgen.store_mxfp4_mla has k_pe as an optional last argument (default None)."""
    x, slots, cache, pe = _good(device)
    other = cache.clone()
    torch.ops.kvgen.store_mxfp4_mla(x, slots, cache, 32, pe)
    store_mxfp4_mla(x, slots, other, k_pe=pe)
    assert torch.equal(cache, other)
    rope_free = torch.zeros(2, 4, 272, dtype=torch.uint8, device=device)
    torch.ops.kvgen.store_mxfp4_mla(x, slots, rope_free, 32)  # the seed op's four arguments
    assert torch.equal(rope_free.reshape(8, 272)[:4], cache.reshape(8, 400)[:4, :272])


GATHERS = registry.variants(ARCH, TARGET, "gather_mxfp4_rope_mla")


@pytest.mark.parametrize("spec", GATHERS, ids=lambda s: s.name)
def test_every_reader_variant_matches_the_reference(spec, device):
    """Rows with RoPE (NaN, inf, -0 and huge RoPE values among them) read back by slot, the
    latent dequantized and the RoPE part exact; invalid slots read as zeros; the cache is
    left untouched."""
    from kvgen.families.mxfp4_mla.verify import verify_gather_mxfp4_rope

    result = verify_gather_mxfp4_rope(spec, device)
    assert result.passed, result


def test_store_then_read_back(device):
    """What store_mxfp4_mla(..., k_pe=) wrote, gather_mxfp4_mla(..., rope_dim=64) reads: the
    dequantized latent and k_pe as bf16, the rows of -1 zero."""
    from kvgen.ops import gather_mxfp4_mla

    gen = torch.Generator().manual_seed(8)
    x = torch.randn(6, 512, generator=gen).to(torch.bfloat16)
    pe = torch.randn(6, 64, generator=gen).to(torch.bfloat16)
    cache = torch.zeros(3, 4, 400, dtype=torch.uint8, device=device)
    slots = torch.tensor([5, 0, 11, 2, 7, 9], device=device)
    store_mxfp4_mla(x.to(device), slots, cache, k_pe=pe.to(device))
    read = torch.tensor([11, -1, 5], device=device)
    got = gather_mxfp4_mla(cache, read, 512, rope_dim=64, out_dtype=torch.float32).cpu()
    rows = mla_cache.quantize_mxfp4_rope(x, pe)
    want = mla_cache.dequantize_mxfp4_rope(rows)
    assert torch.equal(got[0], want[2]) and torch.equal(got[2], want[0])
    assert not got[1].any()
    assert torch.equal(got[0, 512:], pe[2].float())
    with pytest.raises(ValueError, match="rope_dim .* one of"):
        gather_mxfp4_mla(cache, read, 512, rope_dim=48)
    with pytest.raises(ValueError, match="272"):  # rows with RoPE read as rope-free rows
        gather_mxfp4_mla(cache, read, 512)
