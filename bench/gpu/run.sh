#!/usr/bin/env bash
# One command on a machine with an NVIDIA GPU, CMake and PyTorch: builds the
# kernels-only tree, runs the CUDA backend's tests (and compute-sanitizer on a
# small case), then benchmarks it against PyTorch FlexAttention on the same
# GPU. Sized to finish within ~8 minutes on an H200.
#
#   bench/gpu/run.sh OUTDIR
#
# On the device tool's machine, which has no GoogleTest and no CBLAS, first run
# bench/gpu/prepare_carry.sh on the build machine and carry .gtest and .blas:
#   run(command="bash bench/gpu/run.sh $OUT/gpu", carry=[".gtest", ".blas"], timeout_s=600)
#
# OUTDIR gets (at most 8 files, as the device tool brings back): results.md
# (the table), ours.jsonl, peers.jsonl, build.log, tests.log, sanitizer.log,
# run.log. Exit status: non-zero when a test or the sanitizer failed; the
# benchmark runs either way, so one run says as much as it can.
set -uo pipefail
out=${1:?usage: bench/gpu/run.sh OUTDIR}
cd "$(dirname "$0")/../.."
mkdir -p "$out"
out=$(cd "$out" && pwd)
exec > >(tee "$out/run.log") 2>&1
tee_pid=$!
t0=$(date +%s)
elapsed() { echo $(($(date +%s) - t0)); }
step() { echo; echo "== [$(elapsed) s] $*"; }
status=0
jobs=$(nproc)
build=${PLSH_GPU_BUILD_DIR:-build-gpu}
total_budget=${PLSH_GPU_BUDGET_SECONDS:-470}

step "device"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv || true
nvcc=$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)
"$nvcc" --version | tail -2
cmake --version | head -1
python=$(command -v python3)
echo "python: $python"

generator=Ninja
command -v ninja >/dev/null 2>&1 || generator="Unix Makefiles"
prefix=()
blas_args=()
# GoogleTest: the system's, or the carried sources built here.
if [ -d .gtest ] && [ -f .gtest/CMakeLists.txt ]; then
  step "GoogleTest from .gtest"
  # POLICY_VERSION_MINIMUM: GoogleTest 1.12 asks for CMake 3.5, which CMake 4 only takes with it.
  cmake -S .gtest -B /tmp/plsh-gtest-build -G "$generator" -DCMAKE_BUILD_TYPE=Release \
    -DCMAKE_INSTALL_PREFIX=/tmp/plsh-gtest -DCMAKE_POSITION_INDEPENDENT_CODE=ON \
    -DCMAKE_POLICY_VERSION_MINIMUM=3.5 >/tmp/plsh-gtest.log 2>&1 &&
    cmake --build /tmp/plsh-gtest-build -j"$jobs" >>/tmp/plsh-gtest.log 2>&1 &&
    cmake --install /tmp/plsh-gtest-build >>/tmp/plsh-gtest.log 2>&1 ||
    { tail -20 /tmp/plsh-gtest.log; echo "GoogleTest build failed"; }
  prefix+=(/tmp/plsh-gtest)
fi
# CBLAS for the CPU backend (the tests' second opinion): the carried one.
if [ -d .blas ]; then
  prefix+=("$PWD/.blas")
  blas_args+=(-DBLA_VENDOR=Generic)
  export CPATH="$PWD/.blas/include${CPATH:+:$CPATH}"
  export LD_LIBRARY_PATH="$PWD/.blas/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi
# cuBLAS: the toolkit's, else (untested lead) the one PyTorch's wheels carry.
cuda_root=$(dirname "$(dirname "$(readlink -f "$nvcc")")")
cublas_lib=$(ls "$cuda_root"/lib64/libcublas.so* "$cuda_root"/lib/libcublas.so* "$cuda_root"/targets/*/lib/libcublas.so* 2>/dev/null | head -1)
if [ -z "$cublas_lib" ]; then
  wheel=$("$python" -c 'import glob, os, site
for d in site.getsitepackages():
    for lib in sorted(glob.glob(os.path.join(d, "nvidia", "*", "lib", "libcublas.so*"))):
        print(os.path.dirname(os.path.dirname(lib))); raise SystemExit' 2>/dev/null || true)
  echo "no libcublas under $cuda_root; wheel candidate: ${wheel:-none}"
  if [ -n "$wheel" ]; then
    mkdir -p /tmp/plsh-cublas/lib
    for f in "$wheel"/lib/libcublas*.so.*; do ln -sf "$f" "/tmp/plsh-cublas/lib/$(basename "$f" | sed 's/\.so\..*/.so/')"; done
    prefix+=(/tmp/plsh-cublas)
    export CPATH="$wheel/include${CPATH:+:$CPATH}"
    export LD_LIBRARY_PATH="$wheel/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  fi
fi
prefix_path=$(IFS=';'; echo "${prefix[*]:-}")

step "configure and build (kernels only, sm_90)"
targets=(plsh_cuda plsh_cuda_host_tests plsh_cuda_registry_tests plsh_cuda_gpu_tests bench_cuda)
if ! { cmake -S . -B "$build" -G "$generator" -DCMAKE_BUILD_TYPE=Release -DPLSH_KERNELS_ONLY=ON \
         -DCMAKE_CUDA_COMPILER="$nvcc" -DCMAKE_CUDA_ARCHITECTURES=90 ${prefix_path:+-DCMAKE_PREFIX_PATH="$prefix_path"} "${blas_args[@]}" &&
       cmake --build "$build" --target "${targets[@]}" -j"$jobs"; } >"$out/build.log" 2>&1; then
  tail -60 "$out/build.log"
  grep -q "plsh: CUDA backend ON" "$out/build.log" ||
    echo "CMake did not enable the CUDA backend (nvcc or cuBLAS not found): see 'plsh: CUDA backend' in build.log"
  echo "BUILD FAILED (see build.log)"
  exit 1
fi
grep -E "plsh: CUDA backend|warning" "$out/build.log" | head -20
bin="$build/bin"

step "tests"
{
  "$bin/plsh_cuda_host_tests" --gtest_brief=1 || status=1
  "$bin/plsh_cuda_registry_tests" || status=1
  "$bin/plsh_cuda_gpu_tests" || status=1
} >"$out/tests.log" 2>&1
grep -E "^\[  (PASSED|FAILED)  \]|^\[  FAILED  \] |test suites? ran|Failure|registry note" "$out/tests.log" | head -60
skipped=$(grep -c "^\[  SKIPPED \]" "$out/tests.log" || true)
if [ "$skipped" != "0" ]; then
  echo "GPU tests SKIPPED ($skipped lines): the backend saw no device here:"
  grep -m1 "no CUDA device" "$out/tests.log"
  status=1
fi

step "compute-sanitizer"
sanitizer=$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2>/dev/null || true)
if [ -n "$sanitizer" ]; then
  small='Cases/CudaVsCpu.MatchesCpuBackendAndReference/lsh_causal_gqa_bf16:Cases/CudaVsCpu.MatchesCpuBackendAndReference/exact_causal_decode_f32:CudaBins.*'
  {
    for tool in memcheck racecheck initcheck; do
      # The benchmark needs most of the time left: later tools only if early.
      if [ "$tool" != memcheck ] && [ "$(elapsed)" -gt 200 ]; then echo "--- $tool skipped (time)"; continue; fi
      echo "--- $tool"
      timeout 90 "$sanitizer" --tool "$tool" --error-exitcode 17 "$bin/plsh_cuda_gpu_tests" --gtest_filter="$small" --gtest_brief=1
      echo "$tool exit $?"
    done
  } >"$out/sanitizer.log" 2>&1
  grep -E "^--- |exit [0-9]+|ERROR SUMMARY|========= (Invalid|Uninitialized|Race)" "$out/sanitizer.log" | head -30
  grep -qE "exit (17|124|1)$" "$out/sanitizer.log" && { echo "SANITIZER REPORTED ERRORS (see sanitizer.log)"; status=1; }
else
  echo "compute-sanitizer not found" | tee "$out/sanitizer.log"
fi

step "benchmark"
# 128k first: the issue's headline figure must not be the one the time budget drops.
left=$((total_budget - $(elapsed)))
echo "benchmark budget: $left s"
# The backend's memory budget: leave the rest of the card to PyTorch.
export PLSH_CUDA_MEMORY_MB=${PLSH_CUDA_MEMORY_MB:-40000}
PYTHONUNBUFFERED=1 "$python" bench/gpu/peers.py --bench-bin "$bin/bench_cuda" --out "$out" \
  --sizes "${PLSH_GPU_SIZES:-131072,8192,32768,524288}" --budget-seconds "$left" || status=1

step "done in $(elapsed) s, status $status"
[ -f "$out/results.md" ] && cat "$out/results.md"
# Let tee write the last lines before the caller reads the output.
exec >&- 2>&-
wait "$tee_pid" 2>/dev/null || sleep 1
exit "$status"
