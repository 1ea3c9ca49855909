"""Chats in SQLite (stdlib sqlite3, WAL): messages, tab order, preset, title; the presets (configs).

A database that cannot be read is moved aside (never silently dropped) and `moved_aside` says where.
"""
from __future__ import annotations

import json
import sqlite3
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

SCHEMA = """
CREATE TABLE IF NOT EXISTS chats (
    id TEXT PRIMARY KEY, title TEXT NOT NULL, position INTEGER NOT NULL,
    config TEXT NOT NULL DEFAULT '{}', created REAL NOT NULL);
CREATE TABLE IF NOT EXISTS messages (
    chat_id TEXT NOT NULL REFERENCES chats(id) ON DELETE CASCADE, idx INTEGER NOT NULL,
    role TEXT NOT NULL, content TEXT NOT NULL, PRIMARY KEY (chat_id, idx));
CREATE TABLE IF NOT EXISTS presets (
    id TEXT PRIMARY KEY, name TEXT NOT NULL, position INTEGER NOT NULL, data TEXT NOT NULL DEFAULT '{}');
"""


@dataclass
class Chat:
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    title: str = "New chat"
    messages: list[dict] = field(default_factory=list)
    config: dict = field(default_factory=dict)


class Store:
    def __init__(self, path: Path):
        self.path = Path(path)
        self.moved_aside: Path | None = None
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
        except sqlite3.DatabaseError:
            db.close()
            raise
        return db

    def chats(self) -> list[Chat]:
        out = []
        for cid, title, config in self.db.execute("SELECT id, title, config FROM chats ORDER BY position"):
            msgs = [{"role": r, "content": c} for r, c in self.db.execute(
                "SELECT role, content FROM messages WHERE chat_id=? ORDER BY idx", (cid,))]
            try:
                cfg = json.loads(config)
            except ValueError:
                cfg = {}
            out.append(Chat(cid, title, msgs, cfg))
        return out

    def save_chat(self, chat: Chat, position: int | None = None) -> None:
        with self.db:
            row = self.db.execute("SELECT position FROM chats WHERE id=?", (chat.id,)).fetchone()
            if position is None:
                position = row[0] if row else (self.db.execute(
                    "SELECT COALESCE(MAX(position), -1) + 1 FROM chats").fetchone()[0])
            self.db.execute(
                "INSERT INTO chats (id, title, position, config, created) VALUES (?, ?, ?, ?, ?) "
                "ON CONFLICT(id) DO UPDATE SET title=excluded.title, position=excluded.position, "
                "config=excluded.config", (chat.id, chat.title, position, json.dumps(chat.config), time.time()))
            self.db.execute("DELETE FROM messages WHERE chat_id=?", (chat.id,))
            self.db.executemany("INSERT INTO messages (chat_id, idx, role, content) VALUES (?, ?, ?, ?)",
                                [(chat.id, i, m["role"], m["content"]) for i, m in enumerate(chat.messages)])

    def set_order(self, ids: list[str]) -> None:
        with self.db:
            self.db.executemany("UPDATE chats SET position=? WHERE id=?", [(i, cid) for i, cid in enumerate(ids)])

    def delete_chat(self, chat_id: str) -> None:
        with self.db:
            self.db.execute("DELETE FROM messages WHERE chat_id=?", (chat_id,))
            self.db.execute("DELETE FROM chats WHERE id=?", (chat_id,))

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
