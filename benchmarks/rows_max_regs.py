"""Time the rows (Gluon, sm90) decode kernels under register caps (ptxas' ``maxnreg``).

A kernel of 4 warps that takes more than 168 registers a thread runs two programs an SM; at
168 or fewer three fit (where the shared memory allows), at 128 four. The cap trades spills
(local loads and stores) for programs in flight. Each kernel is launched through its module's
``launch`` at its tuned (or default) meta-parameters with ``max_regs`` set, on the benches'
problems, CUDA-graph timed, the caps alternated over rounds, medians printed:

- ``mla-mxfp4``: the MLA rows kernel over MXFP4 rows (576 / 512, group 32), FlashMLA's batch
  (128 x 4096 keys, page 64) and the mixed lengths of the same total, 16 and 8 heads;
- ``gqa-int4`` / ``gqa-int8`` / ``gqa-fp8e4m3``: the GQA rows kernel, ``kvgen bench``'s
  batches (128 x 4096 and 8 x 32768 keys, 8 KV heads x 128, block 16), 32 query heads.

    python -P benchmarks/rows_max_regs.py --kernels mla-mxfp4,gqa-int4 --caps 0,168,128
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys

import torch

from kvgen import runtime
from kvgen.bench import decode, harness
from kvgen.bench import gqa_decode as gqa_bench
from kvgen.codegen import load
from kvgen.families.per_token_head import row_align
from kvgen.ops._gqa_decode import bucket as gqa_bucket

KERNELS = ("mla-mxfp4", "gqa-int4", "gqa-int8", "gqa-fp8e4m3")


def mla_cases(device, heads_list):
    """(label, call) of the MXFP4 MLA rows kernel on FlashMLA's batch and the mixed one."""
    from kvgen.families.mla_decode import MLADecodeMXFP4Spec
    from kvgen.ops import get_mla_metadata

    arch, target = runtime.target_of(device)
    spec = MLADecodeMXFP4Spec(576, 512, "bf16", "rows", arch, target)
    mod = load(spec)
    out = []
    for batch in ("equal", "mixed"):
        lengths = [4096] * 128 if batch == "equal" else decode.mixed_lengths(128 * 4096, 128)
        for heads in heads_list:
            q, k, table, sl = decode._make(lengths, heads, device)
            cache = decode.quantized_caches(k, torch.ones(1, device=device), ("mxfp4",))["mxfp4"]
            del k
            meta, splits = get_mla_metadata(sl, heads, 1)
            mp = runtime.meta_params(spec, rows=heads)

            def call(cap, q=q, cache=cache, table=table, sl=sl, meta=meta, splits=splits, mp=mp):
                return mod.launch(q, cache, table, sl, meta, splits, 576**-0.5, False,
                                  **{**mp, "max_regs": cap})  # fmt: skip

            out.append((f"mla mxfp4 {batch:5} h={heads:<3} {mp}", call))
    return out


def gqa_cases(device, kv):
    """(label, call) of the GQA rows kernel over ``kv`` on the bench's two batches."""
    from kvgen.families.gqa_decode import GQADecodeSpec

    arch, target = runtime.target_of(device)
    group = 32 if kv == "int4" else 0
    spec = GQADecodeSpec(128, 128, "bf16", kv, group, "rows", arch, target)
    mod = load(spec)
    out = []
    for shape, batch, seqlen in gqa_bench.SHAPES:
        q, k, v, ks, vs, table, sl = gqa_bench.problem(kv, group, [seqlen] * batch, 32, device)
        mp = runtime.meta_params(spec, **gqa_bucket(spec, 32 // gqa_bench.H_KV, row_align(k, v)))
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        launch = functools.partial(mod.launch, num_sms=sms)

        def call(cap, q=q, k=k, v=v, ks=ks, vs=vs, table=table, sl=sl, mp=mp, launch=launch):
            return launch(q, k, v, ks, vs, table, sl, 128**-0.5, False, **{**mp, "max_regs": cap})

        out.append((f"gqa {kv:8} {shape:10} {mp}", call))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kernels", default=",".join(KERNELS), help=f"of {', '.join(KERNELS)}")
    ap.add_argument("--caps", default="0,168,128", help="max_regs values (0: no cap)")
    ap.add_argument("--heads", default="16,8", help="the MLA kernel's query heads")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    names = args.kernels.split(",")
    for name in names:
        if name not in KERNELS:
            raise SystemExit(f"--kernels: unknown {name!r}; known: {', '.join(KERNELS)}")
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU (sm90)")
    device = torch.device("cuda")
    caps = [int(c) for c in args.caps.split(",")]
    print(f"{torch.cuda.get_device_name(device)}; caps {caps}", flush=True)
    harness.warm_up(device)
    for name in names:
        if name == "mla-mxfp4":
            cases = mla_cases(device, [int(h) for h in args.heads.split(",")])
        else:
            cases = gqa_cases(device, name.removeprefix("gqa-"))
        for label, call in cases:
            ref, _ = call(0)
            times = {c: [] for c in caps}
            for r in range(args.rounds):
                for c in caps[r % len(caps) :] + caps[: r % len(caps)]:
                    times[c].append(harness.graph_time_us(lambda i, c=c, f=call: f(c), 1, calls=8,
                                                          replays=5))  # fmt: skip
            line = []
            for c in caps:
                out, _ = call(c)
                same = "" if torch.equal(out, ref) else " (out differs)"
                line.append(f"cap {c or '-'}: {statistics.median(times[c]):7.1f} us{same}")
            print(f"{label}\n    " + "   ".join(line), flush=True)
        del cases
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
