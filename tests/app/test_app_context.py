"""The context meter and the overflow policies in the window, on the real engine with the tiny GGUF and a
config of a tiny context: the meter's figures are the engine's CountTokens, it warns before a send that
would overflow, and each policy goes on past the context (the next turn's cached tokens showing the K/V
reuse) or stops with a note, keeping the replies."""
from __future__ import annotations

import os

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

import pytest  # noqa: E402

from app_fixtures import REPLY_TIMEOUT_MS, send_and_wait  # noqa: E402
from engine.text.context_policy import reply_reserve  # noqa: E402

pytestmark = pytest.mark.gui

GREEDY = dict(temperature=0.0, top_p=1.0, top_k=0, min_p=0.0, repetition_penalty=1.0)
SYSTEM = "Be brief."
CONTEXT = 200
MAX_TOKENS = 8


def count(qtbot, window, messages):
    req = window.client.count_prompt_tokens(messages)
    with qtbot.waitSignal(req.done, timeout=REPLY_TIMEOUT_MS) as blocker:
        pass
    return blocker.args[0]


def reading(qtbot, view):
    """The meter's reading once its count (asked now) is answered."""
    with qtbot.waitSignal(view.counter.counted, timeout=REPLY_TIMEOUT_MS) as blocker:
        view.counter.count_now()
    assert view.meter.reading == blocker.args[0]
    return blocker.args[0]


def tiny_tab(window, policy: str, context: int = CONTEXT, **kw):
    p = window.presets.create(f"Tiny {policy}", system_prompt=SYSTEM, context_length=context,
                              max_tokens=MAX_TOKENS, **GREEDY, **kw)
    view = window.new_tab(preset_id=p.id)
    view.set_overflow(policy)
    return view


def question(i: int) -> str:
    return f"Tell me about the tea harvest number {i}, please, in a few words."


def test_meter_is_the_engines_count(qtbot, window):
    view = window.current_view()
    n_ctx = window.library.n_ctx
    assert n_ctx > 0 and view.model_context == n_ctx
    send_and_wait(qtbot, view, "Hello there")
    r = reading(qtbot, view)
    c = count(qtbot, window, view.request_messages())
    assert (r.total, r.system, r.n_ctx) == (c.tokens, c.system_tokens, n_ctx)
    assert 0 < r.system < r.total and not r.drafted
    assert r.reserve == reply_reserve(view.preset.max_tokens, n_ctx)
    assert view.meter.label.text() == f"Context {r.total + r.reserve:,} / {n_ctx:,}"
    tip = view.meter.toolTip()
    assert f"System prompt: {r.system:,} tokens" in tip and f"Reply reserve (max tokens): {r.reserve:,}" in tip
    # The message being typed counts too (what the next send asks for)
    view.input.setPlainText("And one more question about the weather")
    typed = reading(qtbot, view)
    c2 = count(qtbot, window, view.request_messages() + [
        {"role": "user", "content": "And one more question about the weather"}])
    assert typed.drafted and typed.total == c2.tokens > r.total
    # A config with a smaller context: the meter counts against it
    small = window.presets.create("Small", system_prompt=SYSTEM, context_length=64, max_tokens=16)
    view.set_preset(small.id)
    r3 = reading(qtbot, view)
    assert r3.n_ctx == 64 and r3.reserve == 16
    assert "Too long to send" in view.meter.warning_text()        # the warning, before any send


ROOMY = 480          # a context a page of which (a quarter) holds a few turns, as a real chat's does


@pytest.mark.parametrize("policy", ["rolling", "truncate_middle"])
def test_a_dropping_policy_goes_on_and_reuses_the_kv(qtbot, window, policy):
    """Past the context the chat goes on; the status bar's cached figure shows the whole previous
    prompt reused while the cut stays, the pinned head when it moves, which happens once a page (a few
    turns), never two turns running."""
    view = tiny_tab(window, policy, context=ROOMY)
    results = []
    for i in range(26):
        view.input.setPlainText(question(i))
        if not any(res.dropped_messages for res in results):
            r = reading(qtbot, view)
            if r.over > 0:          # the warning comes before the send that overflows
                assert "will be left out" in view.meter.warning_text()
        results.append(send_and_wait(qtbot, view, question(i)))
        assert f"cached {results[-1].cached_tokens}/{results[-1].prompt_tokens} tokens" in window.status.cached.text()
    dropping = [i for i, res in enumerate(results) if res.dropped_messages]
    assert len(dropping) >= 8, [res.prompt_tokens for res in results]
    assert all(res.prompt_tokens + MAX_TOKENS <= ROOMY for res in results)
    assert len(view.chat.messages) == 52                        # every turn kept in the chat
    assert any("earlier messages were left out of the prompt" in n for n in view.notes)
    # what the policy never drops (the system prompt; truncate_middle: the first exchange too), less
    # the generation prompt's few tokens
    pinned = view.request_messages(view.chat.messages[:0 if policy == "rolling" else 2])
    head = count(qtbot, window, pinned).tokens - 8
    reread = []
    for i in dropping[1:]:
        a, b = results[i - 1], results[i]
        if a.dropped_messages == b.dropped_messages:
            assert b.cached_tokens >= a.prompt_tokens, (i, a, b)   # the whole previous prompt (and reply)
        else:
            assert b.cached_tokens >= head, (i, head, b)           # the kept prefix, the rest read once
            reread.append(i)
    assert len(reread) <= len(dropping) // 3, ([res.dropped_messages for res in results], reread)
    assert all(j - i > 1 for i, j in zip(reread, reread[1:]))


def test_stop_keeps_the_replies_and_says_so(qtbot, window):
    view = tiny_tab(window, "stop")
    warned = False
    for i in range(14):
        view.input.setPlainText(question(i))
        r = reading(qtbot, view)
        warned = warned or bool(view.meter.warning_text())
        if r.total >= CONTEXT:
            with qtbot.waitSignal(view.message, timeout=REPLY_TIMEOUT_MS) as blocker:
                view.send_input()
            assert "Generation failed" in blocker.args[0]
            break
        send_and_wait(qtbot, view, question(i))
    else:
        pytest.fail("the chat never outgrew its context")
    assert warned and "Not sent: the prompt is" in view.transcript_text()
    assert sum(m["role"] == "assistant" for m in view.chat.messages) == i         # the replies are kept
    assert not view.busy and view.send_btn.isEnabled()


def test_stop_at_the_end_of_the_context_keeps_the_reply(qtbot, window):
    """A reply that reaches the end of the context stops there, is kept, and the note says why."""
    ask = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question(0)}]
    n = count(qtbot, window, ask).tokens
    p = window.presets.create("Edge", system_prompt=SYSTEM, context_length=n + 3, max_tokens=50, **GREEDY)
    view = window.new_tab(preset_id=p.id)
    r = send_and_wait(qtbot, view, question(0))
    assert r.prompt_tokens == n and r.generated_tokens == 3 and r.finish_reason == "length"
    assert view.chat.messages[-1]["role"] == "assistant"
    assert any(note.startswith("The reply stopped at the token limit of the context") for note in view.notes)


def test_policy_default_from_settings_and_per_chat(qtbot, window):
    view = window.current_view()
    assert view.overflow == "stop" and view.meter.policy_box.currentData() == "stop"
    window.settings.set("overflow", "rolling")
    assert view.overflow == "rolling"                           # a chat without its own follows the default
    fresh = window.new_tab()
    assert fresh.meter.policy_box.currentData() == "rolling"
    i = view.meter.policy_box.findData("truncate_middle")
    view.meter.policy_box.setCurrentIndex(i)
    view.meter.policy_box.activated.emit(i)
    assert view.chat.config["overflow"] == "truncate_middle"
    stored = next(c for c in window.store.chats() if c.id == view.chat.id)
    assert stored.config["overflow"] == "truncate_middle"


def test_settings_page_sets_the_default_policy(qtbot, idle_window, app_home):
    """The Settings page's "When a chat is full" is the default of every chat without its own policy
    (an open chat's meter follows at once); a hand-edited value loads as the default policy."""
    from PySide6.QtCore import QSettings

    from app import settings
    window = idle_window
    view = window.current_view()
    page = window.open_settings()
    assert page.overflow.currentData() == "stop"
    page.overflow.setCurrentIndex(page.overflow.findData("truncate_middle"))
    with qtbot.waitSignal(window.settings.changed, timeout=REPLY_TIMEOUT_MS,
                          check_params_cb=lambda key: key == "overflow"):
        page.submit()
    assert settings.load().overflow == "truncate_middle"
    assert view.overflow == "truncate_middle" and view.meter.policy == "truncate_middle"
    q = QSettings(str(app_home / "settings.ini"), QSettings.Format.IniFormat)
    q.setValue("app/overflow", "middle-out")
    q.sync()                            # a hand-edited value the engine would refuse: the default instead
    assert settings.load().overflow == "stop"
