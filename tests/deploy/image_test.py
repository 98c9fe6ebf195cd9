#!/usr/bin/env python3
"""The CPU image, built for real and run as its own user.

1. deploy/docker/podman-build.sh builds the CPU variant of the Dockerfile
   with Debian's podman (local debootstrap bases; state cached in --work).
2. The image's config: user 10001:10001, entrypoint plsh-server, the two
   ports, a HEALTHCHECK, PLSH_* environment.
3. Its root filesystem, exported (podman create + podman export): every ELF
   file in /opt/plsh resolves all its libraries there, no compiler or -dev
   package, the uid-10001 user exists.
4. plsh-server from that root: chroot --userspec=<the image's USER>, the
   image's environment and nothing else (listen addresses moved to free
   loopback ports), the root mounted read-only, /proc /dev /sys bound in as
   a container runtime would, in a private mount namespace (nothing stays
   mounted). `podman run` cannot create cgroups on these machines.
5. Through the image's own plsh: the HEALTHCHECK command, `plsh info`, one
   exact `plsh attend` against a float64 NumPy reference and one lsh attend
   equal to `plsh compute` in the same root; `GET /metrics` from outside.
6. Hostile clients, each followed by a check that the server still serves:
   stray `GET /` and `GET /favicon.ico` on the metrics port, an HTTP/1.1
   request and a corrupt HTTP/2 preface on the gRPC port, idle connections
   on both ports held open during the checks (GET / and /favicon.ico
   crashed plsh-server until the metrics port moved to libmicrohttpd). A
   server that dies is reported and a fresh one takes the remaining cases,
   so one crash hides no other result.
7. SIGTERM: exit 0.

Exit 77 (ctest: skipped) only where it cannot run: neither root nor
passwordless sudo, or no mount namespaces (an unprivileged container).
"""
import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from plsh_proc import Server, ServerError  # noqa: E402

SKIP = 77

problems = []
started = time.monotonic()
phases = []


def check(ok, message):
    if not ok:
        problems.append(message)
        print(f"FAIL: {message}", flush=True)
    return ok


def phase(name, since):
    phases.append((name, time.monotonic() - since))
    print(f"[{time.monotonic() - started:7.1f} s] {name}: {phases[-1][1]:.1f} s", flush=True)
    return time.monotonic()


def skip(message):
    print(f"SKIP: {message}", flush=True)
    sys.exit(SKIP)


def run(argv, **kw):
    kw.setdefault("capture_output", True)
    kw.setdefault("text", True)
    return subprocess.run(argv, **kw)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def disk_usage(path):
    """Bytes under path on its own file system (not podman's overlay mounts)."""
    out = run(["du", "-sxB1", path])
    return int(out.stdout.split()[0]) if out.returncode == 0 else -1


# ------------------------------------------------------------ privileges ----

def ensure_privileges():
    """Root, or re-run under passwordless sudo; skip where neither works."""
    if os.geteuid() != 0:
        if shutil.which("sudo") and run(["sudo", "-n", "true"]).returncode == 0:
            print("not root: re-running under sudo -n", flush=True)
            os.execvp("sudo", ["sudo", "-n", "--preserve-env=PATH", sys.executable, *sys.argv])
        skip("needs root (chroot --userspec, mount namespaces, podman's rootful storage, debootstrap) "
             "and this user is not root and has no passwordless sudo; run `sudo ctest -L image`")
    if run(["unshare", "--mount", "true"]).returncode != 0:
        skip("cannot create a mount namespace (no CAP_SYS_ADMIN, e.g. an unprivileged container): "
             "podman's overlay storage and the chroot's /proc and /dev need mounts")


# ---------------------------------------------------------------- chroot ----

# Runs "$@" in the exported root as a container runtime would: private mount
# namespace, root read-only, /proc /dev /sys bound in, optionally a writable
# host directory on /tmp (a volume); then chroot as the image's user. exec all
# the way, so the pid that Popen holds is the program's own: signals reach it.
CHROOT_SH = r'''
set -eu
root=$1 data=$2 user=$3
shift 3
mount --bind "$root" "$root"
mount -o remount,bind,ro "$root"
mount --rbind /proc "$root/proc"
mount --rbind /dev "$root/dev"
mount --rbind /sys "$root/sys"
mount -o remount,bind,ro "$root/sys"
if [ -n "$data" ]; then mount --bind "$data" "$root/tmp"; fi
exec chroot --userspec="$user" "$root" "$@"
'''


class Root:
    def __init__(self, path, user, env, data):
        self.path, self.user, self.env, self.data = path, user, env, data

    def argv(self, argv, data=False):
        return ["unshare", "--mount", "--propagation", "private", "--", "sh", "-c", CHROOT_SH, "sh",
                self.path, self.data if data else "", self.user, *argv]

    def run(self, argv, env=None, timeout=120):
        """argv in the root as the image's user, /tmp = the data directory."""
        return run(self.argv(argv, data=True), env={**self.env, **(env or {})}, timeout=timeout)


# ----------------------------------------------------------------- build ----

def build_image(args):
    """podman-build.sh; its log (with times) in --work; the image ID."""
    log_path = os.path.join(args.work, "build.log")
    t0 = time.monotonic()
    cmd = ["bash", os.path.join(args.repo, "deploy/docker/podman-build.sh"), "--state", args.work,
           "--tag", args.tag, "--jobs", str(args.jobs)]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        lines = []
        for line in proc.stdout:
            stamp = f"[{time.monotonic() - t0:7.1f} s] "
            log.write(stamp + line)
            lines.append(line.rstrip("\n"))
            # The steps and the package list, not apt's and ninja's chatter.
            if (" STEP " in line and line.startswith("[")) or line.startswith(("runtime packages:", "podman-build.sh:")):
                print(stamp + line.rstrip("\n")[:160], flush=True)
        code = proc.wait()
    if code != 0:
        print("\n".join(lines[-40:]))
        raise SystemExit(f"FAIL: podman-build.sh exited {code} (log: {log_path})")
    return lines[-1].strip().removeprefix("sha256:")


def podman_env(args):
    """The environment that makes podman use --work's configuration."""
    return {**os.environ,
            "CONTAINERS_CONF": os.path.join(args.work, "containers.conf"),
            "CONTAINERS_STORAGE_CONF": os.path.join(args.work, "storage.conf"),
            "CONTAINERS_REGISTRIES_CONF": os.path.join(args.work, "registries.conf"),
            "TMPDIR": os.path.join(args.work, "tmp")}


def podman(args, *argv, **kw):
    out = run(["podman", *argv], env=podman_env(args), **kw)
    if out.returncode != 0:
        raise SystemExit(f"FAIL: podman {' '.join(argv)} exited {out.returncode}: {out.stderr}")
    return out.stdout


def export_rootfs(args, image, rootfs):
    """podman create + podman export, unpacked into rootfs (owners kept)."""
    if os.path.exists(rootfs):
        shutil.rmtree(rootfs)
    os.makedirs(rootfs)
    cid = podman(args, "create", image).strip()
    try:
        exporter = subprocess.Popen(["podman", "export", cid], stdout=subprocess.PIPE, env=podman_env(args))
        untar = run(["tar", "-x", "--numeric-owner", "-C", rootfs], stdin=exporter.stdout)
        exporter.stdout.close()
        if exporter.wait() != 0 or untar.returncode != 0:
            raise SystemExit(f"FAIL: podman export | tar: {untar.stderr}")
    finally:
        podman(args, "rm", cid)


# ---------------------------------------------------------- image checks ----

def check_config(inspect):
    config = inspect.get("Config") or {}
    env = dict(e.split("=", 1) for e in config.get("Env") or [])
    check(config.get("User") == "10001:10001", f"image USER is {config.get('User')!r}, expected 10001:10001")
    check(config.get("Entrypoint") == ["plsh-server"], f"image ENTRYPOINT is {config.get('Entrypoint')}")
    ports = set(config.get("ExposedPorts") or {})
    check(ports == {"50051/tcp", "9464/tcp"}, f"image EXPOSEs {sorted(ports)}, expected 50051/tcp and 9464/tcp")
    check(env.get("PLSH_LISTEN") == "0.0.0.0:50051" and env.get("PLSH_METRICS_LISTEN") == "0.0.0.0:9464",
          f"image PLSH_LISTEN / PLSH_METRICS_LISTEN are {env.get('PLSH_LISTEN')} / {env.get('PLSH_METRICS_LISTEN')}")
    check(config.get("StopSignal") in ("SIGTERM", "15"), f"image STOPSIGNAL is {config.get('StopSignal')}")
    health = inspect.get("Healthcheck") or config.get("Healthcheck") or {}
    test = health.get("Test") or []
    check(len(test) == 2 and test[0] == "CMD-SHELL", f"image HEALTHCHECK is {health!r}, expected a CMD (shell form)")
    print(f"image: user {config.get('User')}, entrypoint {config.get('Entrypoint')}, ports {sorted(ports)}, "
          f"healthcheck {test[1:] if test else None}", flush=True)
    return config, env, test[1] if len(test) == 2 else None


def check_rootfs(rootfs):
    """Libraries resolve inside the root; no build tools shipped; the user exists."""
    elves = []
    for sub in ("opt/plsh/bin", "opt/plsh/lib"):
        for name in sorted(os.listdir(os.path.join(rootfs, sub))):
            path = os.path.join(rootfs, sub, name)
            with open(path, "rb") as f:
                if f.read(4) == b"\x7fELF":
                    elves.append("/" + sub + "/" + name)
    check({"/opt/plsh/bin/plsh-server", "/opt/plsh/bin/plsh"} <= set(elves), f"ELF files in /opt/plsh: {elves}")
    for elf in elves:
        out = run(["chroot", rootfs, "ldd", elf])
        missing = [line.strip() for line in out.stdout.splitlines() if "not found" in line]
        check(out.returncode == 0 and not missing, f"{elf} in the image: ldd exit {out.returncode}, missing {missing} "
              f"{out.stderr.strip()} (deploy/docker/runtime-packages.sh should have listed their packages)")
    packages = run(["chroot", rootfs, "dpkg-query", "-W", "-f", "${Package}\n"]).stdout.split()
    heavy = [p for p in packages if p.endswith("-dev") or p in ("gcc", "g++", "cpp", "cmake", "ninja-build", "golang-go")]
    check(not heavy, f"the runtime image has build packages: {heavy}")
    with open(os.path.join(rootfs, "etc/passwd")) as f:
        users = [line.split(":") for line in f]
    plsh = [u for u in users if u[2] == "10001"]
    check(len(plsh) == 1 and plsh[0][3] == "10001", f"no user with uid 10001 and gid 10001 in /etc/passwd: {plsh}")
    print(f"root filesystem: {len(packages)} packages, ELF files {elves} resolve", flush=True)
    return plsh[0] if plsh else None


# --------------------------------------------------------------- serving ----

def http_get(addr, path, timeout=10):
    try:
        with urllib.request.urlopen(f"http://{addr}{path}", timeout=timeout) as r:
            return r.status, r.read().decode(errors="replace")
    except urllib.error.HTTPError as e:
        return e.code, ""


def raw_exchange(addr, payload, timeout=5):
    """Connect, send payload, read what comes back until close or timeout."""
    host, port = addr.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=timeout) as s:
        if payload:
            s.sendall(payload)
        got = b""
        try:
            while len(got) < 65536:
                chunk = s.recv(4096)
                if not chunk:
                    break
                got += chunk
        except (socket.timeout, ConnectionResetError):
            pass
        return got


class Service:
    """The server from the image plus the image's plsh as its client."""

    def __init__(self, root, entry, health_cmd):
        self.root, self.entry, self.health_cmd = root, entry, health_cmd
        self.count = 0
        self.server = None
        self.idle = []  # connections that send nothing, held open until the end

    def start(self):
        self.count += 1
        self.env = {**self.root.env, "PLSH_LISTEN": f"127.0.0.1:{free_port()}",
                    "PLSH_METRICS_LISTEN": f"127.0.0.1:{free_port()}", "PLSH_LOG_FORMAT": "json"}
        self.server = Server(self.root.argv(self.entry)[0], self.root.argv(self.entry)[1:], env=self.env,
                             inherit_env=False, startup_timeout=60)
        print(f"plsh-server #{self.count} from the image: gRPC {self.server.grpc}, metrics {self.server.metrics}",
              flush=True)

    def plsh(self, *argv, timeout=120):
        return self.root.run(["plsh", *argv], timeout=timeout)

    def serves(self, context):
        """Alive, HEALTHCHECK passes, /metrics answers; problems name the context."""
        ok = check(self.server.proc.poll() is None,
                   f"{context}: plsh-server exited with {self.server.proc.returncode}:\n{self.server.log()}")
        if not ok:
            return False
        health = self.root.run(["sh", "-c", self.health_cmd], env=self.env, timeout=30)
        ok &= check(health.returncode == 0, f"{context}: HEALTHCHECK exit {health.returncode}: {health.stderr.strip()}")
        try:
            status, body = http_get(self.server.metrics, "/metrics", timeout=10)
            ok &= check(status == 200 and "plsh_build_info" in body, f"{context}: GET /metrics gave {status}")
        except OSError as e:
            ok &= check(False, f"{context}: GET /metrics failed: {e}")
        return ok

    def kill(self):
        for conn in self.idle:
            conn.close()
        if self.server and self.server.proc.poll() is None:
            self.server.proc.kill()
            self.server.proc.wait()


def alibi_reference(q, k, v, slopes, causal):
    """SPEC section 2 in float64: out [B, Nq, H, D], lse [B, Nq, H]."""
    q, k, v = (x.astype(np.float64) for x in (q, k, v))
    _, nq, heads, d = q.shape
    nk, kv_heads = k.shape[1], k.shape[2]
    group = heads // kv_heads
    pos_q = (nk - nq) + np.arange(nq)[:, None]
    pos_k = np.arange(nk)[None, :]
    out = np.zeros_like(q)
    lse = np.zeros(q.shape[:3])
    for h in range(heads):
        kh, vh = k[:, :, h // group], v[:, :, h // group]
        s = np.einsum("bid,bjd->bij", q[:, :, h], kh) / np.sqrt(d) - slopes[h] * np.abs(pos_q - pos_k)
        if causal:
            s = np.where(pos_k <= pos_q, s, -np.inf)
        top = s.max(axis=2, keepdims=True)
        w = np.exp(s - top)
        total = w.sum(axis=2, keepdims=True)
        out[:, :, h] = np.einsum("bij,bjd->bid", w / total, vh)
        lse[:, :, h] = (np.log(total) + top)[:, :, 0]
    return out, lse


def check_attention(service, data):
    """One exact request against NumPy, one lsh request equal to plsh compute."""
    r = np.random.default_rng(10001)
    q = r.standard_normal((1, 96, 4, 32)).astype(np.float32)
    k = r.standard_normal((1, 128, 2, 32)).astype(np.float32)
    v = r.standard_normal((1, 128, 2, 32)).astype(np.float32)
    for name, x in (("q", q), ("k", k), ("v", v)):
        np.save(os.path.join(data, f"{name}.npy"), x)
    slopes = [0.5, 0.25, 0.125, 0.0625]
    inputs = ["--q", "/tmp/q.npy", "--k", "/tmp/k.npy", "--v", "/tmp/v.npy", "--causal",
              "--slopes", ",".join(map(str, slopes))]
    target = ["--target", service.server.grpc, "--deadline", "60"]

    exact = service.plsh("attend", *inputs, *target, "--mode", "exact", "--out", "/tmp/exact.npy",
                         "--lse", "/tmp/exact_lse.npy", "--meta", "/tmp/exact.json")
    if check(exact.returncode == 0, f"plsh attend --mode exact: exit {exact.returncode}: {exact.stderr.strip()}"):
        want, want_lse = alibi_reference(q, k, v, slopes, causal=True)
        got, got_lse = np.load(os.path.join(data, "exact.npy")), np.load(os.path.join(data, "exact_lse.npy"))
        # float32 arithmetic against float64: 1e-5 of the output's scale.
        err = np.abs(got - want).max() / np.abs(want).max()
        lse_err = np.abs(got_lse - want_lse).max() / np.abs(want_lse).max()
        check(got.shape == want.shape and err < 1e-5 and lse_err < 1e-5,
              f"exact attend from the image vs float64 NumPy: shape {got.shape}, relative error {err:.2e}, lse {lse_err:.2e}")
        print(f"exact attend vs float64 NumPy: relative error {err:.1e} (out), {lse_err:.1e} (lse)", flush=True)

    lsh = ["--mode", "lsh", "--samples", "16", "--seed", "7"]
    remote = service.plsh("attend", *inputs, *lsh, *target, "--out", "/tmp/lsh_remote.npy", "--meta", "/tmp/lsh.json")
    local = service.plsh("compute", *inputs, *lsh, "--backend", "cpu", "--out", "/tmp/lsh_local.npy")
    if check(remote.returncode == 0 and local.returncode == 0,
             f"lsh: plsh attend exit {remote.returncode} ({remote.stderr.strip()}), "
             f"plsh compute exit {local.returncode} ({local.stderr.strip()})"):
        a, b = np.load(os.path.join(data, "lsh_remote.npy")), np.load(os.path.join(data, "lsh_local.npy"))
        check(a.shape == b.shape and np.abs(a - b).max() <= 1e-6 * np.abs(b).max(),
              "lsh attend from the image differs from plsh compute on the same inputs")
        with open(os.path.join(data, "lsh.json")) as f:
            meta = json.load(f)
        check(meta.get("backend") == "cpu", f"lsh attend's META.json names backend {meta.get('backend')!r}, expected cpu")
        print(f"lsh attend (s = 16) equals plsh compute; probe relative error "
              f"{meta.get('summary', {}).get('probe', {}).get('rel_err')}", flush=True)


# ---------------------------------------------------------- hostile cases ----

def hostile_cases():
    """(name, action(service) -> None)."""
    def metrics_get(path):
        def act(s):
            try:
                status, _ = http_get(s.server.metrics, path, timeout=10)
                print(f"  GET {path} on the metrics port: {status}", flush=True)
            except OSError as e:
                print(f"  GET {path} on the metrics port: {e}", flush=True)
        return act

    def grpc_bytes(payload):
        def act(s):
            got = raw_exchange(s.server.grpc, payload)
            print(f"  {len(payload)} bytes sent, {len(got)} bytes back", flush=True)
        return act

    def idle(port_of):
        def act(s):
            # Held open, sending nothing, while the server is checked.
            host, port = port_of(s).rsplit(":", 1)
            conn = socket.create_connection((host, int(port)), timeout=5)
            s.idle.append(conn)
        return act

    return [
        ("GET / on the metrics port", metrics_get("/")),
        ("GET /favicon.ico on the metrics port", metrics_get("/favicon.ico")),
        ("HTTP/1.1 request on the gRPC port", grpc_bytes(b"GET / HTTP/1.1\r\nHost: plsh\r\n\r\n")),
        ("corrupt HTTP/2 preface on the gRPC port",
         grpc_bytes(b"PRI * HTTP/2.0\r\n\r\nXX\r\n\r\n" + bytes(range(256)) * 4)),
        ("HTTP/2 preface then a garbage frame on the gRPC port",
         grpc_bytes(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\xff\xff\xff\x09\xff\x7f\xff\xff\xff" + b"\x00" * 64)),
        ("idle connection on the gRPC port", idle(lambda s: s.server.grpc)),
        ("idle connection on the metrics port", idle(lambda s: s.server.metrics)),
    ]


def exercise(service, data):
    """Start, check, attack, check again, SIGTERM; the hostile cases' results."""
    try:
        service.start()
    except ServerError as e:
        raise SystemExit(f"FAIL: plsh-server from the image did not start: {e}")
    if check(service.serves("after start"), "the server from the image does not serve"):
        info = service.plsh("info", "--target", service.server.grpc)
        if check(info.returncode == 0, f"plsh info: exit {info.returncode}: {info.stderr.strip()}"):
            backends = [b["name"] for b in json.loads(info.stdout).get("backends", [])]
            check(backends == ["cpu"], f"the CPU image's server offers backends {backends}, expected [cpu]")
        check_attention(service, data)

    results = []
    for name, act in hostile_cases():
        print(f"hostile: {name}", flush=True)
        try:
            act(service)
        except OSError as e:
            print(f"  {e}", flush=True)
        time.sleep(0.5)  # a crash takes a moment to show
        ok = service.serves(f"after {name}")
        results.append((name, ok))
        if service.server.proc.poll() is not None:
            print(f"  plsh-server died ({service.server.proc.returncode}); a fresh one takes the next case", flush=True)
            service.start()
    check_attention(service, data)  # still computes, idle connections still open
    for conn in service.idle:
        conn.close()

    code = service.server.stop(timeout=40)
    check(code == 0, f"plsh-server exited {code} on SIGTERM, expected 0:\n{service.server.log()}")
    print(f"SIGTERM: plsh-server exited {code}", flush=True)
    return results


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repo", required=True)
    parser.add_argument("--work", required=True, help="podman state, base images, exported root (kept between runs)")
    parser.add_argument("--jobs", type=int, default=0, help="compile jobs in the image build; 0: all cores")
    parser.add_argument("--tag", default="localhost/plsh:cpu-test")
    args = parser.parse_args()
    args.repo, args.work = os.path.abspath(args.repo), os.path.abspath(args.work)
    args.jobs = args.jobs or os.cpu_count()

    ensure_privileges()
    missing = [(tool, pkg) for tool, pkg in (("podman", "podman"), ("debootstrap", "debootstrap"),
                                             ("unshare", "util-linux"), ("chroot", "coreutils"))
               if not shutil.which(tool)]
    if missing:
        raise SystemExit(f"FAIL: not found: {', '.join(f'{t} (Debian package {p})' for t, p in missing)}: "
                         "run scripts/setup.sh")
    os.makedirs(args.work, exist_ok=True)

    t = time.monotonic()
    image = build_image(args)
    t = phase("bases + podman build (podman-build.sh)", t)
    inspect = json.loads(podman(args, "image", "inspect", image))[0]
    config, image_env, health_cmd = check_config(inspect)
    rootfs = os.path.join(args.work, "rootfs")
    export_rootfs(args, image, rootfs)
    t = phase("podman create + export", t)
    user = check_rootfs(rootfs)
    data = os.path.join(args.work, "data")
    if os.path.exists(data):
        shutil.rmtree(data)
    os.makedirs(data)
    os.chown(data, 10001, 10001)
    env = dict(image_env)
    if user:
        env["HOME"] = user[5]  # as docker sets it from the image's passwd
    root = Root(rootfs, config.get("User") or "0:0", env, data)
    entry = (config.get("Entrypoint") or []) + (config.get("Cmd") or [])
    if problems or not health_cmd:
        raise SystemExit(f"FAIL: the image is not fit to run: {len(problems)} problem(s) above")

    service = Service(root, entry, health_cmd)
    try:
        results = exercise(service, data)
    finally:
        service.kill()  # only if something above raised: a normal run has stopped it
    t = phase("serve, hostile cases, SIGTERM", t)

    print("\nhostile cases (each followed by: alive, HEALTHCHECK, GET /metrics):")
    for name, ok in results:
        print(f"  {'ok  ' if ok else 'FAIL'}  {name}")
    print("\ntimes: " + ", ".join(f"{n} {s:.0f} s" for n, s in phases) + f"; total {time.monotonic() - started:.0f} s")
    print(f"disk: {disk_usage(args.work) / 2**30:.2f} GiB in {args.work} (podman storage and bases, kept)")
    if problems:
        # First lines only: the server logs are printed above, where they failed.
        print(f"\n{len(problems)} problem(s):\n  " + "\n  ".join(p.splitlines()[0] for p in problems))
        sys.exit(1)
    shutil.rmtree(rootfs)  # kept on failure, to look into
    shutil.rmtree(data)


if __name__ == "__main__":
    main()
