"""Tiny, real GGUF models for fast tests.

``write_tiny_gguf`` writes a small random-weight model with gguf-py's GGUFWriter,
laid out the way llama.cpp's ``convert_hf_to_gguf.py`` writes real checkpoints,
so llama.cpp (through llama-cpp-python) and our engine both load it:

* ``llama``  SmolLM2/Llama style: RMSNorm, SwiGLU, no biases, the Q/K rows
             permuted like ``LlamaModel.permute`` (GGUF llama uses "normal"
             adjacent-pair RoPE, HF uses rotate-half), optional untied
             ``output.weight``; writes ``llama.vocab_size`` and
             ``llama.rope.dimension_count`` like LlamaModel does.
* ``qwen2``  Q/K/V biases, no permute (NEOX RoPE).
* ``qwen3``  per-head ``attn_q_norm``/``attn_k_norm``, explicit head_dim written as
             ``qwen3.attention.key_length``/``value_length``, no biases.

The tokenizer is a real byte-level BPE ("gpt2" model): 3 control tokens
(``<|endoftext|>`` = 0, ``<|im_start|>`` = 1, ``<|im_end|>`` = 2), the 256 byte
tokens in GPT-2 byte-to-unicode form (ids 3..258, in byte order), then one
token per merge, the merges trained with the ``tokenizers`` BPE trainer on the
small English text below (deterministic, cached in-process).

``tiny_hf_weights`` returns the same weights in Hugging Face layout/naming
(before the llama Q/K permute), for comparisons against HF-layout code such as
mlx-lm.  ``tiny_hf_tokenizer`` returns a ``tokenizers.Tokenizer`` that tokenizes
like llama.cpp does with the chosen pre-tokenizer.
"""

from __future__ import annotations

import ctypes
import functools
import json
import logging
from pathlib import Path

import numpy as np

import gguf

ARCHS = ("llama", "qwen2", "qwen3")

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
TOKEN_TYPE_NORMAL = 1
TOKEN_TYPE_CONTROL = 3
N_MERGES_TARGET = 320  # merges the trainer is asked for (it may stop a little earlier)

# The pre-tokenizer name written per architecture (both are accepted by llama.cpp):
#   "smollm": digits split one by one, then the GPT-2 regex (SmolLM/SmolLM2 GGUFs)
#   "qwen2":  the Qwen2 regex (single digits, letters with one leading non-letter)
DEFAULT_PRE = {"llama": "smollm", "qwen2": "qwen2", "qwen3": "qwen2"}

QWEN2_PRE_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

TRAINING_TEXT = """\
The little boat left the harbor early in the morning, when the sea was still and grey.
Its captain, an old woman named Margaret, had sailed these waters for forty-two years.
She knew every rock, every current and every bird that followed the fishing boats home.
"We'll be back before noon," she told the boy who helped her with the nets. "Don't worry."
The boy nodded. He wasn't worried; he was curious. What would they find today?

On the first day of spring, the children of the village planted a garden behind the school.
They planted beans, carrots, potatoes and three rows of sunflowers. The teacher showed them
how to water the seeds, and how to pull the weeds without hurting the young plants.
By the end of June the sunflowers were taller than the teacher, and the children laughed.

A computer program is a list of instructions. The computer reads the instructions one by one
and does exactly what they say, nothing more and nothing less. If the instructions are wrong,
the program is wrong, even when the computer is working perfectly. Good programmers test
their programs often, write small functions, and read the error messages carefully.
In 1969 people walked on the moon; in 1972 the last of them came home. It's 2024 now,
and a phone in your pocket has more memory than all of those computers together.

The weather today will be cloudy in the north and sunny in the south, with temperatures
between 12 and 18 degrees. There is a chance of rain in the evening, so take an umbrella.
Tomorrow should be warmer: the wind will turn to the west and the clouds will clear.

Hello! How are you? I'm fine, thank you. What's your name? My name is Anna, and I'm from
the city by the river. I like reading books, cooking for my friends and walking in the park.
They're going to the market on Saturday; we'll meet them there at 10 o'clock.
You've been there before, haven't you? I'd like to go again, if there's time.

Once upon a time there was a king who had three daughters. The youngest daughter was the
cleverest of all, and when a dragon came to the kingdom she was the one who found a way
to make peace with it. The dragon, it turned out, only wanted someone to talk to.
The end.
"""

_DEFAULT_NORM_EPS = 1e-5
_QWEN_NORM_EPS = 1e-6


# --------------------------------------------------------------------------- tokenizer


@functools.lru_cache(maxsize=None)
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable unicode character map."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def _hf_pre_tokenizer(pre: str):
    from tokenizers import Regex, pre_tokenizers

    if pre == "qwen2":
        return pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(QWEN2_PRE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    if pre == "smollm":
        return pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ])
    raise ValueError(f"unknown pre-tokenizer {pre!r} (have: qwen2, smollm)")


@functools.lru_cache(maxsize=None)
def _trained_vocab() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(tokens in id order, merges "a b" in rank order) -- trained once per process."""
    from tokenizers import Tokenizer, models, trainers

    tok = Tokenizer(models.BPE())
    # The trainer's pre-tokenization only decides which merges are learnt; the
    # Qwen2 regex is used for all architectures so the vocabulary is the same.
    tok.pre_tokenizer = _hf_pre_tokenizer("qwen2")
    byte_chars = [bytes_to_unicode()[b] for b in range(256)]
    trainer = trainers.BpeTrainer(
        vocab_size=256 + N_MERGES_TARGET,
        min_frequency=1,
        show_progress=False,
        initial_alphabet=byte_chars,
        special_tokens=[],
    )
    tok.train_from_iterator(TRAINING_TEXT.splitlines(keepends=True), trainer=trainer)
    raw = json.loads(tok.to_str())["model"]["merges"]
    merges = [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in raw]

    tokens = list(SPECIAL_TOKENS) + byte_chars
    seen = set(tokens)
    for a, b in merges:
        t = a + b
        if t in seen:  # cannot happen with the BPE trainer; keep ids unique anyway
            raise AssertionError(f"merge {a!r} {b!r} repeats token {t!r}")
        seen.add(t)
        tokens.append(t)
    return tuple(tokens), tuple(f"{a} {b}" for a, b in merges)


def tiny_tokenizer_fields(arch: str = "llama", pre: str | None = None) -> dict:
    """The ``tokenizer.*`` metadata write_tiny_gguf writes (keys -> python values)."""
    tokens, merges = _trained_vocab()
    token_types = [TOKEN_TYPE_CONTROL if t in SPECIAL_TOKENS else TOKEN_TYPE_NORMAL for t in tokens]
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": pre or DEFAULT_PRE[arch],
        "tokenizer.ggml.tokens": list(tokens),
        "tokenizer.ggml.token_type": token_types,
        "tokenizer.ggml.merges": list(merges),
        "tokenizer.ggml.bos_token_id": SPECIAL_TOKENS.index("<|endoftext|>"),
        "tokenizer.ggml.eos_token_id": SPECIAL_TOKENS.index("<|im_end|>"),
        "tokenizer.ggml.padding_token_id": SPECIAL_TOKENS.index("<|endoftext|>"),
        "tokenizer.ggml.add_bos_token": False,
        "tokenizer.chat_template": CHAT_TEMPLATE,
    }


def tiny_vocab_size() -> int:
    return len(_trained_vocab()[0])


def tiny_hf_tokenizer(pre: str = "smollm"):
    """A ``tokenizers.Tokenizer`` equivalent to the GGUF vocabulary with pre-tokenizer ``pre``."""
    from tokenizers import AddedToken, Tokenizer, decoders, models

    tokens, merges = _trained_vocab()
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[tuple(m.split(" ", 1)) for m in merges]))
    tok.pre_tokenizer = _hf_pre_tokenizer(pre)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    return tok


# --------------------------------------------------------------------------- weights


def _llama_permute(w: np.ndarray, n_head: int, n_head_kv: int | None) -> np.ndarray:
    """convert_hf_to_gguf.py LlamaModel.permute: rotate-half rows -> interleaved pairs."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2)
            .reshape(w.shape))


def tiny_hf_weights(arch: str = "llama", *, n_layer=2, n_embd=64, n_head=4, n_head_kv=2, n_ff=128,
                    head_dim=None, tie_embeddings=True, seed=0, embedding_rows=None) -> dict[str, np.ndarray]:
    """The random weights of the tiny model, in HF naming and layout (float32)."""
    if arch not in ARCHS:
        raise ValueError(f"arch {arch!r} not in {ARCHS}")
    if head_dim is None:
        if n_embd % n_head:
            raise ValueError(f"n_embd {n_embd} is not a multiple of n_head {n_head}")
        head_dim = n_embd // n_head
    if head_dim % 2:
        raise ValueError(f"head_dim {head_dim} must be even for RoPE")
    if n_head % n_head_kv:
        raise ValueError(f"n_head {n_head} is not a multiple of n_head_kv {n_head_kv}")
    n_vocab = embedding_rows or tiny_vocab_size()
    rng = np.random.default_rng(seed)

    def normal(shape, std):
        return (rng.standard_normal(shape, dtype=np.float32) * np.float32(std)).astype(np.float32)

    def norm_w(n):
        return (1.0 + normal((n,), 0.1)).astype(np.float32)

    q_dim, kv_dim = n_head * head_dim, n_head_kv * head_dim
    w: dict[str, np.ndarray] = {}
    # Scales: logits = norm(h) @ E^T have std ~ sqrt(n_embd) * std_E = 2 whatever the width;
    # q/k/gate/up keep unit-variance activations; o_proj/down_proj are strong (3 and 4 /
    # sqrt(fan_in)) so the blocks dominate the residual stream -- with tied embeddings
    # a weak block lets the input token's own embedding win and greedy repeats it.
    w["model.embed_tokens.weight"] = normal((n_vocab, n_embd), 2.0 / np.sqrt(n_embd))
    for i in range(n_layer):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = norm_w(n_embd)
        w[p + "self_attn.q_proj.weight"] = normal((q_dim, n_embd), 1.0 / np.sqrt(n_embd))
        w[p + "self_attn.k_proj.weight"] = normal((kv_dim, n_embd), 1.0 / np.sqrt(n_embd))
        w[p + "self_attn.v_proj.weight"] = normal((kv_dim, n_embd), 1.0 / np.sqrt(n_embd))
        if arch == "qwen2":
            w[p + "self_attn.q_proj.bias"] = normal((q_dim,), 0.2)
            w[p + "self_attn.k_proj.bias"] = normal((kv_dim,), 0.2)
            w[p + "self_attn.v_proj.bias"] = normal((kv_dim,), 0.2)
        if arch == "qwen3":
            w[p + "self_attn.q_norm.weight"] = norm_w(head_dim)
            w[p + "self_attn.k_norm.weight"] = norm_w(head_dim)
        w[p + "self_attn.o_proj.weight"] = normal((n_embd, q_dim), 3.0 / np.sqrt(q_dim))
        w[p + "post_attention_layernorm.weight"] = norm_w(n_embd)
        w[p + "mlp.gate_proj.weight"] = normal((n_ff, n_embd), 1.0 / np.sqrt(n_embd))
        w[p + "mlp.up_proj.weight"] = normal((n_ff, n_embd), 1.0 / np.sqrt(n_embd))
        w[p + "mlp.down_proj.weight"] = normal((n_embd, n_ff), 4.0 / np.sqrt(n_ff))
    w["model.norm.weight"] = norm_w(n_embd)
    if not tie_embeddings:
        w["lm_head.weight"] = normal((n_vocab, n_embd), 2.0 / np.sqrt(n_embd))
    return w


_HF_TO_GGUF_LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def gguf_tensor_name(hf_name: str) -> str:
    if hf_name == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf_name == "model.norm.weight":
        return "output_norm.weight"
    if hf_name == "lm_head.weight":
        return "output.weight"
    parts = hf_name.split(".", 3)  # model, layers, i, rest
    if parts[:2] == ["model", "layers"] and parts[3] in _HF_TO_GGUF_LAYER:
        return f"blk.{parts[2]}.{_HF_TO_GGUF_LAYER[parts[3]]}"
    raise KeyError(hf_name)


# --------------------------------------------------------------------------- writer

_TENSOR_TYPES = {
    "F32": (gguf.GGMLQuantizationType.F32, gguf.LlamaFileType.ALL_F32),
    "F16": (gguf.GGMLQuantizationType.F16, gguf.LlamaFileType.MOSTLY_F16),
    "BF16": (gguf.GGMLQuantizationType.BF16, gguf.LlamaFileType.MOSTLY_BF16),
    "Q8_0": (gguf.GGMLQuantizationType.Q8_0, gguf.LlamaFileType.MOSTLY_Q8_0),
}


def _encode(arr: np.ndarray, qtype: gguf.GGMLQuantizationType):
    """(data, raw_dtype) the way convert_hf_to_gguf stores a tensor of the chosen file type:
    1-D tensors (norms, biases) stay F32, 2-D weights take the file type."""
    if arr.ndim == 1 or qtype == gguf.GGMLQuantizationType.F32:
        return arr.astype(np.float32), None
    if qtype == gguf.GGMLQuantizationType.F16:
        return arr.astype(np.float16), None
    if qtype == gguf.GGMLQuantizationType.Q8_0 and arr.shape[-1] % 32:
        return arr.astype(np.float16), None  # convert's fallback for non-block-aligned rows
    return gguf.quants.quantize(arr, qtype), qtype


def _add_tokenizer(w, tok: dict) -> None:
    """The tokenizer fields of `tiny_tokenizer_fields` into a GGUFWriter."""
    w.add_tokenizer_model(tok["tokenizer.ggml.model"])
    w.add_tokenizer_pre(tok["tokenizer.ggml.pre"])
    w.add_token_list(tok["tokenizer.ggml.tokens"])
    w.add_token_types(tok["tokenizer.ggml.token_type"])
    w.add_token_merges(tok["tokenizer.ggml.merges"])
    w.add_bos_token_id(tok["tokenizer.ggml.bos_token_id"])
    w.add_eos_token_id(tok["tokenizer.ggml.eos_token_id"])
    w.add_pad_token_id(tok["tokenizer.ggml.padding_token_id"])
    w.add_add_bos_token(tok["tokenizer.ggml.add_bos_token"])
    w.add_chat_template(tok["tokenizer.chat_template"])


def write_tiny_gguf(path, arch="llama", *, n_layer=2, n_embd=64, n_head=4, n_head_kv=2, n_ff=128,
                    head_dim=None, context_length=2048, tensor_type="F32", tie_embeddings=True,
                    seed=0, rope_theta=10000.0, tokenizer_pre=None, name=None, embedding_rows=None) -> Path:
    """Write a tiny random-weight GGUF model and return its path.

    ``embedding_rows``: the embedding's (and ``llama.vocab_size``'s) rows, when not the tokenizer's
    token count (a hostile file's: fewer rows than tokens).

    ``tensor_type`` is one of F32, F16, BF16, Q8_0 (others: quantize_with_llama).
    ``tokenizer_pre`` overrides the tokenizer.ggml.pre name (default per arch,
    see DEFAULT_PRE).
    """
    if tensor_type not in _TENSOR_TYPES:
        raise ValueError(f"tensor_type {tensor_type!r} not in {sorted(_TENSOR_TYPES)}; "
                         "use quantize_with_llama for other types")
    explicit_head_dim = head_dim is not None or arch == "qwen3"
    hf = tiny_hf_weights(arch, n_layer=n_layer, n_embd=n_embd, n_head=n_head, n_head_kv=n_head_kv,
                         n_ff=n_ff, head_dim=head_dim, tie_embeddings=tie_embeddings, seed=seed,
                         embedding_rows=embedding_rows)
    if head_dim is None:
        head_dim = n_embd // n_head
    qtype, ftype = _TENSOR_TYPES[tensor_type]
    eps = _DEFAULT_NORM_EPS if arch == "llama" else _QWEN_NORM_EPS
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)

    w = gguf.GGUFWriter(str(path), arch)
    w.add_type(gguf.GGUFType.MODEL)
    w.add_name(name or f"Tiny {arch} {n_layer}x{n_embd} seed {seed}")
    w.add_size_label("tiny")
    w.add_block_count(n_layer)
    w.add_context_length(context_length)
    w.add_embedding_length(n_embd)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head_kv)
    w.add_rope_freq_base(float(rope_theta))
    w.add_layer_norm_rms_eps(eps)
    if explicit_head_dim:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    w.add_file_type(ftype)
    if arch == "llama":
        w.add_vocab_size(embedding_rows or tiny_vocab_size())
        w.add_rope_dimension_count(head_dim)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)

    tok = tiny_tokenizer_fields(arch, pre=tokenizer_pre)
    _add_tokenizer(w, tok)

    for hf_name, arr in hf.items():
        if arch == "llama":
            if hf_name.endswith("self_attn.q_proj.weight"):
                arr = _llama_permute(arr, n_head, n_head)
            elif hf_name.endswith("self_attn.k_proj.weight"):
                arr = _llama_permute(arr, n_head, n_head_kv)
        data, raw_dtype = _encode(arr, qtype)
        if raw_dtype is None:
            w.add_tensor(gguf_tensor_name(hf_name), data)
        else:
            w.add_tensor(gguf_tensor_name(hf_name), data, raw_dtype=raw_dtype)

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# --------------------------------------------------------------------------- llama.cpp

QUANT_FTYPES = ("F16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K_M", "Q5_K_M", "Q6_K", "Q3_K_M", "Q2_K",
                "MXFP4_MOE",   # MXFP4_MOE: gpt-oss experts in MXFP4 (tests/gguf_factory_gpt_oss.py)
                # the IQ and ternary types; IQ2_* and IQ1_* need an importance matrix (imatrix=)
                "IQ4_NL", "IQ4_XS", "IQ3_XXS", "IQ3_S", "IQ3_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ2_M",
                "IQ1_S", "IQ1_M", "TQ1_0", "TQ2_0")

_LLAMA_FTYPE_NAMES = {"Q6_K": "LLAMA_FTYPE_MOSTLY_Q6_K", "Q2_K": "LLAMA_FTYPE_MOSTLY_Q2_K"}


def _require_llama_cpp():
    try:
        import llama_cpp
    except ImportError as e:
        raise ImportError(
            "llama-cpp-python is not installed (the llama.cpp oracle; pip install 'strata[oracle]')"
        ) from e
    return llama_cpp


def quantize_with_llama(src, dst, ftype: str, *, imatrix: dict | None = None, pure: bool = False) -> Path:
    """Quantize ``src`` to ``dst`` with llama.cpp, in the oracle's worker process (tests/llama_oracle.py),
    so a native crash in llama.cpp fails the caller's test instead of killing pytest. ``imatrix``: tensor
    name -> importance per input column (float32, as llama-imatrix writes); ``pure``: every 2-D tensor
    in ``ftype``'s type (no per-tensor mix)."""
    if ftype not in QUANT_FTYPES:
        raise ValueError(f"ftype {ftype!r} not in {QUANT_FTYPES}")
    import llama_oracle
    if not llama_oracle.available():
        raise ImportError("llama-cpp-python is not installed (the llama.cpp oracle; pip install 'strata[oracle]')")
    Path(dst).parent.mkdir(parents=True, exist_ok=True)
    llama_oracle.quantize(src, dst, ftype, imatrix=imatrix, pure=pure)
    return Path(dst)


def _imatrix_entries(llama_cpp, imatrix: dict):
    """llama.cpp's importance-matrix array (name, data, size) ending in a NULL name, and the buffers it
    points into (kept alive by the caller)."""
    keep = [np.ascontiguousarray(v, dtype=np.float32) for v in imatrix.values()]
    entries = (llama_cpp.llama_model_imatrix_data * (len(keep) + 1))()
    for e, name, buf in zip(entries, imatrix, keep):
        e.name = name.encode()
        e.data = buf.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
        e.size = buf.size
    return entries, keep


def quantize_with_llama_in_process(src, dst, ftype: str, *, verbose: bool = False, imatrix: dict | None = None,
                                   pure: bool = False) -> Path:
    """Quantize ``src`` to ``dst`` with llama.cpp's llama_model_quantize (allow_requantize on).

    Raises ImportError (message suitable for pytest.skip) without llama-cpp-python,
    ValueError for an unknown type, RuntimeError when llama.cpp fails.
    Note: K-quants need rows (n_embd, n_ff, n_head*head_dim) that are multiples
    of 256; otherwise llama.cpp silently falls back to a legacy type per tensor.
    """
    if ftype not in QUANT_FTYPES:
        raise ValueError(f"ftype {ftype!r} not in {QUANT_FTYPES}")
    llama_cpp = _require_llama_cpp()
    const = _LLAMA_FTYPE_NAMES.get(ftype, f"LLAMA_FTYPE_MOSTLY_{ftype}")
    ftype_value = getattr(llama_cpp, const)
    src, dst = Path(src), Path(dst)
    dst.parent.mkdir(parents=True, exist_ok=True)
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftype_value
    params.allow_requantize = True
    params.nthread = 2
    params.pure = pure
    if imatrix:
        entries, _keep = _imatrix_entries(llama_cpp, imatrix)
        params.imatrix = ctypes.cast(entries, ctypes.POINTER(llama_cpp.llama_model_imatrix_data))
    # llama-cpp-python routes llama.cpp's log through this logger; quantize logs every tensor.
    log = logging.getLogger("llama-cpp-python")
    old_level = log.level
    if not verbose:
        log.setLevel(logging.ERROR)
    try:
        rc = llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params))
    finally:
        log.setLevel(old_level)
    if rc != 0 or not dst.exists():
        raise RuntimeError(f"llama_model_quantize({src} -> {dst}, {ftype}) failed with {rc}")
    return dst


# --------------------------------------------------------------------------- mixture of experts

MOE_ARCHS = ("qwen3moe", "qwen2moe", "mixtral")  # "mixtral" = GGUF arch "llama" with llama.expert_count


def write_tiny_moe_gguf(path, arch="qwen3moe", *, n_layer=2, n_embd=256, n_head=4, n_head_kv=2,
                        n_expert=4, n_expert_used=2, n_ff_exp=256, n_ff_shexp=512, head_dim=None,
                        context_length=2048, tensor_type="F16", tie_embeddings=None, seed=0,
                        rope_theta=10000.0, router_std=3.0, name=None) -> Path:
    """A tiny random-weight mixture-of-experts GGUF, laid out as convert_hf_to_gguf.py writes one.

    * ``qwen3moe``  Qwen3-30B-A3B style: qwen3 attention (q/k norms), every block a MoE of
                    ``n_expert`` SwiGLU experts, top-``n_expert_used``, weights renormalised.
    * ``qwen2moe``  Qwen1.5/Qwen2-57B-A14B style: qwen2 attention (Q/K/V biases), MoE plus a shared
                    expert (``ffn_*_shexp``) gated by sigmoid(``ffn_gate_inp_shexp`` . x); untied
                    ``output.weight`` (llama.cpp requires it for qwen2moe).
    * ``mixtral``   GGUF architecture ``llama`` with ``llama.expert_count``: llama attention (Q/K rows
                    permuted), MoE blocks whose ``feed_forward_length`` is the expert width.

    The stacked expert tensors are ``blk.N.ffn_{gate,up,down}_exps.weight`` of GGUF shape
    [in, out, n_expert], the router ``blk.N.ffn_gate_inp.weight`` [n_embd, n_expert].
    ``router_std`` scales the router logits (std ~ router_std): well separated routing keeps
    near-ties in expert choice (which flip on rounding) rare. Quantize with quantize_with_llama.
    """
    if arch not in MOE_ARCHS:
        raise ValueError(f"arch {arch!r} not in {MOE_ARCHS}")
    if tensor_type not in _TENSOR_TYPES:
        raise ValueError(f"tensor_type {tensor_type!r} not in {sorted(_TENSOR_TYPES)}")
    gguf_arch = "llama" if arch == "mixtral" else arch
    if head_dim is None:
        head_dim = n_embd // n_head
    if tie_embeddings is None:
        tie_embeddings = arch != "qwen2moe"
    rng = np.random.default_rng(seed)

    def normal(shape, std):
        return (rng.standard_normal(shape, dtype=np.float32) * np.float32(std)).astype(np.float32)

    def norm_w(n):
        return (1.0 + normal((n,), 0.1)).astype(np.float32)

    n_vocab = tiny_vocab_size()
    q_dim, kv_dim = n_head * head_dim, n_head_kv * head_dim
    t: dict[str, np.ndarray] = {"token_embd.weight": normal((n_vocab, n_embd), 2.0 / np.sqrt(n_embd))}
    for i in range(n_layer):
        p = f"blk.{i}."
        t[p + "attn_norm.weight"] = norm_w(n_embd)
        q = normal((q_dim, n_embd), 1.0 / np.sqrt(n_embd))
        k = normal((kv_dim, n_embd), 1.0 / np.sqrt(n_embd))
        if arch == "mixtral":
            q, k = _llama_permute(q, n_head, n_head), _llama_permute(k, n_head, n_head_kv)
        t[p + "attn_q.weight"], t[p + "attn_k.weight"] = q, k
        t[p + "attn_v.weight"] = normal((kv_dim, n_embd), 1.0 / np.sqrt(n_embd))
        if arch == "qwen2moe":
            t[p + "attn_q.bias"] = normal((q_dim,), 0.2)
            t[p + "attn_k.bias"] = normal((kv_dim,), 0.2)
            t[p + "attn_v.bias"] = normal((kv_dim,), 0.2)
        if arch == "qwen3moe":
            t[p + "attn_q_norm.weight"] = norm_w(head_dim)
            t[p + "attn_k_norm.weight"] = norm_w(head_dim)
        t[p + "attn_output.weight"] = normal((n_embd, q_dim), 3.0 / np.sqrt(q_dim))
        t[p + "ffn_norm.weight"] = norm_w(n_embd)
        t[p + "ffn_gate_inp.weight"] = normal((n_expert, n_embd), router_std / np.sqrt(n_embd))
        # numpy (E, out, in) -> GGUF shape [in, out, E], the layout of llama.cpp's *_exps tensors
        t[p + "ffn_gate_exps.weight"] = normal((n_expert, n_ff_exp, n_embd), 1.0 / np.sqrt(n_embd))
        t[p + "ffn_up_exps.weight"] = normal((n_expert, n_ff_exp, n_embd), 1.0 / np.sqrt(n_embd))
        t[p + "ffn_down_exps.weight"] = normal((n_expert, n_embd, n_ff_exp), 4.0 / np.sqrt(n_ff_exp))
        if arch == "qwen2moe":
            t[p + "ffn_gate_inp_shexp.weight"] = normal((n_embd,), 1.0 / np.sqrt(n_embd))
            t[p + "ffn_gate_shexp.weight"] = normal((n_ff_shexp, n_embd), 1.0 / np.sqrt(n_embd))
            t[p + "ffn_up_shexp.weight"] = normal((n_ff_shexp, n_embd), 1.0 / np.sqrt(n_embd))
            t[p + "ffn_down_shexp.weight"] = normal((n_embd, n_ff_shexp), 3.0 / np.sqrt(n_ff_shexp))
    t["output_norm.weight"] = norm_w(n_embd)
    if not tie_embeddings:
        t["output.weight"] = normal((n_vocab, n_embd), 2.0 / np.sqrt(n_embd))

    qtype, ftype = _TENSOR_TYPES[tensor_type]
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    w = gguf.GGUFWriter(str(path), gguf_arch)
    w.add_type(gguf.GGUFType.MODEL)
    w.add_name(name or f"Tiny {arch} {n_layer}x{n_embd} {n_expert}x{n_ff_exp} seed {seed}")
    w.add_size_label("tiny")
    w.add_block_count(n_layer)
    w.add_context_length(context_length)
    w.add_embedding_length(n_embd)
    # convert_hf_to_gguf writes the dense width here; Mixtral's is the expert width
    w.add_feed_forward_length(n_ff_exp if arch == "mixtral" else 4 * n_embd)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head_kv)
    w.add_rope_freq_base(float(rope_theta))
    w.add_layer_norm_rms_eps(_DEFAULT_NORM_EPS if arch == "mixtral" else _QWEN_NORM_EPS)
    w.add_expert_count(n_expert)
    w.add_expert_used_count(n_expert_used)
    if arch != "mixtral":
        w.add_expert_feed_forward_length(n_ff_exp)
    if arch == "qwen2moe":
        w.add_expert_shared_feed_forward_length(n_ff_shexp)
    if arch == "qwen3moe":
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    if arch == "mixtral":
        w.add_vocab_size(n_vocab)
        w.add_rope_dimension_count(head_dim)
    w.add_file_type(ftype)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)

    tok = tiny_tokenizer_fields("llama" if arch == "mixtral" else "qwen2")
    _add_tokenizer(w, tok)

    # convert_hf_to_gguf keeps the router in F32 (like the norms); llama.cpp's quantizer does too
    write_tensors_and_close(w, t, qtype, f32_always=("ffn_gate_inp.weight",))
    return path


def write_tensors_and_close(w, tensors: dict, qtype, f32_always: tuple[str, ...] = ()) -> None:
    """Add `tensors` (GGUF name -> array) to writer `w` in `qtype` (names ending in `f32_always` as F32),
    then write the file and close it: every factory's last step."""
    for gname, arr in tensors.items():
        if f32_always and gname.endswith(f32_always):
            w.add_tensor(gname, arr.astype(np.float32))
            continue
        data, raw_dtype = _encode(arr, qtype)
        if raw_dtype is None:
            w.add_tensor(gname, data)
        else:
            w.add_tensor(gname, data, raw_dtype=raw_dtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
