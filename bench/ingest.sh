#!/usr/bin/env bash
# Tensor transport on loopback: one 256 MiB request in, its 128 MiB output
# out, against raw TCP transfers of the same bytes measured in the same run
# (bench/raw_tcp.cpp); then the same request through same-host shared
# memory.
#
#   bench/ingest.sh [BUILD_DIR]      (default: build)
#
# The request: q [1, 131072, 4, 64] and k, v [1, 131072, 2, 64], float32:
# 128 + 64 + 64 MiB = 256 MiB up, out [1, 131072, 4, 64] = 128 MiB down.
# Mode window with width 1 and no estimates, so computing is small.
#
#   ingest = 268435456 B / the server's receiving phase (header to end of
#            input, from the response summaries), vs raw TCP's 256 MiB
#   send   = 134217728 B / the server's sending phase (first output chunk to
#            the summary), vs raw TCP's 128 MiB
#   dout   = 134217728 B / the backward's receiving phase (`plsh bench
#            --backward`: each forward keeps its context, then its backward
#            by context sends dout [1, 131072, 4, 64] alone), vs raw TCP's
#            128 MiB: the backward's ingest on the same transport; and
#            against the same steps' forward (their q, k, v receiving
#            phase, vs raw TCP's 256 MiB): the two RPCs under one load
#
# The server runs as shipped: default flags, no environment variables
# (it sets its own allocator behaviour). Two warmup seconds first (two or
# more requests), so that the pooled buffers are mapped before the measured
# requests: a request's block returns to the pool only once gRPC has let go
# of its last output chunk, which may be after the next header arrives, so
# a second block may be mapped once.
# Raw TCP runs before and after the plsh runs; the ratios use the mean of
# its two medians (the machine's load moves both alike).
#
# Shared memory: the server with --shm-dir (a fresh directory under
# /dev/shm), `plsh bench --shm` (inputs in one registered file, the output
# written there): its receiving phase against the streamed one, and its
# end-to-end latency against its computing phase.
#
# Prints lscpu, the date, the load, every command and its output, the
# ratios, and the CPU seconds per request of the server's gRPC threads, its
# compute threads and the client. PLSH_INGEST_REQUESTS: requests per run
# (5). PLSH_INGEST_PERF=1: also perf record the server's gRPC threads over
# the streamed requests and print their top symbols.
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
shm_dir=$(mktemp -d /dev/shm/plsh-ingest-XXXXXX)
server_pid=
cleanup() {
  if [[ -n $server_pid ]]; then kill "$server_pid" 2>/dev/null || true; wait "$server_pid" 2>/dev/null || true; fi
  rm -rf "$work" "$shm_dir"
}
trap cleanup EXIT

echo "## device"
lscpu | grep -E '^(Model name|CPU\(s\)|Thread|Core|Socket|L2|L3)' || true
echo "kernel: $(uname -r)"
echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
echo "load average: $(cut -d' ' -f1-3 /proc/loadavg)"

start_server() {  # flags...
  "$server_bin" --listen 127.0.0.1:0 --metrics-listen off --workers 1 "$@" 2>"$work/server.log" &
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

raw() {  # label
  echo
  echo "## raw TCP ($1)"
  for bytes in 268435456 134217728; do
    cmd=("$raw_bin" --bytes $bytes --chunk 4194304 --repeat "$requests")
    echo "\$ ${cmd[*]}"
    "${cmd[@]}" | tee -a "$work/raw.txt"
  done
}

# CPU ticks of the server's threads: "grpc compute", split by thread name
# (compute: the threads named plsh-server, i.e. main, the workers and their
# OpenMP teams; grpc: gRPC's own threads, which run the stream's callbacks).
server_cpu() {
  local grpc=0 compute=0
  for t in /proc/"$server_pid"/task/*; do
    read -r -a f < <(sed -E 's/^.*\) //' "$t/stat")  # fields after "(comm)", from state (field 3)
    local ticks=$((f[11] + f[12]))                   # utime + stime: fields 14 and 15
    if [[ $(cat "$t/comm") == plsh-server ]]; then compute=$((compute + ticks)); else grpc=$((grpc + ticks)); fi
  done
  echo "$grpc $compute"
}

run_bench() {  # label json extra-bench-flags...
  local label=$1 json=$2
  shift 2
  cmd=("$plsh_bin" bench --target "$addr" --shape 1,131072,4,2,64 --mode window --window-width 1 --no-estimates
       --concurrency 1 --requests "$requests" --warmup 2 --quiet --json "$json" "$@")
  echo
  echo "## plsh: $label"
  echo "\$ ${cmd[*]}"
  local before after
  before=$(server_cpu)
  "${cmd[@]}"
  after=$(server_cpu)
  echo "$before $after" >"$json.cpu"
}

raw "before"

start_server
run_bench "streamed (server: --workers 1, defaults)" "$work/streamed.json" &
bench_pid=$!
if [[ ${PLSH_INGEST_PERF:-0} != 0 ]] && command -v perf >/dev/null; then
  sleep 3  # past the warmup seconds
  perf record -F 999 -g -o "$work/perf.data" -p "$server_pid" 2>/dev/null &
  perf_pid=$!
  wait $bench_pid
  kill -INT $perf_pid; wait $perf_pid || true
else
  wait $bench_pid
fi
stop_server

start_server
run_bench "training steps (server: --workers 1, defaults)" "$work/backward.json" --backward
stop_server

start_server --shm-dir "$shm_dir"
run_bench "shared memory (server: --workers 1 --shm-dir $shm_dir)" "$work/shm.json" --shm --shm-dir "$shm_dir"
stop_server

raw "after"

echo
echo "## summary"
/usr/bin/python3 - "$work" "$requests" <<'PY'
import json, os, re, sys
work, n = sys.argv[1], int(sys.argv[2])
raw = {}
for line in open(os.path.join(work, "raw.txt")):
    m = re.search(r"bytes=(\d+) .*median_s=([\d.]+) .*cpu_s=([\d.]+)", line)
    raw.setdefault(int(m.group(1)), []).append((float(m.group(2)), float(m.group(3))))
hz = os.sysconf("SC_CLK_TCK")

def load(name):
    run = json.load(open(os.path.join(work, name + ".json")))
    g0, c0, g1, c1 = (float(x) / hz for x in open(os.path.join(work, name + ".json.cpu")).read().split())
    level = run["levels"][0]
    ok = level["ok"] + level["warmup"]["ok"]
    cpu = level["client_cpu"]
    return level, {"grpc": (g1 - g0) / ok, "compute": (c1 - c0) / ok,
                   "client": cpu["process_cores"] * cpu["wall_s"] / max(1, level["ok"])}

def raw_s(nbytes):
    runs = raw[nbytes]
    return sum(s for s, _ in runs) / len(runs), [s for s, _ in runs]

streamed, streamed_cpu = load("streamed")
backward, _ = load("backward")
shm, shm_cpu = load("shm")
ms = lambda level, phase, stat="p50": level["server_ms"][phase][stat]
for nbytes, phase, what in ((268435456, "receiving", "ingest"), (134217728, "sending", "send")):
    raw_mean, raw_each = raw_s(nbytes)
    t = ms(streamed, phase) / 1e3
    print(f"{what}: {nbytes} bytes, server {phase} p50 {t * 1e3:.1f} ms (avg {ms(streamed, phase, 'avg'):.1f}, "
          f"max {ms(streamed, phase, 'max'):.1f}) -> {nbytes / t / 1e6:.0f} MB/s; raw TCP median "
          f"{' / '.join(f'{s * 1e3:.1f}' for s in raw_each)} ms (before / after) -> {nbytes / raw_mean / 1e6:.0f} MB/s; "
          f"ratio {raw_mean / t:.2f}")
ratios = {}
for nbytes, phase, what in ((268435456, "receiving", "ingest"), (134217728, "sending", "send")):
    ratios[what] = raw_s(nbytes)[0] / (ms(streamed, phase) / 1e3)
dout_ms = backward["step_ms"]["backward_receiving"]
t = dout_ms["p50"] / 1e3
raw_mean, raw_each = raw_s(134217728)
print(f"dout (backward by context): 134217728 bytes, server receiving p50 {t * 1e3:.1f} ms (avg {dout_ms['avg']:.1f}, "
      f"max {dout_ms['max']:.1f}) -> {134217728 / t / 1e6:.0f} MB/s; raw TCP median "
      f"{' / '.join(f'{s * 1e3:.1f}' for s in raw_each)} ms -> {134217728 / raw_mean / 1e6:.0f} MB/s; ratio "
      f"{raw_mean / t:.2f} ({raw_mean / t / ratios['ingest']:.2f} of the forward-only bench's ingest ratio)")
# The same steps' forward (q, k, v, 256 MiB): the two RPCs' ingest under the
# same server, the same load and the same pooled blocks, request by request.
step_fwd = backward["step_ms"]["forward_receiving"]["p50"] / 1e3
step_ratio = raw_s(268435456)[0] / step_fwd
# Over one raw TCP rate (the 256 MiB one's), dout's ratio over the forward's
# is their rates' ratio: the raw medians' own noise (each size measured
# apart) then cancels.
print(f"  the same training steps' forward: 268435456 bytes, receiving p50 {step_fwd * 1e3:.1f} ms -> "
      f"{268435456 / step_fwd / 1e6:.0f} MB/s; ratio {step_ratio:.2f}; dout's ratio is {raw_mean / t / step_ratio:.2f} "
      f"of it, over one raw TCP rate {(134217728 / t) / (268435456 / step_fwd):.2f} "
      f"(goal within 10%)")
print(f"streamed: whole request p50 {streamed['latency_ms']['p50']:.1f} ms; server phases p50 ms: "
      + ", ".join(f"{p} {ms(streamed, p):.1f}" for p in ("queued", "receiving", "computing", "sending")))
print(f"  CPU seconds per request: server gRPC threads {streamed_cpu['grpc']:.3f} (256 MiB in + 128 MiB out), "
      f"server compute threads {streamed_cpu['compute']:.3f}, client {streamed_cpu['client']:.3f}; raw TCP both ends "
      f"{raw[268435456][0][1]:.3f} for 256 MiB")
print(f"shared memory: whole request p50 {shm['latency_ms']['p50']:.1f} ms; server phases p50 ms: "
      + ", ".join(f"{p} {ms(shm, p):.2f}" for p in ("queued", "receiving", "computing", "sending")))
print(f"  receiving {ms(shm, 'receiving'):.2f} ms = {ms(shm, 'receiving') / ms(streamed, 'receiving'):.3f} of the "
      f"streamed {ms(streamed, 'receiving'):.1f} ms (goal < 0.1); end to end {shm['latency_ms']['p50']:.1f} ms = "
      f"{shm['latency_ms']['p50'] / ms(shm, 'computing'):.2f}x its computing {ms(shm, 'computing'):.1f} ms (goal <= 1.3)")
print(f"  CPU seconds per request: server gRPC threads {shm_cpu['grpc']:.3f}, compute threads {shm_cpu['compute']:.3f}, "
      f"client {shm_cpu['client']:.3f}")
PY
echo "load average at the end: $(cut -d' ' -f1-3 /proc/loadavg)"

if [[ -f $work/perf.data ]]; then
  echo
  echo "## perf: the server's gRPC threads over the streamed requests (perf record -F 999 -g)"
  perf report -i "$work/perf.data" --no-children --sort comm,dso,sym -g none --stdio 2>/dev/null |
    grep -v '^#' | grep -v plsh-server | grep '%' | head -25 || true  # head closes the pipe early
fi
