"""Where the portable decodes go wrong on 16-key tiles of 4-bit codes (on a GPU).

The portable MLA decode over MXFP4 rows and the portable GQA decode over int4 caches gave wrong
results on sm90 with ``block_n`` 16 in every tuning trial under 64-row head tiles, so their
spaces leave those tiles out (``nibble_tiles`` in ``templates/*.space.toml``). This script runs
both kernels at such tiles and at the spaces' neighbours (outside the spaces: the launchers
take any meta), each on its tuning problem's checked batch, and prints the relative error of
each run against the float64 reference, the error of each query row, and of each 32-channel
block of the output, so that a pattern (some rows, some channels, every key) shows:

    python benchmarks/nibble_tile_check.py [--rows R]

No output is written; the exit status is 0 whatever the kernels give.
"""

from __future__ import annotations

import argparse

import torch

from kvgen.codegen import load
from kvgen.families.gqa_decode import GQADecodeSpec
from kvgen.families.mla_decode import MLADecodeMXFP4Spec

# (block_h, block_n, num_warps): the tiles that failed in tuning (16 keys under 64-row head
# tiles, 4 and 8 warps), 2 warps (no trial had them), a 64-row head tile, and 32-key neighbours
TILES = ((16, 16, 4), (16, 16, 2), (16, 16, 8), (32, 16, 4), (64, 16, 8), (16, 32, 4), (16, 32, 8))


def report(label: str, out: torch.Tensor, ref: torch.Tensor) -> None:
    """The error of ``out`` [..., rows, channels] against ``ref``, overall, by row and by
    32-channel block (the worst five of each)."""
    out, ref = out.double().cpu(), ref.double().cpu()
    err = (out - ref).abs()
    rel = float((out - ref).norm() / ref.norm())
    by_row = err.flatten(0, -3).amax(dim=(0, 2)) if err.dim() > 2 else err.amax(dim=1)
    blocks = err.reshape(-1, err.shape[-1] // 32, 32).amax(dim=(0, 2))
    worst_rows = torch.argsort(by_row, descending=True)[:5].tolist()
    worst_blocks = torch.argsort(blocks, descending=True)[:5].tolist()
    print(f"{label}: rel error {rel:.3e}; max |err| {float(err.max()):.3e}")
    print(f"  rows (worst 5): {[(r, round(float(by_row[r]), 4)) for r in worst_rows]}")
    print(
        f"  32-channel blocks (worst 5): {[(b, round(float(blocks[b]), 4)) for b in worst_blocks]}"
    )
    bad = (by_row > 1e-2 * float(ref.abs().max())).nonzero().flatten().tolist()
    print(
        f"  rows off by more than 1 % of the largest output: {len(bad)} of {len(by_row)} {bad[:16]}"
    )


def mla(rows: int, device: str) -> None:
    from kvgen.bench import decode
    from kvgen.families.mla_decode.tuning import pages_read
    from kvgen.formats.mla_decode import mla_decode
    from kvgen.ops._mla_choice import schedule_policy
    from kvgen.ops._mla_metadata import num_sm_parts, schedule

    spec = MLADecodeMXFP4Spec(576, 512, "bf16")
    q, k, table, sl = decode._make([700, 333], rows, device, torch.bfloat16)
    k_scale = torch.tensor([decode.K_SCALE], device=device)
    cache = decode.quantized_caches(k, k_scale, ("mxfp4",))["mxfp4"]
    pages, ref_table = pages_read(table, sl, cache.shape[1])
    k_ref = decode.dequantized("mxfp4", cache[pages], None)
    ref, _ = mla_decode(q.cpu(), k_ref.cpu(), ref_table.cpu(), sl.cpu(), spec.head_dim_v)
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    launch = load(spec).launch
    for bh, bn, warps in TILES:
        if bh > rows:
            continue
        meta = dict(block_h=bh, block_n=bn, num_warps=warps, num_stages=2, split_factor=1,
                    page_ahead=0)  # fmt: skip
        parts = num_sm_parts(sms, rows, 1, meta["split_factor"])
        sched = schedule(sl, parts, schedule_policy(spec.variant))
        out, _ = launch(q, cache, table, sl, *sched, spec.head_dim**-0.5, False, **meta)
        torch.cuda.synchronize()
        report(f"MXFP4 MLA portable, {rows} rows, block_h {bh}, block_n {bn}, {warps} warps",
               out, ref)  # fmt: skip


def gqa(rows: int, device: str) -> None:
    from kvgen.bench import gqa_decode as bench

    spec = GQADecodeSpec(kv="int4", group=32)
    (q, k, v, ks, vs, table, sl), (ref, _) = bench.checked_problem(
        "int4", 32, rows * bench.H_KV, device
    )
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    launch = load(spec).launch
    for bh, bn, warps in TILES:
        if bh > max(rows, 16):
            continue
        meta = dict(block_h=bh, block_n=bn, num_warps=warps, num_stages=2, split_factor=1,
                    max_regs=0)  # fmt: skip
        out, _ = launch(q, k, v, ks, vs, table, sl, 128**-0.5, False, num_sms=sms, **meta)
        torch.cuda.synchronize()
        report(f"int4 GQA portable, {rows} rows a KV head, block_h {bh}, block_n {bn}, "
               f"{warps} warps", out, ref)  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[16, 32])
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("nibble_tile_check.py needs a CUDA GPU")
    for rows in args.rows:
        mla(rows, "cuda")
        gqa(rows, "cuda")


if __name__ == "__main__":
    main()
