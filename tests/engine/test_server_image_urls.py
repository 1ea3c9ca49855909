"""Image URLs through the server (engine/frontends/image_parts.py, strata_fetch.index_fetch.fetch_url):
refused with a 400 naming the part unless the server fetches them (create_app(allow_image_urls=True),
`strata serve --allow-image-urls`); then fetched from a real local HTTP server holding real files, with
the model fetch's bounds: a size bound (a large Content-Length refused before a byte is read, an
endless body cut at the bound), a deadline (a stalled server), at most 5 redirects; every failure a
400 naming the content part. Sent with the real openai and anthropic SDKs to a real Engine behind
uvicorn; as in test_server_images.py, the tiny model reads text only, so the servers that reach past
the projector check see the engine through `ClaimsVision` and every request here is answered before
the engine is asked for anything.
"""
from __future__ import annotations

import asyncio
import base64
import http.server
import threading
from pathlib import Path

import anthropic
import openai
import pytest
from test_server_images import ClaimsVision, _anthropic, _openai, _png

from engines import running
from engine.api import ImageInput
from engine.frontends.anthropic_api import convert_messages
from engine.frontends.image_parts import ImageBudget, split_openai, with_images
from engine.frontends.server import ServerThread, create_app
from engine.vision.images import MAX_IMAGE_BYTES
from engine.frontends.tool_calls import openai_messages


class _Files(http.server.SimpleHTTPRequestHandler):
    """Real files from the folder, and a few hostile answers: a redirect loop, a redirect to a file, a
    stalled body, a trickling body, a huge declared length and an endless body."""
    hits: list[str]
    stop: threading.Event

    def log_message(self, *a):
        pass

    def do_GET(self):                                  # noqa: N802 - http.server's name
        self.hits.append(self.path)
        if self.path.startswith("/loop/"):
            n = int(self.path.rsplit("/", 1)[1])
            return self._redirect(f"/loop/{n + 1}")
        if self.path.startswith("/to/"):
            return self._redirect("/files/" + self.path[4:])
        if self.path == "/stall":
            self._head(1000)
            self.stop.wait(60)
            return None
        if self.path == "/trickle":                     # a byte at a time: no read ever times out
            self._head(1000)
            try:
                while not self.stop.wait(0.1):
                    self.wfile.write(b"\0")
                    self.wfile.flush()
            except OSError:
                pass
            return None
        if self.path == "/huge":
            return self._head(100 << 20)
        if self.path == "/endless":
            self._head(None)
            chunk = b"\0" * (1 << 20)
            try:
                while not self.stop.is_set():
                    self.wfile.write(chunk)
            except OSError:
                pass                                   # the client went away: what is checked
            return None
        self.path = self.path.removeprefix("/files")
        return super().do_GET()

    def _redirect(self, to: str):
        self.send_response(302)
        self.send_header("Location", to)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def _head(self, length: int | None):
        self.send_response(200)
        self.send_header("Content-Type", "image/png")
        if length is not None:
            self.send_header("Content-Length", str(length))
        self.end_headers()
        self.wfile.flush()


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """(base URL, the folder, the paths asked) of a local HTTP server of real files."""
    folder = tmp_path_factory.mktemp("image-files")
    (folder / "cat.png").write_bytes(_png(32, 20, seed=7))
    (folder / "notes.txt").write_bytes(b"not a picture at all")
    (folder / "cut.png").write_bytes(_png(64, 64, seed=8)[:150])
    hits: list[str] = []
    stop = threading.Event()
    handler = type("Files", (_Files,), {"hits": hits, "stop": stop})
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), lambda *a: handler(*a, directory=str(folder)))
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}", folder, hits
    stop.set()
    httpd.shutdown()
    httpd.server_close()


@pytest.fixture(scope="module")
def engine(server_model):
    with running(server_model) as eng:
        yield eng


@pytest.fixture(scope="module")
def servers(engine):
    """(no fetching, fetching) servers over the engine seen with a projector."""
    closed = ServerThread(create_app(ClaimsVision(engine))).start()
    fetching = ServerThread(create_app(ClaimsVision(engine), allow_image_urls=True)).start()
    yield closed, fetching
    closed.stop()
    fetching.stop()


def _oa_refusal(srv, url: str) -> openai.BadRequestError:
    c = _openai(srv)
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model="tiny-server", max_tokens=4, messages=[{"role": "user", "content": [
            {"type": "text", "text": "what is this?"}, {"type": "image_url", "image_url": {"url": url}}]}])
    c.close()
    return e.value


def _an_refusal(srv, url: str, count: bool = False) -> str:
    c = _anthropic(srv)
    content = [{"type": "image", "source": {"type": "url", "url": url}}, {"type": "text", "text": "?"}]
    with pytest.raises(anthropic.BadRequestError) as e:
        if count:
            c.messages.count_tokens(model="m", messages=[{"role": "user", "content": content}])
        else:
            c.messages.create(model="m", max_tokens=4, messages=[{"role": "user", "content": content}])
    c.close()
    return e.value.body["error"]["message"]


def test_without_the_flag_an_image_url_is_refused_by_name_and_never_fetched(servers, files):
    closed, _ = servers
    base, _, hits = files
    before = len(hits)
    e = _oa_refusal(closed, f"{base}/files/cat.png")
    assert e.body["param"] == "messages[0].content[1].image_url.url" and e.body["code"] == "image_url_not_supported"
    assert "--allow-image-urls" in e.body["message"]
    msg = _an_refusal(closed, f"{base}/files/cat.png")
    assert msg.startswith("messages.0.content.0.source.url: image URLs are not fetched by this server")
    assert len(hits) == before                                 # nothing was asked of the file server


def test_with_the_flag_the_fetched_file_reaches_the_checks(servers, files):
    """A fetched text file is refused as not an image, a truncated PNG as damaged, a missing file
    with its HTTP status: each a 400 naming the part, through both SDKs and count_tokens."""
    _, fetching = servers
    base, _, hits = files
    e = _oa_refusal(fetching, f"{base}/files/notes.txt")
    assert e.body["param"] == "messages[0].content[1].image_url.url" and e.body["code"] == "invalid_image"
    assert "not an image Strata reads" in e.body["message"]
    assert "/files/notes.txt" in hits
    e = _oa_refusal(fetching, f"{base}/to/cut.png")                 # a redirect to a real file
    assert "damaged or truncated" in e.body["message"] and "/cut.png" in " ".join(hits)
    e = _oa_refusal(fetching, f"{base}/files/missing.png")
    assert e.body["code"] == "image_fetch_failed" and "answered HTTP 404" in e.body["message"]
    msg = _an_refusal(fetching, f"{base}/files/notes.txt")
    assert msg.startswith("messages.0.content.0.source.url: ") and "not an image Strata reads" in msg
    msg = _an_refusal(fetching, f"{base}/files/notes.txt", count=True)
    assert msg.startswith("messages.0.content.0.source.url: ") and "not an image Strata reads" in msg


def test_a_fetch_is_bounded_in_redirects_size_and_time(servers, files, monkeypatch):
    _, fetching = servers
    base, _, hits = files
    e = _oa_refusal(fetching, f"{base}/loop/0")
    assert e.body["code"] == "image_fetch_failed" and "too many redirects" in e.body["message"]
    assert sum(h.startswith("/loop/") for h in hits) <= 6
    e = _oa_refusal(fetching, f"{base}/huge")                       # refused from its Content-Length
    assert e.body["code"] == "image_fetch_failed" and f"at most {MAX_IMAGE_BYTES} are read" in e.body["message"]
    e = _oa_refusal(fetching, f"{base}/endless")                    # cut at the bound
    assert f"sent more than {MAX_IMAGE_BYTES} bytes" in e.body["message"]
    monkeypatch.setenv("PIP_TIMEOUT", "0.5")            # a read's timeout; the whole fetch's deadline: 4 of them
    e = _oa_refusal(fetching, f"{base}/stall")
    assert e.body["code"] == "image_fetch_failed" and "broke off: timed out" in e.body["message"]
    e = _oa_refusal(fetching, f"{base}/trickle")
    assert e.body["code"] == "image_fetch_failed" and "did not send it within 2 s" in e.body["message"]
    e = _oa_refusal(fetching, "http://127.0.0.1:1/cat.png")          # nothing listens
    assert e.body["code"] == "image_fetch_failed" and "could not reach" in e.body["message"]


def test_a_text_only_model_or_too_many_images_costs_no_fetch(engine, files):
    """The count and the projector are checked as the parts are read, before anything is fetched."""
    base, _, hits = files
    srv = ServerThread(create_app(engine, allow_image_urls=True)).start()
    try:
        before = len(hits)
        e = _oa_refusal(srv, f"{base}/files/cat.png")
        assert e.body["code"] == "model_reads_text_only" and len(hits) == before
    finally:
        srv.stop()


def test_fetched_images_are_the_files_bytes_in_the_order_given(files):
    """What the engine is handed for a fetched image: the file's bytes as an ImageInput named by the
    URL's file name, in its place among the parts (OpenAI and Anthropic)."""
    base, folder, _ = files
    cat, inline = (Path(folder) / "cat.png").read_bytes(), _png(8, 8, seed=2)
    budget = ImageBudget("gemma3", "m", fetch_urls=True)
    raw = [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": f"{base}/to/cat.png"}}, {"type": "text", "text": "and"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(inline).decode()}}]}]
    stripped, parts_of = split_openai(raw, budget)
    got = asyncio.run(budget.ready(with_images(openai_messages(stripped), parts_of)))
    parts = got[0]["content"]
    assert [p["type"] for p in parts] == ["image", "text", "image"]
    assert parts[0]["image"] == ImageInput(cat, "cat.png") and parts[2]["image"].data == inline
    assert budget.total == len(cat) + len(inline)

    budget = ImageBudget("gemma3", "m", fetch_urls=True)
    msgs = convert_messages({"messages": [{"role": "user", "content": [
        {"type": "text", "text": "?"}, {"type": "image", "source": {"type": "url", "url": f"{base}/files/cat.png"}}]}]},
        budget)
    got = asyncio.run(budget.ready(msgs))
    assert got[0]["content"][1]["image"] == ImageInput(cat, "cat.png")
    assert msgs[0]["content"][1]["image"].data == b""                # the parse's stand-in, replaced in a copy
