"""concat_and_cache_mla (vLLM's argument list) against the reference, byte for byte, into
poisoned guarded caches; every variant, the cache views vLLM and FlashMLA pass, bad input."""

import pytest
import torch

from kvgen import registry
from kvgen.families.mla_cache.verify import edge_case_rows, make_cache
from kvgen.formats import mla_cache
from kvgen.ops import concat_and_cache_mla
from kvgen.runtime import local_target
from kvgen.verify import make_slots

ARCH, TARGET = local_target()
VARIANTS = registry.variants(ARCH, TARGET, "concat_and_cache_mla")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@pytest.mark.parametrize("spec", VARIANTS, ids=lambda s: s.name)
def test_every_variant_is_byte_exact(spec, device):
    """Edge-case rows (outliers, zero tiles, ties, NaN, inf) into a cache whose blocks are
    further apart than their rows, with skipped slots; every byte of the backing buffer,
    guards included, equals the reference's."""
    kv_c, k_pe = edge_case_rows(23, 512, 64, DTYPES[spec.in_dtype], seed=5)
    cache = make_cache(spec, 3, device)
    want = cache.backing.cpu().clone()
    slots = make_slots(23, 3 * 16, device, dtype=torch.int32, seed=5)
    scale = torch.tensor([0.05], device=device)
    concat_and_cache_mla(kv_c.to(device), k_pe.to(device), cache.view, slots, spec.fmt, scale)
    mla_cache.store(kv_c, k_pe, cache.rebuild(want), slots.cpu(), spec.fmt, scale.cpu())
    assert torch.equal(cache.backing.cpu(), want)


def test_fp8_cache_as_e4m3_and_the_4d_view(device):
    """vLLM's fp8 cache may be float8_e4m3fn; FlashMLA's view is [num_blocks, page, 1, row];
    "fp8_e4m3" is "fp8"."""
    kv_c, k_pe = edge_case_rows(9, 512, 64, torch.bfloat16, seed=1)
    scale = torch.tensor([0.02], device=device)
    cache = torch.zeros(2, 8, 1, 576, dtype=torch.float8_e4m3fn, device=device)
    slots = torch.arange(9, dtype=torch.int64, device=device) + 3
    concat_and_cache_mla(kv_c.to(device), k_pe.to(device), cache, slots, "fp8_e4m3", scale)
    want = mla_cache.encode(kv_c, k_pe, "fp8", scale.cpu())
    got = cache.view(torch.uint8).reshape(16, 576)[3:12].cpu()
    assert torch.equal(got, want)


def _good(device, kv_cache_dtype="fp8_ds_mla"):
    kv_c = torch.randn(4, 512, dtype=torch.bfloat16, device=device)
    k_pe = torch.randn(4, 64, dtype=torch.bfloat16, device=device)
    row = {"auto": 576, "fp8": 576, "fp8_ds_mla": 656}[kv_cache_dtype]
    dtype = torch.bfloat16 if kv_cache_dtype == "auto" else torch.uint8
    cache = torch.full((2, 4, row), 0x7B if dtype == torch.uint8 else 1.0, dtype=dtype)
    slots = torch.arange(4, dtype=torch.int32, device=device)
    return kv_c, k_pe, cache.to(device), slots, torch.tensor([0.1], device=device)


@pytest.mark.parametrize(
    "change,error,match",
    [
        ({"kv_cache_dtype": "fp4"}, ValueError, "kv_cache_dtype must be one of"),
        ({"kv_cache": lambda c: c[..., :600]}, ValueError, r"kv_cache .* must be \[num_blocks"),
        ({"kv_cache": lambda c: c.float()}, TypeError, "kv_cache must have dtype"),
        ({"k_pe": lambda t: t.half()}, TypeError, "k_pe must have kv_c's dtype"),
        ({"k_pe": lambda t: t[:, :48]}, ValueError, "power of two"),
        ({"kv_c": lambda t: t[:, :500]}, ValueError, "multiple of 128"),
        ({"slot_mapping": lambda s: s[:3]}, ValueError, "slot_mapping has 3 entries"),
        ({"slot_mapping": lambda s: s.float()}, TypeError, "slot_mapping must have dtype"),
        ({"kv_c": lambda t: t.t().contiguous().t()}, ValueError, "contiguous in its last"),
        ({"kv_c": lambda t: t.tolist()}, TypeError, "kv_c must be a torch.Tensor"),
    ],
)
def test_bad_arguments_raise_before_any_write(change, error, match, device):
    names = ("kv_c", "k_pe", "kv_cache", "slot_mapping", "scale")
    args = dict(zip(names, _good(device), strict=True))
    args["kv_cache_dtype"] = "fp8_ds_mla"
    original = args["kv_cache"]
    before = original.clone()
    for key, value in change.items():
        args[key] = value(args[key]) if callable(value) else value
    order = ("kv_c", "k_pe", "kv_cache", "slot_mapping", "kv_cache_dtype", "scale")
    with pytest.raises(error, match=match):
        concat_and_cache_mla(*(args[k] for k in order))
    assert torch.equal(original, before)  # not a byte written


def test_fp8_needs_a_one_element_fp32_scale(device):
    kv_c, k_pe, cache, slots, _ = _good(device, "fp8")
    before = cache.clone()
    with pytest.raises(ValueError, match="scale must hold one fp32 value"):
        concat_and_cache_mla(kv_c, k_pe, cache, slots, "fp8", torch.ones(2, device=device))
    with pytest.raises(TypeError, match="scale must have dtype"):
        concat_and_cache_mla(kv_c, k_pe, cache, slots, "fp8", torch.ones(1, dtype=torch.float64))
    with pytest.raises(TypeError, match="kv_cache must have dtype"):
        concat_and_cache_mla(kv_c, k_pe, cache.view(torch.int8), slots, "fp8", torch.ones(1))
    assert torch.equal(cache, before)


def test_auto_takes_the_input_dtype_only(device):
    kv_c, k_pe, cache, slots, scale = _good(device, "auto")
    with pytest.raises(TypeError, match="kv_cache must have dtype torch.bfloat16"):
        concat_and_cache_mla(kv_c, k_pe, cache.half(), slots, "auto", scale)
    with pytest.raises(TypeError, match="16-bit"):
        concat_and_cache_mla(kv_c.float(), k_pe.float(), cache.float(), slots, "auto", scale)
