"""The stepping loop: prefill the new part of the prompt into the live K/V, then decode token by token.

Written here rather than calling mlx_lm.generate_step so the engine knows exactly which tokens the
K/V holds (`fed`), which parking and session files depend on; the model call, caches, samplers and
pipelining (submit step n+1 before handing out token n) are mlx-lm's.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Iterator

import mlx.core as mx
from mlx_lm.generate import generation_stream

from engine.generation.constraints import GrammarMasks
from engine.device import on_gpu
from engine.cache import layer_cache
from engine.errors import Cancelled
from engine.text.markers import partial_suffix
from engine.text.tokenizer import StreamDecoder
from engine.text.image_tokens import image_runs, text_only


@dataclass
class StepStats:
    ttft_ms: float = 0.0
    prefill_tps: float = 0.0
    decode_tps: float = 0.0
    t_start: float = field(default_factory=time.perf_counter)
    t_first: float = 0.0


def _stream():
    """mlx-lm's generation stream (one per thread, on the default device): the engine steps on the
    same stream raw mlx-lm does, so the two are measured alike."""
    return generation_stream


FIRST_CHUNK = 16   # tokens in the first prefill chunk
# On the CPU a prefill chunk of a 135M model can take a minute on a busy 2-vCPU machine (SmolLM2
# reads ~7 tokens/s there), so a chunk is stepped through layer by layer (one mx.eval per layer's K/V:
# the same kernels, the same numbers, only the host waits in between): the cancel flag is read after
# every layer and a progress report goes out whenever PROGRESS_S has passed. Chunks are also capped so
# that one layer's share of a chunk takes at most LAYER_TARGET_S (measured, per model: PrefillPace),
# which keeps both a progress report and a cancel within about a second on any machine, while a
# fast machine keeps the full-size chunks (the cap only binds where a chunk takes many seconds).
PROGRESS_S = 0.5
LAYER_TARGET_S = 0.5


def chunk_sizes(total: int, chunk: int, first: int = FIRST_CHUNK, cap: int = 0) -> list[int]:
    """The prefill schedule: 16, 16, 32, 64, ... (each chunk as large as all before it) up to `chunk`
    (and `cap`, a power of two, when a chunk of that size would take too long: PrefillPace).
    Small first chunks put the first progress report (and the first chance to cancel) within a
    moment of the start even on a slow machine; doubling reaches full-size chunks after a few steps,
    and the running totals (16, 32, 64, ..., 512, 1024) stay on mlx-lm's 256-cell cache steps, so the
    K/V is allocated as with full-size chunks."""
    sizes, n = [], 0
    while n < total:
        sizes.append(next_chunk(n, total, chunk, first, cap))
        n += sizes[-1]
    return sizes


def next_chunk(done: int, total: int, chunk: int, first: int = FIRST_CHUNK, cap: int = 0) -> int:
    """The size of the chunk after `done` of `total` tokens (see chunk_sizes)."""
    if chunk <= 0:
        return total - done
    size = min(max(done, first), chunk)
    if cap > 0 and size > cap:
        size = cap
        if done:                      # a smaller chunk keeps the totals on its own multiples
            size = min(size, done & -done)
    return max(1, min(size, total - done))


class PrefillPace:
    """A model's measured prefill speed (the engine keeps one per load): the chunk cap that keeps one
    layer's share of a chunk under LAYER_TARGET_S. Timing decides only the size of a chunk on a machine
    where a full chunk is slow; the schedule on a fast one is the fixed 16, 16, 32, ... of chunk_sizes."""

    def __init__(self, n_layers: int = 1):
        self.n_layers = max(1, n_layers)
        self.s_per_token = 0.0        # the latest chunk's seconds per token (0: not measured yet)

    def record(self, tokens: int, seconds: float) -> None:
        # Not from a turn's few new tokens, whose pass costs more per token than a chunk's: a full-size
        # first chunk (16), or a chunk of the capped size where the cap is smaller.
        if seconds > 0 and tokens >= min(FIRST_CHUNK, self.cap() or FIRST_CHUNK):
            self.s_per_token = seconds / tokens

    def cap(self) -> int:
        """The largest power-of-two chunk whose layers take LAYER_TARGET_S each (0: no cap known)."""
        if not self.s_per_token:
            return 0
        fit = int(self.n_layers * LAYER_TARGET_S / self.s_per_token)
        return 1 << max(2, fit.bit_length() - 1) if fit >= 4 else 4


def prefill(model, cache, tokens: list[int], fed: list[int], *, chunk: int = 512,
            progress: Callable[[int, int], None] | None = None, cancelled=lambda: False,
            pace: PrefillPace | None = None, layerwise: bool | None = None, first: int | None = None,
            last_logits: bool = False) -> mx.array | None:
    """Feed `tokens` into the cache in chunks (all of them; the caller keeps the last one back, unless it
    asks for the logits after it: `last_logits`).
    `progress(0, total)` comes first, then one call per chunk (and, on a slow machine, calls from
    within a chunk every PROGRESS_S). `pace`: the model's remembered speed (a throwaway one if None).
    `layerwise`: step a chunk layer by layer (default: on the CPU; never across processes).
    `last_logits`: return the (1, vocab) logits after the last token (evaluated with the last chunk),
    for a caller that feeds the whole prompt and samples the first token from this pass."""
    done = 0
    # The doubling start is for progress on a slow machine (the CPU: ~50 ms per 16 SmolLM2 tokens).
    # On a GPU a full chunk takes milliseconds and the small ones only add syncs and launches (an
    # H200: prefill 0.84-1.0x raw mlx-lm with them), so chunks are full-size from the first.
    gpu = on_gpu()
    # `first`: the first chunk's size (a batched row's prefill, engine/generation/batching.py, one chunk a call)
    first = first or (chunk if gpu else FIRST_CHUNK)
    if layerwise is None:
        layerwise = not gpu
    if pace is None:
        pace = PrefillPace(len(cache))
    total = len(tokens)
    if progress and tokens:
        progress(0, total)
    last_report = time.perf_counter()
    logits = None
    while done < total:
        if cancelled():
            raise Cancelled("cancelled")
        size = next_chunk(done, total, chunk, first, 0 if gpu else pace.cap())
        part = tokens[done:done + size]
        t0 = time.perf_counter()
        with mx.stream(_stream()):
            want = last_logits and done + len(part) >= total
            if not layerwise:
                out = model(mx.array(part)[None], cache=cache)
                logits = out[:, -1, :] if want else None
                del out     # unevaluated, it would keep every layer's activations of the chunk alive
                mx.eval(layer_cache.arrays(cache) + ([logits] if want else []))
            else:
                # What each layer's cache held before this chunk: put back on a cancel mid-chunk for the
                # layers not yet computed (references only; each is let go just before its layer runs,
                # so the K/V update can still reuse its buffer in place).
                before = [dict(vars(c)) for c in cache]
                # A cache with layers that cannot trim (a recurrent state, a window) is undone from a
                # snapshot instead (engine/cache/layer_cache.py); None for full K/V.
                snap = layer_cache.snapshot(cache, len(fed))
                out = model(mx.array(part)[None], cache=cache)
                logits = out[:, -1, :] if want else None
                del out
                n = len(cache)

                def queue(i: int) -> None:
                    # Layer i + 1 is queued before the host waits for layer i, so the worker does not
                    # idle between two layers while the host wakes, checks and queues the next one
                    # (~3% of a paced CPU prefill of Gemma 3 1B's layout: bench/README.md).
                    before[i] = None
                    mx.async_eval(layer_cache.kind_of(cache[i]).arrays(cache[i]))
                queue(0)
                for i, c in enumerate(cache):
                    if i + 1 < n:
                        queue(i + 1)
                    mx.eval(layer_cache.kind_of(c).arrays(c))
                    if i + 1 < n and cancelled():
                        nxt = cache[i + 1]      # queued: let it finish, then it is undone with the others
                        mx.eval(layer_cache.kind_of(nxt).arrays(nxt))
                        if snap is not None:
                            layer_cache.rollback(cache, len(fed) + len(part), len(part), snap, lambda k: None)
                            raise Cancelled("cancelled")
                        for j, d in enumerate(cache):
                            if before[j] is None:
                                d.trim(len(part))
                            else:
                                vars(d).update(before[j])
                        raise Cancelled("cancelled")
                    if progress and time.perf_counter() - last_report >= PROGRESS_S and i + 1 < n:
                        last_report = time.perf_counter()
                        progress(done + len(part) * (i + 1) // n, total)
        pace.record(len(part), time.perf_counter() - t0)
        fed.extend(part)
        done += len(part)
        if progress:
            last_report = time.perf_counter()
            progress(done, total)
    if total >= chunk:
        # as mlx-lm does after a prefill: a full chunk's activations go back to the system. Not
        # after a turn's few new tokens, where it only costs time (~1.4 ms on an H200).
        mx.clear_cache()
    if logits is not None:
        mx.eval(logits)      # layerwise: the layers are in; the output head is all that is left
    return logits


def first_step_merge_limit(chunk: int) -> int:
    """How many of a request's last prompt tokens go in with the first decode step instead of through
    a prefill pass (at most one prefill chunk). On a GPU a pass costs its kernel launches and a wait
    more than its work: a returning turn's few new tokens plus the last one in one pass saves a pass
    and a wait (a parked turn's time to first token, bench/turns.py), and so does a new prompt's last
    chunk (its time to first token, bench/engine.py; mlx-lm 0.32's generate_step prefills all but
    the last token, clears MLX's cache, then steps). Not on the CPU: there a pass costs its work, and
    a merged pass projects every position to the vocabulary (mlx-lm's models do), where a prefill
    pass stops at the K/V: 32 + 1 tokens of the tiny bench model over 2,200 held took 10.5 ms split
    and 19.2 ms merged. Nor without chunks (chunk 0): the merged part would be the whole prompt."""
    return chunk if on_gpu() and chunk > 0 else 0


def decode(model, cache, last_token: int, fed: list[int], *, history: list[int], sampler,
           processors, max_tokens: int, stats: StepStats, seed: int | None = None,
           cancelled=lambda: False, pending: list[int] = (), constraint=None) -> Iterator[int]:
    """Yield up to max_tokens sampled ids; `fed` always equals the tokens the cache holds.

    mlx-lm's order: step n+1's graph is built from the still-lazy token n and submitted
    (mx.async_eval) before the host waits for token n, so the device never waits for Python.
    Building step n+1 feeds token n to the cache, so `fed` takes token n as soon as its value is
    read, before it is handed out; the last token (n == max_tokens) is never fed. A consumer that
    stops early (EOS, a stop string, cancel) leaves the cache holding exactly `fed`.
    `pending`: prompt tokens not yet in the cache, fed with `last_token` in the first step.
    `constraint`: a compiled grammar (engine/generation/constraints.py): step n+1's forward pass is queued alone,
    the grammar's mask for it is computed on the host from token n while the device runs it, and the
    masked sample is queued after it, before token n is handed out (constraints.GrammarMasks)."""
    if seed is not None:
        mx.random.seed(seed)
    masks = GrammarMasks(constraint) if constraint is not None else None
    forward, pick = _step_parts(model, cache, history, sampler, processors)
    logits = forward(mx.array([*pending, last_token]), first=True)
    fed.extend(pending)
    fed.append(last_token)
    if masks is None:
        y = pick(logits)
    else:
        mx.async_eval(logits)
        y = pick(logits, masks.first(logits.shape[-1]))     # the first mask: beside the first pass
    mx.async_eval(y)
    n = 0
    while n < max_tokens:
        if cancelled():
            return
        fed_next = n + 1 < max_tokens
        if fed_next:
            nxt = forward(y)            # from the lazy token n: queued behind it on the device
            if masks is None:
                nxt = pick(nxt)
            mx.async_eval(nxt)
        token = y.item()
        if n == 0:
            stats.t_first = time.perf_counter()
        if masks is not None:
            masks.advance(token)
        if fed_next:
            fed.append(token)
        n += 1
        if n % 256 == 0:
            mx.clear_cache()
        if fed_next and masks is not None:
            # the masked sample queued before the token is handed out: the consumer's work on it
            # (detokenizing, stop strings, streaming) overlaps the device, as in the unmasked order
            nxt = pick(nxt, masks.or_eos(masks.after(token)))
            mx.async_eval(nxt)
        yield token
        if fed_next:
            y = nxt


def _step_parts(model, cache, history: list[int], sampler, processors):
    """A decode step in two parts on mlx-lm's generation stream: the forward pass with the logits
    processors (their context grows by each fed token), and the sample from logits (masked where a
    grammar allows only some tokens)."""
    stream = _stream()
    ctx = mx.array(text_only(history), dtype=mx.int32) if processors else None
    neg_inf = mx.array(-float("inf"), dtype=mx.float32)

    def forward(tok: mx.array, first: bool = False) -> mx.array:
        nonlocal ctx
        with mx.stream(stream):
            logits = model(tok[None], cache=cache)[:, -1, :]
            if processors:
                if not first:           # the prompt's last token is already in `history`
                    ctx = mx.concatenate([ctx, tok.astype(mx.int32)])
                for p in processors:
                    logits = p(ctx, logits)
            return logits

    def pick(logits: mx.array, allowed=None) -> mx.array:
        with mx.stream(stream):
            if allowed is not None:
                logits = mx.where(mx.array(allowed)[None], logits, neg_inf.astype(logits.dtype))
            logprobs = logits - mx.logsumexp(logits, keepdims=True)
            return sampler(logprobs)

    return forward, pick


# ---- one reply: prefill, decode, stop strings, stats ----------------------------------------------
@dataclass
class Reply:
    tokens: list[int]
    text: str
    finish: str                 # "stop" | "length" | "cancelled"
    stats: StepStats


def reply(model, entry, tokens: list[int], reuse: int, *, tokenizer, sampling, n_vocab: int, max_tokens: int,
          chunk: int, on_token: Callable[[int, str], None], on_progress: Callable[[int, int], None],
          cancelled: Callable[[], bool], steps=None, stats: StepStats | None = None,
          pace: PrefillPace | None = None, layerwise: bool | None = None, constraint=None,
          marks: list[int] = (), images=None) -> Reply:
    """Extend `entry` (its K/V holds tokens[:reuse]) with the rest of the prompt, then decode a reply.

    Text goes out through `on_token(id, text)` as it is decoded, a possible stop string's start
    held back until it is decided; EOS or a stop string ends with "stop", `max_tokens` with
    "length", a cancel with "cancelled". `steps`: a token iterator that replaces `decode`
    (speculative decoding), built over the same `stats`. `constraint`: the grammar of `decode`'s
    tokens (engine/generation/constraints.py; `steps` carries its own). `images`: the loaded projector's
    spans (engine/vision/spans.Vision) when `tokens` holds image runs: each is fed whole, in one pass."""
    stats = stats or StepStats()
    new = tokens[reuse:-1]
    # The prompt's last part (1..limit tokens; speculative steps start from a fully fed cache) goes in
    # with the first decode step; what comes before it, whole multiples of the limit, is prefilled.
    # Nor where checkpoints are due (`marks`: a cache that cannot trim): the turn's message boundaries
    # and the prompt's end fall in that last part, and a merged pass takes no checkpoint inside it, so
    # the next turn of a Qwen3.5-like model found none and read its history again (bench/gpu.md).
    limit = first_step_merge_limit(chunk) if steps is None and not marks and images is None else 0
    n_merged = len(new) - limit * ((len(new) - 1) // limit) if limit and new else 0
    pending = new[len(new) - n_merged:]
    ahead = new[:len(new) - n_merged]
    if ahead or not pending:
        # `marks`: positions in `tokens` (message boundaries) where a cache that cannot trim takes a
        # checkpoint (engine/cache/layer_cache.py's policy; empty for full K/V): the prefill stops there.
        checkpoints = sorted({m - reuse for m in marks if 0 < m - reuse < len(ahead)}) + [len(ahead)]
        runs = image_runs(ahead) if images is not None else []
        cuts = sorted(set(checkpoints) | {x for run in runs for x in run if 0 < x < len(ahead)})
        done = 0
        for cut in cuts:
            if (done, cut) in runs:
                if cancelled():
                    raise Cancelled("cancelled")
                images.feed(model, entry.cache, ahead[done:cut], entry.tokens)
            else:
                prefill(model, entry.cache, ahead[done:cut], entry.tokens, chunk=chunk,
                        progress=on_progress if cut - done > 1 else None, cancelled=cancelled, pace=pace,
                        layerwise=layerwise)
            done = cut
            if cut and cut in checkpoints and hasattr(entry, "checkpoint"):
                entry.checkpoint()  # a message boundary, and the prompt read (engine/cache/layer_cache.py's policy)
    t_prefill = time.perf_counter()
    sp = sampling
    out = ReplyText(tokenizer, sp.stop, on_token)
    for token in steps or decode(model, entry.cache, tokens[-1], entry.tokens, history=tokens,
                                 sampler=sp.sampler(n_vocab), processors=sp.processors(), max_tokens=max_tokens,
                                 stats=stats, seed=sp.seed, cancelled=cancelled, pending=pending,
                                 constraint=constraint):
        if out.push(token):
            break
    else:
        if cancelled():
            out.finish = "cancelled"
    return out.close(stats, len(tokens) - reuse, t_prefill)


class ReplyText:
    """One reply's tokens made text: EOS and stop strings end it, a possible stop string's start is
    held back until decided, text goes out through `on_token(id, text)`. Used by `reply` and by a
    batched row (engine/generation/batching.py), which pushes its tokens one step at a time."""

    def __init__(self, tokenizer, stops: list[str], on_token: Callable[[int, str], None]):
        self.eos = tokenizer.eos_ids
        self.stops = stops
        self.on_token = on_token
        self.stream = StreamDecoder(tokenizer)
        self.out_ids: list[int] = []
        self.text = ""
        self.held = ""          # text held back while it could still be the start of a stop string
        self.finish = "length"

    def push(self, token: int) -> bool:
        """Take the next token; True when the reply ends with it (EOS or a stop string)."""
        self.out_ids.append(token)
        if token in self.eos:
            self.finish = "stop"
            return True
        self.held += self.stream.push(token)
        emit, stop_hit = split_stop(self.held, self.stops)
        if emit:
            self.text += emit
            self.on_token(token, emit)
        self.held = self.held[len(emit):]
        if stop_hit:
            self.finish = "stop"
            return True
        return False

    def close(self, stats: StepStats, n_new: int, t_prefill: float) -> "Reply":
        """What is still held goes out (unless a stop string ended it); the timing figures."""
        if self.finish != "stop" or not self.stops:
            rest = self.held + self.stream.flush()
            if rest:
                self.text += rest
                self.on_token(self.out_ids[-1] if self.out_ids else -1, rest)
        t_end = time.perf_counter()
        n_out = len(self.out_ids)
        stats.ttft_ms = ((stats.t_first or t_end) - stats.t_start) * 1e3
        stats.prefill_tps = n_new / max(1e-9, (stats.t_first or t_prefill) - stats.t_start)
        stats.decode_tps = (n_out - 1) / (t_end - stats.t_first) if n_out > 1 else 0.0
        return Reply(self.out_ids, self.text, self.finish, stats)


def split_stop(text: str, stops: list[str]) -> tuple[str, bool]:
    """(text safe to emit, whether a stop string was hit). Holds back a possible stop-string start."""
    if not stops:
        return text, False
    for s in stops:
        i = text.find(s)
        if i >= 0:
            return text[:i], True
    return text[:len(text) - partial_suffix(text, stops)], False
