#!/usr/bin/env bash
# On a GPU: compute-sanitizer over every kernel family (scripts/gpu_check.py: each store format
# into guarded caches, each reader, each decode variant and kernel, small shapes).
#   memcheck, initcheck, synccheck: every kernel;
#   racecheck: every kernel but the warp-specialised decode (split_kernel_roles: the tool reports
#   hazards on its mbarrier-ordered hand-overs between warpgroups, as it does on FlashMLA's own
#   mbarrier-synchronised kernel).
# Writes the reports to ${1:-gpu-check.txt}; exits non-zero on any error. Further arguments name
# scripts/gpu_check.py's sections to run (default: all). KVGEN_SANITIZER_TOOLS picks the tools
# (default: "memcheck initcheck synccheck racecheck").
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-gpu-check.txt}
shift || true
: "${PYTHON:=python3}"
tools=${KVGEN_SANITIZER_TOOLS:-memcheck initcheck synccheck racecheck}
{
  echo "# compute-sanitizer ($tools) over scripts/gpu_check.py"
  echo "# $(date -u +%FT%TZ) $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader)"
  echo "# kvgen ${KVGEN_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo '?')}, $($PYTHON -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)')"
} >"$out"
rc=0
for tool in $tools; do
  extra=()
  case "$tool" in
    racecheck) extra=(--kernel-name-exclude kns=split_kernel_roles) ;;
  esac
  echo "## $tool" >>"$out"
  compute-sanitizer --tool "$tool" "${extra[@]}" --error-exitcode 3 "$PYTHON" -P \
    scripts/gpu_check.py "$@" >>"$out" 2>&1 || rc=$?
  echo "$tool: $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$out" | tail -n 1)"
done
tail -n 3 "$out"
exit $rc
