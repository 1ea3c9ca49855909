"""Session files in the app: save, drop onto the window / tab bar, refused files, QFileOpenEvent, --self-test."""
from __future__ import annotations

import os
import subprocess
import sys

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

import pytest  # noqa: E402
from PySide6.QtCore import QMimeData, QPoint, QPointF, Qt, QUrl  # noqa: E402
from PySide6.QtGui import QDragEnterEvent, QDropEvent  # noqa: E402
from PySide6.QtWidgets import QApplication  # noqa: E402

from app_fixtures import REPLY_TIMEOUT_MS, send_and_wait  # noqa: E402

pytestmark = pytest.mark.gui


def drop_files(target, paths) -> QDropEvent:
    """What a real drag does: DragEnter (which picks the drop target), then Drop."""
    mime = QMimeData()
    mime.setUrls([QUrl.fromLocalFile(str(p)) for p in paths])
    enter = QDragEnterEvent(QPoint(10, 10), Qt.DropAction.CopyAction, mime, Qt.MouseButton.LeftButton,
                            Qt.KeyboardModifier.NoModifier)
    QApplication.sendEvent(target, enter)
    assert enter.isAccepted(), "the drop target refused the drag"
    event = QDropEvent(QPointF(10, 10), Qt.DropAction.CopyAction, mime, Qt.MouseButton.LeftButton,
                       Qt.KeyboardModifier.NoModifier)
    QApplication.sendEvent(target, event)
    return event


def make_session(qtbot, window, path) -> list[dict]:
    view = window.current_view()
    send_and_wait(qtbot, view, "Keep this conversation")
    with qtbot.waitSignal(window.status_updated, timeout=REPLY_TIMEOUT_MS):  # title call done, status in
        pass
    req = window.sessions.save_session(view, str(path))
    with qtbot.waitSignal(req.finished, timeout=REPLY_TIMEOUT_MS):
        pass
    assert req.error is None, req.error
    assert path.exists()
    return list(view.chat.messages)


@pytest.mark.parametrize("onto", ["window", "tabbar"])
def test_app_drop_session_file_opens_tab(qtbot, window, tmp_path, onto):
    path = tmp_path / "kept.stratasession"
    messages = make_session(qtbot, window, path)
    n = window.tabs.count()
    target = window if onto == "window" else window.tabs.tabBar()
    with qtbot.waitSignal(window.sessions.restored, timeout=REPLY_TIMEOUT_MS) as blocker:
        ev = drop_files(target, [path])
    assert ev.isAccepted()
    view = blocker.args[0]
    assert window.tabs.count() == n + 1 and window.current_view() is view
    system = [m for m in view.chat.messages if m["role"] == "system"]
    assert [m for m in view.chat.messages if m["role"] != "system"] == messages
    assert len(system) <= 1
    text = view.transcript_text()
    assert "Keep this conversation" in text
    assert "restored" in text and "tokens in" in text and " ms" in text
    # The restored conversation continues from its K/V.
    result = send_and_wait(qtbot, view, "Continue")
    assert result.cached_tokens > 0


def test_app_drop_corrupt_session_is_refused(qtbot, window, tmp_path):
    bad = tmp_path / "broken.stratasession"
    bad.write_bytes(b"this is not a session file at all" * 10)
    n = window.tabs.count()
    with qtbot.waitSignal(window.sessions.refused, timeout=REPLY_TIMEOUT_MS) as blocker:
        drop_files(window, [bad])
    reason = blocker.args[0]
    assert reason and "Traceback" not in reason
    assert window.tabs.count() == n
    assert not window.message_bar.isHidden()
    assert "broken.stratasession was not restored" in window.message_bar.text() and reason in window.message_bar.text()


def test_app_file_open_event_is_queued_until_window(qtbot, app_home, tmp_path):
    """QFileOpenEvent (Finder / Dock) before the window exists is queued, then handled."""
    from PySide6.QtGui import QFileOpenEvent

    from app.main import make_app
    app = make_app()
    files = app._strata_files
    files.window, files.pending = None, []
    opened = []

    class FakeSessions:
        def open_file(self, p):
            opened.append(p)

    class FakeWindow:
        sessions = FakeSessions()

    target = str(tmp_path / "x.stratasession")
    QApplication.sendEvent(app, QFileOpenEvent(target))
    assert files.pending == [target] and not opened
    files.set_window(FakeWindow())
    assert opened == [target] and files.pending == []
    QApplication.sendEvent(app, QFileOpenEvent(target + "2"))
    assert opened == [target, target + "2"]
    files.window = None


def test_app_self_test_flag(app_home, tiny_model):
    env = dict(os.environ, QT_QPA_PLATFORM="offscreen", STRATA_HOME=str(app_home))
    proc = subprocess.run([sys.executable, "-m", "app.main", "--self-test", "--model", str(tiny_model)],
                          capture_output=True, text=True, timeout=300, env=env,
                          cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "self-test: OK" in proc.stdout
    assert "restored" in proc.stdout


def test_app_self_test_without_model_fails_cleanly(app_home, tmp_path):
    """No model and no index to fetch it from (a closed port on 127.0.0.1): one reason, exit 1,
    nothing left in the models folder. (--self-test fetches first when it can: tests/app/test_app_first_run.py.)"""
    env = dict(os.environ, QT_QPA_PLATFORM="offscreen", STRATA_HOME=str(tmp_path / "empty"),
               PIP_INDEX_URL="http://127.0.0.1:9/simple")
    env.pop("STRATA_DEFAULT_WHEEL", None)
    proc = subprocess.run([sys.executable, "-m", "app.main", "--self-test"], capture_output=True, text=True,
                          timeout=120, env=env, cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert proc.returncode == 1
    out = proc.stdout + proc.stderr
    assert "no model" in out and "could not be fetched" in out and "Traceback" not in out
    assert not any((tmp_path / "empty" / "models").glob("*"))
