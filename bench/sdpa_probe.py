"""Does attention cost more the first time it sees a shape? (a diagnostic for bench/turns.py on CUDA)

    python bench/sdpa_probe.py [--turns]

Llama-1B's heads (32 query, 8 K/V, head 64, float16 on a GPU), L new queries over K keys, causal:
ms per call (evaluated), for MLX's fused `mx.fast.scaled_dot_product_attention` ("fused") and the
engine's explicit form for short chunks (engine/model/attention.py, "explicit"), over (a) the same shape
10 times, (b) a new (L, K) pair every call, as each turn of a returning conversation is, (c) one
query (a decode step) at a new K every call, (d) (b) with an explicit mask array, and (e) the
prefill chunk sizes, repeated, to show where the explicit form stops paying; (f) a returning turn's
33 queries over 53, 2,033 and 8,033 keys: the explicit form as it runs, without its mask, and over
keys padded to a multiple of 8 (session 4's engine did that; it was slower end to end and removed in
session 5, bench/gpu.md). The broadcast form these rows
replaced is in bench/gpu.md, session 4 (commit f149c6c has both).
"""
from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.harness import Run  # noqa: E402
from engine.model.attention import explicit_attention  # noqa: E402

RUN = Run()         # figures to $BENCH_RESULTS or bench/results/results.jsonl (no argparse here)

DT = mx.float16 if mx.default_device() == mx.gpu else mx.float32


def fused(q, k, m):
    return mx.fast.scaled_dot_product_attention(q, k, k, scale=0.125, mask=m)


def explicit(q, k, m):
    return explicit_attention(q, k, k, scale=0.125, mask=m)


def timed(fn, shape, mask, n=10):
    """shape(i) -> (L, K); inputs are made and evaluated before the clock starts."""
    xs = []
    for i in range(n):
        L, K = shape(i)
        q, k, m = _inputs(L, K, mask)
        t = time.perf_counter()
        mx.eval(fn(q, k, m))
        xs.append((time.perf_counter() - t) * 1e3)
    return statistics.median(xs), max(xs), xs[0]


def _inputs(L, K, mask):
    q = mx.random.normal((1, 32, L, 64)).astype(DT)
    k = mx.random.normal((1, 8, K, 64)).astype(DT)
    m = mx.triu(mx.full((L, K), -mx.inf, dtype=DT), k=K - L + 1) if mask == "array" else mask
    mx.eval(q, k, m) if mask == "array" else mx.eval(q, k)
    return q, k, m


def _padded(L, K, pad):
    """Inputs over K rounded up to `pad` keys, the extra keys masked off (a bool mask array)."""
    Kp = -(-K // pad) * pad
    q = mx.random.normal((1, 32, L, 64)).astype(DT)
    k = mx.random.normal((1, 8, Kp, 64)).astype(DT)
    cols = mx.arange(Kp)[None]
    m = (cols <= mx.arange(K - L, K)[:, None]) & (cols < K)
    mx.eval(q, k, m)
    return q, k, m


def returning_turns() -> None:
    for K in (53, 2033, 8033):
        med, worst, first = timed(explicit, lambda i, K=K: (33, K), "causal", n=20)
        RUN.record(f"returning turn (L 33, K {K}) explicit", med, "ms", max=worst,
                   line=f"returning turn (L 33, K {K}) explicit (rows): median {med:.3f} ms, max {worst:.2f} ms")
        med, worst, _ = timed(explicit, lambda i, K=K: (33, K), None, n=20)
        RUN.record(f"returning turn (L 33, K {K}) explicit, no mask", med, "ms", max=worst,
                   line=f"returning turn (L 33, K {K}) explicit (rows), no mask (what the mask costs): "
                        f"median {med:.3f} ms")
        for pad in (8, 64):
            q, k, m = _padded(33, K, pad)
            xs = []
            for _ in range(20):
                t = time.perf_counter()
                mx.eval(explicit(q, k, m))
                xs.append((time.perf_counter() - t) * 1e3)
            RUN.record(f"returning turn (L 33, K {K}) explicit, keys padded to {pad}", statistics.median(xs), "ms",
                       spread=xs, line=f"returning turn (L 33, K {K}) explicit (rows), keys padded to a multiple of "
                                       f"{pad}: median {statistics.median(xs):.3f} ms, max {max(xs):.2f} ms")


def main() -> None:
    print(f"mlx {mx.__version__} on {mx.default_device()}, {DT}")
    if "--turns" in sys.argv[1:]:            # (f) alone
        returning_turns()
        return
    for fn_name, fn in [("explicit", explicit), ("fused", fused)]:   # explicit first: it needs no plan
        t = time.perf_counter()
        mx.eval(fn(*_inputs(33, 2033, "causal")))
        print(f"{fn_name}: first call ever (L 33, K 2033): {(time.perf_counter() - t) * 1e3:.1f} ms")
    cases = [("same shape (L 33, K 2033)", lambda i: (33, 2033), "causal"),
             ("new shape each call (L 34+i, K 3000+37i)", lambda i: (34 + i, 3000 + 37 * i), "causal"),
             ("new shape, short (L 2+i, K 9000+37i)", lambda i: (2 + i, 9000 + 37 * i), "causal"),
             ("new shape, L 64 (K 20000+37i)", lambda i: (64, 20000 + 37 * i), "causal"),
             ("decode, new K each call (L 1, K 5000+i)", lambda i: (1, 5000 + i), None),
             ("new shape, mask array (L 50+i, K 7000+37i)", lambda i: (50 + i, 7000 + 37 * i), "array")]
    cases += [(f"prefill chunk, same shape (L {L}, K {K})", (lambda L, K: lambda i: (L, K))(L, K), "causal")
              for L, K in [(16, 16), (64, 128), (128, 256), (512, 512), (512, 2048), (512, 8192)]]
    for name, shape, mask in cases:
        for fn_name, fn in [("fused", fused), ("explicit", explicit)]:
            if fn is explicit and mask is None:
                continue
            med, worst, first = timed(fn, shape, mask)
            RUN.record(f"{name} {fn_name}", med, "ms", max=worst, first=first,
                       line=f"{name} {fn_name}: median {med:.3f} ms, max {worst:.2f} ms, first {first:.2f} ms")
    returning_turns()


if __name__ == "__main__":
    main()
