"""Speculative decoding: draft a few tokens cheaply, check them all in one forward pass of the target.

Three drafters:
* prompt lookup (`lookup`): the continuation of the most recent earlier occurrence of the last
  NGRAM_MAX..NGRAM_MIN tokens of the conversation (prompt + reply so far). No second model; it pays
  off when the reply repeats the prompt (editing, quoting, code rewrites).
* a draft model (`draft:PATH`): a second, smaller GGUF with the same vocabulary, run unsteered with
  its own K/V, kept in step with the target's by trimming to the common prefix before each draft.
* the model's own NextN/MTP head (`mtp`, `mtp:PATH`): drafts from the target's last hidden state
  (engine/generation/mtp_spec.py: the head, its K/V and the tap that keeps the target's hidden states).

Verification (one target pass over [pending, d1..dk]):
* greedy: accept drafts while they equal the target's argmax; then the target's own token. The
  output is the non-speculative greedy output, token for token.
* sampled: standard speculative rejection sampling (Leviathan et al. 2023, Chen et al. 2023): accept
  d_i with probability min(1, p(d_i)/q(d_i)), on rejection sample from norm(max(0, p - q)); if all are
  accepted, sample a bonus token from p. For lookup drafts q is a point mass on d_i, so acceptance is
  p(d_i) and the residual is p with d_i removed. The output follows the target's distribution
  (p is the target's distribution after the request's processors, top-p/min-p/top-k and temperature,
  exactly what the non-speculative sampler draws from).

Bookkeeping: `fed` is exactly what the target's K/V holds. Rejected drafts are trimmed from the cache
and from `fed` at once; if the consumer stops mid-way through an accepted run (EOS, a stop string,
cancel), closing the generator trims the K/V back to the tokens actually delivered, so parking and
session files hold only accepted, delivered tokens. "Trimmed" goes through the cache contract
(engine/cache/layer_cache.py rollback): a trim for full K/V; for a cache that cannot trim (a recurrent state,
a sliding window the pass wrapped) the layers snapshotted before the verify pass are restored and the
accepted tokens fed again.

Never slower: the first PLAIN_FIRST passes of a request are plain one-token steps, timing the
baseline. From the MIN_JUDGE-th drafting pass on, the last (up to WINDOW) drafting passes are judged
after each verify pass: tokens/s below the plain baseline (below EARLY_MARGIN of it while fewer than
WINDOW passes are in) (the fastest plain pass, or this model's
plain decode speed from an earlier reply when that is faster; with no baseline, acceptance below
MIN_ACCEPTANCE) and the request stops speculating and finishes in the ordinary (pipelined) decode
loop. A pass with no n-gram match is a plain one-token step (without the plain loop's pipelining);
after MAX_IDLE of them in a row the request also finishes in the plain loop. The reply's
`speculation_stopped` says which rule fired.

Verdicts are remembered per target model + draft model + greedy/sampled (`Verdicts`, held by the
engine): once speculation with a draft model was slower than plain decoding, later replies with that
pair decode plain from the start and say so, instead of paying for the trial again. (Lookup drafts
depend on the text, so lookup is judged per request only.)

A draft model that lacks much of the conversation (a restored or parked chat, another tab's turn)
reads it first only when that pays: with `gap` tokens to read at the draft's measured seconds per
prompt token (its first SIZE_PROBE tokens are read to measure it), the read must cost less than what
speculation can save in this reply, min(tokens left, SAVING_HORIZON) x the plain pass time x
(1 - 1/S), S being the pair's measured speedup from earlier replies (ASSUMED_SPEEDUP before there is
one). Otherwise the reply finishes in the plain loop, and `speculation_stopped` says what the read
would have cost.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import mlx.core as mx
import xxhash
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p

from engine.device import on_gpu
from engine.errors import Cancelled, RequestError
from engine.cache import layer_cache
from engine.generation import generate
from engine.generation.generate import PrefillPace, prefill
from engine.model.gguf_file import open_gguf
from engine.model.model_loader import load_model
from engine.model.models import resolve_model
from engine.text.image_tokens import text_only

# Prompt lookup: the longest suffix n-gram (NGRAM_MAX down to NGRAM_MIN tokens) that occurred before
# proposes the tokens that followed it. n = 1 matches are mostly noise on chat text; longer than 4
# rarely finds more than 3-4 does. See bench/README.md ("Speculative decoding") for the tuning runs.
NGRAM_MAX = 4
NGRAM_MIN = 2
# Tokens proposed per verify pass. On a GPU a pass over 9 tokens costs about what a pass over 1
# does (decode is memory-bound); on MLX's CPU backend it does not (SmolLM2-135M, 2 vCPUs: 1 token
# 0.36 s, 2: 0.56 s, 4: 0.94 s, 8: 2.9 s), so drafts there are kept short.
LOOKUP_DRAFT_GPU = 8
LOOKUP_DRAFT_CPU = 3
MODEL_DRAFT = 4            # draft model: each drafted token also costs a draft-model step
# "Never slower": judged over the last WINDOW passes that carried a draft. When plain one-token
# passes were timed in this request, speculation stops once its tokens/s over the window fall below
# the plain passes' (the fastest plain pass: noise on a busy machine errs towards speculating less);
# without a plain timing, once acceptance falls below MIN_ACCEPTANCE.
WINDOW = 8
MIN_JUDGE = 3              # drafting passes before the first judgement (a slow draft costs little)
EARLY_MARGIN = 0.8         # before a full WINDOW, stop only below this share of the plain speed (noise)
MIN_ACCEPTANCE = 0.25
PLAIN_FIRST = 2            # the first passes of a request are plain: they time the baseline
# Passes without any draft (no n-gram match) are plain decode steps, minus the plain loop's
# pipelining: after this many in a row the request finishes in the plain loop.
MAX_IDLE = 32
# The draft's catch-up rule (module docstring): gaps up to FREE_GAP tokens are read without asking.
FREE_GAP = 32
SIZE_PROBE = 16
SAVING_HORIZON = 256
ASSUMED_SPEEDUP = 2.0
# Tests of the drafting mechanics (tiny models, where speculation never pays) turn these two off.
REMEMBER = True            # keep verdicts across replies
CATCH_UP_RULE = True       # the draft's catch-up rule


@dataclass
class SpecMode:
    kind: str = "off"                # "off" | "lookup" | "draft" | "mtp"
    draft_path: str | None = None    # draft: the draft GGUF; mtp: a sibling head file (None: found by name)

    @property
    def label(self) -> str:
        if self.kind in ("draft", "mtp") and self.draft_path:
            return f"{self.kind}:{self.draft_path}"
        return self.kind


def parse_spec(text: str | None) -> SpecMode:
    """'off' | 'lookup' | 'draft:PATH' | 'mtp' | 'mtp:PATH' (RequestError otherwise)."""
    t = (text or "off").strip()
    if t in ("off", "none", ""):
        return SpecMode()
    if t == "lookup":
        return SpecMode("lookup")
    if t.startswith("draft:") and t[6:].strip():
        return SpecMode("draft", t[6:].strip())
    if t == "mtp":
        return SpecMode("mtp")
    if t.startswith("mtp:") and t[4:].strip():
        return SpecMode("mtp", t[4:].strip())
    raise RequestError(f"speculative must be off, lookup or draft:PATH, or mtp[:PATH] (got {text!r})")


@dataclass
class SpecStats:
    mode: str = "off"
    drafted: int = 0
    accepted: int = 0
    passes: int = 0                  # verify passes that carried a draft
    stopped: str = ""                # why speculation stopped for this request ("" = it did not)
    idle: int = 0                    # consecutive passes without a draft
    recent: deque = field(default_factory=lambda: deque(maxlen=WINDOW))   # (drafted, accepted, seconds)
    plain_s: float = 0.0             # the fastest plain one-token pass (0: none timed yet)
    plain_tps_hint: float = 0.0      # this model's plain decode tok/s from an earlier reply (0: none)
    slower: bool = False             # stopped because speculating was slower than plain decoding
    speedup_hint: float = 0.0        # this model + draft's speedup measured in an earlier reply (0: none)

    def record(self, drafted: int, accepted: int, seconds: float = 0.0) -> None:
        self.drafted += drafted
        self.accepted += accepted
        self.passes += 1
        self.recent.append((drafted, accepted, seconds))

    def record_plain(self, seconds: float) -> None:
        self.plain_s = seconds if not self.plain_s else min(self.plain_s, seconds)

    def plain_tps(self) -> float:
        """The plain decoding speed speculation must beat (0: not known)."""
        return max(1.0 / self.plain_s if self.plain_s else 0.0, self.plain_tps_hint)

    def spec_tps(self) -> float:
        t = sum(x[2] for x in self.recent)
        return (sum(x[1] for x in self.recent) + len(self.recent)) / t if t > 0 else 0.0

    def too_low(self) -> str:
        """Why speculation should stop now ('' = keep going)."""
        if len(self.recent) < MIN_JUDGE:
            return ""
        d = sum(x[0] for x in self.recent)
        a = sum(x[1] for x in self.recent)
        n = len(self.recent)
        plain_tps, spec_tps = self.plain_tps(), self.spec_tps()
        if plain_tps and spec_tps:
            if spec_tps < plain_tps * (1.0 if n >= WINDOW else EARLY_MARGIN):
                self.slower = True
                return (f"{spec_tps:.1f} tok/s speculating vs {plain_tps:.1f} plain over the last "
                        f"{n} drafts (accepted {a}/{d})")
            return ""
        if n >= WINDOW and d > 0 and a / d < MIN_ACCEPTANCE:
            return f"acceptance {a}/{d} over the last {n} drafts"
        return ""

    @property
    def rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    def log_suffix(self) -> str:
        if self.mode == "off":
            return ""
        return (f", speculative {self.mode}: {self.accepted}/{self.drafted} drafts accepted"
                + (f" (stopped: {self.stopped})" if self.stopped else ""))

    def result(self) -> dict:
        return {"speculative": self.mode, "drafted_tokens": self.drafted, "accepted_tokens": self.accepted,
                "acceptance_rate": round(self.rate, 4), "speculation_stopped": self.stopped}


class Verdicts:
    """What earlier replies measured, per (target, draft, greedy/sampled): plain decode tok/s per target,
    and for each pair whether speculating was slower (then later replies skip it) or its speedup."""

    def __init__(self):
        self.plain_tps: dict[str, float] = {}      # target -> plain decode tok/s of its latest plain reply
        self.pairs: dict[tuple, dict] = {}         # key -> {"slower": why} or {"speedup": x}

    def note_plain(self, target: str, tps: float) -> None:
        if tps > 0:
            self.plain_tps[target] = tps

    def slower(self, key) -> str:
        """Why this pair is off ('' = try it)."""
        return self.pairs.get(key, {}).get("slower", "") if REMEMBER else ""

    def speedup(self, key) -> float:
        return self.pairs.get(key, {}).get("speedup", 0.0)

    def record(self, key, spec: "SpecStats") -> None:
        if spec.slower:
            self.pairs[key] = {"slower": spec.stopped}
        elif spec.passes >= MIN_JUDGE and not spec.stopped:
            plain = spec.plain_tps()
            if plain > 0:
                self.pairs[key] = {"speedup": spec.spec_tps() / plain}


# ---- drafters ---------------------------------------------------------------------------------
class LookupDrafter:
    """Prompt-lookup drafts from an n-gram index kept up to date as the context grows.

    A prompt with images holds image spans (runs of one negative pseudo-token id,
    engine/text/image_tokens.py): they have no embedding row a verify pass could feed, and a run's
    n-grams (the same id repeated) would only ever propose more of the run. So no n-gram with an image
    id is a key, and a draft ends before the first image id it would copy; the text around an image
    drafts as any text does."""

    def __init__(self, ngram_max: int = NGRAM_MAX, ngram_min: int = NGRAM_MIN, draft_len: int | None = None):
        if draft_len is None:
            draft_len = LOOKUP_DRAFT_GPU if on_gpu() else LOOKUP_DRAFT_CPU
        self.ngram_max, self.ngram_min, self.draft_len = ngram_max, ngram_min, draft_len
        self.tokens: list[int] = []
        # n-gram -> end index of its most recent occurrence that is not the current suffix
        self.index: dict[tuple, int] = {}
        self.indexed = 0             # positions < indexed have their n-grams (ending there) in `index`

    def _sync(self, context: list[int]) -> None:
        if self.tokens != context[:len(self.tokens)]:
            self.tokens, self.index, self.indexed = [], {}, 0
        self.tokens.extend(context[len(self.tokens):])
        # Index every position but the last: the suffix must find an *earlier* occurrence.
        for end in range(self.indexed, len(self.tokens) - 1):
            for n in range(self.ngram_min, self.ngram_max + 1):
                if end + 1 >= n:
                    gram = tuple(self.tokens[end + 1 - n:end + 1])
                    if min(gram) >= 0:
                        self.index[gram] = end
        self.indexed = max(self.indexed, len(self.tokens) - 1)

    def propose(self, context: list[int], k: int) -> tuple[list[int], None]:
        self._sync(context)
        toks = self.tokens
        for n in range(self.ngram_max, self.ngram_min - 1, -1):
            if len(toks) < n:
                continue
            end = self.index.get(tuple(toks[-n:]))
            if end is not None:
                draft = toks[end + 1:end + 1 + min(k, self.draft_len)]
                return draft[:next((i for i, t in enumerate(draft) if t < 0), len(draft))], None
        return [], None


class DraftModel:
    """A second model with the target's vocabulary; owns its K/V, kept in step by prefix trimming."""

    def __init__(self, path: Path, model, vocab_hash: str, n_ctx: int, target_path: Path | None = None):
        self.path, self.model, self.vocab_hash, self.n_ctx = path, model, vocab_hash, n_ctx
        self.target_path = target_path
        self.cache = make_prompt_cache(model)
        self.fed: list[int] = []
        # A draft whose cache cannot trim (a recurrent state, a window) keeps a checkpoint where each
        # propose starts drafting, so undoing its rejected drafts costs a restore, not a re-read
        # (engine/cache/layer_cache.py; always empty for full K/V).
        self.checkpoints: list = []
        self.draft_len = MODEL_DRAFT
        self.pace = PrefillPace(len(self.cache))   # its prompt-reading speed (the catch-up rule)
        self.catchup_s = 0.0                       # time the last propose spent reading a gap

    def _common(self, context: list[int]) -> int:
        n = 0
        m = min(len(self.fed), len(context) - 1)    # always evaluate at least the last token
        while n < m and self.fed[n] == context[n]:
            n += 1
        return n

    def _cut_to(self, n: int) -> int:
        """Cut the draft's K/V back to at most n tokens (engine/cache/layer_cache.py: a trim, else its
        latest checkpoint at or before n, else from scratch): tokens held."""
        if len(self.fed) > n:
            self.cache, n = layer_cache.rewind(self.cache, len(self.fed), n, self.checkpoints,
                                               lambda: make_prompt_cache(self.model))
            del self.fed[n:]
        return len(self.fed)

    def gap(self, context: list[int]) -> int:
        """How many tokens of `context` the draft would read before drafting."""
        return len(context) - self._common(context)

    def read(self, context: list[int], upto: int, cancelled=lambda: False) -> None:
        """Read context[:upto] into the draft's K/V (timed into `pace`; generate.Cancelled on a cancel)."""
        n = self._cut_to(self._common(context))
        if upto > n:
            t0 = time.perf_counter()
            prefill(self.model, self.cache, context[n:upto], self.fed, pace=self.pace, cancelled=cancelled)
            self.catchup_s += time.perf_counter() - t0

    def _catch_up(self, context: list[int]) -> mx.array:
        """Feed the draft model the context it lacks; logits for the token after `context`."""
        if self.gap(context) > 2:                   # a long gap (a new prompt): chunked, timed
            self.read(context, len(context) - 1)
        n = self._cut_to(self._common(context))
        rest = context[n:]
        logits = self.model(mx.array(rest)[None], cache=self.cache)[0, -1]
        self.fed.extend(rest)
        return logits

    def propose(self, context: list[int], k: int, target_dist=None) -> tuple[list[int], list | None]:
        """k draft tokens; with sampling, also the draft distributions they were drawn from."""
        k = min(k, self.draft_len)
        self.catchup_s = 0.0
        logits = self._catch_up(context)
        layer_cache.add_checkpoint(self.checkpoints, self.cache, len(self.fed))   # none for full K/V
        out, dists = [], []
        for i in range(k):
            if target_dist is None:
                t = int(mx.argmax(logits).item())
            else:
                q = target_dist(logits[None])[0]
                t = int(mx.random.categorical(mx.log(q)).item())
                dists.append(q)
            out.append(t)
            if i < k - 1:
                logits = self.model(mx.array([t])[None], cache=self.cache)[0, -1]
                self.fed.append(t)
        return out, (dists if target_dist is not None else None)


def vocab_hash(gguf) -> str:
    """Hash of the whole token list (and its types): drafts are only meaningful over the same ids."""
    h = xxhash.xxh3_64()
    for t in gguf.get("tokenizer.ggml.tokens") or []:
        h.update(str(t).encode("utf-8", "surrogatepass") + b"\0")
    types = gguf.get("tokenizer.ggml.token_type")
    if types is not None:
        h.update(bytes(str(list(types)), "ascii"))
    return h.hexdigest()


def load_draft(path: str, target_gguf_path: Path, dtype, n_ctx: int, log=lambda s: None,
               admit=None) -> DraftModel:
    """Load a draft GGUF beside the target, refusing one whose vocabulary differs (by name);
    `admit(path)` (the engine's memory estimate and guard) runs before any tensor is read."""
    p = resolve_model(path)
    g = open_gguf(p)
    target = open_gguf(target_gguf_path)
    ours, theirs = vocab_hash(target), vocab_hash(g)
    if ours != theirs:
        n_t = len(target.get("tokenizer.ggml.tokens") or [])
        n_d = len(g.get("tokenizer.ggml.tokens") or [])
        raise RequestError(f"draft model {p.name} has another vocabulary than {target_gguf_path.name} "
                           f"({n_d} vs {n_t} tokens, token lists differ): it cannot draft for it")
    if admit is not None:
        admit(p)
    model, info = load_model(g, dtype=dtype)
    log(f"draft model: {p.name} ({info.architecture}, {info.n_layer} layers, "
        f"{info.n_params / 1e6:.0f}M params), same vocabulary as the target")
    return DraftModel(p, model, ours, n_ctx, Path(target_gguf_path))


# ---- verification -----------------------------------------------------------------------------
def target_distribution(sampling):
    """logprobs (rows, V) -> the probabilities the request's sampler draws from (temperature > 0)."""
    temp, top_p, min_p, top_k = sampling.temperature, sampling.top_p, sampling.min_p, sampling.top_k

    def dist(logits: mx.array) -> mx.array:
        lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        # the same filters, in the same order, as mlx_lm.sample_utils.make_sampler
        if 0 < top_p < 1.0:
            lp = apply_top_p(lp, top_p)
        if min_p != 0.0:
            lp = apply_min_p(lp, min_p, 1)
        if top_k > 0:
            lp = apply_top_k(lp, top_k)
        return mx.softmax(lp * (1.0 / temp), axis=-1)
    return dist


def verify(logits: mx.array, draft: list[int], dist=None, draft_dists: list | None = None) -> tuple[int, int]:
    """(number of drafts accepted, the target's next token) from target logits (len(draft)+1, V).

    dist None: greedy. Otherwise rejection sampling against `dist(logits)`, with draft
    distributions `draft_dists` (None: point masses, i.e. lookup drafts)."""
    if dist is None:
        best = mx.argmax(logits, axis=-1).tolist()
        n = 0
        while n < len(draft) and draft[n] == best[n]:
            n += 1
        return n, best[n]
    p = dist(logits)                                        # (k+1, V)
    k = len(draft)
    if k:
        d = mx.array(draft)
        p_d = mx.take_along_axis(p[:k], d[:, None], axis=-1)[:, 0]
        if draft_dists is None:
            ratio = p_d
        else:
            q = mx.stack(draft_dists)
            q_d = mx.take_along_axis(q, d[:, None], axis=-1)[:, 0]
            ratio = mx.minimum(1.0, p_d / mx.maximum(q_d, 1e-20))
        u = mx.random.uniform(shape=(k,))
        ok = (u < ratio).tolist()
    else:
        ok = []
    n = 0
    while n < k and ok[n]:
        n += 1
    if n == k:
        return n, int(mx.random.categorical(mx.log(p[k])).item())
    if draft_dists is None:
        residual = p[n] * (mx.arange(p.shape[-1]) != draft[n])
    else:
        residual = mx.maximum(p[n] - draft_dists[n], 0.0)
    total = mx.sum(residual)
    if total.item() <= 0:       # p == q exactly: any sample of p is right
        residual, total = p[n], mx.array(1.0)
    return n, int(mx.random.categorical(mx.log(residual / total)).item())


# ---- the loop ---------------------------------------------------------------------------------
def _draft_gap_too_costly(drafter: DraftModel, context: list[int], left: int, spec: SpecStats,
                          cancelled) -> str:
    """The catch-up rule (module docstring): '' when the draft may read what it lacks of `context`
    (read here, the first SIZE_PROBE tokens measuring its speed when that is not known yet), else why
    not. generate's Cancelled on a cancel."""
    gap = drafter.gap(context)
    if not CATCH_UP_RULE or gap <= FREE_GAP or not spec.plain_tps():
        return ""
    have = len(context) - gap
    if not drafter.pace.s_per_token:
        drafter.read(context, have + SIZE_PROBE, cancelled)
        gap -= SIZE_PROBE
    cost = gap * drafter.pace.s_per_token
    speedup = spec.speedup_hint or ASSUMED_SPEEDUP
    saving = min(left, SAVING_HORIZON) / spec.plain_tps() * max(0.0, 1.0 - 1.0 / speedup)
    if cost > saving:
        return (f"the draft model would read {gap} tokens of the conversation first (~{cost:.1f} s) "
                f"to save at most ~{saving:.1f} s in this reply")
    drafter.read(context, len(context) - 1, cancelled)
    return ""



def _account(spec: SpecStats, draft: list[int], n_ok: int, seconds: float, delivered: int, drafting: bool) -> None:
    """One verify pass in the reply's speculation figures: a drafted pass's acceptance and time, or a
    plain pass's time (the baseline) and, where a draft was due, one more pass without one."""
    if draft:
        spec.record(len(draft), n_ok, seconds)
        spec.idle = 0
        return
    if delivered > 0:       # the first pass carries set-up costs: not a fair baseline
        spec.record_plain(seconds)
    if drafting:
        spec.idle += 1


def _propose(drafter, context: list[int], room: int, dist, constraint):
    """(draft, its distributions or None, seconds of catch-up reading not to count against the pass).
    Under a grammar the draft is cut at its first refused token (kept for sampled drafts: verification
    rejects it with certainty)."""
    catchup = 0.0
    if isinstance(drafter, DraftModel):
        draft, draft_dists = drafter.propose(context, room, dist)
        catchup = drafter.catchup_s     # a gap read is judged by the catch-up rule, not here
    elif getattr(drafter, "samples_drafts", False):     # the MTP head: drafts from q
        draft, draft_dists = drafter.propose(context, room, dist)
        catchup = drafter.catchup_s     # its first read of the prompt: once, not per pass
    else:
        draft, draft_dists = drafter.propose(context, room)
    if constraint is not None and draft:
        n_keep = constraint.valid_prefix(draft)
        if draft_dists is not None and n_keep < len(draft):
            n_keep += 1
        draft = draft[:n_keep]
        draft_dists = draft_dists[:n_keep] if draft_dists is not None else None
    return draft, draft_dists, catchup


def _verify_logits(model, cache, inputs: list[int], draft: list[int], context: list[int], processors, constraint):
    """The verify pass's (k+1, V) logits: the target over `inputs`, each row through the logits
    processors with its own context, masked by the grammar after that row's draft prefix (the masks
    computed on the CPU while the pass runs)."""
    logits = model(mx.array(inputs)[None], cache=cache)[0]        # (k+1, V)
    allowed = None
    if constraint is not None:
        mx.async_eval(logits)
        allowed, _ = constraint.draft_masks(draft, logits.shape[-1], keep_refused=True)
    if processors:
        rows, text = [], text_only(context)
        for i in range(len(inputs)):
            row = logits[i:i + 1]
            ctx = mx.array(text + draft[:i])
            for proc in processors:
                row = proc(ctx, row)
            rows.append(row)
        logits = mx.concatenate(rows, axis=0)
    if allowed is not None:
        logits = mx.where(mx.array(allowed), logits, mx.array(-float("inf"), dtype=logits.dtype))
    return logits


def decode(model, cache, last_token: int, fed: list[int], *, history: list[int], sampling, processors,
           max_tokens: int, stats, spec: SpecStats, drafter, seed: int | None = None,
           cancelled=lambda: False, constraint=None) -> Iterator[int]:
    """Like generate.decode (same arguments, same `fed` contract), drafting with `drafter`.
    `constraint` (engine/generation/constraints.py): drafts are cut at the grammar's first refused token (kept
    for a draft model's sampled drafts: verification rejects it with certainty) and each verify row
    is masked by the grammar after that row's draft prefix."""
    if seed is not None:
        mx.random.seed(seed)
    context = list(history)
    dist = target_distribution(sampling) if sampling.temperature > 0 else None
    pending = last_token
    delivered = 0
    gap_checked = not isinstance(drafter, DraftModel)
    snap = None

    def replay(k: int) -> None:
        """Feed again the first k tokens the last verify pass fed (after its snapshot is restored)."""
        start = snap.n
        if k > 0:
            model(mx.array(fed[start:start + k])[None], cache=cache)
            mx.eval(layer_cache.arrays(cache))

    try:
        while delivered < max_tokens:
            if cancelled():
                return
            why = spec.too_low() or (f"no draft in {MAX_IDLE} tokens" if spec.idle >= MAX_IDLE else "")
            if why:
                spec.stopped = why
                break
            room = max_tokens - delivered - 1     # the pass itself yields one token beyond the drafts
            if not gap_checked and room > 0 and delivered >= PLAIN_FIRST:
                gap_checked = True
                try:
                    why = _draft_gap_too_costly(drafter, context, max_tokens - delivered, spec,
                                                cancelled)
                except Cancelled:
                    return
                if why:
                    spec.stopped = why
                    break
            t0 = time.perf_counter()
            draft, draft_dists, catchup = [], None, 0.0
            if room > 0 and delivered >= PLAIN_FIRST:
                draft, draft_dists, catchup = _propose(drafter, context, room, dist, constraint)
            inputs = [pending] + draft
            # A cache that cannot trim back (a recurrent state; a window the pass may wrap) is
            # snapshotted first: rejected drafts are then undone by restoring the snapshot and feeding
            # the accepted tokens again (layer_cache.rollback). None for full K/V: a trim, as before.
            snap = layer_cache.snapshot(cache, len(fed))
            logits = _verify_logits(model, cache, inputs, draft, context, processors, constraint)
            fed.extend(inputs)
            n_ok, nxt = verify(logits, draft, dist, draft_dists)
            if constraint is not None:
                constraint.advance_all(draft[:n_ok] + [nxt])
            _account(spec, draft, n_ok, time.perf_counter() - t0 - catchup, delivered,
                     drafting=room > 0 and delivered >= PLAIN_FIRST)
            rejected = len(draft) - n_ok
            if rejected:
                layer_cache.rollback(cache, len(fed), rejected, snap, replay)
                del fed[len(fed) - rejected:]
            pending = nxt
            for t in draft[:n_ok] + [nxt]:
                if delivered == 0:
                    stats.t_first = time.perf_counter()
                context.append(t)
                delivered += 1
                yield t
                if delivered >= max_tokens:
                    return
        if delivered >= max_tokens:
            return
        # Speculation stopped paying: finish in the ordinary decode loop (pipelined, no drafts).
        snap = None                 # it leaves the cache holding exactly `fed`: nothing to undo after
        sub = generate.StepStats()
        n_vocab = getattr(getattr(model, "args", None), "vocab_size", None)
        for t in generate.decode(model, cache, pending, fed, history=context, sampler=sampling.sampler(n_vocab),
                                 processors=processors, max_tokens=max_tokens - delivered, stats=sub,
                                 seed=None, cancelled=cancelled, constraint=constraint):
            context.append(t)
            delivered += 1
            yield t
    finally:
        # A consumer that stops mid-run (EOS, stop string, cancel) closes the generator: the K/V must
        # not keep accepted drafts it never delivered.
        extra = len(fed) - len(context)
        if extra > 0:
            layer_cache.rollback(cache, len(fed), extra, snap, replay)
            del fed[len(fed) - extra:]
