"""Documents into the prompt, and the reply's citations back to them. No Qt.

A user message that carries documents has the key `documents`: its sources, numbered from 1, as they
were when it was sent (so every later turn renders the same prompt, and the K/V of it is reused):
  {"n": 1, "doc": id, "name": "notes.txt", "mode": "whole", "place": "whole document"}
  {"n": 2, "doc": id, "name": "book.pdf", "mode": "passages", "chunk": 149, "place": "p. 150", "text": "..."}
A whole document's text is read from the chat database when the prompt is made; a passage's text is
kept in the message. The engine gets the message with its content made of the sources (each under its
number and name) followed by the question, and no `documents` key."""
from __future__ import annotations

import html
import re
from typing import Callable

from .index import WHOLE, ChatDocuments, DocInfo, Passage

INSTRUCTION = ("Sources for the question below, numbered. Answer from them, and cite each source you use "
               "by its number in square brackets, like [1].")
MISSING = "(this document is no longer stored)"
_CITE = re.compile(r"\[(\d{1,3}(?:\s*,\s*\d{1,3})*)\](?!\()")
_FENCE = re.compile(r"^```.*?(?:^```[ \t]*$|\Z)", re.S | re.M)


def sources(whole: list[DocInfo], passages: list[Passage]) -> list[dict]:
    """The numbered sources of one question: the whole documents first, then the passages, best first."""
    out: list[dict] = [{"doc": d.id, "name": d.name, "mode": WHOLE, "place": "whole document"} for d in whole]
    out += [{"doc": p.doc_id, "name": p.name, "mode": "passages", "chunk": p.chunk, "place": p.place,
             "text": p.text} for p in passages]
    for n, s in enumerate(out, 1):
        s["n"] = n
    return out


def source_text(s: dict, text_of: Callable[[str], str | None]) -> str:
    return (text_of(s.get("doc", "")) or MISSING) if s.get("mode") == WHOLE else str(s.get("text", ""))


def user_content(question: str, srcs: list[dict], text_of: Callable[[str], str | None]) -> str:
    """The text the engine reads for a question with sources."""
    parts = [INSTRUCTION]
    for s in srcs:
        tag = "document" if s.get("mode") == WHOLE else "passage"
        parts.append(f"[{s.get('n')}] {s.get('name')}, {s.get('place')}:\n<{tag}>\n{source_text(s, text_of)}\n</{tag}>")
    parts.append(f"Question: {question}")
    return "\n\n".join(parts)


def rename_documents(messages: list[dict], ids: dict[str, str]) -> None:
    """The sources in `messages` point at the documents' copies (`ids`: new by old, ChatDocuments.copy_to)."""
    for m in messages:
        for s in m.get("documents") or []:
            if isinstance(s, dict) and s.get("doc") in ids:
                s["doc"] = ids[s["doc"]]


def expand(messages: list[dict], text_of: Callable[[str], str | None]) -> list[dict]:
    """`messages` as the engine gets them: each one with documents has them in its content."""
    out = []
    for m in messages:
        srcs = m.get("documents")
        if isinstance(srcs, list) and srcs:
            m = {k: v for k, v in m.items() if k != "documents"}
            m["content"] = user_content(m["content"], srcs, text_of)
        out.append(m)
    return out


def sources_of_reply(messages: list[dict], i: int) -> tuple[int, list[dict]]:
    """(index of the user message, its sources) that reply `i` answers: the nearest user message before it."""
    for j in range(i - 1, -1, -1):
        if messages[j].get("role") == "user":
            srcs = messages[j].get("documents")
            return j, (srcs if isinstance(srcs, list) else [])
    return -1, []


def link_citations(text: str, at: int, srcs: list[dict]) -> str:
    """The reply's Markdown with each citation of a known source ([2], [1, 3]) a link `cite:<at>:<n>`
    (outside code blocks)."""
    known = {s.get("n") for s in srcs}
    if not known:
        return text

    def link(m: re.Match) -> str:
        nums = [int(x) for x in re.findall(r"\d+", m.group(1))]
        if not all(n in known for n in nums):
            return m.group(0)
        return "".join(f"[\\[{n}\\]](cite:{at}:{n})" for n in nums)

    out, pos = [], 0
    for f in _FENCE.finditer(text):
        out.append(_CITE.sub(link, text[pos:f.start()]))
        out.append(f.group(0))
        pos = f.end()
    out.append(_CITE.sub(link, text[pos:]))
    return "".join(out)


def sources_html(at: int, srcs: list[dict]) -> str:
    """One line under a question: its sources, each a link to the passage."""
    items = [f'<a href="cite:{at}:{s.get("n")}">[{s.get("n")}]</a> {html.escape(str(s.get("name")))}, '
             f'{html.escape(str(s.get("place")))}' for s in srcs]
    return "Sources: " + " &nbsp;·&nbsp; ".join(items)


def find_source(messages: list[dict], at: int, n: int) -> dict | None:
    if not 0 <= at < len(messages):
        return None
    srcs = messages[at].get("documents")
    return next((s for s in srcs if s.get("n") == n), None) if isinstance(srcs, list) else None


def export_markdown(srcs: list[dict]) -> str:
    """A question's sources in a Markdown export: names, places, and each passage quoted."""
    lines = ["**Sources:**"]
    for s in srcs:
        lines.append(f"- [{s.get('n')}] {s.get('name')}, {s.get('place')}")
        if s.get("mode") != WHOLE:
            lines += ["", *("  > " + ln for ln in str(s.get("text", "")).splitlines()), ""]
    return "\n".join(lines)


def for_question(docs: ChatDocuments, question: str, messages: list[dict]) -> list[dict]:
    """The sources of a new question: the whole documents no earlier message carried, then the passages of
    the by-passage documents that BM25 ranks best for it ([] when the chat has no documents)."""
    listed = docs.documents()
    if not listed:
        return []
    sent = {s.get("doc") for m in messages if isinstance(m.get("documents"), list)
            for s in m["documents"] if s.get("mode") == WHOLE}
    whole = [d for d in listed if d.mode == WHOLE and d.id not in sent]
    passages = docs.retrieve(question) if any(d.mode != WHOLE for d in listed) else []
    return sources(whole, passages)
