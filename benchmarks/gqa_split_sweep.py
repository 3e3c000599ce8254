"""Time the GQA decode at each split factor, each bench shape on its own.

The tuner times a config as the mean over the two bench shapes (128 x 4096 and 8 x 32768 keys),
so one ``split_factor`` serves both; this prints what each shape alone would take at every split
factor (and the pieces a sequence is cut into there), the measurement a split rule that depends
on the batch is chosen from. The problem is the tuning problem's (checked against the float64
reference first), the other meta-parameters the variant's tuned ones at the bucket.

    python -P benchmarks/gqa_split_sweep.py --variant rows --formats int8,fp8e4m3 --rows 4,8
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from kvgen import configs, runtime
from kvgen.bench import harness
from kvgen.codegen import load
from kvgen.families.gqa_decode import GQADecodeSpec
from kvgen.families.gqa_decode.tuning import problem


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variant", default="rows", choices=("portable", "rows"))
    ap.add_argument("--formats", default="int8,fp8e4m3")
    ap.add_argument("--rows", default="4,8", help="query heads a KV head, comma-separated")
    ap.add_argument("--split-factors", default="1,2,4,8,12,16,24")
    ap.add_argument("--json", help="write the measurements here")
    args = ap.parse_args(argv)

    from kvgen.bench import gqa_decode as bench

    arch, target = runtime.local_target()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    factors = [int(x) for x in args.split_factors.split(",")]
    doc = {"variant": args.variant, "sms": sms, "points": []}
    for kv in args.formats.split(","):
        spec = GQADecodeSpec(128, 128, "bf16", kv, 32 if kv == "int4" else 0, args.variant, arch,
                             target)  # fmt: skip
        module = load(spec)
        for rows in (int(r) for r in args.rows.split(",")):
            bucket = {"rows": rows}
            tuned = configs.meta_params(spec, **bucket)
            run, check, n_sets = problem(spec, bucket, "cuda")
            for sf in factors:
                meta = tuned | {"split_factor": sf}
                if not check(meta):
                    raise SystemExit(f"{spec.name} rows={rows} {meta}: wrong result")
                for i, (label, batch, keys) in enumerate(bench.SHAPES):
                    us = harness.graph_time_us(lambda _, i=i, r=run, m=meta: r(i, m), 1, calls=8,
                                               replays=5, trials=5)  # fmt: skip
                    tile = meta.get("block_n", 64)
                    blocks = 1 if args.variant == "rows" else -(-rows // meta["block_h"])
                    pieces = module.num_splits(batch, bench.H_KV, blocks, keys, tile, sf, sms)
                    print(f"{kv} rows={rows} split_factor={sf:2d} {label:>10}: "
                          f"{pieces:3d} pieces {us:8.1f} us", flush=True)  # fmt: skip
                    doc["points"].append({"kv": kv, "rows": rows, "meta": meta, "shape": label,
                                          "pieces": pieces, "us": us})  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1, sort_keys=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
