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


def resize_bilinear(rgb: np.ndarray, width: int, height: int, resample=Image.BILINEAR) -> np.ndarray:
    """(height, width, 3) uint8, resized as llama.cpp's (Pillow-compatible) bilinear filter does;
    `resample` Image.BICUBIC: as its Pillow-compatible bicubic (RESIZE_ALGO_BICUBIC_PILLOW), the same
    two passes in the same order (Pillow's one-call resize of 33x400 to 8x96 came out 1 off in places)."""
    im = Image.fromarray(np.ascontiguousarray(rgb), "RGB")
    if im.width != width:
        im = im.resize((width, im.height), resample)
    if im.height != height:
        im = im.resize((width, height), resample)
    return np.asarray(im)


def letterbox(rgb: np.ndarray, size: int) -> np.ndarray:
    """Fit into a size x size black square, aspect kept (llama.cpp's resize with padding, PAD_CEIL)."""
    sh, sw = rgb.shape[:2]
    if (sw, sh) == (size, size):
        return rgb
    scale = min(np.float32(size) / np.float32(sw), np.float32(size) / np.float32(sh))
    nw = max(1, min(int(math.ceil(np.float32(sw) * scale)), size))
    nh = max(1, min(int(math.ceil(np.float32(sh) * scale)), size))
    out = np.zeros((size, size, 3), dtype=np.uint8)
    ox, oy = (size - nw) // 2, (size - nh) // 2
    out[oy:oy + nh, ox:ox + nw] = resize_bilinear(rgb, nw, nh)
    return out


def normalize(rgb: np.ndarray, spec: VisionSpec) -> np.ndarray:
    """(v / 255 - mean) / std per channel, float32, (height, width, 3)."""
    mean = np.asarray(spec.mean, dtype=np.float32)
    std = np.asarray(spec.std, dtype=np.float32)
    return ((rgb.astype(np.float32) / np.float32(255.0)) - mean) / std



def fit_in(rgb: np.ndarray, width: int, height: int, resample=Image.BILINEAR) -> np.ndarray:
    """Fit into a width x height black canvas, aspect kept (llama.cpp's resize with padding, PAD_CEIL:
    the smaller side ratio in float32, sides rounded up, centered with offsets rounded down): the
    dynamic-size preprocessors' resize, whose target keeps the aspect only to whole patches, so an
    image can get a black column or row."""
    sh, sw = rgb.shape[:2]
    if (sw, sh) == (width, height):
        return rgb
    scale = min(np.float32(width) / np.float32(sw), np.float32(height) / np.float32(sh))
    nw = max(1, min(int(math.ceil(np.float32(sw) * scale)), width))
    nh = max(1, min(int(math.ceil(np.float32(sh) * scale)), height))
    out = np.zeros((height, width, 3), dtype=np.uint8)
    ox, oy = (width - nw) // 2, (height - nh) // 2
    out[oy:oy + nh, ox:ox + nw] = resize_bilinear(rgb, nw, nh, resample)
    return out
