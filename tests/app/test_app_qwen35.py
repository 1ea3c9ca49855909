"""A Qwen3.5 reply in a chat tab: its template opens a <think> block, so the reply starts in its reasoning;
the reasoning is shown apart, collapsed (one line with Show/Hide, as gpt-oss's analysis channel), the
reply below it, no tag in the transcript, and the reasoning is not sent back in the next turn.

Real engine on tests/gguf_factory_qwen35.py's tiny model: a whole journey in the window (a random model
never closes the block: its reply is all reasoning), and a reply forced by a grammar to close it
(streamed into a tab as the engine's token deltas would be)."""
from __future__ import annotations

import pytest
from PySide6.QtCore import QUrl

from app_fixtures import LOAD_TIMEOUT_MS, open_window, send_and_wait

pytestmark = pytest.mark.gui


@pytest.fixture(scope="module")
def qwen35_file(tmp_path_factory):
    from gguf_factory_qwen35 import write_tiny_qwen35_gguf
    return write_tiny_qwen35_gguf(tmp_path_factory.mktemp("q35app") / "tiny-qwen35.gguf", "qwen35", seed=4)


@pytest.fixture(scope="module")
def closed_reply(qwen35_file):
    from engine.generation.constraints import ConstraintSpec
    from engine.engine import Engine, EngineOptions, GenerateRequest
    from engine.sampling import SamplingParams
    grammar = r'start: /[a-z]{2,8}( [a-z]{2,8}){4,6}/ "\n</think>\n\n" /[A-Z][a-z]{2,8}( [a-z]{2,8}){2,4}/'
    eng = Engine(EngineOptions(model=str(qwen35_file), cache_mib=0)).start()
    try:
        return eng.call(GenerateRequest(messages=[{"role": "user", "content": "Hi"}],
                                        constraint=ConstraintSpec.lark(grammar),
                                        sampling=SamplingParams(max_tokens=120, temperature=0.0)), 300)
    finally:
        eng.stop()


def test_a_closed_think_block_streams_collapsed_and_the_reply_lands_below_it(qtbot, idle_window, closed_reply):
    r = closed_reply
    thought, reply = r.text.split("</think>")
    thought, reply = thought.strip(), reply.strip()
    assert r.finish_reason == "stop" and thought and reply
    view = idle_window.current_view()
    view.think_open = True                      # as the window sets it from the load's facts
    view.chat.title = "qwen"                    # no title request: no engine runs here
    view.chat.messages = [{"role": "user", "content": "Hi"}]
    view.streaming = ""
    view.render_all()
    seen_thinking = False
    for i in range(0, len(r.text), 3):
        view._on_token(r.text[i:i + 3])
        view._render_tail()
        shown = view.transcript_text().split("Assistant", 1)[1]
        # no tag, and the reasoning itself stays folded away while it streams
        assert "think>" not in shown and thought[:10] not in shown, shown
        seen_thinking |= "Thinking\u2026" in shown
    assert seen_thinking
    view._on_done(r)
    assert view.chat.messages[-1] == {"role": "assistant", "content": reply, "reasoning": thought}
    shown = view.transcript_text()
    assert f"Reasoning ({len(thought.split())} words)" in shown and reply in shown and thought not in shown
    view._on_anchor(QUrl("reasoning:1"))
    assert thought in view.transcript_text() and "Hide" in view.transcript_text()
    assert view.request_messages()[-1] == {"role": "assistant", "content": reply}


def test_a_qwen35_chat_in_the_window_shows_its_reasoning_apart_and_goes_on(qtbot, app_home, qwen35_file):
    """The user's journey: the Qwen3.5 file loaded, a question, a follow-up. The load's facts say the
    template opens a <think> block; the reply (never closed by a random model) is all reasoning, shown
    collapsed; the follow-up is answered with the first reply's reasoning left out of what is sent."""
    import shutil

    from app import settings
    model = app_home / "models" / qwen35_file.name
    shutil.copyfile(qwen35_file, model)
    s = settings.load()
    s.model = str(model)
    s.sampling.max_tokens = 24
    s.sampling.temperature = 0.0
    settings.save(s)
    window = open_window(qtbot)
    with qtbot.waitSignal(window.library.loaded, timeout=LOAD_TIMEOUT_MS):
        window.show()
    try:
        view = window.current_view()
        assert window.library.think_open and view.think_open
        send_and_wait(qtbot, view, "Tell me about the sea.")
        first = view.chat.messages[-1]
        assert first["role"] == "assistant" and first["content"] == "" and first["reasoning"], first
        shown = view.transcript_text()
        assert f"Reasoning ({len(first['reasoning'].split())} words)" in shown
        assert first["reasoning"][:12] not in shown and "think>" not in shown
        sent = view.request_messages()
        assert sent[-1] == {"role": "assistant", "content": ""}
        second = window.new_tab()                 # a new tab loaded after the model: told too
        assert second.think_open
        send_and_wait(qtbot, view, "And the mountains?")
        assert [m["role"] for m in view.chat.messages][-4:] == ["user", "assistant", "user", "assistant"]
        assert view.chat.messages[-1]["reasoning"]
    finally:
        window.close()
