"""Every field of every endpoint of both APIs, with each class of hostile value: a lone surrogate, a
100,000-digit number, 10,000 nested arrays, a value of the wrong type, a NUL inside text and a 1 MiB
string (and each object key renamed to hold a surrogate). Each request must be answered 200 or 400 (404
where a name is looked up) in the API's error shape, never 500, with nothing in the server's log that
has a traceback; the first three classes are always 400s naming the field.

One tiny model served for the module; most cases are refused while the body is parsed, the rest
generate 2 tokens. The tally per endpoint is printed (README's Reliability section quotes it).
"""
from __future__ import annotations

import copy
import json
import logging

import httpx
import pytest
from log_records import LogRecords

SURROGATE, BIGNUM, DEEP, WRONG, NUL, HUGE = "surrogate", "bignum", "deep", "wrong type", "nul", "1 MiB"
CLASSES = (SURROGATE, BIGNUM, DEEP, WRONG, NUL, HUGE)
ALWAYS_REFUSED = (SURROGATE, BIGNUM, DEEP)
_BIG_MARK, _DEEP_MARK = "@@BIGNUM@@", "@@DEEP@@"

TOOL_SCHEMA = {"type": "object", "properties": {"q": {"type": "string", "enum": ["x", "y"]},
                                                "n": {"type": "integer", "minimum": 0, "maximum": 9}},
               "required": ["q"]}
CHAT = {
    "model": "default",
    "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Hi"}]},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "lookup", "arguments": "{\"q\": \"x\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "42"},
    ],
    "tools": [{"type": "function", "function": {"name": "lookup", "description": "Look it up",
                                                "parameters": TOOL_SCHEMA}}],
    "tool_choice": {"type": "function", "function": {"name": "lookup"}},
    "parallel_tool_calls": False, "max_tokens": 2, "temperature": 0, "top_p": 1.0, "top_k": 40, "min_p": 0.0,
    "repetition_penalty": 1.0, "seed": 1, "stop": ["\n\n"], "n": 1, "stream": False,
    "stream_options": {"include_usage": False}, "speculative": "off", "experimental_speed_projection": False,
    "logprobs": False,
}
CHAT_SCHEMA = {
    "messages": [{"role": "developer", "content": "JSON only."}, {"role": "user", "content": "Hi"}],
    "max_completion_tokens": 2,
    "response_format": {"type": "json_schema", "json_schema": {
        "name": "reply", "strict": True, "schema": {
            "type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9},
                                             "b": {"type": "array", "items": {"type": "string"}, "maxItems": 2}},
            "required": ["a"]}}},
}
COMPLETION = {"model": "default", "prompt": "Once upon", "max_tokens": 2, "temperature": 0, "top_p": 1.0,
              "seed": 1, "stop": "\n", "stream": False, "echo": False, "speculative": "off"}
MESSAGES = {
    "model": "claude-sonnet-4-5", "max_tokens": 2,
    "system": [{"type": "text", "text": "Be brief."}],
    "messages": [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": [{"type": "text", "text": "ok"},
                                          {"type": "tool_use", "id": "toolu_1", "name": "lookup", "input": {"q": "x"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                      "content": [{"type": "text", "text": "42"}], "is_error": False}]},
    ],
    "tools": [{"name": "lookup", "description": "Look it up", "input_schema": TOOL_SCHEMA}],
    "tool_choice": {"type": "tool", "name": "lookup", "disable_parallel_tool_use": True},
    "temperature": 0, "top_p": 1.0, "top_k": 40, "stop_sequences": ["\n\n"], "stream": False,
    "thinking": {"type": "disabled"},
}
COUNT = {k: v for k, v in MESSAGES.items() if k in ("model", "system", "messages", "tools", "tool_choice")}
SAVE = {"name": "fuzzed", "messages": [{"role": "user", "content": "Hi"}], "force": True}
RESTORE = {"name": "fuzzed"}

ENDPOINTS = [("/v1/chat/completions", CHAT), ("/v1/chat/completions", CHAT_SCHEMA),
             ("/v1/completions", COMPLETION), ("/v1/messages", MESSAGES), ("/v1/messages/count_tokens", COUNT),
             ("/v1/sessions/save", SAVE), ("/v1/sessions/restore", RESTORE)]


# ---- the cases --------------------------------------------------------------------------------------
def paths(value, prefix=()):
    """Every path into `value` (leaves and containers), the root excluded."""
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for k, v in items:
        yield prefix + (k,)
        yield from paths(v, prefix + (k,))


def _wrong(value):
    """A value of another type than `value`."""
    if isinstance(value, bool):
        return "yes"
    if isinstance(value, (int, float)):
        return "7"
    if isinstance(value, str):
        return {"text": value}
    if isinstance(value, list):
        return {"0": value[0] if value else 1}
    return [value]


def _hostile(cls: str, old):
    return {SURROGATE: "a\ud800b", BIGNUM: _BIG_MARK, DEEP: _DEEP_MARK, WRONG: _wrong(old),
            NUL: "a\x00b", HUGE: "a" * (1 << 20)}[cls]


def _set(body: dict, path: tuple, value) -> dict:
    out = copy.deepcopy(body)
    node = out
    for k in path[:-1]:
        node = node[k]
    node[path[-1]] = value
    return out


def _rename_key(body: dict, path: tuple) -> dict:
    out = copy.deepcopy(body)
    node = out
    for k in path[:-1]:
        node = node[k]
    node[f"{path[-1]}\ud800"] = node.pop(path[-1])
    return out


def encode(body: dict) -> bytes:
    raw = json.dumps(body, ensure_ascii=True)
    raw = raw.replace(f'"{_BIG_MARK}"', "9" * 100_000).replace(f'"{_DEEP_MARK}"', "[" * 10_000 + "]" * 10_000)
    return raw.encode()


def cases(body: dict):
    """(label, class, the field's name, raw body) for every path x class, and every key renamed."""
    for path in paths(body):
        node = body
        for k in path:
            node = node[k]
        name = next((str(k) for k in reversed(path) if isinstance(k, str)), str(path[0]))
        label = ".".join(map(str, path))
        for cls in CLASSES:
            yield label, cls, name, encode(_set(body, path, _hostile(cls, node)))
        if isinstance(path[-1], str):
            yield label + " (key)", SURROGATE, name, encode(_rename_key(body, path))


# ---- the server -------------------------------------------------------------------------------------
_LOGGERS = ("uvicorn", "asyncio", "starlette", "strata")     # their children propagate to them


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from gguf_factory import write_tiny_gguf

    from engine.engine import Engine, EngineOptions
    from engine.frontends.server import ServerThread, create_app
    path = write_tiny_gguf(tmp_path_factory.mktemp("fields-fuzz") / "tiny-fields.gguf", arch="llama",
                           n_layer=2, n_embd=64, seed=5, context_length=4096)
    eng = Engine(EngineOptions(model=str(path), context_length=2048, cache_mib=16)).start()
    srv = ServerThread(create_app(eng)).start()
    records = LogRecords()
    for name in _LOGGERS:                 # after uvicorn's logging set-up, which replaces handlers
        logging.getLogger(name).addHandler(records)
    yield srv, records
    for name in _LOGGERS:
        logging.getLogger(name).removeHandler(records)
    srv.stop()
    eng.stop()


def _problem(r: httpx.Response, cls: str, name: str, path: str) -> str | None:
    allowed = {400} if cls in ALWAYS_REFUSED else {200, 400, 404}
    if r.status_code not in allowed:
        return f"status {r.status_code}: {r.text[:300]}"
    try:
        body = r.json()
    except ValueError:
        return f"not JSON: {r.text[:200]}"
    if r.status_code == 200:
        return None
    error = body.get("error") if isinstance(body, dict) else None
    message = error.get("message") if isinstance(error, dict) else None
    if not isinstance(message, str) or "\n" in message or "internal error" in message:
        return f"bad error {body!r:.300}"
    if r.status_code == 404 and error.get("code") not in ("model_not_found", "session_not_found") \
            and "not_found" not in str(error.get("type")):
        return f"a 404 that is not a name looked up: {body!r:.300}"
    if cls in ALWAYS_REFUSED and name not in f"{error.get('param')} {message}":
        return f"the 400 does not name {name!r}: {body!r:.300}"
    return None


@pytest.mark.parametrize("endpoint,base", ENDPOINTS, ids=[f"{p}#{i}" for i, (p, _) in enumerate(ENDPOINTS)])
def test_every_field_with_hostile_values(served, endpoint, base):
    srv, records = served
    url = f"http://127.0.0.1:{srv.port}{endpoint}"
    before = len(records.records)
    failures, tally = [], {"200": 0, "400": 0, "404": 0}
    with httpx.Client(timeout=120) as client:
        if endpoint.endswith("/restore"):            # the session the restores name (STRATA_HOME is per test)
            saved = client.post(f"http://127.0.0.1:{srv.port}/v1/sessions/save", json=SAVE)
            assert saved.status_code == 200, saved.text
        ok = client.post(url, content=encode(base), headers={"Content-Type": "application/json"})
        assert ok.status_code == 200, ok.text          # the base request itself is served
        for label, cls, name, raw in cases(base):
            r = client.post(url, content=raw, headers={"Content-Type": "application/json"})
            tally[str(r.status_code)] = tally.get(str(r.status_code), 0) + 1
            problem = _problem(r, cls, name, label)
            if problem:
                failures.append(f"{label} x {cls}: {problem}")
        again = client.post(url, content=encode(base), headers={"Content-Type": "application/json"})
        assert again.status_code == 200, again.text
    logged = records.tracebacks(before)
    print(f"\n{endpoint}: {sum(tally.values())} requests: {tally}")
    assert not failures, f"{len(failures)} failures:\n" + "\n".join(failures[:40])
    assert not logged, "\n".join(logged[:20])


GET_IDS = ["default", "a%ED%A0%80b", "a%00b", "%FF%FE", "x" * 4000, "..%2F..%2Fetc%2Fpasswd", "%F0%9F%98%80"]


def test_models_and_health_with_hostile_names(served):
    srv, records = served
    base = f"http://127.0.0.1:{srv.port}"
    with httpx.Client(timeout=60) as client:
        assert client.get(base + "/v1/models").status_code == 200
        assert client.get(base + "/health").status_code == 200
        for name in GET_IDS:
            r = client.get(f"{base}/v1/models/{name}")
            assert r.status_code in (200, 404), (name, r.status_code, r.text[:200])
            assert isinstance(r.json(), dict)
    logged = records.tracebacks()
    assert not logged, "\n".join(logged[:20])
