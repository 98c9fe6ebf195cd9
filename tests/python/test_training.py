"""Training draws through plsh_client.torch (SPEC section 8, issue 20):
a fresh 64-bit seed per lsh forward from torch's generator, so that
torch.manual_seed reproduces a run and every layer and step differs; an
explicit seed fixes the draws; evaluation without a gradient runs its own
mode; the seeds used can be read back and a step recomputed from them; the
ALiBiAttention module stands in for a model's attention."""

import pytest
import torch

import plsh_client.torch as pt
from plsh_client import Client

LSH = dict(mode="lsh", samples=8, causal=True)


def inputs(seed, shape=(1, 2, 96, 8)):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g).requires_grad_() for _ in range(3)]


@pytest.fixture
def client(server):
    with Client(server.address) as c:
        yield c


def seeds_of(calls):
    seeds = []
    for q, k, v, kw in calls:
        pt.attention(q, k, v, **kw)
        seeds.append(pt.last_summary().seed)
    return seeds


def test_every_forward_draws_a_fresh_seed_that_manual_seed_reproduces(client):
    q, k, v = inputs(0)
    torch.manual_seed(123)
    first = seeds_of([(q, k, v, dict(client=client, **LSH))] * 3)
    torch.manual_seed(123)
    again = seeds_of([(q, k, v, dict(client=client, **LSH))] * 3)
    assert first == again and len(set(first)) == 3  # before: seed 0 every call
    assert any(s >= 1 << 32 for s in first)  # 64-bit seeds, not 32
    # Exact draws nothing: torch's random stream is left as it was.
    torch.manual_seed(5)
    pt.attention(q, k, v, client=client, mode="exact")
    after_exact = torch.rand(1)
    torch.manual_seed(5)
    assert torch.equal(torch.rand(1), after_exact)


def test_an_explicit_seed_fixes_the_draws_and_a_step_can_be_recomputed(client):
    q, k, v = inputs(1)
    out = pt.attention(q, k, v, client=client, **LSH)
    seed = pt.last_summary().seed
    again = pt.attention(q, k, v, client=client, seed=seed, **LSH)
    assert torch.equal(out, again) and pt.last_summary().seed == seed
    other = pt.attention(q, k, v, client=client, **LSH)
    assert not torch.equal(out, other)
    # The backward differentiates the forward's own draws: the same step, the same gradients.
    out.sum().backward()
    grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    pt.attention(q, k, v, client=client, seed=seed, **LSH).sum().backward()
    assert all(torch.equal(a, t.grad) for a, t in zip(grads, (q, k, v)))


def test_evaluation_runs_its_own_mode(client):
    q, k, v = inputs(2)
    train = dict(client=client, eval_mode="exact", **LSH)
    pt.attention(q, k, v, **train)
    assert pt.last_summary().mode == "lsh"
    with torch.no_grad():
        evaluated = pt.attention(q, k, v, **train)
    assert pt.last_summary().mode == "exact" and pt.last_summary().estimated_rel_err == 0.0
    with torch.no_grad():
        exact = pt.attention(q, k, v, client=client, mode="exact", causal=True)
    assert torch.equal(evaluated, exact)
    with torch.no_grad():  # lsh for evaluation, with draws of its own
        pt.attention(q, k, v, client=client, eval_mode="window", **LSH)
    assert pt.last_summary().mode == "window"


def test_the_module_stands_in_for_attention_with_per_layer_options(client):
    slopes = [[0.5, 0.25], [0.125, 0.0625]]
    layers = [pt.ALiBiAttention(2, slopes=s, client=client, eval_mode="exact", **LSH) for s in slopes]
    seen = []
    layers[0]._on_result = seen.append
    q, k, v = inputs(3)
    torch.manual_seed(9)
    out = layers[1](layers[0](q, k, v), k, v)
    out.sum().backward()
    assert q.grad is not None and q.grad.shape == q.shape
    assert layers[0].last_result.seed != layers[1].last_result.seed  # every layer its own hashes
    assert seen and seen[-1] is layers[0].last_result
    # The recorded seed recomputes the layer's step (with its own slopes: the
    # standard ones for 2 heads are 1/16 and 1/256).
    torch.manual_seed(9)
    first = layers[0](q, k, v)
    replay = pt.attention(q, k, v, client=client, slopes=slopes[0], seed=layers[0].last_result.seed, **LSH)
    assert torch.equal(first, replay)
    with pytest.raises(ValueError, match="expected this module's 2"):
        layers[0](q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
    assert "heads=2" in repr(layers[0])
