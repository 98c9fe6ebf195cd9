#!/usr/bin/python3
"""Coverage of the probe's upper bound (ProbeEstimate.rel_err_upper).

Two parts:

  simulate  Reads the populations of populations.py (every row's error, per
            head, of whole requests) and draws the probe's stratified row
            sample (64 rows per head, as compute_estimates does) K times per
            request, applying the bound's formula (kernels/src/probe_bound.cpp,
            restated in numpy below). This is where the constants were chosen.
  validate  Held-out requests through the real implementation: `plsh compute`
            with its estimates on inputs of other sizes and seeds than the
            simulation's, each compared with exact attention. Coverage is the
            share of requests whose true error is <= rel_err_upper.

    bench/pareto/calibrate.py simulate --populations bench/out/populations
    bench/pareto/calibrate.py validate --plsh build/bin/plsh --out bench/out/validate
"""

import argparse
import collections
import glob
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

ROWS = 64


def tail_growth(gamma, m):
    gamma = np.asarray(gamma, float)
    one = np.abs(gamma - 1) < 1e-9
    safe = np.where(one, 0.5, 1 - gamma)
    integral = np.where(one, np.log(m), np.expm1(safe * np.log(m)) / safe)
    return m ** (gamma - 1) * (integral + (1 + m ** (-gamma)) / 2)


def upper_bound(e, n, population):
    """The bound for K probes at once: e, n [K, H, r] err2 and ref2 of the rows."""
    K, H, r = e.shape
    se, sn = e.sum(2), n.sum(2)
    Q = se.sum(1) / sn.sum(1)
    z = e - Q[:, None, None] * n
    s2 = ((z - z.mean(2, keepdims=True)) ** 2).sum(2) / (r - 1)
    var = (r * s2 * (1 - r / population)).sum(1)
    se_q = np.sqrt(var) / sn.sum(1)
    flat = -np.sort(-e.reshape(K, H * r), axis=1)
    k = max(4, int(np.floor(np.sqrt(H * r))))
    with np.errstate(divide="ignore", invalid="ignore"):
        gamma = np.mean(np.log(flat[:, :k] / flat[:, k:k + 1]), axis=1)
        share = flat[:, 0] / se.sum(1)
    u2 = Q + 2 * se_q + 2 * Q * share * tail_growth(gamma, population / r)
    u = np.sqrt(np.maximum(u2, 0))
    # What the probe reported before: rel_err + 2 rel_err_stderr (delta method).
    normal = np.sqrt(Q) + 2 * se_q / (2 * np.sqrt(np.maximum(Q, 1e-300)))
    return np.where(flat[:, k] > 0, u, np.inf), np.sqrt(Q), normal


def simulate(a):
    rng = np.random.default_rng(0)
    rows = []
    for path in sorted(glob.glob(f"{a.populations}/*.npz")):
        name = os.path.basename(path)[:-4]
        family, layout = name.split("-")[0], "-".join(name.split("-")[1:3])
        d = np.load(path)
        ref2 = d["ref2"].astype(np.float64)
        N, H = ref2.shape
        t = np.arange(ROWS)
        lo, hi = (t * N) // ROWS, ((t + 1) * N) // ROWS
        idx = np.minimum(lo + np.floor(rng.random((a.draws, H, ROWS)) * (hi - lo)).astype(int), hi - 1)
        for key in d.files:
            if key == "ref2":
                continue
            err2 = d[key].astype(np.float64)
            true = np.sqrt(err2.sum() / ref2.sum())
            e = err2.T[np.arange(H)[None, :, None], idx]
            n = ref2.T[np.arange(H)[None, :, None], idx]
            u, est, normal = upper_bound(e, n, N)
            flat = np.sort(err2.ravel())[::-1]
            rows.append({"family": family, "layout": layout, "config": key, "mode": key.split("_")[0],
                         "true": true, "coverage": float(np.mean(true <= u)),
                         "normal_coverage": float(np.mean(true <= normal)),
                         "median_upper_over_true": float(np.median(u / true)),
                         "est_over_true": est / true,
                         "top1": float(flat[:max(1, len(flat) // 100)].sum() / flat.sum())})
    findings(rows)
    report(rows, "simulated probes (%d per request type)" % a.draws)


def findings(rows):
    """The probe's estimate against the truth, and where rel_err + 2 stderr fails."""
    print("probe rel_err / true error over simulated probes, and the top 1% of rows' share of the squared error")
    print(f"{'family':10s} {'layout':12s} {'config':34s} {'true':>7s} {'mean':>6s} {'2.5%':>6s} {'min':>6s} "
          f"{'top 1%':>7s} {'cover(+2se)':>11s}")
    for r in rows:
        if not (r["config"].startswith("lsh_samples=16_sampling=iid") or r["config"].startswith("lsh_samples=64_sampling=iid")
                or r["config"] in ("window_window-eps=0.01", "window_window-eps=1e-3")):
            continue
        q = r["est_over_true"]
        print(f"{r['family']:10s} {r['layout']:12s} {r['config']:34s} {r['true']:7.3g} {q.mean():6.3f} "
              f"{np.quantile(q, 0.025):6.3f} {q.min():6.3f} {r['top1']:7.2f} {r['normal_coverage']:11.3f}")
    cov = np.mean([r["normal_coverage"] for r in rows])
    print(f"rel_err + 2 rel_err_stderr covered the true error in {cov:.3f} of simulated probes over all {len(rows)} request types")


def report(rows, what):
    print(f"coverage of rel_err_upper, {what}")
    groups = collections.defaultdict(list)
    for r in rows:
        groups[(r["family"], r["mode"])].append(r)
        groups[("all", r["mode"])].append(r)
        groups[("all", "all")].append(r)
    print(f"{'family':10s} {'mode':7s} {'requests':>8s} {'coverage':>9s} {'min':>6s} {'median U/true':>14s}")
    for (family, mode), g in sorted(groups.items()):
        cov = np.array([r["coverage"] for r in g])
        over = np.array([r["median_upper_over_true"] for r in g])
        print(f"{family:10s} {mode:7s} {len(g):8d} {cov.mean():9.4f} {cov.min():6.3f} {np.median(over):14.2f}")
    worst = sorted(rows, key=lambda r: r["coverage"])[:5]
    print("lowest:", "; ".join(f"{r['family']} {r['layout']} {r['config']} true {r['true']:.3g}: {r['coverage']:.3f}"
                               for r in worst))


CONFIGS = (
    [("window", {"window-eps": e}) for e in ("0.3", "0.1", "0.03", "0.01", "1e-3")]
    + [("lsh", {"samples": s, "sampling": smp}) for s in ("16", "64", "256") for smp in ("iid", "ash")]
)


def plsh_compute(plsh, d, tag, args):
    cmd = [plsh, "compute", "--q", f"{d}/q.npy", "--k", f"{d}/k.npy", "--v", f"{d}/v.npy",
           "--out", f"{d}/{tag}.npy", "--meta", f"{d}/{tag}.json"] + args
    subprocess.run(cmd, check=True)
    with open(f"{d}/{tag}.json") as f:
        return np.load(f"{d}/{tag}.npy").astype(np.float64), json.load(f)


def validate(a):
    os.makedirs(a.out, exist_ok=True)
    rows = []
    csv_path = f"{a.out}/validate.csv"
    done = set()
    if os.path.exists(csv_path):
        with open(csv_path) as f:
            for line in f.read().splitlines()[1:]:
                p = line.split(",")
                rows.append({"family": p[0], "layout": p[1], "n": int(p[2]), "seed": int(p[3]), "config": p[4],
                             "mode": p[4].split("_")[0], "true": float(p[5]), "rel_err": float(p[6]),
                             "upper": float(p[7])})
                done.add((p[0], p[1], p[2], p[3]))
    else:
        with open(csv_path, "w") as f:
            f.write("family,layout,n,seed,config,true,rel_err,rel_err_upper\n")
    for n, family, (causal, kv_div), seed in itertools.product(
            [int(x) for x in a.sizes.split(",")], a.families.split(","), [(True, 1), (False, 4)],
            [int(x) for x in a.seeds.split(",")]):
        layout = f"{'causal' if causal else 'full'}-kv{a.heads // kv_div}"
        if (family, layout, str(n), str(seed)) in done:
            continue
        t0 = time.time()
        q, k, v = inputs.make(family, n, a.heads, a.heads // kv_div, a.head_dim, 5000 + seed)
        with tempfile.TemporaryDirectory() as d:
            for x, arr in (("q", q), ("k", k), ("v", v)):
                np.save(f"{d}/{x}.npy", arr)
            common = ["--threads", str(a.threads), "--seed", str(seed)] + (["--causal"] if causal else [])
            exact, _ = plsh_compute(a.plsh, d, "exact", ["--mode", "exact"] + common)
            norm = np.linalg.norm(exact)
            new = []
            for mode, extra in CONFIGS:
                args = ["--mode", mode] + common + [x for kv in extra.items() for x in (f"--{kv[0]}", kv[1])]
                out, meta = plsh_compute(a.plsh, d, "o", args)
                probe = meta["summary"]["probe"]
                upper = probe["rel_err_upper"]
                key = mode + "".join(f"_{k}={v}" for k, v in extra.items())
                new.append({"family": family, "layout": layout, "n": n, "seed": seed, "config": key, "mode": mode,
                            "true": float(np.linalg.norm(out - exact) / norm), "rel_err": probe["rel_err"],
                            "upper": float("inf") if upper is None else upper})
        with open(csv_path, "a") as f:
            for r in new:
                f.write(f"{r['family']},{r['layout']},{r['n']},{r['seed']},{r['config']},{r['true']:.6g},"
                        f"{r['rel_err']:.6g},{r['upper']:.6g}\n")
        rows += new
        print(f"{family} {layout} n={n} seed={seed}: {time.time() - t0:.0f} s", flush=True)
    for r in rows:
        r["coverage"] = 1.0 if r["true"] <= r["upper"] else 0.0
        r["median_upper_over_true"] = r["upper"] / r["true"] if r["true"] > 0 else 1.0
    report(rows, f"{len(rows)} held-out requests through plsh compute")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("simulate")
    s.add_argument("--populations", default="bench/out/populations")
    s.add_argument("--draws", type=int, default=300)
    v = sub.add_parser("validate")
    v.add_argument("--plsh", default="build/bin/plsh")
    v.add_argument("--out", default="bench/out/validate")
    v.add_argument("--sizes", default="2048,8192")
    v.add_argument("--families", default="gauss,peaked,longrange,sharp")
    v.add_argument("--seeds", default="2,3")
    v.add_argument("--heads", type=int, default=8)
    v.add_argument("--head-dim", type=int, default=64)
    v.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    simulate(a) if a.cmd == "simulate" else validate(a)


if __name__ == "__main__":
    main()
