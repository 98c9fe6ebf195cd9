#!/usr/bin/python3
"""Error against time and against FLOPs for every mode, on the CPU via
`plsh compute` (no server): exact, window at several eps, lsh at several s
with each sampler, and error-targeted requests at several targets, at
n = 8192 and 32768 (B = 1, H = 8, D = 64, causal, standard slopes), on
Gaussian and peaked inputs (bench/pareto/inputs.py). The true error is the
relative L2 error of the whole output against exact attention on the same
inputs; FLOPs and seconds come from each run's META.json (seconds: the
library's forward plus its estimates, every attempt of a targeted request
included; load and save excluded; the median of --repeat runs).

    bench/pareto/pareto.py --plsh build/bin/plsh --out bench/pareto
    bench/pareto/pareto.py --plot-only --out bench/pareto      # redraw from the CSV

Writes OUT/pareto.csv (one row per run) and OUT/pareto.png.
"""

import argparse
import csv
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import inputs  # noqa: E402

FIELDS = ["n", "family", "input_seed", "config", "mode", "sampling", "samples", "window_eps", "target",
          "kept", "true_rel_err", "probe_rel_err", "probe_rel_err_upper", "flops", "dense_flops",
          "compute_s", "estimates_s", "seconds", "attempts"]


def configs(n):
    c = [("exact", ["--mode", "exact"])]
    c += [(f"window eps={e}", ["--mode", "window", "--window-eps", e]) for e in ("0.1", "1e-2", "1e-3", "1e-4")]
    for smp in ("iid", "stratified", "ash"):
        c += [(f"lsh {smp} s={s}", ["--mode", "lsh", "--samples", s, "--sampling", smp]) for s in ("16", "64", "256")]
    c += [(f"target {t}", ["--target-error", t]) for t in ("0.1", "0.03", "0.01")]
    return c


def run(plsh, d, args, threads, repeat=1):
    """The output and META.json of one run; with repeat > 1 the run is repeated
    and META's timings are the median of the runs (the machine is shared)."""
    cmd = [plsh, "compute", "--q", f"{d}/q.npy", "--k", f"{d}/k.npy", "--v", f"{d}/v.npy", "--causal",
           "--threads", str(threads), "--out", f"{d}/o.npy", "--meta", f"{d}/m.json"] + args
    timings = []
    for _ in range(repeat):
        subprocess.run(cmd, check=True)
        with open(f"{d}/m.json") as f:
            meta = json.load(f)
        timings.append(meta["timings"])
    meta["timings"] = {k: float(np.median([t.get(k, 0) for t in timings])) for k in timings[0]}
    return np.load(f"{d}/o.npy").astype(np.float64), meta


def sweep(a):
    path = f"{a.out}/pareto.csv"
    have = set()
    if os.path.exists(path):
        with open(path) as f:
            for r in csv.DictReader(f):
                have.add((r["n"], r["family"], r["input_seed"], r["config"]))
    else:
        with open(path, "w", newline="") as f:
            csv.writer(f).writerow(FIELDS)
    plan = [(n, fam, seed) for n in a.sizes for fam in a.families
            for seed in range(a.seeds if n <= 8192 else a.seeds_large)]
    for n, family, seed in plan:
        todo = [c for c in configs(n) if (str(n), family, str(seed), c[0]) not in have]
        if not todo:
            continue
        t0 = time.time()
        q, k, v = inputs.make(family, n, 8, 8, 64, 7000 + seed)
        with tempfile.TemporaryDirectory() as d:
            for x, arr in (("q", q), ("k", k), ("v", v)):
                np.save(f"{d}/{x}.npy", arr)
            exact, _ = run(a.plsh, d, ["--mode", "exact", "--no-estimates"], a.threads)
            norm = np.linalg.norm(exact)
            for name, args in todo:
                out, meta = run(a.plsh, d, args + ["--seed", str(seed)], a.threads, a.repeat)
                probe = meta["summary"]["probe"] if meta["mode"] != "exact" else {}
                target = meta.get("target")
                row = {"n": n, "family": family, "input_seed": seed, "config": name,
                       "mode": "target" if target else meta["mode"], "sampling": meta["sampling"],
                       "samples": meta["samples"] if meta["mode"] == "lsh" else "",
                       "window_eps": args[args.index("--window-eps") + 1] if "--window-eps" in args else "",
                       "target": target["target_rel_err"] if target else "",
                       "kept": (meta["mode"] + (f" s={meta['samples']}" if meta["mode"] == "lsh" else "") +
                                (f" eps={target['attempts'][target['chosen']].get('window_eps', 0):.2g}"
                                 if target and meta["mode"] == "window" else "")) if target else "",
                       "true_rel_err": float(np.linalg.norm(out - exact) / norm),
                       "probe_rel_err": probe.get("rel_err", ""), "probe_rel_err_upper": probe.get("rel_err_upper", ""),
                       "flops": meta["flops"], "dense_flops": meta["dense_flops"],
                       "compute_s": meta["timings"].get("compute", 0), "estimates_s": meta["timings"].get("estimates", 0),
                       "attempts": len(target["attempts"]) if target else ""}
                row["seconds"] = row["compute_s"] + row["estimates_s"]
                with open(path, "a", newline="") as f:
                    csv.writer(f).writerow([row[k] for k in FIELDS])
                print(f"n={n} {family} seed={seed} {name}: err {row['true_rel_err']:.3g}, "
                      f"{row['flops'] / 1e9:.1f} GFLOP, {row['seconds']:.2f} s", flush=True)
        print(f"n={n} {family} seed={seed}: {time.time() - t0:.0f} s", flush=True)


def load(path):
    with open(path) as f:
        rows = list(csv.DictReader(f))
    for r in rows:
        for k in ("true_rel_err", "flops", "seconds", "dense_flops"):
            r[k] = float(r[k])
        r["n"] = int(r["n"])
    return rows


def series_of(r):
    if r["mode"] == "lsh":
        return f"lsh {r['sampling']}"
    return r["mode"]


STYLE = {"exact": ("black", "s"), "window": ("tab:blue", "o"), "lsh iid": ("tab:red", "v"),
         "lsh stratified": ("tab:orange", "^"), "lsh ash": ("tab:green", "D"), "target": ("tab:purple", "*")}


def gains(rows):
    """Error of iid over the other samplers' at equal s and at equal FLOPs
    (iid's error interpolated log-log in FLOPs between its s = 16, 64, 256
    points of the same inputs), mean over input seeds."""
    out = ["| n | inputs | sampler | s | error | iid error, same s | gain, same s | iid error at equal FLOPs | gain, equal FLOPs |",
           "|---|---|---|---|---|---|---|---|---|"]
    keys = sorted({(r["n"], r["family"]) for r in rows})
    for n, fam in keys:
        for smp in ("stratified", "ash"):
            for s in ("16", "64", "256"):
                same, equal, errs, iids, iid_eq = [], [], [], [], []
                for seed in sorted({r["input_seed"] for r in rows if r["n"] == n and r["family"] == fam}):
                    sel = [r for r in rows if r["n"] == n and r["family"] == fam and r["input_seed"] == seed
                           and r["mode"] == "lsh"]
                    iid = sorted([(r["flops"], r["true_rel_err"], r["samples"]) for r in sel if r["sampling"] == "iid"])
                    mine = [r for r in sel if r["sampling"] == smp and r["samples"] == s]
                    if len(iid) < 2 or not mine:
                        continue
                    f, e = mine[0]["flops"], mine[0]["true_rel_err"]
                    e_same = [x[1] for x in iid if x[2] == s][0]
                    lf, le = np.log([x[0] for x in iid]), np.log([x[1] for x in iid])
                    i = int(np.clip(np.searchsorted(lf, np.log(f)), 1, len(lf) - 1))
                    t = (np.log(f) - lf[i - 1]) / (lf[i] - lf[i - 1])
                    e_eq = float(np.exp(le[i - 1] + t * (le[i] - le[i - 1])))
                    errs.append(e); iids.append(e_same); iid_eq.append(e_eq)
                    same.append(e_same / e); equal.append(e_eq / e)
                if not errs:
                    continue
                out.append(f"| {n} | {fam} | {smp} | {s} | {np.mean(errs):.3g} | {np.mean(iids):.3g} | "
                           f"{np.mean(same):.2f}x | {np.mean(iid_eq):.3g} | {np.mean(equal):.2f}x |")
    return "\n".join(out)


def plot(a):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = load(f"{a.out}/pareto.csv")
    sizes = sorted({r["n"] for r in rows})
    families = [f for f in ("gauss", "peaked") if any(r["family"] == f for r in rows)]
    fig, axes = plt.subplots(len(sizes) * len(families), 2, figsize=(12, 4.2 * len(sizes) * len(families)),
                             squeeze=False)
    floor = 1e-5  # exact's error (0) drawn here
    for i, (n, fam) in enumerate([(n, f) for n in sizes for f in families]):
        sel = [r for r in rows if r["n"] == n and r["family"] == fam]
        # mean over input seeds per configuration
        agg = {}
        for r in sel:
            agg.setdefault(r["config"], []).append(r)
        points = []
        for cfg, rs in agg.items():
            # error and FLOPs: mean over seeds; seconds: median (the machine is shared)
            points.append((series_of(rs[0]), cfg, np.mean([max(r["true_rel_err"], floor) for r in rs]),
                           np.median([r["seconds"] for r in rs]), np.mean([r["flops"] for r in rs]), len(rs)))
        for j, (xkey, xlabel) in enumerate(((3, "seconds (forward + estimates, 2 shared cores)"), (4, "FLOPs done"))):
            ax = axes[i][j]
            for series in STYLE:
                # joined in the order of their FLOPs (the configuration's cost), not of
                # their seconds, which the shared machine makes noisy
                pts = sorted([p for p in points if p[0] == series], key=lambda p: p[4])
                if not pts:
                    continue
                color, marker = STYLE[series]
                ax.plot([p[xkey] for p in pts], [p[2] for p in pts], marker=marker, color=color,
                        linestyle="-" if series not in ("target", "exact") else "none", label=series, markersize=7)
                if series == "target":
                    for p in pts:
                        ax.annotate(p[1].split()[1], (p[xkey], p[2]), textcoords="offset points", xytext=(5, 4),
                                    fontsize=8, color=color)
            ax.set_xscale("log")
            ax.set_yscale("log")
            ax.grid(True, which="both", alpha=0.3)
            ax.set_xlabel(xlabel)
            ax.set_ylabel("relative L2 error vs exact")
            seeds = max(p[5] for p in points)
            ax.set_title(f"n = {n}, {fam} inputs ({seeds} seed{'s' if seeds > 1 else ''}); exact drawn at 1e-5",
                         fontsize=10)
            if i == 0 and j == 0:
                ax.legend(fontsize=8)
    fig.suptitle("plsh CPU backend: error against cost (B=1, H=8, D=64, causal); "
                 "stars: --target-error, labelled with the target", fontsize=12)
    fig.tight_layout(rect=(0, 0, 1, 0.98))
    fig.savefig(f"{a.out}/pareto.png", dpi=90)
    print(f"wrote {a.out}/pareto.png")
    table = gains(rows)
    with open(f"{a.out}/gains.md", "w") as f:
        f.write(table + "\n")
    print(table)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--plsh", default="build/bin/plsh")
    ap.add_argument("--out", default="bench/out/pareto")
    ap.add_argument("--sizes", type=lambda s: [int(x) for x in s.split(",")], default=[8192, 32768])
    ap.add_argument("--families", type=lambda s: s.split(","), default=["gauss", "peaked"])
    ap.add_argument("--seeds", type=int, default=3, help="input seeds at n <= 8192")
    ap.add_argument("--seeds-large", type=int, default=1, help="input seeds above 8192")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=3, help="runs per configuration; seconds are their median")
    ap.add_argument("--plot-only", action="store_true")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    if not a.plot_only:
        sweep(a)
    plot(a)


if __name__ == "__main__":
    main()
