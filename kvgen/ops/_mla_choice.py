"""Which MLA decode variant a call runs, and the split policy its schedule uses: both follow
the tuned times (``kvgen.configs``), so the op and ``get_mla_metadata`` agree."""

from __future__ import annotations

from functools import cache

import torch

from kvgen import runtime
from kvgen.codegen import load
from kvgen.codegen.spec import SpecError
from kvgen.families.mla_decode import MLADecodeSpec, available, variants_for


@cache
def module(spec):
    """The generated module of ``spec`` (rendered and imported once)."""
    return load(spec)


@cache
def cached_spec(cls, *fields):
    return cls(*fields)  # validated once per specialisation, not on every call


def choose(cls, d, dv, dtype, arch, target, k, rows, *more, q=None):
    """Of the variants that apply to this cache, the one tuning measured fastest at ``rows``; a
    Hopper variant (wgmma, rows) only where it has been tuned on this arch (tuning checks every
    candidate against the reference on the GPU; an untuned one's module is not even loaded),
    the spec exists (``SpecError`` otherwise) and its launcher accepts the call (page size,
    strides, alignment: its ``check_cache``; the rows variant's ``accepts`` also looks at
    ``q``); the portable one otherwise. ``more``: the spec's fields after ``target`` (the
    MXFP4 group)."""
    from kvgen import configs

    portable = cached_spec(cls, d, dv, dtype, "portable", arch, target, *more)
    fmt = portable.derived()["kv_format"]
    others = [
        spec
        for v in variants_for(fmt)
        if v != "portable"
        if available(v, arch, target)
        for spec in [spec_or_none(cls, d, dv, dtype, v, arch, target, *more)]
        if spec is not None and configs.tuned_time(spec, rows=rows) is not None
        if accepts(spec, k, rows, q)
    ]
    return tuned_winner(portable, others, rows)


@cache
def spec_or_none(*fields):
    """``cached_spec(*fields)``, or None where no such spec exists."""
    try:
        return cached_spec(*fields)
    except SpecError:  # (e.g. no wgmma MXFP4 decode for fp16 queries)
        return None


def accepts(spec, k, rows, q) -> bool:
    """Whether ``spec``'s launcher reads cache ``k`` (its ``check_cache`` at the tuned tile of
    ``rows``) for queries ``q`` (the rows variant's ``accepts``: their shape and dtype too; a
    meta tensor will do)."""
    mod = module(spec)
    if hasattr(mod, "accepts"):  # (the rows variant: q's shape and dtype matter too)
        return q is not None and mod.accepts(q, k) is None
    block_n = runtime.meta_params(spec, rows=rows)["block_n"]
    try:
        mod.check_cache(k, block_n)
    except ValueError:
        return False
    return True


def tuned_winner(portable, others, rows, sizes=None):
    """The fastest of ``others`` that tuning measured at ``rows`` if no slower than the portable
    variant (untuned counts as slower); else the portable one. ``sizes(spec)``: the bucket
    sizes to look a spec's time up at, where they are more than ``rows``."""
    from kvgen import configs

    def size(spec):
        return sizes(spec) if sizes is not None else {"rows": rows}

    best, t_best = portable, configs.tuned_time(portable, **size(portable))
    for spec in others:
        t = configs.tuned_time(spec, **size(spec))
        if t is not None and (t_best is None or t <= t_best):
            best, t_best = spec, t
    return best


def split_policy(device: torch.device, rows: int) -> tuple[int, str]:
    """The split policy ``get_mla_metadata`` uses: the tuned ``split_factor`` of the 576/512
    bf16 decode (DeepSeek's shape) for this arch and ``rows`` = seq_len_q * num_heads_q, from
    the variant tuning measured fastest there (the template default if none is tuned), and the
    schedule's policy for that variant (``schedule_policy``). The metadata does not know the
    cache's width or dtype, so this one policy serves them all: it affects only the speed,
    never the result (every variant is right under every schedule)."""
    try:
        arch, target = runtime.target_of(device)
    except ValueError:  # a CPU schedule without the interpreter: the schedule is plain torch
        arch, target = runtime.INTERPRETER_ARCH, "interp"
    return _split_policy(arch, target, rows)


def schedule_policy(variant: str) -> str:
    """``schedule``'s policy for a variant: "auto" (whole sequences where that costs little) for
    the wgmma variant, whose split kernel writes a whole sequence's output itself; "split" for
    the others, which always write partial results (the combine kernel merges or copies them),
    so that whole sequences would only cost balance."""
    return "auto" if variant == "wgmma" else "split"


def _split_policy(arch, target, rows):
    def spec(variant):
        return cached_spec(MLADecodeSpec, 576, 512, "bf16", variant, arch, target)

    others = [
        spec(v) for v in variants_for("auto") if v != "portable" and available(v, arch, target)
    ]
    best = tuned_winner(spec("portable"), others, rows)
    return runtime.meta_params(best, rows=rows)["split_factor"], schedule_policy(best.variant)
