#!/usr/bin/env python3
"""Static checks of deploy/: every YAML and JSON file parses, the files that
point at each other agree (compose mounts, Grafana provisioning paths,
Prometheus rule files and job name), every dashboard query is valid PromQL
(promtool parses it as a recording rule), and every alert has a firing and a
silent case in the promtool unit tests.

Run by ctest (deploy_static_files); prints one line per check, exits 1 on the
first group of failures with every problem listed."""
import argparse
import json
import os
import re
import subprocess
import sys
import tempfile

import yaml

from deploy_checks import check, finish, problems


def load_yaml_docs(path):
    with open(path, encoding="utf-8") as f:
        return [d for d in yaml.safe_load_all(f) if d is not None]


def dashboard_queries(dashboard):
    """(panel title, expr) for every target of every panel, rows included."""
    out = []
    for panel in dashboard["panels"]:
        for sub in [panel] + panel.get("panels", []):
            for t in sub.get("targets", []):
                out.append((sub["title"], t.get("expr", "")))
    return out


def substitute_grafana(expr, rate_interval):
    """A dashboard query as Grafana sends it with every instance selected."""
    expr = expr.replace("$__rate_interval", rate_interval).replace("$__interval", rate_interval)
    expr = expr.replace("$job", ".+").replace("$instance", ".+")
    return expr


DOCKER_INSTRUCTIONS = {"FROM", "RUN", "CMD", "LABEL", "EXPOSE", "ENV", "ADD", "COPY", "ENTRYPOINT", "VOLUME",
                       "USER", "WORKDIR", "ARG", "ONBUILD", "STOPSIGNAL", "HEALTHCHECK", "SHELL"}


def check_dockerfile(path, ignore_path):
    text = open(path, encoding="utf-8").read()
    logical = re.sub(r"\\\n", " ", text)
    lines = [l.strip() for l in logical.splitlines() if l.strip() and not l.strip().startswith("#")]
    global_args, stages, variants_used = {}, [], []
    for line in lines:
        word, _, rest = line.partition(" ")
        check(word.upper() in DOCKER_INSTRUCTIONS, f"Dockerfile: unknown instruction {word!r}")
        if word == "ARG" and not stages:
            name, _, default = rest.partition("=")
            global_args[name] = default
        elif word == "FROM":
            m = re.fullmatch(r"(\S+)(?: AS (\S+))?", rest)
            check(m is not None, f"Dockerfile: cannot read FROM {rest!r}")
            image, name = m.groups()
            for var in re.findall(r"\$\{(\w+)\}", image):
                check(var in global_args, f"Dockerfile: FROM uses ${{{var}}}, not declared before the first FROM")
            if "${PLSH_VARIANT}" in image:
                variants_used.append(image)
            stages.append(name)
        elif word == "COPY" and "--from=" in rest:
            src = re.search(r"--from=(\S+)", rest).group(1)
            check(src in stages[:-1], f"Dockerfile: COPY --from={src} names no earlier stage")
    for variant in ("cuda", "cpu"):
        for image in variants_used:
            check(image.replace("${PLSH_VARIANT}", variant) in stages,
                  f"Dockerfile: PLSH_VARIANT={variant} selects {image}, which is no stage")
    check(global_args.get("PLSH_VARIANT") == "cuda", "Dockerfile: PLSH_VARIANT should default to cuda")
    final = text[text.rindex("\nFROM "):]
    check(re.search(r"^USER \d+:\d+$", final, re.M), "Dockerfile: the runtime stage needs a numeric non-root USER")
    check(re.search(r"^HEALTHCHECK ", final, re.M), "Dockerfile: no HEALTHCHECK in the runtime stage")
    ignored = open(ignore_path).read().split()
    for pattern in (".git", "/build*"):
        check(pattern in ignored, f".dockerignore: {pattern} should be ignored")
    print(f"Dockerfile: {len(stages)} stages, both PLSH_VARIANT values resolve, runtime runs as a numeric user")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--repo", required=True)
    ap.add_argument("--promtool", default="promtool")
    args = ap.parse_args()
    deploy = os.path.join(args.repo, "deploy")

    # 1. Every YAML file parses (Helm templates are Go templates: the chart is
    #    checked rendered, by check_server_settings.py).
    yaml_files = []
    for root, _, names in os.walk(deploy):
        if os.path.join("helm", "plsh", "templates") in root:
            continue
        yaml_files += [os.path.join(root, n) for n in names if n.endswith((".yml", ".yaml"))]
    for path in sorted(yaml_files):
        try:
            docs = load_yaml_docs(path)
            check(docs, f"{path}: empty")
        except yaml.YAMLError as e:
            check(False, f"{path}: {e}")
    print(f"yaml: {len(yaml_files)} files parse")

    # 2. Prometheus: rule files exist, the plsh job is there, and the rules
    #    select that job name.
    prom_dir = os.path.join(deploy, "prometheus")
    prom = load_yaml_docs(os.path.join(prom_dir, "prometheus.yml"))[0]
    for rf in prom["rule_files"]:
        check(os.path.isfile(os.path.join(prom_dir, rf)), f"prometheus.yml: rule file {rf} missing")
    jobs = {j["job_name"]: j for j in prom["scrape_configs"]}
    check("plsh" in jobs, "prometheus.yml: no job 'plsh'")
    alerts_path = os.path.join(prom_dir, "rules", "plsh-alerts.yml")
    alert_rules = [r for g in load_yaml_docs(alerts_path)[0]["groups"] for r in g["rules"] if "alert" in r]
    for r in alert_rules:
        for job in re.findall(r'job="([^"]+)"', r["expr"]):
            check(job in jobs, f"alert {r['alert']}: selects job={job!r}, which prometheus.yml does not scrape")

    # 3. Every alert fires in some promtool case and stays silent in another.
    tests = load_yaml_docs(os.path.join(prom_dir, "tests", "plsh-rules.test.yml"))[0]
    fired, silent = set(), set()
    for t in tests["tests"]:
        for a in t.get("alert_rule_test", []):
            (fired if a.get("exp_alerts") else silent).add(a["alertname"])
    for r in alert_rules:
        check(r["alert"] in fired, f"alert {r['alert']}: no promtool case where it fires")
        check(r["alert"] in silent, f"alert {r['alert']}: no promtool case where it stays silent")
    print(f"alerts: {len(alert_rules)} alerts, each with firing and silent promtool cases")

    # 4. Grafana dashboard: well formed, every query valid PromQL.
    dash_path = os.path.join(deploy, "grafana", "dashboards", "plsh.json")
    with open(dash_path, encoding="utf-8") as f:
        dash = json.load(f)
    ids = [p["id"] for p in dash["panels"]]
    check(len(ids) == len(set(ids)), f"{dash_path}: duplicate panel ids {ids}")
    check(dash.get("uid"), f"{dash_path}: no uid (provisioned dashboards need a stable one)")
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    check(variables.get("datasource", {}).get("query") == "prometheus",
          f"{dash_path}: needs a datasource variable of type prometheus")
    for panel in dash["panels"]:
        if panel["type"] == "row":
            continue
        check(panel.get("targets"), f"panel {panel['title']!r}: no query")
        check(panel.get("datasource", {}).get("uid") == "${datasource}",
              f"panel {panel['title']!r}: datasource is not ${{datasource}}")
        g = panel.get("gridPos", {})
        check(all(k in g for k in "hwxy") and g["x"] + g["w"] <= 24, f"panel {panel['title']!r}: bad gridPos {g}")
    queries = dashboard_queries(dash)
    for title, expr in queries:
        check(expr.strip(), f"panel {title!r}: empty expr")
        for var in re.findall(r"\$\{?(\w+)", expr):
            check(var in variables or var.startswith("__"), f"panel {title!r}: unknown variable ${var}")
    with tempfile.TemporaryDirectory() as tmp:
        rules = {"groups": [{"name": "dashboard", "rules": [
            {"record": f"dashboard:query_{i}", "expr": substitute_grafana(expr, "1m")}
            for i, (_, expr) in enumerate(queries)]}]}
        path = os.path.join(tmp, "dashboard-queries.yml")
        with open(path, "w") as f:
            yaml.safe_dump(rules, f)
        r = subprocess.run([args.promtool, "check", "rules", path], capture_output=True, text=True)
        check(r.returncode == 0, f"dashboard queries: promtool rejects them:\n{r.stdout}{r.stderr}")
    print(f"dashboard: {len(dash['panels'])} panels, {len(queries)} queries parse as PromQL")

    # 5. Grafana provisioning matches the compose mounts.
    compose = load_yaml_docs(os.path.join(deploy, "compose", "compose.yaml"))[0]
    compose_dir = os.path.join(deploy, "compose")
    mounts = {}
    for name, svc in compose["services"].items():
        for v in svc.get("volumes", []):
            src, dst = v.split(":")[:2]
            if src.startswith("."):
                full = os.path.normpath(os.path.join(compose_dir, src))
                check(os.path.exists(full), f"compose {name}: mounts {src}, which does not exist")
                mounts[dst] = full
    provider = load_yaml_docs(os.path.join(deploy, "grafana", "provisioning", "dashboards", "plsh.yml"))[0]
    dash_mount = provider["providers"][0]["options"]["path"]
    check(mounts.get(dash_mount) == os.path.dirname(dash_path),
          f"grafana provider path {dash_mount} is not where compose mounts deploy/grafana/dashboards")
    home = compose["services"]["grafana"]["environment"].get("GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH", "")
    check(home == f"{dash_mount}/plsh.json", f"grafana home dashboard {home} is not the provisioned file")
    ds = load_yaml_docs(os.path.join(deploy, "grafana", "provisioning", "datasources", "prometheus.yml"))[0]
    url = ds["datasources"][0]["url"]
    check(re.fullmatch(r"http://prometheus:9090", url) is not None and "prometheus" in compose["services"],
          f"grafana datasource url {url} is not the compose prometheus service")

    # 6. Prometheus in compose reads deploy/prometheus/prometheus.yml and
    #    scrapes the name both plsh services answer to.
    cmd = compose["services"]["prometheus"]["command"]
    config_flag = next((c.split("=", 1)[1] for c in cmd if c.startswith("--config.file=")), "")
    mount_dst = os.path.dirname(config_flag)
    check(mounts.get(mount_dst) == prom_dir and os.path.isfile(os.path.join(prom_dir, os.path.basename(config_flag))),
          f"compose prometheus --config.file={config_flag} is not deploy/prometheus/prometheus.yml")
    targets = [t for sc in jobs["plsh"]["static_configs"] for t in sc["targets"]]
    for t in targets:
        host, port = t.rsplit(":", 1)
        check(host == "plsh", f"prometheus.yml: plsh target {t} is not the compose service name")
        for svc in ("plsh", "plsh-cpu"):
            env = compose["services"][svc]["environment"]
            check(env.get("PLSH_METRICS_LISTEN", "").endswith(":" + port),
                  f"compose {svc}: PLSH_METRICS_LISTEN does not listen on the scraped port {port}")
    aliases = compose["services"]["plsh-cpu"].get("networks", {}).get("default", {}).get("aliases", [])
    check("plsh" in aliases, "compose plsh-cpu: needs the network alias plsh that Prometheus scrapes")
    gpu = compose["services"]["plsh"].get("deploy", {}).get("resources", {}).get("reservations", {}).get("devices", [])
    check(any("gpu" in d.get("capabilities", []) for d in gpu), "compose plsh: no GPU reservation")
    print("cross-references: compose mounts, provisioning, scrape target and rule files agree")

    # 7. Dockerfile: instructions known, stages that the variant argument and
    #    COPY --from name exist, ARGs used in FROM declared before the first.
    check_dockerfile(os.path.join(args.repo, "Dockerfile"), os.path.join(args.repo, ".dockerignore"))

    return finish(problems, "all static deploy checks passed")


if __name__ == "__main__":
    sys.exit(main())
