"""The MLA decode reference and the split-KV schedule (get_mla_metadata)."""

import math

import pytest
import torch

from kvgen.formats.mla_decode import mla_decode
from kvgen.ops import get_mla_metadata
from kvgen.ops._mla_metadata import BLOCK_N, FIXED_COST, schedule


def _paged(seqlens, page=16, d=64, seed=0, shuffle=True, heads=1):
    gen = torch.Generator().manual_seed(seed)
    blocks_per = [-(-n // page) for n in seqlens]
    total = sum(blocks_per) + 3
    k_cache = torch.randn(total, page, heads, d, generator=gen)
    order = torch.randperm(total, generator=gen) if shuffle else torch.arange(total)
    width = max(max(blocks_per), 1)
    table = torch.full((len(seqlens), width), -1, dtype=torch.int32)
    i = 0
    for b, nb in enumerate(blocks_per):
        table[b, :nb] = order[i : i + nb].to(torch.int32)
        i += nb
    return k_cache, table


def test_reference_matches_dense_softmax_and_page_order():
    seqlens = [37, 5, 64]
    q = torch.randn(3, 1, 4, 64)
    k_cache, table = _paged(seqlens)
    out, lse = mla_decode(q, k_cache, table, torch.tensor(seqlens), 48)
    for b, n in enumerate(seqlens):
        kv = torch.stack([k_cache[table[b, t // 16], t % 16, 0] for t in range(n)]).double()
        s = q[b, 0].double() @ kv.T / 8.0
        assert torch.allclose(lse[b, :, 0], torch.logsumexp(s, -1))
        assert torch.allclose(out[b, 0], torch.softmax(s, -1) @ kv[:, :48])
    # The same tokens in other pages give the same result.
    k2, t2 = _paged(seqlens, shuffle=False)
    k2 = k2.clone()
    for b, n in enumerate(seqlens):
        for t in range(n):
            k2[t2[b, t // 16], t % 16] = k_cache[table[b, t // 16], t % 16]
    out2, lse2 = mla_decode(q, k2, t2, torch.tensor(seqlens), 48)
    assert torch.allclose(out, out2) and torch.allclose(lse, lse2)


def test_empty_sequences_and_causal_rows():
    seqlens = [0, 1, 3]
    q = torch.randn(3, 4, 2, 32)
    k_cache, table = _paged(seqlens, page=2, d=32)
    out, lse = mla_decode(q, k_cache, table, torch.tensor(seqlens), 32, causal=True)
    # A query that sees no key: out 0 and lse +inf (FlashMLA's convention).
    assert (out[0] == 0).all() and (lse[0] == math.inf).all()
    # seqlen 1, 4 queries: only the last query row sees the token.
    assert (lse[1, :, :3] == math.inf).all() and torch.isfinite(lse[1, :, 3]).all()
    assert (out[1, :3] == 0).all()
    # seqlen 3: query i sees keys 0 .. i - 1 (i = 0 sees none).
    assert (lse[2, :, 0] == math.inf).all() and torch.isfinite(lse[2, :, 1:]).all()
    one, _ = mla_decode(q[:, -1:], k_cache, table, torch.tensor(seqlens), 32, causal=False)
    assert torch.allclose(one[:, 0], out[:, -1])  # the last row is not masked at all


@pytest.mark.parametrize(
    "seqlens,parts",
    [
        ([4096] * 8, 16),
        ([1, 16384, 0, 300, 77, 5000], 7),
        ([0, 0], 3),
        ([1], 132),
        ([700] * 3, 1),
        ([], 4),
    ],
)
@pytest.mark.parametrize("policy", ["auto", "split", "whole"])
def test_schedule_covers_every_block_once_and_balances(seqlens, parts, policy):
    meta, num_splits = schedule(torch.tensor(seqlens, dtype=torch.int32), parts, policy)
    batch = len(seqlens)
    blocks = [-(-n // BLOCK_N) for n in seqlens]
    assert meta.shape == (parts, 8) and meta.dtype == torch.int32
    assert num_splits.dtype == torch.int32 and num_splits.shape == (batch + 1,)
    assert num_splits[0] == 0 and (num_splits[1:] >= num_splits[:-1] + 1).all()
    covered = {(b, k): 0 for b in range(batch) for k in range(blocks[b])}
    used_splits = {b: [] for b in range(batch)}
    for p in range(parts):
        b0, k0, b1, k1, split0, units = meta[p].tolist()[:6]
        if b0 == batch:  # an empty part
            assert units == 0
            continue
        for b in range(b0, b1 + 1):
            lo = k0 if b == b0 else 0
            hi = k1 if b == b1 else blocks[b]
            for k in range(lo, hi):
                covered[(b, k)] += 1
            used_splits[b].append(int(num_splits[b]) + (split0 if b == b0 else 0))
    assert all(c == 1 for c in covered.values()), "a KV block is missed or done twice"
    for b in range(batch):
        assert sorted(used_splits[b]) == list(range(num_splits[b], num_splits[b + 1]))
    units = [-(-n // BLOCK_N) + FIXED_COST for n in seqlens]
    assert int(meta[:, 5].sum()) == sum(units)
    if policy == "whole":
        assert num_splits.tolist() == list(range(batch + 1)), "no sequence is split"
    busy = meta[:, 5][meta[:, 5] > 0]
    if policy == "split" and busy.numel():
        assert (busy[:-1] == busy.max()).all(), "parts other than the last carry equal work"
    if policy == "auto" and busy.numel():
        even = -(-sum(units) // parts)
        assert int(busy.max()) <= even + FIXED_COST, "no part carries much more than its share"


@pytest.mark.parametrize(
    "seqlens,parts,whole",
    [
        ([4096] * 128, 66, True),  # 128 heads on 132 SMs: two sequences a part, nothing to merge
        ([4096] * 128, 132, True),  # 32 or 64 heads: a sequence a part (4 parts idle)
        ([4096] * 128, 264, False),  # two parts a sequence balance better than one
        ([1, 16384, 0, 300, 77, 5000], 7, False),  # the long sequence must be cut
    ],
)
def test_schedule_keeps_sequences_whole_where_that_costs_little(seqlens, parts, whole):
    sl = torch.tensor(seqlens, dtype=torch.int32)
    meta, num_splits = schedule(sl, parts)
    ref = schedule(sl, parts, "whole" if whole else "split")
    assert torch.equal(meta, ref[0]) and torch.equal(num_splits, ref[1])


def test_several_kv_heads_read_their_groups_kv_head():
    """num_heads_k = 2: query heads 0-2 read KV head 0, heads 3-5 KV head 1, which is the
    single-head decode of each group against its own head."""
    seqlens = [5, 9]
    q = torch.randn(2, 2, 6, 32)
    k_cache, table = _paged(seqlens, page=4, d=32, heads=2)
    out, lse = mla_decode(q, k_cache, table, torch.tensor(seqlens), 16, causal=True)
    for kv in range(2):
        heads = slice(3 * kv, 3 * kv + 3)
        one = k_cache[:, :, kv : kv + 1]
        o1, l1 = mla_decode(q[:, :, heads], one, table, torch.tensor(seqlens), 16, causal=True)
        assert torch.equal(out[:, :, heads], o1) and torch.equal(lse[:, heads], l1)


def test_get_mla_metadata_arguments():
    meta, splits = get_mla_metadata(torch.tensor([10, 20], dtype=torch.int32), 16, 1)
    assert splits[-1] >= 2
    with pytest.raises(TypeError, match="cache_seqlens must have dtype"):
        get_mla_metadata(torch.tensor([1.0]), 16, 1)
    with pytest.raises(ValueError, match="num_heads_k must be at least 1"):
        get_mla_metadata(torch.tensor([1], dtype=torch.int32), 16, 0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="checks device-side execution")
def test_schedule_does_not_synchronise():
    seqlens = torch.randint(0, 9000, (128,), dtype=torch.int32, device="cuda")
    torch.cuda.set_sync_debug_mode("error")
    try:
        get_mla_metadata(seqlens, 128, 1)
    finally:
        torch.cuda.set_sync_debug_mode("default")
