"""Steering the residual stream: one dispatch function and the block wrapper.

``steer(h, vec, scale, mode)`` is the only entry point for the operation; it picks
* on a GPU, one fused kernel per call built from ONE body, shaders/cvec.metal, written in Metal's
  dialect: through ``mx.fast.metal_kernel`` when ``mx.metal.is_available()``, and through
  ``mx.fast.cuda_kernel`` on MLX's CUDA backend, where a small header (``CUDA_SHIM``) maps the few
  Metal names the body uses (thread indices, ``simd_sum``, ``threadgroup_barrier``, the shared
  array's address space) onto CUDA's; Metal gets the one-line ``METAL_SHIM``;
* otherwise (CPU) the portable path: plain MLX ops under ``mx.compile`` (the reference).
Callers never learn which ran; ``active_backend()`` exists for the log and the bench only.
The engine's blocks use two prepared forms of the same operation: ``steerer()`` (vector, scale and
call arguments bound once) and ``fused_steerer()``, which takes the block's last residual add
(h + res) into the kernel so a steered block launches nothing extra (SteeredLayer does this for
mlx-lm's llama/qwen2/qwen3 blocks, whose forward it mirrors). The CUDA build is tested on an H200;
the Metal build has never been compiled (no Mac). ``warm_up()`` compiles the kernel for a model's width and dtype ahead (the engine calls it at load),
so no request waits for a compiler.

    add:     h + s d
    project: h - s (h.v) v      (v a unit vector; s = 1 removes the component, s = 2 reflects it)

``h`` is (B, L, D) or (L, D) (any leading shape), float32, float16 or bfloat16; the dot product
and the update are computed in float32 and the result is cast back to ``h.dtype``.
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable

import mlx.core as mx
import mlx.nn as nn
import time

from engine.device import on_cuda
from engine.paths import bundle_root

SHADER_NAME = "cvec.metal"
KERNEL_NAME = "strata_cvec"
INPUT_NAMES = ("h", "vec", "scale")
OUTPUT_NAMES = ("out",)


def shaders_dir() -> Path:
    """shaders/ at the repo root, or in PyInstaller's unpack dir when frozen (engine.paths.bundle_root)."""
    return bundle_root() / "shaders"


def _read_shader() -> str | None:
    try:
        return (shaders_dir() / SHADER_NAME).read_text(encoding="utf-8")
    except OSError:
        return None


CVEC_METAL_SOURCE: str | None = _read_shader()  # read at import


# --------------------------------------------------------------------------------------------
# Portable path: the reference.
# --------------------------------------------------------------------------------------------
def _add_ref(h: mx.array, d: mx.array, s: mx.array) -> mx.array:
    hf = h.astype(mx.float32)
    return (hf + s * d).astype(h.dtype)


def _project_ref(h: mx.array, v: mx.array, s: mx.array) -> mx.array:
    hf = h.astype(mx.float32)
    dot = mx.sum(hf * v, axis=-1, keepdims=True)
    return (hf - (s * dot) * v).astype(h.dtype)


_add_compiled = mx.compile(_add_ref)
_project_compiled = mx.compile(_project_ref)
# The block's last residual add inside the same compiled function: one graph node for a steered
# block's add + steering, as the fused kernel is on a GPU.
_add_residual_compiled = mx.compile(lambda h, res, d, s: _add_ref(h + res, d, s))
_project_residual_compiled = mx.compile(lambda h, res, v, s: _project_ref(h + res, v, s))


def _steer_portable(h: mx.array, vec: mx.array, scale: float, mode: str) -> mx.array:
    s = mx.array(scale, dtype=mx.float32)
    v = vec.astype(mx.float32)
    return _add_compiled(h, v, s) if mode == "add" else _project_compiled(h, v, s)


# --------------------------------------------------------------------------------------------
# The fused kernel: one body (shaders/cvec.metal), one shim per backend. Construction
# (kernel_spec) and call arguments (metal_call_args) are plain data so they can be inspected on a
# machine without a GPU; only the call itself needs one.
# --------------------------------------------------------------------------------------------
# Metal: the body's names are Metal's own; only the shared array's address space is a macro.
METAL_SHIM = "#define CVEC_SHARED threadgroup\n"

# CUDA: MLX's cuda_kernel puts the body inside a generated __global__ function (inputs as
# `const T*`, outputs as `T*`, template ints/bools as constexpr, dtypes as `using`), so the shim
# only names what Metal provides and CUDA spells differently. Grid and threadgroup are passed in
# threads, as on Metal (MLX divides the grid by the block size).
CUDA_SHIM = r"""
typedef unsigned int uint;
typedef unsigned long long ulong;
#define CVEC_SHARED __shared__
#define threadgroup_position_in_grid blockIdx
#define thread_position_in_threadgroup threadIdx
#define thread_index_in_simdgroup (threadIdx.x & 31u)
#define simdgroup_index_in_threadgroup (threadIdx.x >> 5)
#define simdgroups_per_threadgroup (blockDim.x >> 5)
#define threadgroup_barrier(flags) __syncthreads()
__device__ __forceinline__ float simd_sum(float x) {
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}
"""


RESIDUAL_INPUT_NAMES = ("h", "res", "vec", "scale")


def kernel_spec(backend: str = "metal", residual: bool = False) -> dict:
    """Keyword arguments for ``mx.fast.metal_kernel`` / ``mx.fast.cuda_kernel`` (documented names).
    ``residual``: the fused form, steering h + res (the block's last residual add) in one kernel."""
    if CVEC_METAL_SOURCE is None:
        raise RuntimeError(f"{SHADER_NAME} not found in {shaders_dir()}")
    if backend not in ("metal", "cuda"):
        raise ValueError(f"no kernel for backend {backend!r}")
    return dict(
        name=KERNEL_NAME + ("_res" if residual else ""),
        input_names=list(RESIDUAL_INPUT_NAMES if residual else INPUT_NAMES),
        output_names=list(OUTPUT_NAMES),
        source=CVEC_METAL_SOURCE,
        header=(METAL_SHIM if backend == "metal" else CUDA_SHIM) + ("#define CVEC_RESIDUAL 1\n" if residual else ""),
        ensure_row_contiguous=True,
    )


def metal_kernel_spec() -> dict:
    return kernel_spec("metal")


def threads_per_row(d: int) -> int:
    """Threads per threadgroup (= per row): a multiple of 32 (the simd width), at most 256."""
    return max(32, min(256, (d + 31) // 32 * 32))


_scale_arrays: dict[float, mx.array] = {}


def _scale_array(scale: float) -> mx.array:
    """One (1,) float32 array per scale, made once: a decode step makes no new host arrays."""
    a = _scale_arrays.get(scale)
    if a is None:
        a = _scale_arrays[scale] = mx.array([scale], dtype=mx.float32)
    return a


def metal_call_args(h: mx.array, vec: mx.array, scale: float, mode: str) -> dict:
    """Keyword arguments for calling the kernel object (documented names: inputs, template,
    grid, threadgroup, output_shapes, output_dtypes). ``grid`` counts threads (dispatchThreads);
    the same arguments serve the CUDA build."""
    d = int(h.shape[-1])
    rows = h.size // d if d else 0
    tg = threads_per_row(d)
    return dict(
        inputs=[h, vec if vec.dtype == mx.float32 else vec.astype(mx.float32), _scale_array(float(scale))],
        template=[("T", h.dtype), ("D", d), ("TG", tg), ("PROJECT", mode == "project")],
        grid=(rows * tg, 1, 1),
        threadgroup=(tg, 1, 1),
        output_shapes=[tuple(h.shape)],
        output_dtypes=[h.dtype],
    )


_kernels: dict[str, object] = {}


def _get_kernel(backend: str, residual: bool = False):
    k = _kernels.get((backend, residual))
    if k is None:
        make = mx.fast.metal_kernel if backend == "metal" else mx.fast.cuda_kernel
        k = _kernels[(backend, residual)] = make(**kernel_spec(backend, residual))
    return k


def _steer_metal(h: mx.array, vec: mx.array, scale: float, mode: str) -> mx.array:
    return _get_kernel("metal")(**metal_call_args(h, vec, scale, mode))[0]


def _steer_cuda(h: mx.array, vec: mx.array, scale: float, mode: str) -> mx.array:
    return _get_kernel("cuda")(**metal_call_args(h, vec, scale, mode))[0]


# --------------------------------------------------------------------------------------------
# Dispatch.
# --------------------------------------------------------------------------------------------
def _metal_usable() -> bool:
    try:
        return bool(mx.metal.is_available()) and CVEC_METAL_SOURCE is not None
    except Exception:
        return False


def _cuda_usable() -> bool:
    try:
        return on_cuda() and CVEC_METAL_SOURCE is not None
    except Exception:
        return False


_BACKEND: str | None = None


def active_backend() -> str:
    """'metal', 'cuda' or 'portable' (decided once per process)."""
    global _BACKEND
    if _BACKEND is None:
        _BACKEND = "metal" if _metal_usable() else "cuda" if _cuda_usable() else "portable"
    return _BACKEND


def steer(h: mx.array, vec: mx.array, scale: float, mode: str) -> mx.array:
    if mode not in ("add", "project"):
        raise ValueError(f"steering mode {mode!r} is not 'add' or 'project'")
    if h.ndim < 1 or h.shape[-1] != vec.shape[-1] or vec.ndim != 1:
        raise ValueError(f"steering: h {tuple(h.shape)} and vec {tuple(vec.shape)} widths differ")
    if h.size == 0:
        return h
    backend = _BACKEND or active_backend()
    if backend == "metal":
        return _steer_metal(h, vec, scale, mode)
    if backend == "cuda":
        return _steer_cuda(h, vec, scale, mode)
    return _steer_portable(h, vec, scale, mode)


def _check_width(h: mx.array, width: int) -> None:
    if h.ndim < 1 or h.shape[-1] != width:
        raise ValueError(f"steering: h {tuple(h.shape)} and vec ({width},) widths differ")


def _check_fused(h: mx.array, res: mx.array, width: int) -> None:
    if h.ndim < 1 or h.shape[-1] != width or res.shape != h.shape or res.dtype != h.dtype:
        raise ValueError(f"steering: h {tuple(h.shape)}, res {tuple(res.shape)} and vec ({width},) differ")


def steerer(vec: mx.array, scale: float, mode: str) -> Callable[[mx.array], mx.array]:
    """``steer`` with one vector and scale bound, for a layer that steers every step: the vector,
    the scale array and the kernel's call arguments per input shape are made once, so a decode
    step pays for the kernel call alone (the engine's per-layer path; ``steer`` is its reference)."""
    if mode not in ("add", "project"):
        raise ValueError(f"steering mode {mode!r} is not 'add' or 'project'")
    if vec.ndim != 1:
        raise ValueError(f"steering: vec {tuple(vec.shape)} is not one-dimensional")
    v = vec if vec.dtype == mx.float32 else vec.astype(mx.float32)
    width = int(v.shape[0])
    backend = _BACKEND or active_backend()
    if backend == "portable":
        s = mx.array(scale, dtype=mx.float32)
        fn = _add_compiled if mode == "add" else _project_compiled

        def run_portable(h: mx.array) -> mx.array:
            _check_width(h, width)
            return h if h.size == 0 else fn(h, v, s)
        return run_portable
    kernel = _get_kernel(backend)
    s_arr = _scale_array(float(scale))
    calls: dict = {}

    def run_kernel(h: mx.array) -> mx.array:
        key = (h.shape, h.dtype)
        kw = calls.get(key)
        if kw is None:
            _check_width(h, width)
            if h.size == 0:
                return h
            kw = calls[key] = metal_call_args(h, v, scale, mode)
            del kw["inputs"]
        return kernel(inputs=[h, v, s_arr], **kw)[0]
    return run_kernel


def fused_steerer(vec: mx.array, scale: float, mode: str) -> Callable[[mx.array, mx.array], mx.array]:
    """(h, res) -> steer(h + res): the block's last residual add and the steering in one kernel on a
    GPU (the add is replaced, so a steered block launches nothing extra); on the CPU the add and the
    portable op in one compiled function. ``h + res`` is rounded to h's dtype first on every path, as
    the block's own add."""
    if mode not in ("add", "project"):
        raise ValueError(f"steering mode {mode!r} is not 'add' or 'project'")
    backend = _BACKEND or active_backend()
    v = vec if vec.dtype == mx.float32 else vec.astype(mx.float32)
    width = int(v.shape[0])
    if backend == "portable":
        s = mx.array(scale, dtype=mx.float32)
        fn = _add_residual_compiled if mode == "add" else _project_residual_compiled

        def run_portable(h: mx.array, res: mx.array) -> mx.array:
            _check_fused(h, res, width)
            return h + res if h.size == 0 else fn(h, res, v, s)
        return run_portable
    kernel = _get_kernel(backend, residual=True)
    s_arr = _scale_array(float(scale))
    calls: dict = {}

    def run_kernel(h: mx.array, res: mx.array) -> mx.array:
        key = (h.shape, h.dtype, res.shape, res.dtype)
        kw = calls.get(key)
        if kw is None:
            _check_fused(h, res, width)
            if h.size == 0:
                return h + res
            kw = calls[key] = metal_call_args(h, v, scale, mode)
            del kw["inputs"]
        return kernel(inputs=[h, res, v, s_arr], **kw)[0]
    return run_kernel


def warm_up(vector, dtype) -> float:
    """Compile (and run once) the steering op for `vector`'s width, mode and scale in `dtype`, on
    one row and on two (the portable path traces per shape; the kernel compiles once per dtype and
    width), so the first steered request does not stall on a compiler. Returns seconds spent."""
    t0 = time.perf_counter()
    if vector is None or not vector.directions:
        return 0.0
    layer, vec = next(iter(vector.directions.items()))
    outs = []
    for rows in (1, 2):
        z = mx.zeros((1, rows, vec.shape[0]), dtype=dtype)
        outs += [vector.apply(z, layer), vector.apply_residual(z, z, layer)]
    mx.eval(outs)
    return time.perf_counter() - t0


# --------------------------------------------------------------------------------------------
# The per-request switch and the block wrapper.
# --------------------------------------------------------------------------------------------
class SteeringState:
    """Shared by every SteeredLayer of a model: flip ``speed_projection`` per request (the one name of
    the switch, as in EngineOptions, GenerateRequest and Configure).

    Off (or no vector): the wrappers return the block output untouched, no extra op."""

    __slots__ = ("speed_projection", "vector", "rows")

    def __init__(self, vector=None, *, speed_projection: bool):     # the load says (EngineOptions' default)
        self.vector = vector
        self.speed_projection = speed_projection
        # Continuous batching (engine/generation/batching.py): in a batched step of several conversations, a (B, 1, 1) bool
        # array, True for the rows whose turn is steered (the others get the block's own output:
        # stock); None outside a batch.
        self.rows = None

    @property
    def active(self) -> bool:
        return self.speed_projection and self.vector is not None

    def fingerprint(self) -> str:
        """Cache identity: '' when off, the vector's fingerprint when on (K/V computed with the
        vector on must never be reused with it off, nor the other way round)."""
        return self.vector.fingerprint() if self.active else ""


class SteeredLayer(nn.Module):
    """Wraps ``model.model.layers[i]``: calls it, then steers its output when the state says so.

    The block stays a child module (its parameters appear under ``block.``), so install after
    the weights are loaded. Attribute reads the wrapper does not know (``use_sliding``, ...) go
    to the block. The switch is read at call time: do not ``mx.compile`` a forward that
    contains wrappers unless the state is fixed for that compiled function."""

    def __init__(self, block: nn.Module, index: int, state: SteeringState):
        super().__init__()
        self.block = block
        self.layer_index = int(index)
        self.steering_state = state

    def __getattr__(self, key):
        try:
            return super().__getattr__(key)
        except AttributeError:
            if key != "block" and "block" in self:
                return getattr(self["block"], key)
            raise

    def __call__(self, x, *args, **kwargs):
        st = self.steering_state
        if not st.speed_projection or st.vector is None or not st.vector.steers(self.layer_index):
            return self.block(x, *args, **kwargs)
        b = self.block
        if st.rows is not None:     # a batch mixing steered and plain rows (selected, not blended)
            return self._steer_rows(x, st, *args, **kwargs)
        if type(b).__call__ in _FUSABLE_CALLS:
            # mlx-lm's pre-norm block, step for step, with its last residual add done by the
            # steering kernel: a steered block costs no extra kernel launch.
            r = b.self_attn(b.input_layernorm(x), *args, **kwargs)
            h = x + r
            return st.vector.apply_residual(h, b.mlp(b.post_attention_layernorm(h)), self.layer_index)
        return _hidden_mapped(b(x, *args, **kwargs), lambda h: st.vector.apply(h, self.layer_index))


    def _steer_rows(self, x, st: SteeringState, *args, **kwargs):
        """The steered and the plain output of one batched step, each row taking its own: a steered
        row gets exactly what it gets alone (the same fused or unfused op), a plain row the block's."""
        b = self.block
        if type(b).__call__ in _FUSABLE_CALLS:
            r = b.self_attn(b.input_layernorm(x), *args, **kwargs)
            h = x + r
            m = b.mlp(b.post_attention_layernorm(h))
            return mx.where(st.rows, st.vector.apply_residual(h, m, self.layer_index), h + m)
        return _hidden_mapped(b(x, *args, **kwargs),
                              lambda h: mx.where(st.rows, st.vector.apply(h, self.layer_index), h))


def _hidden_mapped(out, fn):
    """`fn` on a block's output hidden state: Gemma 4's blocks return (hidden, shared K/V, offset)."""
    return (fn(out[0]),) + tuple(out[1:]) if isinstance(out, tuple) else fn(out)


def _fusable_calls() -> set:
    """The __call__ of mlx-lm blocks that are exactly `h = x + attn(norm(x)); out = h + mlp(norm(h))`
    (llama, qwen2, qwen3 in mlx-lm 0.32; tests/engine/test_control_vector.py checks fused == unfused)."""
    calls = set()
    for name in ("llama", "qwen2", "qwen3"):
        try:
            module = __import__(f"mlx_lm.models.{name}", fromlist=["TransformerBlock"])
            calls.add(module.TransformerBlock.__call__)
        except (ImportError, AttributeError):
            pass
    return calls


_FUSABLE_CALLS = _fusable_calls()


def _layers_owner(model: nn.Module):
    inner = getattr(model, "model", None)
    if isinstance(inner, nn.Module) and isinstance(getattr(inner, "layers", None), list):
        return inner
    if isinstance(getattr(model, "layers", None), list):
        return model
    raise TypeError("install: the model keeps no list of blocks at model.model.layers or model.layers")


def install(model: nn.Module, state: SteeringState) -> None:
    """Wrap every block in place (idempotent: an installed model gets the new state)."""
    owner = _layers_owner(model)
    layers = owner.layers
    for i, block in enumerate(layers):
        if isinstance(block, SteeredLayer):
            block.steering_state = state
        else:
            layers[i] = SteeredLayer(block, i, state)
