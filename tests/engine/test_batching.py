"""Continuous batching (issue 34, engine/generation/batching.py): streams decoded together give what each gives
alone, keep their own sampling, steering, stops and cancel, are parked as themselves and continue.

The reference is the same model in an engine with max_sequences=1 (the lone-request path, unchanged),
fed the same requests one after another. Batched engines are held at a gate (Scheduler.hold: the
engine thread waits between requests) while the requests are queued, so they really step together; the
counters the batch keeps (Status().batch) show how many rows shared a step. On the tiny models the batched greedy
tokens are identical to the lone ones (measured: every stream, every token, 1-8 streams); for
SmolLM2 see test_real_model_streams_match_alone_up_to_a_near_tie.
"""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from engine.steer.control_vector import SteeringConfig, write_control_vector
from engine.api import CountTokens
from engine.api import BatchCounters
from engine.engine import Engine, EngineOptions, GenerateRequest, Status
from engine_reads import prompt_ids, while_held
from engine.events import Progress, Token
from engine.sampling import SamplingParams

PROMPTS = [
    "Once upon a time",
    "The river flows past the old mill and on towards the sea, where the fishing boats wait for",
    "Hi",
    "A cat who learns to fly is a cat who",
    "In the beginning the engine served one request at a time, and every other client waited in a long "
    "queue behind it while the prompt of the first was read, token after token, chunk after chunk",
    "Q: What is two plus two?\nA:",
    "def fibonacci(n):\n    ",
    "Tea is grown on hills,",
]
CHATS = [[{"role": "user", "content": p}] for p in PROMPTS]
TIE_MARGIN = 0.6          # tests/engine/test_oracle.py's: a closer race has no single right answer


def greedy(n):
    return SamplingParams(max_tokens=n, temperature=0.0)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from gguf_factory import write_tiny_gguf
    return write_tiny_gguf(tmp_path_factory.mktemp("batch") / "tiny.gguf", arch="llama", n_layer=2, n_embd=64,
                           seed=5, context_length=2048)


@pytest.fixture(scope="module")
def tiny4_vec(tmp_path_factory):
    """A 4-layer tiny model and a strong control vector for it (as tests/engine/test_cvec_engine.py)."""
    from gguf_factory import write_tiny_gguf
    d = tmp_path_factory.mktemp("batch-cvec")
    model = write_tiny_gguf(d / "tiny4.gguf", arch="llama", n_layer=4, n_embd=64, n_head=4, n_head_kv=2,
                            n_ff=128, seed=5)
    rng = np.random.default_rng(21)
    vec = d / "strong.gguf"
    write_control_vector(vec, {n: (rng.standard_normal(64) * 3.0).astype(np.float32) for n in range(1, 4)},
                         model_hint="llama")
    return model, vec


def start(model, n, inline: bool = False, **kw) -> Engine:
    eng = Engine(EngineOptions(model=str(model), max_sequences=n, **kw))
    eng.inline() if inline else eng.start()
    assert eng.call(Status()).model is not None
    return eng


def counters(eng) -> BatchCounters:
    """A copy of the engine's batch counters (Status reports them)."""
    return eng.call(Status(), 60).batch or BatchCounters()


class Gate:
    """Holds the engine thread between requests (Scheduler.hold) while requests are queued behind it."""

    def __init__(self, eng):
        self.hold = eng.scheduler.hold()

    def release(self):
        self.hold.release()


def together(eng, reqs, **submit_kw):
    """Submit every request while the engine is held, then let them run as one batch."""
    gate = Gate(eng)
    handles = [eng.submit(r, **submit_kw) for r in reqs]
    gate.release()
    return handles


def alone(eng, reqs):
    return [eng.call(r, 300) for r in reqs]


def requests(n, **kw):
    # mixed prompt lengths (2 to 40 tokens) and reply lengths
    return [GenerateRequest(prompt=PROMPTS[i], conversation=f"c{i}", sampling=greedy(30 + 3 * i), **kw)
            for i in range(n)]


# ---- identity with the lone path -------------------------------------------------------------------
@pytest.fixture(scope="module")
def reference(tiny):
    eng = start(tiny, 1)
    got = alone(eng, requests(8))
    eng.stop()
    return got


@pytest.mark.parametrize("n", [1, 2, 3, 5, 8])
def test_greedy_streams_equal_each_run_alone(tiny, reference, n):
    eng = start(tiny, 8)
    try:
        results = [h.result(300) for h in together(eng, requests(n))]
        c = counters(eng)
    finally:
        eng.stop()
    for i, (r, ref) in enumerate(zip(results, reference)):
        assert r.tokens == ref.tokens, f"stream {i} of {n}"
        assert r.text == ref.text and r.finish_reason == ref.finish_reason
        assert r.prompt_tokens == ref.prompt_tokens and r.generated_tokens == ref.generated_tokens
    assert c.peak_rows == n and c.rows == n
    assert (c.shared_steps > 0) == (n > 1)
    assert c.read_together == (n if n > 1 else 0), "prompts queued together are read in one group"


def test_prompts_read_together_in_small_chunks_equal_alone(tiny, reference):
    """Five prompts of 2-40 tokens read together 32 tokens a row per pass (prefill_chunk 64 / 5 rows,
    engine/generation/batch_prefill.py): the short ones are padded in every pass after their end, the long ones
    take two passes; each stream still gives its lone tokens."""
    eng = start(tiny, 8, prefill_chunk=64)
    try:
        results = [h.result(300) for h in together(eng, requests(5))]
        c = counters(eng)
    finally:
        eng.stop()
    assert c.read_together == 5
    assert [r.tokens for r in results] == [r.tokens for r in reference[:5]]


def test_a_short_prompt_sent_with_a_long_one_decodes_while_the_long_one_is_read(tiny, reference):
    """Read together, the short prompt's row leaves the group once its prompt is in: its tokens come
    while the long prompt is still being read (between that prompt's progress reports), and both
    replies equal their lone runs."""
    long_prompt = " ".join(PROMPTS) * 3         # several passes of 32 tokens
    solo = start(tiny, 1)
    try:
        ref_long = solo.call(GenerateRequest(prompt=long_prompt, conversation="long", sampling=greedy(8)), 300)
    finally:
        solo.stop()
    eng = start(tiny, 8, prefill_chunk=64)
    try:
        order: list[tuple[str, object]] = []      # callbacks run on the engine thread: in engine order
        gate = Gate(eng)
        short = eng.submit(requests(1)[0], callback=lambda ev: order.append(("short", ev)))
        long_ = eng.submit(GenerateRequest(prompt=long_prompt, conversation="long", sampling=greedy(8)),
                           callback=lambda ev: order.append(("long", ev)))
        gate.release()
        rs, rl = short.result(300), long_.result(300)
        c = counters(eng)
    finally:
        eng.stop()
    assert c.read_together == 2
    assert rs.tokens == reference[0].tokens and rl.tokens == ref_long.tokens
    progress = [i for i, (who, ev) in enumerate(order) if who == "long" and isinstance(ev, Progress)]
    first_short = next(i for i, (who, ev) in enumerate(order) if who == "short" and isinstance(ev, Token))
    assert first_short < progress[-1], "the short stream waited for the long prompt's whole read"


def test_a_prompt_cancelled_while_read_together_leaves_the_others_whole(tiny, reference):
    """A row cancelled between two passes of a group's prefill gets Failed(cancelled) and parks what it
    fed; the other rows go on and equal their lone runs."""
    eng = start(tiny, 8, prefill_chunk=64, cache_mib=64)
    long_prompt = " ".join(PROMPTS) * 2       # several passes of 32 tokens
    try:
        victim = []

        def cancel_on_progress(ev):
            if isinstance(ev, Progress) and ev.done > 0:
                victim[0].cancel()
        gate = Gate(eng)
        hs = [eng.submit(r) for r in requests(3)]
        victim.append(eng.submit(GenerateRequest(prompt=long_prompt, conversation="gone", sampling=greedy(8)),
                                 callback=cancel_on_progress))
        gate.release()
        got = [h.result(300) for h in hs]
        with pytest.raises(Exception, match="cancel"):
            victim[0].result(300)
        c = counters(eng)
        held = {x["owner"]: x["tokens"] for x in eng.call(Status()).conversations}
        n_long = eng.call(CountTokens(prompt=long_prompt)).tokens
    finally:
        eng.stop()
    assert c.read_together == 4
    assert [r.tokens for r in got] == [r.tokens for r in reference[:3]]
    assert 0 < held.get("gone", 0) < n_long - 1, "it parked what it had fed, not its whole prompt"


def test_cap_queues_the_rest_and_they_still_match(tiny, reference):
    eng = start(tiny, 2)
    try:
        results = [h.result(300) for h in together(eng, requests(5))]
        c = counters(eng)
    finally:
        eng.stop()
    assert [r.tokens for r in results] == [r.tokens for r in reference[:5]]
    assert c.peak_rows == 2 and c.rows == 5


def test_seeded_sampling_and_penalties_are_each_rows_own(tiny):
    """Each row draws from its own seed's key chain (a lone request seeds the process-wide one), so a
    seeded row gives the lone request's tokens whatever else runs beside it."""
    reqs = [GenerateRequest(prompt=PROMPTS[0], conversation="s0",
                            sampling=SamplingParams(max_tokens=20, temperature=0.9, seed=1)),
            GenerateRequest(prompt=PROMPTS[1], conversation="s1",
                            sampling=SamplingParams(max_tokens=16, temperature=0.7, top_p=0.9, top_k=40, seed=2)),
            GenerateRequest(prompt=PROMPTS[3], conversation="s2",
                            sampling=SamplingParams(max_tokens=18, temperature=0.0, repetition_penalty=1.3)),
            GenerateRequest(prompt=PROMPTS[5], conversation="s3",
                            sampling=SamplingParams(max_tokens=14, temperature=1.0, min_p=0.05, seed=3,
                                                    repetition_penalty=1.1))]
    solo = start(tiny, 1)
    try:
        ref = alone(solo, reqs)
    finally:
        solo.stop()
    eng = start(tiny, 8)
    try:
        got = [h.result(300) for h in together(eng, reqs)]
        assert counters(eng).peak_rows == 4
    finally:
        eng.stop()
    for i, (a, b) in enumerate(zip(got, ref)):
        assert a.tokens == b.tokens, f"row {i}"


def test_stop_strings_are_each_rows_own(tiny, reference):
    # a stop string taken from each stream's own text: each stops where it would alone
    reqs = []
    for i in range(4):
        text = reference[i].text
        stop = text[4:7] if len(text) > 8 else "zzz"
        reqs.append(GenerateRequest(prompt=PROMPTS[i], conversation=f"t{i}",
                                    sampling=SamplingParams(max_tokens=12 + 5 * i, temperature=0.0, stop=[stop])))
    eng = start(tiny, 8)
    try:
        got = [h.result(300) for h in together(eng, reqs)]
    finally:
        eng.stop()
    for i, r in enumerate(got):
        stop = reqs[i].sampling.stop[0]
        full = reference[i].text
        if stop in full:
            assert r.finish_reason == "stop" and r.text == full[:full.index(stop)], f"row {i}"
        else:
            assert r.text == full


# ---- steering, cancel, parking and the next turn ----------------------------------------------------
def test_steered_and_plain_rows_cancel_and_next_turns(tiny4_vec):
    """Four chats in one batch: one steered, one plain, one on the engine's default (steered), one
    cancelled after 4 tokens. Each equals its lone run (the cancelled one up to where it stopped);
    each is parked as itself, and its next turn reuses its whole history and matches the lone
    engine's next turn."""
    model, vec = tiny4_vec
    cfg = SteeringConfig(files=((str(vec), 2.0),), mode="project")
    first = [GenerateRequest(messages=CHATS[0], conversation="steered", speed_projection=True, sampling=greedy(16)),
             GenerateRequest(messages=CHATS[0], conversation="plain", speed_projection=False, sampling=greedy(16)),
             GenerateRequest(messages=CHATS[4], conversation="default", sampling=greedy(20)),
             GenerateRequest(messages=CHATS[1], conversation="cancelled", sampling=greedy(40))]

    def follow(rs):
        out = []
        for req, r in zip(first[:3], rs):
            msgs = req.messages + [{"role": "assistant", "content": r.text}, {"role": "user", "content": "And then?"}]
            out.append(GenerateRequest(messages=msgs, conversation=req.conversation,
                                       speed_projection=req.speed_projection, sampling=greedy(10)))
        return out

    solo = start(model, 1, steering=cfg, cache_mib=64)
    try:
        assert solo.call(Status()).steering_error is None
        ref = alone(solo, first)
        ref_next = alone(solo, follow(ref))
    finally:
        solo.stop()
    assert ref[0].tokens != ref[1].tokens, "the vector must change the steered reply"

    eng = start(model, 8, steering=cfg, cache_mib=64)
    try:
        seen = []

        def cancel_after_4(ev, h=[]):
            if isinstance(ev, Token):
                seen.append(ev)
                if len(seen) == 4:
                    h[0].cancel()
        gate = Gate(eng)
        hs = [eng.submit(r) for r in first[:3]]
        hc = eng.submit(first[3], callback=cancel_after_4)
        cancel_after_4.__defaults__[0].append(hc)
        gate.release()
        got = [h.result(300) for h in hs]
        cancelled = hc.result(300)
        assert counters(eng).peak_rows == 4
        held = {c["owner"]: c["tokens"] for c in eng.call(Status()).conversations}
        nxt = [h.result(300) for h in together(eng, follow(got))]
    finally:
        eng.stop()
    for i in range(3):
        assert got[i].tokens == ref[i].tokens, first[i].conversation
        assert got[i].speed_projection == ref[i].speed_projection
    assert got[0].speed_projection and not got[1].speed_projection and got[2].speed_projection
    assert cancelled.finish_reason == "cancelled"
    assert 4 <= len(cancelled.tokens) < 40 and cancelled.tokens == ref[3].tokens[:len(cancelled.tokens)]
    # parked as themselves: prompt + every generated token but the last one (never fed: max_tokens
    # ended it), the cancelled one with what it fed
    for i, r in enumerate(got):
        assert held[first[i].conversation] == r.prompt_tokens + r.generated_tokens - 1
    assert held["cancelled"] >= cancelled.prompt_tokens + len(cancelled.tokens) - 1
    for i, (a, b) in enumerate(zip(nxt, ref_next)):
        assert a.cached_tokens == got[i].prompt_tokens + got[i].generated_tokens - 1, first[i].conversation
        assert a.cached_tokens == b.cached_tokens
        assert a.tokens == b.tokens, first[i].conversation


# ---- fairness: status while a batch runs, prefill between decode steps, the memory guard -------------
def test_status_answers_and_a_long_prompt_does_not_stall_the_others(tiny):
    eng = start(tiny, 8, prefill_chunk=64)
    try:
        order: list[tuple[str, object]] = []    # callbacks run on the engine thread: in engine order
        a = eng.submit(GenerateRequest(prompt=PROMPTS[0], conversation="a", sampling=greedy(400)),
                       callback=lambda ev: order.append(("a", ev)))
        while not any(isinstance(ev, Token) for _, ev in order):
            time.sleep(0.01)
        long_prompt = " ".join(PROMPTS) * 3      # several prefill chunks
        b = eng.submit(GenerateRequest(prompt=long_prompt, conversation="b", sampling=greedy(8)),
                       callback=lambda ev: order.append(("b", ev)))
        st = eng.call(Status(), 60)
        a_running = not a.finished.is_set()    # answered between the batch's steps, not after it
        rb = b.result(300)
        ra = a.result(300)
    finally:
        eng.stop()
    assert st.model and a_running
    progress = [i for i, (who, ev) in enumerate(order) if who == "b" and isinstance(ev, Progress)]
    assert len(progress) >= 3, "the long prompt was read in several chunks"
    between = [ev for who, ev in order[progress[0]:progress[-1]] if who == "a" and isinstance(ev, Token)]
    assert len(between) >= 2, "stream a kept decoding while b's prompt was read"
    assert ra.generated_tokens == 400 and rb.generated_tokens == 8


def test_memory_guard_refusal_makes_a_stream_wait_not_fail(tiny, reference):
    from engine.memory.memory_guard import MemoryGuard
    eng = start(tiny, 8)
    try:
        # a reserve larger than any machine: every join is refused, so each request runs when alone
        while_held(eng, lambda e: setattr(e, "guard", MemoryGuard(reserve_bytes=1 << 62)))
        results = [h.result(300) for h in together(eng, requests(3))]
        c = counters(eng)
    finally:
        eng.stop()
    assert [r.tokens for r in results] == [r.tokens for r in reference[:3]]
    assert c.peak_rows == 1 and c.rows == 3


def test_speculative_and_constrained_requests_run_alone_between_steps(tiny, reference):
    from engine.generation.constraints import ConstraintSpec
    eng = start(tiny, 8)
    solo = start(tiny, 1)
    try:
        spec = GenerateRequest(prompt=PROMPTS[6], conversation="spec", speculative="lookup", sampling=greedy(24))
        json_req = GenerateRequest(messages=CHATS[5], conversation="json", sampling=greedy(24),
                                   constraint=ConstraintSpec(kind="json_object"))
        ref_spec, ref_json = alone(solo, [spec, json_req])
        hs = together(eng, requests(3) + [spec, json_req])
        got = [h.result(300) for h in hs]
        c = counters(eng)
    finally:
        eng.stop()
        solo.stop()
    assert [r.tokens for r in got[:3]] == [r.tokens for r in reference[:3]]
    assert got[3].tokens == ref_spec.tokens and got[4].tokens == ref_json.tokens
    assert c.rows == 3 and c.peak_rows == 3


# ---- the real model ----------------------------------------------------------------------------------
@pytest.mark.real_model
def test_real_model_streams_match_alone_up_to_a_near_tie(real_model):
    """SmolLM2 (Q8_0), 4 chats of mixed length. A batched step multiplies a (rows, width) matrix where
    a lone step multiplies a vector, and attends over padded keys under a mask: the sums may round
    differently, so streams are compared as the oracle tests are, token for token up to the first
    place where the lone run's own top-2 margin is below TIE_MARGIN."""
    reqs = [GenerateRequest(messages=CHATS[i], conversation=f"r{i}", sampling=greedy(12)) for i in (0, 1, 4, 6)]
    solo = start(real_model, 1, inline=True)
    try:
        ref = alone(solo, reqs)
        prompts = [prompt_ids(solo, r) for r in reqs]
    except BaseException:
        solo.stop()
        raise
    eng = start(real_model, 8)
    try:
        got = [h.result(600) for h in together(eng, reqs)]
        assert counters(eng).peak_rows == 4
    finally:
        eng.stop()
    identical = 0
    try:
        for i, (a, b) in enumerate(zip(got, ref)):
            if a.tokens == b.tokens:
                identical += 1
                continue
            k = next(j for j, (x, y) in enumerate(zip(a.tokens, b.tokens)) if x != y)
            margin = _top2_margin(solo, prompts[i] + b.tokens[:k])
            assert margin < TIE_MARGIN, f"stream {i} differs at token {k} with a lone margin of {margin:.3f}"
    finally:
        solo.stop()
    print(f"SmolLM2: {identical}/4 streams identical to their lone runs")


def _top2_margin(engine, ids) -> float:
    import mlx.core as mx
    cache = engine.handlers.make_cache()
    logits = engine.model(mx.array(ids)[None], cache=cache)[0, -1].astype(mx.float32)
    top = np.sort(np.array(logits))[-2:]
    return float(top[1] - top[0])


# ---- the server: N real HTTP clients streaming at once ------------------------------------------------
def _streamed(client, content, max_tokens) -> tuple[str, str]:
    """(reasoning, reply) streamed: a Qwen3.5 template opens a <think> block (reasoning_content)."""
    reasoning = text = ""
    for ch in client.chat.completions.create(model="default", messages=[{"role": "user", "content": content}],
                                             stream=True, temperature=0, max_tokens=max_tokens):
        for c in ch.choices:
            reasoning += getattr(c.delta, "reasoning_content", None) or ""
            text += c.delta.content or ""
    return reasoning, text


@pytest.fixture(params=["llama", "qwen35"])
def served(request, tiny, tmp_path_factory):
    """The tiny llama, or a tiny Qwen3.5 (recurrent states, batched since session 12)."""
    if request.param == "llama":
        return tiny
    from gguf_factory_qwen35 import write_tiny_qwen35_gguf
    return write_tiny_qwen35_gguf(tmp_path_factory.mktemp("served") / "q.gguf", "qwen35", seed=4)


def test_server_streams_n_clients_at_once(served):
    """Six openai clients stream at once (one more hangs up mid-stream): each gets the answer it gets
    alone, the batch held them together, and /v1/models answers while they run."""
    import httpx
    import openai

    from engine.frontends.server import ServerThread, create_app
    eng = start(served, 8)
    srv = ServerThread(create_app(eng)).start()
    try:
        c0 = openai.OpenAI(base_url=srv.base_url, api_key="x", max_retries=0, timeout=300)
        asks = [(PROMPTS[i], 40 + 4 * i) for i in range(6)]
        alone_answers = [_streamed(c0, p, n) for p, n in asks]
        assert len(set(alone_answers)) >= 4, alone_answers
        before = counters(eng)
        results: dict[int, str] = {}
        errors: list[BaseException] = []
        barrier = threading.Barrier(len(asks) + 2)
        models_ms: list[float] = []

        def worker(i):
            c = openai.OpenAI(base_url=srv.base_url, api_key="x", max_retries=0, timeout=300)
            try:
                barrier.wait()
                results[i] = _streamed(c, *asks[i])
            except BaseException as e:  # noqa: BLE001
                errors.append(e)

        def quitter():         # reads 3 chunks of a long reply, then closes the connection
            c = openai.OpenAI(base_url=srv.base_url, api_key="x", max_retries=0, timeout=300)
            try:
                barrier.wait()
                s = c.chat.completions.create(model="default", messages=[{"role": "user", "content": PROMPTS[7]}],
                                              stream=True, temperature=0, max_tokens=1500)
                for k, _ in enumerate(s):
                    if k == 3:
                        break
                s.close()
            except BaseException as e:  # noqa: BLE001
                errors.append(e)

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(asks))]
        threads.append(threading.Thread(target=quitter))
        for t in threads:
            t.start()
        barrier.wait()
        deadline = time.time() + 60
        while len(results) < len(asks) and time.time() < deadline and len(models_ms) < 20:
            t0 = time.perf_counter()
            assert httpx.get(f"{srv.base_url}/models", timeout=30).status_code == 200
            models_ms.append((time.perf_counter() - t0) * 1e3)
            time.sleep(0.05)
        for t in threads:
            t.join(300)
        after = counters(eng)
        live = eng.call(Status(), 30)
    finally:
        srv.stop()
        eng.stop()
    assert not errors, errors
    assert [results[i] for i in range(len(asks))] == alone_answers
    assert after.peak_rows >= 4 and after.shared_steps > before.shared_steps
    assert models_ms and max(models_ms) < 2000, models_ms
    quit_entry = [c for c in live.conversations if c["tokens"] > 1000]
    assert not quit_entry, "the client that hung up was cancelled, not decoded to 1,500 tokens"


def test_a_queued_request_cancelled_is_answered_at_once(tiny):
    """Beyond the cap a request queues; cancelled there (a client gone), it is answered at the next
    step, not when a row frees up."""
    from engine.errors import EngineError, ErrorCode
    eng = start(tiny, 2)
    try:
        long = [GenerateRequest(prompt=PROMPTS[i], conversation=f"l{i}", sampling=greedy(300)) for i in range(2)]
        queued = GenerateRequest(prompt=PROMPTS[2], conversation="q", sampling=greedy(8))
        hs = together(eng, long + [queued])
        hs[2].cancel()
        with pytest.raises(EngineError) as e:
            hs[2].result(60)
        running = [not h.finished.is_set() for h in hs[:2]]
        rs = [h.result(300) for h in hs[:2]]
    finally:
        eng.stop()
    assert e.value.code == ErrorCode.CANCELLED
    assert all(running), "answered while both rows still ran"
    assert [r.generated_tokens for r in rs] == [300, 300]


def test_first_step_merge_as_a_lone_request_does(tiny, monkeypatch):
    """On a GPU a prompt's last part goes in with the first decode step (generate.first_step_merge_limit);
    a row does it when it steps alone, and prefills that part first when others step with it. Forced on
    here, on the CPU (as tests/engine/test_first_step_merge.py does): the same tokens as the lone path
    with the same merge, and the K/V holds exactly what was fed (the next turn reuses all of it)."""
    from engine.generation import generate
    monkeypatch.setattr(generate, "first_step_merge_limit", lambda chunk: 16)
    reqs = requests(4)
    solo = start(tiny, 1)
    try:
        ref = alone(solo, reqs)
    finally:
        solo.stop()
    eng = start(tiny, 8)
    try:
        lone = eng.call(reqs[1], 300)                       # alone: merged into its first step
        got = [h.result(300) for h in together(eng, reqs)]  # together: prefilled, then joined
        again = GenerateRequest(prompt=PROMPTS[1] + "!", conversation="c1", sampling=greedy(4))
        nxt = eng.call(again, 300)
    finally:
        eng.stop()
    assert lone.tokens == ref[1].tokens
    assert [r.tokens for r in got] == [r.tokens for r in ref]
    assert nxt.cached_tokens >= got[1].prompt_tokens - 1


def test_a_batched_conversation_is_saved_as_if_it_ran_alone(tiny, tmp_path):
    """Three chats batched, then the last one's K/V (alone, a later new chat may take over an earlier
    one's parked K/V by their shared prefix, as parking does) against the lone engine's: the same tokens and K/V
    (measured: identical on the tiny model, max |dK|, |dV| = 0). One is saved to a session file, restored
    into a fresh engine, and its next turn there is the lone engine's next turn."""
    from engine.engine import RestoreSession, SaveSession
    reqs = [GenerateRequest(messages=CHATS[i], conversation=f"chat{i}", sampling=greedy(20 + 4 * i))
            for i in (0, 4, 6)]

    def held(eng, owner):
        import mlx.core as mx

        def read(e):
            entry = next(x for x in e.conversations.held() if x.owner == owner)
            kv = [np.array(a[..., :c.offset, :].astype(mx.float32)) for c in entry.cache for a in (c.keys, c.values)]
            return list(entry.tokens), kv
        return while_held(eng, read)

    def next_turn(r, req):
        msgs = req.messages + [{"role": "assistant", "content": r.text}, {"role": "user", "content": "Why?"}]
        return GenerateRequest(messages=msgs, conversation=req.conversation, sampling=greedy(8))

    solo = start(tiny, 1, cache_mib=64)
    try:
        ref = alone(solo, reqs)
        ref_kv = held(solo, "chat6")
        ref_next = solo.call(next_turn(ref[2], reqs[2]), 300)
    finally:
        solo.stop()
    eng = start(tiny, 8, cache_mib=64)
    try:
        got = [h.result(300) for h in together(eng, reqs)]
        assert counters(eng).peak_rows == 3
        kv = held(eng, "chat6")
        path = str(tmp_path / "chat6.stratasession")
        eng.call(SaveSession(path, messages=reqs[2].messages + [{"role": "assistant", "content": got[2].text}]), 60)
    finally:
        eng.stop()
    assert [r.tokens for r in got] == [r.tokens for r in ref]
    assert kv[0] == ref_kv[0]
    diff = max(float(np.abs(a - b).max()) for a, b in zip(kv[1], ref_kv[1]))
    print(f"batched vs lone K/V: max |d| {diff:.3g}")
    assert diff <= 1e-5, diff
    fresh = start(tiny, 8)
    try:
        fresh.call(RestoreSession(path), 60)
        nxt = fresh.call(next_turn(got[2], reqs[2]), 300)
    finally:
        fresh.stop()
    assert nxt.cached_tokens == ref_next.cached_tokens and nxt.tokens == ref_next.tokens


def test_max_sequences_flag_default_and_range():
    import argparse

    from engine.errors import StrataError
    from engine.frontends.launch import add_engine_flags, engine_options
    from engine.limits import DEFAULT_MAX_SEQUENCES
    p = argparse.ArgumentParser()
    add_engine_flags(p)
    assert engine_options(p.parse_args(["--model", "x.gguf"])).max_sequences == DEFAULT_MAX_SEQUENCES == 8
    assert engine_options(p.parse_args(["--model", "x.gguf", "--max-sequences", "1"])).max_sequences == 1
    assert EngineOptions().max_sequences == 1          # an engine built in code: one at a time unless asked
    for bad in ("0", "257", "-3"):
        with pytest.raises(StrataError, match=f"--max-sequences must be 1 to 256; got {bad}$"):
            engine_options(p.parse_args(["--model", "x.gguf", "--max-sequences", bad]))


def test_quantized_kv_requests_run_alone_and_match(tiny_gguf_wide):
    """8-bit K/V (QuantizedKVCache) is not one mlx-lm's BatchKVCache merges: such requests run alone,
    one after another between steps, and give what the one-at-a-time engine gives."""
    reqs = requests(3)
    solo = start(tiny_gguf_wide, 1, kv_bits=8)
    try:
        ref = alone(solo, reqs)
    finally:
        solo.stop()
    eng = start(tiny_gguf_wide, 8, kv_bits=8)
    try:
        got = [h.result(300) for h in together(eng, reqs)]
        c = counters(eng)
    finally:
        eng.stop()
    assert [r.tokens for r in got] == [r.tokens for r in ref]
    assert c.rows == 0 and c.steps == 0


# ---- a stream joining rows that decode --------------------------------------------------------------
JOINERS = [GenerateRequest(prompt=PROMPTS[1], conversation="j0", sampling=greedy(12)),
           GenerateRequest(prompt=PROMPTS[4], conversation="j1",
                           sampling=SamplingParams(max_tokens=10, temperature=0.9, seed=7)),
           GenerateRequest(prompt=PROMPTS[6], conversation="j2",
                           sampling=SamplingParams(max_tokens=10, temperature=0.0, repetition_penalty=1.3)),
           GenerateRequest(prompt=PROMPTS[7], conversation="j3", sampling=greedy(1)),
           GenerateRequest(prompt=PROMPTS[3], conversation="j4", sampling=greedy(9))]


def test_a_joining_stream_gets_its_first_token_from_its_prompt_and_equals_alone(tiny):
    """Streams that arrive while another decodes read their prompt with its last token and take their
    first token from that pass (engine/generation/batching.py _prefill_chunk), not from the batch's next steps:
    greedy, seeded and penalised rows still equal their lone runs, one of max_tokens=1 ends at that
    token without joining, and the running stream is untouched. On a GPU a joiner's first token then
    costs its prompt's read, not two more steps of the whole batch (bench/concurrency.py)."""
    solo = start(tiny, 1)
    try:
        ref = alone(solo, JOINERS)
        ref_long = solo.call(GenerateRequest(prompt=PROMPTS[0], conversation="long", sampling=greedy(300)), 300)
    finally:
        solo.stop()
    eng = start(tiny, 8)
    try:
        seen = threading.Event()
        count = [0]

        def on(ev):
            if isinstance(ev, Token):
                count[0] += 1
                if count[0] == 3:
                    seen.set()
        long = eng.submit(GenerateRequest(prompt=PROMPTS[0], conversation="long", sampling=greedy(300)), callback=on)
        assert seen.wait(120), "the long stream never started"
        got = []
        for r in JOINERS:           # one at a time, each while the long stream decodes
            got.append(eng.submit(r).result(300))
            assert not long.finished.is_set(), "the long stream ended before every joiner was served"
        long_r = long.result(300)
        c = counters(eng)
    finally:
        eng.stop()
    for i, (a, b) in enumerate(zip(got, ref)):
        assert a.tokens == b.tokens, JOINERS[i].conversation
        assert a.finish_reason == b.finish_reason and a.generated_tokens == b.generated_tokens
    assert got[3].generated_tokens == 1
    assert long_r.tokens == ref_long.tokens
    assert c.first_from_prompt == len(JOINERS), c


def test_a_hybrid_rows_memory_is_its_attention_kv_and_a_fixed_state(tmp_path):
    """The guard is asked for what a row of a Qwen3.5-like model holds: K/V in its attention layers
    (1 in 4) and its fixed recurrent state (the load's estimate), not K/V in every layer."""
    from engine.generation.batching import row_cost
    from engine.model.memory_estimate import estimate, read_header
    from gguf_factory_qwen35 import write_tiny_qwen35_gguf
    path = write_tiny_qwen35_gguf(tmp_path / "q.gguf", "qwen35", n_layer=8, seed=2)
    eng = start(path, 4)
    try:
        per_token, fixed = while_held(eng, row_cost)
        info = eng.call(Status()).info
    finally:
        eng.stop()
    est = estimate(read_header(path), 256, "float32")
    every_layer = 2 * info["n_layer"] * info["n_head_kv"] * info["head_dim"] * 4
    assert per_token == est.kv_bytes_per_token and per_token * 4 == every_layer     # 2 attention layers of 8
    assert fixed == est.state_bytes > 0
