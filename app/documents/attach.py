"""A chat tab's documents, the Qt side: an Attach button and drops of document files on the message
box or anywhere on the chat (by file type: text, Markdown, code, CSV, PDF; session files and models
still go to the session controller, images to theirs), the extraction in a child process with
progress and Cancel, the engine's counts that decide whole or by passages, and the passage a
citation link shows.

Whole or by passages: the engine counts the prompt as the next question would send it with the
document whole (its template and tokenizer, CountTokens) against the context (the chat config's
context length, else the model's), less the reply's reserve (the config's max tokens). What fits goes
in whole with the next question, once; a larger document is retrieved from: each question gets the
TOP_K passages that BM25 ranks best (app/documents/index.py), fewer where TOP_K of them would take more
than half of what the context has left."""
from __future__ import annotations

import html
import sqlite3
import threading
from pathlib import Path

from PySide6.QtCore import QEvent, QObject, QThread, Signal
from PySide6.QtWidgets import (QApplication, QDialog, QDialogButtonBox, QFileDialog, QHBoxLayout, QLabel, QProgressBar,
                               QPushButton, QTextBrowser, QVBoxLayout, QWidget)

from . import prompt
from ..alive import while_alive
from .chunks import CHUNK_CHARS
from .extract import KINDS, kind_of
from .index import PASSAGES, TOP_K, WHOLE, ChatDocuments, DocInfo
from .worker import Outcome, extract_bounded

# A document of more characters than this many per token of the context cannot fit: it is not
# counted (a tokenizer makes a token of every few characters of real text, never of twenty)
MAX_CHARS_PER_TOKEN = 20
FILTER = "Documents (" + " ".join(f"*{s}" for s in sorted(KINDS)) + ")"


def document_files(mime) -> list[Path]:
    if not mime.hasUrls():
        return []
    return [Path(u.toLocalFile()) for u in mime.urls() if u.isLocalFile() and kind_of(u.toLocalFile())]


class ExtractThread(QThread):
    """extract_bounded off the window thread; `cancel()` kills its child process. Unparented and kept in
    RUNNING until it ends: a tab closed meanwhile cancels it (its child is killed within WATCH_SECONDS),
    and the app's quit waits for it."""
    progressed = Signal(int, int)
    outcome = Signal(object)             # worker.Outcome

    def __init__(self, path: Path, parent: QObject | None = None):
        super().__init__(parent)
        self.path = path
        self._stop = threading.Event()

    def run(self) -> None:
        self.outcome.emit(extract_bounded(self.path, progress=self.progressed.emit, cancelled=self._stop.is_set))

    def cancel(self) -> None:
        self._stop.set()


RUNNING: set[ExtractThread] = set()
_QUIT_HOOKED: set[int] = set()           # the applications whose aboutToQuit stops the readers


def _stop_all_on_quit() -> None:
    # Qt's UniqueConnection takes only a QObject's member function: a plain function is connected once
    # per application by hand instead
    app = QApplication.instance()
    if app is not None and id(app) not in _QUIT_HOOKED:
        _QUIT_HOOKED.add(id(app))
        app.aboutToQuit.connect(_stop_all)


def _stop_all() -> None:
    for t in list(RUNNING):
        t.cancel()
        t.wait(10_000)


class TabDocuments(QObject):
    """The documents of one ChatView (`view.documents`): what its send and prompt ask
    (`sources`, `expand`), and the row above its message box."""
    decided = Signal(object)             # a DocInfo once whole or by passages is settled
    refused = Signal(str)                # a file not attached: why

    def __init__(self, view, store, client):
        super().__init__(view)
        self.view, self.client = view, client
        self.docs = ChatDocuments(store.db, view.chat.id, store.doc_fts)
        self.queue: list[Path] = []
        self.thread: ExtractThread | None = None
        self.passage_dialog: QDialog | None = None
        self._build_row()
        view.documents = self
        view.cite_clicked.connect(self.show_source)
        view.changed.connect(self.refresh)       # a question sent takes the whole documents waiting for it
        # dropped on the message box, or anywhere on the chat (its transcript): other drops go on
        view.input.viewport().installEventFilter(self)
        view.setAcceptDrops(True)
        view.installEventFilter(self)
        self.refresh()

    def _build_row(self) -> None:
        self.label = QLabel(wordWrap=True)
        self.bar = QProgressBar(textVisible=True, maximumHeight=16, visible=False)
        self.cancel_btn = QPushButton("Cancel", clicked=self.cancel, visible=False)
        self.attach_btn = QPushButton("Attach…", clicked=self.choose,
                                      toolTip="Attach a text, Markdown, code, CSV or PDF file (or drop it on the chat)")
        self.row = QWidget()
        lay = QHBoxLayout(self.row)
        lay.setContentsMargins(0, 0, 0, 0)
        lay.addWidget(self.label, 1)
        lay.addWidget(self.bar)
        lay.addWidget(self.cancel_btn)
        lay.addWidget(self.attach_btn)
        outer = self.view.layout()
        outer.insertWidget(outer.indexOf(self.view.input), self.row)

    # ---- what ChatView asks ------------------------------------------------------------------------
    def sources(self, question: str, messages: list[dict]) -> list[dict]:
        try:
            return prompt.for_question(self.docs, question, messages)
        except sqlite3.Error as e:          # the database failed: the question goes without them, said
            self.view.message.emit(f"Documents not searched: {e}")
            return []

    def expand(self, messages: list[dict]) -> list[dict]:
        return prompt.expand(messages, self._text)

    def _text(self, doc_id: str) -> str | None:
        try:
            return self.docs.text(doc_id)
        except sqlite3.Error:
            return None

    # ---- attaching ---------------------------------------------------------------------------------
    def choose(self) -> None:
        paths, _ = QFileDialog.getOpenFileNames(self.view, "Attach Documents", str(Path.home()), FILTER)
        for p in paths:
            self.attach(p)

    def attach(self, path) -> None:
        """Read `path` (queued behind a file being read) into this chat's documents."""
        self.queue.append(Path(path))
        if self.thread is None:
            self._next()

    def _next(self) -> None:
        if not self.queue:
            self.bar.hide()
            self.cancel_btn.hide()
            self.refresh()
            return
        path = self.queue.pop(0)
        self.label.setText(f"Reading {path.name}…")
        self.bar.setRange(0, 0)
        self.bar.show()
        self.cancel_btn.show()
        t = self.thread = ExtractThread(path)
        RUNNING.add(t)
        _stop_all_on_quit()
        t.progressed.connect(self._on_progress)
        t.outcome.connect(self._on_outcome)
        t.finished.connect(self._on_thread_end)
        t.finished.connect(t.deleteLater)
        self.view.destroyed.connect(t.cancel)
        t.start()

    def _on_progress(self, done: int, total: int) -> None:
        self.bar.setRange(0, total)
        self.bar.setValue(done)
        self.bar.setFormat("page %v of %m")

    def _on_thread_end(self) -> None:
        RUNNING.discard(self.thread)
        self.thread = None
        self._next()

    def cancel(self) -> None:
        self.queue.clear()
        if self.thread is not None:
            self.thread.cancel()

    def _on_outcome(self, out: Outcome) -> None:
        path = self.thread.path if self.thread is not None else Path("?")
        if out.cancelled:
            self.view.message.emit(f"{path.name}: not attached (cancelled)")
            return
        if out.doc is None:
            self._refuse(out.error)
            return
        try:
            info = self.docs.add(out.doc)
        except sqlite3.Error as e:
            self._refuse(f"{path.name} was read but could not be stored ({e})")
            return
        self.view.changed.emit()
        self._decide(info)

    def _refuse(self, why: str) -> None:
        self.view.add_note(f"Not attached: {why}")
        self.view.message.emit(why)
        self.refused.emit(why)

    # ---- whole or by passages ------------------------------------------------------------------------
    def _decide(self, info: DocInfo) -> None:
        st = self.client.status()
        st.done.connect(while_alive(self, lambda r: self._count(info, r)))
        st.failed.connect(while_alive(self, lambda m: self._settle(info, PASSAGES, 0, TOP_K, f"not counted ({m})")))

    def _context(self, status) -> int:
        n_ctx = status.facts.n_ctx if getattr(status, "facts", None) is not None else 0
        own = self.view.preset.context_length
        return min(n_ctx, own) if own > 0 and n_ctx else n_ctx

    def _count(self, info: DocInfo, status) -> None:
        """Count the next question's prompt without the document, with its first passages and (when it
        may fit) with it whole; then settle."""
        n_ctx = self._context(status)
        if not n_ctx:
            self._settle(info, PASSAGES, 0, TOP_K, "no model is loaded to count it")
            return
        history = self.view.request_messages()
        pending = [d for d in self.pending() if d.id != info.id]

        def probe(whole: list[DocInfo], passages: list) -> list[dict]:
            q = {"role": "user", "content": "?", "documents": prompt.sources(whole, passages)}
            return history + prompt.expand([q], self._text)
        probes = {"without": probe(pending, []), "passages": probe(pending, self.docs.first_passages(info.id))}
        if info.chars <= MAX_CHARS_PER_TOKEN * n_ctx:
            probes["with"] = probe(pending + [info], [])
        counts: dict[str, int] = {}
        failed: list[str] = []

        def fail(m: str) -> None:
            if not failed:
                failed.append(m)
                self._settle(info, PASSAGES, 0, TOP_K, f"not counted ({m})")

        def got(key: str, r) -> None:
            counts[key] = int(r.tokens)
            if len(counts) == len(probes) and not failed:
                self._choose(info, n_ctx, counts)
        for key, msgs in probes.items():
            req = self.client.count_prompt_tokens(msgs)
            req.done.connect(while_alive(self, lambda r, k=key: got(k, r)))
            req.failed.connect(fail)

    def _choose(self, info: DocInfo, n_ctx: int, counts: dict[str, int]) -> None:
        """Whole when the prompt with it whole leaves the reply's reserve; else by passages, as many a
        question (up to TOP_K) as fit half of what is left."""
        reserve = int(self.view.preset.sampling().get("max_tokens", 0))
        base = counts["without"]
        tokens = counts["with"] - base if "with" in counts else 0
        if "with" in counts and counts["with"] + reserve <= n_ctx:
            self._settle(info, WHOLE, tokens, TOP_K, "")
            return
        left = max(0, n_ctx - base - reserve)
        per = max(1, (counts["passages"] - base) / TOP_K)
        k = max(1, min(TOP_K, int(left / 2 / per)))
        why = f"more than the {left:,} tokens left of {n_ctx:,}" if tokens else \
            f"{info.chars:,} characters cannot fit a {n_ctx:,}-token context"
        self._settle(info, PASSAGES, tokens, k, why)

    def _settle(self, info: DocInfo, mode: str, tokens: int, k: int, why: str) -> None:
        try:
            self.docs.set_mode(info.id, mode, tokens, k)
        except sqlite3.Error:
            pass
        size = f"{info.pages} pages, " if info.pages else ""
        size += f"{tokens:,} tokens" if tokens else f"{info.chars:,} characters"
        if mode == WHOLE:
            self.view.add_note(f"Attached {info.name} ({size}): it goes in whole with the next question")
        else:
            which = f"the {k} of its {info.chunks} passages most relevant to each question go in" if k > 1 else \
                f"the one of its {info.chunks} passages most relevant to each question goes in"
            self.view.add_note(f"Attached {info.name} ({size}; {why}): {which} ({CHUNK_CHARS}-character chunks "
                               f"ranked by BM25)")
        self.refresh()
        self.decided.emit(self.docs.info(info.id))

    def pending(self) -> list[DocInfo]:
        """The whole documents the next question takes (attached, not sent yet), with their token counts:
        what the prompt will grow by beyond the chat's messages."""
        sent = {s.get("doc") for m in self.view.chat.messages if isinstance(m.get("documents"), list)
                for s in m["documents"]}
        try:
            return [d for d in self.docs.documents() if d.mode == WHOLE and d.id not in sent]
        except sqlite3.Error:
            return []

    def refresh(self) -> None:
        if self.thread is not None:
            return
        try:
            listed = self.docs.documents()
        except sqlite3.Error:
            listed = []
        waiting = {d.id for d in self.pending()}

        def how(d: DocInfo) -> str:
            if d.mode != WHOLE:
                return f"{d.k} of {d.chunks} passages a question"
            return f"whole, {d.tokens:,} tokens with the next question" if d.id in waiting else "whole"
        items = [f"{html.escape(d.name)} ({how(d)})" for d in listed]
        self.label.setText("Documents: " + " · ".join(items) if items else "")

    # ---- a citation clicked --------------------------------------------------------------------------
    def show_source(self, at: int, n: int) -> None:
        s = prompt.find_source(self.view.chat.messages, at, n)
        if s is None:
            return
        if self.passage_dialog is None:
            self.passage_dialog = QDialog(self.view, windowTitle="Source")
            self.passage_text = QTextBrowser()
            lay = QVBoxLayout(self.passage_dialog)
            lay.addWidget(self.passage_text)
            lay.addWidget(QDialogButtonBox(QDialogButtonBox.StandardButton.Close,
                                           rejected=self.passage_dialog.reject))
            self.passage_dialog.resize(640, 480)
        self.passage_dialog.setWindowTitle(f"[{n}] {s.get('name')}, {s.get('place')}")
        self.passage_text.setPlainText(prompt.source_text(s, self._text))
        self.passage_dialog.show()
        self.passage_dialog.raise_()

    # ---- drops on the message box or the chat --------------------------------------------------------
    def eventFilter(self, obj: QObject, e: QEvent) -> bool:  # noqa: N802
        t = e.type()
        if t in (QEvent.Type.DragEnter, QEvent.Type.DragMove, QEvent.Type.Drop) and document_files(e.mimeData()):
            e.acceptProposedAction()
            if t == QEvent.Type.Drop:
                for p in document_files(e.mimeData()):
                    self.attach(p)
            return True
        return super().eventFilter(obj, e)


def attach_documents(view, store, client) -> TabDocuments:
    """Give chat tab `view` its documents (the window calls this for each new tab)."""
    return TabDocuments(view, store, client)
