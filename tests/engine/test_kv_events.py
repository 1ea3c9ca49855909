"""Parking's moves as typed events (issue 28 item 5): a park, an eviction and a refusal each reach the
request being served as an `events.KVMoved` with the conversation's tokens and K/V bytes and the parking
figures after it: what the app's status bar reacts to, never the log line beside it.

The real engine on a tiny generated GGUF (random weights); slot and byte figures are checked against
the engine's own Status, not against numbers written here.
"""
from __future__ import annotations

from engine.engine import Configure, Engine, EngineOptions, GenerateRequest, Status
from engine.events import KVMove, KVMoved, Log
from engine.sampling import SamplingParams
from gguf_factory import TRAINING_TEXT, write_tiny_gguf

WORDS = TRAINING_TEXT.split()


def chat(n: int, start: int) -> list[dict]:
    return [{"role": "user", "content": " ".join(WORDS[(start + i) % len(WORDS)] for i in range(n))}]


def turn(engine: Engine, messages, conversation: str) -> tuple[object, list[KVMoved], list[str]]:
    h = engine.submit(GenerateRequest(messages=messages, conversation=conversation,
                                      sampling=SamplingParams(max_tokens=4, temperature=0.0)))
    events = list(h.events(timeout=300))
    return (h.result(), [e for e in events if isinstance(e, KVMoved)],
            [e.line for e in events if isinstance(e, Log)])


def test_park_evict_and_refusal_arrive_as_typed_events(tmp_path):
    model = write_tiny_gguf(tmp_path / "tiny.gguf")
    engine = Engine(EngineOptions(model=str(model), cache_mib=64, cache_slots=1)).start()
    try:
        engine.startup.result(120)
        a, moved, _ = turn(engine, chat(40, 0), "a")
        assert moved == []                                  # nothing held before: nothing moved
        b, moved, logs = turn(engine, chat(40, 50), "b")
        (parked,) = moved
        held_a = a.prompt_tokens + min(len(a.tokens), 3)      # the last sampled token is never fed back
        assert parked.kind == KVMove.PARKED and parked.owner == "a" and parked.tokens == held_a
        status = engine.call(Status())
        # The bytes are the ones parking counts: the one parked entry is the whole of its figure.
        assert parked.nbytes > 0 and parked.nbytes == status.parking["bytes"] == parked.parking["bytes"]
        assert any(line.startswith(f"parked {held_a} tokens") for line in logs)   # the log says it too
        # One slot: the third conversation parks "b" and so evicts "a" for the slot limit.
        _, moved, _ = turn(engine, chat(40, 100), "c")
        assert [(m.kind, m.owner) for m in moved] == [(KVMove.EVICTED, "a"), (KVMove.PARKED, "b")]
        assert moved[0].nbytes == parked.nbytes and "slot limit" in moved[0].why
        assert moved[1].parking["entries"] == 1
        # A cap of 0 turns parking off and evicts what it holds: the Configure that did it hears so.
        h = engine.submit(Configure(cache_mib=0))
        moved = [e for e in h.events(timeout=60) if isinstance(e, KVMoved)]
        assert [(m.kind, m.owner) for m in moved] == [(KVMove.EVICTED, "b")]
        assert moved[0].parking["entries"] == 0 and moved[0].nbytes > 0
    finally:
        engine.stop()
