"""The MLA decode over each cache format, against the copy bandwidth and the bf16 matmul rate
measured in the same run: FlashMLA's batch (128 x 4096 keys, page 64) and the mixed lengths
of the same total, at each head count. A narrower, faster run of ``kvgen bench``'s decode
section (the same code): the variants named, fewer rounds.

    python -P benchmarks/decode_formats.py [--variants wgmma] [--heads 16,128] [--json F]
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict

import torch

from kvgen.bench import decode, harness


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variants", default="portable,wgmma", help="comma-separated")
    ap.add_argument("--heads", default="16,32,64,128")
    ap.add_argument("--batches", default="equal,mixed")
    ap.add_argument("--rounds", type=int, default=3, help="alternated timings of each caller")
    ap.add_argument("--json", help="write the rows and the ceilings here")
    ap.add_argument("--unoffered", action="store_true",
                    help="also the variants kvgen generates but does not offer yet")  # fmt: skip
    ap.add_argument("--commit", help="the commit to record (a copied checkout's .git may be older)")
    args = ap.parse_args(argv)

    device = torch.device("cuda")
    copy_bw = harness.copy_bandwidth(device)
    mm = decode.matmul_rate(device)
    print(f"copy {copy_bw / 1e9:.0f} GB/s, bf16 matmul {mm / 1e12:.0f} TFLOP/s", flush=True)
    rows = decode.run(
        device,
        copy_bw,
        mm,
        heads=[int(h) for h in args.heads.split(",")],
        variants=args.variants.split(","),
        batches=args.batches.split(","),
        rounds=args.rounds,
        unoffered=args.unoffered,
        progress=lambda r: print(f"  {r.variant} {r.lengths} h={r.heads}: {r.graph_us:.1f} us"),
    )
    head = "format      caller                                       batch          h_q      us"
    print(f"\n{head}  B/tok   GB/s  of copy  TFLOP/s  of mm  vs bf16  ok")
    for r in rows:
        print(
            f"{r.kv_format:<11} {r.variant:<44} {r.lengths:<14} {r.heads:>3} {r.graph_us:>7.1f}"
            f"  {r.bytes_per_token:>5} {r.gbps:>6.0f}  {r.bw_ratio:>7.3f}  {r.tflops:>7.1f}"
            f"  {r.mm_ratio:>5.3f}  {r.vs_bf16:>7.3f}  {'yes' if r.correct else 'NO'}"
        )
    if args.json:
        doc = {
            "environment": harness.environment(args.commit),
            "copy_bandwidth_GBps": copy_bw / 1e9,
            "matmul_TFLOPs": mm / 1e12,
            "rows": [asdict(r) for r in rows],
        }
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
    return 0 if all(r.correct for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
