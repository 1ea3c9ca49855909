"""Granite (IBM Granite 3.x dense, GGUF architecture `granite`) on mlx-lm's `granite` class.

A llama block with four multipliers the GGUF carries as metadata (llama.cpp's granite graph):
`embedding_scale` multiplies the embeddings, `residual_scale` each block's attention and MLP output
before its residual add, `attention.scale` replaces 1/sqrt(head_dim) as the softmax scale, and the
logits are divided by `logit_scale`. A missing optional one means what it means to llama.cpp: no
scaling (1/sqrt(head_dim) for the attention). The converter (GraniteModel is a LlamaModel) permuted
the Q/K rows like llama's, so RoPE is MLX's "traditional" (adjacent pairs) form.
"""
from __future__ import annotations

from engine.model.archs import Architecture
from engine.model.archs.family_rope import interleaved_rope, positive
from mlx_lm.models.granite import Model, ModelArgs
from engine.errors import ModelFileError


def model_args(g, common: dict, head_dim: int):
    n_embd, n_head = common["hidden_size"], common["num_attention_heads"]
    if head_dim != n_embd // n_head:
        raise _bad(g, f"head size {head_dim} is not width {n_embd} / {n_head} heads, which granite needs")
    if not bool(g.arch_key("rope.scaling.finetuned", True)):
        raise _bad(g, "a granite file without RoPE (rope.scaling.finetuned = false) is not supported")
    tensors = g.tensors()
    return Model, ModelArgs(
        **common,
        logits_scaling=positive(g, "logit_scale", None),
        embedding_multiplier=positive(g, "embedding_scale", 1.0),
        residual_multiplier=positive(g, "residual_scale", 1.0),
        attention_multiplier=positive(g, "attention.scale", head_dim ** -0.5),
        attention_bias="blk.0.attn_q.bias" in tensors,
        mlp_bias="blk.0.ffn_up.bias" in tensors,
    )


def _bad(g, what: str):
    return ModelFileError(f"{g.path.name}: {what}")


ARCH = Architecture(name="granite", model_args=model_args, after_load=interleaved_rope)
