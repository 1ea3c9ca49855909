"""Documents in a chat, on the real engine (a tiny GGUF): a small Markdown file dropped on the message
box goes in whole (the engine's counts say it fits); a 200-page PDF attached goes in by passages, and a
question about a fact on its page 150 sends that passage with its source name; the prompt the engine
received (Status: the live conversation's messages) holds both; the sources' links show the passage;
the chat, its documents and their sources come back after a restart; the library search finds a word
that only the PDF holds; export lists the sources."""
from __future__ import annotations

import json
import os

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

import pytest  # noqa: E402
from PySide6.QtCore import QMimeData, QPoint, QPointF, Qt, QUrl  # noqa: E402
from PySide6.QtGui import QDragEnterEvent, QDropEvent  # noqa: E402
from PySide6.QtWidgets import QApplication  # noqa: E402

from app_fixtures import REPLY_TIMEOUT_MS, open_window, send_and_wait  # noqa: E402
from pdf_factory import book, write_pdf  # noqa: E402

pytestmark = pytest.mark.gui

FACT = "The lighthouse keeper's cat is named Marmalade Quillfeather."
EXTRACT_TIMEOUT_MS = 120_000


def _drop(widget, path) -> None:
    """A drag of `path` entering `widget`, then dropped on it (Qt delivers a drop only after an accepted enter)."""
    mime = QMimeData()
    mime.setUrls([QUrl.fromLocalFile(str(path))])
    enter = QDragEnterEvent(QPoint(5, 5), Qt.DropAction.CopyAction, mime, Qt.MouseButton.NoButton,
                            Qt.KeyboardModifier.NoModifier)
    QApplication.sendEvent(widget, enter)
    assert enter.isAccepted()
    QApplication.sendEvent(widget, QDropEvent(QPointF(5, 5), Qt.DropAction.CopyAction, mime, Qt.MouseButton.NoButton,
                                              Qt.KeyboardModifier.NoModifier))


def _live_messages(qtbot, client) -> list[dict]:
    req = client.status()
    with qtbot.waitSignal(req.done, timeout=REPLY_TIMEOUT_MS) as got:
        pass
    return got.args[0].live_messages


def test_documents_whole_and_retrieved_reach_the_engine_and_survive_a_restart(qtbot, window, tmp_path):
    w = window
    view = w.current_view()
    docs = view.documents
    notes = tmp_path / "notes.md"
    notes.write_text("# Notes\n\nThe door code is 4711.\n")
    with qtbot.waitSignal(docs.decided, timeout=EXTRACT_TIMEOUT_MS) as small:
        _drop(view.input.viewport(), notes)                # dropped on the message box
    assert small.args[0].mode == "whole" and small.args[0].tokens > 0
    assert view.input.toPlainText() == ""                  # the drop attached it, no URL typed
    send_and_wait(qtbot, view, "What is the door code?")
    asked = view.chat.messages[-2]
    assert [(s["name"], s["mode"]) for s in asked["documents"]] == [("notes.md", "whole")]
    live = _live_messages(qtbot, w.client)
    sent = [m for m in live if m["role"] == "user"][-1]["content"]
    assert "[1] notes.md, whole document:" in sent and "The door code is 4711." in sent
    assert sent.rstrip().endswith("Question: What is the door code?")

    pdf = write_pdf(tmp_path / "survey.pdf", book(200, {150: FACT}))
    with qtbot.waitSignal(docs.decided, timeout=EXTRACT_TIMEOUT_MS) as big:
        docs.attach(pdf)
    info = big.args[0]
    assert info.mode == "passages" and info.pages == 200 and 1 <= info.k <= 4
    send_and_wait(qtbot, view, "What is the name of the lighthouse keeper's cat?")
    at = len(view.chat.messages) - 2
    srcs = view.chat.messages[at]["documents"]
    assert srcs[0]["name"] == "survey.pdf" and "150" in srcs[0]["place"]
    assert "Marmalade Quillfeather" in srcs[0]["text"].replace("\n", " ")
    assert all(s["mode"] == "passages" for s in srcs)        # notes.md went in once, with its question
    live = _live_messages(qtbot, w.client)
    users = [m["content"] for m in live if m["role"] == "user"]
    assert f"[1] survey.pdf, {srcs[0]['place']}:" in users[-1] and "Quillfeather" in users[-1]
    assert "The door code is 4711." in users[-2]              # the earlier question renders as it was sent
    # the source link under the question shows its passage
    assert f'href="cite:{at}:1"' in view.transcript.toHtml()
    view.transcript.anchorClicked.emit(QUrl(f"cite:{at}:1"))
    assert docs.passage_dialog.isVisible() and "Quillfeather" in docs.passage_text.toPlainText()
    assert docs.passage_dialog.windowTitle() == f"[1] survey.pdf, {srcs[0]['place']}"
    cid, messages = view.chat.id, [dict(m) for m in view.chat.messages]
    assert [s.id for s in w.store.search("quillfeather")] == [cid]
    docs.passage_dialog.close()
    w.close()

    again = open_window(qtbot, start_engine=False)
    try:
        reopened = again.tabs.view_for(cid)
        assert reopened is not None and reopened.chat.messages == messages
        assert "notes.md (whole)" in reopened.documents.label.text()
        assert "survey.pdf" in reopened.documents.label.text()
        reopened.transcript.anchorClicked.emit(QUrl(f"cite:{at - 2}:1"))     # the whole document, from the database
        assert "The door code is 4711." in reopened.documents.passage_text.toPlainText()
        # the prompt of the reopened chat is the one sent before (its K/V prefix stands)
        assert [m["content"] for m in reopened.request_messages() if m["role"] == "user"] == users
        from app.chat_export import to_json, to_markdown
        md = to_markdown(reopened.chat)
        assert "- [1] notes.md, whole document" in md and "  > " in md and "Quillfeather" in md
        exported = json.loads(to_json(reopened.chat))["messages"]
        assert exported[at]["documents"][0]["name"] == "survey.pdf"
    finally:
        again.close()
