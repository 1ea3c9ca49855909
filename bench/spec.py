"""Speculative decoding: decode tok/s with prompt lookup (and a draft model) vs without, alternating.

    .venv/bin/python bench/spec.py [--model PATH] [--draft PATH] [--rounds 2] [--max-tokens 96]

Workloads (chat template, greedy):
  edit  "rewrite this 60-line function renaming X to Y": the reply repeats most of the prompt;
  chat  a free question: little in the reply repeats the prompt.
Each round runs every mode on each workload, the order of the modes rotating from round to round, on
one engine (the prompt's K/V is reused after the first run, so only decode differs). decode tok/s is
the engine's own: (generated - 1) / (last token - first token). The table gives medians over the
rounds, the speed-up vs "off", the acceptance (accepted/drafted), and whether every mode produced
the same tokens as "off" (greedy output must be identical).

    .venv/bin/python bench/spec.py --tune [--max-tokens 128]

Tuning of prompt lookup's n-gram sizes and draft length, exactly and without timing: one plain greedy
reply per workload, then the lookup drafter replayed over it (greedy verification accepts a draft's
longest prefix that equals the reply, so the passes a speculated run makes follow from the reply
alone). Reports tokens per verify pass and acceptance for each setting.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def edit_prompt(lines: int = 60) -> str:
    body = []
    for i in range(lines - 2):
        k = i % 6
        body.append([f"    total += prices[{i}] * quantity",
                     f"    if total > limit_{i % 7}:",
                     f"        total -= discount(total, {i})",
                     f"    log.debug('step {i}: total=%s', total)",
                     f"    quantity = max(1, quantity - {i % 3})",
                     f"    totals.append(total)"][k])
    code = "def checkout(prices, quantity, limit_0, limit_1, limit_2, limit_3, limit_4, limit_5, limit_6):\n" \
           "    total = 0\n    totals = []\n" + "\n".join(body) + "\n    return total, totals\n"
    return ("Rewrite this Python function, renaming the variable `total` to `amount` everywhere. "
            "Output only the full rewritten code.\n\n```python\n" + code + "```")


CHAT = "Tell me about the history of tea and how it spread around the world."


def main() -> int:
    from engine.engine import Engine, EngineOptions, GenerateRequest, Status
    from engine.models import default_model_path
    from engine.sampling import SamplingParams

    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=str(default_model_path()))
    ap.add_argument("--draft", default=None, help="a draft GGUF with the same vocabulary (adds a mode)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--workloads", default="edit,chat")
    ap.add_argument("--tune", action="store_true", help="replay lookup settings over plain replies")
    args = ap.parse_args()
    if args.tune:
        return tune(args)
    modes = ["off", "lookup"] + ([f"draft:{args.draft}"] if args.draft else [])
    engine = Engine(EngineOptions(model=args.model)).start()
    st = engine.call(Status(), timeout=600)
    assert st.model, "the model did not load"
    workloads = {"edit": edit_prompt(), "chat": CHAT}
    results: dict = {}
    for w in args.workloads.split(","):
        msgs = [{"role": "user", "content": workloads[w]}]
        # warm-up: the prompt's prefill (reused by every run after it)
        engine.call(GenerateRequest(messages=msgs, sampling=SamplingParams(max_tokens=2)), timeout=1200)
        for r in range(args.rounds):
            order = modes[r % len(modes):] + modes[:r % len(modes)]
            for mode in order:
                res = engine.call(GenerateRequest(messages=msgs, speculative=mode,
                                                  sampling=SamplingParams(max_tokens=args.max_tokens)),
                                  timeout=1200)
                results.setdefault((w, mode), []).append(res)
                print(f"  {w} round {r} {mode}: {res.decode_tps:.2f} tok/s, {res.generated_tokens} tokens, "
                      f"accepted {res.accepted_tokens}/{res.drafted_tokens}"
                      + (f" (stopped: {res.speculation_stopped})" if res.speculation_stopped else ""),
                      file=sys.stderr, flush=True)
    print("| workload | mode | decode tok/s (median) | vs off | accepted/drafted | same tokens as off |")
    print("|---|---|---|---|---|---|")
    for w in args.workloads.split(","):
        base = statistics.median(x.decode_tps for x in results[(w, "off")])
        ref = results[(w, "off")][0].tokens
        for mode in modes:
            runs = results[(w, mode)]
            tps = statistics.median(x.decode_tps for x in runs)
            acc = sum(x.accepted_tokens for x in runs)
            dr = sum(x.drafted_tokens for x in runs)
            same = all(x.tokens == ref for x in runs)
            label = "draft" if mode.startswith("draft:") else mode
            print(f"| {w} | {label} | {tps:.2f} | {tps / base:.2f}x | {acc}/{dr}"
                  f"{f' ({acc / dr:.0%})' if dr else ''} | {'yes' if same else 'NO'} |", flush=True)
    engine.stop()
    return 0


def simulate(prompt: list[int], reply: list[int], ngram_max: int, ngram_min: int, k: int) -> tuple[int, int, int]:
    """(verify passes, drafted, accepted) of greedy lookup speculation producing `reply`."""
    from engine.speculative import LookupDrafter
    d = LookupDrafter(ngram_max, ngram_min, k)
    i = passes = drafted = accepted = 0
    while i < len(reply):
        draft, _ = d.propose(prompt + reply[:i], min(k, len(reply) - i - 1))
        n = 0
        while n < len(draft) and draft[n] == reply[i + n]:
            n += 1
        passes += 1
        drafted += len(draft)
        accepted += n
        i += n + 1
    return passes, drafted, accepted


def tune(args) -> int:
    from engine.engine import Engine, EngineOptions, GenerateRequest, Status
    from engine.sampling import SamplingParams
    engine = Engine(EngineOptions(model=args.model)).start()
    assert engine.call(Status(), timeout=600).model, "the model did not load"
    workloads = {"edit": edit_prompt(), "chat": CHAT}
    print("| workload | n-gram | draft | tokens per pass | accepted/drafted |")
    print("|---|---|---|---|---|")
    for w in args.workloads.split(","):
        req = GenerateRequest(messages=[{"role": "user", "content": workloads[w]}],
                              sampling=SamplingParams(max_tokens=args.max_tokens))
        prompt = engine.prompt_tokens(req)
        reply = engine.call(req, timeout=1800).tokens
        for ng in ((2, 1), (3, 2), (4, 2), (5, 3)):
            for k in (2, 3, 4, 8, 16):
                passes, dr, acc = simulate(prompt, reply, ng[0], ng[1], k)
                print(f"| {w} | {ng[1]}-{ng[0]} | {k} | {len(reply) / passes:.2f} | {acc}/{dr}"
                      f"{f' ({acc / dr:.0%})' if dr else ''} |", flush=True)
    engine.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
