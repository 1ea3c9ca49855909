"""The gemma4v projector (Gemma 4's vision encoder and multimodal embedder), computing what clip.cpp's
`clip_graph_gemma4v` computes:

  pixels * 2 - 1 -> patch conv (no bias) -> + learned x and y position rows (`v.position_embd`: two
  tables, column and row) -> RMS-norm blocks (q/k RMS-normed per head, 2-D RoPE: the first half of
  each head rotated by the patch's column, the second by its row, NEOX pairs, base 100; V RMS-normed
  without weight; attention scale 1; post-attention and post-FFN norms; gated FFN; a per-layer output
  scale) -> average pool (`clip.vision.projector.scale_factor` patches a side, 3 when absent) -> *
  sqrt(width) -> (x - v.std_bias) * v.std_scale -> RMS norm -> the input projection.

Every matmul is Gemma4ClippableLinear where the file has the clamps: the input clamped to
`<weight>.input_min/max`, the output to `<weight>.output_min/max` (scalars beside the weight).

Preprocessing is libmtmd's dynamic size (`mtmd_image_preprocessor_dyn_size`): the image keeps its
aspect, each side a multiple of patch x pool, scaled into a budget of 70 to 1,120 tokens (llama.cpp's
fixed limits for Gemma 4), resized bicubic onto that canvas (PAD_CEIL: the rest black). An image is
`<|image>`, its tokens, `<image|>`; libmtmd decodes them non-causally except for the E2B and E4B
widths (1536, 2560), where they stay causal (engine/vision/feed.py's feed_gemma4).
"""
from __future__ import annotations

import dataclasses
import math

import mlx.core as mx
import numpy as np
from PIL import Image

from engine.errors import ModelFileError, RequestError
from engine.vision import vit
from engine.vision.feed import feed_gemma4
from engine.vision.mmproj import VisionSpec
from engine.vision.preprocess import fit_padded, normalize, smart_size
from engine.vision.towers import ImageFeatures, PreparedImage, Tower

DEFAULT_POOL = 3            # clip.cpp's pooling_kernel_size when the file has no scale factor
MIN_TOKENS, MAX_TOKENS = 70, 1120   # clip.cpp's set_limit_image_tokens(70, 1120) for gemma4v
ROPE_THETA = 100.0
CAUSAL_WIDTHS = (1536, 2560)        # mtmd_decode_use_non_causal: E2B and E4B decode images causally


@dataclasses.dataclass(frozen=True)
class Gemma4VisionSpec(VisionSpec):
    """VisionSpec with gemma4v's own: the token budget an image is scaled into and the FFN's activation
    ("gelu", "silu" or "gelu_quick": clip.cpp's choice from clip.use_gelu / clip.use_silu)."""
    min_tokens: int = MIN_TOKENS
    max_image_tokens: int = MAX_TOKENS
    ffn: str = "gelu_quick"

    @property
    def max_patches(self) -> int:
        return self.max_image_tokens * self.pool * self.pool


def read_spec(g, spec) -> Gemma4VisionSpec:
    use_gelu, use_silu = bool(g.get("clip.use_gelu", False)), bool(g.get("clip.use_silu", False))
    if use_gelu and use_silu:
        raise ModelFileError(f"{g.path.name}: both clip.use_gelu and clip.use_silu are set")
    ffn = "gelu" if use_gelu else "silu" if use_silu else "gelu_quick"
    return Gemma4VisionSpec(**{**spec.__dict__, "pool": spec.pool or DEFAULT_POOL}, ffn=ffn)


def max_tokens(spec) -> int:
    return spec.max_image_tokens


def canvas(width: int, height: int, spec) -> tuple[int, int]:
    """The (width, height) libmtmd resizes an image of this size to."""
    area = spec.patch * spec.patch * spec.pool * spec.pool
    return smart_size(width, height, spec.patch * spec.pool, spec.min_tokens * area, spec.max_image_tokens * area)


def prepare(rgb: np.ndarray, spec) -> PreparedImage:
    h, w = rgb.shape[:2]
    cw, ch = canvas(w, h, spec)
    pixels = normalize(fit_padded(rgb, cw, ch, Image.BICUBIC), spec)
    rows, cols = ch // spec.patch, cw // spec.patch
    return PreparedImage(pixels, (rows, cols), (rows // spec.pool) * (cols // spec.pool))


def _mm(x: mx.array, w: dict, name: str) -> mx.array:
    """Gemma4ClippableLinear: x @ name.weight^T with the file's input/output clamps (and bias)."""
    lo, hi = w.get(name + ".input_min"), w.get(name + ".input_max")
    if lo is not None or hi is not None:
        x = mx.clip(x, lo, hi)
    y = vit.matmul(x, w[name + ".weight"].T)
    b = w.get(name + ".bias")
    y = y if b is None else y + b
    lo, hi = w.get(name + ".output_min"), w.get(name + ".output_max")
    return y if lo is None and hi is None else mx.clip(y, lo, hi)


def _rms(x: mx.array, w: dict, name: str, eps: float) -> mx.array:
    y = mx.fast.rms_norm(x, w.get(name + ".weight"), eps)
    b = w.get(name + ".bias")
    return y if b is None else y + b


def rope_tables(cols: np.ndarray, rows: np.ndarray, head_dim: int) -> tuple[mx.array, mx.array]:
    """cos and sin (n, head_dim / 2) for the two halves of a head: ggml's NEOX RoPE over head_dim / 2
    dims at the patch's column (first half) and row (second half); the angles as ggml builds them
    (the position times theta_scale^i, multiplied up in float32)."""
    n_dims = head_dim // 2
    scale = np.float32(ROPE_THETA) ** np.float32(-2.0 / n_dims)
    cos, sin = [], []
    for pos in (cols, rows):
        steps = np.full((len(pos), n_dims // 2), scale, dtype=np.float32)
        steps[:, 0] = pos.astype(np.float32)
        theta = np.cumprod(steps, axis=1, dtype=np.float32)
        cos.append(np.cos(theta))
        sin.append(np.sin(theta))
    return mx.array(np.concatenate(cos, 1)), mx.array(np.concatenate(sin, 1))


def _rope(x: mx.array, cos: mx.array, sin: mx.array) -> mx.array:
    """x (n, heads, d): each half of a head rotated NEOX-style (pairs i, i + d/4) by its own angles."""
    d = x.shape[-1]
    q = d // 4
    out = []
    for h in range(2):
        part = x[..., h * d // 2:(h + 1) * d // 2]
        c, s = cos[:, None, h * q:(h + 1) * q], sin[:, None, h * q:(h + 1) * q]
        a, b = part[..., :q], part[..., q:]
        out += [a * c - b * s, a * s + b * c]
    return mx.concatenate(out, axis=-1)


def _attention(x: mx.array, w: dict, p: str, spec, cos: mx.array, sin: mx.array) -> mx.array:
    n, width = x.shape
    d = width // spec.n_head
    q, k, v = (_mm(x, w, p + name) for name in ("attn_q", "attn_k", "attn_v"))
    per_head = p + "attn_q_norm.weight" in w and w[p + "attn_q_norm.weight"].shape[-1] == d
    if not per_head:
        q = _rms(q, w, p + "attn_q_norm", spec.eps) if p + "attn_q_norm.weight" in w else q
        k = _rms(k, w, p + "attn_k_norm", spec.eps) if p + "attn_k_norm.weight" in w else k
    q, k, v = (t.reshape(n, spec.n_head, d) for t in (q, k, v))
    if per_head:
        q = _rms(q, w, p + "attn_q_norm", spec.eps)
        k = _rms(k, w, p + "attn_k_norm", spec.eps) if p + "attn_k_norm.weight" in w else k
    q, k = _rope(q, cos, sin), _rope(k, cos, sin)
    v = mx.fast.rms_norm(v, None, spec.eps)
    a = vit.attention(*(t.transpose(1, 0, 2)[None] for t in (q, k, v)), 1.0)
    return _mm(a[0].transpose(1, 0, 2).reshape(n, width), w, p + "attn_out")


def _ffn(x: mx.array, w: dict, p: str, act) -> mx.array:
    up = _mm(x, w, p + "ffn_up")
    y = act(_mm(x, w, p + "ffn_gate")) * up if p + "ffn_gate.weight" in w else act(up)
    return _mm(y, w, p + "ffn_down")


def _scaled(x: mx.array, w: dict, name: str) -> mx.array:
    s = w.get(name)
    return x if s is None else x * s


def block(x: mx.array, w: dict, i: int, spec, act, cos: mx.array, sin: mx.array) -> mx.array:
    """One encoder block `v.blk.{i}` as clip.cpp's build_vit builds it for gemma4v (RMS norms)."""
    p, eps = f"v.blk.{i}.", spec.eps
    h = _scaled(_attention(_rms(x, w, p + "ln1", eps), w, p, spec, cos, sin), w, p + "ls1.weight")
    if p + "attn_post_norm.weight" in w:
        h = _rms(h, w, p + "attn_post_norm", eps)
    x = x + h
    h = _ffn(_rms(x, w, p + "ln2", eps), w, p, act)
    if p + "ffn_post_norm.weight" in w:
        h = _rms(h, w, p + "ffn_post_norm", eps)
    return _scaled(x + _scaled(h, w, p + "ls2.weight"), w, p + "out_scale.weight")


def _positions(x: mx.array, w: dict, rows: int, cols: int) -> mx.array:
    table = w["v.position_embd.weight"]         # (2, positions, width): columns, then rows
    if max(rows, cols) > table.shape[1]:
        raise RequestError(f"an image of {cols} x {rows} patches is beyond the projector's "
                           f"{table.shape[1]} positions a side")
    idx = np.arange(rows * cols)
    x = x + table[0][mx.array(idx % cols)]
    return x + table[1][mx.array(idx // cols)]


def encode(proj, prepared: PreparedImage) -> mx.array:
    """The prepared image -> (n_tokens, text_width) embeddings."""
    s, w = proj.spec, proj.weights
    rows, cols = prepared.grid
    pixels = mx.array(prepared.pixels) * 2.0 - 1.0
    x = _positions(vit.patch_embed(pixels.astype(w["v.patch_embd.weight"].dtype), w, s.patch), w, rows, cols)
    idx = np.arange(rows * cols)
    cos, sin = rope_tables(idx % cols, idx // cols, s.width // s.n_head)
    act = vit.activation(s.ffn)
    for i in range(s.n_layer):
        x = block(x, w, i, s, act, cos, sin)
    k = s.pool
    x = x.reshape(rows // k, k, cols // k, k, s.width).mean(axis=(1, 3)).reshape(-1, s.width)
    x = x * math.sqrt(s.width)
    if "v.std_bias" in w and "v.std_scale" in w:
        x = (x - w["v.std_bias"]) * w["v.std_scale"]
    return _mm(mx.fast.rms_norm(x, None, s.eps), w, "mm.input_projection")


def feed(model, cache, features: ImageFeatures) -> None:
    both_ways = int(model.args.hidden_size) not in CAUSAL_WIDTHS
    feed_gemma4(model, cache, features.embeddings[None], both_ways)


def out_width(weights: dict) -> int:
    proj = weights.get("mm.input_projection.weight")
    if proj is None:
        raise ModelFileError("the projector has no mm.input_projection.weight")
    return int(proj.shape[0])


TOWER = Tower(name="gemma4v", text_archs=("gemma4",), markers=("<|image>", "<image|>"),
              read_spec=read_spec, out_width=out_width, prepare=prepare, encode=encode, feed=feed,
              max_tokens=max_tokens, token_range=(MIN_TOKENS, MAX_TOKENS),
              with_budget=lambda spec, n: dataclasses.replace(spec, max_image_tokens=n))
