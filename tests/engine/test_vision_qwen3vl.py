"""The qwen3vl_merger image projector (Qwen3.5 / Qwen3.6 / Qwen3-VL vision, engine/vision/towers/qwen3vl.py)
against llama.cpp's libmtmd on tiny mmproj files (tests/gguf_factory_vision_qwen3vl.py): the embeddings of
Pillow-made images (odd sizes, portrait/landscape, tiny, RGBA, grayscale; resized or not, the position
table resized or not), DeepStack features, the image-token counts of libmtmd's smart resize (min and
max bounds), and projector files that cannot serve the loaded model refused by name.

Through the real Engine on the tiny Qwen3.5 (engine/vision/text_mrope.py's positions): the prompt's
tokens, the logits after an image (its M-RoPE positions, the text after it from p0 + max(rows, cols)),
greedy replies, and the positions kept across K/V reuse (a follow-up, a parked chat, the disk tier after
a restart, a restored session continued with image references only), qwen35moe too."""
from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

import llama_oracle
import mtmd_oracle
from gguf_factory_vision import write_gemma3_mmproj
from gguf_factory_vision_qwen3vl import write_qwen3vl_mmproj, write_qwen3vl_vision_pair
from engine_reads import while_held
from vision_images import photo, png

from engine.api import (CountTokens, EngineOptions, GenerateRequest, ImageInput, RestoreSession, SaveSession,
                        Status)
from engine.engine import Engine
from engine.errors import ModelFileError
from engine.vision import mmproj
from engine.sampling import SamplingParams
from engine.text.image_tokens import image_runs
from engine.vision.images import decode_image
from vision_chat import assert_greedy_equal, encoded, image, rgb, user
from engines import maker

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


# ------------------------------------------------------------------------------------ through the engine
# A text model whose full-attention layers' positions matter in a few tokens (RoPE base 1e4 on 64 of
# 128 dims, every 2nd layer full attention): with text after an image placed at its token count, or
# the image's tokens at plain positions, the first logits differ from llama.cpp's by 0.5-0.9 (measured).
TEXT_KW = {"rope_theta": 1e4, "interval": 2, "n_rot": 64}
N_GEN = 12
TURN = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n<think>\n"


@pytest.fixture(scope="module")
def engine_pair(tmp_path_factory):
    llama_oracle.require()
    return write_qwen3vl_vision_pair(tmp_path_factory.mktemp("qwen3vl-engine"), text_kw=TEXT_KW)


@pytest.fixture(scope="module")
def engine(engine_pair):
    eng = Engine(EngineOptions(model=str(engine_pair[0]), cache_mib=256)).start()
    eng.startup.result()
    yield eng
    eng.stop()


def generate(eng, messages, conversation: str):
    return eng.call(GenerateRequest(messages=messages, conversation=conversation,
                                    sampling=SamplingParams(temperature=0.0, max_tokens=N_GEN)))


def test_loaded_with_the_projector_beside_it(engine):
    assert engine.model_facts().vision == "qwen3vl_merger"


def test_prompt_tokens_equal_libmtmd(engine, engine_pair):
    a = image(203, 97, 1)
    msgs = [user("What is in ", a, " this picture?")]
    ours = while_held(engine, lambda e: e.prompts.prompt_tokens(GenerateRequest(messages=msgs)))
    chunks = mtmd_oracle.chunks(*engine_pair, TURN.format(f"What is in {mtmd_oracle.MARKER} this picture?"), [rgb(a)])
    runs = image_runs(ours)
    assert len(runs) == 1 and [k for k, _ in chunks] == ["text", "image", "text"]
    start, end = runs[0]
    assert ours[:start] == chunks[0][1] and end - start == chunks[1][1] == 300 and ours[end:] == chunks[2][1]
    assert engine.call(CountTokens(messages=msgs)).tokens == len(ours)


def test_first_logits_equal_llama_cpp(engine, engine_pair):
    """The logits after an image + text prompt (the image's (t, h, w) positions, the text after it from
    p0 + max(rows, cols)) against llama.cpp's: measured 0.0014-0.0023 (values up to ~6)."""
    model, mm = engine_pair
    for w, h in ((64, 48), (61, 173)):
        img = image(w, h, seed=w)
        msgs = [user("What is in ", img, " this picture?")]
        tokens = while_held(engine, lambda e: e.prompts.prompt_tokens(GenerateRequest(messages=msgs)))
        _, logits = mtmd_oracle.greedy(model, mm, TURN.format(f"What is in {mtmd_oracle.MARKER} this picture?"),
                                       [rgb(img)], 1)
        ours = while_held(engine, lambda e: last_logits(e, tokens))
        assert float(np.abs(ours - logits[0]).max()) < 2e-2, (w, h)


def last_logits(eng, tokens: list[int], split: int | None = None) -> np.ndarray:
    """The engine's model over `tokens` (text prefilled, each image fed whole) in a fresh cache, the
    last token's logits; `split`: read in two turns (each with the positions `Vision.text_positions`
    gives the cache's tokens so far), as a follow-up reads its text after a held image."""
    model, vision = eng.model, eng.loaded.vision
    cache, fed = model.make_cache(), []
    out = []

    def text(part):
        out[:] = [model(mx.array(part)[None], cache=cache)]
        fed.extend(part)
    split = len(tokens) if split is None else split
    for a, b in ((0, split), (split, len(tokens))):
        vision.read(model, cache, tokens[a:b], fed, text)       # each read takes its positions
    return np.array(out[0][0, -1].astype(mx.float32))


@pytest.mark.parametrize("parts", [
    ("Describe ", ("portrait", 61, 173, "RGBA"), " briefly."),
    (("square", 64, 64, "RGB"), "Compare it with ", ("gray", 150, 90, "L"), "."),
])
def test_greedy_reply_equals_llama_cpp(engine, engine_pair, parts):
    imgs = {p[0]: image(p[1], p[2], seed=p[1] + p[2], mode=p[3]) for p in parts if isinstance(p, tuple)}
    msgs = [user(*(imgs[p[0]] if isinstance(p, tuple) else p for p in parts))]
    text = TURN.format("".join(mtmd_oracle.MARKER if isinstance(p, tuple) else p for p in parts))
    pixels = [rgb(imgs[p[0]]) for p in parts if isinstance(p, tuple)]
    ref, logits = mtmd_oracle.greedy(*engine_pair, text, pixels, N_GEN)
    r = generate(engine, msgs, conversation=f"parity-{len(imgs)}")
    assert r.prompt_tokens == sum(n if k == "image" else len(n) for k, n in mtmd_oracle.chunks(*engine_pair, text, pixels))
    assert_greedy_equal(r.tokens, ref, logits)


def test_a_follow_up_reuses_the_image_and_its_positions(engine, engine_pair):
    """The second turn reads only its new text (the image's K/V reused, not encoded again) and its text
    goes on from the image's M-RoPE positions: its greedy reply equals llama.cpp's over the whole chat."""
    img = image(120, 72, seed=7)
    first = [user("Look at ", img, " and say what you see.")]
    r1 = generate(engine, first, conversation="follow-up")
    encoded = while_held(engine, lambda e: e.loaded.vision.features.encodes)
    history = first + [{"role": "assistant", "content": r1.text}, user("And the colours?")]
    r2 = generate(engine, history, conversation="follow-up")
    assert while_held(engine, lambda e: e.loaded.vision.features.encodes) == encoded
    assert r2.cached_tokens >= 0.9 * r1.prompt_tokens
    tokens = while_held(engine, lambda e: e.prompts.prompt_tokens(GenerateRequest(messages=history)))
    text = (TURN.format(f"Look at {mtmd_oracle.MARKER} and say what you see.").removesuffix("<think>\n")
            + r1.text + "<|im_end|>\n" + TURN.format("And the colours?"))
    chunks = mtmd_oracle.chunks(*engine_pair, text, [rgb(img)])
    assert chunks[0][1] + [tokens[image_runs(tokens)[0][0]]] * chunks[1][1] + chunks[2][1] == tokens
    ref, logits = mtmd_oracle.greedy(*engine_pair, text, [rgb(img)], N_GEN)
    assert_greedy_equal(r2.tokens, ref, logits)
    # the same text read after the held image (its shift from the cache's tokens): llama.cpp's logits
    ours = while_held(engine, lambda e: last_logits(e, tokens, split=r1.prompt_tokens))
    assert float(np.abs(ours - logits[0]).max()) < 2e-2


def test_text_only_conversations_keep_mlx_lms_rope(engine):
    """After a turn with an image, the full-attention layers' RoPE is mlx-lm's own again (the shift is
    installed for a turn with images only)."""
    generate(engine, [user("One ", image(40, 40, seed=3), " image.")], conversation="img")
    ropes = while_held(engine, lambda e: [type(l.self_attn.rope) for l in e.model.layers if not l.is_linear])
    assert ropes and all(r is nn.RoPE for r in ropes)


# ------------------------------------------------------------------------- K/V reuse keeps the positions
@pytest.fixture
def make_engine(engine_pair):
    with maker(engine_pair[0], cache_mib=256) as make:
        yield make


def follow_up_equals_llama_cpp(eng, engine_pair, hist: list, r1, img: ImageInput, words: str):
    """A follow-up on `hist` (one image, then the reply `r1`): served from held K/V with nothing encoded,
    its greedy reply equal to llama.cpp's over the whole chat."""
    n = encoded(eng)
    follow = hist + [user("And the colours?")]
    r2 = generate(eng, follow, "chat")
    assert encoded(eng) == n, "the image was encoded again"
    assert r2.cached_tokens >= 0.9 * r1.prompt_tokens
    text = (TURN.format(f"{words}{mtmd_oracle.MARKER} Describe it.").removesuffix("<think>\n")
            + r1.text + "<|im_end|>\n" + TURN.format("And the colours?"))
    ref, logits = mtmd_oracle.greedy(*engine_pair, text, [rgb(img)], N_GEN)
    assert_greedy_equal(r2.tokens, ref, logits)
    return r2


def first_turn(eng, img: ImageInput, words: str = "Here is a photo: ", conversation: str = "chat"):
    history = [user(words, img, " Describe it.")]
    r = generate(eng, history, conversation)
    return history + [{"role": "assistant", "content": r.text}], r


def test_parked_and_brought_back(make_engine, engine_pair):
    eng = make_engine()
    a = image(150, 110, 51)
    hist, r1 = first_turn(eng, a)
    first_turn(eng, image(110, 150, 52), "Another one: ", conversation="chat-b")      # chat is parked
    assert eng.call(Status()).conversations[0]["owner"] == "chat-b"
    follow_up_equals_llama_cpp(eng, engine_pair, hist, r1, a, "Here is a photo: ")


def test_disk_tier_after_a_restart(make_engine, engine_pair, tmp_path):
    disk = dict(disk_mib=64, disk_dir=str(tmp_path / "disk"))
    eng = make_engine(**disk)
    a = image(140, 100, 61)
    hist, r1 = first_turn(eng, a)
    assert eng.wait_idle(60)
    eng.stop()
    again = make_engine(**disk)
    r2 = follow_up_equals_llama_cpp(again, engine_pair, hist, r1, a, "Here is a photo: ")
    assert r2.restored_from_disk > 0 and encoded(again) == 0


def test_a_restored_session_continued_with_references_only(make_engine, engine_pair, tmp_path):
    """The restored messages keep the image as a reference (digest, tokens and its grid): sent back
    with no pixels, the follow-up is served from the restored K/V and its text placed after the image
    as llama.cpp places it."""
    eng = make_engine()
    a = image(120, 90, 71)
    hist, r1 = first_turn(eng, a)
    path = str(tmp_path / "with-image.strata")
    eng.call(SaveSession(path, messages=hist, conversation="chat"))
    eng.stop()
    again = make_engine()
    restored = again.call(RestoreSession(path, conversation="chat"))
    ref = restored.messages[0]["content"][1]
    assert ref["type"] == "image" and ref["grid"] == [11, 15] and "image" not in ref
    follow_up_equals_llama_cpp(again, engine_pair, restored.messages, r1, a, "Here is a photo: ")
    assert encoded(again) == 0


def test_a_different_image_at_the_same_place_never_reuses_kv(make_engine, engine_pair):
    eng = make_engine()
    a, b = image(90, 140, 21), image(90, 140, 22)
    head = [{"role": "user", "content": "Hello there."}, {"role": "assistant", "content": "Hi."}]
    first = generate(eng, head + [user("Look: ", a, " what is it?")], "swap")
    msgs = head + [user("Look: ", b, " what is it?")]
    second = generate(eng, msgs, "swap")
    start = image_runs(while_held(eng, lambda e: e.prompts.prompt_tokens(GenerateRequest(messages=msgs))))[0][0]
    assert first.cached_tokens == 0 and second.cached_tokens <= start
    text = ("<|im_start|>user\nHello there.<|im_end|>\n<|im_start|>assistant\nHi.<|im_end|>\n"
            + TURN.format(f"Look: {mtmd_oracle.MARKER} what is it?"))
    ref, logits = mtmd_oracle.greedy(*engine_pair, text, [rgb(b)], N_GEN)
    assert_greedy_equal(second.tokens, ref, logits)


def test_qwen35moe_first_logits_equal_llama_cpp(tmp_path):
    """The MoE variant (qwen35moe) takes the same projector and positions."""
    model, mm = write_qwen3vl_vision_pair(tmp_path, text_kw={**TEXT_KW, "arch": "qwen35moe"})
    eng = Engine(EngineOptions(model=str(model), cache_mib=64)).start()
    try:
        eng.startup.result()
        img = image(88, 56, seed=9)
        msgs = [user("What is in ", img, " this picture?")]
        tokens = while_held(eng, lambda e: e.prompts.prompt_tokens(GenerateRequest(messages=msgs)))
        _, logits = mtmd_oracle.greedy(model, mm, TURN.format(f"What is in {mtmd_oracle.MARKER} this picture?"),
                                       [rgb(img)], 1)
        ours = while_held(eng, lambda e: last_logits(e, tokens))
        assert float(np.abs(ours - logits[0]).max()) < 2e-2
    finally:
        eng.stop()


def test_a_projector_with_a_position_table_that_is_not_square_is_refused(tmp_path):
    mm = write_qwen3vl_mmproj(tmp_path / "mmproj-bad.gguf", edit=lambda t: t.update(
        {"v.position_embd.weight": t["v.position_embd.weight"][:-3]}))
    with pytest.raises(ModelFileError, match="shapes disagree.*position table"):
        mmproj.load_projector(mm, "qwen35", 256)


def test_two_images_logits_equal_llama_cpp(engine, engine_pair):
    """The second image starts where the first one's positions end (p0 + max(rows, cols) + the text
    between), and the text after both carries both shifts."""
    model, mm = engine_pair
    a, b = image(96, 40, seed=11), image(40, 72, seed=12)
    msgs = [user("First ", a, " then ", b, " compare.")]
    tokens = while_held(engine, lambda e: e.prompts.prompt_tokens(GenerateRequest(messages=msgs)))
    assert len(image_runs(tokens)) == 2
    text = TURN.format(f"First {mtmd_oracle.MARKER} then {mtmd_oracle.MARKER} compare.")
    _, logits = mtmd_oracle.greedy(model, mm, text, [rgb(a), rgb(b)], 1)
    ours = while_held(engine, lambda e: last_logits(e, tokens))
    assert float(np.abs(ours - logits[0]).max()) < 2e-2


def test_qwen_image_chats_run_alone_beside_a_batch_and_equal_their_lone_replies(make_engine):
    """Qwen's text after an image sits at shifted positions, set on the model for one turn: an image
    chat (and its follow-up) is never a batch row; it runs alone between the batch's steps while the
    text chats batch, and every reply equals the one its request gets alone."""
    a = image(96, 72, 61)
    hist = [user("Here is a photo: ", a, " Describe it.")]
    reqs = [GenerateRequest(messages=m, conversation=c, sampling=SamplingParams(temperature=0.0, max_tokens=N_GEN))
            for m, c in ((hist, "img"), ([{"role": "user", "content": "Tell me about number 7."}], "t1"),
                         ([{"role": "user", "content": "Count to three, slowly."}], "t2"))]
    lone = make_engine(max_sequences=1)
    want = [lone.call(r) for r in reqs]
    lone.stop()
    eng = make_engine(max_sequences=4)
    hold = eng.scheduler.hold()
    try:
        handles = [eng.submit(r) for r in reqs]
    finally:
        hold.release()
    got = [h.result(300) for h in handles]
    assert [r.tokens for r in got] == [r.tokens for r in want]
    c = eng.call(Status()).batch
    assert c.image_rows == 0 and c.rows >= 2, c
