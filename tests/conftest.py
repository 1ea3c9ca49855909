"""Shared fixtures: an isolated STRATA_HOME, tiny generated GGUF models, the real default model."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
sys.path.insert(0, str(Path(__file__).parent))   # the shared helpers, for tests/engine/ and tests/app/

REPO = Path(__file__).resolve().parent.parent

# The app tests' fixtures (app_home, window, fake_client...) and helpers: tests/app_fixtures.py
pytest_plugins = ["app_fixtures"]


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("tiny-models")


@pytest.fixture(scope="session")
def server_model(tmp_path_factory) -> Path:
    """The two-layer llama the server and engine API tests share. Seed 5: greedy replies differ from
    prompt to prompt (several seeds give "\n\n\n..." for all)."""
    from gguf_factory import write_tiny_gguf
    return write_tiny_gguf(tmp_path_factory.mktemp("server-model") / "tiny-server.gguf", arch="llama",
                           n_layer=2, n_embd=64, seed=5, context_length=2048)


@pytest.fixture(scope="session")
def tiny_gguf(tiny_dir) -> Path:
    """A 2-layer llama-architecture GGUF (width 64, real BPE vocab, ChatML template), F32."""
    from gguf_factory import write_tiny_gguf
    return write_tiny_gguf(tiny_dir / "tiny-llama.gguf", arch="llama", n_layer=2, n_embd=64,
                           n_head=4, n_head_kv=2, n_ff=128, seed=0)


@pytest.fixture(scope="session")
def tiny_gguf_other(tiny_dir) -> Path:
    """Same geometry as tiny_gguf, other weights: 'another model'."""
    from gguf_factory import write_tiny_gguf
    return write_tiny_gguf(tiny_dir / "tiny-llama-other.gguf", arch="llama", n_layer=2, n_embd=64,
                           n_head=4, n_head_kv=2, n_ff=128, seed=1)


@pytest.fixture(scope="session")
def tiny_gguf_wide(tiny_dir) -> Path:
    """Another K/V geometry (head_dim 32, 3 layers)."""
    from gguf_factory import write_tiny_gguf
    return write_tiny_gguf(tiny_dir / "tiny-llama-wide.gguf", arch="llama", n_layer=3, n_embd=64,
                           n_head=2, n_head_kv=2, n_ff=128, seed=2)


@pytest.fixture(scope="session")
def big_kv_gguf(tmp_path_factory) -> Path:
    """A model whose K/V is large but cheap to compute, so a child process builds a 32 MiB session in
    seconds on a slow CPU: 32 layers x 32 K/V heads x head_dim 128 (K+V 16 KiB per token per layer in
    fp16 on disk, 32 KiB fp32 in memory) on an 16-wide residual stream (the projections are tiny).
    64 prompt tokens -> ~32.5 MB of K/V in the file; mlx-lm allocates 256 cells, 256 MiB in memory."""
    from gguf_factory import write_tiny_gguf
    return write_tiny_gguf(tmp_path_factory.mktemp("bigkv") / "big-kv.gguf", arch="llama", n_layer=32, n_embd=16,
                           n_head=32, n_head_kv=32, head_dim=128, n_ff=16, seed=4)


@pytest.fixture(autouse=True)
def strata_home(tmp_path, monkeypatch) -> Path:
    home = tmp_path / "strata-home"
    home.mkdir()
    monkeypatch.setenv("STRATA_HOME", str(home))
    # the libraries of other apps (engine/model/model_sources.py) looked for in an empty home, never the real one
    monkeypatch.setenv("STRATA_LIBRARY_HOME", str(tmp_path / "library-home"))
    for key in ("HF_HUB_CACHE", "HF_HOME", "OLLAMA_MODELS"):
        monkeypatch.delenv(key, raising=False)
    return home


@pytest.fixture(autouse=True)
def _chat_views_go_with_their_test():
    """A chat view a widget test made without a window is deleted at the test's end: its debounced work
    (the context meter's count) must not run in a later test, against a window and a store that are gone."""
    yield
    chat_view = sys.modules.get("app.chat_view")
    if chat_view is None:
        return
    from PySide6.QtCore import QEvent
    from PySide6.QtWidgets import QApplication
    app = QApplication.instance()
    if app is None:
        return
    for w in app.topLevelWidgets():
        if isinstance(w, chat_view.ChatView):
            w.deleteLater()
    QApplication.sendPostedEvents(None, QEvent.Type.DeferredDelete)


def real_model_path() -> Path | None:
    """The default model as `make test` fetched it (models folder of the user's STRATA_HOME/XDG)."""
    candidates = []
    if os.environ.get("STRATA_TEST_MODEL"):
        candidates.append(Path(os.environ["STRATA_TEST_MODEL"]))
    home = os.environ.get("STRATA_HOME")
    from engine.model.models import DEFAULT_NAME
    if home:
        candidates.append(Path(home) / "models" / DEFAULT_NAME)
    xdg = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    candidates += [Path(xdg) / "strata" / "models" / DEFAULT_NAME,
                   Path.home() / "Library" / "Application Support" / "Strata" / "models" / DEFAULT_NAME]
    return next((p for p in candidates if p.exists()), None)


_REAL = real_model_path()   # resolved before the autouse fixture points STRATA_HOME elsewhere


@pytest.fixture(scope="session")
def real_model() -> Path:
    if _REAL is None:
        pytest.skip("the default model is not fetched (run `make test`, which fetches it first)")
    return _REAL


def pytest_collection_modifyitems(config, items):
    # The long fuzz campaign runs only when asked for by name: `pytest -m fuzz_long`.
    if "fuzz_long" in (config.getoption("-m") or ""):
        return
    skip = pytest.mark.skip(reason="long fuzz run: select it with -m fuzz_long")
    for item in items:
        if "fuzz_long" in item.keywords:
            item.add_marker(skip)


# ---- the test process's own exit --------------------------------------------------------------------
# One pytest process runs ~1,500 tests that start hundreds of engines, Qt windows and servers in
# threads; mlx 0.32.4 can abort the interpreter's teardown after that ("terminate called without an
# active exception", exit 134) once every test has passed and the summary is printed (CI, 2026-12-02:
# 1,423 passed, then 134). What the tests judge is the product's own exits, and those are run as real
# processes with their exit codes checked (the CLI's refusals exit 2 ten times in a row:
# test_hostile_engine.py; the app's quit and signals: tests/app/test_app_signals.py; the bundle's
# --self-test). So once the session has finished and reported, this process leaves with pytest's exit
# status without running the interpreter's teardown (nothing of the results is lost: reports, caches
# and junit files are written in pytest_sessionfinish, before this). STRATA_TEST_TEARDOWN=1 keeps the
# teardown (to look for what aborts in it).
_EXIT_STATUS: list[int] = []


def pytest_sessionfinish(session, exitstatus):
    _EXIT_STATUS.append(int(exitstatus))


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    if not _EXIT_STATUS or os.environ.get("STRATA_TEST_TEARDOWN") == "1":
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(_EXIT_STATUS[-1])
