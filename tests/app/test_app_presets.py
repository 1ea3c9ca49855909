"""Configs (presets) on the real engine with the tiny GGUF: a tab's config decides its system prompt,
sampling and context; create/rename/duplicate/delete; everything survives a restart."""
from __future__ import annotations

import os

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

import pytest  # noqa: E402

from app_fixtures import REPLY_TIMEOUT_MS, open_window, send_and_wait  # noqa: E402

pytestmark = pytest.mark.gui

PIRATE = ("You are a pirate captain. Answer every question in the voice of an old sea dog, "
          "with nautical words, and never break character.")
GREEDY = dict(temperature=0.0, top_p=1.0, top_k=0, min_p=0.0, repetition_penalty=1.0)


def count_tokens(qtbot, window, messages) -> int:
    req = window.client.count_prompt_tokens(messages)
    with qtbot.waitSignal(req.done, timeout=REPLY_TIMEOUT_MS) as blocker:
        pass
    return blocker.args[0].tokens


def test_app_preset_prompt_and_sampling_reach_the_engine(qtbot, window):
    presets = window.presets
    assert [p.name for p in presets.all()] == ["Default"]
    default_view = window.current_view()
    assert default_view.preset.name == "Default" and default_view.chat.config["preset"] == "default"
    r0 = send_and_wait(qtbot, default_view, "Hello")

    p = presets.create("Pirate", system_prompt=PIRATE, max_tokens=7, **GREEDY)
    view = window.new_tab(preset_id=p.id)
    assert view.preset_box.currentText() == "Pirate" and view.chat.config["preset"] == p.id
    r1 = send_and_wait(qtbot, view, "Hello")
    assert r1.generated_tokens == 7 and r1.finish_reason == "length", r1
    # The prompt is the config's system prompt + the message, token for token, and longer than Default's.
    assert r1.prompt_tokens == count_tokens(qtbot, window, [{"role": "system", "content": PIRATE},
                                                               {"role": "user", "content": "Hello"}])
    assert r0.prompt_tokens == count_tokens(qtbot, window, [
        {"role": "system", "content": "You are a helpful assistant."}, {"role": "user", "content": "Hello"}])
    assert r1.prompt_tokens - r0.prompt_tokens >= 15
    # Temperature 0: regenerating gives the same reply.
    with qtbot.waitSignal(view.stats, timeout=REPLY_TIMEOUT_MS) as again:
        view.regenerate()
    assert again.args[0].text == r1.text and again.args[0].tokens == r1.tokens

    # Switch the Default tab to Pirate from its own combo box: its next request uses the config.
    i = default_view.preset_box.findData(p.id)
    default_view.preset_box.setCurrentIndex(i)
    default_view.preset_box.activated.emit(i)
    assert default_view.chat.config["preset"] == p.id
    r2 = send_and_wait(qtbot, default_view, "Where is the treasure?")
    assert r2.generated_tokens == 7
    assert window.store.chats()[0].config["preset"] == p.id            # persisted with the tab


def test_app_preset_context_length(qtbot, window):
    n = count_tokens(qtbot, window, [{"role": "system", "content": "Be brief."},
                                     {"role": "user", "content": "Count to ten"}])
    p = window.presets.create("Small", system_prompt="Be brief.", context_length=n + 3, max_tokens=50, **GREEDY)
    view = window.new_tab(preset_id=p.id)
    r = send_and_wait(qtbot, view, "Count to ten")
    assert r.prompt_tokens == n and r.generated_tokens <= 3       # capped to what the context holds

    tight = window.presets.create("Tiny", system_prompt="Be brief.", context_length=n - 1)
    view.set_preset(tight.id)
    with qtbot.waitSignal(view.message, timeout=REPLY_TIMEOUT_MS) as blocker:
        view.input.setPlainText("Count to ten")
        view.send_input()
    assert "Generation failed" in blocker.args[0] and "holds" in blocker.args[0]
    assert "Not sent: the prompt is" in view.transcript_text()
    assert not view.busy and view.send_btn.isEnabled()


def test_app_presets_crud_and_restart(qtbot, idle_window):
    """The configs and the tabs using them, across a restart: no engine needed (idle_window)."""
    window = idle_window
    pane, presets = window.preset_pane, window.presets
    a = pane.new_preset()
    assert a.name == "Config" and pane.current_id() == a.id
    pane.rename_selected("Coder")
    assert presets.get(a.id).name == "Coder"
    pane.rename_selected("default")                            # names are unique (case-insensitive)
    assert "already a config named" in pane.error.text() and presets.get(a.id).name == "Coder"
    dlg = pane.edit_selected()
    dlg.sampling_form.system_prompt.setPlainText("You write Python.")
    dlg.sampling_form.temperature.setValue(0.0)
    dlg.sampling_form.max_tokens.setValue(5)
    dlg.sampling_form.context_length.setValue(1024)
    dlg.speed.setChecked(False)
    dlg.submit()
    assert not dlg.isVisible()
    b = pane.duplicate_selected()
    assert b.name == "Coder copy" and b.system_prompt == "You write Python." and b.max_tokens == 5
    pane.select("default")
    assert not pane.rename_btn.isEnabled() and not pane.delete_btn.isEnabled()
    with pytest.raises(ValueError):
        presets.delete("default")
    with pytest.raises(ValueError):
        presets.rename("default", "Other")

    # A tab created while "Coder" is selected uses it, with its speed projection default.
    pane.select(a.id)
    coder_tab = window.new_tab()
    assert coder_tab.chat.config["preset"] == a.id and not coder_tab.projection.isChecked()
    doomed_tab = window.new_tab(preset_id=b.id)
    assert doomed_tab.preset_box.count() == 3
    pane.select(b.id)
    pane.delete_selected(confirm=False)
    assert [p.name for p in presets.all()] == ["Default", "Coder"]
    assert doomed_tab.preset.name == "Default" and doomed_tab.preset_box.currentText() == "Default"
    assert doomed_tab.chat.config["preset"] == "default"

    # Editing Default edits the settings' sampling defaults.
    pane.select("default")
    d = pane.edit_selected()
    assert not d.name.isEnabled()
    d.sampling_form.system_prompt.setPlainText("Default prompt")
    d.submit()
    from app import settings
    assert settings.load().sampling.system_prompt == "Default prompt"
    window.close()

    again = open_window(qtbot, start_engine=False)
    try:
        coder = again.presets.find(a.id)
        assert coder is not None and coder.name == "Coder"
        assert (coder.system_prompt, coder.temperature, coder.max_tokens, coder.context_length,
                coder.speed_projection) == ("You write Python.", 0.0, 5, 1024, False)
        assert again.presets.default().system_prompt == "Default prompt"
        views = {v.chat.id: v for v in again.views()}
        assert views[coder_tab.chat.id].preset_box.currentText() == "Coder"
        assert views[coder_tab.chat.id].request_messages()[0] == {"role": "system", "content": "You write Python."}
        assert views[doomed_tab.chat.id].preset.id == "default"
        assert [again.preset_pane.list.item(i).text() for i in range(again.preset_pane.list.count())] == \
            ["Default", "Coder"]
    finally:
        again.close()
