"""The chat library: the store's new columns, migration and FTS5 search (on real SQLite files), the
side list (close only closes, reopen, rename, delete with confirmation and undo, export), and a
journey on the real engine: a chat closed, the app restarted, the chat reopened from the library and
continued."""
from __future__ import annotations

import json
import os
import sqlite3
import time

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

import pytest  # noqa: E402
from PySide6.QtCore import Qt  # noqa: E402

from app_fixtures import LOAD_TIMEOUT_MS, REPLY_TIMEOUT_MS, open_window, send_and_wait  # noqa: E402

pytestmark = pytest.mark.gui

OLD_SCHEMA = """
CREATE TABLE chats (
    id TEXT PRIMARY KEY, title TEXT NOT NULL, position INTEGER NOT NULL,
    config TEXT NOT NULL DEFAULT '{}', created REAL NOT NULL);
CREATE TABLE messages (
    chat_id TEXT NOT NULL REFERENCES chats(id) ON DELETE CASCADE, idx INTEGER NOT NULL,
    role TEXT NOT NULL, content TEXT NOT NULL, PRIMARY KEY (chat_id, idx));
CREATE TABLE presets (
    id TEXT PRIMARY KEY, name TEXT NOT NULL, position INTEGER NOT NULL, data TEXT NOT NULL DEFAULT '{}');
"""

HOSTILE = ['"', '""', "'", "*", "NEAR(", "NEAR(a b", "a OR", "AND", "OR NOT", "title:", "{title}: x", "(", ")",
           "^", "-", "+", "a*b", '"unterminated', "x\x00y", "🦓", "\\", "%", "_", "a" * 5000, "chat_id: abc",
           "body:zebra", "zebra NEAR(", "  ", ":"]


def _msgs(*texts: str) -> list[dict]:
    return [{"role": "user" if i % 2 == 0 else "assistant", "content": t} for i, t in enumerate(texts)]


def _chat(title: str, *texts: str, updated: float = 0.0, **kw):
    from app.store import Chat
    return Chat(title=title, messages=_msgs(*texts), updated=updated, **kw)


# ---- the store, on a real SQLite file ------------------------------------------------------------
def test_store_fts5_is_available(tmp_path):
    from app.store import Store
    st = Store(tmp_path / "c.sqlite3")
    assert st.fts, f"this Python's SQLite {sqlite3.sqlite_version} has no FTS5"
    st.close()


def test_store_migrates_a_database_of_the_old_schema(tmp_path):
    path = tmp_path / "chats.sqlite3"
    db = sqlite3.connect(path)
    db.executescript(OLD_SCHEMA)
    db.execute("INSERT INTO chats VALUES ('old1', 'Zebra facts', 0, '{\"preset\": \"default\"}', 1000)")
    db.execute("INSERT INTO chats VALUES ('old2', 'Second', 1, '{}', 2000)")
    db.executemany("INSERT INTO messages VALUES (?, ?, ?, ?)", [
        ("old1", 0, "user", "How fast is a zebra?"), ("old1", 1, "assistant", "About 65 km/h."),
        ("old2", 0, "user", "Tell me about penguins")])
    db.execute("INSERT INTO presets VALUES ('p1', 'Terse', 0, '{}')")
    db.commit()
    db.close()

    from app.store import ChatSummary, Store
    st = Store(path)
    assert st.moved_aside is None
    cols = {r[1] for r in st.db.execute("PRAGMA table_info(chats)")}
    assert {"updated", "model", "open"} <= cols
    # Every chat kept, open (it had a tab), last used when created; newest first
    assert st.library() == [ChatSummary("old2", "Second", "", 2000.0, True, 1),
                            ChatSummary("old1", "Zebra facts", "", 1000.0, True, 2)]
    assert [c.id for c in st.chats(open_only=True)] == ["old1", "old2"]
    assert st.chat("old1").messages == _msgs("How fast is a zebra?", "About 65 km/h.")
    assert st.chat("old1").config == {"preset": "default"}
    assert st.presets() == [("p1", "Terse", {})]
    # The index was built from the existing messages
    assert [s.id for s in st.search("penguin")] == ["old2"]
    assert [s.id for s in st.search("65 km")] == ["old1"]
    st.close()
    again = Store(path)                      # a second open migrates nothing and indexes nothing twice
    assert [s.id for s in again.library()] == ["old2", "old1"]
    assert again.db.execute("SELECT COUNT(*) FROM chats_fts").fetchone()[0] == 2
    again.close()


def test_store_search_titles_and_message_text_newest_first(tmp_path):
    from app.store import Store
    st = Store(tmp_path / "c.sqlite3")
    a = _chat("Cooking", "a recipe for crème brûlée", "Heat the cream.", updated=100)
    b = _chat("Holiday plans", "Where do zebras live?", "In Africa, on the savanna.", updated=300)
    c = _chat("Zebra stripes", "why stripes", updated=200)
    for ch in (a, b, c):
        st.save_chat(ch)
    assert [s.id for s in st.library()] == [b.id, c.id, a.id]
    assert [s.id for s in st.search("zebra")] == [b.id, c.id]        # message text, then title; newest first
    assert [s.id for s in st.search("ZEBRA savanna")] == [b.id]      # every word, any case
    assert [s.id for s in st.search("creme brulee")] == [a.id]       # accents ignored
    assert [s.id for s in st.search("sava")] == [b.id]               # a word's beginning (live filtering)
    assert st.search("zebra penguin") == []
    assert [s.id for s in st.search("   ")] == [b.id, c.id, a.id]    # blank: everything
    # Kept in step: new text, a rename, a delete
    a.messages.append({"role": "user", "content": "and a zebra cake?"})
    st.save_chat(a)
    assert {s.id for s in st.search("zebra")} == {a.id, b.id, c.id}
    st.rename(b.id, "Savanna trip")
    assert st.chat(b.id).title == "Savanna trip" and [s.id for s in st.search("trip")] == [b.id]
    st.delete_chat(c.id)
    assert c.id not in {s.id for s in st.search("zebra")}
    assert st.db.execute("SELECT COUNT(*) FROM chats_fts").fetchone()[0] == 2
    st.close()


@pytest.mark.parametrize("text", HOSTILE)
def test_store_search_never_raises_on_fts_syntax(tmp_path, text):
    from app.store import Store
    st = Store(tmp_path / "c.sqlite3")
    z = _chat("Zebra", "NEAR( zebra \"quoted\" * OR body:x", updated=2)
    other = _chat("Other", "nothing here", updated=1)
    st.save_chat(z)
    st.save_chat(other)
    found = st.search(text)
    assert isinstance(found, list)
    if "zebra" in text.lower():
        assert [s.id for s in found] == [z.id]
    st.fts = False                                                   # the LIKE fallback too
    assert isinstance(st.search(text), list)
    st.close()


def test_store_search_without_fts_falls_back_to_like(tmp_path):
    from app.store import Store
    st = Store(tmp_path / "c.sqlite3")
    a = _chat("Cooking", "100% butter_cake", updated=1)
    b = _chat("Zebras", "stripes", updated=2)
    st.save_chat(a)
    st.save_chat(b)
    st.fts = False
    assert [s.id for s in st.search("zebra")] == [b.id]
    assert [s.id for s in st.search("butter cake")] == [a.id]
    assert st.search("%") == []                                      # not a word
    assert [s.id for s in st.search("_")] == [a.id]                  # a literal underscore, not LIKE's wildcard
    st.close()


def test_store_delete_then_restore_round_trip(tmp_path):
    from app.store import Store
    path = tmp_path / "c.sqlite3"
    st = Store(path)
    ch = _chat("Keep me", "first", "second reply", updated=500.5, model="tiny.gguf",
               config={"preset": "x", "speed_projection": False})
    keep = _chat("Other", "x", updated=100)
    st.save_chat(keep)
    st.save_chat(ch)
    st.set_open(ch.id, False)
    before = st.chat(ch.id)
    gone = st.delete_chat(ch.id)
    assert gone == before and gone.open is False
    assert st.chat(ch.id) is None and st.search("second") == []
    assert st.db.execute("SELECT COUNT(*) FROM messages WHERE chat_id=?", (ch.id,)).fetchone()[0] == 0
    st.restore_chat(gone)
    st.close()
    again = Store(path)                          # as it was, on disk
    assert again.chat(ch.id) == before
    assert [s.id for s in again.search("second")] == [ch.id]
    assert [s.id for s in again.library()] == [ch.id, keep.id]
    assert again.delete_chat("no-such-chat") is None
    again.close()


# ---- the side list in a window (no engine) ---------------------------------------------------------
def _fill(window, view, *texts):
    view.chat.messages = _msgs(*texts)
    view.render_all()
    view.changed.emit()


def _listed(qtbot, lib, chat_id, present=True):
    """The library refreshed after the last change (it coalesces them) and lists chat_id, or not."""
    qtbot.waitUntil(lambda: not lib._refresh_timer.isActive() and (chat_id in lib.ids()) == present, timeout=5000)


def test_closing_a_tab_keeps_the_chat_and_the_library_reopens_it(qtbot, idle_window):
    w = idle_window
    lib = w.chat_library
    view = w.current_view()
    _fill(w, view, "what do zebras eat?", "Grass, mostly.")
    view.set_title("Zebra food")
    cid = view.chat.id
    other = w.new_tab()
    _fill(w, other, "hello")
    w.tabs.close_tab(w.tabs.indexOf(view))
    assert w.tabs.view_for(cid) is None and w.tabs.count() == 1
    _listed(qtbot, lib, cid)
    assert w.store.chat(cid).open is False and w.store.chat(cid).messages == _msgs("what do zebras eat?",
                                                                                   "Grass, mostly.")
    item = lib.item_for(cid)
    assert item.text(0) == "Zebra food" and item.text(2).startswith("today ")
    assert not item.font(0).bold() and lib.item_for(other.chat.id).font(0).bold()    # open chats in bold
    assert lib.current_id() == other.chat.id                            # the chat in front is selected
    # Enter on the item opens it in a tab, with its messages
    lib.tree.setFocus()
    lib.select(cid)
    qtbot.keyClick(lib.tree, Qt.Key.Key_Return)
    reopened = w.tabs.view_for(cid)
    assert reopened is not None and w.current_view() is reopened
    assert reopened.chat.messages == _msgs("what do zebras eat?", "Grass, mostly.")
    assert "Grass, mostly." in reopened.transcript_text()
    assert w.tabs.tabText(w.tabs.indexOf(reopened)) == "Zebra food"
    assert w.store.chat(cid).open is True
    # Opening it again only focuses its tab
    w.tabs.setCurrentWidget(other)
    assert lib.open_chat(cid) is reopened and w.tabs.count() == 2 and w.current_view() is reopened


def test_closed_chats_stay_closed_after_a_restart_and_reopen_from_the_list(qtbot, idle_window):
    w = idle_window
    view = w.current_view()
    _fill(w, view, "remember the platypus")
    cid = view.chat.id
    kept = w.new_tab()
    _fill(w, kept, "still open")
    w.tabs.close_tab(w.tabs.indexOf(view))
    w.close()
    again = open_window(qtbot, start_engine=False)
    try:
        assert [v.chat.id for v in again.views()] == [kept.chat.id]
        assert again.chat_library.ids() == [kept.chat.id, cid]          # newest first
        assert [s.id for s in again.store.search("platypus")] == [cid]
        again.chat_library.search.setText("platyp")                     # live filter
        assert again.chat_library.ids() == [cid]
        again.chat_library.search.returnPressed.emit()                  # Enter in the field opens the first
        assert again.current_view().chat.id == cid
        assert again.current_view().chat.messages == _msgs("remember the platypus")
    finally:
        again.close()


def test_an_empty_new_chat_is_dropped_when_its_tab_closes(qtbot, idle_window):
    w = idle_window
    view = w.new_tab()
    cid = view.chat.id
    assert w.store.chat(cid) is not None
    w.tabs.close_tab(w.tabs.indexOf(view))
    assert w.store.chat(cid) is None
    _listed(qtbot, w.chat_library, cid, present=False)


def test_messages_record_last_use_and_model_a_title_does_not(qtbot, idle_window):
    w = idle_window
    w.tabs.model_path = lambda: "/models/dir/tiny-llama.gguf"
    view = w.current_view()
    view.chat.updated = 10.0
    t0 = time.time()
    _fill(w, view, "hi", "hello")
    stored = w.store.chat(view.chat.id)
    assert stored.updated >= t0 and stored.model == "tiny-llama.gguf"
    w.tabs.model_path = lambda: "/models/other.gguf"
    view.set_title("Greeting")                                          # not a use
    assert w.store.chat(view.chat.id).updated == stored.updated
    assert w.store.chat(view.chat.id).model == "tiny-llama.gguf"
    _listed(qtbot, w.chat_library, view.chat.id)
    assert w.chat_library.item_for(view.chat.id).text(0) == "Greeting"
    assert w.chat_library.item_for(view.chat.id).text(1) == "tiny-llama"


def test_delete_asks_first_and_undo_brings_the_chat_back(qtbot, idle_window, monkeypatch):
    from PySide6.QtWidgets import QMessageBox
    w = idle_window
    lib = w.chat_library
    view = w.current_view()
    _fill(w, view, "a question about owls", "An answer.", "more?", "More.")
    view.set_title("Owls")
    cid = view.chat.id
    before = w.store.chat(cid)
    asked = []

    def answer(reply):
        def question(parent, title, text, *a, **k):
            asked.append(text)
            return reply
        return question
    monkeypatch.setattr(QMessageBox, "question", answer(QMessageBox.StandardButton.No))
    assert lib.delete_dialog(cid) is False
    assert "Owls" in asked[0] and "4 messages" in asked[0]
    assert w.store.chat(cid) is not None and w.tabs.view_for(cid) is view

    monkeypatch.setattr(QMessageBox, "question", answer(QMessageBox.StandardButton.Yes))
    lib.select(cid)
    lib.delete_btn.click()
    assert len(asked) == 2
    assert w.store.chat(cid) is None and w.tabs.view_for(cid) is None and cid not in lib.ids()
    assert w.store.search("owls") == []
    assert lib.undo_row.isVisibleTo(lib) and "Owls" in lib.undo_label.text()
    assert w.tabs.count() == 1                                  # the last tab closed: a new chat

    lib.undo_btn.click()
    assert not lib.undo_row.isVisibleTo(lib)
    assert w.store.chat(cid) == before                          # every message, the same times
    back = w.tabs.view_for(cid)
    assert back is not None and back.chat.messages == before.messages    # it had a tab: it has one again
    assert lib.current_id() == cid and [s.id for s in w.store.search("owls")] == [cid]


def test_undo_of_a_closed_chat_keeps_it_closed_and_the_offer_expires(qtbot, idle_window, monkeypatch):
    from PySide6.QtWidgets import QMessageBox
    from app import chat_library
    w = idle_window
    lib = w.chat_library
    view = w.current_view()
    _fill(w, view, "closed one")
    cid = view.chat.id
    w.new_tab()
    w.tabs.close_tab(w.tabs.indexOf(view))
    monkeypatch.setattr(QMessageBox, "question", lambda *a, **k: QMessageBox.StandardButton.Yes)
    lib._undo_timer.setInterval(50)
    assert lib.delete_dialog(cid)
    lib.undo_delete()
    assert w.store.chat(cid).open is False and w.tabs.view_for(cid) is None and cid in lib.ids()
    assert lib.delete_dialog(cid)
    with qtbot.waitSignal(lib._undo_timer.timeout, timeout=5000):
        pass
    assert not lib.undo_row.isVisibleTo(lib) and lib.last_deleted is None
    lib.undo_delete()                                            # nothing left to undo
    assert w.store.chat(cid) is None
    assert chat_library.UNDO_MS == 10_000


def test_rename_from_the_library_open_or_closed(qtbot, idle_window, monkeypatch):
    from PySide6.QtWidgets import QInputDialog
    w = idle_window
    lib = w.chat_library
    a = w.current_view()
    _fill(w, a, "one")
    b = w.new_tab()
    _fill(w, b, "two")
    w.tabs.close_tab(w.tabs.indexOf(b))
    monkeypatch.setattr(QInputDialog, "getText", lambda *args, **kw: ("  Renamed open  ", True))
    lib.rename_dialog(a.chat.id)
    assert a.chat.title == "Renamed open" and w.tabs.tabText(w.tabs.indexOf(a)) == "Renamed open"
    assert w.store.chat(a.chat.id).title == "Renamed open"
    monkeypatch.setattr(QInputDialog, "getText", lambda *args, **kw: ("Renamed closed", True))
    lib.rename_dialog(b.chat.id)
    assert w.store.chat(b.chat.id).title == "Renamed closed"
    assert [s.id for s in w.store.search("renamed closed")] == [b.chat.id]
    _listed(qtbot, lib, b.chat.id)
    assert lib.item_for(b.chat.id).text(0) == "Renamed closed"
    monkeypatch.setattr(QInputDialog, "getText", lambda *args, **kw: ("   ", True))
    lib.rename_dialog(b.chat.id)
    assert w.store.chat(b.chat.id).title == "Renamed closed"


def test_find_chat_shows_the_library_and_focuses_its_search(qtbot, idle_window):
    w = idle_window
    w.show()
    qtbot.waitExposed(w)
    w.activateWindow()
    w.side.setCurrentWidget(w.models)
    action = next(a for m in w.menuBar().actions() for a in m.menu().actions() if a.text() == "Find Chat…")
    assert action.shortcut().toString() == "Ctrl+Shift+F"
    action.trigger()
    assert w.side.currentWidget() is w.chat_library
    qtbot.waitUntil(lambda: w.chat_library.search.hasFocus(), timeout=5000)


def test_the_window_with_the_library_fits_1024x700(qtbot, idle_window):
    w = idle_window
    w.resize(1024, 700)
    w.show()
    qtbot.waitExposed(w)
    assert w.side.indexOf(w.chat_library) == 0 and w.side.indexOf(w.models) == 1
    assert w.chat_library.minimumSizeHint().width() <= 300
    assert w.chat_library.isVisible()


# ---- export --------------------------------------------------------------------------------------
def test_export_markdown_and_json_contents(tmp_path):
    from app.chat_export import export_chat, file_name, to_json, to_markdown
    ch = _chat("Poems: *short*/long", "Write a poem\nwith two lines", "Roses are red,\nviolets are blue.\n\n```py\nx = 1\n```",
               model="tiny-llama.gguf", updated=1_700_000_100.0)
    ch.created = 1_700_000_000.0
    ch.messages.insert(0, {"role": "system", "content": "Be brief."})
    md = to_markdown(ch)
    assert md.startswith("# Poems: *short*/long\n\nModel: tiny-llama.gguf · Created: 2023-11-1")
    assert "\n## System\n\nBe brief.\n" in md
    assert "\n## User\n\nWrite a poem\nwith two lines\n" in md
    assert "\n## Assistant\n\nRoses are red,\nviolets are blue.\n\n```py\nx = 1\n```\n" in md
    assert md.index("## System") < md.index("## User") < md.index("## Assistant")
    data = json.loads(to_json(ch))
    assert set(data) == {"title", "model", "created", "updated", "messages", "tree"}
    assert data["title"] == "Poems: *short*/long" and data["model"] == "tiny-llama.gguf"
    assert data["messages"] == ch.messages
    from datetime import datetime
    assert datetime.fromisoformat(data["created"]).timestamp() == 1_700_000_000.0
    assert datetime.fromisoformat(data["updated"]).timestamp() == 1_700_000_100.0
    assert file_name(ch, "markdown") == "Poems short long.md" and file_name(ch, "json").endswith(".json")
    folder = tmp_path / "exports"
    folder.mkdir()
    out = export_chat(ch, folder / "c.md", "markdown")
    assert out.read_text(encoding="utf-8") == md
    assert json.loads(export_chat(ch, folder / "c.json", "json").read_text(encoding="utf-8")) == data
    assert sorted(p.name for p in folder.iterdir()) == ["c.json", "c.md"]       # no temporary left
    assert (folder / "c.md").stat().st_mode & 0o777 == 0o644


def test_export_from_the_library_writes_the_chosen_file(qtbot, idle_window, monkeypatch, tmp_path):
    from PySide6.QtWidgets import QFileDialog
    w = idle_window
    view = w.current_view()
    _fill(w, view, "Über café ☕", "Ja.")
    view.set_title("Café")
    offered = []

    def save_as(target):
        def dialog(parent, caption, start, filt):
            offered.append((caption, start, filt))
            return (str(target), filt) if target else ("", "")
        return dialog
    monkeypatch.setattr(QFileDialog, "getSaveFileName", save_as(tmp_path / "out.md"))
    out = w.chat_library.export_dialog(view.chat.id, "markdown")
    assert out == tmp_path / "out.md"
    assert offered[0][1].endswith("Café.md") and "*.md" in offered[0][2]
    assert "## User\n\nÜber café ☕\n" in out.read_text(encoding="utf-8")
    monkeypatch.setattr(QFileDialog, "getSaveFileName", save_as(tmp_path / "out.json"))
    out = w.chat_library.export_dialog(view.chat.id, "json")
    assert json.loads(out.read_text(encoding="utf-8"))["messages"][0]["content"] == "Über café ☕"
    assert offered[1][1].startswith(str(tmp_path))                 # the last folder is remembered
    monkeypatch.setattr(QFileDialog, "getSaveFileName", save_as(None))
    assert w.chat_library.export_dialog(view.chat.id, "json") is None     # cancelled


# ---- journeys on the real engine ------------------------------------------------------------------
def test_journey_close_restart_reopen_from_the_library_and_continue(qtbot, window):
    view = window.current_view()
    first = send_and_wait(qtbot, view, "Tell me about zebras")
    cid = view.chat.id
    window.tabs.close_tab(window.tabs.indexOf(view))
    assert window.tabs.view_for(cid) is None
    _listed(qtbot, window.chat_library, cid)
    window.close()

    again = open_window(qtbot)
    try:
        with qtbot.waitSignal(again.library.loaded, timeout=LOAD_TIMEOUT_MS):
            again.show()
        assert cid not in [v.chat.id for v in again.views()]
        lib = again.chat_library
        summary = next(s for s in again.store.library() if s.id == cid)
        assert summary.model == "tiny-llama.gguf" and summary.n_messages == 2 and not summary.open
        lib.search.setText("zebras")
        assert lib.ids() == [cid]
        lib.tree.setFocus()
        lib.select(cid)
        qtbot.keyClick(lib.tree, Qt.Key.Key_Return)
        reopened = again.current_view()
        assert reopened.chat.id == cid
        assert reopened.chat.messages == [{"role": "user", "content": "Tell me about zebras"},
                                          {"role": "assistant", "content": first.text}]
        second = send_and_wait(qtbot, reopened, "And their stripes?")
        assert second.generated_tokens >= 1
        expected = [{"role": "user", "content": "Tell me about zebras"},
                    {"role": "assistant", "content": first.text},
                    {"role": "user", "content": "And their stripes?"},
                    {"role": "assistant", "content": second.text}]
        assert reopened.chat.messages == expected
        assert again.store.chat(cid).messages == expected and again.store.chat(cid).open
        assert "And their stripes?" in reopened.transcript_text()
    finally:
        again.close()


def test_journey_closing_a_tab_mid_reply_still_saves_the_chat(qtbot, window):
    view = window.current_view()
    chat = view.chat
    other = window.new_tab()
    window.tabs.setCurrentWidget(view)
    view.input.setPlainText("Count to twenty")
    view.send_input()
    assert view.busy
    with qtbot.waitSignal(view.request.finished, timeout=REPLY_TIMEOUT_MS):
        window.tabs.close_tab(window.tabs.indexOf(view))
        assert window.tabs.view_for(chat.id) is None and window.tabs.current_view() is other
        assert window.tabs._closing == {chat.id: view}
    # The view stays until the stopped reply (and a title it asked for) ended, then goes
    qtbot.waitUntil(lambda: chat.id not in window.tabs._closing, timeout=REPLY_TIMEOUT_MS)
    stored = window.store.chat(chat.id)
    assert stored is not None and not stored.open
    assert stored.messages[0] == {"role": "user", "content": "Count to twenty"}
    assert stored.messages == chat.messages and stored.title == chat.title      # what arrived, saved
    _listed(qtbot, window.chat_library, chat.id)


def test_journey_deleting_a_chat_mid_reply_leaves_nothing_and_undo_restores_what_was_saved(qtbot, window):
    view = window.current_view()
    chat_id = view.chat.id
    window.new_tab()
    window.tabs.setCurrentWidget(view)
    view.input.setPlainText("Count to twenty")
    view.send_input()
    req = view.request
    with qtbot.waitSignal(req.finished, timeout=REPLY_TIMEOUT_MS):
        gone = window.chat_library.delete_chat(chat_id)
        assert gone.messages == [{"role": "user", "content": "Count to twenty"}]
        assert window.tabs._dropped == {view} and window.tabs.view_for(chat_id) is None
    # The deleted chat's view lives on until its stopped reply (and a title it asked for) ended;
    # what arrived is never saved back
    assert chat_id not in window.tabs._closing
    qtbot.waitUntil(lambda: not window.tabs._dropped, timeout=REPLY_TIMEOUT_MS)
    assert window.store.chat(chat_id) is None and chat_id not in window.chat_library.ids()
    window.chat_library.undo_delete()
    back = window.tabs.view_for(chat_id)
    assert back is not None and back.chat.messages == gone.messages
    assert send_and_wait(qtbot, back, "Go on").generated_tokens >= 1
    assert [m["role"] for m in window.store.chat(chat_id).messages] == ["user", "user", "assistant"]
