"""Attention for a few new tokens over a long history, on MLX's CUDA backend.

Why: with more than one query, `mx.fast.scaled_dot_product_attention` on CUDA runs cuDNN's fused
attention, which builds an execution plan for every new (queries, keys) shape: ~37 ms on an H200
(bench/sdpa_probe.py), while the attention itself takes 0.09 ms. Every turn of a returning
conversation is a new shape (a new message length at a new offset), so that plan was most of a
parked turn's 52 ms time to first token. The explicit form here (scores matmul, masked softmax,
values matmul) runs MLX's precompiled kernels whatever the shape. It is used only for short query
chunks (<= EXPLICIT_MAX_QUERIES, and scores small enough), where it costs about what the fused
kernel does; long prefill chunks, whose shapes repeat from prompt to prompt, keep cuDNN's flash
attention. Metal and the CPU build their attention kernels per dtype and head size, not per length,
so they keep mlx-lm's path untouched: `install` is a no-op there.

mlx-lm's model files call `scaled_dot_product_attention` from their own module globals, so
`install` swaps that name in the loaded model's module (once; the wrapper forwards everything it
does not handle, e.g. quantized K/V or attention sinks, to mlx-lm's function). The swap is
process-wide for that mlx-lm module: raw mlx-lm run in the same process after a load (bench/engine.py)
gets it too, which keeps that comparison like for like (its 511-token prefill and one-query decode
steps take the fused and vector kernels anyway).
"""
from __future__ import annotations

import sys

import mlx.core as mx

from engine.device import on_cuda

EXPLICIT_MAX_QUERIES = 64          # a returning turn's new message; the engine's first prefill chunks
EXPLICIT_MAX_SCORES = 1 << 26      # heads x queries x keys: 256 MB of float32 scores at most


def explicit_attention(q: mx.array, k: mx.array, v: mx.array, *, scale: float, mask) -> mx.array:
    """softmax(q k^T * scale + mask) v with grouped K/V heads; q (B, Hq, L, D), k/v (B, Hk, K, D).
    mask: None, "causal" (the L queries are the last L of the K positions), a bool array (True =
    attend) or an additive array. The softmax runs in float32 (precise), as the fused kernels do.

    The query heads that share a K/V head are stacked as rows, (B, Hk, rep * L, D), so each matmul
    reads a K/V head once as a plain (K, D) operand instead of broadcasting it over the group."""
    b, hq, n_q, d = q.shape
    hk, n_k = k.shape[1], k.shape[2]
    rep = hq // hk
    scores = ((q * scale).reshape(b, hk, rep * n_q, d) @ k.swapaxes(-1, -2)).reshape(b, hk, rep, n_q, n_k)
    if isinstance(mask, str):
        if mask != "causal":
            raise ValueError(f"unknown attention mask {mask!r}")
        rows = mx.arange(n_k - n_q, n_k)[:, None]
        mask = rows >= mx.arange(n_k)[None]
    if mask is not None:
        if mask.dtype == mx.bool_:
            scores = mx.where(mask, scores, mx.array(-mx.inf, scores.dtype))
        else:
            scores = scores + mask
    weights = mx.softmax(scores, axis=-1, precise=True)
    return (weights.reshape(b, hk, rep * n_q, n_k) @ v).reshape(b, hq, n_q, v.shape[-1])


def use_explicit(q: mx.array, k: mx.array) -> bool:
    n_q = q.shape[2]
    return 1 < n_q <= EXPLICIT_MAX_QUERIES and q.shape[1] * n_q * k.shape[2] <= EXPLICIT_MAX_SCORES


def _wrap(original):
    def scaled_dot_product_attention(queries, keys, values, cache, scale, mask, sinks=None):
        if sinks is None and not hasattr(cache, "bits") and use_explicit(queries, keys):
            return explicit_attention(queries, keys, values, scale=scale, mask=mask)
        return original(queries, keys, values, cache, scale=scale, mask=mask, sinks=sinks)
    scaled_dot_product_attention.strata_original = original
    return scaled_dot_product_attention


def needed() -> bool:
    """Only MLX's CUDA backend plans attention per shape (see the module docstring)."""
    return on_cuda()


def install(model, *, force: bool = False) -> bool:
    """Route the model's short-chunk attention through `explicit_attention` where it pays (CUDA).
    Returns whether the model's module now uses it. `force` is for tests on other backends."""
    if not (force or needed()):
        return False
    module = sys.modules.get(type(model).__module__)
    current = getattr(module, "scaled_dot_product_attention", None)
    if current is None:
        return False
    if not hasattr(current, "strata_original"):
        module.scaled_dot_product_attention = _wrap(current)
    return True


def uninstall(model) -> None:
    module = sys.modules.get(type(model).__module__)
    current = getattr(module, "scaled_dot_product_attention", None)
    if current is not None and hasattr(current, "strata_original"):
        module.scaled_dot_product_attention = current.strata_original
