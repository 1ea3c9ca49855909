"""The gemma3 image projector (engine/vision) against llama.cpp's libmtmd on tiny mmproj files:
the embeddings of Pillow-made images (odd sizes, portrait/landscape, RGBA, grayscale) and the image's
token count equal libmtmd's; projector files that cannot serve the loaded model are refused by name."""
from __future__ import annotations

import numpy as np
import pytest

import llama_oracle
import mtmd_oracle
from gguf_factory_vision import write_gemma3_mmproj, write_gemma3_vision_pair
from vision_images import CASES, photo, png


from engine.errors import ModelFileError
from engine.vision.images import decode_image
from engine.vision import mmproj

# max |ours - libmtmd| over an image's embeddings (values up to ~10): measured 0.0027-0.0034 on these
# images (ggml's CPU GELU goes through an fp16 table; the rest is float32 summation order)
TOLERANCE = 1e-2


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    llama_oracle.require()
    return write_gemma3_vision_pair(tmp_path_factory.mktemp("vision"))


@pytest.fixture(scope="module")
def projector(pair):
    return mmproj.load_projector(pair[1], "gemma3", 256)


@pytest.mark.parametrize("name,width,height,mode", CASES)
def test_embeddings_equal_libmtmd(pair, projector, name, width, height, mode):
    model, mm = pair
    image = decode_image(png(photo(width, height, seed=width), mode))
    ref = mtmd_oracle.encode(model, mm, image.rgb)
    tower = projector.spec.tower
    ours = np.array(tower.encode(projector, tower.prepare(image.rgb, projector.spec)))
    assert ours.shape == ref.shape == (tower.max_tokens(projector.spec), 256)
    d = float(np.abs(ours - ref).max())
    assert d < TOLERANCE, f"{name}: max |d| {d:.4f} (values up to {float(np.abs(ref).max()):.2f})"


def test_image_token_count_equals_llama_cpp(pair, projector):
    model, mm = pair
    chunks = mtmd_oracle.chunks(model, mm, f"look: {mtmd_oracle.MARKER} done", [photo(64, 48)])
    assert [kind for kind, _ in chunks] == ["text", "image", "text"]
    assert chunks[1][1] == projector.spec.tower.max_tokens(projector.spec) == 256


def test_projector_of_another_width_is_refused(tmp_path):
    mm = write_gemma3_mmproj(tmp_path / "mmproj-narrow.gguf", n_text=128)
    with pytest.raises(ModelFileError, match="width 128.*256 wide"):
        mmproj.load_projector(mm, "gemma3", 256)


def test_unsupported_projector_type_is_refused(tmp_path):
    mm = write_gemma3_mmproj(tmp_path / "mmproj-other.gguf", projector_type="idefics3")
    with pytest.raises(ModelFileError, match="projector type 'idefics3' is not supported"):
        mmproj.load_projector(mm, "gemma3", 256)


def test_projector_of_another_family_is_refused(pair):
    with pytest.raises(ModelFileError, match="gemma3 projector; the loaded model is a llama"):
        mmproj.load_projector(pair[1], "llama", 256)


def test_a_text_model_is_not_a_projector(pair):
    with pytest.raises(ModelFileError, match="not an image projector.*'gemma3'"):
        mmproj.load_projector(pair[0], "gemma3", 256)
