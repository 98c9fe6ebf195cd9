"""The Python client against the real plsh-server: every mode equals the
in-process result (plsh compute on the same .npy files), errors carry the
status code and name the field, chunking does not change the answer."""

import json
import os
import subprocess

import grpc
import numpy as np
import pytest

from plsh_client import Client, PlshError


def rng_inputs(shape_q, shape_kv, dtype=np.float32, seed=0):
    r = np.random.default_rng(seed)
    return (r.standard_normal(shape_q).astype(dtype), r.standard_normal(shape_kv).astype(dtype),
            r.standard_normal(shape_kv).astype(dtype))


def compute_in_process(tmp_path, q, k, v, *flags):
    """plsh compute: the same request in one process, on the CPU backend."""
    for name, a in (("q", q), ("k", k), ("v", v)):
        np.save(tmp_path / f"{name}.npy", a)
    cmd = [os.environ["PLSH_CLI"], "compute", "--backend", "cpu", "--q", str(tmp_path / "q.npy"),
           "--k", str(tmp_path / "k.npy"), "--v", str(tmp_path / "v.npy"), "--out", str(tmp_path / "out.npy"),
           "--lse", str(tmp_path / "lse.npy"), "--meta", str(tmp_path / "meta.json"), *flags]
    subprocess.run(cmd, check=True)
    return (np.load(tmp_path / "out.npy"), np.load(tmp_path / "lse.npy"),
            json.loads((tmp_path / "meta.json").read_text()))


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.abs(a - b).max() / max(np.abs(b).max(), 1e-30)


@pytest.mark.parametrize("mode", ["exact", "lsh", "window"])
@pytest.mark.parametrize("causal", [False, True])
def test_every_mode_equals_in_process(server, tmp_path, mode, causal):
    q, k, v = rng_inputs((2, 97, 4, 40), (2, 130, 2, 40), seed=3)
    flags = ["--mode", mode, "--samples", "32", "--seed", "9"] + (["--causal"] if causal else [])
    ref_out, ref_lse, ref_meta = compute_in_process(tmp_path, q, k, v, *flags)
    with Client(server.address) as c:
        # 2000-byte chunks: many messages each way.
        out, meta = c.attend(q, k, v, mode=mode, samples=32, seed=9, causal=causal, return_lse=True,
                             chunk_bytes=2000)
    assert out.shape == ref_out.shape and out.dtype == np.float32
    assert rel(out, ref_out) <= 1e-6
    assert rel(meta["lse"], ref_lse) <= 1e-6
    assert meta["mode"] == mode and meta["backend"] == "cpu"
    if mode != "exact":
        # rel_err = ||o~ - o*|| / ||o*||: outputs 1e-6 apart move it by at most ~1e-6.
        assert meta["summary"]["probe"]["rel_err"] == pytest.approx(ref_meta["summary"]["probe"]["rel_err"], rel=0, abs=1e-6)
        assert meta["summary"]["mask_max_err"] == pytest.approx(ref_meta["summary"]["mask_max_err"], rel=1e-9, abs=1e-15)
        assert len(meta["heads"]) == 4
    for phase in ("queued", "receiving", "computing", "sending", "total"):
        assert meta["timings"][phase] >= 0


def test_float16_unbatched_and_chunking_do_not_change_the_answer(server):
    q, k, v = rng_inputs((300, 8, 64), (300, 8, 64), dtype=np.float16, seed=5)
    with Client(server.address) as c:
        whole, _ = c.attend(q, k, v, mode="lsh", samples=16, causal=True)
        pieces, _ = c.attend(q, k, v, mode="lsh", samples=16, causal=True, chunk_bytes=1)  # one row per message
    assert whole.shape == (300, 8, 64) and whole.dtype == np.float16
    # The same float32 arithmetic up to the backend threads' summation order,
    # rounded to float16: at most one float16 ulp apart.
    a, b = whole.astype(np.float32), pieces.astype(np.float32)
    assert np.all(np.abs(a - b) <= np.maximum(np.abs(a), np.abs(b)) * 2.0**-10 + 2.0**-24)


def test_bf16_on_the_wire_is_close_to_f32(server):
    q, k, v = rng_inputs((1, 64, 2, 32), (1, 64, 2, 32), seed=6)
    with Client(server.address) as c:
        ref, _ = c.attend(q, k, v, mode="exact")
        out, _ = c.attend(q, k, v, mode="exact", wire_dtype="bf16")
    assert out.dtype == np.float32
    # bf16 keeps 8 bits of mantissa: inputs and output each lose ~2^-9 relative.
    assert rel(out, ref) < 2e-2


@pytest.mark.parametrize("kwargs, field", [
    ({"samples": 0}, "samples"),
    ({"window_eps": 2.0, "mode": "window"}, "window_eps"),
    ({"slopes": [0.5, -1.0, 0.1, 0.1]}, "slopes[1]"),
    ({"scale": -1.0}, "scale"),
    ({"causal": True, "q_pos0": -3}, "q_pos0"),
])
def test_invalid_requests_raise_with_the_code_and_field(server, kwargs, field):
    q, k, v = rng_inputs((1, 16, 4, 8), (1, 16, 4, 8))
    with Client(server.address) as c:
        with pytest.raises(PlshError) as e:
            c.attend(q, k, v, **kwargs)
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.code_name == "INVALID_ARGUMENT"
    assert field in e.value.details


def test_limits_and_non_finite_inputs(server):
    q, k, v = rng_inputs((1, 16, 4, 8), (1, 16, 3, 8))
    with Client(server.address) as c:
        with pytest.raises(PlshError) as e:
            c.attend(q, k, v)
        assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and "kv_heads" in e.value.details
        q, k, v = rng_inputs((1, 16, 4, 8), (1, 16, 4, 8))
        with pytest.raises(PlshError) as e:
            c.attend(q, k, v, samples=513)
        assert e.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "samples" in e.value.details
        q[0, 5, 1, 2] = np.inf
        with pytest.raises(PlshError) as e:
            c.attend(q, k, v)
        assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert "q has a non-finite value" in e.value.details and "n=5, h=1, d=2" in e.value.details
        assert c.health() == "SERVING"
        assert c.health("plsh.v1.Attention") == "SERVING"


def test_info(server):
    with Client(server.address) as c:
        info = c.info()
    assert info.limits.max_samples == 512
    assert info.backends[-1].name == "cpu"
    assert info.defaults.samples == 16
    # The payload cap clients cut chunks by: under the message size, by a
    # headroom that only the server knows.
    assert 0 < info.limits.max_chunk_payload_bytes < info.limits.max_message_bytes
    assert info.defaults.out_chunk_bytes == info.limits.max_chunk_payload_bytes
    # The backend-dependent constants the clients read instead of copying:
    # the CPU backend's row tile, the backend names, the library's defaults.
    assert info.shard_row_align == 128
    assert list(info.backend_names) == ["auto", "cpu", "cuda"]
    assert (info.defaults.sampling, info.defaults.lsh_algorithm, info.defaults.target_mode) == (0, 0, 3)
    assert (info.limits.max_heads, info.limits.max_head_dim) == (1 << 20, 1024)


def test_options_left_out_take_the_servers_defaults(server):
    q, k, v = rng_inputs((1, 100, 4, 16), (1, 130, 2, 16), seed=8)
    with Client(server.address) as c:
        defaults = c.info().defaults
        out, meta = c.attend(q, k, v, causal=True)
        explicit, _ = c.attend(q, k, v, causal=True, mode="lsh", samples=defaults.samples,
                               probe_rows=defaults.probe_rows, scale=0.25, q_pos0=30)
    assert meta["mode"] == "lsh" and meta["samples"] == defaults.samples
    assert all(h["probe"]["rows"] == defaults.probe_rows for h in meta["heads"])
    # The scale and positions the server resolved (SPEC section 1: 1/sqrt(D), Nk - Nq, 0).
    assert (meta["scale"], meta["q_pos0"], meta["k_pos0"]) == (0.25, 30, 0)
    assert np.array_equal(out, explicit)


def test_deadline_exceeded_is_reported(server):
    q, k, v = rng_inputs((1, 4096, 8, 64), (1, 4096, 8, 64), seed=1)
    with Client(server.address) as c:
        with pytest.raises(PlshError) as e:
            c.attend(q, k, v, mode="exact", deadline=0.05)
    assert e.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
