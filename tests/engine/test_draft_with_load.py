"""A draft model loads with its target as one unit (issue 28 item 4, mlx-lm's ModelProvider pattern):
a LoadModel that names a draft builds the LoadedModel with it; a request naming that draft uses it with
nothing loaded inside the request, and it stays as long as the model does (no idle release); a draft
that cannot load refuses the whole load, the old model serving on; a request naming another draft still
loads that one then (engine/drafts.py says why), and the next load drops the draft.
Real engine, tiny GGUFs from tests/gguf_factory.py; greedy drafts must give plain decoding's tokens."""
from __future__ import annotations

import pytest

from engine.generation import speculative
from engine.engine import Engine, EngineOptions, GenerateRequest, LoadModel, Status
from engine.errors import EngineError
from engine.events import Log
from engine.sampling import SamplingParams
from gguf_factory import TRAINING_TEXT

MSGS = [{"role": "user", "content": " ".join(TRAINING_TEXT.split()[5:35])}]


@pytest.fixture(autouse=True)
def no_verdicts(monkeypatch):
    """Drafting on a tiny model never pays: the rules that would stop it early are not under test."""
    monkeypatch.setattr(speculative, "REMEMBER", False)
    monkeypatch.setattr(speculative, "CATCH_UP_RULE", False)


def run(engine, spec: str):
    """(the Generation, the log lines the request emitted)"""
    h = engine.submit(GenerateRequest(messages=list(MSGS), speculative=spec,
                                      sampling=SamplingParams(max_tokens=32, temperature=0.0)))
    lines = [ev.line for ev in h.events() if isinstance(ev, Log)]
    return h.result(300), lines


def test_a_draft_named_at_load_is_used_by_requests_and_held_with_the_model(tiny_gguf, tiny_gguf_other,
                                                                             monkeypatch):
    # inline: this thread is the engine thread, so the test reads what the engine holds
    eng = Engine(EngineOptions(model=str(tiny_gguf), draft=str(tiny_gguf_other), cache_mib=0)).inline()
    try:
        loaded = eng.startup.result(120)
        assert loaded.draft == str(tiny_gguf_other)
        held = eng.loaded.draft
        assert held is not None and held.path == tiny_gguf_other
        plain, _ = run(eng, "off")
        spec, lines = run(eng, f"draft:{tiny_gguf_other}")
        assert spec.tokens == plain.tokens and spec.drafted_tokens > 0
        assert not [s for s in lines if s.startswith("draft model:")], lines   # nothing loaded in the request
        eng.idle_work(timed=True)         # idle past DRAFT_IDLE_S: the load's draft is not a request's to release
        assert (eng.loaded.draft is held, eng.drafts.named) == (True, None)

        # Another draft than the load's: loaded for that request (and released when idle), same tokens.
        other, lines = run(eng, f"draft:{tiny_gguf}")
        assert other.tokens == plain.tokens and other.drafted_tokens > 0
        assert [s for s in lines if s.startswith("draft model:")], lines
        assert eng.loaded.draft is held and eng.drafts.named is not None
        eng.idle_work(timed=True)         # idle past DRAFT_IDLE_S: the request's own draft is released
        assert eng.loaded.draft is held and eng.drafts.named is None

        # A load without a draft drops it with the old model.
        eng.call(LoadModel(str(tiny_gguf)), timeout=120)
        assert (eng.loaded.draft, eng.drafts.named) == (None, None)
    finally:
        eng.stop()


def test_a_draft_that_cannot_load_refuses_the_load_and_the_old_model_serves_on(tiny_gguf, tiny_gguf_other,
                                                                                 tmp_path):
    eng = Engine(EngineOptions(model=str(tiny_gguf), cache_mib=0)).start()
    try:
        eng.startup.result(120)
        plain, _ = run(eng, "off")
        missing = tmp_path / "no-such-draft.gguf"
        with pytest.raises(EngineError, match="no-such-draft.gguf") as e:
            eng.call(LoadModel(str(tiny_gguf_other), draft=str(missing)), timeout=120)
        assert "\n" not in str(e.value)
        assert eng.call(Status()).model == str(tiny_gguf)
        again, _ = run(eng, "off")
        assert again.tokens == plain.tokens
    finally:
        eng.stop()
