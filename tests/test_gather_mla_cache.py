"""gather_mla_cache: the MLA cache rows concat_and_cache_mla writes, read back by slot and
dequantized, against the references; bad input refused."""

import pytest
import torch

from kvgen import registry
from kvgen.families.mla_cache.verify import verify_gather_mla_cache
from kvgen.formats import mla_cache
from kvgen.ops import concat_and_cache_mla, gather_mla_cache
from kvgen.runtime import local_target

ARCH, TARGET = local_target()
VARIANTS = registry.variants(ARCH, TARGET, "gather_mla_cache")


def test_the_variants_cover_both_formats_and_every_output_dtype():
    got = {(s.fmt, s.dtype) for s in VARIANTS}
    assert got == {(f, d) for f in ("fp8", "fp8_ds_mla") for d in ("bf16", "fp16", "fp32")}


@pytest.mark.parametrize("spec", VARIANTS, ids=lambda s: s.name)
def test_every_variant_matches_the_reference(spec, device):
    """Edge-case rows (NaN and inf tiles, ties, zero tiles) in a guarded cache with poisoned
    rows between blocks, read at random, skipped and out-of-range slots; the cache untouched."""
    result = verify_gather_mla_cache(spec, device)
    assert result.passed, result


@pytest.mark.parametrize("fmt", ["auto", "fp8", "fp8_ds_mla"])
def test_what_the_store_writes_the_reader_reads(fmt, device):
    """Store then read: fp8_ds_mla is exact in bf16 (codes times powers of two, the RoPE part
    as stored), per-tensor fp8 is code * k_scale, auto the values; FlashMLA's 4-D view."""
    gen = torch.Generator().manual_seed(2)
    kv_c = torch.randn(20, 512, generator=gen).to(torch.bfloat16)
    k_pe = torch.randn(20, 64, generator=gen).to(torch.bfloat16)
    row = {"auto": 576, "fp8": 576, "fp8_ds_mla": 656}[fmt]
    dtype = torch.bfloat16 if fmt == "auto" else torch.uint8
    cache = torch.zeros(3, 8, 1, row, dtype=dtype, device=device)
    slots = torch.randperm(24, generator=gen)[:20].to(device)
    k_scale = torch.tensor([0.02], device=device)
    concat_and_cache_mla(kv_c.to(device), k_pe.to(device), cache, slots, fmt, k_scale)
    got = gather_mla_cache(cache, slots, fmt, k_scale, out_dtype=torch.float32).cpu()
    rows = mla_cache.encode(kv_c, k_pe, fmt, k_scale.cpu())  # token i's row, in slot order
    if fmt == "auto":
        want = torch.cat([kv_c, k_pe], dim=1).float()
    elif fmt == "fp8":
        want = mla_cache.dequantize_fp8_per_tensor(rows, k_scale.cpu())
    else:
        want = mla_cache.dequantize_fp8_ds_mla(rows)
    assert torch.equal(got, want)
    if fmt == "fp8_ds_mla":  # exact in bf16, the RoPE part as stored
        assert torch.equal(got[:, 512:], k_pe.float())
    none = gather_mla_cache(cache, torch.tensor([-1, 24], device=device), fmt, k_scale)
    assert not none.any()


def _good(device):
    cache = torch.zeros(2, 4, 656, dtype=torch.uint8, device=device)
    return cache, torch.arange(3, device=device)


@pytest.mark.parametrize(
    "call,error,match",
    [
        (lambda c, s: gather_mla_cache(c, s, "fp4"), ValueError, "kv_cache_dtype must be one of"),
        (lambda c, s: gather_mla_cache(c, s.float(), "fp8_ds_mla"), TypeError, "slots must"),
        (lambda c, s: gather_mla_cache(c[..., :600], s, "fp8_ds_mla"), ValueError, "no fp8_ds"),
        (lambda c, s: gather_mla_cache(c, s, "fp8"), ValueError, "scale .* is needed for 'fp8'"),
        (
            lambda c, s: gather_mla_cache(c[..., :576], s, "fp8", torch.ones(1, dtype=torch.half)),
            TypeError,
            "scale must have dtype",
        ),
        (
            lambda c, s: gather_mla_cache(c, s, "fp8_ds_mla", out_dtype=torch.int8),
            TypeError,
            "out_dtype must be one of",
        ),
        (lambda c, s: gather_mla_cache(c, s, "fp8_ds_mla", latent=500), ValueError, "multiple"),
        (lambda c, s: gather_mla_cache(c.tolist(), s, "fp8_ds_mla"), TypeError, "torch.Tensor"),
    ],
)
def test_bad_arguments(call, error, match, device):
    cache, slots = _good(device)
    with pytest.raises(error, match=match):
        call(cache, slots)
