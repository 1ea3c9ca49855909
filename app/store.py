"""Chats in SQLite (stdlib sqlite3, WAL): messages, tab order, preset, title, model, last use and whether
a tab shows it; a full-text index (FTS5) over titles and message text; the presets (configs).

Closing a tab only clears a chat's `open` flag: every chat stays in the library until it is deleted
there. A database from before the library gets the new columns on open (its chats all open, last used
when created) and its index built once.

A database that cannot be read is moved aside (never silently dropped) and `moved_aside` says where.
"""
from __future__ import annotations

import json
import re
import sqlite3
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

SCHEMA = """
CREATE TABLE IF NOT EXISTS chats (
    id TEXT PRIMARY KEY, title TEXT NOT NULL, position INTEGER NOT NULL,
    config TEXT NOT NULL DEFAULT '{}', created REAL NOT NULL,
    updated REAL NOT NULL DEFAULT 0, model TEXT NOT NULL DEFAULT '', open INTEGER NOT NULL DEFAULT 1);
CREATE TABLE IF NOT EXISTS messages (
    chat_id TEXT NOT NULL REFERENCES chats(id) ON DELETE CASCADE, idx INTEGER NOT NULL,
    role TEXT NOT NULL, content TEXT NOT NULL, PRIMARY KEY (chat_id, idx));
CREATE TABLE IF NOT EXISTS presets (
    id TEXT PRIMARY KEY, name TEXT NOT NULL, position INTEGER NOT NULL, data TEXT NOT NULL DEFAULT '{}');
"""
# Columns added since the first schema: (name, definition) for ALTER TABLE on an older database.
ADDED_COLUMNS = (("updated", "REAL NOT NULL DEFAULT 0"), ("model", "TEXT NOT NULL DEFAULT ''"),
                 ("open", "INTEGER NOT NULL DEFAULT 1"))
# chat_id is an indexed column so that a chat's row is found through the index (user queries are
# restricted to {title body}); remove_diacritics: "cafe" finds "café".
FTS_SCHEMA = ("CREATE VIRTUAL TABLE chats_fts USING fts5(chat_id, title, body, "
              "tokenize='unicode61 remove_diacritics 2')")
_WORD = re.compile(r"\w+", re.UNICODE)


@dataclass
class Chat:
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    title: str = "New chat"
    messages: list[dict] = field(default_factory=list)
    config: dict = field(default_factory=dict)
    model: str = ""                   # file name of the model that last answered in it ('' = none yet)
    created: float = field(default_factory=time.time)
    updated: float = 0.0              # last used (a message added), epoch seconds; 0 = when created
    open: bool = True                 # shown in a tab


@dataclass(frozen=True)
class ChatSummary:
    """One row of the chat library."""
    id: str
    title: str
    model: str
    updated: float
    open: bool
    n_messages: int


def fts_query(text: str) -> str:
    """`text` as an FTS5 query that cannot be a syntax error: each word a quoted prefix term that must
    appear in the title or the messages ('' when `text` has no word)."""
    terms = _WORD.findall(text)
    return " AND ".join('{title body}: "%s"*' % t.replace('"', '""') for t in terms)


class Store:
    def __init__(self, path: Path):
        self.path = Path(path)
        self.moved_aside: Path | None = None
        self.fts = False                  # FTS5 available (else search falls back to LIKE)
        try:
            self.db = self._open()
        except sqlite3.DatabaseError as e:
            aside = self.path.with_name(f"{self.path.name}.corrupt-{time.strftime('%Y%m%d-%H%M%S')}")
            for suffix in ("", "-wal", "-shm"):
                p = Path(str(self.path) + suffix)
                if p.exists():
                    p.replace(Path(str(aside) + suffix))
            self.moved_aside = aside
            self.error = str(e)
            self.db = self._open()

    def _open(self) -> sqlite3.Connection:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        db = sqlite3.connect(self.path)
        try:
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA foreign_keys=ON")
            row = db.execute("PRAGMA quick_check").fetchone()
            if row is None or row[0] != "ok":
                raise sqlite3.DatabaseError(f"integrity check failed: {row[0] if row else 'no answer'}")
            db.executescript(SCHEMA)
            self._migrate(db)
        except sqlite3.DatabaseError:
            db.close()
            raise
        return db

    def _migrate(self, db: sqlite3.Connection) -> None:
        have = {r[1] for r in db.execute("PRAGMA table_info(chats)")}
        with db:
            for name, definition in ADDED_COLUMNS:
                if name not in have:
                    db.execute(f"ALTER TABLE chats ADD COLUMN {name} {definition}")
            db.execute("UPDATE chats SET updated=created WHERE updated=0")
        exists = db.execute("SELECT 1 FROM sqlite_master WHERE name='chats_fts'").fetchone()
        if exists:
            self.fts = True
            return
        try:
            with db:
                db.execute(FTS_SCHEMA)
                for cid, title in db.execute("SELECT id, title FROM chats").fetchall():
                    db.execute("INSERT INTO chats_fts (chat_id, title, body) VALUES (?, ?, ?)",
                               (cid, title, self._body(db, cid)))
            self.fts = True
        except sqlite3.OperationalError:      # an SQLite built without FTS5: search uses LIKE
            self.fts = False

    @staticmethod
    def _body(db: sqlite3.Connection, chat_id: str) -> str:
        return "\n".join(c for (c,) in db.execute(
            "SELECT content FROM messages WHERE chat_id=? ORDER BY idx", (chat_id,)))

    @staticmethod
    def _fts_row(chat_id: str) -> tuple[str, tuple]:
        """A WHERE clause picking the chat's index row: the MATCH narrows through the index, the = drops
        a token-wise look-alike (an id with no word characters is looked for by scanning)."""
        if not _WORD.search(chat_id):
            return "chat_id=?", (chat_id,)
        phrase = 'chat_id: "%s"' % chat_id.replace('"', '""')
        return "rowid IN (SELECT rowid FROM chats_fts WHERE chats_fts MATCH ?) AND chat_id=?", (phrase, chat_id)

    def _unindex(self, chat_id: str) -> None:
        if self.fts:
            where, args = self._fts_row(chat_id)
            self.db.execute(f"DELETE FROM chats_fts WHERE {where}", args)

    def _index(self, chat_id: str, title: str, messages: list[dict]) -> None:
        if self.fts:
            self._unindex(chat_id)
            self.db.execute("INSERT INTO chats_fts (chat_id, title, body) VALUES (?, ?, ?)",
                            (chat_id, title, "\n".join(m["content"] for m in messages)))

    # ---- chats -------------------------------------------------------------------------------
    _COLS = "id, title, config, model, created, updated, open"

    def _chat(self, row) -> Chat:
        cid, title, config, model, created, updated, is_open = row
        msgs = [{"role": r, "content": c} for r, c in self.db.execute(
            "SELECT role, content FROM messages WHERE chat_id=? ORDER BY idx", (cid,))]
        try:
            cfg = json.loads(config)
        except ValueError:
            cfg = {}
        return Chat(cid, title, msgs, cfg if isinstance(cfg, dict) else {}, model, created, updated, bool(is_open))

    def chats(self, open_only: bool = False) -> list[Chat]:
        """Every chat (or those with a tab), in tab order."""
        where = "WHERE open=1 " if open_only else ""
        return [self._chat(r) for r in self.db.execute(
            f"SELECT {self._COLS} FROM chats {where}ORDER BY position").fetchall()]

    def chat(self, chat_id: str) -> Chat | None:
        row = self.db.execute(f"SELECT {self._COLS} FROM chats WHERE id=?", (chat_id,)).fetchone()
        return self._chat(row) if row else None

    def save_chat(self, chat: Chat, position: int | None = None) -> None:
        """Insert or update `chat` (title, config, model, last used, messages). An update keeps the
        stored `open` flag and creation time (`set_open` changes the flag)."""
        with self.db:
            row = self.db.execute("SELECT position FROM chats WHERE id=?", (chat.id,)).fetchone()
            if position is None or position < 0:
                position = row[0] if row else (self.db.execute(
                    "SELECT COALESCE(MAX(position), -1) + 1 FROM chats").fetchone()[0])
            self.db.execute(
                "INSERT INTO chats (id, title, position, config, created, updated, model, open) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?) "
                "ON CONFLICT(id) DO UPDATE SET title=excluded.title, position=excluded.position, "
                "config=excluded.config, updated=excluded.updated, model=excluded.model",
                (chat.id, chat.title, position, json.dumps(chat.config), chat.created,
                 chat.updated or chat.created, chat.model, int(chat.open)))
            self.db.execute("DELETE FROM messages WHERE chat_id=?", (chat.id,))
            self.db.executemany("INSERT INTO messages (chat_id, idx, role, content) VALUES (?, ?, ?, ?)",
                                [(chat.id, i, m["role"], m["content"]) for i, m in enumerate(chat.messages)])
            self._index(chat.id, chat.title, chat.messages)

    def set_order(self, ids: list[str]) -> None:
        with self.db:
            self.db.executemany("UPDATE chats SET position=? WHERE id=?", [(i, cid) for i, cid in enumerate(ids)])

    def set_open(self, chat_id: str, is_open: bool) -> None:
        with self.db:
            self.db.execute("UPDATE chats SET open=? WHERE id=?", (int(bool(is_open)), chat_id))

    def rename(self, chat_id: str, title: str) -> None:
        with self.db:
            self.db.execute("UPDATE chats SET title=? WHERE id=?", (title, chat_id))
            if self.fts:
                where, args = self._fts_row(chat_id)
                self.db.execute(f"UPDATE chats_fts SET title=? WHERE {where}", (title, *args))

    def delete_chat(self, chat_id: str) -> Chat | None:
        """Delete the chat and its messages; returns what was deleted (for `restore_chat`: undo)."""
        gone = self.chat(chat_id)
        with self.db:
            self.db.execute("DELETE FROM messages WHERE chat_id=?", (chat_id,))
            self.db.execute("DELETE FROM chats WHERE id=?", (chat_id,))
            self._unindex(chat_id)
        return gone

    def restore_chat(self, chat: Chat) -> None:
        """Put back a chat `delete_chat` returned, as it was (open flag, times, model, messages)."""
        self.save_chat(chat)
        self.set_open(chat.id, chat.open)

    # ---- the library -------------------------------------------------------------------------
    _SUMMARY = ("SELECT c.id, c.title, c.model, c.updated, c.open, "
                "(SELECT COUNT(*) FROM messages m WHERE m.chat_id=c.id) FROM chats c ")
    _NEWEST = " ORDER BY c.updated DESC, c.created DESC, c.rowid DESC"

    def library(self) -> list[ChatSummary]:
        """Every chat, last used first."""
        return [ChatSummary(r[0], r[1], r[2], r[3], bool(r[4]), r[5])
                for r in self.db.execute(self._SUMMARY + self._NEWEST)]

    def search(self, text: str) -> list[ChatSummary]:
        """The chats whose title or messages hold every word of `text` (word prefixes, case and accents
        ignored), last used first; every chat for a blank `text`. Never raises on odd input."""
        if not text.strip():
            return self.library()
        terms = _WORD.findall(text)
        if not terms:
            return []
        try:
            if self.fts:
                rows = self.db.execute(
                    self._SUMMARY + "WHERE c.id IN (SELECT chat_id FROM chats_fts WHERE chats_fts MATCH ?)"
                    + self._NEWEST, (fts_query(text),)).fetchall()
            else:
                cond = " AND ".join(
                    "(c.title LIKE ? ESCAPE '\\' OR EXISTS (SELECT 1 FROM messages m WHERE m.chat_id=c.id "
                    "AND m.content LIKE ? ESCAPE '\\'))" for _ in terms)
                args = []
                for t in terms:
                    pat = "%" + t.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%"
                    args += [pat, pat]
                rows = self.db.execute(self._SUMMARY + "WHERE " + cond + self._NEWEST, args).fetchall()
        except sqlite3.Error:
            return []
        return [ChatSummary(r[0], r[1], r[2], r[3], bool(r[4]), r[5]) for r in rows]

    # ---- presets (configs); the Default one lives in the settings, not here ----------------------
    def presets(self) -> list[tuple[str, str, dict]]:
        out = []
        for pid, name, data in self.db.execute("SELECT id, name, data FROM presets ORDER BY position, rowid"):
            try:
                d = json.loads(data)
            except ValueError:
                d = {}
            out.append((pid, name, d if isinstance(d, dict) else {}))
        return out

    def save_preset(self, pid: str, name: str, data: dict) -> None:
        with self.db:
            self.db.execute(
                "INSERT INTO presets (id, name, position, data) VALUES "
                "(?, ?, (SELECT COALESCE(MAX(position), -1) + 1 FROM presets), ?) "
                "ON CONFLICT(id) DO UPDATE SET name=excluded.name, data=excluded.data",
                (pid, name, json.dumps(data)))

    def delete_preset(self, pid: str) -> None:
        with self.db:
            self.db.execute("DELETE FROM presets WHERE id=?", (pid,))

    def close(self) -> None:
        self.db.close()
