"""What the kernels cost in SASS, from the KVGEN_SASS_DIR folder ``tests/_gpu_compile_check.py``
writes (no GPU needed: the kernels are compiled for sm90 by Triton's own ptxas):

    env -u TRITON_INTERPRET KVGEN_SASS_DIR=/tmp/sass-a python tests/_gpu_compile_check.py
    python benchmarks/sass_stats.py /tmp/sass-a [--match rows]
    python benchmarks/sass_stats.py /tmp/sass-a /tmp/sass-b    (e.g. a change's base and head)

One line a kernel: registers and stack bytes a thread (from cuobjdump's resource usage),
shared memory, the SASS instruction count, and its main loop (the longest span of a backward
branch) in instructions, CTA barriers, local loads and stores (spills), MMAs, byte permutes
and the integer and logic instructions (``ALU_OPCODES``), which NVIDIA's pipe descriptions put
on the ALU pipe (half a warp a cycle on sm80 / sm90, beside the FMA pipe's IMAD and FP32
work): where twice a loop's loop_alu exceeds its loop count, that pipe bounds it before the
issue slots do (one instruction a cycle). With two folders, the kernels both hold whose
figures differ, side by side. The loop is a heuristic: a kernel whose longest backward branch
is not its hot loop (or that has none) reports that span.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

ADDRESS = re.compile(r"/\*([0-9a-f]{4,6})\*/")
LABEL = re.compile(r"^\s*(\.L_x_\d+):")
BRANCH = re.compile(r"\bBRA\b.*?(\.L_x_\d+)")
# what a loop line counts: name -> the opcode prefix it matches
LOOP_COUNTS = {"bar": "BAR.SYNC", "ldl": "LDL", "stl": "STL", "mma": "GMMA"}
# the integer and logic opcodes a loop line counts as loop_alu (IMAD, IMUL and the FP32
# arithmetic go to the FMA pipe and are not counted)
ALU_OPCODES = ("PRMT", "LOP3", "SHF", "ISETP", "SEL", "IADD3", "LEA", "PLOP3", "VIMNMX", "P2R",
               "R2P")  # fmt: skip
OPCODE = re.compile(r"\*/\s+(?:@!?U?P[T\d]+\s+)?([A-Z][A-Z0-9_]*)")


def stats(text: str) -> dict:
    """The figures of one kernel's file: its header lines (``// name``, ``// REG:n STACK:n
    SHARED:n``) and its nvdisasm output."""
    lines = text.splitlines()
    name = lines[0].removeprefix("// ") if lines else ""
    usage = dict(re.findall(r"(REG|STACK|SHARED):(\d+)", lines[1] if len(lines) > 1 else ""))
    code = []  # (address, instruction line)
    labels = {}  # label -> address of the instruction it marks
    pending = []
    for line in lines:
        m = LABEL.match(line)
        if m:
            pending.append(m.group(1))
            continue
        m = ADDRESS.search(line)
        if m:
            addr = int(m.group(1), 16)
            for label in pending:
                labels[label] = addr
            pending = []
            code.append((addr, line))
    lo = hi = None
    for addr, line in code:
        m = BRANCH.search(line)
        if m and m.group(1) in labels and labels[m.group(1)] < addr:
            if lo is None or addr - labels[m.group(1)] > hi - lo:
                lo, hi = labels[m.group(1)], addr
    loop = [line for addr, line in code if lo is not None and lo <= addr <= hi]
    out = {
        "name": name,
        "reg": int(usage.get("REG", -1)),
        "stack": int(usage.get("STACK", -1)),
        "shared": int(usage.get("SHARED", -1)),
        "sass": len(code),
        "loop": len(loop),
    }
    for key, op in LOOP_COUNTS.items():
        out[f"loop_{key}"] = sum(op in line for line in loop)
    opcodes = [m.group(1) for m in map(OPCODE.search, loop) if m]
    out["loop_prmt"] = opcodes.count("PRMT")  # (not UPRMT, the uniform datapath's)
    out["loop_alu"] = sum(op in ALU_OPCODES for op in opcodes)
    return out


def folder(path: Path, match: str | None = None) -> dict[str, dict]:
    """Each kernel's ``stats`` by name (in name order), of the ``.sass`` files in ``path`` (their
    name lines containing ``match``, when given)."""
    found = {}
    for p in path.glob("*.sass"):
        s = stats(p.read_text())
        if match is None or match in s["name"]:
            found[s["name"]] = s
    return dict(sorted(found.items()))


COLUMNS = ("reg", "stack", "shared", "sass", "loop", "loop_bar", "loop_ldl", "loop_stl", "loop_mma",
           "loop_prmt", "loop_alu")  # fmt: skip


def row(s: dict) -> str:
    return " ".join(f"{s[c]:>7}" for c in COLUMNS)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("folders", type=Path, nargs="+", help="one folder, or two to compare")
    ap.add_argument("--match", help="only the kernels whose name contains this")
    args = ap.parse_args(argv)
    if len(args.folders) > 2:
        ap.error("one folder, or two to compare")
    head = " ".join(f"{c:>7}" for c in COLUMNS)
    a = folder(args.folders[0], args.match)
    if len(args.folders) == 1:
        print(f"{head}  kernel")
        for name, s in a.items():
            print(f"{row(s)}  {name}")
        return 0
    b = folder(args.folders[1], args.match)
    both = [n for n in a if n in b]
    differ = [n for n in both if any(a[n][c] != b[n][c] for c in COLUMNS)]
    print(f"{len(both)} kernels in both folders, {len(differ)} with other figures")
    if differ:
        print(f"    {head}")
    for n in differ:
        print(f"{n}\n  A {row(a[n])}\n  B {row(b[n])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
