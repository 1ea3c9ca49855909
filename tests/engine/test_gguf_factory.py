import numpy as np
import pytest

import gguf
from gguf import GGUFReader

try:  # tests/ is on sys.path (tests/conftest.py puts it there)
    from gguf_factory import (
        DEFAULT_PRE,
        SPECIAL_TOKENS,
        gguf_tensor_name,
        quantize_with_llama,
        tiny_hf_tokenizer,
        tiny_hf_weights,
        tiny_tokenizer_fields,
        tiny_vocab_size,
        write_tiny_gguf,
    )
except ImportError:  # tests imported as a package
    from tests.gguf_factory import (
        DEFAULT_PRE,
        SPECIAL_TOKENS,
        gguf_tensor_name,
        quantize_with_llama,
        tiny_hf_tokenizer,
        tiny_hf_weights,
        tiny_tokenizer_fields,
        tiny_vocab_size,
        write_tiny_gguf,
    )

ARCHS = ["llama", "qwen2", "qwen3"]
MAX_FILE_BYTES = 5 * 1024 * 1024


def _kv(reader: GGUFReader, key: str):
    field = reader.get_field(key)
    assert field is not None, f"missing {key}"
    return field.contents()


def _tensors(reader: GGUFReader):
    return {t.name: t for t in reader.tensors}


def _llama():
    """llama.cpp in the oracle's worker process (a native crash fails one test, not the run)."""
    import llama_oracle
    llama_oracle.require()
    return llama_oracle


@pytest.fixture(scope="module")
def tiny_files(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny")
    return {
        "llama": write_tiny_gguf(d / "llama.gguf", "llama"),
        "llama_untied": write_tiny_gguf(d / "llama_untied.gguf", "llama", tie_embeddings=False, seed=1),
        "qwen2": write_tiny_gguf(d / "qwen2.gguf", "qwen2"),
        "qwen3": write_tiny_gguf(d / "qwen3.gguf", "qwen3", head_dim=32),  # head_dim != n_embd / n_head
    }


# ----------------------------------------------------------------------------- tokenizer


def test_tokenizer_fields():
    tok = tiny_tokenizer_fields()
    tokens = tok["tokenizer.ggml.tokens"]
    assert tok["tokenizer.ggml.model"] == "gpt2"
    assert len(tokens) == tiny_vocab_size() == len(set(tokens))
    assert 250 <= len(tok["tokenizer.ggml.merges"]) <= 400
    assert tokens[:3] == list(SPECIAL_TOKENS) and tokens[0] == "<|endoftext|>"
    assert tok["tokenizer.ggml.eos_token_id"] == tokens.index("<|im_end|>")
    assert tok["tokenizer.ggml.add_bos_token"] is False
    types = tok["tokenizer.ggml.token_type"]
    assert types[:3] == [3, 3, 3] and set(types[3:]) == {1}
    # 256 byte tokens in GPT-2 byte-to-unicode form: Ġ = space, Ċ = newline.
    assert tokens[3 + 32] == "Ġ" and tokens[3 + 10] == "Ċ" and tokens[3 + ord("A")] == "A"
    # Every merge's parts and result are tokens.
    vocab = set(tokens)
    for m in tok["tokenizer.ggml.merges"]:
        a, b = m.split(" ")
        assert a in vocab and b in vocab and a + b in vocab
    assert "<|im_start|>" in tok["tokenizer.chat_template"]
    assert tiny_tokenizer_fields("qwen3")["tokenizer.ggml.pre"] == "qwen2"
    assert tiny_tokenizer_fields("llama")["tokenizer.ggml.pre"] == "smollm"


def test_hf_tokenizer_roundtrip():
    for pre in ("smollm", "qwen2"):
        t = tiny_hf_tokenizer(pre)
        text = "<|im_start|>user\nThe children planted 42 sunflowers, didn't they?<|im_end|>\n"
        ids = t.encode(text).ids
        assert ids[0] == 1 and 2 in ids
        assert len(ids) < len(text.encode()) * 0.8  # merges do something
        assert t.decode(ids, skip_special_tokens=False) == text


# ----------------------------------------------------------------------------- files


@pytest.mark.parametrize("arch", ARCHS)
def test_reads_back_with_gguf_reader(tiny_files, arch):
    path = tiny_files[arch]
    assert path.stat().st_size < MAX_FILE_BYTES
    r = GGUFReader(path)
    n_vocab = tiny_vocab_size()
    head_dim = 32 if arch == "qwen3" else 16
    assert _kv(r, "general.architecture") == arch
    assert _kv(r, "general.file_type") == 0
    assert _kv(r, "general.name")
    assert _kv(r, f"{arch}.block_count") == 2
    assert _kv(r, f"{arch}.embedding_length") == 64
    assert _kv(r, f"{arch}.feed_forward_length") == 128
    assert _kv(r, f"{arch}.attention.head_count") == 4
    assert _kv(r, f"{arch}.attention.head_count_kv") == 2
    assert _kv(r, f"{arch}.context_length") == 2048
    assert _kv(r, f"{arch}.rope.freq_base") == pytest.approx(10000.0)
    assert 0 < _kv(r, f"{arch}.attention.layer_norm_rms_epsilon") < 1e-4
    if arch == "llama":
        assert _kv(r, "llama.rope.dimension_count") == head_dim
        assert _kv(r, "llama.vocab_size") == n_vocab
    if arch == "qwen3":
        assert _kv(r, "qwen3.attention.key_length") == head_dim
        assert _kv(r, "qwen3.attention.value_length") == head_dim
    for key, value in tiny_tokenizer_fields(arch).items():
        assert _kv(r, key) == value, key

    t = _tensors(r)
    # GGUF shapes are ne[] order: (in, out) for weights.
    assert list(t["token_embd.weight"].shape) == [64, n_vocab]
    assert list(t["output_norm.weight"].shape) == [64]
    assert "output.weight" not in t  # tied
    for i in range(2):
        b = f"blk.{i}."
        assert list(t[b + "attn_norm.weight"].shape) == [64]
        assert list(t[b + "attn_q.weight"].shape) == [64, 4 * head_dim]
        assert list(t[b + "attn_k.weight"].shape) == [64, 2 * head_dim]
        assert list(t[b + "attn_v.weight"].shape) == [64, 2 * head_dim]
        assert list(t[b + "attn_output.weight"].shape) == [4 * head_dim, 64]
        assert list(t[b + "ffn_norm.weight"].shape) == [64]
        assert list(t[b + "ffn_gate.weight"].shape) == [64, 128]
        assert list(t[b + "ffn_up.weight"].shape) == [64, 128]
        assert list(t[b + "ffn_down.weight"].shape) == [128, 64]
        assert (b + "attn_q.bias" in t) == (arch == "qwen2")
        assert (b + "attn_q_norm.weight" in t) == (arch == "qwen3")
        if arch == "qwen2":
            assert list(t[b + "attn_k.bias"].shape) == [2 * head_dim]
            assert list(t[b + "attn_v.bias"].shape) == [2 * head_dim]
        if arch == "qwen3":
            assert list(t[b + "attn_q_norm.weight"].shape) == [head_dim]
            assert list(t[b + "attn_k_norm.weight"].shape) == [head_dim]
    assert len(t) == 2 + 2 * (9 + (3 if arch == "qwen2" else 2 if arch == "qwen3" else 0))
    assert all(x.tensor_type == gguf.GGMLQuantizationType.F32 for x in t.values())


def test_untied_output_and_llama_permute(tiny_files):
    r = GGUFReader(tiny_files["llama_untied"])
    t = _tensors(r)
    assert list(t["output.weight"].shape) == [64, tiny_vocab_size()]
    hf = tiny_hf_weights("llama", tie_embeddings=False, seed=1)
    assert np.array_equal(np.asarray(t["output.weight"].data), hf["lm_head.weight"])
    # V and the MLP are stored as is; Q and K are permuted (rows: rotate-half -> interleaved).
    v = np.asarray(t["blk.0.attn_v.weight"].data)
    assert np.array_equal(v, hf["model.layers.0.self_attn.v_proj.weight"])
    q = np.asarray(t["blk.0.attn_q.weight"].data)
    q_hf = hf["model.layers.0.self_attn.q_proj.weight"]
    assert not np.array_equal(q, q_hf)
    hd = 16
    # Head 0: GGUF row 2j is HF row j, GGUF row 2j+1 is HF row j + hd/2.
    assert np.array_equal(q[0:hd:2], q_hf[0:hd // 2]) and np.array_equal(q[1:hd:2], q_hf[hd // 2:hd])
    k = np.asarray(t["blk.1.attn_k.weight"].data)
    k_hf = hf["model.layers.1.self_attn.k_proj.weight"]
    assert np.array_equal(k[hd:2 * hd:2], k_hf[hd:hd + hd // 2])
    # Qwen2 is not permuted.
    t2 = _tensors(GGUFReader(tiny_files["qwen2"]))
    hf2 = tiny_hf_weights("qwen2")
    assert np.array_equal(np.asarray(t2["blk.0.attn_q.weight"].data), hf2["model.layers.0.self_attn.q_proj.weight"])
    assert np.array_equal(np.asarray(t2["blk.0.attn_q.bias"].data), hf2["model.layers.0.self_attn.q_proj.bias"])


def test_deterministic_and_seeded(tmp_path):
    a = write_tiny_gguf(tmp_path / "a.gguf", "qwen3", seed=3)
    b = write_tiny_gguf(tmp_path / "b.gguf", "qwen3", seed=3)
    c = write_tiny_gguf(tmp_path / "c.gguf", "qwen3", seed=4)
    assert a.read_bytes() == b.read_bytes()
    assert a.read_bytes() != c.read_bytes()


@pytest.mark.parametrize("tensor_type, qtype, ftype", [
    ("F16", gguf.GGMLQuantizationType.F16, 1),
    ("BF16", gguf.GGMLQuantizationType.BF16, 32),
    ("Q8_0", gguf.GGMLQuantizationType.Q8_0, 7),
])
def test_other_tensor_types(tmp_path, tensor_type, qtype, ftype):
    p = write_tiny_gguf(tmp_path / "m.gguf", "qwen2", tensor_type=tensor_type)
    r = GGUFReader(p)
    assert _kv(r, "general.file_type") == ftype
    t = _tensors(r)
    assert t["blk.0.attn_q.weight"].tensor_type == qtype
    assert t["token_embd.weight"].tensor_type == qtype
    assert t["blk.0.attn_norm.weight"].tensor_type == gguf.GGMLQuantizationType.F32
    assert t["blk.0.attn_q.bias"].tensor_type == gguf.GGMLQuantizationType.F32


def test_names_and_bad_args(tmp_path):
    assert gguf_tensor_name("model.layers.3.mlp.down_proj.weight") == "blk.3.ffn_down.weight"
    with pytest.raises(ValueError):
        write_tiny_gguf(tmp_path / "x.gguf", "gemma")
    with pytest.raises(ValueError):
        write_tiny_gguf(tmp_path / "x.gguf", "llama", tensor_type="Q4_K_M")


# ----------------------------------------------------------------------------- llama.cpp


@pytest.mark.oracle
@pytest.mark.parametrize("arch", ["llama", "llama_untied", "qwen2", "qwen3"])
def test_loads_in_llama_cpp(tiny_files, arch):
    llama_cpp = _llama()
    llm = llama_cpp.Llama(model_path=str(tiny_files[arch]), n_ctx=64, n_threads=2, n_batch=64,
                          logits_all=True, verbose=False)
    try:
        assert llm.n_vocab() == tiny_vocab_size()
        toks = llm.tokenize(b"Hello, world!", add_bos=False, special=False)
        llm.eval(toks)
        logits = np.array(llm.eval_logits)
        assert logits.shape == (len(toks), tiny_vocab_size())
        assert np.isfinite(logits).all()
        assert logits.std() > 0.1  # not degenerate
        # Greedy continuation is deterministic and uses more than one token.
        out = llama_cpp.greedy(llm, toks, 16)
        assert len(out) == 16 and len(set(out)) > 2, out
    finally:
        llm.close()


def _reference_logits(w, ids, arch, *, n_layer=2, n_head=4, n_head_kv=2, head_dim=16, theta=10000.0):
    """Plain numpy forward pass over the HF-layout weights (rotate-half RoPE)."""
    eps = 1e-5 if arch == "llama" else 1e-6

    def rms(x, g):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * g

    def rope(x, pos):
        half = head_dim // 2
        ang = pos[:, None] * theta ** (-np.arange(0, head_dim, 2) / head_dim)[None]
        c, s = np.cos(ang)[:, None], np.sin(ang)[:, None]
        x1, x2 = x[..., :half], x[..., half:]
        return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], -1)

    w = {k: v.astype(np.float64) for k, v in w.items()}
    T = len(ids)
    pos = np.arange(T, dtype=np.float64)
    x = w["model.embed_tokens.weight"][ids]
    for i in range(n_layer):
        p = f"model.layers.{i}."
        h = rms(x, w[p + "input_layernorm.weight"])
        q, k, v = (h @ w[p + f"self_attn.{n}_proj.weight"].T for n in "qkv")
        if arch == "qwen2":
            q, k, v = (a + w[p + f"self_attn.{n}_proj.bias"] for a, n in zip((q, k, v), "qkv"))
        q, k, v = q.reshape(T, n_head, head_dim), k.reshape(T, n_head_kv, head_dim), v.reshape(T, n_head_kv, head_dim)
        if arch == "qwen3":
            q, k = rms(q, w[p + "self_attn.q_norm.weight"]), rms(k, w[p + "self_attn.k_norm.weight"])
        q, k = rope(q, pos), rope(k, pos)
        k, v = np.repeat(k, n_head // n_head_kv, 1), np.repeat(v, n_head // n_head_kv, 1)
        s = np.einsum("thd,shd->hts", q, k) / np.sqrt(head_dim) + np.triu(np.full((T, T), -np.inf), 1)
        a = np.exp(s - s.max(-1, keepdims=True))
        a /= a.sum(-1, keepdims=True)
        x = x + np.einsum("hts,shd->thd", a, v).reshape(T, -1) @ w[p + "self_attn.o_proj.weight"].T
        h = rms(x, w[p + "post_attention_layernorm.weight"])
        g, u = h @ w[p + "mlp.gate_proj.weight"].T, h @ w[p + "mlp.up_proj.weight"].T
        x = x + (g / (1 + np.exp(-g)) * u) @ w[p + "mlp.down_proj.weight"].T
    x = rms(x, w["model.norm.weight"])
    return x @ w.get("lm_head.weight", w["model.embed_tokens.weight"]).T


@pytest.mark.oracle
@pytest.mark.parametrize("arch", ["llama", "llama_untied", "qwen2", "qwen3"])
def test_llama_cpp_matches_hf_layout_reference(tiny_files, arch):
    """The layout (llama Q/K permute, biases, q/k norms, head_dim) means what HF means."""
    llama_cpp = _llama()
    base = arch.split("_")[0]
    head_dim = 32 if base == "qwen3" else 16
    hf = tiny_hf_weights(base, head_dim=32 if base == "qwen3" else None,
                         tie_embeddings=arch != "llama_untied", seed=1 if arch == "llama_untied" else 0)
    llm = llama_cpp.Llama(model_path=str(tiny_files[arch]), n_ctx=64, n_threads=2, logits_all=True, verbose=False)
    try:
        ids = llm.tokenize(b"Once upon a time, 3 dragons talked.", add_bos=False)
        llm.eval(ids)
        got = np.array(llm.eval_logits)
    finally:
        llm.close()
    want = _reference_logits(hf, ids, base, head_dim=head_dim)
    np.testing.assert_allclose(got, want, atol=2e-3 * np.abs(want).max(), rtol=0)
    assert (got.argmax(-1) == want.argmax(-1)).mean() > 0.9


@pytest.mark.oracle
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_llama_cpp_tokenizes_like_hf(tiny_files, arch):
    llama_cpp = _llama()
    pre = DEFAULT_PRE[arch]
    hf = tiny_hf_tokenizer(pre)
    llm = llama_cpp.Llama(model_path=str(tiny_files[arch]), n_ctx=32, vocab_only=True, verbose=False)
    try:
        texts = [
            "Hello, world!",
            "The weather today will be cloudy in the north.\n\nIt's 2024 now; they're 12345 years old.",
            "  leading spaces,\ttabs and trailing   ",
            "<|im_start|>user\nWhat's your name?<|im_end|>\n<|im_start|>assistant\n",
            "naïve café — 東京 😀 don'T I'LL",
        ]
        for text in texts:
            ours = hf.encode(text).ids
            theirs = llm.tokenize(text.encode(), add_bos=False, special=True)
            assert theirs == ours, (text, theirs, ours)
            assert llm.detokenize(theirs, special=True).decode() == text
        assert llm.token_eos() == 2
    finally:
        llm.close()


@pytest.mark.oracle
@pytest.mark.parametrize("ftype", ["Q8_0", "Q4_K_M"])
def test_quantize_with_llama(tmp_path, ftype):
    llama_cpp = _llama()
    src = write_tiny_gguf(tmp_path / "f32.gguf", "llama", n_layer=1, n_embd=256, n_ff=512, n_head=4, n_head_kv=2)
    assert src.stat().st_size < MAX_FILE_BYTES
    dst = quantize_with_llama(src, tmp_path / f"{ftype}.gguf", ftype)
    r = GGUFReader(dst)
    t = _tensors(r)
    expect = gguf.GGMLQuantizationType.Q8_0 if ftype == "Q8_0" else gguf.GGMLQuantizationType.Q4_K
    assert t["blk.0.attn_q.weight"].tensor_type == expect
    assert t["blk.0.attn_norm.weight"].tensor_type == gguf.GGMLQuantizationType.F32
    assert _kv(r, "general.file_type") == (7 if ftype == "Q8_0" else 15)
    assert dst.stat().st_size < src.stat().st_size / 3
    llm = llama_cpp.Llama(model_path=str(dst), n_ctx=32, logits_all=True, verbose=False)
    try:
        toks = llm.tokenize(b"Once upon a time", add_bos=False)
        llm.eval(toks)
        assert np.isfinite(np.array(llm.eval_logits)).all()
    finally:
        llm.close()


def test_quantize_with_llama_rejects_unknown_type(tmp_path):
    with pytest.raises(ValueError):
        quantize_with_llama(tmp_path / "a", tmp_path / "b", "Q9_Z")
