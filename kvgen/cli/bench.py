"""kvgen bench."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from kvgen.cli import output as show
from kvgen.cli._common import (
    PlotOpt,
    WideOpt,
    app,
    fail,
    need_matplotlib,
    opt,
)
from kvgen.cli.output import err


@app.command("bench")
def bench_cmd(
    tokens: Annotated[str, opt("Comma-separated num_tokens values.")] = "1,16,256,4096,65536",
    ops: Annotated[
        str | None,
        opt(
            "Comma-separated ops: mxfp4, mxfp4-gather, int8, fp8e4m3, fp8e5m2, int4, decode, "
            "gqa_decode, "
            "mla-fp8_ds_mla, mla-fp8 (default: every one but fp8e5m2).",
            show_default=False,
        ),
    ] = None,
    latent: Annotated[int, opt("Latent width of the MXFP4 store.")] = 512,
    group: Annotated[int, opt("MXFP4 group size.")] = 32,
    json_out: Annotated[Path | None, opt("Write the results to this JSON file.", "--json")] = None,
    commit: Annotated[str | None, opt("Commit to record (default: git HEAD).")] = None,
    compare_default: Annotated[
        bool, opt("Also time the store ops' template defaults (what tuning gained).")
    ] = False,
    slot_order: Annotated[
        str,
        opt(
            "The stores' slots: random (decode steps of many sequences), sequential (one "
            "prefill into a fresh cache) or paged (whole pages from the pool, each filled in "
            "order: a prefill as vLLM writes it)."
        ),
    ] = "random",
    plot: PlotOpt = None,
    wide: WideOpt = False,
) -> None:
    """Time the ops with CUDA graphs against a same-run device-to-device copy (and the decode
    against a same-run bf16 matmul).

    MXFP4: latent 512, group 32, bf16, block 64. Per-token-head: 8 heads x 128 and 1 head x 576,
    bf16, block 16 (int4 with 32 channels per scale). MLA decode: batch 128, page 64, 16-128
    heads. --plot draws GB/s against tokens per store op with the copy ceiling, and decode
    TFLOP/s against heads with the matmul ceiling. Exits 1 when a result is wrong.
    """
    import torch

    from kvgen.bench import plots
    from kvgen.bench import run as bench_run
    from kvgen.bench.store import check_slot_order

    try:
        wanted = bench_run.parse_ops(ops)
        check_slot_order(slot_order, "--slot-order")
    except ValueError as exc:
        raise fail(exc) from None
    need_matplotlib(plot)  # before minutes of timing, not after
    if not torch.cuda.is_available():
        raise fail("kvgen bench needs a CUDA GPU (timing the interpreter means nothing)")
    sizes = [int(t) for t in tokens.split(",") if t.strip()]
    doc = bench_run.measure(
        wanted,
        sizes,
        latent=latent,
        group=group,
        compare_default=compare_default,
        commit=commit,
        log=err.print,
        slot_order=slot_order,
    )
    show.print_bench(doc, show.out(wide), compare_default)
    for path, write in ((json_out, bench_run.write_json), (plot, plots.bench_plot)):
        if path is not None:
            write(doc, path)
            err.print(f"wrote {path}")
    if not bench_run.all_correct(doc):
        raise typer.Exit(1)
