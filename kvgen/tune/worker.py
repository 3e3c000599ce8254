"""``python -m kvgen.tune.worker PLAN``: one tuning worker, started by ``kvgen tune --gpus N``
(see ``kvgen.tune.parallel``). It runs on the GPU that ``CUDA_VISIBLE_DEVICES`` leaves it."""

from __future__ import annotations

import pickle
import sys
from pathlib import Path


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m kvgen.tune.worker PLAN_FILE", file=sys.stderr)
        return 2
    from kvgen.tune import parallel

    plan = pickle.loads(Path(argv[0]).read_bytes())
    try:
        return parallel.work(plan, log=lambda line: print(line, flush=True))
    except KeyboardInterrupt:  # Ctrl-C reaches the whole process group; the coordinator reports
        return 130


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
