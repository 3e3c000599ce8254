"""Whether vLLM's inline rows want other configs of the GQA rows decode than the tuned ones.

The rows variant's tuned configs (``tuned_configs/<arch>/.../gqa_decode.json``) are keyed by
``rows`` and ``row_align``: 16 for separate scale caches (16-byte rows), 4 / 8 for vLLM's
inline rows (132-byte int8 / fp8 rows, 72-byte int4 rows: 4- and 8-byte copies, slower); where
a file has no entry at the inline rows' row_align, the op takes the row_align 16 one (the
nearest bucket). This times the rows launcher over the grid below at the bench's two shapes
(``kvgen.bench.gqa_decode``: 128 x 4096 and 8 x 32768 keys, 8 KV heads x 128, block 16), on
inline rows and, for each format, on separate caches, each at the op's config for those caches;
the figure is the mean over the two shapes, as the tuner's. Each point's result on the bench's
small checked batch is compared with the float64 reference before it is timed. Prints every
point and, per format, the best against the op's config on the same rows; a best more than a
few percent ahead says the inline rows' bucket wants (re-)tuning.

    python -P benchmarks/gqa_rows_inline_sweep.py [--formats int8,fp8e4m3,int4] [--heads 32]
        [--json out.json]
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys

import torch

from kvgen import runtime
from kvgen.bench import gqa_decode as bench
from kvgen.bench import harness
from kvgen.codegen import load
from kvgen.families.gqa_decode import GQADecodeSpec
from kvgen.families.per_token_head import row_align
from kvgen.ops._gqa_decode import bucket as gqa_bucket
from kvgen.verify import compare_attention

GRID = {"num_stages": [2, 3, 4], "piece_tiles": [0, 32, 60], "split_factor": [1, 2, 4]}
GROUPS = {"int8": 0, "fp8e4m3": 0, "fp8e5m2": 0, "int4": 32}


def timed(launch, problems, meta, sms) -> float:
    """The mean over ``problems`` of the launch's CUDA-graph time at ``meta``, in us."""
    times = []
    for q, k, v, ks, vs, table, sl in problems:

        def step(i, q=q, k=k, v=v, ks=ks, vs=vs, table=table, sl=sl):
            launch(q, k, v, ks, vs, table, sl, bench.HEAD**-0.5, False, num_sms=sms, **meta)

        times.append(harness.graph_time_us(step, 1, calls=8, replays=5))
    return statistics.mean(times)


def sweep(kv: str, h_q: int, device, sms: int, show) -> dict:
    spec = GQADecodeSpec(bench.HEAD, bench.HEAD, "bf16", kv, GROUPS[kv], "rows", "sm90", "gpu")
    launch = load(spec).launch
    rows = h_q // bench.H_KV
    result = {"format": kv, "heads": h_q, "tuned": {}, "points": []}
    for layout in ("nhd", "inline"):
        (small, ref) = bench.checked_problem(kv, GROUPS[kv], h_q, device, layout=layout)
        # the op's config for these caches (row_align 16, or the inline rows' own bucket)
        tuned = runtime.meta_params(spec, **gqa_bucket(spec, rows, row_align(small[1], small[2])))
        result["tuned"][layout] = tuned
        problems = [
            bench.problem(kv, GROUPS[kv], [n] * b, h_q, device, layout=layout)
            for _, b, n in bench.SHAPES
        ]
        metas = [tuned]
        if layout == "inline":
            grid = itertools.product(*GRID.values())
            metas += [dict(zip(GRID, values, strict=True)) for values in grid]
        for meta in metas:
            q, k, v, ks, vs, table, sl = small
            out, lse = launch(q, k, v, ks, vs, table, sl, bench.HEAD**-0.5, False, num_sms=sms,
                              **meta)  # fmt: skip
            ok = bool(compare_attention(out, lse, *ref)[0])
            us = timed(launch, problems, meta, sms) if ok else float("nan")
            point = {"layout": layout, "meta": meta, "us": us, "correct": ok,
                     "tuned": meta is tuned}  # fmt: skip
            result["points"].append(point)
            show(kv, h_q, point)
        del problems
        torch.cuda.empty_cache()
    return result


def summary(results: list[dict]) -> list[str]:
    """A line a format: the tuned config's time on inline rows, the grid's best (and how much
    faster), and the tuned config's time on separate caches."""
    lines = []
    for r in results:
        inline = [p for p in r["points"] if p["layout"] == "inline" and p["correct"]]
        base = next((p for p in inline if p["tuned"]), None)
        if base is None:  # (a wrong result: its point says WRONG above)
            lines.append(f"{r['format']}: the tuned config's result on inline rows is wrong")
            continue
        best = min(inline, key=lambda p: p["us"])
        sep = next(p for p in r["points"] if p["layout"] == "nhd")
        lines.append(
            f"{r['format']}: inline rows at the tuned config {base['us']:.1f} us, best "
            f"{best['us']:.1f} us at {json.dumps(best['meta'], sort_keys=True)} "
            f"({base['us'] / best['us']:.3f}x); separate caches at the tuned config "
            f"{sep['us']:.1f} us"
        )
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--formats", default="int8,fp8e4m3,int4", help="comma-separated: " +
                    ", ".join(GROUPS))  # fmt: skip
    ap.add_argument("--heads", type=int, default=32, help="query heads (over 8 KV heads)")
    ap.add_argument("--json", help="write every point here")
    args = ap.parse_args(argv)
    formats = args.formats.split(",")
    for kv in formats:
        if kv not in GROUPS:
            raise SystemExit(f"--formats: unknown {kv!r}; known: {', '.join(GROUPS)}")
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    device = torch.device("cuda")
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    print(f"{torch.cuda.get_device_name(device)}; mean of {', '.join(s for s, *_ in bench.SHAPES)}"
          f", {args.heads} query heads", flush=True)  # fmt: skip

    def show(kv, h_q, p) -> None:
        tag = " (tuned)" if p["tuned"] else ""
        ok = "" if p["correct"] else "  WRONG"
        print(f"{kv:<8} {p['layout']:<6} {json.dumps(p['meta'], sort_keys=True):<60} "
              f"{p['us']:8.1f} us{tag}{ok}", flush=True)  # fmt: skip

    results = [sweep(kv, args.heads, device, sms, show) for kv in formats]
    for line in summary(results):
        print(line)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(device), "results": results}, f,
                      indent=1)  # fmt: skip
    return 0 if all(p["correct"] for r in results for p in r["points"]) else 1


if __name__ == "__main__":
    sys.exit(main())
