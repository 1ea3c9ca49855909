"""The Tools page (File › Tools…): the MCP servers of mcp.json and what the chat's tool loop may do.

Servers: add, edit, remove, import from LM Studio / Claude Desktop, enable or disable (the check box;
only an enabled server's process runs), each one's state (starting, ready with N tools, failed with
why), its tools (a read-only hint from the server is shown as such) and the last lines it wrote to
stderr. Environment values and headers are shown masked, here and in the editor (Show values reveals
them there). Approval: the tools that run without asking, each revocable; a call's timeout and the
number of tool steps one reply may take. Changes apply at once (the config file is saved, a server
started or stopped), as there is nothing to confirm that a server's state would not show."""
from __future__ import annotations

import html
import shlex

from PySide6.QtCore import Qt
from PySide6.QtWidgets import (QCheckBox, QComboBox, QDialog, QDialogButtonBox, QDoubleSpinBox, QFormLayout,
                               QGridLayout, QGroupBox, QHBoxLayout, QLabel, QLineEdit, QListWidget, QListWidgetItem,
                               QPlainTextEdit, QPushButton, QSpinBox, QVBoxLayout, QWidget)

from .settings import SettingsService
from .tools.bridge import ToolsService
from .tools.config import ServerConfig, config_notice, masked, parse_entry

TIMEOUT_RANGE_S = (1.0, 3600.0)
STEP_LIMIT_RANGE = (1, 100)
READ_ONLY_NOTE = ("A tool the server marks read-only is labelled so, and still asks before it runs: the mark "
                  "comes from the server the approval is there to check.")


class KeyValueRows(QWidget):
    """Name/value pairs (environment variables, HTTP headers), the values masked until Show values."""

    def __init__(self, what: str, values: dict, parent: QWidget | None = None):
        super().__init__(parent)
        self.what = what
        self.rows: list[tuple[QLineEdit, QLineEdit]] = []
        self.grid = QGridLayout()
        self.grid.setContentsMargins(0, 0, 0, 0)
        self.show_values = QCheckBox("Show values", toggled=self._echo)
        add = QPushButton(f"Add {what}", clicked=lambda: self.add_row("", ""))
        bar = QHBoxLayout()
        bar.addWidget(add)
        bar.addWidget(self.show_values)
        bar.addStretch(1)
        lay = QVBoxLayout(self)
        lay.setContentsMargins(0, 0, 0, 0)
        lay.addLayout(self.grid)
        lay.addLayout(bar)
        for k, v in values.items():
            self.add_row(k, v)

    def add_row(self, key: str, value: str) -> None:
        k, v = QLineEdit(key, placeholderText="name"), QLineEdit(value, placeholderText="value")
        v.setEchoMode(QLineEdit.EchoMode.Normal if self.show_values.isChecked() else QLineEdit.EchoMode.Password)
        row = len(self.rows)
        self.grid.addWidget(k, row, 0)
        self.grid.addWidget(v, row, 1)
        self.rows.append((k, v))

    def _echo(self, shown: bool) -> None:
        for _, v in self.rows:
            v.setEchoMode(QLineEdit.EchoMode.Normal if shown else QLineEdit.EchoMode.Password)

    def values(self) -> dict:
        """The pairs with a name (a row left blank is dropped); ValueError naming a repeated name."""
        out: dict = {}
        for k, v in self.rows:
            key = k.text().strip()
            if not key:
                continue
            if key in out:
                raise ValueError(f"the {self.what} {key!r} is given twice")
            out[key] = v.text()
        return out


class ServerEditor(QDialog):
    """Add or edit one server. `config` is the checked result once accepted."""

    def __init__(self, taken: set[str], config: ServerConfig | None = None, parent: QWidget | None = None):
        super().__init__(parent)
        self.setWindowTitle("Edit MCP Server" if config else "Add MCP Server")
        c = config or ServerConfig("", enabled=False)
        self.taken = taken - {c.name}
        self.config: ServerConfig | None = None
        self.name = QLineEdit(c.name, placeholderText="files")
        self.transport = QComboBox()
        self.transport.addItem("Program (stdio)", "stdio")
        self.transport.addItem("Streamable HTTP", "http")
        self.transport.setCurrentIndex(1 if c.url else 0)
        self.command = QLineEdit(c.command, placeholderText="npx")
        self.args = QLineEdit(shlex.join(c.args),
                              placeholderText="-y @modelcontextprotocol/server-filesystem ~/Documents")
        self.env = KeyValueRows("variable", c.env)
        self.url = QLineEdit(c.url, placeholderText="http://127.0.0.1:8000/mcp")
        self.headers = KeyValueRows("header", c.headers)
        self.enabled = QCheckBox("Enabled (its process runs, its tools are offered)", checked=c.enabled)
        self.error = QLabel(wordWrap=True, visible=False)
        self.error.setStyleSheet("color: #c0392b")
        self._lay_out()
        self.transport.currentIndexChanged.connect(self._show_fields)
        self._show_fields()

    def _lay_out(self) -> None:
        self.form = QFormLayout()
        self.form.addRow("Name", self.name)
        self.form.addRow("Kind", self.transport)
        self.form.addRow("Command", self.command)
        self.form.addRow("Arguments", self.args)
        self.form.addRow("Environment", self.env)
        self.form.addRow("URL", self.url)
        self.form.addRow("Headers", self.headers)
        self.form.addRow("", self.enabled)
        buttons = QDialogButtonBox(QDialogButtonBox.StandardButton.Ok | QDialogButtonBox.StandardButton.Cancel)
        buttons.accepted.connect(self.submit)
        buttons.rejected.connect(self.reject)
        lay = QVBoxLayout(self)
        lay.addLayout(self.form)
        lay.addWidget(self.error)
        lay.addWidget(buttons)

    def _show_fields(self) -> None:
        http = self.transport.currentData() == "http"
        for w, on in ((self.command, not http), (self.args, not http), (self.env, not http),
                      (self.url, http), (self.headers, http)):
            self.form.setRowVisible(w, on)

    def entry(self) -> dict:
        """The fields as an `mcpServers` entry; ValueError with a one-line reason."""
        if self.transport.currentData() == "http":
            return {"url": self.url.text().strip(), "headers": self.headers.values(),
                    "enabled": self.enabled.isChecked()}
        try:
            args = shlex.split(self.args.text())
        except ValueError as e:
            raise ValueError(f"the arguments cannot be split ({e})") from None
        return {"command": self.command.text().strip(), "args": args, "env": self.env.values(),
                "enabled": self.enabled.isChecked()}

    def submit(self) -> None:
        name = self.name.text().strip()
        try:
            if name in self.taken:
                raise ValueError(f"a server named {name!r} exists already")
            self.config = parse_entry(name, self.entry())
        except ValueError as e:
            self.error.setText(f"Not saved: {e}")
            self.error.show()
            return
        self.accept()


def _how(c: ServerConfig) -> str:
    """How a server is reached, its secrets masked."""
    if c.url:
        heads = ", ".join(f"{k}: {masked(v)}" for k, v in c.headers.items())
        return f"Streamable HTTP: {c.url}" + (f"\nHeaders: {heads}" if heads else "")
    env = ", ".join(f"{k}={masked(v)}" for k, v in c.env.items())
    return f"Program: {shlex.join((c.command, *c.args))}" + (f"\nEnvironment: {env}" if env else "")


class ToolsPage(QDialog):
    """The MCP servers and the approval settings; see the module's note."""

    def __init__(self, service: ToolsService, settings: SettingsService, parent: QWidget | None = None):
        super().__init__(parent)
        self.setWindowTitle("Tools: MCP Servers")
        self.service, self.settings = service, settings
        self.resize(820, 640)
        lay = QVBoxLayout(self)
        lay.addWidget(self._servers_group(), 1)
        lay.addWidget(self._approval_group())
        problems = config_notice(service.problems, service.unreadable) if service.problems else ""
        self.note = QLabel(problems, wordWrap=True)
        lay.addWidget(self.note)
        close = QDialogButtonBox(QDialogButtonBox.StandardButton.Close)
        close.rejected.connect(self.reject)
        lay.addWidget(close)
        # bound methods, not lambdas: Qt drops these connections when the page is deleted, so a server's
        # state changing later (the service closing its servers) never reaches a page that is gone
        service.state_changed.connect(self._on_state)
        service.servers_changed.connect(self.refresh)
        settings.changed.connect(self._on_setting)
        self.refresh()

    # ---- building --------------------------------------------------------------------------------
    def _servers_group(self) -> QGroupBox:
        box = QGroupBox("MCP servers (mcp.json in the data folder; only enabled ones run)")
        self.servers = QListWidget()
        self.servers.itemChanged.connect(self._on_item_changed)
        self.servers.currentRowChanged.connect(lambda _r: self._show_details())
        buttons = QVBoxLayout()
        self.add_btn = QPushButton("Add…", clicked=self.add_server)
        self.edit_btn = QPushButton("Edit…", clicked=self.edit_server)
        self.remove_btn = QPushButton("Remove", clicked=self.remove_server)
        self.import_btn = QPushButton("Import…", clicked=self.import_servers,
                                      toolTip="Servers from LM Studio's mcp.json and Claude Desktop's config, "
                                              "added disabled")
        for b in (self.add_btn, self.edit_btn, self.remove_btn, self.import_btn):
            buttons.addWidget(b)
        buttons.addStretch(1)
        self.state = QLabel(wordWrap=True, textInteractionFlags=Qt.TextInteractionFlag.TextSelectableByMouse)
        self.how = QLabel(wordWrap=True, textInteractionFlags=Qt.TextInteractionFlag.TextSelectableByMouse)
        self.tools = QListWidget()
        self.stderr = QPlainTextEdit(readOnly=True, placeholderText="Nothing written to stderr", maximumHeight=110)
        details = QVBoxLayout()
        for w in (self.state, self.how, QLabel("Tools"), self.tools, QLabel("Its last lines on stderr"), self.stderr):
            details.addWidget(w, 1 if w is self.tools else 0)
        row = QHBoxLayout(box)
        row.addWidget(self.servers, 2)
        row.addLayout(buttons)
        row.addLayout(details, 3)
        return box

    def _approval_group(self) -> QGroupBox:
        box = QGroupBox("Approval")
        self.allowed = QListWidget(maximumHeight=120)
        self.revoke_btn = QPushButton("Revoke", clicked=self.revoke,
                                      toolTip="The selected tool asks again before it runs")
        self.timeout = QDoubleSpinBox(minimum=TIMEOUT_RANGE_S[0], maximum=TIMEOUT_RANGE_S[1], decimals=0,
                                      suffix=" s", value=float(self.settings.tools_timeout_s))
        self.step_limit = QSpinBox(minimum=STEP_LIMIT_RANGE[0], maximum=STEP_LIMIT_RANGE[1],
                                   value=int(self.settings.tools_step_limit))
        self.timeout.valueChanged.connect(lambda v: self.settings.set("tools_timeout_s", float(v)))
        self.step_limit.valueChanged.connect(lambda v: self.settings.set("tools_step_limit", int(v)))
        form = QFormLayout()
        form.addRow("A call's timeout", self.timeout)
        form.addRow("Tool steps per reply", self.step_limit)
        left = QVBoxLayout()
        left.addWidget(QLabel("Always allowed (they run without asking)"))
        left.addWidget(self.allowed)
        left.addWidget(self.revoke_btn, 0, Qt.AlignmentFlag.AlignLeft)
        right = QVBoxLayout()
        right.addLayout(form)
        right.addWidget(QLabel(READ_ONLY_NOTE, wordWrap=True))
        right.addStretch(1)
        row = QHBoxLayout(box)
        row.addLayout(left, 1)
        row.addLayout(right, 1)
        return box

    # ---- showing ---------------------------------------------------------------------------------
    def _on_state(self, _state) -> None:
        self.refresh()

    def refresh(self) -> None:
        current = self.selected()
        self.servers.blockSignals(True)
        self.servers.clear()
        for c in self.service.servers:
            item = QListWidgetItem(f"{c.name} — {self.service.state(c.name).line() if c.enabled else 'disabled'}")
            item.setData(Qt.ItemDataRole.UserRole, c.name)
            item.setFlags(item.flags() | Qt.ItemFlag.ItemIsUserCheckable)
            item.setCheckState(Qt.CheckState.Checked if c.enabled else Qt.CheckState.Unchecked)
            self.servers.addItem(item)
            if c.name == current:
                self.servers.setCurrentItem(item)
        self.servers.blockSignals(False)
        if self.servers.currentRow() < 0 and self.servers.count():
            self.servers.setCurrentRow(0)
        self._show_details()
        self._show_allowed()

    def selected(self) -> str | None:
        item = self.servers.currentItem()
        return item.data(Qt.ItemDataRole.UserRole) if item is not None else None

    def _show_details(self) -> None:
        c = self.service.server(self.selected() or "")
        for b in (self.edit_btn, self.remove_btn):
            b.setEnabled(c is not None)
        self.tools.clear()
        if c is None:
            self.state.setText("No server: Add one, or Import those of LM Studio or Claude Desktop.")
            self.how.clear()
            self.stderr.clear()
            return
        st = self.service.state(c.name)
        self.state.setText(f"<b>{html.escape(c.name)}</b>: {html.escape(st.line() if c.enabled else 'disabled')}")
        self.how.setText(_how(c))
        for t in st.tools:
            hint = " (read-only, says the server)" if t.read_only else ""
            first = t.description.strip().split("\n")[0][:160]
            self.tools.addItem(f"{t.name}{hint}" + (f" — {first}" if first else ""))
        self.stderr.setPlainText("\n".join(st.stderr_tail))

    def _show_allowed(self) -> None:
        self.allowed.clear()
        for key in self.settings.tools_allowed:
            self.allowed.addItem(key)
        if self.allowed.count():
            self.allowed.setCurrentRow(0)
        self.revoke_btn.setEnabled(bool(self.settings.tools_allowed))

    def _on_setting(self, key: str) -> None:
        if key == "tools_allowed":
            self._show_allowed()

    # ---- acting ----------------------------------------------------------------------------------
    def _on_item_changed(self, item: QListWidgetItem) -> None:
        self.service.set_enabled(item.data(Qt.ItemDataRole.UserRole), item.checkState() == Qt.CheckState.Checked)

    def editor(self, config: ServerConfig | None = None) -> ServerEditor:
        return ServerEditor({s.name for s in self.service.servers}, config, self)

    def add_server(self) -> None:
        ed = self.editor()
        if ed.exec() == QDialog.DialogCode.Accepted and ed.config is not None:
            self.service.put(ed.config)

    def edit_server(self) -> None:
        old = self.service.server(self.selected() or "")
        if old is None:
            return
        ed = self.editor(old)
        if ed.exec() == QDialog.DialogCode.Accepted and ed.config is not None:
            self.service.put(ed.config, old.name)

    def remove_server(self) -> None:
        name = self.selected()
        if name is not None:
            self.service.remove(name)

    def import_servers(self) -> None:
        r = self.service.import_found()
        if not r.found:
            text = "Found no LM Studio or Claude Desktop MCP config."
        else:
            text = (f"Added {len(r.added)} (disabled): {', '.join(r.added)}." if r.added else "Nothing new to add.")
            if r.skipped:
                text += f" Kept the servers already here: {', '.join(r.skipped)}."
            text += "".join(f"\n{p}" for p in r.problems)
        self.note.setText(text)

    def revoke(self) -> None:
        item = self.allowed.currentItem()
        if item is not None:
            self.settings.set("tools_allowed", [k for k in self.settings.tools_allowed if k != item.text()])
