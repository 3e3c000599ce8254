"""What ``kvgen bench`` measures, as one document: the environment, the ceilings measured in the
same run (device-to-device copy, bf16 matmul), a row per store op and size, a row per decode
variant, length mix and head count. The CLI prints and plots it; ``--json`` writes it."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import asdict

# the ops `kvgen bench --ops` takes; "decode" is the MLA decode at FlashMLA's shapes
STORE_OPS = ("mxfp4", "mxfp4-gather", "int8", "fp8e4m3", "fp8e5m2", "int4")
OPS = (*STORE_OPS, "decode")
DEFAULT_OPS = ("mxfp4", "mxfp4-gather", "int8", "fp8e4m3", "int4", "decode")


def measure(
    ops: list[str],
    sizes: list[int],
    *,
    latent: int = 512,
    group: int = 32,
    compare_default: bool = False,
    commit: str | None = None,
    log: Callable[[str], None] = print,
) -> dict:
    """Time ``ops`` (of ``OPS``) on this machine's first GPU; the bench document."""
    import torch

    from kvgen.bench import harness, store

    unknown = sorted(set(ops) - set(OPS))
    if unknown:
        raise ValueError(f"unknown ops {', '.join(unknown)}; known: {', '.join(OPS)}")
    device = torch.device("cuda")
    env = harness.environment(commit)
    log(f"{env['device']}: measuring the copy ceiling ...")
    copies = harness.copy_bandwidths(device)
    copy_bw = max(copies.values())
    for how, bw in copies.items():
        log(f"  device-to-device copy, {how}: {bw / 1e9:.0f} GB/s (read + write)")

    def progress(row):
        log(
            f"  {row.variant} tokens={row.num_tokens}: {row.graph_us:.2f} us, "
            f"{row.gbps:.0f} GB/s ({row.bw_ratio:.2f} of copy)"
        )

    cases = []
    if "mxfp4" in ops:
        cases.append(store.mxfp4_cases(device, sizes, latent, group))
    if "mxfp4-gather" in ops:
        cases.append(store.mxfp4_gather_cases(device, sizes, latent, group))
    for fmt in (o for o in ops if o in STORE_OPS and not o.startswith("mxfp4")):
        for heads, head_size in store.KV_SHAPES:
            cases.append(store.kv_cases(device, sizes, fmt, heads, head_size))
    rows = store.run(itertools.chain(*cases), device, copy_bw, progress, compare_default)
    decode_rows, mm = [], None
    if "decode" in ops:
        from kvgen.bench import decode

        if compare_default:
            log(
                "note: --compare-default times the store ops only; `kvgen show` lists the "
                "decode's default and tuned times per bucket, measured when it was tuned"
            )
        mm = decode.matmul_rate(device)
        log(f"bf16 matmul 8192^3: {mm / 1e12:.0f} TFLOP/s")
        decode_rows = decode.run(
            device,
            copy_bw,
            mm,
            progress=lambda r: log(
                f"  decode {r.variant} {r.lengths} h={r.heads}: {r.graph_us:.1f} us"
            ),
        )
    return {
        "env": env,
        "copy_bandwidth_GBps": copy_bw / 1e9,
        "copy_bandwidths_GBps": {k: v / 1e9 for k, v in copies.items()},
        "matmul_TFLOPs": None if mm is None else mm / 1e12,
        "results": [asdict(r) for r in rows],
        "decode": [asdict(r) for r in decode_rows],
    }


def all_correct(doc: dict) -> bool:
    return all(r["correct"] for r in [*doc["results"], *doc["decode"]])
