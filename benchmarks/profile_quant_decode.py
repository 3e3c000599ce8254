"""Launch the wgmma decode over a quantized cache a few times, for a profiler to catch one
launch (FlashMLA's batch: 128 x 4096 keys, page 64), e.g.

    ncu --kernel-name split_kernel_roles --launch-skip 2 --launch-count 1 \\
        --section WarpStateStats --section SourceCounters \\
        python -P benchmarks/profile_quant_decode.py --format fp8_ds_mla --heads 16
"""

from __future__ import annotations

import argparse
import sys

import torch

from kvgen import runtime
from kvgen.bench import decode
from kvgen.codegen import load
from kvgen.families import mla_decode as md
from kvgen.ops import get_mla_metadata


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--format", default="fp8_ds_mla", choices=("fp8_ds_mla", "fp8", "mxfp4"))
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--launches", type=int, default=3)
    ap.add_argument("--config", default="32x2", help="block_n x num_stages")
    args = ap.parse_args(argv)
    device = torch.device("cuda")
    arch, target = runtime.target_of(device)
    cls = {"fp8_ds_mla": md.MLADecodeDSMLASpec, "fp8": md.MLADecodeFP8Spec}
    spec = cls.get(args.format, md.MLADecodeMXFP4Spec)(576, 512, "bf16", "wgmma", arch, target)
    k_scale = torch.tensor([decode.K_SCALE], device=device)
    q, k, table, sl = decode._make([decode.SEQLEN] * decode.BATCH, args.heads, device)
    cache = decode.quantized_caches(k, k_scale, (args.format,))[args.format]
    meta, splits = get_mla_metadata(sl, args.heads, 1)
    bn, stages = (int(x) for x in args.config.split("x"))
    mp = {"block_n": bn, "num_stages": stages, "split_factor": 1}
    mp |= {"k_scale": k_scale} if args.format == "fp8" else {}
    mod = load(spec)
    for _ in range(args.launches):
        mod.launch(q, cache, table, sl, meta, splits, 576**-0.5, False, **mp)
    torch.cuda.synchronize()
    print(f"{args.launches} launches of {spec.name}, h_q {args.heads}, {mp}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
