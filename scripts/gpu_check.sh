#!/usr/bin/env bash
# On a GPU: compute-sanitizer's memcheck over every kernel family (scripts/gpu_check.py: each
# store format into guarded caches, each reader, each decode variant and kernel, small shapes).
# Writes the sanitizer's report to ${1:-gpu-check.txt}; exits non-zero on any error. Further
# arguments name scripts/gpu_check.py's sections to run (default: all).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-gpu-check.txt}
shift || true
: "${PYTHON:=python3}"
{
  echo "# compute-sanitizer memcheck over scripts/gpu_check.py"
  echo "# $(date -u +%FT%TZ) $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader)"
  echo "# kvgen ${KVGEN_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo '?')}, $($PYTHON -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)')"
} >"$out"
compute-sanitizer --tool memcheck --error-exitcode 3 "$PYTHON" -P scripts/gpu_check.py "$@" \
  >>"$out" 2>&1
rc=$?
tail -n 3 "$out"
exit $rc
