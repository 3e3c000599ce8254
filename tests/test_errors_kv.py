"""Bad input to the per-token-head stores raises a clear error before any cache byte moves."""

import pytest
import torch

from kvgen.ops import store_kv_int4_per_token_head, store_kv_per_token_head

T, H, D, DV, NB, BS = 4, 2, 64, 80, 3, 8


def _int8(device):
    return dict(
        key=torch.randn(T, H, D, device=device),
        value=torch.randn(T, H, DV, device=device),
        key_cache=torch.zeros(NB, BS, H, D, dtype=torch.int8, device=device),
        value_cache=torch.zeros(NB, BS, H, DV, dtype=torch.int8, device=device),
        k_scale_cache=torch.zeros(NB, BS, H, device=device),
        v_scale_cache=torch.zeros(NB, BS, H, device=device),
        slot_mapping=torch.arange(T, device=device),
    )


def _int4(device):
    return dict(
        key=torch.randn(T, H, D, device=device),
        value=torch.randn(T, H, DV, device=device),
        key_cache=torch.zeros(NB, BS, H, D // 2, dtype=torch.uint8, device=device),
        value_cache=torch.zeros(NB, BS, H, DV // 2, dtype=torch.uint8, device=device),
        k_scale_cache=torch.zeros(NB, BS, H, 2, dtype=torch.float16, device=device),
        v_scale_cache=torch.zeros(NB, BS, H, 3, dtype=torch.float16, device=device),
        slot_mapping=torch.arange(T, device=device),
    )


def _raises(op, args, exc, match, **changes):
    args = dict(args, **changes)
    caches = [args[k] for k in ("key_cache", "value_cache", "k_scale_cache", "v_scale_cache")]
    before = [c.clone() if c.device.type != "meta" else None for c in caches]
    with pytest.raises(exc, match=match):
        op(**args)
    for c, b in zip(caches, before, strict=True):
        if b is not None:
            assert torch.equal(c, b), "a cache changed although the call failed"


def test_int8_fp8_arguments(device):
    a = _int8(device)
    op = store_kv_per_token_head
    _raises(op, a, TypeError, "key must have dtype", key=a["key"].to(torch.int32))
    _raises(op, a, TypeError, "value must have key's dtype", value=a["value"].half())
    _raises(op, a, ValueError, "key must be 3-D", key=a["key"][0])
    _raises(op, a, ValueError, "must agree on", value=a["value"][:, :1])
    _raises(op, a, ValueError, "slot_mapping has 3 entries", slot_mapping=a["slot_mapping"][:3])
    _raises(
        op,
        a,
        ValueError,
        "is not a per-token-head format",
        key_cache=a["key_cache"].half(),
        value_cache=a["value_cache"].half(),
    )
    _raises(
        op,
        a,
        ValueError,
        "key_cache has 1 kv heads but key has 2",
        key_cache=a["key_cache"][:, :, :1],
    )
    _raises(
        op,
        a,
        ValueError,
        "key_cache head is 32 wide; expected head_size 64",
        key_cache=a["key_cache"][..., :32],
    )
    _raises(
        op,
        a,
        ValueError,
        "value_cache head is 64 wide; expected head_size_v 80",
        value_cache=torch.zeros(NB, BS, H, D, dtype=torch.int8, device=device),
    )
    _raises(
        op,
        a,
        TypeError,
        "value_cache must have key_cache's dtype",
        value_cache=a["value_cache"].view(torch.float8_e4m3fn),
    )
    _raises(
        op,
        a,
        ValueError,
        "k_scale_cache must have shape",
        k_scale_cache=torch.zeros(NB, BS, H, 1, device=device),
    )
    _raises(
        op,
        a,
        TypeError,
        "v_scale_cache must have dtype torch.float32",
        v_scale_cache=a["v_scale_cache"].half(),
    )
    _raises(
        op,
        a,
        ValueError,
        "unit last stride",
        key_cache=torch.zeros(NB, BS, H, 2 * D, dtype=torch.int8, device=device)[..., ::2],
    )
    _raises(
        op,
        a,
        ValueError,
        "value_cache has \\[num_blocks, block_size\\]",
        value_cache=torch.zeros(NB + 1, BS, H, DV, dtype=torch.int8, device=device),
    )
    _raises(op, a, ValueError, "slot_mapping is on meta", slot_mapping=a["slot_mapping"].to("meta"))


def test_int4_arguments(device):
    a = _int4(device)
    op = store_kv_int4_per_token_head
    _raises(
        op,
        a,
        ValueError,
        "key_cache head is 64 wide; expected ceil\\(64 / 2\\) = 32",
        key_cache=torch.zeros(NB, BS, H, D, dtype=torch.uint8, device=device),
    )
    _raises(
        op,
        a,
        TypeError,
        "key_cache must have dtype torch.uint8",
        key_cache=a["key_cache"].view(torch.int8),
    )
    _raises(
        op,
        a,
        ValueError,
        "k_scale_cache has 3 scale groups per head",
        k_scale_cache=torch.zeros(NB, BS, H, 3, dtype=torch.float16, device=device),
    )
    _raises(
        op,
        a,
        ValueError,
        "v_scale_cache must have shape",
        v_scale_cache=torch.zeros(NB, BS, H, 2, dtype=torch.float16, device=device),
    )
    _raises(
        op,
        a,
        TypeError,
        "k_scale_cache must have dtype torch.float16",
        k_scale_cache=a["k_scale_cache"].float(),
    )
    _raises(op, a, ValueError, "value_cache is on meta", value_cache=a["value_cache"].to("meta"))
