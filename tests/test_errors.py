"""Bad input raises a TypeError/ValueError naming the argument, before any cache byte moves."""

import pytest
import torch

from kvgen.ops import gather_mxfp4_mla, mxfp4_row_bytes, store_mxfp4_mla
from kvgen.verify import make_cache


@pytest.fixture
def good(device):
    x = torch.randn(8, 512, device=device).to(torch.bfloat16)
    slots = torch.arange(8, device=device)
    cache = make_cache("paged", 64, 272, device, block_size=16, gap_rows=4)
    return x, slots, cache


def _raises(cache, exc, match, *args, **kwargs):
    before = cache.backing.clone()
    with pytest.raises(exc, match=match):
        store_mxfp4_mla(*args, **kwargs)
    assert torch.equal(cache.backing, before), "the cache changed although the call failed"


def test_input_dtype_and_shape(good):
    x, slots, cache = good
    _raises(cache, TypeError, "kv_c_normed must have dtype", x.to(torch.int32), slots, cache.view)
    _raises(cache, TypeError, "kv_c_normed must have dtype", x.double(), slots, cache.view)
    _raises(cache, ValueError, r"kv_c_normed must be 2-D", x[None], slots, cache.view)
    _raises(cache, TypeError, "kv_c_normed must be a torch.Tensor", x.tolist(), slots, cache.view)


def test_slot_mapping(good):
    x, slots, cache = good
    _raises(cache, TypeError, "slot_mapping must have dtype", x, slots.float(), cache.view)
    _raises(cache, TypeError, "slot_mapping must have dtype", x, slots.to(torch.int16), cache.view)
    _raises(cache, ValueError, "slot_mapping must be 1-D", x, slots[None], cache.view)
    _raises(
        cache,
        ValueError,
        "slot_mapping has 7 entries but kv_c_normed has 8",
        x,
        slots[:7],
        cache.view,
    )


def test_cache_dtype_and_geometry(good, device):
    x, slots, cache = good
    _raises(cache, TypeError, "cache must have dtype", x, slots, cache.view.view(torch.int8))
    wrong_width = cache.backing[: 4 * 16 * 256].view(4, 16, 256)
    _raises(cache, ValueError, "must be \\[num_blocks, block_size, 272\\]", x, slots, wrong_width)
    padded_rows = cache.backing.as_strided((2, 16, 272), (16 * 288, 288, 1))
    _raises(cache, ValueError, "contiguous 272-byte rows", x, slots, padded_rows)
    odd_block = cache.backing.as_strided((2, 16, 272), (16 * 272 + 8, 272, 1))
    _raises(cache, ValueError, "whole number of 272-byte rows", x, slots, odd_block)
    overlap = cache.backing.as_strided((2, 16, 272), (8 * 272, 272, 1))
    _raises(cache, ValueError, "at least block_size", x, slots, overlap)
    _raises(
        cache,
        ValueError,
        "not a whole number of 272-byte rows",
        x,
        slots,
        cache.backing[: 272 * 10 + 1],
    )
    not_contig = cache.backing[: 272 * 40].view(40, 272)[::2]
    _raises(cache, ValueError, "paged view or contiguous", x, slots, not_contig)


def test_group(good):
    x, slots, cache = good
    _raises(cache, ValueError, "group must be one of", x, slots, cache.view, group=24)
    _raises(cache, TypeError, "group must be an int", x, slots, cache.view, group=32.0)
    x480 = torch.randn(8, 480, device=x.device)
    _raises(cache, ValueError, "divisible by group=64", x480, slots, cache.view, group=64)
    with pytest.raises(ValueError, match="divisible by group=64"):
        mxfp4_row_bytes(480, 64)


def test_devices_must_match(good):
    x, slots, cache = good
    _raises(cache, ValueError, "slot_mapping is on meta", x, slots.to("meta"), cache.view)
    _raises(
        cache,
        ValueError,
        "cache is on meta",
        x,
        slots,
        torch.empty(4, 16, 272, dtype=torch.uint8, device="meta"),
    )


def test_cpu_tensors_without_interpreter_are_refused(monkeypatch):
    from kvgen import runtime

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        runtime.target_of(torch.device("cpu"))


def test_gather_arguments(good):
    x, slots, cache = good
    with pytest.raises(TypeError, match="out_dtype"):
        gather_mxfp4_mla(cache.view, slots, 512, 32, torch.int8)
    with pytest.raises(TypeError, match="slots must have dtype"):
        gather_mxfp4_mla(cache.view, slots.float(), 512)
    with pytest.raises(ValueError, match="latent width 500"):
        gather_mxfp4_mla(cache.view, slots, 500)
    with pytest.raises(ValueError, match="must be \\[num_blocks, block_size, 136\\]"):
        gather_mxfp4_mla(cache.view, slots, 256)
