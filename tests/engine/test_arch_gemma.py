"""Gemma 3 and Gemma 4 GGUFs (issue 29) against llama.cpp (llama-cpp-python 0.3.36) on tiny files.

The files come from tests/gguf_factory_gemma.py (random weights, an SPM-style vocabulary with byte
fallback, a Gemma chat template), quantized by llama.cpp itself. Every comparison sequence is longer
than the 32-token sliding window, so the local layers' masks and RoPE base are exercised, and the
Gemma 4 file has per-layer embeddings, K/V shared by its last two layers, a double-wide FFN there,
proportional RoPE on its global layers and logit soft-capping.

Comparisons follow tests/engine/test_oracle.py: teacher forcing over llama.cpp's greedy output, a
different greedy pick allowed only where llama.cpp's own top-2 margin is under TIE_MARGIN, and the
logits within tolerances measured here (LOGIT_TOL).
"""
from __future__ import annotations

import numpy as np
import pytest

import llama_oracle
from gguf_factory_gemma import vocab, write_gemma3, write_gemma4, write_tiny_gemma3

from engine.errors import ModelFileError
from engine.model.gguf_file import open_gguf
from engine_reads import prompt_ids

WRITERS = {"gemma3": write_gemma3, "gemma4": write_gemma4}
TURN_END = {"gemma3": "<end_of_turn>", "gemma4": "<turn|>"}
TURN = {"gemma3": ("<start_of_turn>", "<end_of_turn>"), "gemma4": ("<|turn>", "<turn|>")}
WINDOW = 32
N_GEN = 32
TIE_MARGIN = 0.6
# (median, max) |logit difference| per file type over the prompts below, measured 2026-12-02 (seed 3,
# logit scale ~16): F16 gemma3 0.0048-0.0050 / 0.046, gemma4 0.0038-0.0042 / 0.029 (llama.cpp rounds
# activations to F16 in F16 matmuls); Q8_0 gemma3 0.101-0.105 / 1.03, gemma4 0.078-0.084 / 0.61;
# Q4_K_M gemma3 0.142-0.146 / 1.03, gemma4 0.108-0.113 / 0.81 (llama.cpp's 8-bit activations; Q8_0
# weights are bit-exact in MLX, and the weights' own 8-bit rounding moves these random models' logits
# by as much). Greedy ids agreed at 26-32 of 32 positions, every disagreement at a llama.cpp margin
# under 0.54. Tolerances: those figures with ~40-100% headroom.
LOGIT_TOL = {"F16": (0.01, 0.08), "Q8_0": (0.15, 1.5), "Q4_K_M": (0.2, 1.5)}
PROMPTS = {
    "gemma3": ["The little boat left the harbor early in the morning",
               "<start_of_turn>user\nWhat is 12 times 7?<end_of_turn>\n<start_of_turn>model\n"],
    "gemma4": ["The little boat left the harbor early in the morning",
               "<|turn>user\nWhat is 12 times 7?<turn|>\n<|turn>model\n"],
}
TEXTS = ["Hello world", "The little boat left the harbor.", "  two  spaces", "   ", " leading", "trailing ",
         "café 🙂\ttab", "12345 and 3.14159", "a\n\n\nb", "\n\n\n\n", "x\n \n y", "émigré naïve — “quotes”",
         "日本語のテキスト", "it's don't we'll", "ZZZ qqq", "<mask><pad><unk>", "<eos>end"]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """(arch, ftype) -> a tiny file, written (and quantized by llama.cpp) on first use."""
    root = tmp_path_factory.mktemp("gemma")
    made = {}

    def get(arch: str, ftype: str = "F16", **kw):
        key = (arch, ftype, tuple(sorted(kw.items())))
        if key not in made:
            tag = "-".join(f"{k}{v}" for k, v in sorted(kw.items()))
            made[key] = WRITERS[arch](root / f"{arch}-{ftype}{tag}.gguf", ftype=ftype, seed=3,
                                      sliding_window=WINDOW, **kw)
        return made[key]
    return get


def _vocab_llm(path):
    return llama_oracle.Llama(model_path=str(path), n_ctx=64, verbose=False, vocab_only=True)


def _compare(ref: np.ndarray, ours: np.ndarray, start: int) -> dict:
    ref, ours = ref[start:], ours[start:]
    top2 = np.sort(ref, axis=-1)[:, -2:]
    margins = top2[:, 1] - top2[:, 0]
    disagree = np.nonzero(ref.argmax(-1) != ours.argmax(-1))[0]
    diff = np.abs(ref - ours)
    return {"disagree": disagree.tolist(), "margins": margins[disagree].tolist(),
            "median": float(np.median(diff)), "max": float(diff.max())}


def _first_difference(ours: list[int], ref: list[int], ref_logits: np.ndarray, n_prompt: int):
    """(step, llama.cpp's top-2 margin there) at the first differing greedy id, or None."""
    for i, (a, b) in enumerate(zip(ours, ref)):
        if a != b:
            top2 = np.sort(ref_logits[n_prompt - 1 + i])[-2:]
            return i, float(top2[1] - top2[0])
    return None


# ------------------------------------------------------------------------------------------ loading
@pytest.mark.parametrize("arch", ["gemma3", "gemma4"])
def test_loads_onto_mlx_lm_gemma_classes(files, arch):
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache, RotatingKVCache

    from engine.model.model_loader import load_model
    path = files(arch)
    g = open_gguf(path)
    model, info = load_model(g)
    assert type(model).__module__ == f"mlx_lm.models.{arch}_text"
    assert (info.architecture, info.n_layer, info.n_embd) == (arch, 4, 256)
    sliding = [layer.self_attn.is_sliding for layer in model.layers]
    caches = model.make_cache()
    if arch == "gemma3":
        assert sliding == [True, False, True, False]          # the file's pattern 2
        # the converter's 1+w: the module holds w (it adds the 1 itself)
        stored = np.asarray(g.tensors()["output_norm.weight"].data, dtype=np.float32)
        assert np.allclose(np.array(model.model.norm.weight), stored - 1.0, atol=1e-6)
        assert len(caches) == 4
    else:
        assert sliding == [True, False, True, False]
        # layers 2 and 3 reuse layers 0 and 1's K/V: no projections, no caches of their own
        assert [hasattr(layer.self_attn, "k_proj") for layer in model.layers] == [True, True, False, False]
        assert model.model.previous_kvs == [0, 1, 0, 1]
        assert [layer.mlp.up_proj.weight.shape[0] for layer in model.layers] == [512, 512, 1024, 1024]
        assert model.layers[3].layer_scalar.item() == pytest.approx(1.1)   # the file's output scale
        assert len(caches) == 2
    assert [type(c) for c in caches[:2]] == [RotatingKVCache, KVCache]
    assert caches[0].max_size == WINDOW
    mx.eval(model(mx.array([[2, 300, 301]]), cache=caches))


def test_gemma3_without_a_pattern_key_makes_every_sixth_layer_global(tmp_path):
    """Real Gemma 3 files carry no sliding_window_pattern: llama.cpp's default is 6."""
    from engine.model.model_loader import load_model
    path = write_tiny_gemma3(tmp_path / "g6.gguf", n_layer=6, pattern=None, seed=3, sliding_window=8)
    model, _ = load_model(open_gguf(path))
    assert [layer.self_attn.is_sliding for layer in model.layers] == [True] * 5 + [False]


@pytest.mark.parametrize("arch", ["gemma3", "gemma4"])
def test_memory_estimate_counts_global_and_window_kv_as_mlx_holds_it(files, arch):
    """K/V grows with the context in global layers only; a sliding layer holds its window plus one
    prefill chunk (RotatingKVCache keeps window-1 old tokens and the chunk); Gemma 4's sharing layers
    hold none. Measured: within 0.1% of the caches after 1,024 tokens in 512-token chunks (counting
    every layer at the global head size, as before, was 6x over for the Gemma 4 file)."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from engine.model.memory_estimate import PREFILL_CHUNK, estimate, read_header
    from engine.model.model_loader import load_model
    path = files(arch)
    model, _ = load_model(open_gguf(path))
    cache = make_prompt_cache(model)
    ids = mx.array([[300 + i % 200 for i in range(2 * PREFILL_CHUNK)]])
    for s in range(0, ids.shape[1], PREFILL_CHUNK):
        mx.eval(model(ids[:, s:s + PREFILL_CHUNK], cache=cache))
    held = sum(c.keys.nbytes + c.values.nbytes for c in cache)
    e = estimate(read_header(path), ids.shape[1], "float32")
    assert e.window_bytes > 0 and held <= e.kv_bytes + e.window_bytes <= 1.01 * held, (held, e.line())
    assert "sliding-window K/V" in e.line()


@pytest.mark.parametrize("bits", [8, 4])
def test_gemma4_sharing_layers_read_quantized_kv(files, bits):
    """Strata's 8/4-bit K/V on Gemma 4: the K/V-sharing layers get the source layer's quantized K/V
    (mlx-lm's own attention call fails there: no cache to read the bits from). Prefill then decode
    past the window: logits stay within the K/V rounding of the 16-bit run (measured max 0.11 at
    8 bits, 1.8 at 4, on a logit scale of ~16; bits or group read wrongly give garbage), and the
    quantized layers really were quantized."""
    import mlx.core as mx
    from mlx_lm.models.cache import QuantizedKVCache, make_prompt_cache

    from engine.cache import kv_format
    from engine.model.model_loader import load_model
    model, info = load_model(open_gguf(files("gemma4")))
    ids = mx.array([[300 + (7 * i) % 250 for i in range(48)]])

    def run(cache):
        out = [model(ids[:, :40], cache=cache)[0]]
        out += [model(ids[:, i:i + 1], cache=cache)[0] for i in range(40, 48)]
        return np.concatenate([np.array(o) for o in out])
    quantized = kv_format.make_cache(model, kv_format.choose(bits, info.head_dim))
    assert any(isinstance(c, QuantizedKVCache) for c in quantized)
    diff = np.abs(run(quantized) - run(make_prompt_cache(model))).max()
    print(f"{bits}-bit K/V on gemma4: max |dlogit| {diff:.3f}")
    assert 0 < diff < {8: 0.2, 4: 2.5}[bits]


# ---------------------------------------------------------------------------------------- tokenizer
@pytest.mark.oracle
@pytest.mark.parametrize("arch", ["gemma3", "gemma4"])
def test_prompt_token_ids_equal_llama_cpp(files, arch):
    llama_oracle.require()
    from engine.text.tokenizer import load_tokenizer
    path = files(arch)
    tok = load_tokenizer(open_gguf(path))
    llm = _vocab_llm(path)
    start, end = TURN[arch]
    texts = TEXTS + [f"{start}user\nHi there{end}\n{start}model\n", f"{start}{end}{start}"]
    for t in texts:
        assert tok.encode(t) == llm.tokenize(t.encode(), add_bos=True, special=True), t
    # byte fallback really happened (characters outside the vocabulary became <0xXX> tokens)
    pieces = vocab(arch)["tokens"]
    assert "<0xF0>" in [pieces[i] for i in tok.encode("🙂")]
    # a text that already starts with BOS gets no second one (llama.cpp adds it and warns)
    assert tok.encode("<bos>hi") == llm.tokenize(b"<bos>hi", add_bos=False, special=True)
    assert tok.decode(tok.encode("café 🙂 — x\n\n y")) == "café 🙂 — x\n\n y"


# ------------------------------------------------------------------------------- logits and greedy
@pytest.mark.oracle
@pytest.mark.parametrize("ftype", ["F16", "Q8_0", "Q4_K_M"])
@pytest.mark.parametrize("arch", ["gemma3", "gemma4"])
def test_greedy_and_logits_match_llama_cpp(files, arch, ftype):
    llama_oracle.require()
    path = files(arch, ftype)
    llm_tok = _vocab_llm(path)
    llm = llama_oracle.cached_llama(path)
    # the quantized files run the chat prompt only (the machine is shared: ~60 s for the module)
    for prompt in PROMPTS[arch] if ftype == "F16" else PROMPTS[arch][1:]:
        ids = llm_tok.tokenize(prompt.encode(), add_bos=True, special=True)
        gen = llama_oracle.greedy(llm, ids, N_GEN)
        seq = ids + gen
        assert len(seq) > WINDOW + 8, "the comparison must reach past the sliding window"
        ref, ours = llama_oracle.logits(llm, seq), llama_oracle.strata_logits(path, seq)
        r = _compare(ref[:-1], ours[:-1], len(ids) - 1)
        print(f"{arch} {ftype} {prompt[:16]!r}: {N_GEN - len(r['disagree'])}/{N_GEN} greedy ids agree, "
              f"|dlogit| median {r['median']:.4f} max {r['max']:.3f} (scale {np.abs(ref).max():.1f}), "
              f"tie margins {[round(m, 3) for m in r['margins']]}")
        assert all(m < TIE_MARGIN for m in r["margins"]), f"{ftype}: disagreement where llama.cpp leads: {r}"
        med, mx_ = LOGIT_TOL[ftype]
        assert r["median"] < med and r["max"] < mx_, r


# Gemma 4 with experts (26B-A4B-like: 4 experts, top 2, beside the dense FFN in every layer), measured
# 2026-12-02 over PROMPTS["gemma4"][0]: F16 0.004 / 0.11, Q8_0 0.082 / 0.82, Q4_K_M 0.185 / 3.7 (a
# routing choice that flips on llama.cpp's 8-bit activations moves one position's logits by several
# units); greedy disagreements only at llama.cpp margins under 0.54.
MOE_TOL = {"F16": (0.01, 0.2), "Q8_0": (0.15, 1.5), "Q4_K_M": (0.3, 5.0)}


@pytest.mark.oracle
@pytest.mark.parametrize("ftype", ["F16", "Q8_0", "Q4_K_M"])
def test_gemma4_experts_match_llama_cpp(files, ftype):
    llama_oracle.require()
    path = files("gemma4", ftype, n_expert=4)
    if ftype == "F16":
        from engine.model.model_loader import load_model
        model, _ = load_model(open_gguf(path))
        layer = model.layers[0]
        assert layer.enable_moe and layer.experts.switch_glu.gate_proj.weight.shape == (4, 256, 256)
    ids = _vocab_llm(path).tokenize(PROMPTS["gemma4"][0].encode(), add_bos=True, special=True)
    llm = llama_oracle.cached_llama(path)
    seq = ids + llama_oracle.greedy(llm, ids, N_GEN)
    ref, ours = llama_oracle.logits(llm, seq), llama_oracle.strata_logits(path, seq)
    r = _compare(ref[:-1], ours[:-1], len(ids) - 1)
    print(f"gemma4 experts {ftype}: {N_GEN - len(r['disagree'])}/{N_GEN} greedy ids agree, |dlogit| median "
          f"{r['median']:.4f} max {r['max']:.3f}, tie margins {[round(m, 3) for m in r['margins']]}")
    assert all(m < TIE_MARGIN for m in r["margins"]), r
    med, mx_ = MOE_TOL[ftype]
    assert r["median"] < med and r["max"] < mx_, r


@pytest.mark.oracle
def test_gemma4_31b_layout_matches_llama_cpp(files):
    """Gemma 4 31B's layout: global layers with V = K (no attn_v) and their own K/V head count
    (head_count_kv one per layer), no per-layer embeddings, no K/V sharing. F16 measured: median
    |dlogit| 0.0034, max 0.024, every greedy id equal."""
    llama_oracle.require()
    from engine.model.memory_estimate import estimate, read_header
    path = files("gemma4", k_eq_v=True, n_head_kv_global=1, n_embd_per_layer=0, shared_kv_layers=0,
                 double_wide=False)
    ids = _vocab_llm(path).tokenize(PROMPTS["gemma4"][0].encode(), add_bos=True, special=True)
    llm = llama_oracle.cached_llama(path)
    seq = ids + llama_oracle.greedy(llm, ids, N_GEN)
    ref, ours = llama_oracle.logits(llm, seq), llama_oracle.strata_logits(path, seq)
    r = _compare(ref[:-1], ours[:-1], len(ids) - 1)
    assert all(m < TIE_MARGIN for m in r["margins"]), r
    assert r["median"] < LOGIT_TOL["F16"][0] and r["max"] < LOGIT_TOL["F16"][1], r
    # K/V per token: the two global layers, one K/V head each, K and V of 128, float32
    assert estimate(read_header(path), 1024, "float32").kv_bytes_per_token == 2 * 1 * 256 * 4


# (median, max) for the tied files (real Gemma files tie the output head to the embedding), measured
# 2026-12-02 over TIED_TEXT: F16 0.0016-0.0022 / 0.013-0.017, Q4_K_M 0.054-0.074 / 0.52-0.82 (logit
# scale ~10; llama.cpp stores the tied table as Q6_K, which Strata requantizes to 8 bits).
TIED_TOL = {"F16": (0.005, 0.04), "Q4_K_M": (0.12, 1.2)}
TIED_TEXT = b"The little boat left the harbor early in the morning, when the sea was still and grey."


@pytest.mark.oracle
@pytest.mark.parametrize("ftype", ["F16", "Q4_K_M"])
@pytest.mark.parametrize("arch", ["gemma3", "gemma4"])
def test_tied_output_head_logits_match_llama_cpp(files, arch, ftype):
    llama_oracle.require()
    path = files(arch, ftype, tie_embeddings=True)
    ids = _vocab_llm(path).tokenize(TIED_TEXT, add_bos=True, special=True)
    assert len(ids) > WINDOW
    ref = llama_oracle.logits(llama_oracle.cached_llama(path), ids)
    diff = np.abs(ref - llama_oracle.strata_logits(path, ids))
    print(f"{arch} {ftype} tied: |dlogit| median {np.median(diff):.4f} max {diff.max():.3f}")
    med, mx_ = TIED_TOL[ftype]
    assert np.median(diff) < med and diff.max() < mx_


@pytest.mark.oracle
def test_gemma3_embedding_scale_is_llama_cpps_exact_square_root(tmp_path):
    """gemma3_text rounds sqrt(n_embd) to bfloat16 (1152, Gemma 3 1B's width: 34.0 for 33.94);
    llama.cpp does not. On a 1152-wide F32 file, measured |dlogit| median: 0.0028 with mlx-lm's
    rounded scale, 0.0013 with the correction, the floor of this comparison (a 1024-wide file, whose
    square root is exact, gives 0.0013: llama.cpp's GELU goes through an F16 table)."""
    llama_oracle.require()
    path = write_tiny_gemma3(tmp_path / "g1152.gguf", n_embd=1152, seed=3, sliding_window=WINDOW,
                             tie_embeddings=True, tensor_type="F32")
    ids = _vocab_llm(path).tokenize(TIED_TEXT, add_bos=True, special=True)
    ref = llama_oracle.logits(llama_oracle.cached_llama(path), ids)
    diff = np.abs(ref - llama_oracle.strata_logits(path, ids))
    print(f"1152-wide F32: |dlogit| median {np.median(diff):.5f} max {diff.max():.4f}")
    assert np.median(diff) < 0.0022


@pytest.mark.oracle
def test_gemma3_linear_rope_scaling_on_global_layers_matches_llama_cpp(files):
    """Gemma 3 4B/12B/27B files say rope.scaling.type linear, factor 8: llama.cpp divides the global
    layers' positions by 8 and leaves the sliding layers alone, as mlx-lm's gemma3_text does."""
    llama_oracle.require()
    path = files("gemma3", rope_linear=8.0)
    ids = _vocab_llm(path).tokenize(TIED_TEXT, add_bos=True, special=True)
    ref = llama_oracle.logits(llama_oracle.cached_llama(path), ids)
    diff = np.abs(ref - llama_oracle.strata_logits(path, ids))
    unscaled = np.abs(ref - llama_oracle.logits(llama_oracle.cached_llama(files("gemma3")), ids))
    print(f"gemma3 linear x8: |dlogit| median {np.median(diff):.4f} max {diff.max():.3f}; "
          f"the unscaled file differs by median {np.median(unscaled):.3f}")
    assert np.median(unscaled) > 10 * LOGIT_TOL["F16"][0], "the scaling must matter here"
    assert np.median(diff) < LOGIT_TOL["F16"][0] and diff.max() < LOGIT_TOL["F16"][1]


@pytest.mark.oracle
@pytest.mark.parametrize("arch", ["gemma3", "gemma4"])
def test_control_vector_steers_the_same_block_as_llama_cpps_cvec(files, arch, tmp_path):
    """A control vector on block k only: Strata's change to the logits equals llama.cpp's (its cvec
    is added to a block's output, after Gemma 4's per-layer output scale, as SteeredLayer does with
    the hidden state of the block's (hidden, shared K/V, offset) result)."""
    llama_oracle.require()
    if not llama_oracle.has_cvec():
        pytest.skip("this llama-cpp-python exposes no llama_set_adapter_cvec")
    import mlx.core as mx
    from test_control_vector import _flat_buffer

    from engine.steer.control_vector import ControlVector, SteeringConfig, write_control_vector
    from engine.model.model_loader import load_model
    from engine.steer.steering import SteeringState, install
    path = files(arch)
    n_layer, n_embd = 4, 256
    rng = np.random.default_rng(11)
    cv = tmp_path / "cv.gguf"
    write_control_vector(cv, {n: (rng.standard_normal(n_embd) * 2.0).astype(np.float32)
                              for n in range(1, n_layer)}, model_hint=arch)
    buf = _flat_buffer(str(cv), n_layer, n_embd)
    ids = _vocab_llm(path).tokenize(TIED_TEXT, add_bos=True, special=True)
    llm = llama_oracle.Llama(model_path=str(path), n_ctx=128, n_batch=128, logits_all=True, verbose=False)

    def cpp(k):
        assert llama_oracle.set_cvec(llm, None if k is None else buf, n_embd, k or -1, k or -1) == 0
        return llama_oracle.logits(llm, ids).astype(np.float64)

    model, _ = load_model(open_gguf(path))
    state = SteeringState(None, speed_projection=True)
    install(model, state)
    plain = np.array(model(mx.array([ids])), dtype=np.float64)[0]
    cpp_plain = cpp(None)
    for k in range(1, n_layer):
        state.vector = ControlVector.load(SteeringConfig(files=((str(cv), 1.0),), layer_range=(k, k)),
                                          n_layer, n_embd)
        ours = np.array(model(mx.array([ids])), dtype=np.float64)[0] - plain
        theirs = cpp(k) - cpp_plain
        err = np.abs(ours - theirs).max()
        print(f"{arch} block {k}: |delta| max {np.abs(theirs).max():.3f}, |difference| max {err:.4f}")
        assert np.abs(theirs).max() > 0.5 and err < LOGIT_TOL["F16"][1]
    state.vector = None


# ---------------------------------------------------------------------------------- the engine
CHAT = [{"role": "user", "content": "Tell me a story about the little boat and the sea."}]
# the step whose greedy token becomes the turn end's look-alike in the stop test's file: the reply then
# ends at step 16 (gemma3) and 3 (gemma4), where llama.cpp's margin for the turn end is 11.8 and 3.9
STOP_LIKE = {"gemma3": 20, "gemma4": 30}


def _engine_replies(path, requests):
    """Each request's Generation from one engine, with the prompt ids it used (read just before)."""
    from engine.engine import Engine, EngineOptions
    eng = Engine(EngineOptions(model=str(path), cache_mib=64)).start()
    out = []
    try:
        for make in requests:
            req = make(out)
            ids = prompt_ids(eng, req)
            out.append((ids, eng.call(req)))
    finally:
        eng.stop()
    return out


def _chat_ids(path, chat) -> list[int]:
    """The file's template rendered in the sandbox, tokenized by llama.cpp."""
    from engine.text.chat_template import render
    text = render(open_gguf(path).get("tokenizer.chat_template"), chat, bos_token="<bos>")
    return _vocab_llm(path).tokenize(text.encode(), add_bos=False, special=True)


@pytest.mark.oracle
@pytest.mark.parametrize("arch", ["gemma3", "gemma4"])
def test_engine_chat_equals_llama_cpp_past_the_window(files, arch):
    """The whole engine: the file's own Gemma template rendered in the sandbox, the prompt ids,
    greedy decode through the rotating K/V of the sliding layers well past the window, and a second
    turn on the held K/V (llama.cpp is given the engine's own prompt ids for it)."""
    llama_oracle.require()
    from engine.text.chat_template import render
    from engine.engine import GenerateRequest
    from engine.sampling import SamplingParams
    path = files(arch)
    start, end = TURN[arch]
    text = render(open_gguf(path).get("tokenizer.chat_template"), CHAT, bos_token="<bos>")
    assert text == f"<bos>{start}user\n{CHAT[0]['content']}{end}\n{start}model\n"
    follow = {"role": "user", "content": "Now tell me about the garden behind the school."}
    sampling = SamplingParams(max_tokens=24)
    (ids1, r1), (ids2, r2) = _engine_replies(path, [
        lambda done: GenerateRequest(messages=CHAT, sampling=sampling),
        lambda done: GenerateRequest(messages=CHAT + [{"role": "assistant", "content": done[0][1].text}, follow],
                                     sampling=sampling)])
    assert ids1 == _chat_ids(path, CHAT) and r1.prompt_tokens == len(ids1)
    # the engine keeps what it holds of turn 1 (how much of the reply: the conversation rules' business;
    # a random model's reply is not valid UTF-8 text, and the template trims it)
    assert ids2[:len(ids1)] == ids1
    llm = llama_oracle.cached_llama(path)
    ties = []
    for ids, r in ((ids1, r1), (ids2, r2)):
        ref = llama_oracle.greedy(llm, ids, 24)
        tie = _first_difference(r.tokens, ref, llama_oracle.logits(llm, ids + ref), len(ids))
        assert tie is None or tie[1] < TIE_MARGIN, f"step {tie[0]}: llama.cpp margin {tie[1]:.3f}"
        if tie is None:
            assert r.tokens == ref
        assert len(ids) + len(r.tokens) > WINDOW + 30
        ties.append(tie)
    print(f"{arch}: turn 1 {len(ids1)}+{len(r1.tokens)} tokens, turn 2 {len(ids2)} ({r2.cached_tokens} cached)"
          f"+{len(r2.tokens)}; first difference (step, llama.cpp margin) {ties}")


@pytest.mark.oracle
@pytest.mark.parametrize("arch", ["gemma3", "gemma4"])
def test_engine_stops_at_the_turn_end_where_llama_cpp_does(files, arch):
    """A file whose turn-end token comes up in greedy decoding (its output row is twice that of a
    token greedy picks later): the engine's reply ends there, with the marker not in the text."""
    llama_oracle.require()
    from engine.engine import GenerateRequest
    from engine.sampling import SamplingParams
    ids = _chat_ids(files(arch), CHAT)
    plain = llama_oracle.greedy(llama_oracle.cached_llama(files(arch)), ids, STOP_LIKE[arch] + 1)
    path = files(arch, eot_like=plain[STOP_LIKE[arch]])
    end_id = vocab(arch)["tokens"].index(TURN_END[arch])
    llm = llama_oracle.cached_llama(path)
    ref = llama_oracle.greedy(llm, ids, 40)
    assert end_id in ref, "the file's turn end must come up in llama.cpp's greedy reply"
    ref = ref[:ref.index(end_id) + 1]
    [(_, r)] = _engine_replies(path, [lambda done: GenerateRequest(messages=CHAT,
                                                                   sampling=SamplingParams(max_tokens=40))])
    tie = _first_difference(r.tokens, ref, llama_oracle.logits(llm, ids + ref), len(ids))
    assert tie is None or tie[1] < TIE_MARGIN, f"step {tie[0]}: llama.cpp margin {tie[1]:.3f}"
    if tie is None:
        assert r.tokens == ref
    assert r.finish_reason == "stop" and r.tokens[-1] == end_id and TURN_END[arch] not in r.text
    print(f"{arch}: the reply stops after {len(r.tokens)} tokens (llama.cpp {len(ref)})")


# ---------------------------------------------------------------------------------- bad files
def test_broken_gemma_files_are_one_line_model_file_errors(files, tmp_path):
    from test_cli import rewrite_gguf

    from engine.model.model_loader import model_args
    cases = [
        (rewrite_gguf(files("gemma4"), tmp_path / "no-per-layer.gguf",
                      drop_prefix="gemma4.embedding_length_per_layer_input"),
         "missing metadata 'gemma4.embedding_length_per_layer_input'"),
        (write_tiny_gemma3(tmp_path / "wide-window.gguf", sliding_window=4096, context_length=2048),
         "sliding window 4096 is larger than the context 2048"),
        (write_tiny_gemma3(tmp_path / "pattern.gguf", n_layer=4, pattern=None),
         "sliding window pattern 6 needs at least that many layers"),
    ]
    for path, message in cases:
        with pytest.raises(ModelFileError) as e:
            model_args(open_gguf(path))
        assert message in str(e.value) and "\n" not in str(e.value)
