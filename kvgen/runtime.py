"""Run-time facts the generated wrappers need: which target and arch a tensor's device means."""

from __future__ import annotations

import os
from functools import cache

import torch

from kvgen import configs
from kvgen.codegen.spec import ARCHS

# The arch the interpreter stands in for: the interpreter runs the code path of this arch.
INTERPRETER_ARCH = "sm90"


def interpreter_enabled() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "yes", "on")


def _closest_arch(major: int, minor: int) -> str:
    cc = major * 10 + minor
    known = sorted(ARCHS, key=lambda a: int(a[2:]))
    best = known[0]
    for arch in known:
        if int(arch[2:]) <= cc:
            best = arch
    return best


@cache
def _cuda_arch(index: int) -> str:
    major, minor = torch.cuda.get_device_capability(index)
    return _closest_arch(major, minor)


def target_of(device: torch.device) -> tuple[str, str]:
    """``(arch, target)`` of the kernels that run on ``device``."""
    if device.type == "cuda":
        if interpreter_enabled():
            return INTERPRETER_ARCH, "interp"
        index = device.index if device.index is not None else torch.cuda.current_device()
        return _cuda_arch(index), "gpu"
    if device.type == "cpu":
        if interpreter_enabled():
            return INTERPRETER_ARCH, "interp"
        raise ValueError(
            "kvgen kernels run on CUDA tensors; CPU tensors need Triton's interpreter "
            "(set TRITON_INTERPRET=1 before importing kvgen)"
        )
    raise ValueError(f"kvgen kernels run on CUDA tensors, got a tensor on {device}")


def local_target() -> tuple[str, str]:
    """The target this machine runs: its first GPU, else the interpreter."""
    if torch.cuda.is_available() and not interpreter_enabled():
        return _cuda_arch(torch.cuda.current_device()), "gpu"
    return INTERPRETER_ARCH, "interp"


def meta_params(spec, **size: int) -> dict[str, int]:
    """Meta-parameters (rows per program, warps, ...) for ``spec`` at this problem size: from
    ``tuned_configs/<arch>/`` when tuned (kvgen.configs), else the template's defaults."""
    return configs.meta_params(spec, **size)
