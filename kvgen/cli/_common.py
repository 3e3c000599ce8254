"""What every command shares: the Typer app, the common options, usage errors, the target."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

import typer

from kvgen.cli import output as show

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


def opt(help: str, *names: str, **kw) -> typer.models.OptionInfo:
    return typer.Option(*names, help=help, **kw)


WideOpt = Annotated[bool, opt("Full-width tables on a terminal too (never cut a name).", "--wide")]
JsonOpt = Annotated[bool, opt("Print JSON instead of a table.", "--json")]
ArchOpt = Annotated[str | None, opt("sm80, sm89, sm90 or sm100. Default: this machine's.")]
TargetOpt = Annotated[
    str | None, opt("gpu or interp (Triton's CPU interpreter). Default: this machine's.")
]
NamesArg = Annotated[
    list[str] | None,
    typer.Argument(
        help="Variant or family names, or quoted shell-style patterns of variant names "
        "('gqa_decode-*-rows-*'; kvgen list prints them). Default: every variant.",
        show_default=False,
    ),
]
PlotOpt = Annotated[Path | None, opt("Also draw a PNG (pip install 'kvgen[plot]').", "--plot")]


def fail(message: object, code: int = 2) -> typer.Exit:
    """Print ``error: message`` (never parsed as markup) to stderr; raise the returned Exit."""
    show.error(message)
    return typer.Exit(code)


def _version(value: bool) -> None:
    if value:
        import kvgen

        print(f"kvgen {kvgen.__version__}")
        raise typer.Exit()


@app.callback()
def _main(
    version: Annotated[
        bool, opt("Print the version.", "--version", callback=_version, is_eager=True)
    ] = False,
) -> None:
    """Generate, verify, benchmark and tune Triton kernels for quantized paged KV caches."""


def use_interpreter_without_gpu() -> None:
    """On a machine with no GPU, run kernels in Triton's interpreter (before any kernel loads)."""
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")


def choice(value: str, choices, what: str, hint: str) -> str:
    """``value`` if it is one of ``choices``; else the usage error every command gives (exit 2)."""
    if value not in choices:
        expected = ", ".join(choices)
        raise typer.BadParameter(
            f"unknown {what} {value!r}; expected one of {expected}", param_hint=hint
        )
    return value


def resolve_target(arch: str | None, target: str | None) -> tuple[str, str]:
    from kvgen.codegen.spec import ARCHS, TARGETS
    from kvgen.runtime import local_target

    here_arch, here_target = local_target()
    arch = choice(arch or here_arch, ARCHS, "arch", "--arch")
    return arch, choice(target or here_target, TARGETS, "target", "--target")


def specs_named(names, arch, target):
    """The specs ``names`` name (every variant of arch/target when none): a full variant name
    is taken with the arch and target it spells, family names with ``arch`` and ``target``."""
    from kvgen import registry

    try:
        return registry.lookup(names, arch, target) if names else registry.variants(arch, target)
    except KeyError as exc:
        raise fail(exc.args[0]) from None


def need_matplotlib(plot: Path | None) -> None:
    from kvgen.bench import plots

    try:
        if plot is not None:
            plots.require_matplotlib()
    except RuntimeError as exc:
        raise fail(exc) from None
