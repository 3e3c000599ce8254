"""One MXFP4 store launch (65536 tokens, latent 512, bf16) per slot pattern, for Nsight Compute.

    ncu --clock-control none -k regex:store_kernel -c 4 --metrics <...> \
        python benchmarks/profile_store_slots.py

Each pattern launches twice (the first compiles and warms); L2 is flushed before the second.
Patterns: random slots (a permutation, as `kvgen bench` uses), then sequential slots.
"""

import torch

from kvgen.ops import store_mxfp4_mla

t = 65536
latent = 512
pitch = 272
bs = 64
blocks = t // bs + 1
x = torch.randn(t, latent, device="cuda").to(torch.bfloat16)
cache = torch.zeros(blocks, bs, pitch, dtype=torch.uint8, device="cuda")
big = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
for name, slots in (
    ("random", torch.randperm(blocks * bs, device="cuda")[:t]),
    ("sequential", torch.arange(t, device="cuda")),
):
    store_mxfp4_mla(x, slots, cache)  # compile / warm
    big.zero_()  # flush L2
    torch.cuda.synchronize()
    store_mxfp4_mla(x, slots, cache)
    torch.cuda.synchronize()
    print(name, "done", flush=True)
