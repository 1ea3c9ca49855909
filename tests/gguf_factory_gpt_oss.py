"""Tiny gpt-oss GGUFs (general.architecture "gpt-oss", llama.cpp's LLM_ARCH_OPENAI_MOE), laid out as
convert_hf_to_gguf.py's GptOssModel writes one, so llama.cpp (the oracle) and Strata both load it:

* attention with Q/K/V/O biases, NEOX RoPE with YaRN scaling (factor 32 over 4096 positions, as the
  real models), a learnt per-head sink logit (``blk.N.attn_sinks.weight``), sliding-window layers
  (even blocks) alternating with full ones;
* ``blk.N.post_attention_norm`` before a MoE of ``n_expert`` experts with biases everywhere (router
  ``ffn_gate_inp.bias``, ``ffn_{gate,up,down}_exps.bias``), softmax over the top-k router logits,
  the clamped SwiGLU (alpha 1.702, limit 7);
* an untied ``output.weight``;
* the byte-level BPE of tests/gguf_factory.py (pre-tokenizer "gpt-4o", as the real files) plus the
  harmony control tokens, EOS ``<|return|>``, and the real gpt-oss chat template.

``write_tiny_gpt_oss_gguf`` writes F16 (or F32 / Q8_0 via gguf-py); ``write(path, ftype=...)`` (the
tests/arch_cases.py writer) also gives llama.cpp's Q8_0 / Q4_K_M and ``MXFP4_MOE`` (llama.cpp's own
quantizer: MXFP4 experts, the rest Q8_0), or ``MXFP4_PY`` (experts MXFP4-encoded by gguf-py here,
the rest F16: works without llama.cpp).
"""
from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

import gguf_factory as gf
import gguf_random_blocks

HARMONY_TOKENS = ("<|startoftext|>", "<|return|>", "<|constrain|>", "<|channel|>", "<|start|>", "<|end|>",
                  "<|message|>", "<|call|>")
TEMPLATE = Path(__file__).resolve().parent / "engine" / "tool_templates" / "openai-gpt-oss-120b.jinja"
SWIGLU_LIMIT = 7.0


def vocab() -> tuple[list[str], list[int], list[str]]:
    """(tokens, token types, merges): the factory's trained BPE with the harmony control tokens appended."""
    tokens, merges = gf._trained_vocab()
    tokens = list(tokens) + list(HARMONY_TOKENS)
    types = [gf.TOKEN_TYPE_CONTROL if t in gf.SPECIAL_TOKENS or t in HARMONY_TOKENS else gf.TOKEN_TYPE_NORMAL
             for t in tokens]
    return tokens, types, list(merges)


def token_id(text: str) -> int:
    return vocab()[0].index(text)


def write_tiny_gpt_oss_gguf(path, *, n_layer=2, n_embd=256, n_head=4, n_head_kv=2, head_dim=64, n_expert=4,
                            n_expert_used=2, n_ff_exp=256, sliding_window=32, context_length=4096,
                            tensor_type="F16", mxfp4_experts=False, seed=0, rope_theta=150000.0,
                            router_std=3.0, name=None, fast_random=False, edit=None) -> Path:
    """A tiny random-weight gpt-oss GGUF. ``sliding_window`` is small (the real models use 128) so that
    short test prompts already cross it. ``mxfp4_experts``: the ``*_exps`` weights MXFP4-encoded by
    gguf-py (block 32, e8m0 scale), as the real releases ship them. ``fast_random``: the blocks'
    weight matrices written as random quantized blocks (tests/gguf_random_blocks.py; bench/shapes.py's
    big files: gpt-oss-20b's layer shape in seconds, not minutes). ``edit(tensors)``: called on the
    tensor dict before writing (bench/shapes.py zeroes output rows)."""
    rng = np.random.default_rng(seed)

    def normal(shape, std):
        return (rng.standard_normal(shape, dtype=np.float32) * np.float32(std)).astype(np.float32)

    def weight(shape, std):
        return gguf_random_blocks.draw(rng, shape, std) if fast_random else normal(shape, std)

    def norm_w(n):
        return (1.0 + normal((n,), 0.1)).astype(np.float32)

    tokens, types, merges = vocab()
    n_vocab = len(tokens)
    q_dim, kv_dim = n_head * head_dim, n_head_kv * head_dim
    t: dict[str, np.ndarray] = {"token_embd.weight": normal((n_vocab, n_embd), 2.0 / np.sqrt(n_embd))}
    for i in range(n_layer):
        p = f"blk.{i}."
        t[p + "attn_norm.weight"] = norm_w(n_embd)
        t[p + "attn_q.weight"] = weight((q_dim, n_embd), 1.0 / np.sqrt(n_embd))
        t[p + "attn_q.bias"] = normal((q_dim,), 0.2)
        t[p + "attn_k.weight"] = weight((kv_dim, n_embd), 1.0 / np.sqrt(n_embd))
        t[p + "attn_k.bias"] = normal((kv_dim,), 0.2)
        t[p + "attn_v.weight"] = weight((kv_dim, n_embd), 1.0 / np.sqrt(n_embd))
        t[p + "attn_v.bias"] = normal((kv_dim,), 0.2)
        t[p + "attn_output.weight"] = weight((n_embd, q_dim), 3.0 / np.sqrt(q_dim))
        t[p + "attn_output.bias"] = normal((n_embd,), 0.2)
        # sink logits of the order of the scores: some heads give the sink real weight
        t[p + "attn_sinks.weight"] = normal((n_head,), 1.5)
        t[p + "post_attention_norm.weight"] = norm_w(n_embd)
        t[p + "ffn_gate_inp.weight"] = normal((n_expert, n_embd), router_std / np.sqrt(n_embd))
        t[p + "ffn_gate_inp.bias"] = normal((n_expert,), 0.5)
        # gate/up strong enough that some activations pass the clamp at +-7 (the SwiGLU's limit)
        t[p + "ffn_gate_exps.weight"] = weight((n_expert, n_ff_exp, n_embd), 2.5 / np.sqrt(n_embd))
        t[p + "ffn_gate_exps.bias"] = normal((n_expert, n_ff_exp), 0.5)
        t[p + "ffn_up_exps.weight"] = weight((n_expert, n_ff_exp, n_embd), 2.5 / np.sqrt(n_embd))
        t[p + "ffn_up_exps.bias"] = normal((n_expert, n_ff_exp), 0.5)
        t[p + "ffn_down_exps.weight"] = weight((n_expert, n_embd, n_ff_exp), 1.0 / np.sqrt(n_ff_exp))
        t[p + "ffn_down_exps.bias"] = normal((n_expert, n_embd), 0.2)
    t["output_norm.weight"] = norm_w(n_embd)
    t["output.weight"] = normal((n_vocab, n_embd), 2.0 / np.sqrt(n_embd))
    if edit is not None:
        edit(t)

    qtype, ftype = gf._TENSOR_TYPES[tensor_type]
    if mxfp4_experts:
        ftype = gguf.LlamaFileType.MOSTLY_MXFP4_MOE
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    w = gguf.GGUFWriter(str(path), "gpt-oss")
    w.add_type(gguf.GGUFType.MODEL)
    w.add_name(name or f"Tiny gpt-oss {n_layer}x{n_embd} {n_expert}x{n_ff_exp} seed {seed}")
    w.add_size_label("tiny")
    w.add_block_count(n_layer)
    w.add_context_length(context_length)
    w.add_embedding_length(n_embd)
    w.add_feed_forward_length(n_ff_exp)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head_kv)
    w.add_rope_freq_base(float(rope_theta))
    w.add_layer_norm_rms_eps(1e-5)
    w.add_expert_count(n_expert)
    w.add_expert_used_count(n_expert_used)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_sliding_window(sliding_window)
    w.add_expert_feed_forward_length(n_ff_exp)
    w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    w.add_rope_scaling_factor(32.0)
    w.add_rope_scaling_orig_ctx_len(4096)
    w.add_file_type(ftype)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)

    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-4o")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(tokens.index("<|startoftext|>"))
    w.add_eos_token_id(tokens.index("<|return|>"))
    w.add_pad_token_id(tokens.index("<|endoftext|>"))
    w.add_add_bos_token(False)
    w.add_chat_template(TEMPLATE.read_text())

    for gname, arr in t.items():
        if isinstance(arr, gguf_random_blocks.RandomBlocks):
            mx = mxfp4_experts and "_exps." in gname
            data, raw_dtype = arr.encode(gguf.GGMLQuantizationType.MXFP4 if mx else qtype)
            w.add_tensor(gname, data, raw_dtype=raw_dtype) if raw_dtype is not None else w.add_tensor(gname, data)
        elif gname.endswith(("ffn_gate_inp.weight", ".bias")) or arr.ndim == 1:
            # router, biases (the 2-D expert ones too: llama.cpp's CPU add_id takes only F32) and 1-D
            # tensors stay F32, as in the released files
            w.add_tensor(gname, arr.astype(np.float32))
        elif mxfp4_experts and "_exps." in gname:
            w.add_tensor(gname, gguf.quants.quantize(arr, gguf.GGMLQuantizationType.MXFP4),
                         raw_dtype=gguf.GGMLQuantizationType.MXFP4)
        else:
            data, raw_dtype = gf._encode(arr, qtype)
            w.add_tensor(gname, data, raw_dtype=raw_dtype) if raw_dtype is not None else w.add_tensor(gname, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def write(path, *, ftype: str = "F16", seed: int = 0) -> Path:
    """tests/arch_cases.py's writer: F16, MXFP4_PY (gguf-py), or any llama.cpp quantization of the F16
    file (Q8_0, Q4_K_M, MXFP4_MOE)."""
    path = Path(path)
    if ftype == "F16":
        return write_tiny_gpt_oss_gguf(path, seed=seed)
    if ftype == "MXFP4_PY":
        return write_tiny_gpt_oss_gguf(path, seed=seed, mxfp4_experts=True)
    src = write_tiny_gpt_oss_gguf(path.with_suffix(".f16.gguf"), seed=seed)
    return gf.quantize_with_llama(src, path, ftype)
