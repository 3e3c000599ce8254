"""Sweep the MXFP4 store's meta-parameters on the GPU (a stand-in until `kvgen tune` exists).

python benchmarks/sweep_store.py  -> a table of graph time and copy ratio per (rows, warps).
"""

import sys

import torch

from kvgen import runtime
from kvgen.bench import harness, store

device = torch.device("cuda")
copy_bw = harness.copy_bandwidth(device)
print(f"copy {copy_bw / 1e9:.0f} GB/s")
tokens = [int(t) for t in (sys.argv[1] if len(sys.argv) > 1 else "1,16,65536").split(",")]
for dtype, latent in [
    (torch.bfloat16, 512),
    (torch.float32, 512),
    (torch.float16, 512),
    (torch.bfloat16, 448),
]:
    for rows, warps in [(1, 2), (1, 4), (1, 8), (2, 2), (4, 1), (4, 2), (8, 2), (8, 4)]:
        runtime.meta_params = lambda spec, r=rows, w=warps, **size: {  # noqa: E731
            "rows_per_program": r,
            "num_warps": w,
            "num_stages": 1,
        }
        res = store.run(store.mxfp4_cases(device, tokens, latent, 32, dtype), device, copy_bw)
        cells = "  ".join(
            f"T={r.num_tokens}: {r.graph_us:7.2f}us bw {r.bw_ratio:.3f} "
            f"lat {r.latency_ratio:.2f}{'' if r.correct else ' WRONG'}"
            for r in res
        )
        print(f"{str(dtype)[6:]:9s} L={latent} rows={rows:2d} warps={warps}  {cells}", flush=True)
