"""Strata's conversation features on every registered architecture (tests/arch_cases.py ARCH_WRITERS),
through the cache contract (engine/cache/layer_cache.py): parking A/B/A identical, a session saved and
restored in a new Engine continuing identically, Regenerate and Edit giving what a fresh read of the
same tokens gives, and prompt-lookup speculation greedy-identical to plain decoding.

Besides the registered architectures, `llama+window` is the llama file with every other layer made a
sliding-window layer of WINDOW tokens after load: mlx-lm's llama supports that mix itself
(`use_sliding` layers with a RotatingKVCache, `sliding_window`, its own masks: Ministral-style), so it
is a real hybrid model with a window the conversations here outgrow by far. It exercises the
checkpoints (a wrapped window cannot be cut back) on a real model before Gemma / gpt-oss land.

Random weights: replies are sampled (temperature 0.8, fixed seeds: the engine seeds MLX's RNG per
request) so the token streams are varied; the speculation test is greedy, as its identity claim is.
"""
from __future__ import annotations

from pathlib import Path

import pytest

import arch_cases
from engine.cache import layer_cache
from engine.engine import Engine, EngineOptions, GenerateRequest, RestoreSession, SaveSession, Status
from engine.sampling import SamplingParams
import gguf_factory
from engine_reads import while_held
from gguf_factory import TRAINING_TEXT

WORDS = TRAINING_TEXT.split()
WINDOW = 24          # tokens: the conversations below hold 150-300


def words(n: int, start: int = 0) -> str:
    return " ".join(WORDS[(start + i) % len(WORDS)] for i in range(n))


def _slide(engine) -> None:
    """On the engine thread: every other llama layer attends to a window of WINDOW tokens."""
    inner = engine.model.model
    for i, layer in enumerate(inner.layers):
        if i % 2 == 0:
            getattr(layer, "block", layer).use_sliding = True
    inner.sliding_window = WINDOW
    inner.swa_idx, inner.fa_idx = 0, 1          # the layers mlx-lm's llama takes each mask's shape from
    engine.conversations.clear()


# case -> (architecture writer, what to do to a loaded engine: None for nothing, engine options)
CASES = {name: (w, None, {}) for name, w in arch_cases.ARCH_WRITERS.items()}
CASES["llama+window"] = (arch_cases.ARCH_WRITERS["llama"], _slide, {})
# 8-bit K/V beside windows: the full layers quantized (kv_quant), the windows not (mlx-lm cannot)
# (a head of 32: quantized K/V groups are 32 or 64 wide)
CASES["llama+window+q8"] = (lambda path, *, seed=0, **kw: gguf_factory.write_tiny_gguf(
    path, "llama", n_embd=128, n_head=4, n_head_kv=2, seed=seed, tensor_type="F16"), _slide, {"kv_bits": 8})


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request, tmp_path_factory):
    name = request.param
    writer, after, opts = CASES[name]
    path = writer(tmp_path_factory.mktemp("arch") / f"{name.replace('+', '_')}.gguf")
    return name, Path(path), after, opts


def start(case, threaded: bool = False, **opts) -> Engine:
    """The case's engine: inline (served on this thread, whose reads of the engine's objects are then the
    engine thread's own) unless a test needs requests in flight together (threaded)."""
    name, path, after, case_opts = case
    engine = Engine(EngineOptions(model=str(path), **{"cache_mib": 64, "cache_slots": 4, **case_opts, **opts}))
    engine.start() if threaded else engine.inline()
    assert engine.call(Status(), timeout=300).model, "the model did not load"
    if after is not None:
        while_held(engine, after) if threaded else after(engine)
    return engine


def ask(engine, messages, conversation, *, n=12, temperature=0.8, seed=1, speculative="off"):
    h = engine.submit(GenerateRequest(messages=list(messages), conversation=conversation, speculative=speculative,
                                      sampling=SamplingParams(max_tokens=n, temperature=temperature,
                                                              seed=seed if temperature > 0 else None)))
    return h.result(timeout=600)


SYSTEM = "You are a patient storyteller. You tell long stories about the sea, boats and the village."
TURNS = ["Tell me the whole story of the little boat: " + words(60),
         "And what did the boy find in the nets that morning? " + words(20, 90),
         "How did the day end for Margaret and the boy?"]


def chat(engine, name, turns, *, seed=10, other=None):
    """Turns of one conversation (and, before the last, one turn of `other` when given)."""
    msgs = [{"role": "system", "content": SYSTEM}]
    out = []
    for i, user in enumerate(turns):
        if other is not None and i == len(turns) - 1:
            ask(engine, [{"role": "system", "content": "Write a title."}, {"role": "user", "content": other}], "B",
                seed=99)
        msgs.append({"role": "user", "content": user})
        r = ask(engine, msgs, name, seed=seed + i)
        msgs.append({"role": "assistant", "content": r.text})
        out.append(r)
    return out, msgs


def test_parking_aba_is_identical(case):
    """A, then B (A parked whole), then A again: token for token what A alone gives, and A's K/V
    taken back whole (a window far outgrown, so nothing is trimmed or re-read)."""
    engine = start(case)
    try:
        ref, _ = chat(engine, "A", TURNS)
        engine.conversations.clear()
        run, _ = chat(engine, "A2", TURNS, other=words(12, 200))
    finally:
        engine.stop()
    assert [r.tokens for r in run] == [r.tokens for r in ref]
    held = run[1].prompt_tokens + min(len(run[1].tokens), 11)
    assert held > 4 * WINDOW
    # As much reused as without B (all A held, where the template renders the history as it was fed;
    # gpt-oss's harmony template renders a past reply otherwise, so its follow-up shares a bit less).
    assert run[2].cached_tokens == ref[2].cached_tokens > 0
    if case[0].startswith(("llama", "qwen3")) and not case[0].startswith("qwen35"):   # history rendered as fed
        assert run[2].cached_tokens == held


def _fresh_read(engine, tokens: list[int], sampling: SamplingParams) -> list[int]:
    """The reply to exactly `tokens` from an empty cache (no reuse at all), on the inline engine's thread."""
    def run(e):
        from engine.generation.generate import reply
        from engine.cache.parking import KVEntry
        entry = KVEntry([], e.handlers.make_cache(), e.handlers.cache_key())
        return reply(e.model, entry, tokens, 0, tokenizer=e.tokenizer, sampling=sampling, n_vocab=e.info.n_vocab,
                     max_tokens=sampling.max_tokens, chunk=e.options.prefill_chunk, on_token=lambda *a: None,
                     on_progress=lambda *a: None, cancelled=lambda: False).tokens
    return run(engine)


def _prompt_of_live(engine, r) -> list[int]:
    return list(engine.conversations.live.tokens[:r.prompt_tokens])


def test_regenerate_and_edit_equal_a_fresh_read(case):
    """Regenerate (the last reply again) and Edit (the second user message changed) on a conversation
    far past the window: the reply equals a fresh read of the same prompt tokens. A cache that cannot
    be cut back resumes from a checkpoint (a message boundary) at or before the shared prefix."""
    engine = start(case)
    try:
        rs, msgs = chat(engine, "A", TURNS[:2])
        regen = msgs[:-1]
        r = ask(engine, regen, "A", seed=50)
        assert r.cached_tokens == rs[1].prompt_tokens - 1      # the prompt's end is a checkpoint
        toks = _prompt_of_live(engine, r)
        assert r.tokens == _fresh_read(engine, toks, SamplingParams(max_tokens=12, temperature=0.8, seed=50))
        edit = msgs[:3] + [{"role": "user", "content": TURNS[1] + " (edited)"}]
        r = ask(engine, edit, "A", seed=51)
        if layer_cache.needs_checkpoints(engine.handlers.make_cache()):
            # resumed from a checkpoint (the start of the edited message), not re-read from scratch
            assert 0 < r.cached_tokens <= rs[1].prompt_tokens
        else:
            assert r.cached_tokens > rs[0].prompt_tokens      # trimmed: the shared prefix is all kept
        toks = _prompt_of_live(engine, r)
        assert r.tokens == _fresh_read(engine, toks, SamplingParams(max_tokens=12, temperature=0.8, seed=51))
    finally:
        engine.stop()


def test_session_round_trip_in_a_new_engine(case, tmp_path):
    """A conversation saved, then restored in the saving engine and in a new Engine: the follow-up
    is the same in both, and reuses every saved token. (Restored in both because the CPU's live K/V
    is float32 and the file's float16: the live conversation's next sampled token may differ at a
    near-tie, qwen3's did at its 11th token.)"""
    sess = tmp_path / "a.stratasession"
    engine = start(case)
    try:
        rs, msgs = chat(engine, "A", TURNS[:2])
        engine.call(SaveSession(str(sess)), timeout=300)
        follow = msgs + [{"role": "user", "content": TURNS[2]}]
        engine.conversations.clear()
        engine.call(RestoreSession(str(sess), conversation="A"), timeout=300)
        ref = ask(engine, follow, "A", seed=70)
    finally:
        engine.stop()
    engine = start(case)
    try:
        engine.call(RestoreSession(str(sess), conversation="A"), timeout=300)
        r = ask(engine, follow, "A", seed=70)
    finally:
        engine.stop()
    assert r.cached_tokens == ref.cached_tokens > 0
    assert r.tokens == ref.tokens


@pytest.mark.parametrize("mode", ["lookup", "draft"])
def test_speculation_is_greedy_identical(case, mode, monkeypatch, tmp_path):
    """Greedy output with drafts (prompt lookup; a draft model: the same architecture with other
    random weights, so most drafts are rejected) equals plain decoding's. A cache that cannot trim
    back restores its snapshot and replays the accepted tokens; a draft model's cache restores the
    checkpoint it took before drafting."""
    from engine.generation import speculative
    monkeypatch.setattr(speculative, "REMEMBER", False)
    monkeypatch.setattr(speculative, "CATCH_UP_RULE", False)
    spec_mode = "lookup"
    if mode == "draft":
        writer = CASES[case[0]][0]
        spec_mode = "draft:" + str(writer(tmp_path / "draft.gguf", seed=5))
    engine = start(case)
    try:
        msgs = [{"role": "system", "content": SYSTEM},
                {"role": "user", "content": "Repeat after me: " + words(40, 10) + " " + words(40, 10)}]
        plain = ask(engine, msgs, "P", n=40, temperature=0.0)
        spec = ask(engine, msgs, "S", n=40, temperature=0.0, speculative=spec_mode)
    finally:
        engine.stop()
    assert spec.tokens == plain.tokens
    # Lookup drafts only where the reply repeats an n-gram of the conversation: random weights may
    # never do that (qwen35's tiny model does not), and then the identity holds trivially; llama's
    # and qwen3's replies do. A draft model always drafts.
    if mode == "draft" or case[0].startswith(("llama", "qwen3")) and not case[0].startswith("qwen35"):
        assert spec.drafted_tokens > 0, spec.speculation_stopped


def test_cancel_mid_prefill_leaves_the_cache_as_before_the_chunk(case):
    """A cancel after the first layer of a prefill chunk (the CPU's layer-by-layer prefill) puts every
    layer back as it was before the chunk: trimmed K/V, and for a window or a recurrent state the
    snapshot taken before the chunk. Reading the chunk again then gives exactly the logits of a run
    that was never cancelled."""
    def run(e):
        import mlx.core as mx
        from engine.errors import Cancelled
        from engine.generation.generate import prefill
        toks = e.tokenizer.encode(words(80, 30))[:73]
        assert len(toks) == 73

        def logits(cancel: bool):
            cache, fed = e.handlers.make_cache(), []
            prefill(e.model, cache, toks[:40], fed, layerwise=True)
            if cancel:
                answers = iter([False])     # not before the chunk: after its first layer
                with pytest.raises(Cancelled):
                    prefill(e.model, cache, toks[40:72], fed, layerwise=True, cancelled=lambda: next(answers, True))
                assert next(answers, "asked") == "asked"
                assert fed == toks[:40]
            prefill(e.model, cache, toks[40:72], fed, layerwise=True)
            out = e.model(mx.array(toks[72:73])[None], cache=cache)
            mx.eval(out)
            return out
        return bool(mx.array_equal(logits(True), logits(False)).item())
    engine = start(case)
    try:
        assert run(engine)
    finally:
        engine.stop()


def test_gpu_first_step_merge_keeps_the_checkpoints(case, monkeypatch):
    """On a GPU a prompt's last part goes in with the first decode step (generate.first_step_merge_limit).
    Where checkpoints are due (a window or a recurrent state) that part is prefilled instead, so the
    message boundaries in it still get their checkpoints: each turn reuses as much as on the CPU.
    (Before, a Qwen3.5-like model on the H200 reused nothing of a 20-token conversation's history.)
    Forced on here, on the CPU."""
    from engine.generation import generate
    engine = start(case)
    try:
        ref, _ = chat(engine, "A", TURNS)
        monkeypatch.setattr(generate, "first_step_merge_limit", lambda chunk: chunk)
        run, _ = chat(engine, "A2", TURNS, other=words(12, 200))
    finally:
        engine.stop()
    assert [r.tokens for r in run] == [r.tokens for r in ref]
    assert [r.cached_tokens for r in run[1:]] == [r.cached_tokens for r in ref[1:]]
    assert ref[2].cached_tokens > 0


def test_8_bit_kv_parking_aba_is_identical(case):
    """8-bit K/V (--kv-bits 8: the full-attention layers quantized; windows and recurrent states as
    they are) on every architecture: A, B, A again gives what A alone gives. A model whose heads are
    narrower than a quantization group (the tiny llama/qwen3 files: 16), or with attention sinks mlx-lm's
    quantized attention cannot read (gpt-oss), is refused at load in one line."""
    name, path, after, case_opts = case
    engine = Engine(EngineOptions(model=str(path), cache_mib=64, cache_slots=4, **{**case_opts, "kv_bits": 8}))
    engine.inline()
    try:
        try:
            engine.startup.result(timeout=300)
        except Exception as e:  # noqa: BLE001 - the one refusal this test accepts, by its words
            assert ("needs a head size that is a multiple of 32" in str(e) or "has no attention sinks" in str(e)) \
                and "\n" not in str(e)
            pytest.skip(f"{name}: {e}")
        if after is not None:
            after(engine)
        ref, _ = chat(engine, "A", TURNS)
        engine.conversations.clear()
        run, _ = chat(engine, "A2", TURNS, other=words(12, 200))
    finally:
        engine.stop()
    assert [r.tokens for r in run] == [r.tokens for r in ref]
    assert run[2].cached_tokens == ref[2].cached_tokens > 0


def test_batched_streams_equal_each_run_alone_and_leave_what_alone_leaves(case):
    """Continuous batching (engine/generation/batching.py) on every architecture: windows (rows' windows wrap in the
    batch), recurrent states, quantized K/V (runs alone). Three greedy streams of mixed prompt and reply
    lengths decoded together give what each gives alone, and each conversation is left holding what a
    lone reply leaves (the same tokens; a state that cannot be cut back restored from before its last
    token, which the batch's next step fed all the same): its next turn reuses as much and gives the
    same tokens. A fourth stream, cancelled after 4 tokens, leaves a conversation whose next turn gives
    what a fresh read of it gives."""
    from test_batching import Gate, counters
    from engine.events import Token
    name = case[0]
    reqs = [GenerateRequest(prompt=words(n, 7 * i), conversation=f"b{i}",
                            sampling=SamplingParams(max_tokens=m, temperature=0.0))
            for i, (n, m) in enumerate([(40, 14), (6, 30), (90, 9)])]
    # a chat too: its checkpoints at the message boundaries are what its next turn resumes from
    reqs.append(GenerateRequest(messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": words(25, 40)}],
                                conversation="b-chat", sampling=SamplingParams(max_tokens=11, temperature=0.0)))

    def held(engine, owner):
        """The conversation's tokens and what its layers hold for the tokens to come, in temporal order
        (a window's last max_size - 1 cells: how many more it keeps, and its ring's order, are the
        path's own; a recurrent state whole)."""
        import mlx.core as mx
        import numpy as np

        def cells(c):
            kind = layer_cache.kind_of(c)
            if kind.name == "rotating":
                n = min(c.offset, c.max_size) - 1
                return [c._temporal_order(v)[..., -n:, :] for v in (c.keys, c.values)] if n > 0 else []
            return kind.state(c)

        def read(e):
            entry = next(x for x in e.conversations.held() if x.owner == owner)
            return list(entry.tokens), [np.array(a.astype(mx.float32)) for c in entry.cache for a in cells(c)]
        return while_held(engine, read)

    def again(engine, i, r):
        req = reqs[i]
        follow = SamplingParams(max_tokens=8, temperature=0.0)
        if req.messages:
            msgs = req.messages + [{"role": "assistant", "content": r.text}, {"role": "user", "content": words(6, 200)}]
            return engine.call(GenerateRequest(messages=msgs, conversation=req.conversation, sampling=follow), 600)
        return engine.call(GenerateRequest(prompt=req.prompt + r.text + " " + words(5, 300), conversation=req.conversation,
                                           sampling=follow), timeout=600)
    stopped = GenerateRequest(prompt=words(30, 120), conversation="b3", sampling=SamplingParams(max_tokens=40,
                                                                                              temperature=0.0))
    eng = start(case, threaded=True, max_sequences=5)
    try:
        gate = Gate(eng)
        hs = [eng.submit(r) for r in reqs]
        seen = []

        def cancel_after_4(ev):
            if isinstance(ev, Token):
                seen.append(ev)
                if len(seen) == 4:
                    hc.cancel()
        hc = eng.submit(stopped, callback=cancel_after_4)
        gate.release()
        got = [h.result(600) for h in hs]
        cut = hc.result(600)
        c = counters(eng)
        got_held = [held(eng, r.conversation) for r in reqs]
        got_next = [again(eng, i, got[i]) for i in range(len(reqs))]
        after_cut = GenerateRequest(prompt=stopped.prompt + cut.text + " " + words(5, 300), conversation="b3",
                                    sampling=SamplingParams(max_tokens=8, temperature=0.0))
        cut_next = eng.call(after_cut, timeout=600)
    finally:
        eng.stop()
    solo = start(case)
    try:
        ref = [solo.call(r, timeout=600) for r in reqs]
        ref_held = [held(solo, r.conversation) for r in reqs]
        ref_next = [again(solo, i, ref[i]) for i in range(len(reqs))]
        fresh = solo.call(GenerateRequest(prompt=after_cut.prompt, conversation="fresh", sampling=after_cut.sampling),
                          timeout=600)
    finally:
        solo.stop()
    assert cut.finish_reason == "cancelled" and 4 <= len(cut.tokens) < 40, (cut.finish_reason, len(cut.tokens))
    assert cut_next.tokens == fresh.tokens, f"{name}: the cancelled stream's next turn differs from a fresh read"
    assert [r.tokens for r in got] == [r.tokens for r in ref]
    if "q8" in name:
        assert c.rows == 0, "quantized K/V runs alone"
    else:
        assert c.peak_rows >= 3 and c.shared_steps > 0, f"{name}: the streams did not step together"
        assert c.read_together == 5, f"{name}: the prompts were not read in one padded group"
    for i, ((toks, arrays), (ref_toks, ref_arrays)) in enumerate(zip(got_held, ref_held)):
        assert toks == ref_toks, f"stream {i}: held {len(toks)} tokens, alone {len(ref_toks)}"
        assert len(arrays) == len(ref_arrays)
        worst = 0.0
        for a, b in zip(arrays, ref_arrays):
            assert a.shape == b.shape
            worst = max(worst, float(abs(a - b).max()))
        print(f"{name} stream {i}: held state vs alone, max |d| {worst:.3g}")
        assert worst <= 1e-4, f"stream {i}: its held state differs from alone"
    for r, rr in zip(got_next, ref_next):
        assert (r.cached_tokens, r.tokens) == (rr.cached_tokens, rr.tokens)
