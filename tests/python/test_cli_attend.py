"""plsh attend (the CLI) against the real plsh-server: for every mode the
output and lse files equal plsh compute's on the same files (1e-6 relative,
float32), META.json carries the estimates and the server's timings, and
errors print the gRPC status name and exit non-zero. Also plsh health/info."""

import json
import os
import subprocess

import numpy as np
import pytest

PLSH = os.environ.get("PLSH_CLI")


def run(*args):
    return subprocess.run([PLSH, *args], capture_output=True, text=True)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("inputs")
    r = np.random.default_rng(12)
    np.save(d / "q.npy", r.standard_normal((2, 150, 4, 48)).astype(np.float32))
    np.save(d / "k.npy", r.standard_normal((2, 190, 2, 48)).astype(np.float32))
    np.save(d / "v.npy", r.standard_normal((2, 190, 2, 48)).astype(np.float32))
    return d


@pytest.mark.parametrize("mode", ["exact", "lsh", "window"])
def test_attend_equals_compute(server, files, tmp_path, mode):
    common = ["--q", str(files / "q.npy"), "--k", str(files / "k.npy"), "--v", str(files / "v.npy"),
              "--mode", mode, "--samples", "24", "--seed", "5", "--causal"]
    local = run("compute", *common, "--backend", "cpu", "--out", str(tmp_path / "c.npy"),
                "--lse", str(tmp_path / "c_lse.npy"), "--meta", str(tmp_path / "c.json"))
    assert local.returncode == 0, local.stderr
    remote = run("attend", *common, "--target", server.address, "--chunk-bytes", "4096", "--deadline", "60",
                 "--out", str(tmp_path / "a.npy"), "--lse", str(tmp_path / "a_lse.npy"),
                 "--meta", str(tmp_path / "a.json"))
    assert remote.returncode == 0, remote.stderr
    for out, ref in (("a.npy", "c.npy"), ("a_lse.npy", "c_lse.npy")):
        a, b = np.load(tmp_path / out), np.load(tmp_path / ref)
        assert a.shape == b.shape and a.dtype == b.dtype == np.float32
        assert np.abs(a - b).max() <= 1e-6 * np.abs(b).max()
    meta, ref_meta = json.loads((tmp_path / "a.json").read_text()), json.loads((tmp_path / "c.json").read_text())
    assert meta["mode"] == mode and meta["shape"] == ref_meta["shape"] and meta["params"] == ref_meta["params"]
    # rel_err = ||o~ - o*|| / ||o*||: outputs 1e-6 apart move it by at most ~1e-6.
    probe, ref_probe = meta["summary"]["probe"], ref_meta["summary"]["probe"]
    assert probe["rel_err"] == pytest.approx(ref_probe["rel_err"], rel=0, abs=1e-6)
    server_part = meta["server"]
    assert set(server_part["timings"]) == {"queued", "receiving", "computing", "sending", "total"}
    assert server_part["messages"] > 10 and server_part["largest_message_bytes"] <= 4096 + 1024


def test_attend_errors_print_the_status_and_exit_non_zero(server, files, tmp_path):
    inputs = ["--q", str(files / "q.npy"), "--k", str(files / "k.npy"), "--v", str(files / "v.npy"),
              "--out", str(tmp_path / "o.npy")]
    bad = run("attend", *inputs, "--target", server.address, "--samples", "0")
    assert bad.returncode == 2
    assert bad.stderr.startswith("plsh attend: INVALID_ARGUMENT: samples = 0")
    over = run("attend", *inputs, "--target", server.address, "--samples", "100000")
    assert over.returncode == 1 and "RESOURCE_EXHAUSTED" in over.stderr and "samples" in over.stderr
    gone = run("attend", *inputs, "--target", "127.0.0.1:1", "--deadline", "5")
    assert gone.returncode == 1 and "plsh attend: UNAVAILABLE" in gone.stderr


def test_health_and_info(server):
    ok = run("health", "--target", server.address)
    assert ok.returncode == 0 and ok.stdout.strip() == "SERVING"
    service = run("health", "--target", server.address, "--service", "plsh.v1.Attention")
    assert service.returncode == 0
    unknown = run("health", "--target", server.address, "--service", "no.such.Service")
    assert unknown.returncode == 1 and "NOT_FOUND" in unknown.stderr
    info = run("info", "--target", server.address)
    assert info.returncode == 0
    parsed = json.loads(info.stdout)
    # Numbers, not proto JSON's strings for 64-bit integers (issue 21).
    assert parsed["limits"]["max_samples"] == 512 and parsed["limits"]["max_message_bytes"] > 0
    assert parsed["defaults"]["seed"] == 0 and parsed["shard_row_align"] == 128
    assert parsed["backends"][-1]["name"] == "cpu"
    down = run("health", "--target", "127.0.0.1:1", "--deadline", "2")
    assert down.returncode == 1 and "plsh health: " in down.stderr


@pytest.mark.parametrize("mode", ["exact", "lsh", "window"])
def test_attend_backward_equals_compute_bit_for_bit(files, tmp_path, mode):
    """plsh attend --dout runs forward+backward through the server (q, k, v
    up once: the forward keeps its context) and writes the same dq, dk, dv
    as plsh compute --dout: both on one CPU thread, so the backward's dq
    sums run in one order and the bits agree."""
    from conftest import Server
    one_thread = Server("--threads", "1")
    try:
        r = np.random.default_rng(3)
        np.save(tmp_path / "dout.npy", r.standard_normal((2, 150, 4, 48)).astype(np.float32))
        common = ["--q", str(files / "q.npy"), "--k", str(files / "k.npy"), "--v", str(files / "v.npy"),
                  "--mode", mode, "--samples", "24", "--seed", "5", "--causal", "--dout", str(tmp_path / "dout.npy")]
        local = run("compute", *common, "--backend", "cpu", "--threads", "1", "--out", str(tmp_path / "c.npy"),
                    "--dq", str(tmp_path / "c_dq.npy"), "--dk", str(tmp_path / "c_dk.npy"),
                    "--dv", str(tmp_path / "c_dv.npy"))
        assert local.returncode == 0, local.stderr
        remote = run("attend", *common, "--target", one_thread.address, "--chunk-bytes", "8192",
                     "--out", str(tmp_path / "a.npy"), "--dq", str(tmp_path / "a_dq.npy"),
                     "--dk", str(tmp_path / "a_dk.npy"), "--dv", str(tmp_path / "a_dv.npy"),
                     "--meta", str(tmp_path / "a.json"))
        assert remote.returncode == 0, remote.stderr
        for name in ("dq", "dk", "dv"):
            a, b = np.load(tmp_path / f"a_{name}.npy"), np.load(tmp_path / f"c_{name}.npy")
            assert a.shape == b.shape and a.dtype == b.dtype == np.float32
            assert np.array_equal(a, b), name
        meta = json.loads((tmp_path / "a.json").read_text())
        # Only dout went up for the backward; dq, dk, dv came down.
        assert meta["backward"]["server"]["sent_bytes"] == 2 * 150 * 4 * 48 * 4
        assert meta["backward"]["server"]["received_bytes"] == (2 * 150 * 4 + 2 * 2 * 190 * 2) * 48 * 4
        assert meta["backward"]["flops"] > 0 and meta["backward"]["grad_dtype"] == "f32"
        # A dout of the wrong shape is refused before anything is sent.
        np.save(tmp_path / "bad.npy", np.zeros((2, 150, 4, 47), np.float32))
        bad = run("attend", *common[:-2], "--dout", str(tmp_path / "bad.npy"), "--target", one_thread.address,
                  "--out", str(tmp_path / "x.npy"), "--dq", str(tmp_path / "x1.npy"), "--dk", str(tmp_path / "x2.npy"),
                  "--dv", str(tmp_path / "x3.npy"))
        assert bad.returncode == 2 and "dout shape [2, 150, 4, 47], expected the shape of out" in bad.stderr
    finally:
        assert one_thread.stop() == 0
