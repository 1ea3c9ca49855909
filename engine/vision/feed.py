"""Feeding an image's embeddings into the text model, as llama.cpp's `mtmd_helper_eval_chunks` does: the
image's tokens go in as one pass. Where the family decodes image chunks non-causally (Gemma 3) its tokens
see each other both ways; on sliding-window layers a query still sees earlier keys only within the
window, later ones of the same image always. The embeddings are not scaled by sqrt(width) as token
embeddings are (llama.cpp scales token input only)."""
from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.base import create_attention_mask

from engine.cache import layer_cache


def both_ways(mask: mx.array, n: int) -> mx.array:
    """A causal (L, keys) mask whose last `n` columns (the pass's own tokens) are opened to later ones."""
    later = mx.triu(mx.ones((n, n), dtype=mx.bool_), k=1)
    own = mask[..., -n:] | later
    return own if mask.shape[-1] == n else mx.concatenate([mask[..., :-n], own], axis=-1)


def feed_gemma3(model, cache, h: mx.array) -> None:
    """Gemma 3's text blocks over (1, L, width) input embeddings, the L tokens seeing each other both
    ways (mlx-lm's gemma3_text layout: every `sliding_window_pattern`-th layer global)."""
    inner = model.model
    n = h.shape[1]
    pattern = inner.sliding_window_pattern
    gmask = both_ways(create_attention_mask(h, cache[pattern - 1], return_array=True), n)
    smask = None
    if pattern > 1:
        smask = both_ways(create_attention_mask(h, cache[0], window_size=inner.window_size, return_array=True), n)
    for i, (layer, c) in enumerate(zip(inner.layers, cache)):
        h = layer(h, gmask if i % pattern == pattern - 1 else smask, c)
    mx.eval(layer_cache.arrays(cache))


def feed_causal(model, cache, h: mx.array) -> None:
    """A text model's own forward pass (mlx-lm's `model.model(inputs, cache, input_embeddings)`) over
    (1, L, width) input embeddings, causal, at the cache's next L positions, as llama.cpp decodes the
    image chunks of a family that does not ask for a non-causal pass. Position-dependent parts (RoPE,
    Ministral 3's attention temperature) take the image tokens' positions there as they do text's;
    the inputs only give the pass its length. The embeddings are fed as they are (no scaling)."""
    model.model(mx.zeros(h.shape[:2], dtype=mx.int32), cache=cache, input_embeddings=h)
    mx.eval(layer_cache.arrays(cache))
