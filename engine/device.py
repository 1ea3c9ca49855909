"""Which backend MLX computes on, asked in one place. The compute dtype is float32 on the CPU (MLX's
CPU backend has no fast half-precision math) and float16 on any GPU; CUDA is told apart because only
its fused attention is planned per shape (engine/model/attention.py)."""
from __future__ import annotations

import mlx.core as mx


def on_gpu() -> bool:
    return mx.default_device() == mx.gpu


def on_cuda() -> bool:
    return on_gpu() and bool(mx.cuda.is_available())


def compute_dtype_name() -> str:
    return "float16" if on_gpu() else "float32"


def compute_dtype():
    return mx.float16 if on_gpu() else mx.float32
