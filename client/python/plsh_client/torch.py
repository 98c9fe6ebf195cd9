"""ALiBi attention through plsh-server as a differentiable PyTorch op.

    import torch
    from plsh_client.torch import attention, ALiBiAttention

    out = attention(q, k, v, causal=True)                 # exact ALiBi; q [B, H, Nq, D] as for SDPA
    out = attention(q, k, v, causal=True, mode="lsh", samples=16, eval_mode="exact")
    out.sum().backward()                                   # q.grad, k.grad, v.grad computed by the server

The op mirrors torch.nn.functional.scaled_dot_product_attention, plus ALiBi:
  - layout "bhnd" by default, SDPA's: q [B, H, Nq, D], k and v [B, Hkv, Nk, D]
    (3-D: no batch axis); layout="bnhd" takes plsh's and FlashAttention's
    [B, N, H, D]. Shapes that look transposed are refused, naming the tensor
    (plsh_client._layout; check_layout=False accepts them as given). out has
    q's layout, dtype and device.
  - mode "exact" by default: the result is exact ALiBi attention (SPEC section
    2), what a caller of an SDPA-like op expects. "lsh" (positional LSH,
    SPEC section 3; the paper's training mode) and "window" are one argument
    away, and every result says which mode ran and its estimated error
    (last_summary().mode, .estimated_rel_err).
  - causal=False by default, as SDPA's is_causal; scale None is 1/sqrt(D);
    slopes None are the standard ALiBi slopes for H heads.

Training draws (SPEC section 8). With mode "lsh" and seed=None (the
default) every forward draws a fresh 64-bit seed from torch's generator
(`generator`, else torch's default CPU generator), so torch.manual_seed
reproduces a whole run and every layer and step trains against its own
hashes (the model learns E[M~] = L*, not one fixed mask); the backward uses
its forward's draws. An explicit seed fixes the draws. Exact and window draw
nothing (torch's RNG stream is left alone). eval_mode ("exact", "window" or
"lsh"; None: mode) is what runs when no gradient is wanted (torch.no_grad(),
or inputs that need none): evaluation with exact ALiBi, a window, or lsh
with its own fresh draws. The seeds used can be read back: last_summary()
(this thread's last forward), on_result= (called with every forward's
AttendResult, out and lse left out), ALiBiAttention.last_result; pass the
seed back (seed=) to recompute a step.

Estimates (SPEC section 6): estimates=None computes them when no gradient is
wanted and skips them in a training step (they cost a probe per head);
estimated_rel_err is None when they were not computed. return_lse=True
returns (out, lse), lse [B, H, Nq] in bhnd ([B, Nq, H] in bnhd), float32,
without a gradient.

Where the op runs: a CUDA tensor's inputs are copied to the host and the
results back to its device (stats()["device_copy_bytes"] counts them).
Under torch.autocast the inputs are cast to the autocast dtype first, as
SDPA's are (bfloat16 and float16 go on the wire as they are). float64 goes
as float32 and comes back in float64 tensors: the service computes in
float32, so gradcheck needs float32-sized eps (tests/python/test_torch.py).

The forward keeps its context on the server when a gradient is wanted
(keep_context); the backward sends only dout. A graph freed without a
backward releases its context; one whose context is gone (expired, a
second backward of one graph) falls back to a stateless backward that sends
q, k, v and dout (fallback=True), counted in stats(). Double backward
(create_graph=True), functorch's vmap and torch.jit.trace are refused with
an error that says why. On torch >= 2.4 the op is the torch.library custom
op plsh::attention (fake tensors and autograd registered, so torch.compile
graphs can hold it); its backward is stateless (custom ops pass only tensors
between forward and backward), sending q, k, v, out, lse and dout.

client: a plsh_client.Client; else one per (target, token), kept open:
target None is $PLSH_TARGET, else 127.0.0.1:50051, token (or token_file)
None is $PLSH_TOKEN.
"""

import dataclasses
import hashlib
import json
import threading
import weakref
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import grpc
import numpy as np
import torch

from . import _layout
from ._client import Client, PathOrBytes
from ._results import AttendResult
from ._rpc import PlshError
from ._wire import Options

__all__ = ["ALiBiAttention", "attention", "last_summary", "reset_stats", "stats"]

_lock = threading.Lock()
_clients: Dict[Tuple[str, str], Client] = {}
_STAT_KEYS = ("forwards", "backwards_by_context", "backwards_stateless", "contexts_released", "bytes_up",
              "bytes_down", "device_copies", "device_copy_bytes", "fresh_seeds")
_stats = {key: 0 for key in _STAT_KEYS}
_last = threading.local()
OnResult = Callable[[AttendResult], None]


def stats() -> Dict[str, int]:
    """Counters of this process: forwards, backwards by context and
    stateless, contexts released unused, tensor bytes up and down, copies
    between a device and the host (and their bytes), fresh seeds drawn."""
    with _lock:
        return dict(_stats)


def reset_stats() -> None:
    with _lock:
        for key in _stats:
            _stats[key] = 0


def last_summary() -> Optional[AttendResult]:
    """This thread's last forward through the op: mode, seed, samples,
    estimates (estimated_rel_err), timings; out and lse left out."""
    return getattr(_last, "result", None)


def _count(**deltas: int) -> None:
    with _lock:
        for key, value in deltas.items():
            _stats[key] += value


def _client_for(client: Optional[Client], target: Optional[str], token: Optional[str],
                token_file: Optional[PathOrBytes]) -> Client:
    """The given client, else one channel per (target, token), kept open for the process."""
    if client is not None:
        return client
    made = Client(target, token=token, token_file=token_file)  # resolves $PLSH_TARGET, $PLSH_TOKEN
    key = (made.target, hashlib.sha256(repr(made._metadata).encode()).hexdigest())
    with _lock:
        kept = _clients.setdefault(key, made)
    if kept is not made:
        made.close()
    return kept


# torch dtype -> the wire dtype it goes as
_WIRE = {torch.float32: "f32", torch.float64: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}


def _host_array(t: torch.Tensor, wire: str) -> np.ndarray:
    """A tensor as the numpy array its wire dtype sends (bfloat16: its bit patterns), on the host."""
    t = t.detach()
    if t.device.type != "cpu":
        _count(device_copies=1, device_copy_bytes=t.numel() * t.element_size())
        t = t.to("cpu")
    if wire == "bf16":
        return t.contiguous().view(torch.int16).numpy().view(np.uint16)
    return t.to(torch.float32 if wire == "f32" else torch.float16).contiguous().numpy()


def _tensor(a: np.ndarray, like: torch.Tensor) -> torch.Tensor:
    """A result array as a tensor of like's dtype on like's device."""
    if a.dtype == np.uint16:  # bfloat16 bit patterns
        t = torch.from_numpy(np.ascontiguousarray(a).view(np.int16)).view(torch.bfloat16)
    else:
        t = torch.from_numpy(np.ascontiguousarray(a))
    t = t.to(like.dtype)
    if like.device.type != "cpu":
        _count(device_copies=1, device_copy_bytes=t.numel() * t.element_size())
        t = t.to(like.device)
    return t


def _release(client: Client, context_id: str, done: List[bool]) -> None:
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

    def __init__(self, client: Client, context_id: str) -> None:
        self.client = client
        self.context_id = context_id
        self.done = [False]
        weakref.finalize(self, _release, client, context_id, self.done)


class _Call:
    """One forward's settings: the client, the resolved options (the seed
    drawn), what to keep, and where the result's account goes."""

    def __init__(self, client: Client, options: Options, keep: bool, fallback: bool, deadline: Optional[float],
                 return_lse: bool, on_result: Optional[OnResult], rpc: str) -> None:
        self.client, self.options, self.keep, self.fallback = client, options, keep, fallback
        self.deadline, self.return_lse, self.on_result, self.rpc = deadline, return_lse, on_result, rpc

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, str]:
        """out and lse (empty without return_lse) of bnhd tensors, and the kept context's id ("" when none)."""
        wire = _WIRE[q.dtype]
        r = self.client.attend(_host_array(q, wire), _host_array(k, wire), _host_array(v, wire), wire_dtype=wire,
                               keep_context=self.keep, deadline=self.deadline, return_lse=self.return_lse,
                               check_layout=False, options=self.options, bf16_bits=True, rpc=self.rpc)
        _count(forwards=1, bytes_up=r.received_bytes, bytes_down=r.sent_bytes)
        out = _tensor(r.out, q)
        lse = _tensor(r.lse, torch.empty(0, dtype=torch.float32, device=q.device)) if r.lse is not None else \
            torch.empty(0, dtype=torch.float32, device=q.device)
        r.out, r.lse = None, None
        _last.result = r
        if self.on_result is not None:
            self.on_result(r)
        return out, lse, r.context_id

    def backward(self, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 kept: Optional[_Kept], out: Optional[torch.Tensor] = None,
                 lse: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """dq, dk, dv: by the kept context, else statelessly (with out and lse, or recomputing the forward)."""
        wire = _WIRE[q.dtype]
        d = _host_array(dout, wire)
        grads = None
        if kept is not None and not kept.done[0]:
            kept.done[0] = True  # consumed by this backward, or gone: never released again
            try:
                grads = self.client.backward(d, context_id=kept.context_id, kv_shape=tuple(k.shape), out_dtype=wire,
                                             deadline=self.deadline, bf16_bits=True)
                _count(backwards_by_context=1)
            except PlshError as e:
                if e.code != grpc.StatusCode.FAILED_PRECONDITION or not self.fallback:
                    raise
        if grads is None:
            if kept is not None and not self.fallback:
                raise PlshError(grpc.StatusCode.FAILED_PRECONDITION, "the forward's context was used by an earlier "
                                "backward (retain_graph) and fallback=False")
            o = dataclasses.replace(self.options, estimates=None, probe_rows=None, mask_row_budget=None,
                                    return_draws=False, target_rel_err=None)
            stateless: Dict[str, Any] = {"recompute_forward": True}
            if out is not None and lse is not None and lse.numel():
                stateless = {"out": _host_array(out, wire), "lse": lse.detach().cpu().numpy()}
            grads = self.client.backward(d, q=_host_array(q, wire), k=_host_array(k, wire), v=_host_array(v, wire),
                                         options=o, wire_dtype=wire, out_dtype=wire, deadline=self.deadline,
                                         bf16_bits=True, **stateless)
            _count(backwards_stateless=1)
        _count(bytes_up=grads.received_bytes, bytes_down=grads.sent_bytes)
        return _tensor(grads.dq, q), _tensor(grads.dk, k), _tensor(grads.dv, v)


_DOUBLE_BACKWARD = ("plsh_client.torch.attention: double backward (create_graph=True, or a gradient of the "
                    "gradient) is not supported: the server computes dq, dk, dv as numbers, with no autograd graph "
                    "of them to differentiate again")


class _Attention(torch.autograd.Function):
    """torch < 2.4: the op as an autograd.Function over bnhd 4-D tensors."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,  # type: ignore[override]
                call: _Call) -> Tuple[torch.Tensor, torch.Tensor]:
        out, lse, context_id = call.forward(q, k, v)
        ctx.call = call
        ctx.kept = _Kept(call.client, context_id) if call.keep and context_id else None
        ctx.save_for_backward(q, k, v)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor, _dlse: Any) -> Tuple[Any, ...]:  # type: ignore[override]
        if torch.is_grad_enabled():
            raise RuntimeError(_DOUBLE_BACKWARD)
        q, k, v = ctx.saved_tensors
        dq, dk, dv = ctx.call.backward(dout, q, k, v, ctx.kept)
        return dq, dk, dv, None


# torch >= 2.4: a torch.library custom op. Options travel as a JSON string
# (a constant of a compiled graph) and the seed as a tensor (an input), so
# that a fresh seed per step does not recompile; the client by a key into
# _clients, so that a token never enters a graph.
_library: Any = getattr(torch, "library", None)
_CUSTOM_OP = hasattr(_library, "custom_op")


def _op_call(options_json: str, seed: torch.Tensor) -> _Call:
    spec = json.loads(options_json)
    client = _clients[(spec.pop("target"), spec.pop("token_key"))]
    o = Options(**spec.pop("options"))
    o.seed = int(seed[0]) << 32 | int(seed[1]) if seed.numel() else o.seed
    return _Call(client, o, keep=False, fallback=True, deadline=spec["deadline"], return_lse=True,
                 on_result=None, rpc=spec["rpc"])


if _CUSTOM_OP:  # pragma: no cover - Debian's torch is 1.13; bench/gpu/run.sh's 2.x runs it
    @_library.custom_op("plsh::attention", mutates_args=())
    def _op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seed: torch.Tensor,
            options_json: str) -> Tuple[torch.Tensor, torch.Tensor]:
        out, lse, _ = _op_call(options_json, seed).forward(q, k, v)
        return out, lse

    @_op.register_fake
    def _op_fake(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seed: torch.Tensor,
                 options_json: str) -> Tuple[torch.Tensor, torch.Tensor]:
        return q.new_empty(q.shape), q.new_empty(q.shape[:3], dtype=torch.float32)

    @_library.custom_op("plsh::attention_backward", mutates_args=())
    def _op_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                     lse: torch.Tensor, seed: torch.Tensor,
                     options_json: str) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return _op_call(options_json, seed).backward(dout, q, k, v, None, out, lse)

    @_op_backward.register_fake
    def _op_backward_fake(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                          lse: torch.Tensor, seed: torch.Tensor,
                          options_json: str) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)

    def _setup_context(ctx: Any, inputs: Tuple[Any, ...], output: Tuple[torch.Tensor, torch.Tensor]) -> None:
        q, k, v, seed, options_json = inputs
        ctx.save_for_backward(q, k, v, output[0], output[1], seed)
        ctx.options_json = options_json

    def _backward(ctx: Any, dout: torch.Tensor, _dlse: Any) -> Tuple[Any, ...]:
        if torch.is_grad_enabled():
            raise RuntimeError(_DOUBLE_BACKWARD)
        q, k, v, out, lse, seed = ctx.saved_tensors
        dq, dk, dv = _op_backward(dout, q, k, v, out, lse, seed, ctx.options_json)
        return dq, dk, dv, None, None

    _op.register_autograd(_backward, setup_context=_setup_context)


def _fresh_seed(generator: Optional[torch.Generator]) -> Tuple[int, torch.Tensor]:
    """A 64-bit seed from torch's generator, and the same as two 32-bit halves in a tensor."""
    halves = torch.randint(0, 1 << 32, (2,), generator=generator, dtype=torch.int64)
    _count(fresh_seeds=1)
    return int(halves[0]) << 32 | int(halves[1]), halves


def _autocast(t: torch.Tensor) -> Optional[torch.dtype]:
    """The autocast dtype in force for t's device type, or None."""
    device = t.device.type
    api: Any = torch  # the two torch versions' signatures differ
    try:  # torch >= 2.4
        if api.is_autocast_enabled(device):
            dtype: torch.dtype = api.get_autocast_dtype(device)
            return dtype
        return None
    except TypeError:  # torch 1.13: no device argument
        if device == "cuda" and torch.is_autocast_enabled():
            return torch.get_autocast_gpu_dtype()
        if device == "cpu" and torch.is_autocast_cpu_enabled():
            return torch.get_autocast_cpu_dtype()
        return None


def _refuse_transforms(tensors: Sequence[torch.Tensor]) -> None:
    functorch = getattr(torch._C, "_functorch", None)
    if functorch is not None and any(functorch.is_batchedtensor(t) for t in tensors):
        raise RuntimeError("plsh_client.torch.attention under vmap is not supported: the op sends whole tensors to "
                           "a server, which has no batching rule; loop over the batch, or put it in the batch axis")
    if torch.jit.is_tracing():
        raise RuntimeError("plsh_client.torch.attention cannot be traced by torch.jit.trace: it calls a server, "
                           "which a TorchScript graph cannot hold (torch >= 2.4: torch.compile can, as the custom op "
                           "plsh::attention)")


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
              scale: Optional[float] = None, slopes: Optional[Sequence[float]] = None, mode: str = "exact",
              samples: Optional[int] = None, seed: Optional[int] = None, sampling: Optional[str] = None,
              eval_mode: Optional[str] = None, window_eps: Optional[float] = None, window_width: int = 0,
              q_pos0: Optional[int] = None, k_pos0: int = 0, lsh_algorithm: str = "auto",
              estimates: Optional[bool] = None, backend: Optional[str] = None, layout: str = "bhnd",
              check_layout: bool = True, return_lse: bool = False, generator: Optional[torch.Generator] = None,
              client: Optional[Client] = None, target: Optional[str] = None, token: Optional[str] = None,
              token_file: Optional[PathOrBytes] = None, keep_context: bool = True, fallback: bool = True,
              deadline: Optional[float] = None, on_result: Optional[OnResult] = None,
              rpc: str = "auto", extra: Optional[Dict[str, Any]] = None
              ) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
    """ALiBi attention of q, k, v on a plsh-server, differentiable in q, k
    and v (the module docstring says the defaults and why: layout "bhnd",
    mode "exact", fresh lsh seeds per forward, eval_mode, estimates).

    Options are Client.attend's: samples (None: the server's, 16), sampling
    ("iid", "stratified", "ash"), window_eps/window_width, q_pos0/k_pos0
    (absolute positions), lsh_algorithm, backend; extra: AttendHeader fields
    by name for options newer than these. Returns out, or (out, lse) with
    return_lse."""
    _layout.check_layout(layout)
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} is a {type(t).__name__}, expected a torch.Tensor")
    _refuse_transforms((q, k, v))
    _layout.resolve_shapes(tuple(q.shape), tuple(k.shape), tuple(v.shape), layout, slopes=slopes, check=check_layout)
    cast = _autocast(q)
    if cast is not None:
        q, k, v = q.to(cast), k.to(cast), v.to(cast)
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dtype not in _WIRE:
            raise ValueError(f"{name}: dtype {t.dtype}, expected float32, float64, float16 or bfloat16")
    for name, t in (("k", k), ("v", v)):
        if t.dtype != q.dtype:
            raise ValueError(f"{name}: dtype {t.dtype}, expected q's dtype {q.dtype} (one dtype for q, k and v)")
        if t.device != q.device:
            raise ValueError(f"{name}: device {t.device}, expected q's device {q.device}")
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    run_mode = mode if needs_grad or eval_mode is None else eval_mode
    options = Options(mode=run_mode, samples=samples, seed=seed, sampling=sampling, causal=causal, scale=scale,
                      slopes=slopes, q_pos0=q_pos0, k_pos0=k_pos0, lsh_algorithm=lsh_algorithm,
                      window_eps=window_eps, window_width=window_width, backend=backend,
                      estimates=(not needs_grad) if estimates is None else estimates, extra=dict(extra or {}))
    options.check()
    halves = torch.empty(0, dtype=torch.int64)
    if run_mode == "lsh" and seed is None:
        options.seed, halves = _fresh_seed(generator)
    c = _client_for(client, target, token, token_file)

    # To bnhd 4-D (differentiable views: autograd carries the gradients back).
    batched = q.dim() == 4
    q4, k4, v4 = (t if batched else t.unsqueeze(0) for t in (q, k, v))
    if layout == "bhnd":
        q4, k4, v4 = (t.transpose(1, 2) for t in (q4, k4, v4))
    if _CUSTOM_OP:  # pragma: no cover - torch >= 2.4
        key = next(key for key, kept in _clients.items() if kept is c) if client is None else _register(c)
        spec = {"target": key[0], "token_key": key[1], "deadline": deadline, "rpc": rpc,
                "options": {**vars(options), "seed": options.seed if halves.numel() == 0 else None}}
        out, lse = _op(q4, k4, v4, halves, json.dumps(spec))
        lse = lse.detach()  # lse carries no gradient (the backward is out's)
        _last_hook(on_result)
    else:
        call = _Call(c, options, keep_context and needs_grad, fallback, deadline, return_lse, on_result, rpc)
        out, lse = _Attention.apply(q4, k4, v4, call)
    if layout == "bhnd":
        out, lse = out.transpose(1, 2), (lse.transpose(1, 2) if lse.numel() else lse)
    if not batched:
        out, lse = out[0], (lse[0] if lse.numel() else lse)
    return (out, lse) if return_lse else out


def _register(c: Client) -> Tuple[str, str]:  # pragma: no cover - torch >= 2.4
    """A caller's own client in _clients, for the custom op to find by key."""
    key = (c.target, f"client-{id(c)}")
    with _lock:
        _clients[key] = c
    return key


def _last_hook(on_result: Optional[OnResult]) -> None:  # pragma: no cover - torch >= 2.4
    result = last_summary()
    if on_result is not None and result is not None:
        on_result(result)


class ALiBiAttention(torch.nn.Module):
    """plsh_client.torch.attention as a module, for a model's attention:
    forward(q, k, v) -> out in `layout` (default bhnd, SDPA's), in place of
    scaled_dot_product_attention(q, k, v, is_causal=...). One per layer, with
    its own slopes and options; heads, when given, is checked against q.
    Training draws a fresh seed per forward (seed=None; the module docstring
    of plsh_client.torch says how), evaluation runs eval_mode.
    last_result: the last forward's AttendResult (mode, seed, estimates; no
    tensors), so that a step can be recomputed with seed=last_result.seed."""

    def __init__(self, heads: Optional[int] = None, *, slopes: Optional[Sequence[float]] = None,
                 causal: bool = False, mode: str = "exact", eval_mode: Optional[str] = None,
                 samples: Optional[int] = None, seed: Optional[int] = None, layout: str = "bhnd",
                 client: Optional[Client] = None, target: Optional[str] = None,
                 generator: Optional[torch.Generator] = None, on_result: Optional[OnResult] = None,
                 **options: Any) -> None:
        super().__init__()
        _layout.check_layout(layout)
        if heads is not None and slopes is not None and len(slopes) != heads:
            raise ValueError(f"slopes: {len(slopes)} values, expected one per head ({heads})")
        self.heads, self.layout = heads, layout
        self.slopes = list(slopes) if slopes is not None else None
        self.options = dict(causal=causal, mode=mode, eval_mode=eval_mode, samples=samples, seed=seed,
                            client=client, target=target, generator=generator, **options)
        self.last_result: Optional[AttendResult] = None
        self._on_result = on_result

    def _record(self, result: AttendResult) -> None:
        self.last_result = result
        if self._on_result is not None:
            self._on_result(result)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Any:
        if self.heads is not None:
            axis = (1 if self.layout == "bhnd" else 2) if q.dim() == 4 else (0 if self.layout == "bhnd" else 1)
            if q.shape[axis] != self.heads:
                raise ValueError(f"q: shape {tuple(q.shape)} has {q.shape[axis]} heads on axis {axis} "
                                 f"({self.layout}), expected this module's {self.heads}")
        return attention(q, k, v, slopes=self.slopes, layout=self.layout, on_result=self._record, **self.options)

    def extra_repr(self) -> str:
        shown = {k: v for k, v in self.options.items() if v is not None and k not in ("client", "generator")}
        return f"heads={self.heads}, layout={self.layout!r}, " + ", ".join(f"{k}={v!r}" for k, v in shown.items())
