"""The scripts of ``benchmarks/`` imported as modules, for their tests."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).parent.parent / "benchmarks"


def benchmark_script(name: str):
    """``benchmarks/<name>.py`` as a module (the folder is not a package)."""
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    # (registered before it runs: dataclasses look their module up there)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
