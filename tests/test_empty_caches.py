"""Caches with no slot at all: no blocks (``num_blocks`` 0) or blocks of no rows (``block_size``
0). No op may index into them: a decode raises a clear ValueError naming k_cache, a reader gives
zero rows (every slot is out of range), a store writes nothing (every slot is skipped)."""

from __future__ import annotations

import pytest
import torch

from kvgen.ops import (
    concat_and_cache_mla,
    flash_attn_with_kvcache,
    flash_mla_with_kvcache,
    gather_kv_per_token_head,
    gather_mla_cache,
    gather_mxfp4_mla,
    get_mla_metadata,
    mxfp4_row_bytes,
    store_kv_int4_per_token_head,
    store_kv_per_token_head,
    store_mxfp4_mla,
)

EMPTY = [(0, 16), (4, 0)]
IDS = ["no_blocks", "blocks_of_no_rows"]
SLOTS = [0, 3, -1, 70]  # none is in an empty cache


def _slots(device, dtype=torch.int64):
    return torch.tensor(SLOTS, dtype=dtype, device=device)


@pytest.mark.parametrize("shape", EMPTY, ids=IDS)
def test_gqa_decode_over_an_empty_cache_raises(shape, device):
    num_blocks, block_size = shape
    q = torch.randn(2, 1, 4, 64, dtype=torch.bfloat16, device=device)
    k = torch.zeros(num_blocks, block_size, 2, 64, dtype=torch.bfloat16, device=device)
    table = torch.zeros(2, 3, dtype=torch.int32, device=device)
    lengths = torch.tensor([5, 0], dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="k_cache needs at least one block"):
        flash_attn_with_kvcache(q, k, k.clone(), cache_seqlens=lengths, block_table=table)


@pytest.mark.parametrize("shape", EMPTY, ids=IDS)
def test_mla_decode_over_an_empty_cache_raises(shape, device):
    num_blocks, block_size = shape
    q = torch.randn(1, 1, 16, 576, dtype=torch.bfloat16, device=device)
    k = torch.zeros(num_blocks, block_size, 1, 576, dtype=torch.bfloat16, device=device)
    lengths = torch.tensor([5], dtype=torch.int32, device=device)
    meta, splits = get_mla_metadata(lengths, 16, 1)
    with pytest.raises(ValueError, match="k_cache needs at least one page of at least one row"):
        flash_mla_with_kvcache(
            q, k, torch.zeros(1, 2, dtype=torch.int32, device=device), lengths, 512, meta, splits
        )


@pytest.mark.parametrize("shape", EMPTY, ids=IDS)
@pytest.mark.parametrize("int4", (False, True), ids=("int8", "int4"))
def test_per_token_head_store_and_gather_over_an_empty_cache(shape, int4, device):
    num_blocks, block_size = shape
    heads, d = 2, 64
    if int4:
        cache = torch.zeros(num_blocks, block_size, heads, d // 2, dtype=torch.uint8, device=device)
        scales = torch.zeros(num_blocks, block_size, heads, d // 32, dtype=torch.float16,
                             device=device)  # fmt: skip
        store = store_kv_int4_per_token_head
    else:
        cache = torch.zeros(num_blocks, block_size, heads, d, dtype=torch.int8, device=device)
        scales = torch.zeros(num_blocks, block_size, heads, dtype=torch.float32, device=device)
        store = store_kv_per_token_head
    x = torch.randn(len(SLOTS), heads, d, dtype=torch.bfloat16, device=device)
    caches = (cache, cache.clone(), scales, scales.clone())
    store(x, x.clone(), *caches, _slots(device))
    assert all(c.numel() == 0 for c in caches)
    got_k, got_v = gather_kv_per_token_head(*caches, _slots(device), d, d, torch.float32)
    assert got_k.shape == got_v.shape == (len(SLOTS), heads, d)
    assert torch.equal(got_k, torch.zeros_like(got_k))
    assert torch.equal(got_v, torch.zeros_like(got_v))


@pytest.mark.parametrize("shape", EMPTY, ids=IDS)
@pytest.mark.parametrize("fmt", ("auto", "fp8", "fp8_ds_mla"))
def test_mla_cache_store_and_gather_over_an_empty_cache(shape, fmt, device):
    num_blocks, block_size = shape
    row, dtype = {"auto": (576, torch.bfloat16), "fp8": (576, torch.uint8)}.get(
        fmt, (656, torch.uint8)
    )
    cache = torch.zeros(num_blocks, block_size, row, dtype=dtype, device=device)
    scale = torch.ones(1, device=device)
    kv_c = torch.randn(len(SLOTS), 512, dtype=torch.bfloat16, device=device)
    k_pe = torch.randn(len(SLOTS), 64, dtype=torch.bfloat16, device=device)
    concat_and_cache_mla(kv_c, k_pe, cache, _slots(device), fmt, scale)
    got = gather_mla_cache(cache, _slots(device), fmt, scale)
    assert got.shape == (len(SLOTS), 576)
    assert torch.equal(got, torch.zeros_like(got))


@pytest.mark.parametrize("shape", EMPTY, ids=IDS)
def test_mxfp4_store_and_gather_over_an_empty_cache(shape, device):
    num_blocks, block_size = shape
    cache = torch.zeros(num_blocks, block_size, mxfp4_row_bytes(512, 32), dtype=torch.uint8,
                        device=device)  # fmt: skip
    store_mxfp4_mla(torch.randn(len(SLOTS), 512, device=device), _slots(device), cache)
    got = gather_mxfp4_mla(cache, _slots(device), 512, out_dtype=torch.float32)
    assert got.shape == (len(SLOTS), 512)
    assert torch.equal(got, torch.zeros_like(got))
