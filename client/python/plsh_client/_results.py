"""What Client.attend and Client.backward return: dataclasses read from the
server's Summary and BackwardSummary (proto/plsh/v1/plsh.proto documents
every field; the names here are the proto's, less "_seconds").

For code written against the tuples of the client before the package
(no version of its own), an AttendResult unpacks as (out, meta) and a
BackwardResult as (dq, dk, dv, meta), meta being the nested dict that
client returned (result.meta)."""

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, List, Optional, Tuple

import numpy as np

from ._wire import ALGORITHM_NAMES, MODE_NAMES, SAMPLING_NAMES


@dataclass
class Probe:
    """SPEC section 6's probe: `rows` query rows per head computed exactly."""
    rows: int = 0
    rel_err: float = 0.0          # ||o~ - o*|| / ||o*|| over those rows
    rel_err_stderr: float = 0.0
    max_abs_err: float = 0.0
    bound_max: float = 0.0        # the rigorous per-row bound, max over rows
    rel_err_upper: float = 0.0    # upper confidence bound on the whole output's relative error


@dataclass
class Estimates:
    """The request's estimates: max of the heads' mask errors, probe pooled over heads."""
    mask_max_err: float = 0.0
    mask_spectral_err: float = 0.0
    probe: Probe = field(default_factory=Probe)


@dataclass
class HeadEstimate:
    head: int = 0
    slope: float = 0.0
    sigma: float = 0.0
    window: int = 0               # window mode: W_h
    max_block: int = 0            # lsh: largest block within the request's positions
    mask_max_err: float = 0.0
    mask_rows_checked: int = 0
    mask_rows_sampled: bool = False
    mask_spectral_err: float = 0.0
    spectral_iterations: int = 0
    probe: Probe = field(default_factory=Probe)
    draws: Optional[List[Tuple[float, float]]] = None  # (pitch, shift) per sample, with return_draws


@dataclass
class Timings:
    """Seconds of each phase as the server saw it; backend: the backend's own breakdown."""
    queued: float = 0.0
    receiving: float = 0.0
    computing: float = 0.0
    sending: float = 0.0
    total: float = 0.0
    backend: Dict[str, float] = field(default_factory=dict)


@dataclass
class TargetAttempt:
    mode: str = ""
    samples: Optional[int] = None        # lsh
    window_scale: Optional[float] = None  # window
    window_max: Optional[int] = None      # window
    flops: float = 0.0
    rel_err: float = 0.0
    rel_err_upper: float = 0.0
    met: bool = False
    seconds: float = 0.0


@dataclass
class TargetReport:
    """An error-targeted request: what was tried, and `chosen`, the index of the attempt kept."""
    target_rel_err: float = 0.0
    met: bool = False
    chosen: int = 0
    attempts: List[TargetAttempt] = field(default_factory=list)


@dataclass
class AttendResult:
    """One attention: the output and the server's account of it.

    out has the inputs' layout and rank; lse ([B, Nq, H] in bnhd, [B, H, Nq]
    in bhnd, float32) with return_lse. mode, samples, seed, sampling, scale,
    q_pos0 and k_pos0 are what the server used (its defaults resolved).
    `summary` and `heads` are SPEC section 6's estimates (zero for exact),
    estimated_rel_err the one figure to look at first."""
    out: Any
    lse: Optional[Any] = None
    mode: str = ""
    samples: int = 0
    seed: int = 0
    sampling: str = ""
    lsh_algorithm: str = ""
    scale: float = 0.0
    q_pos0: int = 0
    k_pos0: int = 0
    backend: str = ""
    device: str = ""
    request_id: str = ""
    flops: float = 0.0
    dense_flops: float = 0.0
    summary: Estimates = field(default_factory=Estimates)
    heads: List[HeadEstimate] = field(default_factory=list)
    timings: Timings = field(default_factory=Timings)
    received_bytes: int = 0   # tensor bytes the server received
    sent_bytes: int = 0       # tensor bytes it sent back
    context_id: str = ""      # keep_context: the kept context, for backward()
    context_ttl_seconds: float = 0.0
    context_bytes: int = 0
    target: Optional[TargetReport] = None
    rpc: str = ""             # "AttendUnary" or "Attend": how the call went
    sharding: Optional[Dict[str, Any]] = None  # ShardedClient: how the request was cut

    @property
    def estimated_rel_err(self) -> Optional[float]:
        """The probe's estimate of the output's relative L2 error against
        exact ALiBi: 0 for exact (the reference itself), None when nothing
        was estimated (estimates or the probe off)."""
        if self.mode == "exact":
            return 0.0
        return self.summary.probe.rel_err if self.summary.probe.rows > 0 else None

    @property
    def meta(self) -> Dict[str, Any]:
        """Everything but out, as plsh-client 0.1's nested dict (lse under "lse")."""
        meta = {f.name: _plain(getattr(self, f.name)) for f in dataclasses.fields(self)
                if f.name not in ("out", "lse", "target", "sharding", "rpc")}
        for head in meta["heads"]:
            if head["draws"] is None:
                del head["draws"]
            else:
                head["draws"] = [list(d) for d in head["draws"]]
        if self.target is not None:
            meta["target"] = _plain(self.target)
            for a in meta["target"]["attempts"]:
                for key in [k for k, v in a.items() if v is None]:
                    del a[key]
        if self.lse is not None:
            meta["lse"] = self.lse
        if self.sharding is not None:
            meta["sharding"] = self.sharding
        return meta

    def __iter__(self) -> Iterator[Any]:
        """out, meta = client.attend(...): the unpackaged client's form."""
        return iter((self.out, self.meta))


@dataclass
class BackwardResult:
    """dq ([B, Nq, H, D] or q's layout), dk and dv (k's), and the server's account."""
    dq: Any
    dk: Any
    dv: Any
    request_id: str = ""
    context_id: str = ""      # the context used (empty: stateless)
    context_kept: bool = False
    backend: str = ""
    device: str = ""
    mode: str = ""
    flops: float = 0.0
    dense_flops: float = 0.0
    forward_flops: float = 0.0  # recompute_forward: the forward's
    timings: Timings = field(default_factory=Timings)
    received_bytes: int = 0
    sent_bytes: int = 0

    @property
    def meta(self) -> Dict[str, Any]:
        return {f.name: _plain(getattr(self, f.name)) for f in dataclasses.fields(self)
                if f.name not in ("dq", "dk", "dv", "mode")}

    def __iter__(self) -> Iterator[Any]:
        """dq, dk, dv, meta = client.backward(...): the unpackaged client's form."""
        return iter((self.dq, self.dk, self.dv, self.meta))


def _plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return dict(value)
    return value


# ----------------------------------------------------------- from the wire

def _probe(p: Any) -> Probe:
    return Probe(rows=p.rows, rel_err=p.rel_err, rel_err_stderr=p.rel_err_stderr, max_abs_err=p.max_abs_err,
                 bound_max=p.bound_max, rel_err_upper=p.rel_err_upper)


def timings_of(t: Any) -> Timings:
    return Timings(queued=t.queued_seconds, receiving=t.receiving_seconds, computing=t.computing_seconds,
                   sending=t.sending_seconds, total=t.total_seconds, backend=dict(t.backend))


def _target(summary: Any) -> Optional[TargetReport]:
    if not summary.HasField("target") or summary.target.target_rel_err <= 0:
        return None
    t = summary.target
    attempts = []
    for a in t.attempts:
        mode = MODE_NAMES.get(a.mode, str(a.mode))
        attempts.append(TargetAttempt(
            mode=mode, samples=a.samples if mode == "lsh" else None,
            window_scale=a.window_scale if mode == "window" else None,
            window_max=a.window_max if mode == "window" else None,
            flops=a.flops, rel_err=a.rel_err, rel_err_upper=a.rel_err_upper, met=a.met, seconds=a.seconds))
    return TargetReport(target_rel_err=t.target_rel_err, met=t.met, chosen=t.chosen, attempts=attempts)


def attend_result(summary: Any, out: Any, lse: Optional[Any], rpc: str) -> AttendResult:
    """An AttendResult from a plsh.v1 Summary."""
    heads = [HeadEstimate(
        head=h.head, slope=h.slope, sigma=h.sigma, window=h.window, max_block=h.max_block,
        mask_max_err=h.mask_max_err, mask_rows_checked=h.mask_rows_checked, mask_rows_sampled=h.mask_rows_sampled,
        mask_spectral_err=h.mask_spectral_err, spectral_iterations=h.spectral_iterations, probe=_probe(h.probe),
        draws=[(d.pitch, d.shift) for d in h.draws] if len(h.draws) else None) for h in summary.heads]
    return AttendResult(
        out=out, lse=lse, mode=MODE_NAMES.get(summary.mode, str(summary.mode)), samples=summary.samples,
        seed=summary.seed, sampling=SAMPLING_NAMES.get(summary.sampling, str(summary.sampling)),
        lsh_algorithm=ALGORITHM_NAMES.get(summary.lsh_algorithm, str(summary.lsh_algorithm)),
        scale=summary.scale, q_pos0=summary.q_pos0, k_pos0=summary.k_pos0, backend=summary.backend,
        device=summary.device, request_id=summary.request_id, flops=summary.flops, dense_flops=summary.dense_flops,
        summary=Estimates(mask_max_err=summary.mask_max_err, mask_spectral_err=summary.mask_spectral_err,
                          probe=_probe(summary.probe)),
        heads=heads, timings=timings_of(summary.timings), received_bytes=summary.received_bytes,
        sent_bytes=summary.sent_bytes, context_id=summary.context_id,
        context_ttl_seconds=summary.context_ttl_seconds, context_bytes=summary.context_bytes,
        target=_target(summary), rpc=rpc)


def backward_result(summary: Any, dq: np.ndarray, dk: np.ndarray, dv: np.ndarray) -> BackwardResult:
    return BackwardResult(
        dq=dq, dk=dk, dv=dv, request_id=summary.request_id, context_id=summary.context_id,
        context_kept=summary.context_kept, backend=summary.backend, device=summary.device,
        mode=MODE_NAMES.get(summary.mode, str(summary.mode)), flops=summary.flops,
        dense_flops=summary.dense_flops, forward_flops=summary.forward_flops, timings=timings_of(summary.timings),
        received_bytes=summary.received_bytes, sent_bytes=summary.sent_bytes)


def result_from_meta(out: Any, lse: Optional[Any], meta: Dict[str, Any], rpc: str) -> AttendResult:
    """An AttendResult from a meta dict of the form AttendResult.meta gives
    (ShardedClient merges its shards' estimates as such dicts)."""
    def probe(d: Dict[str, Any]) -> Probe:
        return Probe(**d)

    heads = []
    for h in meta["heads"]:
        h = dict(h, probe=probe(h["probe"]))
        if "draws" in h:
            h["draws"] = [tuple(d) for d in h["draws"]]
        heads.append(HeadEstimate(**h))
    fields = {f.name for f in dataclasses.fields(AttendResult)}
    nested = ("heads", "summary", "timings", "target", "sharding", "lse")
    plain = {k: v for k, v in meta.items() if k in fields and k not in nested}
    s = meta["summary"]
    target = None
    if "target" in meta:
        t = meta["target"]
        target = TargetReport(target_rel_err=t["target_rel_err"], met=t["met"], chosen=t["chosen"],
                              attempts=[TargetAttempt(**a) for a in t["attempts"]])
    return AttendResult(
        out=out, lse=lse, heads=heads, summary=Estimates(s["mask_max_err"], s["mask_spectral_err"], probe(s["probe"])),
        timings=Timings(**meta["timings"]), target=target, sharding=meta.get("sharding"), rpc=rpc, **plain)
