"""Per-token-head KV-cache stores with the APIs of vLLM's Triton ops, and their reader."""

from __future__ import annotations

from collections.abc import Callable
from functools import cache

import torch

from kvgen import _dtypes, runtime
from kvgen._math import cdiv
from kvgen.codegen import load
from kvgen.families.per_token_head import (
    INT4_CHANNELS,
    StoreKVInt4Spec,
    StoreKVPerTokenHeadSpec,
    int4_channels_for,
    row_align,
)
from kvgen.formats.per_token_head import INT4_LEVELS
from kvgen.ops import _checks as check
from kvgen.ops._library import define, nothing

_FLOATS = (torch.bfloat16, torch.float16, torch.float32)
_QUANT_FORMATS = {dt: fmt for fmt, dt in _dtypes.CACHE.items() if fmt != "int4"}


def _check_kv(key, value, slot_mapping):
    key = check.tensor("key", key)
    value = check.tensor("value", value)
    check.dtype("key", key, _FLOATS)
    if value.dtype != key.dtype:
        raise TypeError(f"value must have key's dtype {key.dtype}; got {value.dtype}")
    check.ndim("key", key, 3, "[num_tokens, num_kv_heads, head_size]")
    check.ndim("value", value, 3, "[num_tokens, num_kv_heads, head_size_v]")
    if value.shape[:2] != key.shape[:2]:
        raise ValueError(
            f"key {tuple(key.shape)} and value {tuple(value.shape)} must agree on "
            "[num_tokens, num_kv_heads]"
        )
    for name, t in (("key", key), ("value", value)):
        if t.shape[2] > 1 and t.stride(2) != 1:
            raise ValueError(f"{name} must have a unit stride in its last dimension")
    slots = check.tensor("slot_mapping", slot_mapping)
    check.dtype("slot_mapping", slots, (torch.int32, torch.int64))
    check.ndim("slot_mapping", slots, 1, "[num_tokens]")
    if slots.shape[0] != key.shape[0]:
        raise ValueError(
            f"slot_mapping has {slots.shape[0]} entries but key has {key.shape[0]} tokens"
        )
    return key, value, slots


def _check_cache(name, cache_t, num_heads, width, width_doc, like=None):
    cache_t = check.tensor(name, cache_t)
    check.ndim(name, cache_t, 4, "[num_blocks, block_size, num_kv_heads, head]")
    if cache_t.shape[2] != num_heads:
        raise ValueError(f"{name} has {cache_t.shape[2]} kv heads but key has {num_heads}")
    if cache_t.shape[3] != width:
        raise ValueError(f"{name} head is {cache_t.shape[3]} wide; expected {width_doc}")
    if cache_t.shape[3] > 1 and cache_t.stride(3) != 1:
        raise ValueError(f"{name} head dimension must be contiguous (unit last stride)")
    if like is not None and cache_t.shape[:2] != like.shape[:2]:
        raise ValueError(
            f"{name} has [num_blocks, block_size] {tuple(cache_t.shape[:2])} but key_cache has "
            f"{tuple(like.shape[:2])}"
        )
    num_slots = cache_t.shape[0] * cache_t.shape[1]
    if num_slots >= 2**31:
        raise ValueError(f"{name} has {num_slots} slots; kvgen supports fewer than 2^31")
    return cache_t


def _check_scales(name, scales, like, num_heads, groups, dtype):
    scales = check.tensor(name, scales)
    if scales.dtype != dtype:
        raise TypeError(f"{name} must have dtype {dtype}; got {scales.dtype}")
    want = (*like.shape[:2], num_heads) + ((groups,) if groups is not None else ())
    if tuple(scales.shape) != want:
        raise ValueError(f"{name} must have shape {want}; got {tuple(scales.shape)}")
    return scales


@cache
def _variant(cls, fmt, head_size, head_size_v, dtype, device):
    """The spec and launcher of one specialisation (built once, not on every call)."""
    arch, target = runtime.target_of(device)
    spec = cls(fmt, head_size, head_size_v, _dtypes.NAME[dtype], arch, target)
    return spec, load(spec).launch


def _launch(cls, fmt, key, value, caches, slots, device) -> None:
    """Launch the store of ``cls`` once every argument has been checked."""
    if key.shape[0] == 0 or caches[0].shape[0] * caches[0].shape[1] == 0:  # (no slot: skipped)
        return
    spec, launch = _variant(cls, fmt, key.shape[2], value.shape[2], key.dtype, device)
    align = row_align(caches[0], caches[1])
    meta = runtime.meta_params(
        spec, num_tokens=key.shape[0], num_heads=key.shape[1], row_align=align
    )
    launch(key, value, *caches, slots, **meta)


def _device(key, value, caches, slots):
    return check.same_device(
        key=key,
        value=value,
        key_cache=caches[0],
        value_cache=caches[1],
        k_scale_cache=caches[2],
        v_scale_cache=caches[3],
        slot_mapping=slots,
    )


def _check_quant(key, value, key_cache, value_cache, k_scale_cache, v_scale_cache, slot_mapping):
    """Every check of the int8 / fp8 store: (format, checked caches, device), or an error."""
    key, value, slots = _check_kv(key, value, slot_mapping)
    _, num_heads, head_size = key.shape
    head_size_v = value.shape[2]
    kc = check.tensor("key_cache", key_cache)
    fmt = _QUANT_FORMATS.get(kc.dtype)
    if fmt is None:
        raise ValueError(
            f"key_cache dtype {kc.dtype} is not a per-token-head format; supported: "
            f"{', '.join(str(d) for d in _QUANT_FORMATS)} (uint8 int4 caches go to "
            "triton_reshape_and_cache_flash_int4_per_token_head)"
        )
    kc = _check_cache("key_cache", kc, num_heads, head_size, f"head_size {head_size}")
    vc = _check_cache(
        "value_cache", value_cache, num_heads, head_size_v, f"head_size_v {head_size_v}", like=kc
    )
    if vc.dtype != kc.dtype:
        raise TypeError(f"value_cache must have key_cache's dtype {kc.dtype}; got {vc.dtype}")
    ks = _check_scales("k_scale_cache", k_scale_cache, kc, num_heads, None, torch.float32)
    vs = _check_scales("v_scale_cache", v_scale_cache, kc, num_heads, None, torch.float32)
    caches = (kc, vc, ks, vs)
    return fmt, caches, _device(key, value, caches, slots)


_STORE_SCHEMA = (
    "(Tensor key, Tensor value, Tensor(a!) key_cache, Tensor(b!) value_cache, "
    "Tensor(c!) k_scale_cache, Tensor(d!) v_scale_cache, Tensor slot_mapping) -> ()"
)


def _define_store(name: str, check_args, cls):
    """The operator ``kvgen::<name>``: ``check_args`` returns (the spec's first field, the
    checked caches, their device) or raises; the real implementation then launches ``cls``'s
    kernel."""

    def run(checked, key, value, *rest):
        first, caches, device = checked
        _launch(cls, first, key, value, caches, rest[-1], device)

    return define(name + _STORE_SCHEMA, check_args, run, nothing)


def _public_store(op: Callable, name: str, doc: str) -> Callable:
    """The seed op ``name``: vLLM's argument list, calling the store operator ``op``."""

    def store(
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        k_scale_cache: torch.Tensor,
        v_scale_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        op(key, value, key_cache, value_cache, k_scale_cache, v_scale_cache, slot_mapping)

    store.__name__ = store.__qualname__ = name
    store.__doc__ = doc
    return store


_quant_op = _define_store(
    "reshape_and_cache_flash_per_token_head_quant", _check_quant, StoreKVPerTokenHeadSpec
)


triton_reshape_and_cache_flash_per_token_head_quant = _public_store(
    _quant_op,
    "triton_reshape_and_cache_flash_per_token_head_quant",
    """Quantize key/value per (token, head) and write them into the paged caches.

    One scale ``max(amax / QMAX, 1e-6)`` per (token, head), stored as fp32 in
    ``k_scale_cache`` / ``v_scale_cache`` ``[num_blocks, block_size, num_kv_heads]``. The cache
    dtype picks the format: int8 (QMAX 127), float8_e4m3fn (448) or float8_e5m2 (57344).
    Caches are ``[num_blocks, block_size, num_kv_heads, head]`` views with any strides and a
    unit last stride (HND memory passes as ``cache.permute(0, 2, 1, 3)``); negative slots are
    skipped. The op is ``torch.ops.kvgen.reshape_and_cache_flash_per_token_head_quant`` (the
    four caches mutated).
    """,
)


def _check_int4(key, value, key_cache, value_cache, k_scale_cache, v_scale_cache, slot_mapping):
    """Every check of the int4 store: (channels per scale, checked caches, device), or an
    error."""
    key, value, slots = _check_kv(key, value, slot_mapping)
    _, num_heads, head_size = key.shape
    head_size_v = value.shape[2]
    kc = check.tensor("key_cache", key_cache)
    vc = check.tensor("value_cache", value_cache)
    for name, t in (("key_cache", kc), ("value_cache", vc)):
        if t.dtype != torch.uint8:
            raise TypeError(f"{name} must have dtype torch.uint8 (packed int4); got {t.dtype}")
    packed, packed_v = cdiv(head_size, 2), cdiv(head_size_v, 2)
    kc = _check_cache("key_cache", kc, num_heads, packed, f"ceil({head_size} / 2) = {packed}")
    vc = _check_cache(
        "value_cache", vc, num_heads, packed_v, f"ceil({head_size_v} / 2) = {packed_v}", like=kc
    )
    ks = check.tensor("k_scale_cache", k_scale_cache)
    check.ndim("k_scale_cache", ks, 4, "[num_blocks, block_size, num_kv_heads, groups]")
    groups = ks.shape[3]
    channels = int4_channels_for(head_size, groups)
    if channels is None:
        options = ", ".join(f"{cdiv(head_size, c)} (C={c})" for c in INT4_CHANNELS)
        raise ValueError(
            f"k_scale_cache has {groups} scale groups per head; head_size {head_size} allows "
            f"{options}"
        )
    ks = _check_scales("k_scale_cache", ks, kc, num_heads, groups, torch.float16)
    vs = _check_scales(
        "v_scale_cache", v_scale_cache, kc, num_heads, cdiv(head_size_v, channels), torch.float16
    )
    caches = (kc, vc, ks, vs)
    return channels, caches, _device(key, value, caches, slots)


_int4_op = _define_store(
    "reshape_and_cache_flash_int4_per_token_head", _check_int4, StoreKVInt4Spec
)


triton_reshape_and_cache_flash_int4_per_token_head = _public_store(
    _int4_op,
    "triton_reshape_and_cache_flash_int4_per_token_head",
    """Quantize key/value to packed int4 with Gaussian-friendly levels.

    Caches are uint8 ``[num_blocks, block_size, num_kv_heads, ceil(head_size / 2)]`` (channel
    2i in the low nibble of byte i); scales are fp16 ``[num_blocks, block_size, num_kv_heads,
    ceil(head_size / C)]``, one per group of C channels, C in 16, 32, 64, 128 chosen by that
    last dimension (32 is vLLM's default). The op is
    ``torch.ops.kvgen.reshape_and_cache_flash_int4_per_token_head`` (the four caches mutated).
    """,
)


@cache
def _int4_levels(device: torch.device) -> torch.Tensor:
    # one copy per device, made on first use (a copy from the host cannot be graph-captured)
    return torch.tensor(INT4_LEVELS, dtype=torch.float32, device=device)


def _read(cache_t, scales, slots, head_size, out_dtype):
    num_slots = cache_t.shape[0] * cache_t.shape[1]
    if num_slots == 0:  # no slot at all: every row reads as zeros (and there is none to index)
        shape = (slots.shape[0], cache_t.shape[2], head_size)
        return torch.zeros(shape, dtype=out_dtype, device=cache_t.device)
    s = slots.to(torch.int64)
    valid = (s >= 0) & (s < num_slots)
    s = torch.where(valid, s, 0)
    block, row = s // cache_t.shape[1], s % cache_t.shape[1]
    q, sc = cache_t[block, row], scales[block, row].float()
    if cache_t.dtype == torch.uint8:
        q = q.to(torch.int32)
        codes = torch.stack([q & 0xF, q >> 4], dim=-1).flatten(-2)[..., :head_size]
        levels = _int4_levels(q.device)[codes & 7]
        vals = torch.where(codes >= 8, -levels, levels)
        per = int4_channels_for(head_size, sc.shape[-1])
        vals = vals * sc.repeat_interleave(per, dim=-1)[..., :head_size]
    else:
        vals = q.float() * sc[..., None]
    return torch.where(valid[:, None, None], vals, 0.0).to(out_dtype)


def _check_gather(
    key_cache, value_cache, k_scale_cache, v_scale_cache, slots, head_size, head_size_v, out_dtype
):
    """The reader's checks: [(cache, scales, head size)] for K and V, or an error."""
    slots = check.tensor("slots", slots)
    check.dtype("slots", slots, (torch.int32, torch.int64))
    check.ndim("slots", slots, 1, "[n]")
    if out_dtype not in _FLOATS:
        raise TypeError(f"out_dtype must be one of {_FLOATS}, got {out_dtype}")
    out = []
    for name, c, sc, hs in (
        ("key_cache", key_cache, k_scale_cache, head_size),
        ("value_cache", value_cache, v_scale_cache, head_size_v),
    ):
        c = check.tensor(name, c)
        check.ndim(name, c, 4, "[num_blocks, block_size, num_kv_heads, head]")
        if c.dtype != torch.uint8 and c.dtype not in _QUANT_FORMATS:
            raise TypeError(f"{name} dtype {c.dtype} is not a per-token-head format")
        int4 = c.dtype == torch.uint8
        if hs is None:
            hs = c.shape[3] * 2 if int4 else c.shape[3]
        if (-(-hs // 2) if int4 else hs) != c.shape[3]:
            want = f"ceil(head_size / 2) = {-(-hs // 2)}" if int4 else f"head_size {hs}"
            raise ValueError(f"{name} head is {c.shape[3]} wide; expected {want}")
        sc_name = "k_scale_cache" if name == "key_cache" else "v_scale_cache"
        groups = None
        if int4:
            check.tensor(sc_name, sc)
            check.ndim(sc_name, sc, 4, "[num_blocks, block_size, num_kv_heads, groups]")
            groups = sc.shape[3]
            if int4_channels_for(hs, groups) is None:
                raise ValueError(
                    f"{sc_name} has {groups} scales a head, which no channels-per-scale "
                    f"({', '.join(map(str, INT4_CHANNELS))}) gives for head_size {hs}"
                )
        _check_scales(sc_name, sc, c, c.shape[2], groups, torch.float16 if int4 else torch.float32)
        check.same_device(slots=slots, **{name: c, sc_name: sc})
        out.append((c, sc, hs))
    return out


def _run_gather(kv, key_cache, value_cache, k_scale_cache, v_scale_cache, slots, *rest):
    out_dtype = rest[-1]
    k, v = (_read(c, sc, slots, hs, out_dtype) for c, sc, hs in kv)
    return k, v


def _fake_gather(kv, key_cache, value_cache, k_scale_cache, v_scale_cache, slots, *rest):
    out_dtype = rest[-1]
    k, v = (slots.new_empty(slots.shape[0], c.shape[2], hs, dtype=out_dtype) for c, _, hs in kv)
    return k, v


_gather_op = define(
    "gather_kv_per_token_head(Tensor key_cache, Tensor value_cache, Tensor k_scale_cache, "
    "Tensor v_scale_cache, Tensor slots, int? head_size, int? head_size_v, "
    "ScalarType out_dtype) -> (Tensor, Tensor)",
    _check_gather,
    _run_gather,
    _fake_gather,
)


def gather_kv_per_token_head(
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    k_scale_cache: torch.Tensor,
    v_scale_cache: torch.Tensor,
    slots: torch.Tensor,
    head_size: int | None = None,
    head_size_v: int | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Read the K and V rows of ``slots`` back, dequantized: ``([n, heads, head_size],
    [n, heads, head_size_v])`` of ``out_dtype``; rows of invalid slots are zeros.

    The format follows the cache dtype (int8, fp8 e4m3 / e5m2, or uint8 = int4). For int4 pass
    ``head_size`` / ``head_size_v`` when they are odd (the default is twice the packed width).
    The op is ``torch.ops.kvgen.gather_kv_per_token_head``.
    """
    for name, hs in (("head_size", head_size), ("head_size_v", head_size_v)):
        if hs is not None:
            check.int_arg(name, hs)
    if not isinstance(out_dtype, torch.dtype):
        raise TypeError(f"out_dtype must be a torch.dtype, got {type(out_dtype).__name__}")
    return _gather_op(
        key_cache,
        value_cache,
        k_scale_cache,
        v_scale_cache,
        slots,
        head_size,
        head_size_v,
        out_dtype,
    )
