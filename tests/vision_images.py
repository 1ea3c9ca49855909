"""Images made with Pillow for the vision tests: photo-like gradients with noise, odd sizes, portrait
and landscape, RGBA and grayscale, as the encoded files a user attaches (PNG bytes)."""
from __future__ import annotations

import io

import numpy as np
from PIL import Image


def photo(width: int, height: int, seed: int = 0) -> np.ndarray:
    """(height, width, 3) uint8: smooth colour gradients, a bright blob and sensor-like noise."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    fx, fy = x / max(1, width - 1), y / max(1, height - 1)
    cx, cy = rng.uniform(0.2, 0.8, 2)
    blob = np.exp(-((fx - cx) ** 2 + (fy - cy) ** 2) * 12.0)
    rgb = np.stack([200 * fx + 40 * blob, 180 * fy + 60 * blob, 120 * (1 - fx) * fy + 90 * blob], axis=-1)
    rgb += rng.normal(0, 12, rgb.shape)
    return np.clip(rgb, 0, 255).astype(np.uint8)


def png(arr: np.ndarray, mode: str = "RGB") -> bytes:
    """PNG bytes of `arr` converted to `mode` (RGB, RGBA with a soft alpha, L)."""
    im = Image.fromarray(arr, "RGB")
    if mode == "RGBA":
        h, w = arr.shape[:2]
        alpha = (np.linspace(80, 255, w, dtype=np.float32)[None, :].repeat(h, 0)).astype(np.uint8)
        im = im.convert("RGBA")
        im.putalpha(Image.fromarray(alpha, "L"))
    elif mode != "RGB":
        im = im.convert(mode)
    buf = io.BytesIO()
    im.save(buf, "PNG")
    return buf.getvalue()


# (name, width, height, mode): a square the projector's own size, odd landscape and portrait sizes,
# one larger than the projector's square, RGBA and grayscale files
CASES = [
    ("square", 128, 128, "RGB"),
    ("landscape-odd", 203, 97, "RGB"),
    ("portrait-odd", 61, 173, "RGB"),
    ("large", 517, 389, "RGB"),
    ("rgba", 150, 110, "RGBA"),
    ("gray", 90, 140, "L"),
]
