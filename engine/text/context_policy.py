"""What a conversation longer than the context sends: the overflow policies, shared by the engine
(GenerateRequest.overflow: the app's chats and the server's `strata_overflow` field) and the app's meter.

| policy          | what is sent when the history does not fit                         | K/V reuse                      |
|-----------------|--------------------------------------------------------------------|--------------------------------|
| stop            | everything; a prompt over the context is refused, a reply stops at its end | all of it, until full  |
| truncate_middle | the system prompt and the first exchange, then the newest turns    | the pinned head stays cached   |
| rolling         | the system prompt, then the newest turns                           | only the system prompt         |

A turn is a user message with the replies (and tool results) after it, dropped whole so that the
roles still alternate as chat templates require (truncate_middle therefore keeps the first user
message's reply with it). The newest turn (the question) is never dropped.

Conversation K/V is keyed by token prefix (engine/cache/conversations.py): a drop changes the prompt right
after the pinned head, so that head is the prompt's cached part and the rest is read again once.
To make that "once" and not "every turn", drops happen in pages: the places a cut may fall are fixed
by the history's own text (every 1/PAGE_FRACTION of the budget, counted from the first droppable turn in
each message's own size: the engine gives its tokens, else characters at a nominal rate), so the next
turns, which only add to the end, keep the same cut and extend the K/V held for it until that page no
longer fits. Stateless: the server's clients resend the whole history.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

POLICIES = ("stop", "truncate_middle", "rolling")
DEFAULT_POLICY = "stop"
# The places a cut may fall are 1/PAGE_FRACTION of the budget apart (in tokens): a drop frees about
# that much room, so the turns after it read the history again only that rarely.
PAGE_FRACTION = 4
NOMINAL_CHARS_PER_TOKEN = 4           # a message's size without a tokenizer (the default `size`)


class OverflowRefused(ValueError):
    """Even with every droppable turn left out, the prompt does not fit (one line, for people)."""


@dataclass(frozen=True)
class Selection:
    messages: list[dict]          # what is sent
    dropped: int                  # how many messages were left out
    tokens: int                   # the prompt's length in tokens (the counting function's figure)


def check_policy(policy: object, field: str = "overflow") -> str:
    """`policy` if it is one of POLICIES, else ValueError naming `field` and the choices."""
    if policy not in POLICIES:
        raise ValueError(f"{field} must be one of {', '.join(POLICIES)} (got {policy!r})")
    return str(policy)


def reply_reserve(max_tokens: int, n_ctx: int) -> int:
    """The room a prompt leaves for the reply: the max tokens setting, at most half the context (a
    setting as large as the context would leave a history no room at all)."""
    return max(1, min(int(max_tokens), n_ctx // 2))


def turn_starts(messages: list[dict]) -> list[int]:
    """The index of each turn's first message: each user message (a leading run of other roles,
    the system prompt, is no turn)."""
    return [i for i, m in enumerate(messages) if m.get("role") == "user"]


def message_text(message: dict) -> str:
    """A message's text (the text parts of a content list)."""
    content = message.get("content")
    if isinstance(content, list):
        return "".join(str(p.get("text") or "") for p in content if isinstance(p, dict))
    return str(content or "")


def nominal_size(message: dict) -> int:
    """A message's size in tokens at the nominal characters a token (no tokenizer at hand)."""
    return -(-len(message_text(message)) // NOMINAL_CHARS_PER_TOKEN)


def smallest(messages: list[dict], policy: str) -> list[dict]:
    """What `policy` sends with every droppable turn left out: the pinned head and the last turn."""
    starts = turn_starts(messages)
    head = _pinned_end(messages, starts, policy)
    last = starts[-1] if starts else len(messages)
    return messages[:head] + messages[max(head, last):]


def select(messages: list[dict], count: Callable[[list[dict]], int], budget: int, policy: str,
           size: Callable[[dict], int] = nominal_size) -> Selection:
    """The messages to send so that `count(messages) <= budget` under `policy` (see the module's table),
    leaving out as few pages of turns as fits (pages of `budget // PAGE_FRACTION` in `size`, one
    message's tokens). "stop" never drops: a prompt over the budget is refused (OverflowRefused), as is
    one that no drop makes fit."""
    check_policy(policy)
    n = count(messages)
    if n <= budget:
        return Selection(list(messages), 0, n)
    starts = turn_starts(messages)
    head = _pinned_end(messages, starts, policy)
    last = starts[-1] if starts else len(messages)
    if policy == "stop" or head >= last:
        raise OverflowRefused(f"the prompt is {n} tokens and the context leaves it {budget}"
                              + ("" if policy == "stop" else "; nothing more can be left out"))
    cuts = _cut_points(messages, [s for s in starts if head < s <= last], head, budget, size)
    lo, hi = 0, len(cuts) - 1            # the smallest cut that fits: dropping more never lengthens it
    kept = messages[:head] + messages[cuts[hi]:]
    n_hi = count(kept)
    if n_hi > budget:
        raise OverflowRefused(f"the prompt is {n_hi} tokens with every earlier turn left out; "
                              f"the context leaves it {budget}")
    best, best_n = hi, n_hi
    while lo < hi:
        mid = (lo + hi) // 2
        n_mid = count(messages[:head] + messages[cuts[mid]:])
        if n_mid <= budget:
            best, best_n, hi = mid, n_mid, mid
        else:
            lo = mid + 1
    return Selection(messages[:head] + messages[cuts[best]:], cuts[best] - head, best_n)


def _pinned_end(messages: list[dict], starts: list[int], policy: str) -> int:
    """Where the messages that are never dropped end: the leading system messages, and for
    truncate_middle the first turn too."""
    if policy == "truncate_middle" and len(starts) > 1:
        return starts[1]
    return starts[0] if starts else len(messages)


def _cut_points(messages: list[dict], starts: list[int], head: int, budget: int,
                size: Callable[[dict], int]) -> list[int]:
    """The turn starts a kept tail may begin at: the first turn start at or past each page (counted
    from `head` in `size`, so the same history gives the same cuts), and the last turn."""
    page = max(1, budget // PAGE_FRACTION)
    cuts, total, i, next_page = [], 0, head, page
    for s in starts:
        total += sum(size(m) for m in messages[i:s])
        i = s
        if total >= next_page or s == starts[-1]:
            cuts.append(s)
            next_page = (total // page + 1) * page
    return cuts
