"""Settings page round trip and refusals; the SQLite store (corrupt file moved aside); model metadata."""
from __future__ import annotations

import os

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

import pytest  # noqa: E402

from app_fixtures import *  # noqa: E402,F401,F403
from app_fixtures import REPLY_TIMEOUT_MS, open_window  # noqa: E402

pytestmark = pytest.mark.gui


def test_app_settings_round_trip(qtbot, window, app_home):
    from app import settings
    with qtbot.waitSignal(window.status_updated, timeout=REPLY_TIMEOUT_MS):
        window.refresh_status()
    page = window.open_settings()
    assert "GiB available" in page.guard.text()
    page.cache_mib.setValue(512)
    page.cache_slots.setValue(3)
    page.temperature.setValue(0.35)
    page.max_tokens.setValue(99)
    page.system_prompt.setPlainText("Be brief.")
    page.layer_from.setValue(1)
    page.layer_to.setValue(2)
    page.mode.setCurrentText("project")
    page.direction.setText("single:2")
    page.cv_on.setChecked(False)
    page.folders.addItem(str(app_home / "more-models"))
    page._add_cv(str(app_home / "cv.gguf"), 0.5)
    with qtbot.waitSignal(page.saved, timeout=REPLY_TIMEOUT_MS):
        page.submit()
    s = settings.load()
    assert (s.cache_mib, s.cache_slots) == (512, 3)
    assert s.sampling.temperature == pytest.approx(0.35) and s.sampling.max_tokens == 99
    assert s.sampling.system_prompt == "Be brief."
    assert (s.steering.layer_from, s.steering.layer_to, s.steering.mode, s.steering.direction) == (1, 2, "project", "single:2")
    assert s.steering.on_by_default is False
    assert s.steering.files == [(str(app_home / "cv.gguf"), 0.5)]
    assert s.model_folders == [str(app_home / "more-models")]
    # The engine took the new cache limits.
    with qtbot.waitSignal(window.status_updated, timeout=REPLY_TIMEOUT_MS) as blocker:
        window.refresh_status()
    assert blocker.args[0]["parking"]["cap_bytes"] == 512 << 20 and blocker.args[0]["parking"]["slots"] == 3


def test_app_settings_refuses_cache_beyond_guard(qtbot, window):
    from app import settings
    page = window.open_settings()
    page.cache_mib.setValue(4_000_000)         # ~4 TB: more than the guard allows anywhere
    page.submit()
    qtbot.waitUntil(page.error.isVisible, timeout=REPLY_TIMEOUT_MS)
    assert "Not saved" in page.error.text() and "MiB" in page.error.text()
    assert page.isVisible()
    assert settings.load().cache_mib != 4_000_000
    page.reject()


def test_app_corrupt_database_is_moved_aside(qtbot, app_home):
    from app import paths
    db = paths.db_path()
    db.write_bytes(b"definitely not sqlite " * 100)
    w = open_window(qtbot, start_engine=False)
    try:
        assert w.store.moved_aside is not None and w.store.moved_aside.exists()
        assert w.store.moved_aside.read_bytes().startswith(b"definitely not sqlite")
        assert "moved aside" in w.message_bar.text()
        assert w.tabs.count() == 1
        assert db.exists() and db.read_bytes()[:15] == b"SQLite format 3"
    finally:
        w.close()


def test_app_store_round_trip(tmp_path):
    from app.store import Chat, Store
    st = Store(tmp_path / "c.sqlite3")
    a = Chat(title="A", messages=[{"role": "user", "content": "hi"}], config={"speed_projection": False})
    b = Chat(title="B")
    st.save_chat(a)
    st.save_chat(b)
    st.set_order([b.id, a.id])
    st.close()
    again = Store(tmp_path / "c.sqlite3")
    chats = again.chats()
    assert [c.title for c in chats] == ["B", "A"]
    assert chats[1].messages == a.messages and chats[1].config == {"speed_projection": False}
    assert again.db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


def test_app_model_list_metadata(qtbot, window, tiny_model):
    from app.gguf_meta import read_meta
    m = read_meta(tiny_model)
    assert (m.architecture, m.quantization, m.context_length) == ("llama", "F32", 2048)
    assert m.n_params > 100_000 and not m.error
    tree = window.models.tree
    qtbot.waitUntil(lambda: tree.topLevelItemCount() == 1)
    row = [tree.topLevelItem(0).text(c) for c in range(6)]
    assert row[1:4] == ["llama", "111K", "F32"] and row[5] == "2048"
    assert tree.topLevelItem(0).font(0).bold()      # the loaded model
    # The memory estimate (engine/memory_estimate.py, no mlx in the app) at the default context
    from engine import memory_estimate as me
    est = me.estimate(me.read_header(tiny_model), 2048, me.platform_dtype())
    assert tree.topLevelItem(0).text(6) == me.gib(est.total_bytes)
    assert tree.topLevelItem(0).toolTip(6).startswith(est.line() + "; fits in ")
    # Once the engine reports its load budget (on a Mac: the Metal working set), the list uses it
    window.models.engine_budget = {"bytes": 1 << 20, "source": "engine test budget"}
    with qtbot.waitSignal(window.models._scanned, timeout=REPLY_TIMEOUT_MS):
        window.models.refresh()
    qtbot.waitUntil(lambda: tree.topLevelItemCount() == 1 and tree.topLevelItem(0).text(6).endswith("(too big)"))
    assert "does not fit in 1.0 MiB (engine test budget)" in tree.topLevelItem(0).toolTip(6)


def test_app_drop_gguf_links_into_models(qtbot, window, tmp_path, tiny_model):
    import shutil
    src = tmp_path / "dropped.gguf"
    shutil.copyfile(tiny_model, src)
    with qtbot.waitSignal(window.models._scanned, timeout=REPLY_TIMEOUT_MS):
        window.add_model_file(src, how="link")
    from app import paths
    assert (paths.models_dir() / "dropped.gguf").is_symlink()
    qtbot.waitUntil(lambda: window.models.tree.topLevelItemCount() == 2)
