"""concat_and_cache_mla and store_mxfp4_mla over hypothesis-generated arguments, right and
wrong: every call either raises ValueError / TypeError with every cache byte as it was, or
writes exactly the bytes of the formats' reference store."""

from __future__ import annotations

import torch
from _fuzz import SLOT_KINDS, fuzz, slots
from hypothesis import event, given
from hypothesis import strategies as st

from kvgen.formats import mla_cache, mxfp4
from kvgen.ops import concat_and_cache_mla, store_mxfp4_mla

ROW = {"auto": 576 * 2, "fp8": 576, "fp8_e4m3": 576, "fp8_ds_mla": 656}


def _cache(blocks, page, row, gap, dtype, flashmla_view, device):
    """A 0xFF cache [blocks, page, row] whose block stride is page + gap rows, and a second
    one just like it."""
    backing = torch.full((blocks, page + gap, row), 0xFF, dtype=torch.uint8, device=device)
    view = backing.view(dtype)[:, :page] if dtype != torch.uint8 else backing[:, :page]
    return backing, view.unsqueeze(2) if flashmla_view else view


@fuzz
@given(data=st.data())
def test_concat_and_cache_mla_raises_before_writing_or_matches_the_reference(device, data):
    draw = data.draw
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    # half the calls right in every argument, the others wrong in one
    bad = draw(st.sampled_from([None] * 6 + ["dtype", "latent", "rope", "pe_dtype", "row",
                                             "scale", "format", "cache_dtype"]))  # fmt: skip
    fmt = draw(st.sampled_from(["auto", "fp8", "fp8_e4m3", "fp8_ds_mla"]))
    fmt = "fp8_e5m2" if bad == "format" else fmt
    dtype = draw(st.sampled_from([torch.bfloat16, torch.float16, torch.float32]))
    dtype = torch.int32 if bad == "dtype" else dtype
    n = draw(st.integers(0, 5))
    latent, rope = 256 if bad == "latent" else 512, 32 if bad == "rope" else 64
    kv_c = (torch.randn(n, latent, generator=gen) * 4).to(dtype)
    pe_dtype = torch.float16 if dtype != torch.float16 else torch.bfloat16
    k_pe = torch.randn(n, rope, generator=gen).to(pe_dtype if bad == "pe_dtype" else dtype)
    row = ROW.get(fmt, 576) + (2 if bad == "row" else 0)
    cache_dtype = {"auto": torch.bfloat16 if dtype == torch.float32 else dtype}.get(
        fmt, draw(st.sampled_from([torch.uint8, torch.float8_e4m3fn]))
    )
    if fmt == "fp8_ds_mla":
        cache_dtype = torch.uint8
    if bad == "cache_dtype":
        cache_dtype = torch.int8
    blocks, page = draw(st.integers(1, 3)), draw(st.sampled_from([1, 4, 16]))
    gap = draw(st.sampled_from([0, 0, 1]))
    try:
        backing, cache = _cache(blocks, page, row, gap, cache_dtype, draw(st.booleans()), device)
    except RuntimeError:  # (a row that is no whole number of elements of the dtype)
        event("no cache")
        return
    ref_backing, ref_cache = _cache(blocks, page, row, gap, cache_dtype, False, "cpu")
    slot_mapping, _ = slots(draw, n, blocks * page, gen, SLOT_KINDS[:-1])
    scale = torch.ones(2) if bad == "scale" else torch.tensor([0.05])
    before = backing.clone()
    try:
        concat_and_cache_mla(kv_c.to(device), k_pe.to(device), cache, slot_mapping.to(device), fmt,
                             scale.to(device))  # fmt: skip
    except (ValueError, TypeError) as exc:
        assert str(exc)
        event(f"refused: {type(exc).__name__}")
        assert torch.equal(backing, before)
        return
    event(f"stored {fmt}")
    mla_cache.store(kv_c, k_pe, ref_cache, slot_mapping, fmt, scale)
    assert torch.equal(backing.cpu(), ref_backing), (fmt, dtype, n)


@fuzz
@given(data=st.data())
def test_store_mxfp4_mla_raises_before_writing_or_matches_the_reference(device, data):
    draw = data.draw
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    group = draw(st.sampled_from([16, 32, 64, 48]))
    latent = draw(st.sampled_from([512, 256, 96, 500]))
    dtype = draw(st.sampled_from([torch.bfloat16, torch.float16, torch.float32, torch.int32]))
    n = draw(st.integers(0, 5))
    x = (torch.randn(n, latent, generator=gen) * 10).to(dtype)
    try:
        row = mxfp4.row_bytes(latent, group) + draw(st.sampled_from([0, 0, 0, 1]))
    except (ValueError, ZeroDivisionError):
        row = 272
    blocks, page = draw(st.integers(1, 3)), draw(st.sampled_from([1, 4, 16]))
    gap = draw(st.sampled_from([0, 0, 2]))
    backing, cache = _cache(blocks, page, row, gap, torch.uint8, False, device)
    ref_backing, ref_cache = _cache(blocks, page, row, gap, torch.uint8, False, "cpu")
    slot_mapping, _ = slots(draw, n, blocks * page, gen, SLOT_KINDS[:-1])
    before = backing.clone()
    try:
        store_mxfp4_mla(x.to(device), slot_mapping.to(device), cache, group)
    except (ValueError, TypeError) as exc:
        assert str(exc)
        event(f"refused: {type(exc).__name__}")
        assert torch.equal(backing, before)
        return
    event("stored")
    mxfp4.store(x, slot_mapping, ref_cache, group)
    assert torch.equal(backing.cpu(), ref_backing), (group, latent, dtype, n)
