"""kvgen tune."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from kvgen.cli._common import (
    NamesArg,
    app,
    choice,
    fail,
    opt,
)
from kvgen.cli.output import err
from kvgen.tune import MIN_GAIN, PATIENCE, SAMPLER, SAMPLERS


def _ints(text: str | None) -> set[int] | None:
    return {int(v) for v in text.split(",")} if text else None


def _where(items: list[str] | None) -> dict[str, set[int]] | None:
    """``--where KEY=V[,V...]`` options as {KEY: {V, ...}}; a malformed one fails."""
    out: dict[str, set[int]] = {}
    for item in items or ():
        key, sep, values = item.partition("=")
        try:
            if not sep or not key.strip():
                raise ValueError
            out.setdefault(key.strip(), set()).update(int(v) for v in values.split(","))
        except ValueError:
            raise fail(f"--where takes KEY=V[,V...] with integer values (e.g. row_align=4), "
                       f"got {item!r}") from None  # fmt: skip
    return out or None


@app.command("tune")
def tune_cmd(
    names: NamesArg = None,
    arch: Annotated[str, opt("Arch to tune for; must be this GPU's.")] = "sm90",
    trials: Annotated[int, opt("Trials per (variant, bucket) study, at most.")] = 40,
    timeout: Annotated[float | None, opt("Wall-clock budget in seconds.")] = None,
    sampler: Annotated[
        str,
        opt(
            "local (best-first local search from the default and tuned configs), tpe, grid "
            "or random."
        ),
    ] = SAMPLER,
    storage: Annotated[
        str | None,
        opt(
            "Optuna storage: a URL (sqlite:///f.db, postgresql://...) or a journal file "
            "(default ~/.cache/kvgen/tune/<arch>.journal)."
        ),
    ] = None,
    buckets: Annotated[str | None, opt("Only these num_tokens buckets (comma-separated).")] = None,
    heads: Annotated[str | None, opt("Only these num_heads buckets (comma-separated).")] = None,
    where: Annotated[
        list[str] | None,
        opt(
            "Only the buckets with this size at one of these values, KEY=V[,V...] (e.g. "
            "row_align=4: vLLM's inline-scale rows); buckets without KEY are left out. "
            "Repeatable.",
            metavar="KEY=V[,V...]",
        ),
    ] = None,
    out: Annotated[
        Path | None, opt("tuned_configs folder to write (default: the package's).")
    ] = None,
    per_device: Annotated[
        bool | None,
        opt(
            "Write this GPU model's own files, <out>/<arch>/<device>/<family>.json (e.g. "
            "sm90/nvidia-h100-80gb-hbm3/), which the ops prefer on GPUs of that model, or the "
            "arch's, <out>/<arch>/<family>.json. Default: the model's where its folder exists "
            "(the package ships one for the H100), else the arch's.",
            "--per-device/--per-arch",
            show_default=False,
        ),
    ] = None,
    force: Annotated[bool, opt("Tune although this GPU is not --arch.")] = False,
    families: Annotated[
        str | None,
        opt("Only the default variants of these families (comma-separated).", "--family"),
    ] = None,
    jobs: Annotated[
        int,
        opt(
            "Processes that compile the candidates the searches visit first (the start "
            "points and the steps around them, nearest first, for each class of buckets "
            "Triton compiles alike; with tpe / grid / random every candidate): beside the "
            "workers until they are done, or before the trials the start points and two "
            "steps around them (--compile-first); timing stays serial. 1: off.",
            "--jobs",
            "-j",
            show_default="half the CPUs",
        ),
    ] = 0,
    gpus: Annotated[
        int, opt("GPUs to tune on, one worker each (default: all visible).", show_default=False)
    ] = 0,
    confirm: Annotated[
        int,
        opt(
            "Re-time each study's best N configs within 10 % of its best trial (every config, "
            "in a study of 8 or fewer; the default where it is among them; the tuned JSON's "
            "config for the bucket where it read within 25 %) in 3 alternated rounds, then "
            "beside the winner up to N more whose trial read under its median; keep the "
            "lowest median (0: the best trial).",
            min=0,
        ),
    ] = 3,
    patience: Annotated[
        int,
        opt(
            "End a study once this many trials in a row each gained less than --min-gain on "
            "its best and, with the local search, every neighbour of its best config was "
            "tried (0: run every trial; a grid always runs whole).",
            min=0,
        ),
    ] = PATIENCE,
    min_gain: Annotated[
        float, opt("The relative gain that counts for --patience.", "--min-gain", min=0.0)
    ] = MIN_GAIN,
    compile_beside: Annotated[
        bool,
        opt(
            "Compile (--jobs - 1 processes, compile only: no kernel of theirs runs beside a "
            "timing) while the workers tune, ring after ring around the start points until "
            "the workers are done, instead of checking the first rings' candidates before "
            "the first trial.",
            "--compile-beside/--compile-first",
        ),
    ] = True,
) -> None:
    """Tune meta-parameters with Optuna and write tuned_configs/<arch>/<family>.json.

    Every trial is checked against the reference and timed with CUDA graphs, in a worker
    process per GPU (a candidate that breaks its GPU context fails its trial and ends that
    worker; a fresh one takes the GPU); an interrupted run resumes from its storage. With
    several GPUs (or several hosts sharing a --storage postgresql://... database, each running
    this command), the trials of every study are spread over all workers. Right after a
    study's trials, the worker that ran them times its best few configs again in alternated
    rounds (--confirm), so that one lucky timing does not pick the config. A study starts from the
    template's default, the config the tuned JSON holds, the best configs of its nearest
    already-tuned buckets and those of its sibling variants (the same template) at its bucket,
    and ends early once more trials stop paying (--patience); with the local search each study
    then tries the bests its neighbouring buckets and sibling variants found after it ran.
    A trial that runs out of GPU memory is tried again after waits, then queued once more.
    """
    import torch

    from kvgen.codegen.spec import ARCHS

    where_sizes = _where(where)
    arch = choice(arch, ARCHS, "arch", "--arch")
    sampler = choice(sampler, SAMPLERS, "sampler", "--sampler")
    try:
        import optuna  # noqa: F401
    except ImportError:
        raise fail("kvgen tune needs optuna: pip install 'kvgen[tune]'") from None
    if not torch.cuda.is_available():
        raise fail("kvgen tune needs a CUDA GPU")
    from kvgen.runtime import local_target
    from kvgen.tune import run as tune_run

    if local_target()[0] != arch and not force:
        raise fail(f"this GPU is {local_target()[0]}, not {arch}; pass --force to tune anyway")
    opts = tune_run.Options(
        arch, storage, sampler, trials, timeout, jobs, confirm, out, patience, min_gain,
        compile_beside, per_device,
    )  # fmt: skip
    try:
        tune_run.start(
            names,
            opts,
            families={f.strip() for f in families.split(",")} if families else None,
            num_tokens=_ints(buckets),
            num_heads=_ints(heads),
            where=where_sizes,
            gpus=gpus,
            log=err.print,
        )
    except ValueError as exc:
        raise fail(exc) from None
    except tune_run.Incomplete as exc:
        raise fail(f"tune incomplete: {exc}", code=1) from None
    except KeyboardInterrupt:
        err.print("\ninterrupted: nothing written; the same command resumes the studies")
        raise typer.Exit(130) from None
