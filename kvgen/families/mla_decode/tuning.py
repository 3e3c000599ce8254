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
    ``split_factor`` asks for (outside the timed graph). A bucket's ``h_kv`` (default 1, the
    tuned buckets' value) gives the cache that many KV heads, each with ``rows`` query rows."""
    from kvgen.bench import decode
    from kvgen.formats.mla_decode import mla_decode
    from kvgen.ops._mla_choice import schedule_policy
    from kvgen.ops._mla_metadata import num_sm_parts, schedule

    rows, h_kv = bucket["rows"], bucket.get("h_kv", 1)
    equal = [decode.SEQLEN] * decode.BATCH
    mixed = decode.mixed_lengths(sum(equal), decode.BATCH)
    dtype = _dtypes.TORCH[spec.dtype]
    problems = [decode._make(lengths, rows, device, dtype, h_kv=h_kv) for lengths in (equal, mixed)]
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    launch = load(spec).launch
    scale = spec.head_dim**-0.5
    q, k, table, sl = problems[0]
    sub = slice(0, 2)  # the float64 reference runs on the CPU: checked on two sequences
    ref, _ = mla_decode(q[sub].cpu(), k.cpu(), table[sub].cpu(), sl[sub].cpu(), spec.head_dim_v)
    schedules = {}

    def sched(m, which, seqlens):
        key = (m["split_factor"], which)
        if key not in schedules:
            parts = num_sm_parts(sms, rows, h_kv, m["split_factor"])
            schedules[key] = schedule(seqlens, parts, schedule_policy(spec.variant))
        return schedules[key]

    def run(i, m):
        q, k, table, sl = problems[i]
        launch(q, k, table, sl, *sched(m, i, sl), scale, False, **m)

    def check(m):
        for i, (_, _, _, seqlens) in enumerate(problems):
            sched(m, i, seqlens)  # built here, before run() is captured in a graph
        out, _ = launch(
            q[sub], k, table[sub], sl[sub], *sched(m, "check", sl[sub]), scale, False, **m
        )
        return bool((out.cpu().double() - ref).norm() / ref.norm() < 1e-2)

    return run, check, len(problems)
