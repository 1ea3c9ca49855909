"""Issue 29's smaller families against llama.cpp: granite, olmo2 (and OLMo 3: olmo2 with sliding windows),
mistral3 (Ministral 3) and phi3 (Phi-4-mini-like, and a Phi-3-mini-like SentencePiece file).

Tiny random-weight GGUFs from tests/gguf_factory_families.py (2 layers, 4 for OLMo 3; width 256 so
K-quants are real), quantized by llama.cpp. The comparison is test_oracle.py's: llama.cpp generates N_GEN greedy
tokens, both engines score that sequence in one pass, a different greedy pick is allowed only where
llama.cpp's own top-2 margin is under TIE_MARGIN, and logits agree within LOGIT_TOL.
"""
from __future__ import annotations

import numpy as np
import pytest

import llama_oracle as llama_cpp
from llama_oracle import strata_logits

if not llama_cpp.available():
    pytest.skip("llama-cpp-python (the llama.cpp oracle) is not installed", allow_module_level=True)

from engine.errors import ModelFileError  # noqa: E402
from engine.model.gguf_file import open_gguf  # noqa: E402
from engine.text.tokenizer import load_tokenizer  # noqa: E402
from gguf_factory_families import FAMILIES, write_family_gguf, writer  # noqa: E402
from engine_reads import prompt_ids

pytestmark = pytest.mark.oracle

FAMILY_NAMES = tuple(FAMILIES)
N_GEN = 16
TIE_MARGIN = 0.6    # test_oracle.py's: llama.cpp's 8-bit activations move quantized logits this much
# (median, max) |logit difference| per file type over the prompts below, measured 2026-12-02 on every
# family (greedy ids all equal but near-ties in Q4_K_M files, margins 0.013-0.16): F16 median 0.0009-0.0022,
# max 0.007-0.016 (float rounding only: the graphs agree); Q8_0 median 0.019-0.050, max 0.13-0.34; Q4_K_M
# median 0.036-0.075, max 0.25-0.50 (llama.cpp quantizes activations to 8 bits in its quantized matmuls,
# Strata does not). Tolerances: those with headroom.
LOGIT_TOL = {"F16": (0.005, 0.04), "Q8_0": (0.08, 0.6), "Q4_K_M": (0.12, 0.9)}
PROMPTS = [
    "The little boat left the harbor early in the morning, when the sea was still and grey.",
    "In 1969 people walked on the moon; in 1972 the last of them came home. It's 2024 now,",
]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """(family, ftype) -> path, written on first use (a quantized file comes from the F16 one)."""
    root = tmp_path_factory.mktemp("families")
    made: dict = {}

    def get(family: str, ftype: str = "F16"):
        if (family, ftype) not in made:
            made[(family, ftype)] = writer(family)(root / f"{family}-{ftype}.gguf", ftype=ftype, seed=3)
        return made[(family, ftype)]
    return get


def _ids(path, text: str) -> list[int]:
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=64, verbose=False, vocab_only=True)
    return llm.tokenize(text.encode(), add_bos=True, special=True)


def _disagreements(ref: np.ndarray, ours: np.ndarray, start: int) -> tuple[list[int], list[float]]:
    ref, ours = ref[start:], ours[start:]
    top2 = np.sort(ref, axis=-1)[:, -2:]
    disagree = np.nonzero(ref.argmax(-1) != ours.argmax(-1))[0]
    return disagree.tolist(), (top2[:, 1] - top2[:, 0])[disagree].tolist()


# every family in every type; OLMo 3 (olmo2's graph with sliding windows) and the Phi-3 SentencePiece file
# (phi3's graph) in F16: their quantized weights load as olmo2's and phi3's do (time)
PARITY_CASES = ([(f, t) for f in ("granite", "olmo2", "mistral3", "phi3") for t in ("F16", "Q8_0", "Q4_K_M")]
                + [("olmo3", "F16"), ("phi3-spm", "F16")])


@pytest.mark.parametrize("family, ftype", PARITY_CASES)
def test_family_greedy_and_logits_match_llama_cpp(files, family, ftype):
    # (one prompt for a quantized file: time)
    _check_parity(files(family, ftype), family, ftype, PROMPTS if ftype == "F16" else PROMPTS[:1])


def test_phi3_with_separate_q_k_v_matches_llama_cpp(tmp_path):
    """llama.cpp's phi3 also reads attn_q/attn_k/attn_v apart; its Q4_K_M stores some attn_v in Q6_K, so each
    part keeps its own type (phi3.StackedQKV)."""
    from gguf_factory import quantize_with_llama
    src = write_family_gguf(tmp_path / "phi3-qkv.gguf", "phi3", seed=3, fused_qkv=False)
    path = quantize_with_llama(src, tmp_path / "phi3-qkv-Q4_K_M.gguf", "Q4_K_M")
    import gguf
    types = {t.tensor_type.name for t in gguf.GGUFReader(path).tensors if t.name.startswith("blk.1.attn_")}
    assert {"Q4_K", "Q6_K"} <= types, types
    _check_parity(path, "phi3", "Q4_K_M", PROMPTS[:1])


def _check_parity(path, family: str, ftype: str, prompts: list[str]) -> None:
    llm = llama_cpp.cached_llama(path)
    for prompt in prompts:
        ids = _ids(path, prompt)
        seq = ids + llama_cpp.greedy(llm, ids, N_GEN)
        ref, ours = llama_cpp.logits(llm, seq), strata_logits(path, seq)
        disagree, margins = _disagreements(ref[:-1], ours[:-1], len(ids) - 1)
        diff = np.abs(ref - ours)
        print(f"{family} {ftype} {prompt[:16]!r}: {N_GEN - len(disagree)}/{N_GEN} greedy ids agree, "
              f"|dlogit| median {np.median(diff):.4f} max {diff.max():.4f}, tie margins {margins}")
        assert all(m < TIE_MARGIN for m in margins), f"{family} {ftype}: llama.cpp led clearly at {disagree}"
        med, mx_ = LOGIT_TOL[ftype]
        assert np.median(diff) < med and diff.max() < mx_, (family, ftype, float(np.median(diff)), float(diff.max()))


# What each family's distinct computation is: a file without it gives llama.cpp logits far from the
# file with it, so the F16 parity above cannot pass while Strata ignores it.
FEATURE_VARIANTS = [
    ("granite", dict(embedding_scale=1.0)), ("granite", dict(residual_scale=1.0)),
    ("granite", dict(attention_scale=0.125)), ("granite", dict(logit_scale=1.0)),
    ("mistral3", dict(temperature_scale=0.0)), ("mistral3", dict(yarn_factor=0.0)),
    ("phi3", dict(original_context=0)), ("olmo3", dict(sliding_window=0)), ("olmo3", dict(swa_pattern=2)),
    ("olmo3", dict(yarn_factor=0.0)),
]


def test_each_family_feature_changes_llama_cpp_logits(files, tmp_path):
    text = " ".join(PROMPTS)
    refs = {}
    for family, change in FEATURE_VARIANTS:
        base = files(family)
        ids = _ids(base, text)
        if family not in refs:
            refs[family] = llama_cpp.logits(llama_cpp.cached_llama(base), ids)
        ref = refs[family]
        variant = write_family_gguf(tmp_path / f"{family}-{'-'.join(change)}.gguf", family, seed=3, **change)
        other = llama_cpp.logits(llama_cpp.cached_llama(variant), ids)
        gap = float(np.abs(ref - other).max())
        assert gap > 20 * LOGIT_TOL["F16"][1], f"{family} {change}: only {gap:.3f} apart"


@pytest.mark.parametrize("family", [f for f in FAMILY_NAMES if f != "olmo3"])   # olmo3: olmo2's vocabulary
def test_family_tokenizer_matches_llama_cpp(files, family):
    path = files(family)
    tok = load_tokenizer(open_gguf(path))
    spec = FAMILIES[family]
    texts = PROMPTS + ["numbers 1234567 and 3.14159", "émigré naïve café — “quotes”", "tabs\tand\nnewlines\n\n",
                       "CamelCaseWords and snake_case_words it's don't we'll", "🙂 emoji",
                       "".join(spec.specials) + " between" + spec.end_of_turn + "\n after"]
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=64, verbose=False, vocab_only=True)
    for t in texts:
        assert tok.encode(t) == llm.tokenize(t.encode(), add_bos=True, special=True), (family, t)
    assert tok.add_bos == spec.add_bos
    end = tok.backend.token_to_id(spec.end_of_turn)
    assert end in tok.eos_ids, f"{family}: a reply must stop at {spec.end_of_turn}"


# The prompt each family's template makes of CHAT (BOS where the template writes it).
CHAT = [{"role": "system", "content": "You are brief."}, {"role": "user", "content": "Tell me about the sea."}]
RENDERED = {
    "granite": "<|start_of_role|>system<|end_of_role|>You are brief.<|end_of_text|>\n"
               "<|start_of_role|>user<|end_of_role|>Tell me about the sea.<|end_of_text|>\n"
               "<|start_of_role|>assistant<|end_of_role|>",
    "olmo2": "<|endoftext|><|system|>\nYou are brief.\n<|user|>\nTell me about the sea.\n<|assistant|>\n",
    "olmo3": "<|endoftext|><|system|>\nYou are brief.\n<|user|>\nTell me about the sea.\n<|assistant|>\n",
    "mistral3": "<s>[SYSTEM_PROMPT]You are brief.[/SYSTEM_PROMPT][INST]Tell me about the sea.[/INST]",
    "phi3": "<|system|>You are brief.<|end|><|user|>Tell me about the sea.<|end|><|assistant|>",
    "phi3-spm": "<|system|>\nYou are brief.<|end|>\n<|user|>\nTell me about the sea.<|end|>\n<|assistant|>\n",
}


# The end-of-turn token's output row scaled so that the random model ends its reply within N_REPLY tokens
# (measured: after 2, 1, 16, 20, 1 and 12 tokens): a reply that ends is what shows the engine stops at the marker.
EOT_BOOST = {"granite": 1.8, "olmo2": 5.0, "olmo3": 3.0, "mistral3": 8.0, "phi3": 3.0, "phi3-spm": 3.0}
N_REPLY = 24


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_engine_chat_renders_the_family_template_and_stops_at_its_end_of_turn(tmp_path, family):
    """Through the whole engine: the GGUF's template rendered, its ids equal llama.cpp's tokenization of
    that text (one BOS), the greedy reply equal to llama.cpp's up to the first near-tie, ending at the
    family's end-of-turn token where llama.cpp emits it, the marker not in the text."""
    from engine.engine import Engine, EngineOptions, GenerateRequest
    from engine.sampling import SamplingParams
    spec = FAMILIES[family]
    path = write_family_gguf(tmp_path / f"{family}.gguf", family, seed=3, eot_boost=EOT_BOOST[family])
    eng = Engine(EngineOptions(model=str(path), cache_mib=64)).start()
    try:
        req = GenerateRequest(messages=CHAT, sampling=SamplingParams(max_tokens=N_REPLY))
        prompt = prompt_ids(eng, req)
        r = eng.call(req)
    finally:
        eng.stop()
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=64, verbose=False, vocab_only=True)
    want = llm.tokenize(RENDERED[family].encode(), add_bos=not RENDERED[family].startswith(spec.bos), special=True)
    assert prompt == want, family
    eot = llm.tokenize(spec.end_of_turn.encode(), add_bos=False, special=True)
    assert len(eot) == 1
    ref_gen = llama_cpp.greedy(llama_cpp.cached_llama(path), prompt, N_REPLY)
    assert eot[0] in ref_gen, f"{family}: llama.cpp must end the turn within {N_REPLY} tokens for this test"
    ref_gen = ref_gen[:ref_gen.index(eot[0]) + 1]
    print(f"{family}: {r.tokens} {r.finish_reason} {r.text!r}; llama.cpp {ref_gen}")
    ref = llama_cpp.logits(llama_cpp.cached_llama(path), prompt + ref_gen)
    for i, (a, b) in enumerate(zip(r.tokens, ref_gen)):
        if a != b:
            top2 = np.sort(ref[len(prompt) - 1 + i])[-2:]
            assert top2[1] - top2[0] < TIE_MARGIN, f"{family} step {i}: {a} vs {b}, margin {top2[1] - top2[0]}"
            break
    else:
        assert r.tokens == ref_gen and r.finish_reason == "stop"
        assert spec.end_of_turn not in r.text


@pytest.mark.parametrize("family, change, message", [
    ("granite", dict(logit_scale=0.0), "missing metadata 'granite.logit_scale'"),
    ("olmo2", dict(tie=True), "olmo2 needs an 'output.weight' tensor"),
    ("phi3", dict(n_ff=384), "tensor 'blk.0.ffn_up.weight' has shape"),
    ("mistral3", dict(n_head_kv=3), "3 K/V heads do not divide 4 attention heads"),
    ("olmo3", dict(sliding_window=4096), "sliding window 4096 is larger than the context 2048"),
])
def test_broken_family_file_is_one_line_model_file_error(tmp_path, family, change, message):
    from engine.model.model_loader import model_args
    path = write_family_gguf(tmp_path / f"{family}.gguf", family, **change)
    if family == "phi3":   # the file says n_ff 512 while its ffn_up holds 2 x 384 rows
        path = _rewrite_key(path, tmp_path / "phi3-bad.gguf", "phi3.feed_forward_length", 512)
    with pytest.raises(ModelFileError, match=message.replace("(", r"\(")) as e:
        model_args(open_gguf(path))
    assert "\n" not in str(e.value)


def _rewrite_key(src, dst, key: str, value: int):
    import gguf
    r = gguf.GGUFReader(src)
    w = gguf.GGUFWriter(str(dst), r.fields["general.architecture"].contents())
    for k, field in r.fields.items():
        if k.startswith("GGUF.") or k == "general.architecture":
            continue
        if field.types[0] == gguf.GGUFValueType.ARRAY:
            w.add_array(k, field.contents())
        else:
            w.add_key_value(k, value if k == key else field.contents(), field.types[0])
    for t in r.tensors:
        w.add_tensor(t.name, np.array(t.data), raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


@pytest.mark.parametrize("family", ("granite", "olmo2", "mistral3", "phi3"))
def test_control_vector_steers_like_llama_cpp(files, tmp_path, family):
    """A control vector on block 1 (llama.cpp's cvec: added to the block's output, after Granite's scaled
    residual and OLMo 2's post-norms): Strata's change to the logits equals llama.cpp's. Measured: the
    vector moves logits by 3.2-5.8, Strata's change differs from llama.cpp's by 0.002-0.005."""
    import mlx.core as mx

    from engine.steer.control_vector import ControlVector, SteeringConfig, write_control_vector
    from engine.model.model_loader import load_model
    from engine.steer.steering import SteeringState, install
    if not llama_cpp.has_cvec():
        pytest.skip("this llama-cpp-python exposes no llama_set_adapter_cvec")
    path = files(family)
    n_embd, n_layer = 256, 2
    direction = (np.random.default_rng(5).standard_normal(n_embd) * 2.0).astype(np.float32)
    cv = tmp_path / "cv.gguf"
    write_control_vector(cv, {1: direction}, model_hint=FAMILIES[family].arch)
    ids = _ids(path, PROMPTS[0])
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=64, n_batch=64, logits_all=True, verbose=False)
    try:
        ref_plain = llama_cpp.logits(llm, ids)
        assert llama_cpp.set_cvec(llm, direction, n_embd, 1, 1) == 0   # direction N at n_embd * (N - 1)
        ref = llama_cpp.logits(llm, ids) - ref_plain
    finally:
        llm.close()
    model = load_model(open_gguf(path))[0]
    plain = np.array(model(mx.array(ids)[None])[0])
    install(model, SteeringState(ControlVector.load(SteeringConfig(files=((str(cv), 1.0),), layer_range=(1, 1)),
                                                    n_layer, n_embd), speed_projection=True))
    ours = np.array(model(mx.array(ids)[None])[0]) - plain
    print(f"{family}: cvec changes logits by up to {np.abs(ref).max():.3f}; Strata - llama.cpp {np.abs(ours - ref).max():.4f}")
    assert np.abs(ref).max() > 20 * LOGIT_TOL["F16"][1], "the vector must matter in llama.cpp"
    assert np.abs(ours - ref).max() < LOGIT_TOL["F16"][1], (family, float(np.abs(ours - ref).max()))

