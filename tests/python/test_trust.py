"""TLS, client certificates and bearer tokens through the Python client and
the plsh CLI (attend, info, health, bench), against the real plsh-server on
loopback. Certificates are made here with the openssl command; the token
file holds SHA-256 digests. No token may appear in any output."""

import hashlib
import json
import os
import re
import secrets
import subprocess

import numpy as np
import pytest

from conftest import Server
from plsh_client import Client, PlshError

PLSH = os.environ.get("PLSH_CLI")


def run(*args, env=None):
    return subprocess.run([PLSH, *args], capture_output=True, text=True, env=env, timeout=120)


def openssl(d, *args):
    r = subprocess.run(["openssl", *args], cwd=d, capture_output=True, text=True)
    assert r.returncode == 0, f"openssl {' '.join(args)}: {r.stderr}"


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    d = tmp_path_factory.mktemp("pki")
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes"]
    (d / "server.ext").write_text("subjectAltName=DNS:plsh.test,IP:127.0.0.1\n")
    openssl(d, "req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.crt", "-days", "2", "-subj", "/CN=ca")
    for name, cn, ext in (("server", "plsh.test", ["-extfile", "server.ext"]), ("client", "client", [])):
        openssl(d, "req", *ec, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={cn}")
        openssl(d, "x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
                "-out", f"{name}.crt", "-days", "2", *ext)
    return d


@pytest.fixture(scope="module")
def tokens(tmp_path_factory):
    d = tmp_path_factory.mktemp("tokens")
    t = {"trainer": secrets.token_hex(32), "monitor": secrets.token_hex(32)}
    digest = {k: hashlib.sha256(v.encode()).hexdigest() for k, v in t.items()}
    (d / "tokens.json").write_text(json.dumps({"version": 1, "clients": [
        {"name": "trainer", "sha256": [digest["trainer"]]},
        {"name": "monitor", "sha256": digest["monitor"], "methods": ["GetInfo"]}]}))
    (d / "trainer.token").write_text(t["trainer"] + "\n")
    t["dir"] = d
    return t


def health_address(server):
    for line in server.log:
        m = re.search(r" serving .*health=(\S+)", line)
        if m:
            return m.group(1)
    return None


@pytest.fixture(scope="module")
def tls_server(pki, tokens):
    s = Server("--tls-cert", str(pki / "server.crt"), "--tls-key", str(pki / "server.key"),
               "--token-file", str(tokens["dir"] / "tokens.json"), "--health-listen", "127.0.0.1:0")
    yield s
    assert s.stop() == 0, "".join(s.log)
    log = "".join(s.log)
    assert tokens["trainer"] not in log and tokens["monitor"] not in log


@pytest.fixture(scope="module")
def mtls_server(pki):
    s = Server("--tls-cert", str(pki / "server.crt"), "--tls-key", str(pki / "server.key"),
               "--tls-client-ca", str(pki / "ca.crt"), "--tls-client-auth", "require")
    yield s
    assert s.stop() == 0, "".join(s.log)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("inputs")
    r = np.random.default_rng(3)
    for name in ("q", "k", "v"):
        np.save(d / f"{name}.npy", r.standard_normal((1, 96, 2, 16)).astype(np.float32))
    return d


def qkv(files):
    return [np.load(files / f"{n}.npy") for n in ("q", "k", "v")]


# ------------------------------------------------------------ Python client

def test_python_client_over_tls_with_a_token(tls_server, pki, tokens, files):
    q, k, v = qkv(files)
    with Client(tls_server.address, tls_ca=str(pki / "ca.crt"), token=tokens["trainer"]) as c:
        assert c.health() == "SERVING"
        assert c.info().version
        out, meta = c.attend(q, k, v, mode="lsh", samples=16, seed=1, causal=True)
        assert out.shape == q.shape and np.isfinite(out).all() and meta["backend"] == "cpu"
        assert tokens["trainer"] not in repr(c)
    # PEM bytes instead of a path, and the token from a file: the same answer.
    with Client(tls_server.address, tls_ca=(pki / "ca.crt").read_bytes(),
                token_file=str(tokens["dir"] / "trainer.token")) as c:
        again, _ = c.attend(q, k, v, mode="lsh", samples=16, seed=1, causal=True)
    assert np.array_equal(out, again)


def test_python_client_refusals(tls_server, pki, tokens, files):
    q, k, v = qkv(files)
    ca = str(pki / "ca.crt")
    with Client(tls_server.address, tls_ca=ca) as c:
        assert c.health() == "SERVING"  # health needs no token
        with pytest.raises(PlshError) as e:
            c.attend(q, k, v)
        assert e.value.code_name == "UNAUTHENTICATED"
    wrong = secrets.token_hex(32)
    with Client(tls_server.address, tls_ca=ca, token=wrong) as c:
        with pytest.raises(PlshError) as e:
            c.info()
        assert e.value.code_name == "UNAUTHENTICATED" and wrong not in str(e.value)
    with Client(tls_server.address, tls_ca=ca, token=tokens["monitor"]) as c:
        assert c.info().version
        with pytest.raises(PlshError) as e:
            c.attend(q, k, v)
        assert e.value.code_name == "PERMISSION_DENIED" and "client 'monitor'" in e.value.details
        assert tokens["monitor"] not in str(e.value)
    with Client(tls_server.address, token=tokens["trainer"]) as c:  # plaintext to a TLS port
        with pytest.raises(PlshError) as e:
            c.info(timeout=5)
        assert e.value.code_name == "UNAVAILABLE"
    with pytest.raises(ValueError, match="tls_ca = .*cannot read"):
        Client(tls_server.address, tls_ca=str(pki / "missing.crt"))
    with pytest.raises(ValueError, match="character 3 of the token is not visible ASCII"):
        Client(tls_server.address, token="abc def")


def test_python_client_certificates(mtls_server, pki, files):
    q, k, v = qkv(files)
    with Client(mtls_server.address, tls_ca=str(pki / "ca.crt"), tls_cert=str(pki / "client.crt"),
                tls_key=str(pki / "client.key")) as c:
        out, _ = c.attend(q, k, v, mode="exact")
        assert out.shape == q.shape
    with Client(mtls_server.address, tls_ca=str(pki / "ca.crt")) as c:
        with pytest.raises(PlshError) as e:
            c.info(timeout=5)
        assert e.value.code_name == "UNAVAILABLE"  # the handshake fails: no status from the server
    # The certificate's name, through the override.
    with Client(mtls_server.address, tls_ca=str(pki / "ca.crt"), tls_cert=str(pki / "client.crt"),
                tls_key=str(pki / "client.key"), tls_server_name="plsh.test") as c:
        assert c.info().version


# --------------------------------------------------------------------- CLI

def no_secret(tokens, *results):
    for r in results:
        for name in ("trainer", "monitor"):
            assert tokens[name] not in r.stdout and tokens[name] not in r.stderr


def test_cli_attend_over_tls_with_a_token(tls_server, pki, tokens, files, tmp_path):
    common = ["--q", str(files / "q.npy"), "--k", str(files / "k.npy"), "--v", str(files / "v.npy"),
              "--mode", "lsh", "--samples", "16", "--seed", "2", "--causal"]
    local = run("compute", *common, "--backend", "cpu", "--out", str(tmp_path / "c.npy"))
    assert local.returncode == 0, local.stderr
    tls = ["--target", tls_server.address, "--tls-ca", str(pki / "ca.crt")]
    by_file = run("attend", *common, *tls, "--token-file", str(tokens["dir"] / "trainer.token"),
                  "--out", str(tmp_path / "a.npy"), "--meta", str(tmp_path / "a.json"))
    assert by_file.returncode == 0, by_file.stderr
    a, c = np.load(tmp_path / "a.npy"), np.load(tmp_path / "c.npy")
    assert np.abs(a - c).max() <= 1e-6 * np.abs(c).max()
    assert tokens["trainer"] not in (tmp_path / "a.json").read_text()
    by_env = run("attend", *common, *tls, "--out", str(tmp_path / "b.npy"),
                 env=dict(os.environ, PLSH_TOKEN=tokens["trainer"]))
    assert by_env.returncode == 0, by_env.stderr
    assert np.array_equal(np.load(tmp_path / "b.npy"), a)
    missing = run("attend", *common, *tls, "--out", str(tmp_path / "m.npy"))
    assert missing.returncode == 1 and missing.stderr.startswith("plsh attend: UNAUTHENTICATED"), missing.stderr
    denied = run("attend", *common, *tls, "--token", tokens["monitor"], "--out", str(tmp_path / "d.npy"))
    assert denied.returncode == 1 and "PERMISSION_DENIED" in denied.stderr, denied.stderr
    plaintext = run("attend", *common, "--target", tls_server.address, "--token", tokens["trainer"],
                    "--out", str(tmp_path / "p.npy"), "--deadline", "10")
    assert plaintext.returncode == 1 and "UNAVAILABLE" in plaintext.stderr
    bad_ca = run("attend", *common, "--target", tls_server.address, "--tls-ca", str(tmp_path / "none.crt"),
                 "--out", str(tmp_path / "x.npy"))
    assert bad_ca.returncode == 2 and "tls_ca = " in bad_ca.stderr and "cannot read" in bad_ca.stderr
    no_secret(tokens, by_file, by_env, missing, denied, plaintext)


def test_cli_info_and_health(tls_server, pki, tokens):
    tls = ["--target", tls_server.address, "--tls-ca", str(pki / "ca.crt")]
    info = run("info", *tls, "--token", tokens["monitor"])
    assert info.returncode == 0, info.stderr
    assert json.loads(info.stdout)["version"]
    refused = run("info", *tls)
    assert refused.returncode == 1 and "UNAUTHENTICATED" in refused.stderr
    assert run("health", *tls).stdout.strip() == "SERVING"
    # The health-only port: plaintext, no token, and nothing but health.
    health = health_address(tls_server)
    assert health and health != "off"
    probe = run("health", "--target", health, "--service", "plsh.v1.Attention")
    assert probe.returncode == 0 and probe.stdout.strip() == "SERVING", probe.stderr
    other = run("info", "--target", health, "--token", tokens["monitor"])
    assert other.returncode == 1 and "UNIMPLEMENTED" in other.stderr
    assert run("health", "--target", tls_server.address).returncode == 1  # plaintext to the TLS port
    no_secret(tokens, info, refused, other)


def test_cli_bench_over_tls_with_a_token(tls_server, pki, tokens, tmp_path):
    r = run("bench", "--target", tls_server.address, "--tls-ca", str(pki / "ca.crt"),
            "--token-file", str(tokens["dir"] / "trainer.token"), "--shape", "1,128,2,2,16",
            "--requests", "3", "--warmup", "0", "--connections", "2", "--quiet", "--json", str(tmp_path / "b.json"))
    assert r.returncode == 0, r.stderr
    level = json.loads((tmp_path / "b.json").read_text())["levels"][0]
    assert level["ok"] == 3 and level["failed"] == 0, level
    refused = run("bench", "--target", tls_server.address, "--tls-ca", str(pki / "ca.crt"), "--requests", "1",
                  "--warmup", "0", "--quiet")
    assert refused.returncode != 0 and "UNAUTHENTICATED" in refused.stderr, refused.stderr
    no_secret(tokens, r, refused)
