"""The text model's positions around images for Qwen3.5 / Qwen3.6 (`qwen35`, `qwen35moe`), as llama.cpp
decodes them with libmtmd (mtmd-helper's M-RoPE positions, ggml's interleaved M-RoPE):

* an image of rows x cols tokens starting at position p0 takes positions (t, h, w) = (p0, p0 + row,
  p0 + col) in the full-attention layers' RoPE (`rope.dimension_sections` frequencies each: the
  interleaved layout, frequency k turning with h when k % 3 == 1, w when k % 3 == 2, else t);
* the text after it goes on from p0 + max(rows, cols), not from p0 + rows x cols: a conversation's
  text positions are its token offset plus a `shift` (the sum over its images of max - rows x cols,
  never > 0);
* a text token's three positions are equal, so its RoPE is mlx-lm's plain one at offset + shift.

The Gated DeltaNet layers take no positions. `positions(model, shift)` installs the shift for one
turn of a conversation with images (the full-attention layers' RoPE wrapped, put back after it), so
a text-only conversation's RoPE is mlx-lm's own, untouched; `feed` reads an image's embeddings with
its (t, h, w) positions.
"""
from __future__ import annotations

from contextlib import contextmanager

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from engine.cache import layer_cache
from engine.errors import RequestError


class _State:
    """What the wrapped RoPEs of one model share: the text shift, and an image's cos/sin while it is fed."""

    def __init__(self, shift: int):
        self.shift = shift
        self.table: tuple[mx.array, mx.array] | None = None


class ShiftedRoPE(nn.Module):
    """A full-attention layer's RoPE during a turn with images: mlx-lm's own at offset + shift, or
    an image's per-token M-RoPE table while the image is fed."""

    def __init__(self, inner: nn.Module, state: _State):
        super().__init__()
        self.inner = inner
        self.shared = state

    def __call__(self, x: mx.array, offset=0) -> mx.array:
        if self.shared.table is not None:
            return rotate(x, *self.shared.table)
        return self.inner(x, offset=offset + self.shared.shift)


def _attention_layers(model) -> list:
    return [layer.self_attn for layer in model.layers if not layer.is_linear]


@contextmanager
def positions(model, shift: int):
    """The full-attention layers' RoPE shifted by `shift` (the positions the conversation's images so
    far took less than their tokens) until the block ends; yields the shared state (`feed` moves it on)."""
    attns = _attention_layers(model)
    if attns and isinstance(attns[0].rope, ShiftedRoPE):     # already inside a turn's positions
        yield attns[0].rope.shared
        return
    state = _State(shift)
    originals = [a.rope for a in attns]
    for a in attns:
        a.rope = ShiftedRoPE(a.rope, state)
    try:
        yield state
    finally:
        for a, r in zip(attns, originals):
            a.rope = r


def _state_of(model) -> _State:
    attns = _attention_layers(model)
    rope = attns[0].rope if attns else None
    if not isinstance(rope, ShiftedRoPE):
        raise RequestError("an image was fed outside a turn's positions (engine/vision/text_mrope.positions)")
    return rope.shared


def _sections(model) -> tuple[int, int, int]:
    cfg = getattr(model.language_model.args, "rope_scaling", None) or {}
    sec = cfg.get("mrope_section")
    if not sec or len(sec) < 3:
        raise RequestError("the model file has no rope.dimension_sections: its image positions are unknown")
    return int(sec[0]), int(sec[1]), int(sec[2])


def table(model, pos: np.ndarray) -> tuple[mx.array, mx.array]:
    """cos, sin (L, n_rot / 2) of ggml's interleaved M-RoPE for positions `pos` (3, L) = (t, h, w),
    the running theta multiplied by base^(-2 / n_rot) in float32 as ggml does."""
    args = model.language_model.args
    n_rot = int(args.head_dim * args.partial_rotary_factor)
    s0, s1, s2 = _sections(model)
    total = s0 + s1 + s2
    scale = np.float32(args.rope_theta) ** np.float32(-2.0 / n_rot)
    theta = pos.astype(np.float32)                          # (3, L): the running theta of t, h, w
    cols = []
    for k in range(n_rot // 2):
        sector = k % total
        if sector % 3 == 1 and sector < 3 * s1:
            cols.append(theta[1])
        elif sector % 3 == 2 and sector < 3 * s2:
            cols.append(theta[2])
        elif sector % 3 == 0 and sector < 3 * s0:
            cols.append(theta[0])
        else:
            cols.append(np.zeros_like(theta[0]))            # the 4th section: an image's is 0
        theta = (theta * scale).astype(np.float32)
    ang = np.stack(cols, axis=-1)
    return mx.array(np.cos(ang)), mx.array(np.sin(ang))


def rotate(x: mx.array, cos: mx.array, sin: mx.array) -> mx.array:
    """NEOX-style rotation of the first 2 x cos.shape[-1] dims of (B, H, L, D) by per-token angles."""
    half = cos.shape[-1]
    a, b, rest = x[..., :half], x[..., half:2 * half], x[..., 2 * half:]
    cos, sin = cos.astype(x.dtype), sin.astype(x.dtype)
    return mx.concatenate([a * cos - b * sin, a * sin + b * cos, rest], axis=-1)


def feed(model, cache, embeddings: mx.array, grid: tuple[int, int]) -> None:
    """An image's (rows x cols, width) embeddings through the text layers (causal, as llama.cpp decodes
    a Qwen image chunk) at positions (p0, p0 + row, p0 + col), p0 = the cache's offset + the shift;
    the shift then moves on by max(rows, cols) - rows x cols."""
    state = _state_of(model)
    rows, cols = grid
    offset = next(c.offset for layer, c in zip(model.layers, cache) if not layer.is_linear)
    p0 = offset + state.shift
    yy, xx = np.mgrid[0:rows, 0:cols]
    state.table = table(model, np.stack([np.full(rows * cols, p0), p0 + yy.ravel(), p0 + xx.ravel()]))
    try:
        model.model(None, cache, input_embeddings=embeddings[None])
        mx.eval(layer_cache.arrays(cache))
    finally:
        state.table = None
    state.shift += max(rows, cols) - rows * cols
