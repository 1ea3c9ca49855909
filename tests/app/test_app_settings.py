"""Settings page round trip and refusals; the SQLite store (corrupt file moved aside); model metadata."""
from __future__ import annotations

import dataclasses
import os

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

import pytest  # noqa: E402

from app_fixtures import REPLY_TIMEOUT_MS, open_window, send_and_wait  # noqa: E402

pytestmark = pytest.mark.gui


def test_app_settings_round_trip(qtbot, window, app_home):
    from app import settings
    with qtbot.waitSignal(window.status_updated, timeout=REPLY_TIMEOUT_MS):
        window.refresh_status()
    page = window.open_settings()
    assert "GiB available" in page.guard.text()
    page.cache_mib.setValue(512)
    page.cache_slots.setValue(3)
    page.sampling_form.temperature.setValue(0.35)
    page.sampling_form.max_tokens.setValue(99)
    page.sampling_form.system_prompt.setPlainText("Be brief.")
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
    assert s.steering.speed_projection is False
    assert s.steering.files == [(str(app_home / "cv.gguf"), 0.5)]
    assert s.model_folders == [str(app_home / "more-models")]
    # The engine took the new cache limits.
    with qtbot.waitSignal(window.status_updated, timeout=REPLY_TIMEOUT_MS) as blocker:
        window.refresh_status()
    assert blocker.args[0].parking["cap_bytes"] == 512 << 20 and blocker.args[0].parking["slots"] == 3


def test_app_settings_cache_field_refuses_what_is_outside_the_valid_range(qtbot, window):
    """engine.limits' range (0..half of RAM) is the field's range: a negative or a value past the guard
    is refused next to the field (never rewritten to another number), and nothing is saved."""
    from PySide6.QtCore import Qt
    from engine.limits import machine_cache_range
    with qtbot.waitSignal(window.status_updated, timeout=REPLY_TIMEOUT_MS) as blocker:
        window.refresh_status()
    top = machine_cache_range().max_mib
    assert blocker.args[0].cache_mib_max == top
    page = window.open_settings()
    field = page.cache_mib
    assert (field.minimum(), field.maximum()) == (0, top)
    assert f"0 to {top} MiB" in page.guard.text() and f"0 to {top} MiB" in field.toolTip()
    from app import settings
    saved = settings.load().cache_mib
    for typed in ("-5", "4000000", str(top * 10)):              # ~4 TB: past the guard
        field.lineEdit().selectAll()
        qtbot.keyClicks(field.lineEdit(), typed)
        qtbot.keyClick(field.lineEdit(), Qt.Key.Key_Tab)
        assert field.text() == typed and field.value() == int(typed)      # kept as typed
        page.submit()
        assert field.message.isVisible() and field.message.text() == f"must be 0 to {top} MiB; got {typed} MiB"
        assert page.isVisible() and settings.load().cache_mib == saved
    page.reject()


def test_app_settings_engine_refusal_then_next_save_clears_it(qtbot, window):
    """The engine applies the same rule: a page that believes in more RAM is refused in one line (not
    saved), and the next successful save clears the message."""
    from app import settings
    from app.settings_page import SettingsPage
    from engine.limits import machine_cache_range
    top = machine_cache_range().max_mib
    with qtbot.waitSignal(window.status_updated, timeout=REPLY_TIMEOUT_MS) as blocker:
        window.refresh_status()
    status = dataclasses.replace(blocker.args[0])
    status.memory = dict(status.memory, total_bytes=status.memory["total_bytes"] * 4)
    page = SettingsPage(window.settings, window.client, status, window)
    qtbot.addWidget(page)
    page.show()
    assert page.cache_mib.maximum() > top
    page.cache_mib.setValue(top + 1)
    page.submit()
    qtbot.waitUntil(page.error.isVisible, timeout=REPLY_TIMEOUT_MS)
    assert page.error.text() == f"Not saved: the conversation cache must be {machine_cache_range().describe()}; " \
                                f"got {top + 1} MiB"
    assert settings.load().cache_mib != top + 1 and page.buttons.isEnabled()
    page.direction.setText("sideways")                           # refused on the page itself
    page.submit()
    assert page.error.isVisible() and "sideways" in page.error.text()
    page.direction.setText("per-layer")
    page.cache_mib.setValue(300)
    with qtbot.waitSignal(page.saved, timeout=REPLY_TIMEOUT_MS):
        page.submit()
    assert page.error.text() == "" and not page.error.isVisible()
    assert settings.load().cache_mib == 300


def test_app_settings_says_what_a_lower_cap_drops(qtbot, window):
    """Parked conversations that a lower cap evicts are named before saving; the second Save goes ahead."""
    from app import settings
    first = window.current_view()
    send_and_wait(qtbot, first, "Tell me about the sea")
    second = window.new_tab()
    send_and_wait(qtbot, second, "Something else entirely")
    with qtbot.waitSignal(window.status_updated, timeout=REPLY_TIMEOUT_MS) as blocker:
        window.refresh_status()
    parked = blocker.args[0].parking
    assert parked["entries"] >= 1
    page = window.open_settings()
    page.cache_mib.setValue(0)
    page.submit()
    assert page.isVisible() and page.error.isVisible()
    assert page.error.text().startswith(f"Turning the cache off drops the {parked['entries']} parked conversation")
    assert page.error.text().endswith("Press Save again to go ahead.")
    assert settings.load().cache_mib != 0
    with qtbot.waitSignal(page.saved, timeout=REPLY_TIMEOUT_MS):
        page.submit()
    assert settings.load().cache_mib == 0 and page.error.text() == ""
    with qtbot.waitSignal(window.status_updated, timeout=REPLY_TIMEOUT_MS) as blocker:
        window.refresh_status()
    assert blocker.args[0].parking["entries"] == 0


def test_app_a_file_that_is_not_a_database_is_left_and_chats_go_beside_it(qtbot, app_home):
    """A file at the chats database's path that is not SQLite is not Strata's to replace: its bytes are
    left as they are, the chats go to a database beside it, and the window says so."""
    from app import paths
    db = paths.db_path()
    garbage = b"definitely not sqlite " * 100
    db.write_bytes(garbage)
    w = open_window(qtbot, start_engine=False)
    try:
        beside = w.store.path
        assert beside != db and beside.parent == db.parent and beside.exists()
        assert beside.read_bytes()[:15] == b"SQLite format 3"
        assert "left as it is" in w.message_bar.text() and str(beside) in w.message_bar.text()
        assert w.tabs.count() == 1
        assert db.read_bytes() == garbage
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
    qtbot.waitUntil(lambda: tree.topLevelItemCount() == 1, timeout=REPLY_TIMEOUT_MS)
    row = [tree.topLevelItem(0).text(c) for c in range(6)]
    assert row[1:4] == ["llama", "111K", "F32"] and row[5] == "2048"
    # the bits a weight takes in the file and as held, in the row's tooltip (the column stays narrow)
    assert "32.00 bits per weight in the file, 32.00 as held in memory" in tree.topLevelItem(0).toolTip(3)
    assert tree.topLevelItem(0).font(0).bold()      # the loaded model
    # The memory estimate (engine/model/memory_estimate.py, no mlx in the app) at the default context
    from engine.model import memory_estimate as me
    est = me.estimate(me.read_header(tiny_model), 2048, me.platform_dtype())
    assert tree.topLevelItem(0).text(6) == me.gib(est.total_bytes)
    assert tree.topLevelItem(0).toolTip(6).startswith(est.line() + "; fits in ")
    # Once the engine reports its load budget (on a Mac: the Metal working set), the list uses it
    window.models.engine_budget = {"bytes": 1 << 20, "source": "engine test budget"}
    with qtbot.waitSignal(window.models.scanned, timeout=REPLY_TIMEOUT_MS):
        window.models.refresh()
    qtbot.waitUntil(lambda: tree.topLevelItemCount() == 1 and tree.topLevelItem(0).text(6).endswith("(too big)"),
                    timeout=REPLY_TIMEOUT_MS)
    assert "does not fit in 1.0 MiB (engine test budget)" in tree.topLevelItem(0).toolTip(6)


def test_app_drop_gguf_links_into_models(qtbot, idle_window, tmp_path, tiny_model):
    import shutil
    window = idle_window
    src = tmp_path / "dropped.gguf"
    shutil.copyfile(tiny_model, src)
    with qtbot.waitSignal(window.models.scanned, timeout=REPLY_TIMEOUT_MS):
        window.library.add_model_file(src, how="link")
    from app import paths
    assert (paths.models_dir() / "dropped.gguf").is_symlink()
    # the list fills from its per-file reader threads: a loaded CI box took over waitUntil's 5 s default once
    qtbot.waitUntil(lambda: window.models.tree.topLevelItemCount() == 2, timeout=REPLY_TIMEOUT_MS)


def test_a_scan_that_ends_after_a_newer_one_is_dropped(qtbot, idle_window):
    """Model-folder scans run on their own threads: an older one ending last must not put back the folder
    as it was (the list would lose a model just added until the next refresh)."""
    models = idle_window.models
    with qtbot.waitSignal(models.scanned, timeout=REPLY_TIMEOUT_MS):
        models.refresh()
    rows = models.tree.topLevelItemCount()
    assert rows >= 1
    models._scanned.emit(models._scans - 1, [])     # an older scan's (empty) result arrives last (same thread: at once)
    assert models.tree.topLevelItemCount() == rows
