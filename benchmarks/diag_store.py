"""Look inside the MXFP4 store on the GPU: registers, layouts, instruction mix (for ncu too).

python benchmarks/diag_store.py            -> per config: regs, spills, layout converts, PTX mix
python benchmarks/diag_store.py ROWS WARPS -> one 65536-token launch (to run under ncu)
"""

import collections
import re
import sys

import torch
import triton

from kvgen.codegen import load
from kvgen.families.mxfp4_mla import StoreMXFP4MLASpec


def launch(rows, warps, tokens=65536, dtype="bf16", latent=512):
    spec = StoreMXFP4MLASpec(32, latent, dtype, "paged", "sm90", "gpu")
    mod = load(spec)
    x = torch.randn(tokens, latent, device="cuda").to(
        getattr(torch, {"bf16": "bfloat16", "fp32": "float32"}[dtype])
    )
    words = mod._as_words(x)
    cache = torch.zeros(tokens // 64 + 1, 64, mod.ROW_BYTES.value, dtype=torch.uint8, device="cuda")
    slots = torch.randperm(cache.shape[0] * 64, device="cuda")[:tokens]
    grid = (triton.cdiv(tokens, rows),)
    k = mod.store_kernel[grid](
        words,
        slots,
        cache,
        tokens,
        words.stride(0),
        1,
        cache.shape[0] * 64,
        64,
        6,  # log2(block_size)
        cache.stride(0),
        ROWS=rows,
        num_warps=warps,
        num_stages=1,
    )
    torch.cuda.synchronize()
    return k


if len(sys.argv) == 3:
    launch(int(sys.argv[1]), int(sys.argv[2]))
    sys.exit(0)

for rows, warps in [(1, 4), (4, 1), (2, 2), (8, 4)]:
    k = launch(rows, warps, tokens=1024)
    ttgir, ptx = k.asm["ttgir"], k.asm["ptx"]
    ops = collections.Counter(
        m.group(1) for m in re.finditer(r"^\s*(?:@%p\d+\s+)?([a-z]+(?:\.[a-z0-9]+)*)", ptx, re.M)
    )
    keep = {
        o: c
        for o, c in ops.items()
        if any(
            o.startswith(p)
            for p in (
                "ld.global",
                "st.global",
                "shfl",
                "bar",
                "st.shared",
                "ld.shared",
                "div",
                "rem",
                "cvt",
                "mul.wide",
            )
        )
    }
    print(
        f"rows={rows} warps={warps} regs={k.n_regs} spills={k.n_spills} "
        f"converts={ttgir.count('convert_layout')} ptx_lines={len(ptx.splitlines())}"
    )
    print("   ", dict(sorted(keep.items())))
    for line in ttgir.splitlines():
        if line.startswith("#blocked") or line.startswith("#linear"):
            print("   ", line[:200])
