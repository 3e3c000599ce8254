#!/usr/bin/env bash
# The test command: set up .venv (scripts/setup.sh) and run the whole suite against the
# installed kvgen. Without a GPU the kernels run in Triton's CPU interpreter.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
exec .venv/bin/pytest "$@"
