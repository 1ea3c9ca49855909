"""The chat library: every chat in the store (title, model, last used; last used first), open ones in
bold; a search field filtering live over titles and message text (the store's FTS5 index); Open
(double-click or Enter), Rename, Delete (asks first; "Undo delete" for UNDO_MS afterwards brings the
chat back with every message) and Export as Markdown or JSON (app/chat_export.py). A fork names its
parent (in its tooltip, and under the list when selected, with a link that opens it). It follows the
tabs' `library_changed`, so a chat closed, renamed or answered in a tab shows at once."""
from __future__ import annotations

import html
import time
from datetime import datetime
from pathlib import Path

from PySide6.QtCore import QStandardPaths, Qt, QTimer, Signal
from PySide6.QtGui import QAction, QFont
from PySide6.QtWidgets import (QAbstractItemView, QHBoxLayout, QHeaderView, QInputDialog, QLabel, QLineEdit,
                               QMenu, QMessageBox, QPushButton, QToolButton, QTreeWidget, QTreeWidgetItem,
                               QVBoxLayout, QWidget, QFileDialog)

from .branches import fork_origin
from .chat_export import export_chat, file_name
from .store import Chat, ChatSummary

UNDO_MS = 10_000
ID_ROLE = Qt.ItemDataRole.UserRole


def human_time(t: float, now: float | None = None) -> str:
    """"today 14:02", "yesterday 09:15", "12 Mar" (this year) or "12 Mar 2023"."""
    when = datetime.fromtimestamp(t)
    today = datetime.fromtimestamp(time.time() if now is None else now).date()
    days = (today - when.date()).days
    if days == 0:
        return f"today {when:%H:%M}"
    if days == 1:
        return f"yesterday {when:%H:%M}"
    if when.year == today.year:
        return f"{when.day} {when:%b}"
    return f"{when.day} {when:%b %Y}"


def model_label(model: str) -> str:
    return model[:-5] if model.lower().endswith(".gguf") else model


class ChatLibrary(QWidget):
    """`tabs` is the window's ChatTabs (its store, open_chat, rename_chat, delete_chat, restore_chat).
    `opened(chat_id)` after a chat was opened from here."""
    opened = Signal(str)

    def __init__(self, tabs, parent: QWidget | None = None):
        super().__init__(parent)
        self.tabs = tabs
        self.store = tabs.store
        self.last_deleted: Chat | None = None
        self.export_dir = QStandardPaths.writableLocation(QStandardPaths.StandardLocation.DocumentsLocation) \
            or str(Path.home())

        self.search = QLineEdit(placeholderText="Search chats (titles and messages)", clearButtonEnabled=True)
        self.search.textChanged.connect(lambda _t: self.refresh())
        self.search.returnPressed.connect(self._open_from_search)
        self.tree = QTreeWidget(rootIsDecorated=False, uniformRowHeights=True, allColumnsShowFocus=True)
        self.tree.setHeaderLabels(["Title", "Model", "Last used"])
        self.tree.setSelectionMode(QAbstractItemView.SelectionMode.SingleSelection)
        self.tree.setTextElideMode(Qt.TextElideMode.ElideRight)
        header = self.tree.header()
        header.setStretchLastSection(False)
        header.setSectionResizeMode(0, QHeaderView.ResizeMode.Stretch)
        header.setSectionResizeMode(1, QHeaderView.ResizeMode.Interactive)
        header.setSectionResizeMode(2, QHeaderView.ResizeMode.ResizeToContents)
        header.resizeSection(1, 90)
        self.tree.itemActivated.connect(lambda item, _col: self.open_chat(item.data(0, ID_ROLE)))
        self.tree.currentItemChanged.connect(lambda *_: self._update_buttons())
        self.tree.setContextMenuPolicy(Qt.ContextMenuPolicy.CustomContextMenu)
        self.tree.customContextMenuRequested.connect(self._context_menu)
        self.empty = QLabel("No chat matches.", visible=False, alignment=Qt.AlignmentFlag.AlignCenter)
        self.fork_label = QLabel(visible=False, wordWrap=True, textFormat=Qt.TextFormat.RichText)
        self.fork_label.linkActivated.connect(self.open_chat)
        self._forked: dict[str, tuple[str, str]] = {}    # fork id -> (parent id, "forked from ..." line)

        # Tool buttons: narrower than push buttons, so the side pane stays narrow (the window fits 1024 px)
        self.open_btn = QToolButton(text="Open", clicked=lambda: self.open_chat(self.current_id()))
        self.rename_btn = QToolButton(text="Rename…", clicked=lambda: self.rename_dialog(self.current_id()))
        self.delete_btn = QToolButton(text="Delete…", clicked=lambda: self.delete_dialog(self.current_id()))
        self.export_btn = QToolButton(text="Export", popupMode=QToolButton.ToolButtonPopupMode.InstantPopup)
        export_menu = QMenu(self.export_btn)
        export_menu.addAction("Markdown…", lambda: self.export_dialog(self.current_id(), "markdown"))
        export_menu.addAction("JSON…", lambda: self.export_dialog(self.current_id(), "json"))
        self.export_btn.setMenu(export_menu)
        self.undo_label = QLabel()
        self.undo_btn = QPushButton("Undo delete", clicked=self.undo_delete)
        self.undo_row = QWidget(visible=False)
        ul = QHBoxLayout(self.undo_row)
        ul.setContentsMargins(0, 0, 0, 0)
        ul.addWidget(self.undo_label, 1)
        ul.addWidget(self.undo_btn)
        self._undo_timer = QTimer(self, singleShot=True, interval=UNDO_MS)
        self._undo_timer.timeout.connect(self._drop_undo)

        buttons = QHBoxLayout()
        buttons.setContentsMargins(0, 0, 0, 0)
        for w in (self.open_btn, self.rename_btn, self.delete_btn, self.export_btn):
            buttons.addWidget(w)
        buttons.addStretch(1)
        lay = QVBoxLayout(self)
        lay.setContentsMargins(4, 4, 4, 4)
        lay.addWidget(self.search)
        lay.addWidget(self.tree, 1)
        lay.addWidget(self.empty)
        lay.addWidget(self.fork_label)
        lay.addWidget(self.undo_row)
        lay.addLayout(buttons)

        # Several changes in one go (a tab closed and a new one opened) refresh once.
        self._refresh_timer = QTimer(self, singleShot=True, interval=0)
        self._refresh_timer.timeout.connect(self.refresh)
        tabs.library_changed.connect(self._refresh_timer.start)
        tabs.currentChanged.connect(lambda _i: self._follow_current())
        self.refresh()
        self._follow_current()

    # ---- the list ----------------------------------------------------------------------------
    def summaries(self) -> list[ChatSummary]:
        return self.store.search(self.search.text())

    def refresh(self) -> None:
        if self.tabs.closed:                     # the window shut down: the store is closed
            return
        keep = self.current_id()
        rows = self.summaries()
        self.tree.clear()
        bold = QFont(self.tree.font())
        bold.setBold(True)
        now = time.time()
        self._forked = self._fork_lines()
        for s in rows:
            item = QTreeWidgetItem([s.title, model_label(s.model), human_time(s.updated, now)])
            item.setData(0, ID_ROLE, s.id)
            n = f"{s.n_messages} message{'s' if s.n_messages != 1 else ''}"
            fork = self._forked.get(s.id)
            item.setToolTip(0, f"{s.title}\n{n}{' · open in a tab' if s.open else ''}" + (f"\n{fork[1]}" if fork else ""))
            item.setToolTip(1, s.model or "no reply yet")
            item.setToolTip(2, datetime.fromtimestamp(s.updated).strftime("%Y-%m-%d %H:%M:%S"))
            if s.open:
                item.setFont(0, bold)
            self.tree.addTopLevelItem(item)
            if s.id == keep:
                self.tree.setCurrentItem(item)
        self.empty.setVisible(not rows and bool(self.search.text().strip()))
        if not (self.tree.hasFocus() or self.search.hasFocus()):
            self._follow_current()               # not browsing the list: it shows the chat in front
        self._update_buttons()

    def _fork_lines(self) -> dict[str, tuple[str, str]]:
        """Each fork's parent id and its line: "Forked from “Title” at message N"."""
        configs = self.store.configs()
        out = {}
        for cid, (_title, config) in configs.items():
            origin = fork_origin(config)
            if origin is None:
                continue
            parent = configs.get(origin.chat_id)
            what = f"“{parent[0]}”" if parent else "a deleted chat"
            out[cid] = (origin.chat_id if parent else "", f"Forked from {what} at message {origin.message + 1}")
        return out

    def fork_text(self, chat_id: str) -> str:
        """The line under the list for chat `chat_id` ('' when it is not a fork)."""
        got = self._forked.get(chat_id)
        return got[1] if got else ""

    def ids(self) -> list[str]:
        """The listed chats' ids, in order (tests)."""
        return [self.tree.topLevelItem(i).data(0, ID_ROLE) for i in range(self.tree.topLevelItemCount())]

    def item_for(self, chat_id: str) -> QTreeWidgetItem | None:
        for i in range(self.tree.topLevelItemCount()):
            item = self.tree.topLevelItem(i)
            if item.data(0, ID_ROLE) == chat_id:
                return item
        return None

    def select(self, chat_id: str) -> None:
        item = self.item_for(chat_id)
        if item is not None:
            self.tree.setCurrentItem(item)

    def _follow_current(self) -> None:
        """The current tab's chat is the selected one (when listed)."""
        view = self.tabs.current_view()
        if view is not None:
            self.select(view.chat.id)

    def current_id(self) -> str:
        item = self.tree.currentItem()
        return item.data(0, ID_ROLE) if item is not None else ""

    def _update_buttons(self) -> None:
        has = bool(self.current_id())
        for w in (self.open_btn, self.rename_btn, self.delete_btn, self.export_btn):
            w.setEnabled(has)
        fork = self._forked.get(self.current_id())
        if fork:
            link = f' &nbsp; <a href="{html.escape(fork[0])}">Open it</a>' if fork[0] else ""
            self.fork_label.setText(html.escape(fork[1]) + link)
        self.fork_label.setVisible(bool(fork))

    def focus_search(self) -> None:
        self.search.setFocus(Qt.FocusReason.ShortcutFocusReason)
        self.search.selectAll()

    def _open_from_search(self) -> None:
        cid = self.current_id() or (self.ids() or [""])[0]
        self.open_chat(cid)

    def _context_menu(self, pos) -> None:
        item = self.tree.itemAt(pos)
        if item is None:
            return
        cid = item.data(0, ID_ROLE)
        menu = QMenu(self)
        for text, slot in (("Open", lambda: self.open_chat(cid)), ("Rename…", lambda: self.rename_dialog(cid)),
                           ("Delete…", lambda: self.delete_dialog(cid)), (None, None),
                           ("Export Markdown…", lambda: self.export_dialog(cid, "markdown")),
                           ("Export JSON…", lambda: self.export_dialog(cid, "json"))):
            if text is None:
                menu.addSeparator()
            else:
                menu.addAction(QAction(text, menu, triggered=slot))
        menu.exec(self.tree.viewport().mapToGlobal(pos))

    # ---- actions -----------------------------------------------------------------------------
    def open_chat(self, chat_id: str):
        if not chat_id:
            return None
        view = self.tabs.open_chat(chat_id)
        if view is not None:
            self.opened.emit(chat_id)
        return view

    def rename_dialog(self, chat_id: str) -> None:
        chat = self.store.chat(chat_id) if chat_id else None
        if chat is None:
            return
        title, ok = QInputDialog.getText(self, "Rename chat", "Title:", text=chat.title)
        if ok and title.strip():
            self.tabs.rename_chat(chat_id, title)

    def delete_dialog(self, chat_id: str) -> bool:
        """Delete the chat after asking; True when it was deleted (then Undo is offered)."""
        chat = self.store.chat(chat_id) if chat_id else None
        if chat is None:
            return False
        n = len(chat.messages)
        answer = QMessageBox.question(
            self, "Delete chat",
            f"Delete “{chat.title}” and its {n} message{'s' if n != 1 else ''}? "
            "Undo is offered for a few seconds; after that it is gone for good.",
            QMessageBox.StandardButton.Yes | QMessageBox.StandardButton.No, QMessageBox.StandardButton.No)
        if answer != QMessageBox.StandardButton.Yes:
            return False
        self.delete_chat(chat_id)
        return True

    def delete_chat(self, chat_id: str) -> Chat | None:
        """Delete without asking; Undo is offered for UNDO_MS."""
        gone = self.tabs.delete_chat(chat_id)
        if gone is not None:
            if self.last_deleted is not None:          # the Undo of the one before is over
                self.tabs.purge_images(self.last_deleted.id)
            self.last_deleted = gone
            self.undo_label.setText(f"Deleted “{gone.title}”.")
            self.undo_row.show()
            self._undo_timer.start()
            self.refresh()
        return gone

    def undo_delete(self) -> None:
        gone, self.last_deleted = self.last_deleted, None
        self._undo_timer.stop()
        self.undo_row.hide()
        if gone is not None:
            self.tabs.restore_chat(gone)
            self.refresh()
            self.select(gone.id)

    def _drop_undo(self) -> None:
        if self.last_deleted is not None:              # gone for good: its images too
            self.tabs.purge_images(self.last_deleted.id)
        self.last_deleted = None
        self.undo_row.hide()

    def export_dialog(self, chat_id: str, fmt: str) -> Path | None:
        chat = self.store.chat(chat_id) if chat_id else None
        if chat is None:
            return None
        caption, filt = {"markdown": ("Export chat as Markdown", "Markdown (*.md)"),
                         "json": ("Export chat as JSON", "JSON (*.json)")}[fmt]
        path, _ = QFileDialog.getSaveFileName(self, caption, str(Path(self.export_dir) / file_name(chat, fmt)), filt)
        if not path:
            return None
        try:
            out = export_chat(chat, path, fmt, self.tabs.images)
        except OSError as e:
            QMessageBox.warning(self, "Export", f"The chat was not exported: {e.strerror or e}")
            return None
        self.export_dir = str(out.parent)
        return out
