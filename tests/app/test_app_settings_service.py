"""The settings service and the message bus (issue 27): one settings object whose `changed(key)` every
part listens to; the settings page refusing bad numbers next to the field; the light/dark/system choice;
hints naming the control in the window (Settings > K/V cache precision), never a flag; Ctrl+, for
Settings where the platform has no Preferences key."""
from __future__ import annotations

import os

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

import pytest  # noqa: E402

from app_fixtures import LOAD_TIMEOUT_MS, open_window, send_and_wait  # noqa: E402
from fake_engine import FakeClient, Refusal  # noqa: E402

pytestmark = pytest.mark.gui

GIB = 1 << 30


def status_reading(total=16 * GIB):
    from engine.api import EngineStatus
    return EngineStatus(memory={"available_bytes": total // 2, "total_bytes": total, "source": "test"},
                        parking={"entries": 0, "bytes": 0, "cap_bytes": 1024 << 20, "slots": 4})


@pytest.fixture
def qapp_ready(qtbot):
    from app.main import make_app
    make_app()
    return qtbot


# ---- the service ---------------------------------------------------------------------------------
def test_changed_fires_once_for_each_key_that_changed_and_saves(qapp_ready, app_home):
    from app import settings
    service = settings.SettingsService()
    keys = []
    service.changed.connect(keys.append)
    new = service.snapshot()
    new.cache_mib = 321
    new.sampling.temperature = 0.05
    new.steering.files = [("/x/v.gguf", 0.5)]
    assert service.update(new) == keys == ["cache_mib", "sampling.temperature", "steering.files"]
    again = settings.load()                                   # saved at once
    assert (again.cache_mib, again.sampling.temperature, again.steering.files) == (321, 0.05, [("/x/v.gguf", 0.5)])
    with qapp_ready.assertNotEmitted(service.changed):
        assert service.update(service.snapshot()) == []        # nothing changed: nothing said
    with qapp_ready.waitSignal(service.changed, check_params_cb=lambda k: k == "server_port"):
        service.set("server_port", 9000)
    assert service.server_port == 9000 and settings.load().server_port == 9000
    with pytest.raises(AttributeError):
        service.cache_mib = 1                                  # only through set/update, which tell the listeners
    with pytest.raises(KeyError):
        service.set("steering.nonsense", 1)


def test_the_message_bus_reaches_the_bars(qapp_ready, idle_window):
    w = idle_window
    w.bus.tell("Something a person must read")
    assert w.message_bar.text() == "Something a person must read"
    w.bus.say("A passing note", 0)
    assert w.status.currentMessage() == "A passing note"
    w.bus.busy.emit("load")
    assert w.status.progress_label.text() == "Loading model" and not w.status.progress.isHidden()
    w.bus.idle.emit()
    assert w.status.progress.isHidden()
    w.bus.tell("Offer", "Do it", lambda: None)
    assert w.message_bar.action.text() == "Do it" and not w.message_bar.action.isHidden()


# ---- the listeners --------------------------------------------------------------------------------
def test_server_keys_apply_the_server_and_nothing_else_does(qapp_ready, idle_window):
    w = idle_window
    applied = []
    w.server.apply = applied.append                  # what ServerControl is asked for (the engine is not started)
    with qapp_ready.waitSignal(w.settings.changed, check_params_cb=lambda k: k == "server_port"):
        s = w.settings.snapshot()
        s.server_enabled, s.server_port = True, 9123
        w.settings.update(s)
    assert applied == [("127.0.0.1", 9123, "")] * 2              # one per key that changed
    w.settings.set("cache_slots", 5)
    w.settings.set("sampling.top_k", 7)
    assert len(applied) == 2
    w.settings.set("server_enabled", False)
    assert applied[-1] is None


def test_new_model_folders_refresh_the_model_list(qapp_ready, idle_window, tmp_path, tiny_model):
    import shutil
    w = idle_window
    more = tmp_path / "more"
    more.mkdir()
    shutil.copyfile(tiny_model, more / "other.gguf")
    qapp_ready.waitUntil(lambda: w.models.tree.topLevelItemCount() == 1)
    with qapp_ready.waitSignal(w.models.scanned, timeout=10_000):
        w.settings.set("model_folders", [str(more)])
    qapp_ready.waitUntil(lambda: w.models.tree.topLevelItemCount() == 2)


def test_a_new_control_vector_reloads_the_model_once(qapp_ready, idle_window, tmp_path):
    w = idle_window
    qapp_ready.waitUntil(lambda: not w.library._scan_first)       # the first scan's load went to the engine
    fake = FakeClient()
    w.library.client = fake
    w.library.model_path = "loaded.gguf"
    s = w.settings.snapshot()
    s.steering.files = [(str(tmp_path / "v.gguf"), 0.5)]
    s.steering.layer_from, s.steering.layer_to = 1, 2
    with qapp_ready.waitSignal(w.library.loaded, timeout=5000):
        w.settings.update(s)                    # three steering keys: one reload
    assert fake.names() == ["load_model"]
    (path,), kw = fake.calls[0][1], fake.calls[0][2]
    assert path == "loaded.gguf" and kw["steering"].files == [(str(tmp_path / "v.gguf"), 0.5)]
    # The speed projection is the engine's default, configured: no reload
    w.client = w.library.client = w.engine_settings.client = fake
    with qapp_ready.assertNotEmitted(w.library.loaded, wait=100):
        w.settings.set("steering.speed_projection", not w.settings.steering.speed_projection)
    assert [n for n in fake.names() if n != "status"] == ["load_model", "configure"]


def test_sampling_defaults_refresh_the_default_config(qapp_ready, idle_window):
    w = idle_window
    with qapp_ready.waitSignal(w.presets.changed):
        w.settings.set("sampling.temperature", 0.11)
    assert w.presets.default().temperature == pytest.approx(0.11)
    assert "temperature 0.11" in w.preset_pane.list.item(0).toolTip()


# ---- the settings page refuses bad numbers next to the field ---------------------------------------
@pytest.mark.parametrize("field,typed,says", [
    ("cache_mib", "-5", "must be 0 to {top} MiB; got -5 MiB"),
    ("cache_mib", "999999999", "must be 0 to {top} MiB; got 999999999 MiB"),
    ("cache_mib", "lots", "'lots' is not a whole number"),
    ("cache_mib", "", "a number is needed"),
    ("cache_slots", "65", "must be 1 to 64; got 65"),
    ("cache_slots", "0", "must be 1 to 64; got 0"),
    ("cache_slots", "2.5", "'2.5' is not a whole number"),
    ("server_port", "70000", "must be 1 to 65535; got 70000"),
])
def test_the_settings_page_refuses_a_bad_number_next_to_its_field(qapp_ready, app_home, field, typed, says):
    from PySide6.QtCore import Qt

    from app import settings
    from app.settings_page import SettingsPage
    from engine.limits import SLOTS_MAX, cache_range
    assert SLOTS_MAX == 64
    before = settings.load()
    fake = FakeClient()
    page = SettingsPage(settings.load(), fake, status_reading())
    qapp_ready.addWidget(page)
    page.show()
    w = getattr(page, field)
    w.lineEdit().selectAll()
    qapp_ready.keyClicks(w.lineEdit(), typed) if typed else w.lineEdit().clear()
    qapp_ready.keyClick(w.lineEdit(), Qt.Key.Key_Tab)
    assert w.text() == typed                                   # what was typed stays, not rewritten
    page.sampling_form.temperature.setValue(0.42)              # another change: not saved either
    page.submit()
    top = cache_range(16 * GIB).max_mib
    assert w.message.isVisible() and w.message.text() == says.format(top=top)
    assert page.error.isVisible() and says.format(top=top) in page.error.text()
    assert page.isVisible() and fake.calls == []                # nothing sent, nothing saved
    assert settings.load() == before
    # Typing again clears the field's message; a good value saves
    w.lineEdit().selectAll()
    qapp_ready.keyClicks(w.lineEdit(), "3")
    assert not w.message.isVisible()
    with qapp_ready.waitSignal(page.saved, timeout=5000):
        page.submit()
    assert getattr(settings.load(), field) == 3 and settings.load().sampling.temperature == pytest.approx(0.42)


def test_every_number_field_is_checked_and_marked(qapp_ready, app_home):
    from app import settings
    from app.settings_page import SettingsPage
    page = SettingsPage(settings.load(), FakeClient(), status_reading())
    qapp_ready.addWidget(page)
    page.show()
    page.cache_slots.lineEdit().setText("99")
    page.layer_to.lineEdit().setText("-1")
    page.submit()
    assert page.cache_slots.message.isVisible() and page.layer_to.message.isVisible()
    assert not page.cache_mib.message.isVisible()
    assert page.error.text() == "Not saved: Slots must be 1 to 64; got 99; Layers to must be 0 to 999; got -1"


# ---- the theme ------------------------------------------------------------------------------------
def test_the_theme_choice_applies_and_persists(qapp_ready, idle_window):
    from PySide6.QtGui import QGuiApplication

    from app import settings, theme
    w = idle_window
    for choice in ("dark", "light", "dark"):
        page = w.open_settings()
        page.theme.setCurrentIndex(page.theme.findData(choice))
        with qapp_ready.waitSignal(w.settings.changed, check_params_cb=lambda k: k == "theme"):
            page.submit()
        assert settings.load().theme == choice and theme.current() == choice
        assert theme.is_dark(QGuiApplication.palette()) is (choice == "dark")
        qapp_ready.waitUntil(lambda: theme.is_dark(w.palette()) is (choice == "dark"), timeout=2000)   # the window shows it
    # The next launch starts in it
    w.close()
    again = open_window(qapp_ready, start_engine=False)
    try:
        assert again.settings.theme == "dark" and theme.current() == "dark"
        assert again.open_settings().theme.currentData() == "dark"
        again.settings.set("theme", "system")
        assert settings.load().theme == "system"
    finally:
        again.close()


# ---- hints name the control in the window -----------------------------------------------------------
def test_a_kv_precision_refusal_names_the_setting_not_a_flag(qapp_ready, idle_window, tmp_path):
    """The wording follows the refusal's reason (SessionRefusal.KV_FORMAT), not the engine's text."""
    from engine.errors import ErrorCode, SessionRefusal
    w = idle_window
    fake = FakeClient()
    w.sessions.client = fake
    line = "a.stratasession holds 16-bit K/V; this engine runs 8-bit K/V (group 32)"
    fake.answers["restore_session"] = Refusal(line, ErrorCode.SESSION_REFUSED, SessionRefusal.KV_FORMAT)
    with qapp_ready.waitSignal(w.sessions.refused, timeout=5000):
        w.sessions.restore_session(str(tmp_path / "a.stratasession"))
    text = w.message_bar.text()
    assert text.startswith(f"a.stratasession was not restored: {line}")
    assert "Settings > K/V cache precision" in text and "--" not in text
    # Another refusal gets no such hint
    fake.answers["restore_session"] = Refusal("a.stratasession was saved with another model",
                                              ErrorCode.SESSION_REFUSED, SessionRefusal.FILE)
    with qapp_ready.waitSignal(w.sessions.refused, timeout=5000):
        w.sessions.restore_session(str(tmp_path / "a.stratasession"))
    assert "Settings >" not in w.message_bar.text()


def test_a_16bit_session_after_switching_to_8bit_names_the_setting(qtbot, wide_home, tmp_path):
    """The journey of the issue: save at 16-bit, switch Settings to 8-bit, restore: the message names
    Settings > K/V cache precision, never --kv-bits."""
    from app_fixtures import REPLY_TIMEOUT_MS
    w = open_window(qtbot)
    with qtbot.waitSignal(w.library.loaded, timeout=LOAD_TIMEOUT_MS):
        w.show()
    try:
        view = w.current_view()
        send_and_wait(qtbot, view, "Hello there")
        path = str(tmp_path / "sixteen.stratasession")
        with qtbot.waitSignal(w.sessions.saved, timeout=REPLY_TIMEOUT_MS):
            w.sessions.save_session(view, path)
        page = w.open_settings()
        page.kv_bits.setCurrentIndex(page.kv_bits.findData(8))
        with qtbot.waitSignal(page.saved, timeout=REPLY_TIMEOUT_MS):
            page.submit()
        with qtbot.waitSignal(w.sessions.refused, timeout=REPLY_TIMEOUT_MS):
            w.sessions.restore_session(path)
        text = w.message_bar.text()
        assert "holds 16-bit K/V" in text and "Settings > K/V cache precision" in text, text
        assert "--kv-bits" not in text
    finally:
        w.close()


# ---- the Settings shortcut ------------------------------------------------------------------------
def test_settings_has_a_shortcut_on_every_platform(qapp_ready, idle_window):
    from PySide6.QtGui import QKeySequence
    w = idle_window
    action = next(a for a in w.menuBar().actions()[0].menu().actions() if a.text() == "Settings…")
    keys = [k.toString() for k in action.shortcuts()]
    assert keys and all(keys)
    if not QKeySequence.keyBindings(QKeySequence.StandardKey.Preferences):     # Linux: none of its own
        assert keys == ["Ctrl+,"]


def test_a_theme_switch_redraws_open_transcripts(qapp_ready, idle_window):
    """A chat open when the theme changes is drawn again in it: its code block takes the dark code
    style (light code colours on the dark palette were unreadable until the tab was re-rendered)."""
    from app import theme
    w = idle_window
    view = w.current_view()
    view.chat.messages[:] = [{"role": "user", "content": "code?"},
                             {"role": "assistant", "content": "```python\ndef f(n):\n    return n\n```"}]
    view.render_all()
    w.settings.set("theme", "light")
    light_html = view.transcript.toHtml()
    w.settings.set("theme", "dark")
    assert theme.current() == "dark"
    dark_html = view.transcript.toHtml()
    assert dark_html != light_html
    # monokai's keyword colour (#66d9ef) is the dark code style's; the light one has none of it
    assert "#66d9ef" in dark_html.lower() and "#66d9ef" not in light_html.lower()
    w.settings.set("theme", "system")
