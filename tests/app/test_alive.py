"""An engine answer that arrives after its receiver was deleted is dropped, not delivered to a deleted
object: the chat's context counter asks for a count, its view closes before the answer comes back."""
from __future__ import annotations

import shiboken6
from PySide6.QtWidgets import QWidget

from fake_engine import FakeClient

from app.alive import while_alive
from app.context_meter import ContextCounter


def test_a_count_answered_after_the_counter_was_deleted_is_dropped(qtbot):
    client = FakeClient()
    host = QWidget()
    counter = ContextCounter(client, lambda: ([{"role": "user", "content": "hi"}], False),
                             lambda: (4096, 256), host)
    got = []
    counter.counted.connect(got.append)
    counter.count_now()                       # answered on the next turn of the event loop
    assert client.names() == ["count_prompt_tokens"]
    shiboken6.delete(host)                    # the chat view closes first: the counter goes with it
    assert not shiboken6.isValid(counter)
    with qtbot.captureExceptions() as errors:
        qtbot.wait(50)                        # the answer arrives
    assert errors == [] and got == []


def test_while_alive_calls_through_while_the_receiver_lives(qtbot):
    host = QWidget()
    calls = []
    fn = while_alive(host, lambda *a: calls.append(a))
    fn(1, 2)
    shiboken6.delete(host)
    fn(3)
    assert calls == [(1, 2)]
