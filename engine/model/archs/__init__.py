"""Architectures beyond the built-in llama/qwen2/qwen3 (and engine/model/moe.py's MoE ones): one module per
family, each exposing an `ARCH` (an `Architecture`). `model_loader` asks `find(name)`; nothing else
branches on an architecture name.

A module is imported only when a file of its architecture is loaded (mlx-lm's model classes are
imported inside each module's functions)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from engine import lazy_table

# GGUF general.architecture -> module under engine/model/archs/ (add a line per family)
_MODULES: dict[str, str] = {
    "gemma3": "gemma", "gemma4": "gemma",
    "gpt-oss": "gpt_oss",
    "granite": "granite", "olmo2": "olmo2", "mistral3": "mistral3", "phi3": "phi3",
    "qwen35": "qwen35", "qwen35moe": "qwen35",
}


@dataclass(frozen=True)
class Architecture:
    """What the loader needs to know about one GGUF architecture.

    model_args(g, common, head_dim) -> (mlx-lm Model class, its ModelArgs): `common` holds the
        hyperparameters every architecture has (model_loader.common_args), the module adds its own.
    tensor_name(gguf_name, args) -> the mlx-lm parameter name, or None to skip the tensor (the
        default table in model_loader is tried first unless `own_names`).
    fix_weights(weights, qparams, g, args): in-place edits after conversion, before model.sanitize
        (e.g. Gemma's stored 1+w norms, fused tensors split, stacked experts).
    after_load(model, g, args) -> a load note or "": changes to the built model (per-layer RoPE...).
    """
    name: str
    model_args: Callable[..., tuple[type, Any]]
    tensor_name: Callable[[str, Any], str | None] | None = None
    own_names: bool = False
    fix_weights: Callable[..., None] | None = None
    after_load: Callable[..., str] | None = None


def names() -> tuple[str, ...]:
    return tuple(_MODULES)


def find(arch: str | None) -> Architecture | None:
    return lazy_table.entry(__name__, _MODULES, arch, "ARCH")
