#!/usr/bin/env python3
"""Every setting that the deploy files hand to plsh-server is one that the
real server accepts, and the ports and probes agree with it.

- The server's flags and PLSH_* names come from `plsh-server --help`.
- The Helm chart is rendered by helmrender (Helm's engine) with its default
  values and with every optional part on; the manifests are checked for
  ports, probes, selectors, security context, GPU limits and budgets, and the
  Deployment's environment and arguments must name every server flag and no
  other. Then the real server is started with exactly that environment and
  those arguments (addresses moved to free loopback ports and backend cuda
  to cpu on a machine without a GPU) and must report serving; its /metrics
  must have the metric the chart's HPA scales on (the rules' and the
  dashboard's metrics appear with traffic: e2e_prometheus.py checks them).
- The same for the compose file's environment and the Dockerfile's ENV, and
  the Dockerfile's HEALTHCHECK command is run, through sh, against the
  server it configures.
"""
import argparse
import os
import re
import socket
import subprocess
import sys
import urllib.request

import yaml

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from deploy_checks import check, finish, problems  # noqa: E402
from plsh_proc import Server, ServerError  # noqa: E402


def server_options(binary):
    """{flag: env name} and {flag: default} from plsh-server --help."""
    out = subprocess.run([binary, "--help"], capture_output=True, text=True, timeout=30)
    if out.returncode != 0:
        raise SystemExit(f"{binary} --help exited {out.returncode}: {out.stderr}")
    envs, defaults = {}, {}
    # CLI11 (1.9, Debian 12) prints "--flag TYPE=DEFAULT (Env:NAME)", the
    # description on the next line; the type may hold ranges and sets.
    for line in out.stdout.splitlines():
        m = re.match(r"\s*(?:-\w,)?(--[\w-]+)(?: (\S.*?)(?:=(\S*))?)? \(Env:(\w+)\)", line)
        if m:
            flag, _, default, env = m.groups()
            envs[flag] = env
            defaults[flag] = default
    if not envs:
        raise SystemExit(f"no (Env:...) options found in {binary} --help:\n{out.stdout}")
    return envs, defaults


def port_of(addr):
    return int(addr.rsplit(":", 1)[1])


def quantity_bytes(q):
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}
    m = re.fullmatch(r"(\d+)([A-Za-z]*)", str(q))
    return int(m.group(1)) * units.get(m.group(2), 1)


def render(helmrender, chart, *args):
    r = subprocess.run([helmrender, *args, chart], capture_output=True, text=True, timeout=60)
    if r.returncode != 0:
        raise SystemExit(f"helmrender {' '.join(args)} failed:\n{r.stderr}")
    return [d for d in yaml.safe_load_all(r.stdout) if d]


def one(docs, kind, suffix=""):
    found = [d for d in docs if d["kind"] == kind and d["metadata"]["name"].endswith(suffix)]
    check(len(found) >= 1, f"no {kind} *{suffix} rendered")
    return found[0] if found else {}


def matches(selector, labels):
    return all(labels.get(k) == v for k, v in selector.items())


def scrape_names(metrics_addr):
    with urllib.request.urlopen(f"http://{metrics_addr}/metrics", timeout=10) as r:
        text = r.read().decode()
    names = set()
    for line in text.splitlines():
        m = re.match(r"# TYPE (\w+) (\w+)", line)
        if m:
            names.add(m.group(1))
            if m.group(2) == "histogram":
                names.update(m.group(1) + s for s in ("_bucket", "_sum", "_count"))
        elif line and not line.startswith("#"):
            names.add(re.match(r"[\w:]+", line).group(0))
    return names


def run_server(label, binary, env, args, used_metrics, extra=None):
    """Start the server as configured, with addresses on free loopback ports."""
    env = dict(env)
    for key in ("PLSH_LISTEN", "PLSH_METRICS_LISTEN"):
        check(re.fullmatch(r"[\w.\-\[\]:]+:\d+", env.get(key, "")), f"{label}: {key}={env.get(key)!r} is not host:port")
    env["PLSH_LISTEN"] = "127.0.0.1:0"
    env["PLSH_METRICS_LISTEN"] = "127.0.0.1:0"
    if env.get("PLSH_HEALTH_LISTEN", "off") not in ("", "off"):
        check(re.fullmatch(r"[\w.\-\[\]:]+:\d+", env["PLSH_HEALTH_LISTEN"]),
              f"{label}: PLSH_HEALTH_LISTEN={env['PLSH_HEALTH_LISTEN']!r} is not host:port or off")
        env["PLSH_HEALTH_LISTEN"] = "127.0.0.1:0"
    if env.get("PLSH_BACKEND") == "cuda":
        # No GPU on the test machines: the value itself is checked by --help.
        env["PLSH_BACKEND"] = "cpu"
    env.setdefault("PLSH_LOG_FORMAT", "json")
    try:
        server = Server(binary, args, env)
    except ServerError as e:
        check(False, f"{label}: the server refuses its settings: {e}")
        return
    try:
        names = scrape_names(server.metrics)
        for name in sorted(used_metrics):
            check(name in names, f"{label}: /metrics has no {name}")
        if extra:
            extra(server)
        print(f"{label}: plsh-server started with {len(env)} PLSH_* settings {args or ''}, "
              f"serving on {server.grpc}, metrics {server.metrics}")
    finally:
        code = server.stop()
        check(code == 0, f"{label}: plsh-server exited {code} after SIGTERM:\n{server.log()}")


def check_chart(docs, label, envs, defaults, service_name, image_uid, values_expect):
    dep = one(docs, "Deployment")
    pod = dep["spec"]["template"]
    c = pod["spec"]["containers"][0]
    env = {e["name"]: e.get("value") for e in c.get("env", [])}
    server_env = {e for e in envs.values()}
    plsh_env = {k for k in env if k.startswith("PLSH_")}
    for name in sorted(plsh_env - server_env):
        check(False, f"{label}: env {name} is not a plsh-server setting")
    for name in sorted(server_env - plsh_env):
        check(False, f"{label}: server setting {name} is not a chart value")
    for a in c.get("args", []):
        flag = a.split("=", 1)[0]
        if flag.startswith("-"):
            check(flag in envs, f"{label}: arg {a} is not a plsh-server flag")
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    check(ports.get("grpc") == port_of(env["PLSH_LISTEN"]), f"{label}: grpc containerPort != PLSH_LISTEN port")
    check(ports.get("metrics") == port_of(env["PLSH_METRICS_LISTEN"]),
          f"{label}: metrics containerPort != PLSH_METRICS_LISTEN port")
    # Probes go to the plaintext health-only port when the chart opens one
    # (TLS or tokens on: check_chart_trust.py), else to the gRPC port.
    health_listen = env.get("PLSH_HEALTH_LISTEN", "off")
    probe_port_name = "grpc" if health_listen in ("", "off") else "health"
    if probe_port_name == "health":
        check(ports.get("health") == port_of(health_listen), f"{label}: health containerPort != PLSH_HEALTH_LISTEN port")
    for kind in ("startupProbe", "livenessProbe", "readinessProbe"):
        probe = c.get(kind, {})
        check("grpc" in probe, f"{label}: {kind} is not a native gRPC probe")
        check(probe.get("grpc", {}).get("port") == ports.get(probe_port_name),
              f"{label}: {kind} port != {probe_port_name} containerPort")
    check(c["livenessProbe"]["grpc"].get("service", "") == "", f"{label}: liveness should ask for service ''")
    check(c["readinessProbe"]["grpc"].get("service") == service_name,
          f"{label}: readiness asks for {c['readinessProbe']['grpc'].get('service')!r}, the server registers {service_name!r}")
    # Security context.
    sc, psc = c.get("securityContext", {}), pod["spec"].get("securityContext", {})
    check(sc.get("readOnlyRootFilesystem") is True, f"{label}: root filesystem not read-only")
    check(sc.get("allowPrivilegeEscalation") is False, f"{label}: privilege escalation allowed")
    check(psc.get("runAsNonRoot") is True and psc.get("runAsUser") == image_uid,
          f"{label}: pod runs as {psc.get('runAsUser')}, the image's user is {image_uid}")
    check("ALL" in sc.get("capabilities", {}).get("drop", []), f"{label}: capabilities not dropped")
    # Resources and budgets.
    res = c.get("resources", {})
    check(res.get("requests", {}).get("cpu") and res.get("requests", {}).get("memory"), f"{label}: no resource requests")
    gpu = res.get("limits", {}).get("nvidia.com/gpu")
    check((gpu == 1) == values_expect["gpu"], f"{label}: nvidia.com/gpu limit {gpu}, expected gpu={values_expect['gpu']}")
    limit = res.get("limits", {}).get("memory")
    check(limit and int(env["PLSH_MEMORY_BUDGET"]) < quantity_bytes(limit),
          f"{label}: memory budget {env['PLSH_MEMORY_BUDGET']} does not fit the memory limit {limit}")
    check(pod["spec"]["terminationGracePeriodSeconds"] > float(env["PLSH_DRAIN_TIMEOUT"]) + float(env["PLSH_EXIT_TIMEOUT"]),
          f"{label}: terminationGracePeriodSeconds <= drain timeout + exit timeout")
    # Selectors and ports of the Services, ServiceMonitor, PDB, HPA.
    labels = pod["metadata"]["labels"]
    check(matches(dep["spec"]["selector"]["matchLabels"], labels), f"{label}: Deployment selector misses its pods")
    services = [d for d in docs if d["kind"] == "Service"]
    check(len(services) == 3, f"{label}: expected ClusterIP, headless and metrics Services, got {len(services)}")
    headless = [s for s in services if s["spec"].get("clusterIP") == "None"]
    check(len(headless) == 1, f"{label}: no headless Service")
    for s in services:
        check(matches(s["spec"]["selector"], labels), f"{label}: Service {s['metadata']['name']} selects no pod")
        for p in s["spec"]["ports"]:
            check(p["targetPort"] in ports, f"{label}: Service {s['metadata']['name']} targets unknown port {p['targetPort']}")
    sm = one(docs, "ServiceMonitor")
    metrics_svcs = [s for s in services if matches(sm["spec"]["selector"]["matchLabels"], s["metadata"]["labels"])]
    check(len(metrics_svcs) == 1, f"{label}: ServiceMonitor selects {len(metrics_svcs)} Services, expected the metrics one")
    if metrics_svcs:
        names = [p["name"] for p in metrics_svcs[0]["spec"]["ports"]]
        check(sm["spec"]["endpoints"][0]["port"] in names, f"{label}: ServiceMonitor port not on the metrics Service")
        check(metrics_svcs[0]["spec"]["ports"][0]["targetPort"] == "metrics", f"{label}: metrics Service targets {names}")
        check(metrics_svcs[0]["metadata"]["labels"].get(sm["spec"]["jobLabel"]) == "plsh",
              f"{label}: the scrape job would not be named plsh (the alerts select job=\"plsh\")")
    pdb = one(docs, "PodDisruptionBudget")
    check(matches(pdb["spec"]["selector"]["matchLabels"], labels), f"{label}: PDB selects no pod")
    used = set()
    if values_expect["hpa"]:
        hpa = one(docs, "HorizontalPodAutoscaler")
        check(hpa["spec"]["scaleTargetRef"]["name"] == dep["metadata"]["name"], f"{label}: HPA scales another Deployment")
        check("replicas" not in dep["spec"], f"{label}: Deployment fixes replicas while the HPA scales it")
        used |= {m["pods"]["metric"]["name"] for m in hpa["spec"]["metrics"] if m["type"] == "Pods"}
    else:
        check(not [d for d in docs if d["kind"] == "HorizontalPodAutoscaler"], f"{label}: HPA rendered while disabled")
    if values_expect["rules"]:
        rule = one(docs, "PrometheusRule")
        alerts = [r["alert"] for g in rule["spec"]["groups"] for r in g["rules"] if "alert" in r]
        check(len(alerts) >= 6, f"{label}: PrometheusRule has alerts {alerts}")
        cm = one(docs, "ConfigMap", "-dashboard")
        check("plsh.json" in cm.get("data", {}), f"{label}: dashboard ConfigMap has no plsh.json")
    return env, c.get("args", []), used


def parse_args():
    """The command line of this check and of check_chart_trust.py: the
    repository, helmrender and the plsh-server and plsh binaries."""
    ap = argparse.ArgumentParser()
    for flag in ("--repo", "--helmrender", "--server", "--cli"):
        ap.add_argument(flag, required=True)
    return ap.parse_args()


def main():
    args = parse_args()
    deploy = os.path.join(args.repo, "deploy")
    chart = os.path.join(deploy, "helm", "plsh")

    envs, defaults = server_options(args.server)
    cli_help = subprocess.run([args.cli, "--help"], capture_output=True, text=True, timeout=30).stdout
    has_health = re.search(r"^\s+health\b", cli_help, re.M) is not None
    print(f"plsh-server --help: {len(envs)} settings: {' '.join(sorted(envs.values()))}")
    proto = open(os.path.join(args.repo, "proto", "plsh", "v1", "plsh.proto")).read()
    service_name = re.search(r"^package ([\w.]+);", proto, re.M).group(1) + "." + \
        re.search(r"^service (\w+)", proto, re.M).group(1)
    dockerfile = open(os.path.join(args.repo, "Dockerfile")).read()
    image_uid = int(re.search(r"^USER (\d+)", dockerfile, re.M).group(1))

    # 1. The chart with its defaults: ports are the server's defaults.
    docs = render(args.helmrender, chart)
    values = yaml.safe_load(open(os.path.join(chart, "values.yaml")))
    check(values["ports"]["grpc"] == port_of(defaults["--listen"]),
          f"chart ports.grpc {values['ports']['grpc']} != server default {defaults['--listen']}")
    check(values["ports"]["metrics"] == port_of(defaults["--metrics-listen"]),
          f"chart ports.metrics {values['ports']['metrics']} != server default {defaults['--metrics-listen']}")
    env, cargs, used = check_chart(docs, "chart defaults", envs, defaults, service_name, image_uid,
                                   {"gpu": True, "hpa": False, "rules": False})
    container = one(docs, "Deployment")["spec"]["template"]["spec"]["containers"][0]
    probe_services = {container[p]["grpc"].get("service", "") for p in ("startupProbe", "livenessProbe", "readinessProbe")}

    def probes(server):
        # The kubelet's gRPC probes ask grpc.health.v1 for these services.
        for svc in sorted(probe_services):
            r = subprocess.run([args.cli, "health", "--target", server.grpc, "--service", svc],
                               capture_output=True, text=True, timeout=30)
            check(r.returncode == 0, f"chart probe service {svc!r}: not SERVING on the live server: {r.stdout}{r.stderr}")
            print(f"chart probe service {svc!r}: SERVING (plsh health exit {r.returncode})")

    run_server("chart defaults", args.server, env, cargs, used,
               extra=probes if has_health else None)

    # 2. Every optional part on, other ports, extra arguments, CPU image.
    full = render(args.helmrender, chart, "--name", "prod", "--namespace", "ml",
                  "--set", "autoscaling.enabled=true", "--set", "gpu.enabled=false",
                  "--set", "server.backend=cpu", "--set", "image.tag=cpu",
                  "--set", "ports.grpc=6000", "--set", "ports.metrics=7000",
                  "--set", "server.workers=2", "--set", "server.drainTimeout=2.5",
                  "-f", os.path.join(os.path.dirname(os.path.abspath(__file__)), "helm-extra-values.yaml"),
                  "--set", "prometheusRule.enabled=true", "--set", "grafanaDashboard.enabled=true",
                  "--set-file", f"prometheusRule.recordingRules={deploy}/prometheus/rules/plsh-recording.yml",
                  "--set-file", f"prometheusRule.alertRules={deploy}/prometheus/rules/plsh-alerts.yml",
                  "--set-file", f"grafanaDashboard.json={deploy}/grafana/dashboards/plsh.json")
    env, cargs, used = check_chart(full, "chart full", envs, defaults, service_name, image_uid,
                                   {"gpu": False, "hpa": True, "rules": True})
    check(env.get("PLSH_DRAIN_TIMEOUT") == "2.5" and env.get("PLSH_WORKERS") == "2",
          f"chart full: values do not reach the env: {env}")
    check(used == {"plsh_queue_depth"}, f"chart full: the HPA scales on {used}")
    run_server("chart full", args.server, env, cargs, used)

    # 3. Compose: the environment of both plsh services, defaults resolved.
    compose = yaml.safe_load(open(os.path.join(deploy, "compose", "compose.yaml")))
    for svc in ("plsh", "plsh-cpu"):
        cenv = {k: re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", str(v))
                for k, v in compose["services"][svc]["environment"].items()}
        for name in sorted(set(cenv) - set(envs.values())):
            check(False, f"compose {svc}: env {name} is not a plsh-server setting")
        for name in sorted(set(envs.values()) - set(cenv)):
            check(False, f"compose {svc}: server setting {name} is not set")
        published = {int(p.split(":")[-1]) for p in compose["services"][svc]["ports"]}
        check(published == {port_of(cenv["PLSH_LISTEN"]), port_of(cenv["PLSH_METRICS_LISTEN"])},
              f"compose {svc}: publishes {published}, the server listens on {cenv['PLSH_LISTEN']} and {cenv['PLSH_METRICS_LISTEN']}")
        run_server(f"compose {svc}", args.server, cenv, [], set())

    # 4. Dockerfile: ENV names, EXPOSE ports, and the HEALTHCHECK command run
    #    through sh against the server configured like the image.
    # The runtime stage: everything after the last FROM.
    runtime_stage = dockerfile[[m.start() for m in re.finditer(r"^FROM ", dockerfile, re.M)][-1]:]
    denv = dict(re.findall(r"(PLSH_\w+)=(\S+)", " ".join(
        re.findall(r"^ENV ((?:.*\\\n)*.*)$", runtime_stage, re.M))))
    for name in denv:
        check(name in envs.values(), f"Dockerfile: ENV {name} is not a plsh-server setting")
    expose = {int(p) for p in re.search(r"^EXPOSE (.+)$", dockerfile, re.M).group(1).split()}
    check(expose == {port_of(denv.get("PLSH_LISTEN", ":0")), port_of(denv.get("PLSH_METRICS_LISTEN", ":0"))},
          f"Dockerfile: EXPOSE {expose} != the ports of {denv}")
    check(denv.get("PLSH_LISTEN", "").startswith("0.0.0.0:") and denv.get("PLSH_METRICS_LISTEN", "").startswith("0.0.0.0:"),
          "Dockerfile: the image must listen on all interfaces (the server defaults to 127.0.0.1)")
    health = re.search(r"^HEALTHCHECK .*?CMD (.+?)$", dockerfile.replace("\\\n", " "), re.M).group(1)
    cli_dir = os.path.dirname(os.path.abspath(args.cli))

    def healthcheck(server):
        port = port_of(server.grpc)
        shell_env = dict(os.environ, PATH=f"{cli_dir}:{os.environ.get('PATH', '')}", PLSH_LISTEN=f"0.0.0.0:{port}")
        r = subprocess.run(["sh", "-c", health], env=shell_env, capture_output=True, text=True, timeout=30)
        check(r.returncode == 0, f"Dockerfile HEALTHCHECK `{health}` exits {r.returncode} on a serving server: "
                                 f"{r.stdout}{r.stderr}")
        print(f"Dockerfile HEALTHCHECK `{health}`: exit {r.returncode} against {server.grpc}")
        # And it fails where no server listens (a port just released).
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            dead = sock.getsockname()[1]
        shell_env["PLSH_LISTEN"] = f"0.0.0.0:{dead}"
        r = subprocess.run(["sh", "-c", health], env=shell_env, capture_output=True, text=True, timeout=30)
        check(r.returncode != 0, f"Dockerfile HEALTHCHECK exits 0 with no server on port {dead}")
        print(f"Dockerfile HEALTHCHECK: exit {r.returncode} with no server on port {dead}")

    check(has_health, f"{args.cli} has no `health` subcommand: the image's HEALTHCHECK cannot work")
    run_server("Dockerfile", args.server, denv, [], set(), extra=healthcheck if has_health else None)

    return finish(problems, "every deploy setting is accepted by plsh-server; ports and probes agree")


if __name__ == "__main__":
    sys.exit(main())
