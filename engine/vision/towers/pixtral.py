"""The pixtral projector (Mistral 3, Mistral Small 3.1/3.2, Pixtral 12B, Magistral, Ministral 3 vision),
computing what llama.cpp's `clip_graph_pixtral` computes:

  patch conv (no bias) -> pre RMSNorm (`v.pre_ln`) -> RMSNorm blocks: bias-free q/k/v/out with 2-D RoPE
  (the first half of each head rotated by the patch's row, the second by its column; theta 10000,
  adjacent pairs as the converter's permuted q/k rows put them), a gated MLP (SiLU with `clip.use_silu`)
  -> with `clip.vision.spatial_merge_size` > 1 the patch merger (RMSNorm `mm.input_norm`, merge x merge
  patches unfolded into one row, `mm.patch_merger`) -> `mm.1`, GELU, `mm.2` -> the `[IMG_BREAK]` row
  (`v.token_embd.img_break`) after each row of tokens but the last.

Preprocessing is libmtmd's dynamic-size one: the target keeps the image's aspect ratio in whole
patch x merge squares, between 8 and 1024 tokens (before the break rows: llama.cpp's limits for
pixtral); the image is fitted into it with llama.cpp's Pillow-compatible bicubic filter (its padded
resize: where the rounding to whole squares changed the aspect, a black column or row). An image takes
rows x cols + rows - 1 tokens, then the text `[IMG_END]` (no text before it). Its tokens are decoded
causally (libmtmd's `mtmd_decode_use_non_causal` is false for pixtral) at ordinary positions, so
feeding is the text model's own forward pass over the embeddings (Ministral 3 or a llama-architecture
Mistral Small / Pixtral 12B text model).
"""
from __future__ import annotations

import dataclasses
import math

import mlx.core as mx
import numpy as np
from PIL import Image

from engine.device import on_gpu
from engine.errors import ModelFileError, RequestError
from engine.vision import vit
from engine.vision.feed import feed_causal
from engine.vision.mmproj import VisionSpec
from engine.vision.preprocess import fit_padded, normalize, smart_size
from engine.vision.towers import ImageFeatures, PreparedImage, Tower

ROPE_THETA = 10000.0        # clip.cpp's for pixtral (not in the file)
MIN_TOKENS, MAX_TOKENS = 8, 1024    # clip.cpp's token limits for pixtral (merged tokens, breaks not counted)


@dataclasses.dataclass(frozen=True)
class PixtralSpec(VisionSpec):
    """VisionSpec with pixtral's own: the MLP's activation (`clip.use_silu`/`clip.use_gelu`, gated)
    and the pixel bounds of a resized image (patch x merge pixels a token side). `pool` is the merge."""
    act: str = "silu"                 # "silu", "gelu" (tanh form) or "quick" (quick-GELU): clip.cpp's ffn_op
    min_pixels: int = 0
    max_pixels: int = 0

    @property
    def align(self) -> int:
        return self.patch * self.pool

    @property
    def side(self) -> int:
        """Patches a side of the largest square image (the memory estimate's image: MAX_TOKENS tokens)."""
        return math.isqrt(MAX_TOKENS) * self.pool


def read_spec(g, spec):
    merge = int(g.get("clip.vision.spatial_merge_size", 1) or 1)
    if merge < 1 or merge > 8:
        raise ModelFileError(f"{g.path.name}: bad clip.vision.spatial_merge_size {merge}")
    silu, gelu = bool(g.get("clip.use_silu", False)), bool(g.get("clip.use_gelu", False))
    if silu and gelu:
        raise ModelFileError(f"{g.path.name}: both clip.use_gelu and clip.use_silu are set")
    area = (spec.patch * merge) ** 2
    return PixtralSpec(**{**spec.__dict__, "pool": merge}, act="silu" if silu else "gelu" if gelu else "quick",
                       min_pixels=MIN_TOKENS * area, max_pixels=MAX_TOKENS * area)


def max_tokens(spec) -> int:
    """The most tokens an image may take: rows x cols + rows - 1 <= 2 x MAX_TOKENS for any image whose
    resized size keeps within the pixel bound (a strip too thin for it is refused in `prepare`)."""
    return 2 * MAX_TOKENS


def n_tokens(rows: int, cols: int) -> int:
    """rows x cols image tokens and an [IMG_BREAK] between two rows."""
    return rows * cols + rows - 1


def prepare(rgb: np.ndarray, spec) -> PreparedImage:
    h, w = rgb.shape[:2]
    tw, th = smart_size(w, h, spec.align, spec.min_pixels, spec.max_pixels)
    rows, cols = th // spec.align, tw // spec.align
    n = n_tokens(rows, cols)
    if n > max_tokens(spec):
        raise RequestError(f"a {w}x{h} image would take {n} image tokens (at most {max_tokens(spec)}): "
                           f"its sides are too far apart")
    px = fit_padded(rgb, tw, th, Image.BICUBIC)
    return PreparedImage(normalize(px, spec), (rows, cols), n)


def rope_2d(rows: int, cols: int, d_head: int) -> tuple[mx.array, mx.array]:
    """(cos, sin), each (patches, d_head / 2): clip.cpp's `build_rope_2d` with interleaved frequencies.
    A head's first half is rotated by the patch's row at frequencies theta^(-4i/d), its second half by
    the column at theta^(-(4i+2)/d), i < d/4, each over adjacent pairs (ggml's normal RoPE)."""
    quarter = d_head // 4
    base = np.float32(ROPE_THETA) ** (-np.arange(quarter, dtype=np.float32) * np.float32(4.0 / d_head))
    odd = np.float32(ROPE_THETA) ** np.float32(-2.0 / d_head)
    r, c = np.divmod(np.arange(rows * cols, dtype=np.float32), np.float32(cols))
    angles = np.concatenate([r[:, None] * base[None], c[:, None] * (base * odd)[None]], axis=1)
    return mx.array(np.cos(angles)), mx.array(np.sin(angles))


def apply_rope(x: mx.array, cos: mx.array, sin: mx.array) -> mx.array:
    """(1, heads, n, d) rotated pairwise (x[2j], x[2j+1]) by the angles of `rope_2d`."""
    b, h, n, d = x.shape
    cos, sin = cos.astype(x.dtype), sin.astype(x.dtype)
    pairs = x.reshape(b, h, n, d // 2, 2)
    x0, x1 = pairs[..., 0], pairs[..., 1]
    return mx.stack([x0 * cos - x1 * sin, x0 * sin + x1 * cos], axis=-1).reshape(b, h, n, d)


def gated(gate: mx.array, up: mx.array, act: str) -> mx.array:
    """clip.cpp's gated FFN ops (swiglu / geglu in the tanh form / geglu-quick): act(gate) * up. On the
    CPU in numpy for float32: MLX's CPU elementwise took 205-361 ms for a 768 x 4096 SiLU and product
    where numpy took 54-76 ms (a Mistral Small image's MLP is 3,072 x 4,096 a layer); MLX on a GPU."""
    if on_gpu() or gate.dtype != mx.float32:
        return vit.activation("gelu_quick" if act == "quick" else act)(gate) * up
    return mx.array(vit.np_activation(np.asarray(gate), "gelu_quick" if act == "quick" else act) * np.asarray(up))


def block(x: mx.array, w: dict, i: int, s, rope) -> mx.array:
    """One block `v.blk.{i}`: RMSNorm, q/k/v with 2-D RoPE, softmax attention over every patch, out,
    residual; RMSNorm, act(gate) * up, down, residual."""
    p = f"v.blk.{i}."
    n, width = x.shape
    d = width // s.n_head
    h = mx.fast.rms_norm(x, w[p + "ln1.weight"], s.eps)
    q, k, v = (vit.linear(h, w, p + name).reshape(1, n, s.n_head, d).transpose(0, 2, 1, 3)
               for name in ("attn_q", "attn_k", "attn_v"))
    q, k = apply_rope(q, *rope), apply_rope(k, *rope)
    a = vit.attention(q, k, v, d ** -0.5)
    x = x + vit.linear(a.transpose(0, 2, 1, 3).reshape(n, width), w, p + "attn_out")
    h = mx.fast.rms_norm(x, w[p + "ln2.weight"], s.eps)
    h = gated(vit.linear(h, w, p + "ffn_gate"), vit.linear(h, w, p + "ffn_up"), s.act)
    return x + vit.linear(h, w, p + "ffn_down")


def merge_patches(x: mx.array, w: dict, s, rows: int, cols: int) -> mx.array:
    """Mistral Small 3.1's patch merger: RMSNorm, each merge x merge square of patches unfolded into one
    row (channel-major, then the square's rows and columns: torch's unfold), `mm.patch_merger`."""
    m = s.pool
    x = mx.fast.rms_norm(x, w["mm.input_norm.weight"], s.eps)
    x = x.reshape(rows // m, m, cols // m, m, s.width).transpose(0, 2, 4, 1, 3)
    return vit.matmul(x.reshape(-1, s.width * m * m), w["mm.patch_merger.weight"].T)


def with_breaks(x: mx.array, w: dict, rows: int, cols: int) -> mx.array:
    """The `[IMG_BREAK]` row after each row of tokens but the last."""
    brk = w["v.token_embd.img_break"]
    grid = x.reshape(rows, cols, -1)
    grid = mx.concatenate([grid, mx.broadcast_to(brk.astype(x.dtype), (rows, 1, grid.shape[-1]))], axis=1)
    return grid.reshape(rows * (cols + 1), -1)[:-1]


def encode(proj, prepared: PreparedImage) -> mx.array:
    """The prepared image -> (n_tokens, text_width) embeddings, [IMG_BREAK] rows included."""
    s, w = proj.spec, proj.weights
    pixels = mx.array(prepared.pixels).astype(w["v.patch_embd.weight"].dtype)
    prow, pcol = prepared.pixels.shape[0] // s.patch, prepared.pixels.shape[1] // s.patch
    x = mx.fast.rms_norm(vit.patch_embed(pixels, w, s.patch), w["v.pre_ln.weight"], s.eps)
    rope = rope_2d(prow, pcol, s.width // s.n_head)
    for i in range(s.n_layer):
        x = block(x, w, i, s, rope)
    if "mm.patch_merger.weight" in w:
        x = merge_patches(x, w, s, prow, pcol)
    x = vit.linear(vit.activation("gelu")(vit.linear(x, w, "mm.1")), w, "mm.2")
    rows, cols = prepared.grid
    return with_breaks(x, w, rows, cols)


def feed(model, cache, features: ImageFeatures) -> None:
    feed_causal(model, cache, features.embeddings[None])


def out_width(weights: dict) -> int:
    # libmtmd refuses a pixtral file without the [IMG_BREAK] row (it has no image layout without it)
    for name in ("mm.2.weight", "v.patch_embd.weight", "v.pre_ln.weight", "v.token_embd.img_break"):
        if name not in weights:
            raise ModelFileError(f"the projector has no {name}")
    if "mm.patch_merger.weight" in weights and "mm.input_norm.weight" not in weights:
        raise ModelFileError("the projector has a patch merger but no mm.input_norm.weight")
    return int(weights["mm.2.weight"].shape[0])


TOWER = Tower(name="pixtral", text_archs=("mistral3", "llama"), markers=("", "[IMG_END]"),
              read_spec=read_spec, out_width=out_width, prepare=prepare, encode=encode, feed=feed,
              max_tokens=max_tokens, token_range=(MIN_TOKENS, MAX_TOKENS),
              with_budget=lambda spec, n: dataclasses.replace(spec, max_pixels=n * spec.align ** 2))
