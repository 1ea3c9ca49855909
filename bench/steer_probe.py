"""What one steered layer's op costs on the host and on the device, form by form (a diagnostic for
bench/cvec.py: its "of which building the graph" row showed the kernel call's host cost).

    python bench/steer_probe.py [--width 576] [--layers 17] [--iters 300]

For each form, a chain of --layers calls on one decode row (1, 1, width) in float16, as a steered
forward makes them: the time to build the chain (host, per call) and to build and evaluate it (per
call). Forms: the block's plain residual add (the floor: an unsteered block does this add), the
fused kernel through steering.fused_steerer (the engine's path), the same under mx.compile, the
kernel object called with prebuilt arguments (MLX's own per-call cost), and MLX ops with the dot as a
matmul. Medians of --iters chains.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import mlx.core as mx  # noqa: E402

import engine.steer.steering as steering  # noqa: E402
from bench.harness import Run, add_args  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--width", type=int, default=576)
    ap.add_argument("--layers", type=int, default=17)
    ap.add_argument("--iters", type=int, default=300)
    add_args(ap)
    a = ap.parse_args()
    if a.width < 1 or a.layers < 1 or a.iters < 1:
        print("width, layers and iters must be positive", file=sys.stderr)
        return 2
    dt = mx.float16
    v = mx.random.normal((a.width,))
    v = v / mx.linalg.norm(v)
    scale = 2.0
    h = mx.random.normal((1, 1, a.width)).astype(dt)
    res = (0.1 * mx.random.normal((1, 1, a.width))).astype(dt)
    mx.eval(v, h, res)
    forms = {"residual add (floor)": lambda x, r: x + r}
    backend = steering.active_backend()
    forms[f"fused_steerer ({backend})"] = steering.fused_steerer(v, scale, "project")
    forms["fused_steerer, call under mx.compile"] = mx.compile(steering.fused_steerer(v, scale, "project"))
    if backend != "portable":
        kernel = steering._get_kernel(backend, residual=True)
        kw = steering.metal_call_args(h, v, scale, "project")
        s_arr = kw["inputs"][2]
        del kw["inputs"]
        forms["kernel object, prebuilt arguments"] = lambda x, r: kernel(inputs=[x, r, v, s_arr], **kw)[0]
    col = (scale * v).astype(dt)[:, None]
    v16 = v.astype(dt)
    mx.eval(col, v16)

    def matmul_form(x, r):
        y = x + r
        return y - (y @ col) * v16
    forms["MLX ops, dot as matmul (f16)"] = matmul_form
    print(f"mlx {mx.__version__} on {mx.default_device()}, backend {backend}, width {a.width}, "
          f"{a.layers} calls per chain, {a.iters} chains")
    print("| form | build, us per call | build + eval, us per call |")
    print("|---|---:|---:|")
    rec = Run(out=a.out)
    for name, fn in forms.items():
        for _ in range(5):
            x = h
            for _ in range(a.layers):
                x = fn(x, res)
            mx.eval(x)
        build, total = [], []
        for _ in range(a.iters):
            t0 = time.perf_counter()
            x = h
            for _ in range(a.layers):
                x = fn(x, res)
            t1 = time.perf_counter()
            mx.eval(x)
            t2 = time.perf_counter()
            build.append((t1 - t0) / a.layers * 1e6)
            total.append((t2 - t0) / a.layers * 1e6)
        print(f"| {name} | {statistics.median(build):.1f} | {statistics.median(total):.1f} |")
        setup = dict(width=a.width, layers=a.layers, rounds=a.iters, backend=backend)
        rec.record(f"{name} build", statistics.median(build), "us/call", **setup)
        rec.record(f"{name} build + eval", statistics.median(total), "us/call", **setup)
    return 0


if __name__ == "__main__":
    sys.exit(main())
