"""flash_mla_with_kvcache over generated arguments, right and wrong: every call either raises
ValueError / TypeError with the cache unchanged, or matches the float64 reference, with NaN
for a sequence whose block table names a page outside the cache or that is longer than its
table row (the default check_block_table=False: such pages are never read)."""

from __future__ import annotations

import torch
from _fuzz import block_table, check_invalid, fuzz, snapshot
from hypothesis import event, example, given
from hypothesis import strategies as st

from kvgen.formats.mla_decode import mla_decode
from kvgen.ops import flash_mla_with_kvcache, get_mla_metadata

# What a call gets wrong: nothing (half the calls), or one argument. Bad block table entries
# and short tables are not wrong arguments: such a call runs, NaN for those sequences.
WRONG = (None, None, None, None, "dv", "h_q", "mixed", "table_dtype")


@st.composite
def calls(draw):
    wrong = draw(st.sampled_from(WRONG))
    if wrong == "dv":
        d, dv = 576, 500
    else:
        d, dv = draw(st.sampled_from([(576, 512), (512, 512), (288, 256)]))
    # (a query head count that is not a multiple of the KV heads': two KV heads, one extra)
    h_kv = 2 if wrong == "h_q" else draw(st.sampled_from([1, 1, 2]))
    if wrong == "mixed":
        dtype = "mixed"
    else:
        dtype = draw(st.sampled_from([torch.bfloat16, torch.float16]))
    return {
        "wrong": wrong,
        "d": d,
        "dv": dv,
        "h_kv": h_kv,
        "h_q": h_kv * draw(st.integers(1, 8)) + (wrong == "h_q"),
        "s_q": draw(st.integers(1, 3)),
        "page": draw(st.sampled_from([1, 5, 16, 64])),
        "seqlens": draw(st.lists(st.integers(0, 40), min_size=1, max_size=3)),
        "causal": draw(st.booleans()),
        "dtype": dtype,
        "bad_page": draw(st.sampled_from([None, None, -1, 10**6])),
        "short_table": draw(st.booleans()),
        "table_dtype": torch.int64 if wrong == "table_dtype" else torch.int32,
        "seed": draw(st.integers(0, 2**16)),
    }


def wrong_call(wrong: str) -> dict:
    """A small call, wrong in ``wrong`` alone (each kind is tried at least once)."""
    case = {"wrong": wrong, "d": 576, "dv": 512, "h_kv": 1, "h_q": 16, "s_q": 1, "page": 16,
            "seqlens": [20, 3], "causal": False, "dtype": torch.bfloat16, "bad_page": None,
            "short_table": False, "table_dtype": torch.int32, "seed": 0}  # fmt: skip
    case |= {
        "dv": {"dv": 500},
        "h_q": {"h_kv": 2, "h_q": 17},
        "mixed": {"dtype": "mixed"},
        "table_dtype": {"table_dtype": torch.int64},
    }[wrong]
    return case


@fuzz
@given(case=calls())
@example(case=wrong_call("dv"))
@example(case=wrong_call("h_q"))
@example(case=wrong_call("mixed"))
@example(case=wrong_call("table_dtype"))
def test_every_call_raises_a_clear_error_or_matches_the_reference(device, case):
    gen = torch.Generator().manual_seed(case["seed"])
    page, seqlens, h_kv, d, dv = case["page"], case["seqlens"], case["h_kv"], case["d"], case["dv"]
    table, blocks, invalid = block_table(seqlens, page, case["bad_page"], case["short_table"], gen)
    dtype = torch.bfloat16 if case["dtype"] == "mixed" else case["dtype"]
    k_cache = torch.randn(blocks, page, h_kv, d, generator=gen).to(dtype)
    q = torch.randn(len(seqlens), case["s_q"], case["h_q"], d, generator=gen)
    q = q.to(torch.float16 if case["dtype"] == "mixed" else dtype)  # (mixed: q fp16, cache bf16)
    sl = torch.tensor(seqlens, dtype=torch.int32)
    k_dev = k_cache.to(device)
    before = snapshot((k_dev,))
    try:
        rows = case["s_q"] * case["h_q"] // h_kv
        meta, splits = get_mla_metadata(sl.to(device), rows, h_kv)
        out, lse = flash_mla_with_kvcache(
            q.to(device), k_dev, table.to(case["table_dtype"]).to(device), sl.to(device), dv,
            meta, splits, causal=case["causal"],
        )  # fmt: skip
    except (ValueError, TypeError) as exc:
        assert str(exc), "an error must say what was wrong"
        assert case["wrong"], f"a right call was refused: {exc} {case}"
        event(f"refused: {type(exc).__name__}, wrong {case['wrong']}")
        return
    finally:  # the decode never writes its cache
        assert torch.equal(before[0], snapshot((k_dev,))[0])
    assert not case["wrong"], f"a call with a wrong {case['wrong']} ran: {case}"
    event("ran" + (", a bad table" if invalid else ""))
    keep, ref_sl = check_invalid(out, lse, sl, invalid)
    if not keep:
        return
    ref_out, ref_lse = mla_decode(q, k_cache, table.clamp(0, blocks - 1), ref_sl, dv,
                                  causal=case["causal"])  # fmt: skip
    out, lse, ref_out, ref_lse = out[keep].cpu(), lse[keep].cpu(), ref_out[keep], ref_lse[keep]
    assert not torch.isnan(out).any()
    finite = torch.isfinite(ref_lse)
    assert (lse[~finite] == float("inf")).all()
    if finite.any():
        rel = (out.double() - ref_out).norm() / ref_out.norm().clamp(min=1e-30)
        assert rel < 1e-2, (float(rel), case)
        assert float((lse.double()[finite] - ref_lse[finite]).abs().max()) < 1e-3, case
