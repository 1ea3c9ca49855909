"""Speculative decoding with the model's own NextN / MTP head (`--spec mtp`, `mtp:PATH`).

The head (engine/model/archs/qwen35_mtp.py) at target position p reads the target's final hidden state h_p
(after the output norm) and the embedding of token p+1, and predicts token p+2. Its own K/V (one
KVCache) holds one entry per target position it has read, so it is a drafter like a draft model but
fed by the target's passes instead of by tokens alone:

* `TargetTap` stands in for the target model in the reply's prefill and in speculative.decode: it
  runs the inner model and the output head itself (one pass, as mlx-lm's TextModel does) and keeps
  each position's hidden state (lazily: in a prefill chunk only the K/V is evaluated, and the final
  hidden states cost the last block's feed-forward and the norm when the head first reads them).
  Every pass goes through it: the prompt's prefill chunks, the plain first passes, each verify pass
  and the replay after a rollback (which feeds the accepted tokens again: their hidden states are
  the verify pass's rows).
* `MTPDrafter.propose`: first the head reads, in one pass, every target position it has not read
  yet (the positions the last verify pass accepted, each with its next token, the last one's being
  the token the target just chose): the last row's logits give draft 1. Drafts 2..N chain the head
  on its own normed output (vLLM's Qwen3.5 MTP does the same for depth > 1). Those chained entries
  are guesses: they are trimmed from the head's K/V before propose returns, so after every propose
  the head holds exactly one entry per target position from its start to the target's last fed
  token (`held == len(fed) - start`; start is 0 for a conversation read from its beginning, else
  the first position this reply's prefill read, or MAX_ROWS before the prompt's end for a longer
  one): nothing of a rejected draft stays, and a partial acceptance adds only the accepted positions
  at the next propose.
* The target's recurrent state (Gated DeltaNet layers) rolls back through engine/cache/layer_cache.py
  (snapshot before the verify pass, restore + replay), as for the other drafters: decode does that.
* Sampled replies draw drafts from the head's distribution after the request's filters and hand those
  distributions to verification (rejection sampling: the output follows the target's distribution).

The head reads what this reply's prefill read: a returning conversation's earlier turns (the K/V
reused from before) are not read by it (its K/V is the request's), so its attention covers the new
part of the prompt and the reply; that may lower acceptance, never correctness. RoPE is relative, so
a head K/V that starts at 0 where the target is at position `start` attends exactly as one placed at
the target's offsets.

Control vectors wrap the target's blocks only (engine/steer/steering.py): the head's block is its own,
unsteered; it reads the steered target's hidden state, which is what the target continues from.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from engine.device import on_gpu
from engine.errors import ModelFileError, RequestError
from engine.generation.mtp_depth import MTP_DRAFT_CPU, MTP_DRAFT_GPU, target_offset
from engine.model.archs.qwen35_mtp import load_head, check_matches
from engine.model.gguf_file import open_gguf
from engine.model.memory_estimate import read_header, tensor_bytes
from engine.model.model_sources import model_stem
from engine.model.models import resolve_model
from engine.model.archs.gemma4_mtp import Gemma4Assistant, load_sibling
from engine.generation.gemma4_mtp_spec import Gemma4Drafter

MAX_ROWS = 8192         # hidden states the tap keeps unread at most (a plain fallback decode adds one a token)
READ_CHUNK = 512        # the head reads a long prompt's positions this many at a time


class TargetTap:
    """The target model for speculative.decode: the same logits, and each position's final hidden state
    kept in `rows` (position -> (1, n_embd))."""

    def __init__(self, model):
        self.model = model
        self.rows: dict[int, mx.array] = {}
        self.keep_from = 0                  # rows before this position are read: let go

    def __getattr__(self, name):            # args, layers, ...: the target's
        return getattr(self.__dict__["model"], name)

    def __call__(self, inputs: mx.array, cache=None, **kw):
        lm = self.model.language_model
        pos0 = target_offset(cache)
        h = lm.model(inputs, cache, **kw)
        out = lm.model.embed_tokens.as_linear(h) if lm.args.tie_word_embeddings else lm.lm_head(h)
        rows = self.rows
        for i in range(h.shape[1]):
            rows[pos0 + i] = h[:, i]
        cut = max(self.keep_from, pos0 + h.shape[1] - MAX_ROWS)
        if rows and min(rows) < cut:
            for p in [p for p in rows if p < cut]:
                del rows[p]
        return out


def drafter_for(head, model, path: Path, draft_len: int | None = None):
    """The drafter of one request for a loaded head: a NextN head's MTPDrafter, or what a head that
    drafts otherwise makes (Gemma 4's memory-shared drafter, engine/generation/gemma4_mtp_spec.py)."""
    if isinstance(head, Gemma4Assistant):
        return Gemma4Drafter(head, model, path, draft_len)
    return MTPDrafter(head, model, path, draft_len)


class MTPDrafter:
    """Drafts with a loaded head for one request (its K/V is the request's; the head is the engine's)."""
    samples_drafts = True                   # speculative.decode hands it the target distribution

    def __init__(self, head, model, path: Path, draft_len: int | None = None):
        self.head, self.path = head, path
        self.target = TargetTap(model)
        self.cache = KVCache()
        self.draft_len = draft_len or (MTP_DRAFT_GPU if on_gpu() else MTP_DRAFT_CPU)
        self.start: int | None = None       # target position of the head's first entry
        self.upto = 0                       # next target position the head has not read
        self.head_passes = 0
        # time the last propose spent reading the prompt (more than one verify pass's positions): a
        # one-time cost, kept out of the never-slower judgement as a draft model's catch-up is
        self.catchup_s = 0.0

    @property
    def held(self) -> int:
        """Entries in the head's K/V."""
        return self.cache.offset

    def _read(self, context: list[int]) -> tuple[mx.array, mx.array]:
        """Read every target position up to the last fed one (len(context) - 2; its next token is
        context[-1]); (logits, normed hidden) of the last."""
        rows = self.target.rows
        last = len(context) - 2
        if self.start is None or any(p not in rows for p in range(self.upto, last + 1)):
            # first propose (or the rows lost: never in one request's run): start at the earliest
            # position from which the tap holds every hidden state
            p = last
            while p - 1 in rows:
                p -= 1
            if last not in rows:
                raise RuntimeError("the target's last pass did not go through the MTP tap")
            self.cache, self.start, self.upto = KVCache(), p, p
        self.catchup_s = 0.0
        catch_up = last + 1 - self.upto > self.draft_len + 1
        t0 = time.perf_counter()
        while True:
            # the positions not read yet, a long prompt READ_CHUNK at a time (each evaluated)
            end = min(last + 1, self.upto + READ_CHUNK)
            h = mx.concatenate([rows[p] for p in range(self.upto, end)], axis=0)[None]
            nxt = mx.array(context[self.upto + 1:end + 1])[None]
            x = self.head.features(h, nxt, cache=self.cache)
            self.head_passes += 1
            self.upto = end
            if end > last:
                break
            mx.eval(self.cache.keys, self.cache.values)
        if catch_up:
            mx.eval(x)
            self.catchup_s = time.perf_counter() - t0
        self.target.keep_from = self.upto
        x = x[:, -1:]
        return self.head.logits(x)[0, -1], x

    def pick(self, logits: mx.array, target_dist):
        """The drafted token (argmax, or sampled from the head's filtered distribution) and that distribution."""
        if target_dist is None:
            return int(mx.argmax(logits).item()), None
        q = target_dist(logits[None])[0]
        return int(mx.random.categorical(mx.log(q)).item()), q

    def propose(self, context: list[int], k: int, target_dist=None) -> tuple[list[int], list | None]:
        k = min(k, self.draft_len)
        logits, x = self._read(context)
        committed = self.cache.offset
        out, dists = [], []
        for i in range(k):
            t, q = self.pick(logits, target_dist)
            out.append(t)
            if q is not None:
                dists.append(q)
            if i < k - 1:
                x = self.head.features(x, mx.array([[t]]), cache=self.cache)
                self.head_passes += 1
                logits = self.head.logits(x)[0, -1]
        extra = self.cache.offset - committed
        if extra:
            self.cache.trim(extra)          # chained guesses: the next propose reads the verified positions
        return out, (dists if target_dist is not None else None)


# ---- loading ------------------------------------------------------------------------------------
@dataclass
class LoadedHead:
    head: object
    path: Path               # the file the head came from (the model's own, or a sibling)
    model: object            # the target it is attached to (identity: a new load makes it stale)
    head_path: str | None    # what the request named (None: the model's own or its sibling by name)
    note: str


def head_bytes(g, layer: int) -> int:
    """Bytes of the head's own tensors (blk.{layer}.*) as the loader holds them (float16 upper bound for
    unquantized ones counted by engine/memory_estimate.tensor_bytes)."""
    h = read_header(g.path)
    return sum(tensor_bytes(t, 4) for t in h.tensors if t.name.startswith(f"blk.{layer}."))


def find_head_file(model_path: Path, g) -> Path | None:
    """The model's own file when it has a head; else a sibling mtp-*.gguf beside it, found by name:
    one that names the model's file stem, else the only mtp-*.gguf there."""
    if int(g.arch_key("nextn_predict_layers") or 0) > 0:
        return model_path
    sibs = sorted(p for p in model_path.parent.glob("mtp-*.gguf") if p.is_file())
    named = [p for p in sibs if model_stem(model_path).lower() in p.stem.lower()]   # a split set: its name
    if named:
        return named[0]
    return sibs[0] if len(sibs) == 1 else None


def load_mtp(model_path: Path, model, dtype, head_path: str | None = None, log=lambda s: None,
             admit=None) -> LoadedHead:
    """The head for the loaded target at `model_path`: from `head_path` (mtp:PATH), else the model's
    own nextn.* tensors, else a sibling mtp-*.gguf. One-line refusals (RequestError / ModelFileError);
    `admit(nbytes)` (the memory guard) runs before a sibling's tensors are read."""
    target = open_gguf(model_path)
    gemma4 = target.architecture == "gemma4"
    if target.architecture not in ("qwen35", "qwen35moe") and not gemma4:
        raise RequestError(f"speculative mtp: {model_path.name} ({target.architecture}) has no NextN/MTP head "
                           "support here (qwen35/qwen35moe, and gemma4 with its drafter file)")
    if head_path:
        try:
            p = resolve_model(head_path)
        except OSError as e:
            raise RequestError(f"mtp head: {e.strerror or e}") from None
    else:
        p = find_head_file(model_path, target)
        if p is None:
            raise RequestError(f"speculative mtp: {model_path.name} has no mtp-*.gguf beside it (Gemma 4's "
                               "drafter: llama.cpp's gemma4-assistant GGUF)" if gemma4 else
                               f"speculative mtp: {model_path.name} has no NextN head "
                               f"({target.architecture}.nextn_predict_layers is 0) and no mtp-*.gguf beside it")
    sibling = p.resolve() != model_path.resolve()
    if gemma4:          # the drafter is its own file (engine/model/archs/gemma4_mtp.py)
        if not sibling:
            raise RequestError(f"speculative mtp: {p.name} is the model itself; Gemma 4's drafter is a separate "
                               "gemma4-assistant GGUF")
        try:
            head, note = load_sibling(p, model, target, dtype=dtype, admit=admit)
        except ModelFileError as e:
            raise ModelFileError(f"speculative mtp: {e}") from None
        log(f"MTP head: {note} ({p.name})")
        return LoadedHead(head, p, model, head_path, f"{note} ({p.name})")
    g = open_gguf(p) if sibling else target
    if sibling and admit is not None:
        check_matches(g, target)               # refused by name before any byte is admitted
        layer = int(g.arch_key("block_count") or 0) - int(g.arch_key("nextn_predict_layers") or 0)
        admit(head_bytes(g, layer))
    try:
        head, info = load_head(g, model, dtype=dtype, target_g=target if sibling else None)
    except ModelFileError as e:
        raise ModelFileError(f"speculative mtp: {e}") from None
    note = f"{info.note} ({p.name})"
    log(f"MTP head: {note}")
    return LoadedHead(head, p, model, head_path, note)
