"""Time some of ``kvgen bench --ops gqa_decode``'s formats alone, each the variant the op takes.

The bench's own rows (``kvgen.bench.gqa_decode.run``: 8 KV heads x 128, block 16, 128 x 4096
and 8 x 32768 keys, CUDA graphs, median of rounds, formats rotated), the bf16 cache always
among them (each time is also given relative to it), plus formats the bench leaves out (an
int4 group that only the portable variant reads). For an A/B of a kernel change
(``scripts/gpu_session.sh ab``): it uses only what the bench offered before and after.

    python -P benchmarks/gqa_bench_formats.py --formats bf16,int4C16 --heads 32,64
"""

from __future__ import annotations

import argparse
import sys

import torch

from kvgen.bench import gqa_decode as bench
from kvgen.bench import harness

#: the formats this script knows beyond the bench's labels (label without spaces -> entry)
EXTRA = {
    "int4C16": ("int4 C16", "int4", 16, "nhd"),
    "int4C64": ("int4 C64", "int4", 64, "nhd"),
    "int4C128": ("int4 C128", "int4", 128, "nhd"),
}


def formats_from(names: str) -> tuple:
    known = {label.replace(" ", ""): entry for entry in bench.FORMATS for label in [entry[0]]}
    known.update(EXTRA)
    chosen = [known["bf16"]]
    for name in names.split(","):
        if name not in known:
            raise SystemExit(f"--formats: unknown {name!r}; known: {', '.join(known)}")
        if known[name] not in chosen:
            chosen.append(known[name])
    return tuple(chosen)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--formats", default="bf16", help="comma-separated; bf16 is always timed")
    ap.add_argument("--heads", default="32,64", help="query heads, comma-separated")
    ap.add_argument("--rounds", type=int, default=bench.ROUNDS)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    device = torch.device("cuda")
    formats = formats_from(args.formats)
    heads = tuple(int(h) for h in args.heads.split(","))
    copy_bw = harness.copy_bandwidth(device)
    print(f"{torch.cuda.get_device_name(device)}; copy {copy_bw / 1e9:.0f} GB/s")

    def show(row) -> None:
        ok = "" if row.correct else "  WRONG"
        print(
            f"{row.kv_format:<16} {row.lengths:>10} h_q {row.heads:>3} {row.variant:<8} "
            f"{row.graph_us:8.1f} us  {row.bw_ratio:5.3f} of copy  {row.vs_bf16:5.3f}x bf16{ok}",
            flush=True,
        )

    rows = bench.run(device, copy_bw, heads=heads, formats=formats, rounds=args.rounds)
    for row in rows:
        show(row)
    return 0 if all(row.correct for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
