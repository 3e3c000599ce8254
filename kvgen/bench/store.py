"""``kvgen bench`` for the store ops: achieved bandwidth against the same run's copy ceilings."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import torch

from kvgen import _dtypes
from kvgen._math import cdiv
from kvgen.bench import harness
from kvgen.bench._floor_kernel import scatter_rows

TOKENS = (1, 16, 256, 4096, 65536)
BLOCK_SIZE = 64
# The tokens a correctness check covers at most (a prefix of the set's): the reference runs on
# the CPU (the MXFP4 store's took 2.3 s at 65536 tokens). 4096 and 65536 tokens compile to the
# same binaries (Triton specialises a size by its divisibility by 16).
CHECK_TOKENS = 4096
#: how a case's tokens map to cache slots: "random" (a random choice of the cache's slots, as
#: decode steps of many sequences write them; what ``kvgen bench`` times), "sequential" (slot
#: i for token i, as one prefill of a fresh sequence into a fresh cache writes them) or "paged"
#: (whole pages drawn at random from the cache, each filled in token order: a prefill as a
#: paged engine writes it, its sequence's pages taken from the free pool)
SLOT_ORDERS = ("random", "sequential", "paged")


def check_slot_order(order: str, name: str = "slot order") -> None:
    """Raise ValueError naming ``name`` unless ``order`` is one of ``SLOT_ORDERS``."""
    if order not in SLOT_ORDERS:
        raise ValueError(f"{name} must be one of {', '.join(SLOT_ORDERS)}, got {order!r}")


def slot_mapping(
    t: int, num_slots: int, device, order: str = "random", page: int = 1
) -> torch.Tensor:
    """``t`` distinct slots of a cache of ``num_slots`` slots (pages of ``page`` slots, for the
    "paged" order), in ``order`` (``SLOT_ORDERS``)."""
    check_slot_order(order)
    if t > num_slots:
        raise ValueError(f"{t} tokens do not fit {num_slots} slots")
    if order == "sequential":
        return torch.arange(t, device=device)
    if order == "paged":
        if page < 1 or num_slots % page:
            raise ValueError(f"{num_slots} slots are not whole pages of {page}")
        pages = torch.randperm(num_slots // page, device=device)[: cdiv(t, page)]
        offsets = torch.arange(page, device=device)
        return (pages[:, None] * page + offsets).flatten()[:t]
    return torch.randperm(num_slots, device=device)[:t]


@dataclasses.dataclass
class Row:
    op: str
    variant: str
    num_tokens: int
    bytes: int  # fewest bytes moved: inputs read once (latents, slots) + rows written once
    graph_us: float
    eager_us: float
    copy_graph_us: float  # a torch copy moving the same number of bytes (read + write)
    gbps: float = 0.0
    bw_ratio: float = 0.0  # achieved / copy bandwidth of the same run
    latency_ratio: float = 0.0  # graph time / same-bytes copy graph time
    correct: bool = False
    default_graph_us: float | None = None  # the template's defaults instead of tuned configs
    # the store's floor (``_floor_kernel``: its bytes between the same addresses, no format
    # arithmetic) in the same run, where the op has one: its time and its fraction of copy
    floor_graph_us: float | None = None
    floor_bw_ratio: float | None = None


@dataclasses.dataclass
class Case:
    """One op at one size: a step over rotated buffer sets, and a correctness check."""

    op: str
    variant: str
    num_tokens: int
    bytes: int
    n_sets: int
    step: Callable[[int], None]
    check: Callable[[], bool]
    data: list | None = None  # the rotated input sets, for callers that launch themselves
    floor: Callable[[int], None] | None = None  # the same bytes moved without the format's math


def mxfp4_cases(device, tokens=TOKENS, latent=512, group=32, dtype=torch.bfloat16,
                slot_order="random"):  # fmt: skip
    """``store_mxfp4_mla`` of ``t`` tokens into slots in ``slot_order`` (``SLOT_ORDERS``)."""
    from kvgen.families.mxfp4_mla import StoreMXFP4MLASpec
    from kvgen.formats import MXFP4, mxfp4
    from kvgen.ops import store_mxfp4_mla
    from kvgen.runtime import target_of

    arch, target = target_of(torch.device(device))
    name = StoreMXFP4MLASpec(group, latent, _dtypes.NAME[dtype], "paged", arch, target).name
    pitch = MXFP4.row_bytes(latent, group)
    for t in tokens:
        blocks = cdiv(t, BLOCK_SIZE) + 1
        in_bytes = t * latent * dtype.itemsize + t * 8
        out_bytes = t * pitch
        n_sets = harness.sets_for(in_bytes + blocks * BLOCK_SIZE * pitch)
        xs = [torch.randn(t, latent, device=device).to(dtype) for _ in range(n_sets)]
        caches = [
            torch.zeros(blocks, BLOCK_SIZE, pitch, dtype=torch.uint8, device=device)
            for _ in range(n_sets)
        ]
        slots = [
            slot_mapping(t, blocks * BLOCK_SIZE, device, slot_order, BLOCK_SIZE)
            for _ in range(n_sets)
        ]

        def step(i, xs=xs, slots=slots, caches=caches):
            store_mxfp4_mla(xs[i], slots[i], caches[i], group)

        def floor(i, xs=xs, slots=slots, caches=caches):
            scatter_rows(xs[i], slots[i], caches[i], pitch)

        def check(xs=xs, slots=slots, caches=caches, t=t, latent=latent):
            x = torch.randn(t, latent, device=device).to(dtype)  # fresh data, not the timed set
            caches[0].fill_(0xFF)
            store_mxfp4_mla(x, slots[0], caches[0], group)
            ref = torch.full(caches[0].shape, 0xFF, dtype=torch.uint8)
            mxfp4.store(x.cpu(), slots[0].cpu(), ref, group)
            return bool(torch.equal(caches[0].cpu(), ref))

        yield Case(
            "store_mxfp4_mla",
            name,
            t,
            in_bytes + out_bytes,
            n_sets,
            step,
            check,
            data=list(zip(xs, slots, caches, strict=True)),
            floor=floor if pitch % 4 == 0 else None,
        )


def mla_cache_cases(device, tokens=TOKENS, fmt="fp8_ds_mla", dtype=torch.bfloat16,
                    slot_order="random"):  # fmt: skip
    """``concat_and_cache_mla`` of ``t`` tokens (512 latent + 64 RoPE channels) into slots in
    ``slot_order`` (``SLOT_ORDERS``; bytes: kv_c, k_pe and slots read, the rows written)."""
    from kvgen.families.mla_cache import ConcatAndCacheMLASpec
    from kvgen.formats import mla_cache
    from kvgen.ops import concat_and_cache_mla
    from kvgen.runtime import target_of

    arch, target = target_of(torch.device(device))
    spec = ConcatAndCacheMLASpec(fmt, 512, 64, _dtypes.NAME[dtype], arch, target)
    elem = dtype if fmt == "auto" else torch.uint8
    width = spec.row_bytes // elem.itemsize
    rope_bytes = 64 * (1 if fmt in ("fp8", "fp8_e4m3") else 2)  # the row's last bytes
    scale = torch.tensor([0.05], device=device)
    for t in tokens:
        blocks = cdiv(t, BLOCK_SIZE) + 1
        in_bytes = t * 576 * dtype.itemsize + t * 8
        n_sets = harness.sets_for(in_bytes + blocks * BLOCK_SIZE * spec.row_bytes)
        kvs = [torch.randn(t, 512, device=device).to(dtype) for _ in range(n_sets)]
        pes = [torch.randn(t, 64, device=device).to(dtype) for _ in range(n_sets)]
        caches = [
            torch.zeros(blocks, BLOCK_SIZE, width, dtype=elem, device=device) for _ in range(n_sets)
        ]
        slots = [
            slot_mapping(t, blocks * BLOCK_SIZE, device, slot_order, BLOCK_SIZE)
            for _ in range(n_sets)
        ]

        def step(i, kvs=kvs, pes=pes, caches=caches, slots=slots):
            concat_and_cache_mla(kvs[i], pes[i], caches[i], slots[i], fmt, scale)

        def floor(i, kvs=kvs, pes=pes, caches=caches, slots=slots):
            row = caches[i].view(torch.uint8)
            scatter_rows(kvs[i], slots[i], row, spec.row_bytes - rope_bytes)
            scatter_rows(pes[i], slots[i], row[..., spec.row_bytes - rope_bytes :], rope_bytes)

        def check(caches=caches, slots=slots, t=t):
            kv, pe = torch.randn(t, 512, device=device).to(dtype), torch.randn(t, 64).to(dtype)
            pe = pe.to(device)
            caches[0].zero_()
            concat_and_cache_mla(kv, pe, caches[0], slots[0], fmt, scale)
            want = torch.zeros_like(caches[0], device="cpu")
            mla_cache.store(kv.cpu(), pe.cpu(), want, slots[0].cpu(), fmt, scale.cpu())
            return bool(torch.equal(caches[0].cpu(), want))

        data = list(zip(kvs, pes, caches, slots, strict=True))
        moved = in_bytes + t * spec.row_bytes
        yield Case("concat_and_cache_mla", spec.name, t, moved, n_sets, step, check, data, floor)


def mxfp4_gather_cases(device, tokens=TOKENS, latent=512, group=32, dtype=torch.bfloat16):
    """The reader: ``gather_mxfp4_mla`` of ``t`` random slots of a filled cache (bytes: slots
    and the rows read, the dequantized rows written)."""
    from kvgen.families.mxfp4_mla import GatherMXFP4MLASpec
    from kvgen.formats import MXFP4, mxfp4
    from kvgen.ops import gather_mxfp4_mla
    from kvgen.runtime import target_of

    arch, target = target_of(torch.device(device))
    name = GatherMXFP4MLASpec(group, latent, _dtypes.NAME[dtype], "paged", arch, target).name
    pitch = MXFP4.row_bytes(latent, group)
    for t in tokens:
        blocks = cdiv(t, BLOCK_SIZE) + 1
        in_bytes = t * 8 + t * pitch
        out_bytes = t * latent * dtype.itemsize
        n_sets = harness.sets_for(blocks * BLOCK_SIZE * pitch + out_bytes)
        caches = []
        for _ in range(n_sets):
            c = torch.randint(0, 256, (blocks, BLOCK_SIZE, pitch), dtype=torch.uint8)
            c[..., latent // 2 :] = torch.randint(
                100, 150, c[..., latent // 2 :].shape, dtype=torch.uint8
            )  # sane scales
            caches.append(c.to(device))
        slots = [torch.randperm(blocks * BLOCK_SIZE, device=device)[:t] for _ in range(n_sets)]

        def step(i, slots=slots, caches=caches):
            gather_mxfp4_mla(caches[i], slots[i], latent, group, dtype)

        def check(slots=slots, caches=caches):
            got = gather_mxfp4_mla(caches[0], slots[0], latent, group, dtype).cpu()
            want = mxfp4.gather(caches[0].cpu(), slots[0].cpu(), latent, group).to(dtype)
            return bool(torch.equal(got, want))

        yield Case(
            "gather_mxfp4_mla",
            name,
            t,
            in_bytes + out_bytes,
            n_sets,
            step,
            check,
            data=list(zip(caches, slots, strict=True)),
        )


def run(cases, device, copy_bw: float, progress=None, compare_default=False) -> list[Row]:
    from kvgen import configs

    rows = []
    for case in cases:
        default = None
        if compare_default:
            configs.use_tuned = False
            try:
                default = harness.graph_time_us(case.step, case.n_sets)
            finally:
                configs.use_tuned = True
        graph = harness.graph_time_us(case.step, case.n_sets)
        eager = harness.eager_time_us(case.step, case.n_sets)
        cstep, csets = harness.copy_step(case.bytes // 2, device)
        copy = harness.graph_time_us(cstep, csets)
        row = Row(case.op, case.variant, case.num_tokens, case.bytes, graph, eager, copy)
        row.default_graph_us = default
        row.gbps = case.bytes / (graph * 1e-6) / 1e9
        row.bw_ratio = row.gbps * 1e9 / copy_bw
        row.latency_ratio = graph / copy
        if case.floor is not None:
            row.floor_graph_us = harness.graph_time_us(case.floor, case.n_sets)
            row.floor_bw_ratio = case.bytes / (row.floor_graph_us * 1e-6) / copy_bw
        row.correct = case.check()
        rows.append(row)
        if progress is not None:
            progress(row)
        torch.cuda.empty_cache()
    return rows


KV_BLOCK_SIZE = 16


KV_LAYOUTS = ("separate", "inline")


def kv_cases(
    device,
    tokens=TOKENS,
    fmt="int8",
    heads=8,
    head_size=128,
    dtype=torch.bfloat16,
    layout="separate",
    slot_order="random",
):
    """The per-token-head stores: ``fmt`` int8, fp8e4m3, fp8e5m2 or int4 (32 channels/scale).
    ``layout``: ``"separate"`` scale caches, or ``"inline"``: vLLM's allocation, (blocks, 2,
    page, heads, codes + scale bytes) with each row's scales in its pad bytes (132-byte int8 /
    fp8 rows at head 128, 72-byte int4 rows), the caches and scales passed as views of it.
    ``slot_order``: ``SLOT_ORDERS``."""
    from kvgen.families.gqa_decode.verify import alloc_caches
    from kvgen.ops import (
        triton_reshape_and_cache_flash_int4_per_token_head as store_int4,
    )
    from kvgen.ops import (
        triton_reshape_and_cache_flash_per_token_head_quant as store_quant,
    )

    if layout not in KV_LAYOUTS:
        raise ValueError(f"layout must be one of {KV_LAYOUTS}, got {layout!r}")
    cache_dtype = _dtypes.CACHE[fmt]
    int4 = fmt == "int4"
    width = cdiv(head_size, 2) if int4 else head_size
    groups = cdiv(head_size, 32)
    scale_bytes = groups * 2 if int4 else 4
    for t in tokens:
        blocks = cdiv(t, KV_BLOCK_SIZE) + 1
        in_bytes = 2 * t * heads * head_size * dtype.itemsize + t * 8
        out_bytes = 2 * t * heads * (width + scale_bytes)
        cache_bytes = 2 * blocks * KV_BLOCK_SIZE * heads * (width + 8)
        n_sets = harness.sets_for(in_bytes + cache_bytes)

        def make(blocks=blocks):
            c = torch.zeros(blocks, KV_BLOCK_SIZE, heads, width, dtype=torch.uint8, device=device)
            c = c.view(cache_dtype)
            if int4:
                s = torch.zeros(
                    blocks, KV_BLOCK_SIZE, heads, groups, dtype=torch.float16, device=device
                )
            else:
                s = torch.zeros(blocks, KV_BLOCK_SIZE, heads, device=device)
            return c, s

        sets = []
        for _ in range(n_sets):
            k = torch.randn(t, heads, head_size, device=device).to(dtype)
            v = torch.randn(t, heads, head_size, device=device).to(dtype)
            if layout == "inline":
                shape = (blocks, KV_BLOCK_SIZE, heads)
                kc, vc, ks, vs = alloc_caches(
                    fmt, 32, shape, head_size, head_size, dtype, device, "inline"
                )
            else:
                (kc, ks), (vc, vs) = make(), make()
            slots = slot_mapping(t, blocks * KV_BLOCK_SIZE, device, slot_order, KV_BLOCK_SIZE)
            sets.append((k, v, kc, vc, ks, vs, slots))
        op = store_int4 if int4 else store_quant

        def step(i, sets=sets, op=op):
            op(*sets[i])

        def check(sets=sets, op=op):
            return kv_store_checker(sets[0])(op)

        def floor(i, sets=sets):
            k, v, kc, vc, ks, vs, slots = sets[i]
            for x, codes, scales in ((k, kc, ks), (v, vc, vs)):
                if layout == "inline":  # the scales follow the codes in the row
                    scatter_rows(x, slots, codes, width + scale_bytes)
                else:
                    scatter_rows(x, slots, codes, width, scales, scale_bytes)

        name = f"store_kv_{fmt}-h{heads}-d{head_size}-{str(dtype)[6:]}"
        name += "-inline" if layout == "inline" else ""
        moved = in_bytes + out_bytes
        yield Case(name.split("-")[0], name, t, moved, n_sets, step, check, sets, floor)


def poison(*tensors: torch.Tensor) -> None:
    """Set every byte of each tensor (any view: strided, or a view of another's bytes) to 0xFF,
    so that a check after it cannot pass on what an earlier launch left there."""
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    for t in tensors:
        t.view(ints[t.element_size()]).fill_(-1)


def kv_store_checker(data: tuple) -> Callable[[Callable], bool]:
    """``check(store) -> bool`` over the caches of ``data`` (a bench set): the caches poisoned
    (0xFF), then ``store(k, v, kc, vc, ks, vs, slots)`` of random K / V, and every byte of the
    four caches compared with the reference's. The inputs (a prefix of at most CHECK_TOKENS of
    the set's tokens: the reference runs on the CPU) and the reference's bytes are made once,
    at the first check, so that a tuner checking many candidates pays for the reference once."""
    from kvgen.formats import per_token_head as ref

    k, v, kc, vc, ks, vs, slots = data
    n = min(k.shape[0], CHECK_TOKENS)
    k, v, slots = torch.randn_like(k[:n]), torch.randn_like(v[:n]), slots[:n]
    caches = (kc, vc, ks, vs)

    def as_bytes(x: torch.Tensor) -> torch.Tensor:
        return x.contiguous().view(torch.uint8)

    @functools.cache
    def want() -> list[torch.Tensor]:
        expect = [x.cpu().clone() for x in caches]  # (poisoned, as the check leaves them)
        ref.store(k.cpu(), v.cpu(), *expect, slots.cpu())
        return [as_bytes(x).to(kc.device) for x in expect]

    def check(store) -> bool:
        poison(*caches)
        expect = want()
        store(k, v, *caches, slots)
        return all(torch.equal(as_bytes(g), w) for g, w in zip(caches, expect, strict=True))

    return check
