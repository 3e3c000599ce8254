"""Give a tuned_configs folder the configs a `compare_tuned.py` run timed faster than its own.

    python benchmarks/adopt_faster.py COMPARE.json FOLDER [--arch sm90] [--device D]
        [--margin 0.02]

COMPARE.json is `compare_tuned.py A B --json COMPARE.json`'s output, and FOLDER holds B's
configs (B itself, or a copy such as the package's tuned_configs). For every row where A's
config took less time than B's by more than ``--margin`` (B / A above 1 + margin, both medians
of the same process's alternated rounds), FOLDER's entry for that (variant, bucket) takes A's
config. Its ``time_us`` becomes the entry's own times A / B, so that it stays on the scale of the
run that wrote the file (the ops compare variants by their tuned times), and ``adopted``
records the compare file, both medians and the config it replaced. An entry whose config is no
longer B's (the folder changed since the compare) is left as it is and named. With ``--device
D`` the entries are FOLDER's ``<arch>/D/<family>.json`` (a GPU model's own files). Files are
written through ``kvgen.configs.write`` (validated, keys sorted).

Combines two tunes of one GPU (e.g. the default search and a longer TPE run) into the faster
config per bucket, by measurement rather than by either run's own readings.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from kvgen import configs

sys.path.insert(0, str(Path(__file__).resolve().parent))  # (its sibling, run as a script, -P)
from compare_tuned import TOLERANCE as MARGIN  # noqa: E402  (closer is a tie: B stays)


def adopt(
    rows: list[dict],
    folder: Path,
    arch: str,
    device: str = "",
    margin: float = MARGIN,
    source: str = "",
) -> tuple[list[str], list[str]]:
    """Write A's config into ``folder``'s entries where the compare's ``rows`` timed it faster
    by more than ``margin``. Returns ``(adopted, left)``: ``variant @ bucket`` of the entries
    changed, and of those left because their config is no longer the compare's B."""
    docs: dict[Path, dict] = {}
    adopted, left = [], []
    for r in rows:
        if r.get("same") or "ratio" not in r or r["ratio"] <= 1 + margin:
            continue
        where = f"{r['variant']} @ {r['bucket']}"
        path = folder / arch / device / f"{r['family']}.json"
        if path not in docs:
            if not path.is_file():
                left.append(f"{where} (no {path})")
                continue
            docs[path] = json.loads(path.read_text())
        entry = docs[path]["entries"].get(r["variant"], {}).get(r["bucket"])
        if entry is None or entry["meta"] != r["b"]:
            left.append(where)
            continue
        entry["adopted"] = {
            "from": source,
            "a_us": round(r["a_us"], 4),
            "b_us": round(r["b_us"], 4),
            "replaced": entry["meta"],
        }
        entry["meta"] = dict(r["a"])
        entry["time_us"] = round(entry["time_us"] * r["a_us"] / r["b_us"], 4)
        adopted.append(where)
    for path, doc in docs.items():
        configs.write(path, doc, device=device or None)
    return adopted, left


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("compare", type=Path, help="compare_tuned.py's --json output (A against B)")
    ap.add_argument("folder", type=Path, help="the tuned_configs folder holding B's configs")
    ap.add_argument("--arch", default="sm90")
    ap.add_argument("--device", default="", help="write FOLDER/<arch>/D/ (a GPU model's files)")
    ap.add_argument(
        "--margin", type=float, default=MARGIN,
        help="adopt A's config where B / A exceeds 1 + this (default %(default)s)",
    )  # fmt: skip
    args = ap.parse_args(argv)
    if args.margin < 0:
        ap.error("--margin must be at least 0")
    rows = json.loads(args.compare.read_text())["rows"]
    adopted, left = adopt(rows, args.folder, args.arch, args.device, args.margin,
                          str(args.compare))  # fmt: skip
    for where in adopted:
        print(f"adopted A's config: {where}")
    for where in left:
        print(f"left (its config is not the compare's B): {where}", file=sys.stderr)
    print(f"{len(adopted)} entries adopted, {len(left)} left")
    return 0


if __name__ == "__main__":
    sys.exit(main())
