"""Prefill alone, three ways on one model in one process, alternating every round (issue 27, item 8):

* raw   -- mlx-lm's way for a prompt that fits one step: one pass over the prompt, then eval the K/V;
* fixed -- the engine's schedule before issue 27: chunks 16, 16, 32, ... 512, each evaluated whole;
* paced -- the engine now: the same schedule capped by the measured pace, each chunk evaluated layer
           by layer (cancel after every layer, progress within slow chunks).

    python bench/prefill_probe.py [--random-shape smollm2] [--prompt-tokens 512] [--rounds 5]

Per round, paced/raw and fixed/raw are ratios of that round's runs (a slow minute hits all three);
printed: the median [min-max] of those ratios, the median tok/s, and the longest wait between two
progress reports / cancel checks of the paced run.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.harness import Run, add_args, held  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--random-shape", default="smollm2")
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--shape-dir", default=str(Path(tempfile.gettempdir()) / "strata-bench-shapes"))
    add_args(ap)
    args = ap.parse_args()
    import mlx.core as mx

    from bench.shapes import build_random_model
    from engine.generation import generate
    from engine.engine import Engine, EngineOptions, Status
    path = build_random_model(args.random_shape, Path(args.shape_dir))
    engine = Engine(EngineOptions(model=str(path), cache_mib=0)).start()
    engine.call(Status(), timeout=600)

    def run(e, how: str, ids: list[int]):
        cache, fed, checks = e.handlers.make_cache(), [], []
        t0 = time.perf_counter()
        if how == "raw":
            with mx.stream(generate._stream()):
                e.model(mx.array(ids)[None], cache=cache)
                mx.eval([c.state for c in cache])
        else:
            paced = how == "paced"
            generate.prefill(e.model, cache, ids, fed, chunk=512, pace=pace if paced else None,
                             layerwise=paced, cancelled=lambda: checks.append(time.perf_counter()) or False)
        dt = time.perf_counter() - t0
        gaps = [b - a for a, b in zip([t0] + checks, checks + [t0 + dt])]
        return len(ids) / dt, max(gaps)

    pace = generate.PrefillPace(30 if args.random_shape == "smollm2" else 16)
    rates: dict[str, list[float]] = {"raw": [], "fixed": [], "paced": []}
    waits: list[float] = []
    order = ["raw", "fixed", "paced"]
    for rnd in range(args.rounds + 1):
        ids = [(7 + rnd * 13 + i * 31) % 40000 + 100 for i in range(args.prompt_tokens)]  # a new prompt each round
        got = {}
        for how in (order if rnd % 2 == 0 else order[::-1]):
            got[how], wait = held(engine, lambda e, h=how: run(e, h, ids))
            if how == "paced":
                waits.append(wait)
        print(f"round {rnd}: " + ", ".join(f"{k} {v:.1f} tok/s" for k, v in got.items())
              + f"; paced: longest wait between cancel checks {waits[-1]:.2f} s, chunk cap {pace.cap()}", flush=True)
        if rnd:                          # round 0 warms up
            for k, v in got.items():
                rates[k].append(v)
    med = {k: statistics.median(v) for k, v in rates.items()}
    print(f"\n{path.name}, {args.prompt_tokens}-token prompt, {args.rounds} rounds after a warm-up\n")
    print("| prefill | tok/s (median) | / raw, median [min-max] |")
    print("|---|---|---|")
    rec = Run(out=args.out)
    setup = dict(model=path.name, prompt_tokens=args.prompt_tokens, rounds=args.rounds)
    for k in order:
        r = [a / b for a, b in zip(rates[k], rates["raw"])]
        print(f"| {k} | {med[k]:.1f} | {statistics.median(r):.3f} [{min(r):.3f}-{max(r):.3f}] |")
        rec.record(f"{k} prefill", med[k], "tok/s", spread=rates[k], **setup)
        if k != "raw":
            rec.record(f"{k} prefill / raw", statistics.median(r), "x", peer="raw", spread=r, **setup)
    rec.record("paced: longest wait between cancel checks", statistics.median(waits[1:]), "s", spread=waits[1:],
               line=f"\npaced: longest wait between two cancel checks, median of rounds "
                    f"{statistics.median(waits[1:]):.2f} s (max {max(waits[1:]):.2f} s)", **setup)
    engine.stop()


if __name__ == "__main__":
    main()
