"""Pipeline parallelism: one model's layers split into contiguous ranges, one range per process.

Rank 0 embeds the tokens, each rank runs its own layers and sends the hidden states on to the next
rank (mx.distributed.send/recv, neighbours on the ring), the last rank applies the final norm and the
output head. The last position's logits are then summed over the group (the other ranks add zeros,
so the sum is exact) so that every rank holds the same logits and samples the same token: the
followers run the engine's own generation loop in lockstep with rank 0.

A rank builds the mlx-lm model from the WHOLE model's arguments (so every block is configured by its
absolute index: Gemma's sliding/global pattern, Qwen3.5's DeltaNet/attention pattern, gpt-oss's layer
types), then keeps only its own blocks (renumbered from 0 in the parameter tree, the engine's caches
and steering) and reads only their tensors from the GGUF (plus the embeddings on the first rank, the
norm and output head on the last, the embeddings there too when the output is tied to them, and on
every rank for Gemma 4, whose per-layer inputs come from the token embeddings).

A step runs the mlx-lm model's own forward (embedding scale, per-layer-type masks, logit scaling and
soft-capping stay mlx-lm's), with the other ranks' blocks stood in for by `_Skip`s for the length of
the call: the skip just before this rank's blocks receives the hidden states from the previous rank,
the skip just after them sends them on. The masks the forward builds from another rank's cache slot
come from one of this rank's caches of the same kind (same offset, same window), which is what those
layers would have held. Layers whose inputs cross ranks in another way than the hidden states (Gemma
4's K/V-sharing layers read the K/V of an earlier layer) are kept on one rank (`split_for`).
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import make_prompt_cache
from engine.cache import layer_cache

_LAYER_RE = re.compile(r"(.*?model\.)layers\.(\d+)(\..*|)")
_EMBED_RE = re.compile(r"(.*?model\.)embed_tokens\..*")
_NORM_RE = re.compile(r"(.*?model\.)norm\..*")
_HEAD_RE = re.compile(r"(.*\.)?lm_head\..*")


def split_layers(n_layer: int, size: int) -> list[tuple[int, int]]:
    """Contiguous [start, end) ranges, as even as possible, earlier ranks taking the remainder."""
    if size > n_layer:
        raise ValueError(f"{size} ranks cannot split {n_layer} layers (at least one layer per rank)")
    base, extra = divmod(n_layer, size)
    out, start = [], 0
    for r in range(size):
        n = base + (1 if r < extra else 0)
        out.append((start, start + n))
        start += n
    return out


def _shared_kv_floor(args) -> int | None:
    """Gemma 4: the first layer that must share a rank with every layer after it (the K/V-sharing
    layers read the K/V their source layer computed in the same step), or None."""
    n_shared = int(getattr(args, "num_kv_shared_layers", 0) or 0)
    types = getattr(args, "layer_types", None)
    if n_shared <= 0 or not types:
        return None
    n = args.num_hidden_layers
    first = n - n_shared
    sources = [max(i for i in range(first) if types[i] == types[j]) for j in range(first, n)]
    return min(sources)


def split_for(args, size: int) -> list[tuple[int, int]]:
    """The split of this model over `size` ranks: even, unless that would put a K/V-sharing layer on
    another rank than its source (then the shared group goes whole to the last rank and the layers
    before it are split evenly over the others). ValueError with one line when it cannot be."""
    n = args.num_hidden_layers
    split = split_layers(n, size)
    lo = _shared_kv_floor(args)
    if lo is None or all(not (lo < a < n) for a, _ in split):
        return split
    arch = getattr(args, "model_type", "this model")
    if lo < size - 1:
        raise ValueError(f"{arch}: its K/V-sharing layers read layers {lo}..{n - 1} on one rank, which leaves "
                         f"{lo} layer(s) for the other {size - 1} rank(s); use fewer ranks")
    return split_layers(lo, size - 1) + [(lo, n)]


def text_model(model: nn.Module) -> tuple[nn.Module, nn.Module]:
    """(the module holding `layers`, `embed_tokens` and `norm`; the one holding `lm_head`)."""
    # language_model first: qwen3_5's outer `model` is a property onto language_model.model, whose head
    # (when untied) is language_model.lm_head
    for owner in (getattr(model, "language_model", None), model):
        inner = getattr(owner, "model", None) if owner is not None else None
        if isinstance(inner, nn.Module) and isinstance(getattr(inner, "layers", None), list):
            return inner, owner
    raise ValueError(f"{type(model).__module__}: no model.layers to split")


class _Skip(nn.Module):
    """Another rank's block, during a step: passes the hidden states through; the one just before this
    rank's blocks receives them from the previous rank instead, the one just after sends them on.
    Carries the few plain facts mlx-lm's forward and make_cache read off a block (its kind)."""
    _FACTS = ("is_linear", "layer_type", "layer_idx", "is_sliding", "use_sliding")

    def __init__(self, template: nn.Module, tuple_out: bool):
        super().__init__()
        for k in self._FACTS:
            if hasattr(template, k):
                setattr(self, k, getattr(template, k))
        self.tuple_out = tuple_out
        self.recv_from = None           # (rank, group, dtype): the previous rank's output replaces ours
        self.send_to = None             # (rank, group): our input goes on to the next rank

    def __call__(self, x, *args, **kwargs):
        if self.recv_from is not None:
            rank, group, dtype = self.recv_from
            x = mx.distributed.recv(x.shape, dtype, rank, group=group)
        if self.send_to is not None:
            rank, group = self.send_to
            # Evaluated now: the next rank waits for it, and nothing else on this rank depends on it.
            mx.eval(mx.distributed.send(x, rank, group=group))
        return (x, None, None) if self.tuple_out else x


class _Zeros(nn.Module):
    """Stands in for a module this rank does not hold (embeddings, norm, head): the right shape, no
    parameters. What it computes is never used (the rank's logits are zeros in the all_sum)."""

    def __init__(self, width: int, dtype, last_only: bool = False):
        super().__init__()
        self.width, self.dtype, self.last_only = width, dtype, last_only

    def __call__(self, x):
        if x.dtype in (mx.int32, mx.uint32, mx.int64):       # token ids (an embedding)
            return mx.zeros(x.shape + (self.width,), dtype=self.dtype)
        if self.last_only:
            x = x[:, -1:]
        return mx.zeros(x.shape[:-1] + (self.width,), dtype=self.dtype)

    def as_linear(self, x):
        return mx.zeros(x.shape[:-1] + (self.width,), dtype=self.dtype)


class _LastNorm(nn.Module):
    """The last rank's final norm on the last position only: the head then computes one row of logits
    (what the engine reads) instead of one per prompt token."""

    def __init__(self, norm: nn.Module):
        super().__init__()
        self.norm = norm

    def __call__(self, x):
        return self.norm(x[:, -1:, :])


@dataclass
class _Plan:
    """What a rank's model needs beyond its own blocks (a plain object: kept out of the parameter tree)."""
    skips: dict = field(default_factory=dict)     # global index -> _Skip for every other rank's block
    n_layer: int = 0
    start: int = 0                                # this rank's first block (global index)


@dataclass(frozen=True)
class PipelinePart:
    """What one rank holds of the model."""
    rank: int
    size: int
    start: int          # first layer (global index)
    end: int            # one past the last layer
    n_layer: int
    embed_everywhere: bool = False      # Gemma 4: every rank computes its blocks' per-layer inputs

    @property
    def first(self) -> bool:
        return self.rank == 0

    @property
    def last(self) -> bool:
        return self.rank == self.size - 1

    def describe(self) -> str:
        return f"layers {self.start}..{self.end - 1}"

    def _wants_embed(self, tied: bool) -> bool:
        return self.first or (self.last and tied) or self.embed_everywhere

    def local_name(self, name: str, tied: bool) -> str | None:
        """The mlx-lm parameter name (still numbered globally: the architecture's fix_weights and
        mlx-lm's sanitize read layer numbers) or None when another rank holds the tensor."""
        m = _LAYER_RE.fullmatch(name)
        if m:
            return name if self.start <= int(m.group(2)) < self.end else None
        if _EMBED_RE.fullmatch(name):
            return name if self._wants_embed(tied) else None
        if _NORM_RE.fullmatch(name) or _HEAD_RE.fullmatch(name):
            return name if self.last else None
        return name

    def localize(self, named: dict) -> dict:
        """Weights (or quantization parameters) by global name -> this rank's: its blocks renumbered
        from 0, every other block dropped (an architecture's fix_weights may add entries for every block)."""
        out = {}
        for k, v in named.items():
            m = _LAYER_RE.fullmatch(k)
            if m is None:
                out[k] = v
            elif self.start <= int(m.group(2)) < self.end:
                out[f"{m.group(1)}layers.{int(m.group(2)) - self.start}{m.group(3)}"] = v
        return out

    def build(self, model_cls, args) -> nn.Module:
        """The mlx-lm model built as the whole one, then holding only this rank's blocks and without the
        modules it does not need (no memory is spent on them: mlx-lm's initial weights are lazy and
        never evaluated, and a strict weight load checks exactly this rank's part)."""
        model = model_cls(args)
        inner, head_owner = text_model(model)
        layers = list(inner.layers)
        if len(layers) != self.n_layer:
            raise ValueError(f"{type(model).__module__}: {len(layers)} blocks, the file says {self.n_layer}")
        tuple_out = getattr(args, "model_type", "") == "gemma4_text" or type(inner).__name__ == "Gemma4TextModel"
        plan = _Plan({i: _Skip(layers[i], tuple_out) for i in range(self.n_layer)
                      if not self.start <= i < self.end}, self.n_layer, self.start)
        inner.layers = layers[self.start:self.end]
        tied = args.tie_word_embeddings
        if not self._wants_embed(tied):
            del inner["embed_tokens"]
        if not self.last:
            del inner["norm"]
            if "lm_head" in head_owner:
                # a parameterless stand-in rather than nothing: some sanitize steps pop it (Gemma 3)
                head_owner.lm_head = _Zeros(args.vocab_size, mx.float32)
        model._pipeline_plan = plan
        return model


class _RankModel(nn.Module):
    """What both distributed forms share: the inner mlx-lm model's layers and caches, the watchdog's
    heartbeat (`on_step`, one per call) and cancelling in lockstep: rank 0 adds its cancel flag to
    the logits' all_sum, so every rank reads the same flag for the same step
    (engine.ranks.distributed.LockstepCancel)."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.model = inner.model            # steering.install and make_cache find model.model.layers
        self.inner = inner
        self.on_step = None                 # the distributed watchdog's heartbeat
        self.cancel_source = None           # rank 0: () -> bool, the request's cancel button
        self.last_flag = None               # this step's summed flag (lazy, like the logits)

    @property
    def layers(self):
        return self.model.layers

    def make_cache(self) -> list:
        return make_prompt_cache(self.inner)

    def _all_sum_with_flag(self, logits: mx.array, rank0: bool, group) -> mx.array:
        """all_sum of every rank's (B, 1, vocab) logits with rank 0's cancel flag riding along.
        Lazy: decode evaluates it on every rank (the sampled token), and so does every rank's cancel
        check (the flag); one collective per step, so the ranks cannot run two in different orders."""
        flag = 1.0 if rank0 and self.cancel_source is not None and self.cancel_source() else 0.0
        ext = mx.concatenate([logits, mx.full(logits.shape[:2] + (1,), flag, dtype=logits.dtype)], axis=-1)
        out = mx.distributed.all_sum(ext, group=group)
        self.last_flag = out[0, 0, -1]
        return out[..., :-1]


def _fresh(template):
    """A new empty cache of the same kind and window as `template`."""
    return layer_cache.kind_of(template).restore(layer_cache.kind_of(template).checkpoint(template))


def _kind_key(c) -> tuple:
    """Which caches answer a mask the same way: the same kind and, for a window, the same size."""
    name = layer_cache.kind_of(c).name
    return ("kv" if name in ("kv", "kv_quant") else name, getattr(c, "max_size", None))


class PipelineModel(_RankModel):
    """Callable like an mlx-lm model: (tokens (B, L), cache) -> logits (B, 1, vocab) of the last position.
    `cache` holds this rank's blocks' caches only (whatever their kinds), in block order.

    Only the last position's logits are returned (and broadcast): the engine's prefill discards
    logits and its decode reads position -1."""

    def __init__(self, inner: nn.Module, part: PipelinePart, group, vocab: int, hidden: int, tied: bool,
                 dtype=mx.float32):
        super().__init__(inner)
        self.compute_dtype = dtype
        self.part, self.group, self.vocab, self.hidden, self.tied = part, group, vocab, hidden, tied
        self.text, self.head_owner = text_model(inner)
        plan: _Plan = inner._pipeline_plan
        p = part
        if p.start > 0:
            plan.skips[p.start - 1].recv_from = (p.rank - 1, group, dtype)
        if p.end < plan.n_layer:
            plan.skips[p.end].send_to = (p.rank + 1, group)
        self.plan = plan
        # The whole model's cache kinds by global index (mlx-lm's make_cache, run on the whole layout):
        # a stand-in for another rank's slot is one of ours of the same kind.
        with self._whole():
            self.whole_template = list(super().make_cache())

    # -- the whole model, for the length of a call -------------------------------------------------
    def _whole(self):
        model = self

        class _Swap:
            def __enter__(self):
                t, plan, p = model.text, model.plan, model.part
                self.saved = {"layers": t.layers}
                own = list(t.layers)
                t.layers = [plan.skips[i] if i in plan.skips else own[i - p.start] for i in range(plan.n_layer)]
                for name, width in (("embed_tokens", model.hidden), ("norm", model.hidden)):
                    self.saved[name] = t[name] if name in t else None
                    if name not in t:
                        setattr(t, name, _Zeros(width, model.compute_dtype))
                self.saved["lm_head"] = model.head_owner["lm_head"] if "lm_head" in model.head_owner else None
                if p.last:
                    t.norm = _LastNorm(self.saved["norm"])
                elif self.saved["lm_head"] is None:
                    model.head_owner.lm_head = _Zeros(model.vocab, model.compute_dtype)
                else:
                    self.saved["lm_head"] = None        # our stand-in: put back after the call
                return self

            def __exit__(self, *exc):
                t = model.text
                t.layers = self.saved["layers"]
                for name, owner in (("embed_tokens", t), ("norm", t), ("lm_head", model.head_owner)):
                    if self.saved[name] is not None:
                        setattr(owner, name, self.saved[name])
                    elif name in owner:
                        del owner[name]
                return False
        return _Swap()

    def make_cache(self) -> list:
        """This rank's blocks' caches (the whole model's make_cache, cut to this rank's slots; Gemma 4's
        K/V-sharing blocks have none), then one "ghost" per kind of cache that cannot be cut back freely
        (a window of a given size, a recurrent state) which the whole model has and this rank's blocks
        do not. The engine decides from a conversation's caches whether to take checkpoints, how far it
        can cut back, when to fall back to a checkpoint (engine/cache/layer_cache.py); with the ghosts every
        rank sees the same kinds at the same offsets and so decides alike (else the ranks would prefill
        different chunks and wait on each other for good). A ghost is a real cache of its kind fed a
        one-wide zero K/V (or a one-value state) with every step: its offset, wrap and trim follow the
        real ones' for a few bytes."""
        with self._whole():
            whole = super().make_cache()
        own = whole[self.part.start:min(self.part.end, len(whole))]
        return own + [_fresh(t) for t in self._ghost_kinds(own)]

    def _ghost_kinds(self, own: list) -> list:
        have = {_kind_key(c) for c in own}
        out = {}
        for t in self.whole_template:
            k = _kind_key(t)
            if k not in have and k not in out and not layer_cache.kind_of(t).trims_freely:
                out[k] = t
        return list(out.values())

    @property
    def n_own_caches(self) -> int:
        """How many of a conversation's caches are this rank's blocks' (the rest are ghosts)."""
        return max(0, min(self.part.end, len(self.whole_template)) - self.part.start)

    def _feed_ghosts(self, ghosts: list, B: int, L: int) -> None:
        for g in ghosts:
            if layer_cache.kind_of(g).name == "arrays":
                if g.cache[0] is None:
                    g.cache[0] = mx.zeros((B, 1), dtype=self.compute_dtype)
            else:
                z = mx.zeros((B, 1, L, 1), dtype=self.compute_dtype)
                g.update_and_fetch(z, z)

    def make_whole_cache(self) -> list:
        """Fresh caches of the whole model (rank 0 reads a session file into them)."""
        with self._whole():
            return list(super().make_cache())

    def _full_cache(self, cache) -> list:
        p, template = self.part, self.whole_template
        mine = {}
        for c in cache:                 # this rank's own caches first, then the ghosts
            mine.setdefault(_kind_key(c), c)
        out = []
        for i, t in enumerate(template):
            if p.start <= i < p.end:
                out.append(cache[i - p.start])
            else:
                # a never-written template where this rank has no cache of that kind: only the
                # other ranks' layers of that kind read the mask made from it
                out.append(mine.get(_kind_key(t), t))
        return out

    def __call__(self, inputs: mx.array, cache=None):
        if self.on_step is not None:
            self.on_step()
        p = self.part
        B, L = inputs.shape[:2]
        full = None if cache is None else self._full_cache(cache)
        with self._whole():
            out = self.inner(inputs, cache=full)
        if cache is not None:
            self._feed_ghosts(cache[self.n_own_caches:], B, L)
        if p.last:
            logits = out[:, -1:, :].astype(self.compute_dtype)
        else:
            logits = mx.zeros((B, 1, self.vocab), dtype=self.compute_dtype)
        return self._all_sum_with_flag(logits, p.first, self.group)


class TensorModel(_RankModel):
    """mlx-lm's sharded model (tensor parallel): every rank computes the same logits; as in the
    pipeline, the last position's logits and rank 0's cancel flag travel in one all_sum per step
    (the others add zeros), and the watchdog's heartbeat ticks on each call."""

    def __init__(self, inner: nn.Module, group, rank: int, tied: bool):
        super().__init__(inner)
        self.group, self.rank, self.tied = group, rank, tied

    def __call__(self, inputs: mx.array, cache=None):
        if self.on_step is not None:
            self.on_step()
        h = self.model(inputs, cache)[:, -1:, :]      # the head on the last position only
        logits = self.model.embed_tokens.as_linear(h) if self.tied else self.inner.lm_head(h)
        first = self.rank == 0
        # `* 0` rather than zeros: every rank's graph must hold the same collectives (the layers'
        # all_sums) in the same order, so the other ranks' contribution still depends on their logits.
        return self._all_sum_with_flag(logits if first else logits * 0, first, self.group)


def embeds_everywhere(args) -> bool:
    """Whether every rank needs the token embeddings (Gemma 4's per-layer inputs are computed from them
    and from the token ids at the start of every step)."""
    return bool(getattr(args, "hidden_size_per_layer_input", 0))
