"""Non-finite input, format by format (docs/formats.md, "Non-finite input"): a scale group
holding a NaN or an infinity stores codes 0 and the format's NaN scale, reads back as NaN in
every element of that group and nowhere else; a finite int4 group whose scale exceeds fp16's
range stores the scale 65504."""

import pytest
import torch

from kvgen.formats import mxfp4
from kvgen.ops import (
    gather_kv_per_token_head,
    gather_mxfp4_mla,
    store_kv_int4_per_token_head,
    store_kv_per_token_head,
    store_mxfp4_mla,
)

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")

NAN = float("nan")
INF = float("inf")


def _rows(tokens, heads, d, seed=0):
    """Random K or V rows; token 0 head 0 gets a NaN, token 1 head 1 a -inf, token 2 head 0
    a +inf and a NaN."""
    x = torch.randn(tokens, heads, d, generator=torch.Generator().manual_seed(seed))
    x[0, 0, 3] = NAN
    x[1, 1, d - 1] = -INF
    x[2, 0, 0] = INF
    x[2, 0, 1] = NAN
    return x


BAD_ROWS = [(0, 0), (1, 1), (2, 0)]  # (token, head) rows above that hold a non-finite value


@pytest.mark.parametrize(
    "cache_dtype", [torch.int8, torch.float8_e4m3fn, torch.float8_e5m2], ids=str
)
@pytest.mark.parametrize("in_dtype", [torch.bfloat16, torch.float32], ids=str)
def test_int8_fp8_row_with_nan_or_inf_stores_codes_0_and_a_nan_scale(cache_dtype, in_dtype, device):
    tokens, heads, d = 4, 2, 64
    key = _rows(tokens, heads, d).to(in_dtype)
    value = _rows(tokens, heads, d, seed=1).to(in_dtype)
    kc = torch.full((2, 4, heads, d), 0x55, dtype=torch.uint8).view(cache_dtype).to(device)
    vc = kc.clone()
    ks = torch.full((2, 4, heads), 7.0, device=device)
    vs = ks.clone()
    slots = torch.arange(tokens, dtype=torch.int32, device=device)
    store_kv_per_token_head(key.to(device), value.to(device), kc, vc, ks, vs, slots)
    for cache, scales in ((kc, ks), (vc, vs)):
        codes = cache.view(torch.uint8)[0].cpu()  # tokens 0-3 are block 0's rows 0-3
        bits = scales[0].cpu().view(torch.int32)
        for t in range(tokens):
            for h in range(heads):
                if (t, h) in BAD_ROWS:
                    assert (codes[t, h] == 0).all() and int(bits[t, h]) == 0x7FC00000
                else:
                    assert torch.isfinite(scales[0, t, h]) and scales[0, t, h] > 0
    got_k, _ = gather_kv_per_token_head(kc, vc, ks, vs, slots, d, d, out_dtype=torch.float32)
    nan_rows = got_k.isnan().all(dim=-1).cpu()
    assert (got_k.isnan().any(dim=-1).cpu() == nan_rows).all()  # a row is all NaN or none
    assert {tuple(i) for i in nan_rows.nonzero().tolist()} == set(BAD_ROWS)


@pytest.mark.parametrize("in_dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_int4_group_with_nan_or_inf_stores_codes_0_and_the_fp16_nan(in_dtype, device):
    tokens, heads, d, c = 4, 2, 64, 16  # 4 groups a head
    key = _rows(tokens, heads, d).to(in_dtype)
    value = _rows(tokens, heads, d, seed=1).to(in_dtype)
    kc = torch.full((2, 4, heads, d // 2), 0x55, dtype=torch.uint8, device=device)
    vc = kc.clone()
    ks = torch.full((2, 4, heads, d // c), 7.0, dtype=torch.float16, device=device)
    vs = ks.clone()
    slots = torch.arange(tokens, dtype=torch.int32, device=device)
    store_kv_int4_per_token_head(key.to(device), value.to(device), kc, vc, ks, vs, slots)
    # the bad elements' groups: (token, head, group)
    bad = {(0, 0, 3 // c), (1, 1, (d - 1) // c), (2, 0, 0)}
    codes = kc[0].cpu().reshape(tokens, heads, d // c, c // 2)
    bits = ks[0].cpu().view(torch.int16)
    for t in range(tokens):
        for h in range(heads):
            for g in range(d // c):
                if (t, h, g) in bad:
                    assert (codes[t, h, g] == 0).all() and int(bits[t, h, g]) == 0x7E00
                else:
                    assert torch.isfinite(ks[0, t, h, g]).item()
    got_k, _ = gather_kv_per_token_head(kc, vc, ks, vs, slots, d, d, out_dtype=torch.float32)
    nan = got_k.cpu().reshape(tokens, heads, d // c, c).isnan()
    assert (nan.any(dim=-1) == nan.all(dim=-1)).all()  # a group is all NaN or none
    assert {tuple(i) for i in nan.all(dim=-1).nonzero().tolist()} == bad


@pytest.mark.parametrize("in_dtype", [torch.bfloat16, torch.float32], ids=str)
def test_int4_scale_above_fp16_range_saturates_at_65504(in_dtype, device):
    heads, d = 1, 32
    key = torch.zeros(2, heads, d)
    key[0, 0, 0] = 1.0e6  # an fp16 scale of 1e6 would be inf
    key[1, 0, 0] = 65519.0  # rounds to 65504 (below the midpoint to inf)
    key[1, 0, 1] = -3.0e4
    kc = torch.zeros(1, 2, heads, d // 2, dtype=torch.uint8, device=device)
    ks = torch.zeros(1, 2, heads, 1, dtype=torch.float16, device=device)
    slots = torch.arange(2, dtype=torch.int32, device=device)
    k = key.to(in_dtype).to(device)
    store_kv_int4_per_token_head(k, k, kc, kc.clone(), ks, ks.clone(), slots)
    assert ks.cpu().flatten().tolist() == [65504.0, 65504.0]
    # the codes come from the fp32 scale: the peak is level 7 (1.0), the rest 0
    assert kc[0, 0, 0, 0].item() == 0x07 and (kc[0, 0, 0, 1:] == 0).all()


@pytest.mark.parametrize("in_dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_mxfp4_group_with_nan_or_inf_stores_scale_0xff_and_codes_0(in_dtype, device):
    latent, group, tokens = 128, 32, 3
    x = torch.randn(tokens, latent, generator=torch.Generator().manual_seed(5))
    x[0, 40] = NAN  # group 1
    x[1, 0] = INF  # group 0
    x[2, 127] = -INF  # group 3
    x[2, 96] = NAN
    bad = {(0, 1), (1, 0), (2, 3)}
    row = mxfp4.row_bytes(latent, group)
    cache = torch.full((1, 4, row), 0x55, dtype=torch.uint8, device=device)
    slots = torch.arange(tokens, device=device)
    store_mxfp4_mla(x.to(in_dtype).to(device), slots, cache, group)
    rows = cache[0, :tokens].cpu()
    codes = rows[:, : latent // 2].reshape(tokens, latent // group, group // 2)
    scales = rows[:, latent // 2 :]
    for t in range(tokens):
        for g in range(latent // group):
            if (t, g) in bad:
                assert scales[t, g] == 0xFF and (codes[t, g] == 0).all()
            else:
                assert scales[t, g] != 0xFF
    got = gather_mxfp4_mla(cache, slots, latent, group, out_dtype=torch.float32).cpu()
    nan = got.reshape(tokens, latent // group, group).isnan()
    assert (nan.any(dim=-1) == nan.all(dim=-1)).all()
    assert {tuple(i) for i in nan.all(dim=-1).nonzero().tolist()} == bad


def test_mla_decode_over_an_mxfp4_group_of_nan_gives_nan_for_that_sequence_only(device):
    """A key whose latent held a NaN (stored as scale 0xFF, codes 0) makes its sequence's out
    and lse NaN wherever the key is visible; the other sequences are untouched."""
    from kvgen.ops import flash_mla_with_kvcache, get_mla_metadata

    gen = torch.Generator().manual_seed(3)
    page, latent = 16, 512
    x = torch.randn(4 * page, latent, generator=gen)
    x[5, 70] = NAN  # sequence 0's key 5
    cache = torch.zeros(4, page, mxfp4.row_bytes(latent), dtype=torch.uint8, device=device)
    store_mxfp4_mla(x.to(torch.bfloat16).to(device), torch.arange(4 * page, device=device), cache)
    table = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32, device=device)
    sl = torch.tensor([20, 30], dtype=torch.int32, device=device)
    q = torch.randn(2, 1, 4, latent, generator=gen).to(torch.bfloat16).to(device)
    meta, splits = get_mla_metadata(sl, 4, 1)
    out, lse = flash_mla_with_kvcache(q, cache.unsqueeze(2), table, sl, latent, meta, splits)
    assert out[0].isnan().all() and lse[0].isnan().all()
    assert torch.isfinite(out[1].float()).all() and torch.isfinite(lse[1]).all()


@pytest.mark.parametrize("kv", ["int8", "int4"])
def test_gqa_decode_over_a_nan_row_gives_nan_for_that_kv_heads_queries(kv, device):
    """A K row that held a NaN (NaN scale, codes 0) makes NaN the outputs of the query heads
    of its KV head in its sequence; the other KV head and the other sequence are finite."""
    from kvgen.ops import flash_attn_with_kvcache

    gen = torch.Generator().manual_seed(4)
    blocks, page, heads, d = 4, 16, 2, 64
    key = torch.randn(blocks * page, heads, d, generator=gen)
    value = torch.randn(blocks * page, heads, d, generator=gen)
    key[3, 1, 7] = NAN  # block 0 (sequence 0), KV head 1
    shape = (blocks, page, heads)
    if kv == "int8":
        kc = torch.zeros(*shape, d, dtype=torch.int8, device=device)
        scales = (torch.zeros(*shape, device=device), torch.zeros(*shape, device=device))
        store = store_kv_per_token_head
    else:
        kc = torch.zeros(*shape, d // 2, dtype=torch.uint8, device=device)
        scales = tuple(torch.zeros(*shape, 2, dtype=torch.float16, device=device) for _ in "kv")
        store = store_kv_int4_per_token_head
    vc = kc.clone()
    slots = torch.arange(blocks * page, device=device)
    store(key.to(device), value.to(device), kc, vc, *scales, slots)
    q = torch.randn(2, 1, 4, d, generator=gen).to(torch.bfloat16).to(device)
    out, lse = flash_attn_with_kvcache(
        q,
        kc,
        vc,
        cache_seqlens=torch.tensor([20, 25], dtype=torch.int32, device=device),
        block_table=torch.tensor([[0, 1], [2, 3]], dtype=torch.int32, device=device),
        k_scale_cache=scales[0],
        v_scale_cache=scales[1],
        return_softmax_lse=True,
    )
    out, lse = out.cpu(), lse.cpu()
    assert out[0, :, 2:].isnan().all() and lse[0, 2:].isnan().all()  # heads 2, 3: KV head 1
    assert torch.isfinite(out[0, :, :2].float()).all() and torch.isfinite(lse[0, :2]).all()
    assert torch.isfinite(out[1].float()).all() and torch.isfinite(lse[1]).all()
