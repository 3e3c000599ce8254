"""flash_mla_with_kvcache over the fp8_ds_mla cache written by kvgen's store: against kvgen's
bf16 decode over the dequantized cache (exact in bf16) and the float64 reference."""

import itertools
import math

import pytest
import torch
from _hopper import BAD_TABLES, MANY_LENGTHS, hopper, spoil_table, tuned_doc

from kvgen.formats import mla_cache
from kvgen.formats.mla_decode import mla_decode
from kvgen.ops import (
    concat_and_cache_mla,
    flash_mla_with_kvcache,
    get_mla_metadata,
    store_mxfp4_mla,
)


def _table(seqlens, page, gen):
    """(pages, block table): each sequence's pages in random order, a spare page, and the
    entries past a sequence's pages set to FlashMLA's unused-entry value 2147480000 (never a
    page: the decode must not read them)."""
    need = [-(-n // page) for n in seqlens]
    blocks = sum(need) + 1
    order = torch.randperm(blocks, generator=gen).to(torch.int32)
    table = torch.full((len(seqlens), max(need) + 1), 2147480000, dtype=torch.int32)
    for b, nb in enumerate(need):
        table[b, :nb] = order[sum(need[:b]) : sum(need[:b]) + nb]
    return blocks, table


def _store(fmt, kv, slots, cache, k_scale):
    """Write the rows of ``kv`` [n, 576] into ``cache`` as format ``fmt``: with kvgen's store
    kernels on a GPU; under the interpreter with the references (the same bytes: the stores'
    own tests compare them bit for bit), as the store's programs would take most of the test's
    time there."""
    kv_c, k_pe = kv[:, :512], kv[:, 512:]
    if fmt != "mxfp4":
        store = concat_and_cache_mla if kv.device.type == "cuda" else mla_cache.store
        store(kv_c, k_pe, cache, slots, fmt, k_scale)
    elif kv.device.type == "cuda":
        store_mxfp4_mla(kv_c, slots, cache, k_pe=k_pe)
    else:
        mla_cache.store_mxfp4_rope(kv_c, k_pe, slots, cache)


def _assert_matches(out, lse, want, want_lse):
    """``out`` / ``lse`` against kvgen's decode over the dequantized cache: out within 2e-3
    (relative), lse within 1e-3, +inf lse and zero out for the rows that see no key."""
    assert (out.float() - want.float()).norm() / want.float().norm() < 2e-3
    finite = torch.isfinite(want_lse)
    assert (lse[~finite] == math.inf).all() and (out.float()[(~finite).permute(0, 2, 1)] == 0).all()
    assert float((lse[finite] - want_lse[finite]).abs().max()) < 1e-3


def _mxfp4_rows(kv_c, d, group, gen):
    """(MXFP4 rows of ``kv_c`` [n, 512] by the reference, their dequantized values): 576 / 512
    with a random RoPE part as bf16 after the scales, or the seed's rope-free rows for 512 / 512."""
    from kvgen.formats import mxfp4

    if d == 576:
        k_pe = torch.randn(kv_c.shape[0], 64, generator=gen).to(torch.bfloat16)
        rows = mla_cache.quantize_mxfp4_rope(kv_c.to(torch.bfloat16), k_pe, group)
        return rows, mla_cache.dequantize_mxfp4_rope(rows, 512, group)
    rows = mxfp4.quantize_rows(kv_c, group)
    return rows, mxfp4.dequantize_rows(rows, 512, group)


def _cache(seqlens, page, device, seed=0, extra_rows=0):
    """A fp8_ds_mla cache filled by concat_and_cache_mla (pages in random order, blocks
    ``extra_rows`` further apart than a page), its table and the dequantized bf16 cache."""
    gen = torch.Generator().manual_seed(seed)
    blocks, table = _table(seqlens, page, gen)
    kv_c = torch.randn(blocks * page, 512, generator=gen)
    kv_c[:, 5] *= 30.0  # an outlier channel
    k_pe = torch.randn(blocks * page, 64, generator=gen)
    mem = torch.zeros(blocks, page + extra_rows, 1, 656, dtype=torch.uint8, device=device)
    cache = mem[:, :page]
    slots = torch.arange(blocks * page, device=device)
    one = torch.ones(1, device=device)
    kv_c, k_pe = kv_c.to(torch.bfloat16), k_pe.to(torch.bfloat16)
    concat_and_cache_mla(kv_c.to(device), k_pe.to(device), cache, slots, "fp8_ds_mla", one)
    deq = mla_cache.dequantize_fp8_ds_mla(cache.cpu().reshape(-1, 656))
    bf16 = deq.reshape(blocks, page, 1, 576).to(torch.bfloat16)
    assert torch.equal(bf16.float(), deq.reshape(blocks, page, 1, 576))  # exact in bf16
    return cache, table.to(device), bf16.to(device)


@pytest.mark.parametrize(
    "seqlens,page,h_q,s_q,causal,extra",
    [
        ([70, 0, 1, 130], 16, 3, 2, True, 0),
        ([300, 17, 64], 64, 16, 1, False, 1),
        ([5, 129, 40], 32, 8, 4, True, 3),
    ],
)
def test_fp8_ds_mla_decode_matches_the_bf16_decode_of_the_dequantized_cache(
    seqlens, page, h_q, s_q, causal, extra, device
):
    cache, table, bf16 = _cache(seqlens, page, device, seed=page, extra_rows=extra)
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(len(seqlens), s_q, h_q, 576, generator=gen).to(torch.bfloat16).to(device)
    sl = torch.tensor(seqlens, dtype=torch.int32, device=device)
    meta, splits = get_mla_metadata(sl, s_q * h_q, 1)
    out, lse = flash_mla_with_kvcache(q, cache, table, sl, 512, meta, splits, causal=causal)
    want, want_lse = flash_mla_with_kvcache(q, bf16, table, sl, 512, meta, splits, causal=causal)
    _assert_matches(out, lse, want, want_lse)
    ref, ref_lse = mla_decode(
        q.cpu(), bf16.cpu().double(), table.cpu(), sl.cpu(), 512, None, causal
    )
    assert (out.cpu().double() - ref).norm() / ref.norm() < 1e-2


def test_uint8_caches_that_are_not_fp8_ds_mla_rows_are_refused(device):
    cache, table, _ = _cache([20], 16, device)
    q = torch.randn(1, 1, 4, 576, dtype=torch.bfloat16, device=device)
    sl = torch.tensor([20], dtype=torch.int32, device=device)
    meta, splits = get_mla_metadata(sl, 4, 1)
    with pytest.raises(TypeError, match="is no cache format"):
        flash_mla_with_kvcache(q, cache[..., :600], table, sl, 512, meta, splits)
    with pytest.raises(ValueError, match="fp8_ds_mla rows are uint8"):
        flash_mla_with_kvcache(q.half(), cache, table, sl, 512, meta, splits)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("cache_dtype", [torch.uint8, torch.float8_e4m3fn])
def test_per_tensor_fp8_decode(dtype, cache_dtype, device):
    """A per-tensor fp8 cache (e4m3fn codes, one k_scale) against kvgen's decode over the
    dequantized cache rounded to the queries' dtype once, and the float64 reference."""
    gen = torch.Generator().manual_seed(3)
    seqlens, page = [90, 0, 1, 33], 16
    blocks, table = _table(seqlens, page, gen)
    kv_c = torch.randn(blocks * page, 512, generator=gen).to(dtype)
    k_pe = torch.randn(blocks * page, 64, generator=gen).to(dtype)
    k_scale = torch.tensor([0.01], device=device)
    cache = torch.zeros(blocks, page, 1, 576, dtype=cache_dtype, device=device)
    slots = torch.arange(blocks * page, device=device)
    concat_and_cache_mla(kv_c.to(device), k_pe.to(device), cache, slots, "fp8", k_scale)
    rows = cache.view(torch.uint8).cpu().reshape(-1, 576)
    deq = mla_cache.dequantize_fp8_per_tensor(rows, k_scale.cpu()).to(dtype)
    deq = deq.reshape(blocks, page, 1, 576).to(device)
    q = torch.randn(4, 2, 8, 576, generator=gen).to(dtype).to(device)
    sl = torch.tensor(seqlens, dtype=torch.int32, device=device)
    table = table.to(device)
    meta, splits = get_mla_metadata(sl, 16, 1)
    out, lse = flash_mla_with_kvcache(
        q, cache, table, sl, 512, meta, splits, causal=True, k_scale=k_scale
    )
    want, want_lse = flash_mla_with_kvcache(q, deq, table, sl, 512, meta, splits, causal=True)
    _assert_matches(out, lse, want, want_lse)


def test_kv_format_arguments(device):
    cache, table, bf16 = _cache([20], 16, device)
    q = torch.randn(1, 1, 4, 576, dtype=torch.bfloat16, device=device)
    sl = torch.tensor([20], dtype=torch.int32, device=device)
    meta, splits = get_mla_metadata(sl, 4, 1)
    args = (q, cache, table, sl, 512, meta, splits)
    # FlashMLA's spelling for the 656-byte record, and the explicit name: the same result
    a, _ = flash_mla_with_kvcache(*args, is_fp8_kvcache=True)
    b, _ = flash_mla_with_kvcache(*args, kv_format="fp8_ds_mla")
    c, _ = flash_mla_with_kvcache(*args)
    assert torch.equal(a, b) and torch.equal(a, c)
    with pytest.raises(ValueError, match="is_fp8_kvcache=True is kv_format 'fp8_ds_mla'"):
        flash_mla_with_kvcache(*args, is_fp8_kvcache=True, kv_format="fp8")
    with pytest.raises(ValueError, match=r"MXFP4 rows \(group 32\) are uint8 \[..., 400\]"):
        flash_mla_with_kvcache(*args, kv_format="mxfp4")
    with pytest.raises(ValueError, match="kv_format must be one of"):
        flash_mla_with_kvcache(*args, kv_format="int4")
    with pytest.raises(ValueError, match=r"mxfp4_group must be one of \(16, 32, 64\)"):
        flash_mla_with_kvcache(*args, mxfp4_group=48)
    with pytest.raises(TypeError, match="kv_format 'auto'"):
        flash_mla_with_kvcache(*args, kv_format="auto")
    fp8 = torch.zeros(2, 16, 1, 576, dtype=torch.float8_e4m3fn, device=device)
    with pytest.raises(ValueError, match="k_scale .* is needed for fp8"):
        flash_mla_with_kvcache(q, fp8, table, sl, 512, meta, splits)
    with pytest.raises(ValueError, match="k_scale must hold one value"):
        flash_mla_with_kvcache(q, fp8, table, sl, 512, meta, splits, k_scale=torch.ones(2))
    with pytest.raises(ValueError, match="fp8_ds_mla rows are uint8"):
        flash_mla_with_kvcache(q, bf16, table, sl, 512, meta, splits, kv_format="fp8_ds_mla")


@pytest.mark.parametrize(
    "d,dtype,group",
    [
        (576, torch.bfloat16, 32),
        (576, torch.float16, 32),
        (512, torch.bfloat16, 32),
        (512, torch.float16, 32),
        (576, torch.bfloat16, 16),
        (512, torch.bfloat16, 64),
    ],
)
def test_mxfp4_decode(d, dtype, group, device):
    """MXFP4 rows (576 / 512 with the RoPE part as bf16, 400 bytes at group 32, or the seed's
    rope-free rows for 512 / 512, 272 bytes at group 32; groups 16 and 64 by mxfp4_group=)
    against kvgen's decode over the dequantized cache (exact in bf16) and the float64
    reference; blocks further apart than a page."""

    gen = torch.Generator().manual_seed(d + group)
    seqlens, page = [70, 0, 1, 130], 32
    blocks, table = _table(seqlens, page, gen)
    kv_c = torch.randn(blocks * page, 512, generator=gen)
    kv_c[:, 9] *= 25.0
    rows, deq = _mxfp4_rows(kv_c, d, group, gen)
    assert rows.shape[1] == 256 + 512 // group + (128 if d == 576 else 0)
    mem = torch.zeros(blocks, page + 2, 1, rows.shape[1], dtype=torch.uint8)
    mem[:, :page] = rows.reshape(blocks, page, 1, -1)
    cache = mem.to(device)[:, :page]
    ref_cache = deq.reshape(blocks, page, 1, d).to(dtype).to(device)
    assert torch.equal(ref_cache.float().cpu(), deq.reshape(blocks, page, 1, d))  # exact
    q = torch.randn(4, 2, 6, d, generator=gen).to(dtype).to(device)
    sl = torch.tensor(seqlens, dtype=torch.int32, device=device)
    table = table.to(device)
    meta, splits = get_mla_metadata(sl, 12, 1)
    out, lse = flash_mla_with_kvcache(
        q, cache, table, sl, 512, meta, splits, causal=True, mxfp4_group=group
    )
    want, want_lse = flash_mla_with_kvcache(q, ref_cache, table, sl, 512, meta, splits, causal=True)
    if group != 32:  # the default group names another row width: refused, not misread
        with pytest.raises(ValueError, match=r"MXFP4 rows \(group 32\) .* mxfp4_group="):
            flash_mla_with_kvcache(q, cache, table, sl, 512, meta, splits, kv_format="mxfp4")
    _assert_matches(out, lse, want, want_lse)
    ref, _ = mla_decode(q.cpu(), ref_cache.cpu().double(), table.cpu(), sl.cpu(), 512, None, True)
    assert (out.cpu().double() - ref).norm() / ref.norm() < 1e-2


def test_the_bench_caches_are_the_formats_and_the_op_reads_them(device):
    """kvgen bench's quantized caches of one bf16 cache (written by kvgen's stores) hold each
    format's bytes, and the op over each matches the reference over its dequantized cache."""
    from kvgen.bench import decode

    gen = torch.Generator().manual_seed(4)
    k = torch.randn(3, 16, 1, 576, generator=gen).to(torch.bfloat16).to(device)
    k_scale = torch.tensor([decode.K_SCALE], device=device)
    caches = decode.quantized_caches(k, k_scale)
    flat = k.reshape(-1, 576).cpu()
    want_mx = mla_cache.quantize_mxfp4_rope(flat[:, :512], flat[:, 512:])
    assert torch.equal(caches["mxfp4"].reshape(-1, 400).cpu(), want_mx)
    want_ds = mla_cache.quantize_fp8_ds_mla(flat[:, :512], flat[:, 512:])
    assert torch.equal(caches["fp8_ds_mla"].reshape(-1, 656).cpu(), want_ds)
    table = torch.tensor([[2, 0, 1], [1, 2, 0]], dtype=torch.int32, device=device)
    sl = torch.tensor([40, 7], dtype=torch.int32, device=device)
    q = torch.randn(2, 1, 4, 576, generator=gen).to(torch.bfloat16).to(device)
    meta, splits = get_mla_metadata(sl, 4, 1)
    for fmt, cache in caches.items():
        assert cache.shape[-1] == decode.ROW_BYTES[fmt]
        deq = decode.dequantized(fmt, cache, k_scale)
        out, _ = decode._quantized_caller(cache, fmt, k_scale)(q, table, sl, meta, splits)
        ref, _ = mla_decode(q.cpu(), deq.cpu(), table.cpu(), sl.cpu(), 512)
        assert (out.cpu().double() - ref).norm() / ref.norm() < 1e-2, fmt


def _variants():
    from kvgen import registry
    from kvgen.runtime import local_target

    arch, target = local_target()
    return [
        s
        for fam in ("mla_decode_fp8_ds_mla", "mla_decode_fp8", "mla_decode_mxfp4")
        for s in registry.variants(arch, target, fam)
        # (the rows variant takes one query of at most 16 heads in pages of 64: its own tests)
        if s.dtype == "bf16" and s.head_dim == 576 and s.variant != "rows"
    ]


@pytest.mark.parametrize("spec", _variants(), ids=lambda s: s.name)
@pytest.mark.parametrize(
    "page,h_q,h_kv,s_q,extra",
    [(64, 16, 1, 2, 0), (64, 16, 1, 1, 3), (16, 128, 1, 1, 3), (32, 8, 2, 2, 3)],
)
def test_every_quantized_variant_matches_the_bf16_decode(spec, page, h_q, h_kv, s_q, extra, device):
    """Each variant of the fp8 families (portable; on sm90 also wgmma, whose loader partition
    dequantizes), launched with its default meta-parameters: pages that hold whole tiles, back
    to back (the wgmma loader stages them by TMA) or ``extra`` rows further apart (cp.async),
    and pages smaller than a tile, several KV heads, causal rows, lengths 0 and 1; the rows
    past each sequence's end hold 0xFF bytes (NaN codes and scales), which must not reach the
    output; against kvgen's decode over the dequantized cache."""
    _quantized_case(spec, page, h_q, h_kv, s_q, extra, [150, 0, 1, 70], device)


@pytest.mark.parametrize("spec", hopper(_variants()), ids=lambda s: getattr(s, "name", s))
@pytest.mark.parametrize("page,extra", [(64, 0), (64, 3), (16, 3)])
def test_hopper_barrier_phases_with_the_fewest_buffers(spec, page, extra, device):
    """The warp-specialised kernel with every ring at its minimum (one K buffer, one P buffer,
    two staging buffers: fewest_buffers): each buffer is reused every tile or two, so a wait on
    a wrong barrier phase reads a tile before it is written or after it is overwritten, and the
    result is wrong. Many lengths (tile and page edges), TMA and cp.async loaders."""
    _quantized_case(spec, page, 16, 1, 2, extra, MANY_LENGTHS, device, num_stages=1,
                    fewest_buffers=True)  # fmt: skip


def _quantized_case(spec, page, h_q, h_kv, s_q, extra, seqlens, device, **meta_kw):
    from kvgen.bench.decode import K_SCALE, dequantized
    from kvgen.codegen import load

    gen = torch.Generator().manual_seed(page + h_q)
    blocks, table = _table(seqlens, page, gen)
    fmt = {"mla_decode_fp8": "fp8", "mla_decode_mxfp4": "mxfp4"}.get(spec.family, "fp8_ds_mla")
    row = {"fp8": 576, "fp8_ds_mla": 656, "mxfp4": 400}[fmt]
    k_scale = torch.tensor([K_SCALE], device=device)
    mem = torch.zeros(blocks, page + extra, h_kv, row, dtype=torch.uint8, device=device)
    cache = mem[:, :page]
    for head in range(h_kv):  # (the store writes one head's [num_blocks, page, row] cache)
        kv = torch.randn(blocks * page, 576, generator=gen).to(torch.bfloat16).to(device)
        one = torch.empty(blocks, page, row, dtype=torch.uint8, device=device)
        slots = torch.arange(blocks * page, device=device)
        _store(fmt, kv, slots, one, k_scale)
        mem[:, :page, head] = one
    for b, n in enumerate(seqlens):  # the rows past the sequence's end in its last page
        last = -(-n // page) * page
        for t in range(n, last):
            cache[int(table[b, t // page]), t % page] = 0xFF
    deq = dequantized(fmt, cache, k_scale)
    q = torch.randn(len(seqlens), s_q, h_q, 576, generator=gen).to(torch.bfloat16).to(device)
    sl = torch.tensor(seqlens, dtype=torch.int32, device=device)
    table = table.to(device)
    rows = s_q * h_q // h_kv
    meta, splits = get_mla_metadata(sl, rows, h_kv)
    mp = spec.default_meta(rows=rows) | ({"k_scale": k_scale} if fmt == "fp8" else {}) | meta_kw
    out, lse = load(spec).launch(q, cache, table, sl, meta, splits, 576**-0.5, True, **mp)
    want, want_lse = flash_mla_with_kvcache(q, deq, table, sl, 512, meta, splits, causal=True)
    _assert_matches(out, lse, want, want_lse)


def _bad_table_case(spec, bad, device, page=16, s_q=1, gap=0):
    """Three sequences over a cache of ``spec``'s format (pages ``gap`` rows further apart than
    their ``page`` rows), sequence 1's table spoiled as ``bad`` (spoil_table); with ``s_q``
    > 1 causal queries. Sequence 1's out and lse must be NaN, the others those of the decode
    over the dequantized cache."""
    from kvgen.bench.decode import K_SCALE, dequantized
    from kvgen.codegen import load

    gen = torch.Generator().manual_seed(3)
    seqlens = [70, 100, 33]
    blocks, table = _table(seqlens, page, gen)
    fmt = {"mla_decode_fp8": "fp8", "mla_decode_mxfp4": "mxfp4"}.get(spec.family, "fp8_ds_mla")
    row = {"fp8": 576, "fp8_ds_mla": 656, "mxfp4": 400}[fmt]
    k_scale = torch.tensor([K_SCALE], device=device)
    whole = torch.empty(blocks, page + gap, 1, row, dtype=torch.uint8, device=device)
    kv = torch.randn(blocks * page, 576, generator=gen).to(torch.bfloat16).to(device)
    slot = torch.arange(blocks * page, device=device)
    slot = slot // page * (page + gap) + slot % page  # (the first ``page`` rows of each block)
    _store(fmt, kv, slot, whole.view(blocks, page + gap, row), k_scale)
    cache = whole[:, :page]
    q = torch.randn(3, s_q, 16, 576, generator=gen).to(torch.bfloat16).to(device)
    sl = torch.tensor(seqlens, dtype=torch.int32, device=device)
    table = table.to(device)
    good_table, good_sl = table, sl.clone()
    if bad == "longer_than_table":
        good_sl[1] = 0
    table, sl = spoil_table(table, sl, bad, blocks, page)
    causal = s_q > 1
    meta, splits = get_mla_metadata(sl, 16 * s_q, 1)
    mp = spec.default_meta(rows=16 * s_q) | ({"k_scale": k_scale} if fmt == "fp8" else {})
    out, lse = load(spec).launch(q, cache, table, sl, meta, splits, 576**-0.5, causal, **mp)
    assert torch.isnan(out[1].float()).all() and torch.isnan(lse[1]).all()
    deq = dequantized(fmt, cache, k_scale)
    meta, splits = get_mla_metadata(good_sl, 16 * s_q, 1)
    want, want_lse = flash_mla_with_kvcache(
        q, deq, good_table, good_sl, 512, meta, splits, causal=causal
    )
    _assert_matches(out[[0, 2]], lse[[0, 2]], want[[0, 2]], want_lse[[0, 2]])


@pytest.mark.parametrize("bad", BAD_TABLES)
@pytest.mark.parametrize("spec", _variants(), ids=lambda s: s.name)
def test_a_bad_block_table_gives_nan_for_that_sequence_only(spec, bad, device):
    """A page outside the cache, or a length past what the table holds, is never read: that
    sequence's out and lse are NaN, the others those of the decode over the dequantized cache
    (pages of 16 keys: tiles over several pages)."""
    _bad_table_case(spec, bad, device)


@pytest.mark.parametrize("gap", (0, 8), ids=("pages_back_to_back", "pages_apart"))
@pytest.mark.parametrize("s_q", (1, 2), ids=("one_query", "two_causal"))
@pytest.mark.parametrize("bad", BAD_TABLES)
@pytest.mark.parametrize("spec", hopper(_variants()), ids=lambda s: getattr(s, "name", s))
def test_wgmma_bad_block_table_with_tiles_in_one_page(spec, bad, s_q, gap, device):
    """As above with pages of 64 keys, where each tile lies in one page: read by TMA (pages
    back to back) or by cp.async (pages apart). With one query a sequence the loader turns a
    tile whose page is missing into NaN keys (TMA, which writes zeros for rows outside the
    cache, reads the page as the table names it); with causal queries the S warpgroup checks
    the sequence's table."""
    _bad_table_case(spec, bad, device, page=64, s_q=s_q, gap=gap)


@pytest.mark.parametrize("s_q", (1, 2), ids=("one_query", "two_causal"))
@pytest.mark.parametrize("bad", BAD_TABLES)
@pytest.mark.parametrize(
    "spec", [s for s in _variants() if s.variant == "portable"], ids=lambda s: s.name
)
def test_portable_bad_block_table_with_tiles_in_one_page(spec, bad, s_q, device):
    """As above with pages of 64 keys, where each of the portable variant's tiles lies in one
    page (one page lookup a tile, page 0 read in a missing page's place): the combine kernel's
    table check makes the sequence NaN, for one query and for causal rows."""
    _bad_table_case(spec, bad, device, page=64, s_q=s_q)


@pytest.mark.parametrize("spec", _variants(), ids=lambda s: s.name)
def test_one_key_reads_back_its_row(spec, device):
    """A sequence of one key attends to that key alone (P = 1): its out is the key's V, the
    dequantized latent, which each format's values make exact in the queries' dtype; so out
    equals the reference dequantization exactly (but for the sign of a zero), for every row
    (on a GPU 96 rows, scaled over 24 binades: nearly every code of each format) and every
    variant."""
    from kvgen.bench.decode import K_SCALE, dequantized
    from kvgen.codegen import load

    gen = torch.Generator().manual_seed(7)
    fmt = {"mla_decode_fp8": "fp8", "mla_decode_mxfp4": "mxfp4"}.get(spec.family, "fp8_ds_mla")
    row = {"fp8": 576, "fp8_ds_mla": 656, "mxfp4": 400}[fmt]
    batch, page = (96, 32) if device.type == "cuda" else (12, 16)  # (the interpreter: fewer)
    kv = (torch.randn(batch * page, 576, generator=gen) * 4).to(torch.bfloat16).to(device)
    kv[:, :512] *= torch.exp2(torch.randint(-12, 12, (1, 512), generator=gen)).to(device)
    cache = torch.empty(batch, page, 1, row, dtype=torch.uint8, device=device)
    slots = torch.arange(batch * page, device=device)
    k_scale = torch.tensor([K_SCALE], device=device)
    _store(fmt, kv, slots, cache.view(batch, page, row), k_scale)
    # sequence b: the single key at row b % page of page b (a different row each)
    table = torch.arange(batch, dtype=torch.int32, device=device)[:, None]
    sl = torch.ones(batch, dtype=torch.int32, device=device)
    # keys placed so that sequence b's one key is row b % page: shift the pages' rows
    rolled = torch.stack([cache[b].roll(-(b % page), dims=0) for b in range(batch)])
    q = torch.randn(batch, 1, 16, 576, generator=gen).to(torch.bfloat16).to(device)
    meta, splits = get_mla_metadata(sl, 16, 1)
    mp = spec.default_meta(rows=16) | ({"k_scale": k_scale} if fmt == "fp8" else {})
    out, lse = load(spec).launch(q, rolled, table, sl, meta, splits, 576**-0.5, False, **mp)
    want = dequantized(fmt, rolled[:, :1], k_scale)[:, 0, 0, :512]  # [batch, 512] bf16
    got = out[:, 0]  # [batch, 16, 512]: every head reads the same V
    # equal values (a -0 in V sums to +0), NaN where the reference is NaN
    bad = got.float() != want[:, None, :].float()
    bad &= ~(torch.isnan(got) & torch.isnan(want[:, None, :]))
    where = bad.nonzero()[:8].tolist()
    assert not bad.any(), (
        f"{int(bad.sum())} of {bad.numel()} outputs differ, e.g. [b, head, channel] {where}: "
        f"got {[float(got[b, h, c]) for b, h, c in where]}, "
        f"want {[float(want[b, c]) for b, _, c in where]}"
    )


# --- the Hopper rows variant (fp8_ds_mla: the keys as the MMAs' rows, the heads as their N;
# an sm90 GPU only), tested whether or not kvgen offers it yet


def _rows_specs():
    """The rows kernels: fp8_ds_mla, and MXFP4 (group 32) with and without the RoPE part."""
    from kvgen.families.mla_decode import MLADecodeDSMLASpec, MLADecodeMXFP4Spec, available
    from kvgen.runtime import local_target

    arch, target = local_target()
    if not available("rows", arch, target):
        return hopper([], "rows")
    return hopper(
        [
            MLADecodeDSMLASpec(576, 512, "bf16", "rows", arch, target),
            MLADecodeMXFP4Spec(576, 512, "bf16", "rows", arch, target),
            MLADecodeMXFP4Spec(512, 512, "bf16", "rows", arch, target),
        ],
        "rows",
    )


def _mxfp4_rows_cache(seqlens, d, device, seed):
    """``_cache`` for MXFP4 rows of group 32 (576: with the RoPE part; 512: the seed's rows), in
    pages of 64 back to back: the latent's groups scaled by powers of two from 2^-30 to 1, a
    different one for each (key, group), so that a key's groups lie up to 2^30 apart (the
    kernel scales each key's groups to its largest one in fp16, where those more than 2^23
    below it round to subnormals or 0)."""

    gen = torch.Generator().manual_seed(seed)
    blocks, table = _table(seqlens, 64, gen)
    kv_c = torch.randn(blocks * 64, 512, generator=gen)
    kv_c[:, 5] *= 30.0  # an outlier channel
    spread = torch.randint(-30, 1, (blocks * 64, 16), generator=gen).float().exp2()
    kv_c = (kv_c.view(-1, 16, 32) * spread[:, :, None]).view(-1, 512).to(torch.bfloat16)
    rows, deq = _mxfp4_rows(kv_c, d, 32, gen)
    cache = rows.reshape(blocks, 64, 1, -1).to(device)
    bf16 = deq.reshape(blocks, 64, 1, d).to(torch.bfloat16)
    assert torch.equal(bf16.float(), deq.reshape(blocks, 64, 1, d))  # exact in bf16
    return cache, table.to(device), bf16.to(device)


def _rows_case(seqlens, h_q, device, seed=0, spec=None):
    """(q, cache, table, seqlens, dequantized bf16 cache) for the rows kernel ``spec`` (default:
    fp8_ds_mla): pages of 64 back to back, in random order, the rows past each sequence's end
    then set to 0xFF bytes (NaN scales)."""
    d = 576 if spec is None else spec.head_dim
    if spec is None or spec.derived()["kv_format"] == "fp8_ds_mla":
        cache, table, deq = _cache(seqlens, 64, device, seed)
    else:
        cache, table, deq = _mxfp4_rows_cache(seqlens, d, device, seed)
    for b, n in enumerate(seqlens):
        for t in range(n, -(-n // 64) * 64):
            cache[int(table[b, t // 64]), t % 64] = 0xFF
    gen = torch.Generator().manual_seed(seed + 1)
    q = torch.randn(len(seqlens), 1, h_q, d, generator=gen) * 2.0
    sl = torch.tensor(seqlens, dtype=torch.int32, device=device)
    return q.to(torch.bfloat16).to(device), cache, table, sl, deq


def _rows_launch(spec, q, cache, table, sl, **meta_kw):
    from kvgen.codegen import load

    meta, splits = get_mla_metadata(sl, q.shape[2], 1)
    mp = spec.default_meta(rows=q.shape[2]) | meta_kw
    return load(spec).launch(q, cache, table, sl, meta, splits, q.shape[3] ** -0.5, False, **mp)


@pytest.mark.parametrize("batch", [1, 2, 7, 16, 100, 128, 129, 700])
def test_rows_order_kernel_ranks_sequences_longest_first(batch, device):
    """The rows launcher's ``order_of`` (``order_kernel``, plain Triton: runs in the
    interpreter): order[r] is the sequence of rank r by length, longest first, equal lengths by
    index (ties, zeros, batches that are not powers of two, one program's ORDER_BLOCK and
    several programs)."""
    from kvgen.codegen import load
    from kvgen.families.mla_decode import MLADecodeDSMLASpec

    mod = load(MLADecodeDSMLASpec(576, 512, "bf16", "rows", "sm90", "gpu"))
    gen = torch.Generator().manual_seed(batch)
    lengths = torch.randint(0, 40, (batch,), generator=gen, dtype=torch.int32) * 97
    lengths[: batch // 3] = lengths[0]  # ties
    order = mod.order_of(lengths.to(device))
    want = sorted(range(batch), key=lambda b: (-int(lengths[b]), b))
    assert order.tolist() == want


WIDE = {"pages_per_tile": 2}  # fp8_ds_mla's wide kernel (two pages a tile, any N up to 32)


def _rows_kernels(heads=(16,), stages=(2,), wide_only=False):
    """(spec, launch kwargs, heads, num_stages) cases of every rows kernel: each spec's 4-warp
    kernel (tiles of one page, at most 16 heads, two or three stages; not with ``wide_only``)
    and fp8_ds_mla's wide kernel (``WIDE``: tiles of two pages, up to 32 heads, two stages)."""
    specs = [s for s in _rows_specs() if getattr(s, "name", None)]
    if not specs:  # (no sm90 GPU)
        skip = pytest.mark.skip(reason="rows: an sm90 GPU only")
        return [pytest.param(None, {}, 0, 0, marks=skip, id="rows")]
    cases = []
    for spec, h, n in itertools.product(specs, heads, stages):
        if h <= 16 and not wide_only:
            cases.append(pytest.param(spec, {}, h, n, id=f"{spec.name}-h{h}-s{n}"))
        if "ds_mla" in spec.name and n == 2:
            cases.append(pytest.param(spec, WIDE, h, n, id=f"{spec.name}-wide-h{h}"))
    return cases


@pytest.mark.parametrize(("spec", "kw", "h_q", "num_stages"),
                         _rows_kernels((1, 8, 13, 16, 17, 24, 32), (2, 3)))  # fmt: skip
def test_rows_variant_over_page_edges_heads_and_splits(spec, kw, h_q, num_stages, device):
    """Each rows kernel through its launcher: lengths around every page edge (0, 1 and long
    ones; an odd number of pages leaves the wide kernel's last tile a second page past the
    sequence: page 0 stands in, unused), N of 8, 16 and (the wide kernel) 32 (heads padded
    with zero queries, 13 not a power of two), the fewest and the most pages in flight (a wrong
    phase of the ring reads a page before or after it is there), whole sequences and many
    pieces of one; the rows past each sequence's end are NaN bytes, which must not reach the
    output; against the float64 reference over the dequantized cache (the decode's contract:
    out within 1e-2, lse within 1e-3, out 0 and lse +inf for a sequence of no keys)."""
    from kvgen.verify import compare_attention

    q, cache, table, sl, deq = _rows_case(MANY_LENGTHS, h_q, device, seed=h_q, spec=spec)
    ref, ref_lse = mla_decode(q.cpu(), deq.cpu(), table.cpu(), sl.cpu(), 512)
    for split_factor, piece_tiles in ((1, 0), (16, 1), (4, 16)):
        mp = {"num_stages": num_stages, "split_factor": split_factor, "piece_tiles": piece_tiles}
        out, lse = _rows_launch(spec, q, cache, table, sl, **mp, **kw)
        ok, rel, detail = compare_attention(out, lse, ref, ref_lse)
        assert ok, (split_factor, piece_tiles, rel, detail)
        assert (out.cpu()[ref_lse.permute(0, 2, 1).isinf()] == 0).all()  # no key: out 0


@pytest.mark.parametrize("bad", BAD_TABLES)
@pytest.mark.parametrize(("spec", "kw", "h_q", "num_stages"), _rows_kernels((16, 32)))
def test_rows_variant_bad_block_table_gives_nan_for_that_sequence_only(
    spec, kw, h_q, num_stages, bad, device
):
    """A page outside the cache, or a length past what the table holds, is never read (TMA
    boxes of page 0 stand in): that sequence's out and lse are NaN, the others exact as before."""
    q, cache, table, sl, _ = _rows_case([200, 130, 70], h_q, device, seed=3, spec=spec)
    kw = {"split_factor": 4, "piece_tiles": 1, "num_stages": num_stages, **kw}
    good, good_lse = _rows_launch(spec, q, cache, table, sl, **kw)
    table, sl = spoil_table(table, sl, bad, cache.shape[0], 64)
    out, lse = _rows_launch(spec, q, cache, table, sl, **kw)
    assert torch.isnan(out[1].float()).all() and torch.isnan(lse[1]).all()
    assert torch.equal(out[[0, 2]], good[[0, 2]]) and torch.equal(lse[[0, 2]], good_lse[[0, 2]])


@pytest.mark.parametrize("spec", _rows_specs(), ids=lambda s: getattr(s, "name", "rows"))
def test_rows_variant_query_heads_that_are_not_finite_give_nan(spec, device):
    from kvgen.verify import compare_attention

    q, cache, table, sl, deq = _rows_case([70, 5], 16, device, seed=5, spec=spec)
    q = q.clone()
    q[0, 0, 1, 7] = float("nan")
    q[1, 0, 6, q.shape[3] - 1] = -float("inf")  # (in the RoPE part where there is one)
    out, lse = _rows_launch(spec, q, cache, table, sl)
    assert torch.isnan(lse[0, 1]).all() and torch.isnan(out[0, 0, 1].float()).all()
    assert torch.isnan(lse[1, 6]).all() and torch.isnan(out[1, 0, 6].float()).all()
    ref, ref_lse = mla_decode(q[:1, :, 2:].cpu(), deq.cpu(), table[:1].cpu(), sl[:1].cpu(), 512)
    ok, rel, detail = compare_attention(out[:1, :, 2:], lse[:1, 2:], ref, ref_lse)
    assert ok, (rel, detail)


@pytest.mark.parametrize("spec", _rows_specs(), ids=lambda s: getattr(s, "name", "rows"))
def test_rows_variant_a_key_with_a_nan_scale_gives_nan_for_its_sequence_only(spec, device):
    """A key whose scale (of one group or tile) is NaN makes its sequence's out and lse NaN for
    every head (the decodes' non-finite semantics, docs/formats.md); the other sequences are
    exact as before."""
    q, cache, table, sl, _ = _rows_case([200, 130, 70], 16, device, seed=7, spec=spec)
    good, good_lse = _rows_launch(spec, q, cache, table, sl, split_factor=4, piece_tiles=1)
    cache = cache.clone()
    page, row = int(table[1, 1]), 3  # key 67 of sequence 1
    if cache.shape[-1] == 656:  # fp8_ds_mla: scale tile 2, an fp32 NaN
        cache[page, row, 0, 512 + 8 : 512 + 12] = torch.tensor(
            [0, 0, 0xC0, 0x7F], dtype=torch.uint8
        )
    else:  # MXFP4: group 9, E8M0's NaN
        cache[page, row, 0, 256 + 9] = 0xFF
    out, lse = _rows_launch(spec, q, cache, table, sl, split_factor=4, piece_tiles=1)
    assert torch.isnan(out[1].float()).all() and torch.isnan(lse[1]).all()
    assert torch.equal(out[[0, 2]], good[[0, 2]]) and torch.equal(lse[[0, 2]], good_lse[[0, 2]])


@pytest.mark.parametrize("spec", _rows_specs(), ids=lambda s: getattr(s, "name", "rows"))
def test_rows_launcher_refuses_what_its_kernel_cannot_read(spec, device):
    """Several queries a sequence, more heads than the module's kernels take (32 for
    fp8_ds_mla, whose wide kernel takes 17-32; 16 for MXFP4), fp16 queries, pages of another
    size or not back to back: ValueError from the launcher, before any kernel runs."""
    from kvgen.codegen import load

    q, cache, table, sl, _ = _rows_case([70, 0, 33], 16, device, spec=spec)
    mod = load(spec)
    blocks, _, _, width = cache.shape
    d = q.shape[3]
    fmt = "fp8_ds_mla" if width == 656 else "MXFP4"
    most = mod.MAX_HEADS
    assert most == (32 if fmt == "fp8_ds_mla" else 16)
    spaced = torch.zeros(blocks, 65, 1, width, dtype=torch.uint8, device=device)[:, :64]
    cases = [
        (q.expand(3, 2, 16, d).contiguous(), cache, "one query"),
        (q[:, :, :1].expand(3, 1, most + 1, d).contiguous(), cache, f"at most {most}"),
        (q.half(), cache, "must be torch.bfloat16"),
        (q, cache.view(blocks * 4, 16, 1, width), "page_block_size 16"),
        (q, spaced, "back to back"),
        (q, cache[..., : width - 16], fmt),
    ]
    for qq, kk, text in cases:
        assert mod.accepts(qq, kk) is not None
        with pytest.raises(ValueError, match=text):
            mod.launch(qq, kk, table, sl, None, None, d**-0.5, False)
    assert mod.accepts(q, cache) is None


@pytest.mark.parametrize(("spec", "kw", "h_q", "num_stages"), _rows_kernels((32,), wide_only=True))
def test_rows_wide_kernel_non_finite_queries_and_scales_give_nan(spec, kw, h_q, num_stages, device):
    """A query head that is not finite gives NaN for that head; a key with a NaN tile scale
    gives NaN for its whole sequence; the rest as the reference."""
    from kvgen.verify import compare_attention

    q, cache, table, sl, deq = _rows_case([70, 5, 140], 32, device, seed=5, spec=spec)
    q = q.clone()
    q[0, 0, 1, 7] = float("nan")
    q[1, 0, 27, q.shape[3] - 1] = -float("inf")  # (in the RoPE part)
    cache = cache.clone()
    page, row = int(table[2, 1]), 3  # key 67 of sequence 2: scale tile 2, an fp32 NaN
    cache[page, row, 0, 512 + 8 : 512 + 12] = torch.tensor([0, 0, 0xC0, 0x7F], dtype=torch.uint8)
    out, lse = _rows_launch(spec, q, cache, table, sl, **kw)
    assert torch.isnan(lse[0, 1]).all() and torch.isnan(out[0, 0, 1].float()).all()
    assert torch.isnan(lse[1, 27]).all() and torch.isnan(out[1, 0, 27].float()).all()
    assert torch.isnan(out[2].float()).all() and torch.isnan(lse[2]).all()
    ref, ref_lse = mla_decode(q[:1, :, 2:].cpu(), deq.cpu(), table[:1].cpu(), sl[:1].cpu(), 512)
    ok, rel, detail = compare_attention(out[:1, :, 2:], lse[:1, 2:], ref, ref_lse)
    assert ok, (rel, detail)


def test_rows_wide_kernel_takes_17_to_32_heads():
    """fp8_ds_mla's rows module carries the wide kernel (8 warps, tiles of two pages; the one
    kernel for 17-32 heads, reached also with ``pages_per_tile`` 2 at 16 heads or fewer); its
    ``accepts`` takes up to 32 heads, no kernel more. MXFP4's rows module has no wide kernel
    and takes at most 16. (Loads the modules only: the CPU's interpreter does not run
    Gluon.)"""
    from kvgen.codegen import load
    from kvgen.families.mla_decode import MLADecodeDSMLASpec, MLADecodeMXFP4Spec

    mod = load(MLADecodeDSMLASpec(576, 512, "bf16", "rows", "sm90", "gpu"))
    cache = torch.zeros(4, 64, 1, 656, dtype=torch.uint8)
    assert (mod.MAX_HEADS, mod.UNOFFERED_MAX_HEADS) == (32, 32)
    assert [mod.mma_n(h) for h in (1, 8, 9, 16, 17, 32)] == [8, 8, 16, 16, 32, 32]
    kernel, tile, warps, descs = mod.kernel_for(32, cache)
    assert (kernel, tile, warps) == (mod.split_kernel_wide, 128, 8)
    assert [d.block_shape for d in descs] == [[64, 128], [64, 4], [64, 64]]
    assert mod.kernel_for(16, cache)[:3] == (mod.split_kernel, 64, 4)
    assert mod.kernel_for(16, cache, 2)[:3] == (mod.split_kernel_wide, 128, 8)
    with pytest.raises(ValueError, match="pages_per_tile 1 at N 32"):
        mod.kernel_for(32, cache, 1)
    with pytest.raises(ValueError, match="num_stages 3: tiles of two pages take 2"):
        mod.kernel_for(16, cache, 2, num_stages=3)
    mx = load(MLADecodeMXFP4Spec(576, 512, "bf16", "rows", "sm90", "gpu"))
    assert (mx.MAX_HEADS, mx.UNOFFERED_MAX_HEADS) == (16, 16)
    with pytest.raises(ValueError, match="tiles of one page"):
        mx.kernel_for(16, torch.zeros(4, 64, 1, mx.ROW_BYTES, dtype=torch.uint8), 2)

    def q(heads):
        return torch.zeros(2, 1, heads, 576, dtype=torch.bfloat16)

    assert mod.accepts(q(16), cache) is None and mod.accepts(q(32), cache) is None
    assert "at most 32" in mod.accepts(q(33), cache)
    assert "at most 32" in mod.accepts(q(33), cache, max_heads=64)
    assert "at most 16" in mod.accepts(q(17), cache, max_heads=16)
    assert "at most 16" in mx.accepts(q(17), torch.zeros(4, 64, 1, mx.ROW_BYTES, dtype=torch.uint8))


def test_rows_variant_is_chosen_only_where_it_applies_and_was_tuned(tmp_path, monkeypatch):
    """The op takes the rows variant for fp8_ds_mla caches on sm90, one query of at most 32
    heads a sequence in pages of 64 back to back, and only where tuning measured it faster
    than the others at the bucket; an untuned one's module is not even loaded. A bucket's
    entry that breaks a call constraint at the call's rows (three stages, where the wide
    kernel of 17-32 heads takes two) is not used there: the template's defaults are."""
    import json

    import kvgen.ops._mla_choice as choice
    from kvgen import configs
    from kvgen.families.mla_decode import MLADecodeDSMLASpec

    monkeypatch.setenv(configs.OVERRIDE_ENV, str(tmp_path))
    monkeypatch.setattr(configs, "tuned_configs_dir", lambda: tmp_path / "none")
    monkeypatch.setattr(choice, "variants_for", lambda fmt: ("portable", "wgmma", "rows"))
    configs.reset()
    loaded = []
    real_module = choice.module
    monkeypatch.setattr(choice, "module", lambda spec: loaded.append(spec) or real_module(spec))
    cache = torch.empty(8, 64, 1, 656, dtype=torch.uint8)

    def pick(h_q=16, s_q=1, k=cache, dtype=torch.bfloat16):
        q = torch.empty(2, s_q, h_q, 576, dtype=dtype)
        rows = s_q * h_q
        return choice.choose(MLADecodeDSMLASpec, 576, 512, "bf16", "sm90", "gpu", k, rows,
                             q=q).variant  # fmt: skip

    assert pick() == "portable" and loaded == []  # nothing tuned: nothing loaded
    rows = MLADecodeDSMLASpec(576, 512, "bf16", "rows", "sm90", "gpu")
    wgmma = MLADecodeDSMLASpec(576, 512, "bf16", "wgmma", "sm90", "gpu")
    entries = {
        rows.name: {
            "rows=16": {"meta": rows.default_meta(16), "time_us": 100.0, "default_time_us": 100.0}
        },  # fmt: skip
        wgmma.name: {
            "rows=16": {"meta": wgmma.default_meta(16), "time_us": 250.0, "default_time_us": 250.0}
        },  # fmt: skip
    }
    doc = tuned_doc("mla_decode_fp8_ds_mla", entries)
    (tmp_path / "sm90").mkdir()
    (tmp_path / "sm90" / "mla_decode_fp8_ds_mla.json").write_text(json.dumps(doc))
    configs.reset()
    assert pick() == "rows"
    assert pick(h_q=8) == "rows"  # the nearest bucket's times
    assert pick(s_q=2, h_q=8) == "wgmma"  # several queries a sequence
    assert pick(h_q=32) == "rows"  # the wide kernel, by the nearest bucket's times
    assert pick(h_q=33) == "wgmma"  # more heads than the MMAs' N
    assert pick(k=torch.empty(32, 16, 1, 656, dtype=torch.uint8)) == "wgmma"  # pages of 16
    spaced = torch.empty(8, 65, 1, 656, dtype=torch.uint8)[:, :64]
    assert pick(k=spaced) == "wgmma"  # pages not back to back
    three = {**rows.default_meta(16), "num_stages": 3}
    entries[rows.name]["rows=16"]["meta"] = three
    (tmp_path / "sm90" / "mla_decode_fp8_ds_mla.json").write_text(json.dumps(doc))
    configs.reset()
    assert configs.meta_params(rows, rows=16) == three
    assert configs.meta_params(rows, rows=32) == rows.default_meta(32)
    assert rows.default_meta(32)["num_stages"] == 2
    entries[wgmma.name]["rows=16"]["time_us"] = 90.0  # a faster wgmma entry wins
    (tmp_path / "sm90" / "mla_decode_fp8_ds_mla.json").write_text(json.dumps(doc))
    configs.reset()
    assert pick() == "wgmma"
    configs.reset()


def test_the_bench_times_unoffered_variants_only_when_asked(monkeypatch):
    """benchmarks/decode_formats.py --unoffered: the bench's callers over an MXFP4 cache on
    sm90 include a rows kernel kvgen generates but does not offer (here: MXFP4's, taken out of
    ROWS_OFFERED) only when asked (the op never takes it), and never a variant that cannot read
    the format."""
    from kvgen import runtime
    from kvgen.bench import decode
    from kvgen.families import mla_decode

    monkeypatch.setattr(runtime, "target_of", lambda device: ("sm90", "gpu"))
    monkeypatch.setattr(mla_decode, "ROWS_OFFERED", ("fp8_ds_mla",))
    cache = torch.zeros(2, 64, 1, 400, dtype=torch.uint8)
    offered = [label for label, _ in decode._callers(torch.device("cpu"), cache, "mxfp4")]
    every = [
        label for label, _ in decode._callers(torch.device("cpu"), cache, "mxfp4", unoffered=True)
    ]
    rows = "mla_decode_mxfp4-d576-dv512-bf16-rows-sm90-gpu-g32"
    assert rows not in offered and rows in every
    assert set(offered) < set(every) and "auto mxfp4" in offered
    fp8 = decode._callers(torch.device("cpu"), cache[..., :288], "fp8", None, unoffered=True)
    assert not [label for label, _ in fp8 if "-rows-" in label]  # (no rows kernel for fp8)
