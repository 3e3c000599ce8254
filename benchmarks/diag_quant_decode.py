"""What bounds the wgmma decode over a quantized cache: time the kernel with one stage of its
loader left out (METHOD: time variants that leave a stage out, take differences).

Each experiment patches the generated module's text (the result is wrong where a stage is left
out: only the time is read) and is timed on FlashMLA's batch (128 x 4096 keys, page 64) against
the unpatched kernel, in the same run:

  base      the kernel as generated
  nodequant the loader skips dequantizing (the K buffers keep what they hold)
  nocopy    the loader issues no copies (its staging buffers keep what they hold)
  cpasync   the rows' bytes by cp.async (per-thread copies) where the launcher would use TMA
  nopage    each tile's page is its index in the sequence (no block-table load; 64 pages in all)
  nowaitk   the loader does not wait for the K buffer to be free
and the configs (block_n, num_stages) of the space that fit.

    python -P benchmarks/diag_quant_decode.py --format fp8_ds_mla --heads 16,128

With --launches N the kernels are launched N times each, untimed, for a profiler:

    ncu --kernel-name split_kernel_roles --launch-skip 2 --launch-count 1 \\
        --section WarpStateStats --section SourceCounters python -P \\
        benchmarks/diag_quant_decode.py --heads 16 --experiments base --configs 32x2 --launches 3
"""

from __future__ import annotations

import argparse
import math
import sys

import torch

from kvgen import runtime
from kvgen.bench import decode, harness
from kvgen.codegen import load
from kvgen.codegen.render import load_text, render
from kvgen.families import mla_decode as md
from kvgen.ops import get_mla_metadata

PATCHES = {
    "nodequant": [
        (
            "            dequant_tile(codes, scales, rope_raw, j % NUM_RAW, k_words.index(buf),\n"
            "                         k_rope_out.index(buf), k_scale, hi - start, "
            "(missed >> (j % 32)) & 1,\n"
            "                         BLOCK_N, USE_TMA)  # fmt: skip\n",
            "",
        )
    ],
    "nocopy": [  # (the staging buffers' barriers still complete: one arrival, or 128)
        (
            "                    raw_tma(raw, jc % NUM_RAW, raw_descs, page * page_size + cstart % "
            "page_size,\n"
            "                            raw_ready.index(jc % NUM_RAW), BLOCK_N)  # fmt: skip\n",
            "                    mbarrier.arrive(raw_ready.index(jc % NUM_RAW))\n",
        ),
        (
            "                    raw_copy(raw, jc % NUM_RAW, k_ptr, pages, cstart, chi, "
            "page_size,\n"
            "                             table_width, num_blocks, stride_k_block, stride_k_row, "
            "BLOCK_N,\n"
            "                             TILE_IN_PAGE)  # fmt: skip\n",
            "",
        ),
    ],
    "cpasync": [  # the rows' bytes by cp.async where TMA could copy them
        (
            "    descs = raw_descriptors(k_cache, block_n) if tile_in_page and k_cache.shape[0] "
            "else None\n",
            "    descs = None\n",
        )
    ],
    "nopage": [
        (
            "    page = gl.load(pages + tp, mask=(start < hi) & (tp < table_width), other=0)\n",
            "    page = tp\n",
        ),
        (
            "        key_pages = gl.load(pages + kp, mask=(t < hi) & (kp < table_width), "
            "other=0)\n",
            "        key_pages = kp\n",
        ),
    ],
    "nowaitk": [
        (
            "            mbarrier.wait(k_empty.index(buf), ((j // NUM_BUF) & 1) ^ 1)  # both "
            "warpgroups done\n            dequant_tile(",
            "            dequant_tile(",
        )
    ],
}


def patched(spec, name):
    """The generated module of ``spec`` with the text of experiment ``name`` replaced."""
    text = render(spec)
    for old, new in PATCHES[name]:
        if text.count(old) != 1:
            raise SystemExit(f"{name}: the patch's text is not in {spec.name} once")
        text = text.replace(old, new)
    return load_text(spec, text, name)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--format", default="fp8_ds_mla", choices=("fp8_ds_mla", "fp8", "mxfp4"))
    ap.add_argument("--heads", default="16,128")
    ap.add_argument("--experiments", default="base,cpasync,nodequant,nocopy,nopage,nowaitk")
    ap.add_argument("--configs", default="32x2,16x4", help="block_n x num_stages")
    ap.add_argument(
        "--launches",
        type=int,
        default=0,
        help="instead of timing, launch each kernel this many times (for a profiler: ncu "
        "--kernel-name split_kernel_roles --launch-skip 2 --launch-count 1 ...)",
    )
    args = ap.parse_args(argv)
    device = torch.device("cuda")
    arch, target = runtime.target_of(device)
    cls = {"fp8_ds_mla": md.MLADecodeDSMLASpec, "fp8": md.MLADecodeFP8Spec}
    spec = cls.get(args.format, md.MLADecodeMXFP4Spec)(576, 512, "bf16", "wgmma", arch, target)
    k_scale = torch.tensor([decode.K_SCALE], device=device)
    extra = {"k_scale": k_scale} if args.format == "fp8" else {}
    copy_bw = math.nan if args.launches else harness.copy_bandwidth(device)
    print(f"{spec.name}" + ("" if args.launches else f"; copy {copy_bw / 1e9:.0f} GB/s"))
    mods = {}
    for name in args.experiments.split(","):
        mods[name] = load(spec) if name == "base" else patched(spec, name)
    equal = [decode.SEQLEN] * decode.BATCH
    for h in (int(x) for x in args.heads.split(",")):
        q, k, table, sl = decode._make(equal, h, device)
        cache = decode.quantized_caches(k, k_scale, (args.format,))[args.format]
        del k
        meta, splits = get_mla_metadata(sl, h, 1)
        nbytes = sum(equal) * cache.shape[-1]
        for cfg in args.configs.split(","):
            bn, st = (int(x) for x in cfg.split("x"))
            mp = {"block_n": bn, "num_stages": st, "split_factor": 1}
            for name, mod in mods.items():
                if name != "base" and cfg != args.configs.split(",")[0]:
                    continue  # (the experiments at the first config only)

                call = (q, cache, table, sl, meta, splits, 576**-0.5, False)

                def step(i, mod=mod, mp=mp, call=call):
                    mod.launch(*call, **mp, **extra)

                if args.launches:
                    for i in range(args.launches):
                        step(i)
                    torch.cuda.synchronize()
                    print(f"h={h:<4} {cfg:<6} {name:<10} {args.launches} launches", flush=True)
                    continue
                try:
                    t = harness.graph_time_us(step, 1, calls=8, replays=5)
                except Exception as exc:  # a config that does not fit
                    print(f"h={h:<4} {cfg:<6} {name:<10} failed: {str(exc)[-120:]}")
                    continue
                ratio = nbytes / (t * 1e-6) / copy_bw
                print(f"h={h:<4} {cfg:<6} {name:<10} {t:8.1f} us  {ratio:.3f} of copy", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
