"""Seeded fuzzing of image bytes (engine/vision/images.py decode_image), what the app, the server and the
engine all run on an image a stranger hands over.

Every input ends as a DecodedImage (upright 8-bit RGB of the size it reports) or an ImageRefused with
one line: never another exception, never a hang (each input runs in tests/fuzz_worker.py and is killed
past a generous deadline), never past the worker's address-space cap (fuzz_harness.MEMORY_CAP, 1 GiB),
which also holds a full 50 MP image. Inputs: real PNG, JPEG, GIF, WebP, TIFF and BMP files Pillow
writes (palette, CMYK, 16-bit, float, EXIF-rotated, animated, transparent), their headers rewritten
to declare huge or degenerate sizes (header-only bombs), and seeded byte mutants (flips, interesting
bytes, truncation, splices across formats, repeats, insertions). The long campaign:

    pytest tests/engine/test_image_fuzz.py -s -m fuzz_long

Each test prints its tally; seeds are fixed, so a crash is reproduced from its label.
"""
from __future__ import annotations

import io
import random
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from engine.vision.images import MAX_PIXELS, DecodedImage, ImageRefused, decode_image
from fuzz_harness import Tally, Worker
from fuzz_images import bombs, mutant, seeds

IMAGE_TIMEOUT_S = 30.0        # a seed decodes in a few ms; a full 50 MP image in a few seconds
BIG_TIMEOUT_S = 240.0
SEEDS = seeds()


def _run(cases: list[tuple[str, bytes]], tmp_path: Path, timeout: float = IMAGE_TIMEOUT_S) -> Tally:
    tally, worker, path = Tally(), Worker(), tmp_path / "fuzzed.img"
    try:
        for label, data in cases:
            path.write_bytes(data)
            tally.add(label, worker.run({"kind": "image", "path": str(path)}, timeout))
    finally:
        tally.peak_rss = worker.peak_rss
        worker.close()
    return tally


def _mutants(n_each: int, seed: int) -> list[tuple[str, bytes]]:
    rng = random.Random(seed)
    others = [d for _, d in SEEDS]
    out = []
    for label, data in SEEDS:
        for i in range(n_each):
            what, d = mutant(rng, data, others)
            out.append((f"{label} mutant {i} ({what}, seed {seed})", d))
    return out


@pytest.mark.parametrize("label, data", SEEDS, ids=[label for label, _ in SEEDS])
def test_every_seed_decodes_to_upright_rgb(label, data):
    got = decode_image(data)
    assert isinstance(got, DecodedImage) and got.rgb.dtype == np.uint8
    want = (30, 20) if "rotated" in label else ((16, 24) if "animated" in label else (23, 37))
    assert got.rgb.shape == (*want, 3), label      # (height, width): the 30 x 20 JPEG turned upright


def test_header_only_bombs_are_refused_by_their_declared_size(tmp_path):
    cases = bombs(SEEDS)
    tally = _run(cases, tmp_path)
    print(tally.line("image header bombs"))
    assert not tally.crashes, "\n".join(tally.crashes[:20])
    assert tally.tried == len(cases) and tally.refused >= len(cases) * 0.9
    # the named bound, straight: the bombs over it are refused in process too, and quickly enough to
    # hold no pixels (a 100000 x 100000 RGB image would be 30 GB)
    for label, data in cases:
        if "100000x100000" in label or "65535x65535" in label:
            with pytest.raises(ImageRefused) as e:
                decode_image(data)
            # said as a size, whichever bound (Pillow's or ours) stopped it, never as "not an image"
            assert "MP" in str(e.value) and "not an image" not in str(e.value), (label, str(e.value))


def test_byte_mutants_end_decoded_or_refused_in_one_line(tmp_path):
    tally = _run(_mutants(40, seed=20261207), tmp_path)
    print(tally.line("image byte mutants"))
    assert not tally.crashes, "\n".join(tally.crashes[:20])
    assert tally.refused > 0 and tally.accepted > 0


def _full(mode: str, fmt: str) -> bytes:
    side = int(MAX_PIXELS ** 0.5) - 1                  # just under the bound: read, not refused
    if mode == "I;16":
        im = Image.fromarray(np.full((side, side), 40000, np.uint16))
    else:
        im = Image.new(mode, (side, side), "red" if mode != "P" else 3)
    buf = io.BytesIO()
    im.save(buf, fmt)
    return buf.getvalue()


def test_a_full_50_mp_image_decodes_under_the_memory_cap(tmp_path):
    """The largest image read, in the modes that cost most (alpha flattened, 16-bit scaled), decodes
    inside the worker's 1 GiB address space: the bound on pixels is a bound on memory."""
    cases = [(f"{m} {f} at the pixel bound", _full(m, f)) for m, f in (("RGB", "PNG"), ("RGBA", "PNG"),
                                                                        ("I;16", "PNG"))]
    tally = _run(cases, tmp_path, timeout=BIG_TIMEOUT_S)
    print(tally.line("full-size images"))
    assert not tally.crashes, "\n".join(tally.crashes)
    assert tally.accepted == len(cases)


@pytest.mark.fuzz_long
def test_byte_mutants_long(tmp_path):
    tally = _run(_mutants(1000, seed=7), tmp_path)
    print(tally.line("image byte mutants (long)"))
    assert not tally.crashes, "\n".join(tally.crashes[:20])
