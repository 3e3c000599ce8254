"""Where the templates and tuned configs live: inside the installed package, or the checkout."""

from __future__ import annotations

import importlib.resources
from functools import cache
from pathlib import Path

_CHECKOUT = Path(__file__).resolve().parent.parent


def _package_dir(package: str, checkout_name: str) -> Path:
    try:
        path = Path(str(importlib.resources.files(package)))
        if path.is_dir():
            return path
    except ModuleNotFoundError:
        pass
    # Running from a source checkout that was not installed (PYTHONPATH=.).
    path = _CHECKOUT / checkout_name
    if not path.is_dir():
        raise FileNotFoundError(f"kvgen cannot find its {checkout_name}/ folder (looked in {path})")
    return path


@cache
def templates_dir() -> Path:
    return _package_dir("kvgen.templates", "templates")


@cache
def tuned_configs_dir() -> Path:
    return _package_dir("kvgen.tuned_configs", "tuned_configs")
