"""Image tokens through the server on a tiny vision model (a Gemma 3 text model with its gemma3 mmproj
beside it, tests/gguf_factory_vision.py): the image parts reach the engine (not dropped), so
`usage.prompt_tokens`, Anthropic's `input_tokens` and `count_tokens` count the image's tokens, a
follow-up's `cached_tokens` / `cache_read_input_tokens` include the reused image span, and an image
fetched from a URL (--allow-image-urls) is read as the same picture sent inline. Real openai and
anthropic SDKs, a real Engine behind uvicorn, a real local HTTP server of real files.

The tiny vision model's factory comes with the engine's projector (engine/vision/): where the tree has
no projector yet the module is skipped, saying so.
"""
from __future__ import annotations

import base64
import http.server
import io
import threading

import numpy as np
import pytest
from PIL import Image

gguf_factory_vision = pytest.importorskip(
    "gguf_factory_vision", reason="no image projector in this tree yet (tests/gguf_factory_vision.py and "
                                  "engine/vision/ come with it): image token counts cannot be checked")

from test_server_images import _anthropic, _openai  # noqa: E402

from engine.engine import Engine, EngineOptions  # noqa: E402
from engine.frontends.server import ServerThread, create_app  # noqa: E402

IMAGE_TOKENS = 256          # gemma3's tokens an image (llama.cpp's count); the markers around it add a few


def _photo(w: int, h: int, seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w].astype(np.float32)
    rgb = np.stack([200 * x / w, 180 * y / h, 90 + 0 * x], axis=-1) + rng.normal(0, 12, (h, w, 3))
    buf = io.BytesIO()
    Image.fromarray(np.clip(rgb, 0, 255).astype(np.uint8)).save(buf, "PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(server with --allow-image-urls, the base URL of a local file server holding cat.png, its bytes)."""
    folder = tmp_path_factory.mktemp("vision-pair")
    model, _ = gguf_factory_vision.write_gemma3_vision_pair(folder)
    eng = Engine(EngineOptions(model=str(model), cache_mib=256)).start()
    eng.startup.result()
    files = tmp_path_factory.mktemp("vision-files")
    cat = _photo(61, 43, seed=4)
    (files / "cat.png").write_bytes(cat)
    handler = type("Quiet", (http.server.SimpleHTTPRequestHandler,), {"log_message": lambda *a: None})
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), lambda *a: handler(*a, directory=str(files)))
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    srv = ServerThread(create_app(eng, allow_image_urls=True)).start()
    yield srv, f"http://127.0.0.1:{httpd.server_address[1]}", cat
    srv.stop()
    httpd.shutdown()
    httpd.server_close()
    eng.stop()


def _data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def _ask(c, content, history=()):
    return c.chat.completions.create(model="tiny-gemma3-vision", max_tokens=4, temperature=0, messages=[
        *history, {"role": "user", "content": content}])


def test_usage_and_count_tokens_include_the_image(served):
    srv, _, cat = served
    c, a = _openai(srv), _anthropic(srv)
    text = [{"type": "text", "text": "What is in this picture?"}]
    plain = _ask(c, text).usage.prompt_tokens
    r = _ask(c, [{"type": "image_url", "image_url": {"url": _data_url(cat)}}, *text])
    assert r.usage.prompt_tokens >= plain + IMAGE_TOKENS
    block = {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": base64.b64encode(cat).decode()}}
    counted = a.messages.count_tokens(model="m", messages=[{"role": "user", "content": [
        block, {"type": "text", "text": "What is in this picture?"}]}]).input_tokens
    plain_count = a.messages.count_tokens(model="m", messages=[
        {"role": "user", "content": "What is in this picture?"}]).input_tokens
    assert counted >= plain_count + IMAGE_TOKENS
    assert counted == r.usage.prompt_tokens            # the same prompt counted as it is read
    # a follow-up: the image's span is reused, counted in cached_tokens and cache_read_input_tokens
    history = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": _data_url(cat)}}, *text]},
               {"role": "assistant", "content": r.choices[0].message.content or ""}]
    again = _ask(c, [{"type": "text", "text": "And the colours?"}], history)
    assert again.usage.prompt_tokens_details.cached_tokens >= IMAGE_TOKENS
    m = a.messages.create(model="m", max_tokens=4, messages=[
        {"role": "user", "content": [block, {"type": "text", "text": "What is in this picture?"}]},
        {"role": "assistant", "content": r.choices[0].message.content or "ok"},
        {"role": "user", "content": "And the colours?"}])
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens >= plain_count + IMAGE_TOKENS
    c.close()
    a.close()


def test_an_image_fetched_from_a_url_is_read_as_the_same_picture_inline(served):
    srv, base, cat = served
    c, a = _openai(srv), _anthropic(srv)
    text = {"type": "text", "text": "Describe it."}
    inline = _ask(c, [{"type": "image_url", "image_url": {"url": _data_url(cat)}}, text])
    fetched = _ask(c, [{"type": "image_url", "image_url": {"url": f"{base}/cat.png"}}, text])
    assert fetched.usage.prompt_tokens == inline.usage.prompt_tokens
    assert fetched.choices[0].message.content == inline.choices[0].message.content     # greedy, same pixels
    counted = a.messages.count_tokens(model="m", messages=[{"role": "user", "content": [
        {"type": "image", "source": {"type": "url", "url": f"{base}/cat.png"}}, text]}]).input_tokens
    assert counted == inline.usage.prompt_tokens
    c.close()
    a.close()
