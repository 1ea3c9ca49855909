"""Tiny, real Gemma 3 and Gemma 4 GGUF files, laid out as llama.cpp's converter writes them.

* ``gemma3``: SentencePiece vocabulary (``tokenizer.ggml.model`` = "llama": scores, no merges, byte
  fallback through ``<0xXX>`` tokens, no space prefix); every norm stored as 1+w (Gemma3RMSNorm scales
  by 1+w and the converter bakes the 1 in); q/k norms; pre- and post-norms around attention and the
  FFN; GELU-gated FFN; NEOX RoPE (rows not permuted); sliding-window layers with a global layer every
  ``pattern``-th.
* ``gemma4``: the "gemma4" vocabulary (SentencePiece-style BPE: merges over raw characters with
  spaces written as U+2581, byte fallback); norms stored as they are (no 1+w); a per-layer list of
  sliding/global layers; wider heads on global layers with "proportional" RoPE (``rope_freqs``: 1 for
  the rotated pairs, 1e30 for the rest); V normed without weight; per-layer token embeddings;
  the last layers sharing K/V of earlier ones, with a double-wide FFN; a per-layer output scale;
  final logit soft-capping.

The vocabulary: Gemma's control tokens, the 256 byte tokens, then characters and pieces trained with
the `tokenizers` BPE trainer on gguf_factory.TRAINING_TEXT (spaces as U+2581). Scores are minus the
position, so llama.cpp's SentencePiece merge order (best score first) and transformers' rebuilt merges
(file order) agree. Characters outside the training text (accents, emoji, tabs) take the byte fallback.
"""
from __future__ import annotations

import functools
from pathlib import Path

import numpy as np

import gguf
import gguf_factory
import gguf_random_blocks

SPM_SPECIALS = ("<pad>", "<eos>", "<bos>", "<unk>", "<mask>")
GEMMA3_TURN = ("<start_of_turn>", "<end_of_turn>")
GEMMA4_TURN = ("<|turn>", "<turn|>")
# Gemma 3's image markers (llama.cpp's libmtmd writes them around an image's embeddings); appended
# after the pieces, so the other ids stay as they are
GEMMA3_IMAGE = ("<start_of_image>", "<end_of_image>")
GEMMA4_IMAGE = ("<|image>", "<image|>")       # Gemma 4's (libmtmd's markers for gemma4v)
N_PIECES = 300
# q/k norm scale: unit-RMS queries and keys of random weights give near-uniform attention, which makes
# every position's attention output the context's mean and greedy repeats one token; 1.5x sharpens
# it (2x made the quantized files' logits swing by up to 7 on 8-bit rounding alone)
QK_NORM = 1.5
EOT_BOOST = 2.0   # the turn end's output row = EOT_BOOST x the `eot_like` token's (see _head)

GEMMA3_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)
GEMMA4_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{ '<|turn>' + role + '\n' + message['content'] | trim + '<turn|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|turn>model\n' }}{% endif %}"
)


@functools.lru_cache(maxsize=None)
def _pieces() -> tuple[tuple[str, ...], tuple[tuple[str, str], ...]]:
    """(characters then merged pieces in merge order, merges) trained on the factory's text."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.Replace(" ", "\u2581")
    # pieces start at a word's U+2581, as SentencePiece's do (the split is for training only)
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="never", split=True)
    lines = [ln for ln in gguf_factory.TRAINING_TEXT.splitlines() if ln]
    chars = sorted({c for ln in lines for c in ln.replace(" ", "\u2581")})
    trainer = trainers.BpeTrainer(vocab_size=len(chars) + N_PIECES, min_frequency=2, show_progress=False,
                                  initial_alphabet=chars, special_tokens=[])
    tok.train_from_iterator(lines, trainer=trainer)
    import json
    raw = json.loads(tok.to_str())["model"]["merges"]
    merges = tuple(tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in raw)
    pieces = list(chars)
    seen = set(pieces)
    for a, b in merges:
        if a + b not in seen:
            seen.add(a + b)
            pieces.append(a + b)
    return tuple(pieces), merges


def vocab(arch: str, image_tokens: bool = False) -> dict:
    """The tokenizer.* fields for `arch` ("gemma3": SentencePiece; "gemma4": the gemma4 BPE).
    `image_tokens`: the family's image markers as control tokens at the end."""
    turn = GEMMA3_TURN if arch == "gemma3" else GEMMA4_TURN
    pieces, merges = _pieces()
    tokens = list(SPM_SPECIALS) + list(turn) + [f"<0x{b:02X}>" for b in range(256)]
    n_fixed = len(tokens)
    # newline runs are tokens of their own in Gemma's vocabulary (never merged with text)
    tokens += ["\n", "\n\n"] + list(pieces)
    types = [gguf.TokenType.CONTROL] * len(SPM_SPECIALS) + [gguf.TokenType.CONTROL] * len(turn)
    types[SPM_SPECIALS.index("<unk>")] = gguf.TokenType.UNKNOWN
    types += [gguf.TokenType.BYTE] * 256
    types += [gguf.TokenType.NORMAL] * (len(tokens) - len(types))
    scores = [0.0] * n_fixed + [-float(i) for i in range(len(tokens) - n_fixed)]
    if image_tokens:
        marks = GEMMA3_IMAGE if arch == "gemma3" else GEMMA4_IMAGE
        tokens += list(marks)
        types += [gguf.TokenType.CONTROL] * len(marks)
        scores += [0.0] * len(marks)
    out = {
        "tokens": tokens, "types": [int(t) for t in types], "scores": scores,
        "bos": SPM_SPECIALS.index("<bos>"), "eos": SPM_SPECIALS.index("<eos>"),
        "unk": SPM_SPECIALS.index("<unk>"), "pad": SPM_SPECIALS.index("<pad>"),
        "template": GEMMA3_TEMPLATE if arch == "gemma3" else GEMMA4_TEMPLATE,
        "model": "llama" if arch == "gemma3" else "gemma4",
    }
    if arch == "gemma4":
        out["merges"] = ["\n \n"] + [f"{a} {b}" for a, b in merges]
    return out


def _add_vocab(w: gguf.GGUFWriter, v: dict) -> None:
    w.add_tokenizer_model(v["model"])
    w.add_token_list(v["tokens"])
    w.add_token_scores(v["scores"])
    w.add_token_types(v["types"])
    if "merges" in v:
        w.add_token_merges(v["merges"])
    w.add_bos_token_id(v["bos"])
    w.add_eos_token_id(v["eos"])
    w.add_unk_token_id(v["unk"])
    w.add_pad_token_id(v["pad"])
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
    w.add_add_space_prefix(False)
    w.add_chat_template(v["template"])


class _Rand:
    def __init__(self, seed: int, fast: bool = False):
        self.rng = np.random.default_rng(seed)
        self.fast = fast

    def normal(self, shape, std):
        return (self.rng.standard_normal(shape, dtype=np.float32) * np.float32(std)).astype(np.float32)

    def weight(self, shape, std):
        """A block's weight matrix: float normals, or with `fast` its quantized blocks drawn at write
        time (tests/gguf_random_blocks.py: benchmark-size files)."""
        return gguf_random_blocks.draw(self.rng, shape, std) if self.fast else self.normal(shape, std)

    def norm(self, n, center=1.0):
        """A norm's effective scale: `center` plus noise."""
        return (center + self.normal((n,), 0.1)).astype(np.float32)


def _write(path, arch: str, tensors: dict[str, np.ndarray], meta, tensor_type: str,
           image_tokens: bool = False) -> Path:
    qtype, ftype = gguf_factory._TENSOR_TYPES[tensor_type]
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_type(gguf.GGUFType.MODEL)
    meta(w)
    w.add_file_type(ftype)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    _add_vocab(w, vocab(arch, image_tokens))
    for name, arr in tensors.items():
        if name == "rope_freqs.weight" or arr.ndim == 1 or "ffn_gate_inp" in name:   # kept F32
            w.add_tensor(name, arr.astype(np.float32))
            continue
        if isinstance(arr, gguf_random_blocks.RandomBlocks):
            data, raw_dtype = arr.encode(qtype)
        else:
            data, raw_dtype = gguf_factory._encode(arr, qtype)
        w.add_tensor(name, data, **({"raw_dtype": raw_dtype} if raw_dtype is not None else {}))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _head(r: _Rand, n_vocab: int, n_embd: int, turn_end: str, eot_like: int | None) -> np.ndarray:
    """The untied output head. `eot_like`: the turn-end token's row becomes 3x that token's, so
    greedy ends the turn where it would have picked `eot_like` (a stop the tests can see)."""
    head = r.normal((n_vocab, n_embd), 4.0 / np.sqrt(n_embd))
    if eot_like is not None:
        end = len(SPM_SPECIALS) + (GEMMA3_TURN.index(turn_end) if turn_end in GEMMA3_TURN else
                                   GEMMA4_TURN.index(turn_end))
        head[end] = EOT_BOOST * head[eot_like]
    return head


def write_tiny_gemma3(path, *, n_layer=4, n_embd=256, n_head=4, n_head_kv=2, head_dim=64, n_ff=512,
                      sliding_window=32, pattern: int | None = 2, context_length=2048, tensor_type="F16",
                      seed=0, rope_theta=1_000_000.0, tie_embeddings=False, eot_like: int | None = None,
                      rope_linear: float | None = None, name=None, fast_random: bool = False,
                      edit=None, image_tokens: bool = False) -> Path:
    """A tiny Gemma 3. `pattern`: every pattern-th layer is global, written as
    gemma3.attention.sliding_window_pattern (llama.cpp reads it; 2 = sliding, global, ...). Real
    files have no such key (pattern=None): llama.cpp's default then makes every 6th layer global,
    so such a file needs at least 6 layers. `fast_random`: the blocks' weight matrices written as
    random quantized blocks (bench/shapes.py's big files; Q8_0 in seconds). `edit(tensors)`: called
    on the tensor dict before writing (bench/shapes.py zeroes output rows). `image_tokens`: the
    vocabulary ends with Gemma 3's image markers (a vision pair, tests/gguf_factory_vision.py)."""
    r = _Rand(seed, fast_random)
    n_vocab = len(vocab("gemma3", image_tokens)["tokens"])
    q_dim, kv_dim = n_head * head_dim, n_head_kv * head_dim
    t: dict[str, np.ndarray] = {"token_embd.weight": r.normal((n_vocab, n_embd), 2.0 / np.sqrt(n_embd))}
    for i in range(n_layer):
        p = f"blk.{i}."
        # stored as the converter writes them: 1 + w (here the effective scale itself)
        t[p + "attn_norm.weight"] = r.norm(n_embd)
        t[p + "attn_q.weight"] = r.weight((q_dim, n_embd), 1.0 / np.sqrt(n_embd))
        t[p + "attn_k.weight"] = r.weight((kv_dim, n_embd), 1.0 / np.sqrt(n_embd))
        t[p + "attn_v.weight"] = r.weight((kv_dim, n_embd), 1.0 / np.sqrt(n_embd))
        t[p + "attn_q_norm.weight"] = r.norm(head_dim, QK_NORM)
        t[p + "attn_k_norm.weight"] = r.norm(head_dim, QK_NORM)
        t[p + "attn_output.weight"] = r.weight((n_embd, q_dim), 1.0 / np.sqrt(q_dim))
        # post-norms set the blocks' weight in the residual stream: ~2x the scaled embedding's
        # std of 2, so the blocks, not the input token's own embedding, decide the next token
        t[p + "post_attention_norm.weight"] = r.norm(n_embd, 3.0)
        t[p + "ffn_norm.weight"] = r.norm(n_embd)
        t[p + "ffn_gate.weight"] = r.weight((n_ff, n_embd), 1.0 / np.sqrt(n_embd))
        t[p + "ffn_up.weight"] = r.weight((n_ff, n_embd), 1.0 / np.sqrt(n_embd))
        t[p + "ffn_down.weight"] = r.weight((n_embd, n_ff), 1.0 / np.sqrt(n_ff))
        t[p + "post_ffw_norm.weight"] = r.norm(n_embd, 3.0)
    t["output_norm.weight"] = r.norm(n_embd)
    if not tie_embeddings:
        t["output.weight"] = _head(r, n_vocab, n_embd, GEMMA3_TURN[1], eot_like)
    if edit is not None:
        edit(t)

    def meta(w):
        w.add_name(name or f"Tiny gemma3 {n_layer}x{n_embd} seed {seed}")
        w.add_context_length(context_length)
        w.add_embedding_length(n_embd)
        w.add_block_count(n_layer)
        w.add_feed_forward_length(n_ff)
        w.add_head_count(n_head)
        w.add_head_count_kv(n_head_kv)
        w.add_layer_norm_rms_eps(1e-6)
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
        w.add_rope_freq_base(float(rope_theta))
        w.add_sliding_window(sliding_window)
        if pattern is not None:
            w.add_sliding_window_pattern(pattern)
        if rope_linear:     # Gemma 3 4B/12B/27B: linear x8 on the global layers
            w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            w.add_rope_scaling_factor(rope_linear)
    return _write(path, "gemma3", t, meta, tensor_type, image_tokens)


def gemma4_layer_types(n_layer: int, pattern: int) -> list[bool]:
    """True = sliding, the last of every `pattern` global (Gemma 4's layout)."""
    return [(i + 1) % pattern != 0 for i in range(n_layer)]


def write_tiny_gemma4(path, *, n_layer=4, n_embd=256, n_head=4, n_head_kv=2, head_dim=64,
                      global_head_dim=128, n_ff=512, sliding_window=32, pattern=2, shared_kv_layers=2,
                      n_embd_per_layer=64, double_wide=True, partial_rotary=0.25, softcap=30.0,
                      context_length=2048, tensor_type="F16", seed=0, rope_theta=1_000_000.0,
                      rope_theta_swa=10_000.0, tie_embeddings=False, eot_like: int | None = None,
                      n_expert=0, n_expert_used=2, n_ff_exp=256, router_std=3.0, k_eq_v=False,
                      n_head_kv_global: int | None = None, name=None, image_tokens: bool = False) -> Path:
    """A tiny Gemma 4 (E2B-like: per-layer embeddings, shared K/V in the last layers, double-wide FFN
    there). With the defaults: layers sliding/global/sliding/global, layers 2 and 3 reuse the K/V of
    layers 0 and 1. `n_expert` > 0: 26B-A4B-like experts in every layer beside the dense FFN (the
    router F32 as the converter leaves it, the gate/up stack fused as ffn_gate_up_exps, gate rows
    first; `router_std` keeps expert choices clear of near-ties). `image_tokens`: the vocabulary ends
    with Gemma 4's image markers (a vision pair, tests/gguf_factory_vision_gemma4v.py)."""
    r = _Rand(seed)
    n_vocab = len(vocab("gemma4", image_tokens)["tokens"])
    swa = gemma4_layer_types(n_layer, pattern)
    first_shared = n_layer - shared_kv_layers
    kv_heads = [n_head_kv if s else (n_head_kv_global or n_head_kv) for s in swa]
    n_ffs = [n_ff * (2 if double_wide and i >= first_shared else 1) for i in range(n_layer)]
    t: dict[str, np.ndarray] = {"token_embd.weight": r.normal((n_vocab, n_embd), 2.0 / np.sqrt(n_embd))}
    n_rot_pairs = int(global_head_dim * partial_rotary / 2)
    t["rope_freqs.weight"] = np.array([1.0] * n_rot_pairs + [1e30] * (global_head_dim // 2 - n_rot_pairs),
                                      dtype=np.float32)
    if n_embd_per_layer:
        t["per_layer_token_embd.weight"] = r.normal((n_vocab, n_layer * n_embd_per_layer), 1.0)
        t["per_layer_model_proj.weight"] = r.normal((n_layer * n_embd_per_layer, n_embd), 1.0 / np.sqrt(n_embd))
        t["per_layer_proj_norm.weight"] = r.norm(n_embd_per_layer)
    for i in range(n_layer):
        p = f"blk.{i}."
        hd = head_dim if swa[i] else global_head_dim
        q_dim, kv_dim = n_head * hd, kv_heads[i] * hd
        t[p + "attn_norm.weight"] = r.norm(n_embd)
        t[p + "attn_q.weight"] = r.normal((q_dim, n_embd), 1.0 / np.sqrt(n_embd))
        # Gemma 4 does not scale queries (scale 1): norms of hd^-1/4 each make q.k/sqrt(hd) as above
        t[p + "attn_q_norm.weight"] = r.norm(hd, (QK_NORM ** 0.5) * hd ** -0.25)
        if i < first_shared:
            t[p + "attn_k.weight"] = r.normal((kv_dim, n_embd), 1.0 / np.sqrt(n_embd))
            if not (k_eq_v and not swa[i]):     # 31B: global layers take V = K (before the norms)
                t[p + "attn_v.weight"] = r.normal((kv_dim, n_embd), 1.0 / np.sqrt(n_embd))
            t[p + "attn_k_norm.weight"] = r.norm(hd, (QK_NORM ** 0.5) * hd ** -0.25)
        t[p + "attn_output.weight"] = r.normal((n_embd, q_dim), 1.0 / np.sqrt(q_dim))
        t[p + "post_attention_norm.weight"] = r.norm(n_embd, 3.0)
        t[p + "ffn_norm.weight"] = r.norm(n_embd)
        t[p + "ffn_gate.weight"] = r.normal((n_ffs[i], n_embd), 1.0 / np.sqrt(n_embd))
        t[p + "ffn_up.weight"] = r.normal((n_ffs[i], n_embd), 1.0 / np.sqrt(n_embd))
        t[p + "ffn_down.weight"] = r.normal((n_embd, n_ffs[i]), 1.0 / np.sqrt(n_ffs[i]))
        t[p + "post_ffw_norm.weight"] = r.norm(n_embd, 3.0)
        if n_embd_per_layer:
            t[p + "inp_gate.weight"] = r.normal((n_embd_per_layer, n_embd), 1.0 / np.sqrt(n_embd))
            t[p + "proj.weight"] = r.normal((n_embd, n_embd_per_layer), 1.0 / np.sqrt(n_embd_per_layer))
            t[p + "post_norm.weight"] = r.norm(n_embd)
        t[p + "layer_output_scale.weight"] = np.array([0.8 + 0.1 * i], dtype=np.float32)
        if n_expert:
            t[p + "ffn_gate_inp.weight"] = r.normal((n_expert, n_embd), router_std)
            t[p + "ffn_gate_inp.scale"] = r.norm(n_embd)
            # numpy (E, out, in) = GGUF [in, out, E], llama.cpp's *_exps layout
            t[p + "ffn_gate_up_exps.weight"] = r.normal((n_expert, 2 * n_ff_exp, n_embd), 1.0 / np.sqrt(n_embd))
            t[p + "ffn_down_exps.weight"] = r.normal((n_expert, n_embd, n_ff_exp), 1.0 / np.sqrt(n_ff_exp))
            t[p + "ffn_down_exps.scale"] = r.norm(n_expert)
            t[p + "pre_ffw_norm_2.weight"] = r.norm(n_embd)
            t[p + "post_ffw_norm_1.weight"] = r.norm(n_embd, 2.0)
            t[p + "post_ffw_norm_2.weight"] = r.norm(n_embd, 2.0)
    t["output_norm.weight"] = r.norm(n_embd)
    if not tie_embeddings:
        t["output.weight"] = _head(r, n_vocab, n_embd, GEMMA4_TURN[1], eot_like)

    def meta(w):
        w.add_name(name or f"Tiny gemma4 {n_layer}x{n_embd} seed {seed}")
        w.add_context_length(context_length)
        w.add_embedding_length(n_embd)
        w.add_block_count(n_layer)
        w.add_feed_forward_length(n_ffs if len(set(n_ffs)) > 1 else n_ff)
        w.add_head_count(n_head)
        w.add_head_count_kv(kv_heads if len(set(kv_heads)) > 1 else n_head_kv)
        w.add_layer_norm_rms_eps(1e-6)
        w.add_rope_freq_base(float(rope_theta))
        w.add_rope_freq_base_swa(float(rope_theta_swa))
        w.add_sliding_window(sliding_window)
        w.add_sliding_window_pattern(swa)
        w.add_shared_kv_layers(shared_kv_layers)
        w.add_embedding_length_per_layer_input(n_embd_per_layer)
        w.add_key_length(global_head_dim)
        w.add_value_length(global_head_dim)
        w.add_key_length_swa(head_dim)
        w.add_value_length_swa(head_dim)
        w.add_rope_dimension_count(global_head_dim)
        w.add_rope_dimension_count_swa(head_dim)
        if softcap:
            w.add_final_logit_softcapping(softcap)
        if n_expert:
            w.add_expert_count(n_expert)
            w.add_expert_used_count(n_expert_used)
            w.add_expert_feed_forward_length(n_ff_exp)
    return _write(path, "gemma4", t, meta, tensor_type, image_tokens)


def _writer(fn):
    def write(path, *, ftype: str = "F16", seed: int = 0, **kw) -> Path:
        path = Path(path)
        if ftype in ("F16", "F32"):
            return fn(path, tensor_type=ftype, seed=seed, **kw)
        src = fn(path.with_suffix(".f16.gguf"), tensor_type="F16", seed=seed, **kw)
        return gguf_factory.quantize_with_llama(src, path, ftype)
    return write


write_gemma3 = _writer(write_tiny_gemma3)
write_gemma4 = _writer(write_tiny_gemma4)
