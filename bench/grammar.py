"""Constrained decoding's cost: decode tok/s with a grammar mask (response_format json_schema) vs
without, alternating on one engine.

    .venv/bin/python bench/grammar.py [--model PATH] [--rounds 3] [--max-tokens 48] [--temperature 0.8]
    python bench/grammar.py --random-shape llama1b --rounds 20 --max-tokens 256     # a GPU, no model file

--random-shape: a random-weight Q8_0 model of a named shape (bench/shapes.py) with the test factory's
tiny byte-level vocabulary (a few hundred tokens, so the mask is cheaper to compute than over a real
model's 49k-128k), EOS ignored after the warm-up so unmasked replies also run to --max-tokens.

Each round runs an unmasked reply and a masked one (the order swapping from round to round) with
the same prompt and sampling. The masked reply's schema is a JSON object whose one string must be
longer than the budget, so both replies run to --max-tokens (no EOS). decode tok/s is the engine's
own: (generated - 1) / (last token - first token), so the prompt's read does not count. Prints each
round's pair, the medians, the ratio masked/unmasked (median of the per-round ratios) and its spread.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.harness import Run, add_args  # noqa: E402

SCHEMA = {"type": "object",
          "properties": {"story": {"type": "string", "minLength": 4000}},
          "required": ["story"], "additionalProperties": False}
PROMPT = [{"role": "user", "content": "Write a long story about a lighthouse keeper and the sea."}]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="a GGUF (default: the default model)")
    ap.add_argument("--random-shape", choices=("llama1b", "smollm2"), default=None,
                    help="a random-weight Q8_0 model of this shape (the factory's tiny vocabulary) instead of --model")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--kv-bits", type=int, default=16)
    ap.add_argument("--spec", default="off", help="speculative mode for both runs (off, lookup)")
    add_args(ap)
    args = ap.parse_args()

    import mlx.core as mx

    from engine.api import EngineOptions, GenerateRequest
    from engine.generation.constraints import ConstraintSpec
    from engine.engine import Engine
    from engine.model.models import DEFAULT_NAME, resolve_model
    from engine.sampling import SamplingParams

    if args.random_shape:
        import tempfile

        from bench.shapes import build_random_model
        model = str(build_random_model(args.random_shape, Path(tempfile.gettempdir()) / "strata-shapes"))
    else:
        model = str(resolve_model(args.model or DEFAULT_NAME))
    eng = Engine(EngineOptions(model=model, kv_bits=args.kv_bits)).start()
    print(f"model {Path(model).name}, device {mx.default_device()}, mlx {mx.__version__}, "
          f"{args.max_tokens} tokens, temperature {args.temperature}, spec {args.spec}, K/V {args.kv_bits}-bit")
    spec = ConstraintSpec.json_schema(SCHEMA)

    def run(masked: bool, seed: int):
        sp = SamplingParams(temperature=args.temperature, seed=seed, max_tokens=args.max_tokens)
        return eng.call(GenerateRequest(messages=PROMPT, sampling=sp, constraint=spec if masked else None,
                                        conversation="bench-grammar", speculative=args.spec))

    run(True, 0)                        # warm-up: the grammar's tokenizer (once per model), kernels
    if args.random_shape:               # after the grammar's tokenizer took its EOS: random weights emit it
        from bench.shapes import ignore_eos
        ignore_eos(eng)
    run(False, 0)
    rows = []
    for r in range(args.rounds):
        order = (False, True) if r % 2 == 0 else (True, False)
        got = {}
        for masked in order:
            t0 = time.perf_counter()
            g = run(masked, r + 1)
            got[masked] = g
            print(f"  round {r + 1} {'masked  ' if masked else 'unmasked'}: {g.generated_tokens} tokens, "
                  f"decode {g.decode_tps:.2f} tok/s, finish {g.finish_reason}, wall {time.perf_counter() - t0:.1f} s"
                  + (f", text {g.text[:40]!r}" if masked else ""))
        rows.append((got[False].decode_tps, got[True].decode_tps))
    eng.stop()
    plain = [a for a, _ in rows]
    masked = [b for _, b in rows]
    ratios = [b / a for a, b in rows if a > 0]
    out = {"unmasked_tps_median": round(statistics.median(plain), 2),
           "masked_tps_median": round(statistics.median(masked), 2),
           "ratio_median": round(statistics.median(ratios), 3),
           "ratio_min": round(min(ratios), 3), "ratio_max": round(max(ratios), 3), "rounds": len(rows)}
    print(json.dumps(out))
    rec = Run(out=args.out)
    setup = dict(model=Path(model).name, max_tokens=args.max_tokens, temperature=args.temperature, spec=args.spec,
                 kv_bits=args.kv_bits, rounds=len(rows))
    rec.record("unmasked decode", statistics.median(plain), "tok/s", spread=plain, **setup)
    rec.record("masked decode", statistics.median(masked), "tok/s", spread=masked, **setup)
    rec.record("masked / unmasked decode", statistics.median(ratios), "x", peer="unmasked", spread=ratios, **setup)


if __name__ == "__main__":
    main()
