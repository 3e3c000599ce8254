"""Run every kernel family once on small shapes, for compute-sanitizer (scripts/gpu_check.sh):
each store format into guarded caches, each reader, and each decode variant and kernel. Exits 1
when a result disagrees with the reference or a guard byte changed."""

import functools
import sys

import torch

from kvgen import _dtypes, registry, runtime
from kvgen.codegen import load
from kvgen.families.gqa_decode import ROWS_FORMATS
from kvgen.families.per_token_head.verify import make_kv_caches
from kvgen.formats import mxfp4
from kvgen.formats import per_token_head as pth
from kvgen.formats.mla_decode import mla_decode
from kvgen.ops import (
    flash_mla_with_kvcache,
    gather_kv_per_token_head,
    gather_mxfp4_mla,
    get_mla_metadata,
    store_mxfp4_mla,
    triton_reshape_and_cache_flash_int4_per_token_head,
    triton_reshape_and_cache_flash_per_token_head_quant,
)
from kvgen.verify import make_cache, make_slots

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # cpu: the interpreter
failures = []


def check(label: str, ok: bool) -> None:
    print(f"{'ok  ' if ok else 'FAIL'} {label}", flush=True)
    if not ok:
        failures.append(label)


def mxfp4_store_and_gather() -> None:
    for dtype in (torch.bfloat16, torch.float32):
        x = torch.randn(40, 512, device=DEV).to(dtype)
        x[5, 7], x[9, 100], x[11, 300] = float("nan"), float("inf"), -float("inf")
        cache = make_cache("paged", 96, 272, DEV, block_size=16, gap_rows=3)
        want = cache.fresh_copy()
        slots = make_slots(40, 96, DEV)
        store_mxfp4_mla(x, slots, cache.view)
        ref = want.backing.cpu().clone()
        mxfp4.store(x.cpu(), slots.cpu(), want.rebuild(ref), 32)
        check(f"store_mxfp4_mla {dtype}", torch.equal(cache.backing.cpu(), ref))
        got = gather_mxfp4_mla(cache.view, slots, 512, out_dtype=torch.float32).cpu()
        exp = mxfp4.gather(want.rebuild(ref), slots.cpu(), 512, 32)
        check(f"gather_mxfp4_mla {dtype}", torch.equal(got.nan_to_num(), exp.nan_to_num()))


def mxfp4_rope_store_and_gather() -> None:
    from kvgen.families.mxfp4_mla.verify import verify_gather_mxfp4_rope, verify_store_mxfp4_rope

    for family, verify in (
        ("store_mxfp4_rope_mla", verify_store_mxfp4_rope),
        ("gather_mxfp4_rope_mla", verify_gather_mxfp4_rope),
    ):
        for spec in registry.variants(*runtime.local_target(), family=family):
            if spec.group == 32:
                check(spec.name, verify(spec, DEV).passed)


def per_token_head_stores() -> None:
    """Each store into guarded caches: HND views, and vLLM's rows with the scales in their pad
    bytes (``inline``: 4-byte aligned int8 / fp8 rows, 8-byte int4 rows at head 128 and 4-byte
    ones at 576), through the op and, on those rows, through the launcher at the thread layouts
    they take (the int8 / fp8 store's runs of 4 channels: RUNS 2 and 4)."""
    from kvgen.families.per_token_head import StoreKVInt4Spec

    specs = [
        s
        for s in registry.variants(*runtime.local_target())
        if s.family.startswith("store_kv")
        and s.in_dtype == "bf16"
        and (s.head_size, s.head_size_v) in ((128, 128), (576, 512))
        and getattr(s, "channels", 32) == 32
    ]
    cases = [(spec, "hnd", None) for spec in specs]
    for spec in specs:
        if spec.head_size == spec.head_size_v:
            cases.append((spec, "inline", None))
            if spec.family == "store_kv_per_token_head":
                for tokens in (1, 2):  # 2 heads a program on 1 warp: RUNS 2, 4
                    meta = {"tokens_per_program": tokens, "heads_per_program": 2, "num_warps": 1}
                    cases.append((spec, "inline", meta))
    int4_576 = StoreKVInt4Spec(32, 576, 576, "bf16", *runtime.local_target())
    cases.append((int4_576, "inline", {"units_per_program": 32, "num_warps": 1}))
    for spec, layout, meta in cases:
        if meta is None:
            op = (
                triton_reshape_and_cache_flash_int4_per_token_head
                if spec.family == "store_kv_int4_per_token_head"
                else triton_reshape_and_cache_flash_per_token_head_quant
            )
        else:
            op = functools.partial(load(spec).launch, **meta)
        caches = make_kv_caches(spec, 6, 8, 2, DEV, layout=layout)
        expected = {id(c.backing): c.backing.cpu().clone() for c in caches}  # (inline: one)
        want = [c.rebuild(expected[id(c.backing)]) for c in caches]
        key = torch.randn(20, 2, spec.head_size, device=DEV).to(torch.bfloat16)
        value = torch.randn(20, 2, spec.head_size_v, device=DEV).to(torch.bfloat16)
        key[3, 0, 5], key[7, 1, 0] = float("nan"), float("inf")  # (FORMATS: non-finite input)
        value[11, 0, 2] = -float("inf")
        slots = make_slots(20, 48, DEV)
        op(key, value, *[c.view for c in caches], slots)
        pth.store(key.cpu(), value.cpu(), *want, slots.cpu())
        same = all(torch.equal(c.backing.cpu(), expected[id(c.backing)]) for c in caches)
        check(f"{spec.name} {layout}{'' if meta is None else f' {meta}'}", same)
        if meta is None:
            views = [c.view for c in caches]
            gather_kv_per_token_head(*views, slots, spec.head_size, spec.head_size_v)


def mla_cache_stores() -> None:
    from kvgen.families.mla_cache.verify import (
        verify_concat_and_cache_mla,
        verify_gather_mla_cache,
    )

    for spec in registry.variants(*runtime.local_target(), family="concat_and_cache_mla"):
        check(spec.name, verify_concat_and_cache_mla(spec, DEV).passed)
    for spec in registry.variants(*runtime.local_target(), family="gather_mla_cache"):
        check(spec.name, verify_gather_mla_cache(spec, DEV).passed)


def _mla_pages(lengths, page=64):
    """A bf16 576-wide cache of pages of ``page`` rows (two spare), a block table holding each
    sequence's pages in random order (FlashMLA's unused-entry value past them), the lengths and
    the page count."""
    need = [-(-n // page) for n in lengths]
    blocks = sum(need) + 2
    k = torch.randn(blocks, page, 1, 576, device=DEV).to(torch.bfloat16)
    table = torch.full((len(lengths), max(need) + 1), 2147480000, dtype=torch.int32, device=DEV)
    pages = torch.randperm(blocks, device=DEV).to(torch.int32)
    i = 0
    for b, nb in enumerate(need):
        table[b, :nb] = pages[i : i + nb]
        i += nb
    return k, table, torch.tensor(lengths, dtype=torch.int32, device=DEV), blocks


def quantized_decodes() -> None:
    """The decode over each quantized cache (written by kvgen's stores) against the bf16
    decode over its dequantized cache; pages in random order, key-less and one-key rows."""
    from kvgen.bench.decode import K_SCALE, dequantized, quantized_caches

    lengths = [70, 0, 1, 130]
    k, table, sl, blocks = _mla_pages(lengths)
    k_scale = torch.tensor([K_SCALE], device=DEV)
    caches = quantized_caches(k, k_scale)
    for h_q in (16, 128):
        q = torch.randn(len(lengths), 2, h_q, 576, device=DEV).to(torch.bfloat16)
        meta, splits = get_mla_metadata(sl, 2 * h_q, 1)
        for fmt, cache in caches.items():
            out, _ = flash_mla_with_kvcache(
                q, cache, table, sl, 512, meta, splits, causal=True, k_scale=k_scale
            )
            deq = dequantized(fmt, cache, k_scale)
            want, _ = flash_mla_with_kvcache(q, deq, table, sl, 512, meta, splits, causal=True)
            rel = float((out.float() - want.float()).norm() / want.float().norm())
            check(f"flash_mla_with_kvcache {fmt} h_q={h_q} (rel. error {rel:.2e})", rel < 2e-3)
            bad = table.clone()
            bad[0, 1] = -1  # a negative page
            bad[3, 0] = blocks  # one past the last page
            got, lse = flash_mla_with_kvcache(
                q, cache, bad, sl, 512, meta, splits, causal=True, k_scale=k_scale
            )
            check(f"flash_mla_with_kvcache {fmt} h_q={h_q} bad pages -> NaN",
                  _nan_for(got, lse, out, (0, 3)))  # fmt: skip
            # one query a sequence (not causal), where the wgmma variant's loader marks a
            # missing page's tile as NaN keys (and TMA reads the page as the table names it)
            q1 = q[:, :1].contiguous()
            meta1, splits1 = get_mla_metadata(sl, h_q, 1)
            scale = {"k_scale": k_scale} if fmt == "fp8" else {}
            for spec in quantized_variants(fmt):  # each variant, launched directly
                run = load(spec).launch
                mp = spec.default_meta(rows=2 * h_q) | scale
                out, _ = run(q, cache, table, sl, meta, splits, 576**-0.5, True, **mp)
                rel = float((out.float() - want.float()).norm() / want.float().norm())
                check(f"{spec.name} h_q={h_q} {mp} (rel. error {rel:.2e})", rel < 2e-3)
                mp = spec.default_meta(rows=h_q) | scale
                out1, _ = run(q1, cache, table, sl, meta1, splits1, 576**-0.5, False, **mp)
                got, lse = run(q1, cache, bad, sl, meta1, splits1, 576**-0.5, False, **mp)
                check(f"{spec.name} h_q={h_q} one query, bad pages -> NaN",
                      _nan_for(got, lse, out1, (0, 3)))  # fmt: skip


def quantized_variants(fmt: str):
    family = {"fp8": "mla_decode_fp8", "mxfp4": "mla_decode_mxfp4"}.get(
        fmt, "mla_decode_fp8_ds_mla"
    )
    specs = registry.variants(*runtime.local_target(), family=family)
    # (the rows variant takes one query of at most 16 heads: section mla_rows)
    return [s for s in specs if s.dtype == "bf16" and s.head_dim == 576 and s.variant != "rows"]


def mla_rows(fmt: str = "fp8_ds_mla") -> None:
    """The MLA decode's Hopper rows variant over ``fmt`` (fp8_ds_mla, or MXFP4 with the RoPE
    part) through its launcher, whether or not kvgen offers it yet: N of 8 and 16, two and
    three pages in flight, fp8_ds_mla's wide kernel (two pages a tile) at 32 and 16 heads,
    whole sequences and many pieces, against the bf16 decode over the
    dequantized cache (out within the decode's 1e-2: fp16 weights there, bf16 ones in the bf16
    decode); block tables naming pages outside the cache and lengths past the table (never
    read: NaN)."""
    from kvgen.bench.decode import dequantized, quantized_caches
    from kvgen.families.mla_decode import MLADecodeDSMLASpec, MLADecodeMXFP4Spec, available

    arch, target = runtime.local_target()
    check("mla rows variant exists", available("rows", arch, target) or DEV.type != "cuda")
    if not available("rows", arch, target):
        return
    spec_class = MLADecodeDSMLASpec if fmt == "fp8_ds_mla" else MLADecodeMXFP4Spec
    spec = spec_class(576, 512, "bf16", "rows", arch, target)
    mod = load(spec)
    lengths = [70, 0, 1, 130, 64, 257]
    k, table, sl, blocks = _mla_pages(lengths)
    one = torch.ones(1, device=DEV)
    cache = quantized_caches(k, one, (fmt,))[fmt]
    deq = dequantized(fmt, cache, one)
    cases = [(16, 2, 1, 1), (5, 3, 16, 1)]
    wide = mod.UNOFFERED_MAX_HEADS
    if wide > 16:  # the wide kernel (two pages a tile), whether or not the op gives it heads yet
        cases += [(wide, 2, 16, 2), (16, 2, 1, 2)]
    for h_q, stages, split_factor, pages in cases:
        q = torch.randn(len(lengths), 1, h_q, 576, device=DEV).to(torch.bfloat16)
        meta, splits = get_mla_metadata(sl, h_q, 1)
        want, _ = flash_mla_with_kvcache(q, deq, table, sl, 512, meta, splits)
        mp = {"num_stages": stages, "split_factor": split_factor, "piece_tiles": 1}
        mp |= {"pages_per_tile": pages, "max_heads": wide}
        out, _ = mod.launch(q, cache, table, sl, meta, splits, 576**-0.5, False, **mp)
        rel = float((out.float() - want.float()).norm() / want.float().norm())
        check(f"{spec.name} h_q={h_q} {mp} (rel. error {rel:.2e})", rel < 1e-2)
        bad, bad_sl = table.clone(), sl.clone()
        bad[0, 1], bad[3, 0] = -1, blocks  # a negative page, one past the last
        bad_sl[2] = 10**6  # far past its table row
        got, lse = mod.launch(q, cache, bad, bad_sl, meta, splits, 576**-0.5, False, **mp)
        check(f"{spec.name} h_q={h_q} bad pages -> NaN", _nan_for(got, lse, out, (0, 2, 3)))


def decodes() -> None:
    for spec in registry.variants(*runtime.local_target(), family="mla_decode"):
        if spec.dtype != "bf16":
            continue
        for h_kv in (1, 2):  # DeepSeek's one KV head, and several (each group its own)
            decode(spec, h_kv)


def decode(spec, h_kv: int) -> None:
    page = 64
    lengths = [70, 0, 1, 130]
    need = [-(-n // page) for n in lengths]
    shape = (sum(need) + 2, page, h_kv, spec.head_dim)
    k = torch.randn(shape, device=DEV).to(torch.bfloat16)
    table = torch.zeros(len(lengths), max(need) + 1, dtype=torch.int32, device=DEV)
    pages = torch.randperm(k.shape[0], device=DEV).to(torch.int32)
    i = 0
    for b, nb in enumerate(need):
        table[b, :nb] = pages[i : i + nb]
        i += nb
    sl = torch.tensor(lengths, dtype=torch.int32, device=DEV)
    q = torch.randn(len(lengths), 2, 16, spec.head_dim, device=DEV).to(torch.bfloat16)
    ref, _ = mla_decode(q.cpu(), k.cpu(), table.cpu(), sl.cpu(), spec.head_dim_v, causal=True)
    rows = 2 * 16 // h_kv
    meta, splits = get_mla_metadata(sl, rows, h_kv)
    mp = spec.default_meta(rows=rows)
    out, _ = load(spec).launch(q, k, table, sl, meta, splits, spec.head_dim**-0.5, True, **mp)
    rel = float((out.cpu().double() - ref).norm() / ref.norm())
    check(f"{spec.name} h_kv={h_kv} {mp}", rel < 1e-2)
    bad = table.clone()
    bad[0, 0] = -5  # a negative page
    bad[3, 1] = 2**30  # a page far past the cache
    got, lse = load(spec).launch(q, k, bad, sl, meta, splits, spec.head_dim**-0.5, True, **mp)
    check(f"{spec.name} h_kv={h_kv} bad pages -> NaN", _nan_for(got, lse, out, (0, 3)))


def _nan_for(out, lse, good_out, bad) -> bool:
    """Sequences ``bad`` all NaN (out and lse), every other one as ``good_out``."""
    nan = all(bool(out[b].isnan().all() and lse[b].isnan().all()) for b in bad)
    others = [b for b in range(out.shape[0]) if b not in bad]
    return nan and all(torch.equal(out[b], good_out[b]) for b in others)


GQA_FORMATS = (("auto", 0), ("int8", 0), ("fp8e4m3", 0), ("fp8e5m2", 0), ("int4", 32))


def gqa_decodes(formats=GQA_FORMATS) -> None:
    """The GQA decode over each format (NHD, vLLM's inline-scale rows, HND), and over block
    tables that name pages outside the cache and lengths past the table (never read)."""
    from kvgen.families.gqa_decode.verify import make_caches
    from kvgen.formats.gqa_decode import gqa_decode
    from kvgen.ops import flash_attn_with_kvcache
    from kvgen.verify import block_table
    from kvgen.verify import compare_attention as compare

    gen = torch.Generator().manual_seed(0)
    seqlens, page = [70, 0, 1, 130], 16
    blocks, table = block_table(seqlens, page, gen)
    sl = torch.tensor(seqlens, dtype=torch.int32)
    for kv, group in formats:
        for layout in ("nhd", "inline", "hnd"):
            if layout == "inline" and kv == "auto":
                continue
            keys = torch.randn(blocks * page, 2, 128, generator=gen)
            values = torch.randn(blocks * page, 2, 128, generator=gen)
            k, v, ks, vs, k_deq, v_deq = make_caches(kv, group, keys, values, page, DEV,
                                                     layout=layout)  # fmt: skip
            q = torch.randn(4, 2, 8, 128, generator=gen).to(torch.bfloat16)
            kw = dict(k_scale_cache=ks, v_scale_cache=vs, return_softmax_lse=True, causal=True)
            out, lse = flash_attn_with_kvcache(q.to(DEV), k, v, cache_seqlens=sl.to(DEV),
                                               block_table=table.to(DEV), **kw)  # fmt: skip
            ref = gqa_decode(q, k_deq, v_deq, table, sl, causal=True)
            check(f"flash_attn_with_kvcache {kv} {layout}", compare(out, lse, *ref)[0])
            bad_table, bad_sl = table.clone(), sl.clone()
            bad_table[0, 1], bad_table[3, 0] = blocks + 1000, -7
            bad_sl[2] = 10**6  # far past its table row
            out, lse = flash_attn_with_kvcache(q.to(DEV), k, v, cache_seqlens=bad_sl.to(DEV),
                                               block_table=bad_table.to(DEV), **kw)  # fmt: skip
            nan = [bool(torch.isnan(lse[b]).all()) for b in (0, 2, 3)]
            check(f"flash_attn_with_kvcache {kv} {layout} bad pages -> NaN", all(nan))
        # a cache of one block (num_blocks 1, which the compiler takes as a constant), its
        # table naming that page, one past it and a negative one
        keys = torch.randn(page, 2, 128, generator=gen)
        k, v, ks, vs, k_deq, v_deq = make_caches(kv, group, keys, keys.clone(), page, DEV)
        one_sl = torch.tensor([page, 1, 5, 3], dtype=torch.int32)
        one_table = torch.tensor([[0], [0], [1], [-1]], dtype=torch.int32)
        q = torch.randn(4, 1, 8, 128, generator=gen).to(torch.bfloat16)
        out, lse = flash_attn_with_kvcache(q.to(DEV), k, v, cache_seqlens=one_sl.to(DEV),
                                           block_table=one_table.to(DEV), k_scale_cache=ks,
                                           v_scale_cache=vs, return_softmax_lse=True)  # fmt: skip
        ref = gqa_decode(q[:2], k_deq, v_deq, one_table[:2], one_sl[:2])
        nan = bool(torch.isnan(lse[2:]).all())
        check(f"flash_attn_with_kvcache {kv} one block", compare(out[:2], lse[:2], *ref)[0] and nan)


def gqa_rows(kv: str, dtype: str) -> None:
    """The GQA decode's Hopper variant (rows) through its launcher over ``kv`` caches with
    ``dtype`` queries: the fewest and the most tiles in flight, a page size whose tiles cross
    pages, vLLM's inline rows, two causal queries a sequence, and block tables naming pages
    outside the cache and lengths past the table (never read)."""
    from kvgen.families.gqa_decode import GQADecodeSpec, available
    from kvgen.families.gqa_decode.verify import make_caches
    from kvgen.formats.gqa_decode import gqa_decode
    from kvgen.verify import block_table
    from kvgen.verify import compare_attention as compare

    # every form the template generates, offered or not (int4: each scale group once, the
    # default one with both query dtypes)
    arch, target = runtime.local_target()
    groups = ((32, 64) if dtype == "bf16" else (32, 128)) if kv == "int4" else (0,)
    specs = [GQADecodeSpec(128, 128, dtype, kv, g, "rows", arch, target) for g in groups]
    specs = specs if available("rows", arch, target) else []
    check(f"gqa rows variant for {kv}, {dtype} queries found", bool(specs) or DEV.type != "cuda")
    gen = torch.Generator().manual_seed(0)
    seqlens = [70, 0, 1, 130, 64, 257]
    sl = torch.tensor(seqlens, dtype=torch.int32)
    for spec in specs:
        q_dtype = _dtypes.TORCH[spec.dtype]
        launch = load(spec).launch
        # (vLLM's 132-byte inline rows: 4-byte cp.async pieces, also at two stages in pieces
        # of at most 2 tiles, as their tuned configs take them (pieces of 32 tiles of longer
        # sequences); two causal queries a sequence)
        for page, stages, layout, s_q, piece in (
            (16, 2, "nhd", 1, 0), (8, 4, "nhd", 1, 0), (16, 3, "inline", 1, 0),
            (16, 2, "inline", 1, 2), (16, 2, "nhd", 2, 0),
        ):  # fmt: skip
            blocks, table = block_table(seqlens, page, gen)
            keys = torch.randn(blocks * page, 2, 128, generator=gen)
            values = torch.randn(blocks * page, 2, 128, generator=gen)
            k, v, ks, vs, k_deq, v_deq = make_caches(spec.kv, spec.group, keys, values, page,
                                                     DEV, layout=layout, dtype=q_dtype)  # fmt: skip
            q = torch.randn(len(seqlens), s_q, 8, 128, generator=gen).to(q_dtype)
            causal = s_q > 1

            def run(table, sl, k=k, v=v, ks=ks, vs=vs, q=q, stages=stages, causal=causal,
                    launch=launch, piece=piece):  # fmt: skip
                return launch(q.to(DEV), k, v, ks, vs, table.to(DEV), sl.to(DEV), 128**-0.5,
                              causal, num_stages=stages, split_factor=4,
                              piece_tiles=piece)  # fmt: skip

            label = f"{spec.name} page {page} stages {stages} {layout} s_q {s_q} pieces {piece}"
            if k.stride(2) % 4:  # (int4 inline rows at group 128: 66 bytes, refused unread)
                try:
                    run(table, sl)
                    refused = False
                except ValueError as e:
                    refused = "multiples of 4 bytes" in str(e)
                check(f"{label} refused (rows not at multiples of 4 bytes)", refused)
                continue
            out, lse = run(table, sl)
            ref = gqa_decode(q, k_deq, v_deq, table, sl, causal=causal)
            check(label, compare(out, lse, *ref)[0])
            bad_table, bad_sl = table.clone(), sl.clone()
            bad_table[0, 1], bad_table[3, 0] = blocks + 1000, -7
            bad_sl[2] = 10**6  # far past its table row
            bad_out, bad_lse = run(bad_table, bad_sl)
            check(f"{label} bad pages -> NaN",
                  _nan_for(bad_out, bad_lse, out, (0, 2, 3)))  # fmt: skip


SECTIONS = {
    f.__name__: f
    for f in (
        mxfp4_store_and_gather,
        mxfp4_rope_store_and_gather,
        per_token_head_stores,
        mla_cache_stores,
        decodes,
        quantized_decodes,
        mla_rows,
    )
}
SECTIONS["mla_rows_mxfp4"] = functools.partial(mla_rows, "mxfp4")
# (one section a GQA cache format, and for the rows variant a query dtype: racecheck is slowest
# on these, and sections run side by side)
SECTIONS |= {
    f"gqa_decodes_{kv}": functools.partial(gqa_decodes, ((kv, group),)) for kv, group in GQA_FORMATS
}
SECTIONS |= {
    f"gqa_rows_{kv}_{dt}": functools.partial(gqa_rows, kv, dt)
    for kv in ROWS_FORMATS
    for dt in ("bf16", "fp16")
}

if __name__ == "__main__":
    # python scripts/gpu_check.py [--list | section ...]: the sections named (default: all)
    if sys.argv[1:] == ["--list"]:
        print("\n".join(SECTIONS))
        sys.exit(0)
    unknown = set(sys.argv[1:]) - set(SECTIONS)
    if unknown:
        sys.exit(f"unknown sections {sorted(unknown)}; sections: {', '.join(SECTIONS)}")
    for name, section in SECTIONS.items():
        if name in sys.argv[1:] or len(sys.argv) == 1:
            section()
    print(f"{len(failures)} failed" if failures else "all ok")
    sys.exit(1 if failures else 0)
