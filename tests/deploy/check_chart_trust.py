#!/usr/bin/env python3
"""The Helm chart with TLS, client certificates and tokens on (issue 12):

- rendered by helmrender with tls.* and auth.* set: the three probes target
  the plaintext health-only port (a containerPort of its own, the port of
  PLSH_HEALTH_LISTEN, in no Service); every PLSH_TLS_* and PLSH_TOKEN_FILE
  path lies in a read-only mount (a directory, not a subPath, so that the
  kubelet's Secret updates reach the token file) of a Secret volume with the
  named Secret and key, readable by the pod's user; the Deployment's PLSH_*
  names are exactly the server's settings;
- the real plsh-server started with exactly that environment, the mounts
  filled with certificates made here by openssl and a token file: the
  probes' services answer SERVING on the health port without credentials,
  the main port refuses plaintext, and a client with the CA, a client
  certificate and a token is served;
- tokens alone also move the probes; the defaults mount nothing and keep
  the probes on ports.grpc; a chart value that would contradict tls/auth
  (tls.enabled without a Secret, server.tlsCert) fails the render;
- compose.yaml with compose.trust.yaml and compose.mtls.yaml: the merged
  environment of both plsh services names every server setting, each
  /run/secrets path is a secret the service mounts, and the real server
  starts with it (secret files from this test); the overlay's health check
  command answers SERVING against its health-only port.
"""
import hashlib
import json
import os
import secrets
import subprocess
import sys
import re
import tempfile

import yaml

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import check_server_settings as css  # noqa: E402
from deploy_checks import check, finish, problems  # noqa: E402
from plsh_proc import Server, ServerError  # noqa: E402

PROBES = ("startupProbe", "livenessProbe", "readinessProbe")
FILE_SETTINGS = ("PLSH_TLS_CERT", "PLSH_TLS_KEY", "PLSH_TLS_CLIENT_CA", "PLSH_TOKEN_FILE")


def openssl(d, *args):
    r = subprocess.run(["openssl", *args], cwd=d, capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"openssl {' '.join(args)} failed: {r.stderr}")


def make_pki(d):
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes"]
    with open(os.path.join(d, "server.ext"), "w") as f:
        f.write("subjectAltName=IP:127.0.0.1\n")
    openssl(d, "req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.crt", "-days", "2", "-subj", "/CN=ca")
    for name, ext in (("server", ["-extfile", "server.ext"]), ("client", [])):
        openssl(d, "req", *ec, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}")
        openssl(d, "x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
                "-out", f"{name}.crt", "-days", "2", *ext)


def container(docs):
    dep = css.one(docs, "Deployment")
    pod = dep["spec"]["template"]["spec"]
    return pod, pod["containers"][0]


def check_trust_render(label, docs, envs, expect):
    """Probes, ports, env and mounts of a render with tls and/or auth on.
    expect: {setting: (secret name, key) or None for an empty value}."""
    pod, c = container(docs)
    env = {e["name"]: e.get("value") for e in c.get("env", [])}
    plsh_env = {k for k in env if k.startswith("PLSH_")}
    check(plsh_env == set(envs.values()),
          f"{label}: PLSH_* names differ from the server's settings: extra {sorted(plsh_env - set(envs.values()))}, "
          f"missing {sorted(set(envs.values()) - plsh_env)}")
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    health = env.get("PLSH_HEALTH_LISTEN", "off")
    check(health.startswith("0.0.0.0:"), f"{label}: PLSH_HEALTH_LISTEN={health!r}, expected 0.0.0.0:<ports.health>")
    check("health" in ports and ports["health"] == css.port_of(health) if ":" in health else False,
          f"{label}: no containerPort 'health' at the port of PLSH_HEALTH_LISTEN ({ports})")
    check(ports.get("health") != ports.get("grpc"), f"{label}: the health port is the gRPC port")
    for kind in PROBES:
        probe = c.get(kind, {}).get("grpc", {})
        check(probe.get("port") == ports.get("health"),
              f"{label}: {kind} targets port {probe.get('port')}, expected the plaintext health port {ports.get('health')}")
    for svc in (d for d in docs if d["kind"] == "Service"):
        for p in svc["spec"]["ports"]:
            check(p["targetPort"] not in ("health", ports.get("health")),
                  f"{label}: Service {svc['metadata']['name']} exposes the health-only port")
    # Secret mounts.
    volumes = {v["name"]: v for v in pod.get("volumes", [])}
    mounts = c.get("volumeMounts", [])
    psc = pod.get("securityContext", {})
    for setting, want in expect.items():
        path = env.get(setting)
        if want is None:
            check(path == "", f"{label}: {setting}={path!r}, expected empty (off)")
            continue
        secret, key = want
        found = [m for m in mounts if os.path.dirname(path or "") == m["mountPath"].rstrip("/")]
        if not check(len(found) == 1, f"{label}: {setting}={path!r} is in no volumeMount ({[m['mountPath'] for m in mounts]})"):
            continue
        m = found[0]
        check(m.get("readOnly") is True, f"{label}: the mount of {setting} is not read-only")
        check("subPath" not in m, f"{label}: the mount of {setting} uses subPath (Secret updates would not arrive)")
        vol = volumes.get(m["name"], {}).get("secret")
        if not check(vol is not None, f"{label}: {setting}'s volume {m['name']} is not a Secret"):
            continue
        check(vol.get("secretName") == secret, f"{label}: {setting} comes from Secret {vol.get('secretName')}, expected {secret}")
        items = vol.get("items")
        check(items is None and os.path.basename(path) == key or
              any(i["key"] == key and i["path"] == os.path.basename(path) for i in items or []),
              f"{label}: Secret {secret}'s key {key} is not mounted as {path}")
        mode = vol.get("defaultMode", 0o644)
        readable = mode & 0o004 or (mode & 0o040 and psc.get("fsGroup") is not None and
                                    psc.get("fsGroup") == psc.get("runAsGroup"))
        check(readable, f"{label}: {setting}'s file (mode {oct(mode)}) is not readable by the pod's user "
                        f"(runAsGroup {psc.get('runAsGroup')}, fsGroup {psc.get('fsGroup')})")
    return env, c.get("args", []), mounts, volumes


def start_rendered(label, args, env, cargs, mounts, volumes, files, root, probe_services):
    """The real server with the rendered env, each Secret mount filled from
    files[secret][key] under root."""
    for m in mounts:
        vol = volumes.get(m["name"], {}).get("secret")
        if vol is None:
            continue
        d = root + m["mountPath"]
        os.makedirs(d, exist_ok=True)
        for item in vol.get("items", []):
            with open(os.path.join(d, item["path"]), "wb") as f:
                f.write(files[vol["secretName"]][item["key"]])
    senv = dict(env)
    for key in FILE_SETTINGS:
        if senv.get(key):
            senv[key] = root + senv[key]
    senv.update(PLSH_LISTEN="127.0.0.1:0", PLSH_METRICS_LISTEN="127.0.0.1:0", PLSH_HEALTH_LISTEN="127.0.0.1:0",
                PLSH_LOG_FORMAT="json")
    if senv.get("PLSH_BACKEND") == "cuda":
        senv["PLSH_BACKEND"] = "cpu"  # no GPU on the test machines
    try:
        return Server(args.server, cargs, senv)
    except ServerError as e:
        check(False, f"{label}: the server refuses the rendered settings: {e}")
        return None


def resolve(value):
    """A compose value with ${VAR:-default} as the default."""
    return re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", str(value))


def check_compose(args, envs, files, token, pki, root):
    compose_dir = os.path.join(args.repo, "deploy", "compose")
    load = lambda name: yaml.safe_load(open(os.path.join(compose_dir, name)))  # noqa: E731
    base, trust, mtls = load("compose.yaml"), load("compose.trust.yaml"), load("compose.mtls.yaml")
    # Where each Compose secret's file comes from, as the test's files.
    by_file = {"tls.crt": files["plsh-tls"]["tls.crt"], "tls.key": files["plsh-tls"]["tls.key"],
               "tokens.json": files["plsh-tokens"]["tokens.json"], "client-ca.crt": files["plsh-client-ca"]["ca.crt"]}
    for svc in ("plsh", "plsh-cpu"):
        env, mounted, defined = {}, set(), {}
        for layer in (base, trust, mtls):
            s = layer["services"][svc]
            env.update({k: resolve(v) for k, v in s.get("environment", {}).items()})
            mounted |= {x if isinstance(x, str) else x["source"] for x in s.get("secrets", [])}
            defined.update(layer.get("secrets", {}))
        label = f"compose {svc} + trust + mtls"
        check(set(env) == set(envs.values()),
              f"{label}: env names differ from the server's settings: {sorted(set(env) ^ set(envs.values()))}")
        senv = dict(env)
        os.makedirs(root, exist_ok=True)
        for key in FILE_SETTINGS:
            path = env.get(key, "")
            m = re.fullmatch(r"/run/secrets/(\w+)", path)
            if not check(m is not None, f"{label}: {key}={path!r} is not a Compose secret"):
                continue
            name = m.group(1)
            check(name in mounted, f"{label}: {key} reads secret {name}, which the service does not mount")
            source = os.path.basename(resolve(defined.get(name, {}).get("file", "")))
            check(source in by_file, f"{label}: secret {name} comes from {source!r}")
            senv[key] = os.path.join(root, name)
            with open(senv[key], "wb") as f:
                f.write(by_file.get(source, b""))
        check(env.get("PLSH_TLS_CLIENT_AUTH") == "require", f"{label}: PLSH_TLS_CLIENT_AUTH={env.get('PLSH_TLS_CLIENT_AUTH')!r}")
        health_cmd = trust["services"][svc]["healthcheck"]["test"]
        check(health_cmd[0] == "CMD" and css.port_of(health_cmd[-1]) == css.port_of(env["PLSH_HEALTH_LISTEN"]),
              f"{label}: the health check {health_cmd} does not target PLSH_HEALTH_LISTEN {env['PLSH_HEALTH_LISTEN']}")
        senv.update(PLSH_LISTEN="127.0.0.1:0", PLSH_METRICS_LISTEN="127.0.0.1:0", PLSH_HEALTH_LISTEN="127.0.0.1:0",
                    PLSH_LOG_FORMAT="json", PLSH_BACKEND="cpu")
        try:
            server = Server(args.server, [], senv)
        except ServerError as e:
            check(False, f"{label}: the server refuses the merged settings: {e}")
            continue
        try:
            cmd = [args.cli if health_cmd[1] == "plsh" else health_cmd[1], *health_cmd[2:-1], server.serving["health"]]
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
            check(r.returncode == 0, f"{label}: the health check command fails: {r.stdout}{r.stderr}")
            r = subprocess.run([args.cli, "info", "--target", server.grpc, "--tls-ca", os.path.join(pki, "ca.crt"),
                                "--tls-cert", os.path.join(pki, "client.crt"), "--tls-key", os.path.join(pki, "client.key")],
                               capture_output=True, text=True, timeout=30, env=dict(os.environ, PLSH_TOKEN=token))
            check(r.returncode == 0, f"{label}: plsh info with TLS, a client certificate and a token: {r.stderr}")
            print(f"{label}: plsh-server started with the merged environment ({server.serving.get('tls')}, tokens "
                  f"{server.serving.get('tokens')}); the health check answers on the health-only port")
        finally:
            check(server.stop() == 0, f"{label}: plsh-server did not stop cleanly:\n{server.log()}")


def main():
    args = css.parse_args()
    chart = os.path.join(args.repo, "deploy", "helm", "plsh")
    envs, _ = css.server_options(args.server)

    with tempfile.TemporaryDirectory() as tmp:
        pki = os.path.join(tmp, "pki")
        os.makedirs(pki)
        make_pki(pki)
        token = secrets.token_hex(32)
        token_file = json.dumps({"version": 1, "clients": [
            {"name": "trainer", "sha256": hashlib.sha256(token.encode()).hexdigest()}]}).encode()
        read = lambda name: open(os.path.join(pki, name), "rb").read()  # noqa: E731
        files = {"plsh-tls": {"tls.crt": read("server.crt"), "tls.key": read("server.key")},
                 "plsh-client-ca": {"ca.crt": read("ca.crt")},
                 "plsh-tokens": {"tokens.json": token_file}}

        # 1. TLS with client certificates required, and tokens.
        label = "chart tls+mtls+tokens"
        docs = css.render(args.helmrender, chart, "--set", "tls.enabled=true", "--set", "tls.secretName=plsh-tls",
                          "--set", "tls.clientAuth=require", "--set", "tls.clientCaSecretName=plsh-client-ca",
                          "--set", "auth.enabled=true", "--set", "auth.secretName=plsh-tokens",
                          "--set", "ports.health=50060")
        env, cargs, mounts, volumes = check_trust_render(label, docs, envs, {
            "PLSH_TLS_CERT": ("plsh-tls", "tls.crt"), "PLSH_TLS_KEY": ("plsh-tls", "tls.key"),
            "PLSH_TLS_CLIENT_CA": ("plsh-client-ca", "ca.crt"), "PLSH_TOKEN_FILE": ("plsh-tokens", "tokens.json")})
        check(env.get("PLSH_TLS_CLIENT_AUTH") == "require", f"{label}: PLSH_TLS_CLIENT_AUTH={env.get('PLSH_TLS_CLIENT_AUTH')!r}")
        check(env.get("PLSH_HEALTH_LISTEN") == "0.0.0.0:50060", f"{label}: PLSH_HEALTH_LISTEN={env.get('PLSH_HEALTH_LISTEN')!r}")
        _, c = container(docs)
        probe_services = sorted({c[p]["grpc"].get("service", "") for p in PROBES})
        server = start_rendered(label, args, env, cargs, mounts, volumes, files, os.path.join(tmp, "root1"), probe_services)
        if server is not None:
            try:
                health = server.serving.get("health", "off")
                check(health != "off", f"{label}: the server opened no health port")
                for svc in probe_services:
                    r = subprocess.run([args.cli, "health", "--target", health, "--service", svc],
                                       capture_output=True, text=True, timeout=30)
                    check(r.returncode == 0 and r.stdout.strip() == "SERVING",
                          f"{label}: probe service {svc!r} on the health port: {r.stdout}{r.stderr}")
                    print(f"{label}: probe service {svc!r} on the plaintext health port {health}: {r.stdout.strip()}")
                r = subprocess.run([args.cli, "health", "--target", server.grpc, "--deadline", "5"],
                                   capture_output=True, text=True, timeout=30)
                check(r.returncode != 0, f"{label}: the main port answers plaintext health")
                tls = ["--tls-ca", os.path.join(pki, "ca.crt"), "--tls-cert", os.path.join(pki, "client.crt"),
                       "--tls-key", os.path.join(pki, "client.key")]
                r = subprocess.run([args.cli, "info", "--target", server.grpc, *tls], capture_output=True, text=True,
                                   timeout=30, env=dict(os.environ, PLSH_TOKEN=token))
                check(r.returncode == 0, f"{label}: plsh info with the CA, a client certificate and a token: {r.stderr}")
                r = subprocess.run([args.cli, "info", "--target", server.grpc, *tls], capture_output=True, text=True,
                                   timeout=30)
                check(r.returncode == 1 and "UNAUTHENTICATED" in r.stderr, f"{label}: info without a token: {r.stderr}")
                r = subprocess.run([args.cli, "info", "--target", health], capture_output=True, text=True, timeout=30,
                                   env=dict(os.environ, PLSH_TOKEN=token))
                check(r.returncode == 1 and "UNIMPLEMENTED" in r.stderr, f"{label}: the health port serves GetInfo: {r.stderr}")
                print(f"{label}: plsh-server started with the rendered settings: TLS {server.serving.get('tls')}, "
                      f"tokens {server.serving.get('tokens')}, main port refuses plaintext")
            finally:
                code = server.stop()
                check(code == 0, f"{label}: plsh-server exited {code}:\n{server.log()}")
                check(token not in "\n".join(server.lines), f"{label}: the token is in the server's log")

        # 2. Tokens alone: probes move too; nothing of TLS is set or mounted.
        label = "chart tokens"
        docs = css.render(args.helmrender, chart, "--set", "auth.enabled=true", "--set", "auth.secretName=plsh-tokens")
        env, cargs, mounts, volumes = check_trust_render(label, docs, envs, {
            "PLSH_TLS_CERT": None, "PLSH_TLS_KEY": None, "PLSH_TLS_CLIENT_CA": None,
            "PLSH_TOKEN_FILE": ("plsh-tokens", "tokens.json")})
        check(env.get("PLSH_TLS_CLIENT_AUTH") == "none", f"{label}: PLSH_TLS_CLIENT_AUTH={env.get('PLSH_TLS_CLIENT_AUTH')!r}")
        server = start_rendered(label, args, env, cargs, mounts, volumes, files, os.path.join(tmp, "root2"), [])
        if server is not None:
            r = subprocess.run([args.cli, "info", "--target", server.grpc], capture_output=True, text=True, timeout=30,
                               env=dict(os.environ, PLSH_TOKEN=token))
            check(r.returncode == 0, f"{label}: plsh info with the token: {r.stderr}")
            check(server.stop() == 0, f"{label}: plsh-server did not stop cleanly:\n{server.log()}")
        print(f"{label}: probes on the health port, token file mounted from its Secret, no TLS")

        # 3. Defaults: no health port, no Secret, probes on ports.grpc.
        pod, c = container(css.render(args.helmrender, chart))
        env = {e["name"]: e.get("value") for e in c["env"]}
        check(env.get("PLSH_HEALTH_LISTEN") == "off", f"defaults: PLSH_HEALTH_LISTEN={env.get('PLSH_HEALTH_LISTEN')!r}")
        check(all(env.get(k) == "" for k in FILE_SETTINGS), f"defaults: trust files set: {[env.get(k) for k in FILE_SETTINGS]}")
        check(not any("secret" in v for v in pod.get("volumes", [])), "defaults: a Secret is mounted")
        check("health" not in {p["name"] for p in c["ports"]}, "defaults: a health port is declared")
        check(all(c[p]["grpc"]["port"] == 50051 for p in PROBES), "defaults: probes are not on ports.grpc")
        print("chart defaults: no health port, no Secret, probes on ports.grpc")

        # 4. Contradictions fail the render with a message.
        for sets, message in ((["tls.enabled=true"], "tls.enabled needs tls.secretName"),
                              (["auth.enabled=true"], "auth.enabled needs auth.secretName"),
                              (["tls.clientAuth=require"], "needs tls.enabled"),
                              (["tls.enabled=true", "tls.secretName=s", "tls.clientAuth=sometimes"], "expected none, optional or require"),
                              (["server.tlsCert=/x"], "server.tlsCert is derived from tls.*"),
                              (["server.healthListen=:1"], "server.healthListen is derived from ports.*")):
            r = subprocess.run([args.helmrender, *sum((["--set", s] for s in sets), []), chart],
                               capture_output=True, text=True, timeout=60)
            check(r.returncode != 0 and message in r.stderr, f"render with {sets}: expected a failure saying {message!r}, "
                                                              f"got exit {r.returncode}: {r.stderr.strip()[-300:]}")
        print("chart: contradicting tls/auth values fail the render")

        # 5. Compose: the trust overlays over compose.yaml.
        check_compose(args, envs, files, token, pki, os.path.join(tmp, "compose"))

    # css's checks record into the same problems (deploy_checks).
    return finish(problems, "TLS and tokens: probes on the plaintext health port, Secrets mounted, the server serves "
                            "with them")


if __name__ == "__main__":
    sys.exit(main())
