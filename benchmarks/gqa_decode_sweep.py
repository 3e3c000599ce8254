"""Time a grid of the GQA decode's meta-parameters at one bucket, per cache format.

The tuning problem (``kvgen.families.gqa_decode.tuning``: 128 x 4096 and 8 x 32768 keys, 8 KV
heads x 128, block 16, checked against the float64 reference) at ``rows`` query rows a KV
head, every point of the grid below, compiled in parallel first; prints each point's time and
each format's best against its template default.

    python -P benchmarks/gqa_decode_sweep.py --formats auto,int8,int4 --rows 4 --json out.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys

from kvgen import runtime
from kvgen.families.gqa_decode import GQADecodeSpec

GRID = {
    "block_h": [16],
    "block_n": [64, 128],
    "num_warps": [4, 8],
    "num_stages": [2, 3],
    "split_factor": [4, 8],
    "max_regs": [0, 128],
}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--formats", default="auto,int8,fp8e4m3,int4")
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--jobs", type=int, default=12, help="compile processes")
    ap.add_argument("--json", help="write the measurements here")
    args = ap.parse_args(argv)

    from kvgen.tune.precompile import compile_all
    from kvgen.tune.problems import gpu_evaluator

    arch, target = runtime.local_target()
    bucket = {"rows": args.rows}
    points = [dict(zip(GRID, v, strict=True)) for v in itertools.product(*GRID.values())]
    doc = {"rows": args.rows, "grid": GRID, "formats": {}}
    for kv in args.formats.split(","):
        spec = GQADecodeSpec(128, 128, "bf16", kv, 32 if kv == "int4" else 0, "portable", arch,
                             target)  # fmt: skip
        default = spec.default_meta(rows=args.rows)
        metas = [default] + [p for p in points if p != default]
        compile_all(spec, bucket, metas, args.jobs)
        evaluate = gpu_evaluator(spec, bucket).confirm  # (the bench's full settle)
        times = {}
        for m in metas:
            try:
                times[json.dumps(m, sort_keys=True)] = evaluate(m)
            except Exception as exc:  # a point that fails to compile or run
                print(f"  {kv} {m}: failed ({type(exc).__name__})", file=sys.stderr)
        best = min(times, key=times.get)
        d = times[json.dumps(default, sort_keys=True)]
        print(f"{spec.name} rows={args.rows}: default {d:.1f} us, best {times[best]:.1f} us "
              f"{best}", flush=True)  # fmt: skip
        doc["formats"][kv] = {"spec": spec.name, "default": default, "times_us": times}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1, sort_keys=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
