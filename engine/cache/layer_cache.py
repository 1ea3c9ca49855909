"""The cache contract: what every per-layer cache of a conversation says about itself.

A conversation's K/V is a list of mlx-lm per-layer caches. They are not all the same shape:

| kind       | mlx-lm class                  | models                        | can be cut back to              |
|------------|-------------------------------|-------------------------------|---------------------------------|
| `kv`       | KVCache                       | every dense model             | any prefix (trim is free)       |
| `kv_quant` | QuantizedKVCache (+ engine's HalfScaleQuantizedKVCache) | `--kv-bits 8/4` | any prefix   |
| `rotating` | RotatingKVCache (a window)    | Gemma 3/4, gpt-oss sliding layers | any prefix while offset <= max_size; once more tokens than the window went in, none |
| `arrays`   | ArraysCache (conv + recurrent state) | Qwen3.5 DeltaNet, Mamba | none: a fixed-size state holds no past |

Why a wrapped window cannot be cut back at all: a query at position p attends to the W - 1 keys before
it (W = the window = max_size). After offset > max_size the buffer holds only the last max_size
positions, and mlx-lm's in-place writes have overwritten the older ones (its multi-token path keeps up
to max_size + S - 1 in temporal order, but its `trim` only moves `offset`/`_idx` and does not undo a
rotation, so `keys_and_values` afterwards would be wrong). Cutting back k tokens would need keys
p - W + 1 .. p - 1 for p = offset - k, which are gone for every k >= 1 (and mlx-lm's own
`is_trimmable` says the same: offset < max_size). So the floor is offset itself.

`ADAPTERS` (one table, keyed on the cache class through its MRO) is the only place in the engine that
branches on a cache class. Each adapter (`LayerKind`) gives:
  nbytes(c)                 bytes really held (allocated buffers)
  arrays(c)                 the arrays to mx.eval after filling it
  floor(c, held)            the fewest tokens it can be cut back to (held: the conversation's count)
  trim_to(c, held, n)       cut back to n tokens (n >= floor)
  copy_prefix(c, n)         a new cache holding its first n tokens, or None where it cannot
  checkpoint(c) / restore(snap)   a copy of its whole state / a new cache from that copy
  state(c) / meta_state(c) / from_state(tensors, meta)   the tensors and plain facts of a file
The conversation-level view (functions at the bottom) works on the list of layers: `nbytes`, `floor`,
`needs_checkpoints`, `checkpoint`, `rewind` (trim, else the latest checkpoint at or before, else a fresh
cache: never a wrong one), `copy_prefix`, `snapshot`/`rollback` for speculation.

Checkpoint policy (prefix reuse for caches that cannot be cut back):
* Only for conversations with a `rotating` or `arrays` layer (`needs_checkpoints`). Full K/V models
  (`kv`, `kv_quant` only) take none: trim is free, nothing changes for them (not even a render).
* Where: at message boundaries of each turn, the prefill stopping there (generate.reply's `marks`,
  prompts.message_marks): the start and the end of the last message as the history renders without a
  generation prompt (what the next turn, or an Edit of that message, shares: templates such as
  Qwen3.5's or harmony's render a past reply otherwise than it was generated, so the next turn
  diverges right after it), the prompt's end less its last token (what a Regenerate shares), and the
  end of each finished reply (what the next turn shares where the template renders history as fed).
  A restored session takes one at its end.
* What: only the layers that cannot be trimmed (the `rotating` and `arrays` ones); the `kv` layers of
  a hybrid model are trimmed to the checkpoint's length instead, so a checkpoint costs
  sum(window K/V) + sum(recurrent state) bytes, independent of the conversation's length (Qwen3.5-4B:
  24 DeltaNet layers of 32 x 128 x 128 state + conv window, ~50 MiB in float32, half in float16;
  Gemma 3 4B: 29 windows of 1,024 x 4 heads x 256 x 2 (K, V), ~116 MiB in float16).
* How many: the latest MAX_CHECKPOINTS per conversation (two turns' worth; older ones dropped); a cut
  back below a checkpoint drops it. Their bytes count in the conversation's `nbytes`, i.e. in the
  parking cap and the memory guard's view of what parking holds.
* Where a request's prefix has no checkpoint at or before it, the conversation is read again from
  the start: slower, never wrong.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import mlx.core as mx
from mlx.utils import tree_map
from mlx_lm.models.cache import ArraysCache, KVCache, QuantizedKVCache, RotatingKVCache

from engine.errors import ModelFileError

MAX_CHECKPOINTS = 8


def _copy(x):
    """A copy of an MLX array that later in-place writes to `x` (mlx-lm's cache updates are slice
    assignments) do not reach."""
    return None if x is None else mx.array(x)


def _half_scale_cache_class():
    class HalfScaleQuantizedKVCache(QuantizedKVCache):
        """mlx-lm's QuantizedKVCache with float16 scales and biases whatever the compute dtype.

        On the CPU the engine computes in float32, and mlx-lm would keep float32 scales (12,960
        B/token for SmolLM2 at 8 bits). float16 ones take 12,240, and a session file can hold them
        bit for bit, so a restored conversation continues exactly as the live one would.
        (mx.quantized_matmul takes float16 scales with float32 inputs.)"""

        def update_and_fetch(self, keys, values):
            B, n_kv_heads, num_steps, k_head_dim = keys.shape
            v_head_dim = values.shape[-1]
            prev = self.offset
            if self.keys is None or (prev + num_steps) > self.keys[0].shape[-2]:
                el_per_int = 8 * mx.uint32.size // self.bits
                new_steps = (self.step + num_steps - 1) // self.step * self.step
                shape = (B, n_kv_heads, new_steps)

                def init_quant(dim):
                    return (mx.zeros((*shape, dim // el_per_int), dtype=mx.uint32),
                            mx.zeros((*shape, dim // self.group_size), dtype=mx.float16),
                            mx.zeros((*shape, dim // self.group_size), dtype=mx.float16))

                def expand_quant(x):
                    return mx.concatenate([x, mx.zeros((*shape, x.shape[-1]), dtype=x.dtype)], axis=-2)

                if self.keys is not None:
                    if prev % self.step != 0:
                        self.keys, self.values = tree_map(lambda x: x[..., :prev, :], (self.keys, self.values))
                    self.keys, self.values = tree_map(expand_quant, (self.keys, self.values))
                else:
                    self.keys, self.values = init_quant(k_head_dim), init_quant(v_head_dim)
            self.offset += num_steps
            keys = mx.quantize(keys, group_size=self.group_size, bits=self.bits)
            values = mx.quantize(values, group_size=self.group_size, bits=self.bits)
            for i in range(3):
                self.keys[i][..., prev:self.offset, :] = keys[i].astype(self.keys[i].dtype)
                self.values[i][..., prev:self.offset, :] = values[i].astype(self.values[i].dtype)
            return self.keys_and_values()

    return HalfScaleQuantizedKVCache


_HALF = None


def half_scale_cache_class():
    global _HALF
    if _HALF is None:
        _HALF = _half_scale_cache_class()
    return _HALF


class LayerKind:
    """One cache type's side of the contract (stateless: every method takes the cache)."""
    name = ""
    trims_freely = True      # can always be cut back to any prefix (no checkpoint ever needed)
    batches = False          # mlx-lm's batch caches merge it (`merge`/`extend`/`extract`: engine/generation/batching.py's rows)

    def nbytes(self, c) -> int:
        return sum(a.nbytes for a in self.arrays(c))

    def arrays(self, c) -> list:
        raise NotImplementedError

    def floor(self, c, held: int) -> int:
        return 0

    def trim_to(self, c, held: int, n: int) -> None:
        raise NotImplementedError

    def copy_prefix(self, c, n: int):
        return None

    def checkpoint(self, c):
        return tuple(_copy(a) if isinstance(a, mx.array) else a for a in c.state)

    def restore(self, snap):
        raise NotImplementedError

    def state(self, c) -> list:
        raise NotImplementedError

    def meta_state(self, c) -> dict:
        raise NotImplementedError

    def from_state(self, tensors: list, meta: dict):
        raise NotImplementedError


class FullKV(LayerKind):
    """mlx-lm's KVCache: keys/values (B, heads, cells, head_dim), `offset` cells valid."""
    name = "kv"
    batches = True

    def _cls(self):
        return KVCache

    def arrays(self, c) -> list:
        return [] if c.keys is None else [c.keys, c.values]

    def trim_to(self, c, held: int, n: int) -> None:
        if c.offset > n:
            c.trim(c.offset - n)

    def copy_prefix(self, c, n: int):
        dst = self._cls()()
        if n > 0 and c.keys is not None:
            dst.state = (mx.array(c.keys[..., :n, :]), mx.array(c.values[..., :n, :]), n)
        return dst

    def state(self, c) -> list:
        if c.keys is None:
            return []
        n = c.offset
        return [c.keys[..., :n, :], c.values[..., :n, :]]

    def meta_state(self, c) -> dict:
        return {"offset": int(c.offset)}

    def from_state(self, tensors, meta):
        c = self._cls()()
        if tensors:
            c.state = (tensors[0], tensors[1], int(meta["offset"]))
        return c

    def restore(self, snap):
        c = self._cls()()
        if snap[0] is not None:
            c.state = (_copy(snap[0]), _copy(snap[1]), snap[2])
        return c


class QuantKV(LayerKind):
    """mlx-lm's QuantizedKVCache (and kv_format's HalfScaleQuantizedKVCache): keys/values are
    (codes, scales, biases) each."""
    name = "kv_quant"

    def _cls(self):
        return half_scale_cache_class()

    def arrays(self, c) -> list:
        return [] if c.keys is None else [*c.keys, *c.values]

    def trim_to(self, c, held: int, n: int) -> None:
        if c.offset > n:
            c.trim(c.offset - n)

    def copy_prefix(self, c, n: int):
        dst = type(c)(group_size=c.group_size, bits=c.bits)
        if n > 0 and c.keys is not None:
            keys = tuple(mx.array(x[..., :n, :]) for x in c.keys)
            values = tuple(mx.array(x[..., :n, :]) for x in c.values)
            dst.state = (keys, values, n, c.group_size, c.bits)
        return dst

    def checkpoint(self, c):
        keys = None if c.keys is None else tuple(_copy(x) for x in c.keys)
        values = None if c.values is None else tuple(_copy(x) for x in c.values)
        return (type(c), keys, values, c.offset, c.group_size, c.bits)

    def restore(self, snap):
        cls, keys, values, offset, group, bits = snap
        c = cls(group_size=group, bits=bits)
        if keys is not None:
            c.state = (tuple(_copy(x) for x in keys), tuple(_copy(x) for x in values), offset, group, bits)
        return c

    def state(self, c) -> list:
        if c.keys is None:
            return []
        n = c.offset
        return [x[..., :n, :] for x in (*c.keys, *c.values)]

    def meta_state(self, c) -> dict:
        return {"offset": int(c.offset), "group_size": int(c.group_size), "bits": int(c.bits)}

    def from_state(self, tensors, meta):
        c = self._cls()(group_size=int(meta["group_size"]), bits=int(meta["bits"]))
        if tensors:
            c.state = (tuple(tensors[:3]), tuple(tensors[3:6]), int(meta["offset"]),
                       int(meta["group_size"]), int(meta["bits"]))
        return c


class Rotating(LayerKind):
    """mlx-lm's RotatingKVCache: a sliding window of max_size cells (`keep` first ones pinned);
    `_idx` is the next write position in the ring. Cut back to any prefix while offset <= max_size
    (nothing overwritten: the buffer's first `offset` cells are the tokens in order), else not at all
    (see the module docstring)."""
    name = "rotating"
    trims_freely = False
    batches = True           # BatchRotatingKVCache

    def arrays(self, c) -> list:
        return [] if c.keys is None else [c.keys, c.values]

    def floor(self, c, held: int) -> int:
        return 0 if c.offset <= c.max_size else c.offset

    def trim_to(self, c, held: int, n: int) -> None:
        if n < self.floor(c, held):
            raise ValueError(f"a wrapped sliding window ({c.offset} > {c.max_size}) cannot be cut back to {n}")
        if c.offset > n:
            c.trim(c.offset - n)

    def copy_prefix(self, c, n: int):
        if c.offset > c.max_size or n > c.offset:
            return None
        dst = RotatingKVCache(max_size=c.max_size, keep=c.keep)
        if n > 0 and c.keys is not None:
            dst.state = (mx.array(c.keys[..., :n, :]), mx.array(c.values[..., :n, :]), n, c.keep, c.max_size, n)
        return dst

    def checkpoint(self, c):
        if c.keys is not None and c.offset < c.keys.shape[2]:
            # Not wrapped, buffer grown ahead: only the used cells (and the write position is offset).
            n = c.offset
            return (_copy(c.keys[..., :n, :]), _copy(c.values[..., :n, :]), n, c.keep, c.max_size, n)
        return (_copy(c.keys), _copy(c.values), c.offset, c.keep, c.max_size, c._idx)

    def restore(self, snap):
        keys, values, offset, keep, max_size, idx = snap
        c = RotatingKVCache(max_size=max_size, keep=keep)
        if keys is not None:
            c.state = (_copy(keys), _copy(values), offset, keep, max_size, idx)
        return c

    def state(self, c) -> list:
        if c.keys is None:
            return []
        if c.offset < c.keys.shape[2]:
            return [c.keys[..., :c.offset, :], c.values[..., :c.offset, :]]
        return [c.keys, c.values]

    def meta_state(self, c) -> dict:
        idx = c.offset if c.keys is not None and c.offset < c.keys.shape[2] else c._idx
        return {"offset": int(c.offset), "keep": int(c.keep), "max_size": int(c.max_size), "idx": int(idx)}

    def from_state(self, tensors, meta):
        c = RotatingKVCache(max_size=int(meta["max_size"]), keep=int(meta["keep"]))
        if tensors:
            c.state = (tensors[0], tensors[1], int(meta["offset"]), int(meta["keep"]), int(meta["max_size"]),
                       int(meta["idx"]))
        return c


class Recurrent(LayerKind):
    """mlx-lm's ArraysCache: a fixed-size state per layer (Qwen3.5's conv window + DeltaNet state,
    Mamba's). It holds no past: it cannot be cut back at all, only replaced by a checkpoint."""
    name = "arrays"
    trims_freely = False
    batches = True           # ArraysCache merges its rows' states itself

    def arrays(self, c) -> list:
        return [a for a in c.cache if a is not None]

    def floor(self, c, held: int) -> int:
        return 0 if c.empty() else held

    def trim_to(self, c, held: int, n: int) -> None:
        if n < self.floor(c, held):
            raise ValueError(f"a recurrent state of {held} tokens cannot be cut back to {n}")

    def copy_prefix(self, c, n: int):
        return ArraysCache(len(c.cache)) if n == 0 else None

    def checkpoint(self, c):
        # The models replace the entries (cache[i] = new state) rather than writing into them, but a
        # copy costs nothing until evaluated and keeps that an assumption no one has to hold.
        return [_copy(a) for a in c.cache]

    def restore(self, snap):
        c = ArraysCache(len(snap))
        c.cache = [_copy(a) for a in snap]
        return c

    def state(self, c) -> list:
        return [a for a in c.cache if a is not None]

    def meta_state(self, c) -> dict:
        return {"size": len(c.cache), "present": [a is not None for a in c.cache]}

    def from_state(self, tensors, meta):
        c = ArraysCache(int(meta["size"]))
        it = iter(tensors)
        c.cache = [next(it) if p else None for p in meta["present"]]
        return c


_KINDS = {k.name: k for k in (FullKV(), QuantKV(), Rotating(), Recurrent())}
# Keyed on the mlx-lm class name, looked up through the cache's MRO (a subclass, such as the engine's
# HalfScaleQuantizedKVCache, gets its base's adapter). The one branch on a cache class in the engine.
ADAPTERS = {"KVCache": _KINDS["kv"], "QuantizedKVCache": _KINDS["kv_quant"],
            "RotatingKVCache": _KINDS["rotating"], "ArraysCache": _KINDS["arrays"]}


def kind_of(c) -> LayerKind:
    for cls in type(c).__mro__:
        k = ADAPTERS.get(cls.__name__)
        if k is not None:
            return k
    raise ModelFileError(f"this model's layer cache ({type(c).__name__}) is not one Strata knows "
                         f"({', '.join(ADAPTERS)})")


def kind_named(name: str) -> LayerKind | None:
    return _KINDS.get(name)


def check(cache: list) -> list:
    """A fresh cache from a model load: every layer must be a kind the contract knows."""
    for c in cache:
        kind_of(c)
    return cache


# ---- the conversation-level view -----------------------------------------------------------------
@dataclass
class Checkpoint:
    """The non-trimmable layers' state after the first `n` tokens (layer index -> snapshot)."""
    n: int
    layers: dict
    nbytes: int


def nbytes(cache: list) -> int:
    return sum(kind_of(c).nbytes(c) for c in cache)


def arrays(cache: list) -> list:
    return [a for c in cache for a in kind_of(c).arrays(c)]


def floor(cache: list, held: int) -> int:
    """The fewest tokens this conversation's cache can be cut back to by trimming."""
    return max((kind_of(c).floor(c, held) for c in cache), default=0)


def batchable(cache: list) -> bool:
    """Whether every layer is one mlx-lm's batch caches merge (16-bit full K/V, windows, recurrent states):
    continuous batching's rows. Quantized K/V is not (mlx-lm has no batched quantized cache)."""
    return all(kind_of(c).batches for c in cache)


def needs_checkpoints(cache: list) -> bool:
    """Whether some layer may become unable to cut back (rotating, recurrent): only those
    conversations take checkpoints."""
    return any(not kind_of(c).trims_freely for c in cache)


def checkpoint(cache: list, n: int) -> Checkpoint:
    layers = {i: kind_of(c).checkpoint(c) for i, c in enumerate(cache) if not kind_of(c).trims_freely}
    size = sum(a.nbytes for snap in layers.values() for a in snapshot_arrays(snap))
    return Checkpoint(n, layers, size)


def snapshot_arrays(snap) -> list:
    out = []
    for x in snap:
        if isinstance(x, mx.array):
            out.append(x)
        elif isinstance(x, (list, tuple)):
            out.extend(snapshot_arrays(x))
    return out


def add_checkpoint(checkpoints: list, cache: list, n: int) -> None:
    """Take a checkpoint at n tokens (message boundary) into `checkpoints`, keeping the latest
    MAX_CHECKPOINTS; nothing for caches that trim freely."""
    if n <= 0 or not needs_checkpoints(cache):
        return
    if checkpoints and checkpoints[-1].n == n:
        return
    ck = checkpoint(cache, n)
    mx.eval(snapshot_arrays(list(ck.layers.values())))
    checkpoints.append(ck)
    del checkpoints[:-MAX_CHECKPOINTS]


def rewind(cache: list, held: int, n: int, checkpoints: list, make_cache: Callable[[], list]) -> tuple[list, int]:
    """Cut a conversation holding `held` tokens back to at most `n`: (its cache, the tokens it now
    holds). Trim where every layer can; else the latest checkpoint at or before n (trimmable layers
    trimmed to it, the others restored from it); else a fresh cache (0 tokens): never a wrong one.
    Checkpoints beyond the result are dropped from `checkpoints`."""
    if n >= held:
        return cache, held
    if floor(cache, held) <= n:
        for c in cache:
            kind_of(c).trim_to(c, held, n)
        m = n
    else:
        ck = next((k for k in reversed(checkpoints) if k.n <= n), None)
        if ck is None:
            cache, m = make_cache(), 0
        else:
            for i, c in enumerate(cache):
                if i in ck.layers:
                    cache[i] = kind_of(c).restore(ck.layers[i])
                else:
                    kind_of(c).trim_to(c, held, ck.n)
            m = ck.n
    checkpoints[:] = [k for k in checkpoints if k.n <= m]
    return cache, m


def copy_prefix(cache: list, held: int, n: int, checkpoints: list, make_cache: Callable[[], list]) -> tuple[list, int, list]:
    """A new cache of this conversation's first n tokens where it can be had (the cache itself stays
    whole): (cache, tokens it holds (<= n), the checkpoints that go with it). From the layers
    directly when every one can copy a prefix of n, else from the latest checkpoint at or before n,
    else (a fresh cache, 0)."""
    fresh = make_cache()
    copies = [kind_of(c).copy_prefix(c, n) for c in cache] if n > 0 else list(fresh)
    m = n
    if any(x is None for x in copies):
        ck = next((k for k in reversed(checkpoints) if k.n <= n), None)
        if ck is None:
            return fresh, 0, []
        m = ck.n
        copies = [kind_of(c).restore(ck.layers[i]) if i in ck.layers else kind_of(c).copy_prefix(c, m)
                  for i, c in enumerate(cache)]
        if any(x is None for x in copies):
            return fresh, 0, []
    mx.eval(arrays(copies))
    return copies, m, [k for k in checkpoints if k.n <= m]


# ---- speculation's rollback -----------------------------------------------------------------------
def snapshot(cache: list, held: int):
    """Before a verify pass over a cache holding `held` tokens: None where every layer trims freely
    (rollback is a trim), else a copy of the layers that may not trim back (restored, then the
    accepted tokens are fed again)."""
    if not needs_checkpoints(cache):
        return None
    return checkpoint(cache, held)


def rollback(cache: list, held: int, drop: int, snap, replay: Callable[[int], None]) -> None:
    """Remove the last `drop` of the `held` tokens a verify pass fed. By trimming where every layer
    can; else (a recurrent state, a window the pass wrapped) the layers in `snap` (taken before the
    pass) are restored, the others trimmed to the same point, and `replay(k)` feeds the pass's
    first k = (tokens the pass fed) - drop inputs again."""
    if drop <= 0:
        return
    n = held - drop
    if floor(cache, held) <= n:
        for c in cache:
            kind_of(c).trim_to(c, held, n)
        return
    if snap is None:
        raise RuntimeError("a cache that cannot trim back was not snapshotted before the verify pass")
    start = snap.n
    for i, c in enumerate(cache):
        if i in snap.layers:
            cache[i] = kind_of(c).restore(snap.layers[i])
        else:
            kind_of(c).trim_to(c, held, start)
    replay(n - start)


# ---- files -------------------------------------------------------------------------------------------
@dataclass
class LayerState:
    """One layer's file form: its kind, its tensors and its plain facts."""
    kind: str
    tensors: list = field(default_factory=list)
    meta: dict = field(default_factory=dict)


def to_states(cache: list) -> list[LayerState]:
    out = []
    for c in cache:
        k = kind_of(c)
        out.append(LayerState(k.name, k.state(c), k.meta_state(c)))
    return out


def from_states(states: list[LayerState]) -> list:
    return [_KINDS[s.kind].from_state(s.tensors, s.meta) for s in states]
