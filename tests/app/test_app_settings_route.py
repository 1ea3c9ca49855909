"""The settings that reach the engine take one route (SettingsService.changed -> app/engine_settings.py
-> Configure), whoever changes them; the settings page's messages (whole, every problem named, out of
range said as such), its disk-cap warning, its size on a small screen; the window's keyboard."""
from __future__ import annotations

import os

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

import pytest  # noqa: E402

from app_fixtures import REPLY_TIMEOUT_MS  # noqa: E402
from fake_engine import FakeClient, Refusal  # noqa: E402

pytestmark = pytest.mark.gui

GIB = 1 << 30
MIB = 1 << 20


def status_reading(total=16 * GIB, disk=None):
    from engine.api import EngineStatus
    return EngineStatus(memory={"available_bytes": total // 2, "total_bytes": total, "source": "test"},
                        parking={"entries": 0, "bytes": 0, "cap_bytes": 1024 << 20, "slots": 4}, disk=disk)


@pytest.fixture
def qapp_ready(qtbot):
    from app.main import make_app
    make_app()
    return qtbot


@pytest.fixture
def service(qapp_ready, app_home):
    from app import settings
    return settings.SettingsService(settings.load())


# ---- one route ------------------------------------------------------------------------------------
@pytest.mark.parametrize("key, value, field", [
    ("cache_mib", 512, "cache_mib"),
    ("cache_slots", 3, "cache_slots"),
    ("disk_mib", 77, "disk_mib"),
    ("kv_bits", 8, "kv_bits"),
    ("steering.speed_projection", False, "speed_projection"),
])
def test_a_setting_changed_from_anywhere_reaches_the_engine(qapp_ready, service, key, value, field):
    """settings.set from outside the page: one Configure with that field, and the controller holds it."""
    from app.engine_settings import EngineSettings
    fake = FakeClient()
    ctl = EngineSettings.of(service, fake)
    assert EngineSettings.of(service, fake) is ctl                 # one per service
    with qapp_ready.waitSignal(ctl.applied, timeout=5000):
        service.set(key, value)
    assert fake.calls == [("configure", (), {field: value})]
    assert ctl.held(key) == value and service.get(key) == value


def test_one_update_is_one_configure(qapp_ready, service):
    from app.engine_settings import EngineSettings
    fake = FakeClient()
    ctl = EngineSettings.of(service, fake)
    new = service.snapshot()
    new.cache_mib, new.cache_slots, new.kv_bits = 300, 2, 4
    new.sampling.temperature = 0.1                                 # not the engine's: not sent
    with qapp_ready.waitSignal(ctl.applied, timeout=5000):
        service.update(new)
    assert fake.calls == [("configure", (), {"cache_mib": 300, "cache_slots": 2, "kv_bits": 4})]


def test_a_refused_change_is_put_back_and_named(qapp_ready, service):
    """The engine's refusal (its reason names the field): the key is back to what the engine runs with,
    saved, and `refused` says which key; a value out of bounds is refused before anything is sent."""
    from app import settings
    from app.engine_settings import EngineSettings
    fake = FakeClient()
    ctl = EngineSettings.of(service, fake)
    before = service.kv_bits
    fake.answers["configure"] = Refusal("8-bit K/V needs a head size that is a multiple of 32", "bad_request",
                                        "kv_bits")
    with qapp_ready.waitSignal(ctl.refused, timeout=5000) as got:
        service.set("kv_bits", 8)
    assert got.args == ["kv_bits", "8-bit K/V needs a head size that is a multiple of 32"]
    assert service.kv_bits == before and settings.load().kv_bits == before and ctl.held("kv_bits") == before
    fake.calls.clear()
    with qapp_ready.waitSignal(ctl.refused, timeout=5000) as got:
        service.set("cache_slots", 0)                              # engine/limits.py's bounds
    assert got.args[0] == "cache_slots" and "1 to 64" in got.args[1]
    assert fake.calls == [] and service.cache_slots == ctl.held("cache_slots") != 0


def test_the_real_engine_takes_settings_set_from_outside_the_page(qtbot, window):
    """The window's engine (a tiny GGUF): cache cap, slots, disk cap and the projection default set
    through the service alone are in the engine's status."""
    w = window
    with qtbot.waitSignal(w.engine_settings.applied, timeout=REPLY_TIMEOUT_MS):
        w.settings.set("cache_mib", 300)
    with qtbot.waitSignal(w.engine_settings.applied, timeout=REPLY_TIMEOUT_MS):
        w.settings.set("cache_slots", 2)
    with qtbot.waitSignal(w.engine_settings.applied, timeout=REPLY_TIMEOUT_MS):
        w.settings.set("disk_mib", 64)
    with qtbot.waitSignal(w.engine_settings.applied, timeout=REPLY_TIMEOUT_MS) as got:
        w.settings.set("steering.speed_projection", not w.settings.steering.speed_projection)
    status = got.args[0]
    assert status.parking["cap_bytes"] == 300 << 20 and status.parking["slots"] == 2
    assert status.disk["cap_bytes"] == 64 << 20
    assert status.speed_projection_default is w.settings.steering.speed_projection
    # The K/V width this model's head size (16) cannot take: refused by the engine, put back, named
    with qtbot.waitSignal(w.engine_settings.refused, timeout=REPLY_TIMEOUT_MS) as got:
        w.settings.set("kv_bits", 8)
    assert got.args[0] == "kv_bits" and "multiple of 32" in got.args[1]
    assert w.settings.kv_bits == 16 and w.engine_settings.held("kv_bits") == 16


# ---- the page's messages ----------------------------------------------------------------------------
def _page(qapp_ready, status=None, client=None):
    from app import settings
    from app.settings_page import SettingsPage
    page = SettingsPage(settings.load(), client or FakeClient(), status or status_reading())
    qapp_ready.addWidget(page)
    page.show()
    qapp_ready.waitExposed(page)
    return page


def _shows_whole(label) -> bool:
    """Visible, wrapped to its width, tall enough for every line, and as wide as its longest word."""
    longest = max(label.text().split(), key=len)
    return (label.isVisible() and label.wordWrap() and label.height() >= label.heightForWidth(label.width())
            and label.width() >= label.fontMetrics().horizontalAdvance(longest))


def test_a_huge_number_is_out_of_range_said_whole_and_every_problem_is_named(qapp_ready, app_home):
    from app import settings
    from engine.limits import DISK_MIB_MAX
    page = _page(qapp_ready)
    before = settings.load()
    page.disk_mib.lineEdit().setText("999999999999")
    page.cache_slots.lineEdit().setText("99")
    page.layer_to.lineEdit().setText("x")
    page.submit()
    qapp_ready.wait(50)                                            # the layout settles
    says = f"must be 0 to {DISK_MIB_MAX} MiB; got 999999999999 MiB"
    assert page.disk_mib.message.text() == says and _shows_whole(page.disk_mib.message)
    assert page.cache_slots.message.text() == "must be 1 to 64; got 99"
    assert page.layer_to.message.text() == "'x' is not a whole number"
    assert page.error.text() == (f"Not saved: Slots must be 1 to 64; got 99; On disk {says}; "
                                 "Layers to 'x' is not a whole number")
    assert _shows_whole(page.error) and settings.load() == before
    page.disk_mib.lineEdit().setText("9" * 5000)                   # past int()'s digit limit: still a range
    assert page.disk_mib.check() == f"must be 0 to {DISK_MIB_MAX} MiB; got a 5000-digit number"


def test_number_boxes_keep_a_readable_width(qapp_ready, app_home):
    page = _page(qapp_ready)
    page.resize(400, 500)                                          # squeezed: the boxes keep their width
    qapp_ready.wait(50)
    for name, field in page.number_fields().items():
        edit = field.lineEdit()
        need = edit.fontMetrics().horizontalAdvance(str(field.maximum()))
        assert edit.width() > need, (name, edit.width(), need)
    assert page.disk_mib.lineEdit().width() > page.disk_mib.lineEdit().fontMetrics().horizontalAdvance("1048576")


def test_an_engine_refusal_shows_next_to_its_field(qapp_ready, app_home):
    fake = FakeClient()
    page = _page(qapp_ready, client=fake)
    fake.answers["configure"] = Refusal("8-bit K/V needs a head size that is a multiple of 32", "bad_request",
                                        "kv_bits")
    page.kv_bits.setCurrentIndex(page.kv_bits.findData(8))
    page.submit()
    qapp_ready.waitUntil(page.error.isVisible, timeout=5000)
    assert page.kv_bits_message.isVisible() and "multiple of 32" in page.kv_bits_message.text()
    assert page.isVisible() and page.buttons.isEnabled() and page.settings.kv_bits == 16


# ---- the disk cap's warning ------------------------------------------------------------------------
def test_a_lower_disk_cap_warns_before_deleting_cached_chats(qapp_ready, app_home):
    from app import settings
    fake = FakeClient()
    disk = {"enabled": True, "entries": 5, "bytes": int(76.8 * MIB), "cap_bytes": 4096 << 20}
    page = _page(qapp_ready, status_reading(disk=disk), fake)
    before = settings.load()
    page.disk_mib.setValue(10)
    page.submit()
    assert page.isVisible() and page.error.isVisible()
    assert page.error.text() == ("76.8 MiB of conversations are cached on disk: a 10 MiB cap deletes some of "
                                 "them. Press Save again to go ahead.")
    assert fake.calls == [] and settings.load() == before
    with qapp_ready.waitSignal(page.saved, timeout=5000):
        page.submit()
    assert fake.calls == [("configure", (), {"disk_mib": 10})] and settings.load().disk_mib == 10
    # A cap above what is used, or off (the files stay until Clear), warns of nothing
    for cap in (100, 0):
        page = _page(qapp_ready, status_reading(disk=disk), fake)
        page.disk_mib.setValue(cap)
        with qapp_ready.waitSignal(page.saved, timeout=5000):
            page.submit()


# ---- the page on a small screen ---------------------------------------------------------------------
def test_the_settings_page_fits_a_1024x700_screen_with_its_buttons_outside_the_scroll(qapp_ready, app_home):
    from PySide6.QtCore import QRect
    page = _page(qapp_ready)
    hint = page.minimumSizeHint()
    assert hint.width() <= 1024 and hint.height() <= 700, hint
    assert page.width() <= 1024 and page.height() <= 700
    assert not page.scroll.isAncestorOf(page.buttons) and page.scroll.isAncestorOf(page.disk_mib)
    page.resize(1000, 650)
    qapp_ready.wait(50)
    save = page.buttons.button(page.buttons.StandardButton.Save)
    top_left = save.mapTo(page, save.rect().topLeft())
    assert QRect(0, 0, page.width(), page.height()).contains(QRect(top_left, save.size()))


# ---- the keyboard -----------------------------------------------------------------------------------
def test_tab_leaves_the_message_box_and_ctrl_pgdn_switches_chats_from_it(qapp_ready, idle_window):
    from PySide6.QtCore import Qt
    w = idle_window
    w.show()
    qapp_ready.waitExposed(w)
    first = w.current_view() or w.new_tab()
    w.new_tab()
    w.tabs.setCurrentWidget(first)
    w.activateWindow()
    first.input.setFocus()
    qapp_ready.waitUntil(first.input.hasFocus, timeout=2000)
    qapp_ready.keyClick(first.input, Qt.Key.Key_Tab)
    assert not first.input.hasFocus() and first.input.toPlainText() == ""
    first.input.setFocus()
    qapp_ready.waitUntil(first.input.hasFocus, timeout=2000)
    at = w.tabs.currentIndex()
    qapp_ready.keyClick(first.input, Qt.Key.Key_PageDown, Qt.KeyboardModifier.ControlModifier)
    assert w.tabs.currentIndex() == (at + 1) % w.tabs.count()
    now = w.current_view()
    qapp_ready.waitUntil(now.input.hasFocus, timeout=2000)
    qapp_ready.keyClick(now.input, Qt.Key.Key_PageUp, Qt.KeyboardModifier.ControlModifier)
    assert w.tabs.currentIndex() == at
    qapp_ready.waitUntil(first.input.hasFocus, timeout=2000)
    qapp_ready.keyClick(first.input, Qt.Key.Key_Tab, Qt.KeyboardModifier.ControlModifier)
    assert w.tabs.currentIndex() == (at + 1) % w.tabs.count()
    now = w.current_view()
    qapp_ready.waitUntil(now.input.hasFocus, timeout=2000)
    qapp_ready.keyClick(now.input, Qt.Key.Key_Backtab, Qt.KeyboardModifier.ShiftModifier)
    assert not now.input.hasFocus() and now.input.toPlainText() == ""      # Shift+Tab: back out of it
