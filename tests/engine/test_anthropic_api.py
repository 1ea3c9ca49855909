"""The Anthropic Messages API (engine/frontends/anthropic_api.py) end to end: a real Engine on a tiny
GGUF behind uvicorn, the official `anthropic` client (raw httpx for the event order and malformed
bodies). Also the cache-stable agent measurement: a 20-turn transcript whose system prompt carries a
per-request header line, total prefill tokens with and without the volatile-line setting."""
from __future__ import annotations

import json
import uuid

import anthropic
import httpx
import pytest

from engine.frontends import tool_calls as tc

WEATHER = {"name": "get_weather", "description": "Current weather in a city",
           "input_schema": {"type": "object", "properties": {
               "city": {"type": "string", "maxLength": 8},
               "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
               "required": ["city", "unit"]}}
TIME = {"name": "get_time", "description": "The time in a time zone",
        "input_schema": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 8}},
                         "required": ["zone"]}}
TOOLS = [WEATHER, TIME]
API_KEY = "sk-ant-test"


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from gguf_factory import write_tiny_gguf

    from engine.engine import Engine, EngineOptions
    path = write_tiny_gguf(tmp_path_factory.mktemp("anthropic-model") / "tiny-anthropic.gguf", arch="llama",
                           n_layer=2, n_embd=64, seed=5, context_length=4096)
    eng = Engine(EngineOptions(model=str(path))).start()
    yield eng
    eng.stop()


def _serve(engine, **kw):
    from engine.frontends.server import ServerThread, create_app
    return ServerThread(create_app(engine, **kw)).start()


@pytest.fixture(scope="module")
def server(engine):
    srv = _serve(engine, api_key=API_KEY)
    yield srv
    srv.stop()


@pytest.fixture
def client(server):
    c = anthropic.Anthropic(base_url=server.base_url.removesuffix("/v1"), api_key=API_KEY, max_retries=0, timeout=120)
    yield c
    c.close()


def ask(**kw):
    kw.setdefault("model", "claude-sonnet-4-5")
    kw.setdefault("max_tokens", 8)
    # anthropic 2.15's create() has no sampling arguments: they travel in the body as extras
    kw["extra_body"] = {"temperature": kw.pop("temperature", 0)}
    kw.setdefault("messages", [{"role": "user", "content": "What is the weather in Paris?"}])
    return kw


def test_plain_message_and_usage(client):
    r = client.messages.create(**ask(system=[{"type": "text", "text": "You are terse."}]))
    assert r.type == "message" and r.role == "assistant" and r.model == "claude-sonnet-4-5"
    assert r.stop_reason in ("end_turn", "max_tokens")
    assert all(b.type == "text" for b in r.content)
    assert r.usage.output_tokens > 0 and r.usage.input_tokens + r.usage.cache_read_input_tokens > 0


def test_count_tokens_matches_the_prompt(client):
    kw = ask(system="You are terse.", tools=TOOLS, messages=[{"role": "user", "content": "count these tokens, please"}])
    n = client.messages.count_tokens(model=kw["model"], system=kw["system"], tools=TOOLS, messages=kw["messages"]).input_tokens
    r = client.messages.create(**kw)
    assert n == r.usage.input_tokens + r.usage.cache_read_input_tokens > 0
    bare = client.messages.count_tokens(model=kw["model"], messages=kw["messages"]).input_tokens
    assert bare < n                       # the tools are part of the prompt


def test_forced_tool_use_validates_and_round_trips(client):
    r = client.messages.create(**ask(tools=TOOLS, tool_choice={"type": "tool", "name": "get_weather"},
                                     max_tokens=200, temperature=0.8))
    assert r.stop_reason == "tool_use"
    uses = [b for b in r.content if b.type == "tool_use"]
    assert len(uses) == 1 and uses[0].name == "get_weather" and uses[0].id.startswith("toolu_")
    assert tc.validate(uses[0].input, WEATHER["input_schema"]) == []
    # the result goes back; the second turn reads only what is new
    follow = client.messages.create(**ask(tools=TOOLS, messages=[
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in r.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id, "content": "18 C, sunny"},
                                     {"type": "text", "text": "Thanks!"}]}]))
    assert follow.usage.cache_read_input_tokens > 0
    assert follow.usage.cache_read_input_tokens >= r.usage.input_tokens + r.usage.cache_read_input_tokens
    assert follow.usage.input_tokens < follow.usage.cache_read_input_tokens


def test_streaming_event_order(server):
    body = ask(stream=True, tools=TOOLS, tool_choice={"type": "any"}, max_tokens=200, temperature=0.8)
    body.update(body.pop("extra_body"))
    events = []
    with httpx.stream("POST", f"{server.base_url}/messages", json=body, timeout=120,
                      headers={"x-api-key": API_KEY, "anthropic-version": "2023-06-01"}) as resp:
        assert resp.status_code == 200
        name = None
        for line in resp.iter_lines():
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                data = json.loads(line[6:])
                assert data["type"] == name
                events.append(data)
    kinds = [e["type"] for e in events]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    # blocks: start, deltas, stop, with increasing indexes, never interleaved
    open_index, seen = None, []
    for e in events[1:-2]:
        if e["type"] == "content_block_start":
            assert open_index is None
            open_index = e["index"]
            seen.append(e["content_block"])
        elif e["type"] == "content_block_delta":
            assert e["index"] == open_index
        elif e["type"] == "content_block_stop":
            assert e["index"] == open_index
            open_index = None
        else:
            assert e["type"] == "ping"
    assert open_index is None and [s["type"] for s in seen][-1] == "tool_use"
    assert events[-2]["delta"]["stop_reason"] == "tool_use"
    assert events[-2]["usage"]["output_tokens"] > 0


def test_streamed_forced_tool_use_with_the_sdk(client):
    with client.messages.stream(**ask(tools=TOOLS, tool_choice={"type": "tool", "name": "get_time"},
                                      max_tokens=200, temperature=0.8)) as stream:
        final = stream.get_final_message()
    uses = [b for b in final.content if b.type == "tool_use"]
    assert final.stop_reason == "tool_use" and [u.name for u in uses] == ["get_time"]
    assert tc.validate(uses[0].input, TIME["input_schema"]) == []


@pytest.mark.parametrize("kw,needle", [
    (dict(tools=[{"name": "f", "input_schema": {"type": "objekt"}}]), "type must be one of"),
    (dict(tools=[{"name": "f"}]), "input_schema"),
    (dict(tools=TOOLS, tool_choice={"type": "tool", "name": "nope"}), "not among the tools"),
    (dict(messages=[{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_x", "content": "r"}]}]),
     "answers no tool_use"),
    (dict(messages=[{"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "f", "input": "x"}]}]),
     "input"),
    (dict(messages=[{"role": "user", "content": [{"type": "image", "source": {}}]}]),
     'messages.0.content.0: an image block needs "source"'),
    (dict(messages=[{"role": "user", "content": [{"type": "audio", "source": {}}]}]), "not supported"),
    (dict(max_tokens=None), "max_tokens"),
])
def test_bad_requests_answer_400_in_anthropic_shape(client, server, kw, needle):
    body = ask(**kw)
    if body.get("max_tokens") is None:
        body.update(body.pop("extra_body"))
        body.pop("max_tokens")
        r = httpx.post(f"{server.base_url}/messages", json=body, headers={"x-api-key": API_KEY}, timeout=30)
        assert r.status_code == 400 and r.json()["type"] == "error" and needle in r.json()["error"]["message"]
        return
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(**body)
    assert e.value.status_code == 400
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "invalid_request_error"
    assert needle in e.value.body["error"]["message"]


def test_api_key_is_required(server):
    c = anthropic.Anthropic(base_url=server.base_url.removesuffix("/v1"), api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError):
        c.messages.create(**ask())


# ---- cache-stable agents -----------------------------------------------------------------------------
AGENT_SYSTEM = ("You are a coding agent. You read files, run commands and edit code to finish the user's task. "
                "Prefer small, safe steps and explain each change briefly. ") * 3


def agent_transcript_prefill(base_url: str, turns: int = 20) -> tuple[int, int]:
    """(prefill tokens summed over the turns, prompt tokens summed): an agent loop whose system prompt
    starts with a billing-header line that changes every request, as Claude Code's does."""
    c = anthropic.Anthropic(base_url=base_url, api_key="unused", max_retries=0, timeout=120)
    messages = [{"role": "user", "content": "Fix the failing test in tests/test_parser.py."}]
    prefill = total = 0
    for turn in range(turns):
        header = f"x-anthropic-billing-header: cc_version=2.0.14; cc_entrypoint=cli; cch={uuid.uuid4().hex[:5]}"
        r = c.messages.create(model="claude-sonnet-4-5", max_tokens=3, extra_body={"temperature": 0},
                              system=[{"type": "text", "text": header}, {"type": "text", "text": AGENT_SYSTEM}],
                              messages=messages)
        prefill += r.usage.input_tokens
        total += r.usage.input_tokens + r.usage.cache_read_input_tokens
        reply = "".join(b.text for b in r.content if b.type == "text")
        messages += [{"role": "assistant", "content": reply or "ok"},
                     {"role": "user", "content": f"Step {turn + 1} done: ran the tests, 1 failing."}]
    c.close()
    return prefill, total


def test_cache_stable_agent_transcript(engine, capsys):
    stable = _serve(engine)                                   # the default: the billing line is dropped
    raw = _serve(engine, volatile_lines=())                   # every line kept
    try:
        kept_prefill, kept_total = agent_transcript_prefill(stable.base_url.removesuffix("/v1"))
        raw_prefill, raw_total = agent_transcript_prefill(raw.base_url.removesuffix("/v1"))
    finally:
        stable.stop()
        raw.stop()
    with capsys.disabled():
        print(f"\n20-turn agent transcript: prefill {raw_prefill} of {raw_total} prompt tokens with the "
              f"per-request header line, {kept_prefill} of {kept_total} with it dropped")
    assert raw_prefill > 0.9 * raw_total          # each turn read again almost from the start
    assert kept_prefill < raw_prefill / 4
