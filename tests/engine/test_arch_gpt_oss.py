"""gpt-oss GGUFs (general.architecture "gpt-oss") on mlx-lm's gpt_oss class, against llama.cpp.

Files: tests/gguf_factory_gpt_oss.py's tiny model (2 layers, width 256, 4 heads of 64, 4 experts
top-2, sliding window 32 so the prompts below cross it, YaRN x32, sinks, biases everywhere): F16 and
gguf-py MXFP4 experts (at gpt-oss-20b's proportions, SHAPE) written here, Q8_0, Q4_K_M and MXFP4_MOE (MXFP4 experts, Q8_0 elsewhere) by llama.cpp's
own quantizer. No real gpt-oss file can be downloaded here; none was verified.

* MXFP4 blocks convert to MLX's mxfp4 bit-exactly (gguf-py's decoder is the reference) and the
  experts stay mxfp4 on MLX's gather_qmm (never dequantized).
* The model against llama.cpp: prompt ids equal, last-position and teacher-forced logits within
  measured tolerances, greedy ids equal up to the first near-tie; a control vector as llama.cpp's
  cvec (16/16 greedy tokens measured; 10 run).
* Harmony: the analysis channel comes out as reasoning, the final channel as the reply; a reply ends
  at <|return|> (not at <|end|>), through the real engine under a grammar that forces the channels.
* Bad files are refused in one line before anything is allocated.
"""
from __future__ import annotations

import functools
from pathlib import Path

import gguf
import mlx.core as mx
import numpy as np
import pytest

import gguf_factory_gpt_oss as factory
from engine.text import harmony
from engine.errors import ModelFileError
from engine.model.gguf_file import open_gguf
from engine.model.model_loader import load_model
from engine.api import GenerateRequest
from engine_reads import prompt_ids, tokenizer_of
from llama_oracle import strata_logits

FTYPES = ("F16", "Q8_0", "Q4_K_M", "MXFP4_MOE", "MXFP4_PY")


@pytest.fixture(scope="module")
def gdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("gpt_oss")


@pytest.fixture(scope="module")
def f16_engine(gdir):
    """One engine on the F16 file for the tests that need the whole engine (each start costs seconds)."""
    from engine.engine import Engine, EngineOptions
    eng = Engine(EngineOptions(model=str(_file(gdir, "F16")), cache_mib=0)).start()
    yield eng
    eng.stop()


# The gguf-py MXFP4 file has gpt-oss-20b's proportions rather than the others' square ones: width 288
# (2880 / 10, not a power of two), 8 heads of 64 (the attention is wider than the model: 512 vs 288),
# 8 experts top-4 (20b: 32 top-4).
SHAPE = {"MXFP4_PY": dict(n_embd=288, n_head=8, n_head_kv=2, head_dim=64, n_expert=8, n_expert_used=4,
                          n_ff_exp=288)}


@functools.lru_cache(maxsize=None)
def _file(d: Path, ftype: str) -> Path:
    dst = d / f"gpt-oss-{ftype}.gguf"
    if not dst.exists():
        try:
            if ftype in SHAPE:
                factory.write_tiny_gpt_oss_gguf(dst, mxfp4_experts=True, seed=3, **SHAPE[ftype])
            else:
                factory.write(dst, ftype=ftype, seed=3)
        except ImportError as e:        # llama.cpp's quantizer is the oracle's
            pytest.skip(str(e))
    return dst


# --------------------------------------------------------------------------------------------
# MXFP4 -> MLX mxfp4
# --------------------------------------------------------------------------------------------
def _mxfp4_tensor(tmp_path: Path, blocks: np.ndarray, shape: tuple[int, ...]):
    """A GGUF holding one MXFP4 tensor of the given raw blocks, read back as a ReaderTensor."""
    path = tmp_path / "mxfp4.gguf"
    w = gguf.GGUFWriter(str(path), "gpt-oss")
    w.add_tensor("t.weight", blocks.reshape(*shape[:-1], -1), raw_dtype=gguf.GGMLQuantizationType.MXFP4)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return next(t for t in gguf.GGUFReader(path).tensors if t.name == "t.weight")


@pytest.mark.parametrize("shape", [(8, 64), (3, 16, 96)])
def test_mxfp4_conversion_is_bit_exact(tmp_path, shape):
    """Random blocks (every code, exponents 0..254) decode in MLX's mxfp4 to exactly gguf-py's values,
    and a quantized matmul over them matches float64 within float32 rounding. Exponent 255 (NaN in
    the OCP MX spec; gguf-py gives 2^127, MLX inf) is left out: no real tensor has one."""
    from engine.model.quants import convert_tensor
    rng = np.random.default_rng(0)
    n_blocks = int(np.prod(shape)) // 32
    blocks = rng.integers(0, 256, size=(n_blocks, 17), dtype=np.uint8)
    blocks[:, 0] = rng.integers(0, 255, size=n_blocks)          # the e8m0 exponent byte
    blocks[:3, 0] = [0, 1, 254]                                   # the denormal and top ends
    t = _mxfp4_tensor(tmp_path, blocks, shape)
    mt = convert_tensor(t)
    assert (mt.mode, mt.bits, mt.group_size, mt.biases) == ("mxfp4", 4, 32, None)
    assert mt.weight.dtype == mx.uint32 and mt.scales.dtype == mx.uint8
    ours = np.array(mx.dequantize(mt.weight, mt.scales, None, group_size=32, bits=4, mode="mxfp4",
                                  dtype=mx.float32))
    ref = gguf.quants.dequantize(blocks.reshape(-1), gguf.GGMLQuantizationType.MXFP4).reshape(shape)
    assert ours.shape == shape
    # bit-exact, except that code 8 (e2m1's -0) is -0.0 in MLX and +0.0 in gguf-py's table (as in
    # llama.cpp's kvalues_mxfp4): equal as numbers, and the same in every product and sum
    ref = ref.astype(np.float32)
    nonzero = ref != 0
    assert np.array_equal(ours.view(np.uint32)[nonzero], ref.view(np.uint32)[nonzero])
    assert np.array_equal(ours, ref) and (ours == 0).sum() == (ref == 0).sum() > 0

    # the matmul MLX runs on them (2-D: quantized_matmul); values of a realistic range
    blocks[:, 0] = rng.integers(118, 130, size=n_blocks)
    t = _mxfp4_tensor(tmp_path, blocks, shape)
    mt = convert_tensor(t)
    ref = gguf.quants.dequantize(blocks.reshape(-1), gguf.GGMLQuantizationType.MXFP4).reshape(shape)
    x = rng.standard_normal((5, shape[-1])).astype(np.float32)
    w2, s2 = mt.weight.reshape(-1, mt.weight.shape[-1]), mt.scales.reshape(-1, mt.scales.shape[-1])
    got = np.array(mx.quantized_matmul(mx.array(x), w2, s2, None, transpose=True, group_size=32, bits=4,
                                       mode="mxfp4"))
    want = x.astype(np.float64) @ ref.reshape(-1, shape[-1]).astype(np.float64).T
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()


@pytest.mark.parametrize("ftype", FTYPES)
def test_loads(gdir, ftype):
    from mlx_lm.models.switch_layers import QuantizedSwitchLinear, SwitchLinear
    model, info = load_model(open_gguf(_file(gdir, ftype)))
    shape = SHAPE.get(ftype, dict(n_embd=256, n_head=4, n_expert=4, n_expert_used=2))
    assert (info.architecture, info.n_layer, info.n_embd, info.head_dim) == ("gpt_oss", 2, shape["n_embd"], 64)
    assert (info.n_head, model.args.num_local_experts, model.args.num_experts_per_tok) == (
        shape["n_head"], shape["n_expert"], shape["n_expert_used"])
    assert (info.n_expert, info.n_expert_used) == (shape["n_expert"], shape["n_expert_used"])   # the load reply and Status carry them
    assert "sliding window 32" in info.load_note and "YaRN x32" in info.load_note
    assert model.model.layer_types == ["sliding_attention", "full_attention"]
    sw = model.model.layers[0].mlp.experts.up_proj
    if ftype.startswith("MXFP4"):
        # native: the experts stay 4-bit mxfp4 on MLX's gather_qmm
        assert isinstance(sw, QuantizedSwitchLinear) and sw.mode == "mxfp4" and sw.bits == 4
        assert sw.weight.dtype == mx.uint32 and sw.scales.dtype == mx.uint8
        assert "MXFP4 -> mxfp4 g32 (exact)" in info.load_note
    elif ftype in ("Q8_0", "Q4_K_M"):
        assert isinstance(sw, QuantizedSwitchLinear) and (sw.mode, sw.bits) == ("affine", {"Q8_0": 8}.get(ftype, 4))
    else:
        assert isinstance(sw, SwitchLinear)
    assert model.model.layers[1].self_attn.sinks.shape == (shape["n_head"],)
    # the memory estimate counts the weights as they are held (mxfp4 experts at 4.25 bits, not float32)
    from mlx.utils import tree_flatten
    from engine.model import memory_estimate as me
    est = me.estimate(me.read_header(_file(gdir, ftype)), 4096, "float32")
    assert est.weights_bytes == sum(v.nbytes for _, v in tree_flatten(model.parameters()))


def test_memory_estimate_counts_full_and_window_kv_as_mlx_holds_it(gdir):
    """K/V grows with the context in the full blocks only; a sliding block holds its window plus one
    prefill chunk (as for Gemma: engine/model/gemma_layout.py). Checked against the caches after 1,024 tokens
    in 512-token chunks."""
    from mlx_lm.models.cache import make_prompt_cache
    from engine.model.memory_estimate import PREFILL_CHUNK, estimate, read_header
    path = _file(gdir, "F16")
    model, _ = load_model(open_gguf(path))
    cache = make_prompt_cache(model)
    ids = mx.array([[300 + i % 200 for i in range(2 * PREFILL_CHUNK)]])
    for s in range(0, ids.shape[1], PREFILL_CHUNK):
        mx.eval(model(ids[:, s:s + PREFILL_CHUNK], cache=cache))
    held = sum(c.keys.nbytes + c.values.nbytes for c in cache)
    e = estimate(read_header(path), ids.shape[1], "float32")
    print(f"gpt-oss K/V held {held} bytes, estimated {e.kv_bytes + e.window_bytes}")
    assert e.window_bytes > 0 and held <= e.kv_bytes + e.window_bytes <= 1.01 * held, (held, e.line())


# --------------------------------------------------------------------------------------------
# Against llama.cpp
# --------------------------------------------------------------------------------------------
# Tolerances as fractions of the logit scale (max |logit| of llama.cpp's): (last prompt position's
# max |dlogit|, median |dlogit| over the teacher-forced positions). Measured here (the two prompts
# below, 34+32 and 186+32 tokens, both past the 32-token window; 2026-12-01): F16 last <= 9.3e-4,
# median <= 2.3e-4 (float rounding: llama.cpp's CPU runs F16 weights on F16 activations), greedy 64/64;
# Q8_0 last <= 2.2e-2, median <= 4.5e-3, greedy 58/64; Q4_K_M (some Q6_K, requantized to 8 bits)
# last <= 7.7e-2, median <= 6.8e-3, greedy 58/64; MXFP4_MOE last <= 2.7e-2, median <= 4.9e-3,
# greedy 61/64; MXFP4_PY (20b proportions, see SHAPE) last <= 1.1e-2, median <= 2.7e-3, greedy 62/64 --
# every disagreement where llama.cpp's own top-2 margin is <= 0.13. The quantized spread is llama.cpp's 8-bit activation
# quantization in its quantized matmuls (MXFP4 and Q8_0 weights are bit-exact in MLX, see above),
# amplified by routing near-ties (one MXFP4_MOE position differs by 2.0 where an expert flips, as in
# test_moe.py): no bound on the max. Tolerances: the measured figures with ~50% headroom.
LOGIT_TOL = {"F16": (2e-3, 5e-4), "Q8_0": (4e-2, 8e-3), "Q4_K_M": (0.12, 0.012), "MXFP4_MOE": (4e-2, 8e-3),
             "MXFP4_PY": (2.5e-2, 5e-3)}
TIE_MARGIN = 0.6   # as tests/engine/test_oracle.py
N_GEN = 32
PROMPTS = ["The little boat left the harbor early in the morning, when the sea was still and grey.",
           None]   # None: the chat template's prompt (system block, user turn, "<|start|>assistant")
MESSAGES = [{"role": "user", "content": "What would they find today? It's 2024 now."}]


def _oracle():
    import llama_oracle
    llama_oracle.require()
    return llama_oracle


def _prompt_text(path: Path, prompt: str | None) -> str:
    if prompt is not None:
        return prompt
    from engine.text.chat_template import render
    return render(open_gguf(path).get("tokenizer.chat_template"), MESSAGES, add_generation_prompt=True)


@pytest.mark.oracle
def test_prompt_ids_equal_llama_cpp(gdir, f16_engine):
    """The engine's own prompt path (template, tokenizer) against llama.cpp's tokenizer on the same
    text, special tokens included; and the harmony end-of-generation set."""
    lo = _oracle()
    path = _file(gdir, "F16")
    llm = lo.Llama(model_path=str(path), n_ctx=64, vocab_only=True, verbose=False)
    ours = _prompt_tokens(f16_engine, MESSAGES)
    tok = _tokenizer(f16_engine)
    text = _prompt_text(path, None)
    assert ours == llm.tokenize(text.encode(), add_bos=False, special=True)
    tail = [factory.token_id("<|start|>")] + tok.encode("assistant")    # the generation prompt
    assert ours[-len(tail):] == tail
    for text in (PROMPTS[0], "  digits 12345 and tabs\t\n\nend", "<|channel|>final<|message|>Hi<|end|>"):
        assert tok.encode(text) == llm.tokenize(text.encode(), add_bos=False, special=True), text
    # a reply ends at <|return|> or <|call|>; <|end|> only closes a channel's message
    assert {factory.token_id("<|return|>"), factory.token_id("<|call|>")} <= tok.eos_ids
    assert factory.token_id("<|end|>") not in tok.eos_ids


def _prompt_tokens(eng, messages):
    return prompt_ids(eng, GenerateRequest(messages=messages))


def _tokenizer(eng):
    return tokenizer_of(eng.model_facts().model_path)


@pytest.mark.oracle
@pytest.mark.parametrize("ftype", FTYPES)
def test_matches_llama_cpp(gdir, ftype):
    lo = _oracle()
    path = _file(gdir, ftype)
    llm = lo.cached_llama(path)
    # the chat prompt (186 tokens) on two files, to keep the run short; every file crosses the window
    for prompt in PROMPTS if ftype in ("F16", "MXFP4_MOE") else PROMPTS[:1]:
        ids = llm.tokenize(_prompt_text(path, prompt).encode(), add_bos=False, special=True)
        gen = lo.greedy(llm, ids, N_GEN)
        seq = ids + gen
        ref, ours = lo.logits(llm, seq), strata_logits(path, seq)
        scale = float(np.abs(ref).max())
        last = float(np.abs(ref[len(ids) - 1] - ours[len(ids) - 1]).max())
        r, o = ref[len(ids) - 1:-1], ours[len(ids) - 1:-1]
        diff = np.abs(r - o)
        top2 = np.sort(r, axis=-1)[:, -2:]
        margins = top2[:, 1] - top2[:, 0]
        disagree = np.nonzero(r.argmax(-1) != o.argmax(-1))[0]
        print(f"gpt-oss {ftype} {len(ids)}+{len(gen)} tokens: last |dlogit| {last:.4f} ({last / scale:.2e} of "
              f"{scale:.1f}); median {np.median(diff):.4f} ({np.median(diff) / scale:.2e}), max {diff.max():.3f}; "
              f"greedy agrees {len(r) - len(disagree)}/{len(r)}, llama.cpp margins at disagreements "
              f"{margins[disagree].round(3).tolist()}")
        assert len(seq) > 32 + 8            # past the sliding window
        tol_last, tol_median = LOGIT_TOL[ftype]
        assert last < tol_last * scale and np.median(diff) < tol_median * scale, (last, np.median(diff), scale)
        assert all(margins[i] < TIE_MARGIN for i in disagree), (disagree, margins[disagree])


@pytest.mark.oracle
def test_engine_greedy_equals_llama_cpp_up_to_first_near_tie(gdir):
    """The whole engine (chat template, tokenizer, decode loop, rotating window cache, mxfp4 experts)
    on the MXFP4_MOE file, one token at a time past the 32-token window. Measured: 24/32 tokens equal
    before the first near-tie (llama.cpp's margin there < 0.6)."""
    from engine.engine import Engine, EngineOptions, GenerateRequest
    from engine.sampling import SamplingParams
    lo = _oracle()
    path = _file(gdir, "MXFP4_MOE")
    prompt = PROMPTS[0]
    eng = Engine(EngineOptions(model=str(path), cache_mib=0)).start()
    try:
        r = eng.call(GenerateRequest(prompt=prompt, sampling=SamplingParams(max_tokens=N_GEN, temperature=0.0)))
    finally:
        eng.stop()
    llm = lo.cached_llama(path)
    ids = llm.tokenize(prompt.encode(), add_bos=False, special=True)
    ref_gen = lo.greedy(llm, ids, N_GEN, True)
    ref = lo.logits(llm, ids + ref_gen)
    n = min(len(r.tokens), len(ref_gen))
    for i, (a, b) in enumerate(zip(r.tokens, ref_gen)):
        if a != b:
            top2 = np.sort(ref[len(ids) - 1 + i])[-2:]
            assert top2[1] - top2[0] < TIE_MARGIN, f"step {i}: {a} vs {b}, llama.cpp margin {top2[1] - top2[0]}"
            n = i
            break
    print(f"engine vs llama.cpp, gpt-oss MXFP4_MOE: {n}/{N_GEN} greedy tokens equal before the first near-tie")
    assert n >= 8 and r.tokens[:n] == ref_gen[:n]


@pytest.mark.oracle
def test_control_vector_matches_llama_cpp(gdir, tmp_path):
    """A control vector added after block 1 (llama.cpp's build_cvec after the MoE's residual add),
    through the engine and through llama.cpp's llama_set_adapter_cvec: the same greedy tokens up to
    a near-tie."""
    from engine.steer.control_vector import write_control_vector
    from test_cvec_engine import compare_add_mode
    vec = tmp_path / "v.gguf"
    rng = np.random.default_rng(4)
    write_control_vector(vec, {1: (rng.standard_normal(256) * 6.0).astype(np.float32)}, model_hint="gpt-oss")
    compare_add_mode(_file(gdir, "F16"), vec, 1.0, (1, 1), PROMPTS[0], 10, 256, min_agree=4)


# --------------------------------------------------------------------------------------------
# Harmony: reasoning apart from the reply
# --------------------------------------------------------------------------------------------
REPLY = ("<|channel|>analysis<|message|>The user asks what they find. Mention the sea.<|end|>"
         "<|start|>assistant<|channel|>final<|message|>They find **fish** and a <b>bird</b>.")


def test_harmony_split():
    ch = harmony.split(REPLY)
    assert ch == harmony.Channels("The user asks what they find. Mention the sea.",
                                  "They find **fish** and a <b>bird</b>.")
    # a tool call is neither (engine/frontends/tool_calls.py parses it); commentary preambles are reply text
    call = ("<|channel|>analysis<|message|>Need the time.<|end|><|start|>assistant<|channel|>commentary"
            " to=functions.get_time <|constrain|>json<|message|>{\"zone\": \"UTC\"}")
    assert harmony.split(call) == harmony.Channels("Need the time.", "")
    assert harmony.split("<|channel|>commentary<|message|>Checking.<|end|>") == harmony.Channels("", "Checking.")
    # no markers at all: all reply (a file that does not use the channels)
    assert harmony.split("Plain <|text") == harmony.Channels("", "Plain <|text")
    # a reply cut off inside the analysis: reasoning only
    assert harmony.split("<|channel|>analysis<|message|>Hmm") == harmony.Channels("Hmm", "")


STREAMED = [
    REPLY,
    # a message cut short by the next <|start|>, a commentary preamble, then a tool call
    "<|channel|>analysis<|message|>a b<|start|>assistant<|channel|>commentary<|message|>Checking.<|end|>"
    "<|start|>assistant<|channel|>commentary to=functions.f <|constrain|>json<|message|>{\"x\": 1}",
    # junk between messages is skipped
    "<|channel|>final<|message|>Hi<|end|>junk<|start|>assistant<|channel|>analysis<|message|>late",
    "no markers at all <|but a partial",
]


@pytest.mark.parametrize("step", [1, 3, 7, 1000])
@pytest.mark.parametrize("text", STREAMED, ids=range(len(STREAMED)))
def test_harmony_stream_gives_the_same_parts_in_order(step, text):
    cs = harmony.ChannelStream()
    items = []
    for i in range(0, len(text), step):
        items += cs.feed(text[i:i + step])
    items += cs.finish()
    got = harmony.Channels("".join(v for k, v in items if k == "reasoning"),
                           "".join(v for k, v in items if k == "content"))
    assert got == harmony.split(text)
    if text == REPLY:
        kinds = [k for k, _ in items]
        assert kinds == sorted(kinds, key=lambda k: k != "reasoning")    # all reasoning, then the reply
        assert not any("<|" in v for _, v in items)                      # no marker leaks out
    expected = {0: ("The user asks what they find. Mention the sea.", "They find **fish** and a <b>bird</b>."),
                1: ("a b", "Checking."), 2: ("late", "Hi"), 3: ("", "no markers at all <|but a partial")}
    assert tuple(got.__dict__.values()) == expected[STREAMED.index(text)]


HARMONY_GRAMMAR = (r'start: <|channel|> "analysis" <|message|> /[a-z ]{3,30}/ <|end|> <|start|> "assistant" '
                   r'<|channel|> "final" <|message|> /[A-Za-z ]{3,30}/ <|return|>')


def test_engine_reply_keeps_channels_and_ends_at_return(f16_engine):
    """The real engine on the tiny model, its tokens forced into a harmony reply by a grammar (a
    random model does not speak harmony): the markers stay in the text, <|end|> does not end the reply,
    <|return|> does, and the text splits into the reasoning and the reply."""
    from engine.generation.constraints import ConstraintSpec
    from engine.engine import GenerateRequest
    from engine.sampling import SamplingParams
    r = f16_engine.call(GenerateRequest(messages=MESSAGES, sampling=SamplingParams(max_tokens=100, temperature=0.0),
                                        constraint=ConstraintSpec.lark(HARMONY_GRAMMAR)))
    assert r.finish_reason == "stop" and r.tokens[-1] == factory.token_id("<|return|>")
    assert factory.token_id("<|end|>") in r.tokens
    assert r.text.startswith("<|channel|>analysis<|message|>") and "<|end|><|start|>assistant<|channel|>final" in r.text
    ch = harmony.split(r.text)
    assert ch.reasoning and ch.content and "<|" not in ch.reasoning + ch.content
    assert r.text == (f"<|channel|>analysis<|message|>{ch.reasoning}<|end|>"
                      f"<|start|>assistant<|channel|>final<|message|>{ch.content}")


def test_engine_tool_call_reply_parses_and_ends_at_call(gdir, f16_engine):
    """A harmony tool call as the engine writes it (tokens forced by a grammar): the reply ends at
    <|call|>, and its text, markers kept, parses into the call (engine/frontends/tool_calls.py's harmony
    family; before the markers were kept in the text it saw none)."""
    from engine.frontends import tool_calls
    from engine.generation.constraints import ConstraintSpec
    from engine.engine import GenerateRequest
    from engine.sampling import SamplingParams
    grammar = (r'start: <|channel|> "commentary to=functions.get_time " <|constrain|> "json" <|message|> '
               r'"{\"zone\": \"" /[A-Z]{3}/ "\"}" <|call|>')
    r = f16_engine.call(GenerateRequest(messages=MESSAGES, sampling=SamplingParams(max_tokens=60, temperature=0.0),
                                        constraint=ConstraintSpec.lark(grammar)))
    assert r.finish_reason == "stop" and r.tokens[-1] == factory.token_id("<|call|>")
    fmt = tool_calls.detect(open_gguf(_file(gdir, "F16")).get("tokenizer.chat_template"))
    tools = [{"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]
    parsed = tool_calls.parse(r.text, fmt, tools)
    assert fmt.name == "harmony" and [c.name for c in parsed.calls] == ["get_time"]
    assert len(parsed.calls[0].arguments["zone"]) == 3 and parsed.content == ""
    assert harmony.split(r.text) == harmony.Channels("", "")


# --------------------------------------------------------------------------------------------
# Refusals
# --------------------------------------------------------------------------------------------
def test_bad_files_are_refused_in_one_line(gdir, tmp_path):
    from test_moe import rewrite
    src = _file(gdir, "F16")
    U32 = gguf.GGUFValueType.UINT32
    cases = [
        (rewrite(src, tmp_path / "window.gguf", set_keys={"gpt-oss.attention.sliding_window": (8192, U32)}),
         "sliding window 8192 must be in 1..context length 4096"),
        (rewrite(src, tmp_path / "heads.gguf", set_keys={"gpt-oss.attention.head_count_kv": (3, U32)}),
         "3 K/V heads do not divide 4 attention heads"),
        (rewrite(src, tmp_path / "sinks.gguf", drop=("blk.1.attn_sinks",)),
         "tensor 'blk.1.attn_sinks.weight' is missing"),
        (rewrite(src, tmp_path / "experts.gguf", drop=("blk.0.ffn_down_exps.weight",)),
         "tensor 'blk.0.ffn_down_exps.weight' is missing"),
        (rewrite(src, tmp_path / "used.gguf", set_keys={"gpt-oss.expert_used_count": (9, U32)}),
         "'gpt-oss.expert_used_count' is 9, outside 1..4"),
    ]
    for path, match in cases:
        with pytest.raises(ModelFileError, match=match) as e:
            load_model(open_gguf(path))
        assert "\n" not in str(e.value) and str(e.value).startswith(path.name)


def test_server_returns_the_analysis_channel_as_reasoning_content(gdir, f16_engine):
    """The OpenAI server on the real engine, over HTTP with the openai client. A random model does
    not write channels and the server takes no grammar, so the reasoning path is checked on the
    engine's grammar-forced reply (the server's own message builder), and the HTTP journey checks that
    plain and streamed replies carry the same parts, equal to the split of the engine's own text for
    the same greedy request, and that the reply goes back as history (the gpt-oss template refuses
    channel markers in an assistant's content)."""
    import openai
    from engine.generation.constraints import ConstraintSpec
    from engine.engine import GenerateRequest
    from engine.frontends.server import ServerThread, _chat_message, create_app
    from engine.sampling import SamplingParams
    path, eng = _file(gdir, "F16"), f16_engine
    srv = ServerThread(create_app(eng)).start()
    client = openai.OpenAI(base_url=srv.base_url, api_key="unused", max_retries=0, timeout=120)
    try:
        forced = eng.call(GenerateRequest(messages=MESSAGES, sampling=SamplingParams(max_tokens=100, temperature=0.0),
                                          constraint=ConstraintSpec.lark(HARMONY_GRAMMAR)))
        ch = harmony.split(forced.text)
        message, finish = _chat_message(forced.text, "stop", None)
        assert message == {"role": "assistant", "content": ch.content, "reasoning_content": ch.reasoning}

        raw = eng.call(GenerateRequest(messages=MESSAGES, sampling=SamplingParams(max_tokens=12, temperature=0.0)))
        want = harmony.split(raw.text)
        r = client.chat.completions.create(model=path.stem, messages=MESSAGES, max_tokens=12, temperature=0)
        got = r.choices[0].message
        assert got.content == want.content and getattr(got, "reasoning_content", None) == (want.reasoning or None)
        parts = {"reasoning_content": "", "content": ""}
        for c in client.chat.completions.create(model=path.stem, messages=MESSAGES, max_tokens=12, temperature=0,
                                                stream=True):
            if c.choices:
                d = c.choices[0].delta
                parts["content"] += d.content or ""
                parts["reasoning_content"] += getattr(d, "reasoning_content", None) or ""
        assert parts == {"reasoning_content": want.reasoning, "content": want.content}
        history = MESSAGES + [{"role": "assistant", "content": got.content}, {"role": "user", "content": "And then?"}]
        assert client.chat.completions.create(model=path.stem, messages=history, max_tokens=4, temperature=0).choices
    finally:
        client.close()
        srv.stop()
