"""The engine on tiny generated GGUFs: generation, streaming, stops, cancellation, cache reuse."""
from __future__ import annotations

import threading

import pytest

from engine.engine import Engine, EngineOptions, GenerateRequest, LoadModel, Status
from engine.errors import StrataError
from engine.events import Done, Log, Progress, Token
from engine.sampling import SamplingParams
from engine_reads import while_held

CHAT = [{"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Tell me a short story about a cat who learns to fly."}]


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from gguf_factory import write_tiny_gguf
    path = write_tiny_gguf(tmp_path_factory.mktemp("m") / "tiny.gguf", arch="llama")
    eng = Engine(EngineOptions(model=str(path), cache_mib=64)).start()
    assert eng.call(Status()).model == str(path)
    yield eng
    eng.stop()


def sample(n=16, **kw):
    return SamplingParams(max_tokens=n, **{"temperature": 0.8, "seed": 7, **kw})


def test_streamed_tokens_make_the_reply(engine):
    h = engine.submit(GenerateRequest(messages=CHAT, sampling=sample(24)))
    events = list(h.events())
    done = events[-1]
    assert isinstance(done, Done)
    streamed = "".join(e.text for e in events if isinstance(e, Token))
    assert streamed == done.result.text
    r = done.result
    assert r.generated_tokens == len(r.tokens) == 24
    assert r.prompt_tokens > 20 and r.ttft_ms > 0 and r.decode_tps > 0


def test_seed_makes_sampling_repeatable_and_greedy_is_deterministic(engine):
    a = engine.call(GenerateRequest(messages=CHAT, sampling=sample(12, seed=1)))
    b = engine.call(GenerateRequest(messages=CHAT, sampling=sample(12, seed=1)))
    c = engine.call(GenerateRequest(messages=CHAT, sampling=sample(12, seed=2)))
    assert a.tokens == b.tokens
    assert a.tokens != c.tokens
    g1 = engine.call(GenerateRequest(prompt="Once upon a time", sampling=SamplingParams(max_tokens=8)))
    g2 = engine.call(GenerateRequest(prompt="Once upon a time", sampling=SamplingParams(max_tokens=8)))
    assert g1.tokens == g2.tokens


def test_follow_up_turn_reuses_the_whole_history(engine):
    first = engine.call(GenerateRequest(messages=CHAT, sampling=sample(10)))
    history = CHAT + [{"role": "assistant", "content": first.text}, {"role": "user", "content": "More."}]
    second = engine.call(GenerateRequest(messages=history, sampling=sample(10)))
    # Everything the engine fed stays: the prompt and every generated token but the last one
    # (max_tokens ended the reply before it was fed).
    assert second.cached_tokens == first.prompt_tokens + first.generated_tokens - 1
    assert second.prompt_tokens > second.cached_tokens


def test_identical_prompt_re_evaluates_only_the_last_token(engine):
    engine.call(GenerateRequest(prompt="The river flows past the old mill", sampling=SamplingParams(max_tokens=2)))
    r = engine.call(GenerateRequest(prompt="The river flows past the old mill", sampling=SamplingParams(max_tokens=2)))
    assert r.cached_tokens == r.prompt_tokens - 1


def test_stop_string_ends_the_reply_and_is_not_emitted(engine):
    free = engine.call(GenerateRequest(messages=CHAT, sampling=sample(30)))
    text = free.text
    assert len(text) > 6, "the tiny model should produce some text"
    stop = text[3:6]
    r = engine.call(GenerateRequest(messages=CHAT, sampling=sample(30, stop=[stop])))
    assert r.finish_reason == "stop"
    assert stop not in r.text
    assert r.text == text[:text.index(stop)]


def test_cancel_between_tokens(engine):
    seen = threading.Event()

    def on_event(ev):
        if isinstance(ev, Token):
            seen.set()
    h = engine.submit(GenerateRequest(messages=CHAT, sampling=sample(2000)), callback=on_event)
    assert seen.wait(30)
    h.cancel()
    r = h.result(30)
    assert r.finish_reason == "cancelled"
    assert r.generated_tokens < 2000
    # The engine keeps serving.
    assert engine.call(GenerateRequest(messages=CHAT, sampling=sample(3))).generated_tokens == 3


def test_prefill_reports_progress_for_long_prompts(engine):
    long_prompt = " ".join(["alpha beta gamma delta"] * 80)   # ~1,200 tokens of the tiny vocab
    h = engine.submit(GenerateRequest(prompt=long_prompt, sampling=SamplingParams(max_tokens=1)))
    progress = [e for e in h.events() if isinstance(e, Progress) and e.stage == "prefill"]
    assert progress and progress[-1].done == progress[-1].total > 512


def test_prompt_longer_than_context_is_refused_and_engine_keeps_serving(engine):
    huge = "word " * 5000
    with pytest.raises(StrataError, match="context holds"):
        engine.call(GenerateRequest(prompt=huge, sampling=SamplingParams(max_tokens=1)))
    assert engine.call(GenerateRequest(messages=CHAT, sampling=sample(2))).generated_tokens == 2


@pytest.mark.parametrize("bad, message", [
    (dict(temperature=-1), "temperature"), (dict(top_p=0), "top_p"), (dict(max_tokens=0), "max_tokens"),
])
def test_bad_sampling_parameters_are_refused(engine, bad, message):
    with pytest.raises(StrataError, match=message):
        engine.call(GenerateRequest(messages=CHAT, sampling=SamplingParams(**bad)))


def test_failed_load_keeps_the_current_model(engine, tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\x00" * 10)
    h = engine.submit(LoadModel(str(bad)))
    with pytest.raises(StrataError, match="truncated or corrupt"):
        h.result(30)
    assert engine.call(GenerateRequest(messages=CHAT, sampling=sample(2))).generated_tokens == 2


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_other_architectures_generate(tmp_path, arch):
    from gguf_factory import write_tiny_gguf
    path = write_tiny_gguf(tmp_path / f"{arch}.gguf", arch=arch)
    eng = Engine(EngineOptions(model=str(path))).start()
    try:
        h = eng.submit(GenerateRequest(messages=CHAT, sampling=sample(5)))
        logs = [e.line for e in h.events() if isinstance(e, Log)]
        assert h.result().generated_tokens == 5
        info = eng.call(Status()).info
        assert info["architecture"] == arch
    finally:
        eng.stop()
    assert logs  # the request's own log line


def test_save_session_picks_the_named_conversation_even_when_parked(engine, tmp_path):
    from engine.engine import RestoreSession, SaveSession
    a_msgs = [{"role": "system", "content": "Conversation A about boats and the sea."},
              {"role": "user", "content": "Tell me about sailing."}]
    a = engine.call(GenerateRequest(messages=a_msgs, sampling=sample(6), conversation="A"))
    a_msgs = a_msgs + [{"role": "assistant", "content": a.text}]
    b = engine.call(GenerateRequest(messages=[{"role": "user", "content": "Title please"}], sampling=sample(4)))
    assert b.generated_tokens == 4     # B holds the engine now; A is parked
    saved = engine.call(SaveSession(str(tmp_path / "a.stratasession"), messages=a_msgs))
    assert saved.tokens == a.prompt_tokens + a.generated_tokens - 1
    restored = engine.call(RestoreSession(str(tmp_path / "a.stratasession")))
    assert restored.messages == a_msgs
    # A conversation whose K/V is not held (e.g. from before a restart) is read again, then saved.
    other = [{"role": "user", "content": "A question from yesterday?"}, {"role": "assistant", "content": "Yes."}]
    h = engine.submit(SaveSession(str(tmp_path / "x.stratasession"), messages=other))
    events = list(h.events())
    again = h.result()
    assert again.reread is True and again.tokens > 5
    assert any(isinstance(e, Progress) and e.stage == "prefill" for e in events)
    assert engine.call(RestoreSession(str(tmp_path / "x.stratasession"))).messages == other
    follow = engine.call(GenerateRequest(messages=other + [{"role": "user", "content": "More?"}], sampling=sample(2)))
    assert follow.cached_tokens == again.tokens
    with pytest.raises(StrataError, match="no conversation to save"):
        engine.call(SaveSession(str(tmp_path / "y.stratasession"), messages=[{"role": "system", "content": "?"}]))


def test_prefill_reports_progress_at_once_then_in_growing_chunks_and_cancels_between_them(engine):
    from engine.events import Failed
    from engine.generation.generate import chunk_sizes
    assert chunk_sizes(100, 512) == [16, 16, 32, 36]
    assert chunk_sizes(2000, 512)[:8] == [16, 16, 32, 64, 128, 256, 512, 512]
    assert sum(chunk_sizes(2000, 512)) == 2000 and chunk_sizes(40, 8) == [8] * 5
    assert chunk_sizes(1100, 512, first=512) == [512, 512, 76]   # the GPU schedule
    long_chat = [{"role": "user", "content": " ".join(f"river{i} flows" for i in range(80))}]
    h = engine.submit(GenerateRequest(messages=long_chat, sampling=sample(2)))
    steps = [(e.done, e.total) for e in h.events() if isinstance(e, Progress) and e.stage == "prefill"]
    r = h.result()
    total = r.prompt_tokens - r.cached_tokens - 1
    assert steps[0] == (0, total) and steps[1] == (16, total) and steps[2] == (32, total)
    assert steps[-1] == (total, total)
    # Cancel from the first progress report: the prompt stops being read, the engine keeps serving.
    other = [{"role": "user", "content": " ".join(f"lake{i} rests" for i in range(80))}]
    box, known = {}, threading.Event()

    def on_event(e):                  # on the engine thread, between two chunks
        if isinstance(e, Progress) and e.stage == "prefill" and e.done == 16:
            known.wait(10)
            box["h"].cancel()
    box["h"] = h = engine.submit(GenerateRequest(messages=other, sampling=sample(2)), callback=on_event)
    known.set()
    events = list(h.events())
    assert isinstance(events[-1], Failed) and events[-1].message == "cancelled"
    assert max(e.done for e in events if isinstance(e, Progress)) == 16
    assert engine.call(GenerateRequest(messages=CHAT, sampling=sample(2))).generated_tokens == 2


def test_a_request_cancelled_in_the_queue_touches_nothing(engine):
    from engine.events import Failed
    first = engine.call(GenerateRequest(messages=CHAT, sampling=sample(4), conversation="keep"))
    hold = engine.scheduler.hold()
    h = engine.submit(GenerateRequest(messages=[{"role": "user", "content": "never mind"}], sampling=sample(4)))
    h.cancel()
    hold.release()
    events = list(h.events(timeout=30))
    assert [type(e) for e in events] == [Log, Failed] and events[-1].message == "cancelled"
    assert events[0].line == "error: cancelled"
    st = engine.call(Status())
    assert st.live_tokens == first.prompt_tokens + first.generated_tokens - 1


# ---- issue 27 (item 8): prefill on a slow CPU: chunks capped by measured time, stepped layer by layer --------
def test_prefill_chunks_are_capped_by_the_measured_pace_and_stay_aligned():
    from engine.generation.generate import PrefillPace, chunk_sizes, next_chunk
    assert chunk_sizes(2000, 512, cap=64)[:7] == [16, 16, 32, 64, 64, 64, 64]
    assert sum(chunk_sizes(2000, 512, cap=64)) == 2000
    assert chunk_sizes(100, 512, cap=4096) == chunk_sizes(100, 512)      # a fast machine: the fixed schedule
    # a cap that shrinks mid-way: the next chunk keeps the running total on its own multiples
    assert next_chunk(96, 1000, 512, cap=64) == 32 and next_chunk(128, 1000, 512, cap=64) == 64
    pace = PrefillPace(n_layers=30)
    assert pace.cap() == 0                               # nothing measured: no cap
    pace.record(5, 5 * 0.1)
    assert pace.cap() == 0                               # a turn's few new tokens are not a chunk's pace
    pace.record(16, 16 * 0.1)                            # 0.1 s a token (SmolLM2 on a busy 2-vCPU box)
    assert pace.cap() == 128                             # 30 layers x 0.5 s / 0.1 s = 150 -> 128
    pace.record(16, 16 * 10.0)                           # a model that reads 0.1 token/s
    assert pace.cap() == 4


def test_a_cancel_mid_chunk_leaves_the_kv_holding_exactly_the_chunks_read(engine):
    """Layer-by-layer stepping reads the cancel flag after each layer: a cancel inside a chunk puts the
    layers back as they were before it, and the conversation continues as if only the whole chunks were read."""
    from engine.errors import Cancelled
    from engine.generation.generate import prefill

    def run(e):
        toks = e.prompts.prompt_tokens(GenerateRequest(messages=[{"role": "user", "content": " ".join(
            f"hill{i} stands" for i in range(40))}]))
        cache, fed, calls = e.handlers.make_cache(), [], []

        def cancelled():             # true on the check after the first layer of the third chunk
            calls.append(1)
            return len(calls) == 2 + 1 + 1 + 1 + 1
        with pytest.raises(Cancelled):
            prefill(e.model, cache, toks[:-1], fed, chunk=512, cancelled=cancelled, layerwise=True)
        assert fed == toks[:32] and all(c.offset == 32 for c in cache)
        prefill(e.model, cache, toks[32:-1], fed, chunk=512, layerwise=True)
        ref_cache, ref_fed = e.handlers.make_cache(), []
        prefill(e.model, ref_cache, toks[:-1], ref_fed, chunk=512, layerwise=False)
        import mlx.core as mx
        n = len(fed)
        return fed == ref_fed and all(a.offset == b.offset == n for a, b in zip(cache, ref_cache)) and all(
            mx.allclose(x[..., :n, :], y[..., :n, :], atol=1e-5).item()
            for a, b in zip(cache, ref_cache) for x, y in zip(a.state, b.state) if hasattr(x, "shape"))
    assert while_held(engine, run)
