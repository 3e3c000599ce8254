#!/usr/bin/env bash
# The test command: set up .venv (scripts/setup.sh) and run the whole suite against the
# installed kvgen. Without a GPU the kernels run in Triton's CPU interpreter, one pytest-xdist
# worker a CPU core (KVGEN_TEST_WORKERS: another count; 0 runs in this process).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
# --durations: the slowest tests, printed at the end (what to look at when the suite grows).
exec .venv/bin/pytest -n "${KVGEN_TEST_WORKERS:-auto}" --durations=20 "$@"
