"""Seed images and seeded mutators for the image fuzz suite (tests/engine/test_image_fuzz.py).

The seeds are real files Pillow writes in every format and mode a user's picture comes in; the
mutators flip, overwrite, truncate, splice and repeat their bytes, and rewrite the size each format's
header declares (the decompression bombs), so a failing input is rebuilt from its label alone.
"""
from __future__ import annotations

import io
import random
import struct
import zlib

import numpy as np
from PIL import Image


def _save(im: Image.Image, fmt: str, **kw) -> bytes:
    buf = io.BytesIO()
    im.save(buf, fmt, **kw)
    return buf.getvalue()


def _photo(w: int, h: int, seed: int = 0) -> Image.Image:
    """A photo-like picture: gradients plus noise (compressors cannot make it trivially small)."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w]
    a = np.stack([x * 255 // max(w - 1, 1), y * 255 // max(h - 1, 1), (x * y) % 256], -1)
    a = np.clip(a + rng.integers(-20, 21, a.shape), 0, 255).astype(np.uint8)
    return Image.fromarray(a, "RGB")


def _animation(fmt: str, **kw) -> bytes:
    frames = [_photo(24, 16, s) for s in range(3)]
    return _save(frames[0], fmt, save_all=True, append_images=frames[1:], duration=50, loop=0, **kw)


def _rotated_jpeg() -> bytes:
    exif = Image.Exif()
    exif[0x0112] = 6
    return _save(_photo(30, 20), "JPEG", exif=exif)


def seeds() -> list[tuple[str, bytes]]:
    """(label, file bytes): each format in the modes and variants Pillow writes."""
    p = _photo(37, 23)
    i16 = Image.fromarray((np.arange(37 * 23, dtype=np.uint16).reshape(23, 37) * 61))
    out = [
        ("png-rgb", _save(p, "PNG")), ("png-rgba", _save(p.convert("RGBA"), "PNG")),
        ("png-l", _save(p.convert("L"), "PNG")), ("png-la", _save(p.convert("LA"), "PNG")),
        ("png-1", _save(p.convert("1"), "PNG")), ("png-i16", _save(i16, "PNG")),
        ("png-p-transparent", _save(p.convert("P"), "PNG", transparency=3)),
        ("png-interlaced", _save(p, "PNG", interlace=True) if _interlace_ok() else _save(p, "PNG")),
        ("jpeg-rgb", _save(p, "JPEG", quality=80)), ("jpeg-progressive", _save(p, "JPEG", progressive=True)),
        ("jpeg-l", _save(p.convert("L"), "JPEG")), ("jpeg-cmyk", _save(p.convert("CMYK"), "JPEG")),
        ("jpeg-exif-rotated", _rotated_jpeg()),
        ("gif-p", _save(p.convert("P"), "GIF")), ("gif-animated", _animation("GIF")),
        ("gif-transparent", _save(p.convert("P"), "GIF", transparency=0)),
        ("webp-lossy", _save(p, "WEBP", quality=70)), ("webp-lossless", _save(p, "WEBP", lossless=True)),
        ("webp-rgba", _save(p.convert("RGBA"), "WEBP")), ("webp-animated", _animation("WEBP")),
        ("tiff-rgb", _save(p, "TIFF")), ("tiff-cmyk", _save(p.convert("CMYK"), "TIFF")),
        ("tiff-i16", _save(i16, "TIFF")), ("tiff-f", _save(Image.fromarray(np.asarray(i16, np.float32) / 5e4), "TIFF")),
        ("tiff-lzw", _save(p, "TIFF", compression="tiff_lzw")),
        ("tiff-deflate", _save(p, "TIFF", compression="tiff_deflate")),
        ("tiff-packbits", _save(p, "TIFF", compression="packbits")),
        ("tiff-jpeg", _save(p, "TIFF", compression="jpeg")),
        ("tiff-multipage", _save(p, "TIFF", save_all=True, append_images=[p.convert("L")])),
        ("bmp-rgb", _save(p, "BMP")), ("bmp-p", _save(p.convert("P"), "BMP")),
        ("bmp-1", _save(p.convert("1"), "BMP")),
    ]
    return out


def _interlace_ok() -> bool:
    try:
        _save(Image.new("RGB", (2, 2)), "PNG", interlace=True)
        return True
    except (TypeError, ValueError, OSError):
        return False


# ---- declared sizes ----------------------------------------------------------------------------
def with_size(label: str, data: bytes, w: int, h: int) -> bytes | None:
    """The file with the size its header declares set to w x h (the pixel data left as it was), or None
    where the format cannot say that size."""
    fmt = label.split("-")[0]
    fn = {"png": _png_size, "jpeg": _jpeg_size, "gif": _gif_size, "bmp": _bmp_size,
          "webp": _webp_size, "tiff": _tiff_size}[fmt]
    try:
        return fn(bytearray(data), w, h)
    except (struct.error, ValueError):
        return None


def _png_size(d: bytearray, w: int, h: int) -> bytes:
    struct.pack_into(">II", d, 16, w, h)                           # IHDR data starts at 16
    struct.pack_into(">I", d, 29, zlib.crc32(bytes(d[12:29])))    # its CRC, so Pillow reads on
    return bytes(d)


def _jpeg_size(d: bytearray, w: int, h: int) -> bytes | None:
    for marker in (b"\xff\xc0", b"\xff\xc1", b"\xff\xc2"):
        at = d.find(marker)
        if at > 0:
            struct.pack_into(">HH", d, at + 5, min(h, 65535), min(w, 65535))
            return bytes(d)
    return None


def _gif_size(d: bytearray, w: int, h: int) -> bytes:
    w, h = min(w, 65535), min(h, 65535)
    struct.pack_into("<HH", d, 6, w, h)                            # the logical screen
    at = d.find(b"\x2c", 13)                                       # the first image descriptor (a guess)
    if at > 0:
        struct.pack_into("<HH", d, at + 5, w, h)
    return bytes(d)


def _bmp_size(d: bytearray, w: int, h: int) -> bytes:
    struct.pack_into("<ii", d, 18, min(w, 2**31 - 1), min(h, 2**31 - 1))
    return bytes(d)


def _webp_size(d: bytearray, w: int, h: int) -> bytes | None:
    kind = bytes(d[12:16])
    w, h = max(w, 1), max(h, 1)                                    # WebP stores size - 1: no 0 to say
    if kind == b"VP8X":
        w, h = min(w, 1 << 24), min(h, 1 << 24)
        d[24:27] = (w - 1).to_bytes(3, "little")
        d[27:30] = (h - 1).to_bytes(3, "little")
    elif kind == b"VP8L":
        w, h = min(w, 1 << 14), min(h, 1 << 14)
        bits = int.from_bytes(d[21:25], "little") & ~((1 << 28) - 1)
        d[21:25] = (bits | (w - 1) | ((h - 1) << 14)).to_bytes(4, "little")
    elif kind == b"VP8 ":
        w, h = min(w, 1 << 14), min(h, 1 << 14)
        struct.pack_into("<HH", d, 26, w - 1 if w > 1 else 1, h - 1 if h > 1 else 1)
    else:
        return None
    return bytes(d)


def _tiff_size(d: bytearray, w: int, h: int) -> bytes | None:
    end = "<" if d[:2] == b"II" else ">"
    ifd = struct.unpack_from(end + "I", d, 4)[0]
    n = struct.unpack_from(end + "H", d, ifd)[0]
    for i in range(n):
        at = ifd + 2 + 12 * i
        tag = struct.unpack_from(end + "H", d, at)[0]
        if tag in (256, 257):                                      # ImageWidth, ImageLength as LONG
            struct.pack_into(end + "HHII", d, at, tag, 4, 1, w if tag == 256 else h)
    return bytes(d)


BOMB_SIZES = [(100_000, 100_000), (65535, 65535), (7072, 7072), (1, 40_000_000), (40_000, 1), (0, 10), (10, 0),
              (2**31 - 1, 2**31 - 1)]


def bombs(seed_files: list[tuple[str, bytes]]) -> list[tuple[str, bytes]]:
    """Each seed's header rewritten to declare huge, degenerate or just-under-the-bound sizes, the
    pixel data left small (the header-only decompression bomb)."""
    out = []
    for label, data in seed_files:
        for w, h in BOMB_SIZES:
            got = with_size(label, data, w, h)
            if got is not None:
                out.append((f"{label} declares {w}x{h}", got))
    return out


# ---- byte mutants ------------------------------------------------------------------------------
INTERESTING = (0x00, 0xFF, 0x7F, 0x80, 0x01, 0xFE)


def mutant(rng: random.Random, data: bytes, others: list[bytes]) -> tuple[str, bytes]:
    """One seeded mutation of `data`: (what was done, the bytes)."""
    d = bytearray(data)
    kind = rng.choice(("flip", "byte", "truncate", "splice", "repeat", "insert", "zero-run", "header-flip"))
    if kind in ("flip", "header-flip"):
        span = min(len(d), 64) if kind == "header-flip" else len(d)
        for _ in range(rng.randint(1, 8)):
            d[rng.randrange(span)] ^= 1 << rng.randrange(8)
    elif kind == "byte":
        for _ in range(rng.randint(1, 4)):
            d[rng.randrange(len(d))] = rng.choice(INTERESTING)
    elif kind == "truncate":
        d = d[:rng.randrange(1, len(d))]
    elif kind == "splice":
        other = rng.choice(others)
        d = d[:rng.randrange(1, len(d))] + other[rng.randrange(len(other)):]
    elif kind == "repeat":
        a = rng.randrange(len(d))
        b = min(len(d), a + rng.randint(1, 256))
        d = d[:b] + d[a:b] * rng.randint(2, 50) + d[b:]
    elif kind == "insert":
        at = rng.randrange(len(d))
        d = d[:at] + bytes(rng.randrange(256) for _ in range(rng.randint(1, 32))) + d[at:]
    else:
        at = rng.randrange(len(d))
        d[at:at + rng.randint(1, 64)] = bytes(min(64, len(d) - at))
    return kind, bytes(d)
