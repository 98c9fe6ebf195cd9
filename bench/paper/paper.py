#!/usr/bin/python3
"""The paper's section 5 experiments, small and real, through plsh-server.

Character-level ALiBi language models are trained from scratch on the King
James Bible (Debian package bible-kjv: `bible -f gen1:1-rev22:21`, 4.4 MB,
one verse a line, each line starting with its reference, e.g. "Ge1:3 And
God said, ..."). The package's copyright file says the text's copyright
has expired (it dates from 1611; in the UK the Crown's letters patent still
cover it); the program that prints it is GPL-2+.
Every attention layer of every model runs on plsh-server through the torch
op (plsh_client.torch.attention): forward by Attend with keep_context, the
backward by AttendBackward.

Units, each resumable (a unit whose record is in WORK is skipped):
  train:<model>   one model trained at context L, then held-out perplexity
                  at L, 2L and 4L, evaluated with exact ALiBi and with its
                  own mode. Models (section 5.1): exact, window, lsh at
                  s = 10 and 20 with iid draws and with the best sampler,
                  fixed blocks (biased), no bias, with the standard per-head
                  slopes; exact, lsh s = 20 and fixed blocks with the paper's
                  sigma = 256 for every head.
  theory          section 5.2 on the exact model's q, k, v: ||L* - M~|| (max
                  and spectral, the server's estimates) and the output error
                  against s = 1 .. 1024 for iid, stratified and ash draws;
                  decides the "best sampler" the lsh-best models train with.
  finetune:<m>    the Mistral analog: the exact model fine-tuned with lsh
                  s = 20, with fixed blocks, and (the control) with exact.
Every invocation then rewrites bench/paper/results.csv and the figures from
the records of the units done so far.

Training draws (SPEC section 8): every lsh forward passes a fresh 64-bit
seed drawn from torch's generator (torch.randint), so torch.manual_seed
fixes the whole run and every layer and step draws its own hashes; the
backward uses its forward's draws (the kept context). Evaluation with lsh
draws fresh seeds the same way. Every model starts from the same weights
(torch.manual_seed before construction) and sees the same batches (one
numpy generator per run, same seed).

    # everything (about 75 minutes on 2 cores, estimated from the units' times;
    # never run whole yet), in pieces of at most 18 minutes each:
    flock /tmp/plsh-heavy.lock /usr/bin/python3 bench/paper/paper.py --server-bin build/bin/plsh-server --budget-minutes 18
    # (repeat until it says "all units done")
    /usr/bin/python3 bench/paper/paper.py --list          # what is done, and how long each took

PYTHONPATH must hold client/python and <build>/python (the generated stubs).
"""

import argparse
import csv
import json
import math
import os
import signal
import subprocess
import sys
import time

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "examples"))
from train_alibi import start_server  # noqa: E402  (one copy of "a plsh-server on a free loopback port")

# ------------------------------------------------------------------ config

FULL = dict(seq=512, layers=3, d_model=64, heads=4, batch=8, steps=800, lr=3e-3, warmup=30,
            finetune_steps=150, finetune_lr=1e-3, eval_segments=48, eval_batch=8, seed=0,
            theory_windows=4, theory_layers=3, theory_seeds=3, theory_samples=[1, 2, 4, 8, 10, 16, 20, 32, 64, 128, 256, 512, 1024],
            sigma_constant=256.0)
# The ctest smoke run: every kind of unit, tiny.
SMOKE = dict(FULL, seq=64, layers=1, d_model=16, heads=2, batch=2, steps=3, warmup=1, finetune_steps=2,
             eval_segments=2, eval_batch=2, theory_windows=1, theory_layers=1, theory_seeds=1,
             theory_samples=[1, 4, 10, 20])
SMOKE_UNITS = ["train:exact", "theory", "train:lsh10_best", "train:fixed_blocks", "train:no_bias",
               "train:fixed_blocks_sigma256", "finetune:fixed_blocks"]

CSV_FIELDS = ["model", "mode", "samples", "sampler", "slopes", "init", "train_len", "eval_len", "eval_with",
              "perplexity", "nats_per_char", "steps", "seconds", "eval_tokens"]


def models(cfg):
    """name -> how it trains: mode, samples, sampler ('iid', 'best' or None),
    slopes ('standard', 'sigma256' or 'none'), init ('scratch' or the model it
    is fine-tuned from)."""
    m = {}
    m["exact"] = dict(mode="exact", samples=0, sampler=None, slopes="standard")
    m["window"] = dict(mode="window", samples=0, sampler=None, slopes="standard")
    for s in (10, 20):
        m[f"lsh{s}_iid"] = dict(mode="lsh", samples=s, sampler="iid", slopes="standard")
        m[f"lsh{s}_best"] = dict(mode="lsh", samples=s, sampler="best", slopes="standard")
    m["fixed_blocks"] = dict(mode="fixed_blocks", samples=0, sampler=None, slopes="standard")
    m["no_bias"] = dict(mode="exact", samples=0, sampler=None, slopes="none")
    m["exact_sigma256"] = dict(mode="exact", samples=0, sampler=None, slopes="sigma256")
    m["lsh20_iid_sigma256"] = dict(mode="lsh", samples=20, sampler="iid", slopes="sigma256")
    m["fixed_blocks_sigma256"] = dict(mode="fixed_blocks", samples=0, sampler=None, slopes="sigma256")
    for v in m.values():
        v["init"] = "scratch"
    m["ft_lsh20_iid"] = dict(mode="lsh", samples=20, sampler="iid", slopes="standard", init="exact")
    m["ft_fixed_blocks"] = dict(mode="fixed_blocks", samples=0, sampler=None, slopes="standard", init="exact")
    m["ft_exact"] = dict(mode="exact", samples=0, sampler=None, slopes="standard", init="exact")
    return m


def all_units():
    names = models(FULL)
    order = ["exact", "theory", "lsh20_iid", "lsh10_iid", "lsh20_best", "lsh10_best", "fixed_blocks", "no_bias",
             "window", "exact_sigma256", "lsh20_iid_sigma256", "fixed_blocks_sigma256",
             "ft_lsh20_iid", "ft_fixed_blocks", "ft_exact"]
    units = []
    for n in order:
        if n == "theory":
            units.append("theory")
        elif names[n]["init"] == "scratch":
            units.append("train:" + n)
        else:
            units.append("finetune:" + n[3:])
    return units

# ------------------------------------------------------------------ corpus


def corpus(work):
    """The King James Bible as printed by bible-kjv, cached in WORK."""
    path = os.path.join(work, "kjv.txt")
    if not os.path.exists(path):
        try:
            text = subprocess.run(["bible", "-f", "gen1:1-rev22:21"], capture_output=True, text=True,
                                  check=True).stdout
        except FileNotFoundError:
            raise SystemExit("the corpus is Debian's bible-kjv: install it (scripts/setup.sh does)") from None
        if len(text) < 4_000_000:
            raise SystemExit(f"bible printed {len(text)} characters, expected the whole text (~4.4 MB)")
        with open(path + ".tmp", "w") as f:
            f.write(text)
        os.replace(path + ".tmp", path)
    with open(path) as f:
        return f.read()


class Data:
    """Blocks of 64 KiB characters; every tenth is held out (from both
    testaments). Training batches are uniform windows of the rest."""

    BLOCK = 65536

    def __init__(self, text, cfg):
        self.chars = sorted(set(text))
        ids = np.frombuffer(text.encode("latin-1"), dtype=np.uint8)
        lut = np.zeros(256, dtype=np.int64)
        lut[[ord(c) for c in self.chars]] = np.arange(len(self.chars))
        ids = lut[ids]
        blocks = [ids[i:i + self.BLOCK] for i in range(0, len(ids), self.BLOCK)]
        self.train = np.concatenate([b for i, b in enumerate(blocks) if i % 10 != 9])
        self.held = [b for i, b in enumerate(blocks) if i % 10 == 9 and len(b) == self.BLOCK]
        L = cfg["seq"]
        # Scored segments [a, a + L) with 3L of context before them inside their block,
        # spread evenly over the held-out blocks: the same tokens at every eval length.
        per_block = math.ceil(cfg["eval_segments"] / len(self.held))
        self.segments = []
        for bi, b in enumerate(self.held):
            for a in np.linspace(3 * L, len(b) - L - 1, per_block).astype(int):
                self.segments.append((bi, int(a)))
        self.segments = self.segments[:cfg["eval_segments"]]

    def batches(self, cfg, seed):
        rng = np.random.default_rng(seed)
        L, B = cfg["seq"], cfg["batch"]
        while True:
            starts = rng.integers(0, len(self.train) - L - 1, size=B)
            x = np.stack([self.train[s:s + L] for s in starts])
            y = np.stack([self.train[s + 1:s + L + 1] for s in starts])
            yield torch.from_numpy(x), torch.from_numpy(y)

    def eval_windows(self, eval_len, L):
        """(x, y) windows of eval_len ending with each scored segment; the
        last L targets of each are scored."""
        xs, ys = [], []
        for bi, a in self.segments:
            b = self.held[bi]
            start = a + L - eval_len
            xs.append(b[start:start + eval_len])
            ys.append(b[start + 1:start + eval_len + 1])
        return torch.from_numpy(np.stack(xs)), torch.from_numpy(np.stack(ys))

# ------------------------------------------------------------------- model


def standard_slopes(heads):
    from plsh_client._slopes import standard_slopes as s
    return list(s(heads))


def slopes_of(kind, heads, sigma):
    if kind == "standard":
        return standard_slopes(heads)
    if kind == "sigma256":
        return [1.0 / sigma] * heads
    return [0.0] * heads


class Attention:
    """plsh attention with fixed options; lsh gets a fresh seed from torch's
    generator on every call (SPEC section 8's training draws). `record`
    collects q, k, v per call when set (section 5.2's activations)."""

    def __init__(self, client, mode, samples, sampling, slopes):
        self.client, self.mode, self.samples, self.sampling, self.slopes = client, mode, samples, sampling, slopes
        self.record = None

    def __call__(self, q, k, v):
        import plsh_client.torch as pt
        if self.record is not None:
            self.record.append(tuple(t.detach().numpy().copy() for t in (q, k, v)))
        opts = dict(mode=self.mode, causal=True, slopes=self.slopes, client=self.client, layout="bnhd")
        if self.mode == "lsh":
            opts.update(samples=self.samples, sampling=self.sampling,
                        seed=int(torch.randint(0, 2**63 - 1, (1,), dtype=torch.int64).item()))
        return pt.attention(q, k, v, **opts)


class Block(nn.Module):
    def __init__(self, d_model, heads):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))

    def forward(self, x, attention):
        B, N, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(B, N, 3, self.heads, C // self.heads).unbind(2)  # [B, N, H, D] each
        x = x + self.proj(attention(q.contiguous(), k.contiguous(), v.contiguous()).reshape(B, N, C))
        return x + self.mlp(self.ln2(x))


class AlibiLM(nn.Module):
    """No position embeddings: the attention's positional weights are the only position signal."""

    def __init__(self, vocab, cfg):
        super().__init__()
        self.embed = nn.Embedding(vocab, cfg["d_model"])
        self.blocks = nn.ModuleList(Block(cfg["d_model"], cfg["heads"]) for _ in range(cfg["layers"]))
        self.ln = nn.LayerNorm(cfg["d_model"])
        self.head = nn.Linear(cfg["d_model"], vocab)

    def forward(self, ids, attention):
        x = self.embed(ids)
        for b in self.blocks:
            x = b(x, attention)
        return self.head(self.ln(x))

# ---------------------------------------------------------------- training


def evaluate(model, data, attention, cfg):
    """Held-out nats per character at L, 2L and 4L: the same scored tokens
    (the last L of each window), with 0, L and 3L characters of context
    before them."""
    L = cfg["seq"]
    out = {}
    with torch.no_grad():
        for eval_len in (L, 2 * L, 4 * L):
            x, y = data.eval_windows(eval_len, L)
            total, count = 0.0, 0
            for i in range(0, len(x), cfg["eval_batch"]):
                logits = model(x[i:i + cfg["eval_batch"]], attention)[:, -L:]
                target = y[i:i + cfg["eval_batch"]][:, -L:]
                total += F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1),
                                         reduction="sum").item()
                count += target.numel()
            out[eval_len] = (total / count, count)
    return out


def train(model, attention, data, cfg, steps, lr, batch_seed, warmup):
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    batches = data.batches(cfg, batch_seed)
    curve = []
    t0 = time.monotonic()
    for step in range(1, steps + 1):
        scale = min(1.0, step / max(1, warmup)) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / steps)))
        for g in opt.param_groups:
            g["lr"] = lr * scale
        x, y = next(batches)
        logits = model(x, attention)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        curve.append(loss.item())
        if step % 50 == 0 or step == steps:
            print(f"  step {step:4d}  train {np.mean(curve[-50:]):.4f} nats/char  {time.monotonic() - t0:.0f} s",
                  flush=True)
    return curve, time.monotonic() - t0


def best_sampler(work):
    path = os.path.join(work, "theory.json")
    if not os.path.exists(path):
        raise RuntimeError("the lsh-best models need the theory unit's measurement first")
    with open(path) as f:
        return json.load(f)["best_sampler"]


def run_model(name, spec, cfg, data, client, work):
    sampler = spec["sampler"]
    if sampler == "best":
        sampler = best_sampler(work)
    slopes = slopes_of(spec["slopes"], cfg["heads"], cfg["sigma_constant"])
    torch.manual_seed(cfg["seed"])
    model = AlibiLM(len(data.chars), cfg)  # the same initial weights for every model
    attention = Attention(client, spec["mode"], spec["samples"], sampler, slopes)
    if spec["init"] == "scratch":
        steps, lr, batch_seed, warmup = cfg["steps"], cfg["lr"], cfg["seed"], cfg["warmup"]
    else:
        model.load_state_dict(torch.load(os.path.join(work, spec["init"] + ".pt")))
        steps, lr, batch_seed, warmup = cfg["finetune_steps"], cfg["finetune_lr"], cfg["seed"] + 1, 1
        torch.manual_seed(cfg["seed"] + 1)  # the fine-tunes' draws: one stream for all of them
    print(f"{name}: {spec['mode']} s={spec['samples']} sampler={sampler} slopes={spec['slopes']} "
          f"init={spec['init']}, {steps} steps", flush=True)
    curve, seconds = train(model, attention, data, cfg, steps, lr, batch_seed, warmup)
    torch.save(model.state_dict(), os.path.join(work, name + ".pt"))
    t0 = time.monotonic()
    exact_attention = Attention(client, "exact", 0, None, slopes)
    results = {"exact": evaluate(model, data, exact_attention, cfg)}
    if spec["mode"] != "exact":
        results["own"] = evaluate(model, data, attention, cfg)
    record = dict(name=name, spec=dict(spec, sampler=sampler), steps=steps, seconds=seconds,
                  eval_seconds=time.monotonic() - t0, curve=curve,
                  eval={w: {str(n): v for n, v in r.items()} for w, r in results.items()})
    for w, r in results.items():
        print("  eval " + w + ": " + "  ".join(f"{n}: ppl {math.exp(v[0]):.4f}" for n, v in r.items()), flush=True)
    return record

# ------------------------------------------------------------------ theory


def theory(cfg, data, client, work):
    """Section 5.2 on the exact model's activations: held-out windows of
    n = 4L through the model, each layer's q, k, v sent again as lsh
    requests (banded, so that s = 1024 stays cheap) for every s and sampler
    and a few seeds; the mask errors are the server's estimates (exact
    over every row at this n), the output error is against the layer's
    exact output."""
    slopes = slopes_of("standard", cfg["heads"], cfg["sigma_constant"])
    torch.manual_seed(cfg["seed"])
    model = AlibiLM(len(data.chars), cfg)
    model.load_state_dict(torch.load(os.path.join(work, "exact.pt")))
    attention = Attention(client, "exact", 0, None, slopes)
    L = cfg["seq"]
    x, _ = data.eval_windows(4 * L, L)
    n = x.shape[1]
    # Windows spread over the held-out segments (one per held-out block when they suffice).
    picks = np.linspace(0, len(x) - 1, cfg["theory_windows"]).astype(int)
    t0 = time.monotonic()
    rows = []
    for wi in picks:
        attention.record = []
        with torch.no_grad():
            model(x[wi:wi + 1], attention)
        for li, (q, k, v) in enumerate(attention.record[:cfg["theory_layers"]]):
            theory_layer(client, q, k, v, slopes, cfg, int(wi), li, rows)
        print(f"  theory: window {wi} done, {time.monotonic() - t0:.0f} s", flush=True)
    gains = {cost: sampler_gains(rows, cfg, cost) for cost in ("samples", "banded_flops", "per_sample_flops")}
    # The lsh-best models train at s = 10 and 20: the sampler with the lower
    # output error there at equal s (their per-sample cost is iid's in
    # expectation), if it beats iid at all.
    best = max(("stratified", "ash"), key=lambda smp: gains["samples"][smp]["s10_s20"])
    best = best if gains["samples"][best]["s10_s20"] > 1.0 else "iid"
    settings = {k: v for k, v in cfg.items() if k.startswith("theory_")}
    return dict(name="theory", n=n, settings=settings, rows=rows, gains=gains, best_sampler=best,
                seconds=time.monotonic() - t0)


def theory_layer(client, q, k, v, slopes, cfg, window, li, rows):
    """One layer's q, k, v: every sampler, s and seed, into rows."""
    n, dim = q.shape[1], q.shape[3]
    exact, _ = client.attend(q, k, v, mode="exact", causal=True, slopes=slopes)
    for sampling in ("iid", "stratified", "ash"):
        for s in cfg["theory_samples"]:
            for rep in range(cfg["theory_seeds"]):
                seed = 1000003 * window + 7919 * li + 104729 * rep + 17
                out, meta = client.attend(q, k, v, mode="lsh", causal=True, slopes=slopes, samples=s, seed=seed,
                                          sampling=sampling, lsh_algorithm="banded", estimates=True,
                                          probe_rows=0, return_draws=True)
                for h, head in enumerate(meta["heads"]):
                    err = np.linalg.norm(out[0, :, h] - exact[0, :, h]) / np.linalg.norm(exact[0, :, h])
                    rows.append(dict(window=window, layer=li, head=h, sigma=1 / slopes[h], sampling=sampling,
                                     samples=s, seed=seed, mask_max_err=head["mask_max_err"],
                                     mask_spectral_err=head["mask_spectral_err"], output_rel_err=float(err),
                                     # banded's cost is set by the widest pitch (SPEC section 3), the
                                     # per-sample reduction's by the sum of the pitches
                                     banded_flops=banded_flops(n, dim, head["draws"]),
                                     per_sample_flops=per_sample_flops(n, dim, head["draws"])))


def banded_flops(n, dim, draws):
    """Causal banded lsh's multiply-adds x2 for one head: every row visits
    the 64-row tile's band, 64 + 2 max pitch keys (at most n), half of them
    allowed on average (kernels/cpu/cpu_lsh.cpp's cost model)."""
    band = min(n, 64 + 2 * max(min(p, n) for p, _ in draws))
    return n * band * 0.5 * 4 * dim


def per_sample_flops(n, dim, draws):
    """The per-sample reduction's: every row attends its block in each hash."""
    return sum(n * min(p, n) * 0.5 * 4 * dim for p, _ in draws)


def mean_by(rows, key, where):
    """Mean of key over the rows matching `where`, by samples."""
    out = {}
    for r in rows:
        if all(r[k] == v for k, v in where.items()):
            out.setdefault(r["samples"], []).append(r[key])
    return {s: float(np.mean(v)) for s, v in sorted(out.items())}


def iid_error_at(cost, iid_cost, iid_err, cap):
    """iid's output error at a cost: a log-log line through the 4 iid
    points nearest that cost (its cost is a noisy function of s: banded's
    follows the largest pitch drawn). Points at the cap (banded's band
    covering every key: more samples are then free, so "equal cost" says
    nothing) are left out; None when the cost is outside the rest's range."""
    pts = sorted((iid_cost[s], iid_err[s]) for s in iid_cost if iid_cost[s] < cap)
    if len(pts) < 4 or not pts[0][0] <= cost <= pts[-1][0]:
        return None
    near = sorted(pts, key=lambda p: abs(math.log(p[0] / cost)))[:4]
    x, y = np.log([p[0] for p in near]), np.log([p[1] for p in near])
    if np.ptp(x) == 0:
        return None
    slope, intercept = np.polyfit(x, y, 1)
    return float(np.exp(intercept + slope * math.log(cost)))


def max_cost(rows, cost):
    """banded_flops' cap: the band over every key; the per-sample cost has none."""
    return max(r[cost] for r in rows) if cost == "banded_flops" else math.inf


def sampler_gains(rows, cfg, cost):
    """Each sampler's output error against iid's at equal `cost` (samples:
    the same s; banded_flops or per_sample_flops: iid interpolated at the
    sampler's cost): iid's error over the sampler's, geometric mean over
    windows, layers and heads, per s."""
    gains = {}
    for smp in ("iid", "stratified", "ash"):
        per_s = {s: [] for s in cfg["theory_samples"]}
        for wi, li, h in sorted({(r["window"], r["layer"], r["head"]) for r in rows}):
            where = dict(window=wi, layer=li, head=h)
            iid_err = mean_by(rows, "output_rel_err", dict(where, sampling="iid"))
            err = mean_by(rows, "output_rel_err", dict(where, sampling=smp))
            for s in per_s:
                if cost == "samples":
                    at = iid_err[s]
                else:
                    at = iid_error_at(mean_by(rows, cost, dict(where, sampling=smp))[s],
                                      mean_by(rows, cost, dict(where, sampling="iid")), iid_err,
                                      cap=max_cost(rows, cost))
                if at is not None and err[s] > 0:
                    per_s[s].append(at / err[s])
        gains[smp] = {str(s): float(np.exp(np.mean(np.log(v)))) for s, v in per_s.items() if v}
        both = [np.log(v) for s, v in per_s.items() if s in (10, 20) and v]
        gains[smp]["s10_s20"] = float(np.exp(np.mean(np.concatenate(both)))) if both else float("nan")
    return gains

# ----------------------------------------------------------------- results


def load_records(work):
    records = {}
    for f in sorted(os.listdir(work)):
        if f.endswith(".json") and not f.startswith("config"):
            with open(os.path.join(work, f)) as fh:
                r = json.load(fh)
            records[r["name"]] = r
    return records


def write_results(records, cfg, out_dir):
    rows = []
    for name, r in records.items():
        if name == "theory":
            continue
        spec = r["spec"]
        for with_, per_len in r["eval"].items():
            for eval_len, (nats, count) in sorted(per_len.items(), key=lambda kv: int(kv[0])):
                rows.append(dict(model=name, mode=spec["mode"] if spec["slopes"] != "none" else "no_bias",
                                 samples=spec["samples"] or "", sampler=spec["sampler"] or "", slopes=spec["slopes"],
                                 init=spec["init"], train_len=cfg["seq"], eval_len=int(eval_len), eval_with=with_,
                                 perplexity=f"{math.exp(nats):.5f}", nats_per_char=f"{nats:.5f}", steps=r["steps"],
                                 seconds=f"{r['seconds']:.1f}", eval_tokens=count))
    path = os.path.join(out_dir, "results.csv")
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_FIELDS)
        w.writeheader()
        w.writerows(rows)
    return path, rows


def save_small(fig, path, dpi):
    """The figure as a 256-colour PNG: line plots lose nothing visible and
    the file stays small enough to commit (PIL comes with matplotlib)."""
    from PIL import Image
    fig.savefig(path + ".tmp.png", dpi=dpi)
    with Image.open(path + ".tmp.png") as im:
        im.convert("RGB").quantize(colors=256).save(path, optimize=True)
    os.remove(path + ".tmp.png")


def plots(records, cfg, out_dir):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    written = []
    L = cfg["seq"]
    trained = {n: r for n, r in records.items() if n != "theory"}
    if trained:
        fig, axes = plt.subplots(1, 2, figsize=(13, 4.8))
        for n, r in trained.items():
            c = np.array(r["curve"])
            k = max(1, len(c) // 40)
            axes[0].plot(np.arange(k, len(c) + 1), np.convolve(c, np.ones(k) / k, mode="valid"), lw=1, label=n)
            for with_, ls in (("exact", "-"), ("own", "--")):
                if with_ in r["eval"]:
                    lens = sorted(int(x) for x in r["eval"][with_])
                    axes[1].plot(lens, [math.exp(r["eval"][with_][str(x)][0]) for x in lens], ls, marker="o", ms=3,
                                 label=f"{n} ({with_})")
        axes[0].set(xlabel="step", ylabel="train nats/char (running mean)", title="training loss")
        axes[1].set(xlabel="eval length (characters)", ylabel="held-out perplexity (last L scored)", xscale="log",
                    title=f"perplexity at L, 2L, 4L (L = {L}); solid: exact ALiBi, dashed: own mode")
        axes[1].set_xticks([L, 2 * L, 4 * L], [str(L), str(2 * L), str(4 * L)])
        axes[1].minorticks_off()  # the log axis's minor labels would overprint L, 2L, 4L
        for a in axes:
            a.grid(alpha=0.3)
        axes[0].legend(fontsize=7)
        axes[1].legend(fontsize=6, ncol=2)
        fig.suptitle(f"KJV char-level LMs through plsh-server ({cfg['layers']} layers, d={cfg['d_model']}, "
                     f"{cfg['heads']} heads, batch {cfg['batch']}, context {L})", fontsize=10)
        fig.tight_layout()
        written.append(os.path.join(out_dir, "training.png"))
        save_small(fig, written[-1], dpi=110)
        plt.close(fig)
    t = records.get("theory")
    if t:
        rows = t["rows"]
        sigmas = sorted({r["sigma"] for r in rows})
        s_grid = np.array(sorted({r["samples"] for r in rows}), dtype=float)
        fig, axes = plt.subplots(1, 4, figsize=(21, 4.8))
        keys = (("mask_max_err", "max |L* - M~| (server's estimate)"),
                ("mask_spectral_err", "||L* - M~||_2 (server's estimate)"),
                ("output_rel_err", "output ||o~ - o*|| / ||o*||"))
        styles = {"iid": "-", "stratified": ":", "ash": "--"}
        colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
        for ax, (key, label) in zip(axes, keys):
            for ci, sigma in enumerate(sigmas):
                for smp in ("iid", "stratified", "ash"):
                    m = mean_by(rows, key, dict(sampling=smp, sigma=sigma))
                    ax.plot(list(m), list(m.values()), styles[smp], marker="o", ms=2, lw=1, color=colors[ci],
                            label=f"sigma {sigma:g} {smp}")
                m = mean_by(rows, key, dict(sampling="iid", sigma=sigma))
                ax.plot(s_grid, m[s_grid[0]] * np.sqrt(s_grid[0] / s_grid), color="k", lw=0.6, alpha=0.5,
                        label="Theorem 2.1's rate, c / sqrt(s)" if ci == 0 else None)
            ax.set(xscale="log", yscale="log", xlabel="samples s", title=label)
            ax.grid(alpha=0.3, which="both")
        axes[0].legend(fontsize=6, ncol=2)
        for smp, color in (("stratified", "tab:green"), ("ash", "tab:red")):
            for cost, ls in (("samples", "-"), ("banded_flops", "--"), ("per_sample_flops", ":")):
                g = t["gains"][cost][smp]
                ss = sorted(int(x) for x in g if x.isdigit())
                axes[3].plot(ss, [g[str(x)] for x in ss], ls, marker="o", ms=2, color=color,
                             label=f"{smp}, equal {cost.replace('_', ' ')}")
        axes[3].axhline(1, color="tab:blue", lw=1, label="iid")
        axes[3].set(xscale="log", xlabel="samples s", ylabel="iid's output error / the sampler's",
                    title="gain over iid (geometric mean over windows, layers, heads)")
        axes[3].grid(alpha=0.3, which="both")
        axes[3].legend(fontsize=7)
        st = t["settings"]
        fig.suptitle(f"Section 5.2 on the exact-trained model's q, k, v ({st['theory_windows']} held-out windows of "
                     f"n = {t['n']}, causal, {st['theory_layers']} layers x {cfg['heads']} heads, "
                     f"{st['theory_seeds']} seeds each; lines: means by sigma)", fontsize=10)
        fig.tight_layout()
        written.append(os.path.join(out_dir, "theory.png"))
        save_small(fig, written[-1], dpi=90)
        plt.close(fig)
    return written

# -------------------------------------------------------------------- main


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--server-bin", help="start this plsh-server (and stop it at the end)")
    ap.add_argument("--target", default=os.environ.get("PLSH_TARGET", "127.0.0.1:50051"),
                    help="a running server instead of --server-bin")
    ap.add_argument("--threads", type=int, default=2, help="torch's threads and the started server's --threads")
    ap.add_argument("--work", default=os.path.join(HERE, "work"), help="unit records and checkpoints")
    ap.add_argument("--out", default=HERE, help="where results.csv and the figures go")
    ap.add_argument("--budget-minutes", type=float, default=0,
                    help="start no unit after this many minutes (0: run every unit not done)")
    ap.add_argument("--only", help="comma-separated units to run (default: every unit not done, in order)")
    ap.add_argument("--list", action="store_true", help="list the units, done or not, and stop")
    ap.add_argument("--smoke", action="store_true",
                    help="a tiny run of every kind of unit, its results checked (ctest)")
    ap.add_argument("--fresh", action="store_true", help="forget WORK's records first (start over)")
    args = ap.parse_args()
    if args.fresh and os.path.isdir(args.work):
        for f in os.listdir(args.work):
            if f.endswith((".json", ".pt")):
                os.remove(os.path.join(args.work, f))

    cfg = SMOKE if args.smoke else FULL
    units = SMOKE_UNITS if args.smoke else all_units()
    os.makedirs(args.work, exist_ok=True)
    os.makedirs(args.out, exist_ok=True)
    # The models' records must come from one configuration; the theory
    # unit's settings (theory_*) are its own record's.
    config_path = os.path.join(args.work, "config.json")
    trained_cfg = {k: v for k, v in cfg.items() if not k.startswith("theory_")}
    if os.path.exists(config_path):
        with open(config_path) as f:
            if {k: v for k, v in json.load(f).items() if not k.startswith("theory_")} != trained_cfg:
                raise SystemExit(f"{args.work} holds records of another configuration; use another --work")
    with open(config_path, "w") as f:
        json.dump(cfg, f, indent=1)
    done = {u for u in units if os.path.exists(record_path(args.work, u))}
    if args.list:
        records = load_records(args.work)
        for u in units:
            r = records.get(unit_name(u))
            print(f"{u:34s} {'done' if r else '-':5s} " +
                  (f"{r['seconds'] + r.get('eval_seconds', 0):7.0f} s" if r else ""))
        return 0
    todo = [u for u in (args.only.split(",") if args.only else units) if u not in done]

    torch.set_num_threads(args.threads)
    text = corpus(args.work)
    data = Data(text, cfg)
    print(f"corpus: {len(text)} characters (bible-kjv), vocabulary {len(data.chars)}; train {len(data.train)}, "
          f"held out {len(data.held)} blocks, {len(data.segments)} scored segments of {cfg['seq']}", flush=True)
    from plsh_client import Client
    server, target = None, args.target
    if todo and args.server_bin:
        server, target = start_server(args.server_bin, args.threads)
    t_start = time.monotonic()
    spec = models(cfg)
    try:
        with Client(target) as client:
            for u in todo:
                elapsed = (time.monotonic() - t_start) / 60
                if args.budget_minutes and elapsed > 0 and elapsed + estimate_minutes(u, args.work) > args.budget_minutes:
                    print(f"budget: {elapsed:.1f} of {args.budget_minutes} minutes used; {u} and later wait for "
                          "the next run", flush=True)
                    break
                name = unit_name(u)
                record = theory(cfg, data, client, args.work) if u == "theory" else \
                    run_model(name, spec[name], cfg, data, client, args.work)
                with open(record_path(args.work, u) + ".tmp", "w") as f:
                    json.dump(record, f)
                os.replace(record_path(args.work, u) + ".tmp", record_path(args.work, u))
    finally:
        if server is not None:
            server.send_signal(signal.SIGTERM)
            server.wait(30)
    records = load_records(args.work)
    path, rows = write_results(records, cfg, args.out)
    figures = plots(records, cfg, args.out)
    left = [u for u in units if unit_name(u) not in records]
    if args.smoke:
        check_smoke(rows, records, cfg)
    print(f"wrote {path} ({len(rows)} rows) and {', '.join(figures) or 'no figures'}; "
          + ("all units done" if not left else f"{len(left)} units left: {', '.join(left)}"), flush=True)
    return 0


def check_smoke(rows, records, cfg):
    """What a full run relies on, on the tiny one: every model has its
    perplexity at L, 2L and 4L with exact and (not exact) its own mode,
    finite and above 1, and section 5.2 every (sampler, s) pair."""
    L = cfg["seq"]
    for name, r in records.items():
        if name == "theory":
            pairs = {(x["sampling"], x["samples"]) for x in r["rows"]}
            assert pairs == {(smp, s) for smp in ("iid", "stratified", "ash") for s in cfg["theory_samples"]}, pairs
            continue
        withs = ["exact"] + (["own"] if r["spec"]["mode"] != "exact" else [])
        got = {(x["eval_with"], x["eval_len"]) for x in rows if x["model"] == name}
        assert got == {(w, n) for w in withs for n in (L, 2 * L, 4 * L)}, (name, got)
    for x in rows:
        assert 1 < float(x["perplexity"]) < 1e4 and x["steps"] > 0, x
    print("smoke: results.csv and the records check out", flush=True)


def unit_name(u):
    """The record name of a unit: the model (train:x -> x, finetune:x -> ft_x) or theory."""
    kind, _, rest = u.partition(":")
    return {"train": rest, "finetune": "ft_" + rest}.get(kind, kind)


def record_path(work, u):
    return os.path.join(work, unit_name(u) + ".json")


def estimate_minutes(u, work):
    """A unit's expected minutes: the last record of its kind, else a guess."""
    records = load_records(work)
    kind = "theory" if u == "theory" else "finetune" if u.startswith("finetune") else "train"
    same = [r for n, r in records.items() if (n == "theory") == (kind == "theory") and
            (n.startswith("ft_") == (kind == "finetune"))]
    if not same:
        return 0
    return max((r["seconds"] + r.get("eval_seconds", 0)) / 60 for r in same)


if __name__ == "__main__":
    sys.exit(main())
