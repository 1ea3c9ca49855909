"""Images through a pixtral projector: encode time against llama.cpp's libmtmd.

    .venv/bin/python bench/vision_pixtral.py [--rounds 3] [--layers 2] [--width 448 --height 336]

One Pillow-made photo through a pixtral projector of Mistral Small 3.1's vision shape (width 1024, MLP
4096, 16 heads, 14-pixel patches merged 2 x 2; `--layers`: 2 by default so a shared CPU runs it in
seconds, the real tower has 24) with random weights (tests/gguf_factory_vision_pixtral.py), in Strata
(preprocess + the MLX tower, evaluated) and in libmtmd (`mtmd_encode_chunk` through the llama.cpp
oracle's worker process: its figure includes the image's tokenization and one IPC round trip, a few ms),
alternated, median of --rounds after one warm-up each (libmtmd's warm-up is the largest image the
projector takes, so its compute buffer is sized once). Ratio libmtmd / Strata: >= 1.0x is as fast.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import mlx.core as mx   # noqa: E402

import llama_oracle    # noqa: E402
import mtmd_oracle     # noqa: E402
from gguf_factory_vision_pixtral import write_pixtral_vision_pair   # noqa: E402
from vision_images import photo, png   # noqa: E402

from bench.harness import Run, add_args   # noqa: E402
from engine.vision import mmproj   # noqa: E402
from engine.vision.images import decode_image   # noqa: E402

SHAPE = dict(n_embd=1024, n_ff=4096, n_head=16, patch=14, merge=2, image_size=1540)   # Mistral Small 3.1's


def encode_times(folder: Path, args) -> tuple[list[float], list[float], dict]:
    model, mm = write_pixtral_vision_pair(folder, mmproj_kw=dict(SHAPE, n_layer=args.layers))
    proj = mmproj.load_projector(mm, "mistral3", 256)
    tower = proj.spec.tower
    rgb = decode_image(png(photo(args.width, args.height, seed=7))).rgb
    tokens = tower.prepare(rgb, proj.spec).n_tokens

    def ours() -> float:
        t0 = time.perf_counter()
        mx.eval(tower.encode(proj, tower.prepare(rgb, proj.spec)))
        return time.perf_counter() - t0

    def theirs() -> float:
        t0 = time.perf_counter()
        mtmd_oracle.encode(model, mm, rgb)
        return time.perf_counter() - t0
    ours()
    mtmd_oracle.encode(model, mm, photo(896, 896, seed=1))      # the largest image: 1024 tokens
    theirs()
    a, b = [], []
    for _ in range(args.rounds):
        a.append(ours())
        b.append(theirs())
    return a, b, {"layers": args.layers, "image": f"{args.width}x{args.height}", "tokens": tokens}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--width", type=int, default=448)
    ap.add_argument("--height", type=int, default=336)
    add_args(ap)
    args = ap.parse_args()
    if not llama_oracle.available():
        sys.exit("llama-cpp-python is not installed")
    run = Run(out=args.out)
    with tempfile.TemporaryDirectory() as d:
        ours, theirs, shape = encode_times(Path(d), args)
    mo, mt = statistics.median(ours), statistics.median(theirs)
    run.record("pixtral_encode_ms", round(mo * 1e3, 1), "ms", spread=[min(ours) * 1e3, mo * 1e3, max(ours) * 1e3],
               rounds=args.rounds, **shape)
    run.record("pixtral_encode_libmtmd_ms", round(mt * 1e3, 1), "ms", rounds=args.rounds, **shape)
    run.record("pixtral_encode_ratio", round(mt / mo, 2), "x", peer="libmtmd", rounds=args.rounds, **shape,
               line=f"pixtral encode ({shape}): Strata {mo * 1e3:.1f} ms, libmtmd {mt * 1e3:.1f} ms, "
                    f"libmtmd/Strata {mt / mo:.2f}x")


if __name__ == "__main__":
    main()
