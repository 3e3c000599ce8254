#!/usr/bin/env bash
# Create .venv (if missing) and install kvgen into it with what the tests need.
# Non-editable by default, as a user installs it; KVGEN_EDITABLE=1 for development.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
# torch first, pinned: on the CPU machines this is a CPU build kept on local disk; letting pip
# resolve plain "torch" would pull a multi-GB CUDA build.
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  .venv/bin/python -m pip install -q "torch==${KVGEN_TORCH_VERSION:-2.13.0}"
fi
# Triton pinned to the version on the H200 machine, so that the interpreter here runs what the
# GPU compiles there (its behaviour differs between releases; see docs/interpreter.md).
.venv/bin/python -m pip install -q "triton==${KVGEN_TRITON_VERSION:-3.6.0}"
if [ "${KVGEN_EDITABLE:-0}" = 1 ]; then
  .venv/bin/python -m pip install -q -e ".[test]"
else
  .venv/bin/python -m pip install -q --force-reinstall --no-deps .
  .venv/bin/python -m pip install -q ".[test]"
fi
