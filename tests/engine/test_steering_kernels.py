"""Parity of the steering operation against a float64 NumPy reference.

Tolerance (fp32 path). The output is out_j = h_j + c v_j with c = s (add) or c = -s (h.v)
(project), computed in float32 (u = 2**-24). The dot product of D terms carries a rounding
error of at most D*u*|h||v| (worst case) and typically ~sqrt(D)*u*|h| (random signs, blocked /
pairwise sums); it is multiplied by s |v_j| <= s. The final multiply-add adds ~2u(|h_j| + s|h|).
For D = 4096 and s = 2 the typical total is 2*64*6e-8*|h| ~ 8e-6 |h|, so the bound used is

    max_j |out_j - ref_j| <= 1e-5 * max(1, s) * |h_row|_2        (TOL_REL = 1e-5)

per row, i.e. ~1e-5 relative to the row's norm. For float16 inputs the result is rounded to
float16: add one float16 ulp of the reference value (2**-10 relative).
"""
from __future__ import annotations

import inspect
import re
import sys

import mlx.core as mx
import numpy as np
import pytest

from engine.steer import steering
from engine.steer.steering import (
          INPUT_NAMES,
          OUTPUT_NAMES,
          SHADER_NAME,
          active_backend,
          metal_call_args,
          metal_kernel_spec,
          shaders_dir,
          steer,
)

TOL_REL = 1e-5
METAL = bool(mx.metal.is_available())
NO_METAL_REASON = "Metal backend absent on this machine (Linux CPU); the Metal kernel is unverified here"
CUDA = bool(mx.cuda.is_available()) and mx.default_device() == mx.gpu
NO_CUDA_REASON = ("MLX's CUDA backend absent on this machine (needs the mlx-cuda wheel and an NVIDIA GPU); "
                  "the CUDA build of the kernel body is unverified here")

ROW_CASES = [(1, 4096), (3, 1000), (8, 64), (8, 4096), (512, 2048)]  # (rows, D); 1000: D not a multiple of 32
SCALES = [1.0, 2.0]
MODES = ["add", "project"]


def _make(rows: int, d: int, seed: int, batch: bool):
    rng = np.random.default_rng(seed)
    v = rng.standard_normal(d)
    v /= np.linalg.norm(v)
    # a residual stream with a large component along v (what the projection removes), plus noise
    along = rng.choice([-1.0, 1.0], size=(rows, 1)) * (20.0 + 40.0 * np.abs(rng.standard_normal((rows, 1))))
    h = rng.standard_normal((rows, d)) * 3.0 + along * v
    h = h.astype(np.float32)
    if batch:
        h = h.reshape(1, rows, d)
    return h, v.astype(np.float32)


def _ref(h: np.ndarray, vec: np.ndarray, s: float, mode: str) -> np.ndarray:
    h64 = h.astype(np.float64)
    v64 = vec.astype(np.float64)
    if mode == "add":
        return h64 + s * v64
    return h64 - s * (h64 @ v64)[..., None] * v64


def _check(fn, rows, d, s, mode, batch, dtype=mx.float32):
    h, v = _make(rows, d, seed=rows * 7 + d, batch=batch)
    hm = mx.array(h).astype(dtype)
    h_in = np.array(hm.astype(mx.float32))  # the values the op actually sees (fp16-rounded if fp16)
    out = fn(hm, mx.array(v), s, mode)
    mx.eval(out)
    assert out.shape == hm.shape and out.dtype == dtype
    got = np.array(out.astype(mx.float32)).astype(np.float64)
    ref = _ref(h_in, v, s, mode)
    row_norm = np.linalg.norm(h_in.astype(np.float64), axis=-1, keepdims=True)
    tol = TOL_REL * max(1.0, s) * row_norm
    if dtype != mx.float32:
        # one ulp of the reference in the output dtype: float16 keeps 11 bits, bfloat16 8
        tol = tol + np.abs(ref) * (2.0 ** -10 if dtype == mx.float16 else 2.0 ** -7)
    err = np.abs(got - ref)
    assert np.all(err <= tol), f"max err {err.max():.3e}, worst ratio {(err / tol).max():.2f}"
    return got, h_in, v


def _portable(h, v, s, mode):
    return steering._steer_portable(h, v, s, mode)


def _metal(h, v, s, mode):
    return steering._steer_metal(h, v, s, mode)


# ------------------------------------------------------------------ portable path (always)
@pytest.mark.parametrize("rows,d", ROW_CASES)
@pytest.mark.parametrize("s", SCALES)
@pytest.mark.parametrize("mode", MODES)
def test_portable_parity(rows, d, s, mode):
    _check(_portable, rows, d, s, mode, batch=(rows % 2 == 1))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16])
def test_portable_parity_half(mode, dtype):
    if dtype == mx.bfloat16:
        # bf16 keeps 8 bits: widen the rounding term to one bf16 ulp (2**-7 relative)
        h, v = _make(8, 1000, seed=5, batch=True)
        hm = mx.array(h).astype(dtype)
        h_in = np.array(hm.astype(mx.float32))
        got = np.array(steer(hm, mx.array(v), 2.0, mode).astype(mx.float32)).astype(np.float64)
        ref = _ref(h_in, v, 2.0, mode)
        tol = 2 * TOL_REL * np.linalg.norm(h_in, axis=-1, keepdims=True) + np.abs(ref) * 2.0 ** -7
        assert np.all(np.abs(got - ref) <= tol)
        return
    for rows, d in [(1, 4096), (3, 1000), (8, 64), (512, 2048)]:
        _check(_portable, rows, d, 2.0, mode, batch=True, dtype=dtype)


@pytest.mark.parametrize("rows,d", [(1, 4096), (3, 1000), (8, 64), (512, 2048)])
def test_portable_project_s1_removes_component(rows, d):
    got, h_in, v = _check(_portable, rows, d, 1.0, "project", batch=False)
    before = h_in.astype(np.float64) @ v
    after = got @ v
    norms = np.linalg.norm(h_in, axis=-1)
    assert np.all(np.abs(before) > 1.0)  # the test data really has a component to remove
    assert np.all(np.abs(after) <= TOL_REL * norms)


@pytest.mark.parametrize("rows,d", [(1, 4096), (3, 1000), (8, 64), (512, 2048)])
def test_portable_project_s2_reflects(rows, d):
    got, h_in, v = _check(_portable, rows, d, 2.0, "project", batch=False)
    before = h_in.astype(np.float64) @ v
    after = got @ v
    norms = np.linalg.norm(h_in, axis=-1)
    assert np.all(np.abs(after + before) <= 2 * TOL_REL * norms)
    # a reflection keeps the norm
    assert np.allclose(np.linalg.norm(got, axis=-1), norms, rtol=1e-5)


def test_add_zero_vector_is_bitwise_identity():
    h, _ = _make(8, 64, seed=1, batch=True)
    for dtype in (mx.float32, mx.float16):
        hm = mx.array(h).astype(dtype)
        out = steer(hm, mx.zeros((64,)), 1.0, "add")
        assert np.array_equal(np.array(out), np.array(hm))


def test_dispatch_uses_portable_without_metal():
    assert active_backend() == ("metal" if METAL else "cuda" if CUDA else "portable")
    h, v = _make(3, 64, seed=2, batch=False)
    a = steer(mx.array(h), mx.array(v), 1.0, "project")
    b = _portable(mx.array(h), mx.array(v), 1.0, "project")
    if not METAL and not CUDA:
        assert np.array_equal(np.array(a), np.array(b))


def test_steer_refuses_bad_arguments():
    h = mx.zeros((2, 8))
    with pytest.raises(ValueError):
        steer(h, mx.zeros((8,)), 1.0, "multiply")
    with pytest.raises(ValueError):
        steer(h, mx.zeros((9,)), 1.0, "add")


def test_steer_varying_lengths_reuse_compiled_path():
    # decode (1 row) then prompt chunks of other lengths: the compiled reference retraces per shape
    rng = np.random.default_rng(3)
    v = rng.standard_normal(64).astype(np.float32)
    v /= np.linalg.norm(v)
    for L in (1, 7, 1, 33, 2):
        h = rng.standard_normal((1, L, 64)).astype(np.float32)
        got = np.array(steer(mx.array(h), mx.array(v), 1.0, "project"))
        assert np.allclose(got, _ref(h, v, 1.0, "project"), atol=1e-5)


# ------------------------------------------------------------------ the Metal kernel's construction
def _documented_constructor_params() -> set[str]:
    try:
        return set(inspect.signature(mx.fast.metal_kernel).parameters)
    except (TypeError, ValueError):  # nanobind: read the signature line of the docstring
        first = mx.fast.metal_kernel.__doc__.strip().splitlines()[0]
        return set(re.findall(r"(\w+)\s*:", first[first.index("(") + 1:]))


def test_shader_file_exists_and_is_read():
    path = shaders_dir() / SHADER_NAME
    assert path.is_file()
    assert steering.CVEC_METAL_SOURCE == path.read_text(encoding="utf-8")


def test_shaders_dir_follows_pyinstaller(monkeypatch, tmp_path):
    monkeypatch.setattr(sys, "_MEIPASS", str(tmp_path), raising=False)
    assert shaders_dir() == tmp_path / "shaders"


def test_metal_kernel_spec_uses_documented_names():
    spec = metal_kernel_spec()
    params = _documented_constructor_params()
    if "name" not in params:
        pytest.skip("this MLX build (the CUDA one) exposes metal_kernel as a stub without its documented "
                    "signature; checked on the CPU and Metal builds")
    assert {"name", "input_names", "output_names", "source"} <= params
    assert set(spec) <= params, set(spec) - params
    assert spec["input_names"] == list(INPUT_NAMES) == ["h", "vec", "scale"]
    assert spec["output_names"] == list(OUTPUT_NAMES) == ["out"]
    src = spec["source"]
    # the body must use every input/output name and template parameter, and contain no signature
    for name in ("h[", "vec[", "scale[0]", "out[", "T", "D", "TG", "PROJECT", "simd_sum",
                 "threadgroup_barrier", "threadgroup_position_in_grid", "thread_position_in_threadgroup"):
        assert name in src, name
    assert "[[kernel]]" not in src and "kernel void" not in src
    # constructing the kernel object is pure bookkeeping: it works without a Metal device
    kernel = mx.fast.metal_kernel(**spec)
    assert callable(kernel)


@pytest.mark.parametrize("shape", [(1, 1, 4096), (3, 1000), (1, 512, 2048), (2, 8, 64)])
@pytest.mark.parametrize("mode", MODES)
def test_metal_call_args(shape, mode):
    h = mx.zeros(shape, dtype=mx.float16)
    args = metal_call_args(h, mx.zeros((shape[-1],)), 2.0, mode)
    documented = mx.fast.metal_kernel.__doc__
    for key in args:
        assert f"{key}=" in documented, key  # the docstring's own example names every one
    assert set(args) == {"inputs", "template", "grid", "threadgroup", "output_shapes", "output_dtypes"}
    d = shape[-1]
    rows = int(np.prod(shape[:-1]))
    tg = args["threadgroup"][0]
    assert tg % 32 == 0 and 32 <= tg <= 1024 and args["threadgroup"][1:] == (1, 1)
    # grid counts threads (dispatchThreads): one threadgroup per row
    assert args["grid"] == (rows * tg, 1, 1)
    assert dict(args["template"]) == {"T": mx.float16, "D": d, "TG": tg, "PROJECT": mode == "project"}
    assert args["output_shapes"] == [shape] and args["output_dtypes"] == [mx.float16]
    h_in, vec, scale = args["inputs"]
    assert h_in is h and vec.dtype == mx.float32 and scale.shape == (1,) and scale.item() == 2.0


@pytest.mark.skipif(METAL, reason="this machine has Metal")
def test_metal_kernel_cannot_run_here():
    with pytest.raises(RuntimeError):
        mx.eval(_metal(mx.zeros((1, 64)), mx.zeros((64,)), 1.0, "add"))


# ------------------------------------------------------------------ the Metal kernel itself (Mac only)
@pytest.mark.metal
@pytest.mark.skipif(not METAL, reason=NO_METAL_REASON)
@pytest.mark.parametrize("rows,d", ROW_CASES)
@pytest.mark.parametrize("s", SCALES)
@pytest.mark.parametrize("mode", MODES)
def test_metal_parity(rows, d, s, mode):
    _check(_metal, rows, d, s, mode, batch=(rows % 2 == 1))


@pytest.mark.metal
@pytest.mark.skipif(not METAL, reason=NO_METAL_REASON)
@pytest.mark.parametrize("mode", MODES)
def test_metal_parity_float16(mode):
    for rows, d in [(1, 4096), (3, 1000), (8, 64), (512, 2048)]:
        _check(_metal, rows, d, 2.0, mode, batch=True, dtype=mx.float16)


@pytest.mark.metal
@pytest.mark.skipif(not METAL, reason=NO_METAL_REASON)
def test_metal_project_s1_removes_and_s2_reflects():
    for rows, d in [(1, 4096), (3, 1000), (8, 64), (512, 2048)]:
        got, h_in, v = _check(_metal, rows, d, 1.0, "project", batch=False)
        norms = np.linalg.norm(h_in, axis=-1)
        assert np.all(np.abs(got @ v) <= TOL_REL * norms)
        got, h_in, v = _check(_metal, rows, d, 2.0, "project", batch=False)
        assert np.all(np.abs(got @ v + h_in.astype(np.float64) @ v) <= 2 * TOL_REL * norms)


@pytest.mark.metal
@pytest.mark.skipif(not METAL, reason=NO_METAL_REASON)
def test_metal_matches_portable_and_dispatch_picks_metal():
    assert active_backend() == "metal"
    h, v = _make(8, 4096, seed=9, batch=True)
    a = np.array(steer(mx.array(h), mx.array(v), 1.0, "project"))
    b = np.array(_portable(mx.array(h), mx.array(v), 1.0, "project"))
    assert np.allclose(a, b, atol=TOL_REL * float(np.linalg.norm(h, axis=-1).max()))


# ------------------------------------------------------------------ the CUDA build of the same body
def _cuda(h, v, s, mode):
    return steering._steer_cuda(h, v, s, mode)


def test_cuda_and_metal_builds_share_one_body():
    metal, cuda = steering.kernel_spec("metal"), steering.kernel_spec("cuda")
    assert metal["source"] is cuda["source"] is steering.CVEC_METAL_SOURCE
    assert metal["header"] == steering.METAL_SHIM and cuda["header"] == steering.CUDA_SHIM
    # every Metal-only name the body uses is given a CUDA meaning by the shim
    for name in ("CVEC_SHARED", "threadgroup_position_in_grid", "thread_position_in_threadgroup",
                 "thread_index_in_simdgroup", "simdgroup_index_in_threadgroup",
                 "simdgroups_per_threadgroup", "threadgroup_barrier", "simd_sum", "uint", "ulong"):
        if name in steering.CVEC_METAL_SOURCE:
            assert name in steering.CUDA_SHIM, name
    assert "CVEC_SHARED" in steering.METAL_SHIM


@pytest.mark.skipif(not CUDA, reason=NO_CUDA_REASON)
@pytest.mark.parametrize("rows", [1, 3, 8, 2048])
@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16, mx.float32], ids=["f16", "bf16", "f32"])
@pytest.mark.parametrize("mode", MODES)
def test_cuda_parity(rows, dtype, mode):
    for d in (2048, 576, 1000):         # Llama-1B and SmolLM2 widths; 1000: not a multiple of 32
        for s in SCALES:
            _check(_cuda, rows, d, s, mode, batch=(rows % 2 == 1), dtype=dtype)


@pytest.mark.skipif(not CUDA, reason=NO_CUDA_REASON)
def test_cuda_project_s1_removes_and_s2_reflects_and_dispatch_picks_cuda():
    assert active_backend() == "cuda"
    for rows, d in [(1, 4096), (3, 1000), (8, 64), (512, 2048)]:
        got, h_in, v = _check(steer, rows, d, 1.0, "project", batch=False)
        norms = np.linalg.norm(h_in, axis=-1)
        assert np.all(np.abs(got @ v) <= TOL_REL * norms)
        got, h_in, v = _check(steer, rows, d, 2.0, "project", batch=False)
        assert np.all(np.abs(got @ v + h_in.astype(np.float64) @ v) <= 2 * TOL_REL * norms)


@pytest.mark.parametrize("mode", MODES)
def test_steerer_matches_steer(mode):
    # the engine's per-layer form (vector, scale and call arguments bound once) is steer() exactly,
    # on whichever backend this machine has; shapes change between calls as decode and prefill do
    rng = np.random.default_rng(11)
    v = rng.standard_normal(1000).astype(np.float32)
    v /= np.linalg.norm(v)
    fn = steering.steerer(mx.array(v), 2.0, mode)
    for shape, dtype in [((1, 1, 1000), mx.float32), ((1, 7, 1000), mx.float32), ((1, 1, 1000), mx.float16),
                         ((3, 1000), mx.float32), ((1, 1, 1000), mx.float32)]:
        h = mx.array(rng.standard_normal(shape).astype(np.float32) * 3).astype(dtype)
        a, b = fn(h), steer(h, mx.array(v), 2.0, mode)
        assert a.dtype == dtype and a.shape == h.shape
        assert np.array_equal(np.array(a.astype(mx.float32)), np.array(b.astype(mx.float32)))
    with pytest.raises(ValueError):
        fn(mx.zeros((1, 999)))
    assert fn(mx.zeros((0, 1000))).size == 0


# ------------------------------------------------------------------ the fused form (block's residual add)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_fused_block_matches_block_then_steer(arch, mode):
    # SteeredLayer replaces the block's last residual add by the fused kernel (GPU) or add + op
    # (CPU): the same numbers as running the stock block and steering its output.
    import importlib

    from engine.steer.steering import SteeredLayer, SteeringState, _FUSABLE_CALLS
    mod = importlib.import_module(f"mlx_lm.models.{arch}")
    extra = {"head_dim": 16} if arch == "qwen3" else {}
    args = mod.ModelArgs(model_type=arch, hidden_size=64, num_hidden_layers=1, intermediate_size=96,
                         num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=32,
                         rope_theta=10000.0, tie_word_embeddings=True, max_position_embeddings=256,
                         **extra)
    block = mod.TransformerBlock(args)
    assert type(block).__call__ in _FUSABLE_CALLS
    rng = np.random.default_rng(4)
    v = rng.standard_normal(64).astype(np.float32)
    v /= np.linalg.norm(v)

    class _Vec:                              # the ControlVector surface SteeredLayer uses
        directions = {0: mx.array(v)}

        def steers(self, layer):
            return layer == 0

        def apply(self, h, layer):
            return steer(h, self.directions[0], 2.0, mode)

        def apply_residual(self, h, res, layer):
            return steering.fused_steerer(self.directions[0], 2.0, mode)(h, res)

    layer = SteeredLayer(block, 0, SteeringState(_Vec(), speed_projection=True))
    x = mx.array(rng.standard_normal((1, 5, 64)).astype(np.float32))
    for dtype in (mx.float32, mx.float16):
        block.set_dtype(dtype)
        xd = x.astype(dtype)
        got = layer(xd, "causal")
        want = steer(block(xd, "causal"), mx.array(v), 2.0, mode)
        assert got.dtype == want.dtype == dtype
        a, b = np.array(got.astype(mx.float32)), np.array(want.astype(mx.float32))
        if not (METAL or CUDA):
            assert np.array_equal(a, b)
        else:
            assert np.allclose(a, b, rtol=2.0 ** -9, atol=1e-5 * float(np.abs(b).max()))


@pytest.mark.skipif(not CUDA, reason=NO_CUDA_REASON)
@pytest.mark.parametrize("rows", [1, 3, 8, 2048])
@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16, mx.float32], ids=["f16", "bf16", "f32"])
@pytest.mark.parametrize("mode", MODES)
def test_cuda_fused_residual_parity(rows, dtype, mode):
    rng = np.random.default_rng(rows)
    for d in (2048, 576):
        h, v = _make(rows, d, seed=rows + d, batch=True)
        res = rng.standard_normal(h.shape).astype(np.float32)
        hm, rm = mx.array(h).astype(dtype), mx.array(res).astype(dtype)
        x_in = np.array((hm + rm).astype(mx.float32))        # the add, rounded to dtype as the block's
        out = steering.fused_steerer(mx.array(v), 2.0, mode)(hm, rm)
        mx.eval(out)
        got = np.array(out.astype(mx.float32)).astype(np.float64)
        ref = _ref(x_in, v, 2.0, mode)
        tol = TOL_REL * 2.0 * np.linalg.norm(x_in.astype(np.float64), axis=-1, keepdims=True)
        if dtype != mx.float32:
            tol = tol + np.abs(ref) * (2.0 ** -10 if dtype == mx.float16 else 2.0 ** -7)
        err = np.abs(got - ref)
        assert np.all(err <= tol), f"max err {err.max():.3e}, worst ratio {(err / tol).max():.2f}"
