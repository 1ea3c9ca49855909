"""Gemma 4's memory-shared MTP drafter (`--spec mtp` on gemma4; engine/model/archs/gemma4_mtp.py,
engine/generation/gemma4_mtp_spec.py, issue 36) on a tiny gemma4 of tests/gguf_factory_gemma.py (sliding window 32,
layers 2 and 3 sharing the K/V of layers 0 and 1) and a tiny `gemma4-assistant` file of
tests/gguf_factory_gemma4_mtp.py beside it (random weights: its drafts are mostly rejected, which
rolls the target's windows back on almost every pass).

The drafter's logits and projected state against a numpy reference of llama.cpp's
llama_model_gemma4_assistant graph (the same K/V selected independently: the target's cache without
a window), and against llama.cpp itself running the file (all but the attention, which this binding
cannot feed the target's K/V); greedy output equal to plain decoding past the window, the K/V holding exactly the
delivered tokens; partial acceptance (steered picks) giving the plain reply; refusals by name; the
memory guard admitting the drafter's bytes before it is read.
"""
from __future__ import annotations

import functools
import math
import shutil
from pathlib import Path

import gguf
import mlx.core as mx
import numpy as np
import pytest

from engine.generation import mtp_spec, speculative
from engine.engine import Engine, EngineOptions, GenerateRequest, Status
from engine.errors import StrataError
from engine.sampling import SamplingParams
from engine_reads import while_held
from gguf_factory_gemma import write_gemma4
from gguf_factory_gemma4_mtp import write_tiny_gemma4_assistant

# 60+ prompt tokens: past the window of 32 before the first draft
PROMPT = ("the quick brown fox jumps over the lazy dog and then some more words to go past the sliding "
          "window of the tiny model")
PROMPT2 = "one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen"


@pytest.fixture(scope="module")
def mdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("g4mtp")


@functools.lru_cache(maxsize=None)
def _target(d: Path, ftype: str = "F32") -> Path:
    return write_gemma4(d / f"gemma4-{ftype}.gguf", ftype=ftype, seed=3)


@functools.lru_cache(maxsize=None)
def _pair(d: Path) -> tuple[Path, Path]:
    """The target with its drafter beside it (found by name: mtp-<model stem>.gguf)."""
    sub = d / "pair"
    sub.mkdir(exist_ok=True)
    t = Path(shutil.copy(_target(d), sub / "gemma4-F32.gguf"))
    return t, write_tiny_gemma4_assistant(sub / "mtp-gemma4-F32.gguf", tensor_type="F32")


@pytest.fixture(autouse=True)
def keep_drafting(monkeypatch):
    """A random drafter's drafts are rejected and a tiny model never gains from drafting: the never-slower
    rule would stop after MIN_JUDGE passes. The mechanics are tested here, so it never judges."""
    monkeypatch.setattr(speculative, "REMEMBER", False)
    monkeypatch.setattr(speculative, "MIN_JUDGE", 10 ** 6)


@pytest.fixture(scope="module")
def engine(mdir):
    e = Engine(EngineOptions(model=str(_pair(mdir)[0]), cache_mib=0)).start()
    assert e.call(Status(), timeout=120).model

    def no_eos(eng):            # random weights emit EOS at random: every reply runs to max_tokens
        eng.tokenizer.eos_ids = set()
    while_held(e, no_eos)
    yield e
    e.stop()


def _gen(e, text, spec, n=40, temperature=0.0, seed=None):
    sp = SamplingParams(max_tokens=n, temperature=temperature, seed=seed)
    return e.call(GenerateRequest(messages=[{"role": "user", "content": text}], sampling=sp, speculative=spec),
                  timeout=300)


def _loaded(mdir):
    from engine.model.archs.gemma4_mtp import load_assistant
    from engine.model.gguf_file import open_gguf
    from engine.model.model_loader import load_model
    t, h = _pair(mdir)
    tg = open_gguf(t)
    model, _ = load_model(tg)
    return model, load_assistant(open_gguf(h), model, tg), h


# ---- numpy reference of llama.cpp's gemma4-assistant graph -------------------------------------
def _rms(x, w, eps=1e-6):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def _gelu(x):
    return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)))


def _rope_neox(x, pos, base, n_rot, factors=None):
    """ggml_rope_ext NEOX mode: pairs (i, i + n_rot/2), theta_i = pos * base^(-2i/n_rot) / factor_i."""
    half = n_rot // 2
    inv = base ** (-np.arange(half, dtype=np.float64) * 2.0 / n_rot)
    if factors is not None:
        inv = inv / factors.astype(np.float64)
    th = pos * inv
    c, s = np.cos(th), np.sin(th)
    a, b = x[..., :half].astype(np.float64), x[..., half:n_rot].astype(np.float64)
    out = x.astype(np.float64).copy()
    out[..., :half], out[..., half:n_rot] = a * c - b * s, a * s + b * c
    return out


def _reference_step(path: Path, target_embd: np.ndarray, h: np.ndarray, tok: int, kv: dict, pos: int):
    """(logits, h_next) of one drafter step, from the GGUF's tensors (F32) as llama.cpp's graph reads them."""
    r = gguf.GGUFReader(str(path))
    W = {t.name: np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32) for t in r.tensors}

    def f(k):
        v = r.fields[f"gemma4-assistant.{k}"]
        return v.parts[v.data[0]] if len(v.data) == 1 else [v.parts[i][0] for i in v.data]
    n_layer, n_head = int(f("block_count")[0]), int(f("attention.head_count")[0])
    sliding = [bool(x) for x in f("attention.sliding_window_pattern")]
    base, base_swa = float(f("rope.freq_base")[0]), float(f("rope.freq_base_swa")[0])
    nb = target_embd.shape[1]
    x = np.concatenate([target_embd[tok] * math.sqrt(nb), h])
    x = W["nextn.pre_projection.weight"] @ x
    for i in range(n_layer):
        p = f"blk.{i}."
        k, v = kv[sliding[i]]                           # (Hkv, S, D)
        hkv, _, d = k.shape
        q = (W[p + "attn_q.weight"] @ _rms(x, W[p + "attn_norm.weight"])).reshape(n_head, d)
        q = _rms(q, W[p + "attn_q_norm.weight"])
        q = _rope_neox(q, pos, base_swa, d) if sliding[i] else _rope_neox(q, pos, base, d, W["rope_freqs.weight"])
        o = np.empty((n_head, d))
        for j in range(n_head):
            kj, vj = k[j // (n_head // hkv)], v[j // (n_head // hkv)]
            s = kj @ q[j]                               # scale 1 (Gemma 4)
            a = np.exp(s - s.max())
            o[j] = (a / a.sum()) @ vj
        att = W[p + "attn_output.weight"] @ o.reshape(-1)
        x = x + _rms(att, W[p + "post_attention_norm.weight"])
        y = _rms(x, W[p + "ffn_norm.weight"])
        y = W[p + "ffn_down.weight"] @ (_gelu(W[p + "ffn_gate.weight"] @ y) * (W[p + "ffn_up.weight"] @ y))
        x = (x + _rms(y, W[p + "post_ffw_norm.weight"])) * W[p + "layer_output_scale.weight"][0]
    y = _rms(x, W["output_norm.weight"])
    return W["token_embd.weight"] @ y, W["nextn.post_projection.weight"] @ y


def test_drafter_step_matches_a_numpy_reference_of_llama_cpps_graph(mdir):
    """Two chained steps at position p + 1 (the chosen token's) over a prompt past the window: the
    drafter (the tap after a chunked prefill into mlx-lm's rotating window caches) against numpy over
    the target's K/V kept whole (the sliding layer's positions p + 1 - k < 32 picked by position). Measured in float32: logits max |d| 8.3e-6 and
    1.2e-5 on spreads of 14 and 12; h_next 5e-6 and 4e-6 of 3.0 and 3.3 (tolerance 1e-4 of the spread /
    the size)."""
    from mlx_lm.models.cache import KVCache, make_prompt_cache

    from engine.generation import generate
    model, head, hpath = _loaded(mdir)
    d = mtp_spec.drafter_for(head, model, hpath, draft_len=2)
    rng = np.random.default_rng(0)
    toks = [int(x) for x in rng.integers(10, 250, size=70)]
    cache, fed = make_prompt_cache(model), []
    generate.prefill(d.target, cache, toks[:-2], fed, chunk=16, first=16)
    d.target(mx.array([toks[-2]])[None], cache=cache)      # the plain pass before a propose
    p = len(toks) - 2
    kv = d.shared_kv(p + 1)
    assert kv[True][0].shape[2] == 31 and kv[False][0].shape[2] == p + 1

    # the reference's K/V: the target over the same tokens with no window (every position kept)
    from engine.generation.gemma4_mtp_spec import target_layers
    whole = [KVCache() for _ in cache]
    model.model(mx.array(toks[:-1])[None], cache=whole)
    idx = target_layers(model)
    np_kv = {s: (np.array(whole[i].keys[0, :, :p + 1]), np.array(whole[i].values[0, :, :p + 1])) for s, i in idx.items()}
    np_kv[True] = tuple(a[:, p + 2 - 32:] for a in np_kv[True])
    h_ref = np.array(model.model(mx.array(toks[:-1])[None], cache=None)[0, -1])
    h = d.target.row(p)
    assert float(np.max(np.abs(np.array(h[0, 0]) - h_ref))) < 1e-4
    embd = np.array(model.model.embed_tokens.weight)

    tok = toks[-1]
    for _ in range(2):
        logits, h = head.step(h, mx.array([[tok]]), kv, p + 1)
        ref_logits, ref_h = _reference_step(hpath, embd, h_ref, tok, np_kv, p + 1)
        got = np.array(logits)
        spread = float(ref_logits.max() - ref_logits.min())
        err = float(np.max(np.abs(got - ref_logits)))
        assert spread > 1.0 and err < 1e-4 * spread, (err, spread)
        assert int(np.argmax(got)) == int(np.argmax(ref_logits))
        assert float(np.max(np.abs(np.array(h[0, 0]) - ref_h))) < 1e-4 * float(np.max(np.abs(ref_h)))
        h_ref, tok = ref_h, int(np.argmax(ref_logits))


def test_greedy_equals_plain_past_the_window_and_the_kv_holds_the_delivered_tokens(engine):
    for text in (PROMPT, PROMPT2):
        plain = _gen(engine, text, "off")
        r = _gen(engine, text, "mtp")
        assert r.tokens == plain.tokens and len(r.tokens) == 40
        assert r.speculative == "mtp" and r.drafted_tokens > 0 and not r.speculation_stopped
        live = engine.conversations.live
        prompt = engine.prompts.prompt_tokens(GenerateRequest(messages=[{"role": "user", "content": text}]))
        assert live.tokens == (prompt + r.tokens)[:len(live.tokens)]
        offs = [c.offset for c in live.cache if isinstance(getattr(c, "offset", None), int)]
        assert offs and all(o == len(live.tokens) for o in offs)
    assert "Gemma 4 MTP drafter" in engine.drafts.mtp_note and engine.drafts.mtp_path.name == "mtp-gemma4-F32.gguf"


def test_sampled_mtp_runs_and_keeps_bookkeeping(engine):
    r = _gen(engine, PROMPT, "mtp", n=24, temperature=0.8, seed=3)
    assert len(r.tokens) == 24 and r.drafted_tokens > 0
    live = engine.conversations.live
    offs = [c.offset for c in live.cache if isinstance(getattr(c, "offset", None), int)]
    assert all(o == len(live.tokens) for o in offs)


def test_partial_acceptance_gives_the_plain_reply(mdir):
    """The drafter's choices steered from the plain reply (per pass both drafts right, the first only, or
    none): the speculated reply equals it, drafts are accepted, and the target's windows roll back
    through layer_cache where a pass wrapped them."""
    from mlx_lm.models.cache import make_prompt_cache

    from engine.generation import generate
    from engine.generation.gemma4_mtp_spec import Gemma4Drafter
    model, head, hpath = _loaded(mdir)
    rng = np.random.default_rng(1)
    prompt = [int(x) for x in rng.integers(10, 250, size=40)]
    greedy = SamplingParams(temperature=0.0)

    def run(drafter=None, n=40):
        cache, fed = make_prompt_cache(model), []
        generate.prefill(drafter.target if drafter else model, cache, prompt[:-1], fed, chunk=16, first=16)
        spec = speculative.SpecStats("mtp")
        if drafter is None:
            steps = generate.decode(model, cache, prompt[-1], fed, history=prompt, sampler=greedy.sampler(None),
                                    processors=[], max_tokens=n, stats=generate.StepStats())
        else:
            steps = speculative.decode(drafter.target, cache, prompt[-1], fed, history=prompt, sampling=greedy,
                                       processors=[], max_tokens=n, stats=generate.StepStats(), spec=spec,
                                       drafter=drafter)
        return list(steps), fed, cache, spec

    ref, _, _, _ = run()
    passes = []

    class Steered(Gemma4Drafter):
        def propose(self, context, k, target_dist=None):
            self.at, self.i = len(context) - len(prompt), 0
            passes.append(len(context))
            return super().propose(context, k, target_dist)

        def pick(self, logits, target_dist):
            super().pick(logits, target_dist)          # the drafter's own choice is computed, then replaced
            j, self.i = self.at + self.i, self.i + 1
            right = ref[j] if j < len(ref) else 0
            kind = len(passes) % 3                      # 0: both right, 1: the first only, 2: none
            ok = kind == 0 or (kind == 1 and self.i == 1)
            return (right if ok else (right + 1) % 500), None

    d = Steered(head, model, hpath, draft_len=2)
    out, fed, cache, spec = run(d)
    assert out == ref
    assert fed == (prompt + out)[:len(fed)]
    assert all(c.offset == len(fed) for c in cache)
    assert spec.drafted > spec.accepted > 0 and spec.passes >= 8
    assert d.head_passes == spec.drafted


def test_refusals_are_one_line_by_name(mdir, engine, tmp_path):
    t, _ = _pair(mdir)
    cases = [
        (dict(n_embd_target=192), r"does not match gemma4-F32\.gguf \(target width 192 vs 256\)"),
        (dict(n_vocab=300), r"\(vocabulary 300 vs \d+\)"),
        (dict(head_dim=32), r"\(sliding head size 32 vs 64\)"),
        (dict(n_head_kv=1), r"\(global K/V heads 1 vs 2\)"),
        (dict(sliding_window=16), r"\(sliding window 16 vs 32\)"),
        (dict(nextn=2), r"nextn_predict_layers 2 is not block_count 4"),
        (dict(extra={"blk.0.attn_k.weight": np.zeros((64, 128), np.float32)}),
         r"unexpected tensor 'blk\.0\.attn_k\.weight' in a Gemma 4 MTP drafter"),
    ]
    for i, (kw, pattern) in enumerate(cases):
        bad = write_tiny_gemma4_assistant(tmp_path / f"bad{i}.gguf", tensor_type="F32", **kw)
        with pytest.raises(StrataError, match=pattern) as err:
            _gen(engine, "hi", f"mtp:{bad}", n=4)
        assert "\n" not in str(err.value) and str(err.value).startswith("speculative mtp: bad")
    # a file of another architecture, and the model itself, as the drafter
    with pytest.raises(StrataError, match="a Gemma 4 MTP drafter is a 'gemma4-assistant' file, not 'gemma4'"):
        _gen(engine, "hi", f"mtp:{_target(mdir, 'F16')}", n=4)
    with pytest.raises(StrataError, match="is the model itself"):
        _gen(engine, "hi", f"mtp:{t}", n=4)
    assert len(_gen(engine, "hi", "off", n=4).tokens) == 4          # the plain reply still works
    # a gemma4 with no drafter beside it
    e = Engine(EngineOptions(model=str(_target(mdir)), cache_mib=0)).start()
    try:
        assert e.call(Status(), timeout=120).model
        with pytest.raises(StrataError, match=r"no mtp-\*\.gguf beside it \(Gemma 4's drafter: llama\.cpp's "
                                              r"gemma4-assistant GGUF\)"):
            _gen(e, "hi", "mtp", n=4)
    finally:
        e.stop()


def test_memory_guard_admits_the_drafters_bytes_before_reading_it(mdir):
    """load_mtp asks the guard for the drafter's bytes (equal to its loaded parameters, F32 in float32)
    after the by-name checks and before any tensor is read; a refusal leaves nothing loaded. The drafter
    adds no K/V: it reads the target's."""
    from mlx.utils import tree_flatten

    from engine.generation import mtp_spec
    from engine.model.archs.gemma4_mtp import assistant_bytes
    from engine.errors import MemoryRefused
    model, head, hpath = _loaded(mdir)
    # the parameters, and rope_freqs.weight (64 F32 factors), which the global blocks' RoPE holds
    held = sum(v.nbytes for _, v in tree_flatten(head.parameters())) + 64 * 4
    assert assistant_bytes(hpath) == held
    asked = []

    def refuse(n):
        asked.append(n)
        raise MemoryRefused("mtp head: no room")
    with pytest.raises(MemoryRefused, match="no room"):
        mtp_spec.load_mtp(_pair(mdir)[0], model, mx.float32, admit=refuse)
    assert asked == [held]
    loaded = mtp_spec.load_mtp(_pair(mdir)[0], model, mx.float32, admit=asked.append)
    assert asked == [held, held] and loaded.head.args.n_layer == 4
    d = mtp_spec.drafter_for(loaded.head, model, loaded.path)
    assert type(d).__name__ == "Gemma4Drafter" and d.held == 0


# ---- llama.cpp's own gemma4-assistant graph -----------------------------------------------------
# The child process (a native crash costs this test only, as tests/llama_oracle.py's worker): the target
# reads positions 0..p (its final hidden state at p from the embeddings output), then a gemma4-assistant
# context made with ctx_other = the target's context takes one row (token, hidden state) at `pos`.
_CHILD = r"""
import ctypes, sys
import numpy as np
import llama_cpp as L
target, drafter, out, pos = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
toks = [int(x) for x in sys.argv[5].split(",")]
L.llama_backend_init()
mp = L.llama_model_default_params()
tm, dm = (L.llama_model_load_from_file(p.encode(), mp) for p in (target, drafter))
cp = L.llama_context_default_params()
cp.n_ctx = cp.n_batch = cp.n_ubatch = 256
cp.n_threads = cp.n_threads_batch = 2
cp.embeddings = True
tc = L.llama_init_from_model(tm, cp)
# the hidden state llama.cpp's draft-mtp driver hands the drafter (llama_get_embeddings_nextn_ith: a C++
# staging API of llama-ext.h, exported under its C++ name; the binding does not wrap it)
lib = L.llama_cpp._lib
set_nextn = getattr(lib, "_Z26llama_set_embeddings_nextnP13llama_contextbb")
set_nextn.argtypes, set_nextn.restype = [ctypes.c_void_p, ctypes.c_bool, ctypes.c_bool], None
get_nextn = getattr(lib, "_Z30llama_get_embeddings_nextn_ithP13llama_contexti")
get_nextn.argtypes, get_nextn.restype = [ctypes.c_void_p, ctypes.c_int32], ctypes.POINTER(ctypes.c_float)
set_nextn(tc, True, False)
n = len(toks) - 1
b = L.llama_batch_init(n, 0, 1)
for i in range(n):
    b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = toks[i], i, 1, i == n - 1
    b.seq_id[i][0] = 0
b.n_tokens = n
assert L.llama_decode(tc, b) == 0
nb = L.llama_model_n_embd(tm)
h = np.ctypeslib.as_array(L.llama_get_embeddings_ith(tc, n - 1), shape=(nb,)).copy()
h_nextn = np.ctypeslib.as_array(get_nextn(tc, n - 1), shape=(nb,)).copy()
dp = L.llama_context_default_params()
dp.n_ctx = dp.n_batch = dp.n_ubatch = 256
dp.n_threads = dp.n_threads_batch = 2
dp.ctx_type, dp.ctx_other = L.LLAMA_CONTEXT_TYPE_MTP, tc
dc = L.llama_init_from_model(dm, dp)
be = L.llama_batch_ext_init(dc)
idx = L.llama_batch_ext_add_token(be, 0, toks[-1])
buf = (ctypes.c_float * nb)(*h.tolist())
e = L.llama_embd()
e.data, e.n_rows, e.n_embd = ctypes.cast(buf, ctypes.POINTER(ctypes.c_float)), 1, nb
assert L.llama_batch_ext_set_embd_token(be, idx, e)
assert L.llama_batch_ext_set_pos(be, idx, (L.llama_pos * 1)(pos))
assert L.llama_batch_ext_set_output_logits(be, idx, True)
assert L.llama_process(dc, L.LLAMA_PROCESS_TYPE_DECODE, be) == 0
nv = L.llama_vocab_n_tokens(L.llama_model_get_vocab(dm))
np.savez(out, h=h, h_nextn=h_nextn, logits=np.ctypeslib.as_array(L.llama_get_logits_ith(dc, 0), shape=(nv,)).copy())
"""


@pytest.mark.oracle
def test_llama_cpp_runs_the_drafter_file_and_its_graph_matches_the_step(mdir, tmp_path):
    """llama.cpp (the oracle's libllama has llama_model_gemma4_assistant) loads the factory's drafter
    file and runs its graph on (token, target hidden state): Strata's step on the same inputs gives the
    same logits; the hidden state its draft-mtp driver takes from a gemma4 target (h_nextn) is the
    output after the final norm, the row Strata's tap keeps. What this binding cannot give the draft context is the target's K/V: the context made
    with ctx_other shares the target's K/V tensors ("sharing with layer 3" in its log: the target's last
    layer of each kind, as here) but not its cells, which llama.cpp's server driver keeps in step, so its
    attention sees no key and adds nothing. The comparison is therefore with Strata's step over value
    rows of zeros (attention adds nothing either): the pre-projection of [target embedding x sqrt(nb),
    h], the blocks' norms, FFN, output scales, the final norm and the tied head; the attention itself is
    checked against the numpy reference above. Measured: max |d| 3.1e-3 on a logit spread of 12 (ggml's
    CPU GELU goes through a float16 table), the same argmax; the pre-projection's inputs swapped give
    10.1, a zero hidden state 4.4."""
    import json
    import subprocess
    import sys

    import llama_oracle
    llama_oracle.require()
    model, head, hpath = _loaded(mdir)
    t, _ = _pair(mdir)
    rng = np.random.default_rng(0)
    toks = [int(x) for x in rng.integers(10, 250, size=40)]
    out = tmp_path / "llama.npz"
    pos = len(toks) - 1
    r = subprocess.run([sys.executable, "-c", _CHILD, str(t), str(hpath), str(out), str(pos), ",".join(map(str, toks))],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    ref = np.load(out)
    # what llama.cpp's driver feeds the drafter is the target's output after its final norm (what the
    # tap keeps): equal to the embeddings output
    assert np.array_equal(ref["h_nextn"], ref["h"])
    # the target's hidden state itself: llama.cpp's against Strata's (test_arch_gemma checks the logits)
    from mlx_lm.models.cache import make_prompt_cache
    h_s = np.array(model.model(mx.array(toks[:-1])[None], cache=make_prompt_cache(model))[0, -1])
    assert float(np.max(np.abs(h_s - ref["h"]))) < 1e-2 * float(np.max(np.abs(ref["h"]))), json.dumps(
        float(np.max(np.abs(h_s - ref["h"]))))
    kv = {s: (mx.random.normal((1, 2, 5, 64 if s else 128)), mx.zeros((1, 2, 5, 64 if s else 128))) for s in (True, False)}
    logits, _ = head.step(mx.array(ref["h"])[None, None], mx.array([[toks[-1]]]), kv, pos)
    got, want = np.array(logits), ref["logits"]
    spread = float(want.max() - want.min())
    err = float(np.max(np.abs(got - want)))
    assert spread > 1.0 and err < 1e-3 * spread, (err, spread)
    assert int(np.argmax(got)) == int(np.argmax(want))


def test_greedy_equals_plain_with_8_bit_kv(mdir):
    """With 8-bit K/V the drafter reads the global layer's quantized cache (dequantized) and the window
    as it is (mlx-lm's RotatingKVCache stays float): greedy output still equals plain decoding."""
    e = Engine(EngineOptions(model=str(_pair(mdir)[0]), cache_mib=0, kv_bits=8)).start()
    try:
        assert e.call(Status(), timeout=120).model

        def no_eos(eng):
            eng.tokenizer.eos_ids = set()
        while_held(e, no_eos)
        plain = _gen(e, PROMPT, "off", n=24)
        r = _gen(e, PROMPT, "mtp", n=24)
        assert r.tokens == plain.tokens and r.drafted_tokens > 0
        kinds = while_held(e, lambda eng: sorted({type(c).__name__ for c in eng.conversations.live.cache}))
        assert any("Quantized" in k for k in kinds), kinds
    finally:
        e.stop()


def test_cli_spec_mtp(mdir, capsys):
    """`strata generate --spec mtp` on a gemma4 with its drafter beside it: the same tokens as --spec off
    (EOS may end both early: random weights; equal either way), the mode in --json."""
    import json

    from engine.frontends.cli import main
    outs = {}
    for spec in ("off", "mtp"):
        code = main(["generate", "--model", str(_pair(mdir)[0]), "--prompt", PROMPT, "--json",
                     "--max-tokens", "8", "--spec", spec])
        out, err = capsys.readouterr()
        assert code == 0, err
        outs[spec] = json.loads(out)
    assert outs["mtp"]["tokens"] == outs["off"]["tokens"] and outs["mtp"]["speculative"] == "mtp"


@pytest.mark.oracle
def test_a_q8_0_drafter_quantized_by_llama_cpp_loads_and_drafts(mdir, engine):
    """llama.cpp's quantizer writes a Q8_0 drafter (blocks, projections and the tied embedding Q8_0,
    norms F32): it loads kept quantized (8-bit affine, exact for Q8_0), the guard's bytes equal what is
    held, its step equals the numpy reference over the file's dequantized weights (measured: logits
    max |d| 1.2e-5 on a spread of 12; the Q8_0 drafter against the F32 one differs by 0.16), and greedy
    output through it equals plain decoding."""
    from mlx.utils import tree_flatten
    from mlx_lm.models.cache import make_prompt_cache

    from engine.model.archs.gemma4_mtp import assistant_bytes, load_assistant
    from engine.model.gguf_file import open_gguf
    from gguf_factory_gemma4_mtp import write_gemma4_assistant
    import llama_oracle
    llama_oracle.require()
    q = write_gemma4_assistant(mdir / "q8" / "mtp-q8.gguf", ftype="Q8_0")
    model, head, hpath = _loaded(mdir)
    tg = open_gguf(_pair(mdir)[0])
    hq = load_assistant(open_gguf(q), model, tg)
    assert type(hq.layers[0].q_proj).__name__ == "QuantizedLinear" and hq.layers[0].q_proj.bits == 8
    assert type(hq.embed_tokens).__name__ == "QuantizedEmbedding"
    assert assistant_bytes(q) == sum(v.nbytes for _, v in tree_flatten(hq.parameters())) + 64 * 4
    d = mtp_spec.drafter_for(head, model, hpath)
    toks = [int(x) for x in np.random.default_rng(2).integers(10, 250, size=50)]
    cache = make_prompt_cache(model)
    d.target(mx.array(toks[:-1])[None], cache=cache)
    p = len(toks) - 2
    kv, h = d.shared_kv(p + 1), d.target.row(p)
    got, _ = hq.step(h, mx.array([[toks[-1]]]), kv, p + 1)
    np_kv = {s: (np.array(k[0]), np.array(v[0])) for s, (k, v) in kv.items()}
    want, _ = _reference_step(q, np.array(model.model.embed_tokens.weight), np.array(h[0, 0]), toks[-1], np_kv, p + 1)
    got = np.array(got)
    spread = float(want.max() - want.min())
    err = float(np.max(np.abs(got - want)))
    assert spread > 1.0 and err < 1e-4 * spread, (err, spread)
    plain = _gen(engine, PROMPT2, "off", n=24)
    r = _gen(engine, PROMPT2, f"mtp:{q}", n=24)
    assert r.tokens == plain.tokens and r.drafted_tokens > 0


def test_loading_the_drafter_as_a_model_is_refused_by_name(mdir):
    e = Engine(EngineOptions(model=str(_pair(mdir)[1]), cache_mib=0)).start()
    try:
        with pytest.raises(StrataError, match=r"mtp-gemma4-F32\.gguf: a Gemma 4 MTP drafter, not a model: load its "
                                              r"gemma4 model and use --spec mtp"):
            e.startup.result()
    finally:
        e.stop()
