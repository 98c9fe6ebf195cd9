"""Issue 21, point by point: what a PyTorch user met first, each against the
real plsh-server (and the plsh CLI): layouts that gave silent wrong
answers, a torch op that did not behave like one, surprising defaults,
small inconsistencies, and slow small calls. Every test here failed before
the change it names.

Packaging (pip install into a fresh venv, no PYTHONPATH) is
tests/python/packaging_test.sh; mypy and flake8 are ctest entries of their own."""

import hashlib
import inspect
import json
import os
import subprocess
import warnings

import numpy as np
import pytest
import torch

import plsh_client.torch as pt
from conftest import Server
from plsh_client import AttendResult, BackwardResult, Client, LayoutWarning, PlshError, ShardedClient

PLSH = os.environ["PLSH_CLI"]


def run(*args, env=None):
    return subprocess.run([PLSH, *args], capture_output=True, text=True, env=env, timeout=120)


def gaussian(*shape, seed=0, dtype=np.float32):
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


# ------------------------------------------------------------- 1. layouts

@pytest.fixture(scope="module")
def sdpa_files(tmp_path_factory):
    """q, k, v in SDPA's [B, H, N, D] (8 heads, 1024 positions), and the same in plsh's [B, N, H, D]."""
    d = tmp_path_factory.mktemp("layouts")
    q, k, v = (gaussian(2, 8, 1024, 16, seed=s) for s in (1, 2, 3))
    for name, a in (("q", q), ("k", k), ("v", v)):
        np.save(d / f"{name}_bhnd.npy", a)
        np.save(d / f"{name}_bnhd.npy", np.ascontiguousarray(a.transpose(0, 2, 1, 3)))
    return d


def test_cli_refuses_sdpa_files_read_as_plsh_layout_and_takes_layout_bhnd(server, sdpa_files, tmp_path):
    f = sdpa_files
    every = ["--q", str(f / "q_bhnd.npy"), "--k", str(f / "k_bhnd.npy"), "--v", str(f / "v_bhnd.npy"),
             "--mode", "exact"]
    # Before: exit 0, META with q_len 8 and heads 1024.
    wrong = run("attend", "--target", server.address, *every, "--out", str(tmp_path / "x.npy"))
    assert wrong.returncode == 2, wrong.stdout
    assert "more heads (1024, 1024) than positions (8, 8)" in wrong.stderr and "--layout bhnd" in wrong.stderr
    # Only q transposed: the message names q.
    mixed = run("attend", "--target", server.address, "--q", str(f / "q_bhnd.npy"), "--k", str(f / "k_bnhd.npy"),
                "--v", str(f / "v_bnhd.npy"), "--out", str(tmp_path / "x.npy"))
    assert mixed.returncode == 2 and f"so {f / 'q_bhnd.npy'} is probably in the other layout (bhnd)" in mixed.stderr
    # Declared, it runs, and writes the output in the files' layout.
    ok = run("attend", "--target", server.address, *every, "--layout", "bhnd", "--out", str(tmp_path / "o.npy"),
             "--lse", str(tmp_path / "l.npy"), "--meta", str(tmp_path / "m.json"))
    assert ok.returncode == 0, ok.stderr
    ref = run("compute", "--q", str(f / "q_bnhd.npy"), "--k", str(f / "k_bnhd.npy"), "--v", str(f / "v_bnhd.npy"),
              "--mode", "exact", "--backend", "cpu", "--out", str(tmp_path / "r.npy"),
              "--lse", str(tmp_path / "rl.npy"))
    assert ref.returncode == 0, ref.stderr
    out, want = np.load(tmp_path / "o.npy"), np.load(tmp_path / "r.npy")
    assert out.shape == (2, 8, 1024, 16)
    assert np.abs(out.transpose(0, 2, 1, 3) - want).max() <= 1e-6 * np.abs(want).max()
    assert np.load(tmp_path / "l.npy").shape == (2, 8, 1024)
    assert json.loads((tmp_path / "m.json").read_text())["shape"]["layout"] == "bhnd"


def test_client_refuses_one_transposed_tensor_and_takes_layout_bhnd(server):
    q, k, v = (gaussian(2, 1024, 8, 16, seed=s) for s in (1, 2, 3))
    with Client(server.address) as c:
        # Before: out of shape (2, 8, 1024, 16), silently.
        with pytest.raises(ValueError, match=r"so q is probably in the other layout \(bhnd\)"):
            c.attend(q.transpose(0, 2, 1, 3), k, v, mode="exact")
        with pytest.raises(ValueError, match=r"so k and v is probably in the other layout"):
            c.attend(q, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3), mode="exact")
        plain = c.attend(q, k, v, mode="exact", return_lse=True)
        sdpa = c.attend(*(a.transpose(0, 2, 1, 3) for a in (q, k, v)), layout="bhnd", mode="exact", return_lse=True)
    assert sdpa.out.shape == (2, 8, 1024, 16) and sdpa.lse.shape == (2, 8, 1024)
    assert np.array_equal(sdpa.out, plain.out.transpose(0, 2, 1, 3))
    assert np.array_equal(sdpa.lse, plain.lse.transpose(0, 2, 1))


def test_undecidable_shapes_warn_and_explicit_slopes_say_the_heads_are_meant(server):
    q = gaussian(1, 1, 8, 16)  # a first decode step: one query, one key, 8 heads
    with Client(server.address) as c:
        with pytest.warns(LayoutWarning, match="more heads"):
            c.attend(q, q, q, mode="exact")
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            c.attend(q, q, q, mode="exact", slopes=[0.5] * 8)
            c.attend(q, q, q, mode="exact", check_layout=False)


def test_torch_op_takes_sdpa_layout_by_default(server):
    q, k, v = (torch.randn(1, 4, 256, 32, generator=torch.Generator().manual_seed(s)) for s in (1, 2, 3))
    with Client(server.address) as c:
        out = pt.attention(q, k, v, client=c)
        plsh = pt.attention(*(t.transpose(1, 2) for t in (q, k, v)), client=c, layout="bnhd")
        # Before: (1, 4, 256, 32) from a q in SDPA's layout and k, v in plsh's, silently.
        with pytest.raises(ValueError, match="probably in the other layout"):
            pt.attention(q, k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous(), client=c)
    assert out.shape == (1, 4, 256, 32)
    assert torch.equal(out, plsh.transpose(1, 2))


def test_errors_name_the_tensor_that_is_wrong(server, tmp_path):
    q, kv = gaussian(1, 64, 4, 32), gaussian(1, 64, 4, 32)
    with Client(server.address) as c:
        # Before: k alone with the wrong head_dim, and the CLI's message named v.
        with pytest.raises(ValueError, match="^k: shape .* has head_dim = 16, expected q's head_dim = 32"):
            c.attend(q, kv[..., :16], kv, mode="exact")
        with pytest.raises(ValueError, match="^v: shape .* has head_dim = 16"):
            c.attend(q, kv, kv[..., :16], mode="exact")
        # Before: a float16 k was cast to float32 without a word; the CLI refused it.
        with pytest.raises(ValueError, match="^k: dtype float16, expected q's dtype float32"):
            c.attend(q, kv.astype(np.float16), kv, mode="exact")
    for name, a in (("q", q), ("k", kv[..., :16]), ("v", kv)):
        np.save(tmp_path / f"{name}.npy", a)
    r = run("compute", "--q", str(tmp_path / "q.npy"), "--k", str(tmp_path / "k.npy"), "--v", str(tmp_path / "v.npy"),
            "--out", str(tmp_path / "o.npy"))
    assert r.returncode == 2 and f"{tmp_path / 'k.npy'}: head_dim = 16" in r.stderr, r.stderr


# ---------------------------------------------------- 2. a typed package

def test_results_are_dataclasses_with_an_explicit_backward(server):
    q, k, v = gaussian(1, 40, 2, 8), gaussian(1, 50, 2, 8, seed=1), gaussian(1, 50, 2, 8, seed=2)
    with Client(server.address) as c:
        r = c.attend(q, k, v, mode="lsh", samples=8, seed=3, causal=True, return_lse=True, keep_context=True)
        assert isinstance(r, AttendResult)
        assert (r.mode, r.samples, r.seed) == ("lsh", 8, 3) and r.lse.shape == (1, 40, 2)
        assert len(r.heads) == 2 and r.summary.probe.rows > 0 and r.timings.total > 0
        assert r.estimated_rel_err == r.summary.probe.rel_err > 0
        g = c.backward(np.ones_like(q), context_id=r.context_id, kv_shape=k.shape)
        assert isinstance(g, BackwardResult) and g.dq.shape == q.shape and g.dk.shape == k.shape
        # The 0.1 forms still unpack.
        out, meta = c.attend(q, k, v, mode="exact")
        assert np.array_equal(out, c.attend(q, k, v, mode="exact").out) and meta["mode"] == "exact"
    params = inspect.signature(Client.backward).parameters
    assert not any(p.kind == p.VAR_KEYWORD for p in params.values())  # before: backward(self, dout, **kwargs)
    assert {"context_id", "q", "k", "v", "out", "lse", "mode", "seed", "causal"} <= set(params)


@pytest.fixture(scope="module")
def token_server(tmp_path_factory):
    d = tmp_path_factory.mktemp("token")
    token, narrow = "plsh-test-token-1", "plsh-test-token-2"
    (d / "tokens.json").write_text(json.dumps({"version": 1, "clients": [
        {"name": "all", "sha256": [hashlib.sha256(token.encode()).hexdigest()]},
        {"name": "stream-only", "sha256": [hashlib.sha256(narrow.encode()).hexdigest()], "methods": ["Attend"]}]}))
    s = Server("--token-file", str(d / "tokens.json"))
    s.token, s.narrow = token, narrow
    yield s
    assert s.stop() == 0, "".join(s.log)


def test_plsh_token_and_plsh_target_are_honoured(token_server, monkeypatch):
    q = gaussian(1, 16, 2, 8)
    with Client(token_server.address) as c:
        with pytest.raises(PlshError) as e:
            c.attend(q, q, q, mode="exact")
        assert e.value.code_name == "UNAUTHENTICATED"
    monkeypatch.setenv("PLSH_TOKEN", token_server.token)
    monkeypatch.setenv("PLSH_TARGET", token_server.address)
    with Client() as c:  # before: the Python client ignored both
        assert c.attend(q, q, q, mode="exact").out.shape == q.shape
    monkeypatch.delenv("PLSH_TOKEN")
    # The CLI reads PLSH_TARGET too (and PLSH_TOKEN, as before).
    env = dict(os.environ, PLSH_TOKEN=token_server.token)
    assert run("info", env=env).returncode == 0


def test_torch_target_carries_a_token_and_tokens_without_unary_stream(token_server):
    q = torch.randn(1, 2, 16, 8)
    with pytest.raises(PlshError):
        pt.attention(q, q, q, target=token_server.address)
    out = pt.attention(q, q, q, target=token_server.address, token=token_server.token)  # before: no way to say it
    assert out.shape == q.shape
    # A token that allows Attend alone (no GetInfo, no AttendUnary): the client streams.
    with Client(token_server.address, token=token_server.narrow) as c:
        a = q.numpy().transpose(0, 2, 1, 3)
        assert c.attend(a, a, a, mode="exact").rpc == "Attend"


# --------------------------------------------- 3. a torch op that behaves like one

def test_torch_op_keeps_dtype_honours_autocast_and_takes_3d(server):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(4, 64, 16, generator=g) for _ in range(3))  # [H, N, D]: SDPA's without a batch
    with Client(server.address) as c:
        out3 = pt.attention(q, k, v, client=c)  # before: 3-D inputs were refused
        assert torch.equal(out3, pt.attention(q[None], k[None], v[None], client=c)[0])
        with torch.autocast("cpu", dtype=torch.bfloat16):  # before: float32 came back
            low = pt.attention(q, k, v, client=c)
        assert low.dtype == torch.bfloat16 and low.shape == q.shape
        assert (low.float() - out3).abs().max() < 3e-2
        half = pt.attention(q.half(), k.half(), v.half(), client=c)
        assert half.dtype == torch.float16
        out, lse = pt.attention(q, k, v, client=c, return_lse=True)  # before: no lse through the op
        assert lse.shape == (4, 64) and lse.dtype == torch.float32 and torch.equal(out, out3)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: the host copies are not exercised here")
def test_torch_op_keeps_the_device_and_counts_the_copies(server):
    q = torch.randn(1, 2, 32, 8, device="cuda", requires_grad=True)
    pt.reset_stats()
    with Client(server.address) as c:
        out = pt.attention(q, q, q, client=c)
        out.sum().backward()
    assert out.device == q.device and q.grad.device == q.device
    assert pt.stats()["device_copies"] >= 5 and pt.stats()["device_copy_bytes"] > 0


def test_torch_op_refuses_double_backward_vmap_and_jit_trace_saying_why(server):
    q = torch.randn(1, 2, 16, 8, requires_grad=True)
    with Client(server.address) as c:
        out = pt.attention(q, q, q, client=c)
        with pytest.raises(RuntimeError, match="double backward .* is not supported: the server computes"):
            torch.autograd.grad(out.sum(), q, create_graph=True)
        out.sum().backward()  # a plain backward still runs (and consumes the kept context)
        assert q.grad is not None
        functorch = pytest.importorskip("functorch")
        with pytest.raises(RuntimeError, match="under vmap is not supported"):
            functorch.vmap(lambda x: pt.attention(x, x, x, client=c))(q.detach()[None])
        with pytest.raises(RuntimeError, match="cannot be traced by torch.jit.trace"):
            torch.jit.trace(lambda x: pt.attention(x, x, x, client=c), (q.detach(),))


# ------------------------------------------------------- 4. defaults

def test_torch_op_defaults_to_exact_and_says_so(server):
    q, k, v = (torch.randn(1, 4, 128, 16, generator=torch.Generator().manual_seed(s)) for s in (4, 5, 6))
    with Client(server.address) as c:
        out = pt.attention(q, k, v, client=c)
        s = pt.last_summary()
        assert s.mode == "exact" and s.estimated_rel_err == 0.0  # before: lsh at s = 16, 0.19 off, unsaid
        exact = c.attend(*(t.numpy() for t in (q, k, v)), layout="bhnd", mode="exact").out
        assert np.array_equal(out.numpy(), exact)
        with torch.no_grad():
            pt.attention(q, k, v, client=c, mode="lsh", samples=16)
        s = pt.last_summary()
        assert s.mode == "lsh" and s.samples == 16 and 0 < s.estimated_rel_err < 1  # estimates on without a gradient


def test_demo_is_not_causal_by_default_like_attend():
    r = run("demo", "--n", "64", "--heads", "2", "--head-dim", "8", "--samples", "4", "--target-error", "0")
    assert r.returncode == 0 and ", not causal," in r.stdout  # before: causal by default, where attend is not


def test_more_queries_than_keys_is_said_in_the_callers_terms(server):
    q, kv = gaussian(1, 512, 2, 8), gaussian(1, 256, 2, 8)
    with Client(server.address) as c:
        with pytest.raises(PlshError) as e:
            c.attend(q, kv, kv, mode="exact", causal=True)
    # Before: "q_pos0 = -256, expected >= k_pos0 = 0 when causal", a q_pos0 never set.
    assert "q_len = 512 > kv_len = 256" in e.value.details and "explicit q_pos0" in e.value.details


# ------------------------------------------------------ 5. small things

def test_cli_info_prints_64_bit_limits_as_numbers(server):
    info = json.loads(run("info", "--target", server.address).stdout)
    assert isinstance(info["limits"]["max_tokens"], int) and isinstance(info["defaults"]["samples"], int)


def test_cli_bench_fails_when_no_level_meets_the_threshold(server, tmp_path):
    common = ["bench", "--target", server.address, "--shape", "1,64,2,2,8", "--mode", "exact", "--requests", "3",
              "--warmup", "0", "--quiet", "--concurrency", "1,2"]
    over = run(*common, "--p99-threshold", "0.000001")
    assert over.returncode == 1 and "no level met --p99-threshold" in over.stderr  # before: exit 0
    assert run(*common, "--p99-threshold", "600000").returncode == 0


def test_sharded_sequence_cut_with_a_sampler_is_refused_not_sent_whole(server):
    q = gaussian(1, 512, 2, 8)
    with ShardedClient([server.address, server.address]) as c:
        with pytest.raises(ValueError, match="shard_by = 'sequence' with an lsh sampler other than iid"):
            c.attend(q, q, q, mode="lsh", sampling="ash", shard_by="sequence", shards=2)


# ------------------------------------------------------ 6. small calls

def test_small_calls_go_in_one_message_each_way_on_one_channel(server):
    q = gaussian(1, 64, 4, 32)
    with Client(server.address) as c:
        small = c.attend(q, q, q, mode="exact")
        streamed = c.attend(q, q, q, mode="exact", rpc="stream")
        big = c.attend(*(gaussian(1, 4096, 8, 64),) * 3, mode="window")
    assert small.rpc == "AttendUnary" and streamed.rpc == "Attend" and big.rpc == "Attend"
    assert np.array_equal(small.out, streamed.out)
    # The torch op's clients: one channel per (target, token), kept.
    assert pt._client_for(None, server.address, None, None) is pt._client_for(None, server.address, None, None)
