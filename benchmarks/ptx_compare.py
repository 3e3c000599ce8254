"""Compare the kernels' PTX of two KVGEN_PTX_DIR folders written by ``tests/_gpu_compile_check.py``
(e.g. at a change's base and at its head), to show which kernels a change to the templates
changed at all:

    env -u TRITON_INTERPRET KVGEN_PTX_DIR=/tmp/ptx-a python tests/_gpu_compile_check.py
    (check out the other commit, reinstall)
    env -u TRITON_INTERPRET KVGEN_PTX_DIR=/tmp/ptx-b python tests/_gpu_compile_check.py
    python benchmarks/ptx_compare.py /tmp/ptx-a /tmp/ptx-b

Prints how many kernels are the same line for line, then each one that differs (with its count
of differing lines) or that only one folder holds (a compile that failed on one side). Exits 1
when any kernel differs. ``.loc`` and ``.file`` lines (source line numbers, which move with any
edit of a template, and the generated module's path) are ignored.
"""

from __future__ import annotations

import argparse
import difflib
import sys
from pathlib import Path


def body(path: Path) -> tuple[str, list[str]]:
    """``(name, lines)``: the kernel's name line and its PTX without ``.loc`` / ``.file``
    lines."""
    name, *lines = path.read_text().splitlines()
    return name.removeprefix("// "), [
        ln for ln in lines if not ln.lstrip().startswith((".loc", ".file"))
    ]


def compare(a: Path, b: Path) -> tuple[int, list[str], list[str]]:
    """``(same, differ, only)``: the count of kernels alike, lines naming those that differ,
    lines naming those one side lacks."""
    same, differ, only = 0, [], []
    names_a = {p.name for p in a.glob("*.ptx")}
    names_b = {p.name for p in b.glob("*.ptx")}
    for n in sorted(names_a | names_b):
        if n not in names_b or n not in names_a:
            side = a if n in names_a else b
            only.append(f"only in {side}: {body(side / n)[0]}")
            continue
        name, la = body(a / n)
        _, lb = body(b / n)
        if la == lb:
            same += 1
        else:
            changed = sum(1 for d in difflib.ndiff(la, lb) if d[:1] in "+-")
            differ.append(f"differs ({changed} lines): {name}")
    return same, differ, only


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("a", type=Path)
    ap.add_argument("b", type=Path)
    args = ap.parse_args(argv)
    same, differ, only = compare(args.a, args.b)
    print(f"{same} kernels the same, {len(differ)} differ, {len(only)} in one folder only")
    for line in differ + only:
        print(line)
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
