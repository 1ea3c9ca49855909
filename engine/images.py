"""Images as the user gives them (file bytes) turned into pixels the projectors read: bounded before
anything is decoded, and named by what they show.

Pillow reads the header first (`Image.open` is lazy), so a decompression bomb (a small file that claims
gigapixels) is refused by its declared size before one pixel is decoded. Every accepted image becomes
8-bit RGB: the first frame of an animation, EXIF rotation applied (a phone's portrait photo is upright),
palette/CMYK/16-bit/grayscale converted, transparency flattened onto white (as llama.cpp's and most
apps' loaders do: a transparent PNG is not black). Its digest hashes the decoded pixels and their shape,
so the same picture sent as PNG or as a re-saved file is the same span of K/V, and a different picture
at the same place never is. Plain Python + Pillow + numpy: no MLX (the server checks images with it).
"""
from __future__ import annotations

import hashlib
import io
import struct
import warnings
from dataclasses import dataclass

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

MAX_PIXELS = 50_000_000            # width x height an image may declare (a 50 MP photo is the largest kept)
MAX_IMAGE_BYTES = 20 << 20         # one encoded image
MAX_SIDE = 32768                   # either side, whatever the area (a 1 x 50M strip is no picture)
FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP", "TIFF")   # what Pillow may be asked to open


class ImageRefused(ValueError):
    """An image that is not read, with the one-line reason a user sees."""


@dataclass(frozen=True)
class DecodedImage:
    rgb: np.ndarray                # (height, width, 3) uint8
    digest: str                    # sha256 of the shape and the pixels: the image's identity in K/V keys
    width: int
    height: int
    format: str                    # the file's format as Pillow names it ("PNG", "JPEG", ...)


def decode_image(data: bytes, *, max_pixels: int = MAX_PIXELS, max_bytes: int = MAX_IMAGE_BYTES) -> DecodedImage:
    """The image in `data` as RGB pixels, or ImageRefused saying why (never another exception)."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ImageRefused("an image must be the bytes of an image file")
    if len(data) == 0:
        raise ImageRefused("the image is empty (0 bytes)")
    if len(data) > max_bytes:
        raise ImageRefused(f"the image is {len(data) / 2**20:.1f} MiB; at most {max_bytes / 2**20:.0f} MiB is read")
    try:
        with warnings.catch_warnings():
            # Pillow's own bomb check warns (or raises) by its global limit; the bounds here are the rule
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            return _decode(bytes(data), max_pixels)
    except ImageRefused:
        raise
    except (UnidentifiedImageError, Image.DecompressionBombError) as e:
        raise ImageRefused(_first_line("the data is not an image Strata reads (PNG, JPEG, WebP, GIF, BMP, TIFF)", e))
    except (OSError, ValueError, SyntaxError, EOFError, MemoryError, TypeError, IndexError, KeyError,
            ZeroDivisionError, struct.error) as e:
        raise ImageRefused(_first_line("the image is damaged or truncated", e))


def _decode(data: bytes, max_pixels: int) -> DecodedImage:
    with Image.open(io.BytesIO(data), formats=FORMATS) as im:
        width, height = im.size
        if width <= 0 or height <= 0:
            raise ImageRefused(f"the image declares a size of {width}x{height}")
        if width > MAX_SIDE or height > MAX_SIDE or width * height > max_pixels:
            raise ImageRefused(f"the image is {width}x{height} ({width * height / 1e6:.1f} MP); "
                               f"at most {max_pixels / 1e6:.0f} MP and {MAX_SIDE} pixels a side are read")
        fmt = im.format or ""
        im.seek(0)                                   # an animation: its first frame
        frame = ImageOps.exif_transpose(im)          # upright as the camera meant (a copy when rotated)
        rgb = _to_rgb(frame)
    pixels = np.asarray(rgb, dtype=np.uint8)
    if pixels.ndim != 3 or pixels.shape[2] != 3:
        raise ImageRefused(f"the image decoded to an unexpected shape {pixels.shape}")
    h, w = pixels.shape[:2]
    digest = hashlib.sha256(f"{w}x{h}:".encode() + pixels.tobytes()).hexdigest()
    return DecodedImage(rgb=pixels, digest=digest, width=w, height=h, format=fmt)


def _to_rgb(im: Image.Image) -> Image.Image:
    """8-bit RGB; transparency over white. 16-bit and float modes scale to 8 bits first."""
    if im.mode in ("I;16", "I;16B", "I;16L", "I;16N", "I"):
        a = np.asarray(im, dtype=np.float64)
        top = 65535.0 if im.mode.startswith("I;16") or a.max(initial=0) > 255 else 255.0
        im = Image.fromarray(np.clip(a / top * 255.0 + 0.5, 0, 255).astype(np.uint8), "L")
    elif im.mode == "F":
        a = np.nan_to_num(np.asarray(im, dtype=np.float64), nan=0.0, posinf=1.0, neginf=0.0)
        im = Image.fromarray(np.clip(a * 255.0 + 0.5, 0, 255).astype(np.uint8), "L")
    if im.mode == "P" and "transparency" in im.info:
        im = im.convert("RGBA")
    if im.mode in ("RGBA", "LA", "PA", "RGBa", "La"):
        im = im.convert("RGBA")
        white = Image.new("RGBA", im.size, (255, 255, 255, 255))
        im = Image.alpha_composite(white, im)
    return im.convert("RGB")


def _first_line(what: str, e: BaseException) -> str:
    detail = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
    return f"{what}: {detail}"
