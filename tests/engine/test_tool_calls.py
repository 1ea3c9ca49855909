"""Tool calls (engine/frontends/tool_calls.py): each family's calls rendered by its real chat template and parsed
back, reasoning never parsed, streaming, the request checks; then end to end through the OpenAI API
(the official `openai` client on a real server over a tiny GGUF): forced calls under the grammar
(plain and streamed) validate against the tool's schema, a tool-result round trip, 400s.

The templates in tool_templates/ are the models' own (from llama.cpp's models/templates, which copies
them from the GGUF/HF files); Gemma 3's is the shipped one, Qwen3-Coder's is its tool part, abridged."""
from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import openai
import pytest

from engine.frontends import tool_calls as tc
from engine.text.chat_template import render

TEMPLATES = Path(__file__).parent / "tool_templates"

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 8},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7}},
        "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The time in a time zone",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]}}}
TOOLS = [WEATHER, TIME]
CALL_A = {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}
CALL_B = {"name": "get_time", "arguments": {"zone": "Europe/Paris"}}

# file, family, native (the template takes `tools`), parallel calls rendered, the assistant turn's end
FAMILIES = [
    ("Qwen-Qwen2.5-7B-Instruct.jinja", "hermes", True, True, "<|im_end|>\n"),
    ("Qwen-Qwen3-0.6B.jinja", "hermes", True, True, "<|im_end|>\n"),
    ("Qwen3-Coder-abridged.jinja", "qwen3_coder", True, True, "<|im_end|>\n"),
    ("meta-llama-Llama-3.3-70B-Instruct.jinja", "llama3", True, False, "<|eot_id|>"),
    ("mistralai-Mistral-Nemo-Instruct-2407.jinja", "mistral", True, True, "</s>"),
    ("Mistral-Small-3.2-24B-Instruct-2506.jinja", "mistral", True, True, "</s>"),
    ("openai-gpt-oss-120b.jinja", "harmony", True, False, "<|call|>"),
    ("google-gemma-3-it.jinja", "gemma", False, True, "<end_of_turn>\n"),
    (None, "generic", False, True, "<|im_end|>\n"),
]


def template(name):
    return (TEMPLATES / name).read_text() if name else None


def assistant_turn(source, fmt, messages, tools):
    """What the template renders for the last (assistant) message: the text the model would write."""
    msgs, ttools = tc.prepare(fmt, messages, tools)
    kw = dict(bos_token="<s>", eos_token="</s>", tools=ttools)
    full = render(source, msgs, add_generation_prompt=False, **kw)
    head = render(source, msgs[:-1], add_generation_prompt=True, **kw)
    assert full.startswith(head), (head[-200:], full[-400:])
    return full[len(head):]


def conversation(calls):
    return [{"role": "user", "content": "Weather and time in Paris?"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": f"call_{i}abcdefgh", "type": "function", "function": dict(c)} for i, c in enumerate(calls)]}]


@pytest.mark.parametrize("name,family,native,parallel,end", FAMILIES, ids=[f[1] + ":" + str(f[0])[:24] for f in FAMILIES])
def test_family_round_trip_on_the_real_template(name, family, native, parallel, end):
    source = template(name)
    fmt = tc.detect(source)
    assert (fmt.name, fmt.native) == (family, native)
    calls = [CALL_A, CALL_B] if parallel else [CALL_A]
    turn = assistant_turn(source, fmt, conversation(calls), TOOLS)
    assert turn.endswith(end), turn
    text = turn[:-len(end)]
    if family == "harmony":             # the generation prompt is "<|start|>assistant": the turn goes on
        assert text.startswith(" to=functions.get_weather")
    parsed = tc.parse(text, fmt, TOOLS)
    assert [(c.name, c.arguments) for c in parsed.calls] == [(c["name"], c["arguments"]) for c in calls], text
    assert parsed.content.strip() == ""
    # Streamed a few characters at a time: the same calls, and no marker text leaks out as content.
    sp = tc.StreamParser(fmt, TOOLS)
    items = []
    for i in range(0, len(text), 3):
        items += sp.feed(text[i:i + 3])
    items += sp.finish()
    got = [(v.name, v.arguments) for k, v in items if k == "call"]
    assert got == [(c["name"], c["arguments"]) for c in calls]
    streamed = "".join(v for k, v in items if k == "text")
    assert re.sub(r"<think>\s*</think>", "", streamed).strip() == ""    # Qwen3 writes an empty reasoning block


def test_mistral_without_its_control_token_and_with_ids():
    fmt = tc.detect(template("mistralai-Mistral-Nemo-Instruct-2407.jinja"))
    # [TOOL_CALLS] is a control token: the engine's decoded text may lack it
    p = tc.parse('[{"name": "get_time", "arguments": {"zone": "UTC"}}]', fmt, TOOLS)
    assert [(c.name, c.arguments) for c in p.calls] == [("get_time", {"zone": "UTC"})]
    p = tc.parse('[TOOL_CALLS]get_time[CALL_ID]a1b2c3d4e[ARGS]{"zone": "UTC"}', fmt, TOOLS)
    assert p.calls[0].id == "a1b2c3d4e"
    # client ids become the 9 letters/digits the template insists on, the same every time
    msgs, _ = tc.prepare(fmt, conversation([CALL_A]) + [{"role": "tool", "tool_call_id": "call_0abcdefgh",
                                                           "content": "18 C", "name": "get_weather"}], TOOLS)
    ids = {msgs[1]["tool_calls"][0]["id"], msgs[2]["tool_call_id"]}
    assert len(ids) == 1 and len(ids.pop()) == 9
    assert tc.new_call_id(fmt).isalnum() and len(tc.new_call_id(fmt)) == 9


def test_llama3_variants():
    fmt = tc.detect(template("meta-llama-Llama-3.3-70B-Instruct.jinja"))
    for text in ('{"name": "get_time", "parameters": {"zone": "UTC"}}',
                 '<|python_tag|>{"name": "get_time", "parameters": {"zone": "UTC"}}',
                 '{"type": "function", "name": "get_time", "parameters": {"zone": "UTC"}}'):
        assert [c.name for c in tc.parse(text, fmt, TOOLS).calls] == ["get_time"], text
    p = tc.parse('{"name": "get_time", "parameters": {"zone": "UTC"}}; {"name": "get_time", "parameters": {"zone": "CET"}}',
                 fmt, TOOLS)
    assert [c.arguments["zone"] for c in p.calls] == ["UTC", "CET"]
    prose = 'The JSON {"a": 1} is an object.'
    assert tc.parse(prose, fmt, TOOLS).calls == [] and tc.parse(prose, fmt, TOOLS).content == prose
    # an unknown function name is content, not a call
    bad = '{"name": "rm_rf", "parameters": {}}'
    assert tc.parse(bad, fmt, TOOLS).calls == [] and tc.parse(bad, fmt, TOOLS).content == bad


def test_gemma_python_calls_and_tool_code_blocks():
    fmt = tc.detect(template("google-gemma-3-it.jinja"))
    for text in ('[get_weather(city="Paris", unit="celsius")]', '```tool_code\nget_weather(city="Paris", unit="celsius")\n```',
                 '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}'):
        p = tc.parse(text, fmt, TOOLS)
        assert [(c.name, c.arguments) for c in p.calls] == [("get_weather", CALL_A["arguments"])], text
    assert tc.parse("print(1)", fmt, TOOLS).calls == []        # not a tool
    assert tc.parse("[__import__('os').system('x')]", fmt, TOOLS).calls == []


def test_harmony_channels():
    fmt = tc.detect(template("openai-gpt-oss-120b.jinja"))
    text = ('<|channel|>analysis<|message|>Maybe call functions.get_time? to=functions.get_time<|end|>'
            '<|start|>assistant<|channel|>commentary to=functions.get_time <|constrain|>json<|message|>'
            '{"zone": "UTC"}<|call|>')
    p = tc.parse(text, fmt, TOOLS)
    assert [(c.name, c.arguments) for c in p.calls] == [("get_time", {"zone": "UTC"})]
    assert "Maybe" in p.reasoning and p.content == ""
    p = tc.parse("<|channel|>analysis<|message|>think<|end|><|start|>assistant<|channel|>final<|message|>Hello!", fmt, TOOLS)
    assert (p.content, p.calls) == ("Hello!", [])


CALL_TEXT = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>'


@pytest.mark.parametrize("text,calls", [
    (f"<think>\nI might write {CALL_TEXT} but no.\n</think>\n\nNo call.", 0),
    (f"<think>\nplan: {CALL_TEXT}\n</think>\n\n{CALL_TEXT}", 1),
    (f"<think>\nunfinished {CALL_TEXT}", 0),
])
def test_reasoning_is_never_parsed(text, calls):
    fmt = tc.detect(template("Qwen-Qwen3-0.6B.jinja"))
    p = tc.parse(text, fmt, TOOLS)
    assert len(p.calls) == calls
    assert "<think>" in p.content          # the reasoning stays in the content, calls and all
    sp = tc.StreamParser(fmt, TOOLS)
    items = [i for ch in text for i in sp.feed(ch)] + sp.finish()
    assert sum(k == "call" for k, _ in items) == calls


def test_reasoning_opened_by_the_generation_prompt():
    fmt = tc.detect(template("Qwen-Qwen3-0.6B.jinja"), generation_prompt="<|im_start|>assistant\n<think>\n")
    assert fmt.think_open
    text = f"the user wants {CALL_TEXT} maybe\n</think>\n\nIt is noon."
    assert tc.parse(text, fmt, TOOLS).calls == []


def test_text_before_a_call_streams_before_the_call_closes():
    fmt = tc.detect(template("Qwen-Qwen2.5-7B-Instruct.jinja"))
    sp = tc.StreamParser(fmt, TOOLS)
    out = sp.feed("Let me check.\n<tool_")
    assert out == [("text", "Let me check.\n")]           # the partial marker is held back
    assert sp.feed('call>\n{"name": "get_time", "arguments": {"zo') == []
    out = sp.feed('ne": "UTC"}}\n</tool_call>')
    assert [k for k, _ in out] == ["call"]
    assert sp.finish() == []


def test_native_rendering_offers_the_tools():
    source = template("Qwen-Qwen2.5-7B-Instruct.jinja")
    fmt = tc.detect(source)
    msgs, ttools = tc.prepare(fmt, [{"role": "user", "content": "hi"}], TOOLS)
    text = render(source, msgs, tools=ttools)
    assert "<tools>" in text and '"name": "get_weather"' in text
    msgs, ttools = tc.prepare(fmt, [{"role": "user", "content": "hi"}], TOOLS, "none")
    assert ttools is None and "<tools>" not in render(source, msgs, tools=ttools)


def test_fallback_writes_results_as_one_user_turn_for_strict_templates():
    source = template("google-gemma-3-it.jinja")
    fmt = tc.detect(source)
    msgs = tc.openai_messages([{"role": "system", "content": "You are terse."}] + conversation([CALL_A, CALL_B]) + [
        {"role": "tool", "tool_call_id": "call_0abcdefgh", "content": "18 C"},
        {"role": "tool", "tool_call_id": "call_1abcdefgh", "content": "12:00"},
        {"role": "user", "content": "Thanks. And tomorrow?"}])
    out, ttools = tc.prepare(fmt, msgs, TOOLS)
    assert ttools is None and [m["role"] for m in out] == ["system", "user", "assistant", "user"]
    text = render(source, out, bos_token="<bos>")            # alternates: Gemma's template accepts it
    assert "```tool_output\n18 C\n```" in text and "[get_weather(city='Paris', unit='celsius'), get_time(zone='Europe/Paris')]" in text
    assert "You have access to functions" in text


def test_request_checks():
    with pytest.raises(tc.ToolError, match="type must be one of"):
        tc.check_tools([{"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}])
    with pytest.raises(tc.ToolError, match="required must be a list"):
        tc.check_tools([{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "required": "x"}}}])
    with pytest.raises(tc.ToolError, match="1-64 letters"):
        tc.check_tools([{"type": "function", "function": {"name": "bad name"}}])
    with pytest.raises(tc.ToolError, match="given twice"):
        tc.check_tools([WEATHER, WEATHER])
    with pytest.raises(tc.ToolError) as e:
        tc.check_tool_choice({"type": "function", "function": {"name": "nope"}}, tc.check_tools(TOOLS))
    assert e.value.code == "unknown_tool"
    with pytest.raises(tc.ToolError, match="answers no tool call"):
        tc.openai_messages([{"role": "user", "content": "x"}, {"role": "tool", "tool_call_id": "c1", "content": "r"}])
    with pytest.raises(tc.ToolError, match="not valid JSON"):
        tc.openai_messages([{"role": "assistant", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{bad"}}]}])


def test_volatile_header_lines_are_dropped():
    msgs = [{"role": "system", "content": "x-anthropic-billing-header: cc_version=2.0.14; cch=93ab1\nYou are Claude Code."},
            {"role": "user", "content": "x-anthropic-billing-header: stays in user turns"}]
    out = tc.strip_volatile(msgs, tc.DEFAULT_VOLATILE_LINES)
    assert out[0]["content"] == "You are Claude Code." and out[1] == msgs[1]


def test_validate():
    schema = WEATHER["function"]["parameters"]
    assert tc.validate({"city": "Paris", "unit": "celsius"}, schema) == []
    assert tc.validate({"city": "Paris", "unit": "kelvin"}, schema)
    assert tc.validate({"city": "Paris", "unit": "celsius", "x": 1}, schema)
    assert tc.validate({"city": "Paris", "unit": "celsius", "days": 9}, schema)


# ---- end to end: the OpenAI API ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(server_model):
    from engines import running

    from engine.frontends.server import ServerThread, create_app
    with running(server_model) as eng:
        srv = ServerThread(create_app(eng)).start()
        yield srv
        srv.stop()


@pytest.fixture
def client(server):
    c = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120)
    yield c
    c.close()


def ask(**kw):
    kw.setdefault("model", "default")
    kw.setdefault("messages", [{"role": "user", "content": "What is the weather in Paris?"}])
    kw.setdefault("tools", TOOLS)
    kw.setdefault("max_tokens", 120)
    kw.setdefault("temperature", 0.8)
    kw.setdefault("seed", 1)
    return kw


def check_call(call, name=None):
    fn = tc.tool_by_name(TOOLS, call.function.name)
    assert fn is not None and (name is None or call.function.name == name)
    args = json.loads(call.function.arguments)
    assert tc.validate(args, fn["parameters"]) == [], args
    assert call.id and call.type == "function"
    return args


def test_forced_named_call_validates(client):
    for seed in range(3):
        r = client.chat.completions.create(**ask(tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                                 seed=seed))
        ch = r.choices[0]
        assert ch.finish_reason == "tool_calls", ch
        assert len(ch.message.tool_calls) == 1
        check_call(ch.message.tool_calls[0], "get_weather")


def test_forced_required_call_validates_streamed(client):
    stream = client.chat.completions.create(**ask(tool_choice="required", stream=True))
    calls, finish, content = {}, None, ""
    for chunk in stream:
        for c in chunk.choices:
            content += c.delta.content or ""
            finish = c.finish_reason or finish
            for d in c.delta.tool_calls or []:
                entry = calls.setdefault(d.index, {"id": None, "name": "", "arguments": ""})
                entry["id"] = d.id or entry["id"]
                if d.function is not None:
                    entry["name"] += d.function.name or ""
                    entry["arguments"] += d.function.arguments or ""
    assert finish == "tool_calls" and calls and content == ""
    for entry in calls.values():
        fn = tc.tool_by_name(TOOLS, entry["name"])
        assert entry["id"] and fn is not None
        assert tc.validate(json.loads(entry["arguments"]), fn["parameters"]) == []


def test_tool_result_round_trip_reuses_the_kv(client):
    first = client.chat.completions.create(**ask(tool_choice={"type": "function", "function": {"name": "get_time"}}))
    call = first.choices[0].message.tool_calls[0]
    messages = [{"role": "user", "content": "What is the weather in Paris?"},
                first.choices[0].message.model_dump(exclude_none=True),
                {"role": "tool", "tool_call_id": call.id, "content": "12:00"}]
    second = client.chat.completions.create(**ask(messages=messages, tool_choice="auto", max_tokens=4))
    assert second.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert second.usage.prompt_tokens > first.usage.prompt_tokens
    # the call as the model wrote it is the call as the template renders it back: the K/V is kept
    assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens


def test_auto_and_none_answer(client):
    for choice in ("auto", "none"):
        r = client.chat.completions.create(**ask(tool_choice=choice, max_tokens=4))
        assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
        if choice == "none":
            assert not r.choices[0].message.tool_calls


@pytest.mark.parametrize("kw,code", [
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}]), "invalid_schema"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "object",
                                                                               "properties": {"a": {"type": "string", "pattern": "("}}}}}]),
     "invalid_schema"),
    (dict(tool_choice={"type": "function", "function": {"name": "nope"}}), "unknown_tool"),
    (dict(messages=[{"role": "user", "content": "hi"}, {"role": "tool", "tool_call_id": "call_x", "content": "r"}]),
     "invalid_tool_message"),
    (dict(messages=[{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_time", "arguments": "{not json"}}]}]),
     "invalid_tool_arguments"),
    (dict(messages=[{"role": "user", "content": "hi"}, {"role": "tool", "content": "r"}]), "invalid_tool_message"),
])
def test_bad_tool_requests_are_400(server, kw, code):
    r = httpx.post(f"{server.base_url}/chat/completions", json=ask(**kw), timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["code"] == code and err["message"]


@pytest.mark.parametrize("think_open,text", [
    (True, f"the user wants the time\n</think>\n\nLet me look.\n{CALL_TEXT}"),            # Qwen3.5: opened for it
    (False, f"<think>\nthe user wants the time\n</think>\n\nLet me look.\n{CALL_TEXT}"),   # Qwen3: the model opens it
])
def test_a_think_block_before_a_call_is_reasoning_apart_from_the_content(think_open, text):
    """With tools the parser keeps a <think> block in the content (calls inside it are never parsed); both
    APIs tell it apart (engine/frontends/wire.py), whole or streamed a few characters at a time."""
    from engine.frontends.wire import think_stream, with_think_apart
    prompt = "<|im_start|>assistant\n<think>\n" if think_open else "<|im_start|>assistant\n"
    fmt = tc.detect(template("Qwen-Qwen3-0.6B.jinja"), generation_prompt=prompt)
    assert fmt.think_open == think_open
    parsed = tc.parse(text, fmt, TOOLS)
    assert [c.name for c in parsed.calls] == ["get_time"]
    assert with_think_apart(parsed, fmt) == ("Let me look.", "the user wants the time")
    sp, think = tc.StreamParser(fmt, TOOLS), think_stream(fmt)
    parts, calls = {"reasoning": "", "content": ""}, []
    items = [i for k in range(0, len(text), 3) for i in sp.feed(text[k:k + 3])] + sp.finish()
    for kind, value in items:
        if kind == "call":
            calls.append(value.name)
            continue
        for part, delta in think.feed(value):
            parts[part] += delta
    for part, delta in think.finish():
        parts[part] += delta
    assert calls == ["get_time"]
    assert parts["reasoning"].strip() == "the user wants the time" and parts["content"].strip() == "Let me look."
