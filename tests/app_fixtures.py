"""Fixtures of the app tests, loaded for every test file by tests/conftest.py (`pytest_plugins`);
the helpers (open_window, send_and_wait, the timeouts) are imported by name.

`app_home`: an own STRATA_HOME holding a tiny random-weight GGUF in models/ and settings that keep
replies short. `window`: a real MainWindow driving the real engine thread with that model (journeys,
where the engine matters). `idle_window`: the same window with no engine thread started (the tabs,
configs, stores and dialogs alone). `fake_client`: tests/fake_engine.py's FakeClient, for widget tests
of a page or pane where the engine adds nothing.
"""
from __future__ import annotations

import os
import shutil

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

import pytest  # noqa: E402

from gguf_factory import write_tiny_gguf  # noqa: E402

LOAD_TIMEOUT_MS = 60_000
REPLY_TIMEOUT_MS = 60_000


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    return write_tiny_gguf(tmp_path_factory.mktemp("tiny") / "tiny-llama.gguf", arch="llama", n_layer=2, n_embd=64)


@pytest.fixture
def app_home(tmp_path, monkeypatch, tiny_model):
    home = tmp_path / "home"
    (home / "models").mkdir(parents=True)
    shutil.copyfile(tiny_model, home / "models" / tiny_model.name)
    monkeypatch.setenv("STRATA_HOME", str(home))
    from app import settings
    s = settings.Settings()
    s.sampling.max_tokens = 12
    s.sampling.temperature = 0.8
    s.sampling.system_prompt = "You are a helpful assistant."
    settings.save(s)
    return home


def open_window(qtbot, **kw):
    from app.main import make_app
    make_app()
    from app.window import MainWindow
    w = MainWindow(offer_fetch=False, **kw)
    qtbot.addWidget(w)
    return w


@pytest.fixture
def window(qtbot, app_home):
    from app.window import MainWindow  # noqa: F401
    w = open_window(qtbot)
    with qtbot.waitSignal(w.library.loaded, timeout=LOAD_TIMEOUT_MS):
        w.show()
    yield w
    w.close()


@pytest.fixture
def wide_home(app_home, tiny_gguf_wide):
    """app_home whose model has head size 32, the smallest that 8- and 4-bit K/V take."""
    from app import settings
    dest = app_home / "models" / tiny_gguf_wide.name
    shutil.copyfile(tiny_gguf_wide, dest)
    s = settings.load()
    s.model = str(dest)
    settings.save(s)
    return app_home


@pytest.fixture
def idle_window(qtbot, app_home):
    w = open_window(qtbot, start_engine=False)
    yield w
    w.close()


@pytest.fixture
def fake_client():
    from fake_engine import FakeClient
    return FakeClient()


def send_and_wait(qtbot, view, text: str) -> dict:
    with qtbot.waitSignal(view.stats, timeout=REPLY_TIMEOUT_MS) as blocker:
        view.input.setPlainText(text)
        view.send_input()
    return blocker.args[0]
