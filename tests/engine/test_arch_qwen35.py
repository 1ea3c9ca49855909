"""Qwen3.5 / Qwen3.6 GGUFs (`qwen35`, `qwen35moe`: Gated DeltaNet in three blocks of four, gated
attention in the fourth) on mlx-lm's qwen3_5 classes (engine/model/archs/qwen35.py).

* Loading F16, Q8_0 and Q4_K_M files (quantized by llama.cpp itself), quantized as the file is; the
  prompt ids equal llama.cpp's (the `qwen35` pre-tokenizer).
* Against llama.cpp: teacher-forced greedy ids up to the first near-tie and logits within measured
  tolerances; and Q8_0 files against llama.cpp running the same weights dequantized to F32, which
  takes llama.cpp's 8-bit activations out and shows the mapping itself is exact.
* The engine: a chat turn rendered with the file's Qwen3-style template (the reply opens <think>),
  generated equal to llama.cpp up to the first near-tie; reasoning kept apart from tool calls.
* The memory estimate: K/V for the attention layers only, plus the fixed recurrent state.
* A broken file: one line naming the problem.
"""
from __future__ import annotations

import functools
from pathlib import Path

import gguf
import mlx.core as mx
import numpy as np
import pytest

from engine.errors import ModelFileError
from engine.model.gguf_file import open_gguf
from engine.model.model_loader import load_model
from gguf_factory import quantize_with_llama
from gguf_factory_qwen35 import ARCHS, CHAT_TEMPLATE, write_tiny_qwen35_gguf
from llama_oracle import strata_logits

SEED = 3
N_GEN = 24
TIE_MARGIN = 0.6     # as tests/engine/test_oracle.py: below it, llama.cpp's own noise can pick either
CHAT = [{"role": "user", "content": "What would they find today?"}]
PROMPT = "<|im_start|>user\nWhat would they find today?<|im_end|>\n<|im_start|>assistant\n<think>\n"
TEXTS = [PROMPT, "The little boat left the harbor early in the morning, when the sea was still",
         "numbers 1234567 and 3.14159", "it's don't we'll  CamelCase"]


@pytest.fixture(scope="module")
def qdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("qwen35")


@functools.lru_cache(maxsize=None)
def _file(d: Path, arch: str, ftype: str) -> Path:
    src = write_tiny_qwen35_gguf(d / f"{arch}-F16.gguf", arch, seed=SEED)
    if ftype == "F16":
        return src
    try:
        return quantize_with_llama(src, d / f"{arch}-{ftype}.gguf", ftype)
    except ImportError as e:
        pytest.skip(str(e))


def _oracle():
    import llama_oracle
    llama_oracle.require()
    return llama_oracle


# --------------------------------------------------------------------------------------------- loading
@pytest.mark.parametrize("ftype", ["F16", "Q8_0", "Q4_K_M"])
@pytest.mark.parametrize("arch", ARCHS)
def test_loads_as_the_file_is_quantized_and_tokenizes_like_llama_cpp(qdir, arch, ftype):
    from mlx.nn import QuantizedLinear
    from engine.text.tokenizer import load_tokenizer
    path = _file(qdir, arch, ftype)
    g = open_gguf(path)
    model, info = load_model(g)
    assert info.architecture == ("qwen3_5_moe" if arch == "qwen35moe" else "qwen3_5") and info.n_layer == 4
    assert "3 Gated DeltaNet + 1 gated attention" in info.load_note and "value heads regrouped" in info.load_note
    layers = model.layers
    assert [layer.is_linear for layer in layers] == [True, True, True, False]
    qkv = layers[0].linear_attn.in_proj_qkv
    assert isinstance(qkv, QuantizedLinear) == (ftype != "F16")
    assert layers[0].linear_attn.conv1d.weight.shape == (512, 4, 1)         # (conv_dim, d_conv, 1)
    # A_log from the file's -exp(A_log), regrouped: the same values, in mlx-lm's head order
    ssm_a = np.asarray(g.tensors()["blk.0.ssm_a"].data, dtype=np.float32)
    np.testing.assert_allclose(np.sort(np.exp(np.array(layers[0].linear_attn.A_log))), np.sort(-ssm_a), rtol=1e-6)
    if ftype == "F16" and arch == "qwen35":
        oracle = _oracle()
        tok = load_tokenizer(g)
        llm = oracle.Llama(model_path=str(path), n_ctx=64, verbose=False, vocab_only=True)
        for text in TEXTS:
            assert tok.encode(text) == llm.tokenize(text.encode(), add_bos=False, special=True), text


# --------------------------------------------------------------------------------------- against llama.cpp
# Fractions of the logit scale (max |logit| of llama.cpp's): (last prompt position's max |dlogit|, median
# |dlogit| over the 24 teacher-forced positions). Measured here on the prompt above and a plain-text one,
# seed 3 (2026-12-02): F16 last <= 2.7e-3, median <= 3.5e-4 (qwen35moe; qwen35 1.3e-3 / 2.9e-4);
# Q8_0 last <= 0.11, median <= 1.3e-2; Q4_K_M last <= 0.41, median <= 2.9e-2 (qwen35moe; qwen35 0.14 /
# 1.6e-2). The quantized spread is llama.cpp's 8-bit activations in its quantized matmuls (the Q8_0
# test below shows the weights map exactly), carried forward by the recurrent state as K/V carries
# it, and by routing flips in the MoE; teacher-forced disagreements went with llama.cpp margins up to
# 1.4 after an earlier near-tie, so ids are compared up to the first near-tie only.
LOGIT_TOL = {"F16": (5e-3, 7e-4), "Q8_0": (0.2, 0.025), "Q4_K_M": (0.6, 0.045)}


@pytest.mark.oracle
@pytest.mark.parametrize("ftype", ["F16", "Q8_0", "Q4_K_M"])
@pytest.mark.parametrize("arch", ARCHS)
def test_matches_llama_cpp(qdir, arch, ftype):
    oracle = _oracle()
    path = _file(qdir, arch, ftype)
    llm = oracle.cached_llama(path)
    ids = llm.tokenize(PROMPT.encode(), add_bos=False, special=True)
    gen = oracle.greedy(llm, ids, N_GEN)
    seq = ids + gen
    ref, ours = oracle.logits(llm, seq), strata_logits(path, seq)
    scale = float(np.abs(ref).max())
    last = float(np.abs(ref[len(ids) - 1] - ours[len(ids) - 1]).max())
    r, o = ref[len(ids) - 1:-1], ours[len(ids) - 1:-1]       # positions predicting the generated tokens
    diff = np.abs(r - o)
    top2 = np.sort(r, axis=-1)[:, -2:]
    margins = top2[:, 1] - top2[:, 0]
    ties = np.nonzero(margins < TIE_MARGIN)[0]
    first_tie = int(ties[0]) if len(ties) else N_GEN
    disagree = np.nonzero(r.argmax(-1) != o.argmax(-1))[0]
    print(f"{arch} {ftype}: last-position max |dlogit| {last:.4f} ({last / scale:.1e} of scale {scale:.1f}); "
          f"over {N_GEN}: median {np.median(diff):.4f} ({np.median(diff) / scale:.1e}) max {diff.max():.3f}; "
          f"greedy disagrees at {disagree.tolist()} (first llama.cpp near-tie at {first_tie})")
    tol_last, tol_median = LOGIT_TOL[ftype]
    assert last < tol_last * scale and np.median(diff) < tol_median * scale, (last, np.median(diff), scale)
    assert all(i >= first_tie for i in disagree), (disagree, margins[disagree], first_tie)
    if ftype == "F16":
        assert len(disagree) == 0


def _dequantized_copy(src: Path, dst: Path) -> Path:
    """The same file with every tensor decoded by gguf-py to F32 (metadata kept)."""
    r = gguf.GGUFReader(src)
    w = gguf.GGUFWriter(str(dst), r.fields["general.architecture"].contents())
    for key, field in r.fields.items():
        if key.startswith("GGUF.") or key in ("general.architecture", "general.file_type"):
            continue
        if field.types[0] == gguf.GGUFValueType.ARRAY:
            w.add_array(key, field.contents())
        else:
            w.add_key_value(key, field.contents(), field.types[0])
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    for t in r.tensors:
        shape = tuple(int(x) for x in reversed(list(t.shape)))
        w.add_tensor(t.name, gguf.quants.dequantize(np.asarray(t.data), t.tensor_type).astype(np.float32).reshape(shape))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


@pytest.mark.oracle
@pytest.mark.parametrize("arch", ARCHS)
def test_q8_0_equals_llama_cpp_on_the_same_weights_in_f32(qdir, arch):
    """Strata keeps Q8_0 weights bit-exact (engine/model/quants.py); llama.cpp on their F32 decoding has no
    activation quantization, so only float rounding may separate the two. Measured: median 5-7e-6,
    max 6e-5 of the logit scale, every greedy id equal. The regrouped value heads, A_log, conv1d and
    the gates are all in this path: without the regrouping the max is ~1.1 of the scale."""
    oracle = _oracle()
    path = _file(qdir, arch, "Q8_0")
    ref_path = _dequantized_copy(path, qdir / f"{arch}-Q8_0-as-F32.gguf")
    llm = oracle.cached_llama(ref_path)
    ids = llm.tokenize(PROMPT.encode(), add_bos=False, special=True)
    seq = ids + oracle.greedy(llm, ids, N_GEN)
    ref, ours = oracle.logits(llm, seq), strata_logits(path, seq)
    scale = float(np.abs(ref).max())
    diff = np.abs(ref - ours)
    print(f"{arch} Q8_0 vs llama.cpp on its F32 decoding: median {np.median(diff) / scale:.1e}, "
          f"max {diff.max() / scale:.1e} of scale {scale:.1f}")
    assert np.median(diff) < 3e-5 * scale and diff.max() < 3e-4 * scale
    assert (ref.argmax(-1) == ours.argmax(-1)).all()


# ------------------------------------------------------------------------------------------- the engine
@pytest.mark.oracle
def test_engine_chat_turn_renders_the_think_template_and_equals_llama_cpp(qdir):
    pytest.importorskip("engine.cache.layer_cache", reason="the engine's cache handling of ArraysCache comes with the "
                        "cache contract (issue 28); before it, turns.begin_turn reads cache.offset")
    from engine.text.chat_template import render
    from engine.engine import Engine, EngineOptions, GenerateRequest
    from engine.sampling import SamplingParams
    from engine.frontends.tool_calls import detect, parse
    oracle = _oracle()
    path = _file(qdir, "qwen35moe", "F16")
    text = render(CHAT_TEMPLATE, CHAT)
    assert text == PROMPT                                        # the reply opens the reasoning block
    fmt = detect(CHAT_TEMPLATE, text[len(render(CHAT_TEMPLATE, CHAT, add_generation_prompt=False)):])
    assert fmt.think_open
    call = '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>'
    assert parse(f"maybe {call}\n</think>\n\nNo call.", fmt, [{"type": "function", "function": {"name": "f"}}]).calls == []
    eng = Engine(EngineOptions(model=str(path), cache_mib=0)).start()
    try:
        r = eng.call(GenerateRequest(messages=CHAT, sampling=SamplingParams(max_tokens=N_GEN, temperature=0.0)))
    finally:
        eng.stop()
    llm = oracle.cached_llama(path)
    ids = llm.tokenize(PROMPT.encode(), add_bos=False, special=True)
    assert r.prompt_tokens == len(ids)
    ref_gen = oracle.greedy(llm, ids, N_GEN)
    ref = oracle.logits(llm, ids + ref_gen)
    n = len(r.tokens)
    for i, (a, b) in enumerate(zip(r.tokens, ref_gen)):
        if a != b:
            top2 = np.sort(ref[len(ids) - 1 + i])[-2:]
            assert top2[1] - top2[0] < TIE_MARGIN, f"step {i}: {a} vs {b}, llama.cpp margin {top2[1] - top2[0]}"
            n = i
            break
    print(f"engine vs llama.cpp, qwen35moe F16 chat turn: {n}/{len(r.tokens)} greedy tokens equal before "
          "the first near-tie")
    assert n >= 4 and r.tokens[:n] == ref_gen[:n]


# ---------------------------------------------------------------------------------------- memory estimate
def test_memory_estimate_is_kv_of_the_attention_layers_plus_the_fixed_state(qdir):
    """Exactly what MLX holds: the weights, K/V of the one attention layer in four (300 tokens -> 512
    slots) and the DeltaNet layers' conv + recurrent states, which do not grow with the context."""
    from mlx.utils import tree_flatten
    from mlx_lm.models.cache import make_prompt_cache
    from engine.model import memory_estimate as me
    path = write_tiny_qwen35_gguf(qdir / "estimate-qwen35moe.gguf", "qwen35moe", seed=1)
    h = me.read_header(path)
    est = me.estimate(h, 300, "float32")
    model, _ = load_model(open_gguf(path))
    assert est.weights_bytes == sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    cache = make_prompt_cache(model)
    mx.eval(model(mx.zeros((1, 300), dtype=mx.int32), cache=cache))
    kv = [c for c in cache if hasattr(c, "keys")]
    states = [c for c in cache if not hasattr(c, "keys")]
    assert len(kv) == 1 and len(states) == 3
    assert est.kv_bytes == sum(c.keys.nbytes + c.values.nbytes for c in kv)
    # conv state (3 x 512 float32) + recurrent state (4 heads x 64 x 64 float32) per DeltaNet layer
    assert est.state_bytes == sum(a.nbytes for c in states for a in c.cache) == 3 * (3 * 512 * 4 + 4 * 64 * 64 * 4)
    far = me.estimate(h, 8192, "float32")
    assert far.state_bytes == est.state_bytes and far.kv_bytes == 8192 * est.kv_bytes_per_token
    assert "recurrent state" in est.line()
    assert est.total_bytes == est.weights_bytes + est.kv_bytes + est.state_bytes + est.overhead_bytes
    # a float16 load keeps the recurrent state in float32 (mlx-lm's gated_delta_update)
    assert me.estimate(h, 300, "float16").state_bytes == 3 * (3 * 512 * 2 + 4 * 64 * 64 * 4)


# ----------------------------------------------------------------------------------------------- refusals
def _rewrite(src: Path, dst: Path, *, drop_key: str | None = None, tensor: str | None = None, fn=None) -> Path:
    """Copy a GGUF with one metadata key dropped or one (F32) tensor replaced by fn(array)."""
    r = gguf.GGUFReader(src)
    w = gguf.GGUFWriter(str(dst), r.fields["general.architecture"].contents())
    for key, field in r.fields.items():
        if key.startswith("GGUF.") or key in ("general.architecture", drop_key):
            continue
        if field.types[0] == gguf.GGUFValueType.ARRAY:
            w.add_array(key, field.contents())
        else:
            w.add_key_value(key, field.contents(), field.types[0])
    for t in r.tensors:
        if t.name == tensor:
            w.add_tensor(t.name, fn(np.array(t.data, dtype=np.float32)))
        else:
            w.add_tensor(t.name, np.array(t.data), raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


def test_broken_files_are_refused_in_one_line(qdir):
    src = _file(qdir, "qwen35", "F16")
    cases = {
        "positive A": (_rewrite(src, qdir / "a.gguf", tensor="blk.1.ssm_a", fn=np.abs), "'blk.1.ssm_a' must be -exp"),
        "no ssm sizes": (_rewrite(src, qdir / "k.gguf", drop_key="qwen35.ssm.group_count"),
                         "missing metadata 'qwen35.ssm.group_count'"),
        "conv kernel": (_rewrite(src, qdir / "c.gguf", tensor="blk.0.ssm_conv1d.weight", fn=lambda a: a[:, :3].copy()),
                        "'blk.0.ssm_conv1d.weight' has shape"),
    }
    for what, (path, msg) in cases.items():
        with pytest.raises(ModelFileError) as e:
            load_model(open_gguf(path))
        text = str(e.value)
        assert msg in text and "\n" not in text and path.name in text, (what, text)


@pytest.mark.parametrize("tensor_type", ["F16", "Q8_0"])
def test_fused_expert_gate_up_loads_like_the_separate_stacks(qdir, tensor_type):
    """Newer converters write the experts' gate and up stacks as one `ffn_gate_up_exps` (gate rows
    first; llama.cpp takes either): split at load, quantized halves kept quantized, the same model."""
    from llama_oracle import _strata_model
    kw = dict(seed=2, tensor_type=tensor_type)
    sep = write_tiny_qwen35_gguf(qdir / f"sep-{tensor_type}.gguf", "qwen35moe", **kw)
    fused = write_tiny_qwen35_gguf(qdir / f"fused-{tensor_type}.gguf", "qwen35moe", fused_gate_up=True, **kw)
    assert "blk.0.ffn_gate_up_exps.weight" in open_gguf(fused).tensors()
    ids = [398, 273, 114, 373, 309, 47, 259, 107]
    a = strata_logits(sep, ids)
    _strata_model.cache_clear()
    b = strata_logits(fused, ids)
    assert np.array_equal(a, b)


def test_a_log_stays_float32_in_a_half_precision_load(qdir):
    """mlx-lm keeps A_log in float32 whatever the compute dtype (its cast_predicate); so does Strata."""
    path = _file(qdir, "qwen35", "F16")
    g = open_gguf(path)
    model, info = load_model(g, dtype=mx.bfloat16)
    assert "A_log kept in float32" in info.load_note
    la = model.layers[1].linear_attn
    assert la.A_log.dtype == mx.float32 and la.in_proj_qkv.weight.dtype == mx.bfloat16
    ref, _ = load_model(g, dtype=mx.float32)
    assert mx.array_equal(la.A_log, ref.layers[1].linear_attn.A_log)


@pytest.mark.parametrize("arch", ARCHS)
def test_control_vector_steers_like_llama_cpp(qdir, tmp_path, arch):
    """A control vector on block 1 (a DeltaNet block) and block 3 (the attention block): Strata's change
    to the logits equals llama.cpp's cvec (added to each block's output). Measured: the vector moves the
    logits by 7.2 (qwen35) / 6.8 (qwen35moe), Strata's change differs from llama.cpp's by 0.018 / 0.033."""
    oracle = _oracle()
    from engine.steer.control_vector import ControlVector, SteeringConfig, write_control_vector
    from engine.steer.steering import SteeringState, install
    if not oracle.has_cvec():
        pytest.skip("this llama-cpp-python exposes no llama_set_adapter_cvec")
    path = _file(qdir, arch, "F16")
    n_embd, n_layer = 256, 4
    rng = np.random.default_rng(5)
    dirs = {i: (rng.standard_normal(n_embd) * 2.0).astype(np.float32) for i in (1, 3)}
    cv = tmp_path / "cv.gguf"
    write_control_vector(cv, dirs, model_hint=arch)
    llm = oracle.Llama(model_path=str(path), n_ctx=128, n_batch=128, logits_all=True, verbose=False)
    try:
        ids = llm.tokenize(PROMPT.encode(), add_bos=False, special=True)
        ref_plain = oracle.logits(llm, ids)
        buf = np.zeros(n_embd * n_layer, np.float32)          # direction N at n_embd * (N - 1)
        for i, d in dirs.items():
            buf[n_embd * (i - 1):n_embd * i] = d
        assert oracle.set_cvec(llm, buf, n_embd, 1, 3) == 0
        ref = oracle.logits(llm, ids) - ref_plain
    finally:
        llm.close()
    model = load_model(open_gguf(path))[0]
    plain = np.array(model(mx.array(ids)[None])[0])
    install(model, SteeringState(ControlVector.load(SteeringConfig(files=((str(cv), 1.0),), layer_range=(1, 3)),
                                                    n_layer, n_embd), speed_projection=True))
    ours = np.array(model(mx.array(ids)[None])[0]) - plain
    moved, off = float(np.abs(ref).max()), float(np.abs(ours - ref).max())
    print(f"{arch}: cvec changes logits by up to {moved:.3f}; Strata - llama.cpp {off:.4f}")
    assert moved > 1.0, "the vector must matter in llama.cpp"
    assert off < 0.02 * moved, (arch, off, moved)
