"""Where a `kvgen tune` run's worker time went, by family, from its log (the lines the workers
print per study: trials, building inputs, first check, check, timing, kernels compiled or
cached in the worker; and each study's re-timing).

    python benchmarks/tune_log_summary.py tune-sm90.log [more logs of the same run]

"first check" holds each study's reference (made once a problem), "check" the other checks,
where a config's first launch in the worker compiles it (unless the compile pool had) or loads
its binary; "sizing" the eager timings that size a config's graph (logs that say so);
"re-t. checks" the checks and sizings within the re-timing (logs that say so); "compiled"
counts the kernels the worker compiled itself, and "compiling" the seconds those compiles
took, within the checks and the timing (logs that say so). "in all" is
each study's time in the worker from end to end, "opening" the part before its inputs were
built (opening the study in the storage, its warm start): "in all" less "total", "re-timing"
and "opening" is the study's clean-up and bookkeeping (logs that say so). "studies" counts
each study once; "again" its later lines (the local search's second pass, or runs of the same
journal); "oom retries" the trials tried again after running out of GPU memory, "lost" those
given up (their points queued again); "overruled" the re-timings that chose a config other than
the one whose trial read fastest among those re-timed (logs that give each re-timed config's
trial reading).
"""

from __future__ import annotations

import argparse
import re
import sys
from collections import defaultdict

STUDY = re.compile(
    r"\[gpu \S+\] (?P<name>\S+) @ (?P<bucket>\S+): ran (?P<trials>\d+) trials in "
    r"(?P<total>[\d.]+) s \((?P<parts>[^)]*)\)"
)
# a trial out of GPU memory tried again in place, and one given up (its point queued again)
OOM_RETRY = re.compile(r"\[gpu \S+\] (?P<name>\S+) @ \S+: out of GPU memory in a trial")
LOST = re.compile(r"\[gpu \S+\] (?P<name>\S+) @ \S+: a trial lost")
RETIMED = re.compile(
    r"\[gpu \S+\] (?P<name>\S+) @ \S+: re-timed in (?P<s>[\d.]+) s(?: \((?P<parts>[^)]*)\))?"
)
TRIAL_READING = re.compile(r"\(trial (?P<us>[\d.]+)\)")  # each re-timed config's, chosen first
IN_ALL = re.compile(
    r"\[gpu \S+\] (?P<name>\S+) @ \S+: (?P<all>[\d.]+) s in all \((?P<open>[\d.]+) s opening"
)
PART = re.compile(r"(?P<v>[\d.]+) (?:s |kernels )(?P<k>[a-z ]+)")
COLUMNS = ("studies", "again", "trials", "total", "building inputs", "first check", "check",
           "sizing", "timing", "re-timing", "re-t. checks", "compiled", "cached", "compiling",
           "in all", "opening", "oom retries", "lost", "overruled")  # fmt: skip
# the parts of a re-timing line (logs that say so) that are not the graphs' timing: checks and
# eager sizings of configs the re-timing timed first in the worker
RETIME_CHECKS = ("first check", "check", "sizing")
COUNTS = ("studies", "again", "trials", "compiled", "cached", "oom retries", "lost", "overruled")


def summarize(lines) -> dict[str, dict[str, float]]:
    """{family: {column: sum}} over the log's study and re-timing lines."""
    out: dict[str, dict[str, float]] = defaultdict(lambda: dict.fromkeys(COLUMNS, 0.0))
    seen = set()  # (a study's second line: the local search's second pass, or a resumed run)
    for line in lines:
        if m := STUDY.search(line):
            row = out[m["name"].split("-")[0]]
            key = (m["name"], m["bucket"])
            row["again" if key in seen else "studies"] += 1
            seen.add(key)
            row["trials"] += int(m["trials"])
            row["total"] += float(m["total"])
            for part in m["parts"].split(", "):
                if p := PART.fullmatch(part.strip()):
                    if p["k"] in row:
                        row[p["k"]] += float(p["v"])
        elif m := RETIMED.search(line):
            row = out[m["name"].split("-")[0]]
            row["re-timing"] += float(m["s"])
            for part in (m["parts"] or "").split(", "):
                if (p := PART.fullmatch(part.strip())) and p["k"] in RETIME_CHECKS:
                    row["re-t. checks"] += float(p["v"])
            readings = [float(r["us"]) for r in TRIAL_READING.finditer(line)]
            if len(readings) >= 2 and readings[0] > min(readings):
                row["overruled"] += 1
        elif m := OOM_RETRY.search(line):
            out[m["name"].split("-")[0]]["oom retries"] += 1
        elif m := LOST.search(line):
            out[m["name"].split("-")[0]]["lost"] += 1
        elif m := IN_ALL.search(line):
            row = out[m["name"].split("-")[0]]
            row["in all"] += float(m["all"])
            row["opening"] += float(m["open"])
    return dict(out)


def table(rows: dict[str, dict[str, float]]) -> str:
    total = {c: sum(r[c] for r in rows.values()) for c in COLUMNS}
    width = max([len("family"), len("all"), *map(len, rows)])
    head = f"{'family':<{width}}" + "".join(f" {c:>15}" for c in COLUMNS)
    body = []
    for name, r in sorted([*rows.items(), ("all", total)], key=lambda kv: kv[0] == "all"):
        cells = "".join(
            f" {int(r[c]):>15d}" if c in COUNTS
            else f" {r[c]:>13.1f} s"
            for c in COLUMNS
        )  # fmt: skip
        body.append(f"{name:<{width}}{cells}")
    return "\n".join([head, *body])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("logs", nargs="+")
    args = ap.parse_args(argv)
    lines = []
    for path in args.logs:
        with open(path) as f:
            lines += f.readlines()
    rows = summarize(lines)
    if not rows:
        print("no study lines in these logs", file=sys.stderr)
        return 1
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
