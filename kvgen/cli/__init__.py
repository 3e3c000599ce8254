"""The ``kvgen`` command line: list, gen, verify, bench, tune, show. Each command parses its
options, calls the library (``registry``, ``verify``, ``bench``, ``tune``, ``configs``) and prints
(``kvgen.cli.output``); one module per command group."""

from __future__ import annotations

import sys

from kvgen.cli import bench, catalog, tune  # noqa: F401  (each module adds its commands)
from kvgen.cli._common import app

__all__ = ["app", "main"]


def main() -> None:
    try:
        app()
    except BrokenPipeError:  # `kvgen list | head`
        sys.stderr.close()
