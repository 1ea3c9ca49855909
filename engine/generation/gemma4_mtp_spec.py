"""Speculative decoding on Gemma 4 with its MTP drafter (`--spec mtp` / `mtp:PATH` on a gemma4 model;
the drafter: engine/model/archs/gemma4_mtp.py; Qwen3.5's NextN head: engine/generation/mtp_spec.py).

The drafter is memory-shared: it reads the K/V the target wrote and keeps none of its own, so after a
rejection there is nothing of it to roll back; the target's caches (its sliding layers' windows
included) roll back through engine/cache/layer_cache.py in speculative.decode, as for every drafter.

* `Gemma4Tap` stands in for the target in the reply's prefill and in speculative.decode: it runs the
  inner model and the output head (with Gemma 4's soft-capping, as mlx-lm's Model does) in one pass
  and keeps the last pass's final hidden states (after the output norm) and the cache it wrote. A
  replay after a rollback goes through it too, so the rows held always include the last fed position.
* `Gemma4Drafter.propose(context)`: the target has fed context[:-1] (positions 0..p, p = len - 2) and
  chose context[-1]. Draft 1 is the drafter's step on (h_p, context[-1]) at position p + 1, the chosen
  token's (llama.cpp's draft-mtp driver: the row (id_last, n_past) with the last verify row's hidden
  state), over the K/V a query there sees under llama.cpp's causal sliding-window mask: every entry of
  the target's last global layer, the last `window - 1` of its last sliding layer (mlx-lm's
  RotatingKVCache is put in temporal order first); position p + 1 itself has no K/V yet. Drafts 2..N
  feed the step's projected output and the drafted token back at the same position over the same K/V
  (llama.cpp: "with shared memory (e.g. Gemma4 assistants) we use the same position for all draft
  tokens"; transformers' SinglePositionMultiTokenCandidateGenerator).
"""
from __future__ import annotations

from pathlib import Path

import mlx.core as mx
from mlx_lm.models.gemma4_text import logit_softcap

from engine.device import on_gpu
from engine.generation.mtp_depth import MTP_DRAFT_CPU as DRAFT_CPU, MTP_DRAFT_GPU as DRAFT_GPU, target_offset as _offset


class Gemma4Tap:
    """The gemma4 target for speculative.decode: the same logits, and the last pass's final hidden
    states (`pos0`, `hidden` (1, L, n)) and cache."""

    def __init__(self, model):
        self.model = model
        self.pos0 = 0
        self.hidden = None
        self.cache = None

    def __getattr__(self, name):            # args, layers, make_cache, ...: the target's
        return getattr(self.__dict__["model"], name)

    def __call__(self, inputs: mx.array, cache=None, **kw):
        m = self.model
        pos0 = _offset(cache)
        h = m.model(inputs, cache=cache, **kw)
        out = m.model.embed_tokens.as_linear(h) if m.tie_word_embeddings else m.lm_head(h)
        if m.final_logit_softcapping is not None:
            out = logit_softcap(m.final_logit_softcapping, out)
        self.pos0, self.hidden, self.cache = pos0, h, cache
        return out

    def row(self, p: int) -> mx.array:
        """The final hidden state at position p (1, 1, n): it must be in the last pass."""
        if self.hidden is None or not self.pos0 <= p < self.pos0 + self.hidden.shape[1]:
            raise RuntimeError(f"the target's last pass did not go through the MTP tap at position {p}")
        return self.hidden[:, p - self.pos0:p - self.pos0 + 1]


def target_layers(model) -> dict[bool, int]:
    """The target's cache index the drafter's blocks read, by kind (True: sliding): the last layer of
    that kind, through mlx-lm's K/V sharing (a sharing layer's K/V is its source layer's cache)."""
    inner = model.model
    out: dict[bool, int] = {}
    for i, layer in enumerate(inner.layers):
        out[layer.self_attn.is_sliding] = inner.previous_kvs[i]
    return out


def _dense(c, x):
    """A cache's K or V as an array (8/4-bit K/V: dequantized)."""
    if isinstance(x, tuple):
        return mx.dequantize(*x, group_size=c.group_size, bits=c.bits)
    return x


def seen_kv(c, n: int, window: int | None) -> tuple[mx.array, mx.array]:
    """The K/V a query at position n attends to in target cache `c` holding positions 0..n-1: all of
    them, or for a window those with n - k < window, the last `window - 1` (in temporal order)."""
    if c.offset != n:
        raise RuntimeError(f"the target's cache holds {c.offset} positions, the drafter expects {n}")
    if hasattr(c, "_temporal_order"):       # RotatingKVCache: its buffer may be rotated or hold extra
        k, v = c._temporal_order(c.keys), c._temporal_order(c.values)
        keep = min(window - 1, k.shape[2])
        return k[..., k.shape[2] - keep:, :], v[..., v.shape[2] - keep:, :]
    k, v = _dense(c, c.keys), _dense(c, c.values)
    k, v = k[..., :n, :], v[..., :n, :]
    if window is not None:
        keep = min(window - 1, n)
        k, v = k[..., n - keep:, :], v[..., n - keep:, :]
    return k, v


class Gemma4Drafter:
    """Drafts with a loaded Gemma 4 drafter for one request (it holds no K/V: nothing is per request
    but the tap and the counts)."""
    samples_drafts = True                   # speculative.decode hands it the target distribution
    catchup_s = 0.0                         # nothing to read before drafting: the target's K/V is shared
    held = 0                                # entries of its own K/V: none

    def __init__(self, head, model, path: Path, draft_len: int | None = None):
        self.head, self.path = head, path
        self.target = Gemma4Tap(model)
        self.layers = target_layers(model)  # target cache index by kind (True: sliding)
        self.window = model.args.sliding_window
        self.draft_len = draft_len or (DRAFT_GPU if on_gpu() else DRAFT_CPU)
        self.head_passes = 0

    def pick(self, logits: mx.array, target_dist):
        """The drafted token (argmax, or sampled from the drafter's filtered distribution) and that distribution."""
        if target_dist is None:
            return int(mx.argmax(logits).item()), None
        q = target_dist(logits[None])[0]
        return int(mx.random.categorical(mx.log(q)).item()), q

    def shared_kv(self, n: int) -> dict[bool, tuple[mx.array, mx.array]]:
        cache = self.target.cache
        return {s: seen_kv(cache[i], n, self.window if s else None) for s, i in self.layers.items()}

    def propose(self, context: list[int], k: int, target_dist=None) -> tuple[list[int], list | None]:
        k = min(k, self.draft_len)
        p = len(context) - 2
        kv = self.shared_kv(p + 1)
        h, tok = self.target.row(p), context[-1]
        out, dists = [], []
        for i in range(k):
            logits, h = self.head.step(h, mx.array([[tok]]), kv, p + 1)
            self.head_passes += 1
            tok, q = self.pick(logits, target_dist)
            out.append(tok)
            if q is not None:
                dists.append(q)
        return out, (dists if target_dist is not None else None)
