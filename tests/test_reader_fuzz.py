"""The readers (gather_kv_per_token_head, gather_mxfp4_mla) over hypothesis-generated arguments:
each call raises ValueError / TypeError, or returns the reference's values (fp32 output: exact;
rows of negative or out-of-range slots are zeros)."""

from __future__ import annotations

import torch
from _fuzz import fuzz, slots
from hypothesis import event, given
from hypothesis import strategies as st

from kvgen.families.gqa_decode.verify import alloc_caches
from kvgen.formats import mxfp4, per_token_head
from kvgen.ops import gather_kv_per_token_head, gather_mxfp4_mla


@fuzz
@given(data=st.data())
def test_gather_kv_per_token_head_raises_or_matches_the_reference(device, data):
    draw = data.draw
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    kv, group = draw(st.sampled_from([("int8", 0), ("fp8e4m3", 0), ("fp8e5m2", 0), ("int4", 32)]))
    heads, d = draw(st.integers(1, 3)), draw(st.sampled_from([16, 64, 80]))
    dv = d if draw(st.booleans()) else 64
    layout = draw(st.sampled_from(["nhd", "hnd", "inline"]))
    if layout == "inline":
        dv = d
    shape = (draw(st.integers(1, 3)), draw(st.sampled_from([1, 4, 16])), heads)
    k, v, ks, vs = alloc_caches(kv, group, shape, d, dv, torch.bfloat16, device, layout)
    tokens = shape[0] * shape[1]
    keys = torch.randn(tokens, heads, d, generator=gen)
    values = torch.randn(tokens, heads, dv, generator=gen)
    per_token_head.store(keys, values, k, v, ks, vs, torch.arange(tokens))  # every slot written
    slot_mapping, kind = slots(draw, draw(st.integers(0, 6)), tokens, gen)
    out_dtype = draw(st.sampled_from([torch.float32, torch.float32, torch.bfloat16, torch.int32]))
    bad = draw(st.sampled_from([None] * 4 + ["scales", "head_size"]))
    args = [k, v, ks.double() if bad == "scales" else ks, vs, slot_mapping.to(device)]
    sizes = dict(head_size=d + 2 if bad == "head_size" else d, head_size_v=dv)
    try:
        got_k, got_v = gather_kv_per_token_head(*args, **sizes, out_dtype=out_dtype)
    except (ValueError, TypeError) as exc:
        assert str(exc)
        event(f"refused: {type(exc).__name__}")
        return
    event(f"read {out_dtype}")
    assert kind != "float" and out_dtype != torch.int32 and bad is None
    if out_dtype != torch.float32:  # (the interpreter's fp32 -> bf16 cast truncates)
        return
    want_k = per_token_head.gather(k.cpu(), ks.cpu(), slot_mapping, d)
    want_v = per_token_head.gather(v.cpu(), vs.cpu(), slot_mapping, dv)
    assert torch.equal(got_k.cpu(), want_k) and torch.equal(got_v.cpu(), want_v)


@fuzz
@given(data=st.data())
def test_gather_mxfp4_mla_raises_or_matches_the_reference(device, data):
    draw = data.draw
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    group = draw(st.sampled_from([16, 32, 64]))
    latent = draw(st.sampled_from([512, 256, 128]))
    blocks, page = draw(st.integers(1, 3)), draw(st.sampled_from([1, 4, 16]))
    row = mxfp4.row_bytes(latent, group)
    cache = torch.zeros(blocks, page, row, dtype=torch.uint8)
    tokens = blocks * page
    mxfp4.store(torch.randn(tokens, latent, generator=gen) * 8, torch.arange(tokens), cache, group)
    slot_mapping, kind = slots(draw, draw(st.integers(0, 6)), tokens, gen)
    bad = draw(st.sampled_from([None] * 4 + ["latent", "group", "out_dtype"]))
    read_latent = latent * 2 if bad == "latent" else latent
    read_group = 48 if bad == "group" else group
    out_dtype = torch.int8 if bad == "out_dtype" else torch.float32
    try:
        got = gather_mxfp4_mla(cache.to(device), slot_mapping.to(device), read_latent, read_group,
                               out_dtype=out_dtype)  # fmt: skip
    except (ValueError, TypeError) as exc:
        assert str(exc)
        event(f"refused: {type(exc).__name__}")
        return
    event("read")
    assert kind != "float" and bad is None
    assert torch.equal(got.cpu(), mxfp4.gather(cache, slot_mapping, latent, group))
