"""Replay a cold `kvgen tune`'s worker against orders of the compile pool: which of the
candidates the worker visited the pool would have compiled before the worker got there.

    python benchmarks/pool_replay.py tune.journal.gz tune.log [--jobs 7]

From the run's journal (Optuna's journal file, gzipped or not): every first-pass trial's config
and start time, and each variant's last first-pass trial (after it the pool skips the
variant). From its log (its study lines read as ``tune_log_summary.py`` reads them): the
seconds a kernel the worker compiled cost it, per variant, and the pool's process seconds a
candidate for the variants its summary names (1.5x the worker's for the others). The pool is
modelled as ``--jobs`` processes taking its tasks in order, each candidate costing its
variant's seconds; its entries are each (variant, compile class)'s studies with the first two
configs each study tried as start points (the template default and the incumbent or a
sibling's), every ring out to the whole space, as beside the workers.

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
import contextlib
import gzip
import heapq
import re
import shutil
import sys
import tempfile
from pathlib import Path

from kvgen.space import load_space
from kvgen.tune import plan as tune_plan
from kvgen.tune import precompile, tuner

sys.path.insert(0, str(Path(__file__).resolve().parent))  # (its sibling, run as a script, -P)
from tune_log_summary import PART, STUDY  # noqa: E402

SECOND_PASS = re.compile(r"progress: \d+/\d+ studies done in ([\d.]+) min; the second pass")


@contextlib.contextmanager
def open_journal(path: str):
    """The run's Optuna storage (a gzipped journal read from an uncompressed copy)."""
    if not path.endswith(".gz"):
        yield tuner.storage_from(path, Path(path))
        return
    with tempfile.TemporaryDirectory() as tmp:
        copy = Path(tmp) / "run.journal"
        with gzip.open(path, "rb") as src, open(copy, "wb") as dst:
            shutil.copyfileobj(src, dst)
        yield tuner.storage_from(str(copy), copy)


def read_log(path: str):
    """(worker seconds a compiled kernel per variant, pool seconds a candidate per variant named
    in its summary, the second pass's start in seconds or None, the worker's compiles and
    their seconds in all)."""
    text = open(path).read()
    worker = collections.defaultdict(lambda: [0, 0.0])
    for m in STUDY.finditer(text):  # (tune_log_summary's: a study's line in the worker)
        parts = (PART.fullmatch(p.strip()) for p in m["parts"].split(", "))
        got = {p["k"]: float(p["v"]) for p in parts if p}
        worker[m["name"]][0] += int(got.get("compiled", 0))
        worker[m["name"]][1] += got.get("compiling", 0.0)
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
        self.per_kernel, self.pool_s, end, self.logged = read_log(log)
        studies = []  # (plan study, its trials that ran a config of its space, in order)
        with open_journal(journal) as storage:
            for st in tune_plan.plan(None, arch):
                study = tuner.load_study(st.spec, st.bucket, storage)
                if study is None and st.bucket.get("row_align") == 16:
                    # a journal from before the GQA rows variant's row_align bucket: its
                    # studies of 16-byte rows are named by rows alone
                    older = {k: v for k, v in st.bucket.items() if k != "row_align"}
                    study = tuner.load_study(st.spec, older, storage)
                trials = [] if study is None else study.get_trials(deepcopy=False)
                trials = [t for t in trials if t.datetime_start and st.space.allows(t.params)]
                if trials:
                    studies.append((st, trials))
        t0 = min(t.datetime_start for _, trials in studies for t in trials)
        end = float("inf") if end is None else end
        self.jobs = jobs
        self.visits = []  # (seconds, variant, class, compile key)
        self.done = collections.defaultdict(float)  # variant -> its last first-pass trial's end
        # (variant, class) -> [spec, space, its studies, their start points, first trial's time]
        classes = {}
        for st, trials in studies:
            cls = precompile.compile_class(st.bucket, st.space.per_bucket)
            entry = classes.setdefault(
                (st.spec.name, cls), [st.spec, st.space, [], [], float("inf")]
            )
            entry[2].append(st)
            entry[3] += [t.params for t in trials[:2] if t.params not in entry[3]]
            for t in trials:
                at = (t.datetime_start - t0).total_seconds()
                if at < end:
                    self.visits.append((at, st.spec.name, cls, st.space.compile_key(t.params)))
                    entry[4] = min(entry[4], at)
                if t.datetime_complete and (t.datetime_complete - t0).total_seconds() < end:
                    ended = (t.datetime_complete - t0).total_seconds()
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
