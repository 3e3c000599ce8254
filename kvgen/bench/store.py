"""``kvgen bench`` for the store ops: achieved bandwidth against the same run's copy ceilings."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from kvgen import _dtypes
from kvgen.bench import harness

TOKENS = (1, 16, 256, 4096, 65536)
BLOCK_SIZE = 64


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


def mxfp4_cases(device, tokens=TOKENS, latent=512, group=32, dtype=torch.bfloat16):
    from kvgen.families.mxfp4_mla import StoreMXFP4MLASpec
    from kvgen.formats import mxfp4
    from kvgen.ops import store_mxfp4_mla
    from kvgen.runtime import target_of

    arch, target = target_of(torch.device(device))
    name = StoreMXFP4MLASpec(group, latent, _dtypes.NAME[dtype], "paged", arch, target).name
    pitch = mxfp4.row_bytes(latent, group)
    for t in tokens:
        blocks = -(-t // BLOCK_SIZE) + 1
        in_bytes = t * latent * dtype.itemsize + t * 8
        out_bytes = t * pitch
        n_sets = harness.sets_for(in_bytes + blocks * BLOCK_SIZE * pitch)
        xs = [torch.randn(t, latent, device=device).to(dtype) for _ in range(n_sets)]
        caches = [
            torch.zeros(blocks, BLOCK_SIZE, pitch, dtype=torch.uint8, device=device)
            for _ in range(n_sets)
        ]
        slots = [torch.randperm(blocks * BLOCK_SIZE, device=device)[:t] for _ in range(n_sets)]

        def step(i, xs=xs, slots=slots, caches=caches):
            store_mxfp4_mla(xs[i], slots[i], caches[i], group)

        def check(xs=xs, slots=slots, caches=caches, t=t, latent=latent):
            x = torch.randn(t, latent, device=device).to(dtype)  # fresh data, not the timed set
            caches[0].fill_(0xFF)
            store_mxfp4_mla(x, slots[0], caches[0], group)
            ref = torch.full(caches[0].shape, 0xFF, dtype=torch.uint8)
            mxfp4.store(x.cpu(), slots[0].cpu(), ref, group)
            return bool(torch.equal(caches[0].cpu(), ref))

        yield Case("store_mxfp4_mla", name, t, in_bytes + out_bytes, n_sets, step, check)


def run(cases, device, copy_bw: float, progress=None) -> list[Row]:
    rows = []
    for case in cases:
        graph = harness.graph_time_us(case.step, case.n_sets)
        eager = harness.eager_time_us(case.step, case.n_sets)
        cstep, csets = harness.copy_step(case.bytes // 2, device)
        copy = harness.graph_time_us(cstep, csets)
        row = Row(case.op, case.variant, case.num_tokens, case.bytes, graph, eager, copy)
        row.gbps = case.bytes / (graph * 1e-6) / 1e9
        row.bw_ratio = row.gbps * 1e9 / copy_bw
        row.latency_ratio = graph / copy
        row.correct = case.check()
        rows.append(row)
        if progress is not None:
            progress(row)
        torch.cuda.empty_cache()
    return rows
