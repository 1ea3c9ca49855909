"""A document's text cut into overlapping chunks, each with its place (PDF pages, or text lines).

CHUNK_CHARS characters a chunk (about 400 tokens of English at ~4 characters a token), OVERLAP_CHARS
shared with the chunk before it, so a sentence cut at one chunk's end is whole in the next. A chunk
ends at a paragraph break, a line break, a sentence end or a space in its last quarter where there is
one (a hard cut only in text without any). A CSV chunk after the first starts with the header line."""
from __future__ import annotations

import bisect
import re
from dataclasses import dataclass

from .extract import Extracted

CHUNK_CHARS = 1600
OVERLAP_CHARS = 200
_BREAKS = ("\n\n", "\n", ". ", "? ", "! ", " ")
_SPACE = re.compile(r"\s")


@dataclass(frozen=True)
class Chunk:
    index: int
    start: int                 # character offsets in the document's text
    end: int
    place: str                 # "p. 150", "pp. 150-151", "lines 10-42"
    text: str


def _cut(text: str, start: int, size: int) -> int:
    """Where a chunk starting at `start` ends: a break in its last quarter, else `start + size`."""
    end = start + size
    if end >= len(text):
        return len(text)
    floor = start + size * 3 // 4
    for sep in _BREAKS:
        at = text.rfind(sep, floor, end)
        if at >= 0:
            return at + len(sep)
    return end


def _next_start(text: str, end: int, overlap: int, prev: int) -> int:
    """The next chunk's start: `overlap` characters before `end`, moved on to a line's start, or else
    to a word's."""
    at = max(prev + 1, end - overlap)
    line = text.find("\n", at, end - 1)
    if line >= 0:
        return line + 1
    m = _SPACE.search(text, at, end)
    return m.end() if m else at


def place(doc: Extracted, start: int, end: int, newlines: list[int] | None = None) -> str:
    """Where [start, end) is: PDF pages ("p. 3", "pp. 3-4"), else text lines ("line 7", "lines 7-30")."""
    last = max(start, end - 1)
    if doc.pages:
        a, b = bisect.bisect_right(doc.pages, start), bisect.bisect_right(doc.pages, last)
        return f"p. {a}" if a == b else f"pp. {a}-{b}"
    if newlines is None:
        newlines = [m.start() for m in re.finditer("\n", doc.text)]
    a, b = bisect.bisect_left(newlines, start) + 1, bisect.bisect_left(newlines, last) + 1
    return f"line {a}" if a == b else f"lines {a}-{b}"


def chunk(doc: Extracted, size: int = CHUNK_CHARS, overlap: int = OVERLAP_CHARS) -> list[Chunk]:
    """The document's chunks in order, covering all of its text."""
    text = doc.text
    newlines = [m.start() for m in re.finditer("\n", text)] if not doc.pages else None
    header = text.split("\n", 1)[0] + "\n" if doc.kind == "csv" else ""
    out: list[Chunk] = []
    start = 0
    while start < len(text):
        end = _cut(text, start, size)
        body = text[start:end]
        if body.strip():
            shown = header + body if header and start > 0 else body
            out.append(Chunk(len(out), start, end, place(doc, start, end, newlines), shown))
        if end >= len(text):
            break
        start = _next_start(text, end, overlap, start)
    return out
