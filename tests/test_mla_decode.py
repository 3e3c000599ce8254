"""flash_mla_with_kvcache against the float64 reference, over variants, pages, heads and rows."""

import math

import pytest
import torch
from _hopper import BAD_TABLES, MANY_LENGTHS, hopper, spoil_table

from kvgen import registry
from kvgen.codegen import load
from kvgen.formats.mla_decode import mla_decode
from kvgen.ops import flash_mla_with_kvcache, get_mla_metadata
from kvgen.ops._mla_metadata import schedule
from kvgen.runtime import local_target

ARCH, TARGET = local_target()
VARIANTS = registry.variants(ARCH, TARGET, "mla_decode")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _problem(seqlens, page, h_q, s_q, d, dtype, device, seed=0, h_kv=1):
    gen = torch.Generator().manual_seed(seed)
    need = [-(-n // page) for n in seqlens]
    num_blocks = sum(need) + 3
    k_cache = torch.randn(num_blocks, page, h_kv, d, generator=gen).to(dtype)
    pages = torch.randperm(num_blocks, generator=gen)  # pages in no particular order
    table = torch.full((len(seqlens), max(max(need), 1) + 1), -7, dtype=torch.int32)
    i = 0
    for b, nb in enumerate(need):
        table[b, :nb] = pages[i : i + nb].to(torch.int32)
        i += nb
    q = torch.randn(len(seqlens), s_q, h_q, d, generator=gen).to(dtype)
    sl = torch.tensor(seqlens, dtype=torch.int32)
    return q.to(device), k_cache.to(device), table.to(device), sl.to(device)


def _check(q, k_cache, table, sl, dv, causal=False, scale=None, spec=None, policy=None, **meta_kw):
    h_kv = k_cache.shape[2]
    meta, splits = get_mla_metadata(sl, q.shape[1] * q.shape[2] // h_kv, h_kv)
    if policy is not None:  # the same parts, sequences split (partial results) or kept whole
        meta, splits = schedule(sl, meta.shape[0], policy)
    if spec is None:
        out, lse = flash_mla_with_kvcache(q, k_cache, table, sl, dv, meta, splits, scale, causal)
    else:  # a given variant, through its generated launcher
        rows = q.shape[1] * q.shape[2] // h_kv
        out, lse = load(spec).launch(
            q,
            k_cache,
            table,
            sl,
            meta,
            splits,
            scale or q.shape[-1] ** -0.5,
            causal,
            **spec.default_meta(rows=rows) | meta_kw,
        )
    ref_out, ref_lse = mla_decode(q.cpu(), k_cache.cpu(), table.cpu(), sl.cpu(), dv, scale, causal)
    assert out.shape == ref_out.shape and out.dtype == q.dtype
    assert lse.shape == ref_lse.shape and lse.dtype == torch.float32
    assert not out.isnan().any()
    rel = (out.cpu().double() - ref_out).norm() / ref_out.norm().clamp(min=1e-30)
    assert rel < 1e-2, f"relative error {float(rel):.2e}"
    finite = torch.isfinite(ref_lse)
    assert (lse.cpu()[~finite] == math.inf).all(), "rows with no key must have lse +inf"
    assert (out.cpu()[(~finite).permute(0, 2, 1)] == 0).all(), "rows with no key must be 0"
    err = (lse.cpu().double()[finite] - ref_lse[finite]).abs()
    assert err.numel() == 0 or float(err.max()) < 1e-3


def _kid(x):
    return getattr(x, "name", None) or ",".join(f"{k}{v}" for k, v in x.items()) or "default"


@pytest.mark.parametrize("policy", ["split", "whole"])
@pytest.mark.parametrize("spec", VARIANTS, ids=_kid)
def test_variant_unequal_lengths(spec, policy, device):
    # "split": every sequence longer than a block is cut (partial results, combined);
    # "whole": none is (the split kernel writes out and lse itself, the combine skips them).
    q, k, t, sl = _problem([70, 0, 1, 130], 16, 4, 2, spec.head_dim, DTYPES[spec.dtype], device)
    _check(q, k, t, sl, spec.head_dim_v, causal=True, spec=spec, policy=policy)


@pytest.mark.parametrize("policy", ["split", "whole"])
@pytest.mark.parametrize("page", [16, 64])
@pytest.mark.parametrize("spec", hopper(VARIANTS), ids=_kid)
def test_hopper_barrier_phases_with_the_fewest_buffers(spec, page, policy, device):
    """The warp-specialised kernel with one K buffer and one P buffer (num_stages 1,
    fewest_buffers): every buffer is reused every tile, so a wait on a wrong barrier phase reads
    a tile before it is written or after it is overwritten, and the result is wrong. Many
    lengths (tile and page edges), sequences split or whole, causal rows."""
    q, k, t, sl = _problem(MANY_LENGTHS, page, 16, 2, spec.head_dim, DTYPES[spec.dtype], device)
    _check(q, k, t, sl, spec.head_dim_v, causal=True, spec=spec, policy=policy, num_stages=1,
           fewest_buffers=True)  # fmt: skip


@pytest.mark.parametrize("bad", BAD_TABLES)
@pytest.mark.parametrize("page", [16, 64])
@pytest.mark.parametrize("policy", ["split", "whole"])
@pytest.mark.parametrize("spec", VARIANTS, ids=_kid)
def test_bad_block_table_gives_nan_for_that_sequence_only(spec, policy, page, bad, device):
    """A page outside the cache (past its end, or negative), or a length past what the block
    table holds, is never read (the default check_block_table=False): that sequence's out and
    lse are NaN, the other sequences exact."""
    q, k_cache, table, sl = _problem([70, 130, 33], page, 16, 1, spec.head_dim,
                                     DTYPES[spec.dtype], device)  # fmt: skip
    good_table, good_sl = table, sl.clone()
    if bad == "longer_than_table":
        good_sl[1] = 0
    table, sl = spoil_table(table, sl, bad, k_cache.shape[0], page)
    meta, splits = schedule(sl, 4, policy)
    out, lse = load(spec).launch(q, k_cache, table, sl, meta, splits, spec.head_dim**-0.5, False,
                                 **spec.default_meta(rows=16))  # fmt: skip
    assert torch.isnan(out[1].float()).all() and torch.isnan(lse[1]).all()
    ref_out, ref_lse = mla_decode(q.cpu(), k_cache.cpu(), good_table.cpu(), good_sl.cpu(),
                                  spec.head_dim_v)  # fmt: skip
    for b in (0, 2):
        rel = (out[b].cpu().double() - ref_out[b]).norm() / ref_out[b].norm()
        assert rel < 1e-2 and float((lse[b].cpu().double() - ref_lse[b]).abs().max()) < 1e-3


@pytest.mark.parametrize("spec", hopper(VARIANTS), ids=_kid)
def test_hopper_launchers_refuse_caches_their_kernels_cannot_read(spec, device):
    """A direct call of a generated launcher with a cache its kernel cannot read (rows not
    16-byte aligned for the cp.async of the wgmma variant) raises ValueError instead of
    returning wrong output."""
    q, k, t, sl = _problem([70, 0, 130], 16, 3, 1, spec.head_dim, DTYPES[spec.dtype], device)
    meta, splits = get_mla_metadata(sl, 3, 1)
    mp = spec.default_meta(rows=3)
    # the same rows, one element off 16-byte alignment
    flat = torch.empty(k.numel() + 1, dtype=k.dtype, device=device)
    flat[1:] = k.flatten()
    bad = flat[1:].view(k.shape)
    with pytest.raises(ValueError, match="k_cache"):
        load(spec).launch(q, bad, t, sl, meta, splits, 0.1, False, **mp)
    # the op takes another variant for the same cache, and is right
    _check(q, bad, t, sl, spec.head_dim_v)


Q_READERS = hopper(s for s in VARIANTS if s.head_dim == 576 and s.dtype == "bf16")


@pytest.mark.parametrize("spec", Q_READERS, ids=_kid)
@pytest.mark.parametrize("layout", ["offset", "strided"])
def test_hopper_kernels_take_any_q_view(spec, layout, device):
    """The wgmma variant reads Q by cp.async (16-byte aligned rows): a Q that starts 2 bytes
    into its storage, or whose rows are strided, gives the same result."""
    q, k, t, sl = _problem([70, 0, 130], 64, 3, 2, 576, torch.bfloat16, device, seed=9)
    if layout == "offset":
        flat = torch.empty(q.numel() + 1, dtype=q.dtype, device=device)
        flat[1:] = q.flatten()
        q = flat[1:].view(q.shape)
        assert q.data_ptr() % 16 != 0
    else:
        wide = torch.zeros(*q.shape[:3], 600, dtype=q.dtype, device=device)
        wide[..., 8:584] = q
        q = wide[..., 8:584]
    _check(q, k, t, sl, 512, causal=True, spec=spec)


WIDE = [s for s in VARIANTS if (s.head_dim, s.dtype) == (576, "bf16")]


@pytest.mark.parametrize("policy", ["split", "whole"])
@pytest.mark.parametrize("spec", WIDE, ids=_kid)
def test_garbage_past_the_sequence_never_reaches_the_output(spec, policy, device):
    # A page's rows past its sequence, and pages no sequence uses, may hold anything: NaN here.
    q, k, t, sl = _problem([70, 0, 1, 130, 64], 64, 16, 1, 576, torch.bfloat16, device)
    used = torch.zeros(k.shape[0], k.shape[1], dtype=torch.bool, device=device)
    for b, n in enumerate(sl.tolist()):
        for i in range(n):
            used[t[b, i // 64], i % 64] = True
    k[~used] = float("nan")
    _check(q, k, t, sl, 512, spec=spec, policy=policy)


# (the wgmma variant has no page_ahead choice: its cp.async tiles look their pages up as issued)
AHEAD = [(s, {}) for s in WIDE if s.variant == "wgmma"] + [
    (s, {"page_ahead": a}) for s in WIDE if s.variant != "wgmma" for a in (0, 1)
]


@pytest.mark.parametrize("spec,kernel", AHEAD, ids=_kid)
def test_page_lookup_a_tile_ahead(spec, kernel, device):
    # Pages of 32 = two 16-key tiles; several sequences per scheduled part, lengths that end
    # inside a tile, on a tile or page boundary, 0 and 1; table entries past a sequence are -7.
    q, k, t, sl = _problem([70, 0, 1, 130, 32, 48], 32, 4, 1, 576, torch.bfloat16, device)
    _check(q, k, t, sl, 512, spec=spec, block_n=16, **kernel)


KV_HEAD_CASES = [(2, 4, 1), (3, 9, 2), (8, 8, 1), (2, 6, 4)]  # (h_kv, h_q, s_q)


@pytest.mark.parametrize("policy", ["split", "whole"])
@pytest.mark.parametrize("h_kv,h_q,s_q", KV_HEAD_CASES)
@pytest.mark.parametrize("spec", [s for s in VARIANTS if s.head_dim == 576] or [None], ids=_kid)
def test_several_kv_heads(spec, h_kv, h_q, s_q, policy, device):
    """FlashMLA's several KV heads: query head h reads KV head h // (h_q / h_kv); unequal
    lengths with 0 and 1, causal rows, both schedules, every variant."""
    if spec is None:
        pytest.skip("no 576-wide variant on this target")
    dtype = DTYPES[spec.dtype]
    q, k, t, sl = _problem([70, 0, 1, 130], 16, h_q, s_q, 576, dtype, device, seed=h_kv, h_kv=h_kv)
    _check(q, k, t, sl, 512, causal=True, spec=spec, policy=policy)


def test_several_kv_heads_through_the_op(device):
    q, k, t, sl = _problem([300, 0, 17], 64, 16, 2, 576, torch.bfloat16, device, h_kv=4)
    _check(q, k, t, sl, 512, causal=True)


def test_metadata_filled_by_the_first_call(device):
    """FlashMLA's newer form: get_mla_metadata() is empty, the first decode fills it (the same
    schedule as the seed form's), later calls with the same arguments reuse it, a call with
    other shapes is refused, and the seed form's tensors still work."""
    from kvgen.ops import MLASchedMeta

    q, k, t, sl = _problem([70, 0, 130], 16, 4, 2, 576, torch.bfloat16, device, h_kv=2)
    sched, none = get_mla_metadata()
    assert isinstance(sched, MLASchedMeta) and none is None and sched.config is None
    out, lse = flash_mla_with_kvcache(q, k, t, sl, 512, sched, None, causal=True)
    meta, splits = get_mla_metadata(sl, 2 * 4 // 2, 2)
    assert torch.equal(sched.tile_scheduler_metadata, meta) and torch.equal(
        sched.num_splits, splits
    )
    first = sched.tile_scheduler_metadata
    out2, lse2 = flash_mla_with_kvcache(q, k, t, sl, 512, sched, None, causal=True)
    assert sched.tile_scheduler_metadata is first  # reused, not recomputed
    want_out, want_lse = flash_mla_with_kvcache(q, k, t, sl, 512, meta, splits, causal=True)
    for a in (out, out2):
        assert torch.equal(a, want_out)
    for a in (lse, lse2):
        assert torch.equal(a, want_lse)
    with pytest.raises(ValueError, match="causal False \\(was True\\)"):
        flash_mla_with_kvcache(q, k, t, sl, 512, sched, None, causal=False)
    with pytest.raises(ValueError, match="num_splits must be None"):
        flash_mla_with_kvcache(q, k, t, sl, 512, sched, splits)
    with pytest.raises(TypeError, match="num_splits is None"):
        flash_mla_with_kvcache(q, k, t, sl, 512, meta, None)


@pytest.mark.parametrize("page", [1, 5, 64, 256])
def test_page_sizes(page, device):
    q, k, t, sl = _problem([300, 17, 64], page, 2, 1, 576, torch.bfloat16, device, seed=page)
    _check(q, k, t, sl, 512)


@pytest.mark.parametrize("spec", VARIANTS, ids=_kid)
def test_a_cache_of_one_block(spec, device):
    """num_blocks 1, an integer argument the GPU compiler takes as the constant 1: a full page,
    one key and none, every sequence on that block."""
    q, k, t, sl = _problem([64, 1, 0], 64, 16, 1, spec.head_dim, DTYPES[spec.dtype], device)
    k = k[:1].contiguous()
    t = torch.zeros_like(t[:, :1])
    _check(q, k, t, sl, spec.head_dim_v, spec=spec)


@pytest.mark.parametrize("s_q,h_q", [(1, 1), (2, 3), (4, 8), (8, 2)])
def test_speculative_rows_causal(s_q, h_q, device):
    q, k, t, sl = _problem([1, 9, 150, 3], 16, h_q, s_q, 576, torch.bfloat16, device, seed=s_q)
    _check(q, k, t, sl, 512, causal=True)


def test_heads_not_a_multiple_of_the_tile_and_custom_scale(device):
    q, k, t, sl = _problem([200, 40], 64, 22, 1, 288, torch.float16, device, seed=3)
    _check(q, k, t, sl, 256, scale=0.05)


def test_bad_arguments(device):
    q, k, t, sl = _problem([20, 5], 16, 2, 1, 576, torch.bfloat16, device)
    meta, splits = get_mla_metadata(sl, 2, 1)

    def call(**kw):
        args = (
            dict(
                q=q,
                k_cache=k,
                block_table=t,
                cache_seqlens=sl,
                head_dim_v=512,
                tile_scheduler_metadata=meta,
                num_splits=splits,
            )
            | kw
        )
        return flash_mla_with_kvcache(**args)

    with pytest.raises(ValueError, match="head_dim mismatch"):
        call(q=q[..., :512].contiguous())
    with pytest.raises(ValueError, match=r"num_heads_k \(k_cache's dim 2, 3\) must divide"):
        call(k_cache=k.expand(-1, -1, 3, -1))
    with pytest.raises(TypeError, match="is no cache format for q torch.bfloat16"):
        call(k_cache=k.half())
    with pytest.raises(ValueError, match="computed for other seqlens"):
        call(num_splits=get_mla_metadata(torch.cat([sl, sl]), 2, 1)[1])
    with pytest.raises(TypeError, match="block_table must have dtype"):
        call(block_table=t.long())
    bad = t.clone()
    bad[1, 0] = k.shape[0] + 5
    with pytest.raises(ValueError, match=r"block_table\[1, 0\]"):
        call(block_table=bad, check_block_table=True)
    # Widths the decode does not take: a plain ValueError that says which it takes.
    with pytest.raises(
        ValueError,
        match=r"head_dim 576 / head_dim_v 500 is not supported.*"
        r"power of two.*576/512",
    ) as info:
        call(head_dim_v=500)
    assert type(info.value) is ValueError


def test_hopper_variant_is_chosen_only_where_it_applies_and_was_tuned(tmp_path, monkeypatch):
    import json

    from kvgen import configs
    from kvgen.families.mla_decode import MLADecodeSpec
    from kvgen.ops._mla_choice import _split_policy
    from kvgen.ops._mla_choice import choose as _choose

    monkeypatch.setenv(configs.OVERRIDE_ENV, str(tmp_path))
    monkeypatch.setattr(configs, "tuned_configs_dir", lambda: tmp_path / "none")
    configs.reset()
    k = torch.empty(8, 64, 1, 576, dtype=torch.bfloat16)
    pick = lambda k, arch="sm90": _choose(MLADecodeSpec, 576, 512, "bf16", arch, "gpu", k, 16)  # noqa: E731
    assert pick(k).variant == "portable"  # not tuned: never chosen blind
    wgmma = MLADecodeSpec(576, 512, "bf16", "wgmma", "sm90", "gpu")
    # (a tuned entry holds the variant's own meta-parameters only)
    meta = {"block_n": 64, "num_stages": 2, "split_factor": 4}
    doc = {
        "schema_version": 1,
        "family": "mla_decode",
        "env": {
            "arch": "sm90",
            "cuda": "x",
            "device": "x",
            "kvgen": "x",
            "torch": torch.__version__,
            "triton": __import__("triton").__version__,
        },
        "provenance": {"date": "x", "sampler": "tpe", "trials": 1},
        "entries": {
            wgmma.name: {"rows=16": {"meta": meta, "time_us": 1.0, "default_time_us": 2.0}}
        },
    }
    (tmp_path / "sm90").mkdir()
    (tmp_path / "sm90" / "mla_decode.json").write_text(json.dumps(doc))
    assert _split_policy("sm90", "gpu", 16) == (2, "split")  # the template default, untuned
    configs.reset()
    # The Gluon (wgmma) variant: where tuned and cp.async's 16-byte pieces fit the cache.
    assert pick(k).variant == "wgmma"
    assert configs.meta_params(wgmma, rows=16) == meta
    # get_mla_metadata's split policy: the tuned one of the variant measured fastest, and whole
    # sequences where that costs little (its split kernel writes them out itself)
    assert _split_policy("sm90", "gpu", 16) == (4, "auto")
    assert _split_policy("sm90", "gpu", 128) == (4, "auto")  # nearest bucket
    assert _split_policy("sm80", "gpu", 16) == (2, "split")  # nothing tuned for sm80
    strided = torch.empty(8, 64, 2, 576, dtype=torch.bfloat16)[:, :, :1]
    assert pick(strided).variant == "wgmma"  # any row stride that keeps rows 16-byte aligned
    assert pick(torch.empty(8, 48, 1, 576, dtype=torch.bfloat16)).variant == "wgmma"  # any page
    odd = torch.empty(8, 64, 1, 580, dtype=torch.bfloat16)[..., 1:577]
    assert pick(odd).variant == "portable"  # rows 2 bytes off 16-byte alignment
    assert pick(k, arch="sm80").variant == "portable"
    # A faster tuned portable entry wins, with its split policy.
    portable = MLADecodeSpec(576, 512, "bf16", "portable", "sm90", "gpu")
    p_meta = portable.default_meta(rows=16) | {"split_factor": 1}
    doc["entries"][portable.name] = {
        "rows=16": {"meta": p_meta, "time_us": 0.5, "default_time_us": 0.6}
    }
    (tmp_path / "sm90" / "mla_decode.json").write_text(json.dumps(doc))
    configs.reset()
    assert pick(k).variant == "portable"
    assert _split_policy("sm90", "gpu", 16) == (1, "split")
    configs.reset()
