"""Images through a batching server (the server's default: several requests decode together): clients
with the real openai and anthropic SDKs send chats with images and a text chat at the same moment to a
tiny vision model (a Gemma 3 text model with its gemma3 mmproj, tests/gguf_factory_vision.py) behind
uvicorn. Each gets the answer it gets alone, the rows shared decode steps (EngineStatus.batch), and
follow-ups sent at once reuse the held image spans without encoding an image again."""
from __future__ import annotations

import base64
import threading

import pytest

from gguf_factory_vision import write_gemma3_vision_pair
from test_server_images import _anthropic, _openai
from test_server_image_usage import _photo

from engine.api import BatchCounters, Status
from engine.engine import Engine, EngineOptions
from engine.frontends.server import ServerThread, create_app

IMAGE_TOKENS = 256
N_TOKENS = 24


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """(engine and server that batch, engine and server that serve one request at a time)."""
    model, _ = write_gemma3_vision_pair(tmp_path_factory.mktemp("vision-batch"))
    made = []
    for n in (8, 1):
        eng = Engine(EngineOptions(model=str(model), cache_mib=256, max_sequences=n)).start()
        eng.startup.result()
        made.append((eng, ServerThread(create_app(eng)).start()))
    yield made
    for eng, srv in made:
        srv.stop()
        eng.stop()


def _data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def _oa_chat(history: list, content) -> list:
    return [*history, {"role": "user", "content": content}]


def _ask_openai(srv, messages) -> tuple[str, int, int]:
    c = _openai(srv)
    try:
        r = c.chat.completions.create(model="tiny-gemma3-vision", max_tokens=N_TOKENS, temperature=0, messages=messages)
        cached = r.usage.prompt_tokens_details.cached_tokens if r.usage.prompt_tokens_details else 0
        return r.choices[0].message.content or "", r.usage.prompt_tokens, cached or 0
    finally:
        c.close()


def _ask_anthropic(srv, messages) -> tuple[str, int, int]:
    a = _anthropic(srv)
    try:
        # this anthropic SDK's create() has no sampling arguments: they travel in the body as extras
        m = a.messages.create(model="m", max_tokens=N_TOKENS, messages=messages, extra_body={"temperature": 0})
        text = "".join(b.text for b in m.content if b.type == "text")
        read = m.usage.cache_read_input_tokens or 0
        return text, m.usage.input_tokens + read, read
    finally:
        a.close()


def _at_once(asks) -> list:
    """Each (function, arguments) called on its own thread, all released together."""
    results, errors = [None] * len(asks), []
    barrier = threading.Barrier(len(asks))

    def worker(i):
        try:
            barrier.wait()
            results[i] = asks[i][0](*asks[i][1:])
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)
    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(asks))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not errors, errors
    return results


def _state(eng) -> tuple[BatchCounters, int]:
    s = eng.call(Status())
    return s.batch or BatchCounters(), s.vision["images_encoded"]


def _chats(cat: bytes, dog: bytes) -> list:
    """(asker, messages) of two chats with an image (openai, anthropic) and a text chat."""
    return [(_ask_openai, [{"role": "user", "content": [
                {"type": "text", "text": "What is in this picture?"},
                {"type": "image_url", "image_url": {"url": _data_url(cat)}}]}]),
            (_ask_anthropic, [{"role": "user", "content": [
                {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                             "data": base64.b64encode(dog).decode()}},
                {"type": "text", "text": "And this one?"}]}]),
            (_ask_openai, [{"role": "user", "content": "Tell me a story about a lighthouse."}])]


def _follow_ups(chats: list, answers: list) -> list:
    return [(ask, [*msgs, {"role": "assistant", "content": a[0] or "ok"},
                   {"role": "user", "content": "Say more about its colours."}])
            for (ask, msgs), a in zip(chats, answers)]


def test_image_chats_and_a_text_chat_at_once_equal_their_lone_answers(servers):
    (eng, srv), (_, lone) = servers
    chats = _chats(_photo(61, 43, seed=4), _photo(50, 90, seed=5))
    want = [ask(lone, msgs) for ask, msgs in chats]
    before, _ = _state(eng)
    got = _at_once([(ask, srv, msgs) for ask, msgs in chats])
    mid, encoded = _state(eng)
    assert [g[:2] for g in got] == [w[:2] for w in want]      # the answers and their prompt counts
    assert mid.image_rows - before.image_rows == 2, "the image chats were not batch rows"
    assert mid.shared_steps > before.shared_steps, "the clients' rows never stepped together"
    assert encoded == 2
    # their follow-ups at once: the image spans come from held K/V, no image is read or encoded again
    follow = _follow_ups(chats, want)
    want2 = [ask(lone, msgs) for ask, msgs in follow]
    got2 = _at_once([(ask, srv, msgs) for ask, msgs in follow])
    after, encoded_after = _state(eng)
    assert [g[:2] for g in got2] == [w[:2] for w in want2]
    assert all(g[2] >= IMAGE_TOKENS for g in got2[:2]), got2
    assert encoded_after == encoded and after.image_rows == mid.image_rows
    assert after.shared_steps > mid.shared_steps
