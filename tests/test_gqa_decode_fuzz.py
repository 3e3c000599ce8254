"""flash_attn_with_kvcache over generated arguments, right and wrong: every call either raises
ValueError / TypeError or matches the float64 reference (NaN for a sequence whose block table
names a page outside the cache or that is longer than its table row)."""

from __future__ import annotations

import torch
from _fuzz import block_table, check_invalid, fuzz, snapshot
from hypothesis import event, given
from hypothesis import strategies as st

from kvgen.families.gqa_decode.verify import make_caches
from kvgen.formats.gqa_decode import gqa_decode
from kvgen.ops import flash_attn_with_kvcache
from kvgen.verify import compare_attention as compare

FORMATS = [("auto", 0), ("int8", 0), ("fp8e4m3", 0), ("fp8e5m2", 0), ("int4", 16), ("int4", 32)]


@st.composite
def calls(draw):
    kv, group = draw(st.sampled_from(FORMATS))
    h_kv = draw(st.integers(1, 3))
    case = {
        "kv": kv,
        "group": group,
        "h_kv": h_kv,
        "h_q": h_kv * draw(st.integers(1, 3)) + draw(st.sampled_from([0, 0, 0, 1])),
        "s_q": draw(st.integers(1, 3)),
        "d": draw(st.sampled_from([16, 64, 80, 64, 100, 264])),
        "dv": draw(st.sampled_from([16, 64, 48])),
        "page": draw(st.sampled_from([1, 5, 16])),
        "seqlens": draw(st.lists(st.integers(0, 40), min_size=1, max_size=3)),
        "layout": draw(st.sampled_from(["nhd", "hnd"])),
        "causal": draw(st.booleans()),
        "q_dtype": draw(st.sampled_from([torch.bfloat16, torch.float16, torch.bfloat16, "fp32"])),
        "scales": draw(
            st.sampled_from(["ok", "ok", "ok", "missing", "wrong_dtype", "wrong_shape"])
        ),
        "bad_page": draw(st.sampled_from([None, None, -1, 10**6])),
        "short_table": draw(st.booleans()),
        "empty": draw(st.sampled_from([None] * 8 + ["no_blocks", "no_rows"])),
        "seed": draw(st.integers(0, 2**16)),
    }
    return case


@fuzz
@given(case=calls())
def test_every_call_raises_a_clear_error_or_matches_the_reference(device, case):
    gen = torch.Generator().manual_seed(case["seed"])
    page, seqlens, h_kv = case["page"], case["seqlens"], case["h_kv"]
    d, dv = case["d"], case["dv"]
    table, blocks, invalid = block_table(seqlens, page, case["bad_page"], case["short_table"], gen)
    dtype = case["q_dtype"] if case["q_dtype"] != "fp32" else torch.bfloat16
    keys = torch.randn(blocks * page, h_kv, d, generator=gen)
    values = torch.randn(blocks * page, h_kv, dv, generator=gen)
    try:
        k, v, ks, vs, k_deq, v_deq = make_caches(
            case["kv"], case["group"], keys, values, page, device, layout=case["layout"],
            writer="reference", dtype=dtype,
        )  # fmt: skip
    except ValueError:  # (no cache of this shape to call with)
        event("no cache")
        return
    if case["scales"] == "missing":
        ks = None
    elif case["scales"] == "wrong_dtype" and ks is not None:
        ks = ks.double()
    elif case["scales"] == "wrong_shape" and ks is not None:
        ks = ks[:, :1]
    if case["empty"]:  # a cache with no slot: refused, whatever else the call holds
        cut = (slice(0, 0),) if case["empty"] == "no_blocks" else (slice(None), slice(0, 0))
        k, v = k[cut], v[cut]
        ks, vs = (None if s is None else s[cut] for s in (ks, vs))
    q = torch.randn(len(seqlens), case["s_q"], case["h_q"], d, generator=gen)
    q = q.to(torch.float32 if case["q_dtype"] == "fp32" else dtype)
    sl = torch.tensor(seqlens, dtype=torch.int32)
    before = snapshot((k, v, ks, vs))
    try:
        out, lse = flash_attn_with_kvcache(
            q.to(device), k, v, cache_seqlens=sl.to(device), block_table=table.to(device),
            causal=case["causal"], return_softmax_lse=True, k_scale_cache=ks, v_scale_cache=vs,
        )  # fmt: skip
    except (ValueError, TypeError) as exc:
        assert str(exc), "an error must say what was wrong"
        event(f"refused: {type(exc).__name__}")
        return
    finally:  # the decode never writes its caches
        for a, b in zip(before, snapshot((k, v, ks, vs)), strict=True):
            assert torch.equal(a, b)
    assert not case["empty"], "a cache with no slot must be refused"
    event("ran" + (", a bad table" if invalid else ""))
    keep, ref_sl = check_invalid(out, lse, sl, invalid)
    if not keep:
        return
    ref_out, ref_lse = gqa_decode(q, k_deq, v_deq, table.clamp(0, blocks - 1), ref_sl,
                                  causal=case["causal"])  # fmt: skip
    if float(ref_out[keep].norm()) == 0.0:  # only empty rows: out 0, lse +inf
        assert (out[keep] == 0).all() and torch.isinf(lse[keep]).all()
        return
    ok, rel, detail = compare(out[keep], lse[keep], ref_out[keep], ref_lse[keep])
    assert ok, (rel, detail, case)
