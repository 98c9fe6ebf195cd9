#!/usr/bin/python3
"""Bytes on the wire per training step, with and without kept contexts.

One attention layer's training step is a forward and its backward. Three
ways to run it through plsh-server, each measured here (tensor payload
bytes as the server's summaries count them, both directions, and the
client's wall time per step, median of --steps):

  kept       forward with keep_context (q, k, v up; out down), then
             AttendBackward by context_id (dout up; dq, dk, dv down)
  send       stateless: forward with return_lse (q, k, v up; out, lse down),
             then AttendBackward with the forward header and q, k, v, out,
             lse, dout up (dq, dk, dv down)
  recompute  stateless: forward (q, k, v up; out down), then AttendBackward
             with recompute_forward: q, k, v, dout up, the server runs the
             forward again (dq, dk, dv down)

    PYTHONPATH=client/python:build/python /usr/bin/python3 bench/bytes_per_step.py \\
        --server-bin build/bin/plsh-server --shape 8,512,4,16 --shape 1,8192,8,64

Prints a Markdown table (bench/RESULTS.md, "Training: bytes on the wire").
gRPC's own framing (a few dozen bytes per message of up to 4 MiB) is not
counted."""

import argparse
import re
import signal
import statistics
import subprocess
import sys
import threading
import time

import numpy as np

from plsh_client import Client


def step(c, variant, q, k, v, dout, opts):
    forward = {key: value for key, value in opts.items() if key != "estimates"}  # the backward's forward header
    t0 = time.perf_counter()
    if variant == "kept":
        out, m = c.attend(q, k, v, keep_context=True, **opts)
        _, _, _, b = c.backward(dout, context_id=m["context_id"], kv_shape=k.shape)
    elif variant == "send":
        out, m = c.attend(q, k, v, return_lse=True, **opts)
        _, _, _, b = c.backward(dout, q=q, k=k, v=v, out=out, lse=m["lse"], **forward)
    else:
        out, m = c.attend(q, k, v, **opts)
        _, _, _, b = c.backward(dout, q=q, k=k, v=v, recompute_forward=True, **forward)
    seconds = time.perf_counter() - t0
    up = m["received_bytes"] + b["received_bytes"]
    down = m["sent_bytes"] + b["sent_bytes"]
    return up, down, seconds


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="127.0.0.1:50051")
    ap.add_argument("--server-bin")
    ap.add_argument("--shape", action="append", help="B,N,H,D (f32, Hkv = H); repeatable")
    ap.add_argument("--mode", default="lsh")
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args()
    shapes = [tuple(int(x) for x in s.split(",")) for s in (args.shape or ["8,512,4,16"])]
    server, target = None, args.target
    if args.server_bin:
        server = subprocess.Popen([args.server_bin, "--listen", "127.0.0.1:0", "--metrics-listen", "off"],
                                  stderr=subprocess.PIPE, text=True)
        for line in server.stderr:
            m = re.search(r" serving .*grpc=(\S+)", line)
            if m:
                target = m.group(1)
                # Keep reading its log (one line per request): a full pipe would stall it.
                threading.Thread(target=lambda: [None for _ in server.stderr], daemon=True).start()
                break
    opts = dict(mode=args.mode, causal=True, estimates=False)
    print(f"| shape B,N,H,D (f32) | variant | MiB up | MiB down | MiB total | vs kept | s/step (median of {args.steps}) |")
    print("|---|---|---:|---:|---:|---:|---:|")
    try:
        with Client(target) as c:
            for B, N, H, D in shapes:
                r = np.random.default_rng(0)
                q, k, v, dout = (r.standard_normal((B, N, H, D), dtype=np.float32) for _ in range(4))
                kept_total = None
                for variant in ("kept", "send", "recompute"):
                    step(c, variant, q, k, v, dout, opts)  # warm up
                    runs = [step(c, variant, q, k, v, dout, opts) for _ in range(args.steps)]
                    up, down = runs[0][0], runs[0][1]
                    assert all(x[:2] == (up, down) for x in runs)
                    total = up + down
                    kept_total = kept_total or total
                    print(f"| {B},{N},{H},{D} | {variant} | {up / 2**20:.3f} | {down / 2**20:.3f} | "
                          f"{total / 2**20:.3f} | {total / kept_total:.2f}x | "
                          f"{statistics.median(x[2] for x in runs):.3f} |", flush=True)
    finally:
        if server is not None:
            server.send_signal(signal.SIGTERM)
            server.wait(30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
