"""The per-token-head stores over hypothesis-generated arguments, right and wrong: every call
either raises ValueError / TypeError with every cache byte as it was, or writes exactly the
bytes of the formats' reference store (caches in NHD, HND and vLLM's inline-scale layouts)."""

from __future__ import annotations

import torch
from _fuzz import fuzz, snapshot
from hypothesis import event, given
from hypothesis import strategies as st

from kvgen.families.gqa_decode.verify import alloc_caches
from kvgen.formats import per_token_head
from kvgen.ops import store_kv_int4_per_token_head, store_kv_per_token_head

FORMATS = [("int8", 0), ("fp8e4m3", 0), ("fp8e5m2", 0), ("int4", 16), ("int4", 32)]


@st.composite
def calls(draw):
    kv, group = draw(st.sampled_from(FORMATS))
    return {
        "kv": kv,
        "group": group,
        "store": draw(st.sampled_from(["matching", "matching", "other"])),
        "tokens": draw(st.integers(0, 6)),
        "heads": draw(st.integers(1, 3)),
        "cache_heads": draw(st.sampled_from(["same", "same", "same", "other"])),
        "d": draw(st.sampled_from([16, 40, 64, 64, 80])),
        "dv": draw(st.sampled_from([16, 64])),
        "page": draw(st.sampled_from([1, 4, 16])),
        "blocks": draw(st.integers(1, 3)),
        "layout": draw(st.sampled_from(["nhd", "hnd", "inline"])),
        "in_dtype": draw(st.sampled_from([torch.bfloat16, torch.float16, torch.float32, "int"])),
        "strided_input": draw(st.booleans()),
        "slots": draw(
            st.sampled_from(["valid", "valid", "negative", "past_end", "int64", "short"])
        ),
        "scales": draw(st.sampled_from(["ok", "ok", "ok", "wrong_dtype", "wrong_shape"])),
        "seed": draw(st.integers(0, 2**16)),
    }


@fuzz
@given(case=calls())
def test_every_store_raises_before_writing_or_matches_the_reference(device, case):
    gen = torch.Generator().manual_seed(case["seed"])
    kv, group, heads, d, dv = case["kv"], case["group"], case["heads"], case["d"], case["dv"]
    if case["layout"] == "inline":
        dv = d
    shape = (case["blocks"], case["page"], heads + (case["cache_heads"] == "other"))
    try:
        caches = alloc_caches(kv, group, shape, d, dv, torch.bfloat16, device, case["layout"])
        ref = alloc_caches(kv, group, shape, d, dv, torch.bfloat16, "cpu", case["layout"])
    except ValueError:
        event("no cache")
        return
    k, v, ks, vs = caches
    if case["scales"] == "wrong_dtype":
        ks = ks.double()
    elif case["scales"] == "wrong_shape":
        ks = ks[:, :1] if ks.shape[1] > 1 else ks[..., None]
    n = case["tokens"]
    wide = 2 if case["strided_input"] else 1
    key = torch.randn(n, heads, d * wide, generator=gen)[..., ::wide] * 3
    value = torch.randn(n, heads, dv * wide, generator=gen)[..., ::wide]
    if case["in_dtype"] == "int":
        key, value = key.to(torch.int32), value.to(torch.int32)
    else:
        key, value = key.to(case["in_dtype"]), value.to(case["in_dtype"])
    num_slots = shape[0] * shape[1]
    slots = torch.randperm(num_slots, generator=gen)[:n]
    if case["slots"] == "negative" and n:
        slots[0] = -1
    elif case["slots"] == "past_end" and n:
        slots[-1] = num_slots + 3
    elif case["slots"] == "short" and n:
        slots = slots[:-1]
    slots = slots.to(torch.int64 if case["slots"] == "int64" else torch.int32)
    store = store_kv_int4_per_token_head if kv == "int4" else store_kv_per_token_head
    if case["store"] == "other":
        store = store_kv_per_token_head if kv == "int4" else store_kv_int4_per_token_head
    before = snapshot((k, v, ks, vs))
    args = (key.to(device), value.to(device), k, v, ks, vs, slots.to(device))
    try:
        store(*args)
    except (ValueError, TypeError) as exc:
        assert str(exc)
        event(f"refused: {type(exc).__name__}")
        assert all(torch.equal(a, b) for a, b in zip(before, snapshot((k, v, ks, vs)), strict=True))
        return
    event("stored")
    per_token_head.store(key, value, *ref, slots)  # the reference, into 0xFF caches on the CPU
    got = snapshot(t.cpu() for t in (k, v, ks, vs))
    want = snapshot(ref)
    for name, a, b in zip(("key_cache", "value_cache", "k_scales", "v_scales"), got, want,
                          strict=True):  # fmt: skip
        assert torch.equal(a, b), (name, case)
