"""A returning turn's few new tokens fed with the first decode step (engine/generation/generate.py, on by default
on a GPU only): the same greedy tokens as prefill-then-step, and `fed` still equals what the K/V holds.
Forced on here, on the CPU, with the tiny model in float32."""
from __future__ import annotations

import pytest
from mlx_lm.models.cache import make_prompt_cache

from engine.generation import generate
from engine.model.gguf_file import open_gguf
from engine.model.model_loader import load_model
from engine.cache.parking import KVEntry
from engine.sampling import SamplingParams
from engine.text.tokenizer import load_tokenizer


@pytest.mark.parametrize("n_new", [1, 2, 30, 62, 200])
def test_merged_first_step_matches_prefill_then_step(monkeypatch, tiny_gguf, n_new):
    g = open_gguf(tiny_gguf)
    model, info = load_model(g)
    tok = load_tokenizer(g)
    history = [(7 * i) % 200 + 20 for i in range(150)]
    tokens = history + [(11 * i) % 180 + 30 for i in range(n_new + 1)]

    def run(limit):
        monkeypatch.setattr(generate, "first_step_merge_limit", lambda chunk: limit)
        entry = KVEntry([], make_prompt_cache(model), "k")
        generate.prefill(model, entry.cache, history, entry.tokens, chunk=512)
        progress = []
        r = generate.reply(model, entry, tokens, len(history), tokenizer=tok,
                           sampling=SamplingParams(max_tokens=8, temperature=0.0), n_vocab=info.n_vocab,
                           max_tokens=8, chunk=512, on_token=lambda t, s: None,
                           on_progress=lambda d, t: progress.append(d), cancelled=lambda: False)
        assert all(c.offset == len(entry.tokens) for c in entry.cache)
        return r.tokens, entry.tokens, progress

    split, merged = run(0), run(63)
    assert merged[0] == split[0]
    assert merged[1] == split[1] == tokens + split[0][:-1]
    if n_new <= 63:
        assert merged[2] == []      # nothing to report: no prefill pass ran
    else:                           # 189 tokens prefilled (3 x 63), the last 11 merged
        assert merged[2][0] == 0 and merged[2][-1] == 189 and split[2][-1] == n_new
