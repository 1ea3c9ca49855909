"""Small pieces the granite, olmo2, mistral3 and phi3 modules share: checked optional numbers from the
GGUF, and the RoPE layout llama.cpp's converter leaves for llama-like architectures."""
from __future__ import annotations

import math

from engine.errors import ModelFileError
from engine.model.archs.common import apply_rope_factors


def positive(g, key: str, default: float | None) -> float:
    """`<arch>.<key>` as a finite number > 0; `default` when absent or 0 (llama.cpp reads a 0 multiplier
    as "not set"); a missing key without a default, or a bad value, is one ModelFileError line."""
    value = g.arch_key(key)
    try:
        value = float(value) if value is not None else None
    except (TypeError, ValueError):
        raise ModelFileError(f"{g.path.name}: '{g.architecture}.{key}' must be a number") from None
    if value is None or value == 0.0:
        if default is None:
            raise ModelFileError(f"{g.path.name}: missing metadata '{g.architecture}.{key}'")
        return default
    if not (math.isfinite(value) and value > 0):
        raise ModelFileError(f"{g.path.name}: '{g.architecture}.{key}' is {value}; it must be finite and > 0")
    return value


def interleave(model) -> None:
    """Switch every layer's RoPE to MLX's traditional (adjacent pairs) form (see interleaved_rope)."""
    for layer in model.layers:
        layer.self_attn.rope.traditional = True


def interleaved_rope(model, g, args) -> str:
    """llama.cpp's converter permutes a llama-like model's Q/K rows so that adjacent pairs rotate together
    (its "normal" RoPE): MLX's traditional RoPE on the rows as stored, no un-permuting. mlx-lm's granite and
    ministral3 build rotate-half RoPE, so the flag is switched on every layer's rope. A Llama 3.1-style
    `rope_freqs.weight` is applied as for llama."""
    interleave(model)
    if apply_rope_factors(model, g, args):
        return "RoPE frequency factors from rope_freqs.weight"
    return ""
