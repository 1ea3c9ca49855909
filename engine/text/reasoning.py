"""A reply's <think> block told apart from the reply (Qwen3, Qwen3.5/3.6, DeepSeek-R1 style; plain Python:
the app imports it).

Such a template opens the block in its generation prompt (`<|im_start|>assistant\\n<think>\\n`), so the
reply starts inside it and closes it with `</think>`; a model whose template does not open it writes
`<think>` itself as its first text. The block is the model's reasoning: shown apart (collapsed in the
app, `reasoning_content` from the server), and not sent back (these templates drop an earlier turn's
reasoning themselves). gpt-oss's channels are engine/text/harmony.py's; `split_reply` takes either.
"""
from __future__ import annotations

from engine.text import harmony
from engine.text.harmony import Channels

OPEN, CLOSE = "<think>", "</think>"


def opens_think(generation_prompt: str) -> bool:
    """Whether a template's generation prompt (what it appends for the reply) opens the block."""
    return generation_prompt.rstrip().endswith(OPEN)


def _partial(text: str, tag: str) -> int:
    """Length of the end of `text` that could be the start of `tag` (held back while streaming)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


def split(text: str, opened: bool, *, final: bool = True) -> Channels:
    """The reasoning and the reply of `text`. `opened`: the generation prompt opened the block. Not
    `final` (a reply so far): a tag's possible start is held back, so each part only ever grows.
    A block never closed (the reply cut at its token limit) is all reasoning."""
    if not opened:
        head = text.lstrip()
        if not head.startswith(OPEN):
            if not final and OPEN.startswith(head):
                return Channels("", "")          # "", "\n", "<thi": not yet known to be a block or text
            return Channels("", text)
        text = head[len(OPEN):]
    end = text.find(CLOSE)
    if end < 0:
        held = 0 if final else _partial(text, CLOSE)
        return Channels(text[:len(text) - held].lstrip(), "")
    return Channels(text[:end].strip(), text[end + len(CLOSE):].lstrip())


def split_reply(text: str, think_open: bool, *, final: bool = True) -> Channels:
    """Either kind of reasoning: harmony's analysis channel (gpt-oss), else a <think> block."""
    ch = harmony.split(text, final=final)
    if ch.reasoning or harmony.has_markers(text):
        return ch
    th = split(text, think_open, final=final)
    # plain text so far: harmony's split of it, which holds back a marker's possible start while streaming
    return ch if th == Channels("", text) else th
