#!/usr/bin/env bash
# What a change that touches kernels runs on a GPU machine, written under ${OUT:-gpu-out}/:
#   scripts/gpu_session.sh tests [K/N] the test suite (xdist) and the sanitizer
#                                  (scripts/gpu_check.sh); with K/N only the K-th of N like
#                                  shares of the tests (pytest --shard, tests/conftest.py) and
#                                  no sanitizer, in $out/gpu-tests-<day>-K-of-N.log: a suite
#                                  longer than one call run as N calls
#   scripts/gpu_session.sh fuzz [N] the property-based (hypothesis) suites, tests/test_*_fuzz.py, at
#                                  N examples a test (default 300; CI runs 30 under the
#                                  interpreter), one process a file side by side, with
#                                  hypothesis' statistics (examples passing / failing / invalid,
#                                  the share refused and the share matched) in
#                                  $out/gpu-fuzz-<day>.txt; each file stops after
#                                  KVGEN_FUZZ_TIMEOUT seconds (default 480)
#   scripts/gpu_session.sh bench   kvgen bench with its JSON and plot, and kvgen show's plot
#   scripts/gpu_session.sh tune [S] a cold kvgen tune --arch sm90 (every default study) for at
#                                  most S seconds (default 540), its log and JSON (one tar,
#                                  tuned-sm90.tar: a device call brings back 8 files) under $out;
#                                  the studies live in build/tune/sm90.journal (copied to $out
#                                  too), so the same command on the same machine, or on another
#                                  with that file in build/tune/, resumes where the last one
#                                  stopped (a run longer than one call). KVGEN_TUNE_ARGS: more
#                                  options (e.g. a 40-trial TPE baseline: --sampler tpe
#                                  --patience 0); KVGEN_TUNE_JOURNAL and KVGEN_TUNE_OUT: another
#                                  journal file and tuned_configs folder (default
#                                  /tmp/kvgen-tuned), so that such a run keeps its own studies;
#                                  KVGEN_TUNE_TAG=T names its log and tar tune-T-<day>.log and
#                                  tuned-T-sm90.tar (two tunes in one call).
#   scripts/gpu_session.sh tune-start [S] the same cold tune (at most S seconds, default 1200) in
#                                  a process session of its own (setsid), which runs on past
#                                  this call while the machine is held, so that one run longer
#                                  than a call is timed whole; this call then waits as tune-wait.
#                                  Cold: Triton's cache, the journal and the output folder are
#                                  emptied first (KVGEN_TUNE_WARM=1 keeps them: a resumed run)
#   scripts/gpu_session.sh tune-wait  waits (at most KVGEN_TUNE_WAIT seconds, default 540) for the
#                                  tune tune-start began, printing its progress, then brings
#                                  back its log (with its wall time), JSON tar and journal as
#                                  tune does; run it as the next call (within the machine's
#                                  idle release), again until the log says the tune ended.
#                                  It installs nothing (the running tune imports /tmp/kv)
#   scripts/gpu_session.sh compare B [A] the configs of tuned_configs folder B timed against A's
#                                  (default: this checkout's tuned_configs), bucket by bucket,
#                                  in one process (benchmarks/compare_tuned.py; its options,
#                                  e.g. --rounds 5, in KVGEN_COMPARE_ARGS)
#   scripts/gpu_session.sh family F [NAME...] the work a change to one family's kernels needs,
#                                  in one call: its tests (tests/test_F.py, or the files of
#                                  KVGEN_TEST_FILES, with KVGEN_TEST_ARGS), a tune of the
#                                  variants NAME... (default: F's default variants; quoted
#                                  patterns such as 'gqa_decode-*-rows-*' too; options such
#                                  as --timeout S may follow; KVGEN_TUNE=0: none) into a copy of
#                                  tuned_configs (F's JSON comes back), its bench
#                                  (KVGEN_BENCH_OPS, default F) with the copy's configs, and the
#                                  sanitizer over KVGEN_CHECK_SECTIONS (default: every section,
#                                  python3 scripts/gpu_check.py --list), each run capped at
#                                  KVGEN_SANITIZER_TIMEOUT seconds (default 200); each of
#                                  KVGEN_TEST_FILES, KVGEN_BENCH_OPS and KVGEN_CHECK_SECTIONS set
#                                  empty skips its step
#   scripts/gpu_session.sh ab TAR[,TAR...] [N] -- ARGS... python3 -P ARGS (a script or -m module
#                                  and its arguments) under this checkout's kvgen (A) and under
#                                  the kvgen of each TAR (B, C, ...: a `git archive` of another
#                                  commit, e.g. in a carried folder), alternated A B A B ... N
#                                  rounds (default 2), each run's output in
#                                  $out/ab-<side>-<round>.txt: kernel changes timed against
#                                  their base on one machine
#   scripts/gpu_session.sh exec -- COMMAND... COMMAND under this checkout's installed kvgen (e.g.
#                                  python3 -P benchmarks/replay_trials.py ..., or the same
#                                  under compute-sanitizer), its output in $out/exec-<day>.txt
#   scripts/gpu_session.sh protos  the keys-as-rows experiments (benchmarks/proto_keys_as_rows.py,
#                                  proto_gqa_keys_as_rows.py) at their best configs so far, each
#                                  beside kvgen's decodes in its process, with their JSON
# KVGEN_COMMIT, when set, is the commit the bench records (a copied checkout's .git may be
# older than its files). kvgen is installed from this checkout into /tmp/kv (no network: wheels of what the machine
# lacks, e.g. optuna for the tuner tests, may be put in .whl/ and are installed first).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-gpu-out}
mkdir -p "$out"
if [ "${1:-}" = ab ]; then  # every archive there, before minutes of installs and runs
  IFS=, read -ra ab_tars <<< "${2:-}"
  [ ${#ab_tars[@]} -gt 0 ] || ab_tars=("")
  for tar in "${ab_tars[@]}"; do
    if [ ! -f "$tar" ]; then
      echo "$0 ab: no archive '$tar'" | tee "$out/ab-error.txt" >&2
      exit 2
    fi
  done
fi
export PYTHONUNBUFFERED=1
bg=/tmp/kvgen-tune-bg  # the detached tune's log, exit status and settings (tune-start)
# tune-wait installs nothing: the running tune imports what the call that started it installed
install=1
[ "${1:-}" = tune-wait ] && [ -d /tmp/kv ] && install=
if [ -n "$install" ] && compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
fi
[ -d /tmp/site ] && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
if [ -n "$install" ]; then
  python3 -m pip install -q --no-index --no-deps --no-build-isolation --upgrade --target /tmp/kv \
    . || exit 1
fi
export PYTHONPATH=/tmp/kv${PYTHONPATH:+:$PYTHONPATH}
day=$(date -u +%F)
rc=0
# a cold tune's studies and JSON (tune, tune-start)
journal=${KVGEN_TUNE_JOURNAL:-build/tune/sm90.journal}
tuned=${KVGEN_TUNE_OUT:-/tmp/kvgen-tuned}
tag=${KVGEN_TUNE_TAG:+$KVGEN_TUNE_TAG-}  # names a tune's log and tar apart from another's
case "${1:-tests}" in
  tests)
    shard=${2:-}
    log=$out/gpu-tests-$day${shard:+-${shard%/*}-of-${shard#*/}}.log
    # -v: each test's outcome as it ends, so that a call cut short still names its failures;
    # --durations: where the suite's time goes
    python3 -P -m pytest -v -n 8 -p no:cacheprovider --durations=25 ${shard:+--shard "$shard"} \
      tests 2>&1 | tee "$log" | grep -v " PASSED \| SKIPPED " | tail -n 25 || rc=1
    if [ -z "$shard" ]; then
      PYTHON=python3 scripts/gpu_check.sh "$out/gpu-check-$day.txt" || rc=1
    fi
    ;;
  fuzz)
    n=${2:-300}
    pids=()
    files=(tests/test_*_fuzz.py)
    for f in "${files[@]}"; do
      KVGEN_FUZZ_EXAMPLES=$n timeout "${KVGEN_FUZZ_TIMEOUT:-480}" python3 -P -m pytest -q \
        -p no:cacheprovider --hypothesis-show-statistics "$f" \
        >"$out/fuzz.$(basename "$f" .py).txt" 2>&1 &
      pids+=($!)
    done
    for i in "${!pids[@]}"; do  # a file stopped by KVGEN_FUZZ_TIMEOUT (124) says so last
      wait "${pids[$i]}" && continue
      st=$?
      rc=1
      echo "exit $st$([ $st = 124 ] && echo ", stopped at KVGEN_FUZZ_TIMEOUT")" \
        >>"$out/fuzz.$(basename "${files[$i]}" .py).txt"
    done
    {
      echo "# the hypothesis suites at KVGEN_FUZZ_EXAMPLES=$n on $(nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1), $(date -u +%FT%TZ), kvgen ${KVGEN_COMMIT:-?}"
      for f in "$out"/fuzz.*.txt; do
        echo "## $(basename "$f" .txt | cut -d. -f2): $(tail -n 1 "$f")"
        grep -v -e "^$" -e "Warning" -e "warner(" "$f"
      done
    } >"$out/gpu-fuzz-$day.txt"
    rm -f "$out"/fuzz.*.txt
    grep "^## " "$out/gpu-fuzz-$day.txt"
    ;;
  bench)
    python3 -P -m kvgen bench --tokens 1,16,4096,65536 --json "$out/bench-$day.json" \
      --plot "$out/bench-$day.png" ${KVGEN_COMMIT:+--commit "$KVGEN_COMMIT"} 2>&1 | tee "$out/bench-$day.txt" | tail -n 40 || rc=1
    python3 -P -m kvgen show sm90 --plot "$out/tuned-sm90.png" >/dev/null || rc=1
    ;;
  tune)
    mkdir -p "$(dirname "$journal")"
    start=$(date +%s)
    # shellcheck disable=SC2086  # KVGEN_TUNE_ARGS is a list of options
    # (one JSON a family: more files than a device call brings back)
    python3 -P -m kvgen tune --arch sm90 --storage "$journal" --out "$tuned" \
      --timeout "${2:-540}" ${KVGEN_TUNE_ARGS:-} 2>&1 | tee -a "$out/tune-$tag$day.log" |
      grep -E "^(tuning|compiling ahead|progress|workers done|wrote)" || rc=1
    echo "this call: $(($(date +%s) - start)) s" | tee -a "$out/tune-$tag$day.log"
    [ -d "$tuned/sm90" ] && tar -C "$tuned" -cf "$out/tuned-${tag}sm90.tar" sm90
    # the studies come back with the results: put the file in build/tune/ of the next
    # machine's checkout (e.g. a carried folder) to resume there
    cp "$journal" "$out/" 2>/dev/null || true
    ;;
  tune-start)
    if [ -f "$bg/pid" ] && kill -0 "$(cat "$bg/pid")" 2>/dev/null; then
      echo "$0 tune-start: a tune is already running (pid $(cat "$bg/pid")); tune-wait" >&2
      exit 2
    fi
    rm -rf "$bg" && mkdir -p "$bg" "$(dirname "$journal")"
    if [ "${KVGEN_TUNE_WARM:-0}" != 1 ]; then  # cold: no compiled kernel, study or JSON yet
      cache=${TRITON_CACHE_DIR:-$HOME/.triton/cache}
      echo "cold: emptying $cache, $journal and $tuned"
      rm -rf "$cache" "$journal" "$tuned"
    fi
    printf '%s\n' "$journal" >"$bg/journal"
    printf '%s' "$tag" >"$bg/tag"
    printf '%s\n' "$tuned" >"$bg/tuned"
    # shellcheck disable=SC2016  # expanded by the detached shell
    KVGEN_BG=$bg KVGEN_BG_JOURNAL=$journal KVGEN_BG_TUNED=$tuned KVGEN_BG_LIMIT=${2:-1200} \
      setsid bash -c 'start=$(date +%s)
        # shellcheck disable=SC2086  # KVGEN_TUNE_ARGS is a list of options
        python3 -P -m kvgen tune --arch sm90 --storage "$KVGEN_BG_JOURNAL" \
          --out "$KVGEN_BG_TUNED" --timeout "$KVGEN_BG_LIMIT" ${KVGEN_TUNE_ARGS:-} \
          >>"$KVGEN_BG/tune.log" 2>&1
        st=$?
        echo "tune wall time: $(($(date +%s) - start)) s, exit $st" >>"$KVGEN_BG/tune.log"
        echo "$st" >"$KVGEN_BG/rc"' </dev/null >/dev/null 2>&1 &
    echo $! >"$bg/pid"
    echo "started a detached tune (pid $(cat "$bg/pid")), log $bg/tune.log"
    ;&
  tune-wait)
    [ -f "$bg/pid" ] || { echo "$0 tune-wait: no tune was started (tune-start)" >&2; exit 2; }
    limit=$(($(date +%s) + ${KVGEN_TUNE_WAIT:-540}))
    seen=0
    while [ ! -f "$bg/rc" ] && [ "$(date +%s)" -lt "$limit" ]; do
      sleep 5
      n=$(wc -l <"$bg/tune.log" 2>/dev/null || echo 0)
      if [ "$n" -gt "$seen" ]; then
        sed -n "$((seen + 1)),${n}p" "$bg/tune.log" | grep -E "^(tuning|progress|wrote)" || true
        seen=$n
      fi
    done
    tag=$(cat "$bg/tag" 2>/dev/null || true)
    cp "$bg/tune.log" "$out/tune-$tag$day.log"
    if [ -f "$bg/rc" ]; then
      tail -n 1 "$bg/tune.log"
      [ "$(cat "$bg/rc")" = 0 ] || rc=1
    else
      echo "the tune is still running: call $0 tune-wait again (within the machine's idle release)"
    fi
    tuned=$(cat "$bg/tuned")
    [ -d "$tuned/sm90" ] && tar -C "$tuned" -cf "$out/tuned-${tag}sm90.tar" sm90
    cp "$(cat "$bg/journal")" "$out/" 2>/dev/null || true
    ;;
  compare)
    [ -n "${2:-}" ] || { echo "usage: $0 compare B [A]" >&2; exit 2; }
    # shellcheck disable=SC2086  # KVGEN_COMPARE_ARGS is a list of options (--rounds 5, ...)
    python3 -P benchmarks/compare_tuned.py "${3:-tuned_configs}" "$2" ${KVGEN_COMPARE_ARGS:-} \
      --json "$out/compare-tuned-$day.json" 2>&1 | tee "$out/compare-tuned-$day.txt" |
      tail -n 40 || rc=1
    ;;
  family)
    fam=${2:?usage: $0 family F [NAME...]}
    shift 2
    if [ "${KVGEN_TEST_FILES-unset}" != "" ]; then  # (set and empty: no tests)
      # shellcheck disable=SC2086  # lists of files and options
      python3 -P -m pytest -v -n 8 -p no:cacheprovider --durations=15 \
        ${KVGEN_TEST_FILES:-tests/test_$fam.py} \
        ${KVGEN_TEST_ARGS:-} 2>&1 |
        tee "$out/gpu-tests-$fam-$day.log" | grep -v " PASSED \| SKIPPED " | tail -n 25 || rc=1
    fi
    tuned=/tmp/kvgen-tuned-$fam
    rm -rf "$tuned" && cp -r tuned_configs "$tuned"
    names=("$@")
    [ ${#names[@]} -gt 0 ] || names=(--family "$fam")
    if [ "${KVGEN_TUNE:-1}" != 0 ]; then
      python3 -P -m kvgen tune --arch sm90 "${names[@]}" --out "$tuned" \
        --storage "/tmp/kvgen-tune-$fam.journal" 2>&1 | tee "$out/tune-$fam-$day.log" |
        grep -E "^(tuning|progress|workers done|wrote|  \[)" || rc=1
      # the file the tune wrote: the GPU model's own where the package has its folder (the
      # loader, and so the bench below, reads that one first), else the arch's
      written=$(sed -n "s/^wrote \(.*\/$fam\.json\)$/\1/p" "$out/tune-$fam-$day.log" | tail -n 1)
      [ -n "$written" ] && cp "$written" "$out/" || true
    fi
    ops=${KVGEN_BENCH_OPS-$fam}  # (set and empty: no bench)
    if [ -n "$ops" ]; then
      KVGEN_TUNED_CONFIGS=$tuned python3 -P -m kvgen bench --ops "$ops" \
        --json "$out/$fam-$day.json" ${KVGEN_COMMIT:+--commit "$KVGEN_COMMIT"} 2>&1 |
        tee "$out/bench-$fam-$day.txt" | tail -n 30 || rc=1
    fi
    if [ "${KVGEN_CHECK_SECTIONS-unset}" != "" ]; then  # (set and empty: no sanitizer)
      # shellcheck disable=SC2086  # a list of section names
      KVGEN_SANITIZER_TIMEOUT=${KVGEN_SANITIZER_TIMEOUT:-200} PYTHON=python3 \
        scripts/gpu_check.sh "$out/gpu-check-$fam-$day.txt" ${KVGEN_CHECK_SECTIONS:-} || rc=1
    fi
    ;;
  ab)
    rounds=2
    shift 2
    if [ "${1:-}" != "--" ]; then rounds=$1; shift; fi
    [ "${1:-}" = "--" ] || { echo "usage: $0 ab TAR[,TAR...] [N] -- ARGS..." >&2; exit 2; }
    shift
    sides=(A)
    letters=(B C D E F G H)
    for i in "${!ab_tars[@]}"; do
      side=${letters[$i]}
      sides+=("$side")
      rm -rf "/tmp/kv$side-src" && mkdir -p "/tmp/kv$side-src" &&
        tar -xf "${ab_tars[$i]}" -C "/tmp/kv$side-src" || exit 1
      python3 -m pip install -q --no-index --no-deps --no-build-isolation --upgrade \
        --target "/tmp/kv$side" "/tmp/kv$side-src" || exit 1
      echo "$side: ${ab_tars[$i]}"
    done
    for r in $(seq 1 "$rounds"); do
      for side in "${sides[@]}"; do
        pp=$PYTHONPATH
        [ "$side" = A ] || pp=${PYTHONPATH/\/tmp\/kv/\/tmp\/kv$side}
        echo "== $side round $r"
        PYTHONPATH=$pp python3 -P "$@" 2>&1 | tee "$out/ab-$side-$r.txt" | tail -n 12 || rc=1
      done
    done
    ;;
  protos)
    python3 -P benchmarks/proto_keys_as_rows.py --heads 16,32 --splits 1,2 --bufs 2 --async 0 \
      --s-fp8 1 --lazy 1 --wgs 1,2 --json "$out/proto-keys-as-rows-$day.json" 2>&1 |
      grep "^h=" || rc=1
    python3 -P benchmarks/proto_gqa_keys_as_rows.py --heads 32,64 --kv int8,fp8e4m3 \
      --splits 1,2 --bufs 3 --json "$out/proto-gqa-keys-as-rows-$day.json" 2>&1 |
      grep "^h=" || rc=1
    ;;
  exec)
    shift
    [ "${1:-}" = "--" ] && shift
    [ $# -gt 0 ] || { echo "usage: $0 exec -- COMMAND..." >&2; exit 2; }
    "$@" 2>&1 | tee "$out/exec-$day.txt" | tail -n 60 || rc=1
    ;;
  *)
    echo "usage: $0 tests [K/N]|fuzz [N]|bench|tune [seconds]|tune-start [seconds]|tune-wait|" \
      "compare B [A]|family F [NAME...]|" \
      "ab TAR[,TAR...] [N] -- ARGS...|protos|exec -- COMMAND..." >&2
    exit 2
    ;;
esac
exit $rc
