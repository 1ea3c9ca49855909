"""The reply flow around the user's own requests: titles come after the user's replies (cancelled when
the user sends, asked once per chat, never for a stopped reply, short noun phrases), a stop before the
first token leaves the chat as it was (a Regenerate's previous reply back, the status bar's streaming
figures gone), and a prompt being read shows the time left. Journeys drive the real engine on the tiny
GGUF; widget tests use tests/fake_engine.py where the engine adds nothing."""
from __future__ import annotations

import os

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

import pytest  # noqa: E402
from PySide6.QtGui import QAction  # noqa: E402

from app_fixtures import REPLY_TIMEOUT_MS, send_and_wait  # noqa: E402
from engine.api import Generation  # noqa: E402

pytestmark = pytest.mark.gui


def fake_view(idle_window, fake_client):
    """A chat view of the real window's configs on the fake engine (its own title queue)."""
    from app.chat_view import ChatView
    from app.store import Chat
    view = ChatView(Chat(), fake_client, idle_window.presets)
    return view


def replies(answer_reply, answer_title="Facts about the sea"):
    """FakeClient's generate answer: `answer_reply` for the chat's replies, `answer_title` for titles."""
    def answer(messages, sampling, conversation="", **kw):
        if kw.get("side"):
            return Generation(text=answer_title, finish_reason="stop")
        return answer_reply() if callable(answer_reply) else answer_reply
    return answer


def titles_asked(fake_client) -> int:
    return sum(1 for name, _a, kw in fake_client.calls if name == "generate" and kw.get("side"))


# ---- titles: what is asked and what is kept ------------------------------------------------------------

@pytest.mark.parametrize("said, title", [
    ("I'm ready to assist you. What's", ""),                     # a reply, not a title: the question names it
    ("Sure! Here is a title:\n\"Python Learning Tips\"", "Python Learning Tips"),
    ("Title: The Sea and Its Creatures.", "The Sea and Its Creatures"),
    ("Certainly! Python tips for beginners. Hope it helps", "Python tips for beginners"),
    ("Here's a short title for this conversation\nOcean facts", "Ocean facts"),
    ("**Lighthouse keeper story**", "Lighthouse keeper story"),
    ("one two three four five six seven eight", "One two three four five six"),
    # SmolLM2-135M's answers (the default model, on this prompt and the old one)
    ("1. Python learning tips: 1. Practice every day. 2.", "Python learning tips"),
    ("The sea is a vast and mysterious place, full of wonders and wonders.", "The sea"),
    ("The Lone Lighthouse: A tale of solitude and the unforgiving beauty of", "The Lone Lighthouse"),
    ("The lighthouse keeper's a lonely soul, but they're a loyal one.", "The lighthouse keeper"),
    ("How to make a cup of coffee", "How to make a cup"),
    ("What is recursion", "What is recursion"),
    ("", ""),
])
def test_a_title_is_a_short_phrase_without_a_sentence_start(said, title):
    from app.titles import clean_title
    assert clean_title(said) == title


def test_a_title_that_names_another_conversation_gives_way_to_the_question():
    """SmolLM2-135M answered "How to make a cup of coffee" for a chat that said Hello; a small model
    may also copy the prompt's worked example."""
    from app.titles import EXAMPLE, title_for
    assert title_for("How to make a cup of coffee", "Hello", "Hello! How can I help you today?") == "Hello"
    assert title_for(EXAMPLE[1], "Tell me about the sea", "The sea is wide.") == "The sea"
    assert title_for("1. Python for beginners", "Give me three tips for learning Python.",
                     "1. Practice every day.") == "Python for beginners"
    assert title_for("Lighthouse keeper, a tale of solitude and resilience.",
                     "Write a short story about a lighthouse keeper", "Once upon a time...") == "Lighthouse keeper"


def test_a_title_from_the_question_drops_its_polite_opening():
    from app.titles import fallback_title
    assert fallback_title("Give me three tips for learning Python.") == "Three tips for learning Python"
    assert fallback_title("Can you please explain recursion?") == "Explain recursion"
    assert fallback_title("hi") == "Hi"


def test_the_title_request_states_the_shape_and_length_it_wants(qtbot, idle_window, fake_client):
    from app.titles import TITLE_MAX_TOKENS
    view = fake_view(idle_window, fake_client)
    fake_client.answers["generate"] = replies(Generation(text="The sea is wide.", finish_reason="stop"),
                                              "I'm ready to assist you. What's")
    with qtbot.waitSignal(view.title_changed, timeout=5000) as blocker:
        view.input.setPlainText("Tell me about the sea")
        view.send_input()
    # the model answered with a sentence about itself: the question names the chat instead
    assert blocker.args[0] == "The sea"
    (messages, sampling), kw = next((a, k) for n, a, k in fake_client.calls if n == "generate" and k.get("side"))
    assert "noun phrase of 2 to 5 words" in messages[0]["content"] and "Tell me about the sea" in messages[-1]["content"]
    # a worked example first; the task in a user turn (some templates refuse a system role)
    assert [m["role"] for m in messages] == ["user", "assistant", "user"]
    assert sampling["max_tokens"] == TITLE_MAX_TOKENS and sampling["temperature"] == 0.0
    assert kw["speed_projection"] is False


def test_a_stopped_reply_asks_no_title_and_a_chat_is_titled_once(qtbot, idle_window, fake_client):
    view = fake_view(idle_window, fake_client)
    fake_client.answers["generate"] = replies(Generation(text="The sea is", finish_reason="cancelled"))
    with qtbot.waitSignal(view.stats, timeout=5000):
        view.input.setPlainText("Tell me about the sea")
        view.send_input()
    qtbot.wait(50)
    assert titles_asked(fake_client) == 0 and view.chat.title == "New chat"     # stopped: no title
    fake_client.answers["generate"] = replies(Generation(text="The sea is wide.", finish_reason="stop"))
    with qtbot.waitSignal(view.title_changed, timeout=5000):
        view.regenerate()
    assert view.chat.title == "Facts about the sea" and titles_asked(fake_client) == 1
    for ask in (view.regenerate, lambda: view.send("And rivers?")):
        with qtbot.waitSignal(view.stats, timeout=5000):
            ask()
        qtbot.wait(50)
    assert titles_asked(fake_client) == 1                          # once per chat


def test_a_failed_reply_asks_no_title(qtbot, idle_window, fake_client):
    from fake_engine import Refusal
    view = fake_view(idle_window, fake_client)
    fake_client.answers["generate"] = replies(Refusal("out of memory"))
    view.send("Tell me about the sea")
    qtbot.waitUntil(lambda: not view.busy, timeout=5000)
    qtbot.wait(50)
    assert titles_asked(fake_client) == 0 and view.chat.title == "New chat"


class HeldClient:
    """The fake engine, except that the chat's replies are answered when the test says (`end`)."""

    def __init__(self, fake_client):
        self.fake = fake_client
        self.held = []

    def __getattr__(self, name):
        return getattr(self.fake, name)

    def generate(self, messages, sampling, conversation="", **kw):
        if kw.get("side"):
            return self.fake.generate(messages, sampling, conversation=conversation, **kw)
        from app.engine_thread import Request
        self.held.append(Request("generate"))
        return self.held[-1]

    def end(self, text: str) -> None:
        req = self.held.pop(0)
        req.done.emit(Generation(text=text, finish_reason="stop"))
        req.finished.emit()


def _two_chats(window, fake_client):
    """Two chats sharing one title queue: `a` answered at once, `b` on a client whose replies are held."""
    from app.chat_view import ChatView
    from app.store import Chat
    from app.titles import TitleQueue
    queue = TitleQueue(fake_client)
    fake_client.answers["generate"] = replies(Generation(text="Waves and tides.", finish_reason="stop"))
    held = HeldClient(fake_client)
    a = ChatView(Chat(), fake_client, window.presets, titles=queue)
    b = ChatView(Chat(), held, window.presets, titles=queue)
    return queue, held, a, b


def test_a_title_waits_while_any_tab_replies(qtbot, idle_window, fake_client):
    """Two chats share the window's title queue: a chat's title is not asked while the other's reply runs."""
    queue, held, a, b = _two_chats(idle_window, fake_client)
    b.send("A long question")                                       # b's reply is in flight
    with qtbot.waitSignal(a.stats, timeout=5000):
        a.send("Tell me about the sea")
    qtbot.wait(50)
    assert b.busy and titles_asked(fake_client) == 0                # a's title waits for b's reply
    with qtbot.waitSignal(a.title_changed, timeout=5000):
        held.end("A long answer.")
    assert not b.busy and titles_asked(fake_client) >= 1


# ---- a stop before the first token ----------------------------------------------------------------------

def test_a_regenerate_stopped_before_its_first_token_keeps_the_previous_reply(qtbot, idle_window, fake_client):
    view = fake_view(idle_window, fake_client)
    fake_client.answers["generate"] = replies(Generation(text="The sea is wide.", finish_reason="stop"))
    with qtbot.waitSignal(view.title_changed, timeout=5000):
        view.send("Tell me about the sea")
    before = [dict(m) for m in view.chat.messages]
    # the engine's answer to a stop after the prompt was read and before a token: a cancelled reply, no text
    fake_client.answers["generate"] = replies(Generation(text="", finish_reason="cancelled"))
    view.regen_btn.click()
    assert view.busy
    qtbot.waitUntil(lambda: not view.busy, timeout=5000)
    assert view.chat.messages == before
    assert view.transcript_text().count("Assistant") == 1 and "The sea is wide." in view.transcript_text()
    assert view.regen_btn.isEnabled()


def test_a_regenerate_that_fails_before_its_first_token_keeps_the_previous_reply(qtbot, idle_window, fake_client):
    from fake_engine import Refusal
    view = fake_view(idle_window, fake_client)
    fake_client.answers["generate"] = replies(Generation(text="The sea is wide.", finish_reason="stop"))
    with qtbot.waitSignal(view.stats, timeout=5000):
        view.send("Tell me about the sea")
    before = [dict(m) for m in view.chat.messages]
    fake_client.answers["generate"] = replies(Refusal("out of memory"))
    view.regenerate()
    qtbot.waitUntil(lambda: not view.busy, timeout=5000)
    assert view.chat.messages == before


# ---- the time left of a prompt being read ---------------------------------------------------------------

def test_a_prompt_being_read_shows_the_time_left_from_the_measured_rate(qtbot, idle_window, fake_client):
    from app.engine_thread import Request
    view = fake_view(idle_window, fake_client)
    now = [100.0]
    view.eta.clock = lambda: now[0]
    req = Request("generate")
    view.track(req, view.TASKS["prefill"])
    req.progress.emit("prefill", 0, 1467)
    assert view.task_visible() and view.task_bar.text() == "0 / 1467 tokens"
    now[0] += 1.0
    req.progress.emit("prefill", 4, 1467)
    assert view.task_bar.text() == "4 / 1467 tokens"              # too little read to say yet
    now[0] += 19.5
    req.progress.emit("prefill", 82, 1467)                       # 4 tokens/s: 1385 left, ~346 s
    assert view.task_bar.text() == "82 / 1467 tokens, about 6 min left"
    now[0] += 300
    req.progress.emit("prefill", 1400, 1467)
    assert view.task_bar.text() == "1400 / 1467 tokens, about 20 s left"
    # the next read measures afresh
    again = Request("generate")
    view.track(again, view.TASKS["prefill"])
    again.progress.emit("prefill", 0, 500)
    assert view.task_bar.text() == "0 / 500 tokens"


def test_time_left_reads_as_a_person_would_say_it():
    from app.prefill_eta import time_left_text
    assert [time_left_text(s) for s in (3, 42, 346, 3000, 3700, 7200)] == [
        "a few seconds left", "about 40 s left", "about 6 min left", "about 50 min left",
        "about 1 h 2 min left", "about 2 h left"]


# ---- journeys on the real engine --------------------------------------------------------------------------

def stop_action(window) -> QAction:
    """Chat > Stop (Esc), as the person presses it."""
    return next(a for a in window.findChildren(QAction) if a.text() == "Stop")


def test_a_message_sent_while_the_title_runs_cancels_it_and_the_title_comes_after(qtbot, window):
    view = window.current_view()
    titles = window.tabs.titles
    order: list[str] = []

    def on_started(owner, req):
        order.append("title-start")
        req.token.connect(lambda _t: order.append("title-token"))
        req.finished.connect(lambda: order.append("title-end"))
        if order.count("title-start") == 1:          # the person sends while the first title request runs
            view.input.setPlainText("And what about rivers?")
            view.send_input()
            order.append("send")
            view.request.token.connect(lambda _t: order.append("reply-token"))
            view.request.finished.connect(lambda: order.append("reply-end"))
    titles.started.connect(on_started)
    titles.preempted.connect(lambda _o: order.append("title-preempted"))
    titles.finished.connect(lambda _o: order.append("title-finished"))
    named: list[str] = []
    view.title_changed.connect(named.append)
    send_and_wait(qtbot, view, "Tell me about the sea")
    assert order[:2] == ["title-start", "send"] and view.busy
    qtbot.waitUntil(lambda: "title-finished" in order and not view.busy, timeout=3 * REPLY_TIMEOUT_MS)
    # the title stopped at once: it ended (cancelled, put back) before the reply's first token, and
    # decoded at most one step after the person sent
    first_end = order.index("title-end")
    assert "reply-token" not in order[:first_end], order
    assert order[order.index("send"):first_end].count("title-token") <= 1, order
    assert order.index("title-preempted") < order.index("reply-end")
    # ... and ran again once the reply was over (its last token in; sent from the reply's own end), once,
    # to the end: the chat titled once
    last_token = len(order) - 1 - order[::-1].index("reply-token")
    assert order.count("title-start") == 2 and order.index("title-start", 1) > last_token, order
    assert order.count("title-finished") == 1 and len(named) == 1 and view.chat.title == named[0] != "New chat"
    assert [m["role"] for m in view.chat.messages] == ["user", "assistant", "user", "assistant"]


def test_a_stopped_reply_gets_no_title_and_the_next_one_gets_one_title(qtbot, window):
    view = window.current_view()
    starts: list[object] = []
    window.tabs.titles.started.connect(lambda owner, _r: starts.append(owner))
    view.input.setPlainText("Tell me about the sea")
    view.send_input()
    view.request.token.connect(lambda _t: view.busy and view.stop())     # stopped at its first token
    qtbot.waitUntil(lambda: not view.busy, timeout=REPLY_TIMEOUT_MS)
    qtbot.wait(100)
    assert starts == [] and view.title_request is None and view.chat.title == "New chat"
    with qtbot.waitSignal(view.title_changed, timeout=2 * REPLY_TIMEOUT_MS):
        with qtbot.waitSignal(view.stats, timeout=REPLY_TIMEOUT_MS):
            view.regen_btn.click()
    with qtbot.waitSignal(view.stats, timeout=REPLY_TIMEOUT_MS):
        view.regen_btn.click()
    qtbot.wait(100)
    assert starts == [view]


def test_cancelling_a_prompt_read_clears_the_streaming_figures(qtbot, window):
    view = window.current_view()
    earlier = send_and_wait(qtbot, view, "Tell me about the sea")
    view.input.setPlainText("A second question")
    view.send_input()
    assert window.status.ttft.text() == "ttft … (reading the prompt)"
    stop_action(window).trigger()                   # Esc while the prompt is read
    qtbot.waitUntil(lambda: not view.busy, timeout=REPLY_TIMEOUT_MS)
    assert "streaming" not in window.status.speed.text() and "reading the prompt" not in window.status.ttft.text()
    assert window.status.ttft.text() == f"ttft {earlier.ttft_ms:.0f} ms"     # the tab's last reply's again


def test_regenerate_then_esc_before_the_first_token_restores_the_previous_reply(qtbot, window):
    view = window.current_view()
    send_and_wait(qtbot, view, "Tell me about the sea")
    before = [dict(m) for m in view.chat.messages]
    shown = view.transcript_text()
    view.regen_btn.click()
    assert view.busy
    stop_action(window).trigger()                   # Esc before the first token
    qtbot.waitUntil(lambda: not view.busy, timeout=REPLY_TIMEOUT_MS)
    assert view.chat.messages == before
    assert view.transcript_text() == shown and view.transcript_text().count("Assistant") == 1
    assert "streaming" not in window.status.speed.text()


def test_a_closed_chats_waiting_title_is_not_asked(qtbot, idle_window, fake_client):
    queue, held, a, b = _two_chats(idle_window, fake_client)
    b.send("A long question")
    with qtbot.waitSignal(a.stats, timeout=5000):
        a.send("Tell me about the sea")
    assert queue.pending(a) and titles_asked(fake_client) == 0
    a.drop_title()                                   # its tab closes while the title waits
    a.deleteLater()
    qtbot.wait(20)
    with qtbot.waitSignal(b.title_changed, timeout=5000):
        held.end("A long answer.")
    assert titles_asked(fake_client) == 1 and not queue.pending(a)     # b's own title only
