#!/usr/bin/env bash
# The main job: set up, generate every variant's source into build/generated, verify every
# variant against the reference on this machine, and on a GPU run a short benchmark.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
.venv/bin/kvgen gen --out build/generated
.venv/bin/kvgen verify --quiet
if .venv/bin/python -c "import torch, sys; sys.exit(not torch.cuda.is_available())"; then
  .venv/bin/kvgen bench --tokens 16,4096,65536 --json build/bench.json
fi
