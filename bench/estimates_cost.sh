#!/usr/bin/env bash
# What the error estimates cost next to the answer, and whether lsh's time
# follows its FLOPs (issue 13's two before/after figures), with `plsh
# compute` on the CPU:
#   1. n = 8192, H = 8, D = 64, causal, banded lsh at s = 16 and s = 256:
#      compute time against FLOPs.
#   2. n = 131072 (and PLSH_ESTIMATES_N, default 131072), H = 8, D = 64,
#      causal: banded lsh (s = 16) and window (eps 1e-4), compute against
#      the default estimates (mask errors + spectral, probe of 64 rows).
# q, k, v ~ N(0, 1) float32, seed 0. Each configuration runs
# PLSH_ESTIMATES_REPEAT times (3); the table shows the median of each phase.
#
#   bench/estimates_cost.sh [BUILD_DIR]      (default: build)
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
plsh=$build/bin/plsh
[[ -x $plsh ]] || { echo "estimates_cost.sh: $plsh not built (cmake --build $build --target plsh)" >&2; exit 2; }
repeat=${PLSH_ESTIMATES_REPEAT:-3}
big=${PLSH_ESTIMATES_N:-131072}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

echo "## device"
lscpu | grep -E '^(Model name|CPU\(s\))' || true
echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)  commit: $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
echo "load average: $(cut -d' ' -f1-3 /proc/loadavg)"

inputs() {  # n
  /usr/bin/python3 - "$work" "$1" <<'PY'
import sys, numpy as np
work, n = sys.argv[1], int(sys.argv[2])
rng = np.random.default_rng(0)
for name in "qkv":
    np.save(f"{work}/{name}{n}.npy", rng.standard_normal((1, n, 8, 64), dtype=np.float32))
PY
}

run() {  # label n flags...
  local label=$1 n=$2
  shift 2
  for i in $(seq "$repeat"); do
    "$plsh" compute --q "$work/q$n.npy" --k "$work/k$n.npy" --v "$work/v$n.npy" --causal \
      --out "$work/out.npy" --meta "$work/$label.$i.json" "$@"
  done
  echo "\$ plsh compute --q q.npy --k k.npy --v v.npy --causal --out out.npy --meta meta.json $*   (x$repeat, n = $n)"
}

inputs 8192
run lsh16_8k 8192 --mode lsh --samples 16 --lsh-algorithm banded
run lsh256_8k 8192 --mode lsh --samples 256 --lsh-algorithm banded
rm -f "$work"/[qkv]8192.npy
inputs "$big"
run lsh16_big "$big" --mode lsh --samples 16 --lsh-algorithm banded
run window_big "$big" --mode window --window-eps 1e-4
echo "load average at the end: $(cut -d' ' -f1-3 /proc/loadavg)"

echo
/usr/bin/python3 - "$work" "$repeat" "$big" <<'PY'
import json, statistics, sys
work, repeat, big = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
def med(label, key):
    values = [json.load(open(f"{work}/{label}.{i}.json"))["timings"].get(key, 0.0) for i in range(1, repeat + 1)]
    return statistics.median(values)
def flops(label):
    return json.load(open(f"{work}/{label}.1.json"))["flops"]
print("| run | n | FLOPs | compute s | estimates s (masks + probe) | estimates / compute |")
print("|---|---:|---:|---:|---:|---:|")
for label, name, n in (("lsh16_8k", "banded lsh s=16", 8192), ("lsh256_8k", "banded lsh s=256", 8192),
                       ("lsh16_big", "banded lsh s=16", big), ("window_big", "window eps 1e-4", big)):
    c, e = med(label, "compute"), med(label, "estimates")
    print(f"| {name} | {n} | {flops(label):.3g} | {c:.3f} | {e:.3f} ({med(label, 'estimates_masks'):.3f} + "
          f"{med(label, 'estimates_probe'):.3f}) | {e / c:.2f} |")
ratio_t = med("lsh256_8k", "compute") / med("lsh16_8k", "compute")
ratio_f = flops("lsh256_8k") / flops("lsh16_8k")
print(f"\nn = 8192: s = 256 over s = 16: compute time x{ratio_t:.2f}, FLOPs x{ratio_f:.2f}")
PY
