"""A gpt-oss (harmony) reply in a chat tab: its analysis channel shown apart from the reply, collapsed
like a reasoning block (one line with Show/Hide), the final channel as the reply, and no channel
markers in the transcript or in the history sent back (the gpt-oss template refuses them).

The reply is the real engine's, on tests/gguf_factory_gpt_oss.py's tiny model with its tokens forced
into harmony by a grammar (a random model does not write channels)."""
from __future__ import annotations

import pytest
from PySide6.QtCore import QUrl

import gguf_factory_gpt_oss as factory


@pytest.fixture(scope="module")
def harmony_reply(tmp_path_factory):
    from engine.generation.constraints import ConstraintSpec
    from engine.engine import Engine, EngineOptions, GenerateRequest
    from engine.sampling import SamplingParams
    path = factory.write(tmp_path_factory.mktemp("gpt_oss_app") / "gpt-oss.gguf", ftype="F16", seed=3)
    grammar = (r'start: <|channel|> "analysis" <|message|> /[a-z]{2,8}( [a-z]{2,8}){4,6}/ <|end|> <|start|> '
               r'"assistant" <|channel|> "final" <|message|> /[A-Z][a-z]{2,8}( [a-z]{2,8}){2,4}/ <|return|>')
    eng = Engine(EngineOptions(model=str(path), cache_mib=0)).start()
    try:
        return eng.call(GenerateRequest(messages=[{"role": "user", "content": "Hi"}],
                                        constraint=ConstraintSpec.lark(grammar),
                                        sampling=SamplingParams(max_tokens=120, temperature=0.0)))
    finally:
        eng.stop()


def test_harmony_reply_streams_and_lands_with_its_reasoning_collapsed(qtbot, idle_window, harmony_reply):
    from engine.text import harmony
    r = harmony_reply
    ch = harmony.split(r.text)
    assert r.finish_reason == "stop" and ch.reasoning and ch.content
    view = idle_window.current_view()
    view.chat.title = "gpt-oss"                 # no title request: no engine runs here
    view.chat.messages = [{"role": "user", "content": "Hi"}]
    view.streaming = ""
    view.render_all()
    seen_thinking = False
    for i in range(0, len(r.text), 5):           # streamed as the engine's token deltas would be
        view._on_token(r.text[i:i + 5])
        view._render_tail()
        shown = view.transcript_text()
        reply_part = shown.split("Assistant", 1)[1]
        # no marker, no channel name, and the reasoning itself stays folded away while it streams
        assert "<|" not in shown and "analysis" not in reply_part and ch.reasoning[:12] not in reply_part
        seen_thinking |= "Thinking\u2026" in reply_part
    assert seen_thinking

    view._on_done(r)
    msg = view.chat.messages[-1]
    assert msg == {"role": "assistant", "content": ch.content, "reasoning": ch.reasoning}
    shown = view.transcript_text()
    words = len(ch.reasoning.split())
    assert f"Reasoning ({words} words)" in shown and "Show" in shown and ch.content in shown
    assert ch.reasoning.strip() not in shown                                   # collapsed
    view._on_anchor(QUrl("reasoning:1"))
    assert ch.reasoning.strip() in view.transcript_text() and "Hide" in view.transcript_text()
    view._on_anchor(QUrl("reasoning:1"))
    assert ch.reasoning.strip() not in view.transcript_text()
    # what goes back to the engine: the reply without its reasoning or any marker
    sent = view.request_messages()
    assert sent[-1] == {"role": "assistant", "content": ch.content}
    assert not any("<|" in m["content"] for m in sent)


def test_plain_replies_are_unchanged(qtbot, idle_window):
    """A reply without channel markers (every other model) is its own content, no reasoning line."""
    view = idle_window.current_view()
    from app.chat_view import _assistant_message
    text = "Hello <|not a marker and <think>kept</think> as it was"
    assert _assistant_message(text) == {"role": "assistant", "content": text}
    view.chat.messages = [{"role": "user", "content": "Hi"}, _assistant_message(text)]
    view.render_all()
    assert "Reasoning" not in view.transcript_text()


def test_a_harmony_title_reply_gives_its_final_channel_or_the_fallback(qtbot, idle_window):
    view = idle_window.current_view()
    view._on_title("<|channel|>analysis<|message|>The user wants a title about boats", "Boats at dawn")
    assert view.chat.title == "Boats at dawn"           # only reasoning within the title's 12 tokens
    view._on_title("<|channel|>analysis<|message|>Short.<|end|><|start|>assistant<|channel|>final<|message|>"
                   "**The Little Boat**", "Tell me a story about a little boat")
    assert view.chat.title == "The Little Boat"
