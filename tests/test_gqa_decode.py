"""flash_attn_with_kvcache (the paged GQA decode) against the float64 reference over the
dequantized caches: every format and layout, GQA groups, page sizes, causal rows, bad block
tables, and the argument checks."""

from __future__ import annotations

import math

import pytest
import torch

from kvgen.families.gqa_decode.verify import make_caches
from kvgen.formats.gqa_decode import gqa_decode
from kvgen.ops import flash_attn_with_kvcache
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


def test_lse_is_optional(device):
    args, kwargs, _ = _case(device, "auto")
    out = flash_attn_with_kvcache(*args, **kwargs)
    assert isinstance(out, torch.Tensor) and out.shape == (4, 1, 4, 128)


@pytest.mark.parametrize("bad", ["page_past_end", "negative_page", "longer_than_table"])
def test_bad_block_table_gives_nan_for_that_sequence_only(device, bad):
    """A page outside the cache, or a length past the table, is never read: that sequence's
    out and lse are NaN, the others exact."""
    args, kwargs, ref_in = _case(device, "int4", 32, seqlens=(40, 33, 50))
    table, sl = kwargs["block_table"].clone(), kwargs["cache_seqlens"].clone()
    num_blocks = args[1].shape[0]
    if bad == "page_past_end":
        table[1, 1] = num_blocks + 99
    elif bad == "negative_page":
        table[1, 0] = -1
    else:
        sl[1] = table.shape[1] * args[1].shape[1] + 5
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
