#!/usr/bin/env bash
# One command on a machine with an NVIDIA GPU, CMake and PyTorch: builds the
# kernels-only tree, runs the CUDA backend's tests (compute-sanitizer on a
# small case), then benchmarks it against PyTorch FlexAttention on the same
# GPU, 128k first. Made so that a first device call takes at most 420 s
# (the machine's start is extra) and a second still fits a 15-minute lease:
#
#   bash bench/gpu/run.sh OUTDIR [TOTAL_SECONDS]      (default 420, or $PLSH_GPU_BUDGET_SECONDS)
#
# On the device tool's machine, which has no GoogleTest and no CBLAS, first
# run bench/gpu/prepare_carry.sh here and carry .gtest and .blas:
#   run(command="bash bench/gpu/run.sh $OUT", carry=[".gtest", ".blas"], timeout_s=450)
#
# Phases, in the order that answers most first, each inside its share of
# TOTAL_SECONDS (T; the figures for T = 420):
#   1. setup and build              ends by 2T/5 (168 s); cut off there
#   2. tests                        at most T/14 (30 s): host emulation, unit
#                                   (injected CUDA errors), registry, GPU tests
#                                   without the context-killing ones; a GPU test
#                                   that did not pass runs again alone, to tell
#                                   its own failure from a dead context's
#   3. compute-sanitizer memcheck   at most T/16 (26 s), on a small fused and a
#                                   small cuBLAS case
#   4. benchmark (peers.py)         until T - T/28 (405 s): N = 131072 first,
#                                   then 8192, 32768, 524288 while they fit;
#                                   ours forward and backward (fused lsh,
#                                   per-sample lsh, window, exact), lsh with its
#                                   estimates, FlexAttention exact, window and
#                                   per-sample lsh, and issue 19's goals
#   5. the tail, while time is left: context-killing GPU tests (gtest names
#      matching $PLSH_GPU_KILLING_FILTER, which must match at least one),
#      each in its own process; then racecheck and initcheck
# A phase that cannot run (no time left, no GPU, nothing built) is skipped and
# the reason written down; a later phase never borrows from an earlier one.
#
# OUTDIR gets four files (the device tool brings back at most 8, 2 folders
# down): run.log (everything printed, tests and sanitizer included), build.log
# (the compiler's output), results.md (the phases, then the benchmark table,
# rewritten after every phase and every benchmark case, so a timeout keeps
# what was done) and results.json (the benchmark's figures). Exit status:
# non-zero when something that should have run did not pass (no GPU included).
#
# Rehearsal without a GPU (every step up to the device call):
#   bash bench/gpu/prepare_carry.sh && bash bench/gpu/run.sh /tmp/gpurehearsal
# builds with the carried pieces only, runs the tests (GPU ones skip, saying
# why) and lets peers.py fail gracefully. These make it go further:
#   PLSH_GPU_REHEARSE=1       run every phase's commands although no GPU is seen
#   PLSH_GPU_SANITIZER=PATH   another compute-sanitizer (a stand-in that runs its command)
#   PLSH_GPU_PEERS_ARGS=...   more peers.py arguments, e.g. "--dry-run"
#   PLSH_GPU_SKIP_BUILD=1     test and time what the build folder already holds
# Other knobs: PLSH_GPU_SIZES, PLSH_GPU_KILLING_FILTER, PLSH_GPU_SANITIZER_FILTER,
# PLSH_GPU_BUILD_DIR, PLSH_GPU_WORK, PLSH_GPU_PYTHON, PLSH_CUDA_MEMORY_MB.
set -uo pipefail
out=${1:?usage: bash bench/gpu/run.sh OUTDIR [TOTAL_SECONDS]}
total=${2:-${PLSH_GPU_BUDGET_SECONDS:-420}}
cd "$(dirname "$0")/../.." || exit 2
mkdir -p "$out"
out=$(cd "$out" && pwd)
# Scratch (q/k/v files, notes), this run's own: two runs on one machine must
# not delete each other's. Removed at the end.
if [ -n "${PLSH_GPU_WORK:-}" ]; then
  work=$PLSH_GPU_WORK
  rm -rf "$work"
  mkdir -p "$work"
else
  work=$(mktemp -d "${TMPDIR:-/tmp}/plsh-gpu.XXXXXX")
fi
rm -f "$out/run.log" "$out/build.log" "$out/results.md" "$out/results.json"  # no figures from an earlier run
exec > >(tee "$out/run.log") 2>&1
tee_pid=$!
SECONDS=0
build_end=$((total * 2 / 5))
tests_slice=$((total / 14))
sanitizer_slice=$((total / 16))
bench_end=$((total - total / 28))
jobs=$(nproc)
build=${PLSH_GPU_BUILD_DIR:-build-gpu}
mkdir -p "$build"
gtest_prefix=$(cd "$build" && pwd)/_gtest  # beside the build that links it, kept with it
# The tests that fault on purpose (a device fault in a child process):
# kept out of the main run and the sanitizers, run alone in the tail.
killing=${PLSH_GPU_KILLING_FILTER:-*DeathTest*}
small=${PLSH_GPU_SANITIZER_FILTER:-Cases/FusedOnDevice.ForwardMatchesReferenceAndHostEmulation/lsh_causal_gqa_bf16_d64:Cases/FusedBackwardOnDevice.MatchesFloat64Autograd/window_causal_gqa_bf16_d128:Cases/CudaVsCpu.MatchesCpuBackendAndReference/exact_causal_decode_f32:CudaBins.*}
status=0

step() { echo; echo "== [${SECONDS} s of ${total}] $*"; }

# results.md = this header and phase table, then peers.py's section.
{
  echo "# plsh GPU run (bench/gpu/run.sh)"
  echo
  if commit=$(git rev-parse --short HEAD 2>/dev/null); then
    git diff --quiet HEAD 2>/dev/null || commit="$commit with uncommitted changes"
  else
    commit="${PLSH_GPU_COMMIT:-unknown (no git checkout here; set PLSH_GPU_COMMIT)}"
  fi
  echo "Commit $commit;" \
       "started $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(hostname); budget ${total} s" \
       "(build until ${build_end} s, tests ${tests_slice} s, memcheck ${sanitizer_slice} s, benchmark until ${bench_end} s, then the tail)."
} >"$work/header.md"
printf '| phase | status | s | detail |\n|---|---|---|---|\n' >"$work/phases.md"
publish() {
  cat "$work/header.md" >"$work/preamble.md"
  echo >>"$work/preamble.md"
  cat "$work/phases.md" >>"$work/preamble.md"
  cp "$work/preamble.md" "$work/results.md"
  if [ -f "$work/bench/bench_section.md" ]; then
    echo >>"$work/results.md"
    cat "$work/bench/bench_section.md" >>"$work/results.md"
  fi
  mv "$work/results.md" "$out/results.md"  # whole, never half-written: a timeout can strike at any time
}
# phase NAME STATUS SECONDS DETAIL: one row of the table, published at once.
phase() {
  echo "-- phase $1: $2 ($3 s) $4"
  printf '| %s | %s | %s | %s |\n' "$1" "$2" "$3" "$(echo "$4" | tr '|\n' '/ ')" >>"$work/phases.md"
  publish
}
# capped DEADLINE CAP CMD...: CMD under a timeout of min(CAP, DEADLINE - now); 124 on timeout, 125 when no time is left.
capped() {
  local t=$(($1 - SECONDS))
  [ "$t" -gt "$2" ] && t=$2
  shift 2
  if [ "$t" -lt 5 ]; then echo "(no time left for: $*)"; return 125; fi
  timeout -k 5 "$t" "$@"
}
publish

step "device"
t=$SECONDS
gpu=""
if command -v nvidia-smi >/dev/null 2>&1; then
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv || true
  gpu=$(nvidia-smi -L 2>/dev/null | grep -m1 '^GPU' || true)
fi
[ -z "$gpu" ] && [ -e /dev/nvidia0 ] && gpu="/dev/nvidia0 (nvidia-smi found none)"
# Rehearsal on a machine without a GPU: run every phase's commands anyway.
[ -z "$gpu" ] && [ "${PLSH_GPU_REHEARSE:-0}" = 1 ] && gpu="none (PLSH_GPU_REHEARSE=1: every phase runs regardless)"
nvcc=$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)
"$nvcc" --version | tail -2
cmake --version | head -1
python=${PLSH_GPU_PYTHON:-$(command -v python3)}
echo "python: $python ($("$python" --version 2>&1))"
echo "cores: $jobs"
if [ -n "$gpu" ]; then
  phase device ok $((SECONDS - t)) "$gpu; $("$nvcc" --version | tail -1)"
else
  phase device "NO GPU" $((SECONDS - t)) "nvidia-smi found no GPU: the GPU tests will skip and the benchmark cannot run; $("$nvcc" --version | tail -1)"
fi

step "setup and build (kernels only, sm_90); cut off at ${build_end} s"
t=$SECONDS
generator=Ninja
command -v ninja >/dev/null 2>&1 || generator="Unix Makefiles"
keep_going=(-k 0)
[ "$generator" = Ninja ] || keep_going=(-k)
launcher=()
command -v ccache >/dev/null 2>&1 && launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache -DCMAKE_CUDA_COMPILER_LAUNCHER=ccache)
prefix=()
extra=()
: >"$out/build.log"
# PLSH_GPU_SKIP_BUILD=1: test and time what $build already holds (a second
# call on a machine still warm from the first, or a rehearsal).
reuse=${PLSH_GPU_SKIP_BUILD:-0}
# GoogleTest: the carried sources built here (once per build folder), else the system's.
if [ -f "$gtest_prefix/lib/cmake/GTest/GTestConfig.cmake" ]; then
  echo "GoogleTest from .gtest, built before: $gtest_prefix"
  prefix+=("$gtest_prefix")
elif [ -f .gtest/CMakeLists.txt ] && [ "$reuse" != 1 ]; then
  echo "GoogleTest from .gtest"
  # POLICY_VERSION_MINIMUM: GoogleTest 1.12 asks for CMake 3.5, which CMake 4 only takes with it.
  { capped "$build_end" 300 cmake -S .gtest -B "$gtest_prefix-build" -G "$generator" -DCMAKE_BUILD_TYPE=Release \
      -DCMAKE_INSTALL_PREFIX="$gtest_prefix" -DCMAKE_POSITION_INDEPENDENT_CODE=ON -DCMAKE_POLICY_VERSION_MINIMUM=3.5 \
      "${launcher[@]}" &&
    capped "$build_end" 300 cmake --build "$gtest_prefix-build" -j"$jobs" &&
    capped "$build_end" 60 cmake --install "$gtest_prefix-build"; } >>"$out/build.log" 2>&1 ||
    { tail -20 "$out/build.log"; echo "GoogleTest build failed"; }
  prefix+=("$gtest_prefix")
fi
# CBLAS: the CPU backend has needed none since its products became its own
# kernels (issue 23), so CMake no longer looks for one in a kernels-only
# build; a carried .blas is still put on the paths (an older checkout's
# build wants it) and is otherwise unused.
if [ -d .blas ]; then
  prefix+=("$PWD/.blas")
  extra+=(-DBLA_VENDOR=Generic -DCMAKE_DISABLE_FIND_PACKAGE_PkgConfig=ON)
  export CPATH="$PWD/.blas/include${CPATH:+:$CPATH}"
  export LD_LIBRARY_PATH="$PWD/.blas/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi
# cuBLAS: the toolkit's, else (untested lead) the one PyTorch's wheels carry.
cuda_root=$(dirname "$(dirname "$(readlink -f "$nvcc")")")
# shellcheck disable=SC2012  # the first match of three globs; library names are plain
cublas_lib=$(ls "$cuda_root"/lib64/libcublas.so* "$cuda_root"/lib/libcublas.so* "$cuda_root"/targets/*/lib/libcublas.so* 2>/dev/null | head -1)
if [ -z "$cublas_lib" ]; then
  wheel=$("$python" -c 'import glob, os, site
for d in site.getsitepackages():
    for lib in sorted(glob.glob(os.path.join(d, "nvidia", "*", "lib", "libcublas.so*"))):
        print(os.path.dirname(os.path.dirname(lib))); raise SystemExit' 2>/dev/null || true)
  echo "no libcublas under $cuda_root; wheel candidate: ${wheel:-none}"
  if [ -n "$wheel" ]; then
    mkdir -p "$work/cublas/lib"
    for f in "$wheel"/lib/libcublas*.so.*; do ln -sf "$f" "$work/cublas/lib/$(basename "$f" | sed 's/\.so\..*/.so/')"; done
    prefix+=("$work/cublas")
    export CPATH="$wheel/include${CPATH:+:$CPATH}"
    export LD_LIBRARY_PATH="$wheel/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  fi
fi
prefix_path=$(IFS=';'; echo "${prefix[*]:-}")
targets=(plsh_cuda plsh_cuda_host_tests plsh_cuda_unit_tests plsh_cuda_registry_tests plsh_cuda_gpu_tests bench_cuda)
if [ "$reuse" = 1 ]; then
  echo "PLSH_GPU_SKIP_BUILD=1: not building; using $build as it is" | tee -a "$out/build.log"
  true
else
  capped "$build_end" 600 cmake -S . -B "$build" -G "$generator" -DCMAKE_BUILD_TYPE=Release -DPLSH_KERNELS_ONLY=ON \
    -DCMAKE_CUDA_COMPILER="$nvcc" -DCMAKE_CUDA_ARCHITECTURES=90 ${prefix_path:+-DCMAKE_PREFIX_PATH="$prefix_path"} \
    "${extra[@]}" "${launcher[@]}" >>"$out/build.log" 2>&1
fi
configured=$?
built=1
# Which GoogleTest and BLAS CMake took: with the carry, they must be the carried ones.
gtest_dir=$(sed -n 's/^GTest_DIR:PATH=//p' "$build/CMakeCache.txt" 2>/dev/null)
blas_lib=$(sed -n 's/^BLAS_[A-Za-z0-9_]*_LIBRARY:FILEPATH=//p' "$build/CMakeCache.txt" 2>/dev/null | head -1)
if [ "$reuse" = 1 ]; then
  built=0
elif [ "$configured" = 0 ]; then
  grep -E "plsh: CUDA backend|Found (BLAS|GTest)" "$out/build.log"
  echo "GoogleTest: ${gtest_dir:-?}; BLAS: ${blas_lib:-none (the kernels need none)}"
  [ -f .gtest/CMakeLists.txt ] && case "$gtest_dir" in "$gtest_prefix"*) ;; *) echo "WARNING: not the carried GoogleTest";; esac
  [ -d .blas ] && [ -n "$blas_lib" ] && case "$blas_lib" in "$PWD/.blas/"*) ;; *) echo "WARNING: not the carried BLAS";; esac
  capped "$build_end" 600 cmake --build "$build" --target "${targets[@]}" -j"$jobs" -- "${keep_going[@]}" >>"$out/build.log" 2>&1
  built=$?
fi
bin="$build/bin"
missing=()
for t_ in "${targets[@]}"; do
  case "$t_" in plsh_cuda) f="$build/lib/libplsh_cuda.so" ;; *) f="$bin/$t_" ;; esac
  # After a failed or cut-off build, a file left by an earlier build is stale
  # unless the build tool says the target is up to date: remove it, so that no
  # later phase tests or times old code.
  if [ -e "$f" ] && { [ "$configured" != 0 ] || [ "$built" != 0 ]; }; then
    if [ "$generator" = Ninja ]; then
      ninja -C "$build" -n "$t_" 2>/dev/null | grep -q "no work to do" || { echo "stale, removed: $f"; rm -f "$f"; }
    else
      make -C "$build" -q "$t_" >/dev/null 2>&1 || { echo "stale, removed: $f"; rm -f "$f"; }
    fi
  fi
  [ -e "$f" ] || missing+=("$t_")
done
grep -E "warning" "$out/build.log" | grep -v "^ccache" | head -10
if [ "$configured" != 0 ] || [ "$built" != 0 ]; then
  tail -40 "$out/build.log"
  grep -q "plsh: CUDA backend ON" "$out/build.log" ||
    echo "CMake did not enable the CUDA backend (nvcc or cuBLAS not found): see 'plsh: CUDA backend' in build.log"
  why="configure exit $configured, build exit $built"
  [ "$configured" != 0 ] && why="configure exit $configured"
  case "$configured/$built" in *12[45]*) why="cut off at ${build_end} s ($why)" ;; esac
  phase build FAILED $((SECONDS - t)) "$why; not built: ${missing[*]:-none}; see build.log"
  status=1
else
  phase build "$([ "$reuse" = 1 ] && echo "reused (PLSH_GPU_SKIP_BUILD=1)" || echo ok)" $((SECONDS - t)) "GoogleTest ${gtest_dir:-?}; BLAS ${blas_lib:-?}; $(grep -m1 -o 'plsh: CUDA backend [A-Z]*' "$out/build.log")"
fi

# run_gtest NAME DEADLINE CAP BINARY ARGS...: prints the output, returns its status.
run_gtest() {
  local name=$1 deadline=$2 cap=$3 b=$4
  shift 4
  if [ ! -x "$b" ]; then echo "--- $name: not built"; return 127; fi
  echo "--- $name"
  capped "$deadline" "$cap" "$b" "$@"
  local rc=$?
  echo "--- $name exit $rc$([ "$rc" = 124 ] && echo ' (timed out)')"
  return "$rc"
}

step "tests (at most ${tests_slice} s; without $killing)"
t=$SECONDS
tests_end=$((SECONDS + tests_slice))
{
  run_gtest host "$tests_end" "$tests_slice" "$bin/plsh_cuda_host_tests" --gtest_brief=1
  echo "host=$?" >"$work/tests.rc"
  run_gtest unit "$tests_end" "$tests_slice" "$bin/plsh_cuda_unit_tests" --gtest_brief=1
  echo "unit=$?" >>"$work/tests.rc"
  run_gtest registry "$tests_end" "$tests_slice" "$bin/plsh_cuda_registry_tests" --gtest_brief=1
  echo "registry=$?" >>"$work/tests.rc"
  # Not brief: the OK lines say which tests passed if the process dies.
  run_gtest gpu "$tests_end" "$tests_slice" "$bin/plsh_cuda_gpu_tests" --gtest_filter="-$killing"
  echo "gpu=$?" >>"$work/tests.rc"
} 2>&1 | tee "$work/tests.log"
summary=$(tr '\n' ' ' <"$work/tests.rc")
passed=$(grep -hoE '^\[  PASSED  \] [0-9]+' "$work/tests.log" | awk '{s += $4} END {print s + 0}')
failed=$(grep -oE '^\[  FAILED  \] [A-Za-z][^ ]*' "$work/tests.log" | sort -u | wc -l)
skipped=$(grep -hoE '^\[  SKIPPED \] [0-9]+ tests?' "$work/tests.log" | awk '{s += $4} END {print s + 0}')
detail="exit codes (127: not built): ${summary}; ${passed} passed, ${failed} failed, ${skipped} skipped"
if [ "$skipped" != 0 ]; then
  detail="$detail; skipped because: $(grep -m1 -oE 'no CUDA device[^[]*' "$work/tests.log" | head -c 160)"
fi
# A test that kills the CUDA context (a misaligned operand, an illegal
# address) fails every later test of its process, or ends the process. Each
# GPU test that did not pass (or never reported) runs again alone, to tell its
# own failure from the collateral ones.
if ! grep -qx 'gpu=0' "$work/tests.rc" && [ -x "$bin/plsh_cuda_gpu_tests" ]; then
  echo "--- GPU tests that did not pass, each again in its own process (until ${tests_end} s)"
  mapfile -t listed < <("$bin/plsh_cuda_gpu_tests" --gtest_list_tests --gtest_filter="-$killing" 2>/dev/null |
    awk '/^[^ ]/ {suite = $1} /^  / {print suite $1}')
  grep -oE '^\[ +(OK|SKIPPED) +\] [^ ]+' "$work/tests.log" | awk '{print $NF}' | sort -u >"$work/tests.ok"
  alone_ok=0
  alone_failed=()
  not_rerun=0
  for name in "${listed[@]}"; do
    grep -qxF "$name" "$work/tests.ok" && continue
    if [ $((tests_end - SECONDS)) -lt 5 ]; then not_rerun=$((not_rerun + 1)); continue; fi
    if run_gtest "alone: $name" "$tests_end" 30 "$bin/plsh_cuda_gpu_tests" --gtest_brief=1 --gtest_filter="$name"; then
      alone_ok=$((alone_ok + 1))
    else
      alone_failed+=("$name")
    fi
  done
  detail="$detail; again alone: ${alone_ok} passed (collateral failures), ${#alone_failed[@]} failed (${alone_failed[*]:-none}), ${not_rerun} not rerun (time)"
fi
if grep -qvE '=0$' "$work/tests.rc" || [ "$failed" != 0 ]; then
  phase tests FAILED $((SECONDS - t)) "$detail"
  status=1
elif [ "$skipped" != 0 ]; then
  phase tests "SKIPPED (no GPU)" $((SECONDS - t)) "$detail"
  status=1
else
  phase tests ok $((SECONDS - t)) "$detail"
fi

# shellcheck disable=SC2012  # the first of a few fixed paths
sanitizer=${PLSH_GPU_SANITIZER:-$(command -v compute-sanitizer ||
  ls /usr/local/cuda/bin/compute-sanitizer /usr/local/cuda/compute-sanitizer/compute-sanitizer \
     /opt/nvidia/*/compute-sanitizer/compute-sanitizer 2>/dev/null | head -1)}
# sanitize TOOL DEADLINE CAP: the small case under one compute-sanitizer tool.
sanitize() {
  local tool=$1 t=$SECONDS
  if [ -z "$gpu" ]; then phase "$tool" skipped 0 "no GPU"; return; fi
  if [ -z "$sanitizer" ]; then phase "$tool" skipped 0 "compute-sanitizer not found"; return; fi
  if [ ! -x "$bin/plsh_cuda_gpu_tests" ]; then phase "$tool" skipped 0 "plsh_cuda_gpu_tests not built"; return; fi
  echo "--- $tool on $small"
  capped "$2" "$3" "$sanitizer" --tool "$tool" --error-exitcode 17 "$bin/plsh_cuda_gpu_tests" \
    --gtest_filter="$small:-$killing" --gtest_brief=1 2>&1 | tee "$work/$tool.log"
  local rc=${PIPESTATUS[0]}
  local errors
  errors=$(grep -m1 -oE 'ERROR SUMMARY: [0-9]+ errors?' "$work/$tool.log" || echo "no summary")
  errors="$errors; $(grep -m1 -oE '^\[==========\] [0-9]+ tests?' "$work/$tool.log" | sed 's/^.* \([0-9]*\) test.*/\1/') tests ran"
  # Test names change: a filter that matches nothing must not read as a clean run.
  if grep -qE '^\[==========\] 0 tests' "$work/$tool.log"; then
    phase "$tool" "RAN NO TEST" $((SECONDS - t)) "the filter $small matches no test"
    status=1
    return
  fi
  case "$rc" in
    0) phase "$tool" ok $((SECONDS - t)) "$errors" ;;
    124) phase "$tool" "TIMED OUT" $((SECONDS - t)) "after ${3} s cap or deadline; $errors"; status=1 ;;
    125) phase "$tool" skipped 0 "no time left" ;;
    *) phase "$tool" FAILED $((SECONDS - t)) "exit $rc (17 means errors found); $errors"; status=1 ;;
  esac
}

step "compute-sanitizer memcheck on a small case (at most ${sanitizer_slice} s)"
sanitize memcheck $((SECONDS + sanitizer_slice)) "$sanitizer_slice"

step "benchmark against FlexAttention until ${bench_end} s (131072 first)"
t=$SECONDS
bench_budget=$((bench_end - SECONDS - 12))  # 12: peers.py's grace and its last write
if [ "$bench_budget" -lt 30 ]; then
  phase benchmark skipped 0 "only ${bench_budget} s left for it"
else
  # The backend's memory budget: leave the rest of the card to PyTorch.
  export PLSH_CUDA_MEMORY_MB=${PLSH_CUDA_MEMORY_MB:-40000}
  # shellcheck disable=SC2086  # PLSH_GPU_PEERS_ARGS is word-split on purpose
  PYTHONUNBUFFERED=1 timeout -k 5 $((bench_budget + 12)) "$python" bench/gpu/peers.py \
    --bench-bin "$bin/bench_cuda" --out "$out" --work "$work/bench" --preamble "$work/preamble.md" \
    --sizes "${PLSH_GPU_SIZES:-131072,8192,32768,524288}" --budget-seconds "$bench_budget" --grace-seconds 8 \
    ${PLSH_GPU_PEERS_ARGS:-}  # e.g. "--dry-run" to rehearse without torch; word-split on purpose
  rc=$?
  bench_status=$(sed -n 's/^Status: \*\*\(.*\)\*\* after.*/\1/p' "$work/bench/bench_section.md" 2>/dev/null | head -c 200)
  case "$rc" in
    0) phase benchmark ok $((SECONDS - t)) "${bench_status:-?}" ;;
    2) phase benchmark "NOT RUN" $((SECONDS - t)) "${bench_status:-peers.py exit 2}"; status=1 ;;
    *) phase benchmark "FAILED (exit $rc)" $((SECONDS - t)) "${bench_status:-no results.md from peers.py}"; status=1 ;;
  esac
  grep -q "DIFFER" "$out/results.md" 2>/dev/null && { echo "SLOPES DIFFER between Python and C++: see results.md"; status=1; }
fi

step "tail: context-killing tests ($killing), each in its own process, then racecheck and initcheck"
t=$SECONDS
if [ -z "$gpu" ]; then
  phase context-killing skipped 0 "no GPU"
elif [ ! -x "$bin/plsh_cuda_gpu_tests" ]; then
  phase context-killing skipped 0 "plsh_cuda_gpu_tests not built"
else
  mapfile -t killers < <("$bin/plsh_cuda_gpu_tests" --gtest_list_tests --gtest_filter="$killing" |
    awk '/^[^ ]/ {suite = $1} /^  / {print suite $1}')
  if [ "${#killers[@]}" = 0 ]; then
    # The filter names tests that no longer exist: say so, do not pass quietly.
    phase context-killing "MATCHES NO TEST" 0 "no test in plsh_cuda_gpu_tests matches $killing"
    status=1
  else
    results=()
    for name in "${killers[@]}"; do
      run_gtest "$name" "$total" 20 "$bin/plsh_cuda_gpu_tests" --gtest_filter="$name"
      rc=$?
      results+=("$name=$rc")
      [ "$rc" = 0 ] || status=1
      [ "$rc" = 125 ] && break
    done
    phase context-killing "$(printf '%s\n' "${results[@]}" | grep -qv '=0$' && echo FAILED || echo ok)" \
      $((SECONDS - t)) "${#killers[@]} tests, exit codes: ${results[*]} (125: no time left)"
  fi
fi
sanitize racecheck "$total" "$sanitizer_slice"
sanitize initcheck "$total" "$sanitizer_slice"

step "done in ${SECONDS} s of ${total}, status $status"
publish
cat "$out/results.md"
ls -l "$out"
rm -rf "$work"
# Let tee write the last lines before the caller reads the output.
exec >&- 2>&-
wait "$tee_pid" 2>/dev/null || sleep 1
exit "$status"
