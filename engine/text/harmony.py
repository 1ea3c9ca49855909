"""gpt-oss's harmony format: a reply's channels told apart (plain Python: the app imports it).

A harmony reply is a run of messages, each ``<|start|>assistant<|channel|>NAME<|message|>BODY`` ended
by ``<|end|>`` (more follows), ``<|return|>`` (the reply is done) or ``<|call|>`` (a tool call). The
generation prompt already wrote ``<|start|>assistant``, so a reply reads

    <|channel|>analysis<|message|>The user greets...<|end|><|start|>assistant<|channel|>final<|message|>Hello!

The ``analysis`` channel is the model's reasoning: shown apart from the reply (collapsed in the app,
``reasoning_content`` from the server); ``final`` is the reply; ``commentary`` messages addressed
``to=functions.NAME`` are tool calls (engine/frontends/tool_calls.py parses those) and other commentary is
shown as reply text.

How the text keeps its markers: the tokenizer renders ``MARKERS`` even where it skips special tokens
(as llama.cpp renders <|channel|>, <|message|>, <|start|> and <|constrain|>; Strata also keeps
<|end|> so the channels are delimited), and ends a reply at ``<|return|>`` or ``<|call|>``, not at
``<|end|>`` (engine/text/tokenizer.py, like llama.cpp's end-of-generation set for this vocabulary).
"""
from __future__ import annotations

import re
from dataclasses import dataclass

MARKERS = ("<|start|>", "<|channel|>", "<|message|>", "<|constrain|>", "<|end|>")
STOPS = ("<|return|>", "<|call|>")            # end of a reply
REASONING_CHANNEL = "analysis"

_CHANNEL = re.compile(r"<\|channel\|>\s*(\w+)")
_ENDS = ("<|end|>", "<|call|>", "<|return|>")   # a message's body ends at one of these (consumed) or at <|start|>


def is_harmony_vocab(token_to_id) -> bool:
    """Whether a vocabulary (a token -> id lookup returning None when absent) speaks harmony."""
    return all(token_to_id(t) is not None for t in ("<|channel|>", "<|message|>") + STOPS)


@dataclass(frozen=True)
class Channels:
    """A harmony reply split: `reasoning` (the analysis channel), `content` (the rest, the reply)."""
    reasoning: str
    content: str


_LONGEST = max(len(m) for m in MARKERS + STOPS)


def _held(text: str) -> int:
    """Length of the end of `text` that could be the start of a marker (held back while streaming).
    Every marker starts with its only "<", so the one candidate starts at the last "<"."""
    i = text.rfind("<", max(0, len(text) - _LONGEST + 1))
    if i < 0:
        return 0
    tail = text[i:]
    return len(tail) if any(len(m) > len(tail) and m.startswith(tail) for m in MARKERS + STOPS) else 0


def has_markers(text: str) -> bool:
    return "<|message|>" in text or "<|channel|>" in text


class _Parser:
    """The messages of a reply, read left to right as it grows. Each message: an optional <|start|>,
    a head (role, channel, recipient) up to <|message|>, a body up to <|end|> / <|call|> / <|return|>
    (consumed) or the next <|start|> (not consumed) or the end of the text. Text between messages
    that is not a head (a head never holds <|start|>) is skipped. A closed message is never read
    again and the open body is searched for its end from where the last search stopped: a reply fed
    a token at a time is not re-parsed from its start at every token (measured, 4-character feeds:
    34,000 characters 0.26 s in all, 136,000 2.2 s -- what grows is copying the growing text)."""

    def __init__(self):
        self.marked = False        # a marker has been seen: the text is harmony
        self.pos = 0               # where the next message (or the open one's head) starts
        self.body = -1             # the open message's body start (-1: no open body)
        self.kind = ""             # the open message's part: "reasoning", "content" or "" (a tool call)
        self.searched = 0          # the open body has no end marker before this
        self.closed = Channels("", "")   # the closed messages' parts

    def advance(self, text: str, final: bool) -> Channels:
        if not self.marked:
            if not has_markers(text):
                return Channels("", text if final else text[:len(text) - _held(text)])
            self.marked = True
        while True:
            if self.body < 0 and not self._head(text, final):
                break
            end, size = self._body_end(text)
            if end < 0:
                break
            self._close(text[self.body:end])
            self.pos, self.body = end + size, -1
        if self.body < 0 or not self.kind:
            return self.closed
        body = text[self.body:]
        return self._plus(self.kind, body if final else body[:len(body) - _held(body)])

    def _head(self, text: str, final: bool) -> bool:
        """Read the next message's head; False when it is not all there (yet)."""
        while True:
            if text.startswith("<|start|>", self.pos):
                self.pos += len("<|start|>")
            m, st = text.find("<|message|>", self.pos), text.find("<|start|>", self.pos)
            if m < 0:
                return False
            if 0 <= st < m:            # not a head: skip to the next message
                self.pos = st
                continue
            head = text[self.pos:m]
            channel = _CHANNEL.search(head)
            self.kind = ("" if "to=functions." in head else
                         "reasoning" if channel is not None and channel.group(1) == REASONING_CHANNEL else "content")
            self.body = self.searched = m + len("<|message|>")
            return True

    def _body_end(self, text: str) -> tuple[int, int]:
        """(where the open body ends, the length of the marker consumed there), or (-1, 0)."""
        start = self.searched
        found = [(i, len(e)) for e in _ENDS if (i := text.find(e, start)) >= 0]
        st = text.find("<|start|>", start)
        if st >= 0:
            found.append((st, 0))
        if not found:
            # the next search starts where a marker cut off at the end of the text could begin
            self.searched = max(start, len(text) - max(map(len, _ENDS + ("<|start|>",))) + 1)
            return -1, 0
        return min(found)

    def _close(self, body: str) -> None:
        if self.kind:
            self.closed = self._plus(self.kind, body)

    def _plus(self, kind: str, text: str) -> Channels:
        c = self.closed
        if kind == "reasoning":
            return Channels(c.reasoning + text, c.content)
        return Channels(c.reasoning, c.content + text)


def split(text: str, *, final: bool = True) -> Channels:
    """The channels of a reply (or of a reply so far, when not `final`: a marker's possible start is
    held back, so each part only ever grows). Text without any harmony marker is all content (a
    model or a file that does not use the channels); tool-call messages are left out of both."""
    return _Parser().advance(text, final)


class ChannelStream:
    """Feeds a streamed harmony reply; hands back ("reasoning" | "content", delta) items in order
    (their sums are `split` of the whole text, tested). `split(text, final)`: another way to tell the
    parts of a reply so far (engine/text/reasoning.py's <think> block)."""

    def __init__(self, split=None):
        self.text = ""
        self.sent = Channels("", "")
        self.split = split or _Parser().advance

    def feed(self, delta: str) -> list[tuple[str, str]]:
        self.text += delta
        return self._emit(final=False)

    def finish(self) -> list[tuple[str, str]]:
        return self._emit(final=True)

    def _emit(self, final: bool) -> list[tuple[str, str]]:
        now = self.split(self.text, final)
        out, parts = [], []
        for kind, old, new in (("reasoning", self.sent.reasoning, now.reasoning),
                               ("content", self.sent.content, now.content)):
            if len(new) > len(old) and new.startswith(old):
                out.append((kind, new[len(old):]))
            else:
                new = old           # never take back what went out
            parts.append(new)
        self.sent = Channels(*parts)
        return out
