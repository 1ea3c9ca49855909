"""Control-vector files (llama.cpp's format), their loading, and steering a real tiny mlx-lm model."""
from __future__ import annotations

import gguf
import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models import llama
from mlx_lm.models.base import create_attention_mask

from engine.steer.control_vector import ControlVector, ControlVectorError, SteeringConfig, write_control_vector
from engine.device import on_gpu
from engine.errors import StrataError
from engine.steer.steering import SteeredLayer, SteeringState, install

N_EMBD = 64
N_LAYER = 6


def _dirs(layers, n_embd=N_EMBD, seed=0) -> dict[int, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {n: rng.standard_normal(n_embd).astype(np.float32) for n in layers}


def _write(tmp_path, name, directions, hint="llama"):
    path = tmp_path / name
    write_control_vector(path, directions, model_hint=hint)
    return str(path)


def _load(files, n_layer=N_LAYER, n_embd=N_EMBD, **kw) -> ControlVector:
    return ControlVector.load(SteeringConfig(files=tuple(files), **kw), n_layer, n_embd)


def _np(a) -> np.ndarray:
    return np.array(a, dtype=np.float64)


# ------------------------------------------------------------------ the file format
def test_written_file_is_llama_cpp_format(tmp_path):
    d = _dirs(range(1, N_LAYER))
    path = _write(tmp_path, "v.gguf", d, hint="qwen3")
    r = gguf.GGUFReader(path)
    f = r.fields
    assert bytes(f["general.architecture"].parts[-1]).decode() == "controlvector"
    assert bytes(f["controlvector.model_hint"].parts[-1]).decode() == "qwen3"
    lc = f["controlvector.layer_count"]
    assert lc.types == [gguf.GGUFValueType.INT32] and int(lc.parts[-1][0]) == N_LAYER - 1
    assert [t.name for t in r.tensors] == [f"direction.{n}" for n in range(1, N_LAYER)]
    for t in r.tensors:
        n = int(t.name.split(".")[1])
        assert t.tensor_type == gguf.GGMLQuantizationType.F32 and list(t.shape) == [N_EMBD]
        assert np.array_equal(np.asarray(t.data), d[n])


def test_writer_refuses_direction_zero_and_mixed_widths(tmp_path):
    with pytest.raises(ControlVectorError, match="direction.0"):
        write_control_vector(tmp_path / "a.gguf", {0: np.zeros(8)})
    with pytest.raises(ControlVectorError, match="width"):
        write_control_vector(tmp_path / "b.gguf", {1: np.zeros(8), 2: np.zeros(9)})


# ------------------------------------------------------------------ loading: numbering, scales, sums
def test_direction_n_steers_block_n_and_never_block_0(tmp_path):
    d = _dirs(range(1, N_LAYER + 3))  # direction.N >= n_layer exists in the file but has no block
    cv = _load([(_write(tmp_path, "v.gguf", d), 1.0)])
    assert cv.steered_layers() == list(range(1, N_LAYER))
    for il in cv.steered_layers():
        assert np.array_equal(np.array(cv.directions[il]), d[il])
    assert cv.scale == 1.0
    assert cv.describe() == f"control vector mode = add, dir = per-layer, layers 1..{N_LAYER - 1} ({N_LAYER - 1} steered)"


def test_scale_and_sum_of_files(tmp_path):
    a = _dirs(range(1, N_LAYER), seed=1)
    b = _dirs([2, 3], seed=2)  # a file may carry only some layers
    pa, pb = _write(tmp_path, "a.gguf", a), _write(tmp_path, "b.gguf", b)
    cv = _load([(pa, 0.5)])
    assert np.allclose(_np(cv.directions[3]), 0.5 * a[3].astype(np.float64), rtol=0, atol=1e-7)
    cv = _load([(pa, 0.5), (pb, -2.0)])
    for il in range(1, N_LAYER):
        want = 0.5 * a[il].astype(np.float64) + (-2.0 * b[il].astype(np.float64) if il in b else 0.0)
        assert np.allclose(_np(cv.directions[il]), want, atol=1e-6)
    assert cv.steered_layers() == [1, 2, 3, 4, 5]
    # layers only one file has are still steered; layers no file has are not
    cv = _load([(pb, 1.0)])
    assert cv.steered_layers() == [2, 3]
    assert cv.describe() == f"control vector mode = add, dir = per-layer, layers 1..{N_LAYER - 1} (2 steered)"


def test_layer_range_is_inclusive_with_llama_cpp_defaults(tmp_path):
    p = _write(tmp_path, "v.gguf", _dirs(range(1, N_LAYER)))
    assert _load([(p, 1.0)], layer_range=(2, 4)).steered_layers() == [2, 3, 4]
    assert _load([(p, 1.0)], layer_range=(3, 3)).steered_layers() == [3]
    # start <= 0 -> 1 and end <= 0 -> n_layer, like common_init_from_params
    assert _load([(p, 1.0)], layer_range=(0, 0)).steered_layers() == [1, 2, 3, 4, 5]
    assert _load([(p, 1.0)], layer_range=(0, 2)).steered_layers() == [1, 2]
    # end == n_layer is llama.cpp's own default upper bound: accepted, the last block is n_layer-1
    cv = _load([(p, 1.0)], layer_range=(4, N_LAYER))
    assert cv.steered_layers() == [4, 5]
    assert cv.describe() == "control vector mode = add, dir = per-layer, layers 4..5 (2 steered)"


def test_single_layer_direction(tmp_path):
    d = _dirs(range(1, N_LAYER))
    p = _write(tmp_path, "v.gguf", d)
    cv = _load([(p, 2.0)], direction="single:3", layer_range=(1, 4))
    assert cv.steered_layers() == [1, 2, 3, 4]
    for il in cv.steered_layers():
        assert np.allclose(_np(cv.directions[il]), 2.0 * d[3].astype(np.float64), atol=1e-6)
    assert cv.describe() == "control vector mode = add, dir = single:3, layers 1..4 (4 steered)"
    # single:L works for a file that only has layer L
    p1 = _write(tmp_path, "one.gguf", {5: d[5]})
    cv = _load([(p1, 1.0)], direction="single:5", mode="project")
    assert cv.steered_layers() == [1, 2, 3, 4, 5]
    assert np.allclose(_np(cv.directions[1]), d[5] / np.linalg.norm(d[5].astype(np.float64)), atol=1e-6)


def test_project_mode_unit_direction_and_scale(tmp_path):
    a = _dirs(range(1, N_LAYER), seed=1)
    b = _dirs(range(1, N_LAYER), seed=2)
    pa, pb = _write(tmp_path, "a.gguf", a), _write(tmp_path, "b.gguf", b)
    cv = _load([(pa, 2.0)], mode="project")
    assert cv.scale == 2.0
    for il in cv.steered_layers():
        v = _np(cv.directions[il])
        assert abs(np.linalg.norm(v) - 1.0) < 1e-6
        assert np.allclose(v, a[il] / np.linalg.norm(a[il].astype(np.float64)), atol=1e-6)
    # several files: sum the scaled directions, then normalise; s = mean of the scales
    cv = _load([(pa, 1.0), (pb, 3.0)], mode="project")
    assert cv.scale == 2.0
    want = a[2].astype(np.float64) + 3.0 * b[2].astype(np.float64)
    assert np.allclose(_np(cv.directions[2]), want / np.linalg.norm(want), atol=1e-6)


def test_project_skips_zero_direction(tmp_path):
    d = _dirs(range(1, N_LAYER))
    d[2] = np.zeros(N_EMBD, np.float32)
    cv = _load([(_write(tmp_path, "v.gguf", d), 1.0)], mode="project")
    assert cv.steered_layers() == [1, 3, 4, 5]


def test_describe_matches_the_engine_log_line(tmp_path):
    p = _write(tmp_path, "esp.gguf", _dirs(range(1, 48), n_embd=16))
    cv = ControlVector.load(SteeringConfig(files=((p, 1.0),), layer_range=(4, 44), mode="project"), 48, 16)
    assert cv.describe() == "control vector mode = project, dir = per-layer, layers 4..44 (41 steered)"


def test_fingerprint_is_stable_and_tracks_every_setting(tmp_path):
    d = _dirs(range(1, N_LAYER))
    p = _write(tmp_path, "v.gguf", d)
    p_copy = _write(tmp_path, "copy.gguf", d)
    base = _load([(p, 1.0)], mode="project", layer_range=(1, 4))
    assert base.fingerprint() == _load([(p, 1.0)], mode="project", layer_range=(1, 4)).fingerprint()
    # the same bytes under another file name are the same vector
    assert base.fingerprint() == _load([(p_copy, 1.0)], mode="project", layer_range=(1, 4)).fingerprint()
    others = [
        _load([(p, 2.0)], mode="project", layer_range=(1, 4)),
        _load([(p, 1.0)], mode="add", layer_range=(1, 4)),
        _load([(p, 1.0)], mode="project", layer_range=(2, 4)),
        _load([(p, 1.0)], mode="project", layer_range=(1, 4), direction="single:2"),
    ]
    d2 = dict(d)
    d2[3] = d2[3].copy()
    d2[3][0] += 1.0
    others.append(_load([(_write(tmp_path, "w.gguf", d2), 1.0)], mode="project", layer_range=(1, 4)))
    prints = [base.fingerprint()] + [o.fingerprint() for o in others]
    assert len(set(prints)) == len(prints)
    # add mode: scale changes the folded vector
    assert _load([(p, 1.0)]).fingerprint() != _load([(p, 0.5)]).fingerprint()


def test_parse_scaled():
    assert SteeringConfig.parse_scaled("v.gguf:0.5") == ("v.gguf", 0.5)
    assert SteeringConfig.parse_scaled(r"C:\vec\v.gguf:-1") == (r"C:\vec\v.gguf", -1.0)
    for bad in ("v.gguf", "v.gguf:abc", ":1.0", "v.gguf:nan"):
        with pytest.raises(ControlVectorError):
            SteeringConfig.parse_scaled(bad)


# ------------------------------------------------------------------ refusals
def _one_line(e: pytest.ExceptionInfo) -> str:
    msg = str(e.value)
    assert "\n" not in msg and msg
    assert isinstance(e.value, ValueError) and isinstance(e.value, StrataError)
    return msg


def _raw_gguf(path, tensors: dict[str, np.ndarray]):
    w = gguf.GGUFWriter(str(path), arch="controlvector")
    for name, a in tensors.items():
        w.add_tensor(name, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


def test_refuses_wrong_width(tmp_path):
    p = _write(tmp_path, "v.gguf", _dirs(range(1, 3), n_embd=32))
    with pytest.raises(ControlVectorError) as e:
        _load([(p, 1.0)])
    msg = _one_line(e)
    assert "expected 64" in msg and "width 32" in msg


def test_refuses_direction_zero(tmp_path):
    p = _raw_gguf(tmp_path / "z.gguf", {"direction.0": np.zeros(N_EMBD, np.float32),
                                        "direction.1": np.zeros(N_EMBD, np.float32)})
    with pytest.raises(ControlVectorError) as e:
        _load([(p, 1.0)])
    assert "direction.0" in _one_line(e)


def test_refuses_f16_tensor(tmp_path):
    p = _raw_gguf(tmp_path / "h.gguf", {"direction.1": np.zeros(N_EMBD, np.float16)})
    with pytest.raises(ControlVectorError) as e:
        _load([(p, 1.0)])
    msg = _one_line(e)
    assert "F16" in msg and "F32" in msg


def test_refuses_other_tensor_names_and_empty_files(tmp_path):
    p = _raw_gguf(tmp_path / "n.gguf", {"blk.1.attn_q.weight": np.zeros(N_EMBD, np.float32)})
    with pytest.raises(ControlVectorError) as e:
        _load([(p, 1.0)])
    assert "direction.N" in _one_line(e)
    p = _raw_gguf(tmp_path / "e.gguf", {})
    with pytest.raises(ControlVectorError) as e:
        _load([(p, 1.0)])
    assert "no direction tensors" in _one_line(e)


def test_refuses_text_file(tmp_path):
    p = tmp_path / "notes.gguf"
    p.write_text("this is not a control vector\n")
    with pytest.raises(ControlVectorError) as e:
        _load([(str(p), 1.0)])
    assert "not a GGUF" in _one_line(e)


def test_refuses_truncated_gguf(tmp_path):
    p = _write(tmp_path, "v.gguf", _dirs(range(1, N_LAYER)))
    raw = open(p, "rb").read()
    t = tmp_path / "t.gguf"
    t.write_bytes(raw[: len(raw) // 3])
    with pytest.raises(ControlVectorError) as e:
        _load([(str(t), 1.0)])
    _one_line(e)


def test_refuses_missing_file_and_no_file(tmp_path):
    with pytest.raises(ControlVectorError) as e:
        _load([(str(tmp_path / "absent.gguf"), 1.0)])
    assert "not found" in _one_line(e)
    with pytest.raises(ControlVectorError) as e:
        _load([(str(tmp_path), 1.0)])
    assert "not a file" in _one_line(e)
    with pytest.raises(ControlVectorError):
        _load([])


@pytest.mark.parametrize("rng", [(4, 60), (9, 9), (-1, 3), (N_LAYER, N_LAYER), (4, 2)])
def test_refuses_layer_range_outside_the_model(tmp_path, rng):
    p = _write(tmp_path, "v.gguf", _dirs(range(1, N_LAYER)))
    with pytest.raises(ControlVectorError) as e:
        _load([(p, 1.0)], layer_range=rng)
    msg = _one_line(e)
    assert "layer range" in msg


def test_refuses_single_layer_not_present(tmp_path):
    p = _write(tmp_path, "v.gguf", _dirs([1, 2, 3]))
    with pytest.raises(ControlVectorError) as e:
        _load([(p, 1.0)], direction="single:4")
    msg = _one_line(e)
    assert "direction.4" in msg and "1, 2, 3" in msg


def test_refuses_bad_settings():
    with pytest.raises(ControlVectorError):
        SteeringConfig(mode="subtract")
    with pytest.raises(ControlVectorError):
        SteeringConfig(direction="single:x")
    with pytest.raises(ControlVectorError):
        SteeringConfig(direction="single:0")


# ------------------------------------------------------------------ a real tiny mlx-lm model
def _tiny_model(n_layer=4, seed=0):
    mx.random.seed(seed)
    args = llama.ModelArgs(model_type="llama", hidden_size=N_EMBD, num_hidden_layers=n_layer,
                           intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                           rms_norm_eps=1e-5, vocab_size=97, tie_word_embeddings=True)
    model = llama.Model(args)
    mx.eval(model.parameters())
    return model


TOKENS = mx.array([[3, 14, 15, 92, 65, 35, 89, 79]])


def _logits(model, tokens=TOKENS) -> np.ndarray:
    out = model(tokens)
    mx.eval(out)
    return np.array(out)


def _vector(tmp_path, n_layer, mode, scale=1.0, zero=False, layer_range=None, seed=7):
    d = _dirs(range(1, n_layer), seed=seed)
    if zero:
        d = {n: np.zeros_like(v) for n, v in d.items()}
    p = _write(tmp_path, f"{mode}-{scale}-{zero}-{seed}.gguf", d)
    return ControlVector.load(SteeringConfig(files=((p, scale),), mode=mode, layer_range=layer_range),
                              n_layer, N_EMBD), d


def test_install_disabled_is_bit_identical(tmp_path):
    model = _tiny_model()
    blocks = list(model.model.layers)
    base = _logits(model)
    cv, _ = _vector(tmp_path, 4, "project")
    state = SteeringState(cv, speed_projection=False)
    install(model, state)
    assert all(isinstance(b, SteeredLayer) for b in model.model.layers)
    assert model.model.layers[1].use_sliding is blocks[1].use_sliding  # attribute reads reach the block
    assert np.array_equal(_logits(model), base)
    state.speed_projection, state.vector = True, None  # enabled but no vector: untouched too
    assert np.array_equal(_logits(model), base)
    assert state.fingerprint() == ""
    install(model, state)  # idempotent: no double wrapping
    assert all(isinstance(b.block, llama.TransformerBlock) for b in model.model.layers)


def test_enabled_add_zero_vector_is_bit_identical(tmp_path):
    model = _tiny_model()
    base = _logits(model)
    cv, _ = _vector(tmp_path, 4, "add", zero=True)
    assert cv.steered_layers() == [1, 2, 3]
    install(model, SteeringState(cv, speed_projection=True))
    assert np.array_equal(_logits(model), base)


def test_enabled_project_changes_logits_and_the_switch_is_per_request(tmp_path):
    model = _tiny_model()
    base = _logits(model)
    cv, _ = _vector(tmp_path, 4, "project")
    state = SteeringState(cv, speed_projection=True)
    install(model, state)
    on = _logits(model)
    assert np.abs(on - base).max() > 1e-3
    assert state.fingerprint() == cv.fingerprint() != ""
    state.speed_projection = False
    assert np.array_equal(_logits(model), base)
    state.speed_projection = True
    assert np.array_equal(_logits(model), on)


@pytest.mark.parametrize("mode,scale", [("project", 1.0), ("project", 2.0), ("add", 0.7)])
def test_steered_hidden_states_match_manual_computation(tmp_path, mode, scale):
    n_layer = 4
    model = _tiny_model(n_layer)
    blocks = list(model.model.layers)
    cv, d = _vector(tmp_path, n_layer, mode, scale=scale, layer_range=(2, 3))
    assert cv.steered_layers() == [2, 3]
    install(model, SteeringState(cv, speed_projection=True))

    h = model.model.embed_tokens(TOKENS)
    mask = create_attention_mask(h, None)
    for i in range(n_layer):
        plain = blocks[i](h, mask)
        got = model.model.layers[i](h, mask)
        y = _np(plain)
        if i in (2, 3):
            if mode == "project":
                v = d[i].astype(np.float64) / np.linalg.norm(d[i].astype(np.float64))
                want = y - scale * (y @ v)[..., None] * v
            else:
                want = y + scale * d[i].astype(np.float64)
            tol = 1e-5 * max(1.0, scale) * np.linalg.norm(y, axis=-1, keepdims=True)
            assert np.all(np.abs(_np(got) - want) <= tol)
            if mode == "project" and scale == 1.0:
                assert np.all(np.abs(_np(got) @ v) <= 1e-5 * np.linalg.norm(y, axis=-1))
        else:
            assert np.array_equal(np.array(got), np.array(plain))  # blocks 0 and 1: untouched
        h = got
    # and the full forward is exactly this chain
    manual = np.array(model.model.embed_tokens.as_linear(model.model.norm(h)))
    assert np.array_equal(_logits(model), manual)


def test_steering_with_kv_cache_matches_full_forward(tmp_path):
    model = _tiny_model()
    cv, _ = _vector(tmp_path, 4, "project", scale=2.0)
    install(model, SteeringState(cv, speed_projection=True))
    full = _logits(model)
    cache = model.make_cache()
    first = model(TOKENS[:, :5], cache=cache)
    rest = [model(TOKENS[:, i:i + 1], cache=cache) for i in range(5, TOKENS.shape[1])]
    got = np.concatenate([np.array(first)] + [np.array(r) for r in rest], axis=1)
    # On the H200 (MLX's CUDA backend) one-token steps and the whole prompt differ by up to 1.6e-3 on
    # logits up to 4.2 (bench/results/raw/s6-run8-cvdiff.txt): cuBLAS's float32 matmul precision. A
    # wrong cache path is off by whole units; the CPU checks the path to 1e-4.
    assert np.allclose(got, full, **(dict(rtol=2e-3, atol=5e-3) if on_gpu() else dict(atol=1e-4)))


# ------------------------------------------------------------------ llama.cpp accepts the file
def _llama_cpp_or_skip():
    import llama_oracle       # llama.cpp in a worker process: a native crash fails this test only
    llama_oracle.require()
    try:
        from gguf_factory import tiny_hf_weights, write_tiny_gguf  # tests/gguf_factory.py
    except ImportError:
        pytest.skip("tests/gguf_factory.py (write_tiny_gguf) is not available")
    if not llama_oracle.has_cvec():
        pytest.skip("this llama-cpp-python exposes no llama_set_adapter_cvec")
    return llama_oracle, tiny_hf_weights, write_tiny_gguf


def _flat_buffer(path, n_layer, n_embd) -> np.ndarray:
    """common_control_vector_load_one's layout, from the file read with gguf-py (llama.cpp's own
    Python reader): direction.N at offset n_embd * (N - 1)."""
    r = gguf.GGUFReader(path)
    top = max(int(t.name.split(".")[1]) for t in r.tensors)
    buf = np.zeros(n_embd * top, np.float32)
    for t in r.tensors:
        n = int(t.name.split(".")[1])
        buf[n_embd * (n - 1): n_embd * n] += np.asarray(t.data, np.float32)
    return buf


@pytest.mark.oracle
def test_llama_cpp_accepts_the_file_and_steers_the_same_block(tmp_path):
    oracle, tiny_hf_weights, write_tiny_gguf = _llama_cpp_or_skip()

    n_layer, n_embd = 4, 64
    model_path = write_tiny_gguf(tmp_path / "tiny.gguf", arch="llama", n_layer=n_layer, n_embd=n_embd)
    rng = np.random.default_rng(11)
    directions = {n: (rng.standard_normal(n_embd) * 4.0).astype(np.float32) for n in range(1, n_layer)}
    cv_path = _write(tmp_path, "cv.gguf", directions, hint="llama")
    buf = _flat_buffer(cv_path, n_layer, n_embd)
    tokens = [1, 40, 41, 42, 43, 44]

    llm = oracle.Llama(model_path=str(model_path), n_ctx=64, n_batch=64, logits_all=True, verbose=False)

    def run(layer_range):
        if layer_range is None:
            rc = oracle.set_cvec(llm, None, n_embd)
        else:
            rc = oracle.set_cvec(llm, buf, n_embd, layer_range[0], layer_range[1])
        assert rc == 0
        return oracle.logits(llm, tokens).astype(np.float64)

    cpp_plain = run(None)
    cpp_k = {k: run((k, k)) for k in range(1, n_layer)}

    # The same weights in mlx-lm (HF layout), steered through our loader + SteeredLayer.
    w = tiny_hf_weights("llama", n_layer=n_layer, n_embd=n_embd)
    args = llama.ModelArgs(model_type="llama", hidden_size=n_embd, num_hidden_layers=n_layer,
                           intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                           rms_norm_eps=1e-5, vocab_size=w["model.embed_tokens.weight"].shape[0],
                           rope_theta=10000.0, tie_word_embeddings=True)
    model = llama.Model(args)
    model.load_weights([(k, mx.array(v)) for k, v in w.items()])
    toks = mx.array([tokens])
    mlx_plain = np.array(model(toks), dtype=np.float64)
    scale_ref = np.abs(cpp_plain).max()
    assert np.abs(mlx_plain - cpp_plain).max() <= 1e-3 * scale_ref  # same model first

    state = SteeringState(None, speed_projection=True)
    install(model, state)
    for k in range(1, n_layer):
        state.vector = ControlVector.load(SteeringConfig(files=((cv_path, 1.0),), layer_range=(k, k)), n_layer, n_embd)
        assert state.vector.steered_layers() == [k]
        mlx_k = np.array(model(toks), dtype=np.float64)
        delta_cpp = cpp_k[k] - cpp_plain
        delta_mlx = mlx_k - mlx_plain
        assert np.abs(delta_cpp).max() > 1e-2  # the vector does something in llama.cpp
        assert np.abs(delta_mlx - delta_cpp).max() <= 1e-3 * scale_ref, f"block {k}"
        for other in range(1, n_layer):  # and an off-by-one would be caught
            if other != k:
                assert np.abs((cpp_k[other] - cpp_plain) - delta_mlx).max() > 10 * 1e-3 * scale_ref
