"""Per-token-head store launches on vLLM's inline-scale layout beside separate scale caches,
for Nsight Compute (65536 tokens, bf16, the tuned configs of ``$KVGEN_TUNED_CONFIGS`` or the
package's).

    ncu --clock-control none -k regex:store_kernel --metrics <...> \
        python benchmarks/profile_store_kv.py [FMT:HEADS:D ...]

Cases (default int8:8:128 int8:1:576 int4:8:128 int4:1:576), each in both layouts with random
slots (a permutation, as `kvgen bench` uses), then in the inline layout with sequential slots.
Each launch runs twice (the first compiles and warms); L2 is flushed before the second. Prints
the launches in order, so that ncu's report can be read against them.
"""

import sys

import torch

from kvgen.bench.store import kv_cases
from kvgen.ops import (
    triton_reshape_and_cache_flash_int4_per_token_head as store_int4,
)
from kvgen.ops import (
    triton_reshape_and_cache_flash_per_token_head_quant as store_quant,
)

TOKENS = 65536
cases = sys.argv[1:] or ["int8:8:128", "int8:1:576", "int4:8:128", "int4:1:576"]
big = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
n = 0
for spec in cases:
    fmt, heads, d = spec.split(":")
    op = store_int4 if fmt == "int4" else store_quant
    for layout, pattern in (("separate", "random"), ("inline", "random"), ("inline", "sequential")):
        case = next(kv_cases("cuda", (TOKENS,), fmt, int(heads), int(d), torch.bfloat16, layout))
        k, v, kc, vc, ks, vs, slots = case.data[0]
        if pattern == "sequential":
            slots = torch.arange(TOKENS, device="cuda")
        for _ in range(2):
            big.zero_()  # flush L2
            torch.cuda.synchronize()
            op(k, v, kc, vc, ks, vs, slots)
            torch.cuda.synchronize()
        print(f"launches {n}, {n + 1}: {case.variant} {pattern} slots", flush=True)
        n += 2
        del case, k, v, kc, vc, ks, vs, slots
        torch.cuda.empty_cache()
