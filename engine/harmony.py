"""gpt-oss's harmony format: a reply's channels told apart (plain Python: the app imports it).

A harmony reply is a run of messages, each ``<|start|>assistant<|channel|>NAME<|message|>BODY`` ended
by ``<|end|>`` (more follows), ``<|return|>`` (the reply is done) or ``<|call|>`` (a tool call). The
generation prompt already wrote ``<|start|>assistant``, so a reply reads

    <|channel|>analysis<|message|>The user greets...<|end|><|start|>assistant<|channel|>final<|message|>Hello!

The ``analysis`` channel is the model's reasoning: shown apart from the reply (collapsed in the app,
``reasoning_content`` from the server); ``final`` is the reply; ``commentary`` messages addressed
``to=functions.NAME`` are tool calls (engine/tool_calls.py parses those) and other commentary is
shown as reply text.

How the text keeps its markers: the tokenizer renders ``MARKERS`` even where it skips special tokens
(as llama.cpp renders <|channel|>, <|message|>, <|start|> and <|constrain|>; Strata also keeps
<|end|> so the channels are delimited), and ends a reply at ``<|return|>`` or ``<|call|>``, not at
``<|end|>`` (engine/tokenizer.py, like llama.cpp's end-of-generation set for this vocabulary).
"""
from __future__ import annotations

import re
from dataclasses import dataclass

MARKERS = ("<|start|>", "<|channel|>", "<|message|>", "<|constrain|>", "<|end|>")
STOPS = ("<|return|>", "<|call|>")            # end of a reply
REASONING_CHANNEL = "analysis"

_MESSAGE = re.compile(r"(?:<\|start\|>)?(?P<head>(?:(?!<\|message\|>|<\|start\|>).)*?)<\|message\|>"
                      r"(?P<body>.*?)(?P<end><\|end\|>|<\|call\|>|<\|return\|>|(?=<\|start\|>)|$)", re.S)
_CHANNEL = re.compile(r"<\|channel\|>\s*(\w+)")


def is_harmony_vocab(token_to_id) -> bool:
    """Whether a vocabulary (a token -> id lookup returning None when absent) speaks harmony."""
    return all(token_to_id(t) is not None for t in ("<|channel|>", "<|message|>") + STOPS)


@dataclass(frozen=True)
class Channels:
    """A harmony reply split: `reasoning` (the analysis channel), `content` (the rest, the reply)."""
    reasoning: str
    content: str


def _held(text: str) -> int:
    """Length of the end of `text` that could be the start of a marker (held back while streaming)."""
    for n in range(min(len(text), max(len(m) for m in MARKERS + STOPS) - 1), 0, -1):
        if any(m.startswith(text[-n:]) for m in MARKERS + STOPS):
            return n
    return 0


def split(text: str, *, final: bool = True) -> Channels:
    """The channels of a reply (or of a reply so far, when not `final`: a marker's possible start is
    held back, so each part only ever grows). Text without any harmony marker is all content (a
    model or a file that does not use the channels); tool-call messages are left out of both."""
    if "<|message|>" not in text and "<|channel|>" not in text:
        return Channels("", text if final else text[:len(text) - _held(text)])
    reasoning, content = [], []
    for m in _MESSAGE.finditer(text):
        head, body = m.group("head"), m.group("body")
        if not m.group("end") and not final:
            body = body[:len(body) - _held(body)]
        channel = _CHANNEL.search(head)
        if "to=functions." in head:
            continue
        if channel is not None and channel.group(1) == REASONING_CHANNEL:
            reasoning.append(body)
        else:
            content.append(body)
    return Channels("".join(reasoning), "".join(content))


class ChannelStream:
    """Feeds a streamed harmony reply; hands back ("reasoning" | "content", delta) items in order."""

    def __init__(self):
        self.text = ""
        self.sent = Channels("", "")

    def feed(self, delta: str) -> list[tuple[str, str]]:
        self.text += delta
        return self._emit(final=False)

    def finish(self) -> list[tuple[str, str]]:
        return self._emit(final=True)

    def _emit(self, final: bool) -> list[tuple[str, str]]:
        now = split(self.text, final=final)
        out = []
        for kind in ("reasoning", "content"):
            old, new = getattr(self.sent, kind), getattr(now, kind)
            if len(new) > len(old) and new.startswith(old):
                out.append((kind, new[len(old):]))
            else:
                new = old           # never take back what went out
            now = Channels(**{**now.__dict__, kind: new})
        self.sent = now
        return out
