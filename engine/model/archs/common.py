"""What every architecture module shares with the loader: the hyperparameters every GGUF has, and
RoPE with llama.cpp's per-pair frequency factors. Here, below both, so an architecture module never
imports the loader that imports it (engine/model/model_loader.py -> engine/model/archs -> here)."""
from __future__ import annotations

import re

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from engine.model import quants
from engine.errors import ModelFileError
from engine.model.gguf_file import GGUFFile

_BLOCK_RE = re.compile(r"blk\.(\d+)\.(\w+)")
# The block tensors that llama-like families all name alike in mlx-lm (attention, its norms, the gated FFN)
# and the top-level ones: each family's table adds its own to these.
DENSE_BLOCK_NAMES = {
    "attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def mapped_name(gguf_name: str, block: dict[str, str], top: dict[str, str]) -> str | None:
    """A GGUF tensor name -> the mlx-lm parameter name, through a table of block tensors (blk.N.<key> ->
    model.layers.N.<value>) and one of top-level tensors; None for a tensor neither table names."""
    base, _, kind = gguf_name.rpartition(".")
    m = _BLOCK_RE.fullmatch(base)
    if m and m.group(2) in block:
        return f"model.layers.{m.group(1)}.{block[m.group(2)]}.{kind}"
    if base in top:
        return f"{top[base]}.{kind}"
    return None


def load_checked(module, weights: dict, dtype, mismatch: str) -> None:
    """`weights` into `module` (every parameter, nothing extra), its floating ones cast to `dtype`, then
    evaluated; tensors that do not fit are ModelFileError: `mismatch` and the start of MLX's reason."""
    try:
        module.load_weights(list(weights.items()), strict=True)
    except ValueError as e:
        raise ModelFileError(f"{mismatch} ({str(e)[:160]})") from None
    module.set_dtype(dtype, lambda x: mx.issubdtype(x, mx.floating))
    mx.eval(module.parameters())


def add_tensor(weights: dict, qparams: dict, name: str, t, dtype, file_name: str):
    """GGUF tensor `t` converted for MLX (quants.convert_tensor) into `weights` under `name`, with its scales
    and biases and, in `qparams`, its quantization when it stays quantized; an unsupported type is
    ModelFileError naming the file. Returns the converted tensor."""
    try:
        mt = quants.convert_tensor(t, dtype=dtype)
    except quants.UnsupportedTensorType as e:
        raise ModelFileError(f"{file_name}: {e}") from None
    weights[name] = mt.weight
    if mt.quantized:
        prefix = name.rsplit(".", 1)[0]
        weights[f"{prefix}.scales"] = mt.scales
        if mt.biases is not None:          # mxfp4 has none
            weights[f"{prefix}.biases"] = mt.biases
        qparams[prefix] = {"group_size": mt.group_size, "bits": mt.bits, "mode": mt.mode}
    return mt


def _first(value):
    """Layer 0's value of a per-layer array (Gemma 4's feed_forward_length, head_count_kv); the
    architecture module reads the whole array."""
    return value[0] if hasattr(value, "__len__") and not isinstance(value, str) and len(value) else value


def common_args(g: GGUFFile) -> tuple[dict, int]:
    """The hyperparameters every architecture has, as mlx-lm ModelArgs fields, and the head width."""
    arch = g.architecture
    key = lambda s, d=None: _first(g.arch_key(s, d))  # noqa: E731
    try:
        n_embd = int(key("embedding_length"))
        n_head = int(key("attention.head_count"))
        common = dict(
            model_type=arch, hidden_size=n_embd, num_hidden_layers=int(key("block_count")),
            intermediate_size=int(key("feed_forward_length")), num_attention_heads=n_head,
            num_key_value_heads=int(key("attention.head_count_kv", n_head)),
            rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-6)),
            vocab_size=int(key("vocab_size", 0) or len(g.require("tokenizer.ggml.tokens"))),
            max_position_embeddings=int(key("context_length", 4096)),
            rope_theta=float(key("rope.freq_base", 10000.0)),
            tie_word_embeddings="output.weight" not in g.tensors(),
        )
    except (TypeError, ValueError):
        raise ModelFileError(f"{g.path.name}: missing or bad '{arch}.*' hyperparameters") from None
    return common, int(key("attention.key_length", n_embd // n_head))


class FactorRoPE(nn.Module):
    """RoPE with llama.cpp's per-pair frequency factors (`rope_freqs.weight`, written for Llama 3.1+
    "llama3" scaling): theta_i = pos * base^(-2i/d) / factor_i. mx.fast.rope takes the periods."""

    def __init__(self, dims: int, base: float, traditional: bool, factors: mx.array):
        super().__init__()
        self.dims, self.traditional = dims, traditional
        self._freqs = (base ** (mx.arange(0, dims, 2, dtype=mx.float32) / dims)) * factors.astype(mx.float32)

    def __call__(self, x, offset: int = 0):
        return mx.fast.rope(x, self.dims, traditional=self.traditional, base=None, scale=1.0,
                            offset=offset, freqs=self._freqs)


def apply_rope_factors(model, g: GGUFFile, args) -> bool:
    t = g.tensors().get("rope_freqs.weight")
    if t is None:
        return False
    factors = mx.array(np.asarray(t.data, dtype=np.float32).reshape(-1))
    for layer in model.model.layers:
        rope = layer.self_attn.rope
        layer.self_attn.rope = FactorRoPE(rope.dims, args.rope_theta, rope.traditional, factors)
    return True


def first_layer(model) -> int:
    """The global index of a loaded model's first block: 0, or a pipeline rank's start (an
    architecture's after_load that reads per-block tensors from the file by number asks)."""
    plan = getattr(model, "_pipeline_plan", None)
    return plan.start if plan is not None else 0
