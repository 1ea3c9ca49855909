"""A reply's <think> block told apart (engine/text/reasoning.py): opened by the template (Qwen3.5) or by the
model (Qwen3), never closed, streamed in pieces of every size, and gpt-oss's channels left to harmony."""
from __future__ import annotations

import random

import pytest

from engine.text import harmony, reasoning
from engine.text.harmony import Channels
from engine.text.reasoning import split, split_reply

CASES = [
    # (text, think_open) -> (reasoning, content)
    (("The user asks about rivers.\nThey flow.\n</think>\n\nRivers flow to the sea.", True),
     ("The user asks about rivers.\nThey flow.", "Rivers flow to the sea.")),
    (("<think>\nShort.\n</think>\n\nHello!", False), ("Short.", "Hello!")),          # the model opened it (Qwen3)
    (("\n<think>x</think>y", False), ("x", "y")),
    (("Still thinking when the tokens ran out", True), ("Still thinking when the tokens ran out", "")),
    (("\n\n</think>\n\nNo thoughts.", True), ("", "No thoughts.")),                  # an empty block
    (("Plain reply with </think> inside", False), ("", "Plain reply with </think> inside")),
    (("Plain reply, <think> later is text", False), ("", "Plain reply, <think> later is text")),
    (("Text then </think> then more </think> end", True), ("Text then", "then more </think> end")),
    (("", True), ("", "")),
    (("", False), ("", "")),
]


@pytest.mark.parametrize("args,want", CASES)
def test_split(args, want):
    assert split(*args) == Channels(*want)
    assert split_reply(*args) == Channels(*want)


def _streamed(text: str, think_open: bool, rng: random.Random) -> Channels:
    cs = harmony.ChannelStream(lambda t, final: split_reply(t, think_open, final=final))
    parts = {"reasoning": "", "content": ""}
    i = 0
    while i < len(text):
        n = rng.randint(1, 6)
        for kind, delta in cs.feed(text[i:i + n]):
            parts[kind] += delta
        i += n
    for kind, delta in cs.finish():
        parts[kind] += delta
    return Channels(parts["reasoning"], parts["content"])


@pytest.mark.parametrize("args,want", CASES)
def test_streamed_in_pieces_sums_to_the_split_and_never_shows_a_tag(args, want):
    """Fed 1-6 characters at a time (a tag cut anywhere), the deltas add up to the whole text's split
    (whitespace the final split trims at the block's end aside) and no part ever shows a piece of a tag."""
    text, think_open = args
    rng = random.Random(7)
    for _ in range(20):
        got = _streamed(text, think_open, rng)
        assert got.content == want[1]
        assert got.reasoning.strip() == want[0]
    tags = ["</think>"[:n] for n in range(1, 9)]
    for k in range(1, len(text)):
        now = split_reply(text[:k], think_open, final=False)
        assert not any(now.reasoning.endswith(t) for t in tags), (k, now)
        assert not now.content.startswith("<think"[:max(1, min(k, 6))]) or not text.startswith("<think>"), (k, now)


def test_a_reply_starting_like_the_tag_waits_until_it_is_known():
    assert split_reply("<thi", False, final=False) == Channels("", "")
    assert split_reply("<thi", False) == Channels("", "<thi")                      # the reply ended there
    assert split_reply("<b>bold</b>", False, final=False) == Channels("", "<b>bold</b>")


def test_harmony_replies_keep_their_channels():
    text = ("<|channel|>analysis<|message|>The user greets.<|end|><|start|>assistant<|channel|>final"
            "<|message|>Hello!")
    assert split_reply(text, think_open=False) == harmony.split(text) == Channels("The user greets.", "Hello!")
    assert split_reply("<|chan", think_open=False, final=False).content == ""     # a marker's start held back


def test_generation_prompts_that_open_the_block():
    from engine.text.chat_template import generation_prompt
    from gguf_factory_qwen35 import CHAT_TEMPLATE
    assert reasoning.opens_think(generation_prompt(CHAT_TEMPLATE))
    assert not reasoning.opens_think(generation_prompt(None))                     # the built-in ChatML
    assert generation_prompt("{{ raise_exception('no') }}") == ""                 # a template that fails


MSGS = [{"role": "user", "content": "Tell me about the sea."}]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(server, the engine's own greedy reply's reasoning) on the tiny Qwen3.5: its template opens the block
    and a random model never closes it, so the whole reply is reasoning."""
    from engine.engine import Engine, EngineOptions, GenerateRequest
    from engine.frontends.server import ServerThread, create_app
    from engine.sampling import SamplingParams
    from gguf_factory_qwen35 import write_tiny_qwen35_gguf
    path = write_tiny_qwen35_gguf(tmp_path_factory.mktemp("think") / "q.gguf", "qwen35", seed=4)
    eng = Engine(EngineOptions(model=str(path), cache_mib=0)).start()
    srv = ServerThread(create_app(eng)).start()
    try:
        raw = eng.call(GenerateRequest(messages=MSGS, sampling=SamplingParams(max_tokens=16, temperature=0.0)), 120)
        assert raw.text.strip() and "</think>" not in raw.text
        yield srv, split(raw.text, True).reasoning
    finally:
        srv.stop()
        eng.stop()


def test_the_server_gives_a_qwen35_replys_block_as_reasoning_content(served):
    """A real `openai` client: the whole reply is reasoning_content, streamed or not, and content is empty."""
    import openai
    srv, thought = served
    msgs = MSGS
    client = openai.OpenAI(base_url=srv.base_url, api_key="x", max_retries=0, timeout=120)
    got = client.chat.completions.create(model="default", messages=msgs, max_tokens=16, temperature=0)
    message = got.choices[0].message
    assert message.content == "" and message.reasoning_content == thought
    parts = {"reasoning": "", "content": ""}
    for ch in client.chat.completions.create(model="default", messages=msgs, max_tokens=16, temperature=0,
                                             stream=True):
        for c in ch.choices:
            parts["reasoning"] += getattr(c.delta, "reasoning_content", None) or ""
            parts["content"] += c.delta.content or ""
    assert parts == {"reasoning": thought, "content": ""}


def test_the_anthropic_api_gives_the_block_as_thinking_only_when_asked(served):
    """A real `anthropic` client: with `thinking` enabled the reasoning is a thinking block (streamed as
    thinking_delta), without it the reasoning is left out; never in a text block."""
    import anthropic
    srv, thought = served
    msgs = MSGS
    client = anthropic.Anthropic(base_url=srv.base_url.removesuffix("/v1"), api_key="x", max_retries=0)

    def ask(thinking=None, **kw):
        # (this SDK's create() takes no sampling arguments: they travel in the body as extras)
        extra = {"temperature": 0, **({"thinking": thinking} if thinking else {})}
        return dict(model="claude-x", max_tokens=16, messages=msgs, extra_body=extra, **kw)
    on = {"type": "enabled", "budget_tokens": 1024}
    plain = client.messages.create(**ask())
    assert plain.content == [] and plain.stop_reason == "max_tokens"
    asked = client.messages.create(**ask(on))
    assert [b.type for b in asked.content] == ["thinking"] and asked.content[0].thinking == thought
    kinds, streamed = set(), ""
    for ev in client.messages.create(**ask(on, stream=True)):
        if ev.type == "content_block_delta":
            kinds.add(ev.delta.type)
            streamed += getattr(ev.delta, "thinking", "")
    assert kinds == {"thinking_delta"} and streamed == thought
    with pytest.raises(anthropic.BadRequestError, match="thinking"):      # a malformed `thinking`
        client.messages.create(**ask({"type": "sometimes"}))
