"""ALiBi slopes, bit for bit as kernels/src/params.cpp standard_slopes.

No imports on purpose: bench/gpu/peers.py loads this file by path on a GPU
machine without grpc, where `import plsh_client` (whose __init__ imports grpc)
would fail."""


def standard_slopes(heads):
    """ALiBi's slopes for `heads` heads (BLOOM's rule when not a power of two),
    as plsh_core's: start = 2^(-8/n), then a running product (start * start *
    ...), not start ** (i + 1), which differs by one ulp in 8 of 32 heads."""
    def powers(n):
        start = 2.0 ** (-8.0 / n)
        out, value = [], start
        for _ in range(n):
            out.append(value)
            value *= start
        return out
    if heads <= 0:
        return []
    p = 1
    while p * 2 <= heads:
        p *= 2
    slopes = powers(p)
    extra, i = powers(2 * p), 0
    while len(slopes) < heads:
        slopes.append(extra[i])
        i += 2
    return slopes
