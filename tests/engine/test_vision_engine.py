"""Images in the chat through the whole engine on a tiny Gemma 3 + gemma3 mmproj pair, against llama.cpp's
libmtmd (mtmd_tokenize, then mtmd_helper_eval_chunks and greedy decoding): the prompt's tokens, the
greedy reply; and image spans as part of the K/V key (a different image at the same place never
reuses K/V, a follow-up reuses the image's, an image sent again is not encoded again)."""
from __future__ import annotations

import pytest

import llama_oracle
import mtmd_oracle
from gguf_factory_gemma import write_tiny_gemma3
from gguf_factory_vision import write_gemma3_mmproj, write_gemma3_vision_pair

from engine.api import CountTokens, EngineOptions, GenerateRequest, LoadModel
from engine.engine import Engine
from engine.errors import EngineError, ErrorCode
from engine.sampling import SamplingParams
from engine.text.image_tokens import image_runs
from engine_reads import while_held
from vision_chat import assert_greedy_equal, image, rgb, user

N_GEN = 8
TURN = "<start_of_turn>user\n{}<end_of_turn>\n<start_of_turn>model\n"


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    llama_oracle.require()
    return write_gemma3_vision_pair(tmp_path_factory.mktemp("vision-pair"))


@pytest.fixture(scope="module")
def engine(pair):
    eng = Engine(EngineOptions(model=str(pair[0]), cache_mib=256)).start()
    eng.startup.result()
    yield eng
    eng.stop()


def generate(eng, messages, conversation: str = ""):
    return eng.call(GenerateRequest(messages=messages, conversation=conversation,
                                    sampling=SamplingParams(temperature=0.0, max_tokens=N_GEN)))


def encodes(eng) -> int:
    return while_held(eng, lambda e: e.loaded.vision.features.encodes)


def test_loaded_with_the_projector_beside_it(engine):
    facts = engine.model_facts()
    assert facts.vision == "gemma3"


def test_prompt_tokens_equal_libmtmd(engine, pair):
    a = image(203, 97, 1)
    msgs = [user("What is in ", a, " this picture?")]
    ours = while_held(engine, lambda e: e.prompts.prompt_tokens(GenerateRequest(messages=msgs)))
    chunks = mtmd_oracle.chunks(*pair, TURN.format(f"What is in {mtmd_oracle.MARKER} this picture?"), [rgb(a)])
    runs = image_runs(ours)
    assert len(runs) == 1 and [k for k, _ in chunks] == ["text", "image", "text"]
    start, end = runs[0]
    assert ours[:start] == chunks[0][1] and end - start == chunks[1][1] == 256 and ours[end:] == chunks[2][1]
    assert engine.call(CountTokens(messages=msgs)).tokens == len(ours)


@pytest.mark.parametrize("parts", [
    ("Describe ", ("portrait", 61, 173, "RGBA"), " briefly."),
    (("square", 128, 128, "RGB"), "Compare it with ", ("gray", 150, 90, "L"), "."),
])
def test_greedy_reply_equals_llama_cpp(engine, pair, parts):
    imgs = {p[0]: image(p[1], p[2], seed=p[1] + p[2], mode=p[3]) for p in parts if isinstance(p, tuple)}
    msgs = [user(*(imgs[p[0]] if isinstance(p, tuple) else p for p in parts))]
    text = TURN.format("".join(mtmd_oracle.MARKER if isinstance(p, tuple) else p for p in parts))
    ref, logits = mtmd_oracle.greedy(*pair, text, [rgb(imgs[p[0]]) for p in parts if isinstance(p, tuple)], N_GEN)
    r = generate(engine, msgs, conversation=f"parity-{len(imgs)}")
    assert r.prompt_tokens == sum(n if k == "image" else len(n) for k, n in mtmd_oracle.chunks(
        *pair, text, [rgb(i) for i in imgs.values()]))
    assert_greedy_equal(r.tokens, ref, logits)


def test_a_different_image_at_the_same_place_never_reuses_kv(engine, pair):
    a, b = image(90, 140, 21), image(90, 140, 22)
    # an earlier exchange: the turn's message boundary is a checkpoint the sliding-window K/V can go back to
    head = [{"role": "user", "content": "Hello there."}, {"role": "assistant", "content": "Hi."}]
    first = generate(engine, head + [user("Look: ", a, " what is it?")], conversation="swap")
    msgs = head + [user("Look: ", b, " what is it?")]
    second = generate(engine, msgs, conversation="swap")
    tokens = while_held(engine, lambda e: e.prompts.prompt_tokens(GenerateRequest(messages=msgs)))
    start = image_runs(tokens)[0][0]
    assert first.cached_tokens == 0 and 0 < second.cached_tokens <= start   # the text before the image only
    text = TURN.format("Hello there.").removesuffix("<start_of_turn>model\n") + "<start_of_turn>model\nHi.<end_of_turn>\n" \
        + TURN.format(f"Look: {mtmd_oracle.MARKER} what is it?")
    ref, logits = mtmd_oracle.greedy(*pair, text, [rgb(b)], N_GEN)
    assert_greedy_equal(second.tokens, ref, logits)


def test_a_follow_up_reuses_the_image_without_encoding_it_again(engine):
    a = image(170, 120, 31)
    history = [user("Here is a photo: ", a, " Describe it.")]
    r1 = generate(engine, history, conversation="follow")
    n = encodes(engine)
    history += [{"role": "assistant", "content": r1.text}, user("And the colours?")]
    r2 = generate(engine, history, conversation="follow")
    assert encodes(engine) == n, "the image was encoded again"
    held = r1.prompt_tokens + len(r1.tokens)
    assert r2.cached_tokens >= 0.9 * held, (r2.cached_tokens, held)


def test_an_image_sent_again_in_another_chat_is_not_encoded_again(engine):
    a = image(120, 80, 41)
    generate(engine, [user("First chat: ", a)], conversation="chat-a")
    n = encodes(engine)
    r = generate(engine, [user("Another chat, other words, same picture ", a, " ok?")], conversation="chat-b")
    assert encodes(engine) == n
    assert r.cached_tokens < image_runs(while_held(engine, lambda e: e.prompts.prompt_tokens(GenerateRequest(
        messages=[user("Another chat, other words, same picture ", a, " ok?")]))))[0][0]


def test_a_model_without_a_projector_refuses_an_image(tmp_path):
    model = write_tiny_gemma3(tmp_path / "text-only.gguf", tensor_type="F32", image_tokens=True)
    eng = Engine(EngineOptions(model=str(model))).start()
    try:
        assert eng.startup.result().facts.vision is None
        with pytest.raises(EngineError) as e:
            generate(eng, [user("see ", image(40, 40, 1))])
        assert e.value.code == ErrorCode.BAD_REQUEST
        assert "reads text only: no image projector (mmproj)" in str(e.value) and "\n" not in str(e.value)
        assert generate(eng, [{"role": "user", "content": "text still works"}]).tokens
    finally:
        eng.stop()


def test_projector_choice_at_load(tmp_path, pair):
    model, mm = pair
    narrow = write_gemma3_mmproj(tmp_path / "mmproj-narrow.gguf", n_text=128)
    eng = Engine(EngineOptions(model=str(model), mmproj="")).start()
    try:
        assert eng.startup.result().facts.vision is None            # "": none, though one is beside it
        with pytest.raises(EngineError) as e:
            eng.call(LoadModel(str(model), mmproj=str(narrow)))
        assert e.value.code == ErrorCode.BAD_REQUEST and "width 128" in str(e.value)
        assert eng.call(LoadModel(str(model), mmproj=str(mm))).facts.vision == "gemma3"
    finally:
        eng.stop()


def test_a_mismatched_projector_beside_the_model_is_skipped(tmp_path):
    model = write_tiny_gemma3(tmp_path / "tiny.gguf", tensor_type="F32", image_tokens=True)
    write_gemma3_mmproj(tmp_path / "mmproj-tiny.gguf", n_text=128)
    eng = Engine(EngineOptions(model=str(model))).start()
    try:
        assert eng.startup.result().facts.vision is None             # served as text, said in the log
    finally:
        eng.stop()
