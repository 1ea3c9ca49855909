"""The settings page's server toggle: the OpenAI-compatible server on the app's own engine, talked to
with a real HTTP client (httpx) while the app runs; key, port in use, off closes the port, restart."""
from __future__ import annotations

import os
import socket

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

import httpx  # noqa: E402
import pytest  # noqa: E402

from app_fixtures import LOAD_TIMEOUT_MS, REPLY_TIMEOUT_MS, open_window, send_and_wait  # noqa: E402

pytestmark = pytest.mark.gui


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def client(port: int, key: str = "") -> httpx.Client:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.Client(base_url=f"http://127.0.0.1:{port}/v1", headers=headers, timeout=60, trust_env=False)


def set_server(qtbot, window, on: bool, port: int = 8484, key: str = "") -> dict:
    """Through the settings page, as a person would; returns the server state once settled."""
    page = window.open_settings()
    page.server_on.setChecked(on)
    page.server_port.setValue(port)
    page.server_key.setText(key)
    with qtbot.waitSignal(window.server.state, timeout=REPLY_TIMEOUT_MS,
                          check_params_cb=lambda st: st["running"] == on or bool(st["error"])) as blocker:
        page.submit()
    return blocker.args[0]


def refused(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0


def test_app_server_toggle_serves_the_app_engine(qtbot, window):
    from app import settings
    assert settings.Settings().server_port == 8484 and settings.Settings().server_host == "127.0.0.1"
    assert not window.server.running and not window.status.server.isVisible()
    port = free_port()
    st = set_server(qtbot, window, True, port)
    assert st["running"] and st["port"] == port and not st["error"]
    assert window.status.server.text() == f"server on :{port}"
    s = settings.load()
    assert (s.server_enabled, s.server_port, s.server_api_key) == (True, port, "")

    with client(port) as http:
        models = http.get("/models")
        assert models.status_code == 200
        assert models.json()["data"][0]["id"].startswith("tiny-llama")
        r = http.post("/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}],
                                                 "max_tokens": 4, "temperature": 0})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["object"] == "chat.completion" and isinstance(body["choices"][0]["message"]["content"], str)
        assert 1 <= body["usage"]["completion_tokens"] <= 4
    # The app keeps chatting on the same engine.
    assert send_and_wait(qtbot, window.current_view(), "still here?").generated_tokens >= 1

    # A key: the server restarts with it; without it, 401.
    st = set_server(qtbot, window, True, port, key="sekret")
    assert st["running"] and settings.load().server_api_key == "sekret"
    with client(port) as http:
        assert http.get("/models").status_code == 401
    with client(port, "sekret") as http:
        assert http.get("/models").status_code == 200

    st = set_server(qtbot, window, False, port)
    assert not st["running"] and not st["error"]
    assert refused(port)
    with client(port) as http, pytest.raises(httpx.ConnectError):
        http.get("/models")
    assert not window.status.server.isVisible() and settings.load().server_enabled is False


def test_app_server_port_in_use_leaves_it_off(qtbot, window):
    from app import settings
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        st = set_server(qtbot, window, True, port)
        assert not st["running"] and "cannot listen on 127.0.0.1:" in st["error"] and "in use" in st["error"]
        assert "The local server is off" in window.message_bar.text() and "in use" in window.message_bar.text()
        assert window.status.server.text() == "server off" and "in use" in window.status.server.toolTip()
        assert settings.load().server_enabled is False
        assert not window.open_settings().server_on.isChecked()
    # The app is fine.
    assert send_and_wait(qtbot, window.current_view(), "hello").generated_tokens >= 1


def test_app_server_on_at_start_and_closed_with_the_window(qtbot, app_home):
    from app import settings
    port = free_port()
    s = settings.load()
    s.server_enabled, s.server_port = True, port
    settings.save(s)
    w = open_window(qtbot)
    with qtbot.waitSignal(w.server.state, timeout=LOAD_TIMEOUT_MS, check_params_cb=lambda st: st["running"]):
        w.show()
    try:
        qtbot.waitUntil(lambda: bool(w.library.model_path), timeout=LOAD_TIMEOUT_MS)
        with client(port) as http:
            assert http.get("/models").json()["data"][0]["id"].startswith("tiny-llama")
    finally:
        w.close()
    assert refused(port)


def test_app_server_settings_survive_a_new_process(app_home):
    """QSettings' INI format: the server settings (and the other top-level ones) read back in a new process."""
    import subprocess
    import sys
    from app import settings
    s = settings.load()
    s.server_enabled, s.server_port, s.server_api_key, s.cache_mib = True, 9123, "k", 512
    settings.save(s)
    out = subprocess.run([sys.executable, "-c", "from app import settings; s = settings.load(); "
                          "print(s.server_enabled, s.server_host, s.server_port, s.server_api_key, s.cache_mib)"],
                         capture_output=True, text=True, timeout=120, cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert out.stdout.split() == ["True", "127.0.0.1", "9123", "k", "512"], out.stderr
