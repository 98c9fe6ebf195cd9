#!/usr/bin/env bash
# plsh's two entry points for a fresh Debian 12 machine:
#   scripts/dev.sh run    install packages, build, start plsh-server
#   scripts/dev.sh test   install packages, build, run every test
# Extra arguments after `run` go to the server.
set -euo pipefail
cd "$(dirname "$0")/.."

what=${1:-run}
shift || true
jobs=${PLSH_JOBS:-$(nproc)}
build_dir=${PLSH_BUILD_DIR:-build}

bash scripts/setup.sh
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
    ctest --test-dir "$build_dir" --output-on-failure -j"$jobs" --timeout 900
    ;;
  *)
    echo "usage: scripts/dev.sh run|test" >&2
    exit 2
    ;;
esac
