#!/usr/bin/env bash
# On a GPU: compute-sanitizer over every kernel family (scripts/gpu_check.py: each store format
# into guarded caches, each reader, each decode variant and kernel, small shapes).
#   memcheck, initcheck, synccheck: every kernel;
#   racecheck: every kernel but the warp-specialised decode (split_kernel_roles: the tool reports
#   hazards on its mbarrier-ordered hand-overs between warpgroups, as it does on FlashMLA's own
#   mbarrier-synchronised kernel).
# Writes the reports to ${1:-gpu-check.txt}; exits non-zero on any error. Stopped (an outer
# `timeout`), it stops its runs and still writes the report of what ran, each run cut short
# marked so, in that one file (a device call brings back a few files only). Further arguments name
# scripts/gpu_check.py's sections to run (default: all; `python3 scripts/gpu_check.py --list`). KVGEN_SANITIZER_TOOLS picks the tools
# (default: "memcheck initcheck synccheck racecheck"); KVGEN_SANITIZER_TIMEOUT (seconds) stops
# each run after that long, keeping what it reported (exit 124 for that run).
# Each (tool, section) pair is its own process, KVGEN_SANITIZER_JOBS (default 8) at a time,
# racecheck's first (the slowest); the report lists them by tool, then section. Before the tools,
# each section runs once without them (KVGEN_SANITIZER_WARM=0 skips it), the same number at a
# time, so that the sanitized runs find their kernels in Triton's cache instead of compiling them
# under the tool, which is slow (with a warm cache, initcheck and synccheck over the seven decode
# sections take about 25 s on an H200).
set -uo pipefail
export PYTHONUNBUFFERED=1  # a run stopped by KVGEN_SANITIZER_TIMEOUT keeps the lines it printed
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
sections=("$@")
if [ ${#sections[@]} -eq 0 ]; then
  mapfile -t sections < <("$PYTHON" -P scripts/gpu_check.py --list)
fi
run_one() {
  local tool=$1 section=$2 extra=() limit=()
  case "$tool" in
    racecheck) extra=(--kernel-name-exclude kns=split_kernel_roles) ;;
  esac
  [ -n "${KVGEN_SANITIZER_TIMEOUT:-}" ] && limit=(timeout "$KVGEN_SANITIZER_TIMEOUT")
  local rc=0
  "${limit[@]}" compute-sanitizer --tool "$tool" "${extra[@]}" --error-exitcode 3 "$PYTHON" -P \
    scripts/gpu_check.py "$section" >"$out.$tool.$section" 2>&1 &
  echo $! >"$out.$tool.$section.pid"
  wait $! || rc=$?
  rm -f "$out.$tool.$section.pid"
  echo "$rc" >"$out.$tool.$section.rc"
}
# Stopped (e.g. by an outer `timeout`, which signals this script's process group), stop the runs
# still going: a run under KVGEN_SANITIZER_TIMEOUT is in a process group of its own (timeout's),
# which that signal does not reach, and would go on using the GPU after this script has ended.
stop_runs() {
  local f pid
  for f in "$out".*.pid; do
    [ -f "$f" ] || continue
    pid=$(cat "$f")
    kill -TERM -- "-$pid" 2>/dev/null || kill -TERM "$pid" 2>/dev/null
    rm -f "$f"
  done
  # shellcheck disable=SC2046  # a list of pids
  kill -TERM $(jobs -p) 2>/dev/null
}
# The report: each tool's sections in order, each run's output and exit status (a run the
# script was stopped in: "stopped"; one it never began: "not run"); the per-run files removed.
# Returns non-zero unless every run ended clean.
report() {
  local tool section trc bad rc=0
  for tool in $tools; do
    echo "## $tool" >>"$out"
    bad=()
    for section in "${sections[@]}"; do
      if [ -f "$out.$tool.$section.rc" ]; then
        trc=$(cat "$out.$tool.$section.rc")
      elif [ -f "$out.$tool.$section" ]; then
        trc=stopped
      else
        trc="not run"
      fi
      echo "### $tool $section (exit $trc)" >>"$out"
      [ -f "$out.$tool.$section" ] && cat "$out.$tool.$section" >>"$out"
      [ "$trc" = 124 ] && echo "(stopped after ${KVGEN_SANITIZER_TIMEOUT} s)" >>"$out"
      if [ "$trc" != 0 ]; then
        rc=1
        bad+=("$section (exit $trc)")
      elif ! grep -qE 'ERROR SUMMARY: 0 errors|RACECHECK SUMMARY: 0 hazards' "$out.$tool.$section"; then
        rc=1
        bad+=("$section (no clean summary)")
      fi
      rm -f "$out.$tool.$section" "$out.$tool.$section.rc"
    done
    if [ ${#bad[@]} -eq 0 ]; then
      echo "$tool: ${#sections[@]} sections, 0 errors"
    else
      echo "$tool: ${#sections[@]} sections; not clean: ${bad[*]}"
    fi
  done
  return $rc
}
stopped() {
  stop_runs
  wait 2>/dev/null  # (the runs' subshells, so that none writes a file past the report)
  rm -f "$out".warm.*
  report
  exit 143
}
trap stopped TERM INT HUP
if [ "${KVGEN_SANITIZER_WARM:-1}" != 0 ]; then
  for section in "${sections[@]}"; do
    while [ "$(jobs -rp | wc -l)" -ge "${KVGEN_SANITIZER_JOBS:-8}" ]; do wait -n; done
    "$PYTHON" -P scripts/gpu_check.py "$section" >"$out.warm.$section" 2>&1 &
  done
  wait
  # (a section that fails here fails under the tools too, where its report says why)
  rm -f "$out".warm.*
fi
order=()
for tool in $tools; do [ "$tool" = racecheck ] && order=("$tool" "${order[@]}") || order+=("$tool"); done
for tool in "${order[@]}"; do
  for section in "${sections[@]}"; do
    while [ "$(jobs -rp | wc -l)" -ge "${KVGEN_SANITIZER_JOBS:-8}" ]; do wait -n; done
    run_one "$tool" "$section" &
  done
done
wait
report
