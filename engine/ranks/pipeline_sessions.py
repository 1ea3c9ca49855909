"""Session files of a pipeline-split model: each rank holds its own blocks' caches, of whatever kinds
(full K/V, a sliding window, a recurrent state, quantized K/V); the file is the single-process one.

Everything goes through the cache contract (engine/cache/layer_cache.py): a layer travels as its
LayerState (kind, tensors, meta). For a save rank 0 gathers every rank's layer states in block order
and rebuilds the whole model's caches from them (`gather`); for a restore it sends each layer's state
to every rank and the owner rebuilds its cache (`scatter`). The plain facts (kind, meta, each tensor's
shape and dtype) go first as one pickled message from the rank that has them; each tensor then as an
all_sum to which only that rank adds (exact: the others add zeros), which works on any ring
(send/recv reach only neighbours). Every rank calls these functions at the same point of a request.
"""
from __future__ import annotations

import pickle

import mlx.core as mx

from engine.cache import layer_cache
from engine.session_files import session_v3
from engine.cache.kv_format import make_cache
from engine.ranks.pipeline_model import _kind_key


def _dtype(name: str):
    return getattr(mx, name.rsplit(".", 1)[-1])


def _facts(states: list) -> bytes:
    return pickle.dumps([(s.kind, s.meta, [(tuple(a.shape), str(a.dtype)) for a in s.tensors]) for s in states])


def _from(dist, src: int, states: list | None) -> list:
    """The layer states rank `src` holds (`states` there, None elsewhere), on every rank."""
    facts = pickle.loads(dist._bytes_collective(_facts(states) if dist.rank == src else None))
    out = []
    for j, (kind, meta, specs) in enumerate(facts):
        tensors = [dist._broadcast(src, states[j].tensors[k] if dist.rank == src else None, shape, _dtype(dt))
                   for k, (shape, dt) in enumerate(specs)]
        out.append(layer_cache.LayerState(kind, tensors, meta))
    return out


def gather(dist, cache: list, model) -> list | None:
    """Rank 0: the whole model's caches in block order (new objects); the other ranks: None. Only each
    rank's own blocks' caches travel (not its ghosts: PipelineModel.make_cache)."""
    mine = layer_cache.to_states(cache[:model.n_own_caches])
    whole = []
    for r in range(dist.size):
        got = _from(dist, r, mine if r == dist.rank else None)
        if dist.rank == 0:
            whole.extend(got)
    return layer_cache.from_states(whole) if dist.rank == 0 else None


def _snap_states(cache: list, ck, keep) -> tuple[list, list]:
    """A checkpoint's layers as (their indices, LayerStates), those `keep(i)` says."""
    idx = [i for i in sorted(ck.layers) if keep(i)]
    return idx, [layer_cache.to_states([layer_cache.kind_of(cache[i]).restore(ck.layers[i])])[0] for i in idx]


def _checkpoint(n: int, states: dict):
    """A Checkpoint of `n` tokens from {layer index: LayerState}."""
    snaps = {}
    for i, s in states.items():
        kind = layer_cache.kind_named(s.kind)
        snaps[i] = kind.checkpoint(kind.from_state(s.tensors, s.meta))
    size = sum(a.nbytes for snap in snaps.values() for a in layer_cache.snapshot_arrays(snap))
    return layer_cache.Checkpoint(n, snaps, size)


def gather_checkpoints(dist, entry, model) -> list:
    """Rank 0: the conversation's checkpoints (engine/cache/layer_cache.py) for the whole model, layers numbered
    globally (every rank holds the same checkpoints at the same token counts: they decide alike)."""
    own, out = model.n_own_caches, []
    for ck in entry.checkpoints:
        whole = {}
        for r, (start, _) in enumerate(dist.split):
            idx, states = _snap_states(entry.cache, ck, lambda i: i < own) if r == dist.rank else ([], None)
            idx = pickle.loads(dist._bytes_collective(pickle.dumps(idx) if r == dist.rank else None))
            for i, s in zip(idx, _from(dist, r, states)):
                whole[start + i] = s
        if dist.rank == 0:
            out.append(_checkpoint(ck.n, whole))
    return out


def _one_wide(s) -> "layer_cache.LayerState":
    return layer_cache.LayerState(s.kind, [x[(slice(None),) + (slice(0, 1),) * (x.ndim - 1)] for x in s.tensors],
                                  s.meta)


def _local(model, states: dict, ghost_src: list) -> dict:
    """{global index: state} -> this rank's {local index: state}, its ghosts cut from the layers
    `ghost_src` names (global indices, one per ghost kind)."""
    start, own = model.part.start, model.n_own_caches
    out = {i - start: s for i, s in states.items() if start <= i < start + own}
    for g, i in enumerate(ghost_src):
        if i in states:
            out[own + g] = _one_wide(states[i])
    return out


def scatter(dist, whole: list | None, checkpoints: list | None, model) -> tuple[list, list]:
    """Every rank: its own blocks' caches of the whole model's `whole` (held by rank 0), then its ghosts,
    each one cut from a layer of its kind (the same offset, window position and wrap, one wide); and
    the conversation's checkpoints for those same caches."""
    states = _from(dist, 0, layer_cache.to_states(whole) if dist.rank == 0 else None)
    own = layer_cache.from_states(states[model.part.start:model.part.start + model.n_own_caches])
    whole_caches = layer_cache.from_states(states)
    ghost_src = [next(i for i, c in enumerate(whole_caches) if _kind_key(c) == _kind_key(t))
                 for t in model._ghost_kinds(own)]
    local = _local(model, dict(enumerate(states)), ghost_src)
    cache = layer_cache.from_states([local[i] for i in range(len(local))])
    ns = pickle.loads(dist._bytes_collective(pickle.dumps([c.n for c in checkpoints]) if dist.rank == 0 else None))
    cks = []
    for k, n in enumerate(ns):
        idx, got = _snap_states(whole, checkpoints[k], lambda i: True) if dist.rank == 0 else ([], None)
        idx = pickle.loads(dist._bytes_collective(pickle.dumps(idx) if dist.rank == 0 else None))
        cks.append(_checkpoint(n, _local(model, dict(zip(idx, _from(dist, 0, got))), ghost_src)))
    return cache, cks


def probe(dist, model, make_cache) -> list | None:
    """The whole model's cache after one token (what a format-3 file's layers are checked against),
    on rank 0; every rank runs the one-token step together (it crosses the ranks)."""
    cache = make_cache()
    model(mx.array([[0]]), cache=cache)
    mx.eval(layer_cache.arrays(cache))
    return gather(dist, cache, model)


def needs_probe(model) -> bool:
    """Whether this model's sessions are format 3 (some layer is not full K/V): the same answer on
    every rank, from the whole model's cache kinds."""
    return session_v3.needed(model.whole_template)


class WholeModel:
    """What kv_format.make_cache asks of a model, for the whole of a split one (rank 0 reads a file
    into it)."""

    def __init__(self, model):
        self.model = model

    def make_cache(self) -> list:
        return self.model.make_whole_cache()


def whole_cache(engine) -> list:
    return make_cache(WholeModel(engine.model), engine.kv_fmt)
