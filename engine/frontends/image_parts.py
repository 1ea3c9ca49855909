"""Images in API requests: OpenAI `image_url` content parts and Anthropic `image` blocks as the engine's
ImageInput parts ({"type": "image", "image": ImageInput} in a user message's content list).

Data carried in the request is read: an OpenAI `data:` URL with base64, an Anthropic `base64` source.
An http(s) URL (an OpenAI image_url, an Anthropic `url` source) is refused with a 400 naming the part,
unless the server was started with --allow-image-urls: then it is fetched through the model fetch's
transport (strata_fetch.index_fetch.fetch_url: http(s) only, at most 5 redirects, a deadline, at most
MAX_IMAGE_BYTES read), off the event loop, once every part of the request has been read, so a refusal
by count or by a text-only model costs no fetch. Per request: at most MAX_REQUEST_IMAGES images and
MAX_REQUEST_IMAGE_BYTES of image bytes in all, each image at most engine.vision.images.MAX_IMAGE_BYTES, and
each checked with decode_image (off the event loop) before the engine sees it, so a damaged file, a
decompression bomb or a failed fetch is a 400 that names its content part, never a traceback. A model
without an image projector (ModelFacts.vision is None) answers 400 "reads text only" at the first
image part.
"""
from __future__ import annotations

import base64
import binascii
import re
import urllib.parse
from dataclasses import dataclass, field

from starlette.concurrency import run_in_threadpool

from strata_fetch.index_fetch import FetchError, fetch_url

from engine.api import ImageInput
from engine.vision.images import MAX_IMAGE_BYTES, ImageRefused, decode_image
from engine.frontends.tool_calls import uses_tools
from engine.frontends.wire import APIError

MAX_REQUEST_IMAGES = 8
MAX_REQUEST_IMAGE_BYTES = 48 << 20
_DATA_URL = re.compile(r"data:(?P<type>[\w.+-]+/[\w.+-]+)?(?P<params>(?:;[\w.+-]+=[^;,]*)*)(?P<b64>;base64)?,",
                       re.IGNORECASE)


def _bad(where: str, message: str, code: str = "invalid_image") -> APIError:
    return APIError(400, f"{where}: {message}", param=where, code=code)


@dataclass
class _Pending:
    """An image URL found in the request, fetched by `ImageBudget.check`."""
    where: str
    url: str
    stand_in: ImageInput               # in the parts until the fetch gives the file


@dataclass
class ImageBudget:
    """The images of one request as they are found: counted and bounded, fetched and checked later
    (`check`; then `resolve` puts the fetched files in the messages)."""
    vision: str | None                 # the loaded model's projector; None: it reads text only
    model: str = ""
    fetch_urls: bool = False           # the server's --allow-image-urls
    found: list[tuple[str, ImageInput]] = field(default_factory=list)
    total: int = 0
    pending: list[_Pending] = field(default_factory=list)
    fetched: dict[int, ImageInput] = field(default_factory=dict)    # id(stand-in) -> the fetched image
    loading: object = None             # the engine while its start-up load runs: `vision` is not known yet

    @classmethod
    def for_engine(cls, engine, fetch_urls: bool = False) -> "ImageBudget":
        """A request's budget: the projector from the loaded model's facts; a request that comes while
        the server's start-up load runs learns it in `check`, once the load is done (a vision model
        still loading is no text-only model)."""
        facts = engine.model_facts()
        if facts is None and getattr(engine, "startup", None) is not None:
            return cls(None, "", fetch_urls, loading=engine)
        return cls(getattr(facts, "vision", None), facts.model_id if facts is not None else "", fetch_urls)

    def _admit(self, where: str) -> None:
        if self.vision is None and self.loading is None:
            raise self._text_only(where)
        if len(self.found) >= MAX_REQUEST_IMAGES:
            raise _bad(where, f"a request takes at most {MAX_REQUEST_IMAGES} images", code="too_many_images")

    def add(self, where: str, b64: str, name: str) -> ImageInput:
        self._admit(where)
        size = len(b64) * 3 // 4                         # before decoding: a bound from the text alone
        if size > MAX_IMAGE_BYTES + 3:
            raise _bad(where, f"the image is {size / 2**20:.1f} MiB; at most {MAX_IMAGE_BYTES / 2**20:.0f} MiB "
                              "is read", code="image_too_large")
        self._count(where, size, 0)
        try:
            data = base64.b64decode(b64.strip(), validate=True)
        except (binascii.Error, ValueError):
            raise _bad(where, "the image's data is not valid base64") from None
        self.total += len(data)
        image = ImageInput(data, name)
        self.found.append((where, image))
        return image

    def _count(self, where: str, size: int, adds: int) -> None:
        """Refuse `size` more bytes past the request's bound; count `adds` of them now."""
        if self.total + size > MAX_REQUEST_IMAGE_BYTES:
            raise _bad(where, f"the request's images pass {MAX_REQUEST_IMAGE_BYTES / 2**20:.0f} MiB in all",
                       code="image_too_large")
        self.total += adds

    def add_url(self, where: str, url: str, name: str) -> ImageInput:
        """An http(s) image URL: refused unless the server fetches them; else a stand-in until `check`."""
        self._admit(where)
        if not self.fetch_urls:
            raise _bad(where, "image URLs are not fetched by this server (start it with --allow-image-urls to "
                              "fetch them): send the image in the request (a data: URL with base64, or an "
                              "Anthropic base64 source)", code="image_url_not_supported")
        stand_in = ImageInput(b"", _url_name(url) or name)
        self.pending.append(_Pending(where, url, stand_in))
        self.found.append((where, stand_in))
        return stand_in

    def _text_only(self, where: str) -> APIError:
        who = f"the model {self.model}" if self.model else "the loaded model"
        return _bad(where, f"{who} reads text only (no image projector is loaded with it): images cannot "
                           "be sent to it", code="model_reads_text_only")

    async def _after_load(self) -> None:
        """The start-up load awaited (off the event loop) when the request came during it; a text-only
        model refuses its first image then. A failed load is left to the engine's own answer."""
        engine, self.loading = self.loading, None
        if engine is None or not self.found:
            return
        await run_in_threadpool(engine.startup.finished.wait)
        facts = engine.model_facts()
        if facts is None:
            return
        self.vision, self.model = getattr(facts, "vision", None), facts.model_id
        if self.vision is None:
            raise self._text_only(self.found[0][0])

    async def check(self) -> None:
        """The start-up load awaited if it runs, then every URL fetched and every image decoded once
        (bounded, off the event loop): a 400 naming the first bad one."""
        await self._after_load()
        for p in self.pending:
            data = await run_in_threadpool(self._fetch, p)
            self._count(p.where, len(data), len(data))
            got = self.fetched[id(p.stand_in)] = ImageInput(data, p.stand_in.name)
            self.found = [(w, got if im is p.stand_in else im) for w, im in self.found]
        for where, image in self.found:
            try:
                await run_in_threadpool(decode_image, image.data)
            except ImageRefused as e:
                raise _bad(where, str(e)) from None

    async def ready(self, messages: list[dict]) -> list[dict]:
        """`check`, then `messages` as the engine reads them (each fetched image in place)."""
        await self.check()
        return self.resolve(messages)

    def _fetch(self, p: _Pending) -> bytes:
        limit = min(MAX_IMAGE_BYTES, max(0, MAX_REQUEST_IMAGE_BYTES - self.total))
        try:
            return fetch_url(p.url, limit, "the image could not be fetched", accept="image/*").data
        except FetchError as e:
            raise _bad(p.where, str(e), code="image_fetch_failed") from None

    def resolve(self, messages: list[dict]) -> list[dict]:
        """`messages` with each fetched image in place of its stand-in (after `check`)."""
        got = self.fetched
        if not got:
            return messages
        out = []
        for m in messages:
            content = m.get("content") if isinstance(m, dict) else None
            if isinstance(content, list) and any(_stand_in(p, got) for p in content):
                m = dict(m, content=[dict(p, image=got[id(p["image"])]) if _stand_in(p, got) else p
                                     for p in content])
            out.append(m)
        return out


def _stand_in(part, got: dict) -> bool:
    return isinstance(part, dict) and part.get("type") == "image" and id(part.get("image")) in got


def _url_name(url: str) -> str:
    """The URL's file name (for the engine's messages and log), at most 80 characters."""
    try:
        name = urllib.parse.unquote(urllib.parse.urlsplit(url).path.rsplit("/", 1)[-1])
    except ValueError:
        return ""
    return "".join(c for c in name if c.isprintable())[:80]


def _http_url(url: str) -> bool:
    return url[:8].lower().startswith(("http://", "https:/"))


# ---- OpenAI -----------------------------------------------------------------------------------------
def openai_image(part: dict, where: str, budget: ImageBudget) -> ImageInput:
    """An `image_url` part: {"type": "image_url", "image_url": {"url": "data:image/png;base64,...",
    "detail"?}} (the URL as a bare string too, as some clients send it)."""
    spec = part.get("image_url")
    url = spec.get("url") if isinstance(spec, dict) else spec
    at = f"{where}.image_url.url" if isinstance(spec, dict) else f"{where}.image_url"
    if not isinstance(url, str) or not url:
        raise _bad(where, "an image_url part needs {\"url\": \"data:image/...;base64,...\"}")
    if _http_url(url):
        return budget.add_url(at, url, f"image {len(budget.found) + 1}")
    m = _DATA_URL.match(url[:300])
    if m is None or not m.group("b64"):
        raise _bad(at, "the image must be a data: URL with base64 data (data:image/png;base64,...)")
    return budget.add(where, url[m.end():], f"image {len(budget.found) + 1}")


def split_openai(messages, budget: ImageBudget):
    """(the messages with their image parts taken out, {message index: its content parts with the
    images as ImageInput, in the order given}). Messages that are not lists of parts pass unchanged."""
    if not isinstance(messages, list):
        return messages, {}
    out, parts_of = [], {}
    for i, m in enumerate(messages):
        content = m.get("content") if isinstance(m, dict) else None
        if not isinstance(content, list) or not any(_is_openai_image(p) for p in content):
            out.append(m)
            continue
        if m.get("role") != "user":
            raise _bad(f"messages[{i}].content", "images are read in user messages only")
        parts, texts = [], []
        for j, p in enumerate(content):
            if _is_openai_image(p):
                parts.append({"type": "image", "image": openai_image(p, f"messages[{i}].content[{j}]", budget)})
            else:
                parts.append(p)
                texts.append(p)
        out.append(dict(m, content=texts))
        parts_of[i] = parts
    return out, parts_of


def _is_openai_image(p) -> bool:
    return isinstance(p, dict) and p.get("type") in ("image_url", "input_image")


def with_images(messages: list[dict], parts_of: dict) -> list[dict]:
    """The checked messages (one per message given, in order) with each image message's content as
    its parts: text parts as they were checked, the images as ImageInput."""
    if not parts_of:
        return messages
    out = []
    for i, m in enumerate(messages):
        if i in parts_of:
            parts = [p if p.get("type") == "image" else {"type": "text", "text": p.get("text", "")}
                     for p in parts_of[i]]
            m = dict(m, content=parts)
        out.append(m)
    return out


def tools_with_images(fmt, messages: list[dict], where: str) -> None:
    """A model whose tool format writes tool results into user turns as text (not its template's own
    tool messages) cannot take images in the same conversation: refused naming the first image part
    `where`, before rendering."""
    if fmt is not None and not fmt.native and uses_tools(messages):
        raise _bad(where, f"images cannot be mixed with tool calls for this model (its tool format, "
                          f"{fmt.name}, writes tool results as text)", code="unsupported_content")


# ---- Anthropic --------------------------------------------------------------------------------------
def anthropic_image(block: dict, where: str, budget: ImageBudget) -> ImageInput:
    """An `image` block: {"type": "image", "source": {"type": "base64", "media_type", "data"}}."""
    source = block.get("source")
    kind = source.get("type") if isinstance(source, dict) else None
    if kind == "url" and isinstance(source.get("url"), str) and _http_url(source["url"]):
        return budget.add_url(f"{where}.source.url", source["url"], f"image {len(budget.found) + 1}")
    if kind == "url":
        raise _bad(f"{where}.source.url", "an image url source needs an http(s) URL")
    if kind != "base64" or not isinstance(source.get("data"), str):
        raise _bad(where, 'an image block needs "source": {"type": "base64", "media_type": "image/png", '
                          '"data": "..."}')
    return budget.add(where, source["data"], f"image {len(budget.found) + 1}")
