#!/usr/bin/env bash
# Builds the fuzz targets with clang-16, libFuzzer, ASan and UBSan (in
# build-fuzz/, apart from the regular build) and runs each for SECONDS.
#   tests/fuzz/run.sh [SECONDS] [TARGET...]     SECONDS default 60; TARGETs: header attend_stream npy metrics_http
# Environment: PLSH_FUZZ_RUNS=N also stops each target after N inputs;
# PLSH_FUZZ_BUILD_DIR (build-fuzz); PLSH_JOBS (nproc): compile jobs, and how many
# targets run at once.
# Each target starts from the committed seeds (tests/fuzz/corpus/NAME, read
# only) and the corpus it grew before (BUILD_DIR/corpus/NAME). A crash, a
# leak, a sanitizer report, a failed PLSH_FUZZ_CHECK, a 30 s input or 2 GiB of
# RSS stops the target, leaves the input in BUILD_DIR/artifacts/NAME/ and
# makes the script exit 1. The last lines are one row per target (execs,
# coverage, corpus) and a "fuzz: N passed, M failed" tally.
set -euo pipefail
cd "$(dirname "$0")/../.."

seconds=${1:-60}
shift || true
targets=("$@")
[ ${#targets[@]} -gt 0 ] || targets=(header attend_stream npy metrics_http)
build_dir=${PLSH_FUZZ_BUILD_DIR:-build-fuzz}
jobs=${PLSH_JOBS:-$(nproc)}

# ASan and UBSan on every library (libFuzzer's coverage too: fuzzer-no-link),
# so that a bad read anywhere below a target is a crash; recovery off, so
# that UBSan's findings stop the run like ASan's.
sanitize="-fsanitize=address,undefined,fuzzer-no-link -fno-sanitize-recover=all -fno-omit-frame-pointer"
# Line tables only (as OSS-Fuzz builds): a report's stack still names every
# function, file and line, and the build takes 164 s instead of 196 s on 2
# cores (2026-12-06), the full debug information being most of the rest.
launcher=()
command -v ccache >/dev/null 2>&1 && launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache -DCMAKE_C_COMPILER_LAUNCHER=ccache)
cmake -S . -B "$build_dir" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DCMAKE_C_COMPILER=clang-16 -DCMAKE_CXX_COMPILER=clang++-16 "${launcher[@]}" \
  -DCMAKE_C_FLAGS="$sanitize" -DCMAKE_CXX_FLAGS="$sanitize" \
  -DCMAKE_C_FLAGS_RELWITHDEBINFO="-O2 -gline-tables-only -DNDEBUG" -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O2 -gline-tables-only -DNDEBUG" \
  -DPLSH_FUZZ=ON -DPLSH_WITH_CUDA=OFF >/dev/null
cmake --build "$build_dir" -j"$jobs" --target plsh_fuzz

export ASAN_OPTIONS=${ASAN_OPTIONS:-abort_on_error=1:detect_stack_use_after_return=1:strict_string_checks=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1}

# Options of each target (and an unknown name refused before any runs).
target_args() {  # target -> seeds and extra, for the caller
  case "$1" in
    header) seeds=header; extra=() ;;
    attend_stream) seeds=stream; extra=(-max_len=16384) ;;
    npy) seeds=npy; extra=(-dict=tests/fuzz/dict/npy.dict) ;;
    metrics_http) seeds=metrics_http; extra=(-dict=tests/fuzz/dict/http.dict -max_len=40000) ;;
    *) echo "run.sh: unknown target '$1'" >&2; exit 2 ;;
  esac
  [ -n "${PLSH_FUZZ_RUNS:-}" ] && extra+=(-runs="$PLSH_FUZZ_RUNS")
  return 0
}
for t in "${targets[@]}"; do target_args "$t"; done

# The targets run side by side, PLSH_JOBS (nproc) at a time: each is one
# process on one core, so on 2 cores the step takes half as long. Each
# writes its exit status beside its log.
pids=()
for t in "${targets[@]}"; do
  target_args "$t"
  work="$build_dir/corpus/$t"
  artifacts="$build_dir/artifacts/$t"
  log="$build_dir/fuzz-$t.log"
  mkdir -p "$work" "$artifacts"
  rm -f "$log.rc"
  echo "fuzz_$t: ${seconds} s${PLSH_FUZZ_RUNS:+ or $PLSH_FUZZ_RUNS inputs}, log $log"
  (
    rc=0
    "$build_dir/bin/fuzz_$t" "$work" "tests/fuzz/corpus/$seeds" -max_total_time="$seconds" -timeout=30 \
      -rss_limit_mb=2048 -print_final_stats=1 -artifact_prefix="$artifacts/" "${extra[@]}" >"$log" 2>&1 || rc=$?
    echo "$rc" >"$log.rc"
  ) &
  pids+=($!)
  if [ ${#pids[@]} -ge "$jobs" ]; then
    wait "${pids[0]}"
    pids=("${pids[@]:1}")
  fi
done
wait

passed=0
failed=0
rows=()
for t in "${targets[@]}"; do
  artifacts="$build_dir/artifacts/$t"
  log="$build_dir/fuzz-$t.log"
  rc=$(cat "$log.rc" 2>/dev/null || echo 1)
  execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -1)
  speed=$(sed -n 's/^stat::average_exec_per_sec: *//p' "$log" | tail -1)
  last=$(grep -E '^#[0-9]+' "$log" | tail -1 || true)
  cov=$(sed -n 's/.* cov: \([0-9]*\).*/\1/p' <<<"$last")
  ft=$(sed -n 's/.* ft: \([0-9]*\).*/\1/p' <<<"$last")
  corp=$(sed -n 's/.* corp: \([0-9]*\/[0-9]*[a-zA-Z]*\).*/\1/p' <<<"$last")
  if [ "$rc" -eq 0 ]; then
    passed=$((passed + 1))
    status=ok
  else
    failed=$((failed + 1))
    status="FAILED (exit $rc)"
    echo "---- fuzz_$t failed; the end of $log:" >&2
    tail -60 "$log" >&2
    echo "---- reproduce: $build_dir/bin/fuzz_$t $(ls -t "$artifacts"/* 2>/dev/null | head -1)" >&2
  fi
  rows+=("$(printf '%-14s %10s execs %7s/s  cov %5s  ft %6s  corpus %-12s %s' "$t" "${execs:-?}" "${speed:-?}" \
    "${cov:-?}" "${ft:-?}" "${corp:-?}" "$status")")
done
echo "fuzz summary (${seconds} s per target, $(date -u +%Y-%m-%dT%H:%MZ)):"
printf '  %s\n' "${rows[@]}"
echo "fuzz: $passed passed, $failed failed"
[ "$failed" -eq 0 ]
