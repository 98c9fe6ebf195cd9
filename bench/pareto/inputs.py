"""Input families for the accuracy benchmarks (bench/pareto/*.py).

Each family is a function (n, heads, kv_heads, head_dim, rng) -> (q, k, v),
float32 arrays [1, n, H, D] / [1, n, Hkv, D]. They are chosen so that the
approximations fail in different ways:

- gauss:     q, k, v ~ N(0, 1). Attention is spread over the ALiBi decay;
             rows err alike.
- peaked:    q and k share a rank-4 part (q_i += c A u_i, k_j += c A w_j with
             A [4, D] orthonormal rows, u, w ~ N(0, I_4), c = 2): a few keys
             dominate each row, so a row's error hangs on the mask at those
             keys and the error is heavy-tailed across rows.
- longrange: Gaussian, plus "anchor" keys every 256 positions that every
             query matches strongly (logit about +12 over the rest): attention
             reaches thousands of positions back in the wide heads, which a
             window cuts and lsh samples rarely.
- sharp:     Gaussian q and k scaled by 3 (logits of std 9): nearly one-hot
             rows, the heaviest tail across rows.
"""

import numpy as np


def _gauss(shape, rng):
    return rng.standard_normal(shape, dtype=np.float64)


def gauss(n, heads, kv_heads, head_dim, rng):
    q = _gauss((1, n, heads, head_dim), rng)
    k = _gauss((1, n, kv_heads, head_dim), rng)
    v = _gauss((1, n, kv_heads, head_dim), rng)
    return q, k, v


def _basis(rank, head_dim, rng):
    a = _gauss((head_dim, rank), rng)
    qmat, _ = np.linalg.qr(a)
    return qmat.T  # [rank, D], orthonormal rows


def peaked(n, heads, kv_heads, head_dim, rng, c=2.0, rank=4):
    q, k, v = gauss(n, heads, kv_heads, head_dim, rng)
    for h in range(kv_heads):
        basis = _basis(rank, head_dim, rng)
        k[0, :, h, :] += c * _gauss((n, rank), rng) @ basis
        for g in range(heads // kv_heads):
            q[0, :, h * (heads // kv_heads) + g, :] += c * _gauss((n, rank), rng) @ basis
    return q, k, v


def longrange(n, heads, kv_heads, head_dim, rng, every=256, strength=12.0):
    q, k, v = gauss(n, heads, kv_heads, head_dim, rng)
    direction = _gauss((head_dim,), rng)
    direction /= np.linalg.norm(direction)
    # logit = scale * q.k: with q's component sqrt(strength*sqrt(D)) along the
    # direction and the anchors' likewise, the anchors gain ~strength.
    amp = np.sqrt(strength * np.sqrt(head_dim))
    q += amp * direction
    anchors = np.arange(every // 2, n, every)
    k[0, anchors, :, :] += amp * direction
    return q, k, v


def sharp(n, heads, kv_heads, head_dim, rng, factor=3.0):
    q, k, v = gauss(n, heads, kv_heads, head_dim, rng)
    return factor * q, factor * k, v


FAMILIES = {"gauss": gauss, "peaked": peaked, "longrange": longrange, "sharp": sharp}


def make(family, n, heads, kv_heads, head_dim, seed):
    rng = np.random.default_rng(seed)
    q, k, v = FAMILIES[family](n, heads, kv_heads, head_dim, rng)
    return tuple(np.ascontiguousarray(x, dtype=np.float32) for x in (q, k, v))
