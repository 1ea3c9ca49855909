"""Tool calls: the request side (tools, tool_choice, tool messages checked), the prompt side (tools
rendered through the model's own chat template, or described in the system prompt when the template
has no tools) and the reply side (calls parsed out of the model's text in its family's format, whole
or while it streams). Plain Python, no MLX: the server's two APIs (OpenAI chat completions and
Anthropic messages) share it.

Families, picked from the chat template's text (`detect`):

| family        | models (architectures the engine loads in brackets)   | a call as the model writes it                       |
|---------------|--------------------------------------------------------|-----------------------------------------------------|
| `hermes`      | Qwen2.5, Qwen3 [qwen2, qwen3, qwen3moe], Hermes        | `<tool_call>\\n{"name": .., "arguments": {..}}\\n</tool_call>` (several: parallel) |
| `qwen3_coder` | Qwen3-Coder [qwen3moe]                                 | `<tool_call>\\n<function=NAME>\\n<parameter=P>\\nV\\n</parameter>\\n</function>\\n</tool_call>` |
| `llama3`      | Llama 3.1/3.2/3.3 [llama]                              | `{"name": .., "parameters": {..}}` (optionally after `<|python_tag|>`; `;`-separated) |
| `mistral`     | Mistral 7B v0.3, Nemo, Small, Mixtral [llama]          | `[TOOL_CALLS][{"name": .., "arguments": {..}}, ..]` or `[TOOL_CALLS]NAME[ARGS]{..}` |
| `harmony`     | gpt-oss                                                | `<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{..}<|call|>` |
| `gemma`       | Gemma 2/3 (no tools in the template)                   | `[NAME(a=1, b="x")]` or a ```` ```tool_code ```` block, or JSON |
| `generic`     | any other template (SmolLM2, Qwen1.5 [qwen2moe], ...)  | as `hermes`; the tools are described in the system prompt |

A family whose template takes `tools` gets them through the template (`native`); the others get a
system-prompt description in their own format, and their history's calls and results are written
into the messages as text (results as a user turn, so role-strict templates such as Gemma's accept
them).

Reasoning is never parsed: text inside `<think>...</think>` (also when the template opened the block
in the generation prompt) and gpt-oss's analysis channel can mention `<tool_call>` freely.
"""
from __future__ import annotations

import ast
import hashlib
import json
import re
import secrets
import string
from dataclasses import dataclass, field

from engine.text.markers import partial_suffix
from engine.text.reasoning import opens_think
from engine.generation.constraints import ConstraintSpec, ConstraintError

NAME_RE = re.compile(r"[A-Za-z0-9_-]{1,64}")
ANTHROPIC_NAME_RE = re.compile(r"[A-Za-z0-9_-]{1,128}")
MAX_TOOLS = 128
MAX_SCHEMA_DEPTH = 32
_JSON_TYPES = {"object", "array", "string", "number", "integer", "boolean", "null"}
_ALNUM = string.ascii_letters + string.digits


class ToolError(Exception):
    """A bad tools / tool_choice / tool message in a request: the front end answers 400 with it."""

    def __init__(self, message: str, param: str | None = None, code: str = "invalid_value"):
        super().__init__(message)
        self.message, self.param, self.code = message, param, code


# ---- request side: tools, tool_choice, schemas ------------------------------------------------------
def check_schema(schema, where: str, depth: int = 0) -> None:
    """A JSON schema a tool's arguments (or a response_format) can be held to: keywords of the right
    types, known type names, required names that are strings. ToolError names the first problem."""
    if depth > MAX_SCHEMA_DEPTH:
        raise ToolError(f"{where}: the schema is nested deeper than {MAX_SCHEMA_DEPTH} levels", code="invalid_schema")
    if isinstance(schema, bool):
        return
    if not isinstance(schema, dict):
        raise ToolError(f"{where} must be a JSON schema object, got {type(schema).__name__}", code="invalid_schema")
    t = schema.get("type")
    if t is not None:
        names = t if isinstance(t, list) else [t]
        if not names or not all(isinstance(n, str) and n in _JSON_TYPES for n in names):
            raise ToolError(f"{where}.type must be one of {sorted(_JSON_TYPES)} (or a list of them), got "
                            f"{json.dumps(t)[:80]}", code="invalid_schema")
    props = schema.get("properties")
    if props is not None:
        if not isinstance(props, dict):
            raise ToolError(f"{where}.properties must be an object", code="invalid_schema")
        for k, v in props.items():
            check_schema(v, f"{where}.properties.{k}", depth + 1)
    req = schema.get("required")
    if req is not None and (not isinstance(req, list) or not all(isinstance(r, str) for r in req)):
        raise ToolError(f"{where}.required must be a list of property names", code="invalid_schema")
    for key in ("items", "additionalProperties", "not", "contains"):
        if key in schema and schema[key] is not None:
            check_schema(schema[key], f"{where}.{key}", depth + 1)
    for key in ("anyOf", "oneOf", "allOf", "prefixItems"):
        if key in schema:
            sub = schema[key]
            if not isinstance(sub, list) or not sub:
                raise ToolError(f"{where}.{key} must be a non-empty list of schemas", code="invalid_schema")
            for i, s in enumerate(sub):
                check_schema(s, f"{where}.{key}[{i}]", depth + 1)
    for key in ("$defs", "definitions"):
        if key in schema:
            if not isinstance(schema[key], dict):
                raise ToolError(f"{where}.{key} must be an object", code="invalid_schema")
            for k, v in schema[key].items():
                check_schema(v, f"{where}.{key}.{k}", depth + 1)
    if "enum" in schema and (not isinstance(schema["enum"], list) or not schema["enum"]):
        raise ToolError(f"{where}.enum must be a non-empty list", code="invalid_schema")
    for key in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"):
        v = schema.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))):
            raise ToolError(f"{where}.{key} must be a number", code="invalid_schema")
    for key in ("minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties"):
        v = schema.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
            raise ToolError(f"{where}.{key} must be a non-negative integer", code="invalid_schema")
    if "pattern" in schema:
        if not isinstance(schema["pattern"], str):
            raise ToolError(f"{where}.pattern must be a string", code="invalid_schema")
        try:
            re.compile(schema["pattern"])
        except re.error as e:
            raise ToolError(f"{where}.pattern is not a valid regular expression ({e})", code="invalid_schema") from None
    ref = schema.get("$ref")
    if ref is not None and not isinstance(ref, str):
        raise ToolError(f"{where}.$ref must be a string", code="invalid_schema")


def _tool(name, description, parameters, where: str, strict=None) -> dict:
    params = {"type": "object", "properties": {}} if parameters is None else parameters
    check_schema(params, f"{where}.parameters")
    if isinstance(params, dict) and params.get("type") not in (None, "object"):
        raise ToolError(f"{where}.parameters must describe an object (type 'object'), got type "
                        f"{json.dumps(params.get('type'))}", code="invalid_schema")
    fn = {"name": name, "description": description or "", "parameters": params}
    if strict is not None:
        fn["strict"] = strict
    return {"type": "function", "function": fn}


def check_tools(tools, param: str = "tools") -> list[dict]:
    """OpenAI `tools` checked, as [{"type": "function", "function": {name, description, parameters}}]."""
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise ToolError(f"'{param}' must be a list of tools", param, "invalid_type")
    if len(tools) > MAX_TOOLS:
        raise ToolError(f"'{param}' takes at most {MAX_TOOLS} tools", param)
    out, seen = [], set()
    for i, t in enumerate(tools):
        where = f"{param}[{i}]"
        if not isinstance(t, dict) or t.get("type", "function") != "function" or not isinstance(t.get("function"), dict):
            raise ToolError(f"{where} must be {{\"type\": \"function\", \"function\": {{...}}}} (function tools only)",
                            where, "invalid_type")
        fn = t["function"]
        name = fn.get("name")
        if not isinstance(name, str) or not NAME_RE.fullmatch(name):
            raise ToolError(f"{where}.function.name must be 1-64 letters, digits, '_' or '-', got {str(name)[:80]!r}",
                            f"{where}.function.name")
        if name in seen:
            raise ToolError(f"{where}: the tool name '{name}' is given twice", f"{where}.function.name")
        seen.add(name)
        desc = fn.get("description")
        if desc is not None and not isinstance(desc, str):
            raise ToolError(f"{where}.function.description must be a string", f"{where}.function.description")
        try:
            out.append(_tool(name, desc, fn.get("parameters"), f"{where}.function", fn.get("strict")))
        except ToolError as e:
            e.param = e.param or f"{where}.function.parameters"
            raise
    return out


def tool_names(tools: list[dict]) -> list[str]:
    return [t["function"]["name"] for t in tools]


def check_tool_choice(choice, tools: list[dict], param: str = "tool_choice") -> str | dict:
    """'auto' | 'none' | 'required' | {"name": NAME} (a named function, which must be among the tools)."""
    if choice is None:
        return "auto" if tools else "none"
    if isinstance(choice, str):
        if choice not in ("auto", "none", "required"):
            raise ToolError(f"'{param}' must be 'auto', 'none', 'required' or a named function, got {choice[:40]!r}", param)
        if choice == "required" and not tools:
            raise ToolError(f"'{param}' is 'required' but no tools were given", param)
        return choice if tools else "none"
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict):
        return _named(choice["function"].get("name"), tools, param)
    raise ToolError(f"'{param}' must be 'auto', 'none', 'required' or "
                    "{\"type\": \"function\", \"function\": {\"name\": ...}}", param, "invalid_type")


def _named(name, tools, param) -> dict:
    if not isinstance(name, str) or name not in tool_names(tools):
        raise ToolError(f"'{param}' names the tool {str(name)[:64]!r}, which is not among the tools "
                        f"({', '.join(tool_names(tools)) or 'none given'})", param, "unknown_tool")
    return {"name": name}


def tool_by_name(tools: list[dict], name: str) -> dict | None:
    return next((t["function"] for t in tools if t["function"]["name"] == name), None)


# ---- request side: messages ---------------------------------------------------------------------------
def content_text(content, where: str) -> str:
    """A message's content as text: a string, or a list of text parts (ToolError names `where` else)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
                parts.append(part["text"])
            else:
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise ToolError(f"{where}: content parts of type '{kind}' are not supported (text only)", where,
                                "unsupported_content")
        return "".join(parts)
    raise ToolError(f"{where} must be a string or a list of text parts", where, "invalid_type")


def parse_arguments(raw, where: str) -> dict:
    """A call's arguments (a JSON object, or a string holding one) as a dict; ToolError when not."""
    if isinstance(raw, dict):
        return raw
    if isinstance(raw, str):
        try:
            value = json.loads(raw) if raw.strip() else {}
        except (json.JSONDecodeError, RecursionError) as e:
            raise ToolError(f"{where} is not valid JSON ({str(e)[:80]})", where, "invalid_tool_arguments") from None
        if isinstance(value, dict):
            return value
    raise ToolError(f"{where} must be a JSON object (as a string)", where, "invalid_tool_arguments")


def openai_messages(messages, param: str = "messages") -> list[dict]:
    """OpenAI chat messages checked and made uniform: {"role", "content"} plus, for an assistant's calls,
    "tool_calls": [{"id", "type": "function", "function": {"name", "arguments": dict}}], and for a tool
    result "tool_call_id" and "name" (the call it answers). A tool message must answer a call made
    earlier in the conversation."""
    if not isinstance(messages, list) or not messages:
        raise ToolError(f"'{param}' must be a non-empty list", param,
                        "missing_required_parameter" if messages is None else "invalid_type")
    out, calls = [], {}
    for i, m in enumerate(messages):
        where = f"{param}[{i}]"
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ToolError(f"{where} must be an object with a 'role'", where, "invalid_type")
        role = "system" if m["role"] == "developer" else m["role"]
        if role not in ("system", "user", "assistant", "tool"):
            raise ToolError(f"{where}: unknown role '{m['role'][:40]}'", f"{where}.role")
        msg = {"role": role, "content": content_text(m.get("content"), f"{where}.content")}
        if role == "assistant" and m.get("tool_calls") is not None:
            tcs = m["tool_calls"]
            if not isinstance(tcs, list):
                raise ToolError(f"{where}.tool_calls must be a list", f"{where}.tool_calls", "invalid_type")
            norm = []
            for j, tc in enumerate(tcs):
                w = f"{where}.tool_calls[{j}]"
                fn = tc.get("function") if isinstance(tc, dict) else None
                if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
                    raise ToolError(f"{w} must be {{\"id\", \"type\": \"function\", \"function\": {{\"name\", "
                                    "\"arguments\"}}}}", w, "invalid_tool_call")
                tid = tc.get("id")
                if not isinstance(tid, str) or not tid:
                    raise ToolError(f"{w}.id must be a non-empty string", f"{w}.id", "invalid_tool_call")
                args = parse_arguments(fn.get("arguments", "{}"), f"{w}.function.arguments")
                norm.append({"id": tid, "type": "function", "function": {"name": fn["name"], "arguments": args}})
                calls[tid] = fn["name"]
            if norm:
                msg["tool_calls"] = norm
        if role == "tool":
            tid = m.get("tool_call_id")
            if not isinstance(tid, str) or not tid:
                raise ToolError(f"{where}: a tool message needs 'tool_call_id'", f"{where}.tool_call_id",
                                "invalid_tool_message")
            if tid not in calls:
                raise ToolError(f"{where}: 'tool_call_id' {tid[:64]!r} answers no tool call made earlier in the "
                                "messages", f"{where}.tool_call_id", "invalid_tool_message")
            msg["tool_call_id"], msg["name"] = tid, calls[tid]
        out.append(msg)
    return out


def uses_tools(messages: list[dict]) -> bool:
    return any(m.get("tool_calls") or m.get("role") == "tool" for m in messages)


# ---- families -----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ToolFormat:
    name: str
    native: bool                  # the template takes `tools` (and renders tool_calls / tool messages)
    think_open: bool = False      # the generation prompt opens a <think> block

    @property
    def parallel(self) -> bool:
        """Whether one reply can hold several calls in this format."""
        return self.name != "llama3"


_TOOLS_VAR = re.compile(r"\{[{%][^}]*\btools\b")


def detect(template: str | None, generation_prompt: str = "") -> ToolFormat:
    """The tool-call family of a chat template (None: the engine's built-in ChatML). `generation_prompt`:
    what the template appends for the reply, when known (a `<think>` there opens the reasoning block)."""
    t = template or ""
    native = bool(_TOOLS_VAR.search(t))
    think_open = opens_think(generation_prompt)
    if "<|channel|>" in t:
        name = "harmony"
    elif "[TOOL_CALLS]" in t:
        name = "mistral"
    elif "<tool_call>" in t and "<function=" in t:
        name = "qwen3_coder"
    elif "<tool_call>" in t:
        name = "hermes"
    elif "<|start_header_id|>" in t:
        name = "llama3"
    elif "<start_of_turn>" in t:
        name = "gemma"
    else:
        name, native = "generic", False
    if name == "gemma":
        native = False
    return ToolFormat(name, native, think_open)


def new_call_id(fmt: ToolFormat | None = None, prefix: str = "call_") -> str:
    if fmt is not None and fmt.name == "mistral":         # Mistral's templates want 9 letters/digits
        return "".join(secrets.choice(_ALNUM) for _ in range(9))
    return prefix + "".join(secrets.choice(_ALNUM) for _ in range(24))


def _mistral_id(tid: str) -> str:
    """A client's call id as Mistral's templates need it (9 letters/digits), the same every time."""
    if re.fullmatch(r"[A-Za-z0-9]{9}", tid):
        return tid
    n = int.from_bytes(hashlib.sha256(tid.encode()).digest()[:8], "big")
    out = ""
    for _ in range(9):
        n, r = divmod(n, 62)
        out += _ALNUM[r]
    return out


# ---- prompt side --------------------------------------------------------------------------------------
def _hermes_call(name: str, args: dict) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": args}, ensure_ascii=False) + "\n</tool_call>"


def _py_value(v) -> str:
    return repr(v) if not isinstance(v, (dict, list)) else json.dumps(v, ensure_ascii=False)


def _gemma_call(name: str, args: dict) -> str:
    return f"{name}(" + ", ".join(f"{k}={_py_value(v)}" for k, v in args.items()) + ")"


def _llama_call(name: str, args: dict) -> str:
    return json.dumps({"name": name, "parameters": args}, ensure_ascii=False)


def _choice_line(choice, fmt: ToolFormat) -> str:
    if isinstance(choice, dict):
        return f"\n\nYou must call the function `{choice['name']}` now."
    if choice == "required":
        return "\n\nYou must call at least one of these functions now."
    return ""


def tools_prompt(fmt: ToolFormat, tools: list[dict], choice="auto") -> str:
    """The system-prompt description of `tools` for a family whose template cannot render them."""
    lines = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    if fmt.name == "gemma":
        body = ("You have access to functions. If you decide to invoke any of the function(s), you MUST put it in "
                "the format of\n[func_name1(params_name1=params_value1, params_name2=params_value2...), "
                "func_name2(params)]\nYou SHOULD NOT include any other text in the response if you call a "
                f"function.\n{lines}")
    elif fmt.name == "llama3":
        body = ("You have access to the following functions. To call a function, please respond with JSON for a "
                'function call. Respond in the format {"name": function name, "parameters": dictionary of '
                f"argument name and its value}}. Do not use variables.\n\n{lines}")
    else:   # hermes, the generic fallback
        body = ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided "
                f"with function signatures within <tools></tools> XML tags:\n<tools>\n{lines}\n</tools>\n\nFor each "
                "function call, return a json object with function name and arguments within <tool_call></tool_call> "
                'XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')
    return body + _choice_line(choice, fmt)


def prepare(fmt: ToolFormat, messages: list[dict], tools: list[dict], choice="auto") -> tuple[list[dict], list | None]:
    """(messages, tools) to render: a native template gets the tools and the calls as structure; any
    other gets them written into the messages as text in its own format. choice 'none': no tools."""
    offer = tools if choice != "none" else []
    if fmt.native:
        out = []
        for m in messages:
            m = dict(m)
            if fmt.name == "mistral":
                if m.get("tool_calls"):
                    m["tool_calls"] = [dict(tc, id=_mistral_id(tc["id"])) for tc in m["tool_calls"]]
                if m.get("tool_call_id"):
                    m["tool_call_id"] = _mistral_id(m["tool_call_id"])
            out.append(m)
        if offer and choice != "auto":
            out = _with_system(out, _choice_line(choice, fmt).strip())
        return out, (offer or None)
    write = {"gemma": _gemma_call, "llama3": _llama_call}.get(fmt.name, _hermes_call)
    out: list[dict] = []
    last_was_result = False
    for m in messages:
        role, content = m["role"], m.get("content") or ""
        if role == "assistant" and m.get("tool_calls"):
            calls = [write(tc["function"]["name"], tc["function"]["arguments"]) for tc in m["tool_calls"]]
            text = ("[" + ", ".join(calls) + "]" if fmt.name == "gemma" else
                    "; ".join(calls) if fmt.name == "llama3" else "\n".join(calls))
            out.append({"role": "assistant", "content": (content + "\n" if content else "") + text})
            last_was_result = False
            continue
        result = role == "tool"
        if result:
            role = "user"
            content = (f"```tool_output\n{content}\n```" if fmt.name == "gemma"
                       else f"<tool_response>\n{content}\n</tool_response>")
        if role == "user" and out and out[-1]["role"] == "user" and (result or last_was_result):
            # results (and a user turn right after them) as one user turn: role-strict templates need it
            out[-1] = {"role": "user", "content": out[-1]["content"] + "\n" + content}
        else:
            out.append({"role": role, "content": content})
        last_was_result = result
    if offer:
        out = _with_system(out, tools_prompt(fmt, offer, choice))
    return out, None


def _with_system(messages: list[dict], text: str) -> list[dict]:
    if not text:
        return messages
    if messages and messages[0]["role"] == "system":
        first = dict(messages[0])
        first["content"] = (first["content"] + "\n\n" + text) if first["content"] else text
        return [first] + messages[1:]
    return [{"role": "system", "content": text}] + messages


# ---- reply side ----------------------------------------------------------------------------------------
@dataclass
class ToolCall:
    name: str
    arguments: dict
    id: str | None = None          # when the model wrote one (Mistral's [CALL_ID])

    @property
    def arguments_json(self) -> str:
        return json.dumps(self.arguments, ensure_ascii=False)


@dataclass
class Parsed:
    content: str
    calls: list[ToolCall] = field(default_factory=list)
    reasoning: str = ""


def _think_spans(text: str, think_open: bool) -> list[tuple[int, int]]:
    spans, pos = [], 0
    if think_open or ("</think>" in text and "<think>" not in text.split("</think>", 1)[0]):
        end = text.find("</think>")
        spans.append((0, len(text) if end < 0 else end + len("</think>")))
        pos = spans[-1][1]
    while True:
        a = text.find("<think>", pos)
        if a < 0:
            return spans
        b = text.find("</think>", a)
        spans.append((a, len(text) if b < 0 else b + len("</think>")))
        if b < 0:
            return spans
        pos = b + len("</think>")


def _find_outside(text: str, marker: str, pos: int, spans) -> int:
    while True:
        i = text.find(marker, pos)
        if i < 0:
            return -1
        inside = next((e for s, e in spans if s <= i < e), None)
        if inside is None:
            return i
        pos = inside


def _decode_json_prefix(s: str):
    """(value, rest) of the JSON value at the start of s (after spaces), or None."""
    s = s.lstrip()
    try:
        value, end = json.JSONDecoder().raw_decode(s)
    except (json.JSONDecodeError, RecursionError):
        return None
    return value, s[end:]


def _call_of(obj, names, keys=("arguments", "parameters")) -> ToolCall | None:
    if not isinstance(obj, dict):
        return None
    if isinstance(obj.get("function"), dict):          # {"type": "function", "function": {...}}
        obj = obj["function"]
    name = obj.get("name")
    if not isinstance(name, str) or (names is not None and name not in names):
        return None
    raw = next((obj[k] for k in keys if k in obj), {})
    try:
        args = parse_arguments(raw, "arguments")
    except ToolError:
        return None
    tid = obj.get("id") if isinstance(obj.get("id"), str) else None
    return ToolCall(name, args, tid)


def _json_calls(body: str, names) -> list[ToolCall] | None:
    """Calls written as JSON: one object, an array of them, or objects separated by ';' / newlines."""
    got = _decode_json_prefix(body)
    if got is None:
        return None
    value, rest = got
    items = value if isinstance(value, list) else [value]
    while rest.strip():
        rest = rest.lstrip().lstrip(";").lstrip()
        if not rest:
            break
        got = _decode_json_prefix(rest)
        if got is None:
            return None
        value, rest = got
        items.append(value)
    calls = [_call_of(it, names) for it in items]
    return calls if calls and all(calls) else None


def _coder_calls(body: str, names, tools) -> list[ToolCall] | None:
    m = re.fullmatch(r"\s*<function=([^>\n]+)>(.*?)(?:</function>\s*)?", body, re.S)
    if not m:
        return None
    name = m.group(1).strip()
    if names is not None and name not in names:
        return None
    schema = (tool_by_name(tools, name) or {}).get("parameters", {}) if tools else {}
    props = schema.get("properties", {}) if isinstance(schema, dict) else {}
    args = {}
    for pm in re.finditer(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", m.group(2), re.S):
        key, raw = pm.group(1).strip(), pm.group(2)
        kind = props.get(key, {}).get("type") if isinstance(props.get(key), dict) else None
        if kind == "string":
            args[key] = raw
        else:
            try:
                args[key] = json.loads(raw)
            except (json.JSONDecodeError, RecursionError):
                args[key] = raw
    return [ToolCall(name, args)]


def _py_calls(src: str, names) -> list[ToolCall] | None:
    """Gemma's Python-style calls: `[f(a=1), g(b="x")]` or `f(a=1)`."""
    try:
        tree = ast.parse(src.strip(), mode="eval").body
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    nodes = tree.elts if isinstance(tree, (ast.List, ast.Tuple)) else [tree]
    calls = []
    for n in nodes:
        if not isinstance(n, ast.Call) or n.args:
            return None
        fn = n.func
        name = fn.id if isinstance(fn, ast.Name) else (fn.attr if isinstance(fn, ast.Attribute) else None)
        if name is None or (names is not None and name not in names):
            return None
        try:
            args = {kw.arg: ast.literal_eval(kw.value) for kw in n.keywords if kw.arg}
        except (ValueError, SyntaxError, TypeError, RecursionError):
            return None
        calls.append(ToolCall(name, args))
    return calls or None


def _mistral_calls(body: str, names) -> list[ToolCall] | None:
    body = body.strip()
    if body.startswith("[") or body.startswith("{"):
        return _json_calls(body, names)
    calls = []
    for part in body.split("[TOOL_CALLS]"):
        part = part.strip()
        if not part:
            continue
        m = re.match(r"([A-Za-z0-9_.-]+)\s*(?:\[CALL_ID\]\s*([A-Za-z0-9]+)\s*)?\[ARGS\]", part)
        if not m:
            return None
        got = _decode_json_prefix(part[m.end():])
        if got is None or got[1].strip() or not isinstance(got[0], dict):
            return None
        if names is not None and m.group(1) not in names:
            return None
        calls.append(ToolCall(m.group(1), got[0], m.group(2)))
    return calls or None


_HARMONY_MARKS = ("<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|call|>", "<|return|>", "<|constrain|>")


def _parse_harmony(text: str, names, final: bool) -> tuple[Parsed, int]:
    content, reasoning, calls = [], [], []
    for m in re.finditer(r"(?:<\|start\|>)?(?P<head>(?:(?!<\|message\|>|<\|start\|>).)*?)<\|message\|>"
                         r"(?P<body>.*?)(?P<end><\|end\|>|<\|call\|>|<\|return\|>|$)", text, re.S):
        head, body, closed = m.group("head"), m.group("body"), bool(m.group("end"))
        channel = re.search(r"<\|channel\|>\s*(\w+)", head)
        channel = channel.group(1) if channel else ""
        to = re.search(r"to=functions\.([A-Za-z0-9_-]+)", head)
        if to:
            if not (closed or final):
                continue
            try:
                args = parse_arguments(body.strip() or "{}", "arguments")
            except ToolError:
                content.append(body)
                continue
            if names is None or to.group(1) in names:
                calls.append(ToolCall(to.group(1), args))
            continue
        if channel == "analysis":
            reasoning.append(body)
            continue
        if not (closed or final):
            body = body[:len(body) - partial_suffix(body, _HARMONY_MARKS)]
        content.append(body)
    if final and "<|message|>" not in text and not text.startswith("<|") and "<|channel|>" not in text:
        content = [text]        # a reply without harmony markers at all (special tokens not decoded)
    return Parsed("".join(content), calls, "".join(reasoning)), 0


def parse(text: str, fmt: ToolFormat, tools: list[dict] | None = None, *, final: bool = True) -> Parsed:
    """Content and calls of a reply (`final`), or of a reply so far (not `final`: text that may still
    become a call is held back, so the content only ever grows)."""
    return _scan(text, fmt, tools, final)[0]


def _scan(text: str, fmt: ToolFormat, tools, final: bool) -> tuple[Parsed, bool]:
    names = set(tool_names(tools)) if tools else None
    if fmt.name == "harmony":
        return _parse_harmony(text, names, final)[0], False
    spans = _think_spans(text, fmt.think_open)
    content, calls = [], []
    # 1. marker formats (also the fallback's): regions opened by a marker outside reasoning
    if fmt.name in ("hermes", "qwen3_coder", "generic", "mistral"):
        start, close = ("[TOOL_CALLS]", None) if fmt.name == "mistral" else ("<tool_call>", "</tool_call>")
        pos = 0
        while True:
            i = _find_outside(text, start, pos, spans)
            if i < 0:
                tail = text[pos:]
                if not final:
                    tail = tail[:len(tail) - partial_suffix(tail, (start,))]
                content.append(tail)
                break
            content.append(text[pos:i])
            j = text.find(close, i) if close else -1
            if j < 0 and not final:
                return Parsed("".join(content), calls), True
            body = text[i + len(start): j if j >= 0 else len(text)]
            end = (j + len(close)) if j >= 0 else len(text)
            if fmt.name == "mistral":
                got = _mistral_calls(body, names)
            elif "<function=" in body:
                got = _coder_calls(body, names, tools)
            else:
                got = _json_calls(body, names)
            if got:
                calls.extend(got)
            else:
                content.append(text[i:end])
            pos = end
        if calls or fmt.name in ("hermes", "qwen3_coder"):
            joined = "".join(content)
            return Parsed(_tidy(joined, calls) if final else joined, calls), False
        text_only = "".join(content)
    else:
        text_only = text
    # 2. bare formats: the whole reply (after any reasoning) is a call or it is content
    head_end = max((e for s, e in spans if s == 0 or text[:s].strip() == ""), default=0)
    head, rest = text_only[:head_end], text_only[head_end:]
    body = rest.strip()
    if body.startswith("<|python_tag|>"):
        body = body[len("<|python_tag|>"):].strip()
    looks = body[:1] in ("{", "[") or body.startswith("```") or (fmt.name == "gemma" and re.match(r"[A-Za-z_]\w*\(", body))
    if not looks:
        if not final and not body:
            return Parsed(head), True
        return Parsed(text_only), False
    if not final:
        return Parsed(head), True
    got = None
    fence = re.fullmatch(r"```(?:tool_code|json|python)?\s*\n?(.*?)\n?```", body, re.S)
    inner = fence.group(1) if fence else body
    if fmt.name == "gemma":
        got = _py_calls(inner, names) or _json_calls(inner, names)
    else:
        got = _json_calls(inner, names)
    if not got:
        return Parsed(text_only), False
    return Parsed(head.strip() and head, got), False


def _tidy(content: str, calls) -> str:
    """A reply with calls: an empty reasoning block and the spaces around the calls are not content."""
    if not calls:
        return content
    content = re.sub(r"<think>\s*</think>", "", content)
    return content.strip() if not content.strip() else content.rstrip()


class StreamParser:
    """Feeds a streamed reply's text; hands back what can go out: ("text", delta) and ("call", ToolCall)
    items, in order. Text that may still turn into a call is held until it is decided."""

    def __init__(self, fmt: ToolFormat, tools: list[dict] | None):
        self.fmt, self.tools = fmt, tools
        self.text = ""
        self.sent = ""           # the content handed out so far
        self.sent_calls = 0

    def feed(self, delta: str) -> list[tuple[str, object]]:
        self.text += delta
        return self._emit(final=False)

    def finish(self) -> list[tuple[str, object]]:
        return self._emit(final=True)

    def _emit(self, final: bool) -> list[tuple[str, object]]:
        parsed, _ = _scan(self.text, self.fmt, self.tools, final)
        out: list[tuple[str, object]] = []
        if len(parsed.content) > len(self.sent) and parsed.content.startswith(self.sent):
            out.append(("text", parsed.content[len(self.sent):]))
            self.sent = parsed.content
        for call in parsed.calls[self.sent_calls:]:
            out.append(("call", call))
        self.sent_calls = len(parsed.calls)
        return out


# ---- validation (the forced-call fallback and the tests) -----------------------------------------------
def validate(value, schema, path: str = "$") -> list[str]:
    """The ways `value` breaks `schema` (a practical subset of JSON Schema: type, properties,
    required, additionalProperties, items, enum, const, bounds, lengths, pattern, anyOf/oneOf/allOf)."""
    if schema is True or schema is None or schema == {}:
        return []
    if schema is False:
        return [f"{path}: no value is allowed"]
    errs: list[str] = []
    t = schema.get("type")
    if t is not None:
        kinds = t if isinstance(t, list) else [t]
        if not any(_is_type(value, k) for k in kinds):
            return [f"{path}: expected {'/'.join(kinds)}, got {type(value).__name__}"]
    if "enum" in schema and value not in schema["enum"]:
        errs.append(f"{path}: {value!r} is not one of {schema['enum']}")
    if "const" in schema and value != schema["const"]:
        errs.append(f"{path}: must be {schema['const']!r}")
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        for key, bad in (("minimum", lambda v, b: v < b), ("maximum", lambda v, b: v > b),
                         ("exclusiveMinimum", lambda v, b: v <= b), ("exclusiveMaximum", lambda v, b: v >= b)):
            if isinstance(schema.get(key), (int, float)) and bad(value, schema[key]):
                errs.append(f"{path}: {value} breaks {key} {schema[key]}")
    if isinstance(value, str):
        if len(value) < schema.get("minLength", 0) or len(value) > schema.get("maxLength", 1 << 62):
            errs.append(f"{path}: length {len(value)} out of bounds")
        if isinstance(schema.get("pattern"), str) and not re.search(schema["pattern"], value):
            errs.append(f"{path}: does not match {schema['pattern']}")
    if isinstance(value, list):
        if len(value) < schema.get("minItems", 0) or len(value) > schema.get("maxItems", 1 << 62):
            errs.append(f"{path}: {len(value)} items out of bounds")
        if isinstance(schema.get("items"), (dict, bool)):
            for i, v in enumerate(value):
                errs += validate(v, schema["items"], f"{path}[{i}]")
    if isinstance(value, dict):
        props = schema.get("properties", {}) or {}
        for r in schema.get("required", []) or []:
            if r not in value:
                errs.append(f"{path}: missing required '{r}'")
        extra = schema.get("additionalProperties", True)
        for k, v in value.items():
            if k in props:
                errs += validate(v, props[k], f"{path}.{k}")
            elif extra is False:
                errs.append(f"{path}: unexpected property '{k}'")
            elif isinstance(extra, dict):
                errs += validate(v, extra, f"{path}.{k}")
    if "anyOf" in schema and not any(not validate(value, s, path) for s in schema["anyOf"]):
        errs.append(f"{path}: matches none of anyOf")
    if "oneOf" in schema and sum(not validate(value, s, path) for s in schema["oneOf"]) != 1:
        errs.append(f"{path}: does not match exactly one of oneOf")
    for s in schema.get("allOf", []) or []:
        errs += validate(value, s, path)
    return errs


def _is_type(v, kind: str) -> bool:
    return {"object": isinstance(v, dict), "array": isinstance(v, list), "string": isinstance(v, str),
            "boolean": isinstance(v, bool), "null": v is None,
            "integer": isinstance(v, int) and not isinstance(v, bool) or (isinstance(v, float) and v.is_integer()),
            "number": isinstance(v, (int, float)) and not isinstance(v, bool)}.get(kind, True)


# ---- a request's plan (both APIs) ----------------------------------------------------------------------
@dataclass
class ToolPlan:
    fmt: ToolFormat
    tools: list[dict]                 # checked, OpenAI form
    choice: str | dict                # 'auto' | 'none' | 'required' | {"name": ...}
    messages: list[dict]              # to render
    template_tools: list | None       # the template's `tools` (native families)
    constraint: object = None         # constraints.ConstraintSpec for a forced call, or None
    note: str | None = None           # said when a forced call could not be constrained
    parallel: bool = True

    @property
    def active(self) -> bool:
        """Whether the reply is parsed for calls."""
        return bool(self.tools) and self.choice != "none"

    @property
    def forced(self) -> bool:
        return self.active and self.choice != "auto"


def forced_constraint(fmt: ToolFormat, tools: list[dict], choice, parallel: bool):
    """The grammar (engine/generation/constraints.py) a forced call is decoded under, in the family's own format,
    or (None, why) where the format has no JSON-object form the grammar can take."""
    name = choice["name"] if isinstance(choice, dict) else None
    # One call: a forced reply's grammar could otherwise go on call after call up to max_tokens (a
    # small model does); parallel calls are parsed from unforced replies.
    many = False
    if fmt.name in ("hermes", "qwen3_coder", "generic"):
        kw = dict(begin="<tool_call>\n", end="\n</tool_call>", arguments_key="arguments", sep="\n")
    elif fmt.name == "llama3":
        kw, many = dict(begin="", end="", arguments_key="parameters"), False
    elif fmt.name == "mistral":
        kw, many = dict(begin="[TOOL_CALLS][", end="]", arguments_key="arguments"), False
    elif fmt.name == "gemma":
        kw, many = dict(begin="", end="", arguments_key="arguments"), False
    else:
        return None, f"the {fmt.name} tool-call format has no constrained form here"
    return ConstraintSpec.tool_call(tools, name=name, parallel=many, param="tool_choice", **kw), None


def plan(fmt: ToolFormat, messages: list[dict], tools: list[dict], choice, *, parallel: bool = True,
         constrain: bool = True) -> ToolPlan:
    constraint, note = None, None
    if tools and choice not in ("auto", "none"):
        constraint, note = forced_constraint(fmt, tools, choice, parallel) if constrain else (None, "not asked")
        if constraint is not None:
            try:
                constraint.check()
            except ConstraintError as e:
                raise ToolError(str(e), getattr(e, "param", None) or "tools", "invalid_schema") from None
        else:
            note = f"not constrained ({note}): the call was asked for in the prompt and may not validate"
    # A constrained call needs no instruction: the prompt stays the one an 'auto' turn renders, so the
    # next turn's K/V follows on.
    msgs, template_tools = prepare(fmt, messages, tools, "auto" if constraint is not None else choice)
    return ToolPlan(fmt, tools, choice, msgs, template_tools, constraint, note, parallel)


def finish_calls(p: ToolPlan, calls: list[ToolCall]) -> list[ToolCall]:
    """The calls a reply reports: the first only without parallel calls; a forced call's name kept."""
    if not p.parallel:
        calls = calls[:1]
    if isinstance(p.choice, dict):
        calls = [c for c in calls if c.name == p.choice["name"]] or calls[:0]
    return calls


# ---- cache-stable prompts ------------------------------------------------------------------------------
# Lines some clients change on every request inside an early message; left in, each request's prompt
# differs from the held K/V a few tokens in, and the whole conversation is read again. Claude Code
# writes a per-request billing header line into the system prompt (LM Studio #1229).
DEFAULT_VOLATILE_LINES = (r"x-anthropic-billing-header:[^\n]*",)


def strip_volatile(messages: list[dict], patterns) -> list[dict]:
    """`messages` with the system messages' lines that match one of `patterns` (whole lines) removed."""
    if not patterns:
        return messages
    rx = re.compile("|".join(f"(?:{p})" for p in patterns))
    out = []
    for m in messages:
        c = m.get("content")
        if m.get("role") == "system" and isinstance(c, str) and rx.search(c):
            kept = [line for line in c.split("\n") if not rx.fullmatch(line.strip())]
            m = dict(m, content="\n".join(kept).strip("\n"))
        out.append(m)
    return out
