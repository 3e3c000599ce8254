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
    """Declare ``kvgen::<name>`` from its schema; returns the op's default overload behind a
    check of its arguments' Python types (``_typed``).

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
    return _typed(getattr(torch.ops.kvgen, name).default, schema)


def _typed(op: torch._ops.OpOverload, schema: str) -> Callable:
    """``op`` behind a check of its Tensor (optional ones: Tensor or None) and int arguments'
    Python types, by the schema's argument names (the operator's own parsing names neither
    argument nor type as clearly).
    The checked call is what the public functions use; ``.op`` is the operator itself."""
    tensors, optional, ints = [], [], []
    params = schema.split("(", 1)[1].rsplit(") ->", 1)[0]
    for i, param in enumerate(params.split(",")):
        kind, arg = param.split()[:2]
        arg = arg.split("=", 1)[0]  # (an argument with a default: "Tensor? k_pe=None")
        if kind.startswith("Tensor"):
            (optional if kind.endswith("?") else tensors).append((i, arg))
        elif kind == "int":
            ints.append((i, arg))

    def call(*args):
        for i, arg_name in tensors:
            if not isinstance(args[i], torch.Tensor):
                raise TypeError(f"{arg_name} must be a torch.Tensor, got {type(args[i]).__name__}")
        for i, arg_name in optional:
            if i < len(args) and args[i] is not None and not isinstance(args[i], torch.Tensor):
                raise TypeError(
                    f"{arg_name} must be a torch.Tensor or None, got {type(args[i]).__name__}"
                )
        for i, arg_name in ints:
            if i >= len(args):  # (an argument with a default, not given)
                continue
            if not isinstance(args[i], int) or isinstance(args[i], bool):
                raise TypeError(f"{arg_name} must be an int, got {type(args[i]).__name__}")
        return op(*args)

    call.op = op
    return call


def nothing(checked, *args) -> None:
    """The fake implementation of an op that returns nothing (it only mutates its caches)."""
