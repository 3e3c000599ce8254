#!/usr/bin/env bash
# On a GPU: compute-sanitizer over every kernel family (scripts/gpu_check.py: each store format
# into guarded caches, each reader, each decode variant and kernel, small shapes).
#   memcheck, initcheck, synccheck: every kernel;
#   racecheck: every kernel but the warp-specialised decode (split_kernel_roles: the tool reports
#   hazards on its mbarrier-ordered hand-overs between warpgroups, as it does on FlashMLA's own
#   mbarrier-synchronised kernel).
# Writes the reports to ${1:-gpu-check.txt}; exits non-zero on any error. Further arguments name
# scripts/gpu_check.py's sections to run (default: all). KVGEN_SANITIZER_TOOLS picks the tools
# (default: "memcheck initcheck synccheck racecheck"); KVGEN_SANITIZER_TIMEOUT (seconds) stops
# each tool after that long, keeping what it reported (exit 124 for that tool).
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
# The tools run side by side (one process each: the compiles are on the CPU, the GPU has room
# for all four); their reports are joined in order.
run_tool() {
  local tool=$1
  shift
  local extra=()
  case "$tool" in
    racecheck) extra=(--kernel-name-exclude kns=split_kernel_roles) ;;
  esac
  local limit=()
  [ -n "${KVGEN_SANITIZER_TIMEOUT:-}" ] && limit=(timeout "$KVGEN_SANITIZER_TIMEOUT")
  "${limit[@]}" compute-sanitizer --tool "$tool" "${extra[@]}" --error-exitcode 3 "$PYTHON" -P \
    scripts/gpu_check.py "$@" >"$out.$tool" 2>&1
}
declare -A pids
for tool in $tools; do
  run_tool "$tool" "$@" &
  pids[$tool]=$!
done
rc=0
for tool in $tools; do
  trc=0
  wait "${pids[$tool]}" || trc=$?
  [ $trc -ne 0 ] && rc=$trc
  echo "## $tool" >>"$out"
  cat "$out.$tool" >>"$out"
  rm -f "$out.$tool"
  [ $trc -eq 124 ] && echo "(stopped after ${KVGEN_SANITIZER_TIMEOUT} s)" >>"$out"
  echo "$tool: exit $trc; $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$out" | tail -n 1)"
done
exit $rc
