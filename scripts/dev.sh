#!/usr/bin/env bash
# plsh's entry points for a fresh Debian 12 machine:
#   scripts/dev.sh run    install packages, build, start plsh-server
#   scripts/dev.sh test   install packages, build, run every test; then every
#                         test again under ASan + UBSan (build-asan/) and a
#                         30 s soak of that build's server, then each fuzz
#                         target for 30 s (build-fuzz/)
#   scripts/dev.sh asan   install packages, the ASan + UBSan step alone
#   scripts/dev.sh fuzz [SECONDS [TARGET...]]   the fuzz step alone (tests/fuzz/run.sh)
# Extra arguments after `run` go to the server. For `test`: PLSH_SANITIZE=0
# leaves out the sanitizer step, PLSH_FUZZ_SECONDS=N runs each fuzz target N
# seconds (0: not at all).
set -euo pipefail
cd "$(dirname "$0")/.."

what=${1:-run}
shift || true
jobs=${PLSH_JOBS:-$(nproc)}
build_dir=${PLSH_BUILD_DIR:-build}

asan_dir=${PLSH_ASAN_BUILD_DIR:-build-asan}
fuzz_seconds=${PLSH_FUZZ_SECONDS:-30}

# ctest's closing line in a log ("100% tests passed, 0 tests failed out of
# 313") as "313 passed, 0 failed"; a log without one counts as a failure.
ctest_tally() {
  local line
  line=$(grep -E '^[0-9]+% tests passed, [0-9]+ tests? failed out of [0-9]+$' "$1" | tail -1) || true
  if [ -z "$line" ]; then
    echo "0 passed, 1 failed"
    return
  fi
  read -r failed total < <(sed -E 's/.* ([0-9]+) tests? failed out of ([0-9]+)$/\1 \2/' <<<"$line")
  echo "$((total - failed)) passed, $failed failed"
}

# Every test again, built by GCC with AddressSanitizer (leaks included) and
# UndefinedBehaviorSanitizer, without recovery: any report fails its test.
# The integration and Python tests start this build's plsh-server. Not the
# image test: it builds the image from the sources with podman, whatever the
# build directory, so it would only repeat the first step's. Nor the static
# checks (label lint: mypy, flake8), which read sources, not binaries.
sanitizer_tests() {
  local flags="-fsanitize=address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer -g1"
  # -O1, not Release's -O3 (ASan's own advice for a tested build): on 2
  # cores the build took 723 s instead of 1297 s and its tests 559 s instead
  # of 479 s (2026-12-06), 8 minutes less in all. No bench/ programs: no test
  # runs them, and they cost a minute of the build.
  cmake -S . -B "$asan_dir" -G Ninja -DCMAKE_BUILD_TYPE=Release -DPLSH_WITH_CUDA=OFF -DPLSH_BUILD_BENCH=OFF \
    -DCMAKE_C_FLAGS="$flags" -DCMAKE_CXX_FLAGS="$flags" \
    -DCMAKE_C_FLAGS_RELEASE="-O1 -DNDEBUG" -DCMAKE_CXX_FLAGS_RELEASE="-O1 -DNDEBUG" >/dev/null
  cmake --build "$asan_dir" -j"$jobs"
  ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1:strict_string_checks=1:detect_stack_use_after_return=1:check_initialization_order=1} \
  UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1} \
    ctest --test-dir "$asan_dir" --output-on-failure -j"$jobs" --timeout 900 -LE 'image|lint' 2>&1 | tee "$asan_dir/ctest.log"
}

# 30 s of bench/soak.py's mixed load (valid requests of every mode checked
# against NumPy, malformed streams, cancels, stalled and non-reading clients)
# on the sanitizer build's plsh-server, which must exit 0 (LeakSanitizer
# included) at the end. RSS is not checked: ASan's quarantine holds freed memory.
sanitizer_soak() {
  ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1} /usr/bin/python3 bench/soak.py --duration 30 --concurrency 8 \
    --server "$asan_dir/bin/plsh-server" --no-rss-check 2>&1 | tee "$asan_dir/soak.log"
}

bash scripts/setup.sh
case "$what" in
  fuzz) exec tests/fuzz/run.sh "$@" ;;
  asan)
    sanitizer_tests
    sanitizer_soak
    echo "sanitizers: $(ctest_tally "$asan_dir/ctest.log")"
    tail -1 "$asan_dir/soak.log"
    exit 0
    ;;
esac

cmake -S . -B "$build_dir" -G Ninja -DCMAKE_BUILD_TYPE=Release
cmake --build "$build_dir" -j"$jobs"

case "$what" in
  run)
    # The service: on the GPU when build/lib/libplsh_cuda.so finds one, on
    # the CPU otherwise. Extra arguments go to plsh-server (--listen, ...).
    cat >&2 <<EOF
plsh-server is starting (gRPC 127.0.0.1:50051, metrics http://127.0.0.1:9464/metrics
unless --listen / --metrics-listen say otherwise). From another shell:
  $build_dir/bin/plsh health --target 127.0.0.1:50051
  $build_dir/bin/plsh info   --target 127.0.0.1:50051
  $build_dir/bin/plsh attend --target 127.0.0.1:50051 --q q.npy --k k.npy --v v.npy \\
      --mode lsh --samples 64 --causal --out out.npy --meta meta.json
  PYTHONPATH=client/python:$build_dir/python /usr/bin/python3 -c 'import numpy as np; from plsh_client import Client; x = np.random.randn(1, 4096, 8, 64).astype(np.float32); out, meta = Client("127.0.0.1:50051").attend(x, x, x, mode="lsh", samples=64, causal=True); print(meta["summary"])'
Ctrl-C (or SIGTERM) finishes the requests in flight, then stops it.
EOF
    exec "$build_dir/bin/plsh-server" "$@"
    ;;
  test)
    # Steps stop at the first failure (set -e, pipefail); each tallies its
    # tests, and the last line adds them up.
    step=$SECONDS
    ctest --test-dir "$build_dir" --output-on-failure -j"$jobs" --timeout 900 2>&1 | tee "$build_dir/ctest.log"
    tallies=("tests: $(ctest_tally "$build_dir/ctest.log") ($build_dir, ctest $((SECONDS - step)) s)")
    if [ "${PLSH_SANITIZE:-1}" != 0 ]; then
      step=$SECONDS
      sanitizer_tests
      tallies+=("sanitizers: $(ctest_tally "$asan_dir/ctest.log") ($asan_dir, ASan + UBSan, $((SECONDS - step)) s with the build)")
      step=$SECONDS
      sanitizer_soak
      tallies+=("$(tail -1 "$asan_dir/soak.log") (bench/soak.py 30 s on the sanitizer build, $((SECONDS - step)) s)")
    fi
    if [ "$fuzz_seconds" != 0 ]; then
      step=$SECONDS
      tests/fuzz/run.sh "$fuzz_seconds" 2>&1 | tee "$build_dir/fuzz.log"
      tallies+=("$(tail -1 "$build_dir/fuzz.log") (libFuzzer, $fuzz_seconds s per target, $((SECONDS - step)) s with the build)")
    fi
    printf '%s\n' "${tallies[@]}"
    passed=0
    failed=0
    for t in "${tallies[@]}"; do
      read -r p f < <(sed -E 's/^[a-z]+: ([0-9]+) passed, ([0-9]+) failed.*/\1 \2/' <<<"$t")
      passed=$((passed + p))
      failed=$((failed + f))
    done
    echo "all: $passed passed, $failed failed"
    [ "$failed" -eq 0 ]
    ;;
  *)
    echo "usage: scripts/dev.sh run|test|asan|fuzz" >&2
    exit 2
    ;;
esac
