"""sampling= and target_rel_err= through the real server: the same answer and
the same metadata as plsh compute in one process, the attempts of a
targeted request in meta["target"], and the errors that name the field."""

import grpc
import numpy as np
import pytest

from plsh_client import Client, PlshError
from test_client import compute_in_process, rel, rng_inputs


@pytest.mark.parametrize("sampling", ["stratified", "ash"])
def test_samplers_equal_in_process(server, tmp_path, sampling):
    q, k, v = rng_inputs((1, 160, 4, 16), (1, 160, 2, 16), seed=4)
    flags = ["--mode", "lsh", "--samples", "16", "--seed", "3", "--sampling", sampling, "--causal", "--return-draws"]
    ref_out, ref_lse, ref_meta = compute_in_process(tmp_path, q, k, v, *flags)
    with Client(server.address) as c:
        out, meta = c.attend(q, k, v, mode="lsh", samples=16, seed=3, sampling=sampling, causal=True,
                             return_lse=True, return_draws=True)
    assert rel(out, ref_out) <= 1e-6
    assert meta["sampling"] == sampling == ref_meta["sampling"]
    # The draws are the library's, bit for bit (a pure function of seed, head, sample, s).
    for h, ref_h in zip(meta["heads"], ref_meta["heads"]):
        assert h["draws"] == [list(d) for d in ref_h["draws"]]
    upper = meta["summary"]["probe"]["rel_err_upper"]
    assert upper >= meta["summary"]["probe"]["rel_err"] > 0
    assert upper == pytest.approx(ref_meta["summary"]["probe"]["rel_err_upper"], rel=1e-5)


def test_targeted_request_reports_its_attempts(server, tmp_path):
    q, k, v = rng_inputs((1, 512, 4, 16), (1, 512, 4, 16), seed=8)
    slopes = [0.5, 0.25, 0.125, 0.0625]
    ref_out, _, ref_meta = compute_in_process(tmp_path, q, k, v, "--target-error", "0.02", "--causal", "--slopes",
                                              ",".join(map(str, slopes)))
    with Client(server.address) as c:
        out, meta = c.attend(q, k, v, target_rel_err=0.02, causal=True, slopes=slopes)
        exact, _ = c.attend(q, k, v, mode="exact", causal=True, slopes=slopes)
    t = meta["target"]
    assert t["target_rel_err"] == 0.02 and t["met"]
    assert t["chosen"] == len(t["attempts"]) - 1 == ref_meta["target"]["chosen"]
    kept = t["attempts"][t["chosen"]]
    assert meta["mode"] == kept["mode"] == "window"  # no mode given: windows
    assert kept["rel_err_upper"] <= 0.02 and kept["met"]
    assert all(not a["met"] for a in t["attempts"][:-1])
    assert meta["flops"] == pytest.approx(sum(a["flops"] for a in t["attempts"]))
    assert rel(out, ref_out) <= 1e-6
    true = np.linalg.norm(out.astype(np.float64) - exact) / np.linalg.norm(exact)
    assert true <= 0.02


def test_target_errors_name_the_field(server):
    q, k, v = rng_inputs((1, 32, 2, 8), (1, 32, 2, 8))
    with Client(server.address) as c:
        for bad in (0.0, 1.5, -0.1):
            with pytest.raises(PlshError) as e:
                c.attend(q, k, v, target_rel_err=bad)
            assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and "target_rel_err" in e.value.details
        with pytest.raises(PlshError) as e:
            c.attend(q, k, v, target_rel_err=0.1, estimates=False)
        assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and "estimates" in e.value.details
        # lsh tries 16, 64, 256, 1024 samples: over this server's --max-samples 512.
        with pytest.raises(PlshError) as e:
            c.attend(q, k, v, mode="lsh", samples=16, target_rel_err=0.1)
        assert e.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "1024" in e.value.details
        out, meta = c.attend(q, k, v, mode="lsh", samples=8, sampling="ash", target_rel_err=0.1)
        assert meta["target"]["attempts"][0]["samples"] == 8
        with pytest.raises(ValueError):
            c.attend(q, k, v, sampling="sobol")


def test_cli_attend_target_error_equals_compute(server, tmp_path):
    """plsh attend --target-error (the C++ client library's header) against plsh compute."""
    import json
    import os
    import subprocess
    q, k, v = rng_inputs((1, 300, 2, 16), (1, 300, 2, 16), seed=6)
    for name, a in (("q", q), ("k", k), ("v", v)):
        np.save(tmp_path / f"{name}.npy", a)
    common = ["--q", str(tmp_path / "q.npy"), "--k", str(tmp_path / "k.npy"), "--v", str(tmp_path / "v.npy"),
              "--target-error", "0.05", "--slopes", "0.5,0.125", "--causal"]
    plsh = os.environ["PLSH_CLI"]
    local = subprocess.run([plsh, "compute", *common, "--backend", "cpu", "--out", str(tmp_path / "c.npy"),
                            "--meta", str(tmp_path / "c.json")], capture_output=True, text=True)
    assert local.returncode == 0, local.stderr
    remote = subprocess.run([plsh, "attend", *common, "--target", server.address, "--out", str(tmp_path / "a.npy"),
                             "--meta", str(tmp_path / "a.json")], capture_output=True, text=True)
    assert remote.returncode == 0, remote.stderr
    meta, ref = json.loads((tmp_path / "a.json").read_text()), json.loads((tmp_path / "c.json").read_text())
    assert rel(np.load(tmp_path / "a.npy"), np.load(tmp_path / "c.npy")) <= 1e-6
    assert meta["mode"] == ref["mode"] == "window"
    assert meta["target"]["chosen"] == ref["target"]["chosen"]
    assert [a["mode"] for a in meta["target"]["attempts"]] == [a["mode"] for a in ref["target"]["attempts"]]
    assert meta["summary"]["probe"]["rel_err_upper"] <= 0.05
