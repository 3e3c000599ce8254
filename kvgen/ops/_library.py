"""kvgen's ops as PyTorch operators (``torch.ops.kvgen.*``), so that ``torch.compile`` traces a
caller without a graph break, CUDA graphs capture them, and meta / fake tensors get the right
output shapes without running a kernel.

Each op is declared once with its schema (mutated arguments, the caches, are ``Tensor(a!)``),
an implementation for real tensors (CPU under Triton's interpreter, and CUDA) and a fake
implementation. Both implementations run the same argument checks, so a call through
``torch.ops.kvgen`` is checked as one through ``kvgen.ops`` is, and a traced call with bad
arguments fails when it is traced. The low-level ``torch.library.Library`` API is used rather
than ``torch.library.custom_op``, whose Python wrapper costs about ten times more host time a
call.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

_LIB = torch.library.Library("kvgen", "DEF")


def define(schema: str, check: Callable, run: Callable, fake: Callable) -> Callable:
    """Declare ``kvgen::<name>`` from its schema; returns the op's default overload.

    ``check(*args)`` raises for bad arguments and returns what the implementations need (the
    device, the cache geometry, ...); ``run(checked, *args)`` computes on real tensors and
    ``fake(checked, *args)`` returns empty outputs of the right shapes, dtypes and device.
    """
    name = schema.split("(", 1)[0]
    _LIB.define(schema)

    def impl(*args):
        return run(check(*args), *args)

    def fake_impl(*args):
        return fake(check(*args), *args)

    for key in ("CPU", "CUDA"):
        _LIB.impl(name, impl, key)
    torch.library.register_fake(f"kvgen::{name}", fake_impl, lib=_LIB)
    return getattr(torch.ops.kvgen, name).default


def nothing(checked, *args) -> None:
    """The fake implementation of an op that returns nothing (it only mutates its caches)."""
