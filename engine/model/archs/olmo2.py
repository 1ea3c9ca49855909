"""OLMo 2 (GGUF architecture `olmo2`) on mlx-lm's `olmo2` class.

The block has no pre-norms: attention reads the residual stream as it is, and RMSNorms sit after the
attention (`post_attention_norm`) and after the MLP (`post_ffw_norm`), inside each residual branch.
Q and K are RMS-normalized over the whole projection (weights n_head*head_dim and n_head_kv*head_dim
wide, not per head) before RoPE. llama.cpp runs it with NEOX (rotate-half) RoPE on rows the converter
did not permute: mlx-lm's default. The names other than those two norms are the common table's.

OLMo 3 files also say `olmo2`, with `attention.sliding_window`: mlx-lm's `olmo3` class, whose layers are
olmo2's with sliding-window attention on all but every `attention.sliding_window_pattern`-th layer
(llama.cpp's default period 4: layers 3, 7, ... attend to everything), plain RoPE on the sliding layers.
"""
from __future__ import annotations

import re

from mlx_lm.models import olmo2, olmo3

from engine.model.archs import Architecture
from engine.errors import ModelFileError
from engine.model.archs.family_rope import positive

_NAMES = {"post_attention_norm": "post_attention_layernorm", "post_ffw_norm": "post_feedforward_layernorm"}


def model_args(g, common: dict, head_dim: int):
    n_embd, n_head = common["hidden_size"], common["num_attention_heads"]
    if head_dim != n_embd // n_head:
        # llama.cpp's olmo2 sizes heads as width / heads whatever key_length says
        raise ModelFileError(f"{g.path.name}: head size {head_dim} is not width {n_embd} / {n_head} heads, "
                             "which olmo2 needs")
    common = dict(common, rope_scaling=_rope_scaling(g))
    if "output.weight" not in g.tensors():
        raise ModelFileError(f"{g.path.name}: olmo2 needs an 'output.weight' tensor (llama.cpp requires it too)")
    window = int(g.arch_key("attention.sliding_window", 0) or 0)
    if window <= 0:
        return olmo2.Model, olmo2.ModelArgs(**common, head_dim=head_dim)
    return _olmo3(g, common, head_dim, window)


def _olmo3(g, common: dict, head_dim: int, window: int):
    n_layer, context = common["num_hidden_layers"], common["max_position_embeddings"]
    if window > context:
        raise ModelFileError(f"{g.path.name}: sliding window {window} is larger than the context {context}")
    period = g.arch_key("attention.sliding_window_pattern", 4)
    if hasattr(period, "__len__"):
        raise ModelFileError(f"{g.path.name}: a per-layer olmo2 sliding-window pattern is not supported")
    period = int(period)
    # llama.cpp's set_swa_pattern(period): layer i slides unless i % period == period - 1
    types = ["sliding_attention" if period > 1 and i % period < period - 1 else "full_attention"
             for i in range(n_layer)]
    if "sliding_attention" not in types or "full_attention" not in types:
        # mlx-lm's olmo3 takes each mask's shape from a layer of each kind
        raise ModelFileError(f"{g.path.name}: a sliding-window pattern of {period} over {n_layer} layers leaves "
                             "no sliding or no full-attention layer")
    return _with_sanitize(olmo3.Model), olmo3.ModelArgs(**common, head_dim=head_dim, sliding_window=window,
                                                        layer_types=types)


def _with_sanitize(base):
    class Olmo3(base):
        """mlx-lm's olmo3 Model with the `sanitize` step the loader calls (it has none: nothing to drop)."""

        def sanitize(self, weights):
            return weights
    return Olmo3


def _rope_scaling(g) -> dict | None:
    """YaRN (OLMo 3's long-context files) as mlx-lm's initialize_rope takes it, on the full-attention layers
    only (llama.cpp: the sliding layers keep plain RoPE). llama.cpp's magnitude factor with no log
    multiplier is 1 + 0.1 ln(factor) (ggml's YaRN mscale), which is mlx-lm's YarnRoPE with mscale 1 and
    mscale_all_dim 0; a log multiplier m makes it get_mscale(f, 1) / get_mscale(f, m), as for mistral3."""
    kind = str(g.arch_key("rope.scaling.type", "none") or "none")
    if kind == "none":
        return None
    if kind != "yarn":
        raise ModelFileError(f"{g.path.name}: olmo2 RoPE scaling '{kind}' is not supported")
    if positive(g, "rope.scaling.attn_factor", 1.0) != 1.0:
        raise ModelFileError(f"{g.path.name}: olmo2 YaRN with 'rope.scaling.attn_factor' is not supported")
    return {"rope_type": "yarn", "factor": positive(g, "rope.scaling.factor", None),
            "original_max_position_embeddings": int(positive(g, "rope.scaling.original_context_length", None)),
            "beta_fast": positive(g, "rope.scaling.yarn_beta_fast", 32.0),
            "beta_slow": positive(g, "rope.scaling.yarn_beta_slow", 1.0),
            "mscale": 1.0, "mscale_all_dim": float(g.arch_key("rope.scaling.yarn_log_multiplier", 0.0) or 0.0)}


def tensor_name(gguf_name: str, args) -> str | None:
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight)", gguf_name)
    if m and m.group(2) in _NAMES:
        return f"model.layers.{m.group(1)}.{_NAMES[m.group(2)]}.{m.group(3)}"
    return None


ARCH = Architecture(name="olmo2", model_args=model_args, tensor_name=tensor_name)
