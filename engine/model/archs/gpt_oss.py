"""gpt-oss (GGUF ``general.architecture`` "gpt-oss", llama.cpp's LLM_ARCH_OPENAI_MOE) on mlx-lm's
``gpt_oss`` model class.

What llama.cpp's graph (src/models/openai-moe-iswa.cpp) does and where it lands in mlx-lm:

* attention: Q/K/V/O with biases, NEOX RoPE (mlx-lm: traditional=False), a learnt per-head sink
  logit in the softmax's denominator (``blk.N.attn_sinks.weight`` -> ``self_attn.sinks``), scale
  1/sqrt(head_dim); sliding-window layers (every even block, llama.cpp's swa pattern 2 =
  mlx-lm's default ``layer_types``) with the window from ``gpt-oss.attention.sliding_window``;
* RoPE with YaRN from ``rope.scaling.*`` (factor, original context), beta 32/1 as llama.cpp's
  defaults (or the file's ``rope.scaling.yarn_beta_*``);
* ``post_attention_norm`` then a MoE: router with a bias, softmax over the top-k logits
  (LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX_WEIGHT = mlx-lm's MLPBlock), experts with biases and the
  clamped SwiGLU (alpha 1.702, limit 7: hard-coded in both);
* an untied ``output.weight``.

The stacked ``*_exps`` tensors (GGUF [in, out, E] = MLX (E, out, in)) are ``SwitchGLU``'s layout;
MXFP4 experts stay MXFP4 on MLX's mxfp4 ``gather_qmm`` (engine/model/quants.py ``_convert_mxfp4``).
"""
from __future__ import annotations

import math
import re
from mlx_lm.models.gpt_oss import Model, ModelArgs

from engine.errors import ModelFileError
from engine.model.archs import Architecture

_TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_BLOCK = {
    "attn_norm": "input_layernorm", "post_attention_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate_inp": "mlp.router",
    "ffn_gate_exps": "mlp.experts.gate_proj", "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
}
_BLOCK_RE = re.compile(r"blk\.(\d+)\.(\w+)")
_BIASED = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate_inp", "ffn_gate_exps", "ffn_up_exps",
           "ffn_down_exps")
# every block must have these; checked before anything is allocated
_REQUIRED = tuple(f"{b}.weight" for b in _BLOCK) + tuple(f"{b}.bias" for b in _BIASED) + ("attn_sinks.weight",)


def tensor_name(gguf_name: str, args) -> str | None:
    base, _, kind = gguf_name.rpartition(".")
    if base in _TOP:
        return f"{_TOP[base]}.{kind}"
    m = _BLOCK_RE.fullmatch(base)
    if not m:
        return None
    layer, part = m.groups()
    if part == "attn_sinks":
        return f"model.layers.{layer}.self_attn.sinks"
    if part in _BLOCK:
        return f"model.layers.{layer}.{_BLOCK[part]}.{kind}"
    return None


def _int(g, key: str, default=None) -> int:
    try:
        return int(g.arch_key(key, default))
    except (TypeError, ValueError, OverflowError):
        raise ModelFileError(f"{g.path.name}: missing or bad 'gpt-oss.{key}'") from None


def _float(g, key: str, default) -> float:
    try:
        v = float(g.arch_key(key, default))
    except (TypeError, ValueError):
        raise ModelFileError(f"{g.path.name}: bad 'gpt-oss.{key}'") from None
    if not math.isfinite(v):
        raise ModelFileError(f"{g.path.name}: bad 'gpt-oss.{key}' ({v})")
    return v


def _rope_scaling(g) -> dict | None:
    kind = g.arch_key("rope.scaling.type")
    if kind in (None, "none"):
        return None
    if kind != "yarn":
        raise ModelFileError(f"{g.path.name}: gpt-oss with rope scaling {kind!r} is not supported (yarn is)")
    factor = _float(g, "rope.scaling.factor", 1.0)
    orig = _int(g, "rope.scaling.original_context_length", 4096)
    if factor <= 0 or orig <= 0:
        raise ModelFileError(f"{g.path.name}: bad YaRN scaling (factor {factor}, original context {orig})")
    return {"rope_type": "yarn", "factor": factor, "original_max_position_embeddings": orig,
            "beta_fast": _float(g, "rope.scaling.yarn_beta_fast", 32.0),
            "beta_slow": _float(g, "rope.scaling.yarn_beta_slow", 1.0)}


def model_args(g, common: dict, head_dim: int):
    name = g.path.name
    n_layer = common["num_hidden_layers"]
    if n_layer < 2:      # mlx-lm's model needs a sliding and a full block to build its two masks
        raise ModelFileError(f"{name}: gpt-oss with {n_layer} block is not supported (2 or more are)")
    n_expert, n_used = _int(g, "expert_count", 0), _int(g, "expert_used_count", 0)
    if n_expert <= 0 or not 0 < n_used <= n_expert:
        raise ModelFileError(f"{name}: gpt-oss needs 0 < expert_used_count <= expert_count "
                             f"(got {n_used} of {n_expert})")
    window = _int(g, "attention.sliding_window", 0)
    n_ctx = common["max_position_embeddings"]
    if not 0 < window <= n_ctx:
        raise ModelFileError(f"{name}: gpt-oss sliding window {window} must be in 1..context length {n_ctx}")
    tensors = g.tensors()
    missing = [f"blk.{i}.{t}" for i in range(n_layer) for t in _REQUIRED if f"blk.{i}.{t}" not in tensors]
    missing += [t for t in ("token_embd.weight", "output_norm.weight", "output.weight") if t not in tensors]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ModelFileError(f"{name}: gpt-oss tensor '{missing[0]}' is missing{more}")
    up = tuple(int(x) for x in reversed(list(tensors["blk.0.ffn_up_exps.weight"].shape)))
    if len(up) != 3 or up[0] != n_expert or up[2] != common["hidden_size"]:
        raise ModelFileError(f"{name}: blk.0.ffn_up_exps.weight is {up}, expected ({n_expert}, n_ff, "
                             f"{common['hidden_size']})")
    args = ModelArgs.from_dict(dict(
        common, model_type="gpt_oss", num_local_experts=n_expert, num_experts_per_tok=n_used,
        intermediate_size=up[1], head_dim=head_dim, sliding_window=window, rope_scaling=_rope_scaling(g),
        # llama.cpp's swa pattern 2: block il slides when il % 2 == 0
        layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n_layer)]))
    args.tie_word_embeddings = False     # the loader's distributed split asks; gpt-oss has output.weight
    return Model, args


def after_load(model, g, args) -> str:
    scaling = args.rope_scaling
    rope = f"YaRN x{scaling['factor']:g} over {scaling['original_max_position_embeddings']}" if scaling else "RoPE"
    return (f"gpt-oss: {args.num_local_experts} experts x {args.intermediate_size}, top-{args.num_experts_per_tok}; "
            f"sliding window {args.sliding_window} on even blocks; attention sinks; {rope}")


ARCH = Architecture(name="gpt-oss", model_args=model_args, tensor_name=tensor_name, own_names=True,
                    after_load=after_load)
