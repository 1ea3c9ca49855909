"""llama.cpp's image preprocessing (libmtmd, tools/mtmd), pixel for pixel: the pieces each tower's
`prepare` (engine/vision/towers) is made of, so the embeddings can equal libmtmd's.

`letterbox` (libmtmd's fixed-size preprocessor, gemma3's): the image is scaled to fit the projector's square
(`clip.vision.image_size`) keeping its aspect ratio (the scale is the smaller of the two side ratios,
the new sides rounded up), resized with llama.cpp's bilinear filter, centered on a black square
(offsets rounded down), then normalised per channel: (v / 255 - mean) / std with
`clip.vision.image_mean`/`image_std`, in float32. llama.cpp's bilinear filter is a port of Pillow's
separable fixed-point resampler that always runs the horizontal pass, then the vertical one (8-bit
in between); Pillow picks its own order, so here each pass is one single-axis Pillow resize, in
llama.cpp's order: measured equal (embeddings within the projector's float tolerance; Pillow's
one-call resize was off by up to 0.06 on odd sizes, a hand-written corner-aligned bilinear by 5).
"""
from __future__ import annotations

import math

import numpy as np
from PIL import Image

from engine.vision.mmproj import VisionSpec


def letterbox(rgb: np.ndarray, size: int) -> np.ndarray:
    """Fit into a size x size black square, aspect kept (llama.cpp's resize with padding, PAD_CEIL),
    with llama.cpp's bilinear filter."""
    return fit_padded(rgb, size, size, Image.BILINEAR)


def normalize(rgb: np.ndarray, spec: VisionSpec) -> np.ndarray:
    """(v / 255 - mean) / std per channel, float32, (height, width, 3)."""
    mean = np.asarray(spec.mean, dtype=np.float32)
    std = np.asarray(spec.std, dtype=np.float32)
    return ((rgb.astype(np.float32) / np.float32(255.0)) - mean) / std



def resize_pillow(rgb: np.ndarray, width: int, height: int, resample: int) -> np.ndarray:
    """(height, width, 3) uint8 through llama.cpp's Pillow port with `resample` (Image.BILINEAR or
    Image.BICUBIC, a = -0.5 as Pillow's): horizontal pass, then vertical, each a one-axis Pillow resize."""
    im = Image.fromarray(np.ascontiguousarray(rgb), "RGB")
    if im.width != width:
        im = im.resize((width, im.height), resample)
    if im.height != height:
        im = im.resize((width, height), resample)
    return np.asarray(im)


def fit_padded(rgb: np.ndarray, width: int, height: int, resample: int) -> np.ndarray:
    """llama.cpp's `img_tool::resize` with PAD_CEIL to a width x height canvas: scaled by the smaller
    side ratio (float32, sides rounded up), resized, centered on black (offsets rounded down)."""
    sh, sw = rgb.shape[:2]
    if (sw, sh) == (width, height):
        return rgb
    scale = min(np.float32(width) / np.float32(sw), np.float32(height) / np.float32(sh))
    nw = max(1, min(int(math.ceil(np.float32(sw) * scale)), width))
    nh = max(1, min(int(math.ceil(np.float32(sh) * scale)), height))
    out = np.zeros((height, width, 3), dtype=np.uint8)
    ox, oy = (width - nw) // 2, (height - nh) // 2
    out[oy:oy + nh, ox:ox + nw] = resize_pillow(rgb, nw, nh, resample)
    return out


def smart_size(width: int, height: int, align: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """llama.cpp's `calc_size_preserved_ratio` (transformers' "smart resize") in its float32
    arithmetic: each side rounded to a multiple of `align`, then scaled down to at most `max_pixels`
    (sides rounded down) or up to at least `min_pixels` (sides rounded up), aspect kept."""
    f = np.float32(align)

    def rnd(x):     # std::round: half away from zero (x > 0 here)
        return int(math.floor(float(np.float32(x) / f) + 0.5)) * align

    def up(x):
        return int(math.ceil(float(np.float32(x) / f))) * align

    def down(x):
        return int(math.floor(float(np.float32(x) / f))) * align

    w_bar, h_bar = max(align, rnd(np.float32(width))), max(align, rnd(np.float32(height)))
    if max_pixels > 0 and h_bar * w_bar > max_pixels:
        beta = np.float32(math.sqrt(np.float32(height) * np.float32(width) / np.float32(max_pixels)))
        h_bar = max(align, down(np.float32(height) / beta))
        w_bar = max(align, down(np.float32(width) / beta))
    elif min_pixels > 0 and h_bar * w_bar < min_pixels:
        beta = np.float32(math.sqrt(np.float32(min_pixels) / (np.float32(height) * np.float32(width))))
        h_bar = up(np.float32(height) * beta)
        w_bar = up(np.float32(width) * beta)
    return w_bar, h_bar
