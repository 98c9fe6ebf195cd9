#!/usr/bin/python3
"""Reproducer (open, not in ctest): an lsh header makes plsh-server compute
and hold its draws before the request is charged to --memory-budget.

heads = 20000, head_dim = 1, q_len = kv_len = 1, samples = 4096 passes every
default limit (tokens 1, tensors 320 KB, summary ~4 MB); plan_request ->
plan_attention -> start_plan -> plan_draws then allocates 20000 x 4096 x 16 B
= 1.3 GB and spends seconds of CPU on a gRPC thread, and only then does
reserve_and_allocate compare the charge (which does count the draws) with
the budget. N such 18-byte headers at once hold N x 1.3 GB, up to
--max-concurrent (64) of them: far past any budget, and an OOM kill on a
24 GiB machine.

    /usr/bin/python3 tests/fuzz/known/draws_before_budget.py [build/bin/plsh-server]

Starts the server with --memory-budget 1GiB, opens 4 streams that send that
header, samples VmRSS for 15 s. Exits 1 (bug present) when the server's RSS
rises above twice the budget. The 18-byte header alone is
header-draws-before-budget here (fuzz_header replays it in ~8 s, 1.4 GB).
"""
import os
import re
import signal
import subprocess
import sys
import threading
import time

import grpc

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
binary = sys.argv[1] if len(sys.argv) > 1 else os.path.join(ROOT, "build", "bin", "plsh-server")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(binary)), "python"))
from plsh.v1 import plsh_pb2 as pb, plsh_pb2_grpc as pb_grpc  # noqa: E402

BUDGET = 1 << 30
proc = subprocess.Popen([binary, "--listen", "127.0.0.1:0", "--metrics-listen", "off", "--backend", "cpu",
                         "--memory-budget", str(BUDGET)], stderr=subprocess.PIPE, text=True)
address = None
for line in proc.stderr:
    m = re.search(r" serving .*grpc=(\S+)", line)
    if m:
        address = m.group(1)
        break
threading.Thread(target=lambda: [None for _ in proc.stderr], daemon=True).start()


def rss_mib():
    with open(f"/proc/{proc.pid}/status") as f:
        return next(int(l.split()[1]) // 1024 for l in f if l.startswith("VmRSS:"))


stub = pb_grpc.AttentionStub(grpc.insecure_channel(address))
header = pb.AttendHeader(q_len=1, kv_len=1, heads=20000, head_dim=1, dtype=pb.DTYPE_F32, mode=pb.MODE_LSH,
                         samples=4096)
codes = []


def stream():
    try:
        for _ in stub.Attend(iter([pb.AttendRequest(header=header)]), timeout=15):
            pass
        codes.append("OK")
    except grpc.RpcError as e:
        codes.append(e.code().name)


threads = [threading.Thread(target=stream) for _ in range(4)]
for t in threads:
    t.start()
peak = 0
for _ in range(30):
    time.sleep(0.5)
    peak = max(peak, rss_mib())
for t in threads:
    t.join()
proc.send_signal(signal.SIGTERM)
proc.wait(60)
print(f"--memory-budget {BUDGET >> 20} MiB; 4 headers of {header.ByteSize()} bytes; peak RSS {peak} MiB; "
      f"client codes {sorted(codes)}")
bad = peak > 2 * (BUDGET >> 20)
print("BUG: the draws are allocated before the budget is checked" if bad else "ok: RSS stayed near the budget")
sys.exit(1 if bad else 0)
