"""Phi-3 and Phi-4 (GGUF architecture `phi3`: Phi-3-mini/medium, Phi-3.5-mini, Phi-4, Phi-4-mini) on
mlx-lm's `phi3` class.

The converter keeps Phi's fused projections, which are mlx-lm's own layout: `attn_qkv` (Q, K, V rows
stacked) is `qkv_proj`, and `ffn_up` holds the gate half then the up half (2*n_ff rows; llama.cpp's
LLM_FFN_SWIGLU takes silu of the first half times the second), which is `gate_up_proj`. Files with
separate attn_q/k/v (llama.cpp accepts both) get a qkv_proj of three projections whose outputs are
stacked: each keeps its own type (a Q4_K_M file stores some attn_v in Q6_K). NEOX RoPE on unpermuted
rows, possibly partial (`rope.dimension_count` < head_dim: Phi-4-mini rotates 96 of 128).

LongRoPE (Phi-3-128k, Phi-3.5, Phi-4-mini): per-pair factors `rope_factors_long`/`rope_factors_short`
divide each pair's frequency, and `rope.scaling.attn_factor` scales the rotated part of Q and K.
llama.cpp picks the long factors when its context is longer than `rope.scaling.original_context_length`,
the short ones otherwise; Strata picks by the file's context length (what llama.cpp does at its default
context, the file's): the long factors for a file longer than its original context.
Sliding window: some Phi-3 files carry `attention.sliding_window`; llama.cpp ignores it (its Phi-3 SWA
is disabled), and so does Strata, to compute what llama.cpp computes.
"""
from __future__ import annotations


import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.phi3 import Model, ModelArgs

from engine.model.archs import Architecture
from engine.errors import ModelFileError
from engine.model.archs.common import mapped_name
from engine.model.archs.family_rope import positive

_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_qkv": "self_attn.qkv_proj", "attn_output": "self_attn.o_proj",
    "ffn_up": "mlp.gate_up_proj", "ffn_down": "mlp.down_proj",
    # separate projections: the parts of a StackedQKV
    "attn_q": "self_attn.qkv_proj.q", "attn_k": "self_attn.qkv_proj.k", "attn_v": "self_attn.qkv_proj.v",
}
_TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def _bad(g, what: str):
    return ModelFileError(f"{g.path.name}: {what}")


def model_args(g, common: dict, head_dim: int):
    n_embd, n_head = common["hidden_size"], common["num_attention_heads"]
    if head_dim != n_embd // n_head:
        raise _bad(g, f"head size {head_dim} is not width {n_embd} / {n_head} heads, which phi3 needs")
    rope_dim = int(g.arch_key("rope.dimension_count", head_dim) or head_dim)
    if not (2 <= rope_dim <= head_dim and rope_dim % 2 == 0):
        raise _bad(g, f"'phi3.rope.dimension_count' is {rope_dim}; it must be even and 2..{head_dim}")
    tensors = g.tensors()
    if "blk.0.ffn_gate.weight" in tensors:
        raise _bad(g, "phi3 with a separate ffn_gate is not supported (llama.cpp reads the gate from ffn_up)")
    kind = str(g.arch_key("rope.scaling.type", "none") or "none")
    if kind not in ("none", "longrope", "su"):
        raise _bad(g, f"phi3 RoPE scaling '{kind}' is not supported")
    # rope_scaling stays None: the LongRoPE module is put in by after_load, from the tensors
    # mlx-lm rotates int(head_dim * factor) features: half a feature more keeps float rounding off that floor
    args = ModelArgs(**common, partial_rotary_factor=(rope_dim + 0.5) / head_dim)
    separate = "blk.0.attn_qkv.weight" not in tensors
    if separate and not all(f"blk.0.attn_{x}.weight" in tensors for x in "qkv"):
        raise _bad(g, "phi3 needs attn_qkv or all of attn_q, attn_k and attn_v")
    return _model_class(Model, separate), args


class StackedQKV(nn.Module):
    """qkv_proj from separate Q, K and V projections: their outputs side by side, as the fused one's rows."""

    def __init__(self, dim: int, q_dim: int, kv_dim: int):
        super().__init__()
        self.q, self.k, self.v = nn.Linear(dim, q_dim, bias=False), nn.Linear(dim, kv_dim, bias=False), \
            nn.Linear(dim, kv_dim, bias=False)

    def __call__(self, x):
        return mx.concatenate([self.q(x), self.k(x), self.v(x)], axis=-1)


def _model_class(base, separate_qkv: bool):
    class Phi3(base):
        """mlx-lm's phi3 Model with the `sanitize` step the loader calls (phi3 has none: nothing to drop),
        and with StackedQKV projections for a file that stores Q, K and V apart."""

        def __init__(self, args):
            super().__init__(args)
            if separate_qkv:
                head_dim = args.hidden_size // args.num_attention_heads
                for layer in self.model.layers:
                    layer.self_attn.qkv_proj = StackedQKV(args.hidden_size, args.num_attention_heads * head_dim,
                                                          args.num_key_value_heads * head_dim)

        def sanitize(self, weights):
            return weights
    return Phi3


def tensor_name(gguf_name: str, args) -> str | None:
    return mapped_name(gguf_name, _NAMES, _TOP)   # None for rope_factors_long/short: read by after_load


class LongRoPE(nn.Module):
    """Phi's LongRoPE as llama.cpp computes it: theta_i = pos * base^(-2i/d) / factor_i on the first `dims`
    features, and those features (of Q and of K) times `scale` (rope.scaling.attn_factor)."""

    def __init__(self, dims: int, base: float, factors: mx.array, scale: float):
        super().__init__()
        self.dims, self.scale = dims, scale
        self._freqs = (base ** (mx.arange(0, dims, 2, dtype=mx.float32) / dims)) * factors.astype(mx.float32)

    def __call__(self, x, offset: int = 0):
        if self.scale != 1.0:
            x = x.at[..., : self.dims].multiply(self.scale)
        return mx.fast.rope(x, self.dims, traditional=False, base=None, scale=1.0, offset=offset,
                            freqs=self._freqs)


def after_load(model, g, args) -> str:
    tensors = g.tensors()
    long_t, short_t = tensors.get("rope_factors_long.weight"), tensors.get("rope_factors_short.weight")
    if long_t is None and short_t is None:
        return ""
    context = args.max_position_embeddings
    original = int(g.arch_key("rope.scaling.original_context_length", 0) or context)
    use_long = context > original
    t = long_t if use_long or short_t is None else short_t
    if t is None:
        raise _bad(g, "a phi3 file longer than its original context without 'rope_factors_long.weight'")
    rope_dim = model.layers[0].self_attn.rope.dims
    factors = np.asarray(t.data, dtype=np.float32).reshape(-1)
    if factors.shape[0] != rope_dim // 2 or not np.all(np.isfinite(factors)) or np.any(factors <= 0):
        raise _bad(g, f"'{t.name}' must hold {rope_dim // 2} positive factors, has {factors.shape[0]}")
    scale = positive(g, "rope.scaling.attn_factor", 1.0)
    for layer in model.layers:
        layer.self_attn.rope = LongRoPE(rope_dim, args.rope_theta, mx.array(factors), scale)
    return (f"LongRoPE {'long' if t is long_t else 'short'} factors "
            f"(context {context}, original {original}), attention factor {scale:.4f}")


ARCH = Architecture(name="phi3", model_args=model_args, tensor_name=tensor_name, own_names=True,
                    after_load=after_load)
