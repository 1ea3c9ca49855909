"""The memory estimate before a load (engine/model/memory_estimate.py): its parts against what MLX really
holds, the engine refusing (or shrinking the default context of) a model that does not fit, the CLI's
one line and exit 2, and `strata models estimate`."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest

from engine.model import memory_estimate as me
from engine.errors import StrataError
from engine.engine import Engine, EngineOptions, LoadModel, Status
from engine.model.gguf_file import open_gguf
from engine.memory.memory_guard import GiB, MemoryGuard, MemoryReading
from engine.model.model_loader import load_model
from gguf_factory import quantize_with_llama, write_tiny_gguf, write_tiny_moe_gguf

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("estimate")
    out = {
        "llama-F32": write_tiny_gguf(d / "llama.gguf", arch="llama", n_embd=64, n_ff=128, seed=0),
        "qwen3moe-F16": write_tiny_moe_gguf(d / "q3.gguf", arch="qwen3moe", n_expert=4, seed=1),
        "qwen2moe-Q8_0": write_tiny_moe_gguf(d / "q2.gguf", arch="qwen2moe", n_expert=4, tensor_type="Q8_0", seed=2),
    }
    try:
        # Q4_K_M: Q4_K exact repacks plus Q6_K tensors requantized to 8 bits
        out["mixtral-Q4_K_M"] = quantize_with_llama(write_tiny_moe_gguf(d / "mx.gguf", arch="mixtral", seed=3),
                                                    d / "mx-Q4_K_M.gguf", "Q4_K_M")
    except ImportError:
        pass
    return out


def _params_bytes(model) -> int:
    from mlx.utils import tree_flatten
    return sum(v.nbytes for _, v in tree_flatten(model.parameters()))


@pytest.mark.parametrize("name", ["llama-F32", "qwen3moe-F16", "qwen2moe-Q8_0", "mixtral-Q4_K_M"])
def test_weights_and_kv_are_exactly_what_mlx_holds(files, name):
    if name not in files:
        pytest.skip("llama-cpp-python (the llama.cpp oracle, used to quantize) is not installed")
    from mlx_lm.models.cache import make_prompt_cache
    path = files[name]
    model, _ = load_model(open_gguf(path))
    est = me.estimate(me.read_header(path), 300, "float32")
    assert est.weights_bytes == _params_bytes(model)
    cache = make_prompt_cache(model)
    mx.eval(model(mx.zeros((1, 300), dtype=mx.int32), cache=cache))
    assert est.kv_bytes == sum(c.keys.nbytes + c.values.nbytes for c in cache)   # 300 -> 512 slots


def test_real_model_weights_estimate(real_model):
    model, _ = load_model(open_gguf(real_model))
    assert me.estimate(me.read_header(real_model), 8192, "float32").weights_bytes == _params_bytes(model)


def test_the_stated_overhead_bounds_a_real_prefill(files):
    """Peak MLX memory of two 512-token prefill chunks above the weights: at most K/V + the overhead
    less its fixed runtime part (the runtime part is Python/MLX, outside MLX's allocator)."""
    from mlx_lm.models.cache import make_prompt_cache
    path = files["qwen3moe-F16"]
    model, _ = load_model(open_gguf(path))
    est = me.estimate(me.read_header(path), 1024, "float32")
    cache = make_prompt_cache(model)
    mx.clear_cache()
    base = mx.get_active_memory()
    mx.reset_peak_memory()
    for _ in range(2):
        mx.eval(model(mx.zeros((1, 512), dtype=mx.int32), cache=cache))
    used = mx.get_peak_memory() - base
    bound = est.kv_bytes + est.overhead_bytes - me.RUNTIME_OVERHEAD
    print(f"prefill peak {used / 2**20:.1f} MiB, estimate without the runtime part {bound / 2**20:.1f} MiB")
    assert 0 < used <= bound


def test_largest_context_is_the_largest_that_fits(files):
    est = me.estimate(me.read_header(files["qwen3moe-F16"]), 2048, "float32")
    per_token = est.kv_bytes_per_token + est.scores_bytes_per_token
    budget = est.weights_bytes + est.fixed_overhead_bytes + 1000 * per_token
    n = est.largest_context(budget, 2048)
    assert n == 768
    assert est.at_context(n).total_bytes <= budget < est.at_context(n + me.KV_STEP).total_bytes
    assert est.largest_context(est.weights_bytes, 2048) == 0


class Reader:
    """A memory reader with a set available amount (16 GiB machine: the reserve is 1.6 GiB)."""

    def __init__(self, available: int):
        self.available = available

    def __call__(self) -> MemoryReading:
        return MemoryReading(total_bytes=16 * GiB, available_bytes=self.available, source="test")


def _engine(path, available, **opts) -> Engine:
    eng = Engine(EngineOptions(model=str(path), cache_mib=0, **opts))
    eng.guard = MemoryGuard(reader=Reader(available))
    return eng.start()


def _available_for(path, n_tokens: int) -> int:
    """Available RAM that leaves room for about n_tokens of context after the reserve."""
    est = me.estimate(me.read_header(path), 2048, "float32")
    per_token = est.kv_bytes_per_token + est.scores_bytes_per_token
    return est.weights_bytes + est.fixed_overhead_bytes + n_tokens * per_token + max(GiB, 16 * GiB // 10)


def test_engine_shrinks_the_default_context_to_fit_and_says_so(files):
    eng = _engine(files["qwen3moe-F16"], _available_for(files["qwen3moe-F16"], 1000))
    try:
        assert eng.call(Status()).model is not None
        assert eng.call(Status()).context_length == 768
    finally:
        eng.stop()


def test_engine_refuses_an_explicit_context_that_does_not_fit_with_the_numbers(files):
    path = files["qwen3moe-F16"]
    eng = _engine(path, _available_for(path, 1000), context_length=2048)
    try:
        assert eng.call(Status()).model is None
        with pytest.raises(StrataError) as e:      # the engine's ModelTooLarge, as its one line
            eng.call(LoadModel(str(path)))
        msg = str(e.value)
        assert "\n" not in msg and "at context 2048 needs" in msg and "weights" in msg and "K/V" in msg
        assert "does not fit in" in msg and "(test: " in msg and "the largest context that fits is 768" in msg
    finally:
        eng.stop()


def test_engine_refuses_when_nothing_fits_and_keeps_the_loaded_model(files):
    small, big = files["llama-F32"], files["qwen3moe-F16"]
    eng = _engine(small, 64 * GiB)
    try:
        assert eng.call(Status()).model == str(small)
        eng.guard = MemoryGuard(reader=Reader(max(GiB, 16 * GiB // 10) + 10 * 2**20))  # 10 MiB over the reserve
        with pytest.raises(StrataError, match="no context fits"):
            eng.call(LoadModel(str(big)))
        assert eng.call(Status()).model == str(small)      # the old model still serves
    finally:
        eng.stop()


def _cli(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "engine.cli", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=300)


def test_cli_exits_2_with_one_line_when_the_context_cannot_fit(tmp_path):
    # 2^31 tokens of context: a TiB of K/V even for this tiny model
    huge = write_tiny_gguf(tmp_path / "huge-ctx.gguf", arch="llama", n_embd=64, n_ff=128, context_length=1 << 31)
    p = _cli("generate", "--model", str(huge), "--ctx", str(1 << 31), "--prompt", "hi", "-n", "2")
    err = p.stderr.strip().splitlines()
    assert p.returncode == 2 and len(err) == 1, p.stderr
    assert err[0].startswith("strata: huge-ctx.gguf at context 2147483648 needs ") and "does not fit" in err[0]


def test_models_estimate_prints_the_parts(files):
    p = _cli("models", "estimate", str(files["qwen3moe-F16"]), "--context", "1024", "--dtype", "float32")
    assert p.returncode == 0, p.stderr
    est = me.estimate(me.read_header(files["qwen3moe-F16"]), 1024, "float32")
    out = p.stdout
    assert "context 1024, compute float32" in out
    assert f"K/V       {me.gib(est.kv_bytes)}  ({est.kv_bytes_per_token} bytes/token x 1024 tokens" in out
    assert f"weights   {me.gib(est.weights_bytes)}" in out and f"total     {me.gib(est.total_bytes)}" in out
    assert "budget" in out and ("fits;" in out or "does not fit;" in out)
    bad = _cli("models", "estimate", str(files["qwen3moe-F16"]) + ".missing")
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1


def test_models_estimate_shows_file_and_held_bits_per_weight(files):
    """Honest bytes: the file's bits per weight (its tensor bytes, as gguf-py counts them) beside the held
    ones, and the weights line is the held size (what MLX holds once loaded), not the file's."""
    if "mixtral-Q4_K_M" not in files:
        pytest.skip("llama-cpp-python (the llama.cpp oracle, used to quantize) is not installed")
    from gguf import GGUFReader
    path = files["mixtral-Q4_K_M"]
    tensors = GGUFReader(str(path)).tensors
    n = sum(int(t.n_elements) for t in tensors)
    file_bytes = sum(int(t.n_bytes) for t in tensors)
    held = _params_bytes(load_model(open_gguf(path))[0])
    p = _cli("models", "estimate", str(path), "--context", "256", "--dtype", "float32")
    assert p.returncode == 0, p.stderr
    assert (f"weights   {me.gib(held)}  (tensors as held in MLX: {8 * file_bytes / n:.2f} bits/weight in the "
            f"file, {8 * held / n:.2f} held)") in p.stdout
    assert held > file_bytes          # Q6_K tensors held at 8 bits, scales and biases per 32


def test_the_estimate_module_does_not_import_mlx(files):
    """The app (which never imports mlx) can estimate: header parsing and arithmetic only."""
    code = ("import sys; import engine.model.memory_estimate as m; "
            "e = m.estimate(m.read_header(sys.argv[1]), 512, m.platform_dtype()); print(e.total_bytes); "
            "assert 'mlx' not in sys.modules and 'numpy' not in sys.modules")
    p = subprocess.run([sys.executable, "-c", code, str(files["qwen3moe-F16"])], cwd=REPO,
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert int(p.stdout) == me.estimate(me.read_header(files["qwen3moe-F16"]), 512, me.platform_dtype()).total_bytes
    with pytest.raises(me.ModelFileError, match="is not a GGUF file"):
        me.read_header(REPO / "tests" / "conftest.py")


def test_budget_sources():
    r = MemoryReading(total_bytes=16 * GiB, available_bytes=10 * GiB, source="meminfo")
    b = me.budget(r, 2 * GiB)
    assert b.bytes == 8 * GiB and b.source == "meminfo: 10.00 GiB available - 2.00 GiB reserve"
    # On a Mac with Metal the budget is what the GPU may wire, whatever the guard reads
    m = me.budget(r, 2 * GiB, gpu_working_set=12 * GiB)
    assert m.bytes == 12 * GiB and m.source == "Metal recommended working set less what MLX holds: 12.00 GiB"
    assert me.load_budget(MemoryGuard(reader=lambda: (_ for _ in ()).throw(RuntimeError("no"))), None) is None
