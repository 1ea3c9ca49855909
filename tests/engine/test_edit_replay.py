"""bench/edit_replay.py's premise: its ReplayDrafter drafts exactly as prompt lookup drafted on the recorded
editing reply (as many tokens, as many of them right), with the target's own tokens in place of the
recorded ones; and on a hybrid target (recurrent state: rejected drafts undone by restore and re-feed) the
engine's speculative loop, fed by it, returns the plain greedy reply and accepts what the trace accepted.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
from bench.edit_replay import TRACE, ReplayDrafter  # noqa: E402
from bench.spec import simulate  # noqa: E402
from engine.generation.speculative import LookupDrafter, NGRAM_MAX, NGRAM_MIN  # noqa: E402

# a reply that copies its prompt with edits: lookup drafts right runs and wrong tails
PROMPT = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 5, 6, 7, 20, 21, 22, 23, 24]
REPLY = [5, 6, 7, 8, 9, 30, 11, 12, 13, 14, 5, 6, 7, 20, 21, 40, 23, 24, 5, 6]


def test_each_draft_has_lookups_length_and_right_prefix_on_the_targets_tokens():
    trace = {"prompt": PROMPT, "reply": REPLY}
    history = [100 + t for t in PROMPT]            # the target's own prompt, another vocabulary
    target = [200 + i for i in range(len(REPLY))]   # the target's own greedy reply
    d = ReplayDrafter(trace, len(history), target, n_vocab=512, draft_len=4)
    ref = LookupDrafter(draft_len=4)
    seen_wrong = seen_right = 0
    for i in range(len(REPLY)):
        k = min(4, len(REPLY) - i - 1)              # the loop's room: the pass itself yields one more token
        real, _ = ref.propose(PROMPT + REPLY[:i], k)
        right = 0
        while right < len(real) and i + right < len(REPLY) and real[right] == REPLY[i + right]:
            right += 1
        draft, _ = d.propose(history + target[:i], k)
        assert len(draft) == len(real)
        assert draft[:right] == target[i:i + right]
        if right < len(draft):
            assert draft[right] != target[i + right]
            seen_wrong += 1
        seen_right += right
    assert seen_wrong and seen_right          # the fixture has both kinds of draft


def test_the_recorded_trace_is_an_editing_reply():
    trace = json.loads(TRACE.read_text())
    assert len(trace["prompt"]) > 500 and len(trace["reply"]) >= 128
    passes, drafted, accepted = simulate(trace["prompt"], trace["reply"], NGRAM_MAX, NGRAM_MIN, 8)
    assert accepted / drafted > 0.6 and len(trace["reply"]) / passes > 3   # it copies its prompt


@pytest.mark.parametrize("draft_len", [3, 8])
def test_replayed_speculation_on_a_hybrid_target_is_greedy_identical_and_accepts_as_traced(tmp_path, draft_len,
                                                                                          monkeypatch):
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from engine.cache import layer_cache
    from engine.generation import generate, speculative
    from engine.model.gguf_file import open_gguf
    from engine.model.model_loader import load_model
    from engine.sampling import SamplingParams
    from gguf_factory_qwen35 import write_tiny_qwen35_gguf
    path = write_tiny_qwen35_gguf(tmp_path / "q.gguf", "qwen35", seed=5)
    model, _ = load_model(open_gguf(path), dtype=mx.float32)
    n_vocab = model.args.vocab_size
    trace = json.loads(TRACE.read_text())
    trace = {"prompt": trace["prompt"][-200:], "reply": trace["reply"][:60]}
    history = [16 + t % (n_vocab - 16) for t in trace["prompt"]]
    greedy = SamplingParams(temperature=0.0, max_tokens=len(trace["reply"]))

    def fresh():
        cache, fed = make_prompt_cache(model), []
        generate.prefill(model, cache, history[:-1], fed)
        return cache, fed
    cache, fed = fresh()
    assert layer_cache.needs_checkpoints(cache)      # the premise: rejected drafts cannot be trimmed
    plain = list(generate.decode(model, cache, history[-1], fed, history=list(history),
                                 sampler=greedy.sampler(n_vocab), processors=[], max_tokens=greedy.max_tokens,
                                 stats=generate.StepStats()))
    cache, fed = fresh()
    # never judged: every pass drafts, as the trace did (on a tiny model speculating never pays)
    monkeypatch.setattr(speculative, "MIN_JUDGE", 10 ** 9)
    spec = speculative.SpecStats()
    drafter = ReplayDrafter(trace, len(history), plain, n_vocab, draft_len)
    out = list(speculative.decode(model, cache, history[-1], fed, history=list(history), sampling=greedy,
                                  processors=[], max_tokens=greedy.max_tokens, stats=generate.StepStats(),
                                  spec=spec, drafter=drafter))
    assert out == plain
    assert not spec.stopped
    _, t_dr, t_acc = simulate(trace["prompt"], trace["reply"], NGRAM_MAX, NGRAM_MIN, draft_len)
    # the loop's first passes are plain (PLAIN_FIRST), so it drafts a little less than the whole trace
    assert 0 < spec.accepted <= t_acc and spec.drafted <= t_dr
    assert spec.accepted < spec.drafted                 # some drafts were rejected: restore + re-feed ran
    assert spec.accepted / spec.drafted == pytest.approx(t_acc / t_dr, abs=0.1)
