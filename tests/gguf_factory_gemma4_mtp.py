"""A tiny Gemma 4 MTP drafter GGUF (llama.cpp's `gemma4-assistant` architecture: conversion/gemma.py's
Gemma4AssistantModel) for a tiny gemma4 of tests/gguf_factory_gemma.write_tiny_gemma4: the drafter's own
width and FFN, queries only (its blocks read the target's K/V), `nextn.pre_projection` /
`nextn.post_projection` between the target's width and its own, its own tied token embedding.

The target-facing sizes (target width, K/V heads, head sizes, sliding window, vocabulary) default to
write_tiny_gemma4's defaults; a mismatched drafter is written by giving other ones.
"""
from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

import gguf_factory
from gguf_factory_gemma import QK_NORM, _add_vocab, _Rand, vocab

ARCH = "gemma4-assistant"


def write_tiny_gemma4_assistant(path, *, n_layer=4, n_embd=128, n_head=4, n_head_kv=2, n_ff=256, pattern=4,
                                n_embd_target=256, head_dim=64, global_head_dim=128, sliding_window=32,
                                partial_rotary=0.25, rope_theta=1_000_000.0, rope_theta_swa=10_000.0,
                                n_vocab: int | None = None, tensor_type="F16", seed=1, nextn: int | None = None,
                                drop: tuple[str, ...] = (), extra: dict[str, np.ndarray] | None = None) -> Path:
    """Blocks sliding except every `pattern`-th (Google's E2B assistant: 4 blocks, the last global).
    `drop`: tensor names left out; `extra`: tensors added (refusal tests)."""
    r = _Rand(seed)
    v = vocab("gemma4")
    n_vocab = n_vocab or len(v["tokens"])
    swa = [(i + 1) % pattern != 0 for i in range(n_layer)]
    t: dict[str, np.ndarray] = {"token_embd.weight": r.normal((n_vocab, n_embd), 2.0 / np.sqrt(n_embd))}
    n_rot_pairs = int(global_head_dim * partial_rotary / 2)
    t["rope_freqs.weight"] = np.array([1.0] * n_rot_pairs + [1e30] * (global_head_dim // 2 - n_rot_pairs),
                                      dtype=np.float32)
    # numpy (out, in) = GGUF [in, out]: pre_projection takes concat(embedding, target hidden)
    t["nextn.pre_projection.weight"] = r.normal((n_embd, 2 * n_embd_target), 1.0 / np.sqrt(2 * n_embd_target))
    t["nextn.post_projection.weight"] = r.normal((n_embd_target, n_embd), 1.0 / np.sqrt(n_embd))
    for i in range(n_layer):
        p = f"blk.{i}."
        hd = head_dim if swa[i] else global_head_dim
        t[p + "attn_norm.weight"] = r.norm(n_embd)
        t[p + "attn_q.weight"] = r.normal((n_head * hd, n_embd), 1.0 / np.sqrt(n_embd))
        t[p + "attn_q_norm.weight"] = r.norm(hd, (QK_NORM ** 0.5) * hd ** -0.25)
        t[p + "attn_output.weight"] = r.normal((n_embd, n_head * hd), 1.0 / np.sqrt(n_head * hd))
        t[p + "post_attention_norm.weight"] = r.norm(n_embd, 3.0)
        t[p + "ffn_norm.weight"] = r.norm(n_embd)
        t[p + "ffn_gate.weight"] = r.normal((n_ff, n_embd), 1.0 / np.sqrt(n_embd))
        t[p + "ffn_up.weight"] = r.normal((n_ff, n_embd), 1.0 / np.sqrt(n_embd))
        t[p + "ffn_down.weight"] = r.normal((n_embd, n_ff), 1.0 / np.sqrt(n_ff))
        t[p + "post_ffw_norm.weight"] = r.norm(n_embd, 3.0)
        t[p + "layer_output_scale.weight"] = np.array([0.9 + 0.05 * i], dtype=np.float32)
    t["output_norm.weight"] = r.norm(n_embd)
    for name in drop:
        del t[name]
    t.update(extra or {})

    qtype, ftype = gguf_factory._TENSOR_TYPES[tensor_type]
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    w = gguf.GGUFWriter(str(path), ARCH)
    w.add_type(gguf.GGUFType.MODEL)
    w.add_name(f"Tiny gemma4 assistant {n_layer}x{n_embd} seed {seed}")
    w.add_context_length(2048)
    w.add_embedding_length(n_embd)
    w.add_embedding_length_out(n_embd_target)
    w.add_block_count(n_layer)
    w.add_nextn_predict_layers(n_layer if nextn is None else nextn)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head_kv)      # the target's K/V heads: llama.cpp's draft context sizes its cache by it
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(float(rope_theta))
    w.add_rope_freq_base_swa(float(rope_theta_swa))
    w.add_sliding_window(sliding_window)
    w.add_sliding_window_pattern(swa)
    w.add_shared_kv_layers(n_layer)
    w.add_key_length(global_head_dim)
    w.add_value_length(global_head_dim)
    w.add_key_length_swa(head_dim)
    w.add_value_length_swa(head_dim)
    w.add_rope_dimension_count(global_head_dim)
    w.add_rope_dimension_count_swa(head_dim)
    w.add_file_type(ftype)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    if n_vocab == len(v["tokens"]):
        _add_vocab(w, v)
    else:           # another vocabulary size: tokens of its own (a drafter for another model)
        w.add_tokenizer_model("gemma4")
        w.add_token_list([f"t{i}" for i in range(n_vocab)])
    for name, arr in t.items():
        if name == "rope_freqs.weight" or arr.ndim == 1:       # kept F32, as the converter leaves them
            w.add_tensor(name, arr.astype(np.float32))
            continue
        data, raw_dtype = gguf_factory._encode(arr, qtype)
        w.add_tensor(name, data, **({"raw_dtype": raw_dtype} if raw_dtype is not None else {}))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def write_gemma4_assistant(path, *, ftype: str = "F16", **kw) -> Path:
    """F16/F32 as written; another type (Q8_0, Q4_K_M, ...) quantized from F16 by the real llama.cpp
    (its quantizer knows the gemma4-assistant architecture)."""
    path = Path(path)
    if ftype in ("F16", "F32"):
        return write_tiny_gemma4_assistant(path, tensor_type=ftype, **kw)
    src = write_tiny_gemma4_assistant(path.with_suffix(".f16.gguf"), tensor_type="F16", **kw)
    return gguf_factory.quantize_with_llama(src, path, ftype)
