"""The ``kvgen`` command line: list, gen, verify, bench, tune, show."""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table
from rich.text import Text

app = typer.Typer(
    name="kvgen",
    help="Generate, verify, benchmark and tune Triton kernels for quantized paged KV caches.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    # Plain help text, re-wrapped to the terminal (rich's keeps the docstrings' line breaks and
    # cuts long option texts when stdout is not a terminal).
    rich_markup_mode=None,
)
# Markup off: names, paths and error messages (with their [brackets]) print as they are; styles
# come from Text objects only.
err = Console(stderr=True, soft_wrap=True, markup=False, highlight=False)


def _console(wide: bool = False) -> Console:
    """stdout: tables at their full width when stdout is not a terminal (a file, a pipe) or
    with --wide, so that no name or value is cut."""
    if wide or not sys.stdout.isatty():
        return Console(width=100_000, markup=False, highlight=False)
    return Console(markup=False, highlight=False)


def _fail(message: object, code: int = 2) -> typer.Exit:
    """Print ``error: message`` (never parsed as markup) to stderr; raise the returned Exit."""
    err.print(Text.assemble(("error: ", "bold red"), str(message)))
    return typer.Exit(code)


def _print_json(doc: object) -> None:
    """JSON on stdout; non-finite numbers (an infinite error) as null."""

    def clean(v):
        if isinstance(v, float) and not math.isfinite(v):
            return None
        if isinstance(v, dict):
            return {k: clean(x) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return [clean(x) for x in v]
        return v

    print(json.dumps(clean(doc), indent=2, sort_keys=True, allow_nan=False))


def _version(value: bool) -> None:
    if value:
        import kvgen

        print(f"kvgen {kvgen.__version__}")
        raise typer.Exit()


@app.callback()
def _main(
    version: Annotated[
        bool,
        typer.Option("--version", callback=_version, is_eager=True, help="Print the version."),
    ] = False,
) -> None:
    """Generate, verify, benchmark and tune Triton kernels for quantized paged KV caches."""


WideOpt = Annotated[
    bool, typer.Option("--wide", help="Full-width tables on a terminal too (never cut a name).")
]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")]
ArchOpt = Annotated[
    str | None,
    typer.Option("--arch", help="Target arch (sm80, sm89, sm90, sm100). Default: this machine's."),
]
TargetOpt = Annotated[
    str | None,
    typer.Option(
        "--target", help="gpu or interp (Triton's CPU interpreter). Default: this machine's."
    ),
]
NamesArg = Annotated[
    list[str] | None,
    typer.Argument(help="Variant or family names (default: every variant).", show_default=False),
]


def _use_interpreter_without_gpu() -> None:
    """On a machine with no GPU, run kernels in Triton's interpreter (before any kernel loads)."""
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")


def _arch(arch: str, hint: str = "ARCH") -> str:
    """``arch`` if kvgen knows it; else the usage error every command gives (exit 2)."""
    from kvgen.codegen.spec import ARCHS

    if arch not in ARCHS:
        raise typer.BadParameter(
            f"unknown arch {arch!r}; expected one of {', '.join(ARCHS)}", param_hint=hint
        )
    return arch


def _target(arch: str | None, target: str | None) -> tuple[str, str]:
    from kvgen.codegen.spec import TARGETS
    from kvgen.runtime import local_target

    local_arch, local_tgt = local_target()
    arch = _arch(arch or local_arch, "--arch")
    target = target or local_tgt
    if target not in TARGETS:
        raise typer.BadParameter(
            f"unknown target {target!r}; expected one of {', '.join(TARGETS)}",
            param_hint="--target",
        )
    return arch, target


def _specs(names, arch, target):
    """The specs ``names`` name (every variant of arch/target when none): a full variant name
    is taken with the arch and target it spells, family names with ``arch`` and ``target``."""
    from kvgen import registry

    if not names:
        return registry.variants(arch, target)
    try:
        return registry.lookup(names, arch, target)
    except KeyError as exc:
        raise _fail(exc.args[0]) from None


@app.command("list")
def list_cmd(
    arch: ArchOpt = None,
    target: TargetOpt = None,
    family: Annotated[str | None, typer.Option(help="Only this kernel family.")] = None,
    as_json: JsonOpt = False,
) -> None:
    """Print the name of every variant the registry can generate, one per line."""
    _use_interpreter_without_gpu()
    from kvgen import registry

    arch, target = _target(arch, target)
    if family is not None and family not in registry.families():
        raise _fail(f"unknown family {family!r}; known: {', '.join(registry.families())}")
    specs = registry.variants(arch, target, family)
    if as_json:
        _print_json([{"name": s.name, "family": s.family, "fields": s.fields()} for s in specs])
        return
    for spec in specs:
        print(spec.name)


@app.command("gen")
def gen_cmd(
    names: NamesArg = None,
    out: Annotated[
        Path, typer.Option("--out", "-o", help="Folder to write the sources into.")
    ] = Path("kvgen_generated"),
    arch: ArchOpt = None,
    target: TargetOpt = None,
) -> None:
    """Write the generated source of variants into a folder, for reading or review.

    A full variant name generates that variant whatever this machine is (its name says its
    arch and target); --arch and --target choose the variants of family names.
    """
    _use_interpreter_without_gpu()
    from kvgen.codegen import render, write_source

    arch, target = _target(arch, target)
    specs = _specs(names, arch, target)
    written = 0
    for spec in specs:
        written += write_source(out / f"{spec.name}.py", render(spec))
    err.print(
        f"{len(specs)} variants in {out}/ ({written} written, {len(specs) - written} unchanged)"
    )


@app.command("verify")
def verify_cmd(
    names: NamesArg = None,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="Print failures only.")] = False,
    accuracy: Annotated[
        bool,
        typer.Option(
            "--accuracy",
            help="Print SNR and max error of every format on Gaussian and heavy-tailed data "
            "instead (to pick a format).",
        ),
    ] = False,
    as_json: JsonOpt = False,
    wide: WideOpt = False,
) -> None:
    """Run every variant against the pure-torch reference on this machine.

    On a machine without a GPU the kernels run in Triton's CPU interpreter. Exits 1 when a
    variant fails.
    """
    _use_interpreter_without_gpu()
    if accuracy:
        _accuracy(as_json, wide)
        return

    from kvgen.verify import verify

    arch, target = _target(None, None)
    device = "cuda" if target == "gpu" else "cpu"
    specs = _specs(names, arch, target)
    elsewhere = [s.name for s in specs if (s.arch, s.target) != (arch, target)]
    if elsewhere:
        raise _fail(
            f"this machine runs {arch}/{target} variants; cannot verify {', '.join(elsewhere)}"
        )
    results = []
    with err.status("verifying") as status:
        for i, spec in enumerate(specs, 1):
            status.update(f"[{i}/{len(specs)}] {spec.name}")
            results.append(verify(spec, device))
    failed = sum(not r.passed for r in results)
    if as_json:
        import dataclasses

        _print_json(
            {
                "arch": arch,
                "target": target,
                "passed": len(results) - failed,
                "failed": failed,
                "results": [dataclasses.asdict(r) for r in results],
            }
        )
    else:
        table = Table(title=f"kvgen verify ({arch}, {target})")
        for col in ("variant", "result", "mismatched", "max error", "detail"):
            table.add_column(col, justify="right" if col in ("mismatched", "max error") else "left")
        for r in results:
            if not quiet or not r.passed:
                table.add_row(
                    r.name,
                    Text("pass", "green") if r.passed else Text("FAIL", "bold red"),
                    str(r.mismatched),
                    f"{r.max_error:.3g}",
                    r.detail,
                )
        out = _console(wide)
        if table.row_count:
            out.print(table)
        out.print(f"{len(results) - failed} passed, {failed} failed")
    if failed:
        raise typer.Exit(1)


def _accuracy(as_json: bool, wide: bool) -> None:
    from kvgen.verify import accuracy_table

    with err.status("quantizing"):
        rows = accuracy_table()
    if as_json:
        _print_json(rows)
        return
    data_names = list(dict.fromkeys(r["data"] for r in rows))
    table = Table(title="quantize -> dequantize: SNR dB (max |error| / row absmax)")
    table.add_column("format")
    for d in data_names:
        table.add_column(d, justify="right")
    for fmt in dict.fromkeys(r["format"] for r in rows):
        cells = {r["data"]: r for r in rows if r["format"] == fmt}
        table.add_row(
            fmt, *(f"{cells[d]['snr_db']:.1f} ({cells[d]['max_err_amax']:.3f})" for d in data_names)
        )
    _console(wide).print(table)


@app.command("bench")
def bench_cmd(
    tokens: Annotated[
        str, typer.Option(help="Comma-separated num_tokens values.")
    ] = "1,16,256,4096,65536",
    ops: Annotated[
        str | None,
        typer.Option(
            help="Comma-separated ops: mxfp4, mxfp4-gather, int8, fp8e4m3, fp8e5m2, int4, decode "
            "(each family's; default: every one but fp8e5m2).",
            show_default=False,
        ),
    ] = None,
    latent: Annotated[int, typer.Option(help="Latent width of the MXFP4 store.")] = 512,
    group: Annotated[int, typer.Option(help="MXFP4 group size.")] = 32,
    json_out: Annotated[
        Path | None,
        typer.Option("--json", help="Write the results to this JSON file."),
    ] = None,
    commit: Annotated[
        str | None, typer.Option(help="Commit to record (default: git HEAD).")
    ] = None,
    compare_default: Annotated[
        bool,
        typer.Option(
            help="Also time the store ops' template defaults, to show what tuning "
            "gained (the decode's are in `kvgen show`, from its tuning)."
        ),
    ] = False,
    plot: Annotated[
        Path | None,
        typer.Option(
            "--plot",
            help="Also draw the results to this PNG: GB/s against tokens per store op with "
            "the copy ceiling, decode TFLOP/s against heads with the matmul ceiling "
            "(needs matplotlib: pip install 'kvgen[plot]').",
        ),
    ] = None,
    wide: WideOpt = False,
) -> None:
    """Time the store ops with CUDA graphs against a same-run device-to-device copy.

    MXFP4: latent 512, group 32, bf16, block 64. Per-token-head: 8 heads x 128 and 1 head x 576,
    bf16, block 16 (int4 with 32 channels per scale). Exits 1 when a result is wrong.
    """
    import torch

    from kvgen.bench import run as bench_run

    if ops is None:
        wanted = bench_run.default_ops()
    else:
        wanted = [o.strip() for o in ops.split(",") if o.strip()]
    unknown = sorted(set(wanted) - set(bench_run.ops()))
    if unknown:
        raise _fail(f"unknown ops {', '.join(unknown)}; known: {', '.join(bench_run.ops())}")
    if plot is not None:
        _need_matplotlib()  # before minutes of timing, not after
    if not torch.cuda.is_available():
        raise _fail("kvgen bench needs a CUDA GPU (timing the interpreter means nothing)")
    sizes = [int(t) for t in tokens.split(",") if t.strip()]
    doc = bench_run.measure(
        wanted,
        sizes,
        latent=latent,
        group=group,
        compare_default=compare_default,
        commit=commit,
        log=err.print,
    )
    _print_bench(doc, _console(wide), compare_default)
    if json_out is not None:
        json_out.parent.mkdir(parents=True, exist_ok=True)
        json_out.write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")
        err.print(f"wrote {json_out}")
    if plot is not None:
        from kvgen.bench import plots

        plots.bench_plot(doc, plot)
        err.print(f"wrote {plot}")
    if not bench_run.all_correct(doc):
        raise typer.Exit(1)


def _print_bench(doc: dict, out: Console, compare_default: bool) -> None:
    copy, mm = doc["copy_bandwidth_GBps"], doc["matmul_TFLOPs"]
    if doc["results"]:
        table = Table(title=f"kvgen bench on {doc['env']['device']} (copy {copy:.0f} GB/s)")
        cols = [
            "variant",
            "tokens",
            "graph us",
            "eager us",
            "GB/s",
            "x copy BW",
            "copy us",
            "x copy time",
            "ok",
        ]
        if compare_default:
            cols.insert(3, "default us")
        for col in cols:
            table.add_column(col, justify="left" if col == "variant" else "right")
        for r in doc["results"]:
            cells = [
                r["variant"],
                str(r["num_tokens"]),
                f"{r['graph_us']:.2f}",
                f"{r['eager_us']:.2f}",
                f"{r['gbps']:.0f}",
                f"{r['bw_ratio']:.3f}",
                f"{r['copy_graph_us']:.2f}",
                f"{r['latency_ratio']:.2f}",
                _ok(r["correct"]),
            ]
            if compare_default:
                cells.insert(3, f"{r['default_graph_us']:.2f}")
            table.add_row(*cells)
        out.print(table)
        out.print("goals: x copy BW >= 0.85 at 65536 tokens; x copy time <= 1.2 at 1-16 tokens")
    if doc["decode"]:
        dt = Table(
            title=f"MLA decode, batch 128, page 64 (copy {copy:.0f} GB/s, matmul {mm:.0f} TFLOP/s)"
        )
        for col in (
            "variant",
            "lengths",
            "heads",
            "us",
            "KV GB/s",
            "TFLOP/s",
            "x copy BW",
            "x matmul",
            "ok",
        ):
            dt.add_column(col, justify="left" if col in ("variant", "lengths") else "right")
        for r in doc["decode"]:
            dt.add_row(
                r["variant"],
                r["lengths"],
                str(r["heads"]),
                f"{r['graph_us']:.1f}",
                f"{r['gbps']:.0f}",
                f"{r['tflops']:.0f}",
                f"{r['bw_ratio']:.2f}",
                f"{r['mm_ratio']:.2f}",
                _ok(r["correct"]),
            )
        out.print(dt)
        out.print(
            "goals: heads <= 32 >= 0.80 x copy BW; heads 128 >= 0.50 x matmul; "
            "mixed within 10% of equal"
        )


def _need_matplotlib() -> None:
    from kvgen.bench import plots

    try:
        plots.require_matplotlib()
    except RuntimeError as exc:
        raise _fail(exc) from None


def _ok(correct: bool) -> Text:
    return Text("yes") if correct else Text("NO", "bold red")


@app.command("tune")
def tune_cmd(
    names: NamesArg = None,
    arch: Annotated[str, typer.Option(help="Arch to tune for; must be this GPU's.")] = "sm90",
    trials: Annotated[int, typer.Option(help="Trials per (variant, bucket) study.")] = 40,
    timeout: Annotated[float | None, typer.Option(help="Wall-clock budget in seconds.")] = None,
    sampler: Annotated[str, typer.Option(help="tpe (default), grid or random.")] = "tpe",
    storage: Annotated[
        str | None,
        typer.Option(
            help="Optuna storage: a URL (sqlite:///f.db, postgresql://...) or a "
            "journal file (default ~/.cache/kvgen/tune/<arch>.journal)."
        ),
    ] = None,
    buckets: Annotated[
        str | None,
        typer.Option(help="Only these num_tokens buckets (comma-separated; other ops: all)."),
    ] = None,
    heads: Annotated[
        str | None,
        typer.Option(help="Only these num_heads buckets (comma-separated; other ops: all)."),
    ] = None,
    out: Annotated[
        Path | None, typer.Option(help="tuned_configs folder to write (default: the package's).")
    ] = None,
    force: Annotated[bool, typer.Option(help="Tune although this GPU is not --arch.")] = False,
    families: Annotated[
        str | None,
        typer.Option(
            "--family", help="Only the default variants of these families (comma-separated)."
        ),
    ] = None,
    jobs_opt: Annotated[
        int,
        typer.Option(
            "--jobs",
            "-j",
            help="Processes that compile each variant's candidates "
            "up front (timing stays serial); 1: off.",
            show_default="CPU count - 1",
        ),
    ] = 0,
    gpus: Annotated[
        int,
        typer.Option(
            help="GPUs to tune on, one worker process each, sharing the studies "
            "(default: all visible)."
        ),
    ] = 0,
    confirm: Annotated[
        int,
        typer.Option(
            help="Re-time each study's best N configs (all, in a study of 8 or fewer) and "
            "the default in 3 alternated rounds; keep the lowest median (0: the best trial).",
            min=0,
        ),
    ] = 3,
) -> None:
    """Tune meta-parameters with Optuna and write tuned_configs/<arch>/<family>.json.

    Every trial is checked against the reference and timed with CUDA graphs, in a worker
    process per GPU (a candidate that breaks its GPU context ends that worker only); an
    interrupted run resumes from its storage. With several GPUs (or several hosts sharing a
    --storage postgresql://... database, each running this command), the trials of every study
    are spread over all workers. Before writing, the best few configs of each study and the
    default are timed again in alternated rounds (--confirm), so that one lucky timing does not
    pick the config.
    """
    import torch

    arch = _arch(arch, "--arch")
    try:
        import optuna  # noqa: F401
    except ImportError:
        raise _fail("kvgen tune needs optuna: pip install 'kvgen[tune]'") from None
    if not torch.cuda.is_available():
        raise _fail("kvgen tune needs a CUDA GPU")
    from kvgen.bench import harness
    from kvgen.runtime import local_target
    from kvgen.tune import parallel
    from kvgen.tune import run as tune_run
    from kvgen.tune.plan import plan

    here, _ = local_target()
    if here != arch and not force:
        raise _fail(f"this GPU is {here}, not {arch}; pass --force to tune anyway")

    def ints(text):
        return {int(v) for v in text.split(",")} if text else None

    try:
        studies = plan(
            names,
            arch,
            families={f.strip() for f in families.split(",")} if families else None,
            num_tokens=ints(buckets),
            num_heads=ints(heads),
        )
    except KeyError as exc:
        raise _fail(exc.args[0]) from None
    devices = parallel.visible_devices()
    if gpus > len(devices):
        raise _fail(f"--gpus {gpus}, but {len(devices)} GPU(s) are visible")
    opts = tune_run.Options(arch, storage, sampler, trials, timeout, jobs_opt, confirm, out)
    try:
        tune_run.run(
            studies, devices[: gpus or len(devices)], opts, harness.environment(), log=err.print
        )
    except KeyboardInterrupt:
        err.print("\ninterrupted: nothing written; the same command resumes the studies")
        raise typer.Exit(130) from None


@app.command("show")
def show_cmd(
    arch: Annotated[str | None, typer.Argument(help="Arch (default: this machine's).")] = None,
    as_json: JsonOpt = False,
    wide: WideOpt = False,
    plot: Annotated[
        Path | None,
        typer.Option(
            "--plot",
            help="Also draw tuned against default time per bucket to this PNG (needs "
            "matplotlib: pip install 'kvgen[plot]').",
        ),
    ] = None,
) -> None:
    """Print the tuned configs of an arch as a table.

    Where an op chooses between variants by their tuned times (the MLA decode's portable
    and wgmma), the "used" column marks the variant it takes at each bucket.
    """
    from kvgen import configs, registry

    arch = _arch(arch) if arch is not None else _target(None, None)[0]
    if plot is not None:
        from kvgen.bench import plots

        _need_matplotlib()
    files = configs.files(arch)
    if not files:
        raise _fail(
            f"no tuned configs for {arch} (looked in {', '.join(map(str, configs.folders(arch)))})",
            code=1,
        )
    docs = []
    for path in files:
        doc, errors = configs.read(path, arch)
        if errors:
            err.print(Text(f"{path}: invalid ({'; '.join(errors[:3])})", "yellow"))
            continue
        docs.append(
            {
                "file": str(path),
                "family": doc["family"],
                "env": doc["env"],
                "provenance": doc["provenance"],
                "rows": configs.rows(doc, registry.spec_class(doc["family"])),
            }
        )
    if as_json:
        _print_json({"arch": arch, "files": docs})
    else:
        out = _console(wide)
        for d in docs:
            prov, env = d["provenance"], d["env"]
            table = Table(title=f"{d['file']} ({env['device']}, {prov['sampler']}, {prov['date']})")
            for col in ("variant", "bucket", "meta", "us", "default us", "speedup", "used"):
                right = "us" in col or col == "speedup"
                table.add_column(col, justify="right" if right else "left")
            for r in d["rows"]:
                meta = " ".join(f"{k}={v}" for k, v in sorted(r["meta"].items()))
                table.add_row(
                    r["variant"],
                    r["bucket"],
                    meta,
                    f"{r['time_us']:.2f}",
                    f"{r['default_time_us']:.2f}",
                    f"{r['speedup']:.2f}",
                    "yes" if r["used"] else "",
                )
            out.print(table)
    if plot is not None:
        plots.show_plot(arch, docs, plot)
        err.print(f"wrote {plot}")


def main() -> None:
    try:
        app()
    except BrokenPipeError:  # `kvgen list | head`
        sys.stderr.close()


if __name__ == "__main__":
    main()
