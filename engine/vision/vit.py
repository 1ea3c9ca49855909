"""The operations every projector's vision transformer is made of, in MLX, over an mmproj's tensors by
their llama.cpp names (`v.blk.N.attn_q`, `...ffn_up`, ...): linear layers, norms, the patch conv as a
matmul, softmax attention and the pre-LN block clip.cpp's `build_vit` builds.

Written here rather than taken from mlx-vlm (its vision towers would fit): mlx-vlm 0.7.10 declares
opencv-python, datasets, mlx-audio, fastapi and more as requirements and its package import pulls its
generation stack (transformers processors) in; these are a few lines of mlx.core on the file's own
tensors, with no layout conversion (the conv is a matmul over patches in GGUF's own order).
On the CPU the matmuls and attention run through numpy's BLAS (`matmul`, `attention`: MLX's CPU matmul
measured 15x slower on Linux); on a GPU everything stays in MLX.
"""
from __future__ import annotations

import math
from typing import Callable

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from engine.device import on_gpu


def matmul(x: mx.array, weight: mx.array) -> mx.array:
    """x @ weight. On the CPU through numpy's BLAS for float32: MLX's CPU matmul on Linux measured
    15x slower than OpenBLAS on the tower's shapes (1,179 ms against 76 ms for 256x1152 @ 1152x4304,
    docs/VISION.md), and a tower is almost all matmuls; on a GPU it stays in MLX."""
    if on_gpu() or x.dtype != mx.float32 or weight.dtype != mx.float32:
        return x @ weight
    return mx.array(np.asarray(x) @ np.asarray(weight))


def attention(q: mx.array, k: mx.array, v: mx.array, scale: float) -> mx.array:
    """Softmax attention over (1, heads, n, d), every patch seeing every other. On the CPU in numpy,
    float32, as `matmul` (MLX's CPU attention took 224 ms where the matmuls' BLAS takes a few), one head
    at a time so the scores held are one head's (n x n), within the estimate's activations."""
    if on_gpu() or q.dtype != mx.float32:
        return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale)
    qn, kn, vn = np.asarray(q)[0], np.asarray(k)[0], np.asarray(v)[0]
    out = np.empty_like(qn)
    for h in range(qn.shape[0]):
        s = (qn[h] @ kn[h].T) * np.float32(scale)
        s -= s.max(axis=-1, keepdims=True)
        np.exp(s, out=s)
        s /= s.sum(axis=-1, keepdims=True)
        out[h] = s @ vn[h]
    return mx.array(out[None])


def linear(x: mx.array, w: dict, name: str) -> mx.array:
    """x @ `name`.weight^T (+ `name`.bias when the file has one)."""
    y = matmul(x, w[name + ".weight"].T)
    b = w.get(name + ".bias")
    return y if b is None else y + b


def layer_norm(x: mx.array, w: dict, name: str, eps: float) -> mx.array:
    return mx.fast.layer_norm(x, w[name + ".weight"], w.get(name + ".bias"), eps)


def patch_embed(pixels: mx.array, w: dict, patch: int) -> mx.array:
    """(H, W, 3) normalised pixels -> (n_patches, width): the conv as a matmul over patches, the
    patches in row-major order (clip.cpp's conv output order)."""
    h, wd, _ = pixels.shape
    sy, sx = h // patch, wd // patch
    chw = pixels.transpose(2, 0, 1).reshape(3, sy, patch, sx, patch)
    patches = chw.transpose(1, 3, 0, 2, 4).reshape(sy * sx, 3 * patch * patch)
    kernel = w["v.patch_embd.weight"]
    out = matmul(patches, kernel.reshape(kernel.shape[0], -1).T)
    b = w.get("v.patch_embd.bias")
    return out if b is None else out + b


_MLX_ACT = {"gelu": nn.gelu_approx, "silu": nn.silu, "gelu_quick": nn.gelu_fast_approx}


def np_activation(x: np.ndarray, name: str) -> np.ndarray:
    """clip.cpp's activations in numpy, float32: "gelu" (the tanh form), "silu", "gelu_quick"."""
    with np.errstate(over="ignore"):        # exp(-x) of a very negative x: inf, the activation 0
        if name == "silu":
            return x / (np.float32(1) + np.exp(-x))
        if name == "gelu_quick":
            return x / (np.float32(1) + np.exp(np.float32(-1.702) * x))
        c = np.float32(math.sqrt(2 / math.pi))
        return np.float32(0.5) * x * (np.float32(1) + np.tanh(c * (x + np.float32(0.044715) * x * x * x)))


def activation(name: str) -> Callable[[mx.array], mx.array]:
    """The MLP's activation by clip.cpp's name ("gelu": tanh form, "silu", "gelu_quick"). On the CPU in
    numpy for float32: MLX's CPU elementwise took 36.5 ms for GELU over 256 x 4304 where numpy took 4.7
    (two of them were a third of a 2-layer SigLIP's encode); on a GPU in MLX."""
    mlx_fn = _MLX_ACT[name]

    def act(x: mx.array) -> mx.array:
        if on_gpu() or x.dtype != mx.float32:
            return mlx_fn(x)
        return mx.array(np_activation(np.asarray(x), name))
    return act


def gelu(tanh_form: bool) -> Callable[[mx.array], mx.array]:
    """clip.cpp's activation: GELU (tanh form) when `clip.use_gelu` is set, else quick-GELU."""
    return activation("gelu" if tanh_form else "gelu_quick")


def block(x: mx.array, w: dict, i: int, n_head: int, eps: float, act: Callable[[mx.array], mx.array],
          rope: Callable[[mx.array], mx.array] | None = None) -> mx.array:
    """One pre-LN encoder block `v.blk.{i}` over (n, width): LayerNorm, biased q/k/v (`rope` applied to
    q and k, shaped (1, heads, n, d), where the tower positions patches that way), softmax attention,
    out, residual; LayerNorm, ffn_up, `act`, ffn_down, residual."""
    p = f"v.blk.{i}."
    n, width = x.shape
    d = width // n_head
    h = layer_norm(x, w, p + "ln1", eps)
    q, k, v = (linear(h, w, p + name).reshape(1, n, n_head, d).transpose(0, 2, 1, 3)
               for name in ("attn_q", "attn_k", "attn_v"))
    if rope is not None:
        q, k = rope(q), rope(k)
    a = attention(q, k, v, d ** -0.5)
    x = x + linear(a.transpose(0, 2, 1, 3).reshape(n, width), w, p + "attn_out")
    h = act(linear(layer_norm(x, w, p + "ln2", eps), w, p + "ffn_up"))
    return x + linear(h, w, p + "ffn_down")
