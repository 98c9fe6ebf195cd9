"""ALiBi attention through plsh-server as a differentiable PyTorch op.

    import torch
    from plsh_client.torch import attention

    out = attention(q, k, v, mode="lsh", samples=16, causal=True, target="127.0.0.1:50051")
    out.sum().backward()      # q.grad, k.grad, v.grad computed by the server

q is [B, Nq, H, D], k and v [B, Nk, Hkv, D] (the layout of SPEC section 1:
one row per position, heads inside it). The forward runs on the server and
keeps its context there (keep_context); the backward sends only dout and
gets dq, dk, dv (AttendBackward by context_id), so q, k and v go up once per
training step. The server's backward is the exact gradient of the forward
it computed: for lsh, of the same draws (seed), not of ALiBi itself.

Precision: the wire carries float32, float16 and bfloat16 (SPEC section 1);
tensors of those dtypes go as they are. float64 tensors are sent as float32
and their gradients come back as float32 values in float64 tensors: the
service computes in float32 (with float32 accumulation), never float64. So
torch.autograd.gradcheck on float64 inputs checks the float32 function
f(round32(x)), and its default eps = 1e-6 is below float32's resolution;
tests/python/test_torch.py runs it with eps and tolerances derived from
float32 rounding and checks the gradients against a float64 autograd
reference as well (README: "Training").

Contexts are released when they cannot be used any more: a backward
consumes its own; a graph freed without a backward (evaluation with grad
enabled, an exception) releases its context when torch frees it; under
torch.no_grad() (or inputs that need no gradient) none is kept. A context
that is gone when the backward comes (expired, evicted, a server restart;
or a second backward of one graph, retain_graph=True) is replaced by a
stateless backward that sends q, k, v and dout and lets the server
recompute the forward (fallback=True, the default), counted in stats().
"""

import os
import threading
import weakref

import grpc
import numpy as np
import torch
from torch.autograd.function import once_differentiable

from ._client import Client, PlshError

__all__ = ["attention", "stats", "reset_stats"]

_lock = threading.Lock()
_clients = {}
_stats = {"forwards": 0, "backwards_by_context": 0, "backwards_stateless": 0, "contexts_released": 0,
          "bytes_up": 0, "bytes_down": 0}


def stats():
    """Counters of this process: forwards, backwards by context and
    stateless, contexts released unused, tensor bytes up and down."""
    with _lock:
        return dict(_stats)


def reset_stats():
    with _lock:
        for key in _stats:
            _stats[key] = 0


def _count(**deltas):
    with _lock:
        for key, value in deltas.items():
            _stats[key] += value


def _client_for(client, target):
    if client is not None:
        return client
    target = target or os.environ.get("PLSH_TARGET", "127.0.0.1:50051")
    with _lock:
        if target not in _clients:
            _clients[target] = Client(target)
        return _clients[target]


# torch dtype -> (numpy dtype sent, wire dtype)
_WIRE = {torch.float32: (np.float32, "f32"), torch.float64: (np.float32, "f32"), torch.float16: (np.float16, "f16"),
         torch.bfloat16: (np.float32, "bf16")}


def _numpy(t, np_dtype):
    return t.detach().to("cpu", torch.float32 if np_dtype == np.float32 else torch.float16).contiguous().numpy()


def _release(client, context_id, done):
    if done[0]:
        return
    done[0] = True
    try:
        client.release_context(context_id, timeout=5)
        _count(contexts_released=1)
    except Exception:  # the server may be gone (interpreter exit); the TTL cleans up
        pass


class _Kept:
    """A context on the server: released when torch frees the graph that
    holds it, unless a backward has used it."""

    def __init__(self, client, context_id):
        self.client = client
        self.context_id = context_id
        self.done = [False]
        weakref.finalize(self, _release, client, context_id, self.done)


class _Call:
    def __init__(self, client, options, keep, fallback, deadline):
        self.client = client
        self.options = options
        self.keep = keep
        self.fallback = fallback
        self.deadline = deadline


class _Attention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, call):
        np_dtype, wire = _WIRE[q.dtype]
        out, meta = call.client.attend(_numpy(q, np_dtype), _numpy(k, np_dtype), _numpy(v, np_dtype),
                                       wire_dtype=wire, keep_context=call.keep, deadline=call.deadline,
                                       **call.options)
        _count(forwards=1, bytes_up=meta["received_bytes"], bytes_down=meta["sent_bytes"])
        ctx.call = call
        ctx.wire = (np_dtype, wire)
        ctx.kept = _Kept(call.client, meta["context_id"]) if call.keep and meta["context_id"] else None
        ctx.save_for_backward(q, k, v)
        return torch.from_numpy(np.ascontiguousarray(out)).to(q.dtype)

    @staticmethod
    @once_differentiable
    def backward(ctx, dout):
        q, k, v = ctx.saved_tensors
        call, (np_dtype, wire) = ctx.call, ctx.wire
        d = _numpy(dout, np_dtype)
        grads = None
        kept = ctx.kept
        if kept is not None and not kept.done[0]:
            kept.done[0] = True  # consumed by this backward, or gone: never released again
            try:
                grads = call.client.backward(d, context_id=kept.context_id, kv_shape=tuple(k.shape), out_dtype=wire,
                                             deadline=call.deadline)
                _count(backwards_by_context=1)
            except PlshError as e:
                if e.code != grpc.StatusCode.FAILED_PRECONDITION or not call.fallback:
                    raise
        if grads is None:
            if kept is not None and not call.fallback:
                raise PlshError(grpc.StatusCode.FAILED_PRECONDITION,
                                "the forward's context was used by an earlier backward (retain_graph) and fallback=False")
            options = {key: value for key, value in call.options.items() if key not in ("estimates",)}
            grads = call.client.backward(d, q=_numpy(q, np_dtype), k=_numpy(k, np_dtype), v=_numpy(v, np_dtype),
                                         recompute_forward=True, wire_dtype=wire, out_dtype=wire,
                                         deadline=call.deadline, **options)
            _count(backwards_stateless=1)
        dq, dk, dv, meta = grads
        _count(bytes_up=meta["received_bytes"], bytes_down=meta["sent_bytes"])
        as_torch = [torch.from_numpy(np.ascontiguousarray(g)).to(t.dtype) for g, t in ((dq, q), (dk, k), (dv, v))]
        return as_torch[0], as_torch[1], as_torch[2], None


def attention(q, k, v, *, mode="lsh", samples=None, seed=0, causal=False, slopes=None, scale=None, q_pos0=None,
              k_pos0=0, lsh_algorithm="auto", window_eps=None, window_width=0, estimates=False, backend=None,
              client=None, target=None, keep_context=True, fallback=True, deadline=None, sampling=None):
    """ALiBi attention of q [B, Nq, H, D], k and v [B, Nk, Hkv, D] on a
    plsh-server, differentiable in q, k and v. mode: "lsh", "exact",
    "window", or "fixed_blocks" (the paper's biased baseline, SPEC section
    4: blocks of 2 sigma_h from position 0; samples and seed unused); all
    slopes 0 is no positional bias. Options are Client.attend's
    (samples None: the server's default, 16); estimates default off (a
    training step does not read them). client: a plsh_client.Client, else
    one per target (default $PLSH_TARGET or 127.0.0.1:50051). keep_context:
    keep the forward's context for the backward when a gradient is wanted;
    fallback: a stateless backward when the context is gone."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(f"{name} must be a 4-D torch.Tensor [B, N, H, D], got {type(t).__name__} "
                             f"{tuple(t.shape) if isinstance(t, torch.Tensor) else ''}")
        if t.dtype not in _WIRE:
            raise ValueError(f"{name} dtype {t.dtype}, expected float32, float64, float16 or bfloat16")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v dtypes {q.dtype}, {k.dtype}, {v.dtype}: expected one dtype")
    c = _client_for(client, target)
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    options = {"mode": mode, "samples": samples, "seed": seed, "causal": causal, "slopes": slopes, "scale": scale,
               "q_pos0": q_pos0, "k_pos0": k_pos0, "lsh_algorithm": lsh_algorithm, "window_eps": window_eps,
               "window_width": window_width, "estimates": estimates, "backend": backend, "sampling": sampling}
    return _Attention.apply(q, k, v, _Call(c, options, keep_context and needs_grad, fallback, deadline))
