"""Chats in SQLite (stdlib sqlite3, WAL): messages, tab order, preset, title, model, last use and whether
a tab shows it; a full-text index (FTS5) over titles and message text; the presets (configs).

Closing a tab only clears a chat's `open` flag: every chat stays in the library until it is deleted
there. A database from before the library gets the new columns on open (its chats all open, last used
when created) and its index built once.

Nothing the user has is moved or lost when the database is not what it should be; `notice` has the
one line the window shows:
- locked by another process (or not writable): left as it is; its chats are read into memory and
  this session's changes are not saved (`persistent` False);
- not Strata's: never written to. A Strata database carries a mark in its header (PRAGMA
  application_id APPLICATION_ID, PRAGMA user_version its format, FORMAT_VERSION). A file without the
  mark is Strata's only when it holds Strata's tables with exactly their columns and nothing else (a
  database from before the mark: the mark is added to it); anything else is another program's: a file
  that is not SQLite at all, an empty file, an SQLite file with other tables, or with tables of
  Strata's names but another shape (an extra NOT NULL column would fail every save), another program's
  application id, or a Strata database of a newer format. It is left as it is; the chats are kept in a
  database of their own beside it (`chats-strata.sqlite3`), the same one at every start; `notice`
  says so at the start that made that file, and later starts only log it;
- corrupt (malformed, failing its integrity check) and carrying Strata's mark: closed, then copied
  aside (`moved_aside` says where) and only then replaced by a new one; a copy that fails leaves it as
  it is. A corrupt file without the mark is left as it is, as another program's.
A new database is made under a temporary name and renamed into place once it has the mark and the
tables, so a file at the chats path without the mark was never a Strata one.
Values of the wrong type or out of range in any row (a config that is not an object, `1e999`, a
blob title) are read as the defaults, never raised. Any text is stored: a lone surrogate (valid in a
Python string, not in UTF-8; it comes from pasted or decoded text) is stored as U+FFFD (`valid_text`).
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
    role TEXT NOT NULL, content TEXT NOT NULL, fields TEXT NOT NULL DEFAULT '{}', PRIMARY KEY (chat_id, idx));
CREATE TABLE IF NOT EXISTS presets (
    id TEXT PRIMARY KEY, name TEXT NOT NULL, position INTEGER NOT NULL, data TEXT NOT NULL DEFAULT '{}');
CREATE TABLE IF NOT EXISTS documents (
    id TEXT PRIMARY KEY, chat_id TEXT NOT NULL REFERENCES chats(id) ON DELETE CASCADE, name TEXT NOT NULL,
    kind TEXT NOT NULL, text TEXT NOT NULL, pages TEXT NOT NULL DEFAULT '[]', mode TEXT NOT NULL DEFAULT '',
    tokens INTEGER NOT NULL DEFAULT 0, k INTEGER NOT NULL DEFAULT 4, created REAL NOT NULL);
CREATE INDEX IF NOT EXISTS documents_chat ON documents(chat_id);
CREATE TABLE IF NOT EXISTS doc_chunks (
    id INTEGER PRIMARY KEY, doc_id TEXT NOT NULL REFERENCES documents(id) ON DELETE CASCADE,
    idx INTEGER NOT NULL, place TEXT NOT NULL, body TEXT NOT NULL);
CREATE INDEX IF NOT EXISTS doc_chunks_doc ON doc_chunks(doc_id, idx);
"""
APPLICATION_ID = 0x53747261     # "Stra": PRAGMA application_id of a Strata chats database
# PRAGMA user_version: this schema's format. Raise it with any change to SCHEMA: an older Strata then
# leaves the newer file alone instead of failing on columns it does not know.
FORMAT_VERSION = 2
SQLITE_MAGIC = b"SQLite format 3\x00"
_HEADER_APP_ID = slice(68, 72)  # where SQLite keeps application_id in the file header (big-endian)
# Tables FTS5 makes for chats_fts (allowed in an unmarked database beside Strata's own)
FTS_SHADOW = ("chats_fts_data", "chats_fts_idx", "chats_fts_content", "chats_fts_docsize", "chats_fts_config")
# Columns added since the first schema, per table: (name, definition) for ALTER TABLE on an older database.
ADDED_COLUMNS = {"chats": (("updated", "REAL NOT NULL DEFAULT 0"), ("model", "TEXT NOT NULL DEFAULT ''"),
                           ("open", "INTEGER NOT NULL DEFAULT 1")),
                 # a message's fields beyond role and content (images, tool calls, documents, branches) as
                 # one JSON object: each feature keeps its keys in the message dict, the store round-trips them
                 "messages": (("fields", "TEXT NOT NULL DEFAULT '{}'"),)}
MESSAGE_COLUMNS = ("role", "content")   # the message keys with their own column; the rest go to `fields`
MAX_FIELDS = 16 << 20          # a stored message's fields longer than this are read as {}
# chat_id is an indexed column so that a chat's row is found through the index (user queries are
# restricted to {title body}); remove_diacritics: "cafe" finds "café".
FTS_SCHEMA = ("CREATE VIRTUAL TABLE chats_fts USING fts5(chat_id, title, body, "
              "tokenize='unicode61 remove_diacritics 2')")
# Documents' chunks (app/documents): an external-content index kept in step by triggers, so a chunk
# deleted with its chat (ON DELETE CASCADE) leaves the index too; ranked by bm25()
DOC_FTS_SCHEMA = ("CREATE VIRTUAL TABLE doc_fts USING fts5(body, content='doc_chunks', content_rowid='id', "
                  "tokenize='unicode61 remove_diacritics 2')",
                  "CREATE TRIGGER IF NOT EXISTS doc_chunks_ai AFTER INSERT ON doc_chunks BEGIN "
                  "INSERT INTO doc_fts(rowid, body) VALUES (new.id, new.body); END",
                  "CREATE TRIGGER IF NOT EXISTS doc_chunks_ad AFTER DELETE ON doc_chunks BEGIN "
                  "INSERT INTO doc_fts(doc_fts, rowid, body) VALUES ('delete', old.id, old.body); END")
_WORD = re.compile(r"\w+", re.UNICODE)
# The columns Strata reads and writes, per table: a table of this name without them is another program's
REQUIRED = {"chats": ("id", "title", "position", "config", "created"),
            "messages": ("chat_id", "idx", "role", "content"),
            "presets": ("id", "name", "position", "data"),
            "documents": ("id", "chat_id", "name", "kind", "text", "pages", "mode", "tokens", "k", "created"),
            "doc_chunks": ("id", "doc_id", "idx", "place", "body")}
# The documents' indexes, triggers and search index (with FTS5's tables for it): Strata's own objects
DOC_OBJECTS = ("documents_chat", "doc_chunks_doc", "doc_chunks_ai", "doc_chunks_ad", "doc_fts", "doc_fts_data",
               "doc_fts_idx", "doc_fts_docsize", "doc_fts_config")
UNDO_CHATS = 4                # deleted chats whose documents are kept for an undo (in memory)
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


def search_text(m: dict) -> str:
    """What the search index holds of a message: its text, and the tools it called with their arguments
    (a call's message may have no text of its own)."""
    calls = m.get("tool_calls")
    if not isinstance(calls, list):
        return m["content"]
    parts = [m["content"]]
    for c in calls:
        f = c.get("function") if isinstance(c, dict) else None
        if isinstance(f, dict):
            parts.append(f"{f.get('name', '')} {json.dumps(f.get('arguments', ''), ensure_ascii=False)}")
    return "\n".join(parts)


def message_fields(text) -> dict:
    """A stored message's fields beyond role and content: a JSON object, or {} for anything else (damaged, too long)."""
    if isinstance(text, bytes):
        text = _lenient_text(text)
    if not isinstance(text, str) or len(text) > MAX_FIELDS:
        return {}
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        return {}
    return {k: v for k, v in value.items() if k not in MESSAGE_COLUMNS} if isinstance(value, dict) else {}


def valid_text(text: str) -> str:
    """`text` as UTF-8 can hold it: a surrogate pair (two code points) joined into its character, a lone
    surrogate replaced by U+FFFD; any other text unchanged."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return text.encode("utf-16-le", "surrogatepass").decode("utf-16-le", "replace")


def _json_text(value) -> str:
    """A config or preset as stored JSON, its strings valid text (json.dumps would escape a lone surrogate,
    and the value would come back with it)."""
    return valid_text(json.dumps(value, ensure_ascii=False))


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
    """The file is not Strata's (its reason): left as it is."""


@dataclass(frozen=True)
class FileHead:
    """What the first bytes of a file at the chats path say."""
    exists: bool
    size: int = 0
    sqlite: bool = False           # starts with SQLite's magic
    strata: bool = False           # its header carries Strata's application id


def read_head(path: Path) -> FileHead | None:
    """The file's head, or None when it cannot be read as a file (a folder, no permission: SQLite then
    says why)."""
    try:
        with open(path, "rb") as f:
            head = f.read(100)
    except FileNotFoundError:
        return FileHead(exists=False)
    except OSError:
        return None
    return FileHead(True, len(head), head.startswith(SQLITE_MAGIC),
                    int.from_bytes(head[_HEADER_APP_ID], "big") == APPLICATION_ID)


@functools.cache
def _reference_columns() -> dict[str, list[tuple]]:
    """Strata's tables' columns as PRAGMA table_info gives them (name, type, notnull, default, pk)."""
    db = sqlite3.connect(":memory:")
    try:
        db.executescript(SCHEMA)
        return {t: [tuple(r[1:]) for r in db.execute(f"PRAGMA table_info({t})")] for t in REQUIRED}
    finally:
        db.close()


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
        self.doc_fts = False                   # the documents' chunk index (doc_fts) is there
        self._doc_trash: dict[str, list] = {}  # a deleted chat's documents, for restore_chat (undo)
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
            head = read_head(self.path)
            if head is not None and head.strata:   # Strata's own, damaged: copied aside, then replaced
                return self._replace_corrupt()
            return self._use_beside(f"it has no Strata mark and cannot be read: {self.error}")
        return self._in_memory(kind)

    def _open(self, path: Path) -> sqlite3.Connection:
        path.parent.mkdir(parents=True, exist_ok=True)
        head = read_head(path)
        if head is not None and not head.exists:
            self._create(path)
        elif head is not None and not head.sqlite:
            raise ForeignDatabase("the file is empty" if head.size == 0 else "it is not an SQLite database")
        db = sqlite3.connect(path, timeout=BUSY_TIMEOUT_S)
        db.text_factory = _lenient_text           # a stored byte that is not UTF-8 is read as U+FFFD
        try:
            row = db.execute("PRAGMA integrity_check(1)").fetchone()     # indexes against their tables too
            if row is None or row[0] != "ok":
                raise sqlite3.DatabaseError(f"integrity check failed: {str(row[0] if row else 'no answer')[:200]}")
            unmarked = self._check_owner(db)      # before anything is written to it
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA foreign_keys=ON")
            db.executescript(SCHEMA)
            self._migrate(db)
            if unmarked:
                self._mark(db)
        except BaseException:
            db.close()
            raise
        return db

    @staticmethod
    def _create(path: Path) -> None:
        """A new database at `path`: made with its mark and tables under a temporary name, then linked
        into place (a crash leaves no unmarked file at `path`, and a file that appeared there meanwhile
        is not replaced)."""
        tmp = path.with_name(f".{path.name}.{os.getpid()}.new")
        tmp.unlink(missing_ok=True)
        try:
            db = sqlite3.connect(tmp)
            try:
                db.execute(f"PRAGMA application_id={APPLICATION_ID}")
                db.execute(f"PRAGMA user_version={FORMAT_VERSION}")
                db.executescript(SCHEMA)
                db.commit()
            finally:
                db.close()
            try:
                os.link(tmp, path)        # never over a file another program made meanwhile
            except FileExistsError:
                pass                      # that file is checked like any other
            except OSError:               # a file system without hard links
                os.replace(tmp, path)
        finally:                          # a full disk, a folder that turned read-only: nothing left
            for leftover in (tmp, Path(f"{tmp}-journal")):
                leftover.unlink(missing_ok=True)

    @staticmethod
    def _mark(db: sqlite3.Connection) -> None:
        """A Strata database from before the mark (or of an older format): the mark and format set, and
        written through to the file's header (where a damaged file is recognised)."""
        db.commit()                   # the migration's transaction (the index check opens one)
        db.execute(f"PRAGMA application_id={APPLICATION_ID}")
        db.execute(f"PRAGMA user_version={FORMAT_VERSION}")
        try:
            db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        except sqlite3.OperationalError as e:      # a reader holds the WAL: the header follows later
            log.info("chat database: the mark waits for a checkpoint (%s)", e)

    @classmethod
    def _check_owner(cls, db: sqlite3.Connection) -> bool:
        """ForeignDatabase unless the database is Strata's; True when it lacks the mark or has an older
        format (to be marked once it is open)."""
        app_id = db.execute("PRAGMA application_id").fetchone()[0]
        version = db.execute("PRAGMA user_version").fetchone()[0]
        if app_id == APPLICATION_ID:
            if version > FORMAT_VERSION:
                raise ForeignDatabase(f"it was written by a newer Strata: format {version}, this version "
                                      f"reads format {FORMAT_VERSION}")
            cls._check_shape(db, marked=True)
            return version < FORMAT_VERSION
        if app_id:
            raise ForeignDatabase(f"it is marked as another program's (application id {app_id & 0xFFFFFFFF:#010x})")
        cls._check_shape(db, marked=False)
        return True

    @staticmethod
    def _check_shape(db: sqlite3.Connection, marked: bool) -> None:
        """ForeignDatabase unless Strata's tables have exactly their columns (one from before a column was
        added lacks it). An unmarked database must hold chats and messages and nothing Strata never
        makes; a marked one may lack tables (they are made) and hold others (left be)."""
        objects = {name: kind for name, kind in db.execute(
            "SELECT name, type FROM sqlite_master WHERE name NOT LIKE 'sqlite_%'")}
        if not marked:
            if not objects:
                raise ForeignDatabase("it holds no tables, and no Strata mark")
            others = sorted(n for n in objects if n not in REQUIRED and n != "chats_fts" and n not in FTS_SHADOW
                            and n not in DOC_OBJECTS)
            if others:
                raise ForeignDatabase(f"it holds a {objects[others[0]]} '{others[0]}' that Strata never makes, "
                                      f"and no Strata mark")
            for table in ("chats", "messages"):
                if table not in objects:
                    raise ForeignDatabase(f"it has no table '{table}', and no Strata mark")
        ref = _reference_columns()
        for table in REQUIRED:
            if table not in objects:
                continue
            if objects[table] != "table":
                raise ForeignDatabase(f"'{table}' is a {objects[table]}, not a table")
            info = [tuple(r[1:]) for r in db.execute(f"PRAGMA table_info({table})")]
            names = {r[0] for r in info}
            extra = [r[0] for r in info if r not in ref[table]]
            if extra:
                raise ForeignDatabase(f"its table '{table}' has a column {extra[0]!r} that is not Strata's")
            missing = [c for c in REQUIRED[table] if c not in names]
            if missing or [r for r in ref[table] if r[0] in names] != info:
                raise ForeignDatabase(f"its table '{table}' has no column {missing[0]!r}" if missing else
                                      f"its table '{table}' has Strata's columns in another order")
        if "chats_fts" in objects:
            cols = [r[1] for r in db.execute("PRAGMA table_info(chats_fts)")]
            if cols != ["chat_id", "title", "body"]:
                raise ForeignDatabase("its table 'chats_fts' is not Strata's search index")

    def _use_beside(self, reason: str) -> sqlite3.Connection:
        """The requested file is another program's: left as it is; the chats go to a database beside it
        (the same one at every start)."""
        stem = self.requested_path.stem
        self.error = reason
        for n in range(1, 6):
            alt = self.requested_path.with_name(f"{stem}-strata{'' if n == 1 else f'-{n}'}.sqlite3")
            made = not alt.exists()
            try:
                db = self._open(alt)
            except (ForeignDatabase, sqlite3.Error, OSError):
                continue
            self.path = alt
            line = (f"{self.requested_path.name} is not a Strata chat database ({reason}); it was "
                    f"left as it is. Chats are kept in {alt} instead.")
            if made:                  # said once: at the start that moved the chats beside it
                self.notice = line
            else:
                log.info("chat database: %s", line)
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
                    self._check_owner(src)
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
        with db:
            for table, added in ADDED_COLUMNS.items():
                have = {r[1] for r in db.execute(f"PRAGMA table_info({table})")}
                for name, definition in added:
                    if name not in have:
                        db.execute(f"ALTER TABLE {table} ADD COLUMN {name} {definition}")
            db.execute("UPDATE chats SET updated=created WHERE updated=0")
        self.doc_fts = self._migrate_doc_fts(db)
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
    def _migrate_doc_fts(db: sqlite3.Connection) -> bool:
        """The documents' chunk index: made (from the chunks there are) when missing, rebuilt when damaged;
        False without FTS5 (retrieval then ranks in Python, app/documents/index.py)."""
        try:
            if db.execute("SELECT 1 FROM sqlite_master WHERE name='doc_fts'").fetchone() is None:
                with db:
                    for statement in DOC_FTS_SCHEMA:
                        db.execute(statement)
                    db.execute("INSERT INTO doc_fts(doc_fts) VALUES('rebuild')")
                return True
            try:
                db.execute("INSERT INTO doc_fts(doc_fts) VALUES('integrity-check')")
            except sqlite3.DatabaseError as e:
                if "no such module" in str(e):
                    return False
                log.warning("chat database: the documents' index is damaged (%s); it is built again", e)
                with db:
                    db.execute("INSERT INTO doc_fts(doc_fts) VALUES('rebuild')")
            return True
        except sqlite3.OperationalError:       # an SQLite built without FTS5
            return False

    @staticmethod
    def _body(db: sqlite3.Connection, chat_id: str) -> str:
        return "\n".join(search_text({**message_fields(x), "content": _text(c)}) for c, x in db.execute(
            "SELECT content, fields FROM messages WHERE chat_id=? ORDER BY idx", (chat_id,)))

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
            body = "\n".join(search_text({**message_fields(m["fields"]), "content": m["content"]}) for m in messages)
            self.db.execute("INSERT INTO chats_fts (chat_id, title, body) VALUES (?, ?, ?)", (chat_id, title, body))

    # ---- chats -------------------------------------------------------------------------------
    _COLS = "id, title, config, model, created, updated, open"

    def _chat(self, row) -> Chat:
        cid, title, config, model, created, updated, is_open = row
        msgs = [{**message_fields(x), "role": _text(r, "user"), "content": _text(c)} for r, c, x in self.db.execute(
            "SELECT role, content, fields FROM messages WHERE chat_id=? ORDER BY idx", (cid,))]
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

    def configs(self) -> dict[str, tuple[str, dict]]:
        """Every chat's (title, config) by id, without its messages (the library reads a fork's parent)."""
        return {_text(cid): (_text(title, "Chat"), chat_config(config))
                for cid, title, config in self.db.execute("SELECT id, title, config FROM chats")}

    def save_chat(self, chat: Chat, position: int | None = None) -> None:
        """Insert or update `chat` (title, config, model, last used, messages). An update keeps the
        stored `open` flag and creation time (`set_open` changes the flag)."""
        with self.db:
            row = self.db.execute("SELECT position FROM chats WHERE id=?", (chat.id,)).fetchone()
            if position is None or position < 0:
                position = row[0] if row else (self.db.execute(
                    "SELECT COALESCE(MAX(position), -1) + 1 FROM chats").fetchone()[0])
            title = valid_text(chat.title)
            messages = [{"role": valid_text(m["role"]), "content": valid_text(m["content"]),
                         "fields": _json_text({k: v for k, v in m.items() if k not in MESSAGE_COLUMNS})}
                        for m in chat.messages]
            self.db.execute(
                "INSERT INTO chats (id, title, position, config, created, updated, model, open) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?) "
                "ON CONFLICT(id) DO UPDATE SET title=excluded.title, position=excluded.position, "
                "config=excluded.config, updated=excluded.updated, model=excluded.model",
                (valid_text(chat.id), title, position, _json_text(chat.config), chat.created,
                 chat.updated or chat.created, valid_text(chat.model), int(chat.open)))
            self.db.execute("DELETE FROM messages WHERE chat_id=?", (valid_text(chat.id),))
            self.db.executemany("INSERT INTO messages (chat_id, idx, role, content, fields) VALUES (?, ?, ?, ?, ?)",
                                [(valid_text(chat.id), i, m["role"], m["content"], m["fields"])
                                 for i, m in enumerate(messages)])
            self._index(valid_text(chat.id), title, messages)

    def set_order(self, ids: list[str]) -> None:
        with self.db:
            self.db.executemany("UPDATE chats SET position=? WHERE id=?", [(i, cid) for i, cid in enumerate(ids)])

    def set_open(self, chat_id: str, is_open: bool) -> None:
        with self.db:
            self.db.execute("UPDATE chats SET open=? WHERE id=?", (int(bool(is_open)), chat_id))

    def rename(self, chat_id: str, title: str) -> None:
        chat_id, title = valid_text(chat_id), valid_text(title)
        with self.db:
            self.db.execute("UPDATE chats SET title=? WHERE id=?", (title, chat_id))
            if self.fts:
                where, args = self._fts_row(chat_id)
                self.db.execute(f"UPDATE chats_fts SET title=? WHERE {where}", (title, *args))

    def delete_chat(self, chat_id: str) -> Chat | None:
        """Delete the chat and its messages; returns what was deleted (for `restore_chat`: undo)."""
        gone = self.chat(chat_id)
        if gone is not None:       # its documents go with it (cascade), kept here for an undo
            self._doc_trash[chat_id] = [
                self.db.execute("SELECT * FROM documents WHERE chat_id=?", (chat_id,)).fetchall(),
                self.db.execute("SELECT k.* FROM doc_chunks k JOIN documents d ON d.id=k.doc_id "
                                "WHERE d.chat_id=? ORDER BY k.id", (chat_id,)).fetchall()]
            while len(self._doc_trash) > UNDO_CHATS:
                self._doc_trash.pop(next(iter(self._doc_trash)))
        with self.db:
            self.db.execute("DELETE FROM messages WHERE chat_id=?", (chat_id,))
            self.db.execute("DELETE FROM chats WHERE id=?", (chat_id,))
            self._unindex(chat_id)
        return gone

    def restore_chat(self, chat: Chat) -> None:
        """Put back a chat `delete_chat` returned, as it was (open flag, times, model, messages, documents)."""
        self.save_chat(chat)
        self.set_open(chat.id, chat.open)
        docs, chunks = self._doc_trash.pop(chat.id, ([], []))
        with self.db:
            self.db.executemany("INSERT OR IGNORE INTO documents VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)", docs)
            self.db.executemany("INSERT OR IGNORE INTO doc_chunks VALUES (?, ?, ?, ?, ?)", chunks)

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
        """The chats whose title or messages (or one passage of one of their documents) hold every word of
        `text` (word prefixes, case and accents ignored), last used first; every chat for a blank `text`.
        Never raises on odd input."""
        if not text.strip():
            return self.library()
        text = valid_text(text)
        terms = _WORD.findall(text)
        if not terms:
            return []
        try:
            if self.fts:
                in_docs = ""
                args: tuple = (fts_query(text),)
                if self.doc_fts:           # or every word in one chunk of one of its documents
                    in_docs = (" OR c.id IN (SELECT d.chat_id FROM documents d JOIN doc_chunks k ON k.doc_id=d.id "
                               "WHERE k.id IN (SELECT rowid FROM doc_fts WHERE doc_fts MATCH ?))")
                    args += (" AND ".join('"%s"*' % t.replace('"', '""') for t in terms),)
                rows = self.db.execute(
                    self._SUMMARY + "WHERE c.id IN (SELECT chat_id FROM chats_fts WHERE chats_fts MATCH ?)"
                    + in_docs + self._NEWEST, args).fetchall()
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
        pid, name = valid_text(pid), valid_text(name)
        with self.db:
            self.db.execute(
                "INSERT INTO presets (id, name, position, data) VALUES "
                "(?, ?, (SELECT COALESCE(MAX(position), -1) + 1 FROM presets), ?) "
                "ON CONFLICT(id) DO UPDATE SET name=excluded.name, data=excluded.data",
                (pid, name, _json_text(data)))

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
        except (sqlite3.Error, UnicodeError) as e:      # text is made valid on the way in: a bug, told once
            self._failed(fn.__name__, e)
            return default()
    return wrapper


for _name, _default in (("chats", list), ("chat", lambda: None), ("save_chat", lambda: None),
                        ("set_order", lambda: None), ("set_open", lambda: None), ("rename", lambda: None),
                        ("delete_chat", lambda: None), ("restore_chat", lambda: None), ("library", list),
                        ("search", list), ("presets", list), ("save_preset", lambda: None),
                        ("delete_preset", lambda: None), ("close", lambda: None)):
    setattr(Store, _name, _guarded(getattr(Store, _name), _default))
Store.configs = _guarded(Store.configs, dict)
