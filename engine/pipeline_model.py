"""Pipeline parallelism: one model's layers split into contiguous ranges, one range per process.

Rank 0 embeds the tokens, each rank runs its own layers and sends the hidden states on to the next
rank (mx.distributed.send/recv, neighbours on the ring), the last rank applies the final norm and the
output head. The last position's logits are then summed over the group (the other ranks add zeros,
so the sum is exact) so that every rank holds the same logits and samples the same token: the
followers run the engine's own generation loop in lockstep with rank 0.

A rank builds the mlx-lm model with only its own layers (renumbered from 0) and reads only their
tensors from the GGUF (plus the embeddings on the first rank, the norm and output head on the last,
and the embeddings there too when the output is tied to them).
"""
from __future__ import annotations

import copy
import re
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn


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


@dataclass(frozen=True)
class PipelinePart:
    """What one rank holds of the model."""
    rank: int
    size: int
    start: int          # first layer (global index)
    end: int            # one past the last layer
    n_layer: int

    @property
    def first(self) -> bool:
        return self.rank == 0

    @property
    def last(self) -> bool:
        return self.rank == self.size - 1

    def describe(self) -> str:
        return f"layers {self.start}..{self.end - 1}"

    def local_name(self, name: str, tied: bool) -> str | None:
        """The mlx-lm parameter name on this rank, or None when another rank holds the tensor."""
        m = re.match(r"model\.layers\.(\d+)\.(.*)", name)
        if m:
            i = int(m.group(1))
            return f"model.layers.{i - self.start}.{m.group(2)}" if self.start <= i < self.end else None
        if name.startswith("model.embed_tokens."):
            return name if self.first or (self.last and tied) else None
        if name.startswith(("model.norm.", "lm_head.")):
            return name if self.last else None
        return name

    def build(self, model_cls, args) -> nn.Module:
        """The mlx-lm model with this rank's layers only and without the modules it does not need
        (so no memory is spent on them and a strict weight load checks exactly this rank's part)."""
        local = copy.copy(args)
        local.num_hidden_layers = self.end - self.start
        if getattr(local, "layer_types", None) is not None and len(local.layer_types) == args.num_hidden_layers:
            local.layer_types = list(args.layer_types[self.start:self.end])
        model = model_cls(local)
        inner = model.model
        tied = args.tie_word_embeddings
        if not (self.first or (self.last and tied)):
            del inner["embed_tokens"]
        if not self.last:
            del inner["norm"]
            if "lm_head" in model:
                del model["lm_head"]
        return model


class _RankModel(nn.Module):
    """What both distributed forms share: the inner mlx-lm model's layers and caches, the watchdog's
    heartbeat (`on_step`, one per call) and cancelling in lockstep: rank 0 adds its cancel flag to
    the logits' all_sum, so every rank reads the same flag for the same step
    (engine.distributed.LockstepCancel)."""

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
        from mlx_lm.models.cache import make_prompt_cache
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


class PipelineModel(_RankModel):
    """Callable like an mlx-lm model: (tokens (B, L), cache) -> logits (B, 1, vocab) of the last position.

    Only the last position's logits are returned (and broadcast): the engine's prefill discards
    logits and its decode reads position -1."""

    def __init__(self, inner: nn.Module, part: PipelinePart, group, vocab: int, hidden: int, tied: bool,
                 dtype=mx.float32):
        super().__init__(inner)
        self.compute_dtype = dtype
        self.part, self.group, self.vocab, self.hidden, self.tied = part, group, vocab, hidden, tied

    def __call__(self, inputs: mx.array, cache=None):
        from mlx_lm.models.base import create_attention_mask
        if self.on_step is not None:
            self.on_step()
        p, g = self.part, self.group
        B, L = inputs.shape[:2]
        dtype = self.compute_dtype
        if p.first:
            h = self.model.embed_tokens(inputs)
        else:
            h = mx.distributed.recv((B, L, self.hidden), dtype, p.rank - 1, group=g)
        if cache is None:
            cache = [None] * len(self.model.layers)
        mask = create_attention_mask(h, cache[0])
        for layer, c in zip(self.model.layers, cache):
            h = layer(h, mask, cache=c)
        if not p.last:
            # Evaluated now: the next rank waits for it, and nothing else on this rank depends on it.
            mx.eval(mx.distributed.send(h, p.rank + 1, group=g))
            logits = mx.zeros((B, 1, self.vocab), dtype=dtype)
        else:
            out = self.model.norm(h[:, -1:, :])
            logits = self.model.embed_tokens.as_linear(out) if self.tied else self.inner.lm_head(out)
        return self._all_sum_with_flag(logits, p.first, g)


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
