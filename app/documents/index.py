"""A chat's documents in the chat database (tables `documents`, `doc_chunks` and the FTS5 index
`doc_fts`, made by app/store.py): added once extracted, removed with the chat, and the passages most
relevant to a question retrieved by BM25 (SQLite's bm25(), no embedding model).

Retrieval: the question's words (stop words dropped, at most MAX_QUERY_TERMS, each a prefix term)
OR-ed, ranked by bm25() over the chunks of the chat's documents that go in by passages; TOP_K chunks,
fewer where a document's `k` says so (a small context: as many as fit half of what the chat has left).
A question with no word found in them gets the documents' first chunks. Without FTS5 (an SQLite built
without it) the chunks are ranked in Python by how many of the question's words they hold."""
from __future__ import annotations

import json
import re
import sqlite3
import time
import uuid
from dataclasses import dataclass

from .chunks import chunk
from .extract import Extracted

TOP_K = 4                 # passages put in front of each question
MAX_QUERY_TERMS = 32
WHOLE, PASSAGES = "whole", "passages"
_WORD = re.compile(r"\w+", re.UNICODE)
STOP_WORDS = frozenset("""a an and are as at be but by can do does did for from had has have how i if in into is it
its me my of on or our she he so that the their them then there these they this to was we were what when where
which who whom why will with would you your about any all tell please""".split())


@dataclass(frozen=True)
class DocInfo:
    id: str
    name: str
    kind: str
    mode: str                 # WHOLE, PASSAGES, or "" (not decided yet: retrieved as PASSAGES)
    tokens: int               # its tokens as the engine counted them (0: not counted)
    k: int                    # passages a question takes (TOP_K, fewer in a small context)
    chars: int
    pages: int                # PDF pages (0 for other kinds)
    chunks: int


@dataclass(frozen=True)
class Passage:
    doc_id: str
    name: str
    chunk: int
    place: str
    text: str


def query_terms(text: str) -> list[str]:
    """The question's words that can tell passages apart: no stop words, each once, at most MAX_QUERY_TERMS."""
    seen: dict[str, None] = {}
    for w in _WORD.findall(text.lower()):
        if w not in STOP_WORDS and (len(w) > 1 or w.isdigit()):
            seen.setdefault(w, None)
    return list(seen)[:MAX_QUERY_TERMS]


class ChatDocuments:
    """The documents of chat `chat_id` in `db` (the Store's connection); `fts`: doc_fts is there."""

    def __init__(self, db: sqlite3.Connection, chat_id: str, fts: bool = True):
        self.db, self.chat_id, self.fts = db, chat_id, fts

    def add(self, doc: Extracted) -> DocInfo:
        """Store the document and its chunks (indexed by the triggers on doc_chunks)."""
        doc_id = uuid.uuid4().hex[:12]
        parts = chunk(doc)
        with self.db:
            self.db.execute("INSERT INTO documents (id, chat_id, name, kind, text, pages, created) "
                            "VALUES (?, ?, ?, ?, ?, ?, ?)", (doc_id, self.chat_id, doc.name, doc.kind, doc.text,
                                                             json.dumps(list(doc.pages)), time.time()))
            self.db.executemany("INSERT INTO doc_chunks (doc_id, idx, place, body) VALUES (?, ?, ?, ?)",
                                [(doc_id, c.index, c.place, c.text) for c in parts])
        return self.info(doc_id)

    def copy_to(self, chat_id: str) -> dict[str, str]:
        """Every document of this chat, with its chunks, copied to chat `chat_id` (a fork, whose copied
        messages name them: its prompt must read the same text, and its questions search its own copy);
        the new ids by the old."""
        ids = {d.id: uuid.uuid4().hex[:12] for d in self.documents()}
        with self.db:
            for old, new in ids.items():
                self.db.execute("INSERT INTO documents (id, chat_id, name, kind, text, pages, mode, tokens, k, created) "
                                "SELECT ?, ?, name, kind, text, pages, mode, tokens, k, created FROM documents "
                                "WHERE id=?", (new, chat_id, old))
                self.db.execute("INSERT INTO doc_chunks (doc_id, idx, place, body) SELECT ?, idx, place, body "
                                "FROM doc_chunks WHERE doc_id=? ORDER BY idx", (new, old))
        return ids

    def set_mode(self, doc_id: str, mode: str, tokens: int = 0, k: int = TOP_K) -> None:
        with self.db:
            self.db.execute("UPDATE documents SET mode=?, tokens=?, k=? WHERE id=? AND chat_id=?",
                            (mode, int(tokens), max(1, min(int(k), TOP_K)), doc_id, self.chat_id))

    def remove(self, doc_id: str) -> None:
        with self.db:
            self.db.execute("DELETE FROM documents WHERE id=? AND chat_id=?", (doc_id, self.chat_id))

    _INFO = ("SELECT d.id, d.name, d.kind, d.mode, d.tokens, d.k, length(d.text), json_array_length(d.pages), "
             "(SELECT COUNT(*) FROM doc_chunks k WHERE k.doc_id=d.id) FROM documents d ")

    def info(self, doc_id: str) -> DocInfo | None:
        row = self.db.execute(self._INFO + "WHERE d.id=? AND d.chat_id=?", (doc_id, self.chat_id)).fetchone()
        return DocInfo(*row) if row else None

    def documents(self) -> list[DocInfo]:
        return [DocInfo(*r) for r in self.db.execute(
            self._INFO + "WHERE d.chat_id=? ORDER BY d.created, d.rowid", (self.chat_id,))]

    def text(self, doc_id: str) -> str | None:
        row = self.db.execute("SELECT text FROM documents WHERE id=? AND chat_id=?", (doc_id, self.chat_id)).fetchone()
        return row[0] if row else None

    # ---- retrieval ------------------------------------------------------------------------------
    _PASSAGE = ("SELECT d.id, d.name, k.idx, k.place, k.body FROM doc_chunks k JOIN documents d ON d.id=k.doc_id ")

    def first_passages(self, doc_id: str, k: int = TOP_K) -> list[Passage]:
        return [Passage(*r) for r in self.db.execute(self._PASSAGE + "WHERE d.id=? AND d.chat_id=? ORDER BY k.idx LIMIT ?",
                                                     (doc_id, self.chat_id, k))]

    def retrieve(self, question: str, k: int | None = None) -> list[Passage]:
        """The `k` chunks (None: the least `k` of the chat's by-passage documents) of those documents most
        relevant to `question` (BM25), best first."""
        if k is None:
            k = self.db.execute("SELECT MIN(k) FROM documents WHERE chat_id=? AND mode IN (?, '')",
                                (self.chat_id, PASSAGES)).fetchone()[0] or TOP_K
        terms = query_terms(question)
        rows = []
        if terms:
            rows = self._bm25(terms, k) if self.fts else self._by_counts(terms, k)
        if not rows:                      # no word of the question in them: their beginnings
            rows = self.db.execute(self._PASSAGE + "WHERE d.chat_id=? AND d.mode IN (?, '') ORDER BY k.idx, d.created "
                                   "LIMIT ?", (self.chat_id, PASSAGES, k)).fetchall()
        return [Passage(*r) for r in rows]

    def _bm25(self, terms: list[str], k: int) -> list[tuple]:
        match = " OR ".join('"%s"*' % t.replace('"', '""') for t in terms)
        return self.db.execute(
            self._PASSAGE + "JOIN doc_fts ON doc_fts.rowid=k.id WHERE doc_fts MATCH ? AND d.chat_id=? AND d.mode IN (?, '') "
            "ORDER BY bm25(doc_fts) LIMIT ?", (match, self.chat_id, PASSAGES, k)).fetchall()

    def _by_counts(self, terms: list[str], k: int) -> list[tuple]:
        rows = self.db.execute(self._PASSAGE + "WHERE d.chat_id=? AND d.mode IN (?, '')", (self.chat_id, PASSAGES)).fetchall()
        scored = [(sum(r[4].lower().count(t) for t in terms), i, r) for i, r in enumerate(rows)]
        return [r for s, _i, r in sorted(scored, key=lambda x: (-x[0], x[1])) if s > 0][:k]
