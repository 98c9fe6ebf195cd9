"""One attention request cut into shards that several plsh-server replicas
compute at once, stitched back into one output (the C++ client's
plsh/sharding.h, with the same rules).

    from plsh_client import ShardedClient
    with ShardedClient("a:50051,b:50051,c:50051") as c:      # or "dns:///plsh-headless.ns.svc.cluster.local:50051"
        r = c.attend(q, k, v, mode="lsh", causal=True, shards=3)
    r.sharding   # kind, reason, replicas, retries, and per shard: replica, heads, rows, keys, seconds, timings

Two cuts, both exact (positions are absolute, SPEC section 1):
  - "heads": whole GQA groups per shard, every row and key; the shard's
    slopes are sent explicitly (the standard slopes depend on H), and for
    lsh the seed is translated so that local head h draws what global head
    h0 + h draws (SPEC section 5's word index is linear in the head).
  - "sequence": query rows in tiles of the server's shard_row_align
    (GetInfo: the CPU backend's row tile, so every row is summed in the
    same order as unsharded) and only the keys
    they may attend: the causal limit, the widest window W_h, or for lsh the
    union of the blocks that meet the rows under the request's draws (drawn
    here by SPEC section 5's rule), one key more on each side for the error
    estimates. Exact attends every key. lsh with a sampler other than iid
    cannot be cut so (the draws would be needed here): shard_by="sequence"
    is refused for it, and "auto" cuts by heads.
shard_by="auto" takes the cut whose largest shard sends and receives fewer
bytes. shards=0 (the default) is one shard per replica, but no more than
leave each at least min_shard_bytes (4 MiB) in and out; a request below that
goes whole to one replica.

A shard whose replica fails with UNAVAILABLE, RESOURCE_EXHAUSTED, ABORTED,
INTERNAL, UNKNOWN, CANCELLED or its own DEADLINE_EXCEEDED is sent again to
another replica within the deadline; meta["sharding"] names every failed
attempt. Estimates are merged as plsh/sharding.h describes (meta["sharding"]
["pooling"] says how)."""

import math
import random
import socket
import threading
import time
from typing import Any, List

import numpy as np

import grpc

from . import _layout
from ._client import Client
from ._results import AttendResult, result_from_meta
from ._rpc import PlshError
from ._shard_plan import (DEFAULT_MIN_SHARD_BYTES, LEGACY_ROW_ALIGN, POOLING, _Request, _bin, check_cut,  # noqa: F401
                          draw_hashes, head_shard_seed, merge_meta, plan_shards, pool_probes, standard_slopes)
from ._wire import MODE_NAMES, SAMPLING_NAMES

_DOWN_SECONDS = 5.0                 # a replica that answered UNAVAILABLE is passed over this long
_BYTES = {"f32": 4, "f16": 2, "bf16": 2}
_RETRYABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.ABORTED,
              grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN, grpc.StatusCode.CANCELLED,
              grpc.StatusCode.DEADLINE_EXCEEDED}


# --- replicas ---

def resolve_replicas(targets):
    """A --target value (a comma list, or list of strings) -> (replica targets,
    DNS name for TLS or None). "dns:[//authority/]host:port" items are
    resolved here (getaddrinfo) into one ipv4:/ipv6: target per address."""
    items = [t.strip() for t in (targets.split(",") if isinstance(targets, str) else targets)]
    replicas, tls_name = [], None
    for i, item in enumerate(items):
        if not item:
            raise ValueError(f"target = {targets!r}: item {i} is empty, expected host:port")
        if not item.startswith("dns:"):
            replicas.append(item)
            continue
        rest = item[4:]
        if rest.startswith("//"):
            slash = rest.find("/", 2)
            rest = rest[slash + 1:] if slash >= 0 else ""
        if rest.startswith("["):
            host, _, port = rest[1:].partition("]:")
        else:
            host, _, port = rest.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"target = {item!r}, expected dns:///host:port (or dns://authority/host:port)")
        try:
            found = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
        except socket.gaierror as e:
            raise PlshError(grpc.StatusCode.UNAVAILABLE, f"target = {item!r}: cannot resolve {host}: {e}") from None
        for family, _, _, _, address in found:
            if family == socket.AF_INET:
                replicas.append(f"ipv4:{address[0]}:{port}")
            elif family == socket.AF_INET6:
                replicas.append(f"ipv6:[{address[0]}]:{port}")
        tls_name = tls_name or host
    replicas = list(dict.fromkeys(replicas))
    if not replicas:
        raise PlshError(grpc.StatusCode.UNAVAILABLE, f"target = {targets!r}: no address")
    return replicas, tls_name


class ShardedClient:
    """Clients of several replicas of one service; attend() cuts each request
    across them. targets: "a:1,b:2", a list of targets, or a dns: name whose
    every address is a replica. Other arguments are Client's (TLS, tokens),
    used for every replica; with TLS and a dns: name the certificate must
    carry the name (tls_server_name defaults to it)."""

    def __init__(self, targets, **client_kwargs):
        self.replicas, tls_name = resolve_replicas(targets)
        uses_tls = client_kwargs.get("tls") or any(client_kwargs.get(k) is not None
                                                   for k in ("tls_ca", "tls_cert", "tls_key", "tls_server_name"))
        if uses_tls and tls_name and not client_kwargs.get("tls_server_name"):
            client_kwargs["tls_server_name"] = tls_name
        self.clients = [Client(t, **client_kwargs) for t in self.replicas]
        self._lock = threading.Lock()
        self._in_flight = [0] * len(self.replicas)
        self._down_until = [0.0] * len(self.replicas)
        self._next_first = 0
        self._info = None

    def __repr__(self):
        return f"ShardedClient({self.replicas!r})"

    def close(self):
        for c in self.clients:
            c.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _server_info(self):
        """GetInfo of the first replica that answers (the replicas are one service)."""
        if self._info is None:
            error = None
            for c in self.clients:
                try:
                    self._info = c.info()
                    break
                except PlshError as e:
                    error = e
            else:
                assert error is not None
                raise error
        return self._info

    def _sampling(self, options):
        """The lsh sampler a request uses: its own, else the server's default."""
        if options.get("sampling") is not None:
            return options["sampling"]
        return SAMPLING_NAMES.get(self._server_info().defaults.sampling, "iid")

    def _pick(self, preferred, tried):
        with self._lock:
            n, now = len(self.replicas), time.monotonic()
            untried = [r for r in range(n) if not tried[r]]
            order = [(preferred + step) % n for step in range(n)]
            pool = [r for r in order if r in untried] or order
            best = min(pool, key=lambda r: (self._down_until[r] > now, self._in_flight[r], order.index(r)))
            self._in_flight[best] += 1
            return best

    def attend(self, q, k, v, *, shards=0, shard_by="auto", min_shard_bytes=DEFAULT_MIN_SHARD_BYTES,
               max_attempts=0, deadline=None, request_id="", return_lse=False, layout="bnhd", check_layout=True,
               **options) -> AttendResult:
        """Client.attend's arguments and result, cut across the replicas:
        an AttendResult whose .sharding says how. shards: P (0: automatic),
        shard_by: "auto", "heads" or "sequence", max_attempts per shard (0:
        replicas + 1). A request this client cannot check (an unknown mode,
        kv heads that do not divide the heads, ...) goes whole to one
        replica, whose validation answers."""
        if shard_by not in ("auto", "heads", "sequence"):
            raise ValueError(f"shard_by = {shard_by!r}, expected auto, heads or sequence")
        start = time.monotonic()
        q, k, v = (np.asarray(a) for a in (q, k, v))
        _layout.resolve_shapes(q.shape, k.shape, v.shape, layout, slopes=options.get("slopes"), check=check_layout)
        if layout == "bhnd":  # the cuts are in plsh's bnhd (views; the shards' arrays are copied as they go)
            q, k, v = (np.swapaxes(a, -3, -2) for a in (q, k, v))
        if options.get("mode", "lsh") in ("lsh", None):
            check_cut(shard_by, self._sampling(options) != "iid")
        result = self._attend(q, k, v, shards, shard_by, min_shard_bytes, max_attempts, deadline, request_id,
                              return_lse, options, start)
        if layout == "bhnd":
            result.out = np.swapaxes(result.out, -3, -2)
            if result.lse is not None:
                result.lse = np.swapaxes(result.lse, -2, -1)
        return result

    def _attend(self, q, k, v, shards, shard_by, min_shard_bytes, max_attempts, deadline, request_id, return_lse,
                options, start):
        batched = q.ndim == 4
        with self._lock:
            first = self._next_first % len(self.replicas)
            self._next_first += 1
        max_attempts = max_attempts or len(self.replicas) + 1
        stop_at = start + deadline if deadline else None

        request: Any = None
        plan: Any = None
        if q.ndim in (3, 4) and k.ndim == q.ndim and v.shape == k.shape:
            q4, k4, v4 = (q, k, v) if batched else (q[None], k[None], v[None])
            B, Nq, H, D = q4.shape
            Nk, Hkv = k4.shape[1], k4.shape[2]
            if Hkv >= 1 and H % Hkv == 0:
                wire = options.get("wire_dtype") or ("f16" if q.dtype == np.float16 else "f32")
                out_wire = options.get("out_dtype") or wire
                # The whole request's bytes do not depend on the mode: enough to decide whether to cut.
                shape_only = _Request(B, Nq, Nk, H, Hkv, D, _BYTES.get(wire, 4), _BYTES.get(out_wire, 4), return_lse,
                                      False, "exact", None, 0, None, 0, 0, 1e-4, 0)
                plan = plan_shards(shape_only, shards, shard_by, len(self.replicas), min_shard_bytes)
                if plan["kind"] != "single":
                    request = self._resolve(q4, k4, options, return_lse, wire, out_wire)
                    plan = plan_shards(request, shards, shard_by, len(self.replicas), min_shard_bytes) \
                        if request is not None else None
        if plan is None:
            plan = {"kind": "single", "shards": [None],
                    "reason": "sent whole: the client cannot cut it (the server checks it)"}
        sharded = plan["kind"] != "single"
        base_id = request_id[:100] if request_id else f"sharded-{random.getrandbits(64):016x}"
        n = len(plan["shards"])
        reports: List[Any] = [None] * n
        results: List[Any] = [None] * n
        errors: List[Any] = [None] * n
        failed = threading.Event()
        lock = threading.Lock()
        retries = [0]
        out: List[Any] = [None]
        lse: Any = np.zeros((request.B, request.Nq, request.H), np.float32) if sharded and return_lse else None

        def send(i):
            """Shard i, retried on other replicas; its output stitched in place."""
            spec = plan["shards"][i]
            report = {"index": i, "replica": None, "request_id": None, "attempts": 0, "failures": []}
            if spec is not None:
                report.update({key: spec[key] for key in ("heads", "kv_heads", "rows", "keys")})
            reports[i] = report
            kw = dict(options)
            if sharded:
                (h0, h1), (hk0, hk1), (r0, r1), (j0, j1) = spec["heads"], spec["kv_heads"], spec["rows"], spec["keys"]
                arrays = (q4[:, r0:r1, h0:h1], k4[:, j0:j1, hk0:hk1], v4[:, j0:j1, hk0:hk1])
                if plan["kind"] == "heads":
                    kw["slopes"] = request.slopes[h0:h1]  # the standard slopes depend on H
                    kw["q_pos0"] = request.q_pos0
                    if request.mode == "lsh":
                        kw["seed"] = head_shard_seed(request.seed, h0)
                else:
                    kw["q_pos0"] = request.q_pos0 + r0
                    kw["k_pos0"] = request.k_pos0 + j0
                shard_id = f"{base_id}/{i + 1}of{n}"
            else:
                arrays, shard_id = (q, k, v), request_id
            tried = [False] * len(self.replicas)
            preferred = (first + i) % len(self.replicas)
            attempt = 0
            while True:
                attempt += 1
                if failed.is_set():
                    errors[i] = "stopped"
                    return
                t0 = time.monotonic()
                remaining = None if stop_at is None else stop_at - t0
                if remaining is not None and remaining <= 0:
                    errors[i] = PlshError(grpc.StatusCode.DEADLINE_EXCEEDED,
                                          f"shard {i + 1}: the call's deadline passed")
                    failed.set()
                    return
                rid = shard_id if attempt == 1 or not shard_id else f"{shard_id}/retry{attempt - 1}"
                r = self._pick(preferred, tried)
                try:
                    result = self.clients[r].attend(*arrays, deadline=remaining, request_id=rid,
                                                    return_lse=return_lse, check_layout=False, **kw)
                except PlshError as e:
                    t1 = time.monotonic()
                    report["attempts"] = attempt
                    report["failures"].append({"replica": self.replicas[r], "status": str(e), "seconds": t1 - t0})
                    tried[r] = True
                    out_of_time = stop_at is not None and t1 >= stop_at
                    if e.code not in _RETRYABLE or out_of_time or attempt >= max_attempts:
                        errors[i] = PlshError(e.code, f"shard {i + 1} of {n} on {self.replicas[r]}"
                                              + (f" (attempt {attempt})" if attempt > 1 else "") + f": {e.details}")
                        failed.set()
                        return
                    with self._lock:
                        if e.code == grpc.StatusCode.UNAVAILABLE:
                            self._down_until[r] = time.monotonic() + _DOWN_SECONDS
                    with lock:
                        retries[0] += 1
                    if all(tried):  # every replica failed this shard once: round again after a pause
                        tried = [False] * len(self.replicas)
                        time.sleep(min(1.0, 0.05 * attempt, max(0.0, (stop_at or math.inf) - time.monotonic())))
                    continue
                finally:
                    with self._lock:
                        self._in_flight[r] -= 1
                t = result.timings
                report.update({"replica": self.replicas[r], "request_id": result.request_id, "attempts": attempt,
                               "seconds": time.monotonic() - t0,
                               "timings": {"queued": t.queued, "receiving": t.receiving, "computing": t.computing,
                                           "sending": t.sending, "total": t.total},
                               "backend": result.backend, "lsh_algorithm": result.lsh_algorithm,
                               "sent_bytes": result.received_bytes, "received_bytes": result.sent_bytes})
                if not sharded:
                    results[i] = (result, None, None)
                    return
                o, meta = result.out, result.meta
                with lock:
                    if out[0] is None:
                        out[0] = np.zeros((request.B, request.Nq, request.H, request.D), o.dtype)
                stitched: Any = out[0]
                stitched[:, r0:r1, h0:h1] = o
                if return_lse:
                    lse[:, r0:r1, h0:h1] = meta.pop("lse")
                # Mean ||out_i||^2 per shard head: the probe's pooling weights.
                results[i] = (None, meta, (o.astype(np.float64) ** 2).sum(axis=-1).mean(axis=(0, 1)))
                return

        def guarded(i):
            try:
                send(i)
            except BaseException as e:  # surfaced below, in the caller's thread
                errors[i] = e
                failed.set()

        threads = [threading.Thread(target=guarded, args=(i,)) for i in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for e in errors:
            if e is not None and e != "stopped":
                raise e

        sharding = {"kind": plan["kind"], "reason": plan["reason"], "replicas": list(self.replicas),
                    "retries": retries[0], "seconds": time.monotonic() - start, "pooling": POOLING[plan["kind"]],
                    "shards": reports}
        if not sharded:
            whole = results[0][0]
            whole.sharding = sharding
            return whole
        meta = merge_meta(request, plan, [m for _, m, _ in results], [ms for _, _, ms in results], request.seed)
        meta["request_id"] = base_id
        meta["sharding"] = sharding
        return result_from_meta(out[0] if batched else out[0][0], (lse if batched else lse[0]) if return_lse else None,
                                meta, "sharded")

    def _resolve(self, q4, k4, options, return_lse, wire, out_wire):
        """The _Request of a call, with the server's defaults for what it leaves out."""
        B, Nq, H, D = q4.shape
        Nk, Hkv = k4.shape[1], k4.shape[2]
        if options.get("target_rel_err") is not None:
            return None  # the server picks the configuration, attempt by attempt: sent whole
        mode, samples, eps = options.get("mode"), options.get("samples"), options.get("window_eps")
        if mode is None or (mode == "lsh" and samples is None) or (mode == "window" and eps is None):
            d = self._server_info().defaults
            mode = mode or MODE_NAMES.get(d.mode, "lsh")
            samples = samples if samples is not None else d.samples
            eps = eps if eps is not None else d.window_eps
        if mode not in ("exact", "lsh", "window") or (mode == "lsh" and not samples):
            return None
        slopes = options.get("slopes")
        if slopes and len(slopes) != H:
            return None
        k_pos0 = options.get("k_pos0") or 0
        q_pos0 = options.get("q_pos0")
        q_pos0 = Nk - Nq if q_pos0 is None else q_pos0
        # plsh_core's position rules (params.cpp): what they refuse, the server refuses whole.
        if options.get("causal") and q_pos0 < k_pos0:
            return None
        if mode != "exact" and not (k_pos0 <= q_pos0 and q_pos0 + Nq <= k_pos0 + Nk):
            return None
        return _Request(B, Nq, Nk, H, Hkv, D, _BYTES.get(wire, 4), _BYTES.get(out_wire, 4), return_lse,
                        bool(options.get("causal")), mode, q_pos0, k_pos0, slopes, samples or 0,
                        options.get("seed") or 0, eps or 1e-4, options.get("window_width") or 0,
                        heads_only=mode == "lsh" and self._sampling(options) != "iid",
                        row_align=self._server_info().shard_row_align or LEGACY_ROW_ALIGN)
