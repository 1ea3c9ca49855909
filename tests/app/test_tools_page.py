"""The Tools page (File › Tools…) on a real ToolsService with real MCP servers (tests/mcp/tool_server.py
over stdio) and real files: add a server through the editor, see it start with its tools (the
read-only hint labelled), environment values masked, disable it, a failed server with its stderr, bad
entries refused with a reason, import from LM Studio's mcp.json, the always-allowed tools listed and
revoked, the timeout and step limit set."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from PySide6.QtCore import Qt, QTimer
from PySide6.QtWidgets import QApplication, QLineEdit

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "mcp"))

from app.settings import Settings, SettingsService        # noqa: E402
from app.tools.bridge import ToolsService                  # noqa: E402
from app.tools.config import read_config                   # noqa: E402
from app.tools_page import ServerEditor, ToolsPage         # noqa: E402
from servers import SERVER                                 # noqa: E402

START_MS = 60_000          # a hang bound for a server's start, not a timing


@pytest.fixture
def page(qtbot, tmp_path):
    service = ToolsService(tmp_path / "data", home=tmp_path / "home")
    settings = SettingsService(Settings(), persist=False)
    p = ToolsPage(service, settings)
    qtbot.addWidget(p)
    yield p
    service.close()


def fill_stdio(ed: ServerEditor, name: str, args: str, env: dict, enabled: bool = True) -> None:
    ed.name.setText(name)
    ed.transport.setCurrentIndex(0)
    ed.command.setText(sys.executable)
    ed.args.setText(args)
    for k, v in env.items():
        ed.env.add_row(k, v)
    ed.enabled.setChecked(enabled)


def test_add_a_server_see_its_tools_masked_env_then_disable(qtbot, page):
    def fill():
        ed = QApplication.activeModalWidget()
        assert isinstance(ed, ServerEditor)
        fill_stdio(ed, "t", f"{SERVER} stdio", {"TOKEN": "s3cret-value"})
        assert ed.env.rows[0][1].echoMode() == QLineEdit.EchoMode.Password      # masked while typed
        ed.submit()
    QTimer.singleShot(0, fill)
    page.add_btn.click()
    (cfg,) = read_config(page.service.path).servers                # saved to mcp.json
    assert cfg.enabled and cfg.env == {"TOKEN": "s3cret-value"}
    qtbot.waitUntil(lambda: "ready" in page.state.text(), timeout=START_MS)
    n = len(page.service.state("t").tools)
    assert f"ready, {n} tools" in page.state.text() and page.servers.item(0).text() == f"t — ready, {n} tools"
    names = [page.tools.item(i).text() for i in range(page.tools.count())]
    assert any(x.startswith("add — Add two integers") for x in names)
    assert any(x.startswith("peek (read-only, says the server)") for x in names)
    assert "TOKEN=" in page.how.text() and "s3cret" not in page.how.text()    # masked in the details
    page.servers.item(0).setCheckState(Qt.CheckState.Unchecked)              # disable: its process stops
    qtbot.waitUntil(lambda: page.service.state("t").status == "stopped", timeout=START_MS)
    assert not read_config(page.service.path).servers[0].enabled
    assert "disabled" in page.state.text() and page.service.tools() == []


def test_a_failed_server_shows_why_and_its_stderr(qtbot, page):
    ed = page.editor()
    fill_stdio(ed, "broken", "-c \"import sys; print('no such module: frobnicate', file=sys.stderr); sys.exit(1)\"", {})
    ed.submit()
    page.service.put(ed.config)
    qtbot.waitUntil(lambda: "failed" in page.state.text(), timeout=START_MS)
    assert "no such module: frobnicate" in page.stderr.toPlainText()


def test_the_editor_refuses_bad_entries_with_a_reason(qtbot, page):
    page.service.put(read_config_entry("t"))
    ed = page.editor()
    fill_stdio(ed, "t", "x", {}, enabled=False)
    ed.submit()
    assert ed.error.text() == "Not saved: a server named 't' exists already" and ed.config is None
    ed.name.setText("u")
    ed.command.setText("  ")
    ed.submit()
    assert ed.error.text() == "Not saved: 'command' must be a non-empty string"
    ed.transport.setCurrentIndex(1)
    ed.url.setText("ftp://example.com")
    ed.submit()
    assert ed.error.text() == "Not saved: 'url' must be an http:// or https:// address"
    ed.url.setText("http://127.0.0.1:9/mcp")
    ed.headers.add_row("Authorization", "Bearer abc")
    ed.headers.add_row("Authorization", "Bearer def")
    ed.submit()
    assert ed.error.text() == "Not saved: the header 'Authorization' is given twice"
    ed.headers.rows[1][0].clear()
    ed.submit()
    assert ed.config is not None and ed.config.headers == {"Authorization": "Bearer abc"} and not ed.config.enabled
    page.service.put(ed.config)
    page.servers.setCurrentRow(1)
    assert "Headers: Authorization: " in page.how.text() and "Bearer" not in page.how.text()


def read_config_entry(name: str):
    from app.tools.config import ServerConfig
    return ServerConfig(name, command=sys.executable, args=(str(SERVER), "stdio"), enabled=False)


def test_import_from_lm_studio_adds_servers_disabled(qtbot, page, tmp_path):
    lm = tmp_path / "home" / ".lmstudio" / "mcp.json"
    lm.parent.mkdir(parents=True)
    lm.write_text(json.dumps({"mcpServers": {"files": {"command": "npx", "args": ["-y", "fs"]},
                                              "bad": {"url": 3}}}))
    page.import_btn.click()
    assert [s.name for s in page.service.servers] == ["files"] and not page.service.servers[0].enabled
    assert "Added 1 (disabled): files (from LM Studio)." in page.note.text() and "'bad'" in page.note.text()
    assert page.servers.item(0).text() == "files — disabled"
    page.import_btn.click()
    assert "Nothing new to add. Kept the servers already here: files." in page.note.text()


def test_always_allowed_tools_are_listed_and_revocable_and_limits_set(qtbot, page):
    s = page.settings
    s.set("tools_allowed", ["t/peek", "t/add"])
    assert [page.allowed.item(i).text() for i in range(page.allowed.count())] == ["t/peek", "t/add"]
    page.allowed.setCurrentRow(1)
    page.revoke_btn.click()
    assert s.tools_allowed == ["t/peek"] and page.allowed.count() == 1
    page.revoke_btn.click()
    assert s.tools_allowed == [] and not page.revoke_btn.isEnabled()
    page.timeout.setValue(12)
    page.step_limit.setValue(3)
    assert s.tools_timeout_s == 12.0 and s.tools_step_limit == 3


def test_the_window_opens_the_page_on_its_service(qtbot, idle_window):
    menu = [a for m in idle_window.menuBar().actions() for a in m.menu().actions() if a.text() == "Tools…"]
    assert len(menu) == 1
    menu[0].trigger()
    page = idle_window.findChild(ToolsPage)
    assert page is not None and page.isVisible() and page.service is idle_window.tools


def test_the_window_names_each_bad_entry_and_loads_the_rest(qtbot, app_home):
    from app_fixtures import open_window
    (app_home / "mcp.json").write_text(json.dumps({"mcpServers": {
        "good": {"command": "uvx"}, "both": {"command": "x", "url": "http://a"}, "ftp": {"url": "ftp://h"}}}))
    w = open_window(qtbot, start_engine=False)
    try:
        text = w.message_bar.text()
        assert "server 'both': give either 'command' (stdio) or 'url' (streamable HTTP)" in text
        assert "server 'ftp': 'url' must be an http:// or https:// address" in text
        assert [s.name for s in w.tools.servers] == ["good"]
        page = w.open_tools()
        assert "server 'ftp'" in page.note.text() and page.servers.count() == 1
    finally:
        w.close()
