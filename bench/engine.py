"""Prefill and decode speed: Strata's engine vs raw mlx-lm stepping vs llama.cpp, same GGUF, same prompt.

    .venv/bin/python bench/engine.py [--model PATH] [--prompt-tokens 128] [--gen 64] [--repeats 3]

Runs alternate between the three (this VM sometimes stalls a run 5-50x), repeat, and the table shows
medians and ratios. Definitions are the same for all three: prefill tok/s = prompt tokens / time to
first token; decode tok/s = (generated - 1) / (time from first to last token). Greedy, fresh cache.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

TEXT = ("The history of the printing press begins in the fifteenth century, when Johannes Gutenberg "
        "combined movable metal type, oil-based ink and a wooden screw press into a system that could "
        "produce books faster than any scribe. Within fifty years presses operated in more than two "
        "hundred European cities, and the price of books fell so sharply that reading spread from "
        "monasteries and courts to merchants, artisans and students. ") * 8


def prompt_ids(tokenizer, n: int) -> list[int]:
    return tokenizer.encode(TEXT)[:n]


def run_strata(engine, ids, gen):
    from engine.engine import GenerateRequest
    from engine.sampling import SamplingParams
    text = engine.tokenizer.decode(ids, skip_special=False)
    # Fresh cache each run: a different first token defeats prefix reuse without touching the engine.
    r = engine.call(GenerateRequest(prompt=text, sampling=SamplingParams(max_tokens=gen)))
    return r["prompt_tokens"] / (r["ttft_ms"] / 1e3), r["decode_tps"], r["prompt_tokens"]


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


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--gen", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-llama", action="store_true")
    args = ap.parse_args()

    from engine.engine import Call, Engine, EngineOptions
    from engine.gguf_file import open_gguf
    from engine.model_loader import load_model
    from engine.models import default_model_path
    path = Path(args.model or default_model_path())
    engine = Engine(EngineOptions(model=str(path), cache_mib=0)).start()
    engine.call(Call(lambda e: None))
    ids = prompt_ids(engine.tokenizer, args.prompt_tokens)
    # Different first token per run so Strata's prefix reuse cannot help (fresh cache, like the others).
    model, _ = load_model(open_gguf(path))   # raw mlx-lm: same loader, same weights, main thread
    llm = None
    if not args.no_llama:
        try:
            import llama_cpp
            llm = llama_cpp.Llama(model_path=str(path), n_ctx=1024, n_batch=512, verbose=False, n_threads=2)
        except ImportError:
            print("llama-cpp-python missing: llama.cpp column skipped", file=sys.stderr)
    results: dict[str, list[tuple[float, float]]] = {"strata": [], "mlx-lm": [], "llama.cpp": []}
    for rep in range(args.repeats + 1):                     # first round is warm-up, dropped
        variant = ids[:]
        variant[0] = ids[(rep % (len(ids) - 1)) + 1]        # fresh prefix every run
        runs = [("strata", lambda: run_strata(engine, variant, args.gen)),
                ("mlx-lm", lambda: run_mlx_lm(model, variant, args.gen))]
        if llm is not None:
            runs.append(("llama.cpp", lambda: run_llama(llm, variant, args.gen)))
        if rep % 2:
            runs.reverse()
        for name, fn in runs:
            p, d, n = fn()
            print(f"round {rep} {name}: prefill {p:.1f} tok/s ({n} tokens), decode {d:.1f} tok/s",
                  file=sys.stderr)
            if rep > 0:
                results[name].append((p, d))
    med = {k: (statistics.median(x[0] for x in v), statistics.median(x[1] for x in v))
           for k, v in results.items() if v}
    print(f"\nmodel {path.name}, prompt {len(ids)} tokens, {args.gen} generated, "
          f"{args.repeats} alternating rounds, medians\n")
    print("| engine | prefill tok/s | decode tok/s | prefill vs mlx-lm | decode vs mlx-lm |")
    print("|---|---|---|---|---|")
    base = med["mlx-lm"]
    for k, (p, d) in med.items():
        print(f"| {k} | {p:.1f} | {d:.1f} | {p / base[0]:.3f} | {d / base[1]:.3f} |")
    s = med["strata"]
    print(f"\nStrata overhead over raw mlx-lm: prefill {100 * (1 - s[0] / base[0]):+.1f}%, "
          f"decode {100 * (1 - s[1] / base[1]):+.1f}% (target <= 5%)")
    if "llama.cpp" in med:
        ll = med["llama.cpp"]
        print(f"Strata vs llama.cpp: prefill {s[0] / ll[0]:.3f}x, decode {s[1] / ll[1]:.3f}x")
    engine.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
