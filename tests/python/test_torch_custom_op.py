"""plsh_client.torch's torch >= 2.4 path (torch.library.custom_op), run on
Debian's torch 1.13 against a stand-in for custom_op with the documented
contract: the decorated function runs eagerly, register_fake keeps the
fake, register_autograd(backward, setup_context=...) adds the gradient.
The stand-in builds that from an autograd.Function. So this checks plsh's
side of the op (options as a JSON string, the seed as a tensor, the
stateless backward from out and lse, the clients found by key), not torch's
own registration, which only a torch >= 2.4 machine runs."""

import importlib

import torch

import plsh_client.torch as pt
from plsh_client import Client


class _StandIn:
    def __init__(self, fn):
        self.fn, self.fake, self.backward, self.setup = fn, None, None, None

    def register_fake(self, fake):
        self.fake = fake
        return fake

    def register_autograd(self, backward, setup_context):
        self.backward, self.setup = backward, setup_context

    def __call__(self, *args):
        if self.backward is None:
            return self.fn(*args)
        op = self

        class Op(torch.autograd.Function):
            @staticmethod
            def forward(ctx, *inputs):
                output = op.fn(*inputs)
                op.setup(ctx, inputs, output)
                return output

            @staticmethod
            def backward(ctx, *grads):
                return op.backward(ctx, *grads)

        return Op.apply(*args)


def test_the_custom_op_path_computes_what_the_function_path_does(server, monkeypatch):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 80, 8, generator=g).requires_grad_() for _ in range(3))
    opts = dict(mode="lsh", samples=8, causal=True)
    monkeypatch.setattr(torch.library, "custom_op", lambda name, mutates_args: _StandIn, raising=False)
    try:
        importlib.reload(pt)
        assert pt._CUSTOM_OP
        pt.reset_stats()
        torch.manual_seed(4)
        out = pt.attention(q, k, v, target=server.address, **opts)
        seed = pt.last_summary().seed
        out.sum().backward()
        assert pt.stats()["backwards_stateless"] == 1  # custom ops pass tensors only: no kept context
        fake_out, fake_lse = pt._op.fake(*(t.transpose(1, 2) for t in (q, k, v)), torch.empty(0), "{}")
        assert fake_out.shape == (1, 80, 2, 8) and fake_lse.shape == (1, 80, 2)
    finally:
        monkeypatch.undo()
        importlib.reload(pt)
    assert not pt._CUSTOM_OP
    grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    torch.manual_seed(4)
    with Client(server.address) as c:  # the autograd.Function path, the same draws
        ref = pt.attention(q, k, v, client=c, **opts)
        assert pt.last_summary().seed == seed  # one draw from torch's generator either way
        ref.sum().backward()
    assert torch.equal(out, ref)
    for got, want in zip(grads, (q.grad, k.grad, v.grad)):
        assert torch.allclose(got, want, rtol=0, atol=1e-6 * want.abs().max().item())
