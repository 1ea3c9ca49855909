"""Images through the server (engine/frontends/image_parts.py): OpenAI `image_url` parts with data:
URLs and Anthropic `image` blocks with a base64 source, sent with the real openai and anthropic SDKs to
a real Engine behind uvicorn. Before the engine sees an image: a model without a projector answers 400
"reads text only"; a damaged file, non-image data, a decompression bomb, an http(s) URL (not fetched
without --allow-image-urls: test_server_image_urls.py),
bad base64 or more than 8 images answer 400 naming the content part; never a traceback.

The tiny test model reads text only (the projectors are built beside this). To reach the checks that
come after the projector test, one server is given the same engine seen through `ClaimsVision`, which
reports a projector in the model's facts and forwards everything else: every request it gets in these
tests is refused before the engine is asked for anything.
"""
from __future__ import annotations

import base64
import dataclasses
import io
import struct
import zlib

import anthropic
import numpy as np
import openai
import pytest
from PIL import Image

from engines import running
from engine.api import ImageInput
from engine.engine import Engine, EngineOptions
from engine.frontends.anthropic_api import convert_messages
from engine.frontends.image_parts import MAX_REQUEST_IMAGES, ImageBudget, split_openai, with_images
from engine.frontends.server import ServerThread, create_app
from engine.frontends.wire import APIError


def _png(w: int = 24, h: int = 16, seed: int = 0) -> bytes:
    a = np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(a).save(buf, "PNG")
    return buf.getvalue()


def _bomb() -> bytes:
    d = bytearray(_png(8, 8))
    struct.pack_into(">II", d, 16, 80000, 80000)
    struct.pack_into(">I", d, 29, zlib.crc32(bytes(d[12:29])))
    return bytes(d)


def _url(data: bytes, kind: str = "image/png") -> str:
    return f"data:{kind};base64,{base64.b64encode(data).decode()}"


def _oa_image(data: bytes) -> dict:
    return {"type": "image_url", "image_url": {"url": _url(data)}}


def _an_image(data: bytes) -> dict:
    return {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                        "data": base64.b64encode(data).decode()}}


class ClaimsVision:
    """The engine as a server sees it, with an image projector in its facts (see the module's note)."""

    def __init__(self, engine):
        self._engine = engine

    def model_facts(self):
        facts = self._engine.model_facts()
        return dataclasses.replace(facts, vision="gemma3") if facts is not None else None

    def __getattr__(self, name):
        return getattr(self._engine, name)


@pytest.fixture(scope="module")
def engine(server_model):
    with running(server_model) as eng:
        yield eng


@pytest.fixture(scope="module")
def servers(engine):
    text, vision = ServerThread(create_app(engine)).start(), ServerThread(create_app(ClaimsVision(engine))).start()
    yield text, vision
    text.stop()
    vision.stop()


def _openai(srv):
    return openai.OpenAI(base_url=srv.base_url, api_key="unused", max_retries=0, timeout=120)


def _anthropic(srv):
    return anthropic.Anthropic(base_url=srv.base_url.removesuffix("/v1"), api_key="unused", max_retries=0,
                               timeout=120)


def _oa_refusal(srv, content, stream=False) -> openai.BadRequestError:
    c = _openai(srv)
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model="tiny-server", max_tokens=4, stream=stream,
                                  messages=[{"role": "user", "content": content}])
    c.close()
    return e.value


def test_a_text_only_model_refuses_images_by_name_and_still_answers_text(servers):
    text, _ = servers
    e = _oa_refusal(text, [{"type": "text", "text": "what is this?"}, _oa_image(_png())])
    assert e.body["param"] == "messages[0].content[1]" and e.body["code"] == "model_reads_text_only"
    assert "tiny-server reads text only" in e.body["message"]
    c = _anthropic(text)
    with pytest.raises(anthropic.BadRequestError) as ae:
        c.messages.create(model="m", max_tokens=4, messages=[{"role": "user", "content": [
            _an_image(_png()), {"type": "text", "text": "what is this?"}]}])
    assert "messages.0.content.0: the model tiny-server reads text only" in ae.value.body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError):
        c.messages.count_tokens(model="m", messages=[{"role": "user", "content": [_an_image(_png())]}])
    r = c.messages.create(model="m", max_tokens=4, messages=[{"role": "user", "content": "hello"}])
    assert r.usage.output_tokens > 0                      # the engine is fine and answers text
    c.close()


@pytest.mark.parametrize("data, words", [
    (_png(64, 64)[:200], "the image is damaged or truncated"),
    (b"just some text", "not an image Strata reads"),
    (_bomb(), "MP are read"),
])
def test_a_bad_image_is_a_400_naming_its_content_part(servers, data, words):
    _, vision = servers
    for stream in (False, True):
        e = _oa_refusal(vision, [{"type": "text", "text": "look"}, _oa_image(data)], stream=stream)
        assert e.body["param"] == "messages[0].content[1]" and e.body["code"] == "invalid_image"
        assert e.body["message"].startswith(f"messages[0].content[1]: {words}") or words in e.body["message"]
        assert "\n" not in e.body["message"] and "Traceback" not in e.body["message"]
    c = _anthropic(vision)
    with pytest.raises(anthropic.BadRequestError) as ae:
        c.messages.create(model="m", max_tokens=4, messages=[
            {"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
            {"role": "user", "content": [{"type": "text", "text": "look"}, _an_image(data)]}])
    msg = ae.value.body["error"]["message"]
    assert msg.startswith("messages.2.content.1: ") and words in msg
    c.close()


def test_urls_bad_data_urls_too_many_images_and_images_outside_user_turns_are_refused(servers):
    _, vision = servers
    e = _oa_refusal(vision, [{"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}])
    assert e.body["param"] == "messages[0].content[0].image_url.url" and e.body["code"] == "image_url_not_supported"
    e = _oa_refusal(vision, [{"type": "image_url", "image_url": {"url": "data:image/png,notbase64"}}])
    assert "data: URL with base64" in e.body["message"]
    e = _oa_refusal(vision, [{"type": "image_url", "image_url": {"url": "data:image/png;base64,@@@@"}}])
    assert "not valid base64" in e.body["message"]
    many = [_oa_image(_png(8, 8, i)) for i in range(MAX_REQUEST_IMAGES + 1)]
    e = _oa_refusal(vision, many)
    assert e.body["param"] == f"messages[0].content[{MAX_REQUEST_IMAGES}]" and e.body["code"] == "too_many_images"
    c = _openai(vision)
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model="tiny-server", max_tokens=4, messages=[
            {"role": "user", "content": "hi"}, {"role": "assistant", "content": [_oa_image(_png())]}])
    assert e.value.body["param"] == "messages[1].content"
    c.close()
    a = _anthropic(vision)
    with pytest.raises(anthropic.BadRequestError) as ae:
        a.messages.create(model="m", max_tokens=4, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "url", "url": "https://example.com/cat.png"}}]}])
    assert ae.value.body["error"]["message"].startswith("messages.0.content.0.source.url: image URLs are not fetched")
    a.close()


def test_image_parts_become_image_inputs_in_the_order_given():
    """What the engine is handed for a good image: its file bytes as an ImageInput part, text parts kept
    in place (OpenAI), and the same from Anthropic blocks."""
    png, jpg = _png(), _png(seed=3)
    budget = ImageBudget("gemma3", "m")
    raw = [{"role": "system", "content": "be brief"},
           {"role": "user", "content": [{"type": "text", "text": "first"}, _oa_image(png),
                                        {"type": "text", "text": "then"}, _oa_image(jpg)]}]
    stripped, parts_of = split_openai(raw, budget)
    assert stripped[1]["content"] == [{"type": "text", "text": "first"}, {"type": "text", "text": "then"}]
    from engine.frontends.tool_calls import openai_messages
    got = with_images(openai_messages(stripped), parts_of)
    assert got[0] == {"role": "system", "content": "be brief"}
    kinds = [(p["type"], p.get("text") or p["image"].data) for p in got[1]["content"]]
    assert kinds == [("text", "first"), ("image", png), ("text", "then"), ("image", jpg)]
    assert all(isinstance(p["image"], ImageInput) for p in got[1]["content"] if p["type"] == "image")
    assert [w for w, _ in budget.found] == ["messages[1].content[1]", "messages[1].content[3]"]

    budget = ImageBudget("gemma3", "m")
    msgs = convert_messages({"messages": [{"role": "user", "content": [_an_image(png), {"type": "text", "text": "?"}]}]},
                            budget)
    assert msgs[0]["content"][0]["image"].data == png and msgs[0]["content"][1] == {"type": "text", "text": "?"}
    with pytest.raises(APIError):
        convert_messages({"messages": [{"role": "user", "content": [_an_image(png)]}]})   # no budget: refused


def test_an_image_sent_while_the_model_loads_is_answered_by_what_loaded(tmp_path, monkeypatch):
    """`strata serve` answers while its start-up load runs. An image request then waits for the load
    and is answered by the model that loaded: a text-only model's refusal names it, a model with a
    projector goes on to the image's own checks; nothing is refused as text-only for being early.
    (The load is held at its start until both requests are in: the one patch, of the load's timing.)"""
    import threading
    from gguf_factory import write_tiny_gguf
    from engine.model_load import ModelLoad
    real, gate = ModelLoad.load, threading.Event()

    def held(self, req, handle):
        gate.wait(120)
        return real(self, req, handle)

    monkeypatch.setattr(ModelLoad, "load", held)
    path = write_tiny_gguf(tmp_path / "tiny-late.gguf", arch="llama", n_layer=2, n_embd=64, seed=6,
                           context_length=2048)
    eng = Engine(EngineOptions(model=str(path))).start()
    text, vision = ServerThread(create_app(eng)).start(), ServerThread(create_app(ClaimsVision(eng))).start()
    got: dict[str, openai.BadRequestError] = {}

    def ask(name, srv, data):
        try:
            got[name] = _oa_refusal(srv, [{"type": "text", "text": "look"}, _oa_image(data)])
        except BaseException as e:  # noqa: BLE001 - pytest's Failed too: shown by the assertions below
            got[name] = e

    try:
        assert eng.model_facts() is None
        asks = [threading.Thread(target=ask, args=("text", text, _png())),
                threading.Thread(target=ask, args=("vision", vision, b"not a picture"))]
        for t in asks:
            t.start()
        for t in asks:
            t.join(1.0)
        assert all(t.is_alive() for t in asks), got               # waiting for the load, not answered early
        gate.set()
        for t in asks:
            t.join(120)
    finally:
        gate.set()
        text.stop()
        vision.stop()
        eng.stop()
    e = got["text"]
    assert e.body["code"] == "model_reads_text_only" and "tiny-late reads text only" in e.body["message"]
    e = got["vision"]
    assert e.body["code"] == "invalid_image" and "not an image Strata reads" in e.body["message"]
