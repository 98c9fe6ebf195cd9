#!/usr/bin/python3
"""Client latency of plsh_client.Client.attend, call after call on one
channel (closed loop, one in flight): the Python twin of
`plsh bench --concurrency 1`, for bench/RESULTS.md ("Python client
latency"). Prints one line: the first call, then p50, p90, p99 and the mean
of the calls after a warm-up, in milliseconds.

    PYTHONPATH=client/python:build/python /usr/bin/python3 bench/python_latency.py \\
        --target 127.0.0.1:50051 --shape 1,64,4,4,32 --mode exact --duration 10

Works with the client before the package too (the call and its (out, meta) result are
the same), so that one run can compare the two."""

import argparse
import time

import numpy as np

from plsh_client import Client


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", required=True)
    ap.add_argument("--shape", default="1,64,4,4,32", help="B,N,H,Hkv,D (as plsh bench's)")
    ap.add_argument("--kv-len", type=int, default=0, help="keys (0: N, as plsh bench's)")
    ap.add_argument("--mode", default="exact")
    ap.add_argument("--duration", type=float, default=10, help="seconds measured")
    ap.add_argument("--warmup", type=float, default=1, help="seconds before measuring")
    ap.add_argument("--rpc", default="", help="the packaged client only: auto, stream or unary (empty: not passed)")
    ap.add_argument("--label", default="", help="printed first, to tell runs apart")
    args = ap.parse_args()
    b, n, h, hkv, d = (int(x) for x in args.shape.split(","))
    r = np.random.default_rng(0)
    q = r.standard_normal((b, n, h, d)).astype(np.float32)
    k = r.standard_normal((b, args.kv_len or n, hkv, d)).astype(np.float32)
    v = r.standard_normal((b, args.kv_len or n, hkv, d)).astype(np.float32)
    kw = {"mode": args.mode, **({"rpc": args.rpc} if args.rpc else {})}
    with Client(args.target) as c:
        t0 = time.perf_counter()
        c.attend(q, k, v, **kw)
        first = time.perf_counter() - t0
        end = time.monotonic() + args.warmup
        while time.monotonic() < end:
            c.attend(q, k, v, **kw)
        seconds = []
        end = time.monotonic() + args.duration
        while time.monotonic() < end:
            t0 = time.perf_counter()
            c.attend(q, k, v, **kw)
            seconds.append(time.perf_counter() - t0)
    ms = np.array(seconds) * 1e3
    p50, p90, p99 = np.percentile(ms, [50, 90, 99])
    rpc = f" {args.rpc}" if args.rpc else ""
    print(f"{args.label:24s} shape {args.shape} kv {args.kv_len or n} {args.mode}{rpc}: {len(ms)} calls, "
          f"first {first * 1e3:.2f} ms, "
          f"p50 {p50:.3f}  p90 {p90:.3f}  p99 {p99:.3f}  mean {ms.mean():.3f} ms")


if __name__ == "__main__":
    main()
