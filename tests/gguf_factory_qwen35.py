"""Tiny Qwen3.5 / Qwen3.6 GGUFs (`qwen35`, `qwen35moe`) laid out as llama.cpp's converter writes them.

Four blocks by default: every `full_attention_interval`-th (4th) is gated full attention, the others
Gated DeltaNet layers. What the converter does is reproduced (engine/model/archs/qwen35.py lists it):
`ssm_a` = -exp(A_log), `ssm_dt.bias`, `ssm_conv1d` [d_conv, conv_dim] in F32, the norms stored as
1 + w (random around 1 here, so nothing to add), the DeltaNet's value heads in llama.cpp's tiled
order (the weights are random, so writing them directly in file order is writing that order; with
more value heads than key heads, the loader's regrouping is what the llama.cpp comparison checks),
the attention's Q projection doubled (per head [query, gate]), partial RoPE (`rope.dimension_count`)
with `rope.dimension_sections` (text positions make it plain NEOX RoPE), `full_attention_interval`,
the ssm.* sizes. `nextn=1` appends a NextN/MTP block (blk.{n_layer}: a full-attention block plus
`nextn.eh_proj`, `nextn.enorm`, `nextn.hnorm`, `nextn.shared_head_norm`) and writes
`{arch}.nextn_predict_layers`, block_count counting it, as the converter's _Qwen35MtpMixin does.

Widths are multiples of 256 so llama.cpp's K-quants apply to every matrix (quantize with
gguf_factory.quantize_with_llama). The tokenizer is gguf_factory's tiny BPE with the `qwen35`
pre-tokenizer name and a Qwen3-style chat template whose generation prompt opens `<think>`.
"""
from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

import gguf_factory

ARCHS = ("qwen35", "qwen35moe")
IMAGE_MARKERS = ("<|vision_start|>", "<|vision_end|>")     # libmtmd's around a Qwen-VL image

# Qwen3.5's template, abridged: earlier replies lose their reasoning, the reply opens a <think> block
# (closed at once when enable_thinking is false).
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message['role'] == 'assistant' %}"
    "{%- set content = message['content'] %}"
    "{%- if '</think>' in content %}{%- set content = content.split('</think>')[-1].lstrip('\n') %}{%- endif %}"
    "{{- '<|im_start|>assistant\n' + content + '<|im_end|>\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\n\n</think>\n\n' }}"
    "{%- else %}{{- '<think>\n' }}{%- endif %}{%- endif %}"
)


def _tensors(arch, *, n_vocab, n_layer, n_embd, n_head, n_head_kv, head_dim, n_ff, n_k_heads, n_v_heads,
             head_k_dim, d_conv, interval, n_expert, n_ff_exp, n_ff_shexp, nextn, tie_embeddings, seed,
             router_std) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)

    def normal(shape, std):
        return (rng.standard_normal(shape, dtype=np.float32) * np.float32(std)).astype(np.float32)

    def norm_w(n):
        return (1.0 + normal((n,), 0.1)).astype(np.float32)

    q_dim, kv_dim = n_head * head_dim, n_head_kv * head_dim
    key_dim, value_dim = n_k_heads * head_k_dim, n_v_heads * head_k_dim
    conv_dim = 2 * key_dim + value_dim
    t: dict[str, np.ndarray] = {"token_embd.weight": normal((n_vocab, n_embd), 2.0 / np.sqrt(n_embd))}

    def attention(p):
        t[p + "attn_q.weight"] = normal((2 * q_dim, n_embd), 1.0 / np.sqrt(n_embd))   # [query, gate] per head
        t[p + "attn_k.weight"] = normal((kv_dim, n_embd), 1.0 / np.sqrt(n_embd))
        t[p + "attn_v.weight"] = normal((kv_dim, n_embd), 1.0 / np.sqrt(n_embd))
        t[p + "attn_q_norm.weight"] = norm_w(head_dim)
        t[p + "attn_k_norm.weight"] = norm_w(head_dim)
        t[p + "attn_output.weight"] = normal((n_embd, q_dim), 3.0 / np.sqrt(q_dim))

    def ffn(p):
        if arch == "qwen35":
            t[p + "ffn_gate.weight"] = normal((n_ff, n_embd), 1.0 / np.sqrt(n_embd))
            t[p + "ffn_up.weight"] = normal((n_ff, n_embd), 1.0 / np.sqrt(n_embd))
            t[p + "ffn_down.weight"] = normal((n_embd, n_ff), 4.0 / np.sqrt(n_ff))
            return
        t[p + "ffn_gate_inp.weight"] = normal((n_expert, n_embd), router_std / np.sqrt(n_embd))
        t[p + "ffn_gate_exps.weight"] = normal((n_expert, n_ff_exp, n_embd), 1.0 / np.sqrt(n_embd))
        t[p + "ffn_up_exps.weight"] = normal((n_expert, n_ff_exp, n_embd), 1.0 / np.sqrt(n_embd))
        t[p + "ffn_down_exps.weight"] = normal((n_expert, n_embd, n_ff_exp), 4.0 / np.sqrt(n_ff_exp))
        t[p + "ffn_gate_inp_shexp.weight"] = normal((n_embd,), 1.0 / np.sqrt(n_embd))
        t[p + "ffn_gate_shexp.weight"] = normal((n_ff_shexp, n_embd), 1.0 / np.sqrt(n_embd))
        t[p + "ffn_up_shexp.weight"] = normal((n_ff_shexp, n_embd), 1.0 / np.sqrt(n_embd))
        t[p + "ffn_down_shexp.weight"] = normal((n_embd, n_ff_shexp), 3.0 / np.sqrt(n_ff_shexp))

    for i in range(n_layer):
        p = f"blk.{i}."
        t[p + "attn_norm.weight"] = norm_w(n_embd)
        if (i + 1) % interval == 0:
            attention(p)
        else:
            t[p + "attn_qkv.weight"] = normal((conv_dim, n_embd), 1.0 / np.sqrt(n_embd))
            t[p + "attn_gate.weight"] = normal((value_dim, n_embd), 1.0 / np.sqrt(n_embd))
            t[p + "ssm_conv1d.weight"] = normal((conv_dim, d_conv), 1.0 / np.sqrt(d_conv))
            t[p + "ssm_dt.bias"] = normal((n_v_heads,), 0.5) + np.float32(1.0)
            # -exp(A_log) with A in [1, 8): per-head decay rates from slow to fast
            t[p + "ssm_a"] = -rng.uniform(1.0, 8.0, size=(n_v_heads,)).astype(np.float32)
            t[p + "ssm_beta.weight"] = normal((n_v_heads, n_embd), 1.0 / np.sqrt(n_embd))
            t[p + "ssm_alpha.weight"] = normal((n_v_heads, n_embd), 1.0 / np.sqrt(n_embd))
            t[p + "ssm_norm.weight"] = norm_w(head_k_dim)
            t[p + "ssm_out.weight"] = normal((n_embd, value_dim), 3.0 / np.sqrt(value_dim))
        t[p + "post_attention_norm.weight"] = norm_w(n_embd)
        ffn(p)
    for j in range(nextn):
        p = f"blk.{n_layer + j}."
        t[p + "attn_norm.weight"] = norm_w(n_embd)
        attention(p)
        t[p + "post_attention_norm.weight"] = norm_w(n_embd)
        ffn(p)
        t[p + "nextn.eh_proj.weight"] = normal((n_embd, 2 * n_embd), 1.0 / np.sqrt(2 * n_embd))
        t[p + "nextn.enorm.weight"] = norm_w(n_embd)
        t[p + "nextn.hnorm.weight"] = norm_w(n_embd)
        t[p + "nextn.shared_head_norm.weight"] = norm_w(n_embd)
    t["output_norm.weight"] = norm_w(n_embd)
    if not tie_embeddings:
        t["output.weight"] = normal((n_vocab, n_embd), 2.0 / np.sqrt(n_embd))
    return t


# kept in F32 whatever the file type, as the converter and llama.cpp's quantizer do (ggml_ssm_conv
# takes an F32 kernel; the router is small and precision-sensitive)
_F32_ALWAYS = ("ssm_conv1d.weight", "ffn_gate_inp.weight")


def write_tiny_qwen35_gguf(path, arch: str = "qwen35", *, n_layer=4, n_embd=256, n_head=2, n_head_kv=1,
                           head_dim=128, n_ff=512, n_k_heads=2, n_v_heads=4, head_k_dim=64, d_conv=4,
                           n_rot=32, interval=4, n_expert=4, n_expert_used=2, n_ff_exp=256, n_ff_shexp=256,
                           nextn=0, context_length=2048, tensor_type="F16", tie_embeddings=True, seed=0,
                           rope_theta=1e7, router_std=3.0, fused_gate_up=False, name=None,
                           image_tokens: bool = False) -> Path:
    """Write a tiny random-weight qwen35 / qwen35moe GGUF and return its path (tensor_type F32, F16,
    BF16 or Q8_0; other types through gguf_factory.quantize_with_llama). `fused_gate_up`: the experts'
    gate and up stacks as one `ffn_gate_up_exps` (gate rows first), the same weights otherwise.
    `image_tokens`: Qwen's image markers (IMAGE_MARKERS) as control tokens after the vocabulary."""
    if arch not in ARCHS:
        raise ValueError(f"arch {arch!r} not in {ARCHS}")
    if tensor_type not in gguf_factory._TENSOR_TYPES:
        raise ValueError(f"tensor_type {tensor_type!r} not in {sorted(gguf_factory._TENSOR_TYPES)}")
    if n_v_heads % n_k_heads or n_rot % 2 or n_rot > head_dim:
        raise ValueError("n_v_heads must be a multiple of n_k_heads; n_rot even and <= head_dim")
    tok = gguf_factory.tiny_tokenizer_fields("qwen2", pre="qwen35")
    if image_tokens:
        tok["tokenizer.ggml.tokens"] = tok["tokenizer.ggml.tokens"] + list(IMAGE_MARKERS)
        tok["tokenizer.ggml.token_type"] = tok["tokenizer.ggml.token_type"] + [gguf_factory.TOKEN_TYPE_CONTROL] * 2
    t = _tensors(arch, n_vocab=len(tok["tokenizer.ggml.tokens"]), n_layer=n_layer, n_embd=n_embd, n_head=n_head,
                 n_head_kv=n_head_kv, head_dim=head_dim,
                 n_ff=n_ff, n_k_heads=n_k_heads, n_v_heads=n_v_heads, head_k_dim=head_k_dim, d_conv=d_conv,
                 interval=interval, n_expert=n_expert, n_ff_exp=n_ff_exp, n_ff_shexp=n_ff_shexp, nextn=nextn,
                 tie_embeddings=tie_embeddings, seed=seed, router_std=router_std)
    qtype, ftype = gguf_factory._TENSOR_TYPES[tensor_type]
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_type(gguf.GGUFType.MODEL)
    w.add_name(name or f"Tiny {arch} {n_layer}x{n_embd} seed {seed}")
    w.add_size_label("tiny")
    w.add_block_count(n_layer + nextn)
    w.add_context_length(context_length)
    w.add_embedding_length(n_embd)
    w.add_feed_forward_length(n_ff if arch == "qwen35" else n_ff_shexp)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head_kv)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_freq_base(float(rope_theta))
    w.add_rope_dimension_count(n_rot)
    half = n_rot // 2
    w.add_rope_dimension_sections([half - 2 * (half // 3), half // 3, half // 3, 0])
    w.add_layer_norm_rms_eps(1e-6)
    w.add_ssm_conv_kernel(d_conv)
    w.add_ssm_state_size(head_k_dim)
    w.add_ssm_group_count(n_k_heads)
    w.add_ssm_time_step_rank(n_v_heads)
    w.add_ssm_inner_size(head_k_dim * n_v_heads)
    w.add_full_attention_interval(interval)
    if nextn:
        w.add_nextn_predict_layers(nextn)
    if arch == "qwen35moe":
        w.add_expert_count(n_expert)
        w.add_expert_used_count(n_expert_used)
        w.add_expert_feed_forward_length(n_ff_exp)
        w.add_expert_shared_feed_forward_length(n_ff_shexp)
    w.add_file_type(ftype)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    tok["tokenizer.chat_template"] = CHAT_TEMPLATE
    gguf_factory._add_tokenizer(w, tok)
    if fused_gate_up:
        for gname in [k for k in t if k.endswith("ffn_gate_exps.weight")]:
            up = t.pop(gname.replace("gate_exps", "up_exps"))
            t[gname.replace("gate_exps", "gate_up_exps")] = np.concatenate([t.pop(gname), up], axis=1)
    gguf_factory.write_tensors_and_close(w, t, qtype, f32_always=_F32_ALWAYS)
    return path


def writer(arch: str):
    """An arch_cases.ARCH_WRITERS writer: `write(path, *, ftype="F16", seed=0) -> Path`."""
    def write(path, *, ftype: str = "F16", seed: int = 0) -> Path:
        path = Path(path)
        src = write_tiny_qwen35_gguf(path.with_suffix(".f16.gguf") if ftype != "F16" else path, arch,
                                     seed=seed, tensor_type="F16")
        return src if ftype == "F16" else gguf_factory.quantize_with_llama(src, path, ftype)
    return write
