"""One step of a chat's tool loop, on the GUI thread: the calls of a reply, each approved (or already
allowed), run on its MCP server through the ToolsService, denied, or stopped, in order; each answer
appended to the chat as a tool message. `ToolApproval` is the approval shown under the transcript: the
tool, its server, its arguments as formatted JSON the user may edit, and Run / Deny / Always allow.

A read-only hint from the server (the tool's readOnlyHint annotation) is shown but does not allow the
tool by itself: hints come from the server, which the approval is there to check."""
from __future__ import annotations

import html

from PySide6.QtCore import QObject, Qt, Signal
from PySide6.QtGui import QFontDatabase
from PySide6.QtWidgets import QFrame, QHBoxLayout, QLabel, QPlainTextEdit, QPushButton, QVBoxLayout

from .alive import while_alive
from .tools import loop
from .tools.results import ToolInfo


class ToolApproval(QFrame):
    """The pending call: `run(dict)`, `deny()`, `always(dict)` (allow the tool from now on, and run)."""
    run = Signal(object)
    deny = Signal()
    always = Signal(object)
    asked = Signal(object)            # a call is put to the user (its entry)

    def __init__(self, parent=None):
        super().__init__(parent)
        self.setFrameShape(QFrame.Shape.StyledPanel)
        self.setObjectName("toolApproval")
        self.title = QLabel(wordWrap=True, textFormat=Qt.TextFormat.RichText)
        self.hint = QLabel(wordWrap=True)
        self.args = QPlainTextEdit()
        self.args.setFont(QFontDatabase.systemFont(QFontDatabase.SystemFont.FixedFont))
        self.args.setMaximumHeight(self.args.fontMetrics().lineSpacing() * 8 + 12)
        self.error = QLabel(wordWrap=True, visible=False)
        self.error.setStyleSheet("color: #c0392b")
        self.run_btn = QPushButton("Run", clicked=lambda: self._decide(self.run))
        self.deny_btn = QPushButton("Deny", clicked=lambda: self.deny.emit())
        self.always_btn = QPushButton("Always allow this tool", clicked=lambda: self._decide(self.always))
        row = QHBoxLayout()
        row.addStretch(1)
        for b in (self.always_btn, self.deny_btn, self.run_btn):
            row.addWidget(b)
        lay = QVBoxLayout(self)
        lay.setContentsMargins(8, 6, 8, 6)
        for w in (self.title, self.hint, self.args, self.error):
            lay.addWidget(w)
        lay.addLayout(row)
        self.schema: dict = {}
        self.hide()

    def ask(self, entry: dict, info: ToolInfo | None) -> None:
        tool, server = entry.get("tool") or entry["function"]["name"], entry.get("server", "")
        self.title.setText(f"Run the tool <b>{html.escape(tool)}</b> of the MCP server <b>{html.escape(server)}</b>?")
        notes = []
        if info is not None and info.description:
            notes.append(info.description.strip().split("\n")[0][:300])
        if info is not None and info.read_only:
            notes.append("The server marks it read-only (a hint: it still asks).")
        notes.append("The arguments below can be edited before it runs.")
        self.hint.setText("\n".join(notes))
        self.schema = info.input_schema if info is not None else {}
        self.args.setPlainText(loop.pretty(entry["function"]["arguments"]))
        self.error.hide()
        self.show()
        self.run_btn.setFocus()
        self.asked.emit(entry)

    def _decide(self, signal) -> None:
        value, why = loop.check_arguments(self.args.toPlainText(), self.schema)
        if value is None:
            self.error.setText(f"Not run: {why}")
            self.error.show()
            return
        signal.emit(value)


class ToolTurn(QObject):
    """The calls of one reply, answered one after another. `changed` after each message appended (render,
    persist); `finished(bool)`: True when every call is answered (the model continues), False when stopped."""
    changed = Signal()
    finished = Signal(bool)

    def __init__(self, messages: list[dict], entries: list[dict], service, settings, panel: ToolApproval,
                 parent: QObject | None = None):
        super().__init__(parent)
        self.messages = messages          # the chat's own list: answers are appended to it
        self.queue = list(entries)
        self.service = service            # app.tools.bridge.ToolsService
        self.settings = settings          # SettingsService: tools_allowed, tools_timeout_s
        self.panel = panel
        self.running = None               # the ToolCall in flight
        self.waiting = False              # the panel asks about queue[0]
        self.over = False
        panel.run.connect(self._on_run)
        panel.deny.connect(self._on_deny)
        panel.always.connect(self._on_always)

    @property
    def current(self) -> dict | None:
        return self.queue[0] if self.queue else None

    def start(self) -> None:
        self._next()

    def _info(self, entry: dict) -> ToolInfo | None:
        return next((t for t in self.service.tools()
                     if t.server == entry.get("server") and t.name == entry.get("tool")),
                    None)

    def _key(self, entry: dict) -> str:
        return f"{entry.get('server', '')}/{entry.get('tool', '')}"

    def _next(self) -> None:
        if self.over:
            return
        entry = self.current
        if entry is None:
            self._end(True)
            return
        if self._key(entry) in self.settings.tools_allowed:
            self._run(entry, entry["function"]["arguments"])
            return
        self.waiting = True
        self.panel.ask(entry, self._info(entry))

    def _on_run(self, arguments: dict) -> None:
        if self.waiting:
            self._run(self.current, arguments)

    def _on_always(self, arguments: dict) -> None:
        if not self.waiting:
            return
        key = self._key(self.current)
        if key not in self.settings.tools_allowed:
            self.settings.set("tools_allowed", list(self.settings.tools_allowed) + [key])
        self._run(self.current, arguments)

    def _on_deny(self) -> None:
        if self.waiting:
            self._answer(loop.tool_message(self.current, loop.DENIED, loop.DENIED_TEXT))

    def _run(self, entry: dict, arguments: dict) -> None:
        self.waiting = False
        self.panel.hide()
        entry["function"]["arguments"] = arguments          # what ran is what the model's call says
        self.changed.emit()
        self.running = self.service.call(entry["server"], entry["tool"], arguments,
                                         float(self.settings.tools_timeout_s))
        self.running.finished.connect(while_alive(self, lambda result, e=entry, c=self.running: self._on_result(c, e, result)))

    def _on_result(self, call, entry: dict, result) -> None:
        if call is not self.running or self.over:
            return                        # stopped: the answer was written then
        self.running = None
        self._answer(loop.result_message(entry, result))

    def _answer(self, message: dict) -> None:
        self.waiting = False
        self.panel.hide()
        self.messages.append(message)
        self.queue.pop(0)
        self.changed.emit()
        self._next()

    def stop(self) -> None:
        """Stop now: a running call is cancelled, every call not answered gets a 'stopped' answer."""
        if self.over:
            return
        if self.running is not None:
            self.running.cancel()
            self.running = None
        for entry in self.queue:
            self.messages.append(loop.tool_message(entry, loop.STOPPED, loop.STOPPED_TEXT))
        self.queue.clear()
        self.changed.emit()
        self._end(False)

    def _end(self, go_on: bool) -> None:
        self.over = True
        self.waiting = False
        self.panel.hide()
        for sig, slot in ((self.panel.run, self._on_run), (self.panel.deny, self._on_deny),
                          (self.panel.always, self._on_always)):
            sig.disconnect(slot)
        self.finished.emit(go_on)
