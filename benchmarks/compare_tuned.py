"""Time the configs of two tuned_configs folders against each other, bucket by bucket, in one
process on this GPU.

    python benchmarks/compare_tuned.py A B [--arch sm90] [--device D] [--family F,...]
        [--rounds 3] [--json F]

A and B are tuned_configs folders (each holding <arch>/<family>.json; e.g. the package's and a
new `kvgen tune --out` folder); with --device D, each folder's <arch>/D/<family>.json (a GPU
model's own files) replaces its <arch>/<family>.json, as the ops load them on that model. For
every (variant, bucket) that both tuned, the two configs
are timed with the tuner's own trial (the family's tuning problem: its inputs, its correctness
check, CUDA graphs on rotated buffers) in alternated rounds, A B, B A, A B, ...; the row is the
ratio of B's median to A's. Buckets where both chose the same config are listed with ratio 1
and not timed; entries only one folder holds are listed as such (and counted in the
summary). `KVGEN_TUNE_EVALUATOR` (module:function) replaces the GPU timer, as for `kvgen tune`
(the tests' fake timer).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

from kvgen import registry
from kvgen.space import parse_bucket_key

GPU_EVALUATOR = "kvgen.tune.problems:gpu_evaluator"
TOLERANCE = 0.02  # "as good": B within 2 % of A


def load(folder: Path, arch: str, device: str = "") -> dict[str, dict]:
    """{family: its JSON document} of ``folder/arch``, each replaced by the one in
    ``folder/arch/device`` where that folder has one."""
    out = {}
    for where in [folder / arch] + ([folder / arch / device] if device else []):
        for path in sorted(where.glob("*.json")):
            doc = json.loads(path.read_text())
            out[doc["family"]] = doc
    return out


def pairs(
    a: Path, b: Path, arch: str, families: list[str] | None = None, device: str = ""
) -> list[dict]:
    """Every (variant, bucket) tuned in both folders: its spec, bucket and the two configs."""
    docs_a, docs_b = load(a, arch, device), load(b, arch, device)
    out = []
    for family in sorted(set(docs_a) & set(docs_b)):
        if families and family not in families:
            continue
        ea, eb = docs_a[family]["entries"], docs_b[family]["entries"]
        for variant in sorted(set(ea) & set(eb)):
            spec = registry.lookup([variant], arch, "gpu")[0]
            for key in sorted(set(ea[variant]) & set(eb[variant])):
                out.append(
                    {
                        "family": family,
                        "variant": variant,
                        "bucket": key,
                        "spec": spec,
                        "a": ea[variant][key]["meta"],
                        "b": eb[variant][key]["meta"],
                    }
                )
    return out


def unpaired(
    a: Path, b: Path, arch: str, families: list[str] | None = None, device: str = ""
) -> dict:
    """``{"a": [...], "b": [...]}``: the ``variant @ bucket`` entries only folder A (or only B)
    holds, which no row compares (a study with no result on one side, a variant one run did
    not tune)."""
    docs_a, docs_b = load(a, arch, device), load(b, arch, device)

    def keys(docs):
        return {
            f"{variant} @ {key}"
            for family, doc in docs.items()
            if not families or family in families
            for variant, buckets in doc["entries"].items()
            for key in buckets
        }

    ka, kb = keys(docs_a), keys(docs_b)
    return {"a": sorted(ka - kb), "b": sorted(kb - ka)}


def evaluator_factory(name: str | None = None):
    import importlib

    module, _, attr = (name or os.environ.get("KVGEN_TUNE_EVALUATOR", GPU_EVALUATOR)).partition(":")
    return getattr(importlib.import_module(module), attr)


def compare(rows: list[dict], factory, rounds: int = 3, log=print) -> list[dict]:
    """Time each row's two configs in ``rounds`` alternated rounds; adds a_us, b_us, ratio
    (B / A, medians), or ``error`` where a config fails its trial now."""
    out = []
    for i, row in enumerate(rows, 1):
        r = {k: v for k, v in row.items() if k != "spec"}
        if row["a"] == row["b"]:
            r |= {"same": True, "ratio": 1.0}
        else:
            evaluate = factory(row["spec"], parse_bucket_key(row["bucket"]))
            evaluate = getattr(evaluate, "confirm", evaluate)  # (the bench's full settle)
            times: dict[str, list[float]] = {"a": [], "b": []}
            try:
                for k in range(rounds):
                    for side in ("a", "b") if k % 2 == 0 else ("b", "a"):
                        times[side].append(evaluate(row[side]))
            except Exception as exc:  # a config that fails its trial now: the row says so
                r["error"] = f"{type(exc).__name__}: {exc}"[:300]
            else:
                a, b = statistics.median(times["a"]), statistics.median(times["b"])
                r |= {"same": False, "a_us": a, "b_us": b, "ratio": b / a}
        log(describe(r, f"[{i}/{len(rows)}]"))
        out.append(r)
    return out


def describe(r: dict, label: str = "") -> str:
    head = f"{label} {r['variant']} @ {r['bucket']}".strip()
    if "error" in r:
        return f"{head}: {r['error']}"
    if r["same"]:
        return f"{head}: the same config"
    return f"{head}: A {r['a_us']:.2f} us, B {r['b_us']:.2f} us, B/A {r['ratio']:.3f}"


def summary(rows: list[dict], tolerance: float = TOLERANCE) -> str:
    timed = [r for r in rows if "ratio" in r]
    ok = [r for r in timed if r["ratio"] <= 1 + tolerance]
    worst = max(timed, key=lambda r: r["ratio"], default=None)
    text = (
        f"{len(ok)}/{len(timed)} buckets with B within {tolerance:.0%} of A "
        f"({sum(r['same'] for r in timed)} the same config)"
    )
    if worst is not None:
        text += f"; worst B/A {worst['ratio']:.3f} ({worst['variant']} @ {worst['bucket']})"
    errors = [r for r in rows if "error" in r]
    if errors:
        text += f"; {len(errors)} failed now"
    return text


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("a", type=Path, help="tuned_configs folder A (the baseline)")
    ap.add_argument("b", type=Path, help="tuned_configs folder B")
    ap.add_argument("--arch", default="sm90")
    ap.add_argument(
        "--device", default="", help="a device folder (e.g. nvidia-h100-80gb-hbm3) whose files "
        "replace each folder's arch files, as the ops load them on that GPU model",
    )  # fmt: skip
    ap.add_argument("--family", help="comma-separated families (default: every one in both)")
    ap.add_argument("--rounds", type=int, default=3, help="alternated timings of each config")
    ap.add_argument("--json", type=Path, help="write the rows here")
    args = ap.parse_args(argv)
    if args.rounds < 1:
        ap.error("--rounds must be at least 1")
    families = args.family.split(",") if args.family else None
    rows = pairs(args.a, args.b, args.arch, families, args.device)
    if not rows:
        print(f"no (variant, bucket) is tuned in both {args.a} and {args.b}", file=sys.stderr)
        return 1
    out = compare(rows, evaluator_factory(), args.rounds)
    alone = unpaired(args.a, args.b, args.arch, families, args.device)
    for side in ("a", "b"):
        for entry in alone[side]:
            print(f"only in {side.upper()}: {entry}")
    text = summary(out)
    if alone["a"] or alone["b"]:
        text += f"; {len(alone['a'])} only in A, {len(alone['b'])} only in B"
    print(text)
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "a": str(args.a),
                    "b": str(args.b),
                    "rounds": args.rounds,
                    "summary": text,
                    "rows": out,
                    "only_in_a": alone["a"],
                    "only_in_b": alone["b"],
                },  # fmt: skip
                indent=1,
            )
            + "\n"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
