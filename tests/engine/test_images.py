"""Images from file bytes to RGB pixels (engine/vision/images.py) on real files Pillow writes: every mode a user's
picture comes in reads as upright RGB, the digest names the pixels (not the file), and bad data or a bomb
is refused with one line before anything large is decoded."""
from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from engine.vision.images import DecodedImage, ImageRefused, decode_image


def _file(im: Image.Image, fmt: str = "PNG", **kw) -> bytes:
    buf = io.BytesIO()
    im.save(buf, fmt, **kw)
    return buf.getvalue()


def _gradient(w: int, h: int) -> Image.Image:
    y, x = np.mgrid[0:h, 0:w]
    a = np.stack([x * 255 // max(w - 1, 1), y * 255 // max(h - 1, 1), (x + y) % 256], -1).astype(np.uint8)
    return Image.fromarray(a, "RGB")


@pytest.mark.parametrize("mode", ["RGB", "RGBA", "L", "LA", "P", "CMYK", "I;16", "1"])
def test_every_mode_reads_as_rgb(mode):
    im = _gradient(37, 23).convert(mode) if mode != "I;16" else Image.fromarray(
        (np.arange(37 * 23, dtype=np.uint16).reshape(23, 37) * 60))
    fmt = "TIFF" if mode in ("CMYK", "I;16") else "PNG"
    got = decode_image(_file(im, fmt))
    assert isinstance(got, DecodedImage) and got.rgb.shape == (23, 37, 3) and got.rgb.dtype == np.uint8


def test_transparency_is_flattened_onto_white_and_the_digest_names_the_pixels():
    clear = Image.new("RGBA", (8, 8), (0, 0, 0, 0))
    assert (decode_image(_file(clear)).rgb == 255).all()
    photo = _gradient(40, 30)
    png, bmp = decode_image(_file(photo)), decode_image(_file(photo, "BMP"))
    assert png.digest == bmp.digest and png.format == "PNG" and bmp.format == "BMP"
    other = np.asarray(photo).copy()
    other[0, 0, 0] ^= 1
    assert decode_image(_file(Image.fromarray(other))).digest != png.digest


def test_exif_rotation_is_applied_and_an_animation_gives_its_first_frame():
    im = _gradient(40, 20)
    exif = Image.Exif()
    exif[0x0112] = 6                                 # "rotate 90 CW to view"
    assert decode_image(_file(im, "JPEG", exif=exif)).rgb.shape == (40, 20, 3)
    frames = [Image.new("RGB", (10, 10), c) for c in ((255, 0, 0), (0, 0, 255))]
    buf = io.BytesIO()
    frames[0].save(buf, "GIF", save_all=True, append_images=frames[1:])
    first = decode_image(buf.getvalue()).rgb
    assert first[..., 0].mean() > 200 and first[..., 2].mean() < 50


@pytest.mark.parametrize("data, words", [
    (b"", "empty"), (b"hello, not an image", "not an image"),
    (_file(Image.fromarray(np.random.default_rng(0).integers(0, 256, (64, 64, 3), dtype=np.uint8)))[:600],
     "damaged or truncated"),
])
def test_bad_data_is_refused_in_one_line(data, words):
    with pytest.raises(ImageRefused) as e:
        decode_image(data)
    assert words in str(e.value) and "\n" not in str(e.value)


def test_a_bomb_is_refused_by_its_declared_size_before_decoding():
    # a PNG header claiming 30000 x 30000: refused from the header, no 2.7 GB of pixels decoded
    big = _file(Image.new("L", (30000, 30000)), "PNG", optimize=False)
    with pytest.raises(ImageRefused, match="MP"):
        decode_image(big)
    with pytest.raises(ImageRefused, match="MiB"):
        decode_image(b"\x89PNG" + b"\0" * 100, max_bytes=50)
