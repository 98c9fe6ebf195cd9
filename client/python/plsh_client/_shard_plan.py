"""The planning half of plsh_client.sharding, with no gRPC: SPEC section 5's
draws, the head and sequence cuts (client/lib/shard_plan.cpp's rules) and
the merge of the shards' estimates (client/lib/shard_merge.cpp).
ShardedClient (sharding.py) sends the shards and stitches the output.

What is here is what GetInfo cannot say: the maths of SPEC sections 1-5
that decide which keys a row may attend (the draws, block bounds, window
widths, the standard slopes), and how estimates pool. The backend constants
come from the server (GetInfoResponse.shard_row_align; the defaults a
request leaves out). These rules are not generated from the C++ planner's:
there is no generator for C++ into Python that would be simpler than
them, and tests/python/test_sharding.py pins them to the server's (the
draws and slopes bit for bit against return_draws, and the sharded output
bit for bit against the unsharded one in every mode and cut)."""

import math
from typing import Any, List, Optional

from ._slopes import standard_slopes

# What servers before GetInfoResponse.shard_row_align (0 there) aligned
# sequence shards to: the CPU backend's 128-row tile of that time.
LEGACY_ROW_ALIGN = 128
DEFAULT_MIN_SHARD_BYTES = 4 << 20   # automatic shard count: each shard at least this many bytes in and out

_MASK = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_INT64_MIN, _INT64_MAX = -(1 << 63), (1 << 63) - 1
_SINGLETON_PITCH = 0.5
_NO_WINDOW = _INT64_MAX


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


# --- plans ---

class _Request:
    """The request's shape and the options a cut depends on, resolved."""

    def __init__(self, B, Nq, Nk, H, Hkv, D, in_bytes, out_bytes, return_lse, causal, mode, q_pos0, k_pos0,
                 slopes, samples, seed, window_eps, window_width, heads_only=False, row_align=LEGACY_ROW_ALIGN):
        # heads_only: the keys a sequence shard needs are not computable here
        # (lsh with a sampler other than iid, whose draws this module does
        # not reimplement); head shards stay exact (every sampler's draws are
        # linear in the head index, as the seed translation needs).
        self.heads_only = heads_only
        self.row_align = row_align  # sequence shards start at multiples of it (GetInfoResponse.shard_row_align)
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
        self.draws: List[Any] = []
        if r.mode == "lsh":
            for h in range(r.H):
                self.draws += draw_hashes(r.seed, h, r.sigma(h), r.samples)
            self.draws.sort(key=lambda d: -d[0])  # longest pitches first: they reach furthest

    def lo(self, first):
        if self.r.mode == "exact":
            return _INT64_MIN
        if self.r.mode == "window":
            return _INT64_MIN if self.width == _NO_WINDOW else first - self.width
        best: Optional[int] = None
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
            best: Optional[int] = None
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
    align = r.row_align
    tiles = -(-r.Nq // align)
    n = min(parts, tiles)
    reach = _KeyReach(r)
    k_first, k_end = r.k_pos0, r.k_pos0 + r.Nk
    lo_memo, hi_memo = {}, {}

    def row_end(t):  # one past tile t - 1's last row
        return min(r.Nq, t * align)

    def first_key(t):
        if t not in lo_memo:
            lo_memo[t] = min(max(reach.lo(r.q_pos0 + t * align), k_first), k_end) - k_first
        return lo_memo[t]

    def end_key(t):
        if t not in hi_memo:
            hi_memo[t] = min(max(reach.hi(r.q_pos0 + row_end(t + 1) - 1), k_first), k_end) - k_first
        return hi_memo[t]

    def spec(a, b):
        j0 = first_key(a)
        return _spec(0, (0, r.H), (0, r.Hkv), (a * align, row_end(b)), (j0, max(j0, end_key(b - 1))), r)

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
    shards: List[Any] = []
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


def check_cut(shard_by, heads_only):
    """ValueError for shard_by "sequence" where the draws are not this module's to compute."""
    if shard_by == "sequence" and heads_only:
        raise ValueError("shard_by = 'sequence' with an lsh sampler other than iid: a sequence shard needs the keys "
                         "its rows' blocks reach, and this client computes only iid draws; expected shard_by 'heads' "
                         "or 'auto' (which cuts by heads), or sampling 'iid'")


def plan_shards(r, shards, shard_by, replicas, min_shard_bytes=DEFAULT_MIN_SHARD_BYTES):
    """The cut of request r (a _Request) for `replicas` replicas: a dict with
    kind ("single", "heads", "sequence"), shards (heads, kv_heads, rows, keys
    half-open, bytes), totals and a reason. ValueError for shard_by
    "sequence" with a sampler whose draws this module does not compute."""
    check_cut(shard_by, r.heads_only)
    whole = _plan("single", _whole(r))
    if shards == 0:
        by_size = max(1, whole["max_shard_bytes"] // min_shard_bytes) if min_shard_bytes > 0 else replicas
        parts = min(replicas, by_size)
        why = (f"automatic: {replicas} replica(s), {whole['max_shard_bytes'] / 2**20:.3g} MiB in and out"
               + (f" keeps {by_size} shard(s) of at least {min_shard_bytes / 2**20:.3g} MiB"
                  if by_size < replicas else "")
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
    best_kind, best = min(candidates,
                          key=lambda c: (c[1]["max_shard_bytes"], c[1]["sent_bytes"] + c[1]["received_bytes"]))
    reason = (why + f"{best['kind']} into {len(best['shards'])}: largest shard "
              f"{best['max_shard_bytes'] / 2**20:.3g} MiB in and out, {best['sent_bytes'] / 2**20:.3g} MiB sent in all")
    for kind, plan in candidates:
        if kind != best_kind:
            reason += (f"; {kind} would give {len(plan['shards'])} with largest "
                       f"{plan['max_shard_bytes'] / 2**20:.3g} MiB, {plan['sent_bytes'] / 2**20:.3g} MiB sent")
    best["reason"] = reason
    return best


# --- merging the estimates (plsh/sharding.h, merge_results) ---

POOLING = {
    "single": "one shard: the server's estimates as they came",
    "heads": "heads: each head's estimates come whole from its shard (mask_max_err as unsharded; the probe samples its "
             "rows from the shard's seed); the request's probe rel_err pools heads weighted by probe rows x mean "
             "||out||^2 (approximate); rows, max_abs_err, bound_max exact",
    "sequence": "sequence: per head, mask_max_err is the max over shards (as unsharded: each shard's keys reach one "
                "past its rows' blocks or window), mask_spectral_err the root sum of squares (an upper bound), the "
                "probe pools each shard's own rows weighted by probe rows x mean ||out||^2 (approximate); rows, "
                "max_abs_err, bound_max exact",
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
