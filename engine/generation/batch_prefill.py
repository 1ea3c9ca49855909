"""Prompts that arrive together are read together: one padded pass for several rows.

When nothing is decoding and two or more rows wait to read their prompts (N requests sent at the same
moment: an agent's parallel tool calls, a load test's clients), engine/generation/batching.py reads them as one
group instead of one row's chunk after another's: each forward pass takes a chunk of every row's
prompt, as mlx-lm's BatchGenerator prefills the prompts it is given at once. Prompts of one length
then start decoding at the same step, so no stream's decode time holds the other prompts' reading (the
CPU's "slowest stream" figure in bench/README.md), and on a GPU N short prompts cost about one pass. A
row whose prompt is in before the others' leaves the group (`take_out`) and decodes while they read on
(engine/generation/batching.py), so a short prompt sent with a long one is not held for the long one's read.

The rows' own K/V (a returning conversation's parked prefix, or nothing) is merged into one
batch cache per layer (BatchKVCache; a window's BatchRotatingKVCache; a recurrent state's ArraysCache,
masked past each row's length in a pass) (left padding aligns the prefixes' ends). Each chunk feeds up to `n` tokens of
every row, right-padded where a row has fewer left, and is then closed with mlx-lm's
`prepare(right_padding=...)`/`finalize()` (the padding rolled to the left, where the mask hides
it), so between two chunks the K/V is plain left-padded: a row cancelled there leaves with exactly
what it fed (`extract`), the others go on (`filter`), and Status requests are answered between chunks
(the scheduler runs one chunk per iteration). A row gets its prefill progress after every chunk.
"""
from __future__ import annotations

import time

import mlx.core as mx

from engine.events import Progress
from engine.cache import layer_cache
from engine.generation.generate import _stream, on_gpu

MIN_CPU_CHUNK = 32


class GroupPrefill:
    """Rows reading their prompts together; `step()` feeds one chunk of each, `finished()` once all is in."""

    def __init__(self, engine, rows: list):
        self.engine = engine
        self.rows = list(rows)
        for r in self.rows:             # not alone: a GPU row's held-back part is read here too
            r.read_pending()
        # each layer's class merges its rows (BatchKVCache, BatchRotatingKVCache, ArraysCache)
        self.cache = [layer[0].merge(list(layer)) for layer in zip(*(r.cache for r in self.rows))]
        for r in self.rows:             # the group holds the only copy of each row's K/V from now on
            r.cache = r.entry.cache = []

    def finished(self) -> bool:
        return all(r.done >= len(r.todo) for r in self.rows)

    def chunk_size(self) -> int:
        chunk = self.engine.options.prefill_chunk
        # On the CPU a pass costs about rows x chunk tokens: keep one pass (the cancel and Status
        # latency) near a lone row's chunk. On a GPU wider passes are what batching is for.
        return chunk if on_gpu() else max(MIN_CPU_CHUNK, chunk // len(self.rows))

    def step(self) -> None:
        """One chunk of every row still reading (a row that has read all its prompt gets padding)."""
        eng = self.engine
        n = self.chunk_size()
        # a row's part stops at its next checkpoint (a cache that cannot trim: message boundaries, the
        # prompt read), as a lone prefill does
        parts = [r.todo[r.done:min([r.done + n] + [c for c in r.cuts if c > r.done])] for r in self.rows]
        width = max(len(p) for p in parts)
        pads = [width - len(p) for p in parts]
        inputs = mx.array([p + [0] * (width - len(p)) for p in parts])
        st = eng.steering
        steered = [r.steered for r in self.rows]
        t0 = time.perf_counter()
        with mx.stream(_stream()):
            for c in self.cache:
                # K/V: padding rolled to the left after the pass; a window: its valid lengths, so padding
                # evicts nothing; a recurrent state: masked past each row's length, conv state at its end
                c.prepare(right_padding=pads, lengths=[width - p for p in pads])
            if st is not None:
                st.speed_projection = any(steered)
                st.rows = mx.array(steered)[:, None, None] if any(steered) and not all(steered) else None
            try:
                eng.model(inputs, cache=self.cache)
            finally:
                if st is not None:
                    st.rows = None
            for c in self.cache:
                c.finalize()
            mx.eval([a for c in self.cache for a in _arrays(c)])
        eng.turns.prefill_pace().record(sum(len(p) for p in parts), time.perf_counter() - t0)
        for i, (r, p) in enumerate(zip(self.rows, parts)):
            r.entry.tokens.extend(p)
            r.done += len(p)
            if p and r.done in r.cuts:
                layer_cache.add_checkpoint(r.entry.checkpoints, [c.extract(i) for c in self.cache],
                                           len(r.entry.tokens))
            if p and len(r.todo) > 1:
                r.handle.emit(Progress("prefill", r.done, len(r.todo)))

    def take_out(self, i: int):
        """Row i leaves the group (a cancel, or the group ending with one row): its K/V as fed so far,
        a plain cache list, given back to the row."""
        r = self.rows.pop(i)
        # before the first chunk of fresh prompts the group's K/V has no arrays yet
        fresh = self.engine.handlers.make_cache() if any(c.empty() for c in self.cache) else [None] * len(self.cache)
        r.cache = r.entry.cache = [c.extract(i) if not c.empty() else new for c, new in zip(self.cache, fresh)]
        if self.rows:
            keep = mx.array([j for j in range(len(self.rows) + 1) if j != i])
            for c in self.cache:
                c.filter(keep)
        else:
            self.cache = []
        return r


def _arrays(c) -> list:
    """A batch layer's arrays to evaluate after a pass (K/V or a recurrent state's entries)."""
    if hasattr(c, "keys"):
        return [a for a in (c.keys, c.values) if a is not None]
    return [a for a in c.cache if a is not None]
