"""Prefill and decode speed: Strata's engine vs raw mlx-lm stepping (vs llama.cpp), same GGUF, same prompt.

    python bench/engine.py [--model PATH | --random-shape NAME] [--prompt-tokens 128]
                           [--gen 64] [--rounds 10] [--no-llama]

Runs alternate between the engines, the order flipping every round, for --rounds rounds after one
warm-up round (dropped). Per round, Strata/raw is the ratio of that round's two runs, so a slow minute
hits both; the table gives the median, min and max of those per-round ratios, and the median tok/s.
Definitions are the same for all: prefill tok/s = prompt tokens / time to first token; decode tok/s =
(generated - 1) / (time from first to last token). Greedy, fresh cache every run (the first prompt
token changes every run, so Strata's prefix reuse cannot help).

Raw mlx-lm gets the same weights from Strata's own loader in the dtype the engine computes in (float32
on the CPU, float16 on a GPU: Metal or CUDA), and runs on the main thread; its generate_step makes
its cache with mlx-lm's make_prompt_cache, i.e. the model class's own make_cache (RotatingKVCache on
Gemma 3's and gpt-oss's windowed layers, as the engine holds them). --random-shape builds a
random-weight GGUF of that shape (bench/shapes.py: dense llama and Qwen3.5-like shapes in Q8_0,
Gemma-3-1B's layout in Q8_0, gpt-oss-20b's block with MXFP4 experts; EOS ignored so every run makes
all its tokens) where no real model file can travel. llama.cpp runs when llama_cpp is importable (CPU
here).
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.harness import Run, add_args, held  # noqa: E402
from bench.shapes import CHOICES   # noqa: E402  (plain Python: the shape names)

TEXT = ("The history of the printing press begins in the fifteenth century, when Johannes Gutenberg "
        "combined movable metal type, oil-based ink and a wooden screw press into a system that could "
        "produce books faster than any scribe. Within fifty years presses operated in more than two "
        "hundred European cities, and the price of books fell so sharply that reading spread from "
        "monasteries and courts to merchants, artisans and students. ")


def prompt_ids(tokenizer, n: int) -> list[int]:
    text = TEXT
    while len(tokenizer.encode(text)) < n + 1:
        text += TEXT
    return tokenizer.encode(text)[:n]


def run_strata(engine, text, gen):
    from engine.engine import GenerateRequest
    from engine.sampling import SamplingParams
    # The engine's whole request path: queue, engine thread, tokenizer, events to this thread.
    r = engine.call(GenerateRequest(prompt=text, sampling=SamplingParams(max_tokens=gen)))
    if r.generated_tokens != gen:
        raise SystemExit(f"Strata stopped after {r.generated_tokens} of {gen} tokens (EOS?)")
    return r.prompt_tokens / (r.ttft_ms / 1e3), r.decode_tps, r.prompt_tokens


def run_mlx_lm(model, ids, gen):
    import mlx.core as mx
    from mlx_lm.generate import generate_step
    t0 = time.perf_counter()
    t_first = None
    n = 0
    for tok, _ in generate_step(mx.array(ids), model, max_tokens=gen):
        n += 1
        if t_first is None:
            t_first = time.perf_counter()
    t_end = time.perf_counter()
    return len(ids) / (t_first - t0), (n - 1) / (t_end - t_first), len(ids)


def run_llama(llm, ids, gen):
    t0 = time.perf_counter()
    t_first = None
    n = 0
    for _ in llm.generate(ids, temp=0.0, top_k=1, reset=True):
        n += 1
        if t_first is None:
            t_first = time.perf_counter()
        if n == gen:
            break
    t_end = time.perf_counter()
    return len(ids) / (t_first - t0), (n - 1) / (t_end - t_first), len(ids)


def machine() -> str:
    import mlx.core as mx
    dev = str(mx.default_device())
    try:
        if mx.cuda.is_available():
            dev += " (CUDA)"
    except AttributeError:
        pass
    try:
        if mx.metal.is_available():
            dev += " (Metal)"
    except AttributeError:
        pass
    return (f"{platform.system()} {platform.machine()}, {os.cpu_count()} CPUs, mlx {mx.__version__}, "
            f"device {dev}")


def spread(xs: list[float]) -> str:
    return f"{statistics.median(xs):.3f} [{min(xs):.3f}-{max(xs):.3f}]"


def main() -> int:
    ap = argparse.ArgumentParser()
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--model", default=None)
    src.add_argument("--random-shape", choices=CHOICES, default=None)
    ap.add_argument("--shape-dir", default=os.path.join(tempfile.gettempdir(), "strata-shapes"))
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--gen", type=int, default=64)
    ap.add_argument("--rounds", "--repeats", dest="rounds", type=int, default=10)
    ap.add_argument("--no-llama", action="store_true")
    add_args(ap)
    args = ap.parse_args()
    if args.rounds < 1 or args.gen < 2 or args.prompt_tokens < 2:
        raise SystemExit("need --rounds >= 1, --gen >= 2, --prompt-tokens >= 2")

    from engine.engine import Engine, EngineOptions
    from engine.model.gguf_file import open_gguf
    from engine.model.model_loader import load_model
    from engine.model.models import default_model_path
    if args.random_shape:
        from bench.shapes import build_random_model
        path = build_random_model(args.random_shape, Path(args.shape_dir))
    else:
        path = Path(args.model or default_model_path())
    engine = Engine(EngineOptions(model=str(path), cache_mib=0)).start()
    dtype = held(engine, lambda e: e.dtype)
    if args.random_shape:
        from bench.shapes import ignore_eos
        ignore_eos(engine)
    ids = prompt_ids(engine.tokenizer, args.prompt_tokens)
    # Raw mlx-lm: same loader, same weights, the engine's dtype, the main thread.
    model, _ = load_model(open_gguf(path), dtype=dtype)
    llm = None
    if not args.no_llama:
        try:
            import llama_cpp
            llm = llama_cpp.Llama(model_path=str(path), n_ctx=max(1024, 2 * (args.prompt_tokens + args.gen)),
                                  n_batch=512, verbose=False, n_threads=min(8, os.cpu_count() or 2))
        except ImportError:
            print("llama-cpp-python missing: llama.cpp column skipped", file=sys.stderr)
    names = (["strata", "mlx-lm"]
             + (["llama.cpp"] if llm is not None else []))
    results: dict[str, list[tuple[float, float]]] = {k: [] for k in names}
    t_bench = time.perf_counter()
    for rnd in range(args.rounds + 1):                      # round 0 is the warm-up, dropped
        variant = ids[:]
        variant[0] = ids[(rnd % (len(ids) - 1)) + 1]        # fresh prefix every run
        # Strata reads text; raw mlx-lm and llama.cpp get the very ids the engine's tokenizer makes of it.
        text = engine.tokenizer.decode(variant, skip_special=False)
        variant = engine.tokenizer.encode(text)
        runs = {"strata": lambda: run_strata(engine, text, args.gen),
                "mlx-lm": lambda: run_mlx_lm(model, variant, args.gen),
                "llama.cpp": lambda: run_llama(llm, variant, args.gen)}
        order = names if rnd % 2 == 0 else names[::-1]
        for name in order:
            p, d, n = runs[name]()
            print(f"round {rnd} {name}: prefill {p:.1f} tok/s ({n} tokens), decode {d:.1f} tok/s",
                  file=sys.stderr, flush=True)
            if rnd > 0:
                results[name].append((p, d))
    wall = time.perf_counter() - t_bench
    med = {k: (statistics.median(x[0] for x in v), statistics.median(x[1] for x in v))
           for k, v in results.items()}
    ratio = {k: ([a[0] / b[0] for a, b in zip(v, results["mlx-lm"])],
                 [a[1] / b[1] for a, b in zip(v, results["mlx-lm"])]) for k, v in results.items()}
    label = path.name if not args.random_shape else f"{path.name} (random weights, EOS ignored)"
    print(f"\n{machine()}; compute {str(dtype).removeprefix('mlx.core.')}")
    print(f"model {label}, prompt {len(ids)} tokens, {args.gen} generated, {args.rounds} alternating "
          f"rounds after 1 warm-up ({wall:.0f} s)\n")
    print("| engine | prefill tok/s (median) | decode tok/s (median) | prefill / mlx-lm, median [min-max] "
          "| decode / mlx-lm, median [min-max] |")
    print("|---|---|---|---|---|")
    run = Run(out=args.out)
    for k in names:
        p, d = med[k]
        print(f"| {k} | {p:.1f} | {d:.1f} | {spread(ratio[k][0])} | {spread(ratio[k][1])} |")
        setup = dict(model=label, prompt_tokens=len(ids), gen=args.gen, rounds=args.rounds)
        run.record(f"{k} prefill", p, "tok/s", **setup)
        run.record(f"{k} decode", d, "tok/s", **setup)
        if k != "mlx-lm":
            for i, what in enumerate(("prefill", "decode")):
                run.record(f"{k} {what} / mlx-lm", statistics.median(ratio[k][i]), "x", peer="mlx-lm",
                           spread=ratio[k][i], **setup)
    for k in names:
        print(f"raw {k}: prefill {[round(x[0], 1) for x in results[k]]}, "
              f"decode {[round(x[1], 1) for x in results[k]]}")
    engine.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
