"""Constrained decoding (engine/generation/constraints.py): response_format json_object / json_schema through the
real server and the official `openai` client; the grammar's mask with speculation, parking and 8-bit
K/V. Random-weight tiny models are the hard case for the mask (nothing but the mask keeps them on
the schema); the real SmolLM2 model runs one short batch."""
from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from engine.generation.constraints import ConstraintError, ConstraintSpec
from engine.engine import Configure, Engine, EngineOptions, GenerateRequest, Status
from engine.frontends.server import ServerThread, create_app
from engine.sampling import SamplingParams
from engine_reads import tokenizer_of

# nested objects, arrays, enums, number bounds, additionalProperties: false
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "age": {"type": "integer", "minimum": 18, "maximum": 99},
        # a number's digits are unbounded in JSON: a random-weight model writes them on and on, so the
        # fraction is bounded here by multipleOf (a real model stops by itself: the SmolLM2 test)
        "score": {"type": "number", "minimum": -1.5, "maximum": 2.5, "multipleOf": 0.25},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b", "c"]},
                 "minItems": 1, "maxItems": 3},
        "address": {"type": "object",
                    "properties": {"zip": {"type": "integer", "minimum": 1000, "maximum": 9999},
                                   "city": {"type": "string", "maxLength": 8}},
                    "required": ["zip", "city"], "additionalProperties": False},
    },
    "required": ["name", "age", "score", "role", "tags", "address"],
    "additionalProperties": False,
}
FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
ASK = [{"role": "user", "content": "Describe a person as JSON."}]
MODEL = "default"        # the server takes "default" for whichever model it serves


@pytest.fixture(scope="module")
def engine(tiny_gguf_wide):
    eng = Engine(EngineOptions(model=str(tiny_gguf_wide))).start()
    assert eng.call(Status()).model == str(tiny_gguf_wide)
    yield eng
    eng.stop()


@pytest.fixture(scope="module")
def client(engine):
    srv = ServerThread(create_app(engine)).start()
    c = openai.OpenAI(base_url=srv.base_url, api_key="unused", max_retries=0, timeout=120)
    yield c
    c.close()
    srv.stop()


def _valid(text: str, schema: dict) -> dict:
    value = json.loads(text)
    jsonschema.validate(value, schema)
    return value


def test_json_schema_batch_validates_at_temperature_one(client):
    for seed in range(16):
        r = client.chat.completions.create(model=MODEL, messages=ASK, response_format=FORMAT, temperature=1.0,
                                           seed=seed, max_tokens=160)
        c = r.choices[0]
        assert c.finish_reason == "stop", (seed, c.message.content)
        _valid(c.message.content, PERSON)


def test_json_schema_streamed_and_greedy_equals_non_streamed(client):
    kw = dict(model=MODEL, messages=ASK, response_format=FORMAT, temperature=0, max_tokens=160)
    plain = client.chat.completions.create(**kw).choices[0].message.content
    streamed = "".join(ch.choices[0].delta.content or "" for ch in client.chat.completions.create(stream=True, **kw)
                       if ch.choices)
    assert streamed == plain
    _valid(plain, PERSON)


def test_json_object_always_parses(client):
    for seed in range(8):
        r = client.chat.completions.create(model=MODEL, messages=ASK, response_format={"type": "json_object"},
                                           temperature=1.0, seed=seed, max_tokens=120)
        c = r.choices[0]
        if c.finish_reason == "stop":
            assert isinstance(json.loads(c.message.content), dict), c.message.content
        else:                       # an object still open at the token limit: a prefix of one
            assert c.message.content.startswith("{")


@pytest.mark.parametrize("fmt", [
    {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "frob"}}},
    {"type": "json_schema", "json_schema": {"name": "x", "schema": {"properties": {"a": {"$ref": "#/nowhere"}}}}},
    {"type": "json_schema", "json_schema": {"name": "x", "schema": [1, 2]}},
    {"type": "json_schema", "json_schema": "nope"},
    {"type": "xml"},
    "json",
])
def test_bad_schemas_are_400_in_openai_shape(client, fmt):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=ASK, response_format=fmt, max_tokens=8)
    err = e.value.body
    assert err["param"].startswith("response_format") and err["message"] and err["type"] == "invalid_request_error"
    assert client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=2).choices   # still serving


def test_speculation_checks_drafts_against_the_grammar(client):
    kw = dict(model=MODEL, messages=ASK, response_format=FORMAT, max_tokens=160)
    plain = client.chat.completions.create(temperature=0, **kw).choices[0].message.content
    spec = client.chat.completions.create(temperature=0, extra_body={"speculative": "lookup"}, **kw)
    assert spec.choices[0].message.content == plain          # greedy: token for token
    for seed in range(4):
        r = client.chat.completions.create(temperature=1.0, seed=seed, extra_body={"speculative": "lookup"}, **kw)
        assert r.choices[0].finish_reason == "stop"
        _valid(r.choices[0].message.content, PERSON)


def test_parked_conversation_second_turn_is_cached(client):
    first = client.chat.completions.create(model=MODEL, messages=ASK, response_format=FORMAT, temperature=0,
                                           max_tokens=160).choices[0].message.content
    other = [{"role": "user", "content": "Something else entirely, please, and at length."}]
    client.chat.completions.create(model=MODEL, messages=other, response_format={"type": "json_object"},
                                   temperature=0, max_tokens=20)          # takes the engine: ASK is parked
    again = ASK + [{"role": "assistant", "content": first}, {"role": "user", "content": "Another one."}]
    r = client.chat.completions.create(model=MODEL, messages=again, response_format=FORMAT, temperature=0.8,
                                       seed=3, max_tokens=160)
    assert r.usage.prompt_tokens_details.cached_tokens > 0
    assert r.choices[0].finish_reason == "stop"
    _valid(r.choices[0].message.content, PERSON)


def test_kv_bits_8(engine):
    engine.call(Configure(kv_bits=8))
    try:
        for seed in range(4):
            r = engine.call(GenerateRequest(messages=ASK, sampling=SamplingParams(temperature=1.0, seed=seed,
                                                                                   max_tokens=160),
                                            constraint=ConstraintSpec.json_schema(PERSON)))
            assert r.finish_reason == "stop"
            _valid(r.text, PERSON)
    finally:
        engine.call(Configure(kv_bits=16))


def test_greedy_masked_equals_unmasked_where_the_reply_already_fits(engine, tiny_gguf_wide):
    sp = SamplingParams(temperature=0, max_tokens=24)
    free = engine.call(GenerateRequest(prompt="The tea", sampling=sp, side=True))
    tok = tokenizer_of(tiny_gguf_wide)
    # the longest start of the unmasked reply that is printable text (a random model also writes
    # stray bytes), and a grammar whose only sentence is that text: the mask never removes greedy's token
    n = next(k for k in range(len(free.tokens), 0, -1)
             if tok.decode(free.tokens[:k]).isprintable() and "\ufffd" not in tok.decode(free.tokens[:k]))
    assert n >= 3, free.text
    grammar = "start: " + json.dumps(tok.decode(free.tokens[:n]))
    masked = engine.call(GenerateRequest(prompt="The tea", sampling=sp, side=True,
                                         constraint=ConstraintSpec.lark(grammar)))
    assert masked.tokens[:n] == free.tokens[:n]
    assert masked.finish_reason == "stop" and masked.tokens[n] in tok.eos_ids


def test_tool_call_grammar_forces_a_valid_call(engine):
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                         "unit": {"enum": ["c", "f"]}}, "required": ["city", "unit"]}}},
             {"type": "function", "function": {"name": "add", "parameters": {
                 "type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 999}},
                 "required": ["a"]}}}]
    spec = ConstraintSpec.tool_call(tools, "get_weather", begin="<tool_call>\n", end="\n</tool_call>")
    for seed in range(4):
        r = engine.call(GenerateRequest(messages=ASK, sampling=SamplingParams(temperature=1.0, seed=seed,
                                                                               max_tokens=80), constraint=spec))
        assert r.finish_reason == "stop"
        assert r.text.startswith("<tool_call>\n") and r.text.endswith("\n</tool_call>")
        call = json.loads(r.text[len("<tool_call>\n"):-len("\n</tool_call>")])
        assert call["name"] == "get_weather"
        jsonschema.validate(call["arguments"], {**tools[0]["function"]["parameters"], "additionalProperties": False})
    with pytest.raises(ConstraintError):
        ConstraintSpec.tool_call(tools, "nope").check()


@pytest.mark.real_model
def test_real_model_schema_batch(real_model):
    schema = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]},
                                               "confidence": {"type": "integer", "minimum": 0, "maximum": 10}},
              "required": ["answer", "confidence"], "additionalProperties": False}
    eng = Engine(EngineOptions(model=str(real_model))).start()
    try:
        srv = ServerThread(create_app(eng)).start()
        c = openai.OpenAI(base_url=srv.base_url, api_key="unused", max_retries=0, timeout=120)
        msgs = [{"role": "user", "content": "Is the sky blue? Answer in JSON."}]
        for seed in range(2):       # ~15 tokens each; SmolLM2 reads ~5 tok/s on a 2-vCPU machine
            r = c.chat.completions.create(model=MODEL, messages=msgs, temperature=0.9, seed=seed, max_tokens=20,
                                          response_format={"type": "json_schema", "json_schema": {
                                              "name": "a", "schema": schema, "strict": True}})
            assert r.choices[0].finish_reason == "stop"
            _valid(r.choices[0].message.content, schema)
        c.close()
        srv.stop()
    finally:
        eng.stop()


def test_a_steered_request_keeps_to_the_schema(tiny_gguf_wide, tmp_path):
    """A control vector on the target (the speed projection, per request) and the grammar's mask together:
    steered and plain replies both validate, and the vector does change the steered one."""
    import numpy as np

    from engine.steer.control_vector import SteeringConfig, write_control_vector
    rng = np.random.default_rng(7)
    vec = tmp_path / "strong.gguf"
    write_control_vector(vec, {n: (rng.standard_normal(64) * 4.0).astype(np.float32) for n in (1, 2)},
                         model_hint="llama")
    eng = Engine(EngineOptions(model=str(tiny_gguf_wide), steering=SteeringConfig(files=((str(vec), 1.0),)))).start()
    try:
        assert eng.call(Status()).model == str(tiny_gguf_wide)
        texts = {}
        for steered in (False, True):
            r = eng.call(GenerateRequest(messages=ASK, sampling=SamplingParams(temperature=0.0, max_tokens=160),
                                         speed_projection=steered, constraint=ConstraintSpec.json_schema(PERSON)))
            assert r.finish_reason == "stop" and r.speed_projection is steered
            _valid(r.text, PERSON)
            texts[steered] = r.text
        assert texts[True] != texts[False]
    finally:
        eng.stop()
