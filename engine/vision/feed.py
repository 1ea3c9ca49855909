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


IMAGE_BATCH = 512   # libmtmd's helper decodes an image in pieces of n_batch tokens (llama.cpp's default n_ubatch)


def _gemma4_masks(inner, h: mx.array, cache: list, both: bool) -> dict[str, mx.array]:
    """One (L, keys) mask per layer type, from the first layer of that type that holds K/V."""
    masks: dict[str, mx.array] = {}
    n = h.shape[1]
    for layer, c in zip(inner.layers, cache):
        kind = layer.layer_type
        if kind in masks:
            continue
        window = inner.window_size if kind == "sliding_attention" else None
        m = create_attention_mask(h, c, window_size=window, return_array=True)
        masks[kind] = both_ways(m, n) if both else m
    return masks


def _gemma4_per_layer(inner, h: mx.array) -> mx.array | None:
    """Gemma 4's per-layer inputs for image positions, as llama.cpp builds them: token id 0's per-layer
    embedding (scaled by sqrt(its width)) for every position, with the projection of the (unscaled)
    image embeddings, RMS-normed; their sum times 1/sqrt(2). (L tokens: (1, L, layers, width))."""
    if not inner.hidden_size_per_layer_input:
        return None
    n, layers, dpl = h.shape[1], len(inner.layers), inner.hidden_size_per_layer_input
    pad = inner.embed_tokens_per_layer(mx.zeros((1, n), dtype=mx.int32)) * inner.embed_tokens_per_layer_scale
    proj = inner.per_layer_model_projection(h) * inner.per_layer_projection_scale
    proj = inner.per_layer_projection_norm(proj.reshape(1, n, layers, dpl))
    return (proj + pad.reshape(1, n, layers, dpl)) * inner.per_layer_input_scale


def _gemma4_pass(model, cache, h: mx.array, both: bool) -> None:
    """mlx-lm gemma4_text's forward over input embeddings `h` (not scaled by sqrt(width), as llama.cpp
    feeds embeddings), K/V-sharing layers reading their source layer's K/V of this pass."""
    inner = model.model
    masks = _gemma4_masks(inner, h, cache, both)
    per_layer = _gemma4_per_layer(inner, h)
    caches = list(cache) + [None] * (len(inner.layers) - len(cache))
    kvs: list = [(None, None)] * len(inner.layers)
    for i, (layer, c) in enumerate(zip(inner.layers, caches)):
        shared, offset = kvs[inner.previous_kvs[i]]
        pli = per_layer[:, :, i, :] if per_layer is not None else None
        h, shared, offset = layer(h, masks[layer.layer_type], c, per_layer_input=pli, shared_kv=shared,
                                  offset=offset)
        kvs[i] = (shared, offset)
    mx.eval(layer_cache.arrays(cache))


def feed_gemma4(model, cache, h: mx.array, both: bool) -> None:
    """Gemma 4's text layers (mlx-lm's gemma4_text) over (1, L, width) image embeddings, in pieces of
    IMAGE_BATCH tokens as libmtmd's helper decodes them; with `both`, a piece's tokens see each other
    both ways (and every earlier piece), else causally."""
    for start in range(0, h.shape[1], IMAGE_BATCH):
        _gemma4_pass(model, cache, h[:, start:start + IMAGE_BATCH], both)


def feed_causal(model, cache, h: mx.array) -> None:
    """A text model's own forward pass (mlx-lm's `model.model(inputs, cache, input_embeddings)`) over
    (1, L, width) input embeddings, causal, at the cache's next L positions, as llama.cpp decodes the
    image chunks of a family that does not ask for a non-causal pass. Position-dependent parts (RoPE,
    Ministral 3's attention temperature) take the image tokens' positions there as they do text's;
    the inputs only give the pass its length. The embeddings are fed as they are (no scaling)."""
    model.model(mx.zeros(h.shape[:2], dtype=mx.int32), cache=cache, input_embeddings=h)
    mx.eval(layer_cache.arrays(cache))
