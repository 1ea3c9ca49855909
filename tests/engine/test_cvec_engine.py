"""Control vectors through the whole engine, with real files: off == stock, on != off, the same
greedy tokens as llama.cpp in add mode, `cvec train` round trips, the CLI, and cache identity.

Most tests run a 4-layer tiny model (width 64); the real-model ones are short and marked
real_model; the llama.cpp comparisons are marked oracle."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest

from engine.frontends.cli import main
from engine.steer.control_vector import ControlVector, SteeringConfig, write_control_vector
from engine.engine import Engine, EngineOptions, GenerateRequest, RestoreSession, SaveSession, Status
from engine.errors import StrataError
from engine.sampling import SamplingParams
from engine_reads import while_held, prompt_ids

REPO = Path(__file__).resolve().parents[2]
STRATA = [sys.executable, "-m", "engine.cli"]
SHIPPED = REPO / "resources" / "control-vectors" / "smollm2-135m-concise.gguf"
N_LAYER, N_EMBD = 4, 64
TIE_MARGIN = 0.6          # as tests/engine/test_oracle.py: a closer race in llama.cpp has no single right answer
CHAT = [{"role": "user", "content": "Tell me a short story about a cat who learns to fly."}]
RAW = "Once upon a time, in a small village by the sea,"


def greedy(n=12):
    return SamplingParams(max_tokens=n, temperature=0.0)


@pytest.fixture(scope="module")
def tiny4(tmp_path_factory) -> Path:
    from gguf_factory import write_tiny_gguf
    return write_tiny_gguf(tmp_path_factory.mktemp("cvec-tiny") / "tiny4.gguf", arch="llama", n_layer=N_LAYER,
                           n_embd=N_EMBD, n_head=4, n_head_kv=2, n_ff=128, seed=5)


@pytest.fixture(scope="module")
def strong_vec(tmp_path_factory) -> Path:
    """A strong random vector for every steerable block of tiny4 (direction.1..3)."""
    rng = np.random.default_rng(21)
    d = {n: (rng.standard_normal(N_EMBD) * 3.0).astype(np.float32) for n in range(1, N_LAYER)}
    path = tmp_path_factory.mktemp("cvec-files") / "strong.gguf"
    write_control_vector(path, d, model_hint="llama")
    return path


def start(model, steering=None, **kw) -> Engine:
    eng = Engine(EngineOptions(model=str(model), steering=steering, **kw)).start()
    st = eng.call(Status())
    assert st.model is not None, "the model did not load"
    return eng


@pytest.fixture(scope="module")
def stock(tiny4):
    eng = start(tiny4, cache_mib=0)
    yield eng
    eng.stop()


@pytest.fixture(scope="module")
def steered(tiny4, strong_vec):
    eng = start(tiny4, SteeringConfig(files=((str(strong_vec), 2.0),), mode="project"), cache_mib=0)
    yield eng
    eng.stop()


# ------------------------------------------------------------------ (a) off == stock, (b) on != off
@pytest.mark.parametrize("kind", ["chat", "raw"])
def test_off_is_token_for_token_stock_on_tiny(stock, steered, kind):
    kw = {"messages": CHAT} if kind == "chat" else {"prompt": RAW}
    ref = stock.call(GenerateRequest(**kw, sampling=greedy(16)))
    off = steered.call(GenerateRequest(**kw, sampling=greedy(16), speed_projection=False))
    assert off.speed_projection is False and ref.speed_projection is False
    assert off.tokens == ref.tokens and off.text == ref.text
    assert len(ref.tokens) == 16


def test_on_differs_from_off_on_tiny(steered):
    on = steered.call(GenerateRequest(prompt=RAW, sampling=greedy(16), speed_projection=True))
    off = steered.call(GenerateRequest(prompt=RAW, sampling=greedy(16), speed_projection=False))
    default = steered.call(GenerateRequest(prompt=RAW, sampling=greedy(16)))   # the engine's default: on
    assert on.speed_projection is True and off.speed_projection is False
    assert on.tokens != off.tokens
    assert default.tokens == on.tokens
    # The switch really is per request: back to off gives the stock reply again.
    assert steered.call(GenerateRequest(prompt=RAW, sampling=greedy(16), speed_projection=False)).tokens == off.tokens


def test_status_reports_the_vector(steered, stock):
    assert steered.call(Status()).steering == "control vector mode = project, dir = per-layer, layers 1..3 (3 steered)"
    assert stock.call(Status()).steering is None


@pytest.mark.real_model
def test_off_is_stock_on_the_real_model(real_model):
    if not SHIPPED.exists():
        pytest.skip(f"{SHIPPED} is not built")
    msgs = [{"role": "user", "content": "What is a black hole?"}]
    eng = start(real_model, cache_mib=0)
    try:
        ref = eng.call(GenerateRequest(messages=msgs, sampling=greedy(8)))
    finally:
        eng.stop()
    eng = start(real_model, SteeringConfig(files=((str(SHIPPED), 2.0),), mode="project", layer_range=(4, 20)),
                cache_mib=0)
    try:
        off = eng.call(GenerateRequest(messages=msgs, sampling=greedy(8), speed_projection=False))
        on = eng.call(GenerateRequest(messages=msgs, sampling=greedy(8), speed_projection=True))
    finally:
        eng.stop()
    assert off.tokens == ref.tokens and len(ref.tokens) == 8
    assert on.speed_projection is True   # (whether 8 tokens differ is the effect bench's business)


# ------------------------------------------------------------------ (c) llama.cpp add mode, whole engine
def _llama_cpp():
    import llama_oracle       # llama.cpp in a worker process: a native crash fails one test, not the run
    llama_oracle.require()
    if not llama_oracle.has_cvec():
        pytest.skip("this llama-cpp-python exposes no llama_set_adapter_cvec")
    return llama_oracle


def flat_buffer(path, n_embd, scale=1.0) -> np.ndarray:
    """common_control_vector_load_one's layout, from the file read with gguf-py: direction.N at
    offset n_embd * (N - 1), multiplied by the scale; several direction.N for one N add up."""
    r = gguf.GGUFReader(str(path))
    top = max(int(t.name.split(".")[1]) for t in r.tensors)
    buf = np.zeros(n_embd * top, np.float32)
    for t in r.tensors:
        n = int(t.name.split(".")[1])
        assert n >= 1 and t.tensor_type == gguf.GGMLQuantizationType.F32
        buf[n_embd * (n - 1): n_embd * n] += np.asarray(t.data, np.float32) * np.float32(scale)
    return buf


class LlamaCvec:
    """llama.cpp (llama-cpp-python, in the oracle's worker process) with a control vector applied as
    llama.cpp's loader does."""

    def __init__(self, model, n_embd):
        self.oracle = _llama_cpp()
        self.llm = self.oracle.Llama(model_path=str(model), n_ctx=256, n_batch=256, logits_all=True,
                                     verbose=False, n_threads=2)
        self.n_embd = n_embd

    def set(self, path=None, scale=1.0, layer_range=(1, -1)) -> int:
        if path is None:
            return self.oracle.set_cvec(self.llm, None, self.n_embd)
        return self.oracle.set_cvec(self.llm, flat_buffer(path, self.n_embd, scale), self.n_embd, *layer_range)

    def greedy(self, ids, n) -> list[int]:
        # The worker resets first: never reuse K/V computed under another vector.
        return self.oracle.greedy(self.llm, ids, n, stop_at_eos=True)

    def logits(self, ids) -> np.ndarray:
        return self.oracle.logits(self.llm, ids).astype(np.float64)

    def close(self):
        self.llm.close()


def agree_up_to_near_tie(ours: list[int], ref: list[int], ref_logits: np.ndarray, n_prompt: int) -> int:
    """Number of leading tokens compared before the first disagreement (asserted to be a near-tie
    in llama.cpp) or the end."""
    for i, (a, b) in enumerate(zip(ours, ref)):
        if a != b:
            top2 = np.sort(ref_logits[n_prompt - 1 + i])[-2:]
            margin = top2[1] - top2[0]
            assert margin < TIE_MARGIN, f"step {i}: strata {a} vs llama.cpp {b}, llama.cpp margin {margin:.3f}"
            return i
    assert len(ours) == len(ref), (ours, ref)
    return len(ours)


def compare_add_mode(model, vec_path, scale, layer_range, prompt, n_gen, n_embd, min_agree):
    """The same file in add mode through llama.cpp and through the Strata engine: same greedy tokens."""
    cfg = SteeringConfig(files=((str(vec_path), scale),), mode="add", layer_range=layer_range)
    eng = start(model, cfg, cache_mib=0)
    try:
        ids = prompt_ids(eng, GenerateRequest(prompt=prompt))
        ours = eng.call(GenerateRequest(prompt=prompt, sampling=greedy(n_gen))).tokens
        stock_ours = eng.call(GenerateRequest(prompt=prompt, sampling=greedy(n_gen), speed_projection=False)).tokens
    finally:
        eng.stop()
    cpp = LlamaCvec(model, n_embd)
    try:
        assert cpp.set(None) == 0
        plain = cpp.greedy(ids, n_gen)
        assert cpp.set(vec_path, scale, layer_range) == 0
        ref = cpp.greedy(ids, n_gen)
        ref_logits = cpp.logits(ids + ref)
    finally:
        cpp.close()
    assert ref != plain, "the vector changes nothing in llama.cpp: the comparison would prove nothing"
    assert ours != stock_ours
    n = agree_up_to_near_tie(ours, ref, ref_logits, len(ids))
    first_change = next((i for i, (a, b) in enumerate(zip(ref, plain)) if a != b), len(ref))
    print(f"add mode x{scale} layers {layer_range}: {n}/{len(ref)} greedy tokens agree with llama.cpp "
          f"(the vector changes llama.cpp's reply from token {first_change})")
    assert n >= min_agree and n > first_change, \
        f"only {n} tokens compared; the vector acts from token {first_change}"


@pytest.mark.oracle
@pytest.mark.parametrize("layer_range", [(1, 3), (2, 2), (3, 3)])
def test_add_mode_same_greedy_tokens_as_llama_cpp_tiny(tiny4, strong_vec, layer_range):
    compare_add_mode(tiny4, strong_vec, 1.0, layer_range, RAW, 16, N_EMBD, min_agree=4)


@pytest.mark.oracle
@pytest.mark.real_model
def test_add_mode_same_greedy_tokens_as_llama_cpp_real(real_model):
    if not SHIPPED.exists():
        pytest.skip(f"{SHIPPED} is not built")
    prompt = "<|im_start|>user\nWhat is a black hole?<|im_end|>\n<|im_start|>assistant\n"
    # x0.5 on blocks 4..12 changes SmolLM2's reply from its 6th token (measured with llama.cpp).
    compare_add_mode(real_model, SHIPPED, 0.5, (4, 12), prompt, 16, 576, min_agree=8)


# ------------------------------------------------------------------ (d) cvec train
POS = ["Explain in great detail, at length, what the sun is.", "Write a long essay about rivers.",
       "Describe the ocean thoroughly, with many examples."]
NEG = ["In one word, what is the sun?", "In one sentence, what is a river?", "Briefly: the ocean?"]


def _prompt_files(tmp_path, pos=POS, neg=NEG):
    p, n = tmp_path / "pos.txt", tmp_path / "neg.txt"
    p.write_text("\n".join(pos) + "\n")
    n.write_text("\n".join(neg) + "\n")
    return p, n


@pytest.fixture(scope="module")
def trained(tiny4, tmp_path_factory):
    d = tmp_path_factory.mktemp("train")
    p, n = _prompt_files(d)
    outs = {}
    for method in ("mean", "pca"):
        out = d / f"trained-{method}.gguf"
        code = main(["cvec", "train", "--model", str(tiny4), "--positive", str(p), "--negative", str(n),
                     "--out", str(out), "--method", method])
        assert code == 0
        outs[method] = out
    return outs


def test_train_writes_llama_cpp_format(trained, capsys):
    for out in trained.values():
        r = gguf.GGUFReader(str(out))
        assert bytes(r.fields["general.architecture"].parts[-1]).decode() == "controlvector"
        assert bytes(r.fields["controlvector.model_hint"].parts[-1]).decode() == "llama"
        assert [t.name for t in r.tensors] == [f"direction.{n}" for n in range(1, N_LAYER)]
        for t in r.tensors:
            assert t.tensor_type == gguf.GGMLQuantizationType.F32 and list(t.shape) == [N_EMBD]
            assert np.all(np.isfinite(t.data)) and np.linalg.norm(t.data) > 0


def test_train_shows_progress(tiny4, tmp_path, capsys):
    p, n = _prompt_files(tmp_path)
    assert main(["cvec", "train", "--model", str(tiny4), "--positive", str(p), "--negative", str(n),
                 "--out", str(tmp_path / "v.gguf")]) == 0
    err = capsys.readouterr().err
    for k in (1, 2, 3):
        assert f"pair {k}/3" in err
    assert "wrote" in err


def test_train_directions_are_the_block_outputs(tiny4):
    """The captured state of block N is the output of block N (the last one, through the final
    norm and the head, gives the model's own logits), and the mean/pca maths."""
    import mlx.core as mx

    from engine.steer.capture import last_token_states
    from engine.frontends.cvec_train import directions_from_states
    eng = start(tiny4, cache_mib=0)
    try:
        def run(e):
            states = last_token_states(e, POS[:2])
            ids = e.prompts.prompt_tokens(GenerateRequest(messages=[{"role": "user", "content": POS[1]}]))
            logits = e.model(mx.array(ids)[None])[0, -1]
            inner = e.model.model
            h = mx.array(states[1, -1].astype(np.float32))[None, None]
            via_head = inner.embed_tokens.as_linear(inner.norm(h))[0, 0]
            return states, np.array(logits), np.array(via_head)
        states, logits, via_head = while_held(eng, run)
    finally:
        eng.stop()
    assert states.shape == (2, N_LAYER, N_EMBD)
    assert np.abs(logits - via_head).max() < 1e-4 * max(1.0, np.abs(logits).max())
    # maths: mean = mean difference; pca = unit top component of the differences, positives higher
    rng = np.random.default_rng(0)
    base = rng.standard_normal((6, 3, 8))
    axis = np.zeros(8)
    axis[2] = 1.0
    pos = base + 5.0 * axis + 0.01 * rng.standard_normal((6, 3, 8))
    mean = directions_from_states(pos, base, "mean")
    pca = directions_from_states(pos, base, "pca")
    assert sorted(mean) == [1, 2] and sorted(pca) == [1, 2]   # direction.0 is never written
    for n in (1, 2):
        assert np.allclose(mean[n], (pos - base)[:, n].mean(0), atol=1e-6)
        v = pca[n] / np.linalg.norm(pca[n])
        assert v[2] > 0.99          # sign: positives project higher
        assert np.isclose(np.linalg.norm(pca[n]), 5.0, atol=0.05)
    flipped = directions_from_states(base, pos, "pca")
    assert flipped[1][2] < 0
    # sink: each direction is made orthogonal to the first position's state of its layer
    sink = rng.standard_normal((3, 8)) * 100.0
    for method in ("mean", "pca"):
        orth = directions_from_states(pos, base, method, sink)
        for n in (1, 2):
            assert abs(float(orth[n] @ sink[n])) < 1e-3 * np.linalg.norm(sink[n])


def test_trained_direction_is_orthogonal_to_the_first_position(tiny4, trained):
    """`cvec train` (the command) removes the first position's component, so a projection leaves
    the attention sink untouched (see engine/frontends/cvec_train.py)."""
    eng = start(tiny4, cache_mib=0)
    try:
        def run(e):
            from engine.steer.capture import last_token_states
            first: list = []
            last_token_states(e, POS[:1], first=first)
            return first[0]
        first = while_held(eng, run)
    finally:
        eng.stop()
    for path in trained.values():
        r = gguf.GGUFReader(str(path))
        for t in r.tensors:
            n = int(t.name.split(".")[1])
            d = np.asarray(t.data, np.float64)
            u = first[n] / np.linalg.norm(first[n])
            assert abs(d @ u) < 1e-4 * np.linalg.norm(d), t.name


@pytest.mark.oracle
def test_trained_file_loads_in_llama_cpp_and_strata(tiny4, trained):
    """llama-cpp-python exposes no file loader (common_control_vector_load is in llama.cpp's common
    library, not libllama), so the file is read back with gguf-py as that loader does and its data
    applied through llama_set_adapter_cvec; then the same file in Strata."""
    cpp = LlamaCvec(tiny4, N_EMBD)
    ids = [1, 40, 41, 42, 43, 44]
    try:
        assert cpp.set(None) == 0
        plain = cpp.logits(ids)
        for method, path in trained.items():
            assert cpp.set(path, 1.0, (1, N_LAYER - 1)) == 0, method
            steered = cpp.logits(ids)
            assert np.abs(steered - plain).max() > 1e-3, method
    finally:
        cpp.close()
    for method, path in trained.items():
        cfg = SteeringConfig(files=((str(path), 1.0),), mode="project")
        cv = ControlVector.load(cfg, N_LAYER, N_EMBD)
        assert cv.steered_layers() == [1, 2, 3]
        eng = start(tiny4, cfg, cache_mib=0)
        try:
            assert eng.call(Status()).steering.endswith("layers 1..3 (3 steered)")
            r = eng.call(GenerateRequest(prompt=RAW, sampling=greedy(4)))
            assert r.speed_projection is True and len(r.tokens) == 4
        finally:
            eng.stop()


@pytest.mark.parametrize("case", ["missing", "unequal", "empty", "blank line"])
def test_train_refuses_bad_input_with_one_line(case, tiny4, tmp_path, capsys):
    p, n = _prompt_files(tmp_path)
    message = {"missing": "not found", "unequal": "3 (positive) and 2 (negative)", "empty": "is empty",
               "blank line": "line 2 is empty"}[case]
    if case == "missing":
        n = tmp_path / "nope.txt"
    elif case == "unequal":
        n.write_text("\n".join(NEG[:2]) + "\n")
    elif case == "empty":
        n.write_text("\n\n")
    else:
        n.write_text(NEG[0] + "\n\n" + NEG[2] + "\n")
    code = main(["cvec", "train", "--model", str(tiny4), "--positive", str(p), "--negative", str(n),
                 "--out", str(tmp_path / "v.gguf")])
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert code == 2
    assert len(err) == 1 and err[0].startswith("strata: ") and message in err[0], err
    assert not (tmp_path / "v.gguf").exists()


# ------------------------------------------------------------------ (e) the CLI
def test_cli_logs_the_vector_line(tiny4, strong_vec):
    p = subprocess.run([*STRATA, "generate", "--model", str(tiny4), "--prompt", "Hi", "--max-tokens", "2",
                        "--control-vector-scaled", f"{strong_vec}:2", "--cvec-mode", "project",
                        "--control-vector-layer-range", "1", "3", "-v"],
                       capture_output=True, text=True, timeout=180, cwd=REPO)
    assert p.returncode == 0, p.stderr
    assert "control vector mode = project, dir = per-layer, layers 1..3 (3 steered)" in p.stderr.splitlines()


def _json_run(capsys, *args) -> dict:
    code = main(["generate", *args, "--json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    return json.loads(out)


def test_cli_speed_projection_off_equals_stock(tiny4, strong_vec, capsys):
    base = ["--model", str(tiny4), "--prompt", "Tell me about cats.", "--max-tokens", "10",
            "--conversation-cache-mib", "0"]
    vec = ["--control-vector-scaled", f"{strong_vec}:2", "--cvec-mode", "project",
           "--control-vector-layer-range", "1", "3"]
    stock = _json_run(capsys, *base)
    off = _json_run(capsys, *base, *vec, "--speed-projection", "off")
    on = _json_run(capsys, *base, *vec)
    assert off["tokens"] == stock["tokens"]
    assert on["tokens"] != stock["tokens"]


def _bad_files(tmp_path) -> dict:
    wide = tmp_path / "wide.gguf"
    write_control_vector(wide, {1: np.ones(N_EMBD + 8, np.float32)})
    zero = tmp_path / "zero.gguf"
    w = gguf.GGUFWriter(str(zero), arch="controlvector")
    w.add_tensor("direction.0", np.ones(N_EMBD, np.float32))
    w.add_tensor("direction.1", np.ones(N_EMBD, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    text = tmp_path / "notes.gguf"
    text.write_text("not a gguf\n")
    good = tmp_path / "good.gguf"
    write_control_vector(good, {n: np.ones(N_EMBD, np.float32) for n in range(1, N_LAYER)})
    return {
        "wrong width": ([f"{wide}:1"], [], "has width 72, expected 64"),
        "direction.0": ([f"{zero}:1"], [], "direction.0 is invalid"),
        "not a gguf": ([f"{text}:1"], [], "is not a GGUF file"),
        "missing": ([f"{tmp_path / 'nope.gguf'}:1"], [], "control vector file not found"),
        "range outside": ([f"{good}:1"], ["--control-vector-layer-range", "1", "9"], "is outside the model"),
    }


@pytest.mark.parametrize("case", ["wrong width", "direction.0", "not a gguf", "missing", "range outside"])
def test_cli_bad_vector_exits_2_with_one_line(case, tiny4, tmp_path, capsys):
    files, extra, message = _bad_files(tmp_path)[case]
    args = ["generate", "--model", str(tiny4), "--prompt", "Hi", "--max-tokens", "1", "--cvec-mode", "project"]
    for f in files:
        args += ["--control-vector-scaled", f]
    code = main(args + extra)
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert code == 2
    assert len(err) == 1 and err[0].startswith("strata: ") and message in err[0], err
    assert "Traceback" not in "\n".join(err)


# ------------------------------------------------------------------ (f) cache identity
def test_parked_kv_is_not_reused_across_the_switch(tiny4, strong_vec):
    eng = start(tiny4, SteeringConfig(files=((str(strong_vec), 2.0),), mode="project"), cache_mib=64)
    try:
        first = eng.call(GenerateRequest(messages=CHAT, sampling=greedy(8), speed_projection=True))
        turn2 = CHAT + [{"role": "assistant", "content": first.text}, {"role": "user", "content": "And then?"}]
        off = eng.call(GenerateRequest(messages=turn2, sampling=greedy(8), speed_projection=False))
        assert off.cached_tokens == 0            # nothing computed under 'on' is reused under 'off'
        on = eng.call(GenerateRequest(messages=turn2, sampling=greedy(8), speed_projection=True))
        # back on: the parked 'on' conversation is found again (prompt + reply but its last token)
        assert on.cached_tokens == first.prompt_tokens + first.generated_tokens - 1
        again_off = eng.call(GenerateRequest(messages=turn2, sampling=greedy(8), speed_projection=False))
        # only what was computed under 'off' (the previous off request's K/V) is reused
        assert again_off.cached_tokens == off.prompt_tokens - 1
        assert again_off.tokens == off.tokens
    finally:
        eng.stop()


def test_session_saved_under_one_setting_is_refused_under_another(tiny4, strong_vec, tmp_path):
    """A session's steering is the steering applied to its K/V, never the engine's last request."""
    cfg = SteeringConfig(files=((str(strong_vec), 2.0),), mode="project")
    on_file, off_file = tmp_path / "on.session", tmp_path / "off.session"
    eng = start(tiny4, cfg, cache_mib=64)
    stock = start(tiny4, cache_mib=64)
    try:
        eng.call(GenerateRequest(messages=CHAT, sampling=greedy(4), speed_projection=True))
        eng.call(SaveSession(str(on_file)))
        stock.call(GenerateRequest(messages=CHAT, sampling=greedy(4)))
        stock.call(SaveSession(str(off_file)))
        # Without the vector: refused, naming the vector the file needs.
        with pytest.raises(StrataError, match="saved with another steering setting") as err:
            stock.call(RestoreSession(str(on_file)))
        assert f"load {strong_vec.name} x2 (project)" in str(err.value)
        # ... and carrying it as data: what the app offers to load, without reading the file again.
        from engine.errors import SessionRefusal, VectorSpec
        assert err.value.reason == SessionRefusal.STEERING
        assert err.value.vector == VectorSpec(((str(strong_vec), 2.0),), None, "project", "per-layer")
        # A request that names a setting is held to it ...
        with pytest.raises(StrataError, match="saved with another steering setting"):
            eng.call(RestoreSession(str(off_file), speed_projection=True))
        with pytest.raises(StrataError, match="saved with another steering setting"):
            eng.call(RestoreSession(str(on_file), speed_projection=False))
        # ... one that does not gets the file's own setting, whatever the last request was.
        for last in (True, False, True):
            eng.call(GenerateRequest(prompt=RAW, sampling=greedy(1), speed_projection=last))
            assert eng.call(RestoreSession(str(off_file))).speed_projection is False
            r = eng.call(RestoreSession(str(on_file)))
            assert r.speed_projection is True and r.steering["files"] == [[str(strong_vec), 2.0]]
        # The restored conversation continues from its K/V under its own setting.
        msgs = r.messages + [{"role": "user", "content": "And then?"}]
        follow = eng.call(GenerateRequest(messages=msgs, sampling=greedy(2), speed_projection=True))
        assert follow.cached_tokens == r.restored_tokens
        # The stock session restores on the vector engine with the projection off.
        assert eng.call(RestoreSession(str(off_file), speed_projection=False)).speed_projection is False
    finally:
        eng.stop()
        stock.stop()


def test_a_refused_vector_leaves_the_model_serving_without_it(tiny4, tmp_path):
    """A vector for another model (wrong width) must not cost the user the model: the engine loads,
    says why the vector was refused, and answers exactly as stock."""
    from engine.steer.control_vector import SteeringConfig, write_control_vector
    from engine.engine import Engine, EngineOptions, GenerateRequest, Status
    from engine.sampling import SamplingParams
    wrong = tmp_path / "other-model.gguf"
    write_control_vector(wrong, {1: np.ones(N_EMBD * 2, np.float32)})
    eng = Engine(EngineOptions(model=str(tiny4), steering=SteeringConfig(files=((str(wrong), 1.0),)))).start()
    try:
        status = eng.call(Status())
        assert status.model == str(tiny4)
        assert "width" in status.steering_error
        r = eng.call(GenerateRequest(prompt="Hello there", sampling=SamplingParams(max_tokens=6),
                                     speed_projection=True))
        assert r.speed_projection is False and r.generated_tokens == 6
    finally:
        eng.stop()
