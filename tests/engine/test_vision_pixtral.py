"""The pixtral image projector (Mistral 3) against llama.cpp's libmtmd on tiny mmproj files beside a tiny
Ministral 3 (tests/gguf_factory_vision_pixtral.py): the embeddings of Pillow-made images (odd sizes,
portrait/landscape, thin strips, RGBA, grayscale) and of the file layouts (Mistral Small 3.1's patch
merger, Pixtral 12B's biased projector without one, F16, the MLP activations), the image's token count
and resize on many sizes, refusals by name; then through the real Engine: the prompt's tokens, the
greedy reply of image + text prompts (decoded causally at ordinary positions, as libmtmd does for
pixtral), and a follow-up that reuses the image's K/V without encoding it again.

libmtmd's pixtral graph makes its [IMG_BREAK] rows by scaling an uninitialised tensor by 0 before adding
the row: where that memory holds a NaN pattern (fresh heap when the compute buffer grows for a larger
image) the break rows come out NaN, one run in a few. Each module's oracle session encodes the largest
image the projector takes first, so its compute buffer never grows (and has been written) afterwards;
`oracle_encode` asserts the oracle's output is finite so the bug cannot pass as a difference.
"""
from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache

import llama_oracle
import mtmd_oracle
from gguf_factory_vision import write_gemma3_mmproj
from gguf_factory_vision_pixtral import img_break_row, write_pixtral_mmproj, write_pixtral_vision_pair
from vision_images import CASES, photo, png

from engine.api import EngineOptions, GenerateRequest, ImageInput, RestoreSession, SaveSession, Status
from engine.engine import Engine
from engine.errors import EngineError, ErrorCode, ModelFileError, RequestError
from engine.generation.generate import prefill
from engine.sampling import SamplingParams
from engine.text.image_tokens import image_runs
from engine.vision import mmproj
from engine.vision.images import decode_image
from engine_reads import while_held
from vision_chat import assert_greedy_equal, image, rgb, user

# max |ours - libmtmd| over an image's embeddings, relative to the largest |value|: measured
# 3.5e-4 - 7.9e-4 on the images (0.0015-0.0049 on values up to 8), 6.6e-4 - 9.1e-4 on the layouts (Pixtral
# 12B's 0.011-0.012 on values up to 15); ggml's CPU GELU goes through an fp16 table, the rest is float32
# summation order
RELATIVE_TOLERANCE = 2e-3
N_GEN = 8
WIDTH = 256
SIZES = [(128, 128), (203, 97), (61, 173), (517, 389), (1000, 700), (33, 400), (300, 31), (1, 1), (10, 10),
         (2, 300), (96, 40), (64, 64), (17, 9), (250, 260)]


def prime(model, mm) -> None:
    """The largest image first (1024 tokens: 256 x 256 pixels here), so the oracle's compute buffer never
    grows with fresh memory later (see the module docstring)."""
    oracle_encode(model, mm, photo(256, 256, seed=99))


def oracle_encode(model, mm, rgb: np.ndarray) -> np.ndarray:
    ref = mtmd_oracle.encode(model, mm, rgb)
    assert np.isfinite(ref).all(), "libmtmd's embeddings hold NaN (its uninitialised [IMG_BREAK] rows)"
    return ref


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    llama_oracle.require()
    model, mm = write_pixtral_vision_pair(tmp_path_factory.mktemp("pixtral"))
    prime(model, mm)
    return model, mm


@pytest.fixture(scope="module")
def projector(pair):
    return mmproj.load_projector(pair[1], "mistral3", WIDTH)


def assert_close(ours: np.ndarray, ref: np.ndarray, what: str) -> None:
    assert ours.shape == ref.shape, f"{what}: {ours.shape} vs libmtmd's {ref.shape}"
    d, top = float(np.abs(ours - ref).max()), float(np.abs(ref).max())
    assert d <= RELATIVE_TOLERANCE * top, f"{what}: max |d| {d:.4f} (values up to {top:.2f})"


def encode(projector, rgb: np.ndarray) -> np.ndarray:
    tower = projector.spec.tower
    return np.array(tower.encode(projector, tower.prepare(rgb, projector.spec)))


@pytest.mark.parametrize("name,width,height,mode", CASES + [("thin", 33, 400, "RGB"), ("strip", 300, 31, "RGB"),
                                                         ("one-pixel", 1, 1, "RGB"), ("tiny", 10, 10, "L")])
def test_embeddings_equal_libmtmd(pair, projector, name, width, height, mode):
    image = decode_image(png(photo(width, height, seed=width), mode))
    assert_close(encode(projector, image.rgb), oracle_encode(*pair, image.rgb), name)


@pytest.mark.parametrize("layout,kw", [
    ("pixtral-12b", dict(merge=1, bias=True, patch=8)),         # no merger, biased mm.1/mm.2, 8-pixel patches
    ("f16", dict(tensor_type="F16")),
    ("gelu", dict(act="gelu", n_head=4)),                      # gated GELU, 16-wide heads
    ("quick-gelu", dict(act="quick")),
])
def test_file_layouts_equal_libmtmd(tmp_path, pair, layout, kw):
    model = pair[0]
    mm = write_pixtral_mmproj(tmp_path / f"mmproj-{layout}.gguf", img_break=img_break_row(model), seed=5, **kw)
    prime(model, mm)
    proj = mmproj.load_projector(mm, "mistral3", WIDTH)
    for w, h in ((203, 97), (61, 173)):
        rgb = photo(w, h, seed=w + 1)
        assert_close(encode(proj, rgb), oracle_encode(model, mm, rgb), f"{layout} {w}x{h}")


def test_token_counts_equal_libmtmd(pair, projector):
    """The resize (sides to whole 8-pixel squares, 8..1024 tokens) and the tokens an image takes:
    rows x cols + the [IMG_BREAK] rows, then [IMG_END] as text, nothing before it."""
    model, mm = pair
    tower, spec = projector.spec.tower, projector.spec
    end = mtmd_oracle.chunks(model, mm, f"{mtmd_oracle.MARKER}", [photo(8, 8)])[-1][1][0]
    for w, h in SIZES:
        chunks = mtmd_oracle.chunks(model, mm, f"a {mtmd_oracle.MARKER} b", [photo(w, h)])
        assert [k for k, _ in chunks] == ["text", "image", "text"] and chunks[2][1][0] == end
        prepared = tower.prepare(photo(w, h), spec)
        rows, cols = prepared.grid
        assert prepared.n_tokens == chunks[1][1] == rows * cols + rows - 1, (w, h)
        assert prepared.pixels.shape == (rows * 8, cols * 8, 3)
        assert 8 <= rows * cols <= 1024 and prepared.n_tokens <= tower.max_tokens(spec)


def test_a_strip_too_thin_is_refused(projector):
    tower = projector.spec.tower
    with pytest.raises(RequestError, match=r"30000x1 image would take \d+ image tokens"):
        tower.prepare(np.zeros((1, 30000, 3), np.uint8), projector.spec)


def test_projectors_that_cannot_serve_the_model_are_refused(tmp_path, pair):
    with pytest.raises(ModelFileError, match="width 128.*256 wide"):
        mmproj.load_projector(write_pixtral_mmproj(tmp_path / "mmproj-narrow.gguf", n_text=128), "mistral3", WIDTH)
    with pytest.raises(ModelFileError, match="pixtral projector; the loaded model is a gemma3"):
        mmproj.load_projector(pair[1], "gemma3", WIDTH)
    with pytest.raises(ModelFileError, match="gemma3 projector; the loaded model is a mistral3"):
        mmproj.load_projector(write_gemma3_mmproj(tmp_path / "mmproj-gemma3.gguf"), "mistral3", WIDTH)
    no_break = write_pixtral_mmproj(tmp_path / "mmproj-nobreak.gguf", drop=("v.token_embd.img_break",))
    with pytest.raises(ModelFileError, match="has no v.token_embd.img_break"):
        mmproj.load_projector(no_break, "mistral3", WIDTH)


# ------------------------------------------------------------------------------------ the real Engine
@pytest.fixture(scope="module")
def engine(pair):
    eng = Engine(EngineOptions(model=str(pair[0]), cache_mib=256)).start()
    eng.startup.result()
    yield eng
    eng.stop()


def turn(text: str) -> str:
    return f"[INST]{text}[/INST]"        # the family's template (BOS from the tokenizer)


def generate(eng, messages, conversation: str = ""):
    return eng.call(GenerateRequest(messages=messages, conversation=conversation,
                                    sampling=SamplingParams(temperature=0.0, max_tokens=N_GEN)))


def encodes(eng) -> int:
    return while_held(eng, lambda e: e.loaded.vision.features.encodes)


def test_loaded_with_the_projector_beside_it(engine):
    assert engine.model_facts().vision == "pixtral"


def test_prompt_tokens_equal_libmtmd(engine, pair):
    a = image(203, 97, 1)
    msgs = [user("What is in ", a, " this picture?")]
    ours = while_held(engine, lambda e: e.prompts.prompt_tokens(GenerateRequest(messages=msgs)))
    chunks = mtmd_oracle.chunks(*pair, turn(f"What is in {mtmd_oracle.MARKER} this picture?"), [rgb(a)])
    (start, end), = image_runs(ours)
    assert [k for k, _ in chunks] == ["text", "image", "text"]
    assert ours[:start] == chunks[0][1] and end - start == chunks[1][1] == 311 and ours[end:] == chunks[2][1]


def logits_after(eng, messages) -> np.ndarray:
    """Strata's next-token logits after the prompt of `messages`, from an empty cache: text through
    the prefill, each image through the projector's feed (the engine's own parts, on its thread)."""
    def run(e):
        tokens = e.prompts.prompt_tokens(GenerateRequest(messages=messages))
        model, fed = e.loaded.model, []
        cache = make_prompt_cache(model)
        e.loaded.vision.read(model, cache, tokens[:-1], fed, lambda piece: prefill(model, cache, piece, fed))
        return np.array(model(mx.array(tokens[-1:])[None], cache=cache)[0, -1].astype(mx.float32))
    return while_held(eng, run)


# a long text first puts the image past the original context (32 positions here), where Ministral 3's
# attention temperature grows with the position: the image's own queries are scaled by theirs
LONG = "Here is a long preamble before the picture, so that it sits well past the original context. " * 3


@pytest.mark.parametrize("before,size", [("What is in ", (40, 30)), (LONG, (40, 30)), (LONG, (150, 110))])
def test_logits_after_an_image_equal_llama_cpp(engine, pair, before, size):
    """The next-token logits after image + text equal llama.cpp's (max |d| measured 0.0020-0.0033 on
    logits up to 6.8): the image decoded causally at its own positions, as libmtmd does for pixtral. A
    both-ways pass over the image missed by 0.13-1.05, the temperature at positions from 0 by 0.09-0.12."""
    a = image(*size, seed=7)
    ours = logits_after(engine, [user(before, a, " what is it?")])
    _, ref = mtmd_oracle.greedy(*pair, turn(f"{before}{mtmd_oracle.MARKER} what is it?"), [rgb(a)], 1)
    d = float(np.abs(ours - ref[0]).max())
    assert d < 3e-3 * float(np.abs(ref[0]).max()), f"max |d| {d:.4f}"


# small images keep the tiny random model's reply varied (hundreds of image tokens make it repeat one
# token whatever the image); one larger image covers many [IMG_BREAK] rows
@pytest.mark.parametrize("parts", [
    ("What is in ", ("a", 40, 30, 1, "RGB"), " this picture?"),
    ("What is in ", ("b", 40, 30, 9, "RGB"), " this picture?"),
    ("Describe ", ("portrait", 24, 56, 2, "RGBA"), " briefly."),
    (("gray", 64, 40, 4, "L"), "Compare it with ", ("wide", 72, 20, 5, "RGB"), "."),
    ("Look: ", ("large", 150, 110, 6, "RGB"), " what is it?"),
])
def test_greedy_reply_equals_llama_cpp(engine, pair, parts):
    imgs = {p[0]: image(p[1], p[2], seed=p[3], mode=p[4]) for p in parts if isinstance(p, tuple)}
    msgs = [user(*(imgs[p[0]] if isinstance(p, tuple) else p for p in parts))]
    text = turn("".join(mtmd_oracle.MARKER if isinstance(p, tuple) else p for p in parts))
    pixels = [rgb(i) for i in imgs.values()]
    ref, logits = mtmd_oracle.greedy(*pair, text, pixels, N_GEN)
    assert np.isfinite(logits).all()
    r = generate(engine, msgs, conversation=f"parity-{'-'.join(imgs)}")
    assert r.prompt_tokens == sum(n if k == "image" else len(n) for k, n in mtmd_oracle.chunks(*pair, text, pixels))
    assert_greedy_equal(r.tokens, ref, logits)


def test_the_image_decides_the_reply(engine):
    """Two pictures at the same place give different replies (what the parity above rests on: the
    image's embeddings reach the text model)."""
    a = generate(engine, [user("What is in ", image(40, 30, 1), " this picture?")])
    b = generate(engine, [user("What is in ", image(40, 30, 9), " this picture?")])
    assert a.tokens != b.tokens


def test_a_follow_up_reuses_the_image_without_encoding_it_again(engine, pair):
    a = image(48, 40, 31)
    history = [user("Here is a photo: ", a, " Describe it.")]
    r1 = generate(engine, history, conversation="follow")
    n = encodes(engine)
    history += [{"role": "assistant", "content": r1.text}, user("And the colours?")]
    r2 = generate(engine, history, conversation="follow")
    assert encodes(engine) == n, "the image was encoded again"
    held = r1.prompt_tokens + len(r1.tokens)
    assert r2.cached_tokens >= 0.9 * held, (r2.cached_tokens, held)


@pytest.fixture(scope="module")
def llama_pair(tmp_path_factory):
    llama_oracle.require()
    model, mm = write_pixtral_vision_pair(tmp_path_factory.mktemp("pixtral-llama"), family="llama-mistral-vision")
    prime(model, mm)
    return model, mm


def test_a_llama_architecture_model_reads_images_as_llama_cpp(llama_pair):
    """Mistral Small 3.1/3.2's and Pixtral 12B's text models are GGUF architecture llama beside a pixtral
    mmproj: the image feeds them the same way (logits max |d| measured 0.0010-0.0027 on values up to 7)."""
    model, mm = llama_pair
    eng = Engine(EngineOptions(model=str(model), cache_mib=64)).start()
    try:
        assert eng.startup.result().facts.vision == "pixtral"
        for size in ((40, 30), (150, 110)):
            a = image(*size, seed=7)
            msgs = [user("What is in ", a, " what?")]
            ref, logits = mtmd_oracle.greedy(model, mm, turn(f"What is in {mtmd_oracle.MARKER} what?"), [rgb(a)], N_GEN)
            ours = logits_after(eng, msgs)
            assert float(np.abs(ours - logits[0]).max()) < 3e-3 * float(np.abs(logits[0]).max())
            assert_greedy_equal(generate(eng, msgs).tokens, ref, logits)
    finally:
        eng.stop()


def test_an_image_too_thin_for_its_tokens_is_a_bad_request(engine):
    """libmtmd would make a 30000 x 1 strip thousands of tokens wide; Strata refuses it by name, in one
    line, and keeps serving."""
    strip = ImageInput(png(np.full((1, 30000, 3), 128, np.uint8)), "strip.png")
    with pytest.raises(EngineError) as e:
        generate(engine, [user("see ", strip)])
    assert e.value.code == ErrorCode.BAD_REQUEST and "messages[0].content[1]" in str(e.value)
    assert "image tokens" in str(e.value) and "\n" not in str(e.value)
    assert generate(engine, [user("What is in ", image(40, 30, 1), " this picture?")]).tokens


def test_a_session_file_restores_the_image_span_without_encoding(tmp_path, pair):
    """A pixtral image's span is as long as its size makes it (here 5 x 6 + 4 = 34 tokens, not a fixed
    count): saved in a session file and restored in a new engine, the follow-up reads it from the file's
    K/V, encoding nothing."""
    a = image(48, 40, 61)
    history = [user("Here is a photo: ", a, " Describe it.")]
    first = Engine(EngineOptions(model=str(pair[0]), cache_mib=64)).start()
    try:
        r1 = generate(first, history, conversation="saved")
        history += [{"role": "assistant", "content": r1.text}]
        first.call(SaveSession(str(tmp_path / "pixtral.strata"), messages=history, conversation="saved"))
    finally:
        first.stop()
    again = Engine(EngineOptions(model=str(pair[0]), cache_mib=64)).start()
    try:
        restored = again.call(RestoreSession(str(tmp_path / "pixtral.strata"), conversation="saved"))
        follow = restored.messages + [user("And the colours?")]
        tokens = while_held(again, lambda e: e.prompts.prompt_tokens(GenerateRequest(messages=follow)))
        (start, end), = image_runs(tokens)
        assert end - start == 34
        r2 = generate(again, follow, conversation="saved")
        assert again.call(Status()).vision["images_encoded"] == 0
        assert r2.cached_tokens >= max(end, 0.9 * (r1.prompt_tokens + len(r1.tokens)))
    finally:
        again.stop()
