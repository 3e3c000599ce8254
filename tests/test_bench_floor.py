"""The stores' floor (``kvgen.bench._floor_kernel.scatter_rows``): it writes exactly the rows a
store writes (the same slots, strides and row bytes, a fold of the input row) and nothing else,
so that its time is the time of the store's bytes at the store's addresses."""

import pytest
import torch

from kvgen.bench._floor_kernel import scatter_rows
from kvgen.families.per_token_head.verify import inline_row, inline_views


def fold(src: torch.Tensor, heads: int, out_words: int) -> torch.Tensor:
    """[tokens, heads, out_words] int32, the floor's row from its definition: with P the
    power of two at or above out_words, word j is the XOR of the row's input words i with
    i % P == j, and word 0 also takes the XOR of those that land on j >= out_words."""
    words = src.contiguous().view(torch.int32).reshape(src.shape[0], heads, -1)
    p = 1 << (out_words - 1).bit_length()
    acc = torch.zeros(src.shape[0], heads, p, dtype=torch.int32)
    for start in range(0, words.shape[2], p):
        piece = words[:, :, start : start + p]
        acc[:, :, : piece.shape[2]] ^= piece
    out = acc[:, :, :out_words].clone()
    for j in range(out_words, p):
        out[:, :, 0] ^= acc[:, :, j]
    return out


def scale_words(rows: torch.Tensor, n: int) -> torch.Tensor:
    """The aux row: the XOR of the row's words, plus 0, 1, ... (int32, wrapping)."""
    x = torch.zeros(rows.shape[:2], dtype=torch.int32)
    for j in range(rows.shape[2]):
        x ^= rows[:, :, j]
    return x[:, :, None] + torch.arange(n, dtype=torch.int32)


def slot_list(n_slots: int, tokens: int) -> torch.Tensor:
    slots = torch.randperm(n_slots)[:tokens]
    slots[1], slots[3] = -1, n_slots  # skipped: below 0, past the cache
    return slots


@pytest.mark.parametrize("kv", ["int8", "int4"])
def test_floor_writes_vllm_inline_rows_codes_and_scales_at_the_slots(kv, device):
    blocks, page, heads, d, tokens = 3, 16, 2, 128, 9
    codes, groups = (d // 2, d // 32) if kv == "int4" else (d, None)
    _, row = inline_row(codes, groups)
    raw = torch.full((blocks, 2, page, heads, row), 0xAB, dtype=torch.uint8, device=device)
    kc, vc, *_ = inline_views(raw, codes, groups, torch.uint8, torch.float32)
    src = torch.randn(tokens, heads, d).bfloat16()
    slots = slot_list(blocks * page, tokens)
    want = raw.cpu().clone()
    rows = fold(src, heads, row // 4)
    for t, s in enumerate(slots.tolist()):
        if 0 <= s < blocks * page:
            want[s // page, 1, s % page] = rows[t].view(torch.uint8).reshape(heads, row)
    scatter_rows(src.to(device), slots.to(device), vc, row)  # the V half; K's untouched
    assert torch.equal(raw.cpu(), want)


@pytest.mark.parametrize("kv", ["int8", "int4"])
def test_floor_writes_a_separate_scale_cache_beside_the_codes(kv, device):
    blocks, page, heads, d, tokens = 4, 16, 8, 128, 20
    width, scale_shape = (d // 2, (d // 32,)) if kv == "int4" else (d, ())
    scale_bytes = 2 * d // 32 if kv == "int4" else 4
    cache = torch.full((blocks, page, heads, width), 0x5A, dtype=torch.uint8, device=device)
    scale_dtype = torch.float16 if kv == "int4" else torch.float32
    scales = torch.full((blocks, page, heads, *scale_shape), 7.0, dtype=scale_dtype)
    scales = scales.to(device)
    src = torch.randn(tokens, heads, d).bfloat16()
    slots = slot_list(blocks * page, tokens)
    want_c = cache.cpu().clone()
    want_s = scales.cpu().clone().view(torch.uint8).reshape(blocks, page, heads, scale_bytes)
    rows = fold(src, heads, width // 4)
    aux = scale_words(rows, scale_bytes // 4)
    for t, s in enumerate(slots.tolist()):
        if 0 <= s < blocks * page:
            want_c[s // page, s % page] = rows[t].view(torch.uint8).reshape(heads, width)
            want_s[s // page, s % page] = aux[t].view(torch.uint8).reshape(heads, scale_bytes)
    scatter_rows(src.to(device), slots.to(device), cache, width, scales, scale_bytes)
    assert torch.equal(cache.cpu(), want_c)
    got = scales.cpu().view(torch.uint8).reshape(blocks, page, heads, scale_bytes)
    assert torch.equal(got, want_s)


def test_floor_writes_one_head_rows_of_a_paged_latent_cache(device):
    """The MXFP4 store's rows: 272 bytes a token (256 of codes, 16 scales) from 512 bf16."""
    blocks, page, pitch, tokens = 2, 64, 272, 70
    cache = torch.full((blocks, page, pitch), 0x11, dtype=torch.uint8, device=device)
    src = torch.randn(tokens, 512).bfloat16()
    slots = slot_list(blocks * page, tokens)
    want = cache.cpu().clone()
    rows = fold(src, 1, pitch // 4)
    for t, s in enumerate(slots.tolist()):
        if 0 <= s < blocks * page:
            want[s // page, s % page] = rows[t, 0].view(torch.uint8)
    scatter_rows(src.to(device), slots.to(device), cache, pitch)
    assert torch.equal(cache.cpu(), want)


def test_floor_refuses_what_it_cannot_address(device):
    cache = torch.zeros(2, 16, 2, 128, dtype=torch.uint8, device=device)
    src = torch.randn(3, 2, 128, device=device).bfloat16()
    slots = torch.arange(3, device=device)
    with pytest.raises(ValueError, match="wider than its input"):
        scatter_rows(src, slots, cache, 512)
    with pytest.raises(ValueError, match="multiples of 4"):
        scatter_rows(src, slots, cache, 130)
    with pytest.raises(ValueError, match="cache must start"):
        scatter_rows(src, slots, cache[..., 1:], 124)
    with pytest.raises(ValueError, match="src must be contiguous"):
        scatter_rows(src.transpose(0, 1), slots, cache, 128)


def _cache_tensors(case) -> list[torch.Tensor]:
    """The cache tensors of a bench case's first set (what its store writes)."""
    data = case.data[0]
    if case.op in ("store_mxfp4_mla", "concat_and_cache_mla"):
        return [data[2]]
    return [x for x in data[2:6] if x is not None]


def _touched(case, run) -> list[torch.Tensor]:
    """Each cache tensor's bytes that ``run(0)`` writes: bytes that differ from the fill after
    it, over a fill of 0x00 and one of 0xFF (no byte can equal both)."""
    caches = _cache_tensors(case)
    masks = [torch.zeros(c.numel() * c.element_size(), dtype=torch.bool) for c in caches]
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32}
    for fill in (0x00, 0xFF):
        for c in caches:  # every byte of the view (strided, or a view of another's bytes)
            c.view(ints[c.element_size()]).fill_(fill if c.element_size() == 1 else -(fill > 0))
        run(0)
        for m, c in zip(masks, caches, strict=True):
            m |= c.contiguous().view(torch.uint8).flatten().cpu() != fill
    return masks


def _store_cases(device):
    from kvgen.bench import store

    yield from store.kv_cases(device, (7,), "int8", 2, 128, layout="inline")
    yield from store.kv_cases(device, (7,), "int8", 2, 128, layout="separate")
    yield from store.kv_cases(device, (5,), "int4", 1, 576, layout="inline")
    yield from store.kv_cases(device, (5,), "int4", 2, 128, layout="separate")
    yield from store.mxfp4_cases(device, (6,))
    for fmt in ("auto", "fp8", "fp8_ds_mla"):
        yield from store.mla_cache_cases(device, (5,), fmt)


def test_each_store_case_has_a_floor_that_writes_exactly_the_bytes_its_store_writes(device):
    """The floor is the store's bytes at the store's addresses: over every store the bench
    times (per-token-head int8 / int4 on vLLM's rows and on separate scale caches, MXFP4, the
    MLA caches), it writes the same bytes of the same caches, no more and no fewer."""
    for case in _store_cases(device):
        assert case.floor is not None, case.variant
        want, got = _touched(case, case.step), _touched(case, case.floor)
        assert all(m.any() for m in want), case.variant
        for w, g in zip(want, got, strict=True):
            assert torch.equal(w, g), case.variant
