"""Where a decode-speed gap between Strata and raw mlx-lm sits (a diagnostic for bench/engine.py).

    python bench/decode_probe.py --random-shape llama1b [--rounds 10] [--gen 128] [--prompt-tokens 512]
                                 [--paths raw,request]

Alternating, in one process, decode tok/s (tokens after the first / time from first to last) of:
  raw:        mlx-lm's generate_step, its own model object, the main thread (bench/engine.py's raw);
  raw@engine-model: generate_step on the engine's model object, on the engine thread between requests;
  decode:     engine.generation.generate.decode (the engine's step loop alone) on the engine thread between requests;
  request:    a whole GenerateRequest (handler, reply loop, events).
Each against raw, per round: median [min-max] of the ratios. If `decode` keeps up with raw and
`request` does not, the gap is in the request path; if `decode` does not, it is in the loop or model.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.harness import Run, add_args, held  # noqa: E402


PATHS = ("raw", "raw@engine-model", "decode", "request")     # the runs main() alternates


def engine_decode(e, ids, gen):
    from engine.generation.generate import StepStats, decode, prefill
    from engine.sampling import SamplingParams
    cache = e.handlers.make_cache()
    fed: list[int] = []
    prefill(e.model, cache, ids[:-1], fed, chunk=e.options.prefill_chunk)
    sp = SamplingParams(max_tokens=gen)
    t_first, n = None, 0
    for _ in decode(e.model, cache, ids[-1], fed, history=ids, sampler=sp.sampler(e.info.n_vocab),
                    processors=sp.processors(), max_tokens=gen, stats=StepStats()):
        n += 1
        if t_first is None:
            t_first = time.perf_counter()
    return (n - 1) / (time.perf_counter() - t_first)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--random-shape", choices=("llama1b", "smollm2", "tiny"), default="llama1b")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--gen", type=int, default=128)
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--paths", default=",".join(PATHS),
                    help="comma-separated, raw first (fewer paths: each pair of runs closer in time)")
    add_args(ap)
    a = ap.parse_args()
    if a.rounds < 1 or a.gen < 2 or a.prompt_tokens < 2:
        print("need --rounds >= 1, --gen >= 2, --prompt-tokens >= 2", file=sys.stderr)
        return 2
    names = a.paths.split(",")
    if names[0] != "raw" or not set(names) <= set(PATHS):       # checked before the model is built
        print(f"--paths: raw first, then any of {', '.join(PATHS[1:])}", file=sys.stderr)
        return 2
    from bench.engine import prompt_ids, run_mlx_lm
    from bench.shapes import build_random_model, ignore_eos
    from engine.engine import Engine, EngineOptions, GenerateRequest
    from engine.model.gguf_file import open_gguf
    from engine.model.model_loader import load_model
    from engine.sampling import SamplingParams
    path = build_random_model(a.random_shape, Path(tempfile.gettempdir()) / "strata-shapes")
    engine = Engine(EngineOptions(model=str(path), cache_mib=0)).start()
    ignore_eos(engine)
    dtype = held(engine, lambda e: e.dtype)
    own, _ = load_model(open_gguf(path), dtype=dtype)
    ids = prompt_ids(engine.tokenizer, a.prompt_tokens)
    text = engine.tokenizer.decode(ids, skip_special=False)
    ids = engine.tokenizer.encode(text)
    runs = {
        "raw": lambda: run_mlx_lm(own, ids, a.gen)[1],
        "raw@engine-model": lambda: held(engine, lambda e: run_mlx_lm(e.model, ids, a.gen))[1],
        "decode": lambda: held(engine, lambda e: engine_decode(e, ids, a.gen)),
        "request": lambda: engine.call(GenerateRequest(prompt=text, sampling=SamplingParams(max_tokens=a.gen))).decode_tps,
    }
    out = {k: [] for k in names}
    for r in range(a.rounds + 1):
        for name in (names if r % 2 == 0 else names[::-1]):
            x = runs[name]()
            if r:
                out[name].append(x)
        if r:
            print(f"round {r}: " + ", ".join(f"{k} {out[k][-1]:.0f}" for k in names), file=sys.stderr, flush=True)
    print(f"\n{a.random_shape}, prompt {len(ids)}, {a.gen} tokens, {a.rounds} rounds after a warm-up; decode tok/s")
    print("| path | tok/s median | / raw, median [min-max] |\n|---|---|---|")
    run = Run(out=a.out)
    for k in names:
        rs = [x / y for x, y in zip(out[k], out["raw"])]
        print(f"| {k} | {statistics.median(out[k]):.1f} | {statistics.median(rs):.3f} [{min(rs):.3f}-{max(rs):.3f}] |")
        setup = dict(shape=a.random_shape, prompt_tokens=len(ids), gen=a.gen, rounds=a.rounds)
        run.record(f"{k} decode", statistics.median(out[k]), "tok/s", spread=out[k], **setup)
        if k != "raw":
            run.record(f"{k} decode / raw", statistics.median(rs), "x", peer="raw", spread=rs, **setup)
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
