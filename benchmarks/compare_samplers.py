"""Optuna's TPE after N trials against the best of an exhaustive grid over the same space.

Every point of the grid is measured once on the GPU (checked against the reference first);
TPE then runs from those measurements (a lookup, so both see identical timings and the
comparison costs no more GPU time), for N = 10, 20, 40 and several seeds. Prints best(TPE, N)
/ best(grid) per op and N, and writes JSON.

    python benchmarks/compare_samplers.py --json out.json
    python benchmarks/compare_samplers.py --fake     # no GPU: a made-up cost surface
    python benchmarks/compare_samplers.py --grids-from old.json --json new.json
        # TPE again over grids measured on the GPU before (no GPU needed): for a new sampler
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

from kvgen.families.mla_decode import MLADecodeSpec
from kvgen.families.per_token_head import StoreKVPerTokenHeadSpec
from kvgen.space import load_space
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


def measure_grid(spec, bucket, space, fake: bool, jobs: int = 1) -> dict[str, float | None]:
    """Time of every grid point (None: breaks a constraint or fails)."""
    if fake:

        def evaluate(m):
            return 10 + sum((v - 3) ** 2 for v in m.values()) * 0.1
    else:
        from kvgen.tune.precompile import precompile
        from kvgen.tune.problems import gpu_evaluator

        feasible = space.feasible(spec)
        precompile(spec, bucket, feasible, jobs, progress=lambda m: print(m, file=sys.stderr))
        evaluate = gpu_evaluator(spec, bucket)
    times = {}
    for point in space.points():
        key = json.dumps(point, sort_keys=True)
        if space.violations(spec, point):
            times[key] = None
            continue
        try:
            times[key] = evaluate(point)
        except Exception as exc:  # a failed candidate, as in a tuning trial
            print(f"  {point}: failed ({exc})", file=sys.stderr)
            times[key] = None
    return times


def tpe_best(spec, bucket, space, times, n, seed) -> float:
    def lookup(meta):
        t = times[json.dumps(meta, sort_keys=True)]
        if t is None:
            raise tuner.TrialFailed("failed on the grid")
        return t

    with tempfile.TemporaryDirectory() as d:
        storage = tuner.storage_from(f"{d}/s.journal", None)
        r = tuner.run_study(
            spec, bucket, space, lookup, storage=storage, sampler="tpe", n_trials=n, seed=seed
        )
    return r.time_us


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fake", action="store_true", help="made-up costs, no GPU")
    ap.add_argument("--seeds", type=int, default=10)
    ap.add_argument("--grids-from", help="take the grid timings from this earlier --json file")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument(
        "--jobs",
        type=int,
        default=max(1, (os.cpu_count() or 2) - 1),
        help="processes compiling the grid up front (timing stays serial)",
    )
    args = ap.parse_args()
    out, grids = [], []
    env = None
    earlier = {}
    if args.grids_from:
        old = json.loads(open(args.grids_from).read())
        env = {**old["env"], "grids_from": os.path.basename(args.grids_from)}
        earlier = {(g["variant"], json.dumps(g["bucket"], sort_keys=True)): g for g in old["grids"]}
    for spec, bucket in CASES:
        space = load_space(spec.template)
        t0 = time.monotonic()
        key = (spec.name, json.dumps(bucket, sort_keys=True))
        if key in earlier:
            times, grid_seconds = earlier[key]["times_us"], earlier[key]["seconds"]
        else:
            times = measure_grid(spec, bucket, space, args.fake, args.jobs)
            grid_seconds = time.monotonic() - t0
        valid = [t for t in times.values() if t is not None]
        grid_best = min(valid)
        best_point = min((t, k) for k, t in times.items() if t is not None)[1]
        grids.append(
            {
                "variant": spec.name,
                "bucket": bucket,
                "seconds": grid_seconds,
                "best": json.loads(best_point),
                "times_us": times,
            }
        )
        for n in (10, 20, 40):
            ratios = [
                tpe_best(spec, bucket, space, times, n, s) / grid_best for s in range(args.seeds)
            ]
            row = {
                "variant": spec.name,
                "bucket": bucket,
                "grid_points": len(times),
                "feasible_points": len(valid),
                "seeds": args.seeds,
                "n_trials": n,
                "median_ratio": statistics.median(ratios),
                "worst_ratio": max(ratios),
                "grid_best_us": grid_best,
                "seeds_within_3pct": sum(r <= 1.03 for r in ratios),
            }
            out.append(row)
            print(
                f"{spec.name} {bucket}: grid {len(times)} points, best {grid_best:.2f} us; "
                f"TPE@{n}: median x{row['median_ratio']:.3f}, worst x{row['worst_ratio']:.3f}, "
                f"{row['seeds_within_3pct']}/{args.seeds} seeds within 3 %"
            )
    if args.json:
        if env is None and not args.fake:
            from kvgen.bench.harness import environment

            env = environment()
        with open(args.json, "w") as f:
            json.dump({"env": env, "comparison": out, "grids": grids}, f, indent=2, sort_keys=True)


if __name__ == "__main__":
    main()
