"""Structured output over real HTTP on a tiny model: generated JSON schemas x sampled replies, every
reply that ends with finish_reason "stop" parses and validates (jsonschema); schemas llguidance cannot
take (too deep, numbers at the edge of range, vendor extensions that change the grammar) are 400s
naming response_format or the tool, never 500s."""
from __future__ import annotations

import json
import random

import httpx
import jsonschema
import pytest

N_SCHEMAS, SAMPLES = 24, 2


@pytest.fixture(scope="module")
def base_url(server_model):
    from engines import running

    from engine.frontends.server import ServerThread, create_app
    with running(server_model, cache_mib=16) as eng:
        srv = ServerThread(create_app(eng)).start()
        yield f"http://127.0.0.1:{srv.port}/v1"
        srv.stop()


# ---- generated schemas -----------------------------------------------------------------------------
def _leaf(rng: random.Random) -> dict:
    kind = rng.choice(["integer", "number", "string", "enum", "boolean", "null", "const"])
    if kind == "integer":
        lo = rng.randint(-50, 50)
        return {"type": "integer", "minimum": lo, "maximum": lo + rng.randint(0, 100)}
    if kind == "number":
        return {"type": "number", "exclusiveMinimum": -1.5, "maximum": 1e6}
    if kind == "string":
        return {"type": "string", "maxLength": rng.randint(1, 12), **({"minLength": 1} if rng.random() < 0.5 else {})}
    if kind == "enum":
        return {"enum": rng.sample(["red", "green", "blue", 1, 2.5, None, True], rng.randint(1, 4))}
    if kind == "const":
        return {"const": rng.choice(["ok", 7, False])}
    return {"type": kind}


def _schema(rng: random.Random, depth: int = 0) -> dict:
    r = rng.random()
    if depth >= 3 or r < 0.35:
        return _leaf(rng)
    if r < 0.5:
        return {"type": "array", "items": _schema(rng, depth + 1), "maxItems": rng.randint(1, 3),
                **({"minItems": 1} if rng.random() < 0.5 else {})}
    if r < 0.6:
        return {"anyOf": [_schema(rng, depth + 1), _schema(rng, depth + 1)]}
    names = rng.sample(["a", "b", "name", "count", "tags", "ok", "x_y"], rng.randint(1, 3))
    props = {n: _schema(rng, depth + 1) for n in names}
    return {"type": "object", "properties": props, "required": rng.sample(names, rng.randint(0, len(names)))}


def _object_schema(rng: random.Random) -> dict:
    s = _schema(rng, 1)
    names = ["value"] + (["extra"] if rng.random() < 0.5 else [])
    return {"type": "object", "properties": {n: s if n == "value" else _leaf(rng) for n in names},
            "required": ["value"]}


def test_generated_schemas_stopped_replies_parse_and_validate(base_url):
    rng = random.Random(50)
    stopped = cut = 0
    with httpx.Client(timeout=300) as client:
        for i in range(N_SCHEMAS):
            schema = _object_schema(rng)
            for seed in range(SAMPLES):
                r = client.post(base_url + "/chat/completions", json={
                    "messages": [{"role": "user", "content": f"Reply in JSON ({i})."}], "max_tokens": 64,
                    "temperature": 1.0, "seed": seed,
                    "response_format": {"type": "json_schema", "json_schema": {"name": "r", "schema": schema}}})
                assert r.status_code == 200, (schema, r.text)
                choice = r.json()["choices"][0]
                if choice["finish_reason"] != "stop":
                    cut += 1
                    continue
                stopped += 1
                value = json.loads(choice["message"]["content"])
                jsonschema.validate(value, schema)
    print(f"\n{N_SCHEMAS} schemas x {SAMPLES} samples: {stopped} stopped (parsed and validated), {cut} cut by max_tokens")
    assert stopped >= N_SCHEMAS // 2


def _nested(n: int) -> dict:
    s: dict = {"type": "string"}
    for _ in range(n):
        s = {"type": "object", "properties": {"a": s}, "required": ["a"]}
    return s


HOSTILE_SCHEMAS = {
    "x-guidance": {"type": "object", "x-guidance": {"whitespace_flexible": True, "whitespace_pattern": "(a+)+"}},
    "x-guidance nested": {"type": "object", "properties": {"a": {"type": "string", "x-guidance": {}}}},
    "x-vendor": {"type": "object", "x-order": ["a"]},
    "31 nested objects": _nested(31),
    "minimum 1e308": {"type": "object", "properties": {"n": {"type": "number", "minimum": 1e308}},
                      "required": ["n"]},
    "max < min": {"type": "object", "properties": {"n": {"type": "integer", "minimum": 5, "maximum": 1}},
                  "required": ["n"]},
    "multipleOf tiny": {"type": "object", "properties": {"n": {"type": "number", "multipleOf": 1e-300}}},
    "integer 1e60": {"type": "object", "properties": {"n": {"type": "integer", "minimum": 10**60}}},
    "pattern (a+)+": {"type": "object", "properties": {"s": {"type": "string", "pattern": "^(a+)+$"}},
                      "required": ["s"]},
    "bad pattern": {"type": "object", "properties": {"s": {"type": "string", "pattern": "(("}}},
    "unknown format": {"type": "object", "properties": {"s": {"type": "string", "format": "no-such-format"}}},
    "ref loop": {"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"},
    "ref nowhere": {"$ref": "#/$defs/none"},
    "ref a = b = a": {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"anyOf": [{"$ref": "#/$defs/a"}]}},
                      "$ref": "#/$defs/a"},
    "required self": {"type": "object", "properties": {"n": {"$ref": "#"}}, "required": ["n"]},
    "optional self": {"type": "object", "properties": {"n": {"$ref": "#"}}},
}


@pytest.mark.parametrize("name", list(HOSTILE_SCHEMAS))
def test_hostile_schemas_are_400s_naming_the_field(base_url, name):
    schema = HOSTILE_SCHEMAS[name]
    body = {"messages": [{"role": "user", "content": "JSON"}], "max_tokens": 16,
            "response_format": {"type": "json_schema", "json_schema": {"name": "r", "schema": schema}}}
    tool = {"messages": [{"role": "user", "content": "call"}], "max_tokens": 16,
            "tools": [{"type": "function", "function": {"name": "f", "parameters": {
                "type": "object", "properties": {"p": schema}}}}],
            "tool_choice": {"type": "function", "function": {"name": "f"}}}
    with httpx.Client(timeout=300) as client:
        for request, field in ((body, "response_format"), (tool, "tool")):
            r = client.post(base_url + "/chat/completions", json=request)
            assert r.status_code in (200, 400), (name, field, r.status_code, r.text[:300])
            if r.status_code == 400:
                err = r.json()["error"]
                assert field in f"{err['param']} {err['message']}", err
                assert "\n" not in err["message"]
            elif r.json()["choices"][0]["finish_reason"] == "stop" and field == "response_format":
                jsonschema.validate(json.loads(r.json()["choices"][0]["message"]["content"]), schema)
            if name.startswith("x-"):
                assert r.status_code == 400 and "x-" in r.json()["error"]["message"], r.text


ENGINE_SCHEMAS = {
    "64 nested objects": _nested(64),
    "minimum 10**400": {"type": "object", "properties": {"n": {"type": "integer", "minimum": 10**400}}},
    "enum lone surrogate": {"type": "object", "properties": {"s": {"enum": ["\ud800"]}}, "required": ["s"]},
    "x-guidance": HOSTILE_SCHEMAS["x-guidance"],
}


@pytest.mark.parametrize("name", list(ENGINE_SCHEMAS))
def test_schemas_past_the_server_are_constraint_errors(name):
    # What the HTTP body check refuses first (depth, digits, surrogates) can still reach the grammar from
    # the app or the CLI: llguidance's own failure is a ConstraintError naming the field, never raw.
    from engine.generation.constraints import ConstraintError, ConstraintSpec
    schema = ENGINE_SCHEMAS[name]
    for spec in (ConstraintSpec.json_schema(schema),
                 ConstraintSpec.tool_call([{"type": "function", "function": {
                     "name": "f", "parameters": {"type": "object", "properties": {"p": schema}}}}])):
        try:
            spec.check()
        except ConstraintError as e:
            assert e.param in ("response_format", "tools", "tool_choice") or e.param.startswith("tools["), e.param
            assert "\n" not in str(e)
