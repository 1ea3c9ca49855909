"""The tool loop's plain logic (no Qt): which MCP tools a chat offers the model and under which function
names, the request's plan through engine/frontends/tool_calls.py (the same families, prompts and parser the
server uses), a reply's calls as chat messages, and the tool messages that answer them.

In a chat, an assistant message with calls carries `tool_calls` (OpenAI form, arguments as an object)
whose entries also name the MCP `server` and `tool`; each answer is a `{"role": "tool", "tool_call_id",
"name", "content"}` message with its `status` (ran, error, denied, stopped). What the engine gets is
`engine_messages`: those keys only."""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, replace
from pathlib import Path

from engine.frontends import tool_calls as tc
from engine.model.memory_estimate import read_header

from .results import ToolInfo, ToolResult

DEFAULT_STEP_LIMIT = 8
DENIED_TEXT = "The user declined to run this tool call."
STOPPED_TEXT = "Not run: the user stopped the reply."
# Tool messages' statuses
RAN, ERROR, DENIED, STOPPED = "ran", "error", "denied", "stopped"
_ENGINE_KEYS = ("role", "content", "tool_calls", "tool_call_id", "name")


def tool_format(model_path: str, think_open: bool = False) -> tc.ToolFormat:
    """The loaded model's tool-call family, from its GGUF's chat template (the generic one when unreadable)."""
    template = None
    if model_path:
        try:
            template = read_header(Path(model_path)).metadata.get("tokenizer.chat_template")
        except Exception:  # noqa: BLE001 - the engine reports a bad file itself; the generic family works anywhere
            template = None
    return replace(tc.detect(template if isinstance(template, str) else None), think_open=think_open)


def _function_name(info: ToolInfo, taken: set[str]) -> str:
    """The name the model calls a tool by: its own when valid and unique, else server_tool, made valid."""
    name = info.name if tc.NAME_RE.fullmatch(info.name) and info.name not in taken else \
        re.sub(r"[^A-Za-z0-9_-]", "_", f"{info.server}_{info.name}")[:64]
    base, n = name, 2
    while name in taken:
        name = f"{base[:60]}_{n}"
        n += 1
    return name


@dataclass
class Toolbox:
    """The tools a chat offers: OpenAI function tools, each mapped back to its server's tool."""
    functions: dict[str, ToolInfo]
    openai: list[dict]
    skipped: list[str]                # "server/tool: why" for a tool whose schema the engine refuses

    @classmethod
    def of(cls, infos: list[ToolInfo]) -> "Toolbox":
        functions, openai, skipped = {}, [], []
        for info in infos:
            name = _function_name(info, set(functions))
            tool = {"type": "function", "function": {"name": name, "description": info.description[:2000],
                                                     "parameters": info.input_schema}}
            try:
                tc.check_tools([tool])
            except tc.ToolError as e:
                skipped.append(f"{info.key}: {e}")
                continue
            functions[name] = info
            openai.append(tool)
        return cls(functions, openai, skipped)


def engine_messages(messages: list[dict]) -> list[dict]:
    """A chat's messages as the engine takes them: the OpenAI keys only (no reasoning, statuses, servers)."""
    out = []
    for m in messages:
        e = {k: m[k] for k in _ENGINE_KEYS if k in m}
        if "tool_calls" in e:
            e["tool_calls"] = [{"id": c["id"], "type": "function",
                                "function": {"name": c["function"]["name"], "arguments": c["function"]["arguments"]}}
                               for c in e["tool_calls"]]
        out.append(e)
    return out


def plan(fmt: tc.ToolFormat, messages: list[dict], box: Toolbox | None, choice="auto") -> tc.ToolPlan | None:
    """The request's tool plan (messages to render, the template's tools, a forced call's grammar), or
    None for a chat that neither offers tools nor holds calls. `choice`: 'auto', 'required' or {"name"}."""
    msgs = engine_messages(messages)
    tools = box.openai if box is not None else []
    if not tools and not tc.uses_tools(msgs):
        return None
    if not tools:
        choice = "auto"
    return tc.plan(fmt, msgs, tools, choice, parallel=fmt.parallel)


def reply_calls(text: str, p: tc.ToolPlan) -> tuple[str, list[tc.ToolCall]]:
    """A finished reply's content and the calls it makes (engine/frontends/tool_calls.py's parser)."""
    if not p.active:
        return text, []
    parsed = tc.parse(text, p.fmt, p.tools)
    return parsed.content, tc.finish_calls(p, parsed.calls)


def call_entry(call: tc.ToolCall, info: ToolInfo, fmt: tc.ToolFormat) -> dict:
    """A parsed call as an entry of the assistant message's `tool_calls`."""
    return {"id": call.id or tc.new_call_id(fmt), "type": "function",
            "function": {"name": call.name, "arguments": call.arguments}, "server": info.server, "tool": info.name}


def tool_message(entry: dict, status: str, text: str) -> dict:
    return {"role": "tool", "tool_call_id": entry["id"], "name": entry["function"]["name"], "content": text,
            "status": status, "server": entry.get("server", ""), "tool": entry.get("tool", "")}


def result_message(entry: dict, result: ToolResult) -> dict:
    return tool_message(entry, RAN if result.ok else ERROR, result.text)


def check_arguments(text: str, schema: dict) -> tuple[dict | None, str]:
    """The approval's edited arguments: (object, "") or (None, why in one line)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        return None, f"not JSON (line {e.lineno}, column {e.colno}: {e.msg})"
    if not isinstance(value, dict):
        return None, "the arguments must be a JSON object"
    problems = tc.validate(value, schema or {})
    return (None, "; ".join(problems[:3])) if problems else (value, "")


def pretty(arguments) -> str:
    return json.dumps(arguments, indent=2, ensure_ascii=False)


def preview(text: str, lines: int = 3) -> tuple[str, int]:
    """A result's first lines as shown collapsed, and how many lines the whole has."""
    all_lines = text.split("\n")
    return "\n".join(all_lines[:lines]), len(all_lines)


def unanswered(messages: list[dict]) -> list[dict]:
    """The calls of the last assistant message with calls that no tool message answers yet."""
    for i in range(len(messages) - 1, -1, -1):
        m = messages[i]
        if m.get("role") == "assistant" and m.get("tool_calls"):
            answered = {x.get("tool_call_id") for x in messages[i + 1:] if x.get("role") == "tool"}
            return [c for c in m["tool_calls"] if c["id"] not in answered]
        if m.get("role") == "user":
            return []
    return []
