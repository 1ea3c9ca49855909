"""An image chat through a real `strata serve` process, as a client sees it: a generated picture sent
with the real openai and anthropic SDKs on a tiny vision model (a Gemma 3 with its gemma3 mmproj
beside it), the reply compared with llama.cpp's libmtmd greedy reply; the server stopped and served
again on the same data folder, and a follow-up that finds the image's K/V on disk (not read again)
and answers as a server that reads the whole chat afresh."""
from __future__ import annotations

import base64
import codecs
import io
import signal

import numpy as np
import pytest
from PIL import Image

import llama_oracle
import mtmd_oracle
from gguf_factory_vision import write_gemma3_vision_pair
from test_disk_tier import _port, _serve
from test_server_images import _anthropic, _openai
from vision_chat import TIE_MARGIN

N = 8
QUESTION = "What is in this picture?"
TURN = "<start_of_turn>user\n{}<end_of_turn>\n<start_of_turn>model\n"


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    llama_oracle.require()
    # seed 4: llama.cpp's first four greedy steps on this picture are clear wins (top-2 logits > TIE_MARGIN
    # apart), so the comparison below checks tokens, not only near-ties
    return write_gemma3_vision_pair(tmp_path_factory.mktemp("serve-vision"), seed=4)


def _picture() -> np.ndarray:
    y, x = np.mgrid[0:72, 0:108].astype(np.float32)
    sky = np.stack([90 + 0 * x, 140 + 60 * y / 72, 230 - 40 * y / 72], axis=-1)
    hills = (y > 40 + 10 * np.sin(x / 9))[..., None]
    return np.where(hills, np.array([60, 150, 70], np.float32), sky).astype(np.uint8)


def _data_url(rgb: np.ndarray) -> str:
    buf = io.BytesIO()
    Image.fromarray(rgb).save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


class Served:
    """A `strata serve` process on `model` with `home` as its data folder (stopped on exit)."""

    def __init__(self, model, home):
        self.port = _port()
        self.proc = _serve(model, self.port, home)
        self.base_url = f"http://127.0.0.1:{self.port}/v1"

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.proc.send_signal(signal.SIGINT)          # a clean stop: what the disk tier holds is written
        try:
            self.proc.wait(30)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()


def _openai_chat(srv, messages) -> tuple[str, int, int]:
    c = _openai(srv)
    try:
        r = c.chat.completions.create(model="tiny-gemma3-vision", max_tokens=N, temperature=0, messages=messages)
        details = r.usage.prompt_tokens_details
        return r.choices[0].message.content or "", r.usage.prompt_tokens, (details.cached_tokens or 0) if details else 0
    finally:
        c.close()


def _anthropic_chat(srv, url: str) -> str:
    a = _anthropic(srv)
    try:
        data = url.split(",", 1)[1]
        m = a.messages.create(model="m", max_tokens=N, extra_body={"temperature": 0}, messages=[
            {"role": "user", "content": [{"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                                                     "data": data}},
                                         {"type": "text", "text": QUESTION}]}])
        return "".join(b.text for b in m.content if b.type == "text")
    finally:
        a.close()


def assert_llama_cpp_reply(pair, rgb: np.ndarray, text: str) -> None:
    """`text` is llama.cpp's greedy reply up to the first step where they part, allowed only at a near-tie
    in llama.cpp's logits (a closer race has no one right answer); that step comes after the first four."""
    ids, logits = mtmd_oracle.greedy(*pair, TURN.format(mtmd_oracle.MARKER + QUESTION), [rgb], N)
    llm = llama_oracle.cached_llama(pair[0])
    for i in range(len(ids)):
        # a byte not UTF-8 shows as U+FFFD, as the server shows it; a character still incomplete waits
        head = codecs.getincrementaldecoder("utf-8")("replace").decode(llm.detokenize(ids[:i + 1]), final=False)
        if not text.startswith(head):
            margin = float(np.diff(np.sort(logits[i])[-2:])[0])
            assert i >= 4 and margin < TIE_MARGIN, f"step {i}: {text!r} parts from llama.cpp ({margin=:.3f})"
            return


def test_an_image_chat_through_the_server_equals_llama_cpp_and_goes_on_after_a_restart(pair, tmp_path):
    rgb = _picture()
    url = _data_url(rgb)
    first = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                          {"type": "text", "text": QUESTION}]}]
    with Served(pair[0], tmp_path / "home") as srv:
        text, prompt, cached = _openai_chat(srv, first)
        assert prompt > 256 and cached == 0
        assert_llama_cpp_reply(pair, rgb, text)
        assert _anthropic_chat(srv, url) == text
    follow = first + [{"role": "assistant", "content": text}, {"role": "user", "content": "And now?"}]
    with Served(pair[0], tmp_path / "home") as srv:         # served again on the same data folder
        again, prompt2, cached2 = _openai_chat(srv, follow)
    assert cached2 >= prompt - 1, (cached2, prompt)          # the image's K/V read back from disk
    with Served(pair[0], tmp_path / "fresh") as srv:          # nothing held: the whole chat read afresh
        fresh, prompt3, cached3 = _openai_chat(srv, follow)
    assert cached3 == 0 and prompt3 == prompt2 and again == fresh
