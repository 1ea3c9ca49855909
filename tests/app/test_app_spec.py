"""A config's speculative decoding setting (issue 15) reaches the engine; the status bar shows the
drafts accepted. Real engine, tiny GGUF."""
from __future__ import annotations

import os

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

import pytest  # noqa: E402

from app_fixtures import send_and_wait  # noqa: E402

pytestmark = pytest.mark.gui

GREEDY = dict(temperature=0.0, top_p=1.0, top_k=0, min_p=0.0, repetition_penalty=1.0, max_tokens=24)
TEXT = "the cat sat on the mat and the dog sat on the log " * 4


def test_config_speculative_setting_reaches_the_engine(qtbot, window):
    from app.presets import Preset, PresetDialog
    presets = window.presets
    plain = presets.create("Plain", **GREEDY)
    spec = presets.create("Lookup", speculative="lookup", **GREEDY)
    assert presets.get(spec.id).speculative == "lookup" and presets.get(plain.id).speculative == "off"
    r0 = send_and_wait(qtbot, window.new_tab(preset_id=plain.id), TEXT)
    r1 = send_and_wait(qtbot, window.new_tab(preset_id=spec.id), TEXT)
    assert r0.speculative == "off" and r1.speculative == "lookup"
    assert r1.tokens == r0.tokens                  # greedy: the same reply
    assert f"{r1.accepted_tokens}/{r1.drafted_tokens} drafts accepted" in window.status.speed.text()
    # the dialog shows and edits the setting
    dlg = PresetDialog(presets, presets.get(spec.id))
    assert dlg.spec.currentData() == "lookup"
    dlg.spec.setCurrentIndex(dlg.spec.findData("off"))
    assert dlg.values().speculative == "off"
    assert Preset.from_data("x", "y", {"speculative": "lookup"}).speculative == "lookup"


# ---- a draft model (issue 15): the tiny model as its own draft (same vocabulary) ------------------------
def test_a_config_with_a_draft_model_drafts_and_the_status_bar_shows_it(qtbot, window, tiny_model, monkeypatch):
    # On a tiny model drafting never pays: the "never slower" rules (tested in tests/engine/test_speculative.py
    # and by the slower-draft journey) would rightly keep the draft from reading the prompt; this journey
    # is about the config and the status bar, so they are off here.
    from engine.generation import speculative
    monkeypatch.setattr(speculative, "REMEMBER", False)
    monkeypatch.setattr(speculative, "CATCH_UP_RULE", False)
    presets = window.presets
    cfg = presets.create("Drafted", speculative=f"draft:{window.library.model_path}", **GREEDY)
    plain = presets.create("Plain", **GREEDY)
    r0 = send_and_wait(qtbot, window.new_tab(preset_id=plain.id), TEXT)
    view = window.new_tab(preset_id=cfg.id)
    r1 = send_and_wait(qtbot, view, TEXT)
    assert r1.speculative == f"draft:{window.library.model_path}" and r1.drafted_tokens > 0
    assert r1.tokens == r0.tokens                        # greedy: the draft changes the speed, not the reply
    assert f"{r1.accepted_tokens}/{r1.drafted_tokens} drafts accepted" in window.status.speed.text()


def test_a_refused_draft_model_shows_the_engines_reason_in_the_chat(qtbot, window, monkeypatch):
    """A draft with another vocabulary is refused by the engine by name; the chat says so as it does
    for any failed request. (Every tiny model shares one vocabulary: the engine's hash is made to differ.)"""
    import itertools

    from engine.generation import speculative
    counter = itertools.count()
    monkeypatch.setattr(speculative, "vocab_hash", lambda _g: str(next(counter)))
    cfg = window.presets.create("Bad draft", speculative=f"draft:{window.library.model_path}", **GREEDY)
    view = window.new_tab(preset_id=cfg.id)
    with qtbot.waitSignal(view.message, timeout=60_000) as blocker:
        view.input.setPlainText("hello")
        view.send_input()
    note = blocker.args[0]
    name = window.library.model_path.rsplit("/", 1)[-1]
    assert note.startswith(f"Generation failed: draft model {name} has another vocabulary"), note


# ---- K/V cache precision (issue 15) ---------------------------------------------------------------------
def engine_status(qtbot, window):
    req = window.client.status()
    with qtbot.waitSignal(req.done, timeout=30_000) as blocker:
        pass
    return blocker.args[0]


def test_8bit_kv_set_in_settings_serves_a_chat_and_holds_at_the_next_launch(qtbot, wide_home):
    from app_fixtures import LOAD_TIMEOUT_MS, open_window

    from app import settings
    w = open_window(qtbot)
    with qtbot.waitSignal(w.library.loaded, timeout=LOAD_TIMEOUT_MS):
        w.show()
    assert engine_status(qtbot, w).kv_bits == 16
    page = w.open_settings()
    page.kv_bits.setCurrentIndex(page.kv_bits.findData(8))
    with qtbot.waitSignal(page.saved, timeout=30_000):
        page.submit()
    assert settings.load().kv_bits == 8 and w.settings.kv_bits == 8
    r = send_and_wait(qtbot, w.new_tab(), "Say something.")
    assert r.generated_tokens > 0
    assert engine_status(qtbot, w).kv_bits == 8
    w.close()
    # the next launch starts the engine with it
    w2 = open_window(qtbot)
    with qtbot.waitSignal(w2.library.loaded, timeout=LOAD_TIMEOUT_MS):
        w2.show()
    assert engine_status(qtbot, w2).kv_bits == 8
    assert send_and_wait(qtbot, w2.new_tab(), "Again.").generated_tokens > 0
    w2.close()


def test_kv_bits_the_model_cannot_take_are_refused_on_the_settings_page(qtbot, window):
    """The app's tiny model has head size 16: the engine refuses 8-bit K/V and the page shows its line."""
    from app import settings
    page = window.open_settings()
    page.kv_bits.setCurrentIndex(page.kv_bits.findData(8))
    page.submit()
    qtbot.waitUntil(page.error.isVisible, timeout=30_000)
    assert page.error.text() == ("Not saved: 8-bit K/V needs a head size that is a multiple of 32 "
                                 "(this model's is 16)")
    assert settings.load().kv_bits == 16 and engine_status(qtbot, window).kv_bits == 16
    page.reject()
