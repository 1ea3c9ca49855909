"""What the two HTTP APIs (engine/frontends/server.py: OpenAI's; anthropic_api.py: Anthropic's) share:
errors in JSON with their HTTP statuses (HTTP_OF_ERROR), request-body parsing (sampling fields, stop
strings, messages, response_format, tools), the bridge from an engine handle to the event loop
(`_Bridge`, `_EngineStream`, a client's disconnect as a cancel) and the reply's figures.

Its own module so that server.py (which builds the app with both route families) and anthropic_api.py
(one of them) each import it, and not each other: no import circle.
"""
from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, StreamingResponse

from engine.api import Generation
from engine.errors import ErrorCode, SessionRefusal, StrataError
from engine.events import ENGINE_STOPPED, Done, Failed, Progress, Token
from engine.sampling import FIELD, FIELDS, SamplingParams
from engine.frontends.body_check import BodyError, parse_body
from engine.generation.constraints import ConstraintError, ConstraintSpec
from engine.text.context_policy import check_policy
from engine.text.harmony import ChannelStream
from engine.model.memory_estimate import read_header
from engine.text.reasoning import split, split_reply
from engine.generation.speculative import parse_spec
from engine.frontends.tool_calls import (ToolError, check_tool_choice, check_tools, content_text, detect, finish_calls,
                                         new_call_id, parse, plan, strip_volatile, uses_tools)
from engine.frontends import draft_names

MAX_STOP = 16


# ---- errors ------------------------------------------------------------------------------------
class APIError(Exception):
    """Answered as OpenAI's error object with `status`."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return ErrorJSON(self.body(), status_code=self.status)


class ErrorJSON(JSONResponse):
    """An error body as ASCII JSON: whatever it echoes (a name, a value) is escaped, so it always encodes."""

    def render(self, content) -> bytes:
        return json.dumps(content, ensure_ascii=True, allow_nan=False, separators=(",", ":")).encode("ascii")


class ClientGone(APIError):
    """The client went away before its body arrived: nothing to answer, nothing to log."""

    def __init__(self):
        super().__init__(499, "the client disconnected before sending its whole body", code="client_disconnected")


# An engine error code as an HTTP answer: (status, OpenAI error type, the API's code or None).
HTTP_OF_ERROR = {
    ErrorCode.BAD_REQUEST: (400, "invalid_request_error", None),
    ErrorCode.MODEL_NOT_LOADED: (503, "server_error", "model_not_loaded"),
    ErrorCode.SESSION_REFUSED: (400, "invalid_request_error", "session_refused"),
    ErrorCode.MEMORY_REFUSED: (400, "invalid_request_error", "memory_refused"),
    ErrorCode.CANCELLED: (499, "invalid_request_error", "cancelled"),
    ErrorCode.UNAVAILABLE: (503, "server_error", "distributed_rank_lost"),   # a rank was lost
    ErrorCode.INTERNAL: (500, "server_error", None),
}
# Finer API codes for some reasons within an engine code.
API_CODE_OF_REASON = {"context_length": "context_length_exceeded", ENGINE_STOPPED: ENGINE_STOPPED,
                      SessionRefusal.OVERWRITE.value: "session_overwrite"}


def engine_error(failed: Failed, param: str | None = None) -> APIError:
    """An engine Failed(message, code, reason) as an API error (HTTP_OF_ERROR)."""
    status, kind, code = HTTP_OF_ERROR[failed.code]
    message = "the request was cancelled" if failed.code == ErrorCode.CANCELLED else failed.message
    return APIError(status, message, type=kind, param=param, code=API_CODE_OF_REASON.get(failed.reason, code))


# ---- request parsing ---------------------------------------------------------------------------
async def _json_body(request: Request) -> dict:
    """The body as a JSON object whose values are valid text and bounded numbers and depth
    (body_check.py), or a 400 naming the field."""
    try:
        raw = await request.body()
    except ClientDisconnect:
        raise ClientGone() from None
    try:
        body = parse_body(raw)
    except BodyError as e:
        raise APIError(400, e.message, param=e.param, code=e.code) from None
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    return body


def _number(body: dict, name: str, default, *, lo=None, hi=None, integer=False, lo_open=False):
    value = body.get(name)
    if value is None:
        return default
    kind = "an integer" if integer else "a number"
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (integer and not isinstance(value, int)):
        raise APIError(400, f"'{name}' must be {kind}", param=name, code="invalid_type")
    if (lo is not None and (value <= lo if lo_open else value < lo)) or (hi is not None and value > hi):
        bounds = f"{'>' if lo_open else '>='} {lo}" if hi is None else f"in {'(' if lo_open else '['}{lo}, {hi}]"
        raise APIError(400, f"'{name}' must be {bounds}, got {value}", param=name, code="invalid_value")
    return value


def _bool(body: dict, name: str, default):
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise APIError(400, f"'{name}' must be true or false", param=name, code="invalid_type")
    return value


def _stop(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise APIError(400, "'stop' must be a string or a list of strings", param="stop", code="invalid_type")
    if len(stop) > MAX_STOP:
        raise APIError(400, f"'stop' takes at most {MAX_STOP} strings", param="stop", code="invalid_value")
    return [s for s in stop if s]


def _sampling(body: dict, default_max_tokens: int) -> SamplingParams:
    n = _number(body, "n", 1, integer=True)
    if n != 1:
        raise APIError(400, "only n=1 is supported", param="n", code="invalid_value")
    if body.get("logprobs") not in (None, False, 0):
        raise APIError(400, "logprobs are not supported", param="logprobs", code="unsupported_parameter")
    max_tokens = body.get("max_completion_tokens")
    name = "max_completion_tokens"
    if max_tokens is None:
        name = "max_tokens"
    max_tokens = _number(body, name, default_max_tokens, lo=1, integer=True)
    # The fields, their defaults (OpenAI's) and ranges come from engine/sampling.py's table; top_k,
    # min_p and repetition_penalty are llama.cpp-style extras many local clients send.
    values = {f.name: _number(body, f.name, f.api_default, lo=f.lo, hi=f.api_hi, integer=f.kind is int,
                              lo_open=f.lo_open) for f in FIELDS if f.name not in ("seed", "max_tokens")}
    values = {k: float(v) if FIELD[k].kind is float else v for k, v in values.items()}
    values["seed"] = _number(body, "seed", None, integer=True)
    return SamplingParams(**values, max_tokens=max_tokens, stop=_stop(body))


def _speculative(body: dict) -> str:
    """The extra field "speculative": "off" | "lookup" | "draft:NAME" | "mtp" | "mtp:NAME" (a model, or an
    MTP head file, in the models folder; a client does not get to point the server at arbitrary paths)."""
    value = body.get("speculative", "off")
    if value is None:
        return "off"
    try:
        if not isinstance(value, str):
            raise StrataError("speculative must be a string")
        if len(value) > 300:             # a model name has at most 255 characters (draft_names.NAME_MAX)
            raise StrataError(f"speculative is {len(value)} characters: off, lookup or draft:NAME, a model "
                              "name from the models folder")
        mode = parse_spec(value)
    except StrataError as e:
        raise APIError(400, str(e), param="speculative", code="invalid_value") from None
    if mode.kind in ("draft", "mtp") and mode.draft_path:
        # A name in the models folder only (engine/frontends/draft_names.py): the engine gets the file's path.
        try:
            return f"{mode.kind}:{draft_names.resolve(mode.draft_path)}"
        except StrataError as e:
            raise APIError(400, str(e), param="speculative", code="invalid_value") from None
    return mode.label


def _overflow(body: dict) -> str:
    """The extra field "strata_overflow": what a history longer than the context sends
    (engine/text/context_policy.py). Absent (or "stop"): nothing is left out, a prompt over the context is a 400."""
    value = body.get("strata_overflow")
    if value is None:
        return "stop"
    try:
        return check_policy(value, "strata_overflow")
    except ValueError as e:
        raise APIError(400, str(e)[:300], param="strata_overflow", code="invalid_value") from None


def _content_text(content, i: int) -> str:
    try:
        return content_text(content, f"messages[{i}].content")
    except ToolError as e:
        raise tool_error(e) from None


def _messages(body: dict) -> list[dict]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise APIError(400, "'messages' must be a non-empty list", param="messages",
                       code="missing_required_parameter" if messages is None else "invalid_type")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise APIError(400, f"messages[{i}] must be an object with a 'role'", param=f"messages[{i}]")
        role = m["role"]
        if role == "developer":     # OpenAI's newer name for the system role
            role = "system"
        if role not in ("system", "user", "assistant", "tool"):
            raise APIError(400, f"messages[{i}]: unknown role '{m['role']}'", param=f"messages[{i}].role",
                           code="invalid_value")
        out.append({"role": role, "content": _content_text(m.get("content"), i)})
    return out


def _response_format(body: dict):
    """`response_format` as a constraints.ConstraintSpec (None: text). OpenAI's shapes: {"type": "text"},
    {"type": "json_object"}, {"type": "json_schema", "json_schema": {"name", "schema", "strict"?,
    "description"?}}; the schema is compiled here (llguidance, no tokenizer), so a bad one is a 400."""
    fmt = body.get("response_format")
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        spec = ConstraintSpec.json_object()
    elif kind == "json_schema":
        js = fmt.get("json_schema")
        if not isinstance(js, dict) or not isinstance(js.get("schema", {}), (dict, bool)):
            raise APIError(400, "response_format.json_schema must be an object with a 'schema' object",
                           param="response_format.json_schema", code="invalid_value")
        name, strict = js.get("name"), js.get("strict", True)
        if name is not None and not isinstance(name, str) or not isinstance(strict, (bool, type(None))):
            raise APIError(400, "response_format.json_schema: 'name' must be a string and 'strict' true or false",
                           param="response_format.json_schema", code="invalid_type")
        spec = ConstraintSpec.json_schema(js.get("schema", {}), name=name, strict=strict is not False)
    else:
        raise APIError(400, "response_format.type must be 'text', 'json_object' or 'json_schema'",
                       param="response_format", code="invalid_value")
    try:
        spec.check()
    except ConstraintError as e:
        raise APIError(400, str(e), param=e.param or "response_format", code="invalid_json_schema") from None
    return spec


# ---- tool calls (engine/frontends/tool_calls.py) ------------------------------------------------------------
def tool_error(e) -> APIError:
    """A tool_calls.ToolError as OpenAI's 400."""
    return APIError(400, e.message, param=e.param, code=e.code)


@dataclass
class Served:
    """What every handler of both APIs reads (`request.app.state.served`): the engine, the served
    model's tool-call family, the system-prompt lines dropped before rendering, and the model of the
    engine's start-up load (listed as loading until it is done)."""
    engine: object
    formats: "ToolFormats"
    volatile: tuple = ()
    loading: str | None = None
    allow_image_urls: bool = False      # fetch http(s) image URLs named in requests (--allow-image-urls)

    def still_loading(self) -> bool:
        """The start-up load is still running (the engine thread is busy: answered from this state)."""
        startup = getattr(self.engine, "startup", None)
        return bool(self.loading) and self.engine.model_facts() is None and startup is not None \
            and not startup.finished.is_set() and not getattr(self.engine, "failure", None)


class ToolFormats:
    """The served model's tool-call family, from its chat template (read from the GGUF header, once
    per model; the template's generation prompt says whether it opens a <think> block)."""

    def __init__(self):
        self.key, self.fmt = None, None

    def get(self, engine):
        facts = engine.model_facts()
        key = (facts.model_path, facts.model_hash) if facts is not None else None
        if self.fmt is None or key != self.key:
            template = None
            if facts is not None:
                try:
                    template = read_header(facts.model_path).metadata.get("tokenizer.chat_template")
                except Exception:  # noqa: BLE001 - the engine reports a bad file itself
                    pass
            template = template if isinstance(template, str) else None
            # whether the template opens a <think> block was read at load (ModelFacts.think_open)
            fmt = detect(template)
            self.key, self.fmt = key, replace(fmt, think_open=facts is not None and facts.think_open)
        return self.fmt


def chat_plan(engine, formats: ToolFormats, messages: list[dict], tools_in, choice_in, *,
              parallel=True, volatile=()):
    """(messages to render, ToolPlan or None) for checked OpenAI-form messages and raw tools/tool_choice.
    ToolError on bad input."""
    messages = strip_volatile(messages, volatile)
    tools = check_tools(tools_in)
    choice = check_tool_choice(choice_in, tools)
    if not tools and not uses_tools(messages):
        return messages, None
    p = plan(formats.get(engine), messages, tools, choice, parallel=parallel)
    return p.messages, p


def with_think_apart(parsed, fmt) -> tuple[str, str]:
    """(content, reasoning) of a reply the tool-call parser read: its content keeps a <think> block
    (calls are never parsed inside one), told apart here as in a reply without tools."""
    if fmt.name == "harmony":
        return parsed.content, parsed.reasoning
    ch = split(parsed.content, fmt.think_open)
    return ch.content, ch.reasoning


def think_stream(fmt):
    """The tool-call parser's streamed text with its <think> block apart: ("reasoning" | "content", delta)."""
    return ChannelStream(lambda text, final: split(text, fmt.think_open, final=final))


def reply_stream(fmt):
    """A streamed reply without tools, its reasoning apart: harmony's own parser (it reads a growing reply
    incrementally) for gpt-oss, else the <think> block's."""
    return ChannelStream() if fmt.name == "harmony" else think_stream(fmt)


def _chat_message(text: str, finish: str, p, think_open: bool = False) -> tuple[dict, str]:
    """The assistant message (content, tool_calls, and the reasoning as reasoning_content: a harmony
    model's analysis channel, a <think> block, opened by the template when `think_open`) and
    finish_reason of a finished reply."""
    if p is None or not p.active:
        ch = split_reply(text, think_open)
        return {"role": "assistant", "content": ch.content,
                **({"reasoning_content": ch.reasoning} if ch.reasoning else {})}, finish
    parsed = parse(text, p.fmt, p.tools)
    calls = finish_calls(p, parsed.calls)
    content, thought = with_think_apart(parsed, p.fmt)
    reasoning = {"reasoning_content": thought} if thought else {}
    if not calls:
        return {"role": "assistant", "content": content, **reasoning}, finish
    return ({"role": "assistant", "content": content or None, **reasoning,
             "tool_calls": [{"id": c.id or new_call_id(p.fmt), "type": "function",
                             "function": {"name": c.name, "arguments": c.arguments_json}} for c in calls]},
            "tool_calls")


# ---- engine bridge -----------------------------------------------------------------------------
class _Bridge:
    """One submitted engine request whose events arrive on the event loop's asyncio queue."""

    def __init__(self, engine, request):
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue = asyncio.Queue()
        self.handle = engine.submit(request, callback=self._on_event)

    def _on_event(self, ev) -> None:                 # engine thread: must never raise
        if not isinstance(ev, (Token, Done, Failed, Progress)):
            return
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, ev)
        except RuntimeError:                          # the loop is closed: nobody is listening
            self.handle.cancel()

    async def get(self):
        return await self.queue.get()

    def drain_tokens(self, first: Token) -> tuple[str, Any]:
        """`first`'s text plus every token already queued; returns (text, next non-token event or None)."""
        text = first.text
        while not self.queue.empty():
            ev = self.queue.get_nowait()
            if isinstance(ev, Token):
                text += ev.text
            elif not isinstance(ev, Progress):
                return text, ev
        return text, None

    async def stream(self, first):
        """The reply from `first` on, as both APIs stream it: the tokens queued together merged into one
        text (str), Progress left out, and the closing Done or Failed last."""
        ev = first
        while True:
            if isinstance(ev, Token):
                text, ev = self.drain_tokens(ev)
                if text:
                    yield text
                if ev is None:
                    ev = await self.get()
                continue
            if isinstance(ev, (Done, Failed)):
                yield ev
                return
            ev = await self.get()                # Progress

    async def outcome(self):
        while True:
            ev = await self.queue.get()
            if isinstance(ev, (Done, Failed)):
                return ev


async def _watch_disconnect(request: Request, handle) -> None:
    """Cancel `handle` when the client goes away (the body has been read: only a disconnect is left)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            handle.cancel()
            return


async def _await_watching(request: Request, handle, awaitable):
    """Await `awaitable` while watching for the client's disconnect (which cancels the request)."""
    watcher = asyncio.ensure_future(_watch_disconnect(request, handle))
    try:
        return await awaitable
    finally:
        watcher.cancel()
        try:
            await watcher
        except (asyncio.CancelledError, Exception):
            pass


class _EngineStream(StreamingResponse):
    """SSE stream of one engine request; however the response ends (done, client gone, server
    shutting down), the engine request is cancelled so the engine is freed."""

    def __init__(self, content, handle):
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.handle = handle

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.handle.cancel()      # no-op when the request already finished


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


# ---- the app -----------------------------------------------------------------------------------
def _models(engine) -> list[dict]:
    facts = engine.model_facts()
    if facts is None:
        return []
    try:
        created = int(Path(facts.model_path).stat().st_mtime)
    except OSError:
        created = 0
    entry = {"id": facts.model_id, "object": "model", "created": created, "owned_by": "strata"}
    if facts.distributed is not None:     # mode and split of a distributed run (engine.ranks.distributed)
        entry["distributed"] = facts.distributed
    return [entry]


def _model_id(engine) -> str:
    facts = engine.model_facts()
    return facts.model_id if facts is not None else ""


def _check_model(engine, body: dict) -> str:
    """The served model's id when `model` names it (its id, file name, general.name or "default")."""
    facts = engine.model_facts()
    if facts is None:
        # Still loading (or the load failed): the request queues behind the load and the engine
        # answers "no model is loaded" (503) if there is none by then.
        return ""
    model_id = facts.model_id
    asked = body.get("model")
    if asked is None:
        return model_id
    if not isinstance(asked, str):
        raise APIError(400, "'model' must be a string", param="model", code="invalid_type")
    names = {model_id, Path(facts.model_path).name, "default"}
    if facts.name:
        names.add(facts.name)
    if asked.lower() not in {n.lower() for n in names}:
        raise APIError(404, f"The model '{asked}' does not exist; this server serves '{model_id}'",
                       param="model", code="model_not_found")
    return model_id


def _usage(r: Generation) -> dict:
    return {"prompt_tokens": r.prompt_tokens, "completion_tokens": r.generated_tokens,
            "total_tokens": r.prompt_tokens + r.generated_tokens,
            "prompt_tokens_details": {"cached_tokens": r.cached_tokens},
            **({"speculative": {"drafted_tokens": r.drafted_tokens, "accepted_tokens": r.accepted_tokens,
                                "acceptance_rate": r.acceptance_rate}} if r.speculative != "off" else {})}


def _timings(r: Generation, asked: str | None = None) -> dict:
    """The reply's figures; `asked` is the request's "speculative" as the client named it (the draft's
    name, not the server's path to it, which is none of the client's business)."""
    spec = r.speculative
    if asked and spec.startswith("draft:") and str(asked).startswith("draft:"):
        spec = asked
    return {"ttft_ms": r.ttft_ms, "prefill_tps": r.prefill_tps, "decode_tps": r.decode_tps,
            "speed_projection": r.speed_projection, "speculative": spec,
            "drafted_tokens": r.drafted_tokens, "accepted_tokens": r.accepted_tokens,
            "acceptance_rate": r.acceptance_rate, "dropped_messages": r.dropped_messages}


def _finish(r: Generation) -> str:
    return "length" if r.finish_reason == "length" else "stop"


def _plain(result) -> dict:
    return {k: v for k, v in result.to_dict().items() if isinstance(v, (str, int, float, bool, type(None)))}
