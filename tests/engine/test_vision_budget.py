"""The per-image token budget (`--image-max-tokens`, EngineOptions/LoadModel.image_max_tokens) against
llama.cpp's libmtmd with the same `image_max_tokens`: for each dynamic-size projector type the image's
token count under a budget equals libmtmd's on several sizes (a large image scaled down into it, a small
one left as it is), a budget outside the type's range is refused naming the range (also for a projector
only found beside the model), gemma3 (every image 256 tokens) has nothing to set, and the engine serves
an image within the budget, its spans never shared with another budget's."""
from __future__ import annotations

import pytest

import llama_oracle
import mtmd_oracle
from gguf_factory_vision import write_gemma3_vision_pair
from gguf_factory_vision_gemma4v import write_gemma4v_pair
from gguf_factory_vision_pixtral import write_pixtral_vision_pair
from gguf_factory_vision_qwen3vl import write_qwen3vl_vision_pair
from vision_images import photo, png

from engine.api import EngineOptions, GenerateRequest, ImageInput, LoadModel, Status
from engine.engine import Engine
from engine.errors import ModelFileError, StrataError
from engine.sampling import SamplingParams
from engine.vision import mmproj
from engine.vision.images import decode_image

# (writer, text architecture, text width, a budget inside the type's range)
TYPES = {
    "gemma4v": (write_gemma4v_pair, "gemma4", 256, 90),
    "qwen3vl_merger": (write_qwen3vl_vision_pair, "qwen35", 256, 24),
    "pixtral": (write_pixtral_vision_pair, "mistral3", 256, 20),
}
SIZES = ((517, 389), (61, 173), (24, 24), (1000, 90))


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    llama_oracle.require()
    return {k: w(tmp_path_factory.mktemp(k)) for k, (w, *_rest) in TYPES.items()}


@pytest.mark.parametrize("ptype", sorted(TYPES))
def test_token_counts_under_a_budget_equal_libmtmd(pairs, ptype):
    _w, arch, width, budget = TYPES[ptype]
    model, mm = pairs[ptype]
    proj = mmproj.load_projector(mm, arch, width, max_tokens=budget)
    tower = proj.spec.tower
    assert tower.max_tokens(proj.spec) >= budget
    counts = []
    for w, h in SIZES:
        rgb = decode_image(png(photo(w, h, seed=w))).rgb
        ours = tower.prepare(rgb, proj.spec).n_tokens
        ref = [n for kind, n in mtmd_oracle.chunks(model, mm, mtmd_oracle.MARKER, [rgb], max_tokens=budget)
               if kind == "image"]
        assert ref == [ours], f"{ptype} {w}x{h}: ours {ours}, libmtmd {ref}"
        counts.append(ours)
    default = mmproj.load_projector(mm, arch, width)
    big = decode_image(png(photo(*SIZES[0], seed=SIZES[0][0]))).rgb
    assert tower.prepare(big, default.spec).n_tokens > counts[0]       # the budget scaled the large image down


@pytest.mark.parametrize("ptype", sorted(TYPES))
def test_a_budget_outside_the_types_range_is_refused_naming_it(pairs, ptype):
    _w, arch, width, _b = TYPES[ptype]
    lo, hi = mmproj.load_projector(pairs[ptype][1], arch, width).spec.tower.token_range
    for bad in (lo - 1, hi + 1):
        with pytest.raises(ModelFileError, match=rf"takes {lo}\.\.{hi} tokens an image"):
            mmproj.plan(pairs[ptype][1], False, arch, width, 4, max_tokens=bad)    # found beside: refused too


def test_gemma3_has_nothing_to_set(tmp_path):
    _model, mm = write_gemma3_vision_pair(tmp_path)
    proj = mmproj.load_projector(mm, "gemma3", 256, max_tokens=100)
    assert proj.spec.tower.token_range is None and proj.spec.tower.max_tokens(proj.spec) == 256


def _ask(eng, img, conv):
    return eng.call(GenerateRequest(messages=[{"role": "user", "content": [
        {"type": "text", "text": "What is it?"}, {"type": "image", "image": img}]}], conversation=conv,
        sampling=SamplingParams(temperature=0.0, max_tokens=2)))


def test_the_engine_serves_images_within_the_budget(pairs):
    model, mm = pairs["qwen3vl_merger"]
    eng = Engine(EngineOptions(model=str(model), cache_mib=256, image_max_tokens=24)).start()
    try:
        eng.startup.result()
        assert eng.call(Status()).vision["tokens_per_image"] == 24
        img = ImageInput(png(photo(160, 120, seed=1)), "photo.png")
        small = _ask(eng, img, "a")
        eng.call(LoadModel(str(model)))                         # the type's default budget: more tokens
        assert eng.call(Status()).vision["tokens_per_image"] > 24
        full = _ask(eng, img, "a")
        assert full.prompt_tokens > small.prompt_tokens and full.cached_tokens < small.prompt_tokens - 24
        with pytest.raises(StrataError, match=r"takes 8\.\.4096 tokens an image"):
            eng.call(LoadModel(str(model), image_max_tokens=5000))
    finally:
        eng.stop()
