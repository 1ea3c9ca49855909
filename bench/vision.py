"""Images: encode time against llama.cpp's libmtmd, and a follow-up turn after an image.

    .venv/bin/python bench/vision.py [--rounds 5] [--layers 2] [--image-size 224] [--full] [--gen 4]

1. Encode: one Pillow-made photo through a gemma3 projector of SigLIP's width (1152, MLP 4304, 16 heads,
   14-pixel patches; `--layers`, `--image-size`: 2 layers at 224 pixels by default, so a shared CPU runs
   it in seconds; `--full` is Gemma 3's own tower, 27 layers at 896 pixels) with random weights (written
   by tests/gguf_factory_vision.py), in Strata (preprocess + the MLX tower, evaluated) and in libmtmd
   (`mtmd_encode_chunk` through the llama.cpp oracle's worker process: its figure includes the image's
   tokenization and one IPC round trip, a few ms), alternated, median of --rounds after one warm-up each.
   Target: Strata's encode time <= libmtmd's (ratio libmtmd / Strata >= 1.0x). On a GPU the tower runs
   in float16 as the engine runs it; `--no-llama` (a machine without llama-cpp-python) times Strata
   alone (the GPU target: Gemma 3's tower on an 896x896 image <= 100 ms).
2. Follow-up: on the tiny Gemma 3 + gemma3 mmproj of the tests, a first turn with an image, then a
   text follow-up in the same chat, and for comparison a text-only chat of the same shape and its
   follow-up (both sending back the same assistant text; medians of 3 chats). TTFT of each; the
   follow-up after the image must encode nothing (Status's images_encoded) and its TTFT be within 1.2x
   of the text-only follow-up's.
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
from gguf_factory_vision import write_gemma3_vision_pair   # noqa: E402
from vision_images import photo, png   # noqa: E402

from bench.harness import Run, add_args   # noqa: E402
from engine.api import EngineOptions, GenerateRequest, ImageInput, Status   # noqa: E402
from engine.engine import Engine   # noqa: E402
from engine.device import on_gpu   # noqa: E402
from engine.vision.images import decode_image   # noqa: E402
from engine.sampling import SamplingParams   # noqa: E402
from engine.vision import mmproj   # noqa: E402


def encode_times(folder: Path, args) -> tuple[list[float], list[float], dict]:
    size = 896 if args.full else args.image_size
    layers = 27 if args.full else args.layers
    shape = dict(n_embd=1152, n_ff=4304, n_layer=layers, n_head=16, image_size=size, patch=14, pool=4)
    model, mm = write_gemma3_vision_pair(folder / "siglip", mmproj_kw=shape, mmproj_name="mmproj-siglip.gguf")
    proj = mmproj.load_projector(mm, "gemma3", 256, mx.float16 if on_gpu() else mx.float32)
    rgb = decode_image(png(photo(size, size, seed=7) if args.full else photo(640, 480, seed=7))).rgb

    def ours() -> float:
        t0 = time.perf_counter()
        mx.eval(proj.spec.tower.encode(proj, proj.spec.tower.prepare(rgb, proj.spec)))
        return time.perf_counter() - t0

    def theirs() -> float:
        t0 = time.perf_counter()
        mtmd_oracle.encode(model, mm, rgb)
        return time.perf_counter() - t0
    if args.no_llama:
        theirs = None
    ours(), theirs and theirs()               # warm-up: kernels built, the worker's model loaded
    a, b = [], []
    for _ in range(args.rounds):
        a.append(ours())
        if theirs is not None:
            b.append(theirs())
    return a, b, {"layers": layers, "image_size": size, "tokens": proj.spec.tower.max_tokens(proj.spec)}


def ttft(eng, messages, conv: str, gen: int):
    r = eng.call(GenerateRequest(messages=messages, conversation=conv,
                                 sampling=SamplingParams(temperature=0.0, max_tokens=gen)))
    return r, r.ttft_ms


REPLY = "It shows a picture."     # the assistant turn both chats send back (see follow_up)


def follow_up(folder: Path, gen: int, reps: int = 3, n_images: int = 1) -> dict:
    """TTFT of a text follow-up after `n_images` images (320x240 for one; 1280x960 photos, a phone's
    size, for more: what a follow-up must not decode and prepare again) against a text-only chat's
    follow-up of the same shape, medians of `reps` chats each. Both chats send back the same assistant text: the tiny random model's
    own replies are partial UTF-8 byte tokens whose text re-tokenizes differently from chat to chat (one
    follow-up read 35 tokens again, the other 17), which is not what is measured."""
    model, _ = write_gemma3_vision_pair(folder / "tiny", text_kw={"context_length": 8192})
    eng = Engine(EngineOptions(model=str(model), cache_mib=256)).start()
    eng.startup.result()
    try:
        size = (320, 240) if n_images == 1 else (1280, 960)
        imgs = [{"type": "image", "image": ImageInput(png(photo(*size, seed=3 + k)), f"photo{k}.png")}
                for k in range(n_images)]
        q = "Describe what you see in detail, please."
        first = [{"role": "user", "content": [{"type": "text", "text": q}, *imgs]}]
        text = [{"role": "user", "content": q + " word" * (258 * n_images)}]     # about the images' length in text
        after = [{"role": "assistant", "content": REPLY}, {"role": "user", "content": "And the colours?"}]
        firsts, follows, texts, encoded = [], [], [], 0
        for i in range(reps):
            _r1, t_first = ttft(eng, first, f"img{i}", gen)
            n = eng.call(Status()).vision["images_encoded"]
            r2, t_follow = ttft(eng, first + after, f"img{i}", gen)
            encoded += eng.call(Status()).vision["images_encoded"] - n
            ttft(eng, text, f"txt{i}", gen)
            t2, t_text = ttft(eng, text + after, f"txt{i}", gen)
            firsts.append(t_first)
            follows.append(t_follow)
            texts.append(t_text)
        med = statistics.median
        # the first turn of the first chat (the later chats' first turns find its K/V: a prefix hit)
        return {"first_ms": firsts[0], "follow_ms": med(follows), "text_follow_ms": med(texts),
                "encoded_again": encoded, "cached": r2.cached_tokens, "prompt": r2.prompt_tokens,
                "text_cached": t2.cached_tokens, "text_prompt": t2.prompt_tokens}
    finally:
        eng.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--image-size", type=int, default=224)
    ap.add_argument("--full", action="store_true", help="Gemma 3's SigLIP: 27 layers, 896 pixels")
    ap.add_argument("--gen", type=int, default=4)
    ap.add_argument("--images", type=int, default=1, help="images in the follow-up's chat (1: 320x240; more: 1280x960)")
    ap.add_argument("--follow-up-only", action="store_true", help="part 2 alone")
    ap.add_argument("--no-llama", action="store_true", help="Strata's encode alone (no libmtmd, no follow-up)")
    add_args(ap)
    args = ap.parse_args()
    llama_oracle.require = lambda: None if llama_oracle.available() else sys.exit("llama-cpp-python is not installed")
    run = Run(out=args.out)
    with tempfile.TemporaryDirectory() as d:
        if args.follow_up_only:
            return record_follow_up(run, follow_up(Path(d), args.gen, n_images=args.images), args.images)
        ours, theirs, shape = encode_times(Path(d), args)
        mo = statistics.median(ours)
        run.record("encode_ms", round(mo * 1e3, 1), "ms", spread=[min(ours) * 1e3, mo * 1e3, max(ours) * 1e3],
                   rounds=args.rounds, on=str(mx.default_device()), **shape,
                   line=f"encode ({shape}, {mx.default_device()}): Strata {mo * 1e3:.1f} ms "
                        f"[{min(ours) * 1e3:.1f}-{max(ours) * 1e3:.1f}]")
        if args.no_llama:
            return
        mt = statistics.median(theirs)
        run.record("encode_libmtmd_ms", round(mt * 1e3, 1), "ms", rounds=args.rounds, **shape)
        run.record("encode_ratio", round(mt / mo, 2), "x", peer="libmtmd", rounds=args.rounds, **shape,
                   line=f"encode ({shape}): Strata {mo * 1e3:.1f} ms, libmtmd {mt * 1e3:.1f} ms, "
                        f"libmtmd/Strata {mt / mo:.2f}x")
        record_follow_up(run, follow_up(Path(d), args.gen, n_images=args.images), args.images)


def record_follow_up(run: Run, f: dict, n_images: int) -> None:
    run.record("follow_up_ttft_ms", round(f["follow_ms"], 1), "ms", encoded_again=f["encoded_again"],
               cached=f["cached"], prompt_tokens=f["prompt"], images=n_images)
    run.record("follow_up_vs_text_follow_up", round(f["follow_ms"] / f["text_follow_ms"], 2), "x",
               peer="text-only follow-up", images=n_images,
               line=f"first turn with {n_images} image(s) {f['first_ms']:.0f} ms; follow-up {f['follow_ms']:.0f} ms "
                    f"(cached {f['cached']} of {f['prompt']}, images encoded again: {f['encoded_again']}); "
                    f"text-only follow-up {f['text_follow_ms']:.0f} ms (cached {f['text_cached']} of "
                    f"{f['text_prompt']}), medians of 3 chats: "
                    f"{f['follow_ms'] / f['text_follow_ms']:.2f}x")


if __name__ == "__main__":
    main()
