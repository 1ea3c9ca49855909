"""engine/text/context_policy.py: which messages an overflowing conversation sends. Property-style over
seeded random histories: the system prompt is never dropped, the result fits the budget or is
refused, the newest turn is always sent, roles still start each kept turn with a user message, and
the cut is stable as the conversation grows (what keeps the K/V reusable)."""
from __future__ import annotations

import random

import pytest

from engine.text.context_policy import (POLICIES, OverflowRefused, check_policy, reply_reserve, select, smallest,
                                        turn_starts)


def count(messages: list[dict]) -> int:
    """A template-like count: a few tokens a message around its text, a generation prompt."""
    return 2 + sum(4 + len(m["content"]) // 3 for m in messages)


def history(rng: random.Random, turns: int, system: bool = True) -> list[dict]:
    msgs = [{"role": "system", "content": "sys " * rng.randint(1, 30)}] if system else []
    for t in range(turns):
        msgs.append({"role": "user", "content": f"q{t} " + "w" * rng.randint(0, 120)})
        if t < turns - 1 or rng.random() < 0.3:
            msgs.append({"role": "assistant", "content": f"a{t} " + "x" * rng.randint(0, 300)})
    return msgs


@pytest.mark.parametrize("policy", POLICIES)
def test_fits_or_refused_and_keeps_system(policy):
    rng = random.Random(policy)
    for _ in range(400):
        msgs = history(rng, rng.randint(1, 12), system=rng.random() < 0.8)
        budget = rng.randint(5, 900)
        try:
            sel = select(msgs, count, budget, policy)
        except OverflowRefused as e:
            assert str(e) and "\n" not in str(e)
            continue
        assert count(sel.messages) == sel.tokens <= budget
        assert len(sel.messages) + sel.dropped == len(msgs)
        if msgs[0]["role"] == "system":
            assert sel.messages[0] == msgs[0]                       # never drops the system prompt
        last_user = turn_starts(msgs)[-1]
        assert sel.messages[-(len(msgs) - last_user):] == msgs[last_user:]   # the question is sent
        kept_turns = [m for m in sel.messages if m["role"] != "system"]
        assert not kept_turns or kept_turns[0]["role"] == "user"   # roles alternate: a turn starts it
        if policy == "stop":
            assert sel.dropped == 0
        if policy == "truncate_middle" and sel.dropped:
            first = turn_starts(msgs)
            assert sel.messages[:first[1]] == msgs[:first[1]]      # system + the first exchange pinned


def test_nothing_dropped_when_it_fits():
    msgs = history(random.Random(1), 3)
    for policy in POLICIES:
        sel = select(msgs, count, count(msgs), policy)
        assert (sel.messages, sel.dropped) == (msgs, 0)


def test_stop_refuses_an_overflow():
    msgs = history(random.Random(2), 6)
    with pytest.raises(OverflowRefused, match="context leaves it"):
        select(msgs, count, count(msgs) - 1, "stop")


def test_rolling_drops_oldest_first_and_truncate_middle_keeps_the_head():
    msgs = [{"role": "system", "content": "s"}]
    for t in range(10):
        msgs += [{"role": "user", "content": f"question {t} " + "q" * 60},
                 {"role": "assistant", "content": f"answer {t} " + "a" * 60}]
    budget = count(msgs) // 2
    roll = select(msgs, count, budget, "rolling")
    assert roll.dropped > 0 and roll.messages[1]["content"].startswith("question ")
    assert roll.messages[1] == msgs[1 + roll.dropped]             # the oldest turns went, in order
    mid = select(msgs, count, budget, "truncate_middle")
    assert mid.messages[:3] == msgs[:3] and mid.dropped > 0
    assert mid.messages[3] == msgs[3 + mid.dropped]


def test_the_cut_stays_put_as_the_conversation_grows():
    """The next turns keep the same cut until its page no longer fits: the K/V past the pinned head is
    read again once per page, not every turn."""
    rng = random.Random(3)
    msgs = [{"role": "system", "content": "s"}]
    budget = 600
    cuts = []
    for t in range(60):
        msgs.append({"role": "user", "content": "u" * rng.randint(20, 80)})
        sel = select(msgs, count, budget, "rolling")
        cuts.append(sel.dropped)
        msgs.append({"role": "assistant", "content": "a" * rng.randint(40, 160)})
    changes = sum(1 for a, b in zip(cuts, cuts[1:]) if a != b)
    dropping = sum(1 for c in cuts if c)
    assert dropping > 20 and changes < dropping / 2, (changes, dropping, cuts)
    assert cuts == sorted(cuts)                                   # a cut never moves back


def test_refused_when_even_the_question_alone_is_too_long():
    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "x" * 3000}]
    for policy in POLICIES:
        with pytest.raises(OverflowRefused):
            select(msgs, count, 100, policy)


def test_check_policy_and_reserve():
    assert check_policy("rolling") == "rolling"
    with pytest.raises(ValueError, match="strata_overflow must be one of stop, truncate_middle, rolling"):
        check_policy("middle", "strata_overflow")
    assert reply_reserve(512, 256) == 128 and reply_reserve(64, 4096) == 64 and reply_reserve(0, 2) == 1


def test_pages_count_in_the_tokenizers_units():
    """A text of about one token a character (Chinese, say): pages counted in the engine's token sizes
    keep the cut put and the newest turns filling the budget (at a nominal four characters a token a
    page would span the whole budget, and a drop would fall back to the question alone)."""
    def count_chars(messages):
        return 2 + sum(4 + len(m["content"]) for m in messages)
    rng = random.Random(4)
    msgs = [{"role": "system", "content": "s"}]
    budget, cuts, kept = 600, [], []
    for t in range(60):
        msgs.append({"role": "user", "content": "字" * rng.randint(10, 30)})
        sel = select(msgs, count_chars, budget, "rolling", size=lambda m: len(m["content"]))
        assert sel.tokens <= budget
        cuts.append(sel.dropped)
        kept.append(sel.tokens)
        msgs.append({"role": "assistant", "content": "答" * rng.randint(20, 50)})
    assert min(n for n, c in zip(kept, cuts) if c) > budget // 2, kept
    changes = sum(1 for a, b in zip(cuts, cuts[1:]) if a != b)
    dropping = sum(1 for c in cuts if c)
    assert dropping > 30 and changes < dropping / 2, (changes, dropping, cuts)
    assert smallest(msgs[:-1], "rolling") == [msgs[0], msgs[-2]]
    assert smallest(msgs[:-1], "truncate_middle") == msgs[:3] + [msgs[-2]]
