"""OpenAI-compatible local server: one Engine behind Starlette + uvicorn.

    strata serve [--host 127.0.0.1] [--port 8484] [--api-key KEY] [engine flags]

Endpoints: GET /v1/models (and /v1/models/{id}), POST /v1/chat/completions, POST /v1/completions
(streaming with SSE and not), POST /v1/sessions/save {"name", "messages"?, "force"?} and /v1/sessions/restore {"name": ...}.

Concurrent HTTP requests are decoded together, up to --max-sequences at once (engine/batching.py);
the rest queue.
Engine events reach the event loop through the handle's callback (`call_soon_threadsafe`), never by
blocking the loop. A client that goes away - while queued, during prefill or mid-stream - cancels its
request (`Handle.cancel()`), so the engine moves on to the next one.

Errors use OpenAI's shape, {"error": {"message", "type", "param", "code"}}, with the matching status.

`create_app(engine, api_key=None)` returns the Starlette app; `ServerThread(app).start()` runs it on
a background thread (tests, the bench, the Qt app's settings toggle); `cmd_serve(args)` is the CLI.
"""
from __future__ import annotations

import asyncio
import hmac
import ipaddress
import json
import re
import socket
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from ..api import GenerateRequest, Generation, RestoreSession, SaveSession
from ..errors import ErrorCode, SessionRefusal, StrataError
from ..events import Done, Failed, Progress, Token
from ..paths import SESSION_EXTENSION
from ..sampling import FIELD, FIELDS, SamplingError, SamplingParams

SESSION_NAME_MAX = 64
_SESSION_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
MAX_STOP = 16
DEFAULT_MAX_BODY = 8 << 20            # bytes; `strata serve --max-body-mib`
COMPLETIONS_DEFAULT_MAX_TOKENS = 16   # OpenAI's default for the legacy completions endpoint


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
        return JSONResponse(self.body(), status_code=self.status)


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
API_CODE_OF_REASON = {"context_length": "context_length_exceeded",
                      SessionRefusal.OVERWRITE.value: "session_overwrite"}


def engine_error(failed: Failed, param: str | None = None) -> APIError:
    """An engine Failed(message, code, reason) as an API error (HTTP_OF_ERROR)."""
    status, kind, code = HTTP_OF_ERROR[failed.code]
    message = "the request was cancelled" if failed.code == ErrorCode.CANCELLED else failed.message
    return APIError(status, message, type=kind, param=param, code=API_CODE_OF_REASON.get(failed.reason, code))


# ---- request parsing ---------------------------------------------------------------------------
async def _json_body(request: Request) -> dict:
    raw = await request.body()
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(400, f"We could not parse the JSON body of your request ({e}). "
                            "Send a JSON object with Content-Type: application/json.") from None
    except RecursionError:
        raise APIError(400, "the JSON body is nested too deeply", code="invalid_json") from None
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
    """The extra field "speculative": "off" | "lookup" | "draft:NAME" (a model in the models folder;
    a client does not get to point the server at arbitrary paths)."""
    value = body.get("speculative", "off")
    if value is None:
        return "off"
    from ..speculative import parse_spec
    try:
        if not isinstance(value, str):
            raise StrataError("speculative must be a string")
        if len(value) > 300:             # a model name has at most 255 characters (draft_names.NAME_MAX)
            raise StrataError(f"speculative is {len(value)} characters: off, lookup or draft:NAME, a model "
                              "name from the models folder")
        mode = parse_spec(value)
    except StrataError as e:
        raise APIError(400, str(e), param="speculative", code="invalid_value") from None
    if mode.kind == "draft":
        # A name in the models folder only (engine/draft_names.py): the engine gets the file's path.
        from .. import draft_names
        try:
            return f"draft:{draft_names.resolve(mode.draft_path)}"
        except StrataError as e:
            raise APIError(400, str(e), param="speculative", code="invalid_value") from None
    return mode.label


def _content_text(content, i: int) -> str:
    from ..tool_calls import ToolError, content_text
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
    from ..constraints import ConstraintError, ConstraintSpec
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


# ---- tool calls (engine/tool_calls.py) ------------------------------------------------------------
def tool_error(e) -> APIError:
    """A tool_calls.ToolError as OpenAI's 400."""
    return APIError(400, e.message, param=e.param, code=e.code)


class ToolFormats:
    """The served model's tool-call family, from its chat template (read from the GGUF header, once
    per model; the template's generation prompt says whether it opens a <think> block)."""

    def __init__(self):
        self.key, self.fmt = None, None

    def get(self, engine):
        from ..chat_template import render
        from ..memory_estimate import read_header
        from ..tool_calls import detect
        facts = engine.model_facts()
        key = (facts.model_path, facts.model_hash) if facts is not None else None
        if self.fmt is None or key != self.key:
            template, gen = None, ""
            if facts is not None:
                try:
                    template = read_header(facts.model_path).metadata.get("tokenizer.chat_template")
                    one = [{"role": "user", "content": "x"}]
                    full = render(template, one, add_generation_prompt=True)
                    gen = full[len(render(template, one, add_generation_prompt=False)):]
                except Exception:  # noqa: BLE001 - the engine reports a bad template itself
                    pass
            self.key, self.fmt = key, detect(template if isinstance(template, str) else None, gen)
        return self.fmt


def chat_plan(engine, formats: ToolFormats, messages: list[dict], tools_in, choice_in, *,
              parallel=True, volatile=()):
    """(messages to render, ToolPlan or None) for checked OpenAI-form messages and raw tools/tool_choice.
    ToolError on bad input."""
    from ..tool_calls import check_tool_choice, check_tools, plan, strip_volatile, uses_tools
    messages = strip_volatile(messages, volatile)
    tools = check_tools(tools_in)
    choice = check_tool_choice(choice_in, tools)
    if not tools and not uses_tools(messages):
        return messages, None
    p = plan(formats.get(engine), messages, tools, choice, parallel=parallel)
    return p.messages, p


def _chat_message(text: str, finish: str, p, harmony: bool = False) -> tuple[dict, str]:
    """The assistant message (content, tool_calls, and a harmony model's analysis channel as
    reasoning_content) and finish_reason of a finished reply."""
    from ..tool_calls import finish_calls, new_call_id, parse
    if p is None or not p.active:
        if harmony:
            from ..harmony import split
            ch = split(text)
            return {"role": "assistant", "content": ch.content,
                    **({"reasoning_content": ch.reasoning} if ch.reasoning else {})}, finish
        return {"role": "assistant", "content": text}, finish
    parsed = parse(text, p.fmt, p.tools)
    calls = finish_calls(p, parsed.calls)
    reasoning = {"reasoning_content": parsed.reasoning} if parsed.reasoning else {}
    if not calls:
        return {"role": "assistant", "content": parsed.content, **reasoning}, finish
    return ({"role": "assistant", "content": parsed.content or None, **reasoning,
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
    if facts.distributed is not None:     # mode and split of a distributed run (engine.distributed)
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
            "acceptance_rate": r.acceptance_rate}


def _finish(r: Generation) -> str:
    return "length" if r.finish_reason == "length" else "stop"


def _plain(result) -> dict:
    return {k: v for k, v in result.to_dict().items() if isinstance(v, (str, int, float, bool, type(None)))}


def create_app(engine, api_key: str | None = None, *, host: str = "127.0.0.1",
               max_body_bytes: int = DEFAULT_MAX_BODY, allowed_origins: tuple[str, ...] = (),
               loading: str | None = None, volatile_lines=None) -> Starlette:
    """The OpenAI-compatible app over a started Engine. With `api_key`, every request needs
    `Authorization: Bearer <api_key>`. `host` is the address the server listens on (the Host and
    Origin checks accept it besides loopback names); bodies over `max_body_bytes` get 413.
    `loading`: the model of the engine's start-up load, listed as loading until it is done (the
    engine thread is busy loading; this answers from the server's own state).
    `volatile_lines`: regular expressions of system-prompt lines dropped before rendering (a
    per-request header must not cost the conversation's K/V; None: tool_calls.DEFAULT_VOLATILE_LINES)."""
    from ..tool_calls import DEFAULT_VOLATILE_LINES, ToolError
    volatile = tuple(DEFAULT_VOLATILE_LINES if volatile_lines is None else volatile_lines)
    formats = ToolFormats()

    def fingerprint() -> str:
        facts = engine.model_facts()
        return f"strata-{((facts.model_hash if facts else '') or 'none')[:12]}"

    def still_loading() -> bool:
        startup = getattr(engine, "startup", None)
        return bool(loading) and engine.model_facts() is None and startup is not None \
            and not startup.finished.is_set()

    async def list_models(request: Request) -> Response:
        models = _models(engine)
        if not models and still_loading():
            from ..api import model_id
            models = [{"id": model_id(loading), "object": "model", "created": 0, "owned_by": "strata",
                       "status": "loading"}]
        return JSONResponse({"object": "list", "data": models})

    async def health(request: Request) -> Response:
        """llama.cpp's /health: 200 {"status": "ok"} with a model loaded, else 503 in the API's shape."""
        if engine.model_facts() is not None:
            return JSONResponse({"status": "ok"})
        if still_loading():
            raise APIError(503, "the model is loading", type="unavailable_error", code="model_loading")
        raise APIError(503, "no model is loaded", type="server_error", code="model_not_loaded")

    async def get_model(request: Request) -> Response:
        _check_model(engine, {"model": request.path_params["model"]})
        models = _models(engine)
        if not models:
            raise APIError(503, "no model is loaded", type="server_error", code="model_not_loaded")
        return JSONResponse(models[0])

    async def generate(request: Request, chat: bool) -> Response:
        body = await _json_body(request)
        model_id = _check_model(engine, body)
        plan = fmt = None
        if chat:
            fmt = _response_format(body)      # a ConstraintSpec or None (engine/constraints.py)
            from ..tool_calls import openai_messages
            try:
                messages, plan = chat_plan(engine, formats, openai_messages(body.get("messages")), body.get("tools"),
                                           body.get("tool_choice"), volatile=volatile,
                                           parallel=_bool(body, "parallel_tool_calls", True))
            except ToolError as e:
                raise tool_error(e) from None
            prompt, param = None, "messages"
        else:
            prompt = body.get("prompt")
            if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
                prompt = prompt[0]
            if not isinstance(prompt, str):
                raise APIError(400, "'prompt' must be a string (token arrays and batches are not supported)",
                               param="prompt", code="invalid_type" if prompt is not None else
                               "missing_required_parameter")
            if body.get("echo") or body.get("suffix"):
                raise APIError(400, "'echo' and 'suffix' are not supported", param="echo",
                               code="unsupported_parameter")
            messages, param = None, "prompt"
        facts = engine.model_facts()
        sampling = _sampling(body, ((facts.n_ctx if facts else 0) or 8192) if chat else COMPLETIONS_DEFAULT_MAX_TOKENS)
        stream = _bool(body, "stream", False)
        opts = body.get("stream_options")
        include_usage = bool(stream and isinstance(opts, dict) and opts.get("include_usage"))
        speed = _bool(body, "experimental_speed_projection", None)
        speculative = _speculative(body)
        try:
            sampling.validate()                  # the engine's own checks (engine/sampling.py), as 400
        except SamplingError as e:
            raise APIError(400, str(e), param=e.param, code="invalid_value") from None
        except StrataError as e:
            raise APIError(400, str(e), code="invalid_value") from None

        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        created = int(time.time())
        # A forced tool call (tool_choice 'required' or named) is decoded under its grammar.
        constraint = (plan.constraint if plan is not None else None) or fmt
        bridge = _Bridge(engine, GenerateRequest(messages=messages, prompt=prompt, sampling=sampling,
                                                 speed_projection=speed, conversation=f"http {rid}",
                                                 speculative=speculative, constraint=constraint,
                                                 tools=plan.template_tools if plan is not None else None))
        handle = bridge.handle

        if not stream:
            outcome = await _await_watching(request, handle, bridge.outcome())
            if isinstance(outcome, Failed):
                raise engine_error(outcome, param)
            model_id = model_id or _model_id(engine)
            res = outcome.result
            if chat:
                message, finish = _chat_message(res.text, _finish(res), plan, formats.get(engine).name == "harmony")
                choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": finish}
            else:
                choice = {"index": 0, "text": res.text, "logprobs": None, "finish_reason": _finish(res)}
            return JSONResponse({"id": rid, "object": "chat.completion" if chat else "text_completion",
                                 "created": created, "model": model_id, "system_fingerprint": fingerprint(),
                                 "choices": [choice], "usage": _usage(res),
                                 "strata": {**_timings(res, body.get("speculative")), **({"tool_choice": plan.note} if plan and plan.note else {})}})

        # Streaming: wait for the engine to take the request (its first event) before answering, so
        # a refused request (prompt too long) still gets its status code and JSON error.
        first = await _await_watching(request, handle, bridge.get())
        if isinstance(first, Failed):
            raise engine_error(first, param)
        model_id = model_id or _model_id(engine)
        obj = "chat.completion.chunk" if chat else "text_completion"

        def chunk(text: str | None, finish: str | None = None, role: bool = False) -> dict:
            if chat:
                delta = {} if text is None else {"content": text}
                if role:
                    delta = {"role": "assistant", "content": ""}
                c = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            else:
                c = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
            return {"id": rid, "object": obj, "created": created, "model": model_id,
                    "system_fingerprint": fingerprint(), "choices": [c]}

        from ..tool_calls import StreamParser, finish_calls, new_call_id
        parser = StreamParser(plan.fmt, plan.tools) if plan is not None and plan.active else None
        calls_sent: list = []
        # a harmony model's channels: analysis as delta.reasoning_content, the rest as delta.content
        from ..harmony import ChannelStream
        channels = ChannelStream() if chat and parser is None and formats.get(engine).name == "harmony" else None

        def channel_chunks(items):
            for kind, value in items:
                c = chunk(value)
                if kind == "reasoning":
                    c["choices"][0]["delta"] = {"reasoning_content": value}
                yield _sse(c)

        def out(items):
            """Parsed stream items as chunks: content deltas, and each call as delta.tool_calls."""
            for kind, value in items:
                if kind == "text":
                    yield _sse(chunk(value))
                    continue
                if not finish_calls(plan, calls_sent + [value])[len(calls_sent):]:
                    continue
                k = len(calls_sent)
                calls_sent.append(value)
                for part in ({"index": k, "id": value.id or new_call_id(plan.fmt), "type": "function",
                              "function": {"name": value.name, "arguments": ""}},
                             {"index": k, "function": {"arguments": value.arguments_json}}):
                    c = chunk(None)
                    c["choices"][0]["delta"] = {"tool_calls": [part]}
                    yield _sse(c)

        async def events():
            if chat:
                yield _sse(chunk(None, role=True))
            ev = first
            while True:
                if isinstance(ev, Token):
                    text, ev = bridge.drain_tokens(ev)
                    if text:
                        if channels is not None:
                            for line in channel_chunks(channels.feed(text)):
                                yield line
                        elif parser is None:
                            yield _sse(chunk(text))
                        else:
                            for line in out(parser.feed(text)):
                                yield line
                    if ev is None:
                        ev = await bridge.get()
                    continue
                if isinstance(ev, Done):
                    res = ev.result
                    if parser is not None:
                        for line in out(parser.finish()):
                            yield line
                    if channels is not None:
                        for line in channel_chunks(channels.finish()):
                            yield line
                    last = chunk(None, "tool_calls" if calls_sent else _finish(res))
                    last["strata"] = _timings(res, body.get("speculative"))
                    yield _sse(last)
                    if include_usage:
                        yield _sse({"id": rid, "object": obj, "created": created, "model": model_id,
                                    "system_fingerprint": fingerprint(), "choices": [], "usage": _usage(res)})
                    yield "data: [DONE]\n\n"
                    return
                if isinstance(ev, Failed):
                    yield _sse(engine_error(ev, param).body())
                    yield "data: [DONE]\n\n"
                    return
                ev = await bridge.get()               # Progress

        return _EngineStream(events(), handle)

    async def chat_completions(request: Request) -> Response:
        return await generate(request, chat=True)

    async def completions(request: Request) -> Response:
        return await generate(request, chat=False)

    def session_path(body: dict) -> tuple[str, Path]:
        from ..paths import sessions_dir
        name = body.get("name")
        if not isinstance(name, str) or not name:
            raise APIError(400, "'name' must be a non-empty string", param="name", code="invalid_session_name")
        if (len(name) > SESSION_NAME_MAX or not _SESSION_NAME.fullmatch(name) or ".." in name):
            raise APIError(400, f"invalid session name {name[:80]!r}: use 1-{SESSION_NAME_MAX} letters, digits, "
                                "'.', '_' or '-', starting with a letter or digit, without '..'",
                           param="name", code="invalid_session_name")
        return name, sessions_dir() / f"{name}{SESSION_EXTENSION}"

    async def save_session(request: Request) -> Response:
        body = await _json_body(request)
        name, path = session_path(body)
        # With several clients, "the last conversation served" may be someone else's: a client names
        # its conversation by sending its messages (as it would to continue it, replies included).
        messages = _messages(body) if body.get("messages") is not None else None
        force = body.get("force", False)
        if not isinstance(force, bool):
            raise APIError(400, "'force' must be true or false", param="force", code="invalid_force")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise APIError(500, f"cannot create the sessions folder: {e.strerror}", type="server_error") from None
        outcome = await _Bridge(engine, SaveSession(str(path), messages=messages, force=force)).outcome()
        if isinstance(outcome, Failed):
            # A file holding a longer conversation is kept unless the client resends with "force": true.
            overwrite = outcome.code == ErrorCode.SESSION_REFUSED and outcome.reason == SessionRefusal.OVERWRITE
            code = "session_overwrite" if overwrite else "session_refused"
            raise APIError(400, outcome.message, param="name", code=code)
        return JSONResponse({"object": "session", "name": name, "path": str(path), **_plain(outcome.result)})

    async def restore_session(request: Request) -> Response:
        name, path = session_path(await _json_body(request))
        if not path.is_file():
            raise APIError(404, f"no session named '{name}'", param="name", code="session_not_found")
        outcome = await _Bridge(engine, RestoreSession(str(path))).outcome()
        if isinstance(outcome, Failed):
            raise APIError(400, outcome.message, param="name", code="session_refused")
        # The restored conversation's messages: send them back (plus a new turn) to continue it.
        return JSONResponse({"object": "session", "name": name, "path": str(path), **_plain(outcome.result),
                             "messages": outcome.result.messages})

    from .anthropic_api import routes as anthropic_routes

    async def on_api_error(request: Request, exc: APIError) -> Response:
        return exc.response()

    async def on_http_error(request: Request, exc: HTTPException) -> Response:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        message = {404: f"no route {request.method} {request.url.path}",
                   405: f"{request.method} is not allowed on {request.url.path}"}.get(exc.status_code, exc.detail)
        return APIError(exc.status_code, message, code=code).response()

    async def on_error(request: Request, exc: Exception) -> Response:
        return APIError(500, f"internal error: {type(exc).__name__}: {exc}", type="server_error").response()

    routes = [
        Route("/v1/models", list_models, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/v1/health", health, methods=["GET"]),
        Route("/v1/models/{model:path}", get_model, methods=["GET"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/sessions/save", save_session, methods=["POST"]),
        Route("/v1/sessions/restore", restore_session, methods=["POST"]),
        *anthropic_routes(engine, formats, volatile),
    ]
    middleware = [Middleware(_RequestGuard, host=host, max_body_bytes=max_body_bytes,
                             allowed_origins=tuple(allowed_origins))]
    if api_key:
        middleware.append(Middleware(_BearerAuth, api_key=api_key))
    app = Starlette(routes=routes, middleware=middleware,
                    exception_handlers={APIError: on_api_error, HTTPException: on_http_error, Exception: on_error})
    app.state.engine = engine
    return app


def _hostname(value: str) -> str | None:
    """The host name of a Host header value or an Origin URL ("h:port", "[::1]:port", "http://h:port")."""
    from urllib.parse import urlsplit
    try:
        parts = urlsplit(value if "//" in value else "//" + value)
        parts.port                       # noqa: B018 - raises on a malformed port
        return (parts.hostname or "").rstrip(".").lower() or None
    except ValueError:
        return None


def _is_loopback(name: str) -> bool:
    if name == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def _is_wildcard(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_unspecified
    except ValueError:
        return False


class _RequestGuard:
    """Pure ASGI, outermost: what a web page in a browser could otherwise do to a local server.

    - `Host` must name loopback or the configured host: a DNS-rebinding page reaches 127.0.0.1 under
      its own domain name, which this refuses (403). Bound to a wildcard address, any IP literal is
      accepted too (rebinding needs a name).
    - `Origin`, when sent, must be loopback, the configured host or one given with --allow-origin: a
      cross-site page's fetch/form gets 403 (browsers send Origin on every cross-site POST).
    - POST bodies must be `application/json` (415): text/plain and form posts need no CORS preflight.
    - Bodies over `max_body_bytes` get 413: at once from Content-Length, and by counting the bytes
      as they arrive (chunked uploads), before the whole body is read.
    """

    def __init__(self, app, host: str, max_body_bytes: int, allowed_origins: tuple[str, ...]):
        self.app, self.max_body = app, int(max_body_bytes)
        self.host = (_hostname(host) or host).lower()
        self.wildcard = _is_wildcard(self.host)
        self.origins = {o.rstrip("/").lower() for o in allowed_origins}

    def _host_ok(self, name: str | None) -> bool:
        if name is None:
            return False
        if _is_loopback(name) or (name == self.host and not self.wildcard):
            return True
        if self.wildcard:
            try:
                ipaddress.ip_address(name)
                return True
            except ValueError:
                return False
        return False

    def _origin_ok(self, origin: str) -> bool:
        if origin.rstrip("/").lower() in self.origins:
            return True
        name = _hostname(origin)
        return name is not None and (_is_loopback(name) or (name == self.host and not self.wildcard))

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {}
        for k, v in scope.get("headers") or []:
            headers.setdefault(k.decode("latin-1").lower(), v.decode("latin-1"))
        error = None
        host = headers.get("host")
        if host is not None and not self._host_ok(_hostname(host)):
            error = APIError(403, f"Host '{host[:80]}' is not this server's (use localhost or "
                                  f"{self.host})", type="permission_error", code="host_not_allowed")
        elif "origin" in headers and not self._origin_ok(headers["origin"]):
            error = APIError(403, f"requests from origin '{headers['origin'][:80]}' are not allowed",
                             type="permission_error", code="origin_not_allowed")
        elif scope["method"] == "POST":
            ctype = headers.get("content-type", "").split(";")[0].strip().lower()
            length = headers.get("content-length")
            if ctype != "application/json":
                error = APIError(415, f"Content-Type must be application/json, got '{ctype[:80] or 'none'}'",
                                 code="unsupported_media_type")
            elif length is not None and (not length.strip().isdigit() or int(length) > self.max_body):
                error = APIError(413 if length.strip().isdigit() else 400,
                                 f"the request body is {length[:20]} bytes; the limit is {self.max_body}",
                                 code="request_too_large")
        if error is not None:
            await error.response()(scope, receive, send)
            return
        seen = 0

        async def counted_receive():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_body:
                    raise APIError(413, f"the request body passed the limit of {self.max_body} bytes",
                                   code="request_too_large")
            return message

        await self.app(scope, counted_receive, send)


class _BearerAuth:
    """Pure ASGI (streams pass straight through): 401 unless `Authorization: Bearer <api_key>`."""

    def __init__(self, app, api_key: str):
        self.app, self.key = app, api_key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            headers = dict(scope.get("headers") or [])
            value = headers.get(b"authorization", b"")
            scheme, _, token = value.partition(b" ")
            if b"x-api-key" in headers and not value:      # Anthropic's clients send the key this way
                scheme, token = b"bearer", headers[b"x-api-key"]
            if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self.key):
                err = APIError(401, "Incorrect or missing API key: send 'Authorization: Bearer <key>'",
                               code="invalid_api_key")
                resp = err.response()
                resp.headers["WWW-Authenticate"] = "Bearer"
                await resp(scope, receive, send)
                return
        await self.app(scope, receive, send)


# ---- running it --------------------------------------------------------------------------------
def bind_socket(host: str, port: int) -> socket.socket:
    """A listening-ready socket on host:port (port 0: a free one), or StrataError in one line."""
    from ..errors import StrataError
    try:
        family = socket.AF_INET6 if ipaddress.ip_address(host).version == 6 else socket.AF_INET
    except ValueError:
        family = socket.AF_INET                   # a host name such as "localhost"
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(2048)
    except OSError as e:
        sock.close()
        raise StrataError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    sock.set_inheritable(True)
    return sock


class ServerThread:
    """Runs an ASGI app with uvicorn on a background thread (tests, bench, the app's settings toggle).

        srv = ServerThread(create_app(engine), port=0).start();  srv.base_url  ...  srv.stop()
    """

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning"):
        import uvicorn
        self.sock = bind_socket(host, port)
        self.host, self.port = host, self.sock.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(app, log_level=log_level, lifespan="off",
                                                    timeout_graceful_shutdown=3))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       name="strata-server", daemon=True)

    @property
    def base_url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/v1"

    def start(self, timeout: float = 15.0) -> "ServerThread":
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.01)
        return self

    def stop(self, timeout: float = 10.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)
        self.sock.close()


def cmd_serve(args) -> int:
    import uvicorn

    from .launch import check_engine_flags, loaded, start_engine
    from ..errors import StrataError
    if not (0 <= args.port <= 65535):
        raise StrataError(f"--port must be in 0..65535, got {args.port}")
    check_engine_flags(args)                     # before the port is taken
    if not (0 < args.max_body_mib <= 4096):
        raise StrataError(f"--max-body-mib must be in (0, 4096], got {args.max_body_mib}")
    sock = bind_socket(args.host, args.port)      # fail before loading the model
    try:
        loopback = ipaddress.ip_address(args.host).is_loopback
    except ValueError:
        loopback = args.host == "localhost"
    if not loopback and not args.api_key:
        print(f"strata: warning: listening on {args.host} without --api-key: anyone who can reach this "
              "machine can use the model", file=sys.stderr)
    # The server answers from the start: while the model loads, /v1/models lists it as loading and
    # /health says 503 (from what the server holds; the engine thread is busy loading), and
    # completions queue behind the load. A failed load stops the server and exits 2 with its line.
    engine = start_engine(args, wait=False)
    app = create_app(engine, api_key=args.api_key, host=args.host,
                     max_body_bytes=int(args.max_body_mib * (1 << 20)), allowed_origins=tuple(args.allow_origin),
                     loading=engine.options.model)
    host = f"[{args.host}]" if ":" in args.host else args.host
    server = uvicorn.Server(uvicorn.Config(app, log_level="info" if args.verbose else "warning",
                                           lifespan="off", timeout_graceful_shutdown=5))
    failure: list[BaseException] = []
    url = f"http://{host}:{sock.getsockname()[1]}/v1"

    def await_load() -> None:
        try:
            loaded(engine)
        except BaseException as e:  # noqa: BLE001 -- reported on the main thread
            failure.append(e)
            server.should_exit = True
            return
        print(f"strata: serving {_models(engine)[0]['id']} at {url}"
              f"{' (API key required)' if args.api_key else ''}", file=sys.stderr)

    threading.Thread(target=await_load, name="strata-await-load", daemon=True).start()
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
        if not failure:
            engine.stop()
    if failure:
        raise failure[0]
    return 0
