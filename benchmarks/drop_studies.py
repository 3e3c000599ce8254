"""Delete studies from a tuning journal (or database), so that a resumed run does them again.

    python benchmarks/drop_studies.py STORAGE PATTERN... [--dry-run]

Every study whose name (``variant@bucket``) contains one of the PATTERNs is deleted, with its
trials; the others are left as they are. E.g. after a run whose trials of some studies all
failed for a reason that was not their configs' (the GPU's memory taken by other processes):

    python benchmarks/drop_studies.py build/tune/tpe.journal \\
        gqa_decode-d128-dv128-bf16-kvauto-g0-portable-sm90-gpu@
    KVGEN_TUNE_WARM=1 KVGEN_TUNE_ARGS="--sampler tpe --patience 0" ... scripts/gpu_session.sh tune

Prints each study it deletes (or would, with --dry-run) and how many trials it held.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import optuna

from kvgen.tune import tuner


def drop(storage: str, patterns: list[str], dry_run: bool = False) -> list[tuple[str, int]]:
    """``[(study name, trials)]`` of the studies of ``storage`` whose name contains one of
    ``patterns``, deleted unless ``dry_run``."""
    store = tuner.storage_from(storage, Path(storage))
    gone = []
    for summary in store.get_all_studies():
        name = summary.study_name
        if any(p in name for p in patterns):
            trials = len(store.get_all_trials(summary._study_id, deepcopy=False))
            if not dry_run:
                optuna.delete_study(study_name=name, storage=store)
            gone.append((name, trials))
    return gone


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("storage", help="a journal file or a database URL")
    parser.add_argument("patterns", nargs="+", help="parts of the study names to delete")
    parser.add_argument("--dry-run", action="store_true", help="only say what would go")
    args = parser.parse_args()
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    gone = drop(args.storage, args.patterns, args.dry_run)
    verb = "would delete" if args.dry_run else "deleted"
    for name, trials in gone:
        print(f"{verb} {name} ({trials} trials)")
    print(f"{len(gone)} studies {verb}")


if __name__ == "__main__":
    main()
