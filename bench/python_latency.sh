#!/usr/bin/env bash
# Python client latency against the C++ client's, in one run on one server
# (bench/RESULTS.md, "Python client latency"; issue 21 item 6):
#   - a tiny call (1x64x4x32, exact): `plsh bench --concurrency 1` (stream and
#     --unary) beside bench/python_latency.py with this checkout's client and
#     with the client of BEFORE (a git revision; default: the merge base with
#     main), one in flight, on one channel;
#   - a decode step (Nq = 1 against Nk = 4096 keys, 8 heads of 64, exact);
#   - the import time of plsh_client and plsh_client.torch (torch's own
#     import measured beside them).
# Usage: bench/python_latency.sh [BUILD_DIR] [BEFORE]   (run under flock /tmp/plsh-heavy.lock)
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
before=${2:-$(git merge-base HEAD main)}
secs=${PLSH_BENCH_SECONDS:-5}
port=${PLSH_BENCH_PORT:-50071}
py=/usr/bin/python3
old=$(mktemp -d)
trap 'kill "$server" 2>/dev/null || true; wait 2>/dev/null || true; rm -rf "$old"' EXIT
git archive "$before" client/python | tar -x -C "$old"

"$build/bin/plsh-server" --listen "127.0.0.1:$port" --metrics-listen off >"$old/server.log" 2>&1 &
server=$!
for _ in $(seq 100); do
  "$build/bin/plsh" health --target "127.0.0.1:$port" >/dev/null 2>&1 && break
  sleep 0.1
done

echo "# $(date -u +%FT%TZ) $(hostname) $(nproc) cores, OPENBLAS_CORETYPE=${OPENBLAS_CORETYPE:-unset}; HEAD $(git rev-parse --short HEAD), before $(git rev-parse --short "$before")"
for unary in "" --unary; do
  echo "C++ plsh bench ${unary:---stream (Attend)}, shape 1,64,4,4,32 exact, concurrency 1:"
  "$build/bin/plsh" bench --target "127.0.0.1:$port" --shape 1,64,4,4,32 --mode exact --concurrency 1 \
    --duration "$secs" --quiet $unary
done
# B,N,H,Hkv,D and kv_len: the tiny call, then a decode step (plsh bench has
# one length for q and kv, so the decode step is measured from Python only).
for shape in "1,64,4,4,32 0" "1,1,8,8,64 4096"; do
  set -- $shape
  for side in HEAD before; do
    tree=client/python
    [ "$side" = HEAD ] || tree=$old/client/python
    PYTHONPATH="$tree:$build/python" "$py" bench/python_latency.py --target "127.0.0.1:$port" --shape "$1" \
      --kv-len "$2" --mode exact --duration "$secs" --label "python ($side)"
  done
done

imp='import sys, time; t = time.perf_counter(); __import__(sys.argv[1]); print(f"import {sys.argv[1]}: {(time.perf_counter() - t) * 1e3:.0f} ms")'
for i in 1 2 3; do
  "$py" -c "$imp" torch
  PYTHONPATH="client/python:$build/python" "$py" -c "$imp" plsh_client
  PYTHONPATH="client/python:$build/python" "$py" -c "$imp" plsh_client.torch
  PYTHONPATH="$old/client/python:$build/python" "$py" -c "$imp" plsh_client.torch | sed 's/$/ (before)/'
done
