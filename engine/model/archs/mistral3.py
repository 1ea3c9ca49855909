"""Ministral 3 / Mistral 3 text models (GGUF architecture `mistral3`) on mlx-lm's `ministral3` class.

A `mistral3` GGUF is the text model alone (the vision tower goes to a separate mmproj file), so it
maps onto mlx-lm's text class `ministral3`, not the multimodal `mistral3` wrapper. What the GGUF
carries beyond llama:
- YaRN: `rope.scaling.type` yarn, `.factor`, `.original_context_length`, `.yarn_beta_fast/slow`, and
  `.yarn_log_multiplier` (the checkpoint's mscale_all_dim). llama.cpp takes mscale as 1 and
  mscale_all_dim as the log multiplier, so the magnitude factor is get_mscale(f, 1) / get_mscale(f, m)
  (1 for Ministral 3, where both are 1): mlx-lm's YarnRoPE with mscale=1, mscale_all_dim=m.
- Llama-4 attention temperature: queries times 1 + beta * log(1 + floor(pos / original_context)),
  beta = `attention.temperature_scale` (llama_4_scaling_beta); absent = 0 (no scaling).
- Q/K rows permuted by the converter (a LlamaModel): MLX's traditional RoPE (family_rope.interleave).
"""
from __future__ import annotations

from engine.model.archs import Architecture
from engine.model.archs.family_rope import interleave, positive
from mlx_lm.models.ministral3 import Model, ModelArgs
from engine.errors import ModelFileError


def model_args(g, common: dict, head_dim: int):
    if "rope_freqs.weight" in g.tensors():
        raise ModelFileError(f"{g.path.name}: mistral3 with 'rope_freqs.weight' factors is not supported")
    if int(g.arch_key("rope.dimension_count", head_dim) or head_dim) != head_dim:
        raise ModelFileError(f"{g.path.name}: mistral3 with partial RoPE "
                             f"({g.arch_key('rope.dimension_count')} of {head_dim}) is not supported")
    kind = str(g.arch_key("rope.scaling.type", "none") or "none")
    theta = common["rope_theta"]
    original = int(g.arch_key("rope.scaling.original_context_length", 0) or common["max_position_embeddings"])
    rope = {"rope_theta": theta, "original_max_position_embeddings": original,
            "llama_4_scaling_beta": float(g.arch_key("attention.temperature_scale", 0.0) or 0.0)}
    if kind == "yarn":
        rope.update(rope_type="yarn", factor=positive(g, "rope.scaling.factor", None),
                    beta_fast=positive(g, "rope.scaling.yarn_beta_fast", 32.0),
                    beta_slow=positive(g, "rope.scaling.yarn_beta_slow", 1.0),
                    mscale=1.0, mscale_all_dim=float(g.arch_key("rope.scaling.yarn_log_multiplier", 0.0) or 0.0))
    elif kind == "linear":
        rope.update(rope_type="linear", factor=positive(g, "rope.scaling.factor", None))
    elif kind == "none":
        rope["rope_type"] = "default"
    else:
        raise ModelFileError(f"{g.path.name}: mistral3 RoPE scaling '{kind}' is not supported")
    args = {k: v for k, v in common.items() if k != "rope_theta"}   # ministral3 reads it from rope_parameters
    return Model, ModelArgs(**args, head_dim=head_dim, rope_parameters=rope)


def after_load(model, g, args) -> str:
    interleave(model)
    rope = args.rope_parameters
    if rope.get("rope_type") == "yarn":
        return f"YaRN x{rope['factor']:g} from {rope['original_max_position_embeddings']} positions"
    return ""


ARCH = Architecture(name="mistral3", model_args=model_args, after_load=after_load)
