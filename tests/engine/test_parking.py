"""Conversation parking (issue 3): the A/B/A scenario, cap and slot limits, the memory guard, steering.

Everything runs the real engine on tiny generated GGUFs (random weights). Random weights make greedy
output degenerate (one token repeated), so most comparisons sample at temperature 0.8 with a fixed
seed (the engine seeds MLX's RNG per request); one comparison stays greedy.

What a conversation holds after a turn ("held"): every prompt token plus every generated token that
was fed back, i.e. all generated tokens but the last one when the reply ran to max_tokens (the last
sampled token is never fed), all of them when it stopped early. The follow-up's prompt starts with
exactly those tokens, so with parking its cached_tokens equals `held`.
"""
from __future__ import annotations

import logging
import re
from pathlib import Path

import numpy as np
import pytest

from engine.engine import Configure, Engine, EngineOptions, GenerateRequest, RestoreSession, SaveSession, Status
from engine.errors import StrataError
from engine.events import Log
from engine.memory.memory_guard import GiB, MemoryGuard, MemoryReading, MemoryUnavailable
from engine.sampling import SamplingParams
from gguf_factory import TRAINING_TEXT, write_tiny_gguf

MIB = 1 << 20
PARKED = re.compile(r"^parked (\d+) tokens in [\d.]+ ms \(bytes=(\d+),")
EVICTED = re.compile(r"^evicted (\d+) tokens \(([\d.]+) MiB\) for (.+)$")
WORDS = TRAINING_TEXT.split()


def words(n: int, start: int = 0) -> str:
    """n words of the factory's training text (wrapping), so the tiny BPE vocab tokenizes it well."""
    return " ".join(WORDS[(start + i) % len(WORDS)] for i in range(n))


def start(model: Path, guard: MemoryGuard | None = None, **opts) -> Engine:
    engine = Engine(EngineOptions(model=str(model), **opts))
    if guard is not None:
        engine.guard = guard
    engine.start()
    assert engine.call(Status(), timeout=120).model, "the model did not load"
    return engine


def ask(engine: Engine, messages: list[dict], conversation: str, *, n: int = 16, temperature: float = 0.8,
        seed: int | None = 1, speed_projection: bool | None = None) -> tuple[dict, list[str]]:
    """One chat request: (result, the Log lines emitted while serving it)."""
    h = engine.submit(GenerateRequest(messages=list(messages), conversation=conversation,
                                      sampling=SamplingParams(max_tokens=n, temperature=temperature, seed=seed),
                                      speed_projection=speed_projection))
    logs = [ev.line for ev in h.events(timeout=300) if isinstance(ev, Log)]
    return h.result(), logs


def held(result: dict, max_tokens: int) -> int:
    """Tokens the K/V holds after a turn (see the module docstring)."""
    return result.prompt_tokens + min(len(result.tokens), max_tokens - 1)


def configure(engine: Engine, **kw) -> tuple[dict, list[str]]:
    h = engine.submit(Configure(**kw))
    logs = [ev.line for ev in h.events(timeout=60) if isinstance(ev, Log)]
    return h.result(), logs


class Chat:
    """A conversation as the app keeps it: messages with the replies appended."""

    def __init__(self, name: str, system: str, *, temperature: float = 0.8, seed: int = 100, n: int = 16):
        self.name, self.temperature, self.seed, self.n = name, temperature, seed, n
        self.messages = [{"role": "system", "content": system}]
        self.turns = 0

    def turn(self, engine: Engine, user: str, **kw) -> tuple[dict, list[str]]:
        self.messages.append({"role": "user", "content": user})
        r, logs = ask(engine, self.messages, self.name, n=self.n, temperature=self.temperature,
                      seed=self.seed + self.turns if self.temperature > 0 else None, **kw)
        self.messages.append({"role": "assistant", "content": r.text})
        self.turns += 1
        return r, logs


def parked_lines(logs: list[str]) -> list[tuple[int, int]]:
    return [(int(m.group(1)), int(m.group(2))) for m in map(PARKED.match, logs) if m]


def evicted_lines(logs: list[str]) -> list[int]:
    return [int(m.group(1)) for m in map(EVICTED.match, logs) if m]


# ---------------------------------------------------------------------------------------- A / B / A

A_SYSTEM = "You are a patient storyteller. You tell long stories about the sea, boats and the village."
A_TURNS = [
    "Tell me the whole story of the little boat: " + words(90),
    "And what did the boy find in the nets that morning?",
    "How did the day end for Margaret and the boy?",
]
B_MESSAGES = [  # a client's chat-title call: other system prompt, short
    {"role": "system", "content": "Write a title for the chat. Five words at most."},
    {"role": "user", "content": "The little boat and the old captain"},
]


def run_aba(model: Path, *, cache_mib: int, with_b: bool, temperature: float) -> dict:
    engine = start(model, cache_mib=cache_mib, cache_slots=4)
    try:
        a = Chat("A", A_SYSTEM, temperature=temperature, n=16)
        r1, _ = a.turn(engine, A_TURNS[0])
        r2, _ = a.turn(engine, A_TURNS[1])
        live_after_a2 = engine.call(Status()).live_tokens
        b_logs: list[str] = []
        rb = None
        if with_b:
            rb, b_logs = ask(engine, B_MESSAGES, "B", n=8, temperature=temperature, seed=7)
        r3, a3_logs = a.turn(engine, A_TURNS[2])
        return {"r1": r1, "r2": r2, "r3": r3, "held": held(r2, 16), "live_after_a2": live_after_a2,
                "b_logs": b_logs, "b_held": held(rb, 8) if rb else 0, "a3_logs": a3_logs, "status": engine.call(Status())}
    finally:
        engine.stop()


@pytest.mark.parametrize("temperature", [0.8, 0.0], ids=["sampled", "greedy"])
def test_aba_with_parking_reuses_all_of_a_and_matches_the_run_without_b(tiny_gguf, temperature):
    ref = run_aba(tiny_gguf, cache_mib=64, with_b=False, temperature=temperature)
    run = run_aba(tiny_gguf, cache_mib=64, with_b=True, temperature=temperature)
    h = run["held"]
    # A's history held after its second turn: prompt of turn 2 + its reply (bar the last, unfed token).
    assert h == run["live_after_a2"] == ref["held"]
    assert run["r2"].cached_tokens > 0                  # turn 2 continued turn 1 (sanity)
    # B parks A whole, with the logged line; A's follow-up takes it back whole.
    assert [n for n, _ in parked_lines(run["b_logs"])] == [h], run["b_logs"]
    assert any(line.startswith(f"restored {h} tokens (moved) in ") for line in run["a3_logs"]), run["a3_logs"]
    assert run["r3"].cached_tokens == h
    assert run["r3"].cached_tokens == ref["r3"].cached_tokens
    # Token for token what a run without B produced.
    for k in ("r1", "r2", "r3"):
        assert run[k].tokens == ref[k].tokens, k
    assert run["r3"].prompt_tokens == ref["r3"].prompt_tokens
    # B is parked in turn (A's follow-up switched away from it).
    assert parked_lines(run["a3_logs"])[0][0] == run["b_held"]
    assert run["b_held"] in run["status"].parking["tokens"]


def test_aba_without_parking_rereads_a(tiny_gguf):
    run = run_aba(tiny_gguf, cache_mib=0, with_b=True, temperature=0.8)
    assert run["r2"].cached_tokens > 0                  # the live conversation still continues
    assert parked_lines(run["b_logs"]) == []
    assert run["r3"].cached_tokens == 0
    assert run["status"].parking == {"entries": 0, "bytes": 0, "cap_bytes": 0, "slots": 4, "tokens": []}


@pytest.mark.parametrize("limit", ["one slot", "cap for one"])
def test_aba_when_the_cache_holds_one_conversation(mib_gguf, limit):
    """Resuming A must not evict A: with room for one parked conversation, B's parking would push A
    out if A were not taken back first."""
    kw = {"cache_mib": 8, "cache_slots": 1} if limit == "one slot" else {"cache_mib": 1, "cache_slots": 4}
    engine = start(mib_gguf, **kw)
    try:
        a = Chat("A", A_SYSTEM, n=8)
        r1, _ = a.turn(engine, words(60, 3))
        h = held(r1, 8)
        assert h < 256                                     # 1 MiB (see mib_gguf)
        _, logs = ask(engine, B_MESSAGES, "B", n=8)
        assert [n for n, _ in parked_lines(logs)] == [h]
        r, logs = a.turn(engine, "And then?")
        assert r.cached_tokens == h, logs
        assert any(line.startswith(f"restored {h} tokens (moved)") for line in logs), logs
        # B took A's place in the cache.
        assert engine.call(Status()).parking["entries"] == 1
    finally:
        engine.stop()


# ---------------------------------------------------------------------------------------- slots, LRU

def test_slot_limit_evicts_the_least_recently_used(tiny_gguf):
    engine = start(tiny_gguf, cache_mib=64, cache_slots=3)
    try:
        chats, helds = [], []
        for i in range(3):                                 # C0, C1, C2: C0 and C1 parked, in that order
            c = Chat(f"C{i}", words(14, 100 * i + 200) + f" (assistant {i})")
            r, logs = c.turn(engine, words(30, 10 + 30 * i))
            if i:
                assert [n for n, _ in parked_lines(logs)] == [helds[-1]]
            chats.append(c)
            helds.append(held(r, 16))
        # C0 edited (same system prompt, another first message): served by a prefix copy of C0, which
        # marks C0 used; C0 stays parked. C1 is now the least recently used, though C0 was parked first.
        c0e = Chat("C0-edit", chats[0].messages[0]["content"])
        r, logs = c0e.turn(engine, words(3, 10) + " but then something else happened")
        assert any(re.match(rf"restored \d+ of {helds[0]} tokens \(prefix copy\)", l) for l in logs), logs
        assert 16 <= r.cached_tokens < helds[0]
        assert [n for n, _ in parked_lines(logs)] == [helds[2]] and evicted_lines(logs) == []
        h0e = held(r, 16)
        st = engine.call(Status()).parking
        assert st["entries"] == 3 and st["tokens"] == [helds[0], helds[1], helds[2]] and st["slots"] == 3
        # One more conversation: three slots taken, so parking C0-edit evicts C1 (LRU), not C0 (FIFO).
        c3 = Chat("C3", words(14, 600) + " (assistant 3)")
        _, logs = c3.turn(engine, words(30, 70))
        assert evicted_lines(logs) == [helds[1]], logs
        assert any(l.startswith("evicted") and l.endswith("for the slot limit (3 slots)") for l in logs), logs
        assert [n for n, _ in parked_lines(logs)] == [h0e]
        assert logs.index(next(l for l in logs if l.startswith("evicted"))) < \
            logs.index(next(l for l in logs if l.startswith("parked")))
        assert engine.call(Status()).parking["tokens"] == [helds[0], helds[2], h0e]
        # C0 moves back whole (taken before C3 is parked, so it is not evicted to make room for C3).
        r, logs = chats[0].turn(engine, "Go on.")
        assert r.cached_tokens == helds[0]
        assert any(line.startswith(f"restored {helds[0]} tokens (moved)") for line in logs), logs
        assert evicted_lines(logs) == []
        # C1 is really gone: its follow-up is read from scratch.
        r, _ = chats[1].turn(engine, "Go on.")
        assert r.cached_tokens == 0
    finally:
        engine.stop()


# ---------------------------------------------------------------------------------------- the cap

@pytest.fixture(scope="module")
def mib_gguf(tmp_path_factory) -> Path:
    """4 layers x 4 K/V heads x head_dim 32, fp32 on the CPU: mlx-lm's KVCache grows in steps of 256
    cells, and 256 cells x 4 layers x (K+V) x 4 heads x 32 x 4 B = exactly 1 MiB, so a conversation
    of < 256 tokens holds 1 MiB and the cap arithmetic is in whole MiB."""
    return write_tiny_gguf(tmp_path_factory.mktemp("mib") / "mib-per-256.gguf", arch="llama", n_layer=4,
                           n_embd=64, n_head=4, n_head_kv=4, head_dim=32, n_ff=128, seed=5)


def _small(i: int) -> Chat:
    # Distinct from the first word on: no prefix worth reusing between two of them.
    return Chat(f"D{i}", words(10, 50 * i) + f" (assistant number {i})", n=8)


def test_cap_evicts_lru_and_an_oversized_entry_is_refused_alone(mib_gguf):
    engine = start(mib_gguf, cache_mib=3, cache_slots=8)
    try:
        chats, helds = [], []
        for i in range(5):
            c = _small(i)
            r, logs = c.turn(engine, words(40, 30 * i))
            chats.append(c)
            helds.append(held(r, 8))
            assert held(r, 8) < 256
            if 1 <= i <= 3:   # D0..D2 parked as D1..D3 arrive, each exactly 1 MiB
                assert parked_lines(logs) == [(helds[i - 1], MIB)], logs
                assert evicted_lines(logs) == []
        # D4 arrived with D0, D1, D2, D3 to park: 3 MiB cap, so D0 (least recently used) went first.
        assert evicted_lines(logs) == [helds[0]], logs
        assert parked_lines(logs) == [(helds[3], MIB)]
        st = engine.call(Status()).parking
        assert st == {"entries": 3, "bytes": 3 * MIB, "cap_bytes": 3 * MIB, "slots": 8,
                      "tokens": [helds[1], helds[2], helds[3]]}

        # A conversation of ~800 tokens holds 1024 cells = 4 MiB: alone more than the whole cap.
        big = Chat("BIG", "You read long texts. " + words(10, 7), n=8)
        r, logs = big.turn(engine, words(400, 3))
        big_held = held(r, 8)
        assert 768 < big_held <= 1024
        assert evicted_lines(logs) == [helds[1]]           # parking D4 evicts D1 (LRU)
        kept = engine.call(Status()).parking
        assert kept["tokens"] == [helds[2], helds[3], helds[4]]
        # Switching away from BIG: refused alone, nothing else evicted.
        e5 = _small(5)
        r5, logs = e5.turn(engine, words(40, 99))
        assert f"not parked: {big_held} tokens need 4.0 MiB, more than the whole cap of 3 MiB" in logs, logs
        assert evicted_lines(logs) == [] and parked_lines(logs) == []
        assert engine.call(Status()).parking == kept
        # The others really are still there: D2 moves back whole.
        r, logs = chats[2].turn(engine, "Go on.")
        assert r.cached_tokens == helds[2]
        # ...and BIG is gone.
        r, _ = big.turn(engine, "Go on.")
        assert r.cached_tokens == 0
    finally:
        engine.stop()


def test_configure_changes_the_cap_and_slots_at_run_time(mib_gguf):
    engine = start(mib_gguf, cache_mib=3, cache_slots=8)
    try:
        helds = []
        for i in range(4):
            r, _ = _small(i).turn(engine, words(40, 30 * i))
            helds.append(held(r, 8))
        st = engine.call(Status()).parking
        assert st["entries"] == 3 and st["bytes"] == 3 * MIB and st["cap_bytes"] == 3 * MIB
        # Down to 1 MiB: the two least recently used go, in that order.
        status, logs = configure(engine, cache_mib=1)
        assert evicted_lines(logs) == [helds[0], helds[1]], logs
        assert "conversation cache: 1 MiB, 8 slots" in logs
        assert status.parking == {"entries": 1, "bytes": MIB, "cap_bytes": MIB, "slots": 8, "tokens": [helds[2]]}
        assert engine.call(Status()).parking == status.parking
        # Slots: up the cap again, then one slot.
        configure(engine, cache_mib=8)
        _small(4).turn(engine, words(40, 120))             # parks D3
        assert engine.call(Status()).parking["tokens"] == [helds[2], helds[3]]
        status, logs = configure(engine, cache_slots=1)
        assert evicted_lines(logs) == [helds[2]] and "conversation cache: 8 MiB, 1 slots" in logs
        assert status.parking["tokens"] == [helds[3]]
        # Bad settings are refused and change nothing.
        for kw, why in (({"cache_slots": 0}, "slots must be 1 to 64; got 0"),
                        ({"cache_mib": -1}, r"must be 0 to \d+ MiB \(half of this machine's .*\); got -1 MiB")):
            with pytest.raises(StrataError, match=why):
                engine.call(Configure(**kw))
        with pytest.raises(StrataError, match="half of this machine's"):
            engine.call(Configure(cache_mib=1 << 30))
        assert engine.call(Status()).parking == status.parking
        # Off: everything parked goes, nothing is parked any more, switching back reads from scratch.
        status, logs = configure(engine, cache_mib=0)
        assert status.parking["entries"] == 0 and status.parking["cap_bytes"] == 0
        d5 = _small(5)
        d5.turn(engine, words(40, 150))
        r, logs = _small(6).turn(engine, words(40, 170))
        assert parked_lines(logs) == [] and not any(l.startswith("not parked") for l in logs)
        r, _ = d5.turn(engine, "Go on.")
        assert r.cached_tokens == 0
    finally:
        engine.stop()


# ---------------------------------------------------------------------------------------- memory guard

class FailingReader:
    """A memory reader that cannot read (as on a platform without a reader)."""
    REASON = "test: /proc/meminfo is not mounted in this sandbox"

    def __call__(self) -> MemoryReading:
        raise MemoryUnavailable(self.REASON)


def test_unreadable_memory_refuses_parking_and_sessions_and_keeps_serving(tiny_gguf, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="strata")
    engine = start(tiny_gguf, guard=MemoryGuard(reader=FailingReader()), cache_mib=64)
    try:
        reason = FailingReader.REASON
        assert (f"memory guard: the available RAM cannot be read ({reason}); parking and session "
                "save/restore are refused") in caplog.messages
        a = Chat("A", A_SYSTEM)
        r1, _ = a.turn(engine, A_TURNS[0])
        rb, logs = ask(engine, B_MESSAGES, "B", n=8)
        assert f"not parked: {reason}" in logs and parked_lines(logs) == []
        assert rb.generated_tokens == 8                 # B is served all the same
        r, _ = a.turn(engine, A_TURNS[1])
        assert r.cached_tokens == 0                     # A was not kept
        with pytest.raises(StrataError, match=re.escape(f"session save refused: {reason}")):
            engine.call(SaveSession(str(tmp_path / "s.stratasession")))
        with pytest.raises(StrataError, match=re.escape(f"session restore refused: {reason}")):
            engine.call(RestoreSession(str(tmp_path / "s.stratasession")))
        assert not (tmp_path / "s.stratasession").exists()
        st = engine.call(Status())
        assert st.memory is None and st.memory_unavailable == reason
        assert st.parking["entries"] == 0
        r, _ = a.turn(engine, A_TURNS[2])                  # still serving, and continuing A
        assert r.cached_tokens > 0 and r.generated_tokens == 16
    finally:
        engine.stop()


class TightReader:
    """A memory reader whose available RAM the test sets (a real reading of a pretend machine)."""

    def __init__(self, available: int):
        self.available = available

    def __call__(self) -> MemoryReading:
        return MemoryReading(total_bytes=16 * GiB, available_bytes=self.available, source="test")


def test_reserve_evicts_then_refuses(tiny_gguf):
    reader = TightReader(8 * GiB)           # reserve: max(1 GiB, 10% of 16 GiB) = 1.6 GiB
    engine = start(tiny_gguf, guard=MemoryGuard(reader=reader), cache_mib=64)
    try:
        a, b = Chat("A", A_SYSTEM), Chat("B", B_MESSAGES[0]["content"])
        ra, _ = a.turn(engine, A_TURNS[0])
        _, logs = b.turn(engine, B_MESSAGES[1]["content"])
        assert [n for n, _ in parked_lines(logs)] == [held(ra, 16)]
        reader.available = 1 * GiB          # now below the reserve
        _, logs = ask(engine, [{"role": "user", "content": words(30, 5)}], "C")
        assert evicted_lines(logs) == [held(ra, 16)] and \
            any(l.endswith("for the memory guard's reserve") for l in logs), logs
        assert ("not parked: needs 0.0 GiB but only 1.0 GiB is available and 1.6 GiB must stay free "
                "(source: test)") in logs
        assert engine.call(Status()).parking["entries"] == 0
    finally:
        engine.stop()


# ---------------------------------------------------------------------------------------- steering

def test_kv_is_never_reused_across_steering_settings(tiny_gguf, tmp_path):
    from engine.steer.control_vector import SteeringConfig, write_control_vector
    rng = np.random.default_rng(3)
    vec = tmp_path / "steer.gguf"
    write_control_vector(vec, {1: (rng.standard_normal(64) * 4).astype(np.float32)}, model_hint="llama")
    engine = start(tiny_gguf, cache_mib=64, steering=SteeringConfig(files=((str(vec), 1.0),)))
    try:
        a = Chat("A", A_SYSTEM)
        r1, _ = a.turn(engine, A_TURNS[0], speed_projection=True)
        assert r1.speed_projection is True
        h1 = held(r1, 16)
        # The same conversation with the vector off: the steered K/V is parked, not reused.
        r2, logs = a.turn(engine, A_TURNS[1], speed_projection=False)
        assert r2.speed_projection is False
        assert r2.cached_tokens == 0
        assert [n for n, _ in parked_lines(logs)] == [h1]
        h2 = held(r2, 16)
        assert h2 > h1
        # Back on: only the steered entry (A's first turn) is reused, not the longer unsteered one.
        r3, logs = a.turn(engine, A_TURNS[2], speed_projection=True)
        assert [n for n, _ in parked_lines(logs)] == [h2]
        assert r3.cached_tokens == h1
        assert any(line.startswith(f"restored {h1} tokens (moved)") for line in logs), logs
        # The vector does change the computation (otherwise the test above would prove little).
        ref = start(tiny_gguf, cache_mib=64)
        try:
            plain, _ = Chat("A", A_SYSTEM).turn(ref, A_TURNS[0])
        finally:
            ref.stop()
        assert plain.tokens != r1.tokens
    finally:
        engine.stop()


def test_entry_text_grows_with_its_tokens_and_common_prefix_is_exact(tiny_gguf):
    # KVEntry.text is what a follow-up's rendered chat is checked against: it must equal decoding
    # the whole token list after every in-place growth, and start over when the list is replaced.
    from engine.model.gguf_file import open_gguf
    from engine.cache.parking import KVEntry, common_prefix
    from engine.text.tokenizer import load_tokenizer
    tok = load_tokenizer(open_gguf(tiny_gguf))
    rng = np.random.default_rng(5)
    ids = tok.encode(TRAINING_TEXT[:400], add_bos=False)
    e = KVEntry(ids[:50], [], "k")
    assert e.text(tok) == tok.decode(ids[:50], skip_special=False)
    for n in (51, 58, 120, 121, len(ids)):
        e.tokens.extend(ids[len(e.tokens):n])          # prefill/decode append in place
        assert e.text(tok) == tok.decode(ids[:n], skip_special=False)
    for t in rng.integers(3, tok.backend.get_vocab_size(), 40):      # any ids one at a time (lone bytes: broken UTF-8)
        e.tokens.append(int(t))
        assert e.text(tok) == tok.decode(e.tokens, skip_special=False)
    assert e.text(tok, skip=1) == tok.decode(e.tokens[1:], skip_special=False)
    e.tokens = e.tokens[:30]                           # a trim replaces the list
    assert e.text(tok) == tok.decode(ids[:30], skip_special=False)
    for a, b in [([], [1]), ([1, 2, 3], [1, 2, 3]), ([1, 2, 3], [1, 2, 4]), (list(range(1000)), list(range(999)) + [5]),
                 (list(range(9)), list(range(4)) + [0] * 5), ([2], [3])]:
        want = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        assert common_prefix(a, b) == want


# ---------------------------------------------------------------------------------------- side requests, branches

def test_side_requests_leave_every_conversation_in_place(tiny_gguf):
    """A title request (side=True): no park, no eviction, no slot; the live conversation continues."""
    engine = start(tiny_gguf, cache_mib=64, cache_slots=1)
    try:
        a, b = Chat("A", A_SYSTEM), Chat("B", words(14, 300))
        rb, _ = b.turn(engine, words(20, 40))
        ra, logs = a.turn(engine, A_TURNS[0])
        assert [n for n, _ in parked_lines(logs)] == [held(rb, 16)]          # B parked, in the one slot
        before = engine.call(Status())
        h = engine.submit(GenerateRequest(messages=[{"role": "user", "content": "Title for: " + A_TURNS[0]}],
                                          conversation="title-A", side=True,
                                          sampling=SamplingParams(max_tokens=6, temperature=0.0)))
        side_logs = [ev.line for ev in h.events(timeout=60) if isinstance(ev, Log)]
        assert h.result().generated_tokens >= 1
        assert parked_lines(side_logs) == [] and evicted_lines(side_logs) == []
        after = engine.call(Status())
        assert after.live_tokens == before.live_tokens == held(ra, 16)
        assert after.parking == before.parking
        r, logs = a.turn(engine, A_TURNS[1])
        assert r.cached_tokens == held(ra, 16) and parked_lines(logs) == []
    finally:
        engine.stop()


def test_a_new_branch_of_a_conversation_reuses_its_slot(tiny_gguf):
    """Regenerate (the same messages without the last reply) and Edit (an earlier message changed)
    trim the conversation's own K/V, live or parked, instead of parking the old branch beside it."""
    engine = start(tiny_gguf, cache_mib=64, cache_slots=4)
    try:
        a = Chat("A", A_SYSTEM)
        a.turn(engine, A_TURNS[0])
        r1, _ = a.turn(engine, A_TURNS[1])
        regen = a.messages[:-1]                                   # Regenerate: drop the last reply
        r, logs = ask(engine, regen, "A")
        assert parked_lines(logs) == [] and r.cached_tokens == r1.prompt_tokens - 1
        assert engine.call(Status()).parking["entries"] == 0
        Chat("B", words(14, 300)).turn(engine, words(20, 40))   # A parked now
        edit = a.messages[:1] + [{"role": "user", "content": A_TURNS[0] + " (edited)"}]
        r, logs = ask(engine, edit, "A")
        assert any(re.match(r"restored \d+ tokens of \d+ \(own slot, trimmed\)", l) for l in logs), logs
        assert r.cached_tokens >= 16
        st = engine.call(Status()).parking
        assert st["entries"] == 1                                 # B only: A's old branch is gone
    finally:
        engine.stop()
