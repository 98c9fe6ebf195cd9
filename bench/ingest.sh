#!/usr/bin/env bash
# Streaming ingest of one 256 MiB request on loopback, against a raw TCP
# transfer of the same bytes measured in the same run (bench/raw_tcp.cpp).
#
#   bench/ingest.sh [BUILD_DIR]      (default: build)
#
# The request: q [1, 131072, 4, 64] and k, v [1, 131072, 2, 64], float32:
# 128 + 64 + 64 MiB = 256 MiB up. Mode window with width 1 and no
# estimates, so computing is small and the figure is the server's
# receiving phase (header to end of input, from the response summaries):
# ingest MB/s = 268435456 B / receiving seconds. Prints lscpu, the date,
# every command, their output and the ratio, and where the CPU went: the
# server's gRPC threads and its compute threads (/proc/PID/task), the
# client process, and raw TCP's two ends. Three server setups: gRPC's
# default 4 MiB messages, 64 MiB messages, and 4 MiB messages with glibc's
# mmap threshold raised (GLIBC_TUNABLES) so that message buffers are
# reused instead of mapped and faulted in anew for every message. Then
# strace -c of the server over one request when strace is installed
# (PLSH_INGEST_STRACE=0 skips it). PLSH_INGEST_REQUESTS: requests per setup (5).
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
server_bin=$build/bin/plsh-server
plsh_bin=$build/bin/plsh
raw_bin=$build/bin/raw_tcp
for b in "$server_bin" "$plsh_bin" "$raw_bin"; do
  [[ -x $b ]] || { echo "ingest.sh: $b not built (cmake --build $build --target plsh-server plsh raw_tcp)" >&2; exit 2; }
done
requests=${PLSH_INGEST_REQUESTS:-5}
work=$(mktemp -d)
server_pid=
cleanup() {
  if [[ -n $server_pid ]]; then kill "$server_pid" 2>/dev/null || true; wait "$server_pid" 2>/dev/null || true; fi
  rm -rf "$work"
}
trap cleanup EXIT

echo "## device"
lscpu | grep -E '^(Model name|CPU\(s\)|Thread|Core|Socket|L2|L3)' || true
echo "kernel: $(uname -r)"
echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
echo "load average: $(cut -d' ' -f1-3 /proc/loadavg)"

start_server() {  # extra flags...
  env ${tunables:+GLIBC_TUNABLES=$tunables} "$server_bin" --listen 127.0.0.1:0 --metrics-listen off --workers 1 "$@" 2>"$work/server.log" &
  server_pid=$!
  for _ in $(seq 200); do
    grep -q ' serving ' "$work/server.log" && break
    sleep 0.05
  done
  addr=$(grep ' serving ' "$work/server.log" | head -1 | sed -E 's/.* grpc=([^ ]+).*/\1/')
  [[ -n $addr ]] || { echo "ingest.sh: server did not start:" >&2; cat "$work/server.log" >&2; exit 1; }
}
stop_server() {
  kill "$server_pid"; wait "$server_pid" || true; server_pid=
}

bytes=268435456
echo
echo "## raw TCP, the same bytes"
cmd=("$raw_bin" --bytes $bytes --chunk 4194304 --repeat "$requests")
echo "\$ ${cmd[*]}"
raw_line=$("${cmd[@]}")
echo "$raw_line"
raw_mb_s=$(sed -E 's/.*median_mb_s=([0-9.]+).*/\1/' <<<"$raw_line")
raw_cpu_s=$(sed -E 's/.*cpu_s=([0-9.]+).*/\1/' <<<"$raw_line")

# CPU ticks of the server's threads: "grpc compute", split by thread name
# (compute: the threads named plsh-server, i.e. main, the workers and their
# OpenMP teams; grpc: gRPC's own threads).
server_cpu() {
  local grpc=0 compute=0
  for t in /proc/"$server_pid"/task/*; do
    read -r -a f < <(sed -E 's/^.*\) //' "$t/stat")  # fields after "(comm)", from state (field 3)
    local ticks=$((f[11] + f[12]))                   # utime + stime: fields 14 and 15
    if [[ $(cat "$t/comm") == plsh-server ]]; then compute=$((compute + ticks)); else grpc=$((grpc + ticks)); fi
  done
  echo "$grpc $compute"
}

bench_ingest() {  # label, server flags...
  local label=$1
  shift
  start_server "$@"
  echo
  echo "## plsh ingest: $label (server: ${tunables:+GLIBC_TUNABLES=$tunables }--workers 1 $*)"
  cmd=(env ${tunables:+GLIBC_TUNABLES=$tunables} "$plsh_bin" bench --target "$addr" --shape 1,131072,4,2,64 --mode window
       --window-width 1 --no-estimates --concurrency 1 --requests "$requests" --warmup 0 --quiet --json "$work/ingest.json")
  echo "\$ ${cmd[*]}"
  local cpu_before cpu_after
  cpu_before=$(server_cpu)
  "${cmd[@]}"
  cpu_after=$(server_cpu)
  /usr/bin/python3 - "$work/ingest.json" "$raw_mb_s" "$raw_cpu_s" "$label" $cpu_before $cpu_after <<'PY'
import json, os, sys
run = json.load(open(sys.argv[1]))
raw, raw_cpu, label = float(sys.argv[2]), float(sys.argv[3]), sys.argv[4]
hz = os.sysconf("SC_CLK_TCK")
grpc0, compute0, grpc1, compute1 = (float(a) / hz for a in sys.argv[5:9])
level = run["levels"][0]
n = level["ok"]
up = run["client"]["input_bytes"]
rec = level["server_ms"]["receiving"]
mb_p50 = up / (rec["p50"] / 1e3) / 1e6
print(f"ingest [{label}]: {up} bytes up, server receiving p50 {rec['p50']:.1f} ms (avg {rec['avg']:.1f}, max {rec['max']:.1f}) "
      f"-> {mb_p50:.1f} MB/s; raw TCP median {raw:.1f} MB/s; ratio {mb_p50 / raw:.2f}")
print(f"  whole request p50 {level['latency_ms']['p50']:.1f} ms; server phases p50 ms: "
      + ", ".join(f"{p} {level['server_ms'][p]['p50']:.1f}" for p in ("queued", "receiving", "computing", "sending")))
cpu = level["client_cpu"]
client_cpu = cpu["process_cores"] * cpu["wall_s"] / n
print(f"  CPU seconds per request: server gRPC threads {(grpc1 - grpc0) / n:.2f} (256 MiB in + 128 MiB out), "
      f"server compute threads {(compute1 - compute0) / n:.2f}, client {client_cpu:.2f}; "
      f"raw TCP both ends {raw_cpu:.2f} for 256 MiB")
PY
  stop_server
}

tunables=
bench_ingest "default 4 MiB messages"
bench_ingest "64 MiB messages" --max-message-bytes 67108864
tunables=glibc.malloc.mmap_threshold=268435456:glibc.malloc.trim_threshold=1073741824
bench_ingest "4 MiB messages, malloc buffers reused (mmap threshold 256 MiB)"
tunables=

if [[ ${PLSH_INGEST_STRACE:-1} != 0 ]] && command -v strace >/dev/null; then
  start_server
  echo
  echo "## strace -c -f of plsh-server over one request (default messages)"
  strace -c -f -p "$server_pid" -o "$work/strace.txt" &
  strace_pid=$!
  sleep 0.5
  "$plsh_bin" bench --target "$addr" --shape 1,131072,4,2,64 --mode window --window-width 1 --no-estimates \
    --concurrency 1 --requests 1 --warmup 0 --quiet >/dev/null
  kill -INT $strace_pid; wait $strace_pid || true
  head -25 "$work/strace.txt"
  stop_server
fi
