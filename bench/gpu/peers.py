#!/usr/bin/env python3
"""plsh's CUDA backend against PyTorch FlexAttention on the same GPU.

For each N: draws q, k, v (bf16, [1, N, H, D]) on the GPU, writes them as raw
files, times FlexAttention

  * exact ALiBi: score_mod with the standard slopes, causal block mask (the
    reference for every error below);
  * sliding-window ALiBi: the same, restricted to |i - j| < W_h (SPEC's window);
  * the per-sample LSH reduction: one causal same-bin block mask per hash
    (the same draws as plsh, SPEC section 5), merged by log-sum-exp;

runs bench_cuda on the same files in a child process (ours: lsh on the fused
banded kernel, lsh on the cuBLAS per-sample pipeline, window and exact on the
fused kernel, each forward and backward, and lsh with its error estimates
from host tensors; it writes its outputs back), and reports ms (median of
CUDA-event-timed runs after warm-up), useful TFLOP/s (exact causal FLOPs over
the time), speed against FlexAttention exact, relative L2 error against
FlexAttention exact on identical inputs, and the issue-19 goals as ratios.
FlexAttention's exact and sliding-window backward are timed too. Also
measures the bf16 matrix-multiply rate and the device copy bandwidth, the
ceilings for the FLOP and byte floors.

It is made for one short GPU lease (bench/gpu/run.sh), so it cannot lose what
it measured:
  * OUTDIR/results.md and OUTDIR/results.json are rewritten after every case,
    not at the end; a hung or failing bench_cuda costs only its own rows;
  * bench_cuda runs under a timeout, and a hard deadline (--budget-seconds
    plus --grace-seconds) stops the whole script, writing first what it has;
  * a size starts only when its comparison (inputs, FlexAttention exact,
    bench_cuda, errors) is estimated to fit the time left, and each further
    case only when it fits; the estimates start from priors (PRIOR_* below)
    and take over what the earlier sizes measured; what was skipped and why
    goes into results.md;
  * FlexAttention is compiled once per variant with dynamic shapes;
  * the ALiBi slopes are computed as kernels/src/params.cpp does and checked
    bit for bit against the C++ (hard-coded values, and what bench_cuda used).

    python3 bench/gpu/peers.py --bench-bin build-gpu/bin/bench_cuda --out OUTDIR --budget-seconds 300

Without PyTorch or a GPU it writes results.md saying so and exits 2. The
bookkeeping can be rehearsed without either (sleeps stand in for the GPU work;
--fake-child-seconds makes a hung bench_cuda, --dry-run-hang a hung
FlexAttention call):

    python3 bench/gpu/peers.py --dry-run --bench-bin build-gpu/bin/bench_cuda --out /tmp/dry --budget-seconds 20
"""

import argparse
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
import traceback


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bench-bin", required=True, help="path to bench_cuda (missing: FlexAttention alone)")
    ap.add_argument("--out", required=True, help="output folder: results.md, results.json")
    ap.add_argument("--work", default="/tmp/plsh_bench", help="folder for the raw q/k/v/output files")
    ap.add_argument("--preamble", help="markdown file put at the top of results.md (run.sh's phases)")
    ap.add_argument("--sizes", default="131072,8192,32768,524288",
                    help="comma-separated N, run in this order (the first is the one that matters most)")
    ap.add_argument("--heads", type=int, default=32, help="query heads, and as many kv heads (bf16, causal)")
    ap.add_argument("--dim", type=int, default=128, help="head dim")
    ap.add_argument("--samples", type=int, default=16, help="lsh hashes per head")
    ap.add_argument("--seed", type=int, default=0, help="plsh draws seed")
    ap.add_argument("--window-eps", type=float, default=1e-4,
                    help="window mode: each head's width W_h = ceil(sigma_h ln(1/eps))")
    ap.add_argument("--repeats", type=int, default=5, help="timed calls per case (the median is reported)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed calls per case before them")
    ap.add_argument("--budget-seconds", type=float, default=300,
                    help="time for everything; no size or case starts unless its estimate fits what is left")
    ap.add_argument("--grace-seconds", type=float, default=20,
                    help="after budget + grace, stop hard (results written first)")
    ap.add_argument("--max-seconds-per-case", type=float, default=20,
                    help="fewer repeats when one call is slow, here and in bench_cuda")
    # The largest N of each costly case; a larger size skips it.
    for flag, what in (
            ("--flex-lsh-max-n", "the FlexAttention lsh peer (its block tables are dense, N^2 / 128^2 per sample)"),
            ("--ours-exact-max-n", "our exact mode"),
            ("--ours-per-sample-max-n", "our cuBLAS per-sample lsh (memory-bound: ~0.5 TB moved at 128k)"),
            ("--ours-estimates-max-n",
             "our lsh with its error estimates on host tensors (transfers included)")):
        ap.add_argument(flag, type=int, default=131072, help=f"largest N for {what}")
    ap.add_argument("--no-backward", action="store_true", help="forward only, ours and FlexAttention")
    ap.add_argument("--dry-run", action="store_true",
                    help="no torch, no GPU: sleeps of the estimated length stand in for each case")
    ap.add_argument("--dry-run-scale", type=float, default=0.05,
                    help="dry run: every prior cost (and --max-seconds-per-case) times this")
    ap.add_argument("--fake-child-seconds", type=float,
                    help="a fake bench_cuda that sleeps this long, then writes its JSON (a hung child when long)")
    ap.add_argument("--dry-run-hang", metavar="CASE",
                    help="dry run: this case (e.g. flex_window) never returns, as a hung GPU call would")
    return ap.parse_args(argv)


# ---- SPEC section 5: the draws, bit for bit as plsh makes them -------------

MASK64 = (1 << 64) - 1


def mix64(z):
    z ^= z >> 30
    z = (z * 0xBF58476D1CE4E5B9) & MASK64
    z ^= z >> 27
    z = (z * 0x94D049BB133111EB) & MASK64
    z ^= z >> 31
    return z


def draw_uniform(seed, head, sample, j):
    index = (1 + 4 * ((head << 24) + sample) + j) & MASK64
    word = mix64((seed + 0x9E3779B97F4A7C15 * index) & MASK64)
    return ((word >> 11) + 0.5) * 2.0 ** -53


def draw_hash(seed, head, sample, sigma):
    u0, u1, u2 = (draw_uniform(seed, head, sample, j) for j in range(3))
    pitch = -sigma * (math.log(u0) + math.log(u1))
    return pitch, u2 * pitch


# ---- ALiBi slopes, bit for bit as kernels/src/params.cpp standard_slopes ----
# As the C++: start = 2^(-8/n), then a running product (start * start * ...),
# not start ** (i + 1), which differs by one ulp in 8 of 32 heads. The client's
# copy is the one: this machine has no grpc, so not `import plsh_client` (its
# __init__ imports grpc) but its dependency-free file, loaded by path.

def _load_client_slopes():
    import importlib.util
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, os.pardir,
                        "client", "python", "plsh_client", "_slopes.py")
    spec = importlib.util.spec_from_file_location("plsh_client_slopes", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.standard_slopes


standard_slopes = _load_client_slopes()


# plsh::standard_slopes(H) printed with %a by a C++ one-liner linked against
# libplsh_kernels.a (g++ 12, glibc 2.36, Debian 12), 2026-11-30:
#   for (double s : plsh::standard_slopes(h)) std::printf(" %a", s);
CPP_STANDARD_SLOPES_HEX = {
    8: "0x1p-1 0x1p-2 0x1p-3 0x1p-4 0x1p-5 0x1p-6 0x1p-7 0x1p-8",
    12: "0x1p-1 0x1p-2 0x1p-3 0x1p-4 0x1p-5 0x1p-6 0x1p-7 0x1p-8 0x1.6a09e667f3bcdp-1 0x1.6a09e667f3bcep-2 "
        "0x1.6a09e667f3bcep-3 0x1.6a09e667f3bcep-4",
    32: "0x1.ae89f995ad3adp-1 0x1.6a09e667f3bccp-1 0x1.306fe0a31b714p-1 0x1.ffffffffffffep-2 0x1.ae89f995ad3abp-2 "
        "0x1.6a09e667f3bcap-2 0x1.306fe0a31b713p-2 0x1.ffffffffffffcp-3 0x1.ae89f995ad3aap-3 0x1.6a09e667f3bc9p-3 "
        "0x1.306fe0a31b712p-3 0x1.ffffffffffffap-4 0x1.ae89f995ad3a8p-4 0x1.6a09e667f3bc8p-4 0x1.306fe0a31b711p-4 "
        "0x1.ffffffffffff9p-5 0x1.ae89f995ad3a7p-5 0x1.6a09e667f3bc7p-5 0x1.306fe0a31b71p-5 0x1.ffffffffffff7p-6 "
        "0x1.ae89f995ad3a5p-6 0x1.6a09e667f3bc5p-6 0x1.306fe0a31b70fp-6 0x1.ffffffffffff5p-7 0x1.ae89f995ad3a4p-7 "
        "0x1.6a09e667f3bc4p-7 0x1.306fe0a31b70ep-7 0x1.ffffffffffff3p-8 0x1.ae89f995ad3a2p-8 0x1.6a09e667f3bc3p-8 "
        "0x1.306fe0a31b70dp-8 0x1.ffffffffffff2p-9",
}


def compare_slopes(python, cpp_hex, source):
    """Prints the Python slopes next to the C++ ones; returns a one-line verdict and whether all are equal."""
    cpp = [float.fromhex(x) for x in cpp_hex]
    if len(cpp) != len(python):
        return f"slopes: {source} has {len(cpp)} heads, Python {len(python)}", False
    print(f"slopes, Python next to C++ ({source}):")
    bad = []
    for h, (a, b) in enumerate(zip(python, cpp)):
        same = a == b
        if not same:
            bad.append(h)
        print(f"  head {h:2d}  {a.hex():24s} {b.hex():24s} {'=' if same else 'DIFFERENT'}")
    if bad:
        return f"slopes: Python and C++ ({source}) DIFFER in heads {bad}", False
    return f"slopes: Python equals C++ ({source}) bit for bit in all {len(python)} heads", True


def window_widths(slopes, eps):
    """kernels/src/params.cpp: W_h = max(1, ceil(sigma_h ln(1/eps))), sigma_h = 1/m_h."""
    return [max(1, math.ceil((1.0 / m) * math.log(1.0 / eps))) for m in slopes]


# ---- what a case costs: priors, then what was measured ---------------------

N0 = 131072  # the priors are per call at this N, H = 32, D = 128, bf16, s = 16
# Seconds per timed call at N0 and the power of N it grows with. Guesses made
# before any H200 run (FlexAttention ~250 TFLOP/s on causal ALiBi, our
# correctness-first exact ~50); each is replaced by the measured call time as
# soon as one size has run.
PRIOR_CALL = {
    "flex_exact": (0.6, 2),
    "flex_window": (0.05, 1),
    "flex_lsh": (0.5, 1),
    # Ours: forward + backward (2.5x) per timed call when the backward runs.
    # Guesses from the fused kernel's FLOP counts at ~200 TFLOP/s; the
    # per-sample pipeline from its ~0.5 TB moved at 128k.
    "ours_lsh": (0.02, 1),
    "ours_lsh_per_sample": (0.4, 1),
    "ours_window": (0.02, 1),
    "ours_exact": (2.0, 2),
    "ours_lsh_estimates": (3.0, 1),
}
# Seconds outside the timed calls: a part that grows as a power of N (its
# seconds at N0, the power) and a constant part.
PRIOR_FIXED = {
    "inputs": (8.0, 1, 0.5),       # draw q, k, v; 3.2 GB to host and disk at N0
    "flex_exact": (1.0, 1, 0.5),   # block mask, the float32 reference
    "flex_window": (1.0, 1, 0.5),
    "flex_lsh": (6.0, 2, 1.0),     # dense block tables: (N / 128)^2 per (sample, head)
    "flex_backward": (1.0, 1, 0.5),  # gradients' memory
    "ours": (10.0, 1, 3.0),        # 3.2 GB read, 1 GB written back per mode; process, CUDA and cuBLAS start
    "errors": (4.0, 1, 0.5),       # outputs read back, norms
    "ceilings": (0.0, 0, 8.0),     # matmul rate and copy bandwidth, once
}
PRIOR_COMPILE = 30.0  # seconds per FlexAttention variant (exact, window, lsh), first call only


class CostModel:
    # A size starts only when its comparison (CORE) fits the time left; the
    # other cases are then each started only when they fit.
    CORE = ("inputs", "flex_exact", "ours", "errors")
    EXTRAS = ("flex_window", "flex_lsh")

    def __init__(self, args, scale=1.0, with_ours=True):
        self.args = args
        self.scale = scale  # dry run: everything shorter
        self.with_ours = with_ours  # False: bench_cuda was not built
        self.width = args.heads * args.dim / (32 * 128)
        self.call = {}      # case -> (n, seconds per call) measured
        self.fixed = {}     # case -> (n, seconds) measured
        self.compiled = set()

    def call_seconds(self, case, n):
        seconds, power = PRIOR_CALL[case]
        if case in self.call:
            m, measured = self.call[case]
            return measured * (n / m) ** power
        return seconds * self.scale * self.width * (n / N0) ** power

    def fixed_seconds(self, case, n):
        seconds, power, constant = PRIOR_FIXED[case]
        constant *= self.scale
        if case in self.fixed:  # the measured seconds less the constant part grow with N
            m, measured = self.fixed[case]
            return constant + max(0.0, measured - constant) * (n / m) ** power
        return constant + seconds * self.scale * self.width * (n / N0) ** power

    def timed_seconds(self, call):
        """Warm-up, then repeats, cut short past max-seconds (timed() and bench_cuda both do this)."""
        a = self.args
        cap = a.max_seconds_per_case * self.scale
        return a.warmup * call + max(call, min(a.repeats * call, cap))

    def ours_modes(self, n):
        a = self.args
        modes = ["lsh", "window"]
        if n <= a.ours_exact_max_n:
            modes.append("exact")
        if n <= a.ours_per_sample_max_n:
            modes.append("lsh_per_sample")
        if n <= a.ours_estimates_max_n:
            modes.append("lsh_estimates")
        return modes

    def case(self, name, n):
        if name in ("ours", "errors") and not self.with_ours:
            return 0.0
        if name in ("inputs", "errors", "ceilings"):
            return self.fixed_seconds(name, n)
        if name == "ours":
            return self.fixed_seconds("ours", n) + sum(
                self.timed_seconds(self.call_seconds("ours_" + m, n)) for m in self.ours_modes(n))
        if name == "flex_lsh" and n > self.args.flex_lsh_max_n:
            return 0.0
        compile_s = 0.0 if name in self.compiled else PRIOR_COMPILE * self.scale
        call = self.call_seconds(name, n)
        if name in ("flex_exact", "flex_window") and not self.args.no_backward:
            # Forward and backward timed apart; the backward ~2.5 forwards, compiled once more.
            return (self.fixed_seconds(name, n) + self.fixed_seconds("flex_backward", n) + 2 * compile_s +
                    self.timed_seconds(call) + self.timed_seconds(3.5 * call))
        return self.fixed_seconds(name, n) + compile_s + self.timed_seconds(call)

    def size(self, n):
        """(seconds for the core, seconds for everything, each case's seconds)."""
        parts = {c: self.case(c, n) for c in self.CORE + self.EXTRAS}
        return sum(parts[c] for c in self.CORE), sum(parts.values()), parts

    def observe_call(self, case, n, seconds):
        if seconds and seconds > 0:
            self.call[case] = (n, seconds)

    def observe_fixed(self, case, n, seconds):
        if seconds is not None and seconds >= 0:
            self.fixed[case] = (n, seconds)


# ---- results, written after every case --------------------------------------

class Report:
    def __init__(self, args):
        self.args = args
        self.lock = threading.RLock()
        self.t0 = time.monotonic()
        self.current = "start"
        self.data = {
            "schema": 1,
            "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "config": {"heads": args.heads, "kv_heads": args.heads, "dim": args.dim, "dtype": "bf16",
                       "causal": True, "samples": args.samples, "seed": args.seed, "window_eps": args.window_eps,
                       "sizes": args.sizes, "budget_seconds": args.budget_seconds, "dry_run": args.dry_run},
            "device": None,
            "torch": None,
            "ceilings": None,
            "slopes": {},
            "sizes": [],
            "skipped": [],
            "notes": [],
            "status": "running",
        }

    def elapsed(self):
        return time.monotonic() - self.t0

    def row(self, n):
        for r in self.data["sizes"]:
            if r["n"] == n:
                return r
        r = {"n": n, "dense_flops": 4.0 * self.args.heads * self.args.dim * n * (n + 1) / 2}
        self.data["sizes"].append(r)
        return r

    def skip(self, what, why):
        print(f"SKIPPED {what}: {why}", flush=True)
        with self.lock:
            self.data["skipped"].append({"what": what, "why": why, "at_s": round(self.elapsed(), 1)})
        self.write()

    def note(self, text):
        print(text, flush=True)
        with self.lock:
            self.data["notes"].append(text)
        self.write()

    def finish(self, status):
        with self.lock:
            self.data["status"] = status
        self.write()

    def write(self):
        with self.lock:
            self.data["elapsed_s"] = round(self.elapsed(), 1)
            self.data["current"] = self.current
            section = render_markdown(self.args, self.data)
            preamble = ""
            if self.args.preamble and os.path.exists(self.args.preamble):
                with open(self.args.preamble) as f:
                    preamble = f.read().rstrip() + "\n\n"
            os.makedirs(self.args.out, exist_ok=True)
            os.makedirs(self.args.work, exist_ok=True)
            # run.sh puts the section back under its own notes after later phases.
            atomic_write(os.path.join(self.args.work, "bench_section.md"), section)
            atomic_write(os.path.join(self.args.out, "results.md"), preamble + section)
            atomic_write(os.path.join(self.args.out, "results.json"), json.dumps(self.data, indent=1) + "\n")


def atomic_write(path, text):
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def render_markdown(args, d):
    H, D, S = args.heads, args.dim, args.samples
    lines = ["## GPU benchmark: plsh CUDA backend vs FlexAttention (bench/gpu/peers.py)", ""]
    status = d["status"]
    if status == "running":
        status = f"running (now: {d.get('current')})"
    lines.append(f"Status: **{status}** after {d.get('elapsed_s', 0):.0f} s of a {args.budget_seconds:.0f} s budget"
                 + (" (DRY RUN: no GPU, sleeps stand in for the work, every figure below is fake)" if args.dry_run else "")
                 + ".")
    lines.append(f"Device: {d['device'] or '-'}; torch {d['torch'] or '-'}; started {d['started_utc']}; "
                 f"B=1, H={H}, Hkv={H}, D={D}, bf16, causal, standard ALiBi slopes, lsh s={S}, "
                 f"window eps={args.window_eps}.")
    c = d["ceilings"] if d["ceilings"] and "copy_tbs" in d["ceilings"] else None
    if c:
        lines.append(f"Measured ceilings: bf16 matmul {c['matmul_tflops']:.0f} TFLOP/s (8192^3), "
                     f"device copy {c['copy_tbs']:.2f} TB/s (read + write).")
    for v in d["slopes"].values():
        lines.append(f"{v['verdict']}.")
    lines.append("")
    lines.append("| N | impl | mode | ms | backward ms (x fwd) | useful TFLOP/s | x vs flex exact | "
                 "rel. L2 err vs flex exact | FLOP floor ms | byte floor ms |")
    lines.append("|---|---|---|---|---|---|---|---|---|---|")
    cross = []
    goals = []
    for res in d["sizes"]:
        n = res["n"]
        dense = res["dense_flops"]
        io_bytes = 4 * n * H * D * 2  # q, k, v read once, out written once
        byte_floor = f"{io_bytes / (c['copy_tbs'] * 1e12) * 1e3:.3f}" if c else "-"
        base = res.get("flex_exact", {}).get("ms")
        for impl, mode in (("flex", "exact"), ("ours", "exact"), ("flex", "window"), ("ours", "window"),
                           ("flex", "lsh"), ("ours", "lsh"), ("ours", "lsh_per_sample"), ("ours", "lsh_estimates")):
            r = res.get(f"{impl}_{mode}")
            if r is None:
                continue
            if "ms" not in r:
                lines.append(f"| {n} | {impl} | {mode} | {r.get('error') or r.get('skipped') or '-'} | | | | | | |")
                continue
            ms = r["ms"]
            flops = r.get("flops_done", dense if mode == "exact" else None)
            flop_floor = f"{flops / (c['matmul_tflops'] * 1e12) * 1e3:.3f}" if flops and c else "-"
            speed = f"{base / ms:.2f}" if base else "-"
            err = f"{r['err']:.2e}" if "err" in r else ("0 (reference)" if (impl, mode) == ("flex", "exact") else "-")
            bwd = f"{r['bwd_ms']:.3f} ({r['bwd_ms'] / ms:.2f})" if "bwd_ms" in r else "-"
            if mode == "lsh_estimates":
                est = r.get("timing_estimates_s")
                bwd = f"estimates {est * 1e3:.1f} ms" if est is not None else "-"
            lines.append(f"| {n} | {impl} | {mode} | {ms:.3f} | {bwd} | {dense / (ms * 1e-3) / 1e12:.1f} | {speed} | "
                         f"{err} | {flop_floor} | {byte_floor} |")
        if "ours_error" in res:
            lines.append(f"| {n} | ours | - | {res['ours_error']} | | | | | | |")
        for mode in ("lsh", "lsh_per_sample"):
            if "err_vs_flex_lsh" in res.get("ours_" + mode, {}):
                cross.append(f"N={n} {mode}: {res['ours_' + mode]['err_vs_flex_lsh']:.2e}")
        goals.extend(goal_rows(res))
    if goals:
        lines.append("")
        lines.append("Issue 19's goals (each a ratio of two rows above; N = 131072 is the one they name):")
        lines.append("")
        lines.append("| N | goal | measured | met |")
        lines.append("|---|---|---|---|")
        lines.extend(goals)
    lines.append("")
    if d["skipped"]:
        lines.append("Skipped (at seconds since peers.py started):")
        for s in d["skipped"]:
            lines.append(f"- {s['what']} at {s['at_s']:.0f} s: {s['why']}")
        lines.append("")
    if d["notes"]:
        lines.append("Notes:")
        for t in d["notes"]:
            lines.append(f"- {t}")
        lines.append("")
    lines.append("useful TFLOP/s: exact causal attention FLOPs (4 H D N(N+1)/2) over the time, for every row. "
                 "FLOP floor: FLOPs done (ours: both GEMMs over the planned tiles; exact: the causal FLOPs) over the "
                 "measured matmul rate. Byte floor: q, k, v read and the output written once, over the copy "
                 "bandwidth. ms: median of CUDA-event-timed calls after warm-up; FlexAttention compiled once per "
                 "variant with dynamic shapes, the compile time kept out of the timings.")
    if cross:
        lines.append("ours lsh against FlexAttention lsh (same draws, same estimator; should be bf16 rounding, "
                     "~1e-2 or less): relative L2 " + ", ".join(cross) + ".")
    return "\n".join(lines) + "\n"


def goal_rows(res):
    """Markdown rows of issue 19's goals that this size's results can answer."""
    n = res["n"]
    ms = {k: v["ms"] for k, v in res.items() if isinstance(v, dict) and "ms" in v}
    rows = []

    def add(goal, value, met, fmt="{:.2f}x"):
        rows.append(f"| {n} | {goal} | {fmt.format(value)} | {'yes' if met else 'NO'} |")

    if "flex_exact" in ms and "ours_lsh" in ms:
        x = ms["flex_exact"] / ms["ours_lsh"]
        add("fused lsh at least 100x faster than FlexAttention exact ALiBi", x, x >= 100)
    if "flex_window" in ms and "ours_window" in ms:
        x = ms["flex_window"] / ms["ours_window"]
        add("window at least 1.5x FlexAttention sliding-window ALiBi (same width)", x, x >= 1.5)
    if "flex_exact" in ms and "ours_exact" in ms:
        x = ms["ours_exact"] / ms["flex_exact"]
        add("exact within 1.3x of FlexAttention exact (ours / flex)", x, x <= 1.3)
    for mode in ("lsh", "lsh_per_sample", "window", "exact"):
        r = res.get("ours_" + mode, {})
        if "bwd_ms" in r and r.get("ms"):
            x = r["bwd_ms"] / r["ms"]
            add(f"backward at most 2.5x the forward ({mode})", x, x <= 2.5)
    est = res.get("ours_lsh_estimates", {}).get("timing_estimates_s")
    if est is not None and "ours_lsh" in ms:
        x = est * 1e3 / ms["ours_lsh"]
        add("estimates at most 10% of the fused lsh forward", 100 * x, x <= 0.1, "{:.1f}%")
    return rows


# ---- a child process that cannot hang the run --------------------------------

CHILD = {"proc": None}


def run_child(cmd, timeout_s, label=None):
    """Runs cmd in its own process group with its output streamed to ours;
    kills the group after timeout_s. Returns (exit code or None, last lines, timed out, wall s)."""
    t0 = time.monotonic()
    print("$ " + (label or " ".join(cmd)) + f"    (timeout {timeout_s:.0f} s)", flush=True)
    try:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)
    except OSError as e:
        return None, [f"cannot start {cmd[0]}: {e}"], False, time.monotonic() - t0
    CHILD["proc"] = proc
    tail = []

    def pump():
        for line in proc.stdout:
            sys.stdout.write(line)
            sys.stdout.flush()
            tail.append(line.rstrip("\n"))
            del tail[:-20]

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    timed_out = False
    try:
        rc = proc.wait(timeout=max(1.0, timeout_s))
    except subprocess.TimeoutExpired:
        timed_out = True
        kill_child()
        rc = None
    reader.join(5)
    CHILD["proc"] = None
    return rc, tail, timed_out, time.monotonic() - t0


def kill_child():
    proc = CHILD["proc"]
    if proc is not None and proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except OSError:
            pass
        proc.wait()


def child_error(rc, tail, timed_out, wall):
    if timed_out:
        return f"bench_cuda timed out after {wall:.0f} s and was killed"
    lines = [t for t in tail if t.startswith("bench_cuda:")] or tail or [""]
    return f"bench_cuda exit {rc}: {lines[-1]}"


def read_ours_json(path, n):
    """bench_cuda's JSON lines for this N: one per mode (ms, or error)."""
    out = {}
    if not os.path.exists(path):
        return out
    with open(path) as f:
        for line in f:
            try:
                r = json.loads(line)
            except ValueError:
                continue
            if r.get("n") == n and "mode" in r:
                out[r["mode"]] = r
    return out


def start_watchdog(report, deadline_s):
    """At budget + grace: write what we have, kill bench_cuda, exit 3. A hung
    GPU call in this process cannot be interrupted, only outlived."""
    def fire(why):
        kill_child()
        report.finish(f"stopped: {why} during {report.current}; the rows below are what was measured")
        print(f"peers.py: {why} during {report.current}", file=sys.stderr, flush=True)
        os._exit(3)

    def watch():
        while report.elapsed() < deadline_s:
            time.sleep(min(1.0, max(0.05, deadline_s - report.elapsed())))
        fire(f"hard deadline of {deadline_s:.0f} s reached")

    threading.Thread(target=watch, daemon=True).start()
    signal.signal(signal.SIGTERM, lambda *_: fire("SIGTERM (run.sh's timeout)"))


# ---- the run ---------------------------------------------------------------

def main(argv):
    args = parse_args(argv)
    sizes = [int(x) for x in args.sizes.split(",") if x]
    os.makedirs(args.out, exist_ok=True)
    os.makedirs(args.work, exist_ok=True)
    report = Report(args)
    report.write()
    start_watchdog(report, args.budget_seconds + args.grace_seconds)

    slopes = standard_slopes(args.heads)
    if args.heads in CPP_STANDARD_SLOPES_HEX:
        verdict, _ = compare_slopes(slopes, CPP_STANDARD_SLOPES_HEX[args.heads].split(),
                                    "hard-coded from plsh::standard_slopes")
    else:
        verdict = f"slopes: no hard-coded C++ slopes for H={args.heads}; only bench_cuda's are compared"
    print(verdict, flush=True)
    report.data["slopes"]["hardcoded"] = {"verdict": verdict, "python_hex": [s.hex() for s in slopes]}
    report.write()

    if args.dry_run:
        return run_sizes(args, report, sizes, slopes, DryGpu(args))

    try:
        import torch
        from torch.nn.attention.flex_attention import BlockMask, flex_attention
        import numpy as np
    except ImportError as e:
        why = f"PyTorch with FlexAttention is not importable here ({type(e).__name__}: {e})"
        report.skip("FlexAttention and the comparison at every N", why)
        report.finish(f"not run: {why}")
        print(f"peers.py: {why}", file=sys.stderr)
        return 2
    report.data["torch"] = torch.__version__
    if not torch.cuda.is_available():
        why = f"torch {torch.__version__} sees no CUDA device"
        report.skip("FlexAttention and the comparison at every N", why)
        report.finish(f"not run: {why}")
        print(f"peers.py: {why}", file=sys.stderr)
        return 2
    return run_sizes(args, report, sizes, slopes, TorchGpu(args, torch, np, BlockMask, flex_attention, slopes))


def run_sizes(args, report, sizes, slopes, gpu):
    bench_built = os.path.exists(args.bench_bin) or args.fake_child_seconds is not None
    model = CostModel(args, scale=args.dry_run_scale if args.dry_run else 1.0, with_ours=bench_built)
    report.data["device"] = gpu.device_name()
    report.write()
    margin = 5.0 * model.scale  # final writes

    def left():
        return args.budget_seconds - report.elapsed()

    def fits(what, estimate):
        if estimate <= left() - margin:
            return True
        report.skip(what, f"estimated {estimate:.0f} s, {max(0.0, left()):.0f} s left")
        return False

    def guarded(what, fn):
        """One failing case (a compile error, out of memory) must not cost the others."""
        try:
            return fn()
        except Exception as e:
            traceback.print_exc()
            msg = (f"{type(e).__name__}: " + (str(e).strip().splitlines() or [""])[0])[:300]
            report.note(f"{what} failed: {msg}")
            return {"error": f"failed: {msg}"}

    def flex_case(variant, n, row):
        """FlexAttention's `variant` at N=n into row["flex_<variant>"], when
        its estimate fits the time left; whether it ran."""
        what = f"N={n} flex {variant}"
        if not fits(what, model.case("flex_" + variant, n)):
            return False
        report.current = what
        row["flex_" + variant] = guarded(what, lambda: gpu.flex(variant, n, model))
        return True

    for index, n in enumerate(sizes):
        core, total, parts = model.size(n)
        breakdown = ", ".join(f"{k} {v:.0f}" for k, v in parts.items() if v > 0)
        print(f"== N={n}: estimated {core:.0f} s for the comparison, {total:.0f} s in all ({breakdown}); "
              f"{left():.0f} s left", flush=True)
        if core > left() - margin:
            report.skip(f"N={n}", f"estimated {core:.0f} s for inputs, flex exact, ours and errors "
                                  f"({breakdown}), only {max(0.0, left()):.0f} s left")
            continue
        row = report.row(n)
        row["estimated_s"] = round(total, 1)
        t_size = time.monotonic()
        report.current = f"N={n} inputs"
        t = time.monotonic()
        made = guarded(f"N={n} inputs", lambda: gpu.make_inputs(n))
        if made is not None:  # the error, noted
            report.skip(f"N={n}", "its inputs could not be made")
            guarded(f"N={n} cleanup", lambda: gpu.drop_inputs(n))
            continue
        model.observe_fixed("inputs", n, time.monotonic() - t)
        report.write()

        # FlexAttention exact first: the reference for every error.
        if flex_case("exact", n, row):
            report.write()

        # Ours in a child process, with a timeout from the estimate.
        if not bench_built:
            row["ours_error"] = f"bench_cuda not built ({args.bench_bin} missing; see build.log)"
            report.write()
        elif fits(f"N={n} ours", model.case("ours", n)):
            report.current = f"N={n} ours (bench_cuda)"
            report.write()
            guarded("freeing PyTorch's cached memory for bench_cuda", gpu.before_child)
            estimate = model.case("ours", n)
            timeout = min(left() - margin, max(3 * estimate, estimate + 60 * model.scale))
            ours_json = os.path.join(args.work, "ours.jsonl")
            if os.path.exists(ours_json):
                os.remove(ours_json)
            modes = model.ours_modes(n)
            if "exact" not in modes:
                row["ours_exact"] = {"skipped": f"not above N={args.ours_exact_max_n} (--ours-exact-max-n)"}
            if args.fake_child_seconds is not None:
                cmd = fake_bench_cuda(args, n, modes, ours_json)
            else:
                cmd = [args.bench_bin, "--n", str(n), "--inputs", args.work, "--heads", str(args.heads),
                       "--kv-heads", str(args.heads), "--dim", str(args.dim), "--dtype", "bf16",
                       "--samples", str(args.samples), "--seed", str(args.seed), "--modes", ",".join(modes),
                       "--warmup", str(args.warmup), "--repeats", str(args.repeats),
                       "--max-seconds", str(args.max_seconds_per_case * model.scale), "--json", ours_json,
                       "--write-out"] + ([] if args.no_backward else ["--backward"])
            label = f"fake bench_cuda: sleep {args.fake_child_seconds} s, then JSON" if args.fake_child_seconds else None
            rc, tail, timed_out, wall = run_child(cmd, timeout, label)
            found = read_ours_json(ours_json, n)
            calls = 0.0
            for mode in modes:
                r = found.get(mode)
                if r is None:
                    continue
                row["ours_" + mode] = {k: v for k, v in r.items() if k not in ("slopes_hex",)}
                if "ms" in r:
                    model.observe_call("ours_" + mode, n, r["ms"] * 1e-3)
                    calls += model.timed_seconds(r["ms"] * 1e-3)
                if "slopes_hex" in r and "bench_cuda" not in report.data["slopes"]:
                    verdict, _ = compare_slopes(slopes, r["slopes_hex"], "what bench_cuda used")
                    report.data["slopes"]["bench_cuda"] = {"verdict": verdict, "cpp_hex": r["slopes_hex"]}
                if mode == "window" and "windows" in r:
                    ours_w = r["windows"]
                    py_w = window_widths(slopes, args.window_eps)
                    if ours_w != py_w:
                        report.note(f"window widths differ: C++ {ours_w}, Python {py_w}")
            if rc != 0:
                row["ours_error"] = child_error(rc, tail, timed_out, wall)
            if not timed_out:  # a killed child's wall time is its timeout, not its cost
                model.observe_fixed("ours", n, max(0.0, wall - calls))
            report.write()

            report.current = f"N={n} errors of ours"
            t = time.monotonic()
            guarded(f"N={n} errors of ours", lambda: gpu.ours_errors(n, row, modes))
            model.observe_fixed("errors", n, time.monotonic() - t)
            report.write()

        if flex_case("window", n, row):
            report.write()
        if n > args.flex_lsh_max_n:
            row["flex_lsh"] = {"skipped": f"not above N={args.flex_lsh_max_n} (dense block tables of "
                                          f"{n // 128}^2 entries per (sample, head))"}
        elif flex_case("lsh", n, row):
            guarded(f"N={n} ours lsh vs flex lsh", lambda: gpu.cross_check_lsh(n, row))
            report.write()
        guarded(f"N={n} cleanup", lambda: gpu.drop_inputs(n))
        row["wall_s"] = round(time.monotonic() - t_size, 1)
        report.current = f"after N={n}"
        report.write()

        # The ceilings once, after the first size: the headline comes first.
        if index == 0 and fits("ceilings", model.case("ceilings", n)):
            report.current = "ceilings"
            report.data["ceilings"] = guarded("ceilings", gpu.ceilings)
            report.write()
    if report.data["ceilings"] is None and fits("ceilings", model.case("ceilings", 0)):
        report.current = "ceilings"
        report.data["ceilings"] = guarded("ceilings", gpu.ceilings)
    report.current = "end"
    report.finish("finished")
    print(f"peers.py: finished in {report.elapsed():.0f} s; {os.path.join(args.out, 'results.md')}", flush=True)
    return 0


FAKE_BENCH_CUDA = """
import json, sys, time
seconds, path, n, modes, slopes_hex, windows = sys.argv[1:]
time.sleep(float(seconds))
with open(path, "a") as f:
    for mode in modes.split(","):
        r = {"impl": "ours", "mode": mode, "n": int(n), "ms": 1.0, "runs": 5, "flops_done": 1e12, "fake": True,
             "slopes_hex": slopes_hex.split()}
        if mode == "lsh_estimates":
            r["timing_estimates_s"] = 1e-4
        else:
            r["bwd_ms"] = 2.0
        if mode == "window":
            r["windows"] = json.loads(windows)
        f.write(json.dumps(r) + "\\n")
print("fake bench_cuda: wrote", modes, "for n =", n)
"""


def fake_bench_cuda(args, n, modes, ours_json):
    """Dry run: a child that sleeps, then writes bench_cuda's JSON lines
    (with the C++ slopes hard-coded above); killed if it sleeps too long."""
    slopes_hex = CPP_STANDARD_SLOPES_HEX.get(args.heads, "")
    windows = json.dumps(window_widths(standard_slopes(args.heads), args.window_eps))
    return [sys.executable, "-c", FAKE_BENCH_CUDA, str(args.fake_child_seconds), ours_json, str(n), ",".join(modes),
            slopes_hex, windows]


class DryGpu:
    """Stands in for TorchGpu in --dry-run: sleeps for the estimated time of
    each case and records fake figures, so that the budget, the skips, the
    timeouts and the incremental results can be rehearsed without a GPU."""

    def __init__(self, args):
        self.args = args
        self.model = None

    def device_name(self):
        return "dry run (no GPU)"

    def _sleep(self, what, seconds):
        if self.args.dry_run_hang and what == self.args.dry_run_hang:
            print(f"dry run: {what} hangs", flush=True)
            while True:
                time.sleep(3600)
        time.sleep(seconds)

    def make_inputs(self, n):
        self._sleep("inputs", CostModel(self.args, self.args.dry_run_scale).fixed_seconds("inputs", n))

    def flex(self, variant, n, model):
        case = "flex_" + variant
        seconds = model.case(case, n)
        self._sleep(case, seconds)
        call = model.call_seconds(case, n)
        model.compiled.add(case)
        model.observe_call(case, n, call)
        model.observe_fixed(case, n, model.fixed_seconds(case, n))
        return {"ms": call * 1e3 / self.args.dry_run_scale, "err": 0.0 if variant == "exact" else 1e-3,
                "dry_run": True}

    def ours_errors(self, n, row, modes):
        time.sleep(CostModel(self.args, self.args.dry_run_scale).fixed_seconds("errors", n))

    def cross_check_lsh(self, n, row):
        pass

    def before_child(self):
        pass

    def drop_inputs(self, n):
        pass

    def ceilings(self):
        time.sleep(PRIOR_FIXED["ceilings"][0] * self.args.dry_run_scale)
        return {"matmul_tflops": 800.0, "copy_tbs": 4.3, "dry_run": True}


class TorchGpu:
    """The GPU side: inputs, FlexAttention peers, errors against the reference."""

    BLOCK = 128

    def __init__(self, args, torch, np, BlockMask, flex_attention, slopes):
        self.args, self.torch, self.np, self.BlockMask = args, torch, np, BlockMask
        self.dev = torch.device("cuda")
        self.slopes = slopes
        self.slopes_t = torch.tensor(slopes, device=self.dev, dtype=torch.float32)
        self.windows_t = torch.tensor(window_widths(slopes, args.window_eps), device=self.dev, dtype=torch.int64)
        # One compilation per variant for every N: dynamic shapes from the
        # first call, not a static compile and then a dynamic recompile.
        self.flex_fn = torch.compile(flex_attention, dynamic=True)
        # Past the recompile limit Dynamo would fall back to eager
        # flex_attention, which materialises N^2 scores: never at these N.
        try:
            import torch._dynamo
            for name in ("recompile_limit", "cache_size_limit"):
                if hasattr(torch._dynamo.config, name):
                    setattr(torch._dynamo.config, name, max(64, getattr(torch._dynamo.config, name)))
            # Each recompilation and its reason in the log: "compiled once" is checked, not assumed.
            torch._logging.set_logs(recompiles=True)
        except Exception as e:
            print(f"peers.py: Dynamo settings not applied ({type(e).__name__}: {e})", flush=True)
        self.qh = self.kh = self.vh = None
        self.ref = None
        self.flex_lsh_out = None
        self.bins = None  # [g, H, N] int64: the same-bin mask_mod's table
        self.define_mods()

    def define_mods(self):
        """score_mod and mask_mods, each one function object for the whole run
        (a fresh closure per call could count as a new function to Dynamo)."""
        torch, slopes_t, windows_t, gpu = self.torch, self.slopes_t, self.windows_t, self

        def alibi(score, b, h, q_idx, kv_idx):
            return score - slopes_t[h] * (q_idx - kv_idx).abs().to(torch.float32)

        def causal_mod(b, h, q_idx, kv_idx):
            return q_idx >= kv_idx

        def window_mod(b, h, q_idx, kv_idx):
            return (q_idx >= kv_idx) & (q_idx - kv_idx < windows_t[h])

        def same_bin(b, h, q_idx, kv_idx):
            bins = gpu.bins
            return (q_idx >= kv_idx) & (bins[b, h, q_idx] == bins[b, h, kv_idx])

        self.alibi, self.causal_mod, self.window_mod, self.same_bin = alibi, causal_mod, window_mod, same_bin

    def device_name(self):
        p = self.torch.cuda.get_device_properties(0)
        return f"{p.name}, {p.multi_processor_count} SMs, {p.total_memory / 2 ** 30:.0f} GiB"

    def timed(self, fn):
        """Median ms of CUDA-event-timed calls after warm-up (fewer when slow),
        and the wall seconds of the first call (compilation included)."""
        torch, a = self.torch, self.args
        t = time.monotonic()
        out = None
        for _ in range(a.warmup):
            out = fn()
        torch.cuda.synchronize()
        first_s = (time.monotonic() - t) / max(1, a.warmup)
        times = []
        reps = a.repeats
        for r in range(reps):
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = fn()
            stop.record()
            stop.synchronize()
            times.append(start.elapsed_time(stop))
            if r == 0 and times[0] * 1e-3 * reps > a.max_seconds_per_case:
                reps = max(1, int(a.max_seconds_per_case / (times[0] * 1e-3)))
            if len(times) >= reps:
                break
        return statistics.median(times), out, first_s, len(times)

    def make_inputs(self, n):
        torch, H, D = self.torch, self.args.heads, self.args.dim
        gen = torch.Generator(device=self.dev).manual_seed(1000 + n)
        q = torch.randn(1, n, H, D, device=self.dev, dtype=torch.bfloat16, generator=gen)
        k = torch.randn(1, n, H, D, device=self.dev, dtype=torch.bfloat16, generator=gen)
        v = torch.randn(1, n, H, D, device=self.dev, dtype=torch.bfloat16, generator=gen)
        for name, x in (("q", q), ("k", k), ("v", v)):
            x.view(torch.int16).cpu().numpy().tofile(os.path.join(self.args.work, f"{name}.bin"))
        self.qh, self.kh, self.vh = (x.transpose(1, 2).contiguous() for x in (q, k, v))  # [1, H, N, D]
        del q, k, v

    def before_child(self):
        self.torch.cuda.synchronize()
        self.torch.cuda.empty_cache()

    def drop_inputs(self, n):
        for name in ("q", "k", "v", "out_ours_lsh", "out_ours_lsh_per_sample", "out_ours_window", "out_ours_exact"):
            path = os.path.join(self.args.work, f"{name}.bin")
            if os.path.exists(path):
                os.remove(path)
        self.qh = self.kh = self.vh = self.ref = self.flex_lsh_out = None
        self.torch.cuda.empty_cache()

    # -- block masks ----------------------------------------------------------
    def block_mask_from(self, partial, full, n, mask_mod):
        """BlockMask from dense [B, H, nq, nkv] partial/full block flags."""
        def ordered(flags):
            num = flags.sum(-1, dtype=self.torch.int32)
            idx = self.torch.argsort((~flags).to(self.torch.int8), dim=-1, stable=True).to(self.torch.int32)
            return num.contiguous(), idx.contiguous()
        kv_num, kv_idx = ordered(partial)
        full_num, full_idx = ordered(full)
        try:
            return self.BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=self.BLOCK,
                                                 mask_mod=mask_mod, seq_lengths=(n, n))
        except TypeError:  # a PyTorch without seq_lengths: N is a multiple of BLOCK here anyway
            return self.BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=self.BLOCK,
                                                 mask_mod=mask_mod)

    def band_mask(self, n, width_per_head, mask_mod):
        """Causal blocks holding a pair with |i - j| < width (None: any); full where every pair is allowed."""
        torch, B = self.torch, self.BLOCK
        nb = n // B
        qb = torch.arange(nb, device=self.dev).view(1, 1, nb, 1)
        kb = torch.arange(nb, device=self.dev).view(1, 1, 1, nb)
        q0, q1 = qb * B, qb * B + B - 1
        k0, k1 = kb * B, kb * B + B - 1
        any_causal = k0 <= q1
        all_causal = k1 <= q0
        if width_per_head is None:
            partial = any_causal & ~all_causal
            return self.block_mask_from(partial.expand(1, 1, nb, nb), all_causal.expand(1, 1, nb, nb), n, mask_mod)
        w = width_per_head.view(1, -1, 1, 1)
        touched = any_causal & ((q0 - k1).clamp(min=0) < w)
        full = all_causal & ((q1 - k0) < w)
        return self.block_mask_from(touched & ~full, full, n, mask_mod)

    # -- FlexAttention ----------------------------------------------------------
    def flex(self, variant, n, model):
        t = time.monotonic()
        if variant == "lsh":
            return self.flex_lsh(n, model, t)
        if variant == "exact":
            bm = self.band_mask(n, None, self.causal_mod)
        else:
            bm = self.band_mask(n, self.windows_t, self.window_mod)
        ms, out, first_s, runs = self.timed(lambda: self.flex_fn(self.qh, self.kh, self.vh, score_mod=self.alibi,
                                                                 block_mask=bm))
        r = {"ms": ms, "runs": runs, "first_call_s": round(first_s, 2)}
        if variant == "exact":
            self.ref = out.float()
        elif self.ref is not None:
            r["err"] = ((out.float() - self.ref).norm() / self.ref.norm()).item()
        if not self.args.no_backward:
            r.update(self.flex_backward(bm, out, ms))
        bm = out = None  # free before the next case
        self.observe(model, "flex_" + variant, n, ms, first_s, runs, time.monotonic() - t)
        print(f"flex {variant:6s} N={n}: {ms:.3f} ms ({runs} runs; first call {first_s:.1f} s)", flush=True)
        return r

    def flex_backward(self, bm, out, fwd_ms):
        """Forward and backward together (the backward compiled on its first
        call); bwd_ms is their median less the forward's."""
        torch = self.torch
        q, k, v = (x.detach().clone().requires_grad_(True) for x in (self.qh, self.kh, self.vh))
        gen = torch.Generator(device=self.dev).manual_seed(77)
        dout = torch.randn(out.shape, device=self.dev, dtype=out.dtype, generator=gen)

        def fwd_bwd():
            q.grad = k.grad = v.grad = None
            o = self.flex_fn(q, k, v, score_mod=self.alibi, block_mask=bm)
            o.backward(dout)
            return o

        ms, _, first_s, runs = self.timed(fwd_bwd)
        q = k = v = dout = None
        torch.cuda.empty_cache()
        print(f"flex backward: forward + backward {ms:.3f} ms ({runs} runs; first call {first_s:.1f} s)", flush=True)
        return {"fwd_bwd_ms": ms, "bwd_ms": max(0.0, ms - fwd_ms), "bwd_runs": runs, "bwd_first_call_s": round(first_s, 2)}

    def observe(self, model, case, n, ms, first_s, runs, wall):
        call = ms * 1e-3
        compile_s = max(0.0, first_s - call) if case not in model.compiled else 0.0
        if compile_s:
            print(f"{case}: compiled in about {compile_s:.0f} s", flush=True)
        model.compiled.add(case)
        model.observe_call(case, n, call)
        model.observe_fixed(case, n, max(0.0, wall - compile_s - self.args.warmup * call - runs * call))

    def flex_lsh(self, n, model, t_case):
        """The per-sample reduction with FlexAttention: samples folded into the
        batch (q, k, v expanded, not copied), one same-bin causal block mask per
        (sample, head), outputs merged by log-sum-exp (SPEC section 3)."""
        torch, H, D, S, B = self.torch, self.args.heads, self.args.dim, self.args.samples, self.BLOCK
        dev, seed = self.dev, self.args.seed
        nb = n // B
        # Samples per call: the dense block tables are 2 x g x H x nb^2 int32; a
        # divisor of S keeps every call the same shape.
        limit = max(1, int(4e9 // (8 * H * nb * nb)))
        group = max(d for d in range(1, S + 1) if S % d == 0 and d <= limit)
        pos = torch.arange(n, device=dev, dtype=torch.float64)
        self.bins = torch.empty(group, H, n, device=dev, dtype=torch.int64)
        bins_buf = self.bins

        draws = [[draw_hash(seed, h, s, 1.0 / self.slopes[h]) for h in range(H)] for s in range(S)]
        masks = []
        for g0 in range(0, S, group):
            g = min(group, S - g0)
            pitch = torch.tensor([[draws[g0 + i][h][0] for h in range(H)] for i in range(g)], device=dev,
                                 dtype=torch.float64)
            shift = torch.tensor([[draws[g0 + i][h][1] for h in range(H)] for i in range(g)], device=dev,
                                 dtype=torch.float64)
            bins = torch.floor((pos.view(1, 1, n) - shift.view(g, H, 1)) / pitch.view(g, H, 1)).to(torch.int64)
            # Blocks: bins are monotone in position, so a (q block, kv block) pair
            # shares a bin iff their bin intervals overlap.
            bq0 = bins[:, :, 0::B].unsqueeze(-1)
            bq1 = bins[:, :, B - 1::B].unsqueeze(-1)
            bk0 = bins[:, :, 0::B].unsqueeze(-2)
            bk1 = bins[:, :, B - 1::B].unsqueeze(-2)
            qb = torch.arange(nb, device=dev).view(1, 1, nb, 1)
            kb = torch.arange(nb, device=dev).view(1, 1, 1, nb)
            touched = (kb <= qb) & (bk0 <= bq1) & (bq0 <= bk1)
            full = (kb < qb) & (bq0 == bq1) & (bk0 == bk1) & (bq0 == bk0)
            masks.append((g, bins, self.block_mask_from(touched & ~full, full, n, self.same_bin)))

        expand = [True]
        qh, kh, vh = self.qh, self.kh, self.vh

        def call(g, bm):
            if expand[0]:
                try:
                    return self.flex_fn(qh.expand(g, -1, -1, -1), kh.expand(g, -1, -1, -1),
                                        vh.expand(g, -1, -1, -1), block_mask=bm, return_lse=True)
                except Exception as e:  # a FlexAttention that refuses stride-0 batches: copy instead
                    print(f"flex lsh: expanded batch refused ({type(e).__name__}: {e}); repeating q, k, v",
                          flush=True)
                    expand[0] = False
            return self.flex_fn(qh.repeat(g, 1, 1, 1), kh.repeat(g, 1, 1, 1), vh.repeat(g, 1, 1, 1),
                                block_mask=bm, return_lse=True)

        def run_all():
            acc = torch.zeros(1, H, n, D, device=dev, dtype=torch.float32)
            lse_acc = torch.full((1, H, n), -float("inf"), device=dev, dtype=torch.float32)
            for g, bins, bm in masks:
                bins_buf[:g].copy_(bins)
                out, lse = call(g, bm)
                lse_new = torch.logaddexp(lse_acc, torch.logsumexp(lse, dim=0, keepdim=True))
                acc = acc * torch.exp(lse_acc - lse_new).unsqueeze(-1) + \
                    (out.float() * torch.exp(lse - lse_new).unsqueeze(-1)).sum(0, keepdim=True)
                lse_acc = lse_new
            return acc.to(torch.bfloat16)

        ms, out, first_s, runs = self.timed(run_all)
        r = {"ms": ms, "runs": runs, "first_call_s": round(first_s, 2), "samples_per_call": group}
        if self.ref is not None:
            r["err"] = ((out.float() - self.ref).norm() / self.ref.norm()).item()
        self.flex_lsh_out = out
        masks.clear()
        self.observe(model, "flex_lsh", n, ms, first_s, runs, time.monotonic() - t_case)
        print(f"flex lsh    N={n}: {ms:.3f} ms ({runs} runs; first call {first_s:.1f} s)", flush=True)
        return r

    # -- errors -------------------------------------------------------------------
    def load_ours(self, n, mode):
        path = os.path.join(self.args.work, f"out_ours_{mode}.bin")
        if not os.path.exists(path):
            return None
        raw = self.torch.from_numpy(self.np.fromfile(path, dtype=self.np.int16)).to(self.dev)
        if raw.numel() != n * self.args.heads * self.args.dim:
            return None
        return raw.view(self.torch.bfloat16).view(1, n, self.args.heads, self.args.dim).transpose(1, 2).float()

    def ours_errors(self, n, row, modes):
        for mode in modes:
            key = "ours_" + mode
            path = os.path.join(self.args.work, f"out_ours_{mode}.bin")
            if key in row and "ms" in row[key] and self.ref is not None:
                ours = self.load_ours(n, mode)
                if ours is not None:
                    row[key]["err"] = ((ours - self.ref).norm() / self.ref.norm()).item()
                    del ours
            # Ours lsh (both algorithms) stays on disk for the cross-check with FlexAttention lsh.
            if mode not in ("lsh", "lsh_per_sample") and os.path.exists(path):
                os.remove(path)

    def cross_check_lsh(self, n, row):
        """The same draws and estimator on both sides: they must agree to bf16
        rounding, whatever the lsh error is (both of our algorithms)."""
        for mode in ("lsh", "lsh_per_sample"):
            path = os.path.join(self.args.work, f"out_ours_{mode}.bin")
            if self.flex_lsh_out is not None and "ms" in row.get("ours_" + mode, {}):
                ours = self.load_ours(n, mode)
                if ours is not None:
                    other = self.flex_lsh_out.float()
                    row["ours_" + mode]["err_vs_flex_lsh"] = ((ours - other).norm() / other.norm()).item()
                    del ours, other
            if os.path.exists(path):
                os.remove(path)

    def ceilings(self):
        torch = self.torch
        a = torch.randn(8192, 8192, device=self.dev, dtype=torch.bfloat16)
        b = torch.randn(8192, 8192, device=self.dev, dtype=torch.bfloat16)
        mm_ms, _, _, _ = self.timed(lambda: a @ b)
        src = torch.empty(1 << 31, device=self.dev, dtype=torch.uint8).random_(0, 255)
        dst = torch.empty_like(src)
        cp_ms, _, _, _ = self.timed(lambda: dst.copy_(src))
        a = b = src = dst = None
        torch.cuda.empty_cache()
        c = {"matmul_tflops": 2 * 8192 ** 3 / (mm_ms * 1e-3) / 1e12, "copy_tbs": 2 * (1 << 31) / (cp_ms * 1e-3) / 1e12}
        print(f"ceilings: bf16 matmul {c['matmul_tflops']:.0f} TFLOP/s, copy {c['copy_tbs']:.2f} TB/s", flush=True)
        return c


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
