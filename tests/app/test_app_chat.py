"""The chat window on the real engine with a tiny GGUF: streaming, titles, parking, latency, restart."""
from __future__ import annotations

import os

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

import pytest  # noqa: E402
from PySide6.QtCore import QTimer  # noqa: E402

from app_fixtures import REPLY_TIMEOUT_MS, open_window, send_and_wait  # noqa: E402

pytestmark = pytest.mark.gui


def test_app_send_streams_reply(qtbot, window):
    view = window.current_view()
    tokens: list[str] = []
    view.client  # the real EngineClient
    with qtbot.waitSignal(view.stats, timeout=REPLY_TIMEOUT_MS) as blocker:
        view.input.setPlainText("Hello there")
        view.send_input()
        assert view.busy and view.stop_btn.isEnabled() and not view.send_btn.isEnabled()
        view.request.token.connect(tokens.append)
    result = blocker.args[0]
    assert result.generated_tokens >= 1
    assert len(tokens) >= 1 and "".join(tokens) == result.text
    assert view.chat.messages[-2] == {"role": "user", "content": "Hello there"}
    assert view.chat.messages[-1] == {"role": "assistant", "content": result.text}
    text = view.transcript_text()
    assert "Hello there" in text and "Assistant" in text
    assert "tok/s" in window.status.speed.text() and "ttft" in window.status.ttft.text()
    assert not view.busy and view.regen_btn.isEnabled()


def test_app_enter_sends_shift_enter_newline(qtbot, window):
    from PySide6.QtCore import Qt
    view = window.current_view()
    qtbot.keyClicks(view.input, "line one")
    qtbot.keyClick(view.input, Qt.Key.Key_Return, Qt.KeyboardModifier.ShiftModifier)
    qtbot.keyClicks(view.input, "line two")
    assert view.input.toPlainText() == "line one\nline two"
    with qtbot.waitSignal(view.stats, timeout=REPLY_TIMEOUT_MS):
        qtbot.keyClick(view.input, Qt.Key.Key_Return)
    assert view.chat.messages[0]["content"] == "line one\nline two"


def test_app_regenerate_and_edit_resend(qtbot, window):
    view = window.current_view()
    send_and_wait(qtbot, view, "first question")
    send_and_wait(qtbot, view, "second question")
    assert len(view.chat.messages) == 4
    with qtbot.waitSignal(view.stats, timeout=REPLY_TIMEOUT_MS):
        view.regenerate()
    assert len(view.chat.messages) == 4 and view.chat.messages[2]["content"] == "second question"
    view.edit(0)
    assert view.input.toPlainText() == "first question" and view.edit_banner.isVisible()
    send_and_wait(qtbot, view, "first question, edited")
    assert [m["role"] for m in view.chat.messages] == ["user", "assistant"]
    assert view.chat.messages[0]["content"] == "first question, edited"


def test_app_two_tabs_title_then_cached_tokens(qtbot, window):
    first = window.current_view()
    with qtbot.waitSignal(first.title_changed, timeout=REPLY_TIMEOUT_MS):
        send_and_wait(qtbot, first, "Tell me about the sea")
    assert first.chat.title != "New chat"
    assert window.tabs.tabText(window.tabs.indexOf(first)) != "New chat"

    second = window.new_tab()
    assert window.tabs.count() == 2 and window.current_view() is second
    with qtbot.waitSignal(second.title_changed, timeout=REPLY_TIMEOUT_MS):
        send_and_wait(qtbot, second, "Something else entirely")

    window.tabs.setCurrentWidget(first)
    result = send_and_wait(qtbot, first, "And more?")
    # The title calls and the other tab parked this conversation; it resumes from the cache.
    assert result.cached_tokens > 0, result
    assert f"cached {result.cached_tokens}/" in window.status.cached.text()
    with qtbot.waitSignal(window.status_updated, timeout=REPLY_TIMEOUT_MS):
        pass
    assert "parked" in window.status.parked.text() and "MiB" in window.status.parked.text()


def test_app_event_loop_answers_during_generation(qtbot, window):
    """The window's timers keep firing while a long reply streams: a 10 ms probe timer, counted while
    the tokens arrive. Counts, not milliseconds: an event loop that waited on the engine would fire it
    once or never during the reply, whatever the machine's speed; how long its gaps are is measured by
    bench/event_loop.py (a loaded machine must not fail the suite). Greedy: at temperature 0.8 the tiny
    random model ends some replies by EOS within 20 tokens, and the probe needs a long one."""
    window.settings.sampling.max_tokens = 200
    window.settings.sampling.temperature = 0.0
    view = window.current_view()
    events: list[str] = []
    probe = QTimer(interval=10)
    probe.timeout.connect(lambda: events.append("tick"))
    probe.start()
    try:
        with qtbot.waitSignal(view.stats, timeout=REPLY_TIMEOUT_MS) as blocker:
            view.input.setPlainText("Write a long story about a lighthouse keeper")
            view.send_input()
            view.request.token.connect(lambda _t: events.append("token"))
    finally:
        probe.stop()
    result = blocker.args[0]
    assert result.generated_tokens >= 20
    first, last = events.index("token"), len(events) - 1 - events[::-1].index("token")
    streaming = events[first:last]
    # The probe fired between the tokens: in the stretch of the reply itself, several times, and in
    # several separate gaps between tokens (not once, late, in a burst).
    ticks = streaming.count("tick")
    runs = sum(1 for a, b in zip(streaming, streaming[1:]) if a == "token" and b == "tick")
    assert ticks >= 3 and runs >= 2, (ticks, runs, result.generated_tokens)


def test_app_restart_restores_tabs(qtbot, window):
    view = window.current_view()
    send_and_wait(qtbot, view, "remember me")
    second = window.new_tab()
    second.set_title("Second chat")
    window.tabs.tabBar().moveTab(1, 0)          # reorder: the second chat first
    messages = list(view.chat.messages)
    window.close()

    again = open_window(qtbot)
    try:
        assert again.tabs.count() == 2
        titles = [v.chat.title for v in again.views()]
        assert titles[0] == "Second chat"
        restored = again.views()[1]
        assert restored.chat.messages == messages
        assert "remember me" in restored.transcript_text()
    finally:
        again.close()


def test_app_keyboard_new_and_close_tab(qtbot, window):
    from PySide6.QtCore import Qt
    n = window.tabs.count()
    qtbot.keyClick(window, Qt.Key.Key_T, Qt.KeyboardModifier.ControlModifier)
    assert window.tabs.count() == n + 1
    qtbot.keyClick(window, Qt.Key.Key_W, Qt.KeyboardModifier.ControlModifier)
    assert window.tabs.count() == n
    assert window.tabs.isMovable()


def test_app_markdown_code_block_has_copy_link(qtbot, window):
    from PySide6.QtCore import QUrl
    from PySide6.QtGui import QGuiApplication
    view = window.current_view()
    view.chat.messages = [{"role": "user", "content": "code?"},
                          {"role": "assistant", "content": "Here:\n```python\nprint('hi')\n```\n**done**"}]
    view.render_all()
    html = view.transcript.toHtml()
    assert "Copy code" in view.transcript_text() and "print" in view.transcript_text()
    assert "font-weight" in html                       # Markdown bold, Pygments spans
    view._on_anchor(QUrl("copycode:0"))
    assert QGuiApplication.clipboard().text() == "print('hi')"
