"""Hyperparameters of a GGUF model, checked against each other and the tensors before any model is built.

A flipped bit in `block_count` (2 -> 131074) would otherwise make mlx-lm build 131074 layers; a zero
head count divides by zero; an RMS epsilon of 0 aborts the process inside MLX. Every value the loader
uses is checked here, in one place, and a bad one is a ModelFileError of one line.
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import numpy as np
from gguf import GGUFValueType

from engine.errors import ModelFileError
from engine.model.gguf_schema import (BLOCK_RE, MAX_CONTEXT, MAX_HEAD_DIM, MAX_HEADS, MAX_LAYERS, MAX_VOCAB, MAX_WIDTH,
                                      ArrayLen, HeaderView, check_view)


@dataclass(frozen=True)
class Hyperparameters:
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_ff: int
    n_vocab: int
    context_length: int
    rms_eps: float
    rope_theta: float


def _int(g, key: str, default=None, *, lo: int = 1, hi: int) -> int:
    value = g.arch_key(key, default)
    if value is None:
        raise ModelFileError(f"{g.path.name}: missing metadata '{g.architecture}.{key}'")
    if hasattr(value, "__len__") and not isinstance(value, str) and len(value):
        # a per-layer array (Gemma 4): every value checked, layer 0's is the one returned
        values = [_int_value(g, key, v, lo, hi) for v in value]
        return values[0]
    return _int_value(g, key, value, lo, hi)


def _int_value(g, key: str, value, lo: int, hi: int) -> int:
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ModelFileError(f"{g.path.name}: '{g.architecture}.{key}' must be an integer, got {value!r:.40}")
    value = int(value)
    if not lo <= value <= hi:
        raise ModelFileError(f"{g.path.name}: '{g.architecture}.{key}' is {value}, outside {lo}..{hi}")
    return value


def _float(g, key: str, default: float, *, lo_open: float, hi: float) -> float:
    value = g.arch_key(key, default)
    try:
        value = float(value)
    except (TypeError, ValueError):
        raise ModelFileError(f"{g.path.name}: '{g.architecture}.{key}' must be a number") from None
    if not (math.isfinite(value) and lo_open < value <= hi):
        raise ModelFileError(f"{g.path.name}: '{g.architecture}.{key}' is {value}, "
                             f"it must be finite, > {lo_open} and <= {hi}")
    return value


def check_hyperparameters(g) -> Hyperparameters:
    """The checked hyperparameters of GGUFFile `g` (its header already validated by gguf_header)."""
    name = g.path.name
    tensors = g.header.tensors if g.header is not None else {
        t.name: _Shape(tuple(int(d) for d in t.shape)) for t in g.reader.tensors}

    def bad(what: str) -> ModelFileError:
        return ModelFileError(f"{name}: {what}")

    n_embd = _int(g, "embedding_length", hi=MAX_WIDTH)
    n_head = _int(g, "attention.head_count", hi=MAX_HEADS)   # > width is fine with an explicit head size
    n_head_kv = _int(g, "attention.head_count_kv", n_head, hi=n_head)
    if n_head % n_head_kv:
        raise bad(f"{n_head_kv} K/V heads do not divide {n_head} attention heads")
    if g.arch_key("attention.key_length") is None:
        if n_embd % n_head:
            raise bad(f"{n_head} attention heads do not divide the width {n_embd}")
        head_dim = n_embd // n_head
    else:
        head_dim = _int(g, "attention.key_length", hi=MAX_HEAD_DIM)
    n_ff = _int(g, "feed_forward_length", hi=MAX_WIDTH)
    n_layer = _int(g, "block_count", hi=MAX_LAYERS)
    context = _int(g, "context_length", 4096, hi=MAX_CONTEXT)
    eps = _float(g, "attention.layer_norm_rms_epsilon", 1e-6, lo_open=0.0, hi=1.0)
    theta = _float(g, "rope.freq_base", 10000.0, lo_open=0.0, hi=1e12)

    field = g.reader.fields.get("tokenizer.ggml.tokens")
    n_tokens = len(field.data) if field is not None else 0
    if n_tokens < 1:
        raise bad("missing tokenizer metadata 'tokenizer.ggml.tokens'")
    n_vocab = n_tokens
    if g.arch_key("vocab_size") is not None:
        n_vocab = _int(g, "vocab_size", hi=MAX_VOCAB)
        if n_vocab < n_tokens:
            # the embeddings would be read past their end at a token of the tokenizer's (MLX's gather
            # does not check bounds); llama.cpp's loader refuses such a file at the embedding's shape
            raise bad(f"'{g.architecture}.vocab_size' is {n_vocab}, fewer than the tokenizer's {n_tokens} tokens")
    for key in ("bos_token_id", "eos_token_id", "eot_token_id", "unknown_token_id", "padding_token_id"):
        tid = g.get(f"tokenizer.ggml.{key}")
        if tid is not None and not 0 <= int(tid) < n_tokens:
            raise bad(f"tokenizer.ggml.{key} {int(tid)} is outside the vocabulary of {n_tokens}")

    # block_count must be exactly the blocks whose tensors are present.
    present = {int(m.group(1)) for t in tensors if (m := BLOCK_RE.match(t))}
    if present != set(range(n_layer)):
        extra = sorted(present - set(range(n_layer)))[:3]
        missing = sorted(set(range(n_layer)) - present)[:3]
        raise bad(f"block_count is {n_layer} but the file has tensors for {len(present)} blocks"
                  + (f" (unexpected blocks {extra})" if extra else "")
                  + (f" (missing blocks {missing})" if missing else ""))

    def shape_is(tname: str, *want: int) -> None:
        t = tensors.get(tname)
        if t is not None and tuple(t.shape) != want:
            raise bad(f"tensor '{tname}' has shape {list(t.shape)}, the hyperparameters need {list(want)}")

    if "token_embd.weight" not in tensors:
        raise bad("missing tensor 'token_embd.weight'")
    shape_is("token_embd.weight", n_embd, n_vocab)
    shape_is("output.weight", n_embd, n_vocab)
    head_dim0 = head_dim        # layer 0's head size: Gemma 4's sliding layers have their own
    pattern = g.arch_key("attention.sliding_window_pattern")
    if g.arch_key("attention.key_length_swa") is not None and hasattr(pattern, "__len__") \
            and len(pattern) and bool(pattern[0]):
        head_dim0 = _int(g, "attention.key_length_swa", hi=MAX_HEAD_DIM)
    shape_is("blk.0.attn_q.weight", n_embd, n_head * head_dim0)
    shape_is("blk.0.attn_k.weight", n_embd, n_head_kv * head_dim0)
    shape_is("blk.0.attn_v.weight", n_embd, n_head_kv * head_dim0)
    shape_is("blk.0.attn_norm.weight", n_embd)
    shape_is("output_norm.weight", n_embd)
    up = tensors.get("blk.0.ffn_up.weight")
    if up is not None and len(up.shape) == 2:          # dense FFN (MoE experts are 3-D)
        # Phi-3's ffn_up holds the gate half and the up half (llama.cpp: {n_embd, 2 * n_ff})
        shape_is("blk.0.ffn_up.weight", n_embd, 2 * n_ff if g.architecture == "phi3" else n_ff)
    # a fused QKV projection (Phi-3): Q, K and V rows stacked. Not Qwen3.5/3.6's: there blk.0 is a Gated
    # DeltaNet layer whose attn_qkv is its linear attention's (2 x key heads x key size + value heads x
    # value size, checked by engine/model/archs/qwen35.py)
    if g.architecture not in ("qwen35", "qwen35moe"):
        shape_is("blk.0.attn_qkv.weight", n_embd, (n_head + 2 * n_head_kv) * head_dim)
    rope = tensors.get("rope_freqs.weight")
    if rope is not None and math.prod(rope.shape) != head_dim // 2:
        raise bad(f"tensor 'rope_freqs.weight' has {math.prod(rope.shape)} factors, "
                  f"the head size {head_dim} needs {head_dim // 2}")
    check_schema(g)
    return Hyperparameters(n_layer, n_embd, n_head, n_head_kv, head_dim, n_ff, n_vocab, context, eps, theta)


def check_schema(g) -> None:
    """The families read through engine/model/archs/: their own keys and tensors (engine/model/gguf_schema.py)."""
    tensors = g.header.tensors if g.header is not None else {t.name: t for t in g.reader.tensors}
    check_view(header_view(g, {name: tuple(int(d) for d in t.shape) for name, t in tensors.items()}))


def header_view(g, shapes: dict[str, tuple[int, ...]]) -> HeaderView:
    """GGUFFile `g`'s `<arch>.*` values as gguf_schema reads them: arrays of up to MAX_LAYERS numbers as
    tuples, longer ones (or arrays of strings) as their length only."""
    prefix = f"{g.architecture}."
    values = {}
    for key, f in g.reader.fields.items():
        if not key.startswith(prefix):
            continue
        if f.types and f.types[0] == GGUFValueType.ARRAY:
            n = len(f.data)
            strings = len(f.types) > 1 and f.types[-1] == GGUFValueType.STRING
            values[key] = ArrayLen(n) if n > MAX_LAYERS or strings else tuple(np.asarray(g.get(key)).tolist())
        else:
            values[key] = f.contents()
    return HeaderView(g.path.name, g.architecture, values, shapes)


@dataclass(frozen=True)
class _Shape:
    """A tensor's shape when the GGUFFile was made without a header scan (gguf-py's own view)."""
    shape: tuple[int, ...]
