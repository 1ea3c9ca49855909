"""The chat tabs: one ChatView per open chat, in the stored order; new, close, rename, move, and every
change saved to the Store. A new chat takes the config selected in the Configs pane.

Closing a tab only closes it: the chat stays in the store (`open` cleared) and the chat library
(app/chat_library.py) reopens it with `open_chat`. A chat whose reply is still finishing when its tab
closes keeps its view (hidden) until the reply ends, so the reply is saved; reopening it meanwhile
brings that same view back. Only an empty "New chat" is dropped when its tab closes. Deleting
(`delete_chat`) is the library's, and `restore_chat` undoes it.

Each time a chat's messages change, its `updated` (last used) is now and its `model` the loaded
model's file name (`model_path`, set by the window)."""
from __future__ import annotations

import time
from pathlib import Path

from PySide6.QtCore import Qt, Signal
from PySide6.QtWidgets import QInputDialog, QTabWidget, QToolButton, QWidget

from . import branches
from .chat_images import ChatImages
from .chat_view import DEFAULT_TITLE, ChatView
from .documents.index import ChatDocuments
from .documents.prompt import rename_documents
from .paths import AppPaths
from .presets import DEFAULT_ID
from .store import Chat
from .titles import TitleQueue


def _signature(chat: Chat) -> tuple:
    return tuple((m["role"], m["content"]) for m in chat.messages)


class ChatTabs(QTabWidget):
    """`view_added(view)` fires for each new tab's ChatView (the window connects its signals);
    `library_changed` whenever a chat was saved, closed, opened, renamed, deleted or restored."""
    view_added = Signal(object)
    library_changed = Signal()

    def __init__(self, store, client, presets, selected_preset, parent: QWidget | None = None,
                 images: ChatImages | None = None):
        super().__init__(parent, movable=True, tabsClosable=True, documentMode=True)
        self.store = store
        # the chats' images (a folder each): a deleted chat's go when its Undo is over (`purge_images`)
        self.images = images if images is not None else ChatImages(AppPaths.default().images_dir)
        self.client = client
        self.presets = presets
        self.selected_preset = selected_preset     # () -> the Configs pane's selected id, or ""
        self.model_path = lambda: ""               # () -> the loaded model's path ('' = none); the window's
        self.closed = False                        # set at shutdown: nothing is saved after it
        self.titles = TitleQueue(client, self)     # every tab's titles, after every tab's replies
        self._seen: dict[str, tuple] = {}          # chat id -> its messages when last saved
        self._closing: dict[str, ChatView] = {}    # closed tabs whose requests are still finishing
        self._dropped: set[ChatView] = set()       # views of deleted chats finishing: never saved again
        self.tabCloseRequested.connect(self.close_tab)
        self.tabBarDoubleClicked.connect(self.rename_tab)
        self.tabBar().tabMoved.connect(lambda *_: self.save_order())
        self.new_tab_btn = QToolButton(text="+", toolTip="New chat (Ctrl+T)", autoRaise=True)
        self.new_tab_btn.clicked.connect(lambda: self.new_tab())
        self.setCornerWidget(self.new_tab_btn, Qt.Corner.TopRightCorner)

    def open_stored(self) -> None:
        """The chats that had a tab, in order; a first chat when there are none. The images of chats
        the store no longer has (deleted as the app closed, its Undo never used) go first."""
        self.images.sweep(lambda chat_id: self.store.chat(chat_id) is not None)
        for chat in self.store.chats(open_only=True):
            self.add_chat_tab(chat, persist=False)
        if self.count() == 0:
            self.new_tab()

    def views(self) -> list[ChatView]:
        return [self.widget(i) for i in range(self.count())]

    def current_view(self) -> ChatView | None:
        return self.currentWidget()

    def view_for(self, chat_id: str) -> ChatView | None:
        """The tab showing chat `chat_id`, or None."""
        return next((v for v in self.views() if v.chat.id == chat_id), None)

    def new_tab(self, chat: Chat | None = None, preset_id: str | None = None) -> ChatView:
        """A new chat using config `preset_id` (default: the one selected in the Configs list)."""
        if chat is None:
            chat = Chat(config=self.chat_config(preset_id))
        return self.add_chat_tab(chat)

    def chat_config(self, preset_id: str | None = None) -> dict:
        preset = self.presets.get(preset_id or self.selected_preset() or DEFAULT_ID)
        return {"preset": preset.id, "speed_projection": preset.speed_projection}

    def add_chat_tab(self, chat: Chat, persist: bool = True) -> ChatView:
        chat.open = True
        view = ChatView(chat, self.client, self.presets, titles=self.titles, images=self.images)
        view.changed.connect(lambda v=view: self._persist(v))
        view.title_changed.connect(lambda t, v=view: self._set_tab_title(v, t))
        view.fork_requested.connect(lambda i, v=view: self.fork_chat(v.chat.id, i))
        index = self.addTab(view, chat.title)
        self._set_tab_title(view, chat.title)
        self._seen[chat.id] = _signature(chat)
        self.setCurrentIndex(index)
        self.view_added.emit(view)
        if persist:
            self.store.save_chat(chat, index)
            self.library_changed.emit()
        view.input.setFocus()
        return view

    def _persist(self, view: ChatView) -> None:
        chat = view.chat
        if self.closed or view in self._dropped:
            return
        sig = _signature(chat)
        if sig != self._seen.get(chat.id):        # a message came or went: the chat was used now
            self._seen[chat.id] = sig
            chat.updated = time.time()
            model = self.model_path()
            if model:
                chat.model = Path(model).name
        self.store.save_chat(chat, self.indexOf(view))      # -1 (closing): its stored position
        self.library_changed.emit()

    def _set_tab_title(self, view: ChatView, title: str) -> None:
        i = self.indexOf(view)
        if i >= 0:
            self.setTabText(i, title if len(title) <= 28 else title[:27] + "…")
            self.setTabToolTip(i, title)

    def fork_chat(self, chat_id: str, index: int) -> ChatView | None:
        """A new chat, in a new tab, of chat `chat_id`'s history up to and including message `index`
        (app/branches.py): its parent recorded, its first reply reusing the parent's K/V prefix."""
        view = self.view_for(chat_id) or self._closing.get(chat_id)
        parent = view.chat if view is not None else self.store.chat(chat_id)
        if parent is None or not 0 <= index < len(parent.messages):
            return None
        chat = branches.fork(parent, index)
        self.images.copy_chat(parent.id, chat.id, chat.messages)
        view = self.add_chat_tab(chat)
        # the fork's own copies of the parent's images (above) and documents, so its prompt reads the same and its
        # questions search them (the parent's are deleted with the parent)
        ids = ChatDocuments(self.store.db, parent.id, self.store.doc_fts).copy_to(chat.id)
        if ids:
            rename_documents(chat.messages, ids)
            self._persist(view)
        return view

    # ---- close, reopen ------------------------------------------------------------------------
    def close_tab(self, index: int) -> None:
        """Close the tab (its reply stopped); the chat stays in the library. An empty new chat goes."""
        view = self.widget(index)
        if view is None:
            return
        view.stop()
        view.drop_title()
        self.removeTab(index)
        chat = view.chat
        pending = [r for r in (view.request, view.title_request) if r is not None]
        if not pending and not chat.messages and chat.title == DEFAULT_TITLE:
            self.store.delete_chat(chat.id)
            self._seen.pop(chat.id, None)
            view.deleteLater()
        else:
            chat.open = False
            self.store.set_open(chat.id, False)
            if pending:
                # The stopped reply (and a title being written) still arrive: keep the view until then.
                self._closing[chat.id] = view
                for r in pending:
                    r.finished.connect(lambda v=view: self._release(v))
            else:
                view.deleteLater()
        self.save_order()
        self.library_changed.emit()
        if self.count() == 0:
            self.new_tab()

    def _release(self, view: ChatView) -> None:
        """A closed tab's request ended: drop its view once nothing of it is in flight (unless it was
        reopened meanwhile, or already dropped)."""
        closing = self._closing.get(view.chat.id) is view
        if not closing and view not in self._dropped:
            return
        if view.request is None and view.title_request is None:
            if closing:
                del self._closing[view.chat.id]
            self._dropped.discard(view)
            view.deleteLater()
        elif view.title_request is not None:     # the stopped reply asked for a title: wait for it too
            view.title_request.finished.connect(lambda v=view: self._release(v))

    def open_chat(self, chat_id: str) -> ChatView | None:
        """Show chat `chat_id`: focus its tab, or open it in a new one (None: no such chat)."""
        view = self.view_for(chat_id)
        if view is None:
            view = self._closing.pop(chat_id, None)
            if view is not None:                 # closed while finishing a reply: the same view back
                index = self.addTab(view, "")
                self._set_tab_title(view, view.chat.title)
                self.setCurrentIndex(index)
            else:
                chat = self.store.chat(chat_id)
                if chat is None:
                    return None
                view = self.add_chat_tab(chat, persist=False)
            view.chat.open = True
            self.store.set_open(chat_id, True)
            self.save_order()
            self.library_changed.emit()
        self.setCurrentWidget(view)
        view.input.setFocus()
        return view

    # ---- rename, delete, undo -----------------------------------------------------------------
    def rename_tab(self, index: int) -> None:
        view = self.widget(index)
        if view is None:
            return
        title, ok = QInputDialog.getText(self, "Rename chat", "Title:", text=view.chat.title)
        if ok and title.strip():
            view.set_title(title.strip())

    def rename_chat(self, chat_id: str, title: str) -> None:
        """Rename a chat, open or not."""
        title = title.strip()
        if not title:
            return
        view = self.view_for(chat_id) or self._closing.get(chat_id)
        if view is not None:
            view.set_title(title)                # saved through its `changed`
        else:
            self.store.rename(chat_id, title)
            self.library_changed.emit()

    def delete_chat(self, chat_id: str) -> Chat | None:
        """Delete a chat for good (its tab closed first); returns it for `restore_chat` (undo)."""
        gone = self.store.chat(chat_id)
        if gone is None:
            return None
        view = self.view_for(chat_id)
        if view is not None:
            self.close_tab(self.indexOf(view))
        finishing = self._closing.pop(chat_id, None)
        if finishing is not None:                # its late reply is never saved; the view goes when it ends
            self._dropped.add(finishing)
        self.store.delete_chat(chat_id)
        self.images.mark_deleted(chat_id)        # removed when the Undo is over (purge_images)
        forget = getattr(self.client, "forget_conversation", None)
        if forget is not None:                   # its K/V goes too (the engine's disk tier and parking)
            forget(f"chat-{chat_id}")
        self._seen.pop(chat_id, None)
        self.library_changed.emit()
        return gone

    def purge_images(self, chat_id: str) -> None:
        """A deleted chat's images, for good (its Undo is over); kept when the chat is back."""
        if self.store.chat(chat_id) is None:
            self.images.remove_chat(chat_id)

    def restore_chat(self, chat: Chat) -> ChatView | None:
        """Undo `delete_chat`: the chat back with all its messages, in a tab again if it had one."""
        self.store.restore_chat(chat)
        self.images.unmark(chat.id)
        self.library_changed.emit()
        return self.open_chat(chat.id) if chat.open else None

    def save_order(self) -> None:
        if not self.closed:
            self.store.set_order([v.chat.id for v in self.views()])

    def stop_all(self) -> None:
        for v in self.views():
            v.stop()
