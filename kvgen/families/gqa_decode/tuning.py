"""What a tuning trial of the GQA decode runs: the bench's two shapes (128 x 4096 and 8 x 32768
keys, 8 KV heads x 128, block 16) in the spec's cache format and query dtype, ``rows`` query
heads a KV head; a ``row_align`` bucket under 16 on vLLM's rows with the scales inline."""

from __future__ import annotations

import torch

from kvgen import _dtypes
from kvgen.codegen import load
from kvgen.families.per_token_head import row_align


def problem(spec, bucket, device):
    """A trial's time is the mean over the two shapes (a config that only suits many sequences
    does not win); the two batches (2 GiB of bf16 cache each) are built at the first timed
    run, so that the tuner's compile processes, which only check, build the small one alone.
    The check runs the candidate on a small batch against the float64 reference."""
    from kvgen.bench import gqa_decode as bench
    from kvgen.verify import compare_attention

    if (spec.head_size, spec.head_size_v) != (bench.HEAD, bench.HEAD):
        raise ValueError(f"{spec.name}: tuned on 128 / 128 caches")
    dtype = _dtypes.TORCH[spec.dtype]
    rows = bucket["rows"]
    h_q = rows * bench.H_KV
    align = bucket.get("row_align", 16)
    layout = "inline" if align < 16 else "nhd"
    problems = []
    (q, k, v, ks, vs, table, sl), ref = bench.checked_problem(spec.kv, spec.group, h_q, device,
                                                              dtype, layout)  # fmt: skip
    if (got := row_align(k, v)) != align:
        raise ValueError(f"{spec.name}: {layout} caches of row_align {got} for the row_align "
                         f"{align} bucket")  # fmt: skip
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    launch = load(spec).launch
    scale = spec.head_size**-0.5

    def run(i, m):
        if not problems:
            problems.extend(
                bench.problem(
                    spec.kv, spec.group, [n] * b, h_q, device, dtype=dtype, layout=layout
                )  # fmt: skip
                for _, b, n in bench.SHAPES
            )
        q, k, v, ks, vs, table, sl = problems[i]
        launch(q, k, v, ks, vs, table, sl, scale, False, num_sms=sms, **m)

    def check(m):
        out, lse = launch(q, k, v, ks, vs, table, sl, scale, False, num_sms=sms, **m)
        return compare_attention(out, lse, *ref)[0]

    return run, check, len(bench.SHAPES)
