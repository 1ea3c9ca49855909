"""The chat tabs: one ChatView per stored chat, in the stored order; new, close, rename, move, and
every change saved to the Store. A new chat takes the config selected in the Configs pane."""
from __future__ import annotations

from PySide6.QtCore import Qt, Signal
from PySide6.QtWidgets import QInputDialog, QTabWidget, QToolButton, QWidget

from .chat_view import ChatView
from .presets import DEFAULT_ID
from .store import Chat


class ChatTabs(QTabWidget):
    """`view_added(view)` fires for each new tab's ChatView (the window connects its signals)."""
    view_added = Signal(object)

    def __init__(self, store, client, presets, selected_preset, parent: QWidget | None = None):
        super().__init__(parent, movable=True, tabsClosable=True, documentMode=True)
        self.store = store
        self.client = client
        self.presets = presets
        self.selected_preset = selected_preset     # () -> the Configs pane's selected id, or ""
        self.closed = False                        # set at shutdown: nothing is saved after it
        self.tabCloseRequested.connect(self.close_tab)
        self.tabBarDoubleClicked.connect(self.rename_tab)
        self.tabBar().tabMoved.connect(lambda *_: self.save_order())
        self.new_tab_btn = QToolButton(text="+", toolTip="New chat (Ctrl+T)", autoRaise=True)
        self.new_tab_btn.clicked.connect(lambda: self.new_tab())
        self.setCornerWidget(self.new_tab_btn, Qt.Corner.TopRightCorner)

    def open_stored(self) -> None:
        """The stored chats, in order; a first chat when there are none."""
        for chat in self.store.chats():
            self.add_chat_tab(chat, persist=False)
        if self.count() == 0:
            self.new_tab()

    def views(self) -> list[ChatView]:
        return [self.widget(i) for i in range(self.count())]

    def current_view(self) -> ChatView | None:
        return self.currentWidget()

    def new_tab(self, chat: Chat | None = None, preset_id: str | None = None) -> ChatView:
        """A new chat using config `preset_id` (default: the one selected in the Configs list)."""
        if chat is None:
            chat = Chat(config=self.chat_config(preset_id))
        return self.add_chat_tab(chat)

    def chat_config(self, preset_id: str | None = None) -> dict:
        preset = self.presets.get(preset_id or self.selected_preset() or DEFAULT_ID)
        return {"preset": preset.id, "speed_projection": preset.speed_projection}

    def add_chat_tab(self, chat: Chat, persist: bool = True) -> ChatView:
        view = ChatView(chat, self.client, self.presets)
        view.changed.connect(lambda v=view: self._persist(v))
        view.title_changed.connect(lambda t, v=view: self._set_tab_title(v, t))
        index = self.addTab(view, chat.title)
        self._set_tab_title(view, chat.title)
        self.setCurrentIndex(index)
        self.view_added.emit(view)
        if persist:
            self.store.save_chat(chat, index)
        view.input.setFocus()
        return view

    def _persist(self, view: ChatView) -> None:
        if not self.closed:
            self.store.save_chat(view.chat, self.indexOf(view))

    def _set_tab_title(self, view: ChatView, title: str) -> None:
        i = self.indexOf(view)
        if i >= 0:
            self.setTabText(i, title if len(title) <= 28 else title[:27] + "…")
            self.setTabToolTip(i, title)

    def close_tab(self, index: int) -> None:
        view = self.widget(index)
        if view is None:
            return
        view.stop()
        self.removeTab(index)
        self.store.delete_chat(view.chat.id)
        view.deleteLater()
        self.save_order()
        if self.count() == 0:
            self.new_tab()

    def rename_tab(self, index: int) -> None:
        view = self.widget(index)
        if view is None:
            return
        title, ok = QInputDialog.getText(self, "Rename chat", "Title:", text=view.chat.title)
        if ok and title.strip():
            view.set_title(title.strip())

    def save_order(self) -> None:
        if not self.closed:
            self.store.set_order([v.chat.id for v in self.views()])

    def stop_all(self) -> None:
        for v in self.views():
            v.stop()
