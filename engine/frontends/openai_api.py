"""OpenAI's API on the engine: models, health, chat and legacy completions, session files.

Module-level handlers, each reading what the app serves (`wire.Served`: the engine, its tool formats,
the volatile system-prompt lines, the model still loading) from `request.app.state.served`;
engine/frontends/server.py puts `ROUTES` in its route table beside anthropic_api's.
Errors use OpenAI's shape, {"error": {"message", "type", "param", "code"}}, with the matching status.
"""
from __future__ import annotations

import re
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from engine.api import GenerateRequest, RestoreSession, SaveSession, model_id
from engine.errors import ErrorCode, SessionRefusal, StrataError
from engine.events import ENGINE_STOPPED, Done, Failed
from engine.paths import SESSION_EXTENSION, sessions_dir
from engine.sampling import SamplingError
from engine.frontends.tool_calls import StreamParser, ToolError, finish_calls, new_call_id, openai_messages
from engine.frontends.image_parts import ImageBudget, split_openai, tools_with_images, with_images
from engine.frontends.wire import (APIError, Served, _await_watching, _bool, _Bridge, _chat_message, _check_model, _EngineStream,
                                   _finish, _json_body, _messages, _model_id, _models, _plain, _response_format, _sampling,
                                   _overflow, _speculative, _sse, _timings, _usage, chat_plan, engine_error, reply_stream, think_stream,
                                   tool_error)

SESSION_NAME_MAX = 64
_SESSION_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
COMPLETIONS_DEFAULT_MAX_TOKENS = 16   # OpenAI's default for the legacy completions endpoint


def _served(request: Request) -> Served:
    return request.app.state.served


def _fingerprint(engine) -> str:
    facts = engine.model_facts()
    return f"strata-{((facts.model_hash if facts else '') or 'none')[:12]}"


# ---- models and health --------------------------------------------------------------------------------
async def list_models(request: Request) -> Response:
    s = _served(request)
    models = _models(s.engine)
    if not models and s.still_loading():
        models = [{"id": model_id(s.loading), "object": "model", "created": 0, "owned_by": "strata",
                   "status": "loading"}]
    return JSONResponse({"object": "list", "data": models})


async def health(request: Request) -> Response:
    """llama.cpp's /health: 200 {"status": "ok"} with a model loaded, else 503 in the API's shape."""
    s = _served(request)
    failure = getattr(s.engine, "failure", None)
    if failure:     # the engine's own line once its thread has ended on an error
        raise APIError(503, failure, type="server_error", code=ENGINE_STOPPED)
    if s.engine.model_facts() is not None:
        return JSONResponse({"status": "ok"})
    if s.still_loading():
        raise APIError(503, "the model is loading", type="unavailable_error", code="model_loading")
    raise APIError(503, "no model is loaded", type="server_error", code="model_not_loaded")


async def get_model(request: Request) -> Response:
    engine = _served(request).engine
    _check_model(engine, {"model": request.path_params["model"]})
    models = _models(engine)
    if not models:
        raise APIError(503, "no model is loaded", type="server_error", code="model_not_loaded")
    return JSONResponse(models[0])


# ---- chat and legacy completions --------------------------------------------------------------------
@dataclass
class _Call:
    """One completions request as read from its body."""
    chat: bool
    body: dict
    messages: list | None
    prompt: str | None
    plan: object                    # wire.chat_plan's plan (tools), or None
    constraint: object              # the ConstraintSpec the reply is decoded under, or None
    param: str                      # the field an engine refusal names
    rid: str
    created: int
    images: ImageBudget | None = None   # the request's images, checked (decoded) before the engine sees them


def _read_call(s: Served, body: dict, chat: bool) -> _Call:
    plan = fmt = images = None
    if chat:
        fmt = _response_format(body)      # a ConstraintSpec or None (engine/generation/constraints.py)
        images = ImageBudget.for_engine(s.engine, s.allow_image_urls)
        raw, parts_of = split_openai(body.get("messages"), images)
        try:
            checked = openai_messages(raw)
            if images.found:
                tools_with_images(s.formats.get(s.engine), checked, images.found[0][0])
            messages, plan = chat_plan(s.engine, s.formats, with_images(checked, parts_of), body.get("tools"),
                                       body.get("tool_choice"), volatile=s.volatile,
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
    # A forced tool call (tool_choice 'required' or named) is decoded under its grammar.
    constraint = (plan.constraint if plan is not None else None) or fmt
    return _Call(chat, body, messages, prompt, plan, constraint, param,
                 f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}", int(time.time()), images)


def _request_of(s: Served, call: _Call) -> tuple[GenerateRequest, bool]:
    """The engine's request and whether the reply streams (fields checked in the order the API names them)."""
    body = call.body
    facts = s.engine.model_facts()
    sampling = _sampling(body, ((facts.n_ctx if facts else 0) or 8192) if call.chat else COMPLETIONS_DEFAULT_MAX_TOKENS)
    stream = _bool(body, "stream", False)
    speed = _bool(body, "experimental_speed_projection", None)
    speculative = _speculative(body)
    try:
        sampling.validate()                  # the engine's own checks (engine/sampling.py), as 400
    except SamplingError as e:
        raise APIError(400, str(e), param=e.param, code="invalid_value") from None
    except StrataError as e:
        raise APIError(400, str(e), code="invalid_value") from None
    plan = call.plan
    return GenerateRequest(messages=call.messages, prompt=call.prompt, sampling=sampling, speed_projection=speed,
                           conversation=f"http {call.rid}", speculative=speculative, constraint=call.constraint,
                           tools=plan.template_tools if plan is not None else None,
                           overflow=_overflow(body) if call.chat else "stop"), stream


async def _generate(request: Request, chat: bool) -> Response:
    s = _served(request)
    body = await _json_body(request)
    asked_model = _check_model(s.engine, body)
    call = _read_call(s, body, chat)
    if call.images is not None:
        call.messages = await call.images.ready(call.messages)
    req, stream = _request_of(s, call)
    bridge = _Bridge(s.engine, req)
    if not stream:
        outcome = await _await_watching(request, bridge.handle, bridge.outcome())
        if isinstance(outcome, Failed):
            raise engine_error(outcome, call.param)
        return _whole_reply(s, call, asked_model or _model_id(s.engine), outcome.result)
    # Streaming: wait for the engine to take the request (its first event) before answering, so
    # a refused request (prompt too long) still gets its status code and JSON error.
    first = await _await_watching(request, bridge.handle, bridge.get())
    if isinstance(first, Failed):
        raise engine_error(first, call.param)
    opts = body.get("stream_options")
    reply = _ReplyStream(s, call, asked_model or _model_id(s.engine),
                         include_usage=isinstance(opts, dict) and bool(opts.get("include_usage")))
    return _EngineStream(reply.events(first, bridge), bridge.handle)


def _whole_reply(s: Served, call: _Call, model: str, res) -> Response:
    if call.chat:
        message, finish = _chat_message(res.text, _finish(res), call.plan, s.formats.get(s.engine).think_open)
        choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": finish}
    else:
        choice = {"index": 0, "text": res.text, "logprobs": None, "finish_reason": _finish(res)}
    plan = call.plan
    return JSONResponse({"id": call.rid, "object": "chat.completion" if call.chat else "text_completion",
                         "created": call.created, "model": model, "system_fingerprint": _fingerprint(s.engine),
                         "choices": [choice], "usage": _usage(res),
                         "strata": {**_timings(res, call.body.get("speculative")),
                                    **({"tool_choice": plan.note} if plan and plan.note else {})}})


class _ReplyStream:
    """A streamed reply as OpenAI's chunks: content deltas, the reasoning (a harmony model's analysis
    channel, a <think> block) as delta.reasoning_content, each tool call as delta.tool_calls."""

    def __init__(self, s: Served, call: _Call, model: str, include_usage: bool):
        self.s, self.call, self.model, self.include_usage = s, call, model, include_usage
        self.obj = "chat.completion.chunk" if call.chat else "text_completion"
        plan = call.plan
        self.parser = StreamParser(plan.fmt, plan.tools) if plan is not None and plan.active else None
        self.calls_sent: list = []
        fmt = s.formats.get(s.engine)
        self.channels = reply_stream(fmt) if call.chat and self.parser is None else None
        # the tool-call parser's text keeps a <think> block: told apart as without tools
        self.think = think_stream(fmt) if self.parser is not None and fmt.name != "harmony" else None

    def chunk(self, text: str | None, finish: str | None = None, role: bool = False) -> dict:
        if self.call.chat:
            delta = {} if text is None else {"content": text}
            if role:
                delta = {"role": "assistant", "content": ""}
            c = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        else:
            c = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
        return {"id": self.call.rid, "object": self.obj, "created": self.call.created, "model": self.model,
                "system_fingerprint": _fingerprint(self.s.engine), "choices": [c]}

    def channel_chunks(self, items):
        for kind, value in items:
            c = self.chunk(value)
            if kind == "reasoning":
                c["choices"][0]["delta"] = {"reasoning_content": value}
            yield _sse(c)

    def out(self, items):
        """Parsed stream items as chunks: content (and reasoning) deltas, and each call as
        delta.tool_calls. None: the reply's end."""
        if items is None:
            if self.think is not None:
                yield from self.channel_chunks(self.think.finish())
            return
        plan = self.call.plan
        for kind, value in items:
            if kind == "text":
                if self.think is not None:
                    yield from self.channel_chunks(self.think.feed(value))
                else:
                    yield _sse(self.chunk(value))
                continue
            if not finish_calls(plan, self.calls_sent + [value])[len(self.calls_sent):]:
                continue
            k = len(self.calls_sent)
            self.calls_sent.append(value)
            for part in ({"index": k, "id": value.id or new_call_id(plan.fmt), "type": "function",
                          "function": {"name": value.name, "arguments": ""}},
                         {"index": k, "function": {"arguments": value.arguments_json}}):
                c = self.chunk(None)
                c["choices"][0]["delta"] = {"tool_calls": [part]}
                yield _sse(c)

    def text(self, text: str):
        if self.channels is not None:
            yield from self.channel_chunks(self.channels.feed(text))
        elif self.parser is None:
            yield _sse(self.chunk(text))
        else:
            yield from self.out(self.parser.feed(text))

    def end(self, res):
        if self.parser is not None:
            yield from self.out(self.parser.finish())
            yield from self.out(None)
        if self.channels is not None:
            yield from self.channel_chunks(self.channels.finish())
        last = self.chunk(None, "tool_calls" if self.calls_sent else _finish(res))
        last["strata"] = _timings(res, self.call.body.get("speculative"))
        yield _sse(last)
        if self.include_usage:
            yield _sse({"id": self.call.rid, "object": self.obj, "created": self.call.created, "model": self.model,
                        "system_fingerprint": _fingerprint(self.s.engine), "choices": [], "usage": _usage(res)})
        yield "data: [DONE]\n\n"

    async def events(self, first, bridge):
        if self.call.chat:
            yield _sse(self.chunk(None, role=True))
        async for ev in bridge.stream(first):
            if isinstance(ev, str):
                for line in self.text(ev):
                    yield line
            elif isinstance(ev, Done):
                for line in self.end(ev.result):
                    yield line
            else:
                yield _sse(engine_error(ev, self.call.param).body())
                yield "data: [DONE]\n\n"


async def chat_completions(request: Request) -> Response:
    return await _generate(request, chat=True)


async def completions(request: Request) -> Response:
    return await _generate(request, chat=False)


# ---- session files --------------------------------------------------------------------------------
def _session_path(body: dict) -> tuple[str, Path]:
    name = body.get("name")
    if not isinstance(name, str) or not name:
        raise APIError(400, "'name' must be a non-empty string", param="name", code="invalid_session_name")
    if (len(name) > SESSION_NAME_MAX or not _SESSION_NAME.fullmatch(name) or ".." in name):
        raise APIError(400, f"invalid session name {name[:80]!r}: use 1-{SESSION_NAME_MAX} letters, digits, "
                            "'.', '_' or '-', starting with a letter or digit, without '..'",
                       param="name", code="invalid_session_name")
    return name, sessions_dir() / f"{name}{SESSION_EXTENSION}"


async def save_session(request: Request) -> Response:
    engine = _served(request).engine
    body = await _json_body(request)
    name, path = _session_path(body)
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
    engine = _served(request).engine
    name, path = _session_path(await _json_body(request))
    if not path.is_file():
        raise APIError(404, f"no session named '{name}'", param="name", code="session_not_found")
    outcome = await _Bridge(engine, RestoreSession(str(path))).outcome()
    if isinstance(outcome, Failed):
        raise APIError(400, outcome.message, param="name", code="session_refused")
    # The restored conversation's messages: send them back (plus a new turn) to continue it.
    return JSONResponse({"object": "session", "name": name, "path": str(path), **_plain(outcome.result),
                         "messages": outcome.result.messages})


ROUTES = [
    Route("/v1/models", list_models, methods=["GET"]),
    Route("/health", health, methods=["GET"]),
    Route("/v1/health", health, methods=["GET"]),
    Route("/v1/models/{model:path}", get_model, methods=["GET"]),
    Route("/v1/chat/completions", chat_completions, methods=["POST"]),
    Route("/v1/completions", completions, methods=["POST"]),
    Route("/v1/sessions/save", save_session, methods=["POST"]),
    Route("/v1/sessions/restore", restore_session, methods=["POST"]),
]
