"""8-bit and 4-bit K/V against 16-bit K/V, on the oracle prompts (tests/engine/test_oracle.py) and file types.

    .venv/bin/python bench/kv_quality.py [--types Q4_1,F16,Q8_0,Q4_K_M,Q6_K] [--tokens 32]

For each file type and prompt: 32 greedy tokens with 16-bit K/V, then
* teacher-forced: the prompt + those tokens scored in one pass with 8-bit / 4-bit K/V; at each of the
  32 positions, does the greedy pick agree with 16-bit K/V, and the |logit difference| (median, max);
* free-running: 32 greedy tokens decoded step by step with 8-bit / 4-bit K/V; how many of them equal
  the 16-bit run's (the whole sequence, not only the common prefix).
Files other than the default Q4_1 are the ones tests/engine/test_oracle.py makes with llama.cpp's quantizer
(~/.cache/strata-tests); a missing one is skipped with that reason.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.harness import Run, add_args  # noqa: E402

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Once upon a time, in a small village by the sea,",
    "<|im_start|>user\nWhat is 12 times 7?<|im_end|>\n<|im_start|>assistant\n",
]


def files(types: list[str]) -> dict[str, Path]:
    from engine.model.models import default_model_path
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "strata-tests"
    out = {}
    for t in types:
        p = default_model_path() if t == "Q4_1" else cache / f"smollm2-135m-{t}.gguf"
        if p.exists():
            out[t] = p
        else:
            print(f"{t}: skipped ({p} not found; tests/engine/test_oracle.py makes it)", file=sys.stderr)
    return out


def main() -> int:
    import mlx.core as mx
    import numpy as np

    from engine.cache import kv_format
    from engine.model.gguf_file import open_gguf
    from engine.model.model_loader import load_model
    from engine.text.tokenizer import load_tokenizer

    ap = argparse.ArgumentParser()
    ap.add_argument("--types", default="Q4_1,F16,Q8_0,Q4_K_M,Q6_K")
    ap.add_argument("--tokens", type=int, default=32)
    add_args(ap)
    args = ap.parse_args()
    rec = Run(out=args.out)
    n = args.tokens
    print("| file | K/V | teacher-forced greedy agree | median abs logit diff | max abs logit diff "
          "| free-run tokens equal |")
    print("|---|---|---|---|---|---|")
    for ftype, path in files(args.types.split(",")).items():
        g = open_gguf(path)
        tok = load_tokenizer(g)
        model, info = load_model(g, dtype=mx.float32)

        def score(ids, fmt):
            cache = kv_format.make_cache(model, fmt)
            return np.array(model(mx.array(ids)[None], cache=cache)[0].astype(mx.float32))

        def greedy(ids, fmt):
            cache = kv_format.make_cache(model, fmt)
            logits = model(mx.array(ids)[None], cache=cache)[0, -1]
            out = []
            for _ in range(n):
                t = int(mx.argmax(logits).item())
                out.append(t)
                logits = model(mx.array([t])[None], cache=cache)[0, -1]
            return out

        base = kv_format.KVFormat(16)
        rows = {8: [0, [], [], 0], 4: [0, [], [], 0]}
        for prompt in PROMPTS:
            ids = tok.encode(prompt, add_bos=tok.add_bos)
            ref_gen = greedy(ids, base)
            seq = ids + ref_gen
            ref = score(seq, base)[len(ids) - 1:len(seq) - 1]
            for bits in (8, 4):
                fmt = kv_format.choose(bits, info.head_dim)
                q = score(seq, fmt)[len(ids) - 1:len(seq) - 1]
                r = rows[bits]
                r[0] += int((q.argmax(-1) == ref.argmax(-1)).sum())
                d = np.abs(q - ref)
                r[1].append(float(np.median(d)))
                r[2].append(float(d.max()))
                r[3] += sum(a == b for a, b in zip(greedy(ids, fmt), ref_gen))
        total = n * len(PROMPTS)
        for bits, (agree, med, mx_, free) in rows.items():
            fmt = kv_format.choose(bits, info.head_dim)
            print(f"| {ftype} | {fmt.describe()} | {agree}/{total} | {min(med):.3f}-{max(med):.3f} "
                  f"| {max(mx_):.3f} | {free}/{total} |", flush=True)
            setup = dict(file=ftype, kv=fmt.describe(), positions=total)
            rec.record(f"{ftype} {bits}-bit K/V teacher-forced greedy agree", agree / total, "fraction", **setup)
            rec.record(f"{ftype} {bits}-bit K/V max abs logit diff", max(mx_), "logit", **setup)
            rec.record(f"{ftype} {bits}-bit K/V free-run tokens equal", free / total, "fraction", **setup)
    return 0


if __name__ == "__main__":
    sys.exit(main())
