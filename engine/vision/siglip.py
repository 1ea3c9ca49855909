"""The gemma3 projector (SigLIP ViT + Gemma 3's multimodal projector) in MLX, fed from an mmproj's
tensors by their llama.cpp names, computing what clip.cpp's `clip_graph_siglip` computes:

  patch conv (with bias) -> + learned positions -> blocks (LayerNorm, biased q/k/v, softmax attention,
  biased out, residual; LayerNorm, fc1, GELU, fc2, residual) -> post-LayerNorm ->
  2-D average pool (pool x pool patches) -> RMSNorm (soft_emb_norm) -> @ input_projection

Written here rather than taken from mlx-vlm (its gemma3 VisionModel would fit): mlx-vlm 0.7.10
declares opencv-python, datasets, mlx-audio, fastapi and more as requirements and its package import
pulls its generation stack (transformers processors) in; this tower is ~80 lines of mlx.core on the
same tensors, with no layout conversion (the conv is a matmul over patches in GGUF's own order).
On the CPU its matmuls and attention run through numpy's BLAS (`_matmul`, `_attention`: MLX's CPU
matmul measured 15x slower on Linux); on a GPU everything stays in MLX.
"""
from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from engine.device import on_gpu
from engine.vision.mmproj import Projector


def _matmul(x: mx.array, weight: mx.array) -> mx.array:
    """x @ weight. On the CPU through numpy's BLAS for float32: MLX's CPU matmul on Linux measured
    15x slower than OpenBLAS on the tower's shapes (1,179 ms against 76 ms for 256x1152 @ 1152x4304,
    docs/VISION.md), and the tower is almost all matmuls; on a GPU it stays in MLX."""
    if on_gpu() or x.dtype != mx.float32 or weight.dtype != mx.float32:
        return x @ weight
    return mx.array(np.asarray(x) @ np.asarray(weight))


def _attention(q: mx.array, k: mx.array, v: mx.array, scale: float) -> mx.array:
    """Softmax attention over (1, heads, n, d), every patch seeing every other. On the CPU in numpy,
    float32, as _matmul (MLX's CPU attention took 224 ms where the matmuls' BLAS takes a few), one head
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


def _linear(x: mx.array, w: dict, name: str) -> mx.array:
    y = _matmul(x, w[name + ".weight"].T)
    b = w.get(name + ".bias")
    return y if b is None else y + b


def _ln(x: mx.array, w: dict, name: str, eps: float) -> mx.array:
    return mx.fast.layer_norm(x, w[name + ".weight"], w.get(name + ".bias"), eps)


def patch_embed(pixels: mx.array, w: dict, patch: int) -> mx.array:
    """(H, W, 3) normalised pixels -> (n_patches, width): the conv as a matmul over patches, the
    patches in row-major order (clip.cpp's conv output order)."""
    h, wd, _ = pixels.shape
    sy, sx = h // patch, wd // patch
    chw = pixels.transpose(2, 0, 1).reshape(3, sy, patch, sx, patch)
    patches = chw.transpose(1, 3, 0, 2, 4).reshape(sy * sx, 3 * patch * patch)
    kernel = w["v.patch_embd.weight"]
    out = _matmul(patches, kernel.reshape(kernel.shape[0], -1).T)
    b = w.get("v.patch_embd.bias")
    return out if b is None else out + b


def _block(x: mx.array, w: dict, i: int, n_head: int, eps: float, gelu: bool) -> mx.array:
    p = f"v.blk.{i}."
    n, width = x.shape
    d = width // n_head
    h = _ln(x, w, p + "ln1", eps)
    q, k, v = (_linear(h, w, p + name).reshape(1, n, n_head, d).transpose(0, 2, 1, 3)
               for name in ("attn_q", "attn_k", "attn_v"))
    a = _attention(q, k, v, d ** -0.5)
    x = x + _linear(a.transpose(0, 2, 1, 3).reshape(n, width), w, p + "attn_out")
    h = _linear(_ln(x, w, p + "ln2", eps), w, p + "ffn_up")
    h = nn.gelu_approx(h) if gelu else nn.gelu_fast_approx(h)
    return x + _linear(h, w, p + "ffn_down")


def encode(proj: Projector, pixels: mx.array) -> mx.array:
    """(image_size, image_size, 3) preprocessed pixels -> (n_tokens, text_width) embeddings."""
    s, w = proj.spec, proj.weights
    x = patch_embed(pixels.astype(w["v.patch_embd.weight"].dtype), w, s.patch)
    x = x + w["v.position_embd.weight"]
    for i in range(s.n_layer):
        x = _block(x, w, i, s.n_head, s.eps, s.gelu)
    x = _ln(x, w, "v.post_ln", s.eps)
    side, k = s.side, s.pool
    x = x.reshape(side // k, k, side // k, k, s.width).mean(axis=(1, 3)).reshape(-1, s.width)
    x = mx.fast.rms_norm(x, w["mm.soft_emb_norm.weight"], s.eps)
    return _matmul(x, w["mm.input_projection.weight"])
