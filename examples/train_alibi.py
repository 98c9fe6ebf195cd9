#!/usr/bin/python3
"""A small ALiBi transformer trained through plsh-server.

Every attention layer calls plsh through the Python client
(plsh_client.torch.attention): the forward runs on the server and keeps its
context there, the backward sends dout and gets dq, dk, dv. Everything else
(embeddings, MLPs, layer norms, the optimizer) is ordinary PyTorch on the
CPU. The same model, data and seed are trained once per attention mode
(exact, window, lsh with s = 16), and the loss curves go to a CSV and a PNG.

The corpus is generated (no download, no licence question): a small formal
language of documents that mix
  - definitions   "let q7 = 314 ."
  - sentences of a toy grammar with number agreement
                  "the old cats chase a dog ."
  - queries       "q7 is 314 ."  (a name defined earlier in the document)
so that local structure (spelling, grammar) and long-range recall (a
query's digits are only predictable from its definition, up to hundreds of
characters back) both shape the loss. The "recall" loss is the loss on the
query digits whose definition lies inside the model's context window.

    # against a running server
    /usr/bin/python3 examples/train_alibi.py --target 127.0.0.1:50051 --out-dir runs/alibi
    # or let the script start one (and stop it)
    /usr/bin/python3 examples/train_alibi.py --server-bin build/bin/plsh-server --out-dir runs/alibi

plsh_client must be importable: pip install ./client/python, or in a
source checkout PYTHONPATH=client/python:<build>/python.
"""

import argparse
import csv
import math
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from plsh_client import Client
import plsh_client.torch as plsh_torch

# ------------------------------------------------------------------ corpus

NOUNS = ["cat", "dog", "bird", "fox", "owl", "frog", "horse", "mouse", "tiger", "snake"]
VERBS = ["see", "chase", "like", "follow", "watch", "help", "find", "hear"]
ADJS = ["old", "small", "red", "quick", "lazy", "brave"]
DETS = ["the", "a", "every", "this"]


def noun_phrase(rng, plural):
    det = rng.choice(["the", "some", "these"] if plural else DETS)
    words = [det]
    if rng.random() < 0.4:
        words.append(rng.choice(ADJS))
    noun = rng.choice(NOUNS)
    words.append(noun + ("es" if plural and noun.endswith("x") else "s" if plural else ""))
    return " ".join(words)


def sentence(rng):
    plural = rng.random() < 0.5
    subject = noun_phrase(rng, plural)
    verb = rng.choice(VERBS) + ("" if plural else "s")
    if rng.random() < 0.7:
        return f"{subject} {verb} {noun_phrase(rng, rng.random() < 0.5)} ."
    return f"{subject} {verb} ."


def generate_corpus(n_chars, seed):
    """Text, and for every character the position of the character it
    copies (a query digit's defining digit) or -1."""
    rng = random.Random(seed)
    text, source = [], []
    size = 0
    while size < n_chars:
        defined = {}  # name -> position of its value's first digit
        doc_len = rng.randint(1200, 2400)
        start = size
        while size - start < doc_len:
            r = rng.random()
            if r < 0.25 or not defined:
                name = rng.choice("abcdefghjkmnpqrstuvwxyz") + str(rng.randint(0, 9))
                value = str(rng.randint(100, 999))
                piece = f"let {name} = "
                defined[name] = (size + len(piece), value)
                piece += value + " . "
                src = [-1] * len(piece)
            elif r < 0.45:
                name = rng.choice(list(defined))
                at, value = defined[name]
                piece = f"{name} is "
                src = [-1] * len(piece) + [at + i for i in range(3)] + [-1, -1, -1]
                piece += value + " . "
            else:
                piece = sentence(rng) + " "
                src = [-1] * len(piece)
            text.append(piece)
            source.extend(src)
            size += len(piece)
        text.append("\n")
        source.append(-1)
        size += 1
    return "".join(text), np.array(source, dtype=np.int64)


class Data:
    def __init__(self, n_chars, seed, seq, batch):
        text, self.source = generate_corpus(n_chars, seed)
        self.chars = sorted(set(text))
        self.ids = np.array([self.chars.index(c) for c in text], dtype=np.int64)
        self.seq, self.batch = seq, batch
        split = int(0.9 * len(self.ids))
        self.train_range, self.eval_range = (0, split - seq - 1), (split, len(self.ids) - seq - 1)
        self.text = text

    def batch_at(self, rng, lo_hi):
        starts = rng.integers(lo_hi[0], lo_hi[1], size=self.batch)
        x = np.stack([self.ids[s:s + self.seq] for s in starts])
        y = np.stack([self.ids[s + 1:s + self.seq + 1] for s in starts])
        # Recall targets: a copied digit whose source is inside the window.
        src = np.stack([self.source[s + 1:s + self.seq + 1] for s in starts])
        recall = (src >= starts[:, None])
        return torch.from_numpy(x), torch.from_numpy(y), torch.from_numpy(recall)


# ------------------------------------------------------------------- model

class Block(nn.Module):
    def __init__(self, d_model, heads, attention):
        super().__init__()
        self.heads, self.attention = heads, attention
        self.ln1, self.ln2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))

    def forward(self, x):
        B, N, C = x.shape
        # [B, N, 3, H, D]: q, k, v already in plsh's [B, N, H, D] layout.
        q, k, v = self.qkv(self.ln1(x)).view(B, N, 3, self.heads, C // self.heads).unbind(2)
        a = self.attention(q.contiguous(), k.contiguous(), v.contiguous())
        x = x + self.proj(a.reshape(B, N, C))
        return x + self.mlp(self.ln2(x))


class AlibiLM(nn.Module):
    """No position embeddings: ALiBi's bias is the only positional signal."""

    def __init__(self, vocab, d_model, heads, layers, attention):
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model)
        self.blocks = nn.ModuleList(Block(d_model, heads, attention) for _ in range(layers))
        self.ln = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab)

    def forward(self, ids):
        x = self.embed(ids)
        for b in self.blocks:
            x = b(x)
        return self.head(self.ln(x))


def losses(logits, y, recall):
    per_token = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1), reduction="none")
    r = recall.reshape(-1)
    return per_token.mean(), (per_token[r].mean() if r.any() else torch.tensor(float("nan")))


# ---------------------------------------------------------------- training

def train_mode(mode, args, data, client):
    # torch.manual_seed makes the run reproducible, lsh draws included: the
    # op draws a fresh seed from torch's generator on every forward (SPEC
    # section 8), so every layer and step trains against its own hashes.
    torch.manual_seed(args.seed)
    # q, k, v below are [B, N, H, D]; no estimates (a training run reads none).
    opts = dict(mode=mode, causal=True, layout="bnhd", estimates=False)
    if mode == "lsh":
        opts["samples"] = args.samples
    attention = lambda q, k, v: plsh_torch.attention(q, k, v, client=client, keep_context=not args.stateless, **opts)
    model = AlibiLM(len(data.chars), args.d_model, args.heads, args.layers, attention)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    rng = np.random.default_rng(args.seed)
    eval_rng = np.random.default_rng(args.seed + 1)
    eval_batches = [data.batch_at(eval_rng, data.eval_range) for _ in range(args.eval_batches)]
    rows = []
    t0 = time.monotonic()
    # The wire traffic of the training steps alone (evaluation excluded).
    traffic = {key: 0 for key in plsh_torch.stats()}
    for step in range(1, args.steps + 1):
        before = plsh_torch.stats()
        lr = args.lr * min(1.0, step / args.warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / args.steps)))
        for g in opt.param_groups:
            g["lr"] = lr
        x, y, recall = data.batch_at(rng, data.train_range)
        loss, recall_loss = losses(model(x), y, recall)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        after = plsh_torch.stats()
        for key in traffic:
            traffic[key] += after[key] - before[key]
        row = {"mode": mode, "step": step, "train_loss": loss.item(), "train_recall_loss": recall_loss.item(),
               "eval_loss": "", "eval_recall_loss": "", "seconds": time.monotonic() - t0}
        if step % args.eval_every == 0 or step == args.steps:
            with torch.no_grad():
                pairs = [losses(model(ex), ey, er) for ex, ey, er in eval_batches]
            row["eval_loss"] = float(np.mean([p[0].item() for p in pairs]))
            row["eval_recall_loss"] = float(np.nanmean([p[1].item() for p in pairs]))
            print(f"{mode:6s} step {step:4d}  train {loss.item():.3f}  eval {row['eval_loss']:.3f}  "
                  f"recall {row['eval_recall_loss']:.3f}  {row['seconds']:.0f} s", flush=True)
        rows.append(row)
    stats = traffic
    stats["seconds"] = time.monotonic() - t0
    stats["steps"] = args.steps
    return rows, stats


def plot(rows, path, title):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    colors = {"exact": "tab:blue", "window": "tab:green", "lsh": "tab:red"}
    for mode in dict.fromkeys(r["mode"] for r in rows):
        mine = [r for r in rows if r["mode"] == mode]
        steps = np.array([r["step"] for r in mine])
        train = np.array([r["train_loss"] for r in mine])
        k = max(1, len(train) // 30)
        smooth = np.convolve(train, np.ones(k) / k, mode="valid")
        c = colors.get(mode)
        axes[0].plot(steps[k - 1:], smooth, color=c, alpha=0.9, label=f"{mode} train (mean of {k})")
        ev = [(r["step"], r["eval_loss"], r["eval_recall_loss"]) for r in mine if r["eval_loss"] != ""]
        axes[0].plot([e[0] for e in ev], [e[1] for e in ev], "o--", color=c, ms=3, label=f"{mode} held-out")
        axes[1].plot([e[0] for e in ev], [e[2] for e in ev], "o-", color=c, ms=3, label=f"{mode} held-out recall")
    axes[1].axhline(math.log(10), color="gray", ls=":", lw=1, label="uniform over 10 digits (ln 10)")
    axes[0].set(xlabel="step", ylabel="cross-entropy (nats/char)", title="loss")
    axes[1].set(xlabel="step", ylabel="cross-entropy (nats/char)", title="recall digits (definition in context)")
    for a in axes:
        a.grid(alpha=0.3)
        a.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def start_server(binary, threads):
    proc = subprocess.Popen([binary, "--listen", "127.0.0.1:0", "--metrics-listen", "off", "--threads", str(threads)],
                            stderr=subprocess.PIPE, text=True)
    for line in proc.stderr:
        m = re.search(r" serving .*grpc=(\S+)", line)
        if m:
            # Keep reading its log (one line per request): a full pipe would stall it.
            threading.Thread(target=lambda: [None for _ in proc.stderr], daemon=True).start()
            return proc, m.group(1)
    raise RuntimeError("plsh-server did not start")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default=os.environ.get("PLSH_TARGET", "127.0.0.1:50051"))
    ap.add_argument("--server-bin", help="start this plsh-server on a free loopback port (and stop it at the end)")
    ap.add_argument("--server-threads", type=int, default=0, help="the started server's --threads (0: all cores)")
    ap.add_argument("--modes", default="exact,window,lsh")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--seq", type=int, default=512, help="context length")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--d-model", type=int, default=64)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--samples", type=int, default=16, help="lsh: hashes per head")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--eval-every", type=int, default=25)
    ap.add_argument("--eval-batches", type=int, default=4)
    ap.add_argument("--corpus-chars", type=int, default=600_000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--stateless", action="store_true",
                    help="keep no context: every backward sends q, k, v and dout (for the bytes comparison)")
    ap.add_argument("--out-dir", default="train_alibi_out")
    ap.add_argument("--replot", metavar="TITLE", help="only redraw OUT_DIR/loss.png from OUT_DIR/loss.csv")
    args = ap.parse_args()
    if args.replot:
        with open(os.path.join(args.out_dir, "loss.csv")) as f:
            rows = [{k: (v if k == "mode" or v == "" else float(v)) for k, v in r.items()} for r in csv.DictReader(f)]
        plot(rows, os.path.join(args.out_dir, "loss.png"), args.replot)
        return 0

    os.makedirs(args.out_dir, exist_ok=True)
    data = Data(args.corpus_chars, args.seed, args.seq, args.batch)
    print(f"corpus: {len(data.ids)} characters, vocabulary {len(data.chars)}; "
          f"{int(data.source.__ge__(0).sum())} copied digits; sample: {data.text[:120]!r}", flush=True)
    server = None
    target = args.target
    if args.server_bin:
        server, target = start_server(args.server_bin, args.server_threads)
    try:
        with Client(target) as client:
            info = client.info()
            device = info.backends[0].device if info.backends else "?"
            rows, summary = [], {}
            for mode in args.modes.split(","):
                r, stats = train_mode(mode, args, data, client)
                rows += r
                summary[mode] = stats
    finally:
        if server is not None:
            server.send_signal(signal.SIGTERM)
            server.wait(30)

    csv_path = os.path.join(args.out_dir, "loss.csv")
    with open(csv_path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    title = (f"ALiBi LM through plsh ({args.layers} layers, d={args.d_model}, {args.heads} heads, context {args.seq}, "
             f"batch {args.batch}, {args.steps} steps; lsh s={args.samples}; server: {device})")
    png_path = os.path.join(args.out_dir, "loss.png")
    plot(rows, png_path, title)
    print(f"wrote {csv_path} and {png_path}")
    print("mode     final train  final eval  eval recall  wall s   s/step   MB up/step  MB down/step  "
          "by-context  stateless")
    for mode, s in summary.items():
        last = [r for r in rows if r["mode"] == mode and r["eval_loss"] != ""][-1]
        tail = [r["train_loss"] for r in rows if r["mode"] == mode][-20:]
        print(f"{mode:8s} {np.mean(tail):11.3f} {last['eval_loss']:11.3f} {last['eval_recall_loss']:12.3f} "
              f"{s['seconds']:7.1f} {s['seconds'] / s['steps']:8.3f} {s['bytes_up'] / s['steps'] / 1e6:11.3f} "
              f"{s['bytes_down'] / s['steps'] / 1e6:13.3f} {s['backwards_by_context']:11d} {s['backwards_stateless']:10d}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
