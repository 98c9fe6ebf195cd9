"""The experiments' two baselines (SPEC section 4) from every client against
the real plsh-server: fixed blocks (the paper's --fixed_block_size: blocks
of width 2 sigma_h from position 0, biased, labelled "fixed_blocks") and no
positional bias (every slope 0). The reference is float64 torch autograd
of attention with the mask written from the definition,
floor(p / (2 sigma_h)), not from any draw the server reports."""

import json
import math
import os
import subprocess

import numpy as np
import pytest
import torch

import plsh_client.torch as pt
from plsh_client import Client

SLOPES = [0.9, 1 / 16, 1 / 300, 0.0]  # widths 2.2, 32, 600 and one block


def reference(q, k, v, *, slopes, fixed_blocks, causal=True):
    """Attention in float64 with log weights -slope |d| (no bias where the
    slope is 0), or for fixed blocks log 1[same block of width 2 / slope]."""
    B, Nq, H, D = q.shape
    Nk, Hkv = k.shape[1], k.shape[2]
    pos_q = torch.arange(Nq, dtype=torch.float64) + (Nk - Nq)
    pos_k = torch.arange(Nk, dtype=torch.float64)
    outs = []
    for h in range(H):
        kh, vh = k[:, :, h // (H // Hkv)], v[:, :, h // (H // Hkv)]
        scores = torch.einsum("bid,bjd->bij", q[:, :, h], kh) / math.sqrt(D)
        if fixed_blocks and slopes[h] > 0:
            width = 2.0 * (1.0 / slopes[h])
            same = torch.floor(pos_q / width)[:, None] == torch.floor(pos_k / width)[None, :]
            log_w = torch.zeros(Nq, Nk, dtype=torch.float64).masked_fill(~same, -math.inf)
        else:
            log_w = -slopes[h] * (pos_q[:, None] - pos_k[None, :]).abs()
        if causal:
            log_w = log_w.masked_fill(pos_k[None, :] > pos_q[:, None], -math.inf)
        outs.append(torch.einsum("bij,bjd->bid", torch.softmax(scores + log_w, dim=-1), vh))
    return torch.stack(outs, dim=2)


def max_rel(a, b):
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    return ((a - b).abs().max() / b.abs().max()).item()


def leaves(seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g, dtype=torch.float64).float().requires_grad_()
            for s in ((2, 70, 4, 16), (2, 90, 2, 16), (2, 90, 2, 16))]


def test_python_client_fixed_blocks_is_the_deterministic_mask_and_says_so(server):
    q, k, v = (t.detach().numpy() for t in leaves(1))
    with Client(server.address) as c:
        out, meta = c.attend(q, k, v, mode="fixed_blocks", causal=True, slopes=SLOPES, samples=64, seed=9,
                             return_draws=True)
        again, meta2 = c.attend(q, k, v, mode="fixed_blocks", causal=True, slopes=SLOPES, seed=10)
    assert meta["mode"] == "fixed_blocks" and meta["samples"] == 1
    for h, head in enumerate(meta["heads"]):
        assert head["draws"] == [[2 * head["sigma"], 0.0]], h
    assert meta["heads"][1]["mask_max_err"] > 0.1  # its bias, measured against L*
    np.testing.assert_array_equal(out, again)  # the seed plays no part
    ref = reference(*(torch.from_numpy(a).double() for a in (q, k, v)), slopes=SLOPES, fixed_blocks=True)
    assert max_rel(out, ref) <= 1e-5


@pytest.mark.parametrize("mode, slopes", [("fixed_blocks", SLOPES), ("exact", [0.0] * 4), ("lsh", [0.0] * 4)],
                         ids=["fixed_blocks", "exact_no_bias", "lsh_no_bias"])
def test_torch_op_trains_on_the_baselines(server, mode, slopes):
    q, k, v = leaves(2)
    with Client(server.address) as c:
        out = pt.attention(q, k, v, client=c, mode=mode, causal=True, slopes=slopes, seed=3, layout="bnhd")
        dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(4))
        out.backward(dout)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = reference(q64, k64, v64, slopes=slopes, fixed_blocks=mode == "fixed_blocks")
    ref.backward(dout.double())
    assert max_rel(out.detach(), ref.detach()) <= 1e-5
    for name, got, want in (("dq", q.grad, q64.grad), ("dk", k.grad, k64.grad), ("dv", v.grad, v64.grad)):
        assert max_rel(got, want) <= 1e-5, name


def test_cli_attend_runs_fixed_blocks_and_labels_it(server, tmp_path):
    r = np.random.default_rng(5)
    for name, shape in (("q", (1, 60, 4, 16)), ("k", (1, 60, 4, 16)), ("v", (1, 60, 4, 16))):
        np.save(tmp_path / f"{name}.npy", r.standard_normal(shape).astype(np.float32))
    run = subprocess.run([os.environ["PLSH_CLI"], "attend", "--target", server.address, "--mode", "fixed_blocks",
                          "--causal", "--slopes", ",".join(map(str, SLOPES)), "--q", str(tmp_path / "q.npy"),
                          "--k", str(tmp_path / "k.npy"), "--v", str(tmp_path / "v.npy"),
                          "--out", str(tmp_path / "o.npy"), "--meta", str(tmp_path / "m.json")],
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    meta = json.loads((tmp_path / "m.json").read_text())
    assert meta["mode"] == "fixed_blocks" and meta["samples"] == 1
    q, k, v = (torch.from_numpy(np.load(tmp_path / f"{n}.npy")).double() for n in "qkv")
    assert max_rel(np.load(tmp_path / "o.npy"), reference(q, k, v, slopes=SLOPES, fixed_blocks=True)) <= 1e-5


def test_torch_op_passes_the_sampler_to_forward_and_recomputed_backward(server):
    """sampling reaches the forward, and a stateless backward (which
    recomputes the forward) draws what the forward drew: its gradients
    equal the kept context's."""
    opts = dict(mode="lsh", samples=16, seed=11, causal=True, slopes=SLOPES, sampling="ash")
    grads = {}
    with Client(server.address) as c:
        q0, k0, v0 = (t.detach().numpy() for t in leaves(3))
        want, _ = c.attend(q0, k0, v0, **opts)
        iid, _ = c.attend(q0, k0, v0, **{**opts, "sampling": "iid"})
        for keep in (True, False):
            q, k, v = leaves(3)
            out = pt.attention(q, k, v, client=c, keep_context=keep, layout="bnhd", **opts)
            np.testing.assert_array_equal(out.detach().numpy(), want)
            out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(6)))
            grads[keep] = (q.grad, k.grad, v.grad)
    assert np.abs(want - iid).max() > 1e-3  # the sampler changed the draws
    for by_context, stateless in zip(grads[True], grads[False]):
        assert max_rel(stateless, by_context) <= 1e-6
