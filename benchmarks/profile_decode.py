"""Decode launches at the bench's shapes, for Nsight Compute: the kernels the ops choose, with the
tuned configs of ``$KVGEN_TUNED_CONFIGS`` or the package's.

    ncu --clock-control none -k regex:split_kernel --set full -o decode \\
        python benchmarks/profile_decode.py [CASE ...]

Cases (default: all), each at batch 128 x 4096:
  gqa-bf16, gqa-int8, gqa-fp8e4m3, gqa-int4   paged GQA decode, 8 KV heads x 128, block 16,
                                              32 query heads (``flash_attn_with_kvcache``)
  gqa-int8-inline, gqa-fp8e4m3-inline,        the same over vLLM's rows, the scales inline
  gqa-int4-inline
  mla-bf16, mla-fp8_ds_mla, mla-mxfp4         576/512 MLA decode, page 64, 16 heads
                                              (``flash_mla_with_kvcache``)
Each op runs twice (the first compiles and warms); L2 is flushed before the second. Prints the
cases in order with the kernels' names, so that ncu's report can be read against them.
"""

import sys

import torch

from kvgen.bench import decode as mla_bench
from kvgen.bench import gqa_decode as gqa_bench
from kvgen.ops import flash_attn_with_kvcache, flash_mla_with_kvcache, get_mla_metadata

BATCH, SEQLEN = 128, 4096
DEVICE = "cuda"
GQA = {"gqa-bf16": ("auto", 0), "gqa-int8": ("int8", 0), "gqa-fp8e4m3": ("fp8e4m3", 0),
       "gqa-int4": ("int4", 32), "gqa-int8-inline": ("int8", 0, "inline"),
       "gqa-fp8e4m3-inline": ("fp8e4m3", 0, "inline"),
       "gqa-int4-inline": ("int4", 32, "inline")}  # fmt: skip
MLA = ("mla-bf16", "mla-fp8_ds_mla", "mla-mxfp4")


def gqa_call(kv, group, layout="nhd"):
    q, k, v, ks, vs, table, sl = gqa_bench.problem(kv, group, [SEQLEN] * BATCH, 32, DEVICE,
                                                   layout=layout)  # fmt: skip
    return lambda: flash_attn_with_kvcache(
        q, k, v, cache_seqlens=sl, block_table=table, k_scale_cache=ks, v_scale_cache=vs
    )


def mla_call(fmt):
    q, k, table, sl = mla_bench._make([SEQLEN] * BATCH, 16, DEVICE)
    if fmt != "bf16":
        k = mla_bench.quantized_caches(k, torch.tensor([mla_bench.K_SCALE], device=DEVICE),
                                       (fmt,))[fmt]  # fmt: skip
    meta, splits = get_mla_metadata(sl, 16, 1)
    return lambda: flash_mla_with_kvcache(q, k, table, sl, 512, meta, splits)


def sync():
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def main(cases):
    big = torch.empty(256 << 20, dtype=torch.uint8, device=DEVICE)
    for case in cases:
        if case in GQA:
            call = gqa_call(*GQA[case])
        elif case in MLA:
            call = mla_call(case.removeprefix("mla-"))
        else:
            sys.exit(f"profile_decode.py: unknown case {case!r} (one of {[*GQA, *MLA]})")
        for _ in range(2):
            big.zero_()  # flush L2
            sync()
            call()
            sync()
        print(f"case {case}: launched twice", flush=True)
        del call
        if DEVICE == "cuda":
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main(sys.argv[1:] or [*GQA, *MLA])
