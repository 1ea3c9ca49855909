"""The NextN/MTP head of tiny qwen35 / qwen35moe GGUFs (engine/model/archs/qwen35_mtp.py; issue 36, loading):
the head's logits against a numpy transcription of llama.cpp's graph_mtp on the file's own tensors
(decoded by gguf-py), llama.cpp loading the same file with its extra block, and refusals by name."""
from __future__ import annotations

import functools
from pathlib import Path

import gguf
import mlx.core as mx
import numpy as np
import pytest

from engine.model.archs.qwen35_mtp import load_head
from engine.errors import ModelFileError
from engine.model.gguf_file import open_gguf
from engine.model.model_loader import load_model
from gguf_factory_qwen35 import write_tiny_qwen35_gguf

PROMPT_IDS = [398, 273, 114, 373, 309, 47, 259, 107, 308, 325, 264, 270, 556, 259, 406, 291]


@pytest.fixture(scope="module")
def mdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("mtp")


@functools.lru_cache(maxsize=None)
def _file(d: Path, arch: str) -> Path:
    return write_tiny_qwen35_gguf(d / f"{arch}-mtp.gguf", arch, nextn=1, seed=5)


def _t(g, name) -> np.ndarray:
    t = g.reader.tensors[[x.name for x in g.reader.tensors].index(name)]
    shape = tuple(int(x) for x in reversed(list(t.shape)))
    return gguf.quants.dequantize(np.asarray(t.data), t.tensor_type).astype(np.float64).reshape(shape)


def _rms(x, w, eps=1e-6):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def _silu(x):
    return x / (1.0 + np.exp(-x))


def reference_head(g, hidden: np.ndarray, next_ids: list[int]) -> np.ndarray:
    """llama.cpp's graph_mtp (qwen35 / qwen35moe) in numpy, float64: positions 0..T-1, causal attention
    over the head's own K/V, NEOX RoPE on the first rope.dimension_count dims."""
    arch = g.architecture
    key = lambda s: g.arch_key(s)  # noqa: E731
    n_block, n_head, n_kv = int(key("block_count")), int(key("attention.head_count")), int(key("attention.head_count_kv"))
    hd, n_rot, base = int(key("attention.key_length")), int(key("rope.dimension_count")), float(key("rope.freq_base"))
    p = f"blk.{n_block - 1}."
    E = _t(g, "token_embd.weight")
    T = len(next_ids)
    x = np.concatenate([_rms(E[next_ids], _t(g, p + "nextn.enorm.weight")),
                        _rms(hidden.astype(np.float64), _t(g, p + "nextn.hnorm.weight"))], axis=-1)
    z = x @ _t(g, p + "nextn.eh_proj.weight").T
    a = _rms(z, _t(g, p + "attn_norm.weight"))
    qg = (a @ _t(g, p + "attn_q.weight").T).reshape(T, n_head, 2 * hd)
    q, gate = _rms(qg[..., :hd], _t(g, p + "attn_q_norm.weight")), qg[..., hd:].reshape(T, -1)
    k = _rms((a @ _t(g, p + "attn_k.weight").T).reshape(T, n_kv, hd), _t(g, p + "attn_k_norm.weight"))
    v = (a @ _t(g, p + "attn_v.weight").T).reshape(T, n_kv, hd)
    half = n_rot // 2
    ang = np.arange(T)[:, None] * base ** (-np.arange(half) * 2.0 / n_rot)[None, :]
    cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]

    def rope(u):
        u = u.copy()
        x1, x2 = u[..., :half].copy(), u[..., half:n_rot].copy()
        u[..., :half], u[..., half:n_rot] = x1 * cos - x2 * sin, x2 * cos + x1 * sin
        return u
    q, k = rope(q), rope(k)
    out = np.zeros((T, n_head, hd))
    for h in range(n_head):
        kh = h // (n_head // n_kv)
        s = q[:, h] @ k[:, kh].T / np.sqrt(hd)
        s = np.where(np.tril(np.ones((T, T), bool)), s, -np.inf)
        pr = np.exp(s - s.max(-1, keepdims=True))
        out[:, h] = (pr / pr.sum(-1, keepdims=True)) @ v[:, kh]
    z = z + (out.reshape(T, -1) * (1 / (1 + np.exp(-gate)))) @ _t(g, p + "attn_output.weight").T
    f = _rms(z, _t(g, p + "post_attention_norm.weight"))
    if arch == "qwen35":
        ffn = (_silu(f @ _t(g, p + "ffn_gate.weight").T) * (f @ _t(g, p + "ffn_up.weight").T)) @ _t(g, p + "ffn_down.weight").T
    else:
        k_used = int(key("expert_used_count"))
        logits = f @ _t(g, p + "ffn_gate_inp.weight").T
        probs = np.exp(logits - logits.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        gw, uw, dw = (_t(g, p + f"ffn_{n}_exps.weight") for n in ("gate", "up", "down"))
        ffn = np.zeros_like(f)
        for i in range(T):
            top = np.argsort(-probs[i])[:k_used]
            w = probs[i, top] / probs[i, top].sum()
            for e, we in zip(top, w):
                ffn[i] += we * ((_silu(gw[e] @ f[i]) * (uw[e] @ f[i])) @ dw[e].T)
        shared = (_silu(f @ _t(g, p + "ffn_gate_shexp.weight").T) * (f @ _t(g, p + "ffn_up_shexp.weight").T)) \
            @ _t(g, p + "ffn_down_shexp.weight").T
        ffn += shared / (1 + np.exp(-(f @ _t(g, p + "ffn_gate_inp_shexp.weight"))))[:, None]
    z = z + ffn
    return _rms(z, _t(g, p + "nextn.shared_head_norm.weight")) @ E.T


@pytest.mark.parametrize("arch", ["qwen35", "qwen35moe"])
def test_head_logits_match_a_numpy_reference(mdir, arch):
    from mlx_lm.models.cache import KVCache
    path = _file(mdir, arch)
    g = open_gguf(path)
    model, info = load_model(g)
    assert "1 NextN/MTP block(s) not loaded into the main model" in info.load_note
    head, hinfo = load_head(g, model)
    assert hinfo.layer == 4 and hinfo.own == ("norm",)
    ids = mx.array(PROMPT_IDS)[None]
    hidden = model.language_model.model(ids)                # the target's normed hidden states
    # the head at position t sees h_t and token t+1 and predicts token t+2
    next_ids = PROMPT_IDS[1:]
    cache = KVCache()
    ours = np.array(head(hidden[:, :-1], mx.array(next_ids)[None], cache=cache)[0])
    ref = reference_head(g, np.array(hidden[0, :-1]), next_ids)
    scale = float(np.abs(ref).max())
    err = float(np.abs(ours - ref).max())
    print(f"{arch} NextN head vs numpy: max |dlogit| {err:.2e} of scale {scale:.2f}")
    assert err < 1e-4 * scale, err
    assert (ours.argmax(-1) == ref.argmax(-1)).all()
    # one position at a time through the head's own K/V: the same logits (the drafting pattern)
    cache = KVCache()
    steps = [np.array(head(hidden[:, i:i + 1], mx.array([[t]]), cache=cache)[0, 0]) for i, t in enumerate(next_ids)]
    assert np.abs(np.stack(steps) - ref).max() < 1e-4 * scale


@pytest.mark.oracle
def test_llama_cpp_loads_the_file_with_its_head_and_the_main_model_still_matches(mdir):
    import llama_oracle
    from llama_oracle import strata_logits
    llama_oracle.require()
    path = _file(mdir, "qwen35")
    ref = llama_oracle.logits(llama_oracle.cached_llama(path), PROMPT_IDS)
    ours = strata_logits(path, PROMPT_IDS)
    scale, diff = float(np.abs(ref).max()), np.abs(ref - ours)
    # F16, as test_arch_qwen35's bounds: median 7e-4 of the scale (measured 3e-4), max over the positions
    # 8.7e-3 (the recurrent state carries float rounding forward)
    assert np.median(diff) < 7e-4 * scale and diff.max() < 2e-2 * scale, (np.median(diff), diff.max(), scale)
    assert (ref.argmax(-1) == ours.argmax(-1)).all()


def test_refusals_name_the_problem(mdir):
    plain = write_tiny_qwen35_gguf(mdir / "plain.gguf", "qwen35", seed=5)
    g = open_gguf(plain)
    model, _ = load_model(g)
    with pytest.raises(ModelFileError, match="no NextN head") as e:
        load_head(g, model)
    assert "\n" not in str(e.value)
    other = open_gguf(_file(mdir, "qwen35moe"))
    with pytest.raises(ModelFileError, match=r"does not match plain\.gguf \(architecture qwen35moe vs qwen35\)"):
        load_head(other, model, target_g=g)


def test_a_sibling_mtp_file_gives_the_same_head(mdir):
    """convert_hf_to_gguf's --mtp-only output (mtp-*.gguf): the head's block and the top-level tensors
    only, the target's metadata. Loaded beside the target, it is the same head."""
    src = _file(mdir, "qwen35")
    r = gguf.GGUFReader(src)
    sib = mdir / "mtp-tiny.gguf"
    w = gguf.GGUFWriter(str(sib), "qwen35")
    for key, field in r.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        if field.types[0] == gguf.GGUFValueType.ARRAY:
            w.add_array(key, field.contents())
        else:
            w.add_key_value(key, field.contents(), field.types[0])
    for t in r.tensors:
        if t.name.startswith("blk.4.") or not t.name.startswith("blk."):
            w.add_tensor(t.name, np.array(t.data), raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    g = open_gguf(src)
    model, _ = load_model(g)
    own, _ = load_head(g, model)
    sibling, info = load_head(open_gguf(sib), model, target_g=g)
    hidden = model.language_model.model(mx.array(PROMPT_IDS)[None])
    nxt = mx.array(PROMPT_IDS[1:])[None]
    assert mx.array_equal(own(hidden[:, :-1], nxt), sibling(hidden[:, :-1], nxt))
