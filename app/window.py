"""The main window: wiring only. It builds the engine thread and client, the model library (the left
pane's model list), the Configs pane, the chat tabs, the message and status bars and the menus, then
connects them (`_connect_signals`). The work is in the controllers: ModelLibrary (app/model_library.py),
SessionController (app/session_controller.py), ChatTabs (app/chat_tabs.py), ServerControl
(app/server_control.py), PresetManager (app/presets.py). They share the one SettingsService
(app/settings.py: each listens to its keys' `changed`) and report on the MessageBus (app/bus.py), which
the window shows on its message bar and status bar. What is left here is the engine status refresh."""
from __future__ import annotations

from pathlib import Path

from PySide6.QtCore import Qt, QTimer, Signal
from PySide6.QtGui import QAction, QKeySequence
from PySide6.QtWidgets import QMainWindow, QSplitter, QTabWidget, QVBoxLayout, QWidget

from . import settings as settings_mod
from . import theme
from .bus import MessageBus
from .chat_images import ChatImages
from .chat_library import ChatLibrary
from .chat_tabs import ChatTabs
from .chat_view import ChatView
from .documents.attach import attach_documents
from .engine_settings import EngineSettings
from .engine_thread import EngineClient, EngineThread
from .message_bar import MessageBar
from .model_library import ModelLibrary
from .paths import AppPaths
from .presets import PresetManager, PresetPane
from .server_control import ServerControl
from .session_controller import SessionController
from .settings_page import SettingsPage
from .status_bar import StatusBar
from .store import Chat, Store
from .tools.bridge import ToolsService
from .tools_page import ToolsPage
from .tools.config import config_notice
from .tools.loop import tool_format


def settings_shortcuts() -> list[QKeySequence]:
    """The platform's Preferences keys (Cmd+, on a Mac), else Ctrl+, (Linux has none)."""
    keys = QKeySequence.keyBindings(QKeySequence.StandardKey.Preferences)
    return keys or [QKeySequence("Ctrl+,")]


class MainWindow(QMainWindow):
    status_updated = Signal(object)

    def __init__(self, settings: settings_mod.Settings | settings_mod.SettingsService | None = None,
                 offer_fetch: bool = True, start_engine: bool = True, paths: AppPaths | None = None):
        super().__init__()
        self.paths = paths or AppPaths.default()
        if not isinstance(settings, settings_mod.SettingsService):
            settings = settings_mod.SettingsService(settings or settings_mod.load(self.paths), self.paths, parent=self)
        self.settings = settings
        self.bus = MessageBus(self)
        theme.apply(settings.theme)
        self.setWindowTitle("Strata")
        self.resize(1180, 760)
        self.last_status = None                  # the last engine.api.EngineStatus
        self._status_due = False
        self._closed = False

        self.store = Store(self.paths.db_path)
        self.presets = PresetManager(self.store, self.settings, self)
        # The engine's default projection is the settings' (it only serves requests naming none:
        # the app's own always name theirs).
        self.engine_thread = EngineThread(self.settings.cache_mib, self.settings.cache_slots,
                                          self.settings.steering,
                                          speed_projection=self.settings.steering.speed_projection,
                                          kv_bits=self.settings.kv_bits, parent=self,
                                          disk_mib=self.settings.disk_mib)
        self.client = EngineClient(self.engine_thread, self)
        # Every setting that reaches the engine goes there from here (its keys' `changed`)
        self.engine_settings = EngineSettings.of(self.settings, self.client)
        self.server = ServerControl(self.client, self.settings, self.bus, self)
        # MCP servers (app/tools/): only the ones the user enabled in mcp.json start
        self.tools = ToolsService(self.paths.data_dir, self)
        self.tool_format = tool_format("")

        self.message_bar = MessageBar()
        self.status = StatusBar()
        self.bus.attach(self.message_bar, self.status)
        self.library = ModelLibrary(self.client, self.settings, self.bus, self.paths, offer_fetch, self)
        self.models = self.library.models
        self.preset_pane = PresetPane(self.presets, models_dir=self.paths.models_dir)
        self.tabs = ChatTabs(self.store, self.client, self.presets, self.preset_pane.current_id,
                             images=ChatImages(self.paths.images_dir))
        self.tabs.model_path = lambda: self.library.model_path     # recorded with each chat's messages
        self.chat_library = ChatLibrary(self.tabs)                 # every chat: search, open, delete, export
        self.sessions = SessionController(self.client, self.settings, self.bus, self.paths, self.tabs, self.library,
                                          self)
        self._build_layout()
        self._build_menus()
        self._connect_signals()

        self.store.on_error = self.bus.tell        # a failure after the start: one line, once
        if self.store.notice:       # a locked, foreign or corrupt database: what was kept and where
            self.bus.info.emit(self.store.notice)
        if self.tools.problems:                   # mcp.json's bad entries, one line each (the rest loaded)
            self.bus.info.emit(config_notice(self.tools.problems, self.tools.unreadable))
        self.tabs.open_stored()
        self.tools.start_enabled()
        self.library.refresh()
        if start_engine:
            self.engine_thread.start()

    def _build_layout(self) -> None:
        centre = QWidget()
        cl = QVBoxLayout(centre)
        cl.setContentsMargins(0, 0, 0, 0)
        cl.setSpacing(0)
        cl.addWidget(self.message_bar)
        cl.addWidget(self.tabs, 1)
        left = QSplitter(Qt.Orientation.Vertical)
        self.side = QTabWidget(documentMode=True)      # the chat library and the model list, one at a time
        self.side.addTab(self.chat_library, "Chats")
        self.side.addTab(self.models, "Models")
        left.addWidget(self.side)
        left.addWidget(self.preset_pane)
        left.setStretchFactor(0, 3)
        left.setStretchFactor(1, 2)
        split = QSplitter()
        split.addWidget(left)
        split.addWidget(centre)
        split.setStretchFactor(1, 1)
        split.setSizes([430, 850])
        self.setCentralWidget(split)
        self.setStatusBar(self.status)

    def _build_menus(self) -> None:
        def act(menu, text, slot, shortcut=None):
            a = QAction(text, self)
            a.triggered.connect(slot)
            if shortcut is not None:
                a.setShortcut(QKeySequence(shortcut))
            menu.addAction(a)
            return a
        f = self.menuBar().addMenu("&File")
        act(f, "New Chat", lambda: self.new_tab(), "Ctrl+T")
        act(f, "Close Chat", lambda: self.tabs.close_tab(self.tabs.currentIndex()), "Ctrl+W")
        f.addSeparator()
        act(f, "Save Session…", self.sessions.save_session_dialog, QKeySequence.StandardKey.Save)
        act(f, "Restore Session…", self.sessions.restore_session_dialog, QKeySequence.StandardKey.Open)
        f.addSeparator()
        act(f, "Add Model…", self.library.add_model_dialog)
        act(f, "Fetch Default Model", lambda: self.library.offer_default_model())
        f.addSeparator()
        act(f, "Settings…", self.open_settings).setShortcuts(settings_shortcuts())
        act(f, "Tools…", self.open_tools)
        act(f, "Quit", self.close, QKeySequence.StandardKey.Quit)
        c = self.menuBar().addMenu("&Chat")
        act(c, "Stop", lambda: self.current_view() and self.current_view().stop(), "Esc")
        act(c, "Regenerate", lambda: self.current_view() and self.current_view().regenerate(), "Ctrl+R")
        act(c, "Copy Reply", lambda: self.current_view() and self.current_view().copy_last(), "Ctrl+Shift+C")
        act(c, "Rename Chat…", lambda: self.tabs.rename_tab(self.tabs.currentIndex()))
        act(c, "Find Chat…", self.find_chat, "Ctrl+Shift+F")
        act(c, "Attach Document…", lambda: self.current_view() and self.current_view().documents.choose())
        c.addSeparator()
        # From anywhere in the window, the message box included (it gives Tab to the focus chain)
        act(c, "Next Chat", lambda: self.step_tab(1)).setShortcuts(
            [QKeySequence("Ctrl+PgDown"), QKeySequence("Ctrl+Tab")])
        act(c, "Previous Chat", lambda: self.step_tab(-1)).setShortcuts(
            [QKeySequence("Ctrl+PgUp"), QKeySequence("Ctrl+Shift+Tab")])

    def _connect_signals(self) -> None:
        self.engine_thread.crashed.connect(self.bus.error)
        self.client.kv_changed.connect(self._status_soon)
        self.client.kv_state.connect(lambda ev: self.status.show_parking(ev.parking))
        self.client.kv_moved.connect(lambda ev: self.status.show_parking(ev.parking))   # a park/evict as it happens
        self.server.state.connect(self.status.show_server)
        self.settings.changed.connect(self._on_setting)
        # A load: the title and status first, then the session files waiting for it
        self.library.loaded.connect(self._on_model_loaded)
        self.library.loaded.connect(self.sessions.open_pending)
        self.preset_pane.new_chat_requested.connect(lambda pid: self.new_tab(preset_id=pid))
        self.tabs.view_added.connect(self._on_view_added)
        self.tabs.currentChanged.connect(self._on_tab_changed)
        self.sessions.status_changed.connect(self.refresh_status)
        self.engine_settings.applied.connect(lambda _s: self._status_soon())   # e.g. the cache limits: the status bar
        # Session files and models dropped anywhere on the window, the tab bar or a chat open
        for w in (self, self.tabs.tabBar()):
            self.sessions.accept_drops_on(w)

    def _on_view_added(self, view: ChatView) -> None:
        view.think_open = self.library.think_open
        view.images.set_model(self.library.vision, Path(self.library.model_path or "").name)
        view.set_model_context(self.library.n_ctx)
        view.tools, view.tool_settings, view.tool_format = self.tools, self.settings, self.tool_format
        view.stats.connect(lambda r, v=view: self._on_stats(v, r))
        view.live_figures.connect(lambda live, v=view: self._on_live_figures(v, live))
        view.message.connect(lambda m: self.status.showMessage(m, 6000))
        view.input.setTabChangesFocus(True)      # Tab and Shift+Tab leave the message box, as elsewhere
        for w in (view.input.viewport(), view.transcript.viewport()):
            w.installEventFilter(self.sessions)
        attach_documents(view, self.store, self.client)     # after the sessions' filter: documents' drops first

    def _on_model_loaded(self, path: str) -> None:
        self.setWindowTitle(f"Strata — {Path(path).name}")
        self.tool_format = tool_format(path, self.library.think_open)
        for view in self.views():
            view.think_open = self.library.think_open
            view.images.set_model(self.library.vision, Path(path).name)
            view.set_model_context(self.library.n_ctx)
            view.tool_format = self.tool_format
        self.refresh_status()

    # ---- the tabs (the menus and the Configs pane) ------------------------------------------------
    def views(self) -> list[ChatView]:
        return self.tabs.views()

    def current_view(self) -> ChatView | None:
        return self.tabs.current_view()

    def new_tab(self, chat: Chat | None = None, preset_id: str | None = None) -> ChatView:
        return self.tabs.new_tab(chat, preset_id)

    def step_tab(self, step: int) -> None:
        """The next (1) or previous (-1) chat tab, round the ends."""
        n = self.tabs.count()
        if n:
            self.tabs.setCurrentIndex((self.tabs.currentIndex() + step) % n)

    def find_chat(self) -> None:
        """Chat > Find Chat: the chat library shown, its search field focused."""
        self.side.setCurrentWidget(self.chat_library)
        self.chat_library.focus_search()

    # ---- the status bar's engine figures ---------------------------------------------------------
    def _on_tab_changed(self, _index: int) -> None:
        view = self.current_view()
        if view is not None:
            view.input.setFocus()
            self.show_tab_figures(view)

    def show_tab_figures(self, view: ChatView) -> None:
        """The status bar's reply figures are the tab's own: its reply in flight's, its last reply's, or none yet."""
        if view.busy and view.live:
            self.status.show_streaming(view.live)
        elif view.last_result:
            self.status.show_result(view.last_result)
        else:
            self.status.clear_result()

    def _on_live_figures(self, view: ChatView, live: dict) -> None:
        """A reply's figures as it streams; {} once it is over (stopped or failed too): the tab's own again."""
        if self.current_view() is view:
            if live:
                self.status.show_streaming(live)
            else:
                self.show_tab_figures(view)

    def _on_stats(self, view: ChatView, result: dict) -> None:
        if view.disk_note and view.property("diskNoteShown") != view.disk_note:
            # The reply's K/V came from the disk tier: said under the reply too, not only for 6 s in
            # the status bar (the view keeps its last such line: shown once)
            view.setProperty("diskNoteShown", view.disk_note)
            view.add_note(view.disk_note)
        if self.current_view() is view:
            self.status.show_result(result)
        self.refresh_status()

    def _status_soon(self) -> None:
        """Coalesce: several parks/evictions in one go ask for the status once."""
        if not self._status_due:
            self._status_due = True
            QTimer.singleShot(0, self, self._status_now)

    def _status_now(self) -> None:
        self._status_due = False
        if not self._closed and self.client.is_ready:
            self.refresh_status()

    def refresh_status(self) -> None:
        req = self.client.status()
        req.done.connect(self._on_status)

    def _on_status(self, s) -> None:
        self.last_status = s
        self.library.set_engine_budget(s.load_budget)
        self.status.show_status(s)
        self.status_updated.emit(s)

    # ---- settings ----------------------------------------------------------------------------
    def open_settings(self) -> SettingsPage:
        page = SettingsPage(self.settings, self.client, self.last_status, self)
        page.setModal(False)
        page.show()
        return page

    def open_tools(self) -> ToolsPage:
        """The MCP servers and the tools' approval settings (app/tools_page.py)."""
        page = ToolsPage(self.tools, self.settings, self)
        page.setModal(False)
        page.show()
        return page

    def _on_setting(self, key: str) -> None:
        """What the window itself does on a settings change (the controllers listen to their own keys)."""
        if key == "theme":
            theme.apply(self.settings.theme)
            for view in self.tabs.views():     # the transcripts' colours and code style follow the palette
                view.render_all()
        if key != "model" and self.client.is_ready:
            self._status_soon()                # e.g. the cache limits: the status bar's figures

    # ---- shutdown ----------------------------------------------------------------------------
    def closeEvent(self, e) -> None:  # noqa: N802
        self.tabs.stop_all()
        self.tabs.save_order()
        self.shutdown()
        super().closeEvent(e)

    def shutdown(self) -> None:
        self.library.shutdown()
        self.server.shutdown()
        self.tools.close()
        if self.engine_thread.isRunning():
            self.client.cancel_replies()        # a reply or title being read must not hold the stop
            self.engine_thread.stop()
        if not self._closed:
            self._closed = True
            self.tabs.closed = True
            self.store.close()
