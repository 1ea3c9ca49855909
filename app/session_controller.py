"""Session files: save a tab's conversation, restore one into a new tab (offering to load the control
vector a file needs), open files from the command line, Finder, another launch or a drop (queued until
a model is loaded), and the drag-and-drop that brings them."""
from __future__ import annotations

import dataclasses
from pathlib import Path

from PySide6.QtCore import QEvent, QObject, Signal
from PySide6.QtWidgets import QFileDialog

from engine.errors import ErrorCode, SessionRefusal
from engine.paths import SESSION_EXTENSION

from .chat_view import DEFAULT_TITLE, ChatView
from .settings_page import refusal_hint
from .store import Chat


def local_files(mime) -> list[Path]:
    if not mime.hasUrls():
        return []
    return [Path(u.toLocalFile()) for u in mime.urls() if u.isLocalFile()]


def is_openable(p: Path) -> bool:
    return p.suffix.lower() in (SESSION_EXTENSION, ".gguf")


def safe_name(title: str) -> str:
    keep = "".join(c if c.isalnum() or c in " -_" else "_" for c in title).strip()
    return keep[:60] or "session"


class SessionController(QObject):
    """Works on `tabs` (ChatTabs) with `client`; reports to the bus (`tell(text, action, slot)` is the
    message bar's line); `library` (ModelLibrary) loads a file's control vector; `settings` is the app's
    SettingsService. Dialogs are parented to `parent` (the window)."""
    restored = Signal(object)          # the ChatView created from a session file
    saved = Signal(str)
    refused = Signal(str)
    status_changed = Signal()          # the engine's K/V changed: ask for its status

    def __init__(self, client, settings, bus, paths, tabs, library, parent=None):
        super().__init__(parent)
        self.client = client
        self.settings = settings
        self.bus = bus
        self.tell = bus.tell
        self.paths = paths
        self.tabs = tabs
        self.library = library
        self.pending_files: list[str] = []   # session files waiting for the model load
        self._opening: set[str] = set()      # session files opened and being restored

    # ---- save ------------------------------------------------------------------------------------
    def save_session_dialog(self) -> None:
        view = self.tabs.current_view()
        if view is None or not view.chat.messages:
            self.tell("This chat has nothing to save yet")
            return
        default = self.paths.sessions_dir / (safe_name(view.chat.title) + SESSION_EXTENSION)
        path, _ = QFileDialog.getSaveFileName(self.parent(), "Save Session", str(default),
                                              f"Strata sessions (*{SESSION_EXTENSION})")
        if path:
            if not path.endswith(SESSION_EXTENSION):
                path += SESSION_EXTENSION
            self.save_session(view, path)

    def save_session(self, view: ChatView, path: str):
        """Save a tab's conversation with the steering its K/V has (the tab's toggle). When the engine
        no longer holds it (evicted, or a chat from before a restart) it is read again first: the
        tab's bar shows that, with Cancel."""
        self.bus.busy.emit("save")
        req = self.client.save_session(path, messages=view.request_messages(),
                                       speed_projection=view.projection.isChecked(),
                                       conversation=view.conversation)
        req.progress.connect(self.bus.progress)
        view.track(req, "Saving session")

        def done(r):
            self.bus.idle.emit()
            again = " (read again)" if r.reread else ""
            self.bus.say(f"Saved {Path(path).name}{again}: {r.session_bytes / (1 << 20):.1f} "
                         f"MiB in {r.save_ms:.0f} ms", 8000)
            self.status_changed.emit()
            self.saved.emit(path)
        req.done.connect(done)
        req.failed.connect(lambda m: (self.bus.idle.emit(), self.tell(f"Session not saved: {m}")))
        return req

    # ---- restore ---------------------------------------------------------------------------------
    def restore_session_dialog(self) -> None:
        path, _ = QFileDialog.getOpenFileName(self.parent(), "Restore Session", str(self.paths.sessions_dir),
                                              f"Strata sessions (*{SESSION_EXTENSION})")
        if path:
            self.restore_session(path)

    def restore_session(self, path: str):
        """Restore a session into a new tab, with the steering the file was saved with (the tab's
        toggle follows it). A file needing a vector the app has not loaded is refused, naming it,
        with an offer to load it when that file is on this machine."""
        name = Path(path).name
        chat = Chat()                   # its id names the restored K/V's owner
        self.bus.busy.emit("restore")
        req = self.client.restore_session(path, conversation=f"chat-{chat.id}")
        req.progress.connect(self.bus.progress)
        req.done.connect(lambda r: self._on_restored(r, path, chat))

        def refused(m):
            self.bus.idle.emit()
            self.tell(f"{name} was not restored: {m}{refusal_hint(req.error_code, req.error_reason)}")
            if req.error_code == ErrorCode.SESSION_REFUSED and req.error_reason == SessionRefusal.STEERING:
                self._offer_vector(path, m, req.error_vector)
            self.refused.emit(m)
        req.failed.connect(refused)
        return req

    def _offer_vector(self, path: str, message: str, spec) -> None:
        """The refusal names the vector the file needs (engine.errors.VectorSpec, None: none named):
        when its files are here, offer to load it and retry."""
        if spec is None or not all(Path(p).is_file() for p, _ in spec.files):
            return
        self.tell(f"{Path(path).name} was not restored: {message}", "Load it and restore",
                  lambda: self.load_vector_and_restore(spec, path))

    def load_vector_and_restore(self, spec, path: str):
        """Make the file's control vector (an engine.errors.VectorSpec) the configured one (saved in the
        settings), reload the model with it, then restore the file."""
        lr = spec.layer_range or (0, 0)
        s = self.settings.snapshot()
        st = dataclasses.replace(s.steering, files=[(p, sc) for p, sc in spec.files],
                                 layer_from=int(lr[0]), layer_to=int(lr[1]), mode=spec.mode,
                                 direction=spec.direction)
        req = self.library.reload(st, "The control vector was not loaded", then=lambda: self.restore_session(path))
        self.settings.update(dataclasses.replace(s, steering=st))      # the library's own reload is this one
        return req

    def _on_restored(self, r, path: str, chat: Chat | None = None) -> None:
        self.bus.idle.emit()
        messages = [{"role": m.get("role", "user"), "content": m.get("content", "")} for m in r.messages or []]
        first = next((m["content"] for m in messages if m["role"] == "user"), "")
        title = Path(path).stem if Path(path).stem else DEFAULT_TITLE
        chat = chat or Chat()
        # The request's system prompt came from the original tab's config, which never showed it as a
        # message: the restored tab takes a config with that prompt (its requests add it again, the
        # same follow-up); with none, the prompt stays the chat's first message (not shown either).
        config = self.tabs.chat_config()
        if messages and messages[0]["role"] == "system":
            same = self._config_with_system_prompt(messages[0]["content"], config.get("preset"))
            if same is not None:
                config = self.tabs.chat_config(same)
                messages = messages[1:]
        chat.title, chat.messages = title or first[:30], messages
        # The tab's toggle is the file's setting: its follow-ups extend the restored K/V.
        chat.config = dict(config, session=path, speed_projection=bool(r.speed_projection))
        view = self.tabs.add_chat_tab(chat)
        steer = "speed projection on" if r.speed_projection else "speed projection off"
        view.add_note(f"restored {r.restored_tokens} tokens in {r.restore_ms:.0f} ms "
                      f"from {Path(path).name} ({steer})")
        self.status_changed.emit()
        self.restored.emit(view)

    def _config_with_system_prompt(self, prompt: str, preferred: str | None) -> str | None:
        """The id of a config whose system prompt is `prompt`: `preferred` when it is, else the first."""
        presets = self.tabs.presets
        found = [p.id for p in presets.all() if p.system_prompt and p.system_prompt == prompt]
        return preferred if preferred in found else (found[0] if found else None)

    def open_view(self, path: str) -> ChatView | None:
        """The open tab restored from session file `path`, if there is one."""
        want = Path(path).resolve()
        for view in self.tabs.views():
            p = view.chat.config.get("session")
            if p and Path(p).resolve() == want:
                return view
        return None

    # ---- opening files -----------------------------------------------------------------------------
    def open_file(self, path: str) -> None:
        """A file from the command line, Finder, the Dock, another launch or a drop: a session is
        restored once a model is loaded (queued until then), a model is added. A session file a tab
        was restored from already brings that tab to the front (each hand-off opened another)."""
        p = Path(path)
        if p.suffix.lower() == SESSION_EXTENSION:
            view = self.open_view(str(p))
            if view is not None:
                self.tabs.setCurrentWidget(view)
                self.bus.say(f"{p.name} is already open in this tab", 8000)
                return
            key = str(p.resolve())
            if key in self._opening:
                self.bus.say(f"{p.name} is already being restored", 8000)
                return
            if not self.library.model_path:
                if str(p) not in self.pending_files:
                    self.pending_files.append(str(p))
                self.bus.say(f"{p.name} opens when the model is loaded", 8000)
                return
            self._opening.add(key)
            self.restore_session(str(p)).finished.connect(lambda: self._opening.discard(key))
        elif p.suffix.lower() == ".gguf":
            self.library.add_model_file(p)
        else:
            self.tell(f"{p.name}: Strata opens {SESSION_EXTENSION} sessions and .gguf models")

    def open_pending(self, *_model) -> None:
        """The files opened at launch / from Finder before the model was in."""
        pending, self.pending_files = self.pending_files, []
        for p in pending:
            self.open_file(p)

    # ---- drag and drop ----------------------------------------------------------------------------
    def accept_drops_on(self, widget) -> None:
        """Session files and models dropped on `widget` open here."""
        widget.setAcceptDrops(True)
        widget.installEventFilter(self)

    def eventFilter(self, obj: QObject, e: QEvent) -> bool:  # noqa: N802
        t = e.type()
        if t in (QEvent.Type.DragEnter, QEvent.Type.DragMove):
            if any(is_openable(p) for p in local_files(e.mimeData())):
                e.acceptProposedAction()
                return True
        elif t == QEvent.Type.Drop:
            files = local_files(e.mimeData())
            if any(is_openable(p) for p in files):
                e.acceptProposedAction()
                for p in files:
                    self.open_file(str(p))
                return True
        return super().eventFilter(obj, e)
