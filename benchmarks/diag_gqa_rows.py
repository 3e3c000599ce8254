"""What bounds the GQA rows kernel over an int4 or int8 cache: time it with one stage of its
tile left out (METHOD: time variants that leave a stage out, take differences).

Each experiment patches the generated module's text (the result is wrong where a stage is left
out: only the time is read) and is timed on the bench's two batches (128 x 4096 and 8 x 32768
keys, 8 KV heads, pages of 16) beside the unpatched kernel (and, for int4, the int8 rows
kernel), in the same run, at the variants' tuned configs. int4 (--kv int4):

  base      the kernel as generated
  novscale  V's scales are 1 (no page lookups, loads or shared-memory exchange)
  nokscale  K's scales are 1 (no loads)
  nokdeq    K's words converted to f16 as integers (no byte-permute lookups)
  novdeq    V's half-words and scale words summed as integers, to f16 (no lookups)

int8 (--kv int8):

  noscale   K's and V's scales are 1 (no loads)
  nolo      S and PV from the hi parts alone (half the integer MMAs)
  novt      V^T's operand is a constant (no shared-memory load of V or register transpose)
  nopv      no PV at all (no V^T operand, no PV MMAs)

and any "+"-joined set of them (e.g. nokdeq+novdeq). fp8e4m3 and fp8e5m2 (--kv): base only
(the e5m2 form is not offered by the op yet: this times it). Each format but int8 is timed
beside the int8 kernel.

    python -P benchmarks/diag_gqa_rows.py --group 32 --rows 4
    python -P benchmarks/diag_gqa_rows.py --kv int8 --rows 4

With --launches N each kernel is launched N times, untimed, for a profiler:

    ncu --kernel-name split_kernel --launch-skip 2 --launch-count 1 --section WarpStateStats \\
        --section SchedulerStats --section InstructionStats python -P \\
        benchmarks/diag_gqa_rows.py --experiments base --launches 3
"""

from __future__ import annotations

import argparse
import math
import re
import sys

import torch

from kvgen import configs, runtime
from kvgen.bench import gqa_decode as bench
from kvgen.bench import harness
from kvgen.codegen import load
from kvgen.codegen.render import load_text, render
from kvgen.families.gqa_decode import GQADecodeSpec
from kvgen.families.per_token_head import row_align
from kvgen.ops._gqa_decode import bucket as gqa_bucket

_NG = r"(\d+)"


def _ones_for_k_scales(m: re.Match) -> str:
    """nokscale: the load of a key's K scale row (a word of its fp16 scales, or the one fp16
    scale at a group a row) as ones."""
    if m.group(1):  # every half of the word fp16 1.0
        return f"gl.where(ok, 0x3C003C003C003C00, 0).to(gl.int{m.group(2)})"
    return "gl.where(ok, 1.0, 0.0)"


# (regular expression, replacement string or function): each must match at least once
INT4_PATCHES = {
    "novscale": [
        (r"        vs_s\.index\(i % 2\)\.store\(.*\)\n", ""),
        (
            r"        sw = vs_s\.index\(i % 2\)\.permute\(\(1, 0\)\)\.load\((.*)\)\n",
            r"        sw = gl.full([TILE // 2, NG], 0x3C003C00, gl.int32, \1)\n",
        ),
    ],
    "nokscale": [
        (
            r"gl\.load\(ks_row(\.to\(gl\.pointer_type\(gl\.int(\d+)\), bitcast=True\))?, mask=ok, "
            r"other=0(\.0)?\)",
            _ones_for_k_scales,
        )
    ],
    "nokdeq": [
        (
            rf"        n0, n1, n2, n3, n4, n5, n6, n7 = k_levels\(w{_NG}\)\n",
            r"        kx = w\1.to(gl.float16)\n"
            r"        n0, n1, n2, n3, n4, n5, n6, n7 = kx, kx, kx, kx, kx, kx, kx, kx\n",
        )
    ],
    "novdeq": [
        (
            r"        c0e, c0o, c1e, c1o, c2e, c2o, c3e, c3o = v_levels\(hv0, hv1, "
            r"sw\[:, :, None\]\)\n",
            r"        vx = (hv0.to(gl.int32) + hv1.to(gl.int32) + sw[:, :, None]).to(gl.float16)\n"
            r"        c0e, c0o, c1e, c1o, c2e, c2o, c3e, c3o = vx, vx, vx, vx, vx, vx, vx, vx\n",
        )
    ],
}
INT8_PATCHES = {
    "noscale": [
        (
            r"( +)([kv])_sc = gl\.load\(\w+ \+ page \* \w+ \+ slot \* \w+, mask=ok, "
            r"other=0\.0\)\n",
            r"\1\2_sc = gl.where(ok, 1.0, 0.0)\n",
        )
    ],
    "nolo": [
        (r"        s_lo = warpgroup_mma\(kt, ql_s.*\n", ""),
        (
            r"        s_hi, s_lo = warpgroup_mma_wait\(0, deps=\[s_hi, s_lo\]\)\n",
            r"        s_hi = warpgroup_mma_wait(0, deps=[s_hi])\n        s_lo = s_hi\n",
        ),
        (r"        o_lo = warpgroup_mma\(vt, pl_s.*\n", ""),
        (
            r"        o_hi, o_lo = warpgroup_mma_wait\(0, deps=\[o_hi, o_lo\]\)\n",
            r"        o_hi = warpgroup_mma_wait(0, deps=[o_hi])\n        o_lo = o_hi\n",
        ),
    ],
    "novt": [
        (
            r"        w = v_s\.index\(stage\)\.load\(V_BYTES\)\n        vt = .*\n"
            r"        vt = gl\.convert_layout\(vt, A_V\)\n",
            r"        vt = gl.full([128, 64], 1, gl.int8, A_V)\n",
        )
    ],
    "nopv": [
        (
            r"        w = v_s\.index\(stage\)\.load\(V_BYTES\)\n(?:.*\n)*?"
            r"        o \+= \(o_hi \* 128 \+ o_lo\).*\n",
            "",
        )
    ],
}
# fp8 caches: the kernel as generated only (e.g. the e5m2 form, which the op does not take yet,
# beside the int8 one)
PATCHES = {"int4": INT4_PATCHES, "int8": INT8_PATCHES, "fp8e4m3": {}, "fp8e5m2": {}}
EXPERIMENTS = {
    "int4": "base,novscale,nokscale,nokdeq,novdeq",
    "int8": "base,noscale,nolo,novt,nopv",
    "fp8e4m3": "base",
    "fp8e5m2": "base",
}


def patched(spec, names):
    """The generated module of ``spec`` with the text of experiments ``names`` replaced."""
    text = render(spec)
    for name in names:
        for pattern, new in PATCHES[spec.kv][name]:
            text, n = re.subn(pattern, new, text)
            if n == 0:
                raise SystemExit(f"{name}: the patch's text is not in {spec.name}")
    return load_text(spec, text, "_".join(names))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kv", default="int4", choices=tuple(PATCHES), help="the cache format")
    ap.add_argument("--group", type=int, default=32, help="int4 channels a scale")
    ap.add_argument("--dtype", default="bf16", choices=("bf16", "fp16"))
    ap.add_argument("--rows", default="4", help="query heads a KV head, comma-separated")
    ap.add_argument("--experiments", help="comma-separated (default: every one of --kv's)")
    ap.add_argument("--launches", type=int, default=0, help="launch N times, untimed")
    args = ap.parse_args(argv)
    device = torch.device("cuda")
    arch, target = runtime.target_of(device)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    group = args.group if args.kv == "int4" else 0
    spec = GQADecodeSpec(128, 128, args.dtype, args.kv, group, "rows", arch, target)
    int8 = GQADecodeSpec(128, 128, args.dtype, "int8", 0, "rows", arch, target)
    copy_bw = math.nan if args.launches else harness.copy_bandwidth(device)
    print(f"{spec.name}" + ("" if args.launches else f"; copy {copy_bw / 1e9:.0f} GB/s"))
    kernels = {}
    for name in (args.experiments or EXPERIMENTS[args.kv]).split(","):
        parts = [p for p in name.split("+") if p != "base"]
        kernels[name] = (spec, patched(spec, parts) if parts else load(spec))
    if not args.launches and args.kv != "int8":
        kernels["int8 base"] = (int8, load(int8))
    for rows in (int(r) for r in args.rows.split(",")):
        h_q = rows * bench.H_KV
        for label, batch, keys in bench.SHAPES:
            problems = {}
            for name, (s, mod) in kernels.items():
                if s.kv not in problems:
                    problems[s.kv] = bench.problem(s.kv, s.group, [keys] * batch, h_q, device,
                                                   dtype=dtype)  # fmt: skip
                q, k, v, ks, vs, table, sl = problems[s.kv]
                meta = configs.meta_params(s, **gqa_bucket(s, rows, row_align(k, v)))

                def step(_, mod=mod, call=(q, k, v, ks, vs, table, sl), meta=meta):
                    mod.launch(*call, 128**-0.5, False, num_sms=sms, **meta)

                if args.launches:
                    for i in range(args.launches):
                        step(i)
                    torch.cuda.synchronize()
                    print(f"rows={rows} {label} {name}: {args.launches} launches", flush=True)
                    continue
                us = harness.graph_time_us(step, 1, calls=8, replays=5, trials=5)
                print(f"rows={rows} {label:>10} {name:<22} {us:8.1f} us", flush=True)
            del problems
    return 0


if __name__ == "__main__":
    sys.exit(main())
