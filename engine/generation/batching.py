"""Continuous batching: the live generate requests' decode steps as one forward pass.

The engine thread runs `run(engine, first)` while any generate request is live. Each request is a
`Row`: its turn is prepared and ended exactly as a lone request's (`begin_turn`/`end_turn` in
engine/handlers.py), its conversation's K/V is taken from parking as a unit, checked out while the
reply runs (`Conversations.check_out`) and given back whole (`check_in`), so what is parked, saved
or written to the disk tier afterwards is the same as if it had run alone.

How the K/V of several rows is stepped together: left padding, mlx-lm's `BatchKVCache`
(mlx_lm/models/cache.py, the cache of mlx-lm's own BatchGenerator), rather than per-sequence caches
merged at every step. Merging per step would copy every row's whole K/V into one padded array for
each step (O(rows x context) per token), or run attention once per row (rows x layers small kernels
a step: the launch overhead that batching exists to amortise on a GPU). Left padding copies a row's
K/V once when it joins (`merge`/`extend`) and once when it leaves (`extract`, back to the plain
`KVCache` that parking, sessions and the disk tier hold); in between a step is one model call with
one (rows, 1) input, and mlx-lm's models already take BatchKVCache's per-row offsets (RoPE) and
padding mask. Its cost: padding up to the longest row's length (memory, asked of the guard before a
row joins) and the copies at join/leave. While one row is alone it runs on its own `KVCache`, the
very path of a lone request (`generate.decode`'s step), so a lone request's numbers do not change.
Models with sliding windows (Gemma 3/4, gpt-oss) or recurrent states (Qwen3.5) batch the same way,
each layer in its own batch form (BatchRotatingKVCache; ArraysCache holding the rows' states, masked
past each row's length in a padded read). Such a cache cannot be cut back, so a row takes its
checkpoints where a lone prefill does (its `cuts`), and a row whose last token the next step feeds
anyway has its state kept from before that step and restored when it leaves, so it holds what it
would hold alone (`_hand_back`).

The schedule, one iteration:
  1. queued requests are read without waiting: generate requests wait for a row (at most
     `EngineOptions.max_sequences` rows, and the memory guard's yes); `Status` and `CountTokens`
     are answered at once; a generate request that cannot be batched (speculative decoding, a
     constraint, quantized K/V) runs alone,
     to its end, between two steps; anything else (a load, a save, a restore, ...) is a barrier:
     nothing joins after it, and it is served once the rows have ended;
  2. rows that ended leave (their K/V extracted and handed back);
  3. one prefill chunk of the oldest row still reading its prompt (generate.prefill: the same
     chunk schedule, layer-by-layer cancel and progress on the CPU), so a long prompt never stalls
     the decoding rows for more than one chunk; rows whose prompt is in join. When nothing decodes
     and two or more prompts have not begun (requests sent together), a chunk of each of them goes
     in one padded pass instead (engine/generation/batch_prefill.py), and they start decoding at the same step;
     a prompt with image runs is read alone, chunk by chunk into its own cache, each image whole in a
     chunk of its own (engine/vision/spans.Vision.feed, as a lone prefill feeds it), then it joins as
     any row does (a follow-up whose image span is held reads only its new text, like a text row);
  4. one decode step for every decoding row: the step after it is queued on the device before the
     host reads this one's tokens (mlx-lm's pipelining), as `generate.decode` does.
Each row keeps its sampler, seed (its own key chain, the same draws as `mx.random.seed` gives a
lone request), repetition penalty context, stop strings, cancel and control-vector setting (the
steered rows are selected per row in engine/steer/steering.py's SteeredLayer: a row without the vector
gets the block's own output).
"""
from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field

import mlx.core as mx
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p

from engine.api import BatchCounters, CountTokens, GenerateRequest, Status
from engine.errors import Cancelled, EngineError, StrataError
from engine.events import Done, Failed, Handle, Progress, Token
from engine.cache import layer_cache
from engine.generation import generate
from engine.model.memory_estimate import estimate, read_header
from engine.generation.batch_prefill import GroupPrefill
from engine.generation.generate import FIRST_CHUNK, ReplyText, _stream, next_chunk, on_gpu, prefill
from engine.text.image_tokens import has_image_parts, has_images, image_runs, text_only

log = logging.getLogger("strata")

QUICK = (Status, CountTokens)   # answered between two steps: they read, never change, what is held


def counters(engine) -> BatchCounters:
    """The engine's batch counters (kept on its scheduler; Status reports a copy)."""
    sched = engine.scheduler
    if sched.batch_counters is None:
        sched.batch_counters = BatchCounters()
    return sched.batch_counters


# ---- which requests a batch takes ------------------------------------------------------------
def enabled(engine) -> bool:
    return getattr(engine.options, "max_sequences", 1) > 1 and not engine.serving.distributed


def batchable(engine, item) -> bool:
    """A generate request that can be a row: plain decoding on a model whose every layer cache mlx-lm's
    batch caches merge (16-bit K/V, sliding windows, recurrent states; not quantized K/V)."""
    if not isinstance(item, Handle) or not isinstance(item.request, GenerateRequest) or engine.model is None:
        return False
    req = item.request
    if req.constraint is not None or (req.speculative or "off") != "off":
        return False        # the rule: speculation and constrained decoding run alone (between steps)
    # A prompt with images is a row too: its image runs are fed into its own cache before it joins
    # (BatchLoop._prefill_chunk), so it decodes like any row with reused K/V. Not where the family
    # places the text after an image by the image's grid (Qwen's M-RoPE: the turn's positions are
    # shifted from the cache's offsets, set on the model for one lone turn, which a shared step cannot).
    if has_image_parts(req.messages) and not rows_take_images(engine):
        return False
    return cache_batches(engine)


def rows_take_images(engine) -> bool:
    """Whether a batch row can hold images: the loaded projector's images take as many text positions
    as tokens (every type but qwen3vl_merger)."""
    vision = engine.loaded.vision if engine.loaded is not None else None
    return vision is None or vision.tower.n_pos is None


def cache_batches(engine) -> bool:
    return _cache_facts(engine)[0]


def trims_freely(engine) -> bool:
    """Every layer can be cut back (full K/V only): no row's state needs a snapshot before its last step."""
    return _cache_facts(engine)[1]


def _cache_facts(engine) -> tuple[bool, bool]:
    memo = engine.scheduler.batch_memo
    got = memo.get("cache_facts")
    if got is None or got[0] is not engine.model or got[1] != engine.in_force.kv_bits:
        cache = engine.handlers.make_cache()
        facts = (not engine.kv_fmt.quantized and layer_cache.batchable(cache), not layer_cache.needs_checkpoints(cache))
        got = memo["cache_facts"] = (engine.model, engine.in_force.kv_bits, facts)
    return got[2]


def row_cost(engine) -> tuple[int, int]:
    """One row's cache: (bytes per token of the layers that grow with the context, fixed bytes: the
    windows' K/V and the recurrent states), from the load's own estimate (engine/model/memory_estimate.py: it
    knows the hybrid and Gemma layouts); every layer's K/V growing if the header cannot be read."""
    memo = engine.scheduler.batch_memo
    got = memo.get("row_cost")
    if got is None or got[0] is not engine.model:
        itemsize = mx.zeros((), dtype=engine.dtype).itemsize
        info = engine.info
        cost = (2 * info.n_layer * info.n_head_kv * info.head_dim * itemsize, 0)
        try:
            est = estimate(read_header(engine.loaded.path), 256, str(engine.dtype).rsplit(".", 1)[-1])
            cost = (est.kv_bytes_per_token, est.state_bytes + est.window_bytes)
        except Exception:  # noqa: BLE001 - the conservative count above stands
            log.debug("engine: no memory estimate for the batch's rows", exc_info=True)
        got = memo["row_cost"] = (engine.model, cost)
    return got[1]


# ---- one row -------------------------------------------------------------------------------------
@dataclass(eq=False)        # rows compare by identity (`in`, remove): their fields hold MLX arrays
class Row:
    handle: Handle
    turn: object                         # turns.Turn
    out: object                          # generate.ReplyText
    todo: list[int]                      # prompt tokens still to prefill (the last one is fed by a step)
    steered: bool
    sampler: object
    processors: list
    key: mx.array | None = None          # a seeded sampling row's own key chain
    ctx: mx.array | None = None          # the repetition penalty's context (prompt + reply so far)
    done: int = 0                        # of `todo`, prefilled
    n: int = 0                           # tokens generated
    t_prefill: float = 0.0
    ended: str = ""                      # "" while running; else why it leaves ("done", "cancelled", ...)
    cache: list = field(default_factory=list)   # its own KVCache per layer until it joins the batch
    last: mx.array | None = None         # its token of the last step built (lazy), for `ctx`
    pending: list[int] = field(default_factory=list)   # prompt tokens fed with its first step (GPU: below)
    first: int | None = None             # its first token, when sampled from its prompt's last pass
    unheld: int | None = None            # a token read but not held (its last, or a cancel's), which the
                                         # step built after it fed all the same
    snap: object = None                  # layer_cache.Checkpoint before its last token was fed (a cache
                                         # that cannot trim: windows, recurrent states)
    cuts: list[int] = field(default_factory=list)   # of `todo`, where a checkpoint is taken (such caches)
    runs: list[tuple[int, int]] = field(default_factory=list)   # of `todo`, its image runs (start, end):
                                         # each fed whole into the row's own cache before it joins
    images: dict = field(default_factory=dict)   # what feeding each run needs (Vision.hold), let go once fed

    @property
    def entry(self):
        return self.turn.entry

    def read_pending(self) -> None:
        """The prompt's held-back last part is prefilled with the rest (the row will not step alone); the
        prompt-read checkpoint moves to the new end."""
        if not self.pending:
            return
        if self.cuts:
            self.cuts = sorted({c for c in self.cuts if c < len(self.todo)} | {len(self.todo) + len(self.pending)})
        self.todo, self.pending = self.todo + self.pending, []

    @property
    def owner(self) -> str:
        return self.turn.req.conversation

    def sample(self, logits: mx.array, first: bool) -> mx.array:
        """This row's next token from its (1, vocab) logits, as generate.decode's step computes it."""
        if self.processors:
            if not first:
                self.ctx = mx.concatenate([self.ctx, self.last.astype(mx.int32)])
            for p in self.processors:
                logits = p(self.ctx, logits)
        logprobs = logits - mx.logsumexp(logits, keepdims=True)
        if self.key is None:
            y = self.sampler(logprobs)
        else:
            self.key, sub = mx.random.split(self.key)
            y = self.sampler(logprobs, sub)
        self.last = y
        return y


def seeded_sampler(sp, n_vocab: int):
    """mlx-lm's sampler chain (make_sampler: top_p, min_p, top_k, then categorical) with the key given
    per call: a row draws from its own seed's chain, the draws a lone request gets after
    mx.random.seed(seed) (that seeds the process-wide key, which rows share)."""
    top_k = 0 if sp.top_k >= n_vocab else sp.top_k
    temp = sp.temperature

    def sample(logprobs, key):
        if 0 < sp.top_p < 1.0:
            logprobs = apply_top_p(logprobs, sp.top_p)
        if sp.min_p != 0.0:
            logprobs = apply_min_p(logprobs, sp.min_p, 1)
        if top_k > 0:
            logprobs = apply_top_k(logprobs, top_k)
        return mx.random.categorical(logprobs * (1.0 / temp), key=key)
    return sample


# ---- the batch --------------------------------------------------------------------------------------
class Batch:
    """The rows stepping together and their K/V: the one row's own cache list while alone, else one
    batch cache per layer (BatchKVCache, BatchRotatingKVCache or a merged ArraysCache; row i of it is
    rows[i])."""

    def __init__(self, engine):
        self.engine = engine
        self.rows: list[Row] = []
        self.cache: list | None = None
        self.y: mx.array | None = None       # the last built step's tokens (lazy), one per row
        self.steps = 0

    def __len__(self) -> int:
        return len(self.rows)

    def length(self) -> int:
        """Cells per row of the batch's K/V (the longest row, with padding)."""
        if not self.rows:
            return 0
        # a window's or a recurrent state's size() is bounded (0 for the state): the longest layer counts
        return max(c.size() for c in self.cache)

    # -- membership (between steps) --
    def leave(self, gone: list[Row]) -> None:
        """Rows that ended give their K/V back as plain KVCache lists (trimmed to what they fed)."""
        if not gone:
            return
        keep = [i for i, r in enumerate(self.rows) if r not in gone]
        if len(self.rows) == 1:
            self.rows[0].cache = self.cache
        else:
            for i, r in enumerate(self.rows):
                if r in gone:
                    r.cache = [c.extract(i) for c in self.cache]
            if len(keep) == 1:          # alone again: its own KVCache, the lone request's path
                alone = self.rows[keep[0]]
                alone.cache = alone.entry.cache = [c.extract(keep[0]) for c in self.cache]
                self.cache = alone.cache
            elif keep:
                idx = mx.array(keep)
                for c in self.cache:
                    c.filter(idx)
        if self.y is not None:
            self.y = self.y[mx.array(keep)] if keep else None
        self.rows = [self.rows[i] for i in keep]
        if not self.rows:
            self.cache = None
        for r in gone:
            _hand_back(r)

    def join(self, row: Row) -> None:
        """A row whose prompt is in (all but its last token) steps from the next step on."""
        # each layer's own class merges it into its batch form (KVCache -> BatchKVCache, RotatingKVCache
        # -> BatchRotatingKVCache, ArraysCache -> ArraysCache of the rows' states)
        if not self.rows:
            self.cache = row.cache
        elif len(self.rows) == 1:
            self.cache = [a.merge([a, b]) for a, b in zip(self.cache, row.cache)]
        else:
            for c, mine in zip(self.cache, row.cache):
                c.extend(mine.merge([mine]))
        self.rows.append(row)
        if len(self.rows) > 1:
            # the batch holds the only copy of each row's K/V until the row leaves (extract): the
            # rows' own caches are let go, so a joining conversation is not held twice
            for r in self.rows:
                r.cache = r.entry.cache = []

    def join_group(self, rows: list[Row], cache: list) -> None:
        """Rows read together (batch_prefill.GroupPrefill: one BatchKVCache per layer) step from the next
        step on."""
        if not self.rows:
            self.cache = cache
        else:
            if len(self.rows) == 1:
                self.cache = [c.merge([c]) for c in self.cache]
            for c, theirs in zip(self.cache, cache):
                c.extend(theirs)
        self.rows.extend(rows)
        for r in self.rows:
            r.cache = r.entry.cache = []

    # -- one step --
    def build(self, joined: list[Row]) -> mx.array:
        """Queue one step for every row: from the previous step's (lazy) tokens, and a joining row's
        last prompt token. Returns the step's tokens (lazy)."""
        eng = self.engine
        if not trims_freely(eng):
            self._snapshot_last(joined)
        # a joining row feeds its prompt's last token, or the first token its prompt's pass gave it
        firsts = [r.turn.tokens[-1] if r.first is None else r.first for r in joined]
        merged = joined[0].pending if len(self.rows) == 1 and joined else []
        for r, t in zip(joined, firsts):
            r.entry.tokens.extend(r.pending)
            r.entry.tokens.append(t)
            r.pending = []
        parts = ([self.y] if self.y is not None else []) + ([mx.array(firsts)] if firsts else [])
        inputs = parts[0] if len(parts) == 1 else mx.concatenate(parts)
        inputs = mx.array(merged + firsts)[None] if merged else inputs[:, None]   # (rows, tokens)
        st = eng.steering
        steered = [r.steered for r in self.rows]
        with mx.stream(_stream()):
            if st is not None:
                st.speed_projection = any(steered)
                st.rows = mx.array(steered)[:, None, None] if len(self.rows) > 1 and any(steered) \
                    and not all(steered) else None
            try:
                logits = eng.model(inputs, cache=self.cache)[:, -1, :]
            finally:
                if st is not None:
                    st.rows = None
            n_old = len(self.rows) - len(joined)
            if all(_plain_greedy(r) for r in self.rows):
                y = mx.argmax(logits - mx.logsumexp(logits, axis=-1, keepdims=True), axis=-1)
            else:
                y = mx.concatenate([r.sample(logits[i:i + 1], first=i >= n_old and r.first is None)
                                    for i, r in enumerate(self.rows)])
        mx.async_eval(y)
        self.steps += 1
        c = counters(eng)
        c.steps += 1
        c.shared_steps += len(self.rows) > 1
        c.peak_rows = max(c.peak_rows, len(self.rows))
        return y

    def _snapshot_last(self, joined: list[Row]) -> None:
        """A row whose token of the step being built is its last (max_tokens) is fed it all the same (the
        rows step together); a lone reply never feeds its last token. Where the cache cannot be cut back
        (a recurrent state, a wrapped window) the row's state before it is kept, so the row leaves
        holding what it would hold alone (_hand_back)."""
        for i, r in enumerate(self.rows):
            if r in joined or r.snap is not None or r.n + 1 < r.turn.max_tokens:
                continue
            mine = self.cache if len(self.rows) == 1 else [c.extract(i) for c in self.cache]
            r.snap = layer_cache.snapshot(mine, len(r.entry.tokens))


def _hand_back(r: Row) -> None:
    """A leaving row's cache back to its conversation holding exactly `entry.tokens`: the step built
    after its last read token fed that token too (rows step together, and the pipeline builds a step
    before reading the last). Cut back where every layer can; else its state from before that token is
    restored (its last: `snap`); else (a cancel) the token is held, as a lone reply's cancel holds it."""
    held = len(r.entry.tokens)
    if r.unheld is not None:    # the one token a cache can hold beyond `entry.tokens`
        if layer_cache.floor(r.cache, held + 1) <= held:
            layer_cache.rollback(r.cache, held + 1, 1, None, lambda k: None)
        elif r.snap is not None and r.snap.n == held:
            layer_cache.rollback(r.cache, held + 1, 1, r.snap, lambda k: None)
        else:
            r.entry.tokens.append(r.unheld)
    r.snap = None
    r.entry.cache = r.cache


def _plain_greedy(row: Row) -> bool:
    return row.turn.req.sampling.temperature == 0 and not row.processors


# ---- the batch loop -----------------------------------------------------------------------------------
class BatchLoop:
    def __init__(self, engine):
        self.engine = engine
        self.batch = Batch(engine)
        self.waiting: deque[Handle] = deque()
        self.prefilling: list[Row] = []
        self.barrier = None                  # the first queued request that waits for the rows to end
        self.cap = max(1, int(engine.options.max_sequences))
        self.group = None                    # batch_prefill.GroupPrefill: prompts that came together

    @property
    def reading_together(self) -> list[Row]:
        return self.group.rows if self.group is not None else []

    @property
    def busy_owners(self) -> set[str]:
        return {r.owner for r in self.batch.rows + self.prefilling + self.reading_together if r.owner}

    def run(self, first: Handle):
        """Serve generate requests as rows until none is live; returns the barrier (or None)."""
        self.waiting.append(first)
        while True:
            self._read_queue()
            self._admit()
            gone = [r for r in self.batch.rows if r.ended]
            self.batch.leave(gone)
            for r in gone:
                self._finish(r)
            # a prompt's chunk before the step: a prompt it completes is in that very step
            together: list[Row] = []
            if self.group is not None or self._start_group():
                together = self._group_chunk()
            else:
                reading = [r for r in self.prefilling if r.done < len(r.todo)]
                if reading:
                    self._prefill_chunk(reading[0])
            ready = [r for r in self.prefilling if r.done >= len(r.todo)]
            if self.batch.rows or len(ready) > 1:
                for r in [r for r in ready if r.pending]:   # not alone: its last part is prefilled first
                    r.read_pending()
                    ready.remove(r)
            for r in ready:
                self.prefilling.remove(r)
                if r.ended:             # its first token (from its prompt's pass) ended it
                    self._finish(r)
                    continue
                self.batch.join(r)
                r.t_prefill = r.t_prefill or time.perf_counter()
            ready = [r for r in ready if not r.ended]
            if self.batch.rows:
                self._step(together + ready)
            if not self.batch.rows and not self.prefilling and not self.waiting and self.group is None:
                return self.barrier

    # -- the queue --
    def _read_queue(self) -> None:
        eng = self.engine
        while self.barrier is None:
            item = eng.scheduler.take_nowait()
            if item is None:
                return
            if batchable(eng, item):
                self.waiting.append(item)
            elif isinstance(item, Handle) and isinstance(item.request, QUICK):
                eng.scheduler.serve(item)
            elif isinstance(item, Handle) and isinstance(item.request, GenerateRequest) \
                    and not (item.request.conversation and item.request.conversation in self.busy_owners):
                self._alone(item)
            else:
                self.barrier = item

    def _alone(self, handle: Handle) -> None:
        """A request that runs alone (speculation, a constraint, ...): to its end, between two steps.
        The rows' K/V is theirs (checked out), so it takes, parks and makes live as it always did."""
        eng = self.engine
        if self.batch.y is not None:
            mx.eval(self.batch.y)
        eng.scheduler.serve(handle)

    # -- joining --
    def _admit(self) -> None:
        eng = self.engine
        for h in [h for h in self.waiting if h.cancelled]:   # a client gone while it queued: answered now
            self.waiting.remove(h)
            eng.scheduler.serve(h)
        skipped: deque[Handle] = deque()
        while self.waiting and len(self.batch.rows) + len(self.prefilling) + len(self.reading_together) < self.cap:
            h = self.waiting.popleft()
            if h.cancelled:
                eng.scheduler.serve(h)  # cancelled while it waited: answered as the engine always does
                continue
            owner = h.request.conversation
            if owner and owner in self.busy_owners:
                skipped.append(h)       # its conversation is replying: the next turn waits for it
                continue
            row = self._start(h)
            if row is None:
                continue
            if not self._fits(row):
                self._give_back(row)
                self.waiting.appendleft(h)      # tried again when a row has ended
                break
            self.prefilling.append(row)
            counters(eng).rows += 1
            counters(eng).image_rows += bool(row.runs)
        self.waiting.extendleft(reversed(skipped))

    def _start(self, h: Handle) -> Row | None:
        """The request's turn prepared (engine/handlers.py begin_turn); None when it failed."""
        eng = self.engine
        req = h.request
        with eng.scheduler.serving_as(h):
            try:
                turn = eng.turns.begin_turn(req, h, batched=True)
            except Exception as e:  # noqa: BLE001 - one request's refusal, reported as the engine does
                self._fail(h, e)
                return None
        sp = req.sampling
        n_vocab = eng.info.n_vocab
        seeded = sp.seed is not None and sp.temperature > 0
        processors = sp.processors()
        # On a GPU the prompt's last part goes in with the first decode step, as a lone request's does
        # (generate.first_step_merge_limit), when the row steps alone; else it is prefilled first.
        new = turn.tokens[turn.reuse:-1]
        # A cache that cannot trim takes checkpoints where the lone path's prefill does (generate.reply's
        # `marks`: the last message's start and end, and the prompt read), so the next turn finds them.
        marks = eng.prompts.message_marks(turn.req, turn.entry, turn.tokens)
        checkpoints = layer_cache.needs_checkpoints(turn.entry.cache)
        # Nor with images in the prompt, as a lone reply's (generate.reply): a step feeds token ids only.
        limit = generate.first_step_merge_limit(eng.options.prefill_chunk) \
            if not marks and not has_images(turn.tokens) else 0
        n_merged = len(new) - limit * ((len(new) - 1) // limit) if limit and new else 0
        row = Row(handle=h, turn=turn, out=ReplyText(eng.tokenizer, sp.stop, lambda t, s: h.emit(Token(t, s))),
                  todo=new[:len(new) - n_merged], pending=new[len(new) - n_merged:], steered=turn.projection,
                  sampler=seeded_sampler(sp, n_vocab) if seeded else sp.sampler(n_vocab), processors=processors,
                  key=mx.random.key(sp.seed) if seeded else None,
                  ctx=mx.array(text_only(turn.tokens), dtype=mx.int32) if processors else None,
                  cache=turn.entry.cache)
        if checkpoints:
            row.cuts = sorted({m - turn.reuse for m in marks if 0 < m - turn.reuse < len(row.todo)}
                              | ({len(row.todo)} if row.todo else set()))
        row.runs = image_runs(row.todo)
        if row.runs:        # kept from now: later prompts' images must not push this row's out before it reads them
            row.images = eng.loaded.vision.hold(row.todo)
        if row.todo and len(row.todo) > 1:
            h.emit(Progress("prefill", 0, len(row.todo)))
        return row

    def _fits(self, row: Row) -> bool:
        """The memory guard, asked before a row joins a running batch: its K/V at full length, padded
        to the batch's, with the batch copied once as it grows (`extend` concatenates); a window's K/V
        and a recurrent state are a fixed size per row (`row_cost`).
        A request with nothing else running is not asked (a lone request never was)."""
        eng = self.engine
        live = len(self.batch.rows) + len(self.prefilling) + len(self.reading_together)
        if live == 0:
            return True
        per_token, fixed = row_cost(eng)
        turn = row.turn
        length = max(self.batch.length(), len(turn.tokens)) + turn.max_tokens
        need = per_token * ((live + 1) * length + len(turn.tokens)) + fixed * (live + 2)
        ok, why = eng.guard.admit(need)
        if not ok:
            eng.log(f"{turn.req.conversation or 'request'} waits for the batch: K/V {why}")
        return ok

    # -- prefill --
    def _start_group(self) -> bool:
        """Nothing decoding and two or more prompts not yet begun (requests sent together): they are read
        together (engine/generation/batch_prefill.py), each leaving the group to decode once its prompt is in."""
        if self.batch.rows:
            return False
        # a prompt with image runs reads alone (_prefill_chunk): a group's pass feeds token ids only
        fresh = [r for r in self.prefilling if r.done == 0 and r.todo and not r.runs]
        if len(fresh) < 2:
            return False
        for r in fresh:
            self.prefilling.remove(r)
        self.group = GroupPrefill(self.engine, fresh)
        counters(self.engine).read_together += len(fresh)
        return True

    def _group_chunk(self) -> list[Row]:
        """One chunk of the group's prompts; when they are all in, the rows that join the batch now."""
        g = self.group
        for i in reversed(range(len(g.rows))):
            r = g.rows[i]
            if r.handle.cancelled:          # leaves with what it fed, as a lone prefill's cancel does
                g.take_out(i)
                self._give_back(r)
                self._fail(r.handle, Cancelled("cancelled"))
        if g.rows and not g.finished():
            try:
                g.step()
            except Exception as e:  # noqa: BLE001 - a failed pass fails every row in it (their K/V is suspect)
                log.exception("engine: batched prefill failed")
                for r in g.rows:
                    self._drop(r)
                    self._fail(r.handle, e)
                self.group = None
                return []
        if not g.rows:
            self.group = None
            return []
        if not g.finished():
            # A row whose prompt is in leaves the group and decodes from the next step while the others
            # read on (a short prompt sent with a long one does not wait for the long one's whole read,
            # nor is it padded through every pass of it).
            for i in reversed([i for i, r in enumerate(g.rows) if r.done >= len(r.todo)]):
                self.prefilling.append(g.take_out(i))
            return []
        self.group = None
        if len(g.rows) == 1:                # the others cancelled: it joins as a lone row does
            self.prefilling.append(g.take_out(0))
            return []
        now = time.perf_counter()
        for r in g.rows:
            r.t_prefill = now
        self.batch.join_group(g.rows, g.cache)
        return g.rows

    def _prefill_chunk(self, row: Row) -> None:
        """One chunk of the row's prompt into its own cache: text up to its next checkpoint or image, or
        one image run whole (read as a lone prefill reads it, engine/vision/spans.Vision.feed)."""
        eng = self.engine
        h = row.handle
        if self.batch.rows and row.pending:     # it will not step alone: no part goes with a step
            row.read_pending()
        total = len(row.todo)
        image = next(((a, b) for a, b in row.runs if a == row.done), None)
        if image is not None:
            part = row.todo[image[0]:image[1]]
        else:
            part = row.todo[row.done:row.done + self._chunk_size(row)]
        # A row joining rows that decode: its last chunk takes the prompt's last token too, and its first
        # token is sampled from that pass and sent at once. Joining at a step instead, it would wait for
        # the batch's step in flight, its own step, and the next one's build (the pipeline reads a
        # step's tokens after queueing the next): a joining stream's first token would cost its
        # prompt's read plus two steps of the whole batch (bench/concurrency.py's join figure).
        last = bool(self.batch.rows) and row.done + len(part) >= total
        # where checkpoints are due, or after an image, the prompt's last token goes in a pass of its own
        with_last = last and not row.cuts and image is None
        if eng.steering is not None:
            eng.steering.speed_projection = row.steered
        t0 = time.perf_counter()
        try:
            if image is not None:
                if h.cancelled:
                    raise Cancelled("cancelled")
                eng.loaded.vision.feed(eng.model, row.cache, part, row.entry.tokens, row.images.get(part[0]))
                if image == row.runs[-1]:
                    row.images = {}     # all its images are in: their pixels and features are let go
                logits = None
            else:
                logits = self._prefill_text(row, part + [row.turn.tokens[-1]] if with_last else part, with_last)
            if row.done + len(part) in row.cuts:
                row.entry.checkpoint()
            if last and not with_last:
                logits = prefill(eng.model, row.cache, [row.turn.tokens[-1]], row.entry.tokens,
                                 chunk=eng.options.prefill_chunk, cancelled=lambda: h.cancelled, last_logits=True)
        except Exception as e:  # noqa: BLE001 - a cancel (its K/V kept as fed so far) or a failure
            self.prefilling.remove(row)
            if isinstance(e, StrataError):
                self._give_back(row)
            else:
                self._drop(row)
            self._fail(h, e)
            return
        if image is None:
            eng.turns.prefill_pace().record(len(part) + with_last, time.perf_counter() - t0)
        elif total > 1:
            h.emit(Progress("prefill", row.done + len(part), total))
        row.done += len(part)
        if last:
            self._first_token(row, logits)

    def _chunk_size(self, row: Row) -> int:
        """The next text chunk's size: the lone prefill's schedule, stopping at the row's next checkpoint
        and at its next image run (fed whole, in a pass of its own)."""
        eng = self.engine
        gpu = on_gpu()
        chunk = eng.options.prefill_chunk
        pace = eng.turns.prefill_pace()
        size = next_chunk(row.done, len(row.todo), chunk, chunk if gpu else FIRST_CHUNK, 0 if gpu else pace.cap())
        stops = [c for c in row.cuts + [a for a, _ in row.runs] if c > row.done]
        if stops:
            size = min(size, min(stops) - row.done)
        return size

    def _prefill_text(self, row: Row, feed: list[int], last_logits: bool):
        """Text tokens of the row's prompt into its own cache (generate.prefill, one chunk)."""
        eng = self.engine
        h = row.handle
        total, base = len(row.todo), row.done

        def report(d: int, _t: int) -> None:
            if d:   # each chunk's prefill() opens with (0, n): the row said 0 when it started (_start)
                h.emit(Progress("prefill", min(base + d, total), total))
        return prefill(eng.model, row.cache, feed, row.entry.tokens, chunk=eng.options.prefill_chunk,
                       first=len(feed), progress=report if total > 1 else None, cancelled=lambda: h.cancelled,
                       layerwise=None if not eng.serving.distributed else False, last_logits=last_logits)

    def _first_token(self, row: Row, logits) -> None:
        """The row's first token, sampled from its prompt's last pass (it joins rows that decode)."""
        token = row.sample(logits, first=True).item()
        row.first, row.n, row.t_prefill = token, 1, time.perf_counter()
        row.turn.stats.t_first = row.t_prefill
        counters(self.engine).first_from_prompt += 1
        if row.out.push(token) or row.n >= row.turn.max_tokens:
            row.ended = "done"

    # -- decoding --
    def _step(self, joined: list[Row]) -> None:
        b = self.batch
        stepped = [r for r in b.rows if r not in joined]     # the rows the previous step's tokens are for
        prev = b.y
        c = counters(self.engine)
        try:
            t0 = time.perf_counter()
            b.y = b.build(joined)
            t1 = time.perf_counter()
            values = prev.tolist() if prev is not None else []
            t2 = time.perf_counter()
            c.build_s += t1 - t0
            c.wait_s += t2 - t1
        except Exception as e:  # noqa: BLE001 - a failed step fails every row (their K/V is suspect)
            log.exception("engine: batched step failed")
            for r in b.rows:
                r.ended = "failed"
                self._drop(r)
                self._fail(r.handle, e)
            b.rows, b.cache, b.y = [], None, None
            return
        now = time.perf_counter()
        for r, token in zip(stepped, values):
            if r.ended:
                continue
            if r.handle.cancelled:
                r.ended, r.out.finish = "cancelled", "cancelled"
                r.unheld = token                # fed by the step just built, not delivered
                continue
            if r.n == 0:
                r.turn.stats.t_first = now
            r.n += 1
            if r.n < r.turn.max_tokens:
                r.entry.tokens.append(token)    # fed by the step just built (generate.decode's `fed`)
            else:
                r.unheld = token                # fed too, but a lone reply never feeds its last: not held
            if r.out.push(token) or r.n >= r.turn.max_tokens:
                r.ended = "done"
        for r in joined:                        # nothing read for them yet; a cancel may come first
            if r.handle.cancelled:
                r.ended, r.out.finish = "cancelled", "cancelled"
        c.rows_s += time.perf_counter() - now
        if b.steps % 256 == 0:
            mx.clear_cache()

    def _finish(self, row: Row) -> None:
        eng = self.engine
        turn = row.turn
        with eng.scheduler.serving_as(row.handle):
            try:
                row.entry.checkpoint()      # a finished reply is a message boundary, as for a lone reply
                r = row.out.close(turn.stats, len(turn.tokens) - turn.reuse, row.t_prefill or time.perf_counter())
                result = eng.turns.end_turn(turn, r)
                self._give_back(row)
            except Exception as e:  # noqa: BLE001
                self._fail(row.handle, e)
                return
        row.handle.emit(Done(result))

    def _give_back(self, row: Row) -> None:
        """The row's conversation back to the engine as a lone reply leaves it (a side request's
        throwaway K/V is let go)."""
        if not row.turn.req.side:
            self.engine.conversations.check_in(row.entry)

    def _drop(self, row: Row) -> None:
        """After an unexpected failure its K/V may be half-updated: not held any more."""
        conv = self.engine.conversations
        conv.busy = [e for e in conv.busy if e is not row.entry]

    def _fail(self, h: Handle, e: Exception) -> None:
        if isinstance(e, StrataError):
            self.engine.log(f"error: {e}")
        elif not isinstance(e, Cancelled):
            log.error("engine: unexpected error in a batched request", exc_info=e)
        err = EngineError.of(e)
        h.emit(Failed(err.message, err.code, err.reason))


def run(engine, first: Handle):
    """The engine thread's batch loop (engine/engine.py run_forever): returns the first request that
    had to wait for every row to end (a barrier), or None.

    Every op of the loop runs on mlx-lm's generation stream, the one the model's steps run on: a step's
    inputs built from the last step's tokens on another stream (the thread's default) make a
    cross-stream dependency, which the CUDA backend may settle by waiting for the last step on the
    host, so the next step's graph is no longer built while the device runs the last one."""
    with mx.stream(_stream()):
        return BatchLoop(engine).run(first)
