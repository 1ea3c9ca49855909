"""Anthropic's Messages API on the same engine: `POST /v1/messages` and `/v1/messages/count_tokens`.

    client = anthropic.Anthropic(base_url="http://127.0.0.1:8484", api_key="unused")

- `system` (a string or text blocks), `messages` with content blocks `text`, `tool_use` (assistant)
  and `tool_result` (user; a string or text blocks, `is_error` noted), `tools` ({name, description,
  input_schema}) and `tool_choice` ({"type": "auto" | "any" | "tool" | "none"}, `name`,
  `disable_parallel_tool_use`), `max_tokens` (required), `temperature`, `top_p`, `top_k`,
  `stop_sequences`, `stream`. Tool calls go through engine/frontends/tool_calls.py exactly as in the OpenAI
  API (the model's own template, its family's parser, a forced call under the grammar).
- Any `model` name is served by the loaded model (agents ask for "claude-..." names); the reply
  echoes the name asked for.
- `usage`: `input_tokens` (the prompt tokens read this turn), `cache_read_input_tokens` (those taken
  from held K/V: the live or a parked conversation), `cache_creation_input_tokens` 0, `output_tokens`.
- The model's reasoning (gpt-oss's analysis channel, a `<think>` block: engine/text/reasoning.py) is a
  `thinking` block before the reply when the request enables it (`"thinking": {"type": "enabled", ...}`),
  else left out, as Anthropic's API does; never inside a `text` block.
- Streaming: message_start, ping, content_block_start / content_block_delta (thinking_delta, text_delta,
  input_json_delta) / content_block_stop per block, message_delta (stop_reason, usage), message_stop;
  an engine failure mid-stream is an `error` event.
- Errors: {"type": "error", "error": {"type", "message"}} with the matching status.
"""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from engine.api import CountTokens, GenerateRequest
from engine.errors import StrataError
from engine.events import Done, Failed
from engine.text.reasoning import split_reply
from engine.sampling import SamplingError
from engine.frontends.tool_calls import StreamParser, ToolError, finish_calls, new_call_id, parse
from engine.frontends.image_parts import ImageBudget, anthropic_image, tools_with_images
from engine.frontends.wire import (APIError, ErrorJSON, Served, _await_watching, _Bridge, _EngineStream, _json_body, _model_id,
                                   _overflow,
                                   _sampling, chat_plan, engine_error, reply_stream, think_stream,
                                   with_think_apart)

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 415: "invalid_request_error",
               429: "rate_limit_error", 499: "invalid_request_error", 500: "api_error", 503: "overloaded_error"}


def error_body(status: int, message: str) -> dict:
    return {"type": "error", "error": {"type": ERROR_TYPES.get(status, "api_error"), "message": message}}


def error_response(e: APIError) -> JSONResponse:
    return ErrorJSON(error_body(e.status, e.message), status_code=e.status)


def _bad(message: str) -> APIError:
    return APIError(400, message)


# ---- request -> engine -----------------------------------------------------------------------------
def _text_blocks(content, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        out = []
        for j, b in enumerate(content):
            if not isinstance(b, dict) or b.get("type") != "text" or not isinstance(b.get("text"), str):
                kind = b.get("type") if isinstance(b, dict) else type(b).__name__
                raise _bad(f"{where}[{j}]: blocks of type '{kind}' are not supported here (text only)")
            out.append(b["text"])
        return "\n".join(out) if where.endswith("system") else "".join(out)
    raise _bad(f"{where} must be a string or a list of text blocks")


def convert_messages(body: dict, images: ImageBudget | None = None) -> list[dict]:
    """Anthropic system + messages as OpenAI-form messages (tool_calls / role "tool"); a user message's
    `image` blocks (counted and bounded by `images`; refused without it) make its content a list of
    parts, text and ImageInput in the order given."""
    out: list[dict] = []
    system = body.get("system")
    if system is not None:
        text = _text_blocks(system, "system")
        if text:
            out.append({"role": "system", "content": text})
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _bad("messages: must be a non-empty list")
    calls: set[str] = set()
    for i, m in enumerate(messages):
        where = f"messages.{i}"
        if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
            raise _bad(f"{where}.role: must be 'user' or 'assistant'")
        content = m.get("content")
        if isinstance(content, str):
            out.append({"role": m["role"], "content": content})
            continue
        if not isinstance(content, list):
            raise _bad(f"{where}.content: must be a string or a list of content blocks")
        texts, tool_calls, results, parts = [], [], [], []
        for j, b in enumerate(content):
            w = f"{where}.content.{j}"
            kind = b.get("type") if isinstance(b, dict) else None
            if kind == "text" and isinstance(b.get("text"), str):
                texts.append(b["text"])
                parts.append({"type": "text", "text": b["text"]})
            elif kind == "image" and m["role"] == "user" and images is not None:
                parts.append({"type": "image", "image": anthropic_image(b, w, images)})
            elif kind == "tool_use" and m["role"] == "assistant":
                if not isinstance(b.get("id"), str) or not b["id"] or not isinstance(b.get("name"), str):
                    raise _bad(f"{w}: a tool_use block needs 'id', 'name' and 'input'")
                if not isinstance(b.get("input", {}), dict):
                    raise _bad(f"{w}.input: must be an object")
                tool_calls.append({"id": b["id"], "type": "function",
                                   "function": {"name": b["name"], "arguments": json.dumps(b.get("input", {}))}})
                calls.add(b["id"])
            elif kind == "tool_result" and m["role"] == "user":
                tid = b.get("tool_use_id")
                if not isinstance(tid, str) or tid not in calls:
                    raise _bad(f"{w}.tool_use_id: {str(tid)[:64]!r} answers no tool_use block of an earlier "
                               "assistant message")
                c = b.get("content", "")
                text = _text_blocks(c, f"{w}.content") if c is not None else ""
                if b.get("is_error"):
                    text = f"Error: {text}"
                results.append({"role": "tool", "tool_call_id": tid, "content": text})
            elif kind in ("thinking", "redacted_thinking") and m["role"] == "assistant":
                continue                       # earlier reasoning is not shown to the model again
            else:
                raise _bad(f"{w}: content blocks of type '{kind}' are not supported in a {m['role']} message "
                           "(text, image, tool_use, tool_result)")
        if m["role"] == "assistant":
            msg = {"role": "assistant", "content": "".join(texts)}
            if tool_calls:
                msg["tool_calls"] = tool_calls
            out.append(msg)
        else:
            out.extend(results)
            if any(p["type"] == "image" for p in parts):
                out.append({"role": "user", "content": parts})
            elif texts or not results:
                out.append({"role": "user", "content": "".join(texts)})
    return out


def convert_tools(body: dict) -> tuple[list | None, object, bool]:
    """(OpenAI-form tools, OpenAI-form tool_choice, parallel allowed)."""
    tools = body.get("tools")
    out = None
    if tools is not None:
        if not isinstance(tools, list):
            raise _bad("tools: must be a list")
        out = []
        for i, t in enumerate(tools):
            if not isinstance(t, dict) or t.get("type", "custom") != "custom":
                kind = t.get("type") if isinstance(t, dict) else type(t).__name__
                raise _bad(f"tools.{i}: tools of type '{kind}' are not supported (custom tools only)")
            if "input_schema" not in t:
                raise _bad(f"tools.{i}.input_schema: Field required")
            out.append({"type": "function", "function": {"name": t.get("name"), "description": t.get("description"),
                                                          "parameters": t.get("input_schema")}})
    choice = body.get("tool_choice")
    parallel = True
    if choice is None:
        return out, None, parallel
    if not isinstance(choice, dict) or choice.get("type") not in ("auto", "any", "tool", "none"):
        raise _bad("tool_choice: must be {\"type\": \"auto\" | \"any\" | \"tool\" | \"none\"}")
    parallel = not choice.get("disable_parallel_tool_use", False)
    kind = choice["type"]
    if kind == "tool":
        return out, {"type": "function", "function": {"name": choice.get("name")}}, parallel
    return out, {"auto": "auto", "any": "required", "none": "none"}[kind], parallel


def _anthropic_tool_error(e: ToolError) -> APIError:
    msg = e.message.replace("tools[", "tools.").replace("].function.parameters", ".input_schema") \
        .replace("].function.name", ".name").replace("'tool_choice'", "tool_choice")
    return _bad(msg)


def _usage(r) -> dict:
    return {"input_tokens": r.prompt_tokens - r.cached_tokens, "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": r.cached_tokens, "output_tokens": r.generated_tokens}


def _stop_reason(finish: str, calls: bool) -> str:
    return "tool_use" if calls else ("max_tokens" if finish == "length" else "end_turn")


def _sse(event: str, data: dict) -> str:
    return f"event: {event}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"


# ---- routes ----------------------------------------------------------------------------------------
def _served(request: Request) -> Served:
    return request.app.state.served


def _prepare(s: Served, body: dict):
    """The request's messages in the engine's form, its tool plan (tool_calls.chat_plan) and its images
    (an ImageBudget: `await images.check()` before the engine sees them)."""
    images = ImageBudget.for_engine(s.engine, s.allow_image_urls)
    messages = convert_messages(body, images)
    tools, choice, parallel = convert_tools(body)
    try:
        if images.found:
            tools_with_images(s.formats.get(s.engine), messages, images.found[0][0])
        messages, plan = chat_plan(s.engine, s.formats, messages, tools, choice, parallel=parallel,
                                   volatile=s.volatile)
        return messages, plan, images
    except ToolError as e:
        raise _anthropic_tool_error(e) from None


async def messages_endpoint(request: Request) -> Response:
    try:
        return await _messages(request)
    except APIError as e:
        return error_response(e)


@dataclass
class _Ask:
    """One /v1/messages request as read from its body."""
    messages: list
    plan: object                    # wire.chat_plan's plan (tools), or None
    images: ImageBudget             # the request's images, decoded once before the engine sees them
    sampling: object
    stream: bool
    show_thinking: bool
    model: str                      # the name asked for, echoed
    mid: str
    overflow: str = "stop"          # the extra field strata_overflow (engine/text/context_policy.py)


def _read_ask(s: Served, body: dict) -> _Ask:
    max_tokens = body.get("max_tokens")
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise _bad("max_tokens: Field required (an integer >= 1)" if max_tokens is None
                   else "max_tokens: must be an integer >= 1")
    stop = body.get("stop_sequences")
    if stop is not None and (not isinstance(stop, list) or not all(isinstance(s, str) for s in stop)):
        raise _bad("stop_sequences: must be a list of strings")
    sampling = _sampling({"max_tokens": max_tokens, "temperature": body.get("temperature"),
                          "top_p": body.get("top_p"), "top_k": body.get("top_k"), "stop": stop}, max_tokens)
    try:
        sampling.validate()
    except (SamplingError, StrataError) as e:
        raise _bad(str(e)) from None
    messages, plan, images = _prepare(s, body)
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise _bad("stream: must be true or false")
    thinking = body.get("thinking")
    if thinking is not None and (not isinstance(thinking, dict)
                                 or thinking.get("type") not in ("enabled", "disabled")):
        raise _bad('thinking: must be {"type": "enabled", "budget_tokens": N} or {"type": "disabled"}')
    model = body.get("model") if isinstance(body.get("model"), str) else _model_id(s.engine)
    return _Ask(messages, plan, images, sampling, stream, bool(thinking) and thinking["type"] == "enabled", model,
                f"msg_{uuid.uuid4().hex[:24]}", _overflow(body))


async def _messages(request: Request) -> Response:
    s = _served(request)
    ask = _read_ask(s, await _json_body(request))
    ask.messages = await ask.images.ready(ask.messages)
    plan = ask.plan
    bridge = _Bridge(s.engine, GenerateRequest(
        messages=ask.messages, sampling=ask.sampling, conversation=f"http {ask.mid}",
        constraint=plan.constraint if plan is not None else None,
        tools=plan.template_tools if plan is not None else None, overflow=ask.overflow))
    if not ask.stream:
        outcome = await _await_watching(request, bridge.handle, bridge.outcome())
        if isinstance(outcome, Failed):
            raise engine_error(outcome, "messages")
        return _whole_message(s, ask, outcome.result)
    first = await _await_watching(request, bridge.handle, bridge.get())
    if isinstance(first, Failed):
        raise engine_error(first, "messages")
    return _EngineStream(_MessageStream(s, ask).events(first, bridge), bridge.handle)


def _whole_message(s: Served, ask: _Ask, r) -> Response:
    plan = ask.plan
    blocks, calls = [], []
    if plan is not None and plan.active:
        parsed = parse(r.text, plan.fmt, plan.tools)
        calls = finish_calls(plan, parsed.calls)
        text, thought = with_think_apart(parsed, plan.fmt)
    else:
        ch = split_reply(r.text, s.formats.get(s.engine).think_open)
        text, thought = ch.content, ch.reasoning
    if thought and ask.show_thinking:
        blocks.append({"type": "thinking", "thinking": thought, "signature": ""})
    if text:
        blocks.append({"type": "text", "text": text})
    for c in calls:
        blocks.append({"type": "tool_use", "id": new_call_id(prefix="toolu_"), "name": c.name,
                       "input": c.arguments})
    out = {"id": ask.mid, "type": "message", "role": "assistant", "model": ask.model, "content": blocks,
           "stop_reason": _stop_reason(r.finish_reason, bool(calls)), "stop_sequence": None,
           "usage": _usage(r)}
    strata = {**({"tool_choice": plan.note} if plan is not None and plan.note else {}),
              **({"dropped_messages": r.dropped_messages} if r.dropped_messages else {})}
    if strata:
        out["strata"] = strata
    return JSONResponse(out)


class _MessageStream:
    """A streamed reply as Anthropic's events: a content block per run of text, of thinking (when asked
    for) and per tool call, each started, given its deltas and stopped in turn."""

    def __init__(self, s: Served, ask: _Ask):
        self.ask = ask
        plan = ask.plan
        fmt = s.formats.get(s.engine)
        self.parser = StreamParser(plan.fmt, plan.tools) if plan is not None and plan.active else None
        self.channels = reply_stream(fmt) if self.parser is None else None
        # the tool-call parser's text keeps a <think> block: told apart as without tools
        self.think = think_stream(fmt) if self.parser is not None and fmt.name != "harmony" else None
        self.index, self.open, self.calls = 0, None, []

    def items(self, text: str | None):
        """A reply's new text (None: its end) as ("thinking" | "text" | call) items."""
        if self.parser is None:
            parts = self.channels.feed(text) if text is not None else self.channels.finish()
        else:
            parts = []
            for kind, v in (self.parser.feed(text) if text is not None else self.parser.finish()):
                if kind != "text":
                    parts.append((kind, v))
                elif self.think is None:
                    parts.append(("content", v))
                else:
                    parts += self.think.feed(v)
            if text is None and self.think is not None:
                parts += self.think.finish()
        return [("thinking" if kind == "reasoning" else "text" if kind == "content" else kind, v)
                for kind, v in parts if kind != "reasoning" or self.ask.show_thinking]

    def close(self) -> list[str]:
        if self.open is None:
            return []
        self.open = None
        i = self.index
        self.index += 1
        return [_sse("content_block_stop", {"type": "content_block_stop", "index": i})]

    def emit(self, new) -> list[str]:
        lines = []
        for kind, value in new:
            if kind in ("text", "thinking"):
                if value:
                    lines += self._delta(kind, value)
                continue
            if not finish_calls(self.ask.plan, self.calls + [value])[len(self.calls):]:
                continue
            self.calls.append(value)
            lines += self.close()
            self.open = "tool_use"
            lines.append(_sse("content_block_start", {
                "type": "content_block_start", "index": self.index,
                "content_block": {"type": "tool_use", "id": new_call_id(prefix="toolu_"),
                                  "name": value.name, "input": {}}}))
            lines.append(_sse("content_block_delta", {
                "type": "content_block_delta", "index": self.index,
                "delta": {"type": "input_json_delta", "partial_json": value.arguments_json}}))
            lines += self.close()
        return lines

    def _delta(self, kind: str, value: str) -> list[str]:
        lines = []
        if self.open != kind:
            lines += self.close()
            self.open = kind
            lines.append(_sse("content_block_start", {
                "type": "content_block_start", "index": self.index,
                "content_block": ({"type": "text", "text": ""} if kind == "text" else
                                  {"type": "thinking", "thinking": "", "signature": ""})}))
        lines.append(_sse("content_block_delta", {
            "type": "content_block_delta", "index": self.index,
            "delta": ({"type": "text_delta", "text": value} if kind == "text" else
                      {"type": "thinking_delta", "thinking": value})}))
        return lines

    def start(self) -> list[str]:
        return [_sse("message_start", {"type": "message_start", "message": {
            "id": self.ask.mid, "type": "message", "role": "assistant", "model": self.ask.model, "content": [],
            "stop_reason": None, "stop_sequence": None,
            "usage": {"input_tokens": 0, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0,
                      "output_tokens": 0}}}), _sse("ping", {"type": "ping"})]

    def end(self, r) -> list[str]:
        return self.emit(self.items(None)) + self.close() + [
            _sse("message_delta", {
                "type": "message_delta",
                "delta": {"stop_reason": _stop_reason(r.finish_reason, bool(self.calls)), "stop_sequence": None},
                "usage": _usage(r)}),
            _sse("message_stop", {"type": "message_stop"})]

    async def events(self, first, bridge):
        for line in self.start():
            yield line
        async for ev in bridge.stream(first):
            if isinstance(ev, str):
                for line in self.emit(self.items(ev)):
                    yield line
            elif isinstance(ev, Done):
                for line in self.end(ev.result):
                    yield line
            else:
                e = engine_error(ev, "messages")
                yield _sse("error", error_body(e.status, e.message))


async def count_tokens(request: Request) -> Response:
    s = _served(request)
    try:
        body = await _json_body(request)
        messages, plan, images = _prepare(s, body)
        messages = await images.ready(messages)
        outcome = await _Bridge(s.engine, CountTokens(
            messages=messages, tools=plan.template_tools if plan is not None else None)).outcome()
        if isinstance(outcome, Failed):
            raise engine_error(outcome, "messages")
        return JSONResponse({"input_tokens": outcome.result.tokens})
    except APIError as e:
        return error_response(e)


ROUTES = [Route("/v1/messages", messages_endpoint, methods=["POST"]),
          Route("/v1/messages/count_tokens", count_tokens, methods=["POST"])]
