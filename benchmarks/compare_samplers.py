"""The tuner's samplers after N trials against the best of an exhaustive grid over the same space.

Every point of the grid is measured once on the GPU (checked against the reference first);
the samplers then run from those measurements (a lookup, so all see identical timings and the
comparison costs no more GPU time), through the tuner's own study code, for N = 10, 20, 30, 40
and several seeds. Each seed starts where ``kvgen tune`` starts (the template's default), and
again from a random grid point (how the search fares when the default is a poor start).
Prints best(sampler, N) / best(grid) per op and N, and writes JSON with every seed's result.

    python benchmarks/compare_samplers.py --json out.json
    python benchmarks/compare_samplers.py --fake     # no GPU: a made-up cost surface
    python benchmarks/compare_samplers.py --grids-from old.json --json new.json
        # the samplers again over grids measured on the GPU before (no GPU needed)
    python benchmarks/compare_samplers.py --grids-from old.json --patience 8,12,16
        # what the stop rule (kvgen tune --patience) costs
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import statistics
import sys
import tempfile
import time

from kvgen.families.mla_decode import MLADecodeSpec
from kvgen.families.per_token_head import StoreKVPerTokenHeadSpec
from kvgen.space import Space, load_space
from kvgen.tune import tuner

# Two op families whose spaces have at least 160 points, so that N = 40 trials is at most a
# quarter of the grid.
CASES = [
    (MLADecodeSpec(576, 512, "bf16", "portable", "sm90", "gpu"), {"rows": 64}),
    (
        StoreKVPerTokenHeadSpec("int8", 128, 128, "bf16", "sm90", "gpu"),
        {"num_tokens": 65536, "num_heads": 8},
    ),
]
SAMPLERS = ("local", "tpe")
TRIALS = (10, 20, 30, 40)


def _key(point: dict) -> str:
    return json.dumps(point, sort_keys=True)


def measure_grid(spec, bucket, space, fake: bool, jobs: int = 1) -> dict[str, float | None]:
    """Time of every grid point (None: breaks a constraint or fails)."""
    if fake:

        def evaluate(m):
            return 10 + sum((v - 3) ** 2 for v in m.values()) * 0.1
    else:
        from kvgen.tune.precompile import compile_all
        from kvgen.tune.problems import gpu_evaluator

        feasible = space.feasible(spec)
        compile_all(spec, bucket, feasible, jobs, progress=lambda m: print(m, file=sys.stderr))
        evaluate = gpu_evaluator(spec, bucket).confirm  # (the bench's full settle)
    times = {}
    for point in space.points():
        key = _key(point)
        if space.violations(spec, point):
            times[key] = None
            continue
        try:
            times[key] = evaluate(point)
        except Exception as exc:  # a failed candidate, as in a tuning trial
            print(f"  {point}: failed ({exc})", file=sys.stderr)
            times[key] = None
    return times


@dataclasses.dataclass(frozen=True)
class GridSpace(Space):
    """The space a grid was measured over (the template's may have changed since): its points
    are the grid's, the feasible ones those with a time."""

    times: dict = dataclasses.field(default_factory=dict, compare=False, hash=False)

    @classmethod
    def of(cls, times: dict[str, float | None]) -> GridSpace:
        params: dict[str, set] = {}
        for key in times:
            for k, v in json.loads(key).items():
                params.setdefault(k, set()).add(v)
        return cls("grid", {k: tuple(sorted(v)) for k, v in params.items()}, {}, {}, times=times)

    def violations(self, spec, meta, bucket=None) -> list[str]:
        return [] if self.times.get(_key(meta)) is not None else ["not timed on the grid"]

    def feasible(self, spec, bucket=None) -> list[dict]:
        # (Space.feasible evaluates the template's constraints, which a grid has none of)
        return [m for m in self.points() if not self.violations(spec, m, bucket)]


@dataclasses.dataclass(frozen=True)
class GridSpec:
    """The variant as the study sees it: a name no tuned JSON holds (no incumbent) and
    ``start`` as the default config."""

    name: str
    start: str
    arch: str = "sm90"
    family: str = "compare_samplers"

    def default_meta(self, **bucket) -> dict:
        return json.loads(self.start)


def search_best(space, bucket, times, sampler, n, seed, start, patience=0) -> tuple[float, int]:
    """(best time, trials run) of one study of ``sampler`` from ``start``."""

    def lookup(meta):
        t = times[_key(meta)]
        if t is None:
            raise tuner.TrialFailed("failed on the grid")
        return t

    spec = GridSpec(f"compare-{sampler}-{seed}", start)
    with tempfile.TemporaryDirectory() as d:
        storage = tuner.storage_from(f"{d}/s.journal", None)
        r = tuner.run_study(spec, bucket, space, lookup, storage=storage, sampler=sampler,
                            n_trials=n, seed=seed,
                            stop=tuner.StopRule(patience, local=sampler == "local"))  # fmt: skip
    return r.time_us, r.trials


def _searched() -> dict:
    """When and with which kvgen the searches over stored grids ran (the GPU ran none)."""
    import datetime
    import subprocess

    here = os.path.dirname(os.path.abspath(__file__))
    rev = subprocess.run(["git", "-C", here, "rev-parse", "HEAD"], capture_output=True, text=True)
    return {
        "commit": rev.stdout.strip() or None,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "on": "CPU: every trial a lookup of the grid's GPU timings",
    }


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fake", action="store_true", help="made-up costs, no GPU")
    ap.add_argument("--seeds", type=int, default=10)
    ap.add_argument("--grids-from", help="take the grid timings from this earlier --json file")
    ap.add_argument("--samplers", default=",".join(SAMPLERS))
    ap.add_argument("--trials", default=",".join(map(str, TRIALS)))
    ap.add_argument("--patience", default="0", help="stop rules to compare (0: none)")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument(
        "--jobs",
        type=int,
        default=max(1, (os.cpu_count() or 2) - 1),
        help="processes compiling the grid up front (timing stays serial)",
    )
    args = ap.parse_args(argv)
    out, grids = [], []
    env = None
    earlier = {}
    if args.grids_from:
        old = json.loads(open(args.grids_from).read())
        env = {
            **(old["env"] or {}),  # (None: fake grids)
            "grids_from": os.path.basename(args.grids_from),
            "searched": _searched(),
        }
        earlier = {(g["variant"], json.dumps(g["bucket"], sort_keys=True)): g for g in old["grids"]}
    for spec, bucket in CASES:
        t0 = time.monotonic()
        key = (spec.name, json.dumps(bucket, sort_keys=True))
        if key in earlier:
            times, grid_seconds = earlier[key]["times_us"], earlier[key]["seconds"]
        else:
            times = measure_grid(spec, bucket, load_space(spec.template), args.fake, args.jobs)
            grid_seconds = time.monotonic() - t0
        space = GridSpace.of(times)
        valid = sorted(_key(json.loads(k)) for k, t in times.items() if t is not None)
        grid_best = min(times[k] for k in valid)
        best_point = min(valid, key=lambda k: times[k])
        grids.append(
            {
                "variant": spec.name,
                "bucket": bucket,
                "seconds": grid_seconds,
                "best": json.loads(best_point),
                "times_us": times,
            }
        )
        default = spec.default_meta(**bucket)
        default = _key({k: default[k] for k in space.params if k in default})
        if times.get(default) is None:  # the template's default is not a timed grid point
            default = best_point
        print(f"{spec.name} {bucket}: grid {len(times)} points ({len(valid)} timed), best "
              f"{grid_best:.2f} us, the default x{times[default] / grid_best:.3f}")  # fmt: skip
        for sampler in args.samplers.split(","):
            for patience in map(int, args.patience.split(",")):
                for n in map(int, args.trials.split(",")):
                    for start_name in ("default", "random"):
                        ratios, used = [], []
                        for s in range(args.seeds):
                            start = default
                            if start_name == "random":
                                start = random.Random(1000 + s).choice(valid)
                            t, k = search_best(space, bucket, times, sampler, n, s, start, patience)
                            ratios.append(t / grid_best)
                            used.append(k)
                        row = {
                            "variant": spec.name,
                            "bucket": bucket,
                            "sampler": sampler,
                            "start": start_name,
                            "patience": patience,
                            "grid_points": len(times),
                            "feasible_points": len(valid),
                            "n_trials": n,
                            "seeds": args.seeds,
                            "ratios": ratios,
                            "trials_run": used,
                            "median_ratio": statistics.median(ratios),
                            "worst_ratio": max(ratios),
                            "grid_best_us": grid_best,
                            "seeds_within_3pct": sum(r <= 1.03 for r in ratios),
                        }
                        out.append(row)
                        print(
                            f"  {sampler:5s} from {start_name:7s} N={n:2d}"
                            + (f" patience {patience:2d}" if patience else "")
                            + f": median x{row['median_ratio']:.3f}, worst "
                            f"x{row['worst_ratio']:.3f}, {row['seeds_within_3pct']}/{args.seeds} "
                            f"seeds within 3 %, {statistics.mean(used):.1f} trials run"
                        )
    if args.json:
        if env is None and not args.fake:
            from kvgen.bench.harness import environment

            env = environment()
        with open(args.json, "w") as f:
            json.dump({"env": env, "comparison": out, "grids": grids}, f, indent=2, sort_keys=True)


if __name__ == "__main__":
    main()
