"""The gemma4v image projector (Gemma 4) against llama.cpp's libmtmd on tiny files
(tests/gguf_factory_vision_gemma4v.py): the embeddings of Pillow-made images, the image-token counts
of libmtmd's dynamic-size preprocessing (70 to 1,120 tokens an image) on many sizes, refusals by name;
then through the real Engine on a tiny Gemma 4: the prompt's tokens and greedy replies equal
libmtmd's (mtmd_helper_eval_chunks: image tokens decoded non-causally in 512-token pieces, per-layer
inputs of token 0), and a follow-up reuses the image's K/V without encoding it again."""
from __future__ import annotations

import numpy as np
import pytest

import llama_oracle
import mtmd_oracle
from gguf_factory_vision import write_gemma3_mmproj
from gguf_factory_vision_gemma4v import CLAMPS, write_gemma4v_mmproj, write_gemma4v_pair
from vision_images import CASES, photo, png

from engine.api import EngineOptions, GenerateRequest, ImageInput, RestoreSession, SaveSession, Status
from engine.engine import Engine
from engine.errors import ModelFileError
from engine.sampling import SamplingParams
from engine.text.image_tokens import image_runs
from engine.vision import mmproj
from engine.vision.images import decode_image
from engine_reads import while_held
from vision_chat import image, rgb, user
from vision_chat import assert_greedy_equal as _greedy_equal
from engines import maker

# max |ours - libmtmd| over an image's embeddings (values up to ~9.5): measured 0.0048-0.0069 on
# these images (ggml's CPU quick-GELU goes through an fp16 table; the rest is float32 summation order)
TOLERANCE = 1e-2
# a difference only where llama.cpp's top-2 margin is below this: measured, every reply below equals
# llama.cpp's token for token, at margins down to 0.01 (0.6 in test_oracle.py would let a causal feed
# or one without libmtmd's 512-token pieces pass: their first differences come at margins 0.06-0.36)
TIE_MARGIN = 0.05
N_GEN = 8
TURN = "<|turn>user\n{}<turn|>\n<|turn>model\n"
# (width, height): below the budget (scaled up to >= 70 tokens), inside it, above it (scaled down to
# <= 1,120), one pixel, extreme aspect ratios, odd sizes
SIZES = [(1, 1), (7, 5), (49, 51), (64, 48), (100, 100), (127, 33), (200, 200), (201, 199), (517, 389),
         (1024, 768), (1920, 1080), (3000, 40), (33, 700), (12, 1200)]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    llama_oracle.require()
    return write_gemma4v_pair(tmp_path_factory.mktemp("gemma4v"))


@pytest.fixture(scope="module")
def projector(pair):
    return mmproj.load_projector(pair[1], "gemma4", 256)


def ours(projector, rgb: np.ndarray) -> np.ndarray:
    tower = projector.spec.tower
    return np.array(tower.encode(projector, tower.prepare(rgb, projector.spec)))


@pytest.mark.parametrize("name,width,height,mode", CASES)
def test_embeddings_equal_libmtmd(pair, projector, name, width, height, mode):
    image = decode_image(png(photo(width, height, seed=width), mode))
    ref = mtmd_oracle.encode(*pair, image.rgb)
    got = ours(projector, image.rgb)
    assert got.shape == ref.shape and got.shape[1] == 256
    d = float(np.abs(got - ref).max())
    assert d < TOLERANCE, f"{name}: max |d| {d:.4f} (values up to {float(np.abs(ref).max()):.2f})"


def test_an_f16_projector_equals_libmtmd(pair, tmp_path):
    """2-D weights in F16 as most published mmproj files (measured max |d| 0.004)."""
    mm = write_gemma4v_mmproj(tmp_path / "mmproj-f16.gguf", tensor_type="F16")
    projector = mmproj.load_projector(mm, "gemma4", 256)
    rgb = photo(203, 97, seed=2)
    ref = mtmd_oracle.encode(pair[0], mm, rgb)
    assert float(np.abs(ours(projector, rgb) - ref).max()) < TOLERANCE


@pytest.mark.parametrize("width,height", SIZES)
def test_image_token_count_equals_llama_cpp(pair, projector, width, height):
    rgb = photo(width, height, seed=3)
    chunks = mtmd_oracle.chunks(*pair, f"look: {mtmd_oracle.MARKER} done", [rgb])
    assert [kind for kind, _ in chunks] == ["text", "image", "text"]
    n = projector.spec.tower.prepare(rgb, projector.spec).n_tokens
    assert n == chunks[1][1] and 70 <= n <= projector.spec.tower.max_tokens(projector.spec) == 1120


def test_the_clamps_are_part_of_what_is_compared(pair, projector):
    """The file's Gemma4ClippableLinear clamps change the embeddings by far more than the tolerance,
    so the equality above covers them."""
    rgb = photo(100, 100, seed=5)
    unclamped = mmproj.Projector(projector.path, projector.spec, {
        k: v for k, v in projector.weights.items() if not k.endswith(tuple(f".{kind}" for _, kind, _ in CLAMPS))},
        projector.nbytes)
    assert float(np.abs(ours(projector, rgb) - ours(unclamped, rgb)).max()) > 10 * TOLERANCE


def test_a_projector_of_another_width_is_refused(tmp_path):
    mm = write_gemma4v_mmproj(tmp_path / "mmproj-narrow.gguf", n_text=128)
    with pytest.raises(ModelFileError, match="width 128.*256 wide"):
        mmproj.load_projector(mm, "gemma4", 256)


def test_projectors_of_another_family_are_refused(pair, tmp_path):
    with pytest.raises(ModelFileError, match="gemma4v projector; the loaded model is a gemma3"):
        mmproj.load_projector(pair[1], "gemma3", 256)
    g3 = write_gemma3_mmproj(tmp_path / "mmproj-gemma3.gguf")
    with pytest.raises(ModelFileError, match="gemma3 projector; the loaded model is a gemma4"):
        mmproj.load_projector(g3, "gemma4", 256)


# ------------------------------------------------------------------------------ through the Engine
@pytest.fixture(scope="module")
def engine(pair):
    eng = Engine(EngineOptions(model=str(pair[0]), cache_mib=256)).start()
    eng.startup.result()
    yield eng
    eng.stop()


def generate(eng, messages, conversation: str = ""):
    return eng.call(GenerateRequest(messages=messages, conversation=conversation,
                                    sampling=SamplingParams(temperature=0.0, max_tokens=N_GEN)))


def assert_greedy_equal(got: list[int], ref: list[int], logits: np.ndarray) -> None:
    _greedy_equal(got, ref, logits, TIE_MARGIN)


def test_loaded_with_the_projector_beside_it(engine):
    assert engine.model_facts().vision == "gemma4v"


def test_prompt_tokens_equal_libmtmd(engine, pair):
    a = image(203, 97, 1)
    msgs = [user("What is in ", a, " this picture?")]
    got = while_held(engine, lambda e: e.prompts.prompt_tokens(GenerateRequest(messages=msgs)))
    chunks = mtmd_oracle.chunks(*pair, TURN.format(f"What is in {mtmd_oracle.MARKER} this picture?"), [rgb(a)])
    runs = image_runs(got)
    assert len(runs) == 1 and [k for k, _ in chunks] == ["text", "image", "text"]
    start, end = runs[0]
    assert got[:start] == chunks[0][1] and end - start == chunks[1][1] and got[end:] == chunks[2][1]


@pytest.mark.parametrize("parts", [
    ("Describe ", ("portrait", 61, 173, "RGBA", 234), " briefly."),
    ("Describe ", ("landscape", 203, 97, "RGB", 300), " briefly."),
    ("Describe ", ("over-512", 300, 260, "RGB", 7), " briefly."),     # 1,085 tokens: three pieces
    (("square", 64, 64, "RGB", 128), "Compare it with ", ("gray", 90, 60, "L", 150), "."),
])
def test_greedy_reply_equals_llama_cpp(engine, pair, parts):
    imgs = {p[0]: image(p[1], p[2], seed=p[4], mode=p[3]) for p in parts if isinstance(p, tuple)}
    msgs = [user(*(imgs[p[0]] if isinstance(p, tuple) else p for p in parts))]
    text = TURN.format("".join(mtmd_oracle.MARKER if isinstance(p, tuple) else p for p in parts))
    pixels = [rgb(imgs[p[0]]) for p in parts if isinstance(p, tuple)]
    ref, logits = mtmd_oracle.greedy(*pair, text, pixels, N_GEN)
    r = generate(engine, msgs, conversation=f"parity-{'-'.join(imgs)}")
    assert r.prompt_tokens == sum(n if k == "image" else len(n) for k, n in mtmd_oracle.chunks(*pair, text, pixels))
    assert_greedy_equal(r.tokens, ref, logits)


def test_a_follow_up_reuses_the_image_without_encoding_it_again(engine):
    a = image(120, 90, 31)
    history = [user("Here is a photo: ", a, " Describe it.")]
    r1 = generate(engine, history, conversation="follow")
    n = while_held(engine, lambda e: e.loaded.vision.features.encodes)
    history += [{"role": "assistant", "content": r1.text}, user("And the colours?")]
    r2 = generate(engine, history, conversation="follow")
    assert while_held(engine, lambda e: e.loaded.vision.features.encodes) == n, "the image was encoded again"
    held = r1.prompt_tokens + len(r1.tokens)
    assert r2.cached_tokens >= 0.9 * held, (r2.cached_tokens, held)


@pytest.fixture
def make_engine(pair):
    with maker(pair[0], cache_mib=256) as make:
        yield make


def first_turn(eng, conversation: str, img: ImageInput):
    history = [user("Here is a photo: ", img, " Describe it.")]
    r = generate(eng, history, conversation)
    return history + [{"role": "assistant", "content": r.text}], r


def assert_reused_without_encoding(eng, r1, history, conversation: str) -> None:
    follow = history + [user("And the colours?")]
    r2 = generate(eng, follow, conversation)
    assert eng.call(Status()).vision["images_encoded"] == 0, "the image was encoded again"
    tokens = while_held(eng, lambda e: e.prompts.prompt_tokens(GenerateRequest(messages=follow)))
    held = r1.prompt_tokens + len(r1.tokens)
    assert r2.cached_tokens >= 0.9 * held and r2.cached_tokens >= image_runs(tokens)[0][1], (r2.cached_tokens, held)


def test_disk_tier_after_a_restart_keeps_a_dynamic_size_span(make_engine, tmp_path):
    """An image of 276 tokens (not the most an image takes) restored from disk by a new engine."""
    disk = dict(disk_mib=64, disk_dir=str(tmp_path / "disk"))
    eng = make_engine(**disk)
    history, r1 = first_turn(eng, "chat-d", image(140, 70, 61))
    assert eng.wait_idle(60)                   # the idle-time write
    eng.stop()
    again = make_engine(**disk)
    assert_reused_without_encoding(again, r1, history, "chat-d")


def test_session_file_keeps_a_dynamic_size_span(make_engine, tmp_path):
    eng = make_engine()
    history, r1 = first_turn(eng, "chat-s", image(90, 120, 71))
    path = str(tmp_path / "with-image.strata")
    eng.call(SaveSession(path, messages=history, conversation="chat-s"))
    eng.stop()
    again = make_engine()
    again.call(RestoreSession(path, conversation="chat-s"))
    assert_reused_without_encoding(again, r1, history, "chat-s")


def test_e2b_and_e4b_widths_decode_images_causally(tmp_path):
    """libmtmd decodes Gemma 4 images non-causally except for text widths 1536 and 2560 (E2B, E4B),
    whose image tokens stay causal: a tiny Gemma 4 of width 1536 replies as llama.cpp's does."""
    llama_oracle.require()
    pair = write_gemma4v_pair(tmp_path, text_kw={"n_embd": 1536}, mmproj_name="mmproj-e2b-width.gguf")
    eng = Engine(EngineOptions(model=str(pair[0]), cache_mib=256)).start()
    try:
        eng.startup.result()
        a = image(64, 64, 128)
        text = TURN.format(f"Describe {mtmd_oracle.MARKER} briefly.")
        ref, logits = mtmd_oracle.greedy(*pair, text, [rgb(a)], N_GEN)
        assert_greedy_equal(generate(eng, [user("Describe ", a, " briefly.")]).tokens, ref, logits)
    finally:
        eng.stop()
