"""Widget-level tests where the engine adds nothing: the sampling form, the settings page and the
configs pane on tests/fake_engine.py's FakeClient, the status bar, and the session controller's file
opening. Fast: no engine thread, no model."""
from __future__ import annotations

import os

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

import pytest  # noqa: E402

from engine.api import EngineStatus, Generation  # noqa: E402
from fake_engine import Refusal  # noqa: E402

pytestmark = pytest.mark.gui

GIB = 1 << 30


@pytest.fixture
def qapp_ready(qtbot):
    from app.main import make_app
    make_app()
    return qtbot


def status_reading(parked_entries=0, parked_bytes=0, total=16 * GIB) -> EngineStatus:
    return EngineStatus(memory={"available_bytes": total // 2, "total_bytes": total, "source": "test"},
                        parking={"entries": parked_entries, "bytes": parked_bytes, "cap_bytes": 1024 << 20, "slots": 4})


# ---- the sampling form -------------------------------------------------------------------------------
def test_sampling_form_fields_come_from_the_engine_table(qapp_ready):
    from app.sampling_form import SamplingForm
    from app.settings import Sampling
    from engine.sampling import APP_FIELDS
    form = SamplingForm(Sampling())
    qapp_ready.addWidget(form)
    assert list(form.spins) == [f.name for f in APP_FIELDS]
    for f in APP_FIELDS:
        w = getattr(form, f.name)
        lo, hi, step, _decimals = f.form
        assert (w.minimum(), w.maximum(), w.singleStep()) == pytest.approx((lo, hi, step))
        assert w.value() == pytest.approx(f.chat_default)
    assert form.values() == Sampling()
    form.temperature.setValue(0.3)
    form.top_k.setValue(7)
    form.system_prompt.setPlainText("Short answers.")
    form.context_length.setValue(4096)
    v = form.values()
    assert (v.temperature, v.top_k, v.system_prompt, v.context_length) == (pytest.approx(0.3), 7, "Short answers.", 4096)
    form.set_values(Sampling())
    assert form.values() == Sampling()


def test_the_settings_page_and_a_config_dialog_use_the_same_form(qapp_ready, app_home, fake_client):
    from app import settings
    from app.presets import PresetDialog, PresetManager
    from app.sampling_form import SamplingForm
    from app.settings_page import SettingsPage
    from app.store import Store
    s = settings.load()
    page = SettingsPage(s, fake_client, status_reading())
    store = Store(app_home / "chats.sqlite3")
    manager = PresetManager(store, settings.SettingsService(s, persist=False))
    dlg = PresetDialog(manager, manager.default())
    for w in (page, dlg):
        qapp_ready.addWidget(w)
        assert isinstance(w.sampling_form, SamplingForm)
    assert page.sampling_form.values() == dlg.sampling_form.values() == s.sampling
    store.close()


# ---- the settings page ---------------------------------------------------------------------------
def test_settings_page_sends_the_cache_limits_and_saves_once_the_engine_took_them(qapp_ready, app_home, fake_client):
    from app import settings
    from app.settings_page import SettingsPage
    fake_client.answers["configure"] = status_reading()
    page = SettingsPage(settings.load(), fake_client, status_reading())
    qapp_ready.addWidget(page)
    assert "8.0 GiB available of 16.0 GiB (test)" in page.guard.text()
    page.cache_mib.setValue(512)
    page.cache_slots.setValue(3)
    page.sampling_form.max_tokens.setValue(99)
    page.cv_on.setChecked(True)
    with qapp_ready.waitSignal(page.saved, timeout=5000) as blocker:
        page.submit()
    new, old = blocker.args
    assert fake_client.calls == [("configure", (), {"cache_mib": 512, "cache_slots": 3})]
    assert (new.cache_mib, new.cache_slots, new.sampling.max_tokens, new.steering.speed_projection) == (512, 3, 99, True)
    again = settings.load()
    assert (again.cache_mib, again.sampling.max_tokens, again.steering.speed_projection) == (512, 99, True)
    assert old.cache_mib != 512


def test_settings_page_without_cache_changes_asks_the_engine_nothing(qapp_ready, app_home, fake_client):
    from app import settings
    from app.settings_page import SettingsPage
    service = settings.SettingsService(settings.load(), persist=False)
    changed = []
    service.changed.connect(changed.append)
    page = SettingsPage(service, fake_client, status_reading())
    qapp_ready.addWidget(page)
    page.sampling_form.temperature.setValue(0.1)
    page.submit()
    assert fake_client.calls == [] and service.sampling.temperature == pytest.approx(0.1)
    assert changed == ["sampling.temperature"]


def test_settings_page_shows_the_engines_refusal_and_saves_nothing(qapp_ready, app_home, fake_client):
    from app import settings
    from app.settings_page import SettingsPage
    fake_client.answers["configure"] = Refusal("the conversation cache must be 0 to 8 MiB; got 9 MiB")
    page = SettingsPage(settings.load(), fake_client, status_reading())
    qapp_ready.addWidget(page)
    page.show()
    page.cache_mib.setValue(9)
    page.submit()
    assert not page.buttons.isEnabled()                  # waiting for the engine
    qapp_ready.waitUntil(page.error.isVisible, timeout=5000)
    assert page.error.text() == "Not saved: the conversation cache must be 0 to 8 MiB; got 9 MiB"
    assert page.buttons.isEnabled() and settings.load().cache_mib != 9
    page.direction.setText("sideways")
    page.submit()
    assert "sideways" in page.error.text() and len(fake_client.calls) == 1


def test_settings_page_names_what_a_lower_cap_drops_and_goes_ahead_on_the_second_save(qapp_ready, app_home,
                                                                                      fake_client):
    from app import settings
    from app.settings_page import SettingsPage
    page = SettingsPage(settings.load(), fake_client, status_reading(parked_entries=2, parked_bytes=300 << 20))
    qapp_ready.addWidget(page)
    page.cache_mib.setValue(0)
    page.submit()
    assert page.error.text().startswith("Turning the cache off drops the 2 parked conversation(s) (300.0 MiB).")
    assert fake_client.calls == []
    with qapp_ready.waitSignal(page.saved, timeout=5000):
        page.submit()
    assert fake_client.names() == ["configure"] and settings.load().cache_mib == 0


def test_kv_bits_round_trips_through_the_settings_page_and_the_settings_file(qapp_ready, app_home, fake_client):
    """K/V cache precision: an old settings file (no key) and a hand-edited value load as 16; the page
    sends only what changed to the engine (precision and cache values in one Configure, which the engine
    takes whole or not at all) and the page closes once it is taken."""
    from PySide6.QtCore import QSettings

    from app import settings
    from app.settings_page import SettingsPage
    ini = QSettings(str(app_home / "settings.ini"), QSettings.Format.IniFormat)
    ini.remove("app/kv_bits")                           # a file from before the setting
    ini.sync()
    assert settings.load().kv_bits == 16
    fake_client.answers["configure"] = status_reading()
    page = SettingsPage(settings.load(), fake_client, status_reading())
    qapp_ready.addWidget(page)
    assert page.kv_bits.currentData() == 16 and page.kv_bits.currentText() == "16-bit (default)"
    assert [page.kv_bits.itemData(i) for i in range(page.kv_bits.count())] == [16, 8, 4]
    tip = page.kv_bits.toolTip()
    assert "memory per token" in tip and "keep the format" in tip and "Session files" in tip
    page.kv_bits.setCurrentIndex(page.kv_bits.findData(8))
    with qapp_ready.waitSignal(page.saved, timeout=5000) as blocker:
        page.submit()
    assert fake_client.calls == [("configure", (), {"kv_bits": 8})]
    assert blocker.args[0].kv_bits == 8 and blocker.args[1].kv_bits == 16
    assert settings.load().kv_bits == 8
    again = SettingsPage(settings.load(), fake_client, status_reading())   # reopened: shows the saved value
    qapp_ready.addWidget(again)
    assert again.kv_bits.currentData() == 8
    # precision and cache together: one request
    fake_client.calls.clear()
    again.kv_bits.setCurrentIndex(again.kv_bits.findData(4))
    again.cache_slots.setValue(5)
    with qapp_ready.waitSignal(again.saved, timeout=5000):
        again.submit()
    assert [c[2] for c in fake_client.calls] == [{"kv_bits": 4, "cache_slots": 5}]
    assert (settings.load().kv_bits, settings.load().cache_slots) == (4, 5)
    ini = QSettings(str(app_home / "settings.ini"), QSettings.Format.IniFormat)
    ini.setValue("app/kv_bits", 5)                      # hand-edited: the engine would refuse it at start
    ini.sync()
    assert settings.load().kv_bits == 16


def test_settings_page_shows_the_engines_kv_bits_refusal_and_saves_nothing(qapp_ready, app_home, fake_client):
    from app import settings
    from app.settings_page import SettingsPage
    why = "8-bit K/V needs a head size that is a multiple of 32 (this model's is 16)"
    fake_client.answers["configure"] = lambda **kw: Refusal(why) if kw.get("kv_bits") == 8 else status_reading()
    page = SettingsPage(settings.load(), fake_client, status_reading())
    qapp_ready.addWidget(page)
    page.show()
    page.kv_bits.setCurrentIndex(page.kv_bits.findData(8))
    page.cache_slots.setValue(6)
    page.submit()
    qapp_ready.waitUntil(page.error.isVisible, timeout=5000)
    assert page.error.text() == f"Not saved: {why}"
    assert fake_client.calls == [("configure", (), {"kv_bits": 8, "cache_slots": 6})]   # one request, refused whole
    assert page.buttons.isEnabled() and settings.load().kv_bits == 16 and settings.load().cache_slots != 6
    assert page.kv_bits_message.isVisible() and page.kv_bits_message.text() == why   # no reason: the precision


def test_a_cache_refusal_keeps_the_precision_too(qapp_ready, app_home, fake_client):
    """The engine takes a Configure whole or not at all: refused for its cache values, the precision sent
    with them is not in force either, and the settings say so (nothing is sent to put it back)."""
    from app import settings
    from app.settings_page import SettingsPage
    fake_client.answers["configure"] = lambda **kw: Refusal("no slots") if "cache_slots" in kw else status_reading()
    page = SettingsPage(settings.load(), fake_client, status_reading())
    qapp_ready.addWidget(page)
    page.show()
    page.kv_bits.setCurrentIndex(page.kv_bits.findData(4))
    page.cache_slots.setValue(6)
    page.submit()
    qapp_ready.waitUntil(page.error.isVisible, timeout=5000)
    assert page.error.text() == "Not saved: no slots"
    assert [c[2].get("kv_bits") for c in fake_client.calls] == [4]
    assert settings.load().kv_bits == 16 and settings.load().cache_slots != 6


# ---- the configs pane ------------------------------------------------------------------------------
@pytest.fixture
def presets(qapp_ready, app_home):
    from app import settings
    from app.presets import PresetManager
    from app.store import Store
    service = settings.SettingsService(settings.load(), persist=False)
    store = Store(app_home / "chats.sqlite3")
    manager = PresetManager(store, service)
    service.changed.connect(lambda key: manager.changed_keys.append(key))
    manager.changed_keys = []
    yield manager
    store.close()


def test_configs_pane_create_rename_duplicate_delete(qapp_ready, presets):
    from app.presets import PresetPane
    pane = PresetPane(presets)
    qapp_ready.addWidget(pane)
    assert pane.current_id() == "default" and not pane.rename_btn.isEnabled() and not pane.delete_btn.isEnabled()
    a = pane.new_preset()
    assert a.name == "Config" and pane.current_id() == a.id and pane.delete_btn.isEnabled()
    pane.rename_selected("Coder")
    pane.rename_selected("DEFAULT")
    assert "already a config named" in pane.error.text() and presets.get(a.id).name == "Coder"
    b = pane.duplicate_selected()
    assert b.name == "Coder copy" and pane.list.count() == 3
    pane.delete_selected(confirm=False)
    assert [pane.list.item(i).text() for i in range(pane.list.count())] == ["Default", "Coder"]
    assert "temperature 0.8" in pane.list.item(0).toolTip()        # app_home's settings


def test_editing_default_in_its_dialog_edits_the_settings_sampling_defaults(qapp_ready, presets):
    from app.presets import PresetDialog
    dlg = PresetDialog(presets, presets.default())
    qapp_ready.addWidget(dlg)
    assert not dlg.name.isEnabled()
    dlg.sampling_form.max_tokens.setValue(77)
    dlg.speed.setChecked(False)
    dlg.submit()
    s = presets.settings
    assert presets.changed_keys and s.sampling.max_tokens == 77 and s.steering.speed_projection is False
    assert presets.default().max_tokens == 77


def test_a_configs_draft_model_choice_round_trips(qapp_ready, presets, tmp_path, monkeypatch):
    """"Draft model…" opens a file dialog in the models folder, stores draft:PATH and shows
    "Draft: <file name>"; cancelling the dialog keeps the choice before it."""
    from app import presets as presets_mod
    from app.presets import PICK_DRAFT, PresetDialog
    models = tmp_path / "models"
    models.mkdir()
    draft = models / "small-draft.gguf"
    asked = []
    answer = {"path": str(draft)}

    def fake_dialog(parent, caption, start, filters):
        asked.append((caption, start, filters))
        return answer["path"], filters

    monkeypatch.setattr(presets_mod.QFileDialog, "getOpenFileName", staticmethod(fake_dialog))
    p = presets.create("Coder", speculative="lookup")
    dlg = PresetDialog(presets, presets.get(p.id), models_dir=models)
    qapp_ready.addWidget(dlg)
    labels = [dlg.spec.itemText(i) for i in range(dlg.spec.count())]
    assert labels == ["Off", "Prompt lookup", "Model's MTP head", "Draft model…"] and dlg.spec.currentData() == "lookup"
    answer["path"] = ""                                 # cancelled: still lookup
    dlg.spec.setCurrentIndex(dlg.spec.findData(PICK_DRAFT))
    assert dlg.spec.currentData() == "lookup" and asked[-1][1] == str(models) and "*.gguf" in asked[-1][2]
    answer["path"] = str(draft)
    dlg.spec.setCurrentIndex(dlg.spec.findData(PICK_DRAFT))
    assert dlg.spec.currentText() == "Draft: small-draft.gguf" and dlg.spec.currentData() == f"draft:{draft}"
    dlg.submit()
    assert presets.get(p.id).speculative == f"draft:{draft}"
    assert "speculative decoding Draft: small-draft.gguf" in presets_mod._summary(presets.get(p.id))
    # reopened: the stored draft is shown and selected; another pick replaces it (one draft entry)
    dlg2 = PresetDialog(presets, presets.get(p.id), models_dir=models)
    qapp_ready.addWidget(dlg2)
    assert dlg2.spec.currentText() == "Draft: small-draft.gguf" and dlg2.spec.count() == 5
    other = tmp_path / "elsewhere" / "tiny.gguf"
    answer["path"] = str(other)
    dlg2.spec.setCurrentIndex(dlg2.spec.findData(PICK_DRAFT))
    assert asked[-1][1] == str(models)                  # starts where the current draft is
    assert dlg2.spec.count() == 5 and dlg2.values().speculative == f"draft:{other}"
    answer["path"] = ""
    dlg2.spec.setCurrentIndex(dlg2.spec.findData(PICK_DRAFT))
    assert asked[-1][1] == str(other.parent) and dlg2.values().speculative == f"draft:{other}"
    dlg2.spec.setCurrentIndex(dlg2.spec.findData("off"))
    assert dlg2.values().speculative == "off"
    # Default keeps its choice too (in the settings)
    dflt = PresetDialog(presets, presets.default(), models_dir=models)
    qapp_ready.addWidget(dflt)
    answer["path"] = str(draft)
    dflt.spec.setCurrentIndex(dflt.spec.findData(PICK_DRAFT))
    dflt.submit()
    assert presets.settings.speculative == f"draft:{draft}" and presets.default().speculative == f"draft:{draft}"


# ---- the status bar ----------------------------------------------------------------------------------
def test_status_bar_shows_a_reply_the_engine_reading_and_the_server(qapp_ready):
    from app.status_bar import StatusBar
    bar = StatusBar()
    qapp_ready.addWidget(bar)
    bar.show_result(Generation(decode_tps=41.26, ttft_ms=12.4, cached_tokens=5, prompt_tokens=9))
    assert (bar.speed.text(), bar.ttft.text(), bar.cached.text()) == ("41.3 tok/s", "ttft 12 ms", "cached 5/9 tokens")
    bar.clear_result()
    assert bar.speed.text() == "– tok/s"
    bar.show_status(status_reading(parked_entries=1, parked_bytes=1 << 20))
    assert bar.parked.text().startswith("parked 1 ·") and "8.0 of 16.0 GiB free" in bar.memory.text()
    bar.show_server({"running": False, "error": "port 1 in use"})
    assert bar.server.text() == "server off" and bar.server.toolTip() == "port 1 in use"


# ---- the session controller ----------------------------------------------------------------------------
def test_session_files_opened_before_a_model_wait_for_it(qapp_ready, idle_window, tmp_path):
    """open_file of a session before any model is queued; the load opens it (restore asked of the client)."""
    from fake_engine import FakeClient
    w = idle_window
    fake = FakeClient()
    w.sessions.client = fake
    told = []
    w.sessions.tell = lambda text, *a: told.append(text)
    session = tmp_path / "a.stratasession"
    w.sessions.open_file(str(session))
    assert w.sessions.pending_files == [str(session)] and fake.calls == []
    w.sessions.open_file(str(tmp_path / "notes.txt"))
    assert told and "notes.txt: Strata opens .stratasession sessions and .gguf models" in told[-1]
    w.library.model_path = "loaded.gguf"
    w.library.loaded.emit("loaded.gguf")
    assert w.sessions.pending_files == [] and fake.names() == ["restore_session"]
    assert fake.calls[0][1] == (str(session),)


def test_a_refused_restore_offers_the_vector_by_its_reason_not_its_words(qtbot, qapp_ready, idle_window, tmp_path):
    """The vector offer follows the refusal's code and reason (SessionRefusal.STEERING) and the vector
    it carries as data (engine.errors.VectorSpec): a file refusal whose message happens to say "control
    vector ... load" offers nothing, and a steering refusal's offer asks nothing more of the engine."""
    from fake_engine import FakeClient
    from engine.errors import ErrorCode, SessionRefusal, VectorSpec
    w = idle_window
    fake = FakeClient()
    w.sessions.client = fake
    offers = []
    w.sessions.tell = lambda message, action=None, *a: offers.append(action)
    session = str(tmp_path / "a.stratasession")
    here = tmp_path / "v.gguf"
    here.write_bytes(b"GGUF")
    vector = VectorSpec(((str(here), 0.5),), (2, 5), "project", "per-layer")
    wording = "a.stratasession was saved with another steering setting (control vector ab12); load v.gguf"
    fake.answers["restore_session"] = Refusal(wording, ErrorCode.SESSION_REFUSED, SessionRefusal.FILE, vector)
    with qtbot.waitSignal(w.sessions.refused, timeout=5000):
        w.sessions.restore_session(session)
    assert fake.names() == ["restore_session"] and offers == [None]
    fake.answers["restore_session"] = Refusal("saved with another steering setting", ErrorCode.SESSION_REFUSED,
                                              SessionRefusal.STEERING, vector)
    with qtbot.waitSignal(w.sessions.refused, timeout=5000):
        w.sessions.restore_session(session)
    assert fake.names() == ["restore_session", "restore_session"]       # the file is not asked again
    assert offers[1:] == [None, "Load it and restore"]
    gone = VectorSpec(((str(tmp_path / "elsewhere.gguf"), 1.0),))
    fake.answers["restore_session"] = Refusal("saved with another steering setting", ErrorCode.SESSION_REFUSED,
                                              SessionRefusal.STEERING, gone)
    with qtbot.waitSignal(w.sessions.refused, timeout=5000):
        w.sessions.restore_session(session)
    assert offers[3:] == [None]                 # its file is not on this machine: nothing to offer
