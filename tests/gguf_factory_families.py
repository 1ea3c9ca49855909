"""Tiny, real GGUF files of the smaller families of issue #29: granite, olmo2, mistral3, phi3.

Each is laid out as llama.cpp's convert_hf_to_gguf.py writes a real checkpoint of the family, so
llama.cpp (the oracle) loads it with its own graph for that architecture:

* ``granite``   Granite 3.x: llama blocks with Q/K rows permuted (GraniteModel is a LlamaModel), and
                the four multipliers as metadata: ``embedding_scale`` (embeddings times it),
                ``residual_scale`` (each block's output times it before the residual add),
                ``attention.scale`` (the softmax scale, in place of 1/sqrt(head_dim)) and
                ``logit_scale`` (logits divided by it). Tied embeddings.
* ``olmo2``     OLMo 2: no pre-norms; RMSNorm after attention (``post_attention_norm``) and after the
                MLP (``post_ffw_norm``), both inside the residual branch; Q/K RMSNorm over the whole
                projection (``attn_q_norm`` is n_head*head_dim wide, not head_dim); NEOX RoPE, no
                permute; an untied ``output.weight`` (llama.cpp requires it for olmo2).
* ``mistral3``  Ministral 3 (text): llama blocks with Q/K rows permuted, explicit head_dim (twice
                width / heads, as in the real ones), YaRN
                (``rope.scaling.*``, ``yarn_log_multiplier`` = mscale_all_dim) and Llama-4 attention
                temperature (``attention.temperature_scale`` = llama_4_scaling_beta). The original
                context is kept small so both matter inside a short test.
* ``phi3``      Phi-4-mini style: fused ``attn_qkv`` (Q, K, V rows stacked), fused ``ffn_up`` holding
                the gate half then the up half (2*n_ff rows), partial RoPE (``rope.dimension_count`` <
                head_dim), LongRoPE factors ``rope_factors_long``/``rope_factors_short`` with
                ``rope.scaling.attn_factor`` and ``rope.scaling.original_context_length``.
* ``phi3-spm``  the same graph as a Phi-3/3.5-mini file: a SentencePiece vocabulary, full RoPE, no
                LongRoPE, and a "Phi-3" name (llama.cpp right-strips whitespace after its special tokens).

The vocabulary is gguf_factory's trained byte-level BPE; the family's own control tokens take the
three special ids (0-2) and the rest are appended after the merges, and each file carries a chat
template typical of the family (FAMILIES[...].template) ending each turn with its own marker.
Quantize with gguf_factory.quantize_with_llama (width 256 so llama.cpp really uses K-quants).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

import gguf
import gguf_factory
from gguf_factory import TOKEN_TYPE_CONTROL, TOKEN_TYPE_NORMAL, _llama_permute, _trained_vocab


@dataclass(frozen=True)
class Family:
    arch: str
    specials: tuple[str, ...]   # control tokens: the first three are ids 0-2, the rest follow the merges
    pre: str                    # tokenizer.ggml.pre, as the family's real files say it
    bos: str
    eos: str
    add_bos: bool
    end_of_turn: str            # the token a reply ends with under the template
    template: str


GRANITE_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|start_of_role|>' + message['role'] + '<|end_of_role|>' + message['content'] + '<|end_of_text|>\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_of_role|>assistant<|end_of_role|>' }}{%- endif %}"
)
OLMO2_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ '<|system|>\n' + message['content'] + '\n' }}"
    "{% elif message['role'] == 'user' %}{{ '<|user|>\n' + message['content'] + '\n' }}"
    "{% elif message['role'] == 'assistant' %}{% if not loop.last %}"
    "{{ '<|assistant|>\n' + message['content'] + eos_token + '\n' }}"
    "{% else %}{{ '<|assistant|>\n' + message['content'] + eos_token }}{% endif %}{% endif %}"
    "{% if loop.last and add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}{% endfor %}"
)
MISTRAL3_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ '[SYSTEM_PROMPT]' + message['content'] + '[/SYSTEM_PROMPT]' }}"
    "{% elif message['role'] == 'user' %}{{ '[INST]' + message['content'] + '[/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token }}{% endif %}{% endfor %}"
)
PHI3_SPM_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] == 'system' %}{{'<|system|>\n' + message['content'] + '<|end|>\n'}}"
    "{% elif message['role'] == 'user' %}{{'<|user|>\n' + message['content'] + '<|end|>\n'}}"
    "{% elif message['role'] == 'assistant' %}{{'<|assistant|>\n' + message['content'] + '<|end|>\n'}}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% else %}{{ eos_token }}{% endif %}"
)
PHI3_TEMPLATE = (
    "{% for message in messages %}{{ '<|' + message['role'] + '|>' + message['content'] + '<|end|>' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>' }}{% else %}{{ eos_token }}{% endif %}"
)

FAMILIES: dict[str, Family] = {
    "granite": Family("granite", ("<|end_of_text|>", "<|start_of_role|>", "<|end_of_role|>", "<|tool_call|>"),
                      "refact", "<|end_of_text|>", "<|end_of_text|>", False, "<|end_of_text|>", GRANITE_TEMPLATE),
    "olmo2": Family("olmo2", ("<|endoftext|>", "<|user|>", "<|assistant|>", "<|system|>", "<|pad|>"),
                    "dbrx", "<|endoftext|>", "<|endoftext|>", False, "<|endoftext|>", OLMO2_TEMPLATE),
    # OLMo 3: GGUF architecture olmo2 with sliding-window layers (4 layers: 0-2 slide, 3 attends to all)
    "olmo3": Family("olmo2", ("<|endoftext|>", "<|user|>", "<|assistant|>", "<|system|>", "<|pad|>"),
                    "dbrx", "<|endoftext|>", "<|endoftext|>", False, "<|endoftext|>", OLMO2_TEMPLATE),
    "mistral3": Family("mistral3", ("<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[SYSTEM_PROMPT]",
                                    "[/SYSTEM_PROMPT]"),
                       "tekken", "<s>", "</s>", True, "</s>", MISTRAL3_TEMPLATE),
    "phi3": Family("phi3", ("<|endoftext|>", "<|user|>", "<|assistant|>", "<|system|>", "<|end|>"),
                   "gpt-4o", "<|endoftext|>", "<|endoftext|>", False, "<|end|>", PHI3_TEMPLATE),
    # Phi-3/3.5-mini: a SentencePiece vocabulary (<unk> <s> </s>, byte fallback, Phi's markers appended),
    # full RoPE, no LongRoPE (the 4k files); named "Phi-3..." as older Phi-3 GGUFs are, which gives its
    # special tokens llama.cpp's right-strip of the whitespace after them
    "phi3-spm": Family("phi3", ("<unk>", "<s>", "</s>", "<|endoftext|>", "<|assistant|>", "<|end|>", "<|user|>",
                                "<|system|>"),
                       "default", "<s>", "<|endoftext|>", False, "<|end|>", PHI3_SPM_TEMPLATE),
}

# Families with Mistral's image control tokens, for a pixtral mmproj beside them
# (tests/gguf_factory_vision_pixtral.py: its [IMG_BREAK] row goes into the projector, [IMG_END] follows
# each image as text). Not in FAMILIES, whose every entry the family tests run with their own tables.
MISTRAL_IMAGE_SPECIALS = ("<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]",
                          "[IMG]", "[IMG_BREAK]", "[IMG_END]")
VISION_FAMILIES: dict[str, Family] = {
    "mistral3-vision": Family("mistral3", MISTRAL_IMAGE_SPECIALS, "tekken", "<s>", "</s>", True, "</s>",
                              MISTRAL3_TEMPLATE),
    # Mistral Small 3.1/3.2 and Pixtral 12B: their text model converts to GGUF architecture llama
    "llama-mistral-vision": Family("llama", MISTRAL_IMAGE_SPECIALS, "tekken", "<s>", "</s>", True, "</s>",
                                   MISTRAL3_TEMPLATE),
}


def family_spec(family: str) -> Family:
    spec = FAMILIES.get(family) or VISION_FAMILIES.get(family)
    if spec is None:
        raise ValueError(f"family {family!r} not in {sorted(FAMILIES) + sorted(VISION_FAMILIES)}")
    return spec


# Family hyperparameters beyond the common ones (tests may override any of them).
# Not real Granite's (12, 0.22, 1/128, 8): a small embedding scale and strong blocks keep the random
# model's greedy text varied (with the embedding dominating, greedy repeats one token)
GRANITE_SCALES = dict(embedding_scale=0.25, residual_scale=2.0, attention_scale=1.0 / 32, logit_scale=0.5)
MISTRAL3_ROPE = dict(rope_theta=1_000_000.0, yarn_factor=16.0, yarn_original_context=32, yarn_beta_fast=32.0,
                     yarn_beta_slow=1.0, yarn_log_multiplier=1.0, temperature_scale=0.1)
# Phi-4-mini's 4096 -> 131072 scaled down to 64 -> 4096: the oracle's 256-token context is past the
# original, so llama.cpp runs the long factors, as Strata does for a file longer than its original context
PHI3_ROPE = dict(rope_theta=10000.0, partial_rotary=0.75, original_context=64, context_length=4096)
PHI3_SPM_ROPE = dict(PHI3_ROPE, partial_rotary=1.0, original_context=0)
# a window the test prompts outgrow; the pattern key absent (llama.cpp's default period, 4)
# YaRN on the full-attention layers as OLMo 3's long-context files (factor 8 from 8192), scaled down
OLMO3_SWA = dict(sliding_window=16, swa_pattern=0, yarn_factor=4.0, yarn_original_context=16)


# Merges of digit pairs, after the trained ones (which learnt none: the trainer splits digits one by one),
# so that how a pre-tokenizer groups digits shows in the ids: "1234" is 1 2 3 4 under refact/tekken
# (single digits) and 12 34 under dbrx/gpt-4o (up to three digits, then BPE).
DIGIT_MERGES = (("1", "2"), ("3", "4"), ("2", "0"))


def family_tokens(family: str) -> tuple[list[str], list[int]]:
    """The family's vocabulary: (tokens in id order, token types)."""
    spec = family_spec(family)
    if spec.pre == "default":
        return _spm_tokens(spec)[:2]
    tokens, _ = _trained_vocab()
    n_base = len(gguf_factory.SPECIAL_TOKENS)
    toks = (list(spec.specials[:n_base]) + list(tokens[n_base:]) + [a + b for a, b in DIGIT_MERGES]
            + list(spec.specials[n_base:]))
    types = [TOKEN_TYPE_CONTROL if t in spec.specials else TOKEN_TYPE_NORMAL for t in toks]
    return toks, types


def _spm_tokens(spec: Family) -> tuple[list[str], list[int], list[float]]:
    """A SentencePiece vocabulary (tokens, types, scores): <unk> <s> </s>, the 256 byte tokens, the pieces
    gguf_factory_gemma trains (spaces as U+2581, scores minus the position), then the family's markers."""
    import gguf_factory_gemma
    pieces, _ = gguf_factory_gemma._pieces()
    marks = list(spec.specials[3:])
    toks = list(spec.specials[:3]) + [f"<0x{b:02X}>" for b in range(256)] + list(pieces) + marks
    types = ([int(gguf.TokenType.UNKNOWN)] + [int(gguf.TokenType.CONTROL)] * 2 + [int(gguf.TokenType.BYTE)] * 256
             + [int(gguf.TokenType.NORMAL)] * len(pieces) + [int(gguf.TokenType.CONTROL)] * len(marks))
    scores = [0.0] * 259 + [-float(i) for i in range(len(pieces))] + [0.0] * len(marks)
    return toks, types, scores


def _add_family_tokenizer(w: gguf.GGUFWriter, family: str) -> int:
    spec = family_spec(family)
    if spec.pre == "default":
        toks, types, scores = _spm_tokens(spec)
        w.add_tokenizer_model("llama")
        w.add_token_list(toks)
        w.add_token_scores(scores)
        w.add_token_types(types)
        w.add_bos_token_id(toks.index(spec.bos))
        w.add_eos_token_id(toks.index(spec.eos))
        w.add_unk_token_id(0)
        w.add_add_bos_token(spec.add_bos)
        w.add_chat_template(spec.template)
        return len(toks)
    toks, types = family_tokens(family)
    _, merges = _trained_vocab()
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(spec.pre)
    w.add_token_list(toks)
    w.add_token_types(types)
    w.add_token_merges(list(merges) + [f"{a} {b}" for a, b in DIGIT_MERGES])
    w.add_bos_token_id(toks.index(spec.bos))
    w.add_eos_token_id(toks.index(spec.eos))
    w.add_add_bos_token(spec.add_bos)
    w.add_chat_template(spec.template)
    return len(toks)


def _weights(arch: str, *, n_layer, n_embd, n_head, n_head_kv, n_ff, head_dim, n_vocab, tie, seed, fused_qkv=True):
    """GGUF tensor name -> float32 array in numpy (rows = outputs), as the converter writes them."""
    rng = np.random.default_rng(seed)

    def normal(shape, std):
        return (rng.standard_normal(shape, dtype=np.float32) * np.float32(std)).astype(np.float32)

    def norm_w(n):
        return (1.0 + normal((n,), 0.1)).astype(np.float32)

    q_dim, kv_dim = n_head * head_dim, n_head_kv * head_dim
    # The scales of gguf_factory.tiny_hf_weights: strong o/down so the blocks, not the input token's own
    # embedding, decide the next token (with tied embeddings a weak block makes greedy repeat the input).
    t = {"token_embd.weight": normal((n_vocab, n_embd), 2.0 / np.sqrt(n_embd))}
    for i in range(n_layer):
        p = f"blk.{i}."
        q = normal((q_dim, n_embd), 1.0 / np.sqrt(n_embd))
        k = normal((kv_dim, n_embd), 1.0 / np.sqrt(n_embd))
        v = normal((kv_dim, n_embd), 1.0 / np.sqrt(n_embd))
        o = normal((n_embd, q_dim), 3.0 / np.sqrt(q_dim))
        gate = normal((n_ff, n_embd), 1.0 / np.sqrt(n_embd))
        up = normal((n_ff, n_embd), 1.0 / np.sqrt(n_embd))
        down = normal((n_embd, n_ff), 4.0 / np.sqrt(n_ff))
        if arch in ("granite", "mistral3"):
            # LlamaModel.modify_tensors: rotate-half rows -> adjacent pairs ("normal" RoPE in llama.cpp)
            q, k = _llama_permute(q, n_head, n_head), _llama_permute(k, n_head, n_head_kv)
        if arch == "phi3":
            t[p + "attn_norm.weight"] = norm_w(n_embd)
            if fused_qkv:
                t[p + "attn_qkv.weight"] = np.concatenate([q, k, v], axis=0)
            else:   # llama.cpp's phi3 also reads separate projections
                t[p + "attn_q.weight"], t[p + "attn_k.weight"], t[p + "attn_v.weight"] = q, k, v
            t[p + "attn_output.weight"] = o
            t[p + "ffn_norm.weight"] = norm_w(n_embd)
            t[p + "ffn_up.weight"] = np.concatenate([gate, up], axis=0)   # gate half first (LLM_FFN_SWIGLU)
            t[p + "ffn_down.weight"] = down
            continue
        if arch != "olmo2":
            t[p + "attn_norm.weight"] = norm_w(n_embd)
        t[p + "attn_q.weight"], t[p + "attn_k.weight"], t[p + "attn_v.weight"] = q, k, v
        t[p + "attn_output.weight"] = o
        if arch == "olmo2":
            t[p + "attn_q_norm.weight"] = norm_w(q_dim)
            t[p + "attn_k_norm.weight"] = norm_w(kv_dim)
            t[p + "post_attention_norm.weight"] = norm_w(n_embd)
            t[p + "post_ffw_norm.weight"] = norm_w(n_embd)
        else:
            t[p + "ffn_norm.weight"] = norm_w(n_embd)
        t[p + "ffn_gate.weight"], t[p + "ffn_up.weight"], t[p + "ffn_down.weight"] = gate, up, down
    t["output_norm.weight"] = norm_w(n_embd)
    if not tie:
        t["output.weight"] = normal((n_vocab, n_embd), 2.0 / np.sqrt(n_embd))
    return t


def write_family_gguf(path, family: str, *, n_layer=None, n_embd=256, n_head=4, n_head_kv=2, n_ff=512,
                      head_dim=None, context_length=2048, tensor_type="F16", seed=0, tie=None,
                      name=None, eot_boost: float = 0.0, fused_qkv: bool = True, **hp) -> Path:
    """Write a tiny random-weight GGUF of `family` (see the module doc); `hp` overrides the family's
    defaults (GRANITE_SCALES, MISTRAL3_ROPE, PHI3_ROPE). F16/Q8_0 here, other types: quantize_with_llama.
    `eot_boost` scales the end-of-turn token's output row (the embedding when tied), so that a random
    model ends its reply with it after a few tokens: the tests of stopping need a reply that ends."""
    qtype, ftype = gguf_factory._TENSOR_TYPES[tensor_type]
    arch = family_spec(family).arch
    if n_layer is None:
        n_layer = 4 if family == "olmo3" else 2
    if head_dim is None:
        # Ministral 3's heads are wider than width / heads (3B: 3072 wide, 32 heads of 128)
        head_dim = 2 * n_embd // n_head if arch == "mistral3" else n_embd // n_head
    if tie is None:
        tie = arch in ("granite", "phi3")
    defaults = {"granite": GRANITE_SCALES, "mistral3": MISTRAL3_ROPE, "mistral3-vision": MISTRAL3_ROPE,
                "phi3": PHI3_ROPE,
                "phi3-spm": PHI3_SPM_ROPE, "olmo3": OLMO3_SWA}.get(family, {})
    unknown = set(hp) - set(defaults)
    if unknown:
        raise ValueError(f"{family}: unknown hyperparameters {sorted(unknown)}")
    hp = {**defaults, **hp}
    if arch == "phi3":
        context_length = hp["context_length"]
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)

    w = gguf.GGUFWriter(str(path), arch)
    w.add_type(gguf.GGUFType.MODEL)
    # not "phi3" in the name: llama.cpp's vocabulary loader gives a model whose name contains "phi3" or
    # "phi-3" the Phi-3 SentencePiece special-token attributes (and looks up "</s>", absent here)
    label = {"phi3": "Phi-4-mini-like", "phi3-spm": "Phi-3-mini-like"}.get(family, family)
    w.add_name(name or f"Tiny {label} {n_layer}x{n_embd} seed {seed}")
    w.add_size_label("tiny")
    w.add_block_count(n_layer)
    w.add_context_length(context_length)
    w.add_embedding_length(n_embd)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head_kv)
    w.add_layer_norm_rms_eps(1e-5 if arch == "mistral3" else 1e-6)
    w.add_file_type(ftype)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    n_vocab = _add_family_tokenizer(w, family)
    tensors = _weights(arch, n_layer=n_layer, n_embd=n_embd, n_head=n_head, n_head_kv=n_head_kv, n_ff=n_ff,
                       head_dim=head_dim, n_vocab=n_vocab, tie=tie, seed=seed, fused_qkv=fused_qkv)
    if eot_boost:
        eot = family_tokens(family)[0].index(family_spec(family).end_of_turn)
        tensors["output.weight" if "output.weight" in tensors else "token_embd.weight"][eot] *= eot_boost

    if arch == "granite":
        w.add_rope_freq_base(10000.0)
        w.add_vocab_size(n_vocab)
        w.add_rope_dimension_count(head_dim)
        w.add_embedding_scale(hp["embedding_scale"])
        w.add_residual_scale(hp["residual_scale"])
        w.add_attention_scale(hp["attention_scale"])
        w.add_logit_scale(hp["logit_scale"])
    elif arch == "olmo2":
        w.add_rope_freq_base(500000.0)
        if hp.get("sliding_window"):
            w.add_sliding_window(hp["sliding_window"])
        if hp.get("swa_pattern"):
            w.add_uint32(f"{arch}.attention.sliding_window_pattern", hp["swa_pattern"])
        if hp.get("yarn_factor"):
            w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
            w.add_rope_scaling_factor(hp["yarn_factor"])
            w.add_rope_scaling_orig_ctx_len(hp["yarn_original_context"])
    elif arch == "mistral3":
        w.add_rope_freq_base(hp["rope_theta"])
        w.add_vocab_size(n_vocab)
        w.add_rope_dimension_count(head_dim)
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
        if hp["yarn_factor"]:
            w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
            w.add_rope_scaling_factor(hp["yarn_factor"])
            w.add_rope_scaling_orig_ctx_len(hp["yarn_original_context"])
            w.add_rope_scaling_yarn_beta_fast(hp["yarn_beta_fast"])
            w.add_rope_scaling_yarn_beta_slow(hp["yarn_beta_slow"])
            w.add_rope_scaling_yarn_log_mul(hp["yarn_log_multiplier"])
        if hp["temperature_scale"]:
            w.add_attn_temperature_scale(hp["temperature_scale"])
    elif arch == "phi3":
        rope_dim = int(head_dim * hp["partial_rotary"])
        w.add_rope_freq_base(hp["rope_theta"])
        w.add_rope_dimension_count(rope_dim)
        orig = hp["original_context"]
        if orig and orig < context_length:
            # Phi3MiniModel.set_gguf_parameters for LongRoPE ("su"/"longrope") checkpoints
            scale = context_length / orig
            w.add_rope_scaling_attn_factors(float(np.sqrt(1 + np.log(scale) / np.log(orig))))
            w.add_rope_scaling_orig_ctx_len(orig)
            rng = np.random.default_rng(seed + 1)
            # short factors near 1, long ones larger (as in real files): they must differ to be told apart
            tensors["rope_factors_long.weight"] = (1.0 + rng.uniform(0, 40, rope_dim // 2)).astype(np.float32)
            tensors["rope_factors_short.weight"] = (1.0 + rng.uniform(0, 0.5, rope_dim // 2)).astype(np.float32)

    gguf_factory.write_tensors_and_close(w, tensors, qtype)
    return path


def writer(family: str) -> Callable[..., Path]:
    """An arch_cases.ARCH_WRITERS writer: write(path, *, ftype="F16", seed=0) -> Path."""
    def write(path, *, ftype: str = "F16", seed: int = 0) -> Path:
        path = Path(path)
        if ftype == "F16":
            return write_family_gguf(path, family, tensor_type=ftype, seed=seed)
        src = write_family_gguf(path.with_suffix(".f16.gguf"), family, tensor_type="F16", seed=seed)
        return gguf_factory.quantize_with_llama(src, path, ftype)
    return write
