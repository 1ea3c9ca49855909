"""Issue 34 in the window (real engine, tiny GGUFs: a llama, a Qwen3.5): two tabs answer at once, each tab's reply and
live figures its own, decoded together by the engine's batch (engine/generation/batching.py)."""
from __future__ import annotations

import dataclasses
import os
import time

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

import pytest  # noqa: E402

from app_fixtures import REPLY_TIMEOUT_MS  # noqa: E402

pytestmark = pytest.mark.gui


@pytest.fixture(params=["llama", "qwen35"])
def long_replies(request, app_home):
    """app_home with replies long enough to overlap (greedy: each tab's reply is its prompt's own); the
    tiny llama, or a tiny Qwen3.5 (recurrent states: batched since session 12)."""
    from app import settings
    s = settings.load()
    if request.param == "qwen35":
        from gguf_factory_qwen35 import write_tiny_qwen35_gguf
        s.model = str(write_tiny_qwen35_gguf(app_home / "models" / "tiny-qwen35.gguf", "qwen35", seed=4))
    s.sampling.max_tokens = 300
    s.sampling.temperature = 0.0
    settings.save(s)
    return app_home


def test_two_tabs_answer_at_once(qtbot, long_replies):
    from app_fixtures import LOAD_TIMEOUT_MS, open_window
    from pathlib import Path

    from app import settings
    from engine.engine import Status
    window = open_window(qtbot)
    with qtbot.waitSignal(window.library.loaded, timeout=LOAD_TIMEOUT_MS):
        window.show()
    first = window.current_view()
    second = window.new_tab()
    tokens: dict[str, list[float]] = {"first": [], "second": []}
    figures: dict[str, list[dict]] = {"first": [], "second": []}
    for name, view in (("first", first), ("second", second)):
        view.live_figures.connect(lambda live, n=name: figures[n].append(live))
    first.input.setPlainText("Tell me about the sea.")
    first.send_input()
    first.request.token.connect(lambda _t: tokens["first"].append(time.perf_counter()))
    second.input.setPlainText("Write a poem about a cat who learns to fly over the hills.")
    second.send_input()
    second.request.token.connect(lambda _t: tokens["second"].append(time.perf_counter()))
    assert first.busy and second.busy          # neither tab waits for the other to be sent
    qtbot.waitUntil(lambda: not first.busy and not second.busy, timeout=3 * REPLY_TIMEOUT_MS)
    engine = window.engine_thread.engine
    assert Path(engine.call(Status(), 30).model).name == Path(settings.load().model).name   # the model asked for
    c = engine.call(Status(), 30).batch
    assert c.peak_rows == 2 and c.shared_steps > 10, c
    a, b = tokens["first"], tokens["second"]
    assert a and b
    # streamed at once: each tab got tokens while the other was still streaming
    assert sum(1 for t in b if t < a[-1]) > 5 and sum(1 for t in a if t > b[0]) > 5
    # each tab's reply is its own, and each tab's live figures moved while both replied
    # (a Qwen3.5 template opens a <think> block: its reply, never closing it here, is all reasoning)
    replies = [v.chat.messages[-1] for v in (first, second)]
    said = [(m.get("reasoning", ""), m["content"]) for m in replies]
    assert all(m["role"] == "assistant" for m in replies) and all(r or c for r, c in said)
    assert said[0] != said[1]
    assert len(figures["first"]) >= 2 and len(figures["second"]) >= 2
