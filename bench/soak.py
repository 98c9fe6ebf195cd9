#!/usr/bin/python3
"""Soak test of plsh-server (issue 12): a real server on loopback under a
mixed load for a fixed time, checked for crashes, unexpected status codes,
wrong outputs and memory growth.

    PYTHONPATH=client/python /usr/bin/python3 bench/soak.py --duration 600 --concurrency 16

Starts build/bin/plsh-server on 127.0.0.1 (free ports; CPU backend,
--stream-idle-timeout 2, --max-message-bytes 1 MiB) and runs `concurrency`
client threads, each with its own channel, until `duration` seconds pass.
Each request is one of these kinds, drawn at random with the weights below,
and must end with the status listed:

  valid:MODE/DTYPE/causal|full   OK. Every mode (exact, window, lsh), f32 and
                                 f16, causal and not, GQA and q shorter than
                                 k among them, through the Python client
                                 (plsh_client). One in three is compared with
                                 a float64 NumPy reference computed here
                                 (lsh: from the SPEC section 5 draws, which
                                 the server also returns and which must agree).
  bad_field     INVALID_ARGUMENT  a header the server must refuse
  nonfinite     INVALID_ARGUMENT  a NaN in q
  overlap       INVALID_ARGUMENT  two chunks covering the same rows
  oversize      RESOURCE_EXHAUSTED a 1.5 MiB chunk (over --max-message-bytes)
  cancel        CANCELLED         the client cancels after the ack
  stalled       DEADLINE_EXCEEDED a header, then silence
  slow_reader   CANCELLED         8 MiB of output that the client never reads

Memory: the server's VmRSS (/proc/PID/status) every 2 s. After the warm-up
(the first 20 % of the run), the median RSS of the last 20 % must stay
within 5 % of the median of the 20 % after the warm-up. At the end, with
the load stopped, the server must still be up, answer a request, show no
memory reserved, and exit 0 on SIGTERM.

Prints a table of counts per kind and code, the RSS series summary and a
final "soak: N passed, M failed" line (requests with the expected code and,
where verified, the right output; a failed check counts as a failure too);
--json writes everything. Exit status 0 only when every check held.
"""

import argparse
import collections
import json
import math
import os
import random
import re
import statistics
import sys
import threading
import time
import urllib.request

import grpc
import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.append(os.path.join(ROOT, "tests", "deploy"))
import plsh_proc  # noqa: E402  (the plsh-server launcher the tests use too)

MIB = 1 << 20
MAX_MESSAGE_BYTES = 1 * MIB
IDLE_TIMEOUT_S = 2

WEIGHTS = {
    "valid": 70, "bad_field": 5, "nonfinite": 3, "overlap": 5, "oversize": 3,
    "cancel": 5, "stalled": 4, "slow_reader": 2,
}
EXPECTED = {
    "bad_field": "INVALID_ARGUMENT", "nonfinite": "INVALID_ARGUMENT", "overlap": "INVALID_ARGUMENT",
    "oversize": "RESOURCE_EXHAUSTED", "cancel": "CANCELLED", "stalled": "DEADLINE_EXCEEDED",
    "slow_reader": "CANCELLED",
}


# ---------------------------------------------------------------- reference

def default_slopes(heads):
    """ALiBi slopes of Press et al. (SPEC section 1); heads a power of two here."""
    assert heads & (heads - 1) == 0
    return [2.0 ** (-8.0 * (h + 1) / heads) for h in range(heads)]


def reference(q, k, v, *, mode, causal, slopes, draws=None, eps=1e-4):
    """Float64 ALiBi attention, [B, Nq, H, D] out; draws [H][s] of (pitch, shift) for lsh."""
    q, k, v = (np.asarray(a, dtype=np.float64) for a in (q, k, v))
    B, Nq, H, D = q.shape
    Nk, Hkv = k.shape[1], k.shape[2]
    scale = 1.0 / math.sqrt(D)
    qpos = np.arange(Nq) + (Nk - Nq)
    kpos = np.arange(Nk)
    dist = np.abs(qpos[:, None] - kpos[None, :]).astype(np.float64)
    allowed = (kpos[None, :] <= qpos[:, None]) if causal else np.ones_like(dist, dtype=bool)
    out = np.zeros_like(q)
    for h in range(H):
        kv = h // (H // Hkv)
        m = slopes[h]
        if mode == "lsh":
            weight = np.zeros_like(dist)
            for pitch, shift in draws[h]:
                weight += np.floor((qpos - shift) / pitch)[:, None] == np.floor((kpos - shift) / pitch)[None, :]
            weight /= len(draws[h])
        else:
            weight = np.exp(-m * dist)
            if mode == "window":
                width = math.ceil(math.log(1 / eps) / m)
                weight = np.where(dist < width, weight, 0.0)
        weight = np.where(allowed, weight, 0.0)
        for b in range(B):
            s = scale * q[b, :, h, :] @ k[b, :, kv, :].T
            a = np.exp(s - s.max(axis=1, keepdims=True)) * weight
            out[b, :, h, :] = (a @ v[b, :, kv, :]) / a.sum(axis=1, keepdims=True)
    return out


# ---------------------------------------------------------------- the server

class Server(plsh_proc.Server):
    def __init__(self, binary, extra):
        flags = ["--listen", "127.0.0.1:0", "--metrics-listen", "127.0.0.1:0", "--backend", "cpu",
                 "--stream-idle-timeout", str(IDLE_TIMEOUT_S), "--max-message-bytes", str(MAX_MESSAGE_BYTES),
                 "--workers", "2", "--threads", "1", "--queue-depth", "64", "--max-concurrent", "64", *extra]
        # The log grows by a line per request: keep the last 200 for the report.
        super().__init__(binary, flags, startup_timeout=30, tail=200)

    def rss_kib(self):
        try:
            with open(f"/proc/{self.proc.pid}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        return int(line.split()[1])
        except OSError:
            return None
        return None

    def scrape(self):
        text = urllib.request.urlopen(f"http://{self.metrics}/metrics", timeout=10).read().decode()
        samples = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                samples[name] = float(value)
        return samples


# ---------------------------------------------------------------- requests

class Soak:
    def __init__(self, server, args):
        from plsh_client import Client, PlshError  # noqa: needs PYTHONPATH (see the docstring)
        from plsh_client.sharding import draw_hashes  # SPEC section 5, in Python
        from plsh.v1 import plsh_pb2 as pb
        from plsh.v1 import plsh_pb2_grpc as pb_grpc
        self.Client, self.PlshError, self.pb, self.pb_grpc = Client, PlshError, pb, pb_grpc
        self.draw_hashes = draw_hashes
        self.server = server
        self.args = args
        self.lock = threading.Lock()
        self.counts = collections.defaultdict(collections.Counter)  # kind -> code -> n
        self.verified = collections.Counter()                       # kind -> outputs compared
        self.max_err = collections.defaultdict(float)               # kind -> worst |out - ref| / scale
        self.failures = []                                          # (kind, what) for every failed expectation
        self.latency = collections.defaultdict(list)

    def record(self, kind, code, seconds, failure=None):
        with self.lock:
            self.counts[kind][code] += 1
            self.latency[kind].append(seconds)
            if failure:
                self.failures.append((kind, failure))

    # One thread's loop.
    def worker(self, index, stop_at):
        rng = random.Random(self.args.seed * 1000 + index)
        # The non-reading client on a channel of its own with a small, fixed
        # stream window (no BDP probing): the client library's 32 MiB window
        # would take the whole 8 MiB output unread, and the server would
        # rightly finish OK.
        reader_channel = grpc.insecure_channel(
            self.server.grpc, options=[("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 64 << 10)])
        with self.Client(self.server.grpc) as client, reader_channel:
            stub = self.pb_grpc.AttentionStub(client._channel)
            slow_stub = self.pb_grpc.AttentionStub(reader_channel)
            kinds, weights = zip(*WEIGHTS.items())
            while time.monotonic() < stop_at:
                kind = rng.choices(kinds, weights)[0]
                t0 = time.monotonic()
                try:
                    if kind == "valid":
                        kind, code, failure = self.valid(client, rng)
                    else:
                        code = getattr(self, kind)(slow_stub if kind == "slow_reader" else stub, rng)
                        failure = None if code == EXPECTED[kind] else f"got {code}, expected {EXPECTED[kind]}"
                except Exception as e:  # a bug in this script or the client: count it, go on
                    code, failure = "EXCEPTION", f"{type(e).__name__}: {e}"
                self.record(kind, code, time.monotonic() - t0, failure)

    def valid(self, client, rng):
        mode = rng.choice(["exact", "window", "lsh"])
        dtype = rng.choice(["f32", "f16"])
        causal = rng.random() < 0.5
        kind = f"valid:{mode}/{dtype}/{'causal' if causal else 'full'}"
        B = rng.choice([1, 2])
        H = rng.choice([2, 4])
        Hkv = rng.choice([h for h in (1, 2, H) if H % h == 0])
        D = rng.choice([16, 32])
        Nk = rng.choice([17, 64, 100, 256])
        Nq = Nk if rng.random() < 0.7 else rng.randint(1, Nk)
        npr = np.random.default_rng(rng.getrandbits(32))
        np_dtype = np.float32 if dtype == "f32" else np.float16
        q = npr.standard_normal((B, Nq, H, D)).astype(np_dtype)
        k = npr.standard_normal((B, Nk, Hkv, D)).astype(np_dtype)
        v = npr.standard_normal((B, Nk, Hkv, D)).astype(np_dtype)
        slopes = default_slopes(H)
        seed = rng.getrandbits(63)
        samples = rng.choice([4, 16])
        verify = rng.random() < 1 / 3
        try:
            out, meta = client.attend(q, k, v, mode=mode, causal=causal, slopes=slopes, samples=samples,
                                      seed=seed, return_draws=(mode == "lsh" and verify),
                                      probe_rows=8, deadline=60)
        except self.PlshError as e:
            return kind, e.code_name, f"got {e.code_name}: {e.details[:200]}"
        if out.shape != q.shape or out.dtype != np_dtype:
            return kind, "OK", f"out {out.shape} {out.dtype}, expected {q.shape} {np_dtype}"
        if not verify:
            return kind, "OK", None
        draws = None
        if mode == "lsh":
            draws = [h["draws"] for h in meta["heads"]]
            for h in range(H):
                spec = self.draw_hashes(seed, h, 1 / slopes[h], samples)
                for s in (0, samples - 1):
                    want = spec[s]
                    if not np.allclose(draws[h][s], want, rtol=1e-12, atol=0):
                        return kind, "OK", f"draw (head {h}, sample {s}) = {draws[h][s]}, SPEC 5 gives {want}"
        ref = reference(q, k, v, mode=mode, causal=causal, slopes=slopes, draws=draws)
        err = float(np.max(np.abs(out.astype(np.float64) - ref))) / max(1.0, float(np.max(np.abs(ref))))
        # float32 accumulation vs float64; float16 output rounding (2^-11 relative) dominates for f16.
        tol = 1e-4 if dtype == "f32" else 4e-3
        with self.lock:
            self.verified[kind] += 1
            self.max_err[kind] = max(self.max_err[kind], err)
        if not err <= tol:
            return kind, "OK", f"output differs from the float64 reference by {err:.3g} (tolerance {tol})"
        return kind, "OK", None

    # Raw streams: the request iterator and the call, run to the end; returns the code's name.
    def run_stream(self, stub, messages, *, after_ack=None, read_after=0, deadline=30):
        call = stub.Attend(messages, timeout=deadline)
        # A client that reads nothing for read_after seconds. (grpcio reports the server's cancel only
        # once the client reads again: a call left unread ends at its deadline instead.)
        time.sleep(read_after)
        try:
            for response in call:
                if response.WhichOneof("kind") == "ack" and after_ack:
                    after_ack(call)
        except grpc.RpcError as e:
            return e.code().name
        return "OK"

    def header(self, **fields):
        h = dict(q_len=64, kv_len=64, heads=2, head_dim=16, dtype=self.pb.DTYPE_F32, mode=self.pb.MODE_EXACT)
        h.update(fields)
        return self.pb.AttendRequest(header=self.pb.AttendHeader(**h))

    def chunk(self, tensor, start, count, row_floats, value=0.5):
        data = np.full(count * row_floats, value, dtype="<f4").tobytes()
        return self.pb.AttendRequest(chunk=self.pb.TensorChunk(tensor=tensor, row_start=start, row_count=count,
                                                               data=data))

    def full_input(self, n, row_floats, bad_value=None):
        pb = self.pb
        for t in (pb.TENSOR_Q, pb.TENSOR_K, pb.TENSOR_V):
            m = self.chunk(t, 0, n, row_floats)
            if bad_value is not None and t == pb.TENSOR_Q:
                data = bytearray(m.chunk.data)
                data[4 * 7:4 * 8] = np.array([bad_value], dtype="<f4").tobytes()
                m.chunk.data = bytes(data)
            yield m
        yield pb.AttendRequest(end=pb.EndOfInput())

    def bad_field(self, stub, rng):
        edits = [dict(heads=4, kv_heads=3), dict(mode=self.pb.MODE_LSH, samples=0), dict(head_dim=0),
                 dict(dtype=self.pb.DTYPE_UNSPECIFIED), dict(slopes=[1.0]), dict(causal=True, q_pos0=-1)]
        return self.run_stream(stub, iter([self.header(**rng.choice(edits))]))

    def nonfinite(self, stub, rng):
        bad = rng.choice([float("nan"), float("inf"), float("-inf")])
        return self.run_stream(stub, iter([self.header(), *self.full_input(64, 32, bad_value=bad)]))

    def overlap(self, stub, rng):
        pb = self.pb
        start = rng.randint(1, 40)
        return self.run_stream(stub, iter([self.header(), self.chunk(pb.TENSOR_K, 0, start + 8, 32),
                                           self.chunk(pb.TENSOR_K, start, 8, 32)]))

    def oversize(self, stub, rng):
        # 1536 rows of 8 x 32 f32 = 1.5 MiB in one message: over 1 MiB, under gRPC's own 2x limit.
        return self.run_stream(stub, iter([self.header(q_len=2048, kv_len=2048, heads=8, head_dim=32),
                                           self.chunk(self.pb.TENSOR_Q, 0, 1536, 8 * 32)]))

    def cancel(self, stub, rng):
        release = threading.Event()

        def messages():
            yield self.header()
            yield self.chunk(self.pb.TENSOR_Q, 0, 32, 32)
            release.wait(10)

        try:
            return self.run_stream(stub, messages(), after_ack=lambda call: call.cancel())
        finally:
            release.set()

    def stalled(self, stub, rng):
        release = threading.Event()

        def messages():
            yield self.header()
            release.wait(20)  # silence: the server's --stream-idle-timeout (2 s) must end the call first

        try:
            return self.run_stream(stub, messages())
        finally:
            release.set()

    def slow_reader(self, stub, rng):
        # Exact with one key: trivial to compute; 16384 x 8 x 16 f32 = 8 MiB out, never read.
        pb = self.pb
        n, row = 16384, 8 * 16

        def messages():
            yield self.header(q_len=n, kv_len=1, heads=8, head_dim=16)
            per = 1024  # 512 KiB messages, under --max-message-bytes
            for start in range(0, n, per):
                yield self.chunk(pb.TENSOR_Q, start, per, row)
            yield self.chunk(pb.TENSOR_K, 0, 1, row)
            yield self.chunk(pb.TENSOR_V, 0, 1, row)
            yield pb.AttendRequest(end=pb.EndOfInput())

        return self.run_stream(stub, messages(), read_after=IDLE_TIMEOUT_S + 2)


# ---------------------------------------------------------------- main

def summarize_rss(series, duration):
    """series: [(seconds since start, KiB)]; warm-up = the first 20 %."""
    warm = 0.2 * duration
    after = [kib for t, kib in series if warm <= t < warm + 0.2 * duration]
    end = [kib for t, kib in series if t >= 0.8 * duration]
    if not after or not end:
        return None
    base, last = statistics.median(after), statistics.median(end)
    return {"samples": len(series), "min_kib": min(k for _, k in series), "max_kib": max(k for _, k in series),
            "after_warmup_median_kib": base, "end_median_kib": last, "growth": last / base - 1}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--duration", type=float, default=600, help="seconds of load (default 600)")
    p.add_argument("--concurrency", type=int, default=16, help="client threads (default 16)")
    p.add_argument("--server", default=os.path.join(ROOT, "build", "bin", "plsh-server"))
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--max-rss-growth", type=float, default=0.05, help="allowed end/after-warm-up RSS ratio - 1")
    p.add_argument("--no-rss-check", action="store_true",
                   help="report the RSS but do not check it (short runs, sanitizer builds)")
    p.add_argument("--json", help="write the counts, the RSS series and the verdict here")
    p.add_argument("server_flags", nargs="*", help="extra plsh-server flags (after --)")
    args = p.parse_args()

    stubs = os.environ.get("PLSH_PYTHON_STUBS", os.path.join(os.path.dirname(os.path.dirname(args.server)), "python"))
    sys.path.insert(0, stubs)
    sys.path.insert(0, os.path.join(ROOT, "client", "python"))

    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    server = Server(args.server, args.server_flags)
    soak = Soak(server, args)
    t0 = time.monotonic()
    stop_at = t0 + args.duration
    rss = []
    sampling = threading.Event()

    def sample_rss():
        while not sampling.is_set():
            kib = server.rss_kib()
            if kib is not None:
                rss.append((round(time.monotonic() - t0, 1), kib))
            sampling.wait(2)

    sampler = threading.Thread(target=sample_rss, daemon=True)
    sampler.start()
    workers = [threading.Thread(target=soak.worker, args=(i, stop_at)) for i in range(args.concurrency)]
    for w in workers:
        w.start()
    next_report = t0 + 60
    while any(w.is_alive() for w in workers):
        time.sleep(1)
        if time.monotonic() >= next_report:
            next_report += 60
            with soak.lock:
                done = sum(sum(c.values()) for c in soak.counts.values())
            print(f"  {time.monotonic() - t0:5.0f} s: {done} requests, {len(soak.failures)} failed, "
                  f"RSS {rss[-1][1] / 1024:.0f} MiB", flush=True)
    elapsed = time.monotonic() - t0
    sampling.set()
    sampler.join()

    # After the load: still up, nothing held, still serving, and a clean exit.
    checks = {}
    checks["alive_after_load"] = server.proc.poll() is None
    held = None
    for _ in range(50):  # calls the clients ended may take a moment to close on the server
        m = server.scrape()
        held = (sum(v for n, v in m.items() if n.startswith("plsh_memory_reserved_bytes") and 'space="host"' in n),
                m.get("plsh_inflight_requests", 0))
        if held == (0, 0):
            break
        time.sleep(0.2)
    checks["nothing_held_after_load"] = held == (0, 0)
    code_totals = {n: v for n, v in m.items() if n.startswith("plsh_requests_total")}
    timeouts = {n: v for n, v in m.items() if n.startswith("plsh_stream_timeouts_total")}
    with soak.Client(server.grpc) as c:
        q = np.ones((1, 8, 2, 16), dtype=np.float32)
        out, _ = c.attend(q, q, q, mode="exact", deadline=30)
        checks["serves_after_load"] = bool(np.allclose(out, 1.0))
    idle_rss = server.rss_kib()
    exit_code = server.stop(timeout=60)
    checks["exit_0_on_sigterm"] = exit_code == 0
    rss_summary = summarize_rss(rss, args.duration)
    if not args.no_rss_check:
        checks["rss_within_limit"] = rss_summary is not None and rss_summary["growth"] <= args.max_rss_growth

    total = sum(sum(c.values()) for c in soak.counts.values())
    failed = len(soak.failures) + sum(1 for ok in checks.values() if not ok)
    print(f"soak: plsh-server {' '.join(server.command[1:])}")
    print(f"started {started}, {elapsed:.0f} s of load, concurrency {args.concurrency}, {total} requests "
          f"({total / elapsed:.1f}/s), server log {server.line_count} lines")
    print(f"{'kind':28} {'requests':>8}  codes{'':20} {'verified':>8} {'max err':>9} {'p50 s':>7} {'p99 s':>7}")
    for kind in sorted(soak.counts):
        codes = ", ".join(f"{c} {n}" for c, n in soak.counts[kind].most_common())
        lat = sorted(soak.latency[kind])
        p50, p99 = lat[len(lat) // 2], lat[min(len(lat) - 1, int(0.99 * len(lat)))]
        err = f"{soak.max_err[kind]:.2e}" if soak.verified[kind] else "-"
        print(f"{kind:28} {sum(soak.counts[kind].values()):8}  {codes:25} {soak.verified[kind]:8} {err:>9} "
              f"{p50:7.3f} {p99:7.3f}")
    def label(name, key):
        m = re.search(key + r'="(\w+)"', name)
        return m.group(1) if m else "?"

    print("server's plsh_requests_total:", ", ".join(f"{label(n, 'code')}/{label(n, 'mode')}/{label(n, 'backend')} {v:.0f}"
                                                     for n, v in sorted(code_totals.items()) if v))
    print("server's plsh_stream_timeouts_total:", ", ".join(f"{label(n, 'reason')} {v:.0f}"
                                                            for n, v in sorted(timeouts.items())))
    if rss_summary:
        print(f"RSS: {rss_summary['samples']} samples every 2 s, min {rss_summary['min_kib'] / 1024:.1f} MiB, "
              f"max {rss_summary['max_kib'] / 1024:.1f} MiB; median after warm-up "
              f"{rss_summary['after_warmup_median_kib'] / 1024:.1f} MiB, median at the end "
              f"{rss_summary['end_median_kib'] / 1024:.1f} MiB ({100 * rss_summary['growth']:+.2f} %, "
              f"limit {100 * args.max_rss_growth:+.0f} %); idle after the load {idle_rss / 1024:.1f} MiB")
    for name, ok in checks.items():
        print(f"check {name}: {'ok' if ok else 'FAILED'}")
    for kind, what in soak.failures[:20]:
        print(f"FAILED {kind}: {what}")
    if len(soak.failures) > 20:
        print(f"... and {len(soak.failures) - 20} more")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"started": started, "duration_s": elapsed, "concurrency": args.concurrency,
                       "command": server.command, "counts": {k: dict(v) for k, v in soak.counts.items()},
                       "verified": dict(soak.verified), "max_err": dict(soak.max_err),
                       "server_requests_total": code_totals, "server_stream_timeouts_total": timeouts,
                       "rss_series_kib": rss, "rss": rss_summary, "idle_rss_kib": idle_rss, "checks": checks,
                       "failures": soak.failures}, f, indent=1)
    if failed:
        print("server log, last lines:\n" + server.log(20))
    print(f"soak: {total - len(soak.failures)} passed, {failed} failed")
    return 0 if failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
