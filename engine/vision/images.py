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
from PIL import ExifTags, Image, UnidentifiedImageError

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
    except Image.DecompressionBombError as e:
        # Pillow's own bound (far above ours) stops Image.open before the size is seen here
        raise ImageRefused(_first_line(f"the image declares too many pixels (at most {max_pixels / 1e6:.0f} MP "
                                       "are read)", e)) from None
    except UnidentifiedImageError as e:
        raise ImageRefused(_first_line("the data is not an image Strata reads (PNG, JPEG, WebP, GIF, BMP, TIFF)", e))
    except MemoryError:
        raise ImageRefused("there is not enough free memory to decode the image") from None
    except (OSError, ValueError, SyntaxError, EOFError, TypeError, IndexError, KeyError,
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
        pixels = _pixels(_to_rgb(_upright(im)))
    h, w = pixels.shape[:2]
    digest = hashlib.sha256(f"{w}x{h}:".encode())
    digest.update(np.ascontiguousarray(pixels).data)   # hashed in place: a 50 MP image is not copied again
    return DecodedImage(rgb=pixels, digest=digest.hexdigest(), width=w, height=h, format=fmt)


def _pixels(rgb: Image.Image, strip: int = 256) -> np.ndarray:
    """The RGB image as one (h, w, 3) uint8 array, copied a strip of rows at a time: np.asarray on the
    whole image goes through Image.tobytes, which holds the pixels twice more while it joins them."""
    w, h = rgb.size
    out = np.empty((h, w, 3), dtype=np.uint8)
    for y in range(0, h, strip):
        out[y:y + strip] = np.asarray(rgb.crop((0, y, w, min(y + strip, h))), dtype=np.uint8)
    return out


_TRANSPOSE = {2: Image.Transpose.FLIP_LEFT_RIGHT, 3: Image.Transpose.ROTATE_180,
              4: Image.Transpose.FLIP_TOP_BOTTOM, 5: Image.Transpose.TRANSPOSE, 6: Image.Transpose.ROTATE_270,
              7: Image.Transpose.TRANSVERSE, 8: Image.Transpose.ROTATE_90}


def _upright(im: Image.Image) -> Image.Image:
    """The frame as the camera meant it (EXIF orientation), the same object when nothing turns.
    ImageOps.exif_transpose copies an unrotated image and rewrites the EXIF/XMP it carries; neither is
    wanted here (a 50 MP copy, and hostile metadata parsed twice)."""
    im.load()
    orientation = im.getexif().get(ExifTags.Base.Orientation, 1)
    method = _TRANSPOSE.get(orientation) if isinstance(orientation, int) else None
    return im.transpose(method) if method is not None else im


def _to_rgb(im: Image.Image) -> Image.Image:
    """8-bit RGB; transparency over white. 16-bit and float modes scale to 8 bits first, in place in one
    numpy array (a 50 MP 16-bit image would otherwise hold several float64 copies, over 1 GB)."""
    if im.mode in ("I;16", "I;16B", "I;16L", "I;16N", "I"):
        a = np.array(im, dtype=np.int32)
        top = 65535 if im.mode.startswith("I;16") or a.max(initial=0) > 255 else 255
        np.clip(a, 0, top, out=a)
        if top == 65535:
            a >>= 8                                  # 16 to 8 bits by the high byte, as stb_image does
        im = Image.fromarray(a.astype(np.uint8), "L")
    elif im.mode == "F":
        a = np.array(im, dtype=np.float32)
        np.nan_to_num(a, copy=False, nan=0.0, posinf=1.0, neginf=0.0)
        a *= 255.0
        a += 0.5
        np.clip(a, 0, 255, out=a)
        im = Image.fromarray(a.astype(np.uint8), "L")
    if im.mode == "P" and "transparency" in im.info:
        im = im.convert("RGBA")
    if im.mode in ("RGBA", "LA", "PA", "RGBa", "La"):
        rgba = im.convert("RGBA")
        im = Image.new("RGB", rgba.size, (255, 255, 255))
        im.paste(rgba, (0, 0), rgba)                 # over white by the alpha: one RGB copy, not three
    return im if im.mode == "RGB" else im.convert("RGB")


def _first_line(what: str, e: BaseException) -> str:
    detail = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
    return f"{what}: {detail}"
