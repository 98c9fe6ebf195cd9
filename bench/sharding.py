#!/usr/bin/python3
"""Sharding benchmark: one request cut across 1, 2 and 3 plsh-server replicas
on loopback (plsh/sharding.h), through `plsh bench` (closed loop, one request
in flight). Prints a Markdown table: per configuration and shard count, the
cut the client chose, tensor MB sent and received per request, client wall
time (p50 and min) and the server's compute time (the slowest shard's).

    bench/sharding.py --build build [--requests 5] [--threads 1] [--configs exact,window,lsh,lsh-mqa]

MB are 10^6 bytes of tensor payload. Starts its own three servers (--listen 127.0.0.1:0, --threads T each) and
stops them. A benchmark, not a test: bench/RESULTS.md records its runs."""

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading

CONFIGS = {
    # name: (plsh bench flags, what it shows)
    "small": (["--shape", "1,512,8,8,64", "--mode", "exact"], "exact n=512, H=Hkv=8 (4 MiB: the fixed cost)"),
    "exact": (["--shape", "1,4096,8,8,64", "--mode", "exact", "--causal"], "exact causal n=4096, H=Hkv=8"),
    "window": (["--shape", "1,16384,8,8,64", "--mode", "window", "--causal"], "window (eps 1e-4) causal n=16384, H=Hkv=8"),
    "lsh": (["--shape", "1,16384,8,8,64", "--mode", "lsh", "--samples", "16", "--causal"],
            "lsh s=16 causal n=16384, H=Hkv=8"),
    "lsh-mqa": (["--shape", "1,16384,8,1,64", "--mode", "lsh", "--samples", "16", "--causal"],
                "lsh s=16 causal n=16384, H=8, Hkv=1 (no head cut)"),
}


def start_server(binary, threads):
    proc = subprocess.Popen([binary, "--listen", "127.0.0.1:0", "--metrics-listen", "off", "--threads", str(threads)],
                            stderr=subprocess.PIPE, text=True)
    address = []
    ready = threading.Event()

    def read():
        for line in proc.stderr:
            m = re.search(r" serving .*grpc=(\S+)", line)
            if m:
                address.append(m.group(1))
                ready.set()
        ready.set()

    threading.Thread(target=read, daemon=True).start()
    ready.wait(20)
    if not address:
        proc.kill()
        sys.exit(f"{binary} did not start")
    return proc, address[0]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--build", default="build")
    ap.add_argument("--requests", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1, help="--threads of each server")
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--shard-by", default="auto")
    args = ap.parse_args()
    plsh = os.path.join(args.build, "bin", "plsh")
    servers = [start_server(os.path.join(args.build, "bin", "plsh-server"), args.threads) for _ in range(3)]
    addresses = [a for _, a in servers]
    print(f"replicas {', '.join(addresses)}; server --threads {args.threads}; "
          f"load average {os.getloadavg()[0]:.1f} at start", file=sys.stderr)
    print("| request | replicas | cut | MB sent / req | largest shard MB sent | MB received / req | wall p50 ms | "
          "wall min ms | server compute p50 ms |")
    print("|---|---|---|---|---|---|---|---|---|")
    try:
        for name in args.configs.split(","):
            flags, title = CONFIGS[name]
            for p in (1, 2, 3):
                with tempfile.NamedTemporaryFile(suffix=".json") as out:
                    cmd = [plsh, "bench", "--target", ",".join(addresses[:p]), "--shards", str(p), "--shard-by",
                           args.shard_by, *flags, "--requests", str(args.requests), "--warmup", "0", "--quiet",
                           "--json", out.name]
                    run = subprocess.run(cmd, capture_output=True, text=True)
                    if run.returncode != 0:
                        sys.exit(f"{' '.join(cmd)}: {run.stderr}")
                    level = json.load(open(out.name))["levels"][0]
                per_s = level["throughput"]["ok_per_s"]
                up = level["throughput"]["mb_up_per_s"] / per_s
                down = level["throughput"]["mb_down_per_s"] / per_s
                cut, largest = cut_of(plsh, addresses[:p], flags, args.shard_by)
                print(f"| {title} | {p} | {cut} | {up:.1f} | {largest:.1f} | {down:.1f} | {level['latency_ms']['p50']:.0f} | "
                      f"{level['latency_ms']['min']:.0f} | {level['server_ms']['computing']['p50']:.0f} |", flush=True)
    finally:
        for proc, _ in servers:
            proc.send_signal(signal.SIGTERM)
        for proc, _ in servers:
            proc.wait(30)
    print(f"load average {os.getloadavg()[0]:.1f} at the end", file=sys.stderr)


def cut_of(plsh, replicas, flags, shard_by):
    """The cut plsh attend chooses for the same request, and its largest
    shard's MB sent (a one-off request on random inputs)."""
    shape = dict(zip(["B", "N", "H", "Hkv", "D"], map(int, flags[flags.index("--shape") + 1].split(","))))
    mode = flags[flags.index("--mode") + 1]
    with tempfile.TemporaryDirectory() as tmp:
        code = ("import numpy as np, sys; r = np.random.default_rng(0); B, N, H, Hkv, D = map(int, sys.argv[1:6]); "
                "[np.save(f'{sys.argv[6]}/{n}.npy', r.standard_normal((B, N, h, D)).astype(np.float32)) "
                "for n, h in (('q', H), ('k', Hkv), ('v', Hkv))]")
        subprocess.run([sys.executable, "-c", code, *map(str, shape.values()), tmp], check=True)
        cmd = [plsh, "attend", "--target", ",".join(replicas), "--shards", str(len(replicas)), "--shard-by", shard_by,
               "--q", f"{tmp}/q.npy", "--k", f"{tmp}/k.npy", "--v", f"{tmp}/v.npy", "--mode", mode, "--out",
               f"{tmp}/o.npy", "--meta", f"{tmp}/m.json"]
        if "--causal" in flags:
            cmd.append("--causal")
        if "--samples" in flags:
            cmd += ["--samples", flags[flags.index("--samples") + 1]]
        subprocess.run(cmd, check=True, capture_output=True)
        s = json.load(open(f"{tmp}/m.json"))["sharding"]
        largest = max(x["sent_bytes"] for x in s["shards"]) / 1e6
        return (s["kind"] if s["kind"] == "single" else f"{s['kind']} x{len(s['shards'])}"), largest


if __name__ == "__main__":
    main()
