"""engine/api.py's contract on a tiny GGUF: typed results, error codes, the named requests, the
start-up load's handle, and the front ends' package without an import circle."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from engine.api import (CountTokens, EngineStatus, Generation, GenerateRequest, ModelFacts, SessionSteering,
                        Status, TokenCount)
from engine.engine import Engine, EngineOptions
from engine.errors import EngineError, ErrorCode
from engine.events import Failed
from engine.sampling import SamplingParams

REPO = Path(__file__).resolve().parents[2]
CHAT = [{"role": "user", "content": "Tell me a short story about a cat."}]


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from gguf_factory import write_tiny_gguf
    path = write_tiny_gguf(tmp_path_factory.mktemp("m") / "tiny.gguf", arch="llama")
    eng = Engine(EngineOptions(model=str(path), cache_mib=64)).start()
    loaded = eng.startup.result(timeout=300)
    assert loaded.model == str(path) and loaded.steering_error is None
    yield eng
    eng.stop()


def test_results_are_typed_and_read_by_field(engine):
    r = engine.call(GenerateRequest(messages=CHAT, sampling=SamplingParams(max_tokens=5, seed=1)))
    assert isinstance(r, Generation)
    assert r.generated_tokens == len(r.tokens) == 5 and r.finish_reason in ("length", "stop")
    with pytest.raises(TypeError):
        r["text"]                                                      # a key read fails loudly
    assert not hasattr(r, "get") and r.to_dict()["text"] == r.text
    st = engine.call(Status())
    assert isinstance(st, EngineStatus) and isinstance(st.facts, ModelFacts)
    assert st.facts.n_ctx == st.context_length and st.facts.model_path == st.model
    assert st.live_messages[:1] == CHAT and st.live_tokens > 0
    assert st.conversations[0] == {"owner": "", "tokens": st.live_tokens, "live": True}
    assert engine.model_facts() == st.facts


def test_count_tokens_matches_the_prompt(engine):
    n = engine.call(CountTokens(messages=CHAT))
    r = engine.call(GenerateRequest(messages=CHAT, sampling=SamplingParams(max_tokens=1)))
    assert isinstance(n, TokenCount) and n.tokens == r.prompt_tokens


def test_content_of_text_parts_reads_as_its_joined_text(engine):
    """A message whose content is a list of text parts (the shape images come in) is its text joined, as
    the servers join it (a template that does not iterate over parts renders the list otherwise)."""
    parts = [{"role": "user", "content": [{"type": "text", "text": "Tell me a short "},
                                          {"type": "text", "text": "story about a cat."}]}]
    assert engine.call(CountTokens(messages=parts)).ids == engine.call(CountTokens(messages=CHAT)).ids
    sp = SamplingParams(temperature=0.0, max_tokens=6)
    a = engine.call(GenerateRequest(messages=parts, conversation="parts", sampling=sp))
    b = engine.call(GenerateRequest(messages=CHAT, conversation="plain", sampling=sp))
    assert (a.prompt_tokens, a.tokens) == (b.prompt_tokens, b.tokens)


def test_errors_carry_a_code(engine, tmp_path):
    with pytest.raises(EngineError) as e:
        engine.call(GenerateRequest(messages=[{"role": "user", "content": "x" * 10_000_000}]))
    assert e.value.code == ErrorCode.BAD_REQUEST and e.value.reason == "context_length"
    h = engine.submit(SessionSteering(str(tmp_path / "missing.stratasession")))
    assert h.finished.wait(60)
    assert isinstance(h.outcome, Failed) and h.outcome.code == ErrorCode.SESSION_REFUSED
    with pytest.raises(EngineError) as e:
        engine.call(GenerateRequest(prompt="hi", speculative="bogus"))
    assert e.value.code == ErrorCode.BAD_REQUEST


def test_no_model_and_a_failed_start_up_load(tmp_path):
    eng = Engine(EngineOptions(model=str(tmp_path / "missing.gguf"), cache_mib=0)).start()
    try:
        with pytest.raises(EngineError) as e:
            eng.startup.result(timeout=60)             # the start-up load's own error, no second load
        assert e.value.code == ErrorCode.BAD_REQUEST and "missing.gguf" in str(e.value)
        with pytest.raises(EngineError) as e:
            eng.call(CountTokens(messages=CHAT), timeout=60)
        assert e.value.code == ErrorCode.MODEL_NOT_LOADED
        assert eng.model_facts() is None
    finally:
        eng.stop()


def test_server_maps_every_code_to_a_status():
    from engine.frontends.server import HTTP_OF_ERROR, engine_error
    assert set(HTTP_OF_ERROR) == set(ErrorCode)
    assert engine_error(Failed("the prompt is 9 tokens; the context holds 8", ErrorCode.BAD_REQUEST,
                               "context_length")).code == "context_length_exceeded"
    assert engine_error(Failed("no model is loaded", ErrorCode.MODEL_NOT_LOADED)).status == 503
    assert engine_error(Failed("cancelled", ErrorCode.CANCELLED)).status == 499


def test_the_core_imports_no_front_end():
    """engine/*.py (the core) never imports engine.frontends; the front ends import launch, not each other's
    start-up (no import circle)."""
    for p in (REPO / "engine").glob("*.py"):
        if p.name == "cli.py":                          # the `python -m engine.cli` shim
            continue
        text = p.read_text()
        assert "frontends" not in text.replace("engine/frontends/", ""), p.name
    code = ("import sys, engine.frontends.server, engine.frontends.replay, engine.frontends.cvec_train;"
            "assert 'engine.frontends.cli' not in sys.modules, 'a front end imported the CLI'")
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True)
