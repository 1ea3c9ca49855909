"""Chats in SQLite (stdlib sqlite3, WAL): messages, tab order, preset, title, model, last use and whether
a tab shows it; a full-text index (FTS5) over titles and message text; the presets (configs).

Closing a tab only clears a chat's `open` flag: every chat stays in the library until it is deleted
there. A database from before the library gets the new columns on open (its chats all open, last used
when created) and its index built once.

Nothing the user has is moved or lost when the database is not what it should be; `notice` has the
one line the window shows:
- locked by another process (or not writable): left as it is; its chats are read into memory and
  this session's changes are not saved (`persistent` False);
- another program's database at this path (a `chats`, `messages` or `presets` table of another
  shape, or none of Strata's tables): left as it is, never altered; the chats are kept in a database
  of their own beside it (`chats-strata.sqlite3`), the same one at every start, so the app works and
  keeps what is written while the foreign file stays untouched for whoever made it;
- corrupt (not a database, malformed, failing its integrity check): closed, then copied aside
  (`moved_aside` says where) and only then replaced by a new one; a copy that fails leaves it as it is.
Values of the wrong type or out of range in any row (a config that is not an object, `1e999`, a
blob title) are read as the defaults, never raised.
"""
from __future__ import annotations

import functools
import json
import logging
import math
import os
import re
import shutil
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
# The columns Strata reads and writes, per table: a table of this name without them is another program's
REQUIRED = {"chats": ("id", "title", "position", "config", "created"),
            "messages": ("chat_id", "idx", "role", "content"),
            "presets": ("id", "name", "position", "data")}
BUSY_TIMEOUT_S = 2.0          # how long a start-up waits for another process's lock
MAX_JSON = 1 << 20            # a stored config or preset longer than this is read as {}
log = logging.getLogger("strata.app")


def _finite_float(text: str) -> float:
    v = float(text)
    if not math.isfinite(v):
        raise ValueError(f"{text[:20]} is not a finite number")
    return v


def json_object(text) -> dict:
    """A stored config or preset as a dict: {} for anything else (not text, not JSON, not an object,
    too deep, too long, a number past float range such as 1e999, NaN or Infinity)."""
    if isinstance(text, bytes):
        text = text.decode("utf-8", "replace")
    if not isinstance(text, str) or len(text) > MAX_JSON:
        return {}
    try:
        value = json.loads(text, parse_float=_finite_float, parse_constant=_finite_float)
    except (ValueError, RecursionError):
        return {}
    return value if isinstance(value, dict) else {}


# A chat's config keys the app reads, and the type each must have (a key of another type is dropped)
CONFIG_TYPES = {"preset": str, "session": str, "speed_projection": bool}


def chat_config(text) -> dict:
    """A stored chat config: a JSON object whose known keys have their type (a session path without
    NUL characters)."""
    cfg = json_object(text)
    for key, kind in CONFIG_TYPES.items():
        if key in cfg and (not isinstance(cfg[key], kind) or (kind is str and "\x00" in cfg[key])):
            del cfg[key]
    return cfg


def _lenient_text(b: bytes) -> str:
    return b.decode("utf-8", "replace")


def _text(v, default: str = "") -> str:
    if isinstance(v, str):
        return v
    if isinstance(v, bytes):
        return v.decode("utf-8", "replace")
    return default if v is None else str(v)


def _number(v, default: float) -> float:
    try:
        f = float(v)
    except (TypeError, ValueError, OverflowError):
        return default
    return f if math.isfinite(f) else default


def _error_kind(e: sqlite3.Error) -> str:
    """'locked' (another process holds it), 'corrupt' (not a database, malformed) or 'unusable' (cannot
    be opened or written: permissions, a folder, a full disk): only a corrupt one is ever replaced."""
    code = getattr(e, "sqlite_errorcode", None)
    if code is not None:
        code &= 0xFF
        if code in (5, 6):                  # SQLITE_BUSY, SQLITE_LOCKED
            return "locked"
        if code in (11, 26):                # SQLITE_CORRUPT, SQLITE_NOTADB
            return "corrupt"
        return "unusable"
    text = str(e).lower()
    if "locked" in text or "busy" in text:
        return "locked"
    if "malformed" in text or "not a database" in text or "integrity check" in text:
        return "corrupt"
    return "unusable"


class ForeignDatabase(Exception):
    """The file is a database of another shape (its reason): left as it is."""


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
        self.path = Path(path)                 # the database in use (another one for a foreign file)
        self.requested_path = self.path
        self.moved_aside: Path | None = None   # where a corrupt database was copied
        self.error = ""                        # what was wrong with the requested database
        self.notice = ""                       # one line for the user ('' when all is well)
        self.persistent = True                 # False: the chats live in memory (the file is locked)
        self.fts = False                       # FTS5 available (else search falls back to LIKE)
        self.db = self._start()
        if self.notice:
            log.warning("chat database: %s", self.notice)

    # ---- opening: nothing the user has is moved or lost -------------------------------------------
    def _start(self) -> sqlite3.Connection:
        try:
            return self._open(self.path)
        except ForeignDatabase as e:
            self.error = str(e)
            return self._use_beside(str(e))
        except sqlite3.Error as e:
            self.error = str(e).splitlines()[0][:300] if str(e) else type(e).__name__
            kind = _error_kind(e)
        except UnicodeDecodeError:                 # SQLite's own message quotes bytes that are not UTF-8
            self.error, kind = "its schema or pages hold bytes that are not text", "corrupt"
        except OSError as e:                       # the folder cannot be made
            self.error, kind = e.strerror or str(e), "unusable"
        if kind == "corrupt":
            return self._replace_corrupt()
        return self._in_memory(kind)

    def _open(self, path: Path) -> sqlite3.Connection:
        path.parent.mkdir(parents=True, exist_ok=True)
        db = sqlite3.connect(path, timeout=BUSY_TIMEOUT_S)
        db.text_factory = _lenient_text           # a stored byte that is not UTF-8 is read as U+FFFD
        try:
            row = db.execute("PRAGMA integrity_check(1)").fetchone()     # indexes against their tables too
            if row is None or row[0] != "ok":
                raise sqlite3.DatabaseError(f"integrity check failed: {str(row[0] if row else 'no answer')[:200]}")
            self._check_shape(db)                 # before anything is written to it
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA foreign_keys=ON")
            db.executescript(SCHEMA)
            self._migrate(db)
        except BaseException:
            db.close()
            raise
        return db

    @staticmethod
    def _check_shape(db: sqlite3.Connection) -> None:
        """ForeignDatabase unless the file is empty or holds Strata's tables (extra tables are left be)."""
        objects = {name: kind for name, kind in db.execute(
            "SELECT name, type FROM sqlite_master WHERE type IN ('table', 'view') AND name NOT LIKE 'sqlite_%'")}
        if not objects:
            return
        if not objects.keys() & set(REQUIRED):
            names = ", ".join(sorted(objects)[:5])
            raise ForeignDatabase(f"it holds other tables ({names}), none of Strata's")
        for table, cols in REQUIRED.items():
            if table not in objects:
                continue
            if objects[table] != "table":
                raise ForeignDatabase(f"'{table}' is a {objects[table]}, not a table")
            info = db.execute(f"PRAGMA table_info({table})").fetchall()
            have = {r[1] for r in info}
            missing = [c for c in cols if c not in have]
            if missing:
                raise ForeignDatabase(f"its table '{table}' has no column {missing[0]!r}")
            if table in ("chats", "presets") and [r[1] for r in info if r[5]] != ["id"]:
                raise ForeignDatabase(f"its table '{table}' is not keyed by 'id'")
        if "chats_fts" in objects:
            cols = [r[1] for r in db.execute("PRAGMA table_info(chats_fts)")]
            if cols != ["chat_id", "title", "body"]:
                raise ForeignDatabase("its table 'chats_fts' is not Strata's search index")

    def _use_beside(self, reason: str) -> sqlite3.Connection:
        """The requested file is another program's: left as it is; the chats go to a database beside it
        (the same one at every start)."""
        stem = self.requested_path.stem
        for n in range(1, 6):
            alt = self.requested_path.with_name(f"{stem}-strata{'' if n == 1 else f'-{n}'}.sqlite3")
            try:
                db = self._open(alt)
            except (ForeignDatabase, sqlite3.Error, OSError):
                continue
            self.path = alt
            self.notice = (f"{self.requested_path.name} is not a Strata chat database ({reason}); it was "
                           f"left as it is. Chats are kept in {alt} instead.")
            return db
        return self._in_memory("foreign")

    def _replace_corrupt(self) -> sqlite3.Connection:
        """Closed already: copy the file (and its WAL) aside, then start a new one; when the copy fails
        the file is left as it is and the chats live in memory."""
        aside = self.path.with_name(f"{self.path.name}.corrupt-{time.strftime('%Y%m%d-%H%M%S')}")
        copied = []
        try:
            for suffix in ("", "-wal"):
                src = Path(str(self.path) + suffix)
                if src.is_file():
                    dst = Path(str(aside) + suffix)
                    shutil.copyfile(src, dst)
                    copied.append(dst)
                    if dst.stat().st_size != src.stat().st_size:
                        raise OSError(f"the copy of {src.name} is incomplete")
        except OSError as e:
            for dst in copied:
                dst.unlink(missing_ok=True)
            self.error += f"; it could not be copied aside ({e.strerror or e})"
            return self._in_memory("uncopied")
        for suffix in ("", "-wal", "-shm"):
            Path(str(self.path) + suffix).unlink(missing_ok=True)
        self.moved_aside = aside
        try:
            db = self._open(self.path)
        except (ForeignDatabase, sqlite3.Error, OSError):
            return self._in_memory("unusable")
        self.notice = (f"The chat database could not be read ({self.error}); a copy was kept aside as "
                       f"{aside} and a new one was started.")
        return db

    def _in_memory(self, kind: str) -> sqlite3.Connection:
        """The file is left as it is; its chats (when it can be read at all) are copied into memory and
        this session's changes are not saved."""
        self.persistent = False
        mem = sqlite3.connect(":memory:")
        mem.text_factory = _lenient_text
        got = False
        if kind == "locked":
            try:
                src = sqlite3.connect(f"{self.path.resolve().as_uri()}?mode=ro", uri=True,
                                      timeout=BUSY_TIMEOUT_S)
                src.text_factory = _lenient_text
                try:
                    self._check_shape(src)
                    src.backup(mem)
                    got = True
                finally:
                    src.close()
            except (ForeignDatabase, sqlite3.Error, OSError, ValueError):
                mem.close()
                mem = sqlite3.connect(":memory:")
                mem.text_factory = _lenient_text
        mem.execute("PRAGMA foreign_keys=ON")
        mem.executescript(SCHEMA)
        self._migrate(mem)
        why = {"locked": "is in use by another program (locked)",
               "uncopied": "could not be read, nor copied aside",
               "foreign": "is not a Strata chat database",
               }.get(kind, "cannot be opened")
        shown = "its chats are shown, but" if got else "it was left as it is, and"
        self.notice = (f"The chat database {self.requested_path} {why} ({self.error}); {shown} changes in "
                       f"this session are not saved. Close the other program or fix the file, then "
                       f"restart Strata." if kind == "locked" else
                       f"The chat database {self.requested_path} {why} ({self.error}); it was left as it "
                       f"is, and changes in this session are not saved.")
        return mem

    def _migrate(self, db: sqlite3.Connection) -> None:
        have = {r[1] for r in db.execute("PRAGMA table_info(chats)")}
        with db:
            for name, definition in ADDED_COLUMNS:
                if name not in have:
                    db.execute(f"ALTER TABLE chats ADD COLUMN {name} {definition}")
            db.execute("UPDATE chats SET updated=created WHERE updated=0")
        exists = db.execute("SELECT 1 FROM sqlite_master WHERE name='chats_fts'").fetchone()
        if exists:
            try:
                db.execute("INSERT INTO chats_fts(chats_fts) VALUES('integrity-check')")
                self.fts = True
                return
            except sqlite3.DatabaseError as e:
                if "no such module" in str(e):     # an SQLite built without FTS5: search uses LIKE
                    self.fts = False
                    return
                log.warning("chat database: the search index is damaged (%s); it is built again", e)
            with db:                               # derived data: rebuilt from the chats below
                db.execute("DROP TABLE chats_fts")
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
        return "\n".join(_text(c) for (c,) in db.execute(
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
        msgs = [{"role": _text(r, "user"), "content": _text(c)} for r, c in self.db.execute(
            "SELECT role, content FROM messages WHERE chat_id=? ORDER BY idx", (cid,))]
        created = _number(created, 0.0)
        return Chat(_text(cid), _text(title, "Chat"), msgs, chat_config(config), _text(model), created,
                    _number(updated, created), bool(_number(is_open, 1.0)))

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
        return [self._summary(r) for r in self.db.execute(self._SUMMARY + self._NEWEST)]

    @staticmethod
    def _summary(r) -> ChatSummary:
        return ChatSummary(_text(r[0]), _text(r[1], "Chat"), _text(r[2]), _number(r[3], 0.0), bool(_number(r[4], 1.0)),
                           int(r[5]))

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
        return [self._summary(r) for r in rows]

    # ---- presets (configs); the Default one lives in the settings, not here ----------------------
    def presets(self) -> list[tuple[str, str, dict]]:
        out = []
        for pid, name, data in self.db.execute("SELECT id, name, data FROM presets ORDER BY position, rowid"):
            out.append((_text(pid), _text(name, "Config"), json_object(data)))
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

    # ---- failures after the start (a disk error, damage found later): one line, never raised ----
    on_error = None                      # called with a one-line message (the window shows it)
    _told_failure = False

    def _failed(self, what: str, e: Exception) -> None:
        first = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
        log.warning("chat database: %s failed: %s", what, first)
        if not self._told_failure and self.on_error is not None:
            self._told_failure = True
            self.on_error(f"The chat database {self.path} failed ({first}); changes may not be saved. "
                          f"Restart Strata to check it.")


def _guarded(fn, default):
    @functools.wraps(fn)
    def wrapper(self, *args, **kw):
        try:
            return fn(self, *args, **kw)
        except (sqlite3.Error, UnicodeDecodeError) as e:
            self._failed(fn.__name__, e)
            return default()
    return wrapper


for _name, _default in (("chats", list), ("chat", lambda: None), ("save_chat", lambda: None),
                        ("set_order", lambda: None), ("set_open", lambda: None), ("rename", lambda: None),
                        ("delete_chat", lambda: None), ("restore_chat", lambda: None), ("library", list),
                        ("search", list), ("presets", list), ("save_preset", lambda: None),
                        ("delete_preset", lambda: None), ("close", lambda: None)):
    setattr(Store, _name, _guarded(getattr(Store, _name), _default))
