"""Replay a cold `kvgen tune`'s worker against orders of the compile pool: which of the
candidates the worker visited the pool would have compiled before the worker got there.

    python benchmarks/pool_replay.py tune.journal.gz tune.log [--jobs 7]

From the run's journal (Optuna's journal file, gzipped or not): every first-pass trial's config
and start time, and each variant's last first-pass trial (after it the pool skips the
variant). From its log: the seconds a kernel the worker compiled cost it, per variant, and the
pool's process seconds a candidate for the variants its summary names (1.5x the worker's for
the others). The pool is modelled as ``--jobs`` processes taking its tasks in order, each
candidate costing its variant's seconds; its entries are each (variant, compile class)'s
studies with the first two configs each study tried as start points (the template default and
the incumbent or a sibling's), every ring out to the whole space, as beside the workers.

A visited candidate (its compile key at its class) the pool had not compiled by the trial's
start counts as a worker compile, once. The model's counts are those its inputs allow: a
candidate whose trial launches specialise apart from the pool's (another batch, say), or
that the pool failed to compile, is not in it, so the log's own count is the ceiling of what
the order alone can change. Prints, for the current order (``precompile.plan``) and
alternatives (other ring windows; rings ordered by when the worker first reaches each entry
plus a delay a ring), the worker compiles, their seconds and the families most of them were.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import gzip
import heapq
import json
import re

from kvgen.space import bucket_key, load_space
from kvgen.tune import plan as tune_plan
from kvgen.tune import precompile

WORKER = re.compile(
    r"\[gpu \S+\] (\S+) @ \S+: ran \d+ trials .*?(\d+) kernels compiled, \d+ kernels cached, "
    r"([\d.]+) s compiling"
)
SECOND_PASS = re.compile(r"progress: \d+/\d+ studies done in ([\d.]+) min; the second pass")


def read_journal(path: str) -> dict[str, list[dict]]:
    """Study name -> its trials (``meta``, ``start``, ``end``: datetimes or None), in order."""
    opener = gzip.open if path.endswith(".gz") else open
    names, by_study, trials = [], collections.defaultdict(list), []
    with opener(path, "rt") as f:
        for line in f:
            d = json.loads(line)
            op = d["op_code"]
            if op == 0:  # create study
                names.append(d["study_name"])
            elif op == 4:  # create trial
                start = d.get("datetime_start")
                t = {"meta": {}, "start": start and datetime.datetime.fromisoformat(start)}
                t["end"] = None
                trials.append(t)
                by_study[names[d["study_id"]]].append(t)
            elif op == 5:  # set a parameter (categorical: its index)
                choices = json.loads(d["distribution"])["attributes"]["choices"]
                trials[d["trial_id"]]["meta"][d["param_name"]] = choices[
                    int(d["param_value_internal"])
                ]
            elif op == 6:  # set state (start, complete)
                t = trials[d["trial_id"]]
                if d.get("datetime_start"):
                    t["start"] = datetime.datetime.fromisoformat(d["datetime_start"])
                if d.get("datetime_complete"):
                    t["end"] = datetime.datetime.fromisoformat(d["datetime_complete"])
    return dict(by_study)


def read_log(path: str):
    """(worker seconds a compiled kernel per variant, pool seconds a candidate per variant named
    in its summary, the second pass's start in seconds or None, the worker's compiles and
    their seconds in all)."""
    text = open(path).read()
    worker = collections.defaultdict(lambda: [0, 0.0])
    for m in WORKER.finditer(text):
        worker[m.group(1)][0] += int(m.group(2))
        worker[m.group(1)][1] += float(m.group(3))
    pool = {}
    m = re.search(r"most process time: (.*)", text)
    for part in m.group(1).split("; ") if m else []:
        name, secs, _, _, n = part.rsplit(" ", 4)
        pool[name] = float(secs) / int(n)
    second = SECOND_PASS.search(text)
    per_kernel = {v: s / n for v, (n, s) in worker.items() if n}
    total = (sum(n for n, _ in worker.values()), sum(s for _, s in worker.values()))
    return per_kernel, pool, float(second.group(1)) * 60 if second else None, total


class Replay:
    def __init__(self, journal: str, log: str, arch: str = "sm90", jobs: int = 7):
        by_study = read_journal(journal)
        self.per_kernel, self.pool_s, end, self.logged = read_log(log)
        starts = [t["start"] for ts in by_study.values() for t in ts if t["start"]]
        t0 = min(starts)
        end = float("inf") if end is None else end
        self.jobs = jobs
        self.visits = []  # (seconds, variant, class, compile key)
        self.done = collections.defaultdict(float)  # variant -> its last first-pass trial's end
        classes = (
            collections.OrderedDict()
        )  # (variant, class) -> [spec, space, studies, seeds, first]
        for st in tune_plan.plan(None, arch):
            trials = [t for t in by_study.get(f"{st.spec.name}@{bucket_key(st.bucket)}", [])
                      if t["start"] and st.space.allows(t["meta"])]  # fmt: skip
            if not trials:
                continue
            cls = precompile.compile_class(st.bucket, st.space.per_bucket)
            entry = classes.setdefault(
                (st.spec.name, cls), [st.spec, st.space, [], [], float("inf")]
            )
            entry[2].append(st)
            entry[3] += [t["meta"] for t in trials[:2] if t["meta"] not in entry[3]]
            for t in trials:
                at = (t["start"] - t0).total_seconds()
                if at < end:
                    self.visits.append((at, st.spec.name, cls, st.space.compile_key(t["meta"])))
                    entry[4] = min(entry[4], at)
                if t["end"] and (t["end"] - t0).total_seconds() < end:
                    ended = (t["end"] - t0).total_seconds()
                    self.done[st.spec.name] = max(self.done[st.spec.name], ended)
        self.entries, self.first = [], []
        for spec, space, studies, seeds, first in classes.values():
            full = sum(len(values) - 1 for values in space.params.values())
            self.entries.append((spec, space, studies[len(studies) // 2].bucket, seeds, full))
            self.first.append(first)

    def worker_cost(self, variant: str) -> float:
        return self.per_kernel.get(variant, 0.5)

    def pool_cost(self, variant: str) -> float:
        return self.pool_s.get(variant, 1.5 * self.worker_cost(variant))

    def run(self, tasks) -> tuple[int, float, float, collections.Counter]:
        """(worker compiles, their seconds, when the pool ends, seconds by family)."""
        ready: dict[tuple, float] = {}
        free = [0.0] * self.jobs
        for task in tasks:
            at = heapq.heappop(free)
            name = task.spec.name
            if name in self.done and at >= self.done[name]:  # skipped: its studies are done
                heapq.heappush(free, at)
                continue
            space = load_space(task.spec.template)
            cls = precompile.compile_class(task.bucket, space.per_bucket)
            for meta in task.metas:
                at += self.pool_cost(name)
                ready.setdefault((name, cls, space.compile_key(meta)), at)
            heapq.heappush(free, at)
        seen, count, seconds = set(), 0, 0.0
        families = collections.Counter()
        for at, name, cls, key in sorted(self.visits):
            if (name, cls, key) in seen:
                continue
            seen.add((name, cls, key))
            if ready.get((name, cls, key), float("inf")) > at:
                count += 1
                seconds += self.worker_cost(name)
                families[name.split("-")[0]] += self.worker_cost(name)
        return count, seconds, max(free), families


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("journal")
    ap.add_argument("log")
    ap.add_argument("--arch", default="sm90")
    ap.add_argument("--jobs", type=int, default=7, help="the pool's processes (the log's)")
    args = ap.parse_args(argv)
    rp = Replay(args.journal, args.log, args.arch, args.jobs)
    n, s = rp.logged
    print(f"{len(rp.visits)} first-pass trials over {len(rp.entries)} (variant, class) entries; "
          f"the log's worker compiled {n} kernels in {s:.0f} s")  # fmt: skip
    orders = [("current (precompile.plan)", precompile.plan(rp.entries))]
    for w in (1, 2, 4, 6):
        orders.append((f"{w} ring(s) a window", precompile.plan(rp.entries, window=w)))
    first = rp.first
    for lag in (30, 60, 120):
        order = precompile.plan(rp.entries, order=lambda r, i, lag=lag: (first[i] + r * lag, r))
        orders.append((f"first visit + {lag} s a ring", order))
    for label, tasks in orders:
        count, secs, end, fams = rp.run(tasks)
        most = ", ".join(f"{f} {v:.0f} s" for f, v in fams.most_common(3))
        print(f"{label:28s} worker compiles {count:4d} in {secs:6.1f} s; pool ends at "
              f"{end:4.0f} s; {most}")  # fmt: skip


if __name__ == "__main__":
    main()
