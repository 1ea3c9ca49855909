"""A fork of a conversation (a new conversation id whose messages are a prefix of another's) takes its
K/V from the other one's held prefix: parked in RAM (a prefix copy, the parent stays parked) or in the
disk tier after a restart (the parent's file untouched). The fork's prompt goes on from the parent's own
token ids up to a special token (engine/conversations.continue_tokens), so its greedy reply is the
parent's at that point. Real engine, tiny generated GGUF."""
from __future__ import annotations

import pytest

from engine.api import Status
from engine.cache.conversations import before_special
from engine.engine import Engine, EngineOptions, GenerateRequest
from engine.sampling import SamplingParams
from engine_reads import while_held
from gguf_factory import TRAINING_TEXT

GREEDY = SamplingParams(max_tokens=12, temperature=0)
WORDS = TRAINING_TEXT.split()


def _words(n: int, start: int) -> str:
    return " ".join(WORDS[(start + i) % len(WORDS)] for i in range(n))


def _parent(engine: Engine) -> tuple[list[dict], list]:
    """Three greedy turns of conversation "chat-A": its messages (with the replies) and the results."""
    msgs, out = [{"role": "system", "content": "You are a helpful assistant."}], []
    for i in range(3):
        msgs.append({"role": "user", "content": _words(20, i * 7)})
        r = engine.call(GenerateRequest(messages=list(msgs), sampling=GREEDY, conversation="chat-A"), timeout=300)
        out.append(r)
        msgs.append({"role": "assistant", "content": r.text})
    return msgs, out


def _held(r) -> int:
    """Tokens a conversation holds after a reply that ran to max_tokens (its last token is never fed)."""
    return r.prompt_tokens + min(len(r.tokens), GREEDY.max_tokens - 1)


def _start(model, **kw) -> Engine:
    e = Engine(EngineOptions(model=str(model), **kw)).start()
    e.startup.result()
    return e


@pytest.fixture
def engines(tiny_gguf):
    made = []

    def make(**kw):
        made.append(_start(tiny_gguf, **kw))
        return made[-1]
    yield make
    for e in made:
        e.stop()


def _fork_turn(engine: Engine, msgs: list[dict]):
    """The fork's first reply: the parent's history up to its second question, under a new id."""
    return engine.call(GenerateRequest(messages=msgs[:4], sampling=GREEDY, conversation="chat-B"), timeout=300)


def test_fork_reuses_the_parked_parents_prefix_and_answers_as_it_did(engines, strata_home):
    e = engines(disk_mib=0)
    msgs, parent = _parent(e)
    r = _fork_turn(e, msgs)
    assert r.prompt_tokens == parent[1].prompt_tokens          # the parent's own token ids
    assert r.cached_tokens >= 0.9 * r.prompt_tokens
    assert r.text == parent[1].text
    # the parent's K/V stayed parked whole (the fork took a copy of its prefix)
    held = {c["owner"]: c["tokens"] for c in e.call(Status()).conversations}
    assert held == {"chat-A": _held(parent[2]), "chat-B": _held(r)}


def test_fork_after_a_restart_restores_the_parents_prefix_from_disk(engines, strata_home):
    e = engines(disk_mib=64)
    msgs, parent = _parent(e)
    e.stop()
    e2 = engines(disk_mib=64)
    r = _fork_turn(e2, msgs)
    assert r.restored_from_disk > 0
    assert r.cached_tokens >= 0.9 * r.prompt_tokens
    assert r.text == parent[1].text
    e2.wait_idle(30)
    on_disk = while_held(e2, lambda en: sorted((x.owner, len(x.tokens)) for x in en.disk.entries.values()))
    assert ("chat-A", _held(parent[2])) in on_disk       # the parent's file was not cut back


def test_another_conversations_run_stops_before_a_special_token():
    ids = [5, 6, 99, 7, 8, 99, 9, 10]
    assert before_special(ids, 8, frozenset({99})) == 5
    assert before_special(ids, 5, frozenset({99})) == 2
    assert before_special(ids, 2, frozenset({99})) == 0
    assert before_special(ids, 8, frozenset()) == 0
