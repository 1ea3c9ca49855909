"""The qwen3vl_merger image projector (Qwen3.5 / Qwen3.6 / Qwen3-VL vision, engine/vision/towers/qwen3vl.py)
against llama.cpp's libmtmd on tiny mmproj files (tests/gguf_factory_vision_qwen3vl.py): the embeddings of
Pillow-made images (odd sizes, portrait/landscape, tiny, RGBA, grayscale; resized or not, the position
table resized or not), DeepStack features, the image-token counts of libmtmd's smart resize (min and
max bounds), and projector files that cannot serve the loaded model refused by name."""
from __future__ import annotations

import numpy as np
import pytest

import llama_oracle
import mtmd_oracle
from gguf_factory_vision import write_gemma3_mmproj
from gguf_factory_vision_qwen3vl import write_qwen3vl_mmproj, write_qwen3vl_vision_pair
from vision_images import photo, png

from engine.errors import ModelFileError
from engine.vision import mmproj
from engine.vision.images import decode_image

# max |ours - libmtmd| over an image's embeddings (values up to ~6): measured 0.0024-0.0035 on these
# images (ggml's CPU GELU goes through an fp16 table; the rest is float32 summation order)
TOLERANCE = 1e-2

# (name, width, height, mode): a 32-pixel square takes the 8 x 8 position table as it is; the others
# resize it; odd sizes are resized (bicubic) and padded to multiples of 8 pixels, a tiny one scaled up
# to the 8-token minimum
CASES = [
    ("table-size", 32, 32, "RGB"),
    ("aligned", 64, 48, "RGB"),
    ("landscape-odd", 203, 97, "RGB"),
    ("portrait-odd", 61, 173, "RGB"),
    ("tiny", 5, 7, "RGB"),
    ("rgba", 150, 110, "RGBA"),
    ("gray", 90, 140, "L"),
]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    llama_oracle.require()
    return write_qwen3vl_vision_pair(tmp_path_factory.mktemp("qwen3vl"))


@pytest.fixture(scope="module")
def projector(pair):
    return mmproj.load_projector(pair[1], "qwen35", 256)


def _ours(proj, rgb):
    tower = proj.spec.tower
    prepared = tower.prepare(rgb, proj.spec)
    return np.array(tower.encode(proj, prepared)), prepared


@pytest.mark.parametrize("name,width,height,mode", CASES)
def test_embeddings_equal_libmtmd(pair, projector, name, width, height, mode):
    model, mm = pair
    image = decode_image(png(photo(width, height, seed=width), mode))
    ref = mtmd_oracle.encode(model, mm, image.rgb)
    ours, prepared = _ours(projector, image.rgb)
    assert ours.shape == ref.shape == (prepared.n_tokens, 256)
    d = float(np.abs(ours - ref).max())
    assert d < TOLERANCE, f"{name}: max |d| {d:.4f} (values up to {float(np.abs(ref).max()):.2f})"


def test_deepstack_features_equal_libmtmd(pair, tmp_path):
    """A DeepStack file: 128 main + 128 from block 0's merger (libmtmd concatenates them; the width
    then equals the tiny text model's 256, so libmtmd encodes it)."""
    model, _ = pair
    mm = write_qwen3vl_mmproj(tmp_path / "mmproj-deepstack.gguf", n_text=128, deepstack=(0,), seed=3)
    proj = mmproj.load_projector(mm, "qwen35", 256)
    assert proj.spec.n_deepstack == 1
    rgb = photo(72, 40, seed=5)
    ref = mtmd_oracle.encode(model, mm, rgb)
    ours, prepared = _ours(proj, rgb)
    assert ours.shape == ref.shape == (prepared.n_tokens, 256)
    assert float(np.abs(ours - ref).max()) < TOLERANCE


# sizes whose smart resize rounds, scales down past the 4096-token maximum, up below the 8-token
# minimum, or keeps a thin strip's aspect (token counts only: no encode)
SIZES = [(700, 500), (1000, 90), (12, 300), (9, 9), (203, 97), (517, 389), (1, 1), (3000, 8)]


def test_image_token_counts_equal_libmtmd(pair, projector):
    model, mm = pair
    tower = projector.spec.tower
    for width, height in SIZES:
        rgb = photo(width, height, seed=1)
        chunks = mtmd_oracle.chunks(model, mm, f"look: {mtmd_oracle.MARKER} done", [rgb])
        assert [kind for kind, _ in chunks] == ["text", "image", "text"]
        prepared = tower.prepare(rgb, projector.spec)
        assert chunks[1][1] == prepared.n_tokens == prepared.grid[0] * prepared.grid[1], (width, height)
        assert prepared.n_tokens <= tower.max_tokens(projector.spec) == 4096


def test_pixel_bounds_in_the_file_are_ignored_as_libmtmd_does(pair, tmp_path):
    model, _ = pair
    mm = write_qwen3vl_mmproj(tmp_path / "mmproj-bounds.gguf", min_pixels=64 * 20, max_pixels=64 * 100)
    proj = mmproj.load_projector(mm, "qwen35", 256)
    for width, height in ((700, 500), (9, 9)):
        rgb = photo(width, height, seed=2)
        chunks = mtmd_oracle.chunks(model, mm, mtmd_oracle.MARKER, [rgb])
        assert [n for kind, n in chunks if kind == "image"] == [proj.spec.tower.prepare(rgb, proj.spec).n_tokens]


def test_prompt_markers_equal_libmtmd(pair, projector):
    """libmtmd wraps the image in <|vision_start|> ... <|vision_end|>: the text chunks' last and first ids."""
    model, mm = pair
    chunks = mtmd_oracle.chunks(model, mm, f"a {mtmd_oracle.MARKER} b", [photo(40, 40)])
    begin, end = projector.spec.tower.markers
    assert (begin, end) == ("<|vision_start|>", "<|vision_end|>")
    assert len(chunks[0][1]) >= 2 and len(chunks[2][1]) >= 2


def test_projector_of_another_width_is_refused(tmp_path):
    mm = write_qwen3vl_mmproj(tmp_path / "mmproj-narrow.gguf", n_text=128)
    with pytest.raises(ModelFileError, match="width 128.*256 wide"):
        mmproj.load_projector(mm, "qwen35", 256)


def test_projector_of_another_family_is_refused(pair):
    with pytest.raises(ModelFileError, match="qwen3vl_merger projector; the loaded model is a gemma3"):
        mmproj.load_projector(pair[1], "gemma3", 256)


def test_a_gemma3_projector_is_refused_for_qwen35(tmp_path):
    mm = write_gemma3_mmproj(tmp_path / "mmproj-gemma.gguf")
    with pytest.raises(ModelFileError, match="gemma3 projector; the loaded model is a qwen35"):
        mmproj.load_projector(mm, "qwen35", 256)
