"""The chats database and the exporter on real files: a file that is not Strata's at the chats path is
never written to (its bytes unchanged, the chats kept in a database beside it, said once), an older
Strata database without the mark is marked and kept; any text the user can type is stored and
exported (lone surrogates as U+FFFD); export names fit the file system's 255-byte limit; a code fence a
message leaves open is closed in the Markdown export."""
from __future__ import annotations

import hashlib
import os
import sqlite3
from pathlib import Path

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

import pytest  # noqa: E402

from app.chat_export import close_fence, export_chat, file_name, to_markdown  # noqa: E402
from app.store import APPLICATION_ID, FORMAT_VERSION, Chat, Store  # noqa: E402

OLD_TABLES = """
CREATE TABLE chats (
    id TEXT PRIMARY KEY, title TEXT NOT NULL, position INTEGER NOT NULL,
    config TEXT NOT NULL DEFAULT '{}', created REAL NOT NULL);
CREATE TABLE messages (
    chat_id TEXT NOT NULL REFERENCES chats(id) ON DELETE CASCADE, idx INTEGER NOT NULL,
    role TEXT NOT NULL, content TEXT NOT NULL, PRIMARY KEY (chat_id, idx));
"""
OLD_PRESETS = """
CREATE TABLE presets (
    id TEXT PRIMARY KEY, name TEXT NOT NULL, position INTEGER NOT NULL, data TEXT NOT NULL DEFAULT '{}');
"""


def _sql(path: Path, script: str) -> None:
    con = sqlite3.connect(path)
    con.executescript(script)
    con.commit()
    con.close()


def _strata_then(path: Path, script: str) -> None:
    """A database the Store made, then changed by `script` (outside Strata)."""
    Store(path).close()
    _sql(path, script)


# Each maker leaves a file at the path that is not Strata's (or that this Strata must not write).
FOREIGN = {
    # the issue's case: another app's messages table whose extra NOT NULL column fails every insert
    "another app's messages table": lambda p: _sql(
        p, "CREATE TABLE messages (chat_id TEXT, idx INTEGER, role TEXT, content TEXT, extra TEXT NOT NULL); "
           "INSERT INTO messages VALUES ('x', 0, 'user', 'theirs', 'e');"),
    "Strata's tables plus an extra NOT NULL column": lambda p: _sql(
        p, OLD_TABLES.replace("content TEXT NOT NULL,", "content TEXT NOT NULL, extra TEXT NOT NULL,")),
    "Strata's tables and another app's": lambda p: _sql(p, OLD_TABLES + "CREATE TABLE invoices (n INTEGER);"),
    "other tables only": lambda p: _sql(p, "CREATE TABLE invoices (id INTEGER PRIMARY KEY, amount REAL); "
                                           "INSERT INTO invoices VALUES (1, 9.5);"),
    "Strata's tables under another app's id": lambda p: _sql(p, "PRAGMA application_id=1234;" + OLD_TABLES),
    "an SQLite file with no tables": lambda p: _sql(p, "PRAGMA user_version=3;"),
    "a newer Strata format": lambda p: _strata_then(p, f"PRAGMA user_version={FORMAT_VERSION + 1};"),
    "not SQLite": lambda p: p.write_bytes(b"%PDF-1.7 not a database at all\n" * 300),
    "an empty file": lambda p: p.write_bytes(b""),
    "a short file": lambda p: p.write_bytes(b"SQLite format 3\x00"),
    "a damaged SQLite file of another app": lambda p: (
        _sql(p, "CREATE TABLE notes (t TEXT); " + "INSERT INTO notes VALUES (hex(randomblob(500)));" * 40),
        p.write_bytes(p.read_bytes()[:4096] + b"\xa5" * (p.stat().st_size - 4096))),
}


def _digests(db: Path) -> dict[str, str]:
    """The file and any WAL/journal beside it, by content."""
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in db.parent.iterdir()
            if p.name.startswith(db.name)}


@pytest.mark.parametrize("shape", list(FOREIGN))
def test_a_file_that_is_not_stratas_is_never_written_and_the_chats_are_kept(tmp_path, shape):
    db = tmp_path / "chats.sqlite3"
    FOREIGN[shape](db)
    before = _digests(db)
    st = Store(db)
    failures: list[str] = []
    st.on_error = failures.append
    assert st.notice and "\n" not in st.notice, st.notice
    assert "left as it is" in st.notice and str(st.path) in st.notice, st.notice
    assert st.path == tmp_path / "chats-strata.sqlite3" and st.persistent
    chat = Chat(title="mine", messages=[{"role": "user", "content": "zebra?"},
                                        {"role": "assistant", "content": "stripes"}])
    st.save_chat(chat)
    st.save_preset("p1", "Terse", {"temperature": 0.5})
    st.close()
    assert failures == []
    assert _digests(db) == before, shape
    again = Store(db)                                  # the next start: the same file beside it, said once
    assert again.notice == "" and again.path == st.path
    assert [(c.title, c.messages) for c in again.chats()] == [("mine", chat.messages)]
    assert again.presets() == [("p1", "Terse", {"temperature": 0.5})]
    again.close()
    assert _digests(db) == before, shape
    assert not [p for p in tmp_path.iterdir() if ".corrupt-" in p.name or p.name.endswith(".new")]


@pytest.mark.parametrize("tables", ["first schema", "with presets", "library (search index)"])
def test_an_older_strata_database_without_the_mark_is_marked_and_kept(tmp_path, tables):
    db = tmp_path / "chats.sqlite3"
    if tables == "library (search index)":
        st = Store(db)
        st.save_chat(Chat(id="old1", title="Zebra facts", messages=[{"role": "user", "content": "How fast?"}]))
        st.close()
        _sql(db, "PRAGMA application_id=0; PRAGMA user_version=0;")      # as saved before the mark
    else:
        _sql(db, OLD_TABLES + (OLD_PRESETS if tables == "with presets" else "")
             + "INSERT INTO chats VALUES ('old1', 'Zebra facts', 0, '{}', 1000); "
               "INSERT INTO messages VALUES ('old1', 0, 'user', 'How fast?');")
    assert db.read_bytes()[68:72] == b"\0\0\0\0"
    st = Store(db)
    assert st.notice == "" and st.path == db and st.moved_aside is None
    assert [(c.id, c.title, c.messages) for c in st.chats()] == [
        ("old1", "Zebra facts", [{"role": "user", "content": "How fast?"}])]
    assert [s.id for s in st.search("zebra")] == ["old1"]
    st.save_chat(Chat(title="new one"))
    assert st.db.execute("PRAGMA application_id").fetchone()[0] == APPLICATION_ID
    assert st.db.execute("PRAGMA user_version").fetchone()[0] == FORMAT_VERSION
    st.close()
    assert int.from_bytes(db.read_bytes()[68:72], "big") == APPLICATION_ID     # in the header itself
    st = Store(db)
    assert st.notice == "" and sorted(c.title for c in st.chats()) == ["Zebra facts", "new one"]
    st.close()


def test_a_new_database_carries_the_mark_and_a_damaged_marked_one_is_copied_aside(tmp_path):
    db = tmp_path / "chats.sqlite3"
    st = Store(db)
    st.save_chat(Chat(title="kept"))
    st.close()
    assert int.from_bytes(db.read_bytes()[68:72], "big") == APPLICATION_ID
    data = bytearray(db.read_bytes())
    data[16:24] = b"\xff" * 8                         # Strata's own file, damaged: copied aside, replaced
    db.write_bytes(bytes(data))
    st = Store(db)
    assert st.moved_aside is not None and st.moved_aside.read_bytes() == bytes(data) and st.path == db
    st.close()


SURROGATES = [("lone high", "a\ud800b", "a\ufffdb"), ("lone low", "\udfff", "\ufffd"),
              ("escaped byte", "caf\udce9", "caf\ufffd"), ("a pair as two code points", "\ud83d\ude00", "😀"),
              ("reversed pair", "\ude00\ud83d", "\ufffd\ufffd")]


@pytest.mark.parametrize("name, given, stored", SURROGATES)
def test_any_text_is_stored_surrogates_as_replacement(tmp_path, name, given, stored):
    db = tmp_path / "chats.sqlite3"
    st = Store(db)
    failures: list[str] = []
    st.on_error = failures.append
    chat = Chat(title=f"title {given}", model=f"m{given}.gguf", config={"preset": f"p{given}"},
                messages=[{"role": "user", "content": f"question {given}"},
                          {"role": "assistant", "content": f"answer {given}"}])
    st.save_chat(chat)
    st.save_preset("p", f"preset {given}", {"system_prompt": f"be {given}"})
    other = Chat(title="other")
    st.save_chat(other)
    st.rename(other.id, f"renamed {given}")
    assert isinstance(st.search(f"question {given}"), list)
    st.close()
    assert failures == []
    st = Store(db)
    got = {c.id: c for c in st.chats()}
    assert got[chat.id].title == f"title {stored}" and got[chat.id].model == f"m{stored}.gguf"
    assert got[chat.id].config == {"preset": f"p{stored}"}
    assert [m["content"] for m in got[chat.id].messages] == [f"question {stored}", f"answer {stored}"]
    assert got[other.id].title == f"renamed {stored}"
    assert st.presets() == [("p", f"preset {stored}", {"system_prompt": f"be {stored}"})]
    assert [s.id for s in st.search("question")] == [chat.id]
    st.close()


@pytest.mark.parametrize("name, given, stored", SURROGATES)
def test_any_text_is_exported(tmp_path, name, given, stored):
    chat = Chat(title=f"t {given}", messages=[{"role": "user", "content": f"q {given}"}])
    md = export_chat(chat, tmp_path / "c.md", "markdown").read_text(encoding="utf-8")
    assert f"# t {stored}\n" in md and f"\nq {stored}\n" in md
    export_chat(chat, tmp_path / "c.json", "json")
    assert f"q {stored}" in (tmp_path / "c.json").read_text(encoding="utf-8")
    assert file_name(chat, "markdown") == f"t {stored}.md"


@pytest.mark.parametrize("title", ["😀" * 300, "a" + "😀" * 300, "ab" + "é" * 300, "x" * 300,
                                   "👩‍👩‍👧" * 100, "日本語" * 100])
@pytest.mark.parametrize("fmt", ["markdown", "json"])
def test_export_names_fit_the_file_system(tmp_path, title, fmt):
    chat = Chat(title=title, messages=[{"role": "user", "content": "hi"}])
    name = file_name(chat, fmt)
    ext = ".md" if fmt == "markdown" else ".json"
    raw = name.encode("utf-8")
    assert len(raw) <= 255 and name.endswith(ext) and not name.endswith(" " + ext)
    stem = name[:-len(ext)]
    assert stem and title.startswith(stem)             # whole characters, the title's own
    assert len(stem) == 80 or len(raw) > 255 - 8       # cut only at a limit (a character and a joiner short)
    out = export_chat(chat, tmp_path / name, fmt)      # the suggested name can be written here
    assert out.exists() and out.name == name


# ---- an open code fence in the Markdown export ---------------------------------------------------------
CUT_REPLIES = [
    ("backticks", "Here it is:\n\n```python\nprint(1)\n"),
    ("no newline", "```\nx = 1"),
    ("tildes", "~~~\nsome ``` inside\n"),
    ("a longer fence around a shorter", "````md\n```\nnot the end\n"),
    ("in a list item", "1. Run this:\n\n   ```sh\n   make\n"),
    ("the fence line only", "```"),
]


def _headings(md: str) -> list[str]:
    """The level-2 headings of `md` as a CommonMark reader (Qt's md4c) sees them."""
    from PySide6.QtGui import QTextDocument
    doc = QTextDocument()
    doc.setMarkdown(md, QTextDocument.MarkdownFeature.MarkdownDialectGitHub)
    out, b = [], doc.begin()
    while b.isValid():
        if b.blockFormat().headingLevel() == 2:
            out.append(b.text())
        b = b.next()
    return out


@pytest.mark.parametrize("name, reply", CUT_REPLIES)
def test_markdown_export_closes_a_fence_a_message_left_open(qapp, name, reply):
    chat = Chat(title="cut", messages=[{"role": "user", "content": "Show code"},
                                       {"role": "assistant", "content": reply},
                                       {"role": "user", "content": "Thanks"},
                                       {"role": "assistant", "content": "You're welcome."}])
    md = to_markdown(chat)
    assert _headings(md) == ["User", "Assistant", "User", "Assistant"], md
    assert md.index(reply) >= 0                         # the reply itself as it was, then the fence closed


@pytest.mark.parametrize("text", ["```py\nx = 1\n```", "````\n```\n````\n", "```a`b```\ntext", "    ```\n    code",
                                  "> ```\n> quoted", "plain text", "~~~\nx\n~~~~"])
def test_markdown_export_leaves_a_closed_or_inline_fence_as_it_is(text):
    assert close_fence(text) == text


FORMAT_1_MESSAGES = """
CREATE TABLE chats (
    id TEXT PRIMARY KEY, title TEXT NOT NULL, position INTEGER NOT NULL,
    config TEXT NOT NULL DEFAULT '{}', created REAL NOT NULL,
    updated REAL NOT NULL DEFAULT 0, model TEXT NOT NULL DEFAULT '', open INTEGER NOT NULL DEFAULT 1);
CREATE TABLE messages (
    chat_id TEXT NOT NULL REFERENCES chats(id) ON DELETE CASCADE, idx INTEGER NOT NULL,
    role TEXT NOT NULL, content TEXT NOT NULL, PRIMARY KEY (chat_id, idx));
"""


def test_a_messages_fields_beyond_role_and_content_round_trip_and_format_1_gains_them(tmp_path):
    db = tmp_path / "chats.sqlite3"
    _sql(db, f"PRAGMA application_id={APPLICATION_ID}; PRAGMA user_version=1;" + FORMAT_1_MESSAGES
         + "INSERT INTO chats VALUES ('c1', 'Old', 0, '{}', 1000, 1000, '', 1); "
           "INSERT INTO messages VALUES ('c1', 0, 'user', 'Hi');")
    st = Store(db)
    assert st.notice == "" and st.chat("c1").messages == [{"role": "user", "content": "Hi"}]
    rich = [{"role": "user", "content": "Look", "images": [{"sha256": "ab" * 32, "name": "cat.png"}]},
            {"role": "assistant", "content": "", "tool_calls": [{"id": "t1", "name": "add", "arguments": {"a": 1}}]},
            {"role": "tool", "content": "2", "tool_call_id": "t1"}]
    st.save_chat(Chat(id="c2", title="Rich", messages=rich))
    st.close()
    st = Store(db)
    assert st.db.execute("PRAGMA user_version").fetchone()[0] == FORMAT_VERSION
    assert st.chat("c2").messages == rich and st.chat("c1").messages == [{"role": "user", "content": "Hi"}]
    st.db.execute("UPDATE messages SET fields='not json' WHERE chat_id='c2' AND idx=0")
    assert st.chat("c2").messages[0] == {"role": "user", "content": "Look"}      # damaged fields: dropped
    st.close()
