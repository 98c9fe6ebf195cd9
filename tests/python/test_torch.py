"""plsh_client.torch and Client.backward against the real plsh-server.

What "gradcheck passes" means here, honestly: the wire carries float32 (and
16-bit types), never float64, and the kernels compute in float32. So

1. the service's gradients (float32 in, float32 out) are compared with
   float64 autograd of an independent reference of the same function
   (ALiBi attention with the same positional weights: L* for exact, L*
   cut to the window, M~ of the server's own lsh draws), at the float32
   tolerance the kernels' tests use (1e-5 of the largest entry);
2. torch.autograd.gradcheck runs on float64 leaves through the op (sent
   as float32), with eps and tolerances derived from float32 rounding: a
   central difference of a function computed to relative error u = 2^-24
   has rounding error about u * |f| / eps and truncation error about
   eps^2 * |third derivative| / 6. Measured on this test's inputs (max
   |numeric - analytic| over the Jacobian, |J| <= 1): eps = 1e-6: 0.18
   (gradcheck's default measures float32 rounding, not the gradient),
   1e-4: 1.7e-3, 1e-3: 2.3e-4, 1e-2: 2.0e-5 (exact; window and lsh alike).
   So eps = 1e-2 with atol = rtol = 2e-4: a 10x margin. A negative control
   shows the same check fails for a gradient 1% off.
"""

import gc
import math
import re
import urllib.request

import grpc
import numpy as np
import pytest
import torch

import plsh_client.torch as pt
from plsh_client import Client, PlshError


def metrics(server):
    addr = next(m.group(1) for line in server.log for m in [re.search(r" serving .*metrics=(\S+)", line)] if m)
    with urllib.request.urlopen(f"http://{addr}/metrics", timeout=10) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            out[key] = float(value)
    return out


def gauge(server, name):
    return sum(v for k, v in metrics(server).items() if k == name or k.startswith(name + "{"))


def reference(q, k, v, *, mode, slopes, causal, window_width=None, draws=None):
    """ALiBi attention in float64 torch from SPEC sections 2-4, differentiable by autograd.
    q [B, Nq, H, D], k, v [B, Nk, Hkv, D]; queries aligned to the end of the keys."""
    B, Nq, H, D = q.shape
    Nk, Hkv = k.shape[1], k.shape[2]
    group = H // Hkv
    pos_q = torch.arange(Nq, dtype=torch.float64) + (Nk - Nq)
    pos_k = torch.arange(Nk, dtype=torch.float64)
    dist = (pos_q[:, None] - pos_k[None, :]).abs()
    outs = []
    for h in range(H):
        kh, vh = k[:, :, h // group], v[:, :, h // group]
        scores = torch.einsum("bid,bjd->bij", q[:, :, h], kh) / math.sqrt(D)
        if mode == "lsh":
            weight = torch.zeros(Nq, Nk, dtype=torch.float64)
            for pitch, shift in draws[h]:
                bq = torch.floor((pos_q - shift) / pitch)
                bk = torch.floor((pos_k - shift) / pitch)
                weight += (bq[:, None] == bk[None, :]).double()
            log_w = torch.log(weight / len(draws[h]))
        else:
            log_w = -slopes[h] * dist
            if mode == "window":
                log_w = log_w.masked_fill(dist >= window_width, -math.inf)
        if causal:
            log_w = log_w.masked_fill(pos_k[None, :] > pos_q[:, None], -math.inf)
        p = torch.softmax(scores + log_w, dim=-1)
        outs.append(torch.einsum("bij,bjd->bid", p, vh))
    return torch.stack(outs, dim=2)


def max_rel(a, b):
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    return ((a - b).abs().max() / b.abs().max()).item()


SLOPES = [0.5, 0.25, 0.125, 0.0625]


def leaves(shape_q, shape_kv, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
            for s in (shape_q, shape_kv, shape_kv)]


@pytest.mark.parametrize("mode", ["exact", "window", "lsh"])
def test_gradients_match_float64_autograd_of_the_reference(server, mode):
    q, k, v = leaves((2, 37, 4, 16), (2, 45, 2, 16), seed=1)
    opts = dict(mode=mode, causal=True, slopes=SLOPES, samples=8, seed=5, window_width=6)
    draws = None
    with Client(server.address) as c:
        if mode == "lsh":
            # The server's own draws, so that the reference has the same M~.
            _, meta = c.attend(q.detach().numpy(), k.detach().numpy(), v.detach().numpy(), return_draws=True,
                               estimates=True, **opts)
            draws = [h["draws"] for h in meta["heads"]]
        out = pt.attention(q, k, v, client=c, layout="bnhd", **opts)
        g = torch.Generator().manual_seed(2)
        dout = torch.randn(out.shape, generator=g)
        out.backward(dout)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = reference(q64, k64, v64, mode=mode, slopes=SLOPES, causal=True, window_width=6, draws=draws)
    ref.backward(dout.double())
    assert max_rel(out.detach(), ref.detach()) <= 1e-5
    for name, got, want in (("dq", q.grad, q64.grad), ("dk", k.grad, k64.grad), ("dv", v.grad, v64.grad)):
        err = max_rel(got, want)
        print(f"{mode} {name}: max rel {err:.2e}")
        assert err <= 1e-5, name


@pytest.mark.parametrize("mode", ["exact", "window", "lsh"])
def test_gradcheck_through_the_service(server, mode):
    q, k, v = leaves((1, 7, 2, 4), (1, 9, 1, 4), dtype=torch.float64, seed=3)
    with Client(server.address) as c:
        def f(a, b, cc):
            return pt.attention(a, b, cc, client=c, layout="bnhd", mode=mode, causal=True, slopes=[0.5, 0.25],
                                samples=4, seed=1, window_width=3)

        assert torch.autograd.gradcheck(f, (q, k, v), eps=1e-2, atol=2e-4, rtol=2e-4)

        # Negative control: the same check catches a gradient 1% off.
        class OnePercentOff(torch.autograd.Function):
            @staticmethod
            def forward(ctx, x):
                return x.clone()

            @staticmethod
            def backward(ctx, g):
                return g * 1.01

        assert not torch.autograd.gradcheck(lambda a, b, cc: OnePercentOff.apply(f(a, b, cc)), (q, k, v), eps=1e-2,
                                            atol=2e-4, rtol=2e-4, raise_exception=False)


def test_a_training_step_sends_q_k_v_once_and_dout_only(server):
    q, k, v = leaves((2, 64, 4, 16), (2, 64, 4, 16), seed=4)
    pt.reset_stats()
    gc.collect()  # graphs of earlier tests, freed: their contexts released
    with Client(server.address) as c:
        before = gauge(server, "plsh_contexts_kept_total")
        out = pt.attention(q, k, v, client=c, layout="bnhd", mode="window", causal=True)
        assert gauge(server, "plsh_contexts") == 1
        out.sum().backward()
    s = pt.stats()
    tensor_bytes = 2 * 64 * 4 * 16 * 4
    assert s["forwards"] == 1 and s["backwards_by_context"] == 1 and s["backwards_stateless"] == 0
    assert s["bytes_up"] == 3 * tensor_bytes + tensor_bytes  # q, k, v; then dout
    assert s["bytes_down"] == tensor_bytes + 3 * tensor_bytes  # out; then dq, dk, dv
    assert gauge(server, "plsh_contexts") == 0
    assert gauge(server, "plsh_contexts_kept_total") == before + 1


def test_contexts_are_released_with_their_graph_and_not_kept_without_grad(server):
    q, k, v = leaves((1, 32, 2, 8), (1, 32, 2, 8), seed=5)
    pt.reset_stats()
    gc.collect()
    with Client(server.address) as c:
        out = pt.attention(q, k, v, client=c, layout="bnhd", mode="exact")
        assert gauge(server, "plsh_contexts") == 1
        del out
        gc.collect()
        assert pt.stats()["contexts_released"] == 1
        assert gauge(server, "plsh_contexts") == 0
        with torch.no_grad():
            pt.attention(q, k, v, client=c, layout="bnhd", mode="exact")
        pt.attention(q.detach(), k.detach(), v.detach(), client=c, layout="bnhd", mode="exact")
        assert gauge(server, "plsh_contexts") == 0
        assert pt.stats()["forwards"] == 3


def test_a_second_backward_falls_back_to_the_stateless_form(server):
    q, k, v = leaves((1, 40, 2, 8), (1, 40, 2, 8), seed=6)
    pt.reset_stats()
    with Client(server.address) as c:
        out = pt.attention(q, k, v, client=c, layout="bnhd", mode="lsh", samples=8, causal=True)
        first = torch.autograd.grad(out.sum(), (q, k, v), retain_graph=True)
        second = torch.autograd.grad(out.sum(), (q, k, v))
    for a, b in zip(first, second):
        assert torch.equal(a, b)  # same plan, same draws, same bits
    s = pt.stats()
    assert s["backwards_by_context"] == 1 and s["backwards_stateless"] == 1


def test_client_backward_by_context_and_stateless_agree(server):
    r = np.random.default_rng(7)
    q = r.standard_normal((2, 33, 4, 8), dtype=np.float32)
    k = r.standard_normal((2, 41, 2, 8), dtype=np.float32)
    v = r.standard_normal((2, 41, 2, 8), dtype=np.float32)
    dout = r.standard_normal(q.shape, dtype=np.float32)
    with Client(server.address) as c:
        out, meta = c.attend(q, k, v, mode="lsh", samples=8, causal=True, keep_context=True, return_lse=True,
                             chunk_bytes=1000)
        assert meta["context_id"].startswith("ctx-") and meta["context_bytes"] > 0
        dq, dk, dv, bmeta = c.backward(dout, context_id=meta["context_id"], chunk_bytes=1000)
        assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
        assert bmeta["context_id"] == meta["context_id"] and not bmeta["context_kept"]
        sq, sk, sv, smeta = c.backward(dout, q=q, k=k, v=v, out=out, lse=meta["lse"], mode="lsh", samples=8,
                                       causal=True)
        assert np.array_equal(dq, sq) and np.array_equal(dk, sk) and np.array_equal(dv, sv)
        assert smeta["sent_bytes"] == sq.nbytes + sk.nbytes + sv.nbytes
        # Gone: the code and why.
        with pytest.raises(PlshError) as e:
            c.backward(dout, context_id=meta["context_id"])
        assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION and "consumed" in e.value.details
        with pytest.raises(PlshError) as e:
            c.release_context(meta["context_id"])
        assert e.value.code == grpc.StatusCode.NOT_FOUND
        _, meta = c.attend(q, k, v, mode="exact", keep_context=True)
        assert c.release_context(meta["context_id"]) == meta["context_bytes"]
