#!/usr/bin/python3
"""Per-row errors of whole requests, for calibrating the probe's upper bound.

For each case (input family, causal or not, GQA or not, input seed) it runs
`plsh compute` once exactly and once per approximate configuration (window
at several eps, lsh at several s and samplers), and saves every row's
squared error ||o~_i - o*_i||^2 and squared norm ||o*_i||^2 per head
(float32 [B * Nq, H]) into OUT/<case>.npz. calibrate.py then draws the
probe's row samples from these populations many times over.

    bench/pareto/populations.py --plsh build/bin/plsh --out bench/out/populations
"""

import argparse
import itertools
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import inputs  # noqa: E402

CONFIGS = (
    [("window", {"window-eps": e}) for e in ("0.3", "0.1", "0.03", "0.01", "1e-3", "1e-4")]
    + [("lsh", {"samples": s, "sampling": smp}) for s in ("16", "64", "256") for smp in ("iid", "ash")]
)


def run(plsh, d, tag, mode, extra, causal, threads, seed):
    args = [plsh, "compute", "--q", f"{d}/q.npy", "--k", f"{d}/k.npy", "--v", f"{d}/v.npy", "--mode", mode,
            "--out", f"{d}/{tag}.npy", "--meta", f"{d}/{tag}.json", "--threads", str(threads),
            "--seed", str(seed), "--no-estimates"]
    if causal:
        args.append("--causal")
    for key, value in extra.items():
        args += [f"--{key}", value]
    subprocess.run(args, check=True)
    with open(f"{d}/{tag}.json") as f:
        meta = json.load(f)
    return np.load(f"{d}/{tag}.npy"), meta


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--plsh", default="build/bin/plsh")
    ap.add_argument("--out", default="bench/out/populations")
    ap.add_argument("--n", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--families", default="gauss,peaked,longrange,sharp")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    cases = []
    for family, (causal, kv_heads), seed in itertools.product(
            a.families.split(","), [(True, a.heads), (False, a.heads // 4)], range(a.seeds)):
        cases.append((family, causal, kv_heads, seed))
    for family, causal, kv_heads, seed in cases:
        name = f"{family}-{'causal' if causal else 'full'}-kv{kv_heads}-s{seed}"
        path = f"{a.out}/{name}.npz"
        if os.path.exists(path):
            continue
        t0 = time.time()
        q, k, v = inputs.make(family, a.n, a.heads, kv_heads, a.head_dim, 1000 + seed)
        with tempfile.TemporaryDirectory() as d:
            for x, arr in (("q", q), ("k", k), ("v", v)):
                np.save(f"{d}/{x}.npy", arr)
            exact, _ = run(a.plsh, d, "exact", "exact", {}, causal, a.threads, seed)
            exact = exact.astype(np.float64)[0]  # [N, H, D]
            ref2 = (exact ** 2).sum(-1)
            arrays = {"ref2": ref2.astype(np.float32)}
            summary = {}
            for i, (mode, extra) in enumerate(CONFIGS):
                out, meta = run(a.plsh, d, f"c{i}", mode, extra, causal, a.threads, seed)
                err2 = ((out.astype(np.float64)[0] - exact) ** 2).sum(-1)
                key = mode + "".join(f"_{k}={v}" for k, v in extra.items())
                arrays[key] = err2.astype(np.float32)
                summary[key] = {"true_rel_err": float(np.sqrt(err2.sum() / ref2.sum())), "flops": meta["flops"]}
        np.savez_compressed(path, **arrays)
        with open(f"{a.out}/{name}.json", "w") as f:
            json.dump(summary, f, indent=1)
        print(f"{name}: {time.time() - t0:.0f} s; " +
              ", ".join(f"{k} {v['true_rel_err']:.3g}" for k, v in summary.items()), flush=True)


if __name__ == "__main__":
    main()
