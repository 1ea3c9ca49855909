"""The qwen3vl_merger projector (Qwen3-VL, Qwen3.5, Qwen3.6 vision), computing what clip.cpp's
`clip_graph_qwen3vl` computes:

  two patch convs (the checkpoint's 3-D conv split over its 2 frames; a still image feeds both the
  same pixels, so their sum is one conv) + patch bias -> patches reordered 2x2 block by 2x2 block ->
  + learned positions (the square table bilinearly resized to the image's patch grid, reordered the
  same way) -> pre-LN blocks (fused q/k/v with bias, vision M-RoPE: half the head's dims rotate by
  the patch's row, half by its column) -> post-LN -> each 2x2 block's four patches concatenated ->
  mm.0, GELU, mm.2. DeepStack layers (`v.deepstack.N.*`, Qwen3-VL) project the output of block N the
  same way (LayerNorm over the four patches, fc1, GELU, fc2) and are concatenated after the main
  embedding, as libmtmd does; the text models that read them (llama.cpp's qwen3vl/qwen3vlmoe) are
  not loaded by Strata, so such a file is refused by its width against a qwen35 model.

Preprocessing is libmtmd's dynamic-size one: "smart resize" to sides that are multiples of
patch x merge, the area within [8, 4096] tokens' pixels (libmtmd's bounds for Qwen-VL), the image
fitted inside that size keeping its aspect ratio and centered on black (llama.cpp's resize with
padding; libmtmd's bicubic resampler here, measured: a bilinear one was off by 0.13-0.24), each
2x2 block of patches one token between `<|vision_start|>` and `<|vision_end|>`.
"""
from __future__ import annotations

import dataclasses
import math

import mlx.core as mx
import numpy as np
from PIL import Image

from engine.errors import ModelFileError
from engine.vision import text_mrope, vit
from engine.vision.mmproj import VisionSpec
from engine.vision.preprocess import fit_padded, normalize, smart_size
from engine.vision.towers import ImageFeatures, PreparedImage, Tower

MERGE = 2                   # clip.cpp's qwen3vl graph merges 2x2 patches (the converter's default)
MIN_TOKENS, MAX_TOKENS = 8, 4096     # clip.cpp's set_limit_image_tokens for Qwen-VL
ROPE_BASE = 10000.0


@dataclasses.dataclass(frozen=True)
class Qwen3VLSpec(VisionSpec):
    """VisionSpec plus the dynamic-size bounds (pixels) and the DeepStack layers' count."""
    min_pixels: int = 0
    max_pixels: int = 0
    n_deepstack: int = 0


def read_spec(g, spec):
    merge = int(g.get("clip.vision.spatial_merge_size", MERGE) or MERGE)
    if merge != MERGE:
        raise ModelFileError(f"{g.path.name}: spatial_merge_size {merge} (clip.cpp's qwen3vl graph merges 2x2)")
    head = spec.width // spec.n_head
    if head % 4:
        raise ModelFileError(f"{g.path.name}: vision head size {head} is not a multiple of 4 (vision M-RoPE)")
    # libmtmd sets the bounds from token counts for Qwen-VL and ignores clip.vision.image_*_pixels
    # (measured: a file with them gets the same token counts)
    area = (spec.patch * merge) ** 2
    lo, hi = MIN_TOKENS * area, MAX_TOKENS * area
    n_ds = sum(1 for t in g.reader.tensors if t.name.startswith("v.deepstack.") and ".fc1.weight" in t.name)
    fields = {f.name: getattr(spec, f.name) for f in dataclasses.fields(VisionSpec)}
    return Qwen3VLSpec(**{**fields, "pool": merge}, min_pixels=lo, max_pixels=hi, n_deepstack=n_ds)


# ------------------------------------------------------------------------------------- preprocessing
def prepare(rgb: np.ndarray, spec) -> PreparedImage:
    align = spec.patch * MERGE
    w, h = smart_size(rgb.shape[1], rgb.shape[0], align, spec.min_pixels, spec.max_pixels)
    grid = (h // align, w // align)
    return PreparedImage(normalize(fit_padded(rgb, w, h, Image.BICUBIC), spec), grid, grid[0] * grid[1])


def n_tokens_max(spec) -> int:
    return spec.max_pixels // (spec.patch * MERGE) ** 2


# ------------------------------------------------------------------------------------------- encoder
def merge_order(x: np.ndarray | mx.array, rows: int, cols: int):
    """(rows * cols, C) patches in row-major order -> 2x2 block by 2x2 block (clip.cpp's order)."""
    c = x.shape[-1]
    y = x.reshape(rows // MERGE, MERGE, cols // MERGE, MERGE, c).transpose(0, 2, 1, 3, 4)
    return y.reshape(rows * cols, c)


def _bilinear_axis(n_out: int, n_in: int) -> np.ndarray:
    """(n_out, n_in) weights of ggml_interpolate's bilinear with aligned corners (the position table's
    resize in clip.cpp: measured against libmtmd, half-pixel centres were off by up to 1.4)."""
    m = np.zeros((n_out, n_in), dtype=np.float32)
    sf = np.float32(n_out - 1) / np.float32(n_in - 1) if n_out > 1 and n_in > 1 else np.float32(n_out / n_in)
    for i in range(n_out):
        x = np.float32(i) / sf
        x0 = math.floor(float(x))
        d = min(max(float(x - np.float32(x0)), 0.0), 1.0)
        m[i, min(max(x0, 0), n_in - 1)] += np.float32(1.0 - d)
        m[i, min(max(x0 + 1, 0), n_in - 1)] += np.float32(d)
    return m


def positions(table: mx.array, rows: int, cols: int) -> mx.array:
    """The learned (side^2, C) position table resized to a rows x cols patch grid, in merge order."""
    side = int(round(math.sqrt(table.shape[0])))
    t = np.asarray(table.astype(mx.float32)).reshape(side, side, -1)
    if (rows, cols) != (side, side):
        ry, rx = _bilinear_axis(rows, side), _bilinear_axis(cols, side)
        t = np.einsum("ys,sxc->yxc", ry, np.einsum("xt,stc->sxc", rx, t))
    return mx.array(merge_order(t.reshape(rows * cols, -1), rows, cols))


def vision_rope(rows: int, cols: int, head: int) -> tuple[mx.array, mx.array]:
    """cos, sin (n_patches, head / 2) of ggml's GGML_ROPE_TYPE_VISION with positions [y, x, y, x]
    per patch (merge order): frequencies 0..head/4 turn with the row, the next head/4 with the column."""
    quarter = head // 4
    scale = np.float32(ROPE_BASE) ** np.float32(-2.0 / (head // 2))
    inv = np.empty(quarter, dtype=np.float32)
    theta = np.float32(1.0)
    for k in range(quarter):            # ggml multiplies the running theta by theta_scale
        inv[k] = theta
        theta = np.float32(theta * scale)
    yy, xx = np.mgrid[0:rows, 0:cols]
    pos = merge_order(np.stack([yy.ravel(), xx.ravel()], axis=-1), rows, cols).astype(np.float32)
    ang = np.concatenate([pos[:, :1] * inv, pos[:, 1:] * inv], axis=1)
    return mx.array(np.cos(ang)), mx.array(np.sin(ang))


def _rotate(x: mx.array, cos: mx.array, sin: mx.array) -> mx.array:
    half = x.shape[-1] // 2
    a, b = x[..., :half], x[..., half:]
    return mx.concatenate([a * cos - b * sin, a * sin + b * cos], axis=-1)


def _block(x: mx.array, w: dict, i: int, s, act, cos: mx.array, sin: mx.array) -> mx.array:
    """One pre-LN block `v.blk.{i}` with the fused, biased attn_qkv and vision M-RoPE on q and k."""
    p = f"v.blk.{i}."
    n, width = x.shape
    d = width // s.n_head
    qkv = vit.linear(vit.layer_norm(x, w, p + "ln1", s.eps), w, p + "attn_qkv")
    q, k, v = (qkv[:, j * width:(j + 1) * width].reshape(1, n, s.n_head, d).transpose(0, 2, 1, 3)
               for j in range(3))
    a = vit.attention(_rotate(q, cos, sin), _rotate(k, cos, sin), v, d ** -0.5)
    x = x + vit.linear(a.transpose(0, 2, 1, 3).reshape(n, width), w, p + "attn_out")
    h = act(vit.linear(vit.layer_norm(x, w, p + "ln2", s.eps), w, p + "ffn_up"))
    return x + vit.linear(h, w, p + "ffn_down")


def _merger(x: mx.array, w: dict, first: str, second: str, act) -> mx.array:
    return vit.linear(act(vit.linear(x, w, first)), w, second)


def encode(proj, prepared: PreparedImage) -> mx.array:
    """The prepared image -> (n_tokens, text width x (1 + DeepStack layers)) embeddings."""
    s, w = proj.spec, proj.weights
    rows, cols = prepared.grid[0] * MERGE, prepared.grid[1] * MERGE
    kernel = w["v.patch_embd.weight"] + w["v.patch_embd.weight.1"]
    px = mx.array(prepared.pixels).astype(kernel.dtype)
    x = vit.patch_embed(px, {"v.patch_embd.weight": kernel, "v.patch_embd.bias": w.get("v.patch_embd.bias")},
                        s.patch)
    x = merge_order(x, rows, cols) + positions(w["v.position_embd.weight"], rows, cols).astype(x.dtype)
    cos, sin = vision_rope(rows, cols, s.width // s.n_head)
    act, group = vit.gelu(s.gelu), MERGE * MERGE * s.width
    deep = []
    for i in range(s.n_layer):
        x = _block(x, w, i, s, act, cos, sin)
        ds = f"v.deepstack.{i}."
        if ds + "fc1.weight" in w:
            feat = vit.layer_norm(x.reshape(-1, group), w, ds + "norm", s.eps)
            deep.append(_merger(feat, w, ds + "fc1", ds + "fc2", act))
    x = vit.layer_norm(x, w, "v.post_ln", s.eps).reshape(-1, group)
    return mx.concatenate([_merger(x, w, "mm.0", "mm.2", act)] + deep, axis=-1)


def out_width(weights: dict) -> int:
    """mm.2's width x (1 + DeepStack layers), once the tensors the graph reads are there and agree."""
    b = weights.get("mm.2.bias")
    k0, k1 = weights.get("v.patch_embd.weight"), weights.get("v.patch_embd.weight.1")
    table, mm0 = weights.get("v.position_embd.weight"), weights.get("mm.0.weight")
    if b is None or k0 is None or k1 is None or table is None or mm0 is None:
        raise ModelFileError("the projector lacks one of v.patch_embd.weight(.1), v.position_embd.weight, "
                             "mm.0.weight, mm.2.bias (a qwen3vl_merger file has them)")
    width = int(k0.shape[0])
    side = int(round(math.sqrt(table.shape[0])))
    if k1.shape != k0.shape or side * side != table.shape[0] or table.shape[-1] != width \
            or mm0.shape[-1] != 4 * width:
        raise ModelFileError(f"the projector's shapes disagree (patch convs {list(k0.shape)} / {list(k1.shape)}, "
                             f"position table {list(table.shape)}, mm.0 {list(mm0.shape)})")
    n_ds = sum(1 for k in weights if k.startswith("v.deepstack.") and k.endswith(".fc1.weight"))
    return int(b.shape[0]) * (1 + n_ds)


def feed(model, cache, features: ImageFeatures) -> None:
    text_mrope.feed(model, cache, features.embeddings, features.grid)


def n_pos(grid: tuple[int, int]) -> int:
    """An image takes max(rows, cols) text positions (mtmd's n_pos for an M-RoPE image chunk)."""
    return max(grid)


TOWER = Tower(name="qwen3vl_merger", text_archs=("qwen35", "qwen35moe"),
              markers=("<|vision_start|>", "<|vision_end|>"), read_spec=read_spec, out_width=out_width,
              prepare=prepare, encode=encode, feed=feed, max_tokens=n_tokens_max, n_pos=n_pos,
              positions=text_mrope.positions, token_range=(MIN_TOKENS, MAX_TOKENS),
              with_budget=lambda spec, n: dataclasses.replace(spec, max_pixels=n * (spec.patch * MERGE) ** 2))
