"""kvgen list, gen, verify and show."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

import typer

from kvgen.cli import output as show
from kvgen.cli._common import (
    ArchOpt,
    JsonOpt,
    NamesArg,
    PlotOpt,
    TargetOpt,
    WideOpt,
    app,
    choice,
    fail,
    need_matplotlib,
    opt,
    resolve_target,
    specs_named,
    use_interpreter_without_gpu,
)
from kvgen.cli.output import err


@app.command("list")
def list_cmd(
    names: NamesArg = None,
    arch: ArchOpt = None,
    target: TargetOpt = None,
    family: Annotated[str | None, opt("Only this kernel family.")] = None,
    as_json: JsonOpt = False,
) -> None:
    """Print the name of every variant the registry can generate, one per line (with NAMEs, the
    variants they give: what gen, verify and tune would take for them)."""
    use_interpreter_without_gpu()
    from kvgen import registry

    arch, target = resolve_target(arch, target)
    if family is not None and family not in registry.families():
        raise fail(f"unknown family {family!r}; known: {', '.join(registry.families())}")
    if names:
        specs = [s for s in specs_named(names, arch, target) if family in (None, s.family)]
    else:
        specs = registry.variants(arch, target, family)
    if as_json:
        show.print_json([{"name": s.name, "family": s.family, "fields": s.fields()} for s in specs])
    else:
        for spec in specs:
            print(spec.name)


@app.command("gen")
def gen_cmd(
    names: NamesArg = None,
    out: Annotated[Path, opt("Folder to write the sources into.", "--out", "-o")] = Path(
        "kvgen_generated"
    ),
    arch: ArchOpt = None,
    target: TargetOpt = None,
) -> None:
    """Write the generated source of variants into a folder, for reading or review.

    A full variant name generates that variant whatever this machine is (its name says its
    arch and target); --arch and --target choose the variants of family names.
    """
    use_interpreter_without_gpu()
    from kvgen.codegen import render, write_source

    specs = specs_named(names, *resolve_target(arch, target))
    written = sum(write_source(out / f"{spec.name}.py", render(spec)) for spec in specs)
    err.print(
        f"{len(specs)} variants in {out}/ ({written} written, {len(specs) - written} unchanged)"
    )


@app.command("verify")
def verify_cmd(
    names: NamesArg = None,
    quiet: Annotated[bool, opt("Print failures only.", "--quiet", "-q")] = False,
    wide: WideOpt = False,
    accuracy: Annotated[
        bool, opt("Print every format's SNR and max error on three data sets instead.")
    ] = False,
    as_json: JsonOpt = False,
    jobs: Annotated[
        int,
        opt(
            "Worker processes (default: the CPU count under the interpreter, 1 on a GPU).",
            "--jobs",
            "-j",
            show_default=False,
        ),
    ] = 0,
) -> None:
    """Run every variant against the pure-torch reference on this machine.

    On a machine without a GPU the kernels run in Triton's CPU interpreter, the variants
    spread over one worker process a CPU core. Exits 1 when a variant fails. --accuracy prints
    what each format keeps of Gaussian, heavy-tailed and outlier-channel data (to pick a
    format).
    """
    use_interpreter_without_gpu()
    from kvgen import verify

    if accuracy:
        with err.status("quantizing"):
            rows, mla = verify.accuracy_table(), verify.mla_accuracy_table()
            gqa = verify.gqa_accuracy_table()
        if as_json:
            show.print_json({"formats": rows, "decode": mla, "gqa": gqa})
        else:
            show.out(wide).print(show.accuracy_table(rows))
            show.out(wide).print(show.mla_accuracy_table(mla))
            show.out(wide).print(show.gqa_accuracy_table(gqa))
        return
    arch, target = resolve_target(None, None)
    specs = specs_named(names, arch, target)
    elsewhere = [s.name for s in specs if (s.arch, s.target) != (arch, target)]
    if elsewhere:
        raise fail(
            f"this machine runs {arch}/{target} variants; cannot verify {', '.join(elsewhere)}"
        )
    if jobs < 0:
        raise fail(f"--jobs must be 0 (the default) or more; got {jobs}")
    if jobs == 0:
        jobs = 1 if target == "gpu" else (os.cpu_count() or 1)
    with err.status("verifying") as status:
        results = verify.verify_all(
            specs,
            "cuda" if target == "gpu" else "cpu",
            jobs,
            progress=lambda i, n, name: status.update(f"[{i}/{n}] {name}"),
        )
    doc = verify.report(results, arch, target)
    if as_json:
        show.print_json(doc)
    else:
        shown = [r for r in results if not quiet or not r.passed]
        if shown:
            show.out(wide).print(show.verify_table(f"kvgen verify ({arch}, {target})", shown))
        show.out(wide).print(f"{doc['passed']} passed, {doc['failed']} failed")
    if doc["failed"]:
        raise typer.Exit(1)


@app.command("show")
def show_cmd(
    arch: Annotated[str | None, typer.Argument(help="Arch (default: this machine's).")] = None,
    as_json: JsonOpt = False,
    wide: WideOpt = False,
    plot: PlotOpt = None,
) -> None:
    """Print the tuned configs of an arch as a table.

    Where an op chooses between variants by their tuned times (the MLA decode's portable
    and wgmma), the "used" column marks the variant it takes at each bucket. --plot draws tuned
    against default time per bucket.
    """
    from kvgen import configs, registry
    from kvgen.codegen.spec import ARCHS

    arch = (
        choice(arch, ARCHS, "arch", "ARCH") if arch is not None else resolve_target(None, None)[0]
    )
    need_matplotlib(plot)
    if not configs.files(arch):
        looked = ", ".join(map(str, configs.folders(arch)))
        raise fail(f"no tuned configs for {arch} (looked in {looked})", code=1)
    docs, invalid = configs.summary(arch, registry.spec_class)
    for message in invalid:
        err.print(message, style="yellow")
    if as_json:
        show.print_json({"arch": arch, "files": docs})
    else:
        for d in docs:
            show.out(wide).print(show.show_table(d))
    if plot is not None:
        from kvgen.bench import plots

        plots.show_plot(arch, docs, plot)
        err.print(f"wrote {plot}")
