"""One attention request cut into shards that several plsh-server replicas
compute at once, stitched back into one output (the C++ client's
plsh/sharding.h, with the same rules).

    from plsh_client import ShardedClient
    with ShardedClient("a:50051,b:50051,c:50051") as c:      # or "dns:///plsh-headless.ns.svc.cluster.local:50051"
        out, meta = c.attend(q, k, v, mode="lsh", causal=True, shards=3)
    meta["sharding"]   # kind, reason, replicas, retries, and per shard: replica, heads, rows, keys, seconds, timings

Two cuts, both exact (positions are absolute, SPEC section 1):
  - "heads": whole GQA groups per shard, every row and key; the shard's
    slopes are sent explicitly (the standard slopes depend on H), and for
    lsh the seed is translated so that local head h draws what global head
    h0 + h draws (SPEC section 5's word index is linear in the head).
  - "sequence": query rows in tiles of 128 (the CPU backend's row tiles, so
    every row is summed in the same order as unsharded) and only the keys
    they may attend: the causal limit, the widest window W_h, or for lsh the
    union of the blocks that meet the rows under the request's draws (drawn
    here by SPEC section 5's rule), one key more on each side for the error
    estimates. Exact attends every key.
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

import numpy as np

from ._client import Client, PlshError, grpc

SHARD_ROW_ALIGN = 128               # the CPU backend's largest row tile (kernels/cpu/tiles.h); its lsh tile, 64, divides it
DEFAULT_MIN_SHARD_BYTES = 4 << 20   # automatic shard count: each shard at least this many bytes in and out
_DOWN_SECONDS = 5.0                 # a replica that answered UNAVAILABLE is passed over this long

_MASK = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_INT64_MIN, _INT64_MAX = -(1 << 63), (1 << 63) - 1
_SINGLETON_PITCH = 0.5
_BYTES = {"f32": 4, "f16": 2, "bf16": 2}
_NO_WINDOW = _INT64_MAX
_RETRYABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.ABORTED,
              grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN, grpc.StatusCode.CANCELLED,
              grpc.StatusCode.DEADLINE_EXCEEDED}


# --- SPEC section 5's draws and the bins of positions (kernels/src/draws.cpp, line for line) ---

def _mix64(z):
    z ^= z >> 30
    z = (z * 0xBF58476D1CE4E5B9) & _MASK
    z ^= z >> 27
    z = (z * 0x94D049BB133111EB) & _MASK
    return z ^ (z >> 31)


def _uniform(seed, head, sample, j):
    index = (1 + 4 * ((head << 24) + sample) + j) & _MASK
    word = _mix64((seed + _GOLDEN * index) & _MASK)
    return (float(word >> 11) + 0.5) * 2.0 ** -53


def draw_hashes(seed, head, sigma, samples):
    """[(pitch, shift)] of one head: SPEC section 5, as plsh_core's draw_hashes."""
    draws = []
    for k in range(samples):
        u0, u1, u2 = (_uniform(seed, head, k, j) for j in range(3))
        pitch = -sigma * (math.log(u0) + math.log(u1))
        draws.append((pitch, u2 * pitch))
    return draws


def head_shard_seed(seed, head_begin):
    """The seed under which local head h draws what head head_begin + h draws under `seed`."""
    return (seed + _GOLDEN * (head_begin << 26)) & _MASK


def _bin(pos, d):
    pitch, shift = d
    if not math.isfinite(pitch):
        return 0
    if pitch < _SINGLETON_PITCH:
        return pos
    return math.floor((float(pos) - shift) / pitch)


def block_end(pos, d):
    pitch, shift = d
    if not math.isfinite(pitch):
        return _INT64_MAX
    if pitch < _SINGLETON_PITCH:
        return pos + 1
    b = _bin(pos, d)
    e = math.ceil(float(b + 1) * pitch + shift)
    if e <= pos:
        e = pos + 1
    while e - 1 > pos and _bin(e - 1, d) > b:
        e -= 1
    while _bin(e, d) <= b:
        e += 1
    return e


def block_begin(pos, d):
    pitch, shift = d
    if not math.isfinite(pitch):
        return _INT64_MIN
    if pitch < _SINGLETON_PITCH:
        return pos
    b = _bin(pos, d)
    s = math.floor(float(b) * pitch + shift)
    if s > pos:
        s = pos
    while _bin(s, d) < b:
        s += 1
    while s - 1 >= _INT64_MIN // 2 and _bin(s - 1, d) == b:
        s -= 1
    return s


def standard_slopes(heads):
    """ALiBi's slopes for `heads` heads (BLOOM's rule when not a power of two), as plsh_core's."""
    def powers(n):
        start = 2.0 ** (-8.0 / n)
        out, value = [], start
        for _ in range(n):
            out.append(value)
            value *= start
        return out
    p = 1
    while p * 2 <= heads:
        p *= 2
    slopes = powers(p)
    extra, i = powers(2 * p), 0
    while len(slopes) < heads:
        slopes.append(extra[i])
        i += 2
    return slopes


# --- plans ---

class _Request:
    """The request's shape and the options a cut depends on, resolved."""

    def __init__(self, B, Nq, Nk, H, Hkv, D, in_bytes, out_bytes, return_lse, causal, mode, q_pos0, k_pos0,
                 slopes, samples, seed, window_eps, window_width, heads_only=False):
        # heads_only: the keys a sequence shard needs are not computable here
        # (lsh with a sampler other than iid, whose draws this module does
        # not reimplement); head shards stay exact (every sampler's draws are
        # linear in the head index, as the seed translation needs).
        self.heads_only = heads_only
        self.B, self.Nq, self.Nk, self.H, self.Hkv, self.D = B, Nq, Nk, H, Hkv, D
        self.causal, self.mode, self.k_pos0 = causal, mode, k_pos0
        self.q_pos0 = Nk - Nq if q_pos0 is None else q_pos0
        self.slopes = list(slopes) if slopes else standard_slopes(H)
        self.samples, self.seed = samples, seed
        self.q_row = D * in_bytes                                  # per query row and head
        self.out_row = D * out_bytes + (4 if return_lse else 0)    # out + lse per query row and head
        self.kv_row = 2 * D * in_bytes                             # k + v per key row and kv head
        self.window = []
        if mode == "window":
            for m in self.slopes:
                if window_width > 0:
                    self.window.append(window_width)
                elif m == 0:
                    self.window.append(_NO_WINDOW)
                else:
                    w = math.ceil((1.0 / m) * math.log(1.0 / window_eps))
                    self.window.append(_NO_WINDOW if w >= 9.0e18 else max(1, int(w)))

    def sigma(self, h):
        m = self.slopes[h]
        return 1.0 / m if m > 0 else math.inf


def _spec(index, heads, kv_heads, rows, keys, r):
    h0, h1 = heads
    hk0, hk1 = kv_heads
    nrows, nkeys = rows[1] - rows[0], keys[1] - keys[0]
    return {"index": index, "heads": heads, "kv_heads": kv_heads, "rows": rows, "keys": keys,
            "sent_bytes": r.B * (nrows * (h1 - h0) * r.q_row + nkeys * (hk1 - hk0) * r.kv_row),
            "received_bytes": r.B * nrows * (h1 - h0) * r.out_row}


def _whole(r):
    return [_spec(0, (0, r.H), (0, r.Hkv), (0, r.Nq), (0, r.Nk), r)]


def _head_shards(r, parts):
    n, group = min(parts, r.Hkv), r.H // r.Hkv
    shards = []
    for i in range(n):
        k0, k1 = r.Hkv * i // n, r.Hkv * (i + 1) // n
        shards.append(_spec(i, (k0 * group, k1 * group), (k0, k1), (0, r.Nq), (0, r.Nk), r))
    return shards


class _KeyReach:
    """Key positions [lo, hi) that query positions [first, last] may attend."""

    def __init__(self, r):
        self.r = r
        self.width = max(r.window) if r.mode == "window" else 0
        self.draws = []
        if r.mode == "lsh":
            for h in range(r.H):
                self.draws += draw_hashes(r.seed, h, r.sigma(h), r.samples)
            self.draws.sort(key=lambda d: -d[0])  # longest pitches first: they reach furthest

    def lo(self, first):
        if self.r.mode == "exact":
            return _INT64_MIN
        if self.r.mode == "window":
            return _INT64_MIN if self.width == _NO_WINDOW else first - self.width
        best = None
        for d in self.draws:
            if not math.isfinite(d[0]):
                return _INT64_MIN
            if best is not None and first - math.ceil(d[0]) >= best:
                break
            b = block_begin(first, d)
            best = b if best is None else min(best, b)
        return first if best is None else best - 1

    def hi(self, last):
        h = _INT64_MAX
        if self.r.mode == "window":
            h = _INT64_MAX if self.width == _NO_WINDOW else last + self.width + 1
        elif self.r.mode == "lsh":
            best = None
            for d in self.draws:
                if not math.isfinite(d[0]):
                    best = _INT64_MAX
                    break
                if best is not None and last + math.ceil(d[0]) <= best:
                    break
                e = block_end(last, d)
                best = e if best is None else max(best, e)
            h = last + 1 if best is None else min(_INT64_MAX, best + 1)
        if self.r.causal:
            h = min(h, last + 1)
        return h


def _sequence_shards(r, parts):
    tiles = -(-r.Nq // SHARD_ROW_ALIGN)
    n = min(parts, tiles)
    reach = _KeyReach(r)
    k_first, k_end = r.k_pos0, r.k_pos0 + r.Nk
    lo_memo, hi_memo = {}, {}

    def row_end(t):  # one past tile t - 1's last row
        return min(r.Nq, t * SHARD_ROW_ALIGN)

    def first_key(t):
        if t not in lo_memo:
            lo_memo[t] = min(max(reach.lo(r.q_pos0 + t * SHARD_ROW_ALIGN), k_first), k_end) - k_first
        return lo_memo[t]

    def end_key(t):
        if t not in hi_memo:
            hi_memo[t] = min(max(reach.hi(r.q_pos0 + row_end(t + 1) - 1), k_first), k_end) - k_first
        return hi_memo[t]

    def spec(a, b):
        j0 = first_key(a)
        return _spec(0, (0, r.H), (0, r.Hkv), (a * SHARD_ROW_ALIGN, row_end(b)), (j0, max(j0, end_key(b - 1))), r)

    def cost(a, b):
        s = spec(a, b)
        return s["sent_bytes"] + s["received_bytes"]

    def cut(threshold, out=None):
        count, a = 0, 0
        while a < tiles:
            if cost(a, a + 1) > threshold:
                return False
            b = a + 1
            while b < tiles and cost(a, b + 1) <= threshold:
                b += 1
            if out is not None:
                out.append(spec(a, b))
            count += 1
            if count > n:
                return False
            a = b
        return True

    # A shard's bytes grow with its last tile and shrink with its first: the
    # least threshold a greedy cut meets is the optimal largest shard.
    lo, hi = 0, cost(0, tiles)
    while lo < hi:
        mid = (lo + hi) // 2
        if cut(mid):
            hi = mid
        else:
            lo = mid + 1
    shards = []
    cut(lo, shards)
    for i, s in enumerate(shards):
        s["index"] = i
    return shards


def _plan(kind, shards):
    if len(shards) == 1:
        kind = "single"
    return {"kind": kind, "shards": shards,
            "sent_bytes": sum(s["sent_bytes"] for s in shards),
            "received_bytes": sum(s["received_bytes"] for s in shards),
            "max_shard_bytes": max(s["sent_bytes"] + s["received_bytes"] for s in shards)}


def plan_shards(r, shards, shard_by, replicas, min_shard_bytes=DEFAULT_MIN_SHARD_BYTES):
    """The cut of request r (a _Request) for `replicas` replicas: a dict with
    kind ("single", "heads", "sequence"), shards (heads, kv_heads, rows, keys
    half-open, bytes), totals and a reason."""
    whole = _plan("single", _whole(r))
    if shards == 0:
        by_size = max(1, whole["max_shard_bytes"] // min_shard_bytes) if min_shard_bytes > 0 else replicas
        parts = min(replicas, by_size)
        why = (f"automatic: {replicas} replica(s), {whole['max_shard_bytes'] / 2**20:.3g} MiB in and out"
               + (f" keeps {by_size} shard(s) of at least {min_shard_bytes / 2**20:.3g} MiB" if by_size < replicas else "")
               + "; ")
    else:
        parts, why = shards, f"asked for {shards} shard(s); "
    if parts == 1:
        whole["reason"] = why + "one shard: the request as is"
        return whole
    candidates = []
    for kind in ("heads", "sequence"):
        if kind == "sequence" and r.heads_only:
            continue
        if shard_by in (kind, "auto"):
            cut = _head_shards(r, parts) if kind == "heads" else _sequence_shards(r, parts)
            candidates.append((kind, _plan(kind, cut)))
    # Fewer bytes for the largest shard, then in all; heads on a tie.
    if not candidates:
        whole["reason"] = why + "one shard: sequence cuts need the draws, and this module computes only iid draws"
        return whole
    best_kind, best = min(candidates, key=lambda c: (c[1]["max_shard_bytes"], c[1]["sent_bytes"] + c[1]["received_bytes"]))
    reason = (why + f"{best['kind']} into {len(best['shards'])}: largest shard {best['max_shard_bytes'] / 2**20:.3g} MiB "
              f"in and out, {best['sent_bytes'] / 2**20:.3g} MiB sent in all")
    for kind, plan in candidates:
        if kind != best_kind:
            reason += (f"; {kind} would give {len(plan['shards'])} with largest {plan['max_shard_bytes'] / 2**20:.3g} MiB, "
                       f"{plan['sent_bytes'] / 2**20:.3g} MiB sent")
    best["reason"] = reason
    return best


# --- merging the estimates (plsh/sharding.h, merge_results) ---

POOLING = {
    "single": "one shard: the server's estimates as they came",
    "heads": "heads: each head's estimates come whole from its shard (mask_max_err as unsharded; the probe samples its "
             "rows from the shard's seed); the request's probe rel_err pools heads weighted by probe rows x mean "
             "||out||^2 (approximate); rows, max_abs_err, bound_max exact",
    "sequence": "sequence: per head, mask_max_err is the max over shards (as unsharded: each shard's keys reach one past "
                "its rows' blocks or window), mask_spectral_err the root sum of squares (an upper bound), the probe pools "
                "each shard's own rows weighted by probe rows x mean ||out||^2 (approximate); rows, max_abs_err, "
                "bound_max exact",
}


def pool_probes(units):
    """[(probe dict, weight)] -> one probe dict: rel_err^2 averaged with the
    weights (estimates of each unit's sum ||o*||^2), its standard error by
    the delta method; rows summed, max_abs_err and bound_max maxed."""
    e = {"rows": sum(p["rows"] for p, _ in units), "rel_err": 0.0, "rel_err_stderr": 0.0,
         "max_abs_err": max([p["max_abs_err"] for p, _ in units] or [0.0]),
         "bound_max": max([p["bound_max"] for p, _ in units] or [0.0])}
    if e["rows"] == 0:
        return e
    any_weight = any(p["rows"] > 0 and w > 0 and math.isfinite(w) for p, w in units)
    w_sum = q_sum = var_sum = 0.0
    for p, w in units:
        if p["rows"] == 0:
            continue
        w = (w if math.isfinite(w) else 0.0) if any_weight else float(p["rows"])
        q = p["rel_err"] ** 2
        q_err = 2 * p["rel_err"] * p["rel_err_stderr"]
        w_sum += w
        q_sum += w * q
        var_sum += w * w * (q_err * q_err if math.isfinite(q_err) else math.inf)
    if w_sum > 0:
        q = q_sum / w_sum
        e["rel_err"] = math.sqrt(q)
        e["rel_err_stderr"] = math.sqrt(var_sum) / w_sum / (2 * math.sqrt(q)) if q > 0 else 0.0
    return e


def _dense_flops(r):
    if not r.causal:
        pairs = r.Nq * r.Nk
    else:
        pairs = sum(min(max(r.q_pos0 + i - r.k_pos0 + 1, 0), r.Nk) for i in range(r.Nq))
    return 4.0 * r.B * r.H * r.D * pairs


def merge_meta(r, plan, metas, mean_squares, seed):
    """The merged meta of the shards' (in plan order)."""
    if plan["kind"] == "single":
        return metas[0]
    m = dict(metas[0])
    m["seed"], m["q_pos0"], m["k_pos0"] = seed, r.q_pos0, r.k_pos0
    m["backend"] = "; ".join(dict.fromkeys(x["backend"] for x in metas))
    m["device"] = "; ".join(dict.fromkeys(x["device"] for x in metas))
    m["flops"] = sum(x["flops"] for x in metas)
    m["dense_flops"] = sum(x["dense_flops"] for x in metas) if plan["kind"] == "heads" else _dense_flops(r)
    # Shards run side by side: the longest stands for each phase.
    t = {k: max(x["timings"][k] for x in metas) for k in ("queued", "receiving", "computing", "sending", "total")}
    t["backend"] = {}
    for x in metas:
        for k, v in x["timings"]["backend"].items():
            t["backend"][k] = max(t["backend"].get(k, 0.0), v)
    m["timings"] = t
    m["received_bytes"] = sum(x["received_bytes"] for x in metas)
    m["sent_bytes"] = sum(x["sent_bytes"] for x in metas)
    heads, units = [], []
    if plan["kind"] == "heads":
        for s, x, ms in zip(plan["shards"], metas, mean_squares):
            for h in x["heads"]:
                he = dict(h, head=h["head"] + s["heads"][0])
                units.append((h["probe"], h["probe"]["rows"] * ms[h["head"]]))
                heads.append(he)
    else:
        for h in range(len(metas[0]["heads"])):
            parts = [x["heads"][h] for x in metas]
            he = dict(parts[0])
            he["max_block"] = max(p["max_block"] for p in parts)
            he["mask_max_err"] = max(p["mask_max_err"] for p in parts)
            he["mask_rows_checked"] = sum(p["mask_rows_checked"] for p in parts)
            he["mask_rows_sampled"] = any(p["mask_rows_sampled"] for p in parts)
            he["mask_spectral_err"] = math.sqrt(sum(p["mask_spectral_err"] ** 2 for p in parts))
            he["spectral_iterations"] = max(p["spectral_iterations"] for p in parts)
            head_units = [(p["probe"], p["probe"]["rows"] * ms[h]) for p, ms in zip(parts, mean_squares)]
            he["probe"] = pool_probes(head_units)
            units += head_units
            heads.append(he)
    m["heads"] = heads
    m["summary"] = {"mask_max_err": max([h["mask_max_err"] for h in heads] or [0.0]),
                    "mask_spectral_err": max([h["mask_spectral_err"] for h in heads] or [0.0]),
                    "probe": pool_probes(units)}
    return m


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
        self._defaults = None

    def __repr__(self):
        return f"ShardedClient({self.replicas!r})"

    def close(self):
        for c in self.clients:
            c.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _server_defaults(self):
        """GetInfo's defaults from the first replica that answers."""
        if self._defaults is None:
            error = None
            for c in self.clients:
                try:
                    self._defaults = c.info().defaults
                    break
                except PlshError as e:
                    error = e
            else:
                raise error
        return self._defaults

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
               max_attempts=0, deadline=None, request_id="", return_lse=False, **options):
        """Client.attend's arguments and result, cut across the replicas:
        (out, meta), meta["sharding"] saying how. shards: P (0: automatic),
        shard_by: "auto", "heads" or "sequence", max_attempts per shard (0:
        replicas + 1). A request this client cannot check (an unknown mode,
        kv heads that do not divide the heads, ...) goes whole to one
        replica, whose validation answers."""
        if shard_by not in ("auto", "heads", "sequence"):
            raise ValueError(f"shard_by = {shard_by!r}, expected auto, heads or sequence")
        start = time.monotonic()
        q, k, v = (np.asarray(a) for a in (q, k, v))
        batched = q.ndim == 4
        with self._lock:
            first = self._next_first % len(self.replicas)
            self._next_first += 1
        max_attempts = max_attempts or len(self.replicas) + 1
        stop_at = start + deadline if deadline else None

        request, plan = None, None
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
        reports, results, errors = [None] * n, [None] * n, [None] * n
        failed = threading.Event()
        lock = threading.Lock()
        retries = [0]
        out = [None]
        lse = np.zeros((request.B, request.Nq, request.H), np.float32) if sharded and return_lse else None

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
                    errors[i] = PlshError(grpc.StatusCode.DEADLINE_EXCEEDED, f"shard {i + 1}: the call's deadline passed")
                    failed.set()
                    return
                rid = shard_id if attempt == 1 or not shard_id else f"{shard_id}/retry{attempt - 1}"
                r = self._pick(preferred, tried)
                try:
                    o, meta = self.clients[r].attend(*arrays, deadline=remaining, request_id=rid,
                                                     return_lse=return_lse, **kw)
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
                report.update({"replica": self.replicas[r], "request_id": meta["request_id"], "attempts": attempt,
                               "seconds": time.monotonic() - t0,
                               "timings": {key: meta["timings"][key]
                                           for key in ("queued", "receiving", "computing", "sending", "total")},
                               "backend": meta["backend"], "lsh_algorithm": meta["lsh_algorithm"],
                               "sent_bytes": meta["received_bytes"], "received_bytes": meta["sent_bytes"]})
                if not sharded:
                    results[i] = (o, meta, None)
                    return
                with lock:
                    if out[0] is None:
                        out[0] = np.zeros((request.B, request.Nq, request.H, request.D), o.dtype)
                out[0][:, r0:r1, h0:h1] = o
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
            o, meta, _ = results[0]
            meta["sharding"] = sharding
            return o, meta
        meta = merge_meta(request, plan, [m for _, m, _ in results], [ms for _, _, ms in results], request.seed)
        meta["request_id"] = base_id
        if return_lse:
            meta["lse"] = lse if batched else lse[0]
        meta["sharding"] = sharding
        return (out[0] if batched else out[0][0]), meta

    def _resolve(self, q4, k4, options, return_lse, wire, out_wire):
        """The _Request of a call, with the server's defaults for what it leaves out."""
        B, Nq, H, D = q4.shape
        Nk, Hkv = k4.shape[1], k4.shape[2]
        if options.get("target_rel_err") is not None:
            return None  # the server picks the configuration, attempt by attempt: sent whole
        mode, samples, eps = options.get("mode"), options.get("samples"), options.get("window_eps")
        if mode is None or (mode == "lsh" and samples is None) or (mode == "window" and eps is None):
            d = self._server_defaults()
            names = {1: "exact", 2: "lsh", 3: "window"}
            mode = mode or names.get(d.mode, "lsh")
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
                        heads_only=mode == "lsh" and options.get("sampling") not in (None, "iid"))
