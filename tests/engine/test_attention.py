"""engine/model/attention.py: the explicit short-chunk attention used on CUDA equals MLX's fused attention.
The function is portable, so it is checked here on the CPU against mx.fast.scaled_dot_product_attention
(and through a real model's forward pass with `install(force=True)`); whether it is *faster* on CUDA
is a benchmark (bench/sdpa_probe.py, bench/turns.py on the H200; bench/gpu.md)."""
from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from engine.model import attention
from engine.device import on_gpu

# On the H200 (MLX's CUDA backend) the explicit float32 matmuls and the fused kernel differ by up to
# 1.1e-4 on values of ~0.1 at 700 keys (s5-run7): cuBLAS's float32 matmul precision, not the algorithm,
# which the CPU checks to 1e-5.
TOL = dict(rtol=2e-3, atol=5e-4) if on_gpu() else dict(rtol=1e-4, atol=1e-5)


def _qkv(b, hq, hk, n_q, n_k, d, seed=0):
    mx.random.seed(seed)
    return (mx.random.normal((b, hq, n_q, d)), mx.random.normal((b, hk, n_k, d)),
            mx.random.normal((b, hk, n_k, d)))


@pytest.mark.parametrize("hq,hk,n_q,n_k", [(4, 2, 3, 3), (4, 2, 5, 40), (9, 3, 33, 300), (8, 8, 64, 64), (32, 8, 2, 700)])
def test_causal_matches_fused(hq, hk, n_q, n_k):
    q, k, v = _qkv(1, hq, hk, n_q, n_k, 16)
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.25, mask="causal")
    got = attention.explicit_attention(q, k, v, scale=0.25, mask="causal")
    np.testing.assert_allclose(np.array(got), np.array(want), **TOL)


def test_array_masks_match_fused():
    q, k, v = _qkv(2, 4, 2, 6, 20, 8, seed=1)
    allowed = mx.array(np.random.default_rng(0).random((6, 20)) > 0.3) | mx.eye(6, 20, k=14).astype(mx.bool_)
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.3, mask=allowed)
    np.testing.assert_allclose(np.array(attention.explicit_attention(q, k, v, scale=0.3, mask=allowed)),
                               np.array(want), **TOL)
    additive = mx.where(allowed, 0.0, -1e9)
    np.testing.assert_allclose(np.array(attention.explicit_attention(q, k, v, scale=0.3, mask=additive)),
                               np.array(want), **TOL)


def test_only_short_chunks_take_the_explicit_path():
    def shape(n_q, n_k, hq=32):
        return mx.zeros((1, hq, n_q, 4)), mx.zeros((1, 8, n_k, 4))
    assert not attention.use_explicit(*shape(1, 5000))           # a decode step: MLX's vector kernel
    assert attention.use_explicit(*shape(33, 2033))               # a returning turn
    assert not attention.use_explicit(*shape(attention.EXPLICIT_MAX_QUERIES + 1, 100))
    assert not attention.use_explicit(*shape(64, 1 << 20))        # scores too large: fused kernel


def test_installed_only_on_cuda(tiny_gguf):
    """On CUDA the loader routes short chunks through the explicit form and says so; elsewhere
    (CPU here, Metal) mlx-lm's attention stays untouched."""
    from engine.model.gguf_file import open_gguf
    from engine.model.model_loader import load_model
    model, info = load_model(open_gguf(tiny_gguf))
    cuda = mx.default_device() == mx.gpu and mx.cuda.is_available()
    assert attention.needed() is cuda
    assert ("explicit attention" in info.load_note) is cuda
    if not cuda:
        assert not attention.install(model)


def test_forced_install_keeps_the_forward_pass(tiny_gguf):
    """A real model's prefill of a short chunk over a cached history, with and without the swap."""
    from mlx_lm.models.cache import make_prompt_cache

    from engine.model.gguf_file import open_gguf
    from engine.model.model_loader import load_model
    model, _ = load_model(open_gguf(tiny_gguf))
    history, chunk = mx.array([list(range(10, 60))]), mx.array([list(range(70, 90))])

    def run():
        cache = make_prompt_cache(model)
        model(history, cache=cache)
        return np.array(model(chunk, cache=cache))

    want = run()
    assert attention.install(model, force=True)
    try:
        import sys
        assert hasattr(sys.modules[type(model).__module__].scaled_dot_product_attention, "strata_original")
        got = run()
    finally:
        attention.uninstall(model)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
