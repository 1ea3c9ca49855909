"""A conversation's prompt tokenized from where it stopped sharing text with a recent one
(engine/text/prompt_encoder.py), and a held run found from the end (engine/conversations.held_run): both must
give exactly what tokenizing / searching the whole text gives, for every vocabulary Strata reads.

Each architecture's factory GGUF (tests/arch_cases.py) gives its real tokenizer and chat template; a
conversation grows turn by turn (multi-byte characters, runs of spaces and newlines, digits, text that
looks like markup) and every rendering is tokenized both ways.
"""
from __future__ import annotations

import random

import pytest

from arch_cases import ARCH_WRITERS
from gguf_factory_families import writer as family_writer
from engine.text.chat_template import render
from engine.cache.conversations import held_run
from engine.model.gguf_file import open_gguf
from engine.text.tokenizer import load_tokenizer

VOCABS = {**ARCH_WRITERS, "phi3-spm": family_writer("phi3-spm")}
# the vocabularies whose special tokens the tokenizer splits on exactly: the cut must be used there
# (the others, e.g. Phi-3's whitespace-eating specials, must fall back to whole tokenization)
MUST_CUT = {"llama", "qwen3", "qwen35", "qwen35moe", "gpt-oss", "granite", "olmo2", "mistral3", "gemma3"}

USER_TEXTS = ["Hello there!", "Ça coûte 12,50 € — 中文 too?\n\n  indented  line", "x" * 40 + " 1234567",
              "<b>bold</b> and </s> as plain text", "  leading and trailing  ", "Tab\tand\r\nCRLF", "done."]


@pytest.fixture(scope="module")
def vocab(tmp_path_factory):
    root = tmp_path_factory.mktemp("prompt-encoder")
    made = {}

    def get(name):
        if name not in made:
            path = VOCABS[name](root / f"{name}.gguf", ftype="F16", seed=1)
            g = open_gguf(path)
            made[name] = (load_tokenizer(g), g.get("tokenizer.chat_template"))
        return made[name]
    return get


def _render(tok, template, messages, gen=True):
    bos = tok.token_text(tok.bos_id) if tok.bos_id is not None else ""
    eos = tok.token_text(min(tok.eos_ids)) if tok.eos_ids else ""
    return render(template, messages, bos_token=bos, eos_token=eos, add_generation_prompt=gen)


@pytest.mark.parametrize("name", sorted(VOCABS))
def test_prompt_ids_equal_whole_tokenization_as_a_chat_grows(vocab, name):
    tok, template = vocab(name)
    rng = random.Random(5)
    msgs = [{"role": "system", "content": "You answer briefly."}]
    for turn, text in enumerate(USER_TEXTS):
        msgs.append({"role": "user", "content": text})
        for gen in (True, False):
            prompt = _render(tok, template, msgs, gen)
            assert tok.encode_prompt(prompt) == tok.encode(prompt), (name, turn, gen)
        reply = " ".join(rng.choice(["sure", "ok,", "no", "1.5", "é", "\n"]) for _ in range(12))
        msgs.append({"role": "assistant", "content": reply})
    # an edit: an earlier message changed, the rest rendered again
    edited = msgs[:3] + [{"role": "user", "content": "Edited question?"}]
    prompt = _render(tok, template, edited)
    assert tok.encode_prompt(prompt) == tok.encode(prompt)
    enc = tok.prompts
    if name in MUST_CUT:
        assert enc.cut_ids, f"{name}: no special token to cut at"
        assert enc.reused > 0, f"{name}: nothing was reused"


def test_special_tokens_that_eat_whitespace_are_not_cut_at(vocab):
    """Phi-3's special tokens eat the whitespace after them (llama.cpp's RSTRIP, engine/text/tokenizer.py gives
    a file named phi-3 those flags): a cut there could change the text's ids, so they are not cut at and
    the prompt is still tokenized exactly."""
    from engine.text.prompt_encoder import PromptEncoder
    from engine.text.tokenizer import _phi3_special_rstrip
    tok, template = vocab("phi3")
    backend = _phi3_special_rstrip(tok.backend, "Phi-3 mini")
    enc = PromptEncoder(backend)
    stripping = {i for i, t in backend.get_added_tokens_decoder().items() if t.rstrip}
    assert stripping and not (enc.cut_ids & stripping)
    msgs = [{"role": "user", "content": "  Hi\n"}, {"role": "assistant", "content": " ok "}, {"role": "user", "content": "\nMore"}]
    for n in range(1, 4):
        prompt = _render(tok, template, msgs[:n])
        assert enc.encode(prompt) == backend.encode(prompt, add_special_tokens=False).ids


@pytest.mark.parametrize("name", ["llama", "gemma3", "phi3-spm", "gpt-oss"])
def test_held_run_is_a_true_prefix_and_no_shorter_than_the_whole_prefix_search(vocab, name):
    tok, _ = vocab(name)
    rng = random.Random(7)
    text = "".join(rng.choice(["a", "b", " ", "é", "中", "\n", "12", "the ", "  "]) for _ in range(600))
    ids = tok.encode(text, add_bos=False)
    full = tok.decode(ids, skip_special=False)

    def reference(t):
        lo, hi = 0, len(ids)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if t.startswith(tok.decode(ids[:mid], skip_special=False)):
                lo = mid
            else:
                hi = mid - 1
        return lo
    cuts = [len(full), len(full) - 1, len(full) // 2, 3, 0] + [rng.randrange(len(full)) for _ in range(12)]
    for c in cuts:
        for tail in ("", "Z changed", " and more"):
            t = full[:c] + tail
            got = held_run(tok, ids, t, full)
            # a run the text really starts with, and no shorter than the old search's (whose predicate
            # is not monotone where a token ends inside a multi-byte character, so neither is always
            # the very longest)
            assert t.startswith(tok.decode(ids[:got], skip_special=False)), (name, c, tail)
            assert got >= reference(t), (name, c, tail)


def test_held_prompts_cost_a_few_bytes_a_token(vocab):
    """KEEP long prompts held, their ids packed (4 bytes an id): a chat that grew past 20,000 tokens, sixteen
    renderings of it, cost the encoder under 6 bytes a held token with the texts themselves (measured 4.5;
    held as lists of ints, 10.2)."""
    import tracemalloc

    from engine.text.prompt_encoder import KEEP, PromptEncoder
    tok, template = vocab("qwen3")
    enc = PromptEncoder(tok.backend)
    msgs = [{"role": "system", "content": "You answer briefly."}]
    words = "the harbour wall was built of grey stone and the boats came home at dusk 1234 ".split()
    prompts = []
    while len(prompts) < KEEP:
        msgs.append({"role": "user", "content": " ".join(words[(i * 7) % len(words)] for i in range(1200))})
        prompts.append(_render(tok, template, msgs))
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        held_tokens = sum(len(enc.encode(p)) for p in prompts)
        grown = tracemalloc.get_traced_memory()[0] - base
    finally:
        tracemalloc.stop()
    assert held_tokens > 150_000
    assert grown / held_tokens < 6, f"{grown / held_tokens:.1f} bytes a held token"
