"""Documents in a chat, on the real engine (a tiny GGUF): a small Markdown file dropped on the message
box goes in whole (the engine's counts say it fits); a 200-page PDF attached goes in by passages, and a
question about a fact on its page 150 sends that passage with its source name; the notes in the chat say
which (with the engine's count, or the passages a question takes); the prompt the engine
received (Status: the live conversation's messages) holds both; the sources' links show the passage;
the chat, its documents and their sources come back after a restart; the library search finds a word
that only the PDF holds; export lists the sources. Bad files (a zip renamed .pdf, an encrypted PDF, a
scanned one) are refused with one line each and lose nothing; Cancel kills the reader mid-file and
empties the queue, and the chat goes on."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

import psutil  # noqa: E402
import pytest  # noqa: E402
from PySide6.QtCore import QMimeData, QPoint, QPointF, Qt, QUrl  # noqa: E402
from PySide6.QtGui import QDragEnterEvent, QDropEvent  # noqa: E402
from PySide6.QtWidgets import QApplication  # noqa: E402

from app_fixtures import REPLY_TIMEOUT_MS, open_window, send_and_wait  # noqa: E402
from pdf_factory import book, encrypted, image_only, write_pdf  # noqa: E402

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
    assert f"Attached notes.md ({small.args[0].tokens:,} tokens): it goes in whole with the next question" \
        in view.transcript_text()                          # the chat says how it goes in, with the engine's count
    assert docs.label.text() == f"Documents: notes.md (whole, {small.args[0].tokens:,} tokens with the next question)"
    assert [d.name for d in docs.pending()] == ["notes.md"]
    # the meter counts the question as it would be sent: with the whole document it carries
    view.input.setPlainText("What is the door code?")
    view.counter.count_now()
    qtbot.waitUntil(lambda: view.meter.reading is not None and view.meter.reading.drafted
                    and view.counter.pending is None, timeout=EXTRACT_TIMEOUT_MS)
    with_doc = view.meter.reading.total
    alone = w.client.count_prompt_tokens(view.request_messages([{"role": "user", "content": "What is the door code?"}]))
    with qtbot.waitSignal(alone.done, timeout=EXTRACT_TIMEOUT_MS) as counted:
        pass
    assert with_doc >= counted.args[0].tokens + small.args[0].tokens - 4, (with_doc, counted.args[0].tokens)
    view.input.setPlainText("")
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
    assert info.chunks > 100
    assert f"of its {info.chunks} passages most relevant to each question go" in view.transcript_text()
    assert "(1600-character chunks ranked by BM25)" in view.transcript_text()
    assert docs.label.text() == f"Documents: notes.md (whole) · survey.pdf ({info.k} of {info.chunks} passages " \
        "a question)" and docs.pending() == []              # notes.md went with the first question
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
    # the reply's citation links to the same passage. The tiny random model cannot write one, so the
    # reply is given the "[1]" a real model writes (the prompt asks for it), as an edited reply would be
    view.chat.messages[at + 1]["content"] += " (see [1])"
    view.changed.emit()
    view.render_all()
    html = view.transcript.toHtml()
    assert html.count(f'href="cite:{at}:1"') == 2              # under the question and in the reply
    docs.passage_dialog.close()
    view.transcript.anchorClicked.emit(QUrl(f"cite:{at}:1"))
    assert docs.passage_dialog.isVisible() and "Quillfeather" in docs.passage_text.toPlainText()
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
        assert reopened.transcript.toHtml().count(f'href="cite:{at}:1"') == 2
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


def _bad_files(tmp_path) -> list:
    """A zip renamed .pdf, a password-protected PDF and a scanned one (pages without a text layer)."""
    with zipfile.ZipFile(tmp_path / "report.zip", "w") as z:
        z.writestr("report.txt", "quarterly figures\n" * 200)
    zipped = tmp_path / "report.pdf"
    (tmp_path / "report.zip").rename(zipped)
    locked = encrypted(tmp_path / "locked.pdf", [["the vault code is 9912"]])
    scan = tmp_path / "scan.pdf"
    scan.write_bytes(image_only(3))
    return [zipped, locked, scan]


def test_bad_files_are_refused_in_one_line_and_nothing_is_lost(qtbot, window, tmp_path):
    view = window.current_view()
    docs = view.documents
    notes = tmp_path / "notes.txt"
    notes.write_text("The door code is 4711.\n")
    with qtbot.waitSignal(docs.decided, timeout=EXTRACT_TIMEOUT_MS):
        docs.attach(notes)
    send_and_wait(qtbot, view, "What is the door code?")
    before = [dict(m) for m in view.chat.messages]
    listed = docs.docs.documents()
    view.input.setPlainText("a draft being written")
    refused: list[str] = []
    docs.refused.connect(refused.append)
    zipped, locked, scan = _bad_files(tmp_path)
    _drop(view.transcript.viewport(), zipped)                 # dropped on the chat, like a good file
    docs.attach(locked)                                       # queued behind it
    docs.attach(scan)
    qtbot.waitUntil(lambda: len(refused) == 3 and docs.thread is None, timeout=EXTRACT_TIMEOUT_MS)
    assert refused == ["report.pdf is not a PDF file (it has no %PDF- header)",
                       "locked.pdf is password-protected; Strata does not open encrypted PDFs: save a copy "
                       "without a password",
                       "scan.pdf has no text layer (a scanned PDF?): Strata reads a PDF's text and does not "
                       "recognise text in images"]
    shown = view.transcript_text()
    assert all(f"Not attached: {why}" in shown for why in refused)      # each reason in the chat, one line
    # nothing lost: the chat, its documents, the draft; the bar is gone and the list says what is attached
    assert view.chat.messages == before and docs.docs.documents() == listed
    assert view.input.toPlainText() == "a draft being written"
    assert docs.bar.isHidden() and docs.cancel_btn.isHidden()
    assert docs.label.text() == "Documents: notes.txt (whole)"
    # and the chat goes on: the next question is answered (notes.txt went in once, with the first)
    send_and_wait(qtbot, view, "Thanks. And the vault code?")
    assert len(view.chat.messages) == len(before) + 2 and "documents" not in view.chat.messages[-2]


def _readers(before: set[int]) -> list[psutil.Process]:
    """The app's processes started by multiprocessing's spawn since `before` (the document reader; not
    multiprocessing's resource tracker, which stays for the process's life)."""
    out = []
    for p in psutil.Process().children(recursive=True):
        try:
            if p.pid not in before and any("spawn_main" in part for part in p.cmdline()):
                out.append(p)
        except psutil.Error:           # gone meanwhile
            pass
    return out


def test_cancel_stops_the_reading_at_once_and_the_chat_goes_on(qtbot, window, tmp_path):
    view = window.current_view()
    docs = view.documents
    big = write_pdf(tmp_path / "atlas.pdf", book(600, {}))       # read page by page for several seconds
    small = tmp_path / "small.md"
    small.write_text("# Small\n\nA few words.\n")
    said: list[str] = []
    view.message.connect(said.append)
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    docs.attach(big)
    docs.attach(small)                                           # waits behind it
    assert docs.label.text() == "Reading atlas.pdf…" and docs.cancel_btn.isVisible()
    # the window thread is free while the child reads: the page count arrives and moves on
    qtbot.waitUntil(lambda: docs.bar.maximum() == 600 and docs.bar.value() >= 3, timeout=EXTRACT_TIMEOUT_MS)
    readers = _readers(before)
    assert readers, "the PDF is read in a child process"
    at = docs.bar.value()
    docs.cancel_btn.click()
    qtbot.waitUntil(lambda: docs.thread is None, timeout=EXTRACT_TIMEOUT_MS)
    assert at < 600 and "atlas.pdf: not attached (cancelled)" in said
    qtbot.waitUntil(lambda: not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in readers),
                    timeout=10_000)                              # the reader was killed, not left reading
    assert docs.docs.documents() == [] and docs.queue == []        # nothing half-stored; Cancel emptied the queue
    assert docs.bar.isHidden() and docs.cancel_btn.isHidden() and docs.label.text() == ""
    # attaching works again after a Cancel, and the chat goes on
    with qtbot.waitSignal(docs.decided, timeout=EXTRACT_TIMEOUT_MS) as got:
        docs.attach(small)
    assert got.args[0].mode == "whole"
    send_and_wait(qtbot, view, "What does the file say?")
    assert [s["name"] for s in view.chat.messages[-2]["documents"]] == ["small.md"]


# The real entry point (app.main.main): a PDF attached once the model is loaded, and Quit (the window
# closed, the application quit, as the menu's Quit and a SIGTERM do) while its third page is read. The
# readers counted are the spawned processes that were not there before the attach (the model list's
# header reader lives for the app's life).
QUIT_DRIVER = """
import sys
import psutil
from PySide6.QtWidgets import QApplication
import app.main as m


def spawned():
    out = set()
    for p in psutil.Process().children(recursive=True):
        try:
            if any("spawn_main" in c for c in p.cmdline()) and p.status() != psutil.STATUS_ZOMBIE:
                out.add(p.pid)
        except psutil.Error:
            pass
    return out


before = set()
real_start = m.start_window

def start_window(*a, **kw):
    w = real_start(*a, **kw)
    docs = w.current_view().documents
    asked = []

    def on_progress(done, total):
        if done >= 3 and not asked:
            asked.append(done)
            print("quit while reading page", done, "of", total, flush=True)
            w.close()
            QApplication.instance().quit()

    def attach(_path):                    # once the model is loaded: a quit here is the reader's alone
        before.update(spawned())
        docs.attach(sys.argv[1])
        docs.thread.progressed.connect(on_progress)
    w.library.loaded.connect(attach)
    return w
m.start_window = start_window
rc = m.main([])
print("readers left:", len(spawned() - before), flush=True)
sys.exit(rc)
"""


def test_quit_while_a_document_is_read_stops_its_reader_and_exits_cleanly(app_home, tmp_path):
    pdf = write_pdf(tmp_path / "atlas.pdf", book(600, {}))
    env = dict(os.environ, QT_QPA_PLATFORM="offscreen",
               PYTHONPATH=os.pathsep.join([str(Path(__file__).resolve().parents[2]), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-c", QUIT_DRIVER, str(pdf)], env=env, capture_output=True, text=True,
                          timeout=300)
    out = done.stdout + done.stderr
    assert "quit while reading page" in out and done.returncode == 0, out[-3000:]
    assert "readers left: 0" in out, out[-3000:]
    assert "Destroyed while thread" not in out, out[-3000:]
