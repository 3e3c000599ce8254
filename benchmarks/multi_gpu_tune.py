"""The same tuning job on 1 GPU and on N GPUs (``kvgen tune --gpus``): wall time and winners.

Both runs start from a warm Triton cache (a first run compiles every candidate), so what is
compared is the tuning itself: trials checked against the reference and timed, spread over the
GPUs. With ``--sampler grid`` both runs time exactly the same points, so their winners can be
compared point for point; where they differ, the report gives how far apart the two winners
were in the 1-GPU run's own timings (timing noise, not a different search).

    python benchmarks/multi_gpu_tune.py --gpus 2 --json out.json NAME [NAME ...]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def tune(names, gpus, storage, out, sampler, trials, jobs, log) -> float:
    cmd = [
        sys.executable,
        "-P",
        "-m",
        "kvgen",
        "tune",
        *names,
        "--arch",
        "sm90",
        "--gpus",
        str(gpus),
        "--sampler",
        sampler,
        "--trials",
        str(trials),
        "--storage",
        str(storage),
        "--out",
        str(out),
        "--jobs",
        str(jobs),
    ]
    t0 = time.monotonic()
    with open(log, "w") as f:
        subprocess.run(cmd, check=True, stdout=f, stderr=subprocess.STDOUT)
    return time.monotonic() - t0


def entries(out: Path) -> dict:
    found = {}
    for path in sorted((out / "sm90").glob("*.json")):
        for variant, buckets in json.loads(path.read_text())["entries"].items():
            for bucket, e in buckets.items():
                found[(variant, bucket)] = e
    return found


def trial_times(journal: Path, names) -> dict:
    """{(variant, bucket): {json(meta): us}} from a run's storage."""
    import optuna

    from kvgen.tune import tuner

    storage = tuner.storage_from(str(journal), journal)
    out = {}
    for s in optuna.get_all_study_summaries(storage):
        variant, bucket = s.study_name.split("@", 1)
        study = optuna.load_study(study_name=s.study_name, storage=storage)
        out[(variant, bucket)] = {
            json.dumps(t.params, sort_keys=True): t.value
            for t in study.trials
            if t.state == optuna.trial.TrialState.COMPLETE
        }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("names", nargs="+", help="variants to tune (as `kvgen list` names them)")
    ap.add_argument("--gpus", type=int, default=2)
    ap.add_argument("--sampler", default="grid")
    ap.add_argument("--trials", type=int, default=1000)
    ap.add_argument("--json", required=True)
    ap.add_argument("--logs", default=None, help="folder for the runs' logs (default: tmp)")
    ap.add_argument(
        "--out", default=None, help="tuned_configs folder the N-GPU run writes (default: tmp)"
    )
    ap.add_argument("--jobs", type=int, default=max(1, (os.cpu_count() or 2) - 1))
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="kvgen-mgpu-"))
    logs = Path(args.logs or tmp)
    logs.mkdir(parents=True, exist_ok=True)
    print("warming the Triton cache (every candidate compiled once) ...", flush=True)
    warm = tune(
        args.names,
        1,
        tmp / "warm.journal",
        tmp / "warm",
        args.sampler,
        1,
        args.jobs,
        logs / "warm.log",
    )
    print(f"  {warm:.1f} s", flush=True)
    walls = {}
    outs = {1: tmp / "g1", args.gpus: Path(args.out) if args.out else tmp / f"g{args.gpus}"}
    for n in (1, args.gpus):
        print(f"tuning on {n} GPU(s) ...", flush=True)
        walls[n] = tune(
            args.names,
            n,
            tmp / f"g{n}.journal",
            outs[n],
            args.sampler,
            args.trials,
            1,
            logs / f"tune-{n}gpu.log",
        )
        print(f"  {walls[n]:.1f} s", flush=True)
    one, many = entries(outs[1]), entries(outs[args.gpus])
    many = {k: v for k, v in many.items() if k[0] in args.names}
    times_one = trial_times(tmp / "g1.journal", args.names)
    rows, same = [], 0
    for key in sorted(one):
        a, b = one[key], many.get(key)
        row = {
            "variant": key[0],
            "bucket": key[1],
            "meta_1gpu": a["meta"],
            "time_us_1gpu": a["time_us"],
            "trials_1gpu": a["trials"],
        }
        if b is not None:
            row.update(meta_ngpu=b["meta"], time_us_ngpu=b["time_us"], trials_ngpu=b["trials"])
            row["same_winner"] = a["meta"] == b["meta"]
            same += row["same_winner"]
            # the N-GPU winner as the 1-GPU run timed it: how far apart the two winners are
            t = times_one.get(key, {}).get(json.dumps(b["meta"], sort_keys=True))
            row["ngpu_winner_in_1gpu_run_us"] = t
            row["winner_gap"] = None if t is None else t / a["time_us"] - 1
        rows.append(row)
        print(
            f"  {key[0]} @ {key[1]}: 1 GPU {a['meta']} {a['time_us']:.2f} us; "
            f"{args.gpus} GPUs {b and b['meta']} {b and b['time_us']:.2f} us"
            + (
                ""
                if b is None or row["same_winner"]
                else f" (gap in the 1-GPU timings {row['winner_gap']:+.1%})"
            )
        )
    ratio = walls[args.gpus] / walls[1]
    print(
        f"wall: 1 GPU {walls[1]:.1f} s, {args.gpus} GPUs {walls[args.gpus]:.1f} s "
        f"-> x{ratio:.2f} (goal <= 0.6); same winner in {same}/{len(rows)} studies"
    )
    from kvgen.bench.harness import environment

    doc = {
        "env": environment(),
        "gpus": args.gpus,
        "sampler": args.sampler,
        "trials": args.trials,
        "names": args.names,
        "warmup_s": warm,
        "wall_s_1gpu": walls[1],
        "wall_s_ngpu": walls[args.gpus],
        "wall_ratio": ratio,
        "same_winner": same,
        "studies": len(rows),
        "rows": rows,
    }
    Path(args.json).write_text(json.dumps(doc, indent=2, sort_keys=True))


if __name__ == "__main__":
    main()
