"""flash_attn_with_kvcache (the paged GQA decode) against the float64 reference over the
dequantized caches: every format and layout, GQA groups, page sizes, causal rows, bad block
tables, and the argument checks."""

from __future__ import annotations

import math

import pytest
import torch
from _hopper import BAD_TABLES, MANY_LENGTHS, hopper, spoil_table, tuned_doc

from kvgen import _dtypes, registry
from kvgen.codegen import load
from kvgen.families.gqa_decode import ROWS_FORMATS, ROWS_OFFERED, GQADecodeSpec, available
from kvgen.families.gqa_decode.verify import alloc_caches, make_caches
from kvgen.formats.gqa_decode import gqa_decode
from kvgen.ops import flash_attn_with_kvcache
from kvgen.runtime import local_target
from kvgen.verify import block_table
from kvgen.verify import compare_attention as compare

FORMATS = [("auto", 0), ("int8", 0), ("fp8e4m3", 0), ("fp8e5m2", 0), ("int4", 32)]


def _case(device, kv="int8", group=0, *, seqlens=(70, 0, 1, 130), s_q=1, h_q=4, h_kv=2, d=128,
          dv=128, page=16, layout="nhd", dtype=torch.bfloat16, seed=0):  # fmt: skip
    gen = torch.Generator().manual_seed(seed)
    blocks, table = block_table(list(seqlens), page, gen)
    keys = torch.randn(blocks * page, h_kv, d, generator=gen)
    values = torch.randn(blocks * page, h_kv, dv, generator=gen)
    writer = "store" if torch.device(device).type == "cuda" else "reference"
    k, v, ks, vs, k_deq, v_deq = make_caches(
        kv, group, keys, values, page, device, layout=layout, writer=writer, dtype=dtype
    )
    q = torch.randn(len(seqlens), s_q, h_q, d, generator=gen).to(dtype)
    sl = torch.tensor(seqlens, dtype=torch.int32)
    args = (q.to(device), k, v)
    kwargs = dict(cache_seqlens=sl.to(device), block_table=table.to(device), k_scale_cache=ks,
                  v_scale_cache=vs)  # fmt: skip
    return args, kwargs, (q, k_deq, v_deq, table, sl)


def _check(args, kwargs, ref_in, causal=False):
    out, lse = flash_attn_with_kvcache(*args, **kwargs, causal=causal, return_softmax_lse=True)
    ref_out, ref_lse = gqa_decode(*ref_in, causal=causal)
    ok, rel, detail = compare(out, lse, ref_out, ref_lse)
    assert ok, (rel, detail)
    return out, lse


@pytest.mark.parametrize(
    "kv,group,layout",
    [(kv, g, "hnd") for kv, g in FORMATS] + [(kv, g, "inline") for kv, g in FORMATS[1:]],
)
def test_layouts(device, kv, group, layout):
    """HND as a permuted view, and vLLM's rows with the scale in their pad bytes (the caches
    passed as cache[..., :head_size] views, the scales as strided views into the rows; a
    quantized cache's layout: bf16 has no scales)."""
    _check(*_case(device, kv, group, layout=layout))


@pytest.mark.parametrize(
    "h_q,h_kv,s_q,page",
    [(1, 1, 1, 1), (8, 1, 1, 256), (16, 1, 3, 7), (6, 3, 8, 32), (32, 2, 2, 16)],
)
def test_groups_pages_and_causal_rows(device, h_q, h_kv, s_q, page):
    """GQA groups 1-16, pages of 1 to 256 keys (and one that no tile divides), causal
    speculative rows up to 8."""
    _check(*_case(device, "fp8e4m3", h_q=h_q, h_kv=h_kv, s_q=s_q, page=page), causal=True)


@pytest.mark.parametrize("kv,group", [("int4", 16), ("int4", 64), ("int8", 0)])
def test_head_sizes_that_differ(device, kv, group):
    """head_size_v narrower than head_size, and widths that are not powers of two."""
    _check(*_case(device, kv, group, d=192, dv=80, dtype=torch.float16))


@pytest.mark.parametrize("kv,group", FORMATS[:4] + [("int4", 16)])
def test_the_smallest_heads(device, kv, group):
    """16-channel heads: one int4 scale group, 8 bytes of codes a row."""
    _check(*_case(device, kv, group, d=16, dv=16, seqlens=(1, 17, 0)))


@pytest.mark.parametrize("kv", ["int8", "fp8e4m3", "fp8e5m2"])
def test_a_v_cache_off_word_alignment(device, kv):
    """A V cache one byte into its storage (rows not at multiples of 4 bytes) is read code by
    code; an aligned one four codes a 32-bit word. Both give the reference's result."""
    args, kwargs, ref_in = _case(device, kv)
    q, k, v = args
    storage = torch.empty(v.numel() + 1, dtype=torch.uint8, device=device)
    shifted = storage[1:].view(v.dtype).view(v.shape)
    shifted.copy_(v)
    assert shifted.data_ptr() % 4 == 1
    _check((q, k, shifted), kwargs, ref_in)


def _one_block_case(device, kv, group, dtype=torch.bfloat16, page=16, d=64, h_q=4):
    """A cache of exactly one block (num_blocks 1: an integer argument the GPU compiler takes
    as the constant 1), three sequences on it: a full page, one key, none."""
    gen = torch.Generator().manual_seed(3)
    keys = torch.randn(page, 2, d, generator=gen)
    values = torch.randn(page, 2, d, generator=gen)
    writer = "store" if torch.device(device).type == "cuda" else "reference"
    k, v, ks, vs, k_deq, v_deq = make_caches(kv, group, keys, values, page, device,
                                             writer=writer, dtype=dtype)  # fmt: skip
    assert k.shape[0] == 1
    q = torch.randn(3, 1, h_q, d, generator=gen).to(dtype)
    sl = torch.tensor([page, 1, 0], dtype=torch.int32)
    table = torch.zeros(3, 1, dtype=torch.int32)
    kwargs = dict(cache_seqlens=sl.to(device), block_table=table.to(device), k_scale_cache=ks,
                  v_scale_cache=vs)  # fmt: skip
    return (q.to(device), k, v), kwargs, (q, k_deq, v_deq, table, sl)


@pytest.mark.parametrize("kv,group", FORMATS)
def test_a_cache_of_one_block(device, kv, group):
    _check(*_one_block_case(device, kv, group))


def test_lse_is_optional(device):
    args, kwargs, _ = _case(device, "auto")
    out = flash_attn_with_kvcache(*args, **kwargs)
    assert isinstance(out, torch.Tensor) and out.shape == (4, 1, 4, 128)


@pytest.mark.parametrize("bad", BAD_TABLES)
def test_bad_block_table_gives_nan_for_that_sequence_only(device, bad):
    """A page outside the cache, or a length past the table, is never read: that sequence's
    out and lse are NaN, the others exact."""
    args, kwargs, ref_in = _case(device, "int4", 32, seqlens=(40, 33, 50))
    table, sl = spoil_table(kwargs["block_table"], kwargs["cache_seqlens"], bad,
                            args[1].shape[0], args[1].shape[1])  # fmt: skip
    kwargs |= dict(block_table=table, cache_seqlens=sl)
    out, lse = flash_attn_with_kvcache(*args, **kwargs, return_softmax_lse=True)
    assert torch.isnan(out[1].float()).all() and torch.isnan(lse[1]).all()
    ref_out, ref_lse = gqa_decode(*ref_in)
    keep = [0, 2]
    ok, rel, detail = compare(out[keep], lse[keep], ref_out[keep], ref_lse[keep])
    assert ok, (rel, detail)


def test_empty_rows_are_zero_with_lse_inf(device):
    args, kwargs, _ = _case(device, "int8", seqlens=(0, 5))
    out, lse = flash_attn_with_kvcache(*args, **kwargs, return_softmax_lse=True)
    assert (out[0] == 0).all() and (lse[0] == math.inf).all()


def _bad(device, **change):
    args, kwargs, _ = _case(device, "int8", seqlens=(5, 3))
    q, k, v = args
    named = dict(q=q, k_cache=k, v_cache=v, **kwargs)
    named |= change
    q, k, v = named.pop("q"), named.pop("k_cache"), named.pop("v_cache")
    return lambda: flash_attn_with_kvcache(q, k, v, **named)


def test_bad_input_names_the_argument(device):
    args, kwargs, _ = _case(device, "int8", seqlens=(5, 3))
    q, k, v = args
    ks = kwargs["k_scale_cache"]
    cases = [
        (dict(q=q.float()), TypeError, "q must have dtype"),
        (dict(q=q[:, :, :3].contiguous()), ValueError, "must divide num_heads_q"),
        (dict(q=q[..., :64].contiguous()), ValueError, "head_size mismatch"),
        (dict(v_cache=v.view(torch.uint8)), TypeError, "v_cache must have k_cache's dtype"),
        (dict(k_scale_cache=None), ValueError, "k_scale_cache is needed"),
        (dict(v_scale_cache=ks[..., None]), ValueError, "v_scale_cache must have shape"),
        (dict(k_scale_cache=ks.half()), TypeError, "k_scale_cache must have dtype"),
        (dict(cache_seqlens=kwargs["cache_seqlens"].long()), TypeError, "cache_seqlens"),
        (dict(block_table=kwargs["block_table"][:1]), ValueError, "q's batch"),
        (dict(k_cache=k[:, :, :1]), ValueError, "v_cache has"),
    ]
    for change, err, text in cases:
        with pytest.raises(err, match=text):
            _bad(device, **change)()


def test_scales_given_for_a_bf16_cache_are_refused(device):
    args, kwargs, _ = _case(device, "auto", seqlens=(5,))
    kwargs["k_scale_cache"] = torch.ones(args[1].shape[:3], device=args[1].device)
    with pytest.raises(ValueError, match="must be None"):
        flash_attn_with_kvcache(*args, **kwargs)


def test_int4_group_follows_the_scale_shape(device):
    args, kwargs, _ = _case(device, "int4", 16, seqlens=(5,))
    kwargs["k_scale_cache"] = kwargs["k_scale_cache"][..., :3]
    with pytest.raises(ValueError, match="scales a head"):
        flash_attn_with_kvcache(*args, **kwargs)


# --- the Hopper variant (rows: Gluon, integer / e4m3 MMAs; an sm90 GPU only)

ARCH, TARGET = local_target()
# every rows form the template generates: those kvgen offers, and those not yet offered (their
# tests are what offering them waits for)
_UNOFFERED = [
    GQADecodeSpec(128, 128, dt, kv, 0, "rows", ARCH, TARGET)
    for dt in ("bf16", "fp16")
    for kv in sorted(set(ROWS_FORMATS) - set(ROWS_OFFERED))
    if available("rows", ARCH, TARGET)
]
ROWS = hopper(registry.variants(ARCH, TARGET, "gqa_decode") + _UNOFFERED, "rows")


def _rows_case(spec, device, *, seqlens=MANY_LENGTHS, h_q=8, h_kv=2, page=16, seed=0,
               layout="nhd", s_q=1):  # fmt: skip
    dtype = _dtypes.TORCH[spec.dtype]
    return _case(device, spec.kv, spec.group, seqlens=seqlens, h_q=h_q, h_kv=h_kv, page=page,
                 dtype=dtype, seed=seed, layout=layout, s_q=s_q)  # fmt: skip


def _launch(spec, args, kwargs, causal=False, **meta):
    q, k, v = args
    return load(spec).launch(
        q, k, v, kwargs["k_scale_cache"], kwargs["v_scale_cache"], kwargs["block_table"],
        kwargs["cache_seqlens"], q.shape[-1] ** -0.5, causal,
        **spec.default_meta(rows=q.shape[1] * q.shape[2] // k.shape[2]) | meta,
    )  # fmt: skip


@pytest.mark.parametrize("num_stages", [2, 4])
@pytest.mark.parametrize("h_q,h_kv,page", [(8, 2, 16), (1, 1, 64), (16, 1, 1), (26, 2, 256)])
@pytest.mark.parametrize("spec", ROWS, ids=lambda s: getattr(s, "name", "rows"))
def test_rows_variant_over_tile_edges_groups_and_pages(spec, h_q, h_kv, page, num_stages, device):
    """The rows kernel through its launcher: lengths around every 64-key tile and page edge (0,
    1 and a long one), groups 1-16 (N 8 and 16, one not a power of two), pages of 1-256 keys,
    the fewest and the most tiles in flight (a wrong phase of the ring reads a tile before or
    after it is there), split and whole sequences."""
    args, kwargs, ref_in = _rows_case(spec, device, h_q=h_q, h_kv=h_kv, page=page)
    ref = gqa_decode(*ref_in)
    for split_factor in (1, 16):
        out, lse = _launch(spec, args, kwargs, num_stages=num_stages, split_factor=split_factor)
        ok, rel, detail = compare(out, lse, *ref)
        assert ok, (split_factor, rel, detail)
        assert (out.cpu()[ref[1].permute(0, 2, 1).isinf()] == 0).all()  # no key: out 0


@pytest.mark.parametrize("spec", ROWS, ids=lambda s: getattr(s, "name", "rows"))
def test_rows_variant_over_a_cache_of_one_block(spec, device):
    dtype = _dtypes.TORCH[spec.dtype]
    args, kwargs, ref_in = _one_block_case(device, spec.kv, spec.group, dtype, d=128, h_q=8)
    ok, rel, detail = compare(*_launch(spec, args, kwargs), *gqa_decode(*ref_in))
    assert ok, (rel, detail)


@pytest.mark.parametrize("h_q,h_kv,page,num_stages", [(8, 2, 16, 2), (16, 1, 32, 4), (3, 3, 1, 3)])
@pytest.mark.parametrize("spec", ROWS, ids=lambda s: getattr(s, "name", "rows"))
def test_rows_variant_reads_vllm_inline_rows(spec, h_q, h_kv, page, num_stages, device):
    """vLLM's layout: 132-byte rows (int4: 64 code bytes, then a float16 scale a group: 72, 68
    and 66 bytes at groups 32, 64 and 128), the caches and the scales passed as strided views
    into them; rows at multiples of 4 bytes only come by 4-byte cp.async pieces, and rows that
    are not at multiples of 4 (int4 at group 128) are refused by ``accepts`` and the launcher
    before anything runs (the op reads them with the portable kernel)."""
    args, kwargs, ref_in = _rows_case(spec, device, h_q=h_q, h_kv=h_kv, page=page,
                                      layout="inline")  # fmt: skip
    row = args[1].stride(2)
    assert row % 16  # (vLLM's rows are never 16-aligned)
    if row % 4:
        ks, vs = kwargs["k_scale_cache"], kwargs["v_scale_cache"]
        why = load(spec).accepts(*args, kwargs["block_table"], ks, vs)
        assert why is not None and "multiples of 4 bytes" in why
        with pytest.raises(ValueError, match="multiples of 4 bytes"):
            _launch(spec, args, kwargs, num_stages=num_stages)
        return
    ref = gqa_decode(*ref_in)
    for split_factor in (1, 16):
        out, lse = _launch(spec, args, kwargs, num_stages=num_stages, split_factor=split_factor)
        ok, rel, detail = compare(out, lse, *ref)
        assert ok, (split_factor, rel, detail)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize(
    "s_q,h_q,h_kv,page", [(2, 8, 1, 16), (4, 8, 2, 64), (8, 2, 1, 32), (3, 5, 1, 1)]
)
@pytest.mark.parametrize("spec", ROWS, ids=lambda s: getattr(s, "name", "rows"))
def test_rows_variant_several_queries_a_sequence(spec, s_q, h_q, h_kv, page, causal, device):
    """Speculative decoding: 2-8 queries a sequence as the MMAs' columns (queries x heads, up
    to 16 a KV head, 15 padded to 16), causal (query i sees the keys up to seqlen - s_q + i:
    the first queries of a sequence shorter than s_q see none, out 0 and lse +inf) or not,
    split and whole sequences."""
    args, kwargs, ref_in = _rows_case(spec, device, h_q=h_q, h_kv=h_kv, page=page, s_q=s_q)
    ref = gqa_decode(*ref_in, causal=causal)
    for split_factor in (1, 16):
        out, lse = _launch(spec, args, kwargs, causal=causal, split_factor=split_factor)
        ok, rel, detail = compare(out, lse, *ref)
        assert ok, (split_factor, rel, detail)
        assert (out.cpu()[ref[1].permute(0, 2, 1).isinf()] == 0).all()  # no key: out 0


@pytest.mark.parametrize("bad", BAD_TABLES)
@pytest.mark.parametrize("spec", ROWS, ids=lambda s: getattr(s, "name", "rows"))
def test_rows_variant_bad_block_table_gives_nan_for_that_sequence_only(spec, bad, device):
    args, kwargs, _ = _rows_case(spec, device, seqlens=(200, 130, 70))
    good, good_lse = _launch(spec, args, kwargs)
    table, sl = spoil_table(kwargs["block_table"], kwargs["cache_seqlens"], bad,
                            args[1].shape[0], args[1].shape[1])  # fmt: skip
    out, lse = _launch(spec, args, kwargs | dict(block_table=table, cache_seqlens=sl))
    assert torch.isnan(out[1].float()).all() and torch.isnan(lse[1]).all()
    assert torch.equal(out[[0, 2]], good[[0, 2]]) and torch.equal(lse[[0, 2]], good_lse[[0, 2]])


@pytest.mark.parametrize("spec", ROWS, ids=lambda s: getattr(s, "name", "rows"))
def test_rows_variant_query_heads_that_are_not_finite_give_nan(spec, device):
    args, kwargs, ref_in = _rows_case(spec, device, seqlens=(70, 5))
    q = args[0].clone()
    q[0, 0, 1, 7] = float("nan")
    q[1, 0, 6, 0] = -float("inf")
    out, lse = _launch(spec, (q, *args[1:]), kwargs)
    assert torch.isnan(lse[0, 1]).all() and torch.isnan(out[0, 0, 1].float()).all()
    assert torch.isnan(lse[1, 6]).all()
    keep = [h for h in range(8) if h != 1]
    ref_out, ref_lse = gqa_decode(*ref_in)
    ok, rel, detail = compare(out[:1, :, keep], lse[:1, keep], ref_out[:1, :, keep],
                              ref_lse[:1, keep])  # fmt: skip
    assert ok, (rel, detail)


@pytest.mark.parametrize("spec", ROWS, ids=lambda s: getattr(s, "name", "rows"))
def test_rows_launcher_refuses_what_its_kernel_cannot_read(spec, device):
    """More than 8 queries a sequence, more than 16 query rows (queries x query heads) a KV
    head, pages that are not a power of two, rows not at multiples of 4 bytes: ValueError from
    the launcher; the op takes the portable variant for them, and is right."""
    cases = [
        (dict(s_q=9, h_q=1, h_kv=1), {}, "1 to 8 queries"),
        (dict(h_q=32, h_kv=1), {}, "at most 16"),
        (dict(s_q=2, h_q=16, h_kv=1), {}, "at most 16"),
        (dict(page=24), {}, "power of two"),
    ]
    dtype = _dtypes.TORCH[spec.dtype]
    for change, _, text in cases:
        args, kwargs, ref_in = _case(device, spec.kv, spec.group, seqlens=(70, 0, 33),
                                     dtype=dtype, **change)  # fmt: skip
        with pytest.raises(ValueError, match=text):
            _launch(spec, args, kwargs)
        _check(args, kwargs, ref_in)
    # rows 2 bytes longer than the codes, from a 2-byte offset: no cp.async piece fits
    args, kwargs, ref_in = _case(device, spec.kv, spec.group, seqlens=(70, 0, 33), dtype=dtype)
    q, k, v = args
    odd = [torch.zeros(*c.shape[:3], c.shape[3] + 2, dtype=c.dtype, device=c.device)[..., 2:]
           for c in (k, v)]  # fmt: skip
    odd[0].copy_(k)
    odd[1].copy_(v)
    with pytest.raises(ValueError, match="4 bytes"):
        _launch(spec, (q, *odd), kwargs)
    _check((q, *odd), kwargs, ref_in)


def test_rows_variant_is_chosen_only_where_it_applies_and_was_tuned(tmp_path, monkeypatch):
    """The op takes the Hopper variant on sm90 for int8 / fp8 e4m3 caches of 128-channel heads,
    one query a sequence and 16-byte aligned rows, and only where tuning measured it faster than the
    portable one at the bucket."""
    import json

    import kvgen.ops._gqa_decode as op_module
    from kvgen import configs
    from kvgen.ops._gqa_decode import choose

    monkeypatch.setenv(configs.OVERRIDE_ENV, str(tmp_path))
    monkeypatch.setattr(configs, "tuned_configs_dir", lambda: tmp_path / "none")
    configs.reset()

    def pick(kv="int8", s_q=1, h_q=32, h_kv=8, page=16, d=128, layout="nhd", arch="sm90",
             group=None):  # fmt: skip
        group = (32 if kv == "int4" else 0) if group is None else group
        k, v, ks, vs = alloc_caches(kv, group, (4, page, h_kv), d, d, torch.bfloat16, "cpu",
                                    layout)  # fmt: skip
        q = torch.empty(2, s_q, h_q, d, dtype=torch.bfloat16)
        bt = torch.zeros(2, 4, dtype=torch.int32)
        rows = s_q * h_q // h_kv
        return choose(q, k, v, bt, kv, d, group, arch, "gpu", rows, ks, vs).variant

    loaded = []
    real_module = op_module.module
    monkeypatch.setattr(op_module, "module", lambda spec: loaded.append(spec) or real_module(spec))
    assert pick() == "portable"  # not tuned: never chosen blind,
    assert loaded == []  # nor its module loaded
    rows = GQADecodeSpec(128, 128, "bf16", "int8", 0, "rows", "sm90", "gpu")
    portable = GQADecodeSpec(128, 128, "bf16", "int8", 0, "portable", "sm90", "gpu")
    meta = {"num_stages": 3, "split_factor": 4, "piece_tiles": 32}
    key = "rows=4,row_align=16"  # (the rows variant's buckets; the portable one's: rows alone)
    entries = {rows.name: {key: {"meta": meta, "time_us": 300.0, "default_time_us": 310.0}}}
    p_meta = portable.default_meta(rows=4)
    entries[portable.name] = {
        "rows=4": {"meta": p_meta, "time_us": 340.0, "default_time_us": 340.0}
    }
    (tmp_path / "sm90").mkdir()
    path = tmp_path / "sm90" / "gqa_decode.json"
    path.write_text(json.dumps(tuned_doc("gqa_decode", entries)))
    configs.reset()
    assert pick() == "rows"
    assert configs.meta_params(rows, rows=4, row_align=16) == meta
    assert pick(h_q=64) == "rows"  # rows 8: the nearest bucket's times
    assert pick(layout="hnd") == "rows"  # any strides of multiples of 16 bytes
    assert pick(page=64) == "rows"
    assert pick(layout="inline") == "rows"  # vLLM's 132-byte rows: 4-byte cp.async pieces
    assert pick(s_q=2) == "rows" and pick(s_q=4) == "rows"  # 4 x 4 query rows a KV head
    assert pick(s_q=5) == "portable"  # 20 query rows a KV head
    assert pick(h_q=32, h_kv=1) == "portable"  # 32 query heads a KV head
    assert pick(page=24) == "portable"
    assert pick(kv="fp8e4m3") == "portable"  # its rows variant is not tuned
    assert pick(kv="int4") == "portable"  # its rows variant is not tuned
    for group in (32, 128):
        spec = GQADecodeSpec(128, 128, "bf16", "int4", group, "rows", "sm90", "gpu")
        entries[spec.name] = {key: {"meta": meta, "time_us": 300.0, "default_time_us": 310.0}}
    e5m2 = GQADecodeSpec(128, 128, "bf16", "fp8e5m2", 0, "rows", "sm90", "gpu")
    entries[e5m2.name] = {key: {"meta": meta, "time_us": 100.0, "default_time_us": 310.0}}
    path.write_text(json.dumps(tuned_doc("gqa_decode", entries)))
    configs.reset()
    assert pick(kv="int4") == "rows"  # tuned: the untuned portable counts as slower
    assert pick(kv="fp8e5m2") == "rows"
    with monkeypatch.context() as m:  # a form kvgen does not offer: never chosen, even tuned
        m.setattr(op_module, "ROWS_OFFERED", ("int8", "fp8e4m3", "int4"))
        assert pick(kv="fp8e5m2") == "portable"
    assert pick(kv="int4", layout="inline") == "rows"  # 72-byte rows: 4-byte pieces
    assert pick(kv="int4", group=128) == "rows"
    assert pick(kv="int4", group=128, layout="inline") == "portable"  # 66-byte rows: refused
    assert pick(arch="sm80") == "portable"
    # a faster tuned portable entry wins
    entries[portable.name]["rows=4"]["time_us"] = 290.0
    path.write_text(json.dumps(tuned_doc("gqa_decode", entries)))
    configs.reset()
    assert pick() == "portable"


def test_inline_rows_take_their_row_align_bucket_else_the_16_byte_one(tmp_path, monkeypatch):
    """vLLM's inline-scale rows (132 bytes: row_align 4) run the rows variant at the config
    tuned at their own row_align bucket where the file has one, else at the 16-byte rows'
    (the nearest bucket); the op chooses between variants by their times on 16-byte rows."""
    import json

    import kvgen.ops._gqa_decode as op_module
    from kvgen import configs
    from kvgen.families.per_token_head import row_align

    monkeypatch.setenv(configs.OVERRIDE_ENV, str(tmp_path))
    monkeypatch.setattr(configs, "tuned_configs_dir", lambda: tmp_path / "none")
    rows = GQADecodeSpec(128, 128, "bf16", "int8", 0, "rows", "sm90", "gpu")
    portable = GQADecodeSpec(128, 128, "bf16", "int8", 0, "portable", "sm90", "gpu")
    k, v, ks, vs = alloc_caches("int8", 0, (4, 16, 8), 128, 128, torch.bfloat16, "cpu", "inline")
    sep = alloc_caches("int8", 0, (4, 16, 8), 128, 128, torch.bfloat16, "cpu", "nhd")
    assert row_align(k, v) == 4 and row_align(*sep[:2]) == 16
    assert op_module.bucket(rows, 4, row_align(k, v)) == {"rows": 4, "row_align": 4}
    assert op_module.bucket(portable, 4, row_align(k, v)) == {"rows": 4}
    aligned = {"num_stages": 2, "split_factor": 2, "piece_tiles": 60}
    inline = {"num_stages": 2, "split_factor": 1, "piece_tiles": 32}

    def entry(meta, us):
        return {"meta": meta, "time_us": us, "default_time_us": 400.0}

    entries = {
        rows.name: {"rows=4,row_align=16": entry(aligned, 300.0)},
        portable.name: {"rows=4": entry(portable.default_meta(rows=4), 350.0)},
    }
    (tmp_path / "sm90").mkdir()
    path = tmp_path / "sm90" / "gqa_decode.json"

    def write():
        path.write_text(json.dumps(tuned_doc("gqa_decode", entries)))
        configs.reset()

    def chosen(caches):
        q = torch.empty(2, 1, 32, 128, dtype=torch.bfloat16)
        bt = torch.zeros(2, 4, dtype=torch.int32)
        spec = op_module.choose(q, caches[0], caches[1], bt, "int8", 128, 0, "sm90", "gpu", 4,
                                caches[2], caches[3])  # fmt: skip
        sizes = op_module.bucket(spec, 4, row_align(*caches[:2]))
        return spec.variant, configs.meta_params(spec, **sizes)

    write()
    assert chosen((k, v, ks, vs)) == ("rows", aligned)  # no inline entry: the 16-byte one's
    entries[rows.name]["rows=4,row_align=4"] = entry(inline, 320.0)
    write()
    assert chosen((k, v, ks, vs)) == ("rows", inline)
    assert chosen(sep) == ("rows", aligned)
    # the choice between variants compares the times on 16-byte rows, where both were tuned:
    # an inline-row time (slower rows) is not compared with the portable variant's
    entries[rows.name]["rows=4,row_align=4"] = entry(inline, 360.0)
    write()
    assert chosen((k, v, ks, vs)) == ("rows", inline) and chosen(sep)[0] == "rows"
    entries[portable.name]["rows=4"]["time_us"] = 290.0
    write()
    assert chosen((k, v, ks, vs))[0] == "portable" and chosen(sep)[0] == "portable"


@pytest.mark.parametrize("device_dir", ["", "nvidia-h100-80gb-hbm3"])
def test_the_package_configs_keep_the_rows_variant_on_inline_rows(monkeypatch, device_dir):
    """With the package's tuned configs (the arch's file and the H100's), vLLM's inline rows
    of every format whose rows variant is tuned there run the rows variant, as separate caches
    do, at each rows bucket: the portable variant reads those rows 3-5x slower (H100), so an
    inline-row time compared with the portable variant's separate-cache one must not pick it."""
    import kvgen.ops._gqa_decode as op_module
    from kvgen import configs

    monkeypatch.delenv(configs.OVERRIDE_ENV, raising=False)
    monkeypatch.setenv(configs.DEVICE_ENV, device_dir)
    configs.reset()
    picked = 0
    for kv in ROWS_OFFERED:
        group = 32 if kv == "int4" else 0
        spec = GQADecodeSpec(128, 128, "bf16", kv, group, "rows", "sm90", "gpu")
        for h_q in (32, 64, 128):
            if configs.tuned_time(spec, rows=h_q // 8, row_align=16) is None:
                continue
            for layout in ("nhd", "inline"):
                k, v, ks, vs = alloc_caches(kv, group, (4, 16, 8), 128, 128, torch.bfloat16,
                                            "cpu", layout)  # fmt: skip
                q = torch.empty(2, 1, h_q, 128, dtype=torch.bfloat16)
                bt = torch.zeros(2, 4, dtype=torch.int32)
                got = op_module.choose(q, k, v, bt, kv, 128, group, "sm90", "gpu", h_q // 8,
                                       ks, vs)  # fmt: skip
                assert got.variant == "rows", (kv, h_q, layout, device_dir)
                picked += 1
    configs.reset()
    assert picked >= 18  # int8, fp8 e4m3, int4 at least: 3 x 3 rows x 2 layouts


def test_rows_row_align_buckets_are_the_formats_inline_rows():
    """The rows variant is tuned at row_align 16 and at the alignment of vLLM's inline rows of
    its format (int8 / fp8: 4; int4 at 32 channels a scale: 8, not by default), which is what
    those caches have (``row_align``); the portable variant has no row_align bucket."""
    from kvgen import registry
    from kvgen.families.gqa_decode import inline_row_align
    from kvgen.families.per_token_head import row_align
    from kvgen.tune import plan

    for kv, group in (("int8", 0), ("fp8e4m3", 0), ("fp8e5m2", 0), ("int4", 16), ("int4", 32),
                      ("int4", 64), ("int4", 128)):  # fmt: skip
        k, v, _, _ = alloc_caches(kv, group, (2, 16, 2), 128, 128, torch.bfloat16, "cpu",
                                  "inline")  # fmt: skip
        assert inline_row_align(kv, group) == row_align(k, v), (kv, group)
    assert inline_row_align("auto", 0) == 16
    studies = plan.plan(None, "sm90")
    rows_studies = [s for s in studies if s.spec.family == "gqa_decode" if s.spec.variant == "rows"]
    got = {(s.spec.kv, s.spec.dtype, s.bucket["rows"], s.bucket["row_align"]) for s in rows_studies}
    for dt in ("bf16", "fp16"):
        for r in (4, 8, 16):
            for kv in ("int8", "fp8e4m3", "fp8e5m2"):
                assert {(kv, dt, r, 16), (kv, dt, r, 4)} <= got
                assert (kv, dt, r, 8) not in got
            assert ("int4", dt, r, 16) in got
            assert ("int4", dt, r, 8) not in got and ("int4", dt, r, 4) not in got
    named = plan.plan(["gqa_decode-d128-dv128-bf16-kvint4-g32-rows-sm90-gpu"], "sm90")
    assert sorted({s.bucket["row_align"] for s in named}) == [8, 16]
    fam = registry.family("gqa_decode")
    g128 = GQADecodeSpec(128, 128, "bf16", "int4", 128, "rows", "sm90", "gpu")
    assert not fam.bucket_applies(g128, {"rows": 4, "row_align": 4})  # 66-byte rows: refused
    assert all("row_align" not in s.bucket for s in studies
               if s.spec.family == "gqa_decode" and s.spec.variant == "portable")  # fmt: skip


def test_int4_rows_accepts_refuses_what_its_kernel_cannot_read():
    """The int4 rows form's ``accepts`` (host code: runs without a GPU): packed rows of 64 bytes
    at multiples of 4 bytes, float16 scale caches of 4 scales a row with a unit last stride."""
    module = load(GQADecodeSpec(128, 128, "bf16", "int4", 32, "rows", "sm90", "gpu"))
    q = torch.zeros(2, 1, 8, 128, dtype=torch.bfloat16)
    codes = torch.zeros(4, 16, 2, 64, dtype=torch.uint8)
    scales = torch.zeros(4, 16, 2, 4, dtype=torch.float16)
    table = torch.zeros(2, 4, dtype=torch.int32)
    assert module.accepts(q, codes, codes, table, scales, scales) is None
    odd = torch.zeros(4, 16, 2, 66, dtype=torch.uint8)[..., 2:]  # rows 2 bytes off
    assert "multiples of 4 bytes" in module.accepts(q, codes, odd, table, scales, scales)
    assert "uint8 [..., 64]" in module.accepts(q, codes[..., :32], codes, table, scales, scales)
    strided = torch.zeros(4, 16, 2, 8, dtype=torch.float16)[..., ::2]
    assert "unit last stride" in module.accepts(q, codes, codes, table, scales, strided)
    assert "float16" in module.accepts(q, codes, codes, table, scales.float(), scales)
    assert "float16 [..., 4]" in module.accepts(q, codes, codes, table, scales[..., :2], scales)
    # a key's 4 K scales come by one 8-byte load: K's scale rows at multiples of 8 bytes (V's
    # are read a scale at a time)
    pad = torch.zeros(4, 16, 2, 6, dtype=torch.float16)[..., 1:5]  # rows 2 bytes off
    k8 = "k_scale_cache's rows must all start at multiples of 8 bytes"
    assert module.accepts(q, codes, codes, table, pad, scales).startswith(k8)
    assert module.accepts(q, codes, codes, table, scales, pad) is None
    wide = torch.zeros(4, 16, 2, 6, dtype=torch.float16)[..., :4]  # 12-byte rows
    assert module.accepts(q, codes, codes, table, wide, scales).startswith(k8)
    inline = torch.zeros(4, 16, 2, 36, dtype=torch.float16)[..., 32:]  # vLLM's 72-byte rows
    assert module.accepts(q, codes, codes, table, inline, inline) is None
    # group 64: a key's 2 K scales by one 4-byte load
    module = load(GQADecodeSpec(128, 128, "bf16", "int4", 64, "rows", "sm90", "gpu"))
    two = torch.zeros(4, 16, 2, 2, dtype=torch.float16)
    assert module.accepts(q, codes, codes, table, two, two) is None
    off = torch.zeros(4, 16, 2, 3, dtype=torch.float16)[..., 1:]  # 6-byte rows, 2 bytes off
    k4 = "k_scale_cache's rows must all start at multiples of 4 bytes"
    assert module.accepts(q, codes, codes, table, off, two).startswith(k4)


def test_int4_rows_level_tables_hold_the_levels_in_one_f16_term():
    """The byte-permute tables of the int4 rows form (``_int4_level_tables``): magnitude m's low
    and high bytes, put back together, are f16(level / INT4_KEY_MU) for K and f16(level) for V;
    K's terms times INT4_KEY_MU are within 4.6e-5 of each level, relative, and of the
    multipliers k / 2^21 in [0.5, 1) none comes closer (f16 of the levels alone: 3.9e-4)."""
    import numpy as np

    from kvgen.families.gqa_decode import INT4_KEY_MU, _int4_level_tables
    from kvgen.formats.per_token_head import INT4_LEVELS

    def f16s(tables):
        low, high = (int(tables[0], 16) | int(tables[1], 16) << 32,
                     int(tables[2], 16) | int(tables[3], 16) << 32)  # fmt: skip
        bits = [(low >> 8 * m & 0xFF) | (high >> 8 * m & 0xFF) << 8 for m in range(8)]
        return np.array(bits, dtype=np.uint16).view(np.float16).astype(np.float64)

    k_tables, v_tables = _int4_level_tables()
    levels = np.array(INT4_LEVELS, dtype=np.float32).astype(np.float64)
    assert np.array_equal(f16s(v_tables), levels.astype(np.float16).astype(np.float64))
    k = f16s(k_tables)
    assert np.array_equal(k, (levels / INT4_KEY_MU).astype(np.float16).astype(np.float64))
    assert k[0] == 0.0

    def worst(mu):  # the largest relative error of the terms times mu, over the nonzero levels
        terms = (levels[None, 1:] / mu[:, None]).astype(np.float16).astype(np.float64)
        return np.max(np.abs(terms * mu[:, None] - levels[1:]) / levels[1:], axis=1)

    assert INT4_KEY_MU * 2**21 == 1128464  # exact in fp32
    grid = np.arange(2**20, 2**21, dtype=np.float64) / 2**21
    errors = worst(grid)
    assert errors.argmin() == 1128464 - 2**20
    assert worst(np.array([INT4_KEY_MU]))[0] < 4.6e-5
    assert worst(np.array([1.0]))[0] > 3.8e-4  # one f16 term without the multiplier


def test_verify_takes_a_rows_variant_through_its_launcher(monkeypatch):
    """``kvgen verify`` runs a rows variant through its own launcher (the op takes it only
    where tuned). Gluon does not run on the CPU, so the portable launcher of the same format
    stands in for it here: what verify builds, passes and compares against is what is checked."""
    import types

    import kvgen.codegen
    from kvgen.families.gqa_decode import GQADecodeSpec
    from kvgen.families.gqa_decode.verify import verify_gqa_decode

    rows = GQADecodeSpec(128, 128, "bf16", "int8", 0, "rows", "sm90", "gpu")
    portable = GQADecodeSpec(128, 128, "bf16", "int8", 0, "portable", ARCH, TARGET)
    loaded = []

    def stand_in(spec):
        loaded.append(spec)
        mod = load(portable)
        meta = portable.default_meta(rows=4)
        return types.SimpleNamespace(launch=lambda *a, **_: mod.launch(*a, num_sms=8, **meta))

    monkeypatch.setattr(kvgen.codegen, "load", stand_in)
    result = verify_gqa_decode(rows, "cpu" if TARGET == "interp" else "cuda")
    assert loaded == [rows]
    assert result.passed, result


def test_chosen_spec_is_the_variant_the_op_runs(device):
    """``chosen_spec`` (what ``kvgen bench`` reports) names the kernel the op runs: its
    launcher gives the op's output bit for bit."""
    from kvgen import runtime
    from kvgen.ops._gqa_decode import chosen_spec, num_sms

    args, kwargs, _ = _case(device, "int8", seqlens=(70, 0, 130))
    spec = chosen_spec(*args, **kwargs)
    assert spec.kv == "int8" and (spec.variant == "portable" or TARGET == "gpu")
    out, lse = flash_attn_with_kvcache(*args, **kwargs, return_softmax_lse=True)
    meta = runtime.meta_params(spec, rows=args[0].shape[2] // args[1].shape[2])
    got, got_lse = load(spec).launch(
        *args, kwargs["k_scale_cache"], kwargs["v_scale_cache"], kwargs["block_table"],
        kwargs["cache_seqlens"], 128**-0.5, False, num_sms=num_sms(args[0].device), **meta,
    )  # fmt: skip
    assert torch.equal(got, out) and torch.equal(got_lse, lse)


@pytest.mark.parametrize("kv,group", [("int8", 0), ("int4", 32)])
def test_bench_problem_in_vllm_inline_rows(kv, group, device):
    """``kvgen bench``'s inline rows: the caches are views into vLLM's padded rows (132 bytes
    for int8, 72 for int4), the scales in the pad bytes, and the op reads them right."""
    from kvgen.bench import gqa_decode as bench
    from kvgen.formats.gqa_decode import dequantize_cache

    q, k, v, ks, vs, table, sl = bench.problem(kv, group, [70, 3], 8, device, h_kv=2,
                                               layout="inline")  # fmt: skip
    row = 132 if kv == "int8" else 72
    assert k.stride(2) * k.element_size() == row and v.stride(2) * v.element_size() == row
    assert ks.data_ptr() - k.data_ptr() == (128 if kv == "int8" else 64)  # in the pad bytes
    out, lse = flash_attn_with_kvcache(q, k, v, cache_seqlens=sl, block_table=table,
                                       k_scale_cache=ks, v_scale_cache=vs,
                                       return_softmax_lse=True)  # fmt: skip
    k_deq = dequantize_cache(k.cpu(), ks.cpu(), 128)
    v_deq = dequantize_cache(v.cpu(), vs.cpu(), 128)
    ok, rel, detail = compare(out, lse, *gqa_decode(q.cpu(), k_deq, v_deq, table.cpu(), sl.cpu()))
    assert ok, (rel, detail)


def test_a_default_tune_leaves_out_the_portable_studies_the_rows_variant_covers():
    """``kvgen tune`` without names: on sm90 the portable variant of a format the rows variant
    is offered for is tuned only at the rows the rows variant does not take (32 query rows a
    KV head), the rows variant at the others, the bf16 cache's portable variant at every
    bucket; on sm80 (no rows variant) every portable study stays; a named portable variant is
    tuned at every bucket."""
    from kvgen.families.gqa_decode import ROWS_MAX_ROWS
    from kvgen.tune import plan

    def studies(arch, names=None):
        out = {}
        for st in plan.plan(names, arch, families={"gqa_decode"}):
            out.setdefault((st.spec.variant, st.spec.kv), set()).add(st.bucket["rows"])
        return out

    sm90 = studies("sm90")
    for kv in ROWS_OFFERED:
        assert sm90[("portable", kv)] == {32}, kv
        assert sm90[("rows", kv)] == {4, 8, 16}, kv
    assert sm90[("portable", "auto")] == {4, 8, 16, 32}
    assert max(sm90[("rows", "int8")]) == ROWS_MAX_ROWS
    sm80 = studies("sm80")
    assert {v for v, _ in sm80} == {"portable"}
    assert all(rows == {4, 8, 16, 32} for rows in sm80.values())
    named = GQADecodeSpec(128, 128, "bf16", "int8", 0, "portable", "sm90", "gpu").name
    assert studies("sm90", [named]) == {("portable", "int8"): {4, 8, 16, 32}}


def test_the_rows_variant_takes_as_many_query_rows_as_the_family_says():
    """ROWS_MAX_ROWS (what a default tune leaves to the rows variant) is the generated
    module's MAX_ROWS."""
    from kvgen.codegen import load
    from kvgen.families.gqa_decode import ROWS_MAX_ROWS

    mod = load(GQADecodeSpec(128, 128, "bf16", "int8", 0, "rows", "sm90", "gpu"))
    assert mod.MAX_ROWS == ROWS_MAX_ROWS


def test_the_tuning_problem_builds_inline_rows_for_a_row_align_bucket_under_16(monkeypatch):
    """The rows variant's tuning problem times vLLM's inline rows at a row_align bucket under
    16 and separate caches at 16, and refuses a bucket its format's inline rows do not have
    (int4 at 32 channels a scale: 72-byte rows, row_align 8) before timing anything."""
    from kvgen.bench import gqa_decode as bench
    from kvgen.families.gqa_decode import tuning

    built = []

    def fake_checked_problem(kv, group, h_q, device, dtype=torch.bfloat16, layout="nhd"):
        built.append(layout)
        k, v, ks, vs = alloc_caches(kv, group, (2, 16, 8), 128, 128, dtype, "cpu", layout)
        return (None, k, v, ks, vs, None, None), None

    class Built(Exception):
        pass

    def stop(*_):
        raise Built  # (the problem's next step asks the GPU for its SM count)

    monkeypatch.setattr(bench, "checked_problem", fake_checked_problem)
    monkeypatch.setattr(torch.cuda, "get_device_properties", stop)
    int8 = GQADecodeSpec(128, 128, "bf16", "int8", 0, "rows", "sm90", "gpu")
    int4 = GQADecodeSpec(128, 128, "bf16", "int4", 32, "rows", "sm90", "gpu")
    for spec, bucket, layout in ((int8, {"rows": 4, "row_align": 4}, "inline"),
                                 (int8, {"rows": 4, "row_align": 16}, "nhd"),
                                 (int4, {"rows": 8, "row_align": 8}, "inline")):  # fmt: skip
        with pytest.raises(Built):
            tuning.problem(spec, bucket, "cpu")
        assert built[-1] == layout, (spec.kv, bucket)
    with pytest.raises(ValueError, match="inline caches of row_align 8 for the row_align 4"):
        tuning.problem(int4, {"rows": 4, "row_align": 4}, "cpu")


def test_show_marks_the_variant_the_op_takes_and_the_inline_entries_that_follow_it():
    """``configs.rows`` (kvgen show's "used"): at each rows bucket the faster of the portable
    variant and the rows variant at row_align 16, as the op compares them; a rows variant's
    row_align 4 entry (vLLM's inline rows) is used where that variant is used at row_align 16."""
    from kvgen import configs

    portable = GQADecodeSpec(128, 128, "bf16", "int8", 0, "portable", "sm90", "gpu").name
    rows = GQADecodeSpec(128, 128, "bf16", "int8", 0, "rows", "sm90", "gpu").name

    def entry(us):
        return {"meta": {}, "time_us": us, "default_time_us": us}

    doc = tuned_doc("gqa_decode", {
        portable: {"rows=4": entry(340.0), "rows=8": entry(350.0), "rows=32": entry(500.0)},
        rows: {"rows=4,row_align=16": entry(300.0), "rows=4,row_align=4": entry(450.0),
               "rows=8,row_align=16": entry(400.0), "rows=8,row_align=4": entry(420.0)},
    })  # fmt: skip
    used = {(r["variant"], r["bucket"]): r["used"] for r in configs.rows(doc, GQADecodeSpec)}
    assert used == {
        (portable, "rows=4"): False,
        (portable, "rows=8"): True,
        (portable, "rows=32"): True,
        (rows, "rows=4,row_align=16"): True,
        (rows, "rows=4,row_align=4"): True,
        (rows, "rows=8,row_align=16"): False,
        (rows, "rows=8,row_align=4"): False,
    }
