"""Does attention cost more the first time it sees a shape? (a diagnostic for bench/turns.py on CUDA)

    python bench/sdpa_probe.py

mx.fast.scaled_dot_product_attention with Llama-1B's heads (32 query, 8 K/V, head 64, float16),
L new queries over K keys, causal: ms per call (evaluated) for (a) the same shape 10 times, (b) a
new (L, K) pair every call, as each turn of a returning conversation is, (c) one query (a decode
step) at a new K every call, and (d) (b) with an explicit additive mask array instead of "causal".
"""
from __future__ import annotations

import statistics
import time

import mlx.core as mx


def timed(shape, mask, n=10):
    """shape(i) -> (L, K); inputs are made and evaluated before the clock starts."""
    xs = []
    for i in range(n):
        L, K = shape(i)
        q, k, m = _inputs(L, K, mask)
        t = time.perf_counter()
        mx.eval(mx.fast.scaled_dot_product_attention(q, k, k, scale=0.125, mask=m))
        xs.append((time.perf_counter() - t) * 1e3)
    return statistics.median(xs), max(xs)


DT = mx.float16 if mx.default_device() == mx.gpu else mx.float32


def _inputs(L, K, mask):
    q = mx.random.normal((1, 32, L, 64)).astype(DT)
    k = mx.random.normal((1, 8, K, 64)).astype(DT)
    m = mx.triu(mx.full((L, K), -mx.inf, dtype=DT), k=K - L + 1) if mask == "array" else mask
    mx.eval(q, k, m) if mask == "array" else mx.eval(q, k)
    return q, k, m


def main() -> None:
    timed(lambda i: (33, 2033), "causal", 2)
    print(f"mlx {mx.__version__} on {mx.default_device()}, {DT}")
    for name, shape, mask in [("same shape (L 33, K 2033)", lambda i: (33, 2033), "causal"),
                              ("new shape each call (L 34+i, K 3000+37i)", lambda i: (34 + i, 3000 + 37 * i), "causal"),
                              ("decode, new K each call (L 1, K 5000+i)", lambda i: (1, 5000 + i), None),
                              ("new shape, mask array (L 50+i, K 7000+37i)", lambda i: (50 + i, 7000 + 37 * i), "array")]:
        med, worst = timed(shape, mask)
        print(f"{name}: median {med:.2f} ms, max {worst:.2f} ms")


if __name__ == "__main__":
    main()
