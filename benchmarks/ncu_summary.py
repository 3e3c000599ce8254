"""A short summary of Nsight Compute's details page, kernel by kernel: what bounds a kernel at a
glance (time, DRAM and issue utilisation, occupancy, the stall that costs most, how much of each
sector the global loads use).

    ncu --clock-control none -k regex:split_kernel --set full --page details --csv \\
        python benchmarks/profile_decode.py gqa-int8 > ncu.csv
    python benchmarks/ncu_summary.py ncu.csv [--skip-first]

``--skip-first``: of each kernel name's launches, leave out the first of every case
(profile_decode.py launches each case twice: the first compiles and warms); with it, every
other launch of a name is summarised, starting at the second.
"""

from __future__ import annotations

import argparse
import csv
import re
import sys

# (section's metric name, the label printed): the details page's figures kept
METRICS = (
    ("Duration", "Duration"),
    ("DRAM Throughput", "DRAM Throughput"),
    ("Memory Throughput", "Memory Throughput"),
    ("L2 Hit Rate", "L2 Hit Rate"),
    ("L1/TEX Hit Rate", "L1/TEX Hit Rate"),
    ("Issue Slots Busy", "Issue Slots Busy"),
    ("Warp Cycles Per Issued Instruction", "Warp Cycles Per Issued Instruction"),
    ("Registers Per Thread", "Registers Per Thread"),
    ("Achieved Occupancy", "Achieved Occupancy"),
    ("Theoretical Occupancy", "Theoretical Occupancy"),
)
# what a rule's description says, reduced to one line each
RULES = (
    (
        re.compile(r"spends ([\d.,]+) cycles being stalled (waiting for [^.]*|[^.]*)\."),
        lambda m: f"stall: {m[1]} cycles {m[2]}",
    ),
    (
        re.compile(
            r"global loads from L2[^.]*\. On average, only ([\d.]+) of the 32 bytes transmitted "
            r"per sector are utilized by each thread[^.]*\.(?:.*?([\d.]+)% of sectors missed in "
            r"L1)?",
            re.S,
        ),
        lambda m: (
            f"global loads from L2: {m[1]} of 32 bytes a sector used"
            + (f" ({m[2]} % of sectors missed in L1)" if m[2] else "")
        ),
    ),
    (
        re.compile(
            r"uncoalesced global accesses resulting in a total of ([\d,]+) excessive sectors "
            r"\((\d+)% of the total ([\d,]+) sectors\)"
        ),
        lambda m: (
            f"uncoalesced global accesses: {m[1].replace(',', '')} excessive sectors "
            f"({m[2]} % of {m[3].replace(',', '')})"
        ),
    ),
)


def launches(rows) -> dict[str, dict]:
    """{ID: {"name", "grid", "block", "metrics": {name: (value, unit)}, "rules": [line]}} in the
    report's order."""
    out: dict[str, dict] = {}
    for r in rows:
        k = out.setdefault(
            r["ID"],
            {"name": r["Kernel Name"], "grid": r.get("Grid Size", ""),
             "block": r.get("Block Size", ""), "metrics": {}, "rules": []},
        )  # fmt: skip
        name = r.get("Metric Name") or ""
        if name and name not in k["metrics"]:
            k["metrics"][name] = (r.get("Metric Value", ""), r.get("Metric Unit", ""))
        text = r.get("Rule Description") or ""
        for pattern, line in RULES:
            if (m := pattern.search(text)) and (said := line(m)) not in k["rules"]:
                k["rules"].append(said)
    return out


def summary(kernels: dict[str, dict], skip_first: bool = False) -> str:
    lines = []
    seen: dict[str, int] = {}
    for kid, k in kernels.items():
        n = seen[k["name"]] = seen.get(k["name"], 0) + 1
        if skip_first and n % 2 == 1:
            continue
        lines.append(f"## {k['name']} {k['grid']}x{k['block']} (ID {kid})")
        for name, label in METRICS:
            if name in k["metrics"]:
                value, unit = k["metrics"][name]
                lines.append(f"    {label} {unit} {value}".replace("  ", " "))
        lines += [f"    {r}" for r in k["rules"]]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("csv")
    ap.add_argument("--skip-first", action="store_true")
    args = ap.parse_args(argv)
    with open(args.csv, newline="") as f:
        text = f.read()
    start = text.find('"ID"')  # (the profiled program's own output comes first)
    if start < 0:
        print(f'{args.csv}: no Nsight Compute CSV (a header starting with "ID")', file=sys.stderr)
        return 1
    kernels = launches(csv.DictReader(text[start:].splitlines()))
    print(summary(kernels, args.skip_first))
    return 0


if __name__ == "__main__":
    sys.exit(main())
