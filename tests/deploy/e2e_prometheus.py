#!/usr/bin/env python3
"""End to end: the real plsh-server, a real Prometheus (Debian's) with the
deploy scrape config and rules, about 20 s of load from the plsh CLI, then
every query of the Grafana dashboard must return data from that Prometheus,
`up` must be 1 and every recording rule must produce series, every rule
evaluating without error.

Everything runs on loopback ports picked free, in --work (recreated), and is
stopped on exit, on error and on timeout (SIGALRM bounds the whole test).

The load: `plsh bench` when the CLI has it, else loops of `plsh attend`
(exact, lsh and window requests, plus one request per loop that the server
must refuse, so that the request-rate panel shows more than one code)."""
import argparse
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request

import yaml

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from check_static import dashboard_queries, substitute_grafana  # noqa: E402
from deploy_checks import finish  # noqa: E402
from plsh_proc import Server  # noqa: E402

LOAD_SECONDS = 20.0
SCRAPE_SECONDS = 1
# Grafana's $__rate_interval for a 1 s scrape interval: four scrapes.
RATE_INTERVAL = "4s"


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def api(prom, path, **params):
    url = f"http://{prom}/api/v1/{path}?{urllib.parse.urlencode(params)}"
    with urllib.request.urlopen(url, timeout=10) as r:
        body = json.load(r)
    if body.get("status") != "success":
        raise RuntimeError(f"{url}: {body}")
    return body["data"]


def has_values(data):
    """True when a query result holds at least one finite sample."""
    if data["resultType"] == "matrix":
        return any(v[1] not in ("NaN", "+Inf", "-Inf") for s in data["result"] for v in s["values"])
    if data["resultType"] == "vector":
        return any(s["value"][1] not in ("NaN", "+Inf", "-Inf") for s in data["result"])
    return data["resultType"] == "scalar"


def write_npy_inputs(work, n, heads, dim):
    """q, k, v (and dout, for the backward) as .npy [n, heads, dim] float32, fixed seed."""
    code = ("import numpy as np, sys; r = np.random.default_rng(7); "
            f"[np.save(sys.argv[1] + '/' + t + '.npy', r.standard_normal(({n}, {heads}, {dim}), dtype=np.float32)) "
            "for t in ('q', 'k', 'v', 'dout')]")
    subprocess.run(["/usr/bin/python3", "-c", code, work], check=True, timeout=60)


class Load:
    """Bounded load against the server from the plsh CLI."""

    def __init__(self, cli, target, work, seconds, kind="auto"):
        self.cli, self.target, self.work, self.seconds = cli, target, work, seconds
        self.counts = {}
        self.failures = []
        self.lock = threading.Lock()
        help_text = subprocess.run([cli, "--help"], capture_output=True, text=True, timeout=30).stdout
        self.kind = kind if kind != "auto" else "bench" if re.search(r"^\s+bench\b", help_text, re.M) else "attend"
        # Training steps where the CLI has them: plsh bench --backward, plsh attend --dout.
        self.backward = self.kind == "bench" and "--backward" in subprocess.run(
            [cli, "bench", "--help"], capture_output=True, text=True, timeout=30).stdout
        self.attend_backward = self.kind == "attend" and "--dout" in subprocess.run(
            [cli, "attend", "--help"], capture_output=True, text=True, timeout=30).stdout

    def describe(self):
        return f"plsh {self.kind}"

    def run(self):
        if self.kind == "bench":
            return self.run_bench()
        write_npy_inputs(self.work, 512, 4, 32)
        deadline = time.monotonic() + self.seconds
        threads = [threading.Thread(target=self.attend_loop, args=(i, deadline)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    def attend(self, mode, *extra):
        w = self.work
        cmd = [self.cli, "attend", "--target", self.target, "--q", f"{w}/q.npy", "--k", f"{w}/k.npy",
               "--v", f"{w}/v.npy", "--mode", mode, "--causal", "--out", f"{w}/out-{threading.get_ident()}.npy",
               *extra]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
        return r

    def attend_loop(self, index, deadline):
        # One refused request first: samples above the server's limit.
        r = self.attend("lsh", "--samples", "1000000")
        self.tally("refused" if r.returncode != 0 else "unexpectedly accepted", r)
        modes = ["exact", "lsh", "window"]
        i = index
        while time.monotonic() < deadline:
            mode = modes[i % len(modes)]
            i += 1
            extra = []
            if mode == "window" and self.attend_backward:
                # A training step: forward keeping its context, then the backward.
                w, t = self.work, threading.get_ident()
                extra = ["--dout", f"{w}/dout.npy", "--dq", f"{w}/dq-{t}.npy", "--dk", f"{w}/dk-{t}.npy",
                         "--dv", f"{w}/dv-{t}.npy"]
            r = self.attend(mode, "--samples", "16", "--seed", str(i), *extra)
            self.tally(mode if r.returncode == 0 else f"{mode} failed", r)

    def tally(self, key, result):
        with self.lock:
            self.counts[key] = self.counts.get(key, 0) + 1
            if "failed" in key or "unexpectedly" in key:
                self.failures.append(f"{key}: rc={result.returncode} {result.stderr.strip()[-300:]}")

    def run_bench(self):
        # One closed-loop client per mode, in parallel for the whole window:
        # exact feeds the latency panels, lsh and window the error panels too;
        # window runs training steps (--backward: a forward keeping its
        # context, then its backward) for the training row.
        procs = {}
        for mode in ("exact", "lsh", "window"):
            cmd = [self.cli, "bench", "--target", self.target, "--mode", mode, "--causal",
                   "--shape", "1,512,4,4,32", "--concurrency", "1", "--warmup", "1",
                   "--duration", str(self.seconds - 1), "--quiet",
                   "--json", os.path.join(self.work, f"bench-{mode}.json")]
            if mode == "window" and self.backward:
                cmd.append("--backward")
            procs[mode] = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                           stderr=subprocess.PIPE, text=True)
        for mode, p in procs.items():
            try:
                out, err = p.communicate(timeout=self.seconds + 60)
            except subprocess.TimeoutExpired:
                p.kill()
                out, err = p.communicate()
            self.counts[f"bench {mode}"] = p.returncode
            if p.returncode != 0:
                self.failures.append(f"plsh bench --mode {mode}: rc={p.returncode} {err.strip()[-500:]}")
            else:
                print(f"plsh bench --mode {mode}:\n{out.rstrip()[-1500:]}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--repo", required=True)
    ap.add_argument("--server", required=True)
    ap.add_argument("--cli", required=True)
    ap.add_argument("--prometheus", default="prometheus")
    ap.add_argument("--work", required=True)
    ap.add_argument("--timeout", type=float, default=150)
    ap.add_argument("--load", choices=("auto", "bench", "attend"), default="auto",
                    help="load generator (auto: bench when the CLI has it)")
    args = ap.parse_args()
    deploy = os.path.join(args.repo, "deploy")

    def on_alarm(*_):
        raise TimeoutError(f"e2e test exceeded {args.timeout:.0f} s")

    signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(int(args.timeout))
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # ctest's timeout: still clean up

    shutil.rmtree(args.work, ignore_errors=True)
    os.makedirs(args.work)
    server = prom_proc = None
    problems = []
    try:
        server = Server(args.server, ["--listen", "127.0.0.1:0", "--metrics-listen", "127.0.0.1:0",
                                      "--log-format", "json", "--workers", "1", "--threads", "1"])
        print(f"plsh-server: gRPC {server.grpc}, metrics {server.metrics}, backend {server.serving.get('backend')}")

        # The deploy config with loopback addresses and a 1 s cadence.
        prom_port = free_port()
        prom = f"127.0.0.1:{prom_port}"
        with open(os.path.join(deploy, "prometheus", "prometheus.yml")) as f:
            config = yaml.safe_load(f)
        config["global"]["scrape_interval"] = f"{SCRAPE_SECONDS}s"
        config["global"]["evaluation_interval"] = f"{SCRAPE_SECONDS}s"
        config["rule_files"] = [os.path.join(deploy, "prometheus", rf) for rf in config["rule_files"]]
        substituted = {"plsh": server.metrics, "prometheus": prom}
        for job in config["scrape_configs"]:
            for sc in job["static_configs"]:
                sc["targets"] = [substituted[job["job_name"]]]
        config_path = os.path.join(args.work, "prometheus.yml")
        with open(config_path, "w") as f:
            yaml.safe_dump(config, f)
        prom_log = open(os.path.join(args.work, "prometheus.log"), "w")
        prom_proc = subprocess.Popen(
            [args.prometheus, f"--config.file={config_path}", f"--storage.tsdb.path={args.work}/data",
             f"--web.listen-address={prom}", "--log.level=warn"],
            stdin=subprocess.DEVNULL, stdout=prom_log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30
        while True:
            try:
                with urllib.request.urlopen(f"http://{prom}/-/ready", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if prom_proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"Prometheus did not get ready:\n{open(prom_log.name).read()[-2000:]}")
            time.sleep(0.2)
        print(f"prometheus: {prom}, scraping {server.metrics} every {SCRAPE_SECONDS} s")

        deadline = time.monotonic() + 20
        while not [s for s in api(prom, "query", query='up{job="plsh"} == 1')["result"]]:
            if time.monotonic() > deadline:
                raise RuntimeError(f"up{{job=\"plsh\"}} never became 1: {api(prom, 'targets')}")
            time.sleep(0.5)

        load = Load(args.cli, server.grpc, args.work, LOAD_SECONDS, args.load)
        start = time.time()
        load.run()
        end = time.time()
        print(f"load: {load.describe()} for {end - start:.1f} s: {load.counts}")
        problems += load.failures
        # Let the last scrapes and rule evaluations land.
        time.sleep(3 * SCRAPE_SECONDS + 1)

        up = api(prom, "query", query='up{job="plsh"}')["result"]
        if not (len(up) == 1 and up[0]["value"][1] == "1"):
            problems.append(f'up{{job="plsh"}} is {up}, expected 1')

        backend = {s["metric"].get("backend") for s in api(prom, "query", query="plsh_build_info")["result"]}
        with open(os.path.join(deploy, "grafana", "dashboards", "plsh.json")) as f:
            dashboard = json.load(f)
        checked = 0
        for title, expr in dashboard_queries(dashboard):
            query = substitute_grafana(expr, RATE_INTERVAL)
            if "plsh_device_memory" in expr and "cuda" not in backend:
                print(f"panel {title!r}: NOT CHECKED, the server runs on {backend} (CUDA-only metric)")
                continue
            data = api(prom, "query_range", query=query, start=start, end=time.time(), step=SCRAPE_SECONDS)
            checked += 1
            if not has_values(data):
                problems.append(f"panel {title!r}: no data for {query}")
            else:
                print(f"panel {title!r}: {len(data['result'])} series")
        print(f"dashboard: {checked} queries return data" if not problems else "dashboard: see failures")

        with open(os.path.join(deploy, "prometheus", "rules", "plsh-recording.yml")) as f:
            records = [r["record"] for g in yaml.safe_load(f)["groups"] for r in g["rules"]]
        for record in records:
            if not has_values(api(prom, "query", query=record)):
                problems.append(f"recording rule {record}: no data")
        groups = api(prom, "rules")["groups"]
        bad = [(r.get("name"), r.get("lastError")) for g in groups for r in g["rules"] if r.get("health") != "ok"]
        if bad:
            problems.append(f"rules not evaluating cleanly: {bad}")
        alerts = [(a["labels"]["alertname"], a["state"]) for a in api(prom, "alerts")["alerts"]]
        # A healthy server under light load: any pending alert is a false
        # positive of the rules (as the interpolated p90 of errors once was).
        if alerts:
            problems.append(f"alerts pending or firing on a healthy server: {alerts}")
        print(f"rules: {len(records)} recording rules with data, "
              f"{sum(len(g['rules']) for g in groups)} rules healthy; alerts now: {alerts or 'none'}")
    finally:
        signal.alarm(0)
        if prom_proc is not None and prom_proc.poll() is None:
            prom_proc.terminate()
            try:
                prom_proc.wait(10)
            except subprocess.TimeoutExpired:
                prom_proc.kill()
                prom_proc.wait()
        if server is not None:
            code = server.stop()
            if code != 0:
                problems.append(f"plsh-server exited {code} after SIGTERM:\n{server.log()}")

    return finish(problems, "e2e: Prometheus scraped plsh-server; up is 1 and every dashboard query has data")


if __name__ == "__main__":
    sys.exit(main())
