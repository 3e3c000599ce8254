"""What a tuning trial of the MLA decode runs: FlashMLA's headline batch and the bench's mixed
lengths, checked against the float64 reference."""

from __future__ import annotations

import torch

from kvgen import _dtypes
from kvgen.codegen import load


def problem(spec, bucket, device):
    """FlashMLA's headline batch (128 x 4096, page 64) with ``rows`` query heads, and the bench's
    mixed lengths (1 to 16384, the same total KV): a trial's time is the mean of the two, so a
    config that only suits equal lengths does not win. Each trial builds the schedules its
    ``split_factor`` asks for (outside the timed graph). A quantized decode's problem is the
    same keys in its cache format (``kvgen.bench.decode.quantized_caches``). A bucket's
    ``h_kv`` (default 1, the tuned buckets' value) gives the cache that many KV heads, each
    with ``rows`` query rows."""
    from kvgen.bench import decode
    from kvgen.formats.mla_decode import mla_decode
    from kvgen.ops._mla_choice import schedule_policy
    from kvgen.ops._mla_metadata import num_sm_parts, schedule

    rows, h_kv = bucket["rows"], bucket.get("h_kv", 1)
    equal = [decode.SEQLEN] * decode.BATCH
    mixed = decode.mixed_lengths(sum(equal), decode.BATCH)
    dtype = _dtypes.TORCH[spec.dtype]
    problems = [decode._make(lengths, rows, device, dtype, h_kv=h_kv) for lengths in (equal, mixed)]
    fmt, extra = spec.derived()["kv_format"], {}
    if fmt != "auto":  # the same keys in the spec's cache format, written by kvgen's stores
        if (spec.head_dim, spec.head_dim_v, h_kv) != (decode.HEAD_DIM, decode.HEAD_DIM_V, 1) or (
            fmt == "mxfp4" and spec.dtype != "bf16"  # (the bench's MXFP4 rows: bf16 RoPE bytes)
        ):
            raise ValueError(f"{spec.name}: tuned on 576 / 512 bf16 caches with one KV head")
        k_scale = torch.tensor([decode.K_SCALE], device=device)
        problems = [
            (q, decode.quantized_caches(k, k_scale, (fmt,))[fmt], table, sl)
            for q, k, table, sl in problems
        ]
        extra = {"k_scale": k_scale} if fmt == "fp8" else {}
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    launch = load(spec).launch
    scale = spec.head_dim**-0.5
    q, k, table, sl = problems[0]
    sub = slice(0, 2)  # the float64 reference runs on the CPU: checked on two sequences
    pages, ref_table = pages_read(table[sub], sl[sub], k.shape[1])  # (their pages alone)
    k_ref = k[pages] if fmt == "auto" else decode.dequantized(fmt, k[pages], extra.get("k_scale"))
    ref, _ = mla_decode(q[sub].cpu(), k_ref.cpu(), ref_table.cpu(), sl[sub].cpu(), spec.head_dim_v)
    schedules = {}

    def sched(m, which, seqlens):
        key = (m["split_factor"], which)
        if key not in schedules:
            parts = num_sm_parts(sms, rows, h_kv, m["split_factor"])
            schedules[key] = schedule(seqlens, parts, schedule_policy(spec.variant))
        return schedules[key]

    def run(i, m):
        q, k, table, sl = problems[i]
        launch(q, k, table, sl, *sched(m, i, sl), scale, False, **m, **extra)

    def check(m):
        for i, (_, _, _, seqlens) in enumerate(problems):
            sched(m, i, seqlens)  # built here, before run() is captured in a graph
        out, _ = launch(
            q[sub], k, table[sub], sl[sub], *sched(m, "check", sl[sub]), scale, False, **m, **extra
        )
        return bool((out.cpu().double() - ref).norm() / ref.norm() < 1e-2)

    return run, check, len(problems)


def pages_read(table: torch.Tensor, seqlens: torch.Tensor, page: int):
    """``(pages, compact_table)``: the cache pages the sequences of ``table`` read (the first
    ``ceil(seqlen / page)`` entries of each row), in ascending order, and the table renumbered
    onto them, so that ``cache[pages]`` with ``compact_table`` holds what ``cache`` with
    ``table`` holds for these sequences: the reference copies those pages to the CPU, not a
    cache of gigabytes."""
    need = [-(-int(n) // page) for n in seqlens.tolist()]
    used = [table[b, :nb] for b, nb in enumerate(need)]
    pages, where = torch.unique(torch.cat(used), return_inverse=True)
    compact = torch.zeros(table.shape[0], max(max(need), 1), dtype=table.dtype,
                          device=table.device)  # fmt: skip
    start = 0
    for b, nb in enumerate(need):
        compact[b, :nb] = where[start : start + nb].to(table.dtype)
        start += nb
    return pages, compact
