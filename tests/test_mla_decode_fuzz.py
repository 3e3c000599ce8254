"""flash_mla_with_kvcache over generated arguments, right and wrong: every call either raises
ValueError / TypeError with the cache unchanged, or matches the float64 reference, with NaN
for a sequence whose block table names a page outside the cache or that is longer than its
table row (the default check_block_table=False: such pages are never read)."""

from __future__ import annotations

import torch
from _fuzz import block_table, check_invalid, fuzz, snapshot
from hypothesis import event, given
from hypothesis import strategies as st

from kvgen.formats.mla_decode import mla_decode
from kvgen.ops import flash_mla_with_kvcache, get_mla_metadata


@st.composite
def calls(draw):
    d, dv = draw(st.sampled_from([(576, 512), (512, 512), (288, 256), (576, 500)]))
    h_kv = draw(st.sampled_from([1, 1, 2]))
    return {
        "d": d,
        "dv": dv,
        "h_kv": h_kv,
        "h_q": h_kv * draw(st.integers(1, 8)) + draw(st.sampled_from([0, 0, 0, 1])),
        "s_q": draw(st.integers(1, 3)),
        "page": draw(st.sampled_from([1, 5, 16, 64])),
        "seqlens": draw(st.lists(st.integers(0, 40), min_size=1, max_size=3)),
        "causal": draw(st.booleans()),
        "dtype": draw(st.sampled_from([torch.bfloat16, torch.float16, torch.bfloat16, "mixed"])),
        "bad_page": draw(st.sampled_from([None, None, -1, 10**6])),
        "short_table": draw(st.booleans()),
        "table_dtype": draw(st.sampled_from([torch.int32, torch.int32, torch.int32, torch.int64])),
        "seed": draw(st.integers(0, 2**16)),
    }


@fuzz
@given(case=calls())
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
        event(f"refused: {type(exc).__name__}")
        return
    finally:  # the decode never writes its cache
        assert torch.equal(before[0], snapshot((k_dev,))[0])
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
