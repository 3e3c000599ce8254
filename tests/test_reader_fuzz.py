"""The readers (gather_kv_per_token_head, gather_mxfp4_mla, gather_mla_cache) and
get_mla_metadata over hypothesis-generated arguments: each call raises ValueError / TypeError,
or returns the reference's values (fp32 output: exact; rows of negative or out-of-range slots
are zeros; a schedule that covers every key once)."""

from __future__ import annotations

import torch
from _fuzz import fuzz, slots
from hypothesis import event, given
from hypothesis import strategies as st

from kvgen.families.gqa_decode.verify import alloc_caches
from kvgen.families.mla_cache.verify import reference_rows
from kvgen.formats import mla_cache, mxfp4, per_token_head
from kvgen.ops import gather_kv_per_token_head, gather_mla_cache, gather_mxfp4_mla, get_mla_metadata


@fuzz
@given(data=st.data())
def test_gather_kv_per_token_head_raises_or_matches_the_reference(device, data):
    draw = data.draw
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    kv, group = draw(st.sampled_from([("int8", 0), ("fp8e4m3", 0), ("fp8e5m2", 0), ("int4", 32)]))
    heads, d = draw(st.integers(1, 3)), draw(st.sampled_from([16, 64, 80]))
    dv = d if draw(st.booleans()) else 64
    layout = draw(st.sampled_from(["nhd", "hnd", "inline"]))
    if layout == "inline":
        dv = d
    shape = (draw(st.integers(1, 3)), draw(st.sampled_from([1, 4, 16])), heads)
    k, v, ks, vs = alloc_caches(kv, group, shape, d, dv, torch.bfloat16, device, layout)
    tokens = shape[0] * shape[1]
    keys = torch.randn(tokens, heads, d, generator=gen)
    values = torch.randn(tokens, heads, dv, generator=gen)
    per_token_head.store(keys, values, k, v, ks, vs, torch.arange(tokens))  # every slot written
    slot_mapping, kind = slots(draw, draw(st.integers(0, 6)), tokens, gen)
    out_dtype = draw(st.sampled_from([torch.float32, torch.float32, torch.bfloat16, torch.int32]))
    bad = draw(st.sampled_from([None] * 4 + ["scales", "head_size"]))
    args = [k, v, ks.double() if bad == "scales" else ks, vs, slot_mapping.to(device)]
    sizes = dict(head_size=d + 2 if bad == "head_size" else d, head_size_v=dv)
    try:
        got_k, got_v = gather_kv_per_token_head(*args, **sizes, out_dtype=out_dtype)
    except (ValueError, TypeError) as exc:
        assert str(exc)
        event(f"refused: {type(exc).__name__}")
        return
    event(f"read {out_dtype}")
    assert kind != "float" and out_dtype != torch.int32 and bad is None
    if out_dtype != torch.float32:  # (the interpreter's fp32 -> bf16 cast truncates)
        return
    want_k = per_token_head.gather(k.cpu(), ks.cpu(), slot_mapping, d)
    want_v = per_token_head.gather(v.cpu(), vs.cpu(), slot_mapping, dv)
    assert torch.equal(got_k.cpu(), want_k) and torch.equal(got_v.cpu(), want_v)


@fuzz
@given(data=st.data())
def test_gather_mxfp4_mla_raises_or_matches_the_reference(device, data):
    draw = data.draw
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    group = draw(st.sampled_from([16, 32, 64]))
    latent = draw(st.sampled_from([512, 256, 128]))
    blocks, page = draw(st.integers(1, 3)), draw(st.sampled_from([1, 4, 16]))
    row = mxfp4.row_bytes(latent, group)
    cache = torch.zeros(blocks, page, row, dtype=torch.uint8)
    tokens = blocks * page
    mxfp4.store(torch.randn(tokens, latent, generator=gen) * 8, torch.arange(tokens), cache, group)
    slot_mapping, kind = slots(draw, draw(st.integers(0, 6)), tokens, gen)
    bad = draw(st.sampled_from([None] * 4 + ["latent", "group", "out_dtype"]))
    read_latent = latent * 2 if bad == "latent" else latent
    read_group = 48 if bad == "group" else group
    out_dtype = torch.int8 if bad == "out_dtype" else torch.float32
    try:
        got = gather_mxfp4_mla(cache.to(device), slot_mapping.to(device), read_latent, read_group,
                               out_dtype=out_dtype)  # fmt: skip
    except (ValueError, TypeError) as exc:
        assert str(exc)
        event(f"refused: {type(exc).__name__}")
        return
    event("read")
    assert kind != "float" and bad is None
    assert torch.equal(got.cpu(), mxfp4.gather(cache, slot_mapping, latent, group))


@fuzz
@given(data=st.data())
def test_gather_mla_cache_raises_or_matches_the_reference(device, data):
    draw = data.draw
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    fmt = draw(st.sampled_from(["auto", "fp8", "fp8_e4m3", "fp8_ds_mla"]))
    in_dtype = draw(st.sampled_from([torch.bfloat16, torch.float16]))
    blocks, page = draw(st.integers(1, 3)), draw(st.sampled_from([1, 4, 16]))
    gap = draw(st.sampled_from([0, 0, 2]))  # rows between one block's last and the next's first
    row = mla_cache.ds_mla_row_bytes() if fmt == "fp8_ds_mla" else 576
    cache_dtype = {"auto": in_dtype, "fp8_ds_mla": torch.uint8}.get(
        fmt, draw(st.sampled_from([torch.uint8, torch.float8_e4m3fn]))
    )
    backing = torch.zeros(blocks, page + gap, row, dtype=cache_dtype)
    cache = backing[:, :page]
    k_scale = torch.tensor([0.04])
    tokens = blocks * page
    kv_c = (torch.randn(tokens, 512, generator=gen) * 3).to(in_dtype)
    k_pe = torch.randn(tokens, 64, generator=gen).to(in_dtype)
    mla_cache.store(kv_c, k_pe, cache, torch.arange(tokens), fmt, k_scale)
    slot_mapping, kind = slots(draw, draw(st.integers(0, 6)), tokens, gen)
    bad = draw(
        st.sampled_from([None] * 5 + ["format", "latent", "scale", "out_dtype", "cache_dtype"])
    )
    scale = k_scale
    if bad == "scale":  # two values, or none where fp8 needs one
        scale = torch.ones(2) if fmt != "auto" and draw(st.booleans()) else None
    out_dtype = torch.int32 if bad == "out_dtype" else torch.float32
    read_cache = cache
    if bad == "cache_dtype":  # the same bytes as another dtype
        read_cache = cache.view(torch.int16 if fmt == "auto" else torch.int8)
    args = dict(
        kv_cache_dtype="fp8_e5m2" if bad == "format" else fmt,
        scale=None if scale is None else scale.to(device),
        latent=500 if bad == "latent" else 512,
        out_dtype=out_dtype,
    )
    device_backing = backing.to(device)
    view = device_backing[:, :page].view(read_cache.dtype)
    try:
        got = gather_mla_cache(view, slot_mapping.to(device), **args)
    except (ValueError, TypeError) as exc:
        assert str(exc)
        event(f"refused: {type(exc).__name__} {str(exc)[:60]}")
        return
    # a reader writes no cache byte
    assert torch.equal(device_backing.cpu().view(torch.uint8), backing.view(torch.uint8))
    event(f"read {fmt}")
    harmless = bad is None or (bad == "scale" and fmt in ("auto", "fp8_ds_mla"))
    assert kind != "float" and harmless, (bad, kind)
    if fmt == "auto":
        rows = cache.reshape(tokens, 576).float()
        want = torch.zeros(slot_mapping.shape[0], 576)
        s = slot_mapping.long()
        valid = (s >= 0) & (s < tokens)
        want[valid] = rows[(s[valid] // page) * page + s[valid] % page]
    else:
        want = reference_rows(fmt, cache, slot_mapping, k_scale)
    assert torch.equal(got.cpu(), want)


@fuzz
@given(data=st.data())
def test_get_mla_metadata_raises_or_schedules_every_key_once(device, data):
    """get_mla_metadata over generated lengths and head counts, right and wrong: a clear error,
    or a schedule whose parts cover each sequence's keys exactly once, in order."""
    draw = data.draw
    batch = draw(st.integers(0, 6))
    lengths = draw(st.lists(st.integers(0, 5000), min_size=batch, max_size=batch))
    dtype = draw(st.sampled_from([torch.int32, torch.int32, torch.int64, torch.float32]))
    seqlens = torch.tensor(lengths, dtype=dtype)
    if draw(st.booleans()) and batch:
        seqlens = seqlens.reshape(batch, 1)  # not [batch]
    rows = draw(st.sampled_from([1, 16, 64, 128, 0, -4]))
    heads_k = draw(st.sampled_from([1, 1, 2, 0]))
    try:
        meta, splits = get_mla_metadata(seqlens.to(device), rows, heads_k)
    except (ValueError, TypeError) as exc:
        assert str(exc)
        event(f"refused: {type(exc).__name__}")
        return
    event("scheduled")
    assert dtype != torch.float32 and seqlens.ndim == 1 and rows > 0 and heads_k > 0
    assert splits.dtype == torch.int32 and tuple(splits.shape) == (batch + 1,)
    assert covered_keys(meta.cpu(), lengths) == [list(range(n)) for n in lengths]


def covered_keys(meta: torch.Tensor, lengths: list[int]) -> list[list[int]]:
    """Each sequence's keys as the decode's parts walk them (its ``key_range``), sorted, with
    any key walked twice listed twice."""
    from kvgen.families.mla_decode import SCHED_BLOCK

    keys = [[] for _ in lengths]
    for b0, k0, b1, k1 in meta[:, :4].tolist():
        for b in range(b0, b1 + 1):
            lo = (k0 if b == b0 else 0) * SCHED_BLOCK
            units = k1 if b == b1 else -(-lengths[b] // SCHED_BLOCK)
            keys[b] += range(lo, min(units * SCHED_BLOCK, lengths[b]))
    return [sorted(k) for k in keys]
