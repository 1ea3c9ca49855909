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
