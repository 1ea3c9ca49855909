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

    .venv/bin/python bench/spec.py --modes off,mtp --shape qwen35-tiny [--mtp-costs]
    .venv/bin/python bench/spec.py --mtp-costs --shape gemma4-e2b-half   (bench/gemma4_mtp_costs.py)

`--modes` picks the modes of the table (off, lookup, mtp, draft:PATH); `--shape` runs on a random
Qwen3.5-like file of bench/shapes.py written with a NextN head. With random weights a head's acceptance
means nothing, so `--mtp-costs` measures what the speed-up follows from instead, outside the engine
(model and head loaded directly, CPU or GPU as MLX runs): the target's pass over n = 1..4 tokens at a
context (T_n), one head step (H), the recurrent state's snapshot before a verify pass and its restore
after a rejection (engine/cache/layer_cache.py), and from them the expected speed-up at acceptance rates
0.5-0.95 for depth k = 1..3, each draft accepted with probability a independently:
  tokens per verify pass  E = (1 - a^(k+1)) / (1 - a)
  time per verify pass    T_(k+1) + snapshot + k H + sum_(j<k) a^j (1-a) (restore + T_(j+1))
(a rejection after j accepted drafts restores the state and feeds the j + 1 kept tokens again); speed-up
= E T_1 / time. With T_(k+1) = T_1, H = 0 and free copies, k = 1 gives the bound (1+a)/(2-a).
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.harness import Run, add_args  # noqa: E402 - after the path line
from bench.mtp_model import mtp_speedup  # noqa: E402 - after the path line


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
    from engine.model.models import default_model_path
    from engine.sampling import SamplingParams

    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=str(default_model_path()))
    ap.add_argument("--draft", default=None, help="a draft GGUF with the same vocabulary (adds a mode)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--workloads", default="edit,chat")
    ap.add_argument("--tune", action="store_true", help="replay lookup settings over plain replies")
    ap.add_argument("--modes", default=None, help="comma-separated: off,lookup,mtp,draft:PATH (default off,lookup"
                                                  " and the --draft)")
    ap.add_argument("--shape", default=None, help="a Qwen3.5-like random shape of bench/shapes.py, written with a "
                                                  "NextN head (replaces --model)")
    ap.add_argument("--mtp-costs", action="store_true", help="measure the MTP pass costs and the speed-ups they give")
    ap.add_argument("--context", type=int, default=256, help="--mtp-costs: the context the passes run at")
    ap.add_argument("--reps", type=int, default=31, help="--mtp-costs: rounds (medians)")
    add_args(ap)
    args = ap.parse_args()
    if args.shape and args.shape.startswith("gemma4"):     # a gemma4 with its MTP drafter beside it
        from bench.gemma4_mtp_costs import build_pair
        args.model = str(build_pair(args.shape, Path("/tmp/strata-shapes")))
    elif args.shape:
        from bench.shapes import build_random_model
        args.model = str(build_random_model(args.shape, Path("/tmp/strata-shapes"), nextn=1))
    if args.mtp_costs:
        return mtp_costs(args)
    if args.tune:
        return tune(args)
    modes = args.modes.split(",") if args.modes else ["off", "lookup"] + ([f"draft:{args.draft}"] if args.draft else [])
    if "off" not in modes:
        modes.insert(0, "off")
    engine = Engine(EngineOptions(model=args.model)).start()
    st = engine.call(Status(), timeout=600)
    assert st.model, "the model did not load"
    if args.shape:
        from bench.shapes import ignore_eos
        ignore_eos(engine)              # random weights: every run makes all of its tokens
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
    rec = Run(out=args.out)
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
            setup = dict(model=Path(args.model).name, max_tokens=args.max_tokens, rounds=args.rounds, same_tokens=same)
            rec.record(f"{w} {label} decode", tps, "tok/s", spread=[x.decode_tps for x in runs], **setup)
            if mode != "off":
                rec.record(f"{w} {label} decode / off", tps / base, "x", peer="off", accepted=acc, drafted=dr, **setup)
    engine.stop()
    return 0


def mtp_costs(args) -> int:
    """The target's pass costs, the head's step and the recurrent state's copies; the speed-up table."""
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache, make_prompt_cache

    from engine.cache import layer_cache
    from engine.generation import generate
    from engine.model.archs.qwen35_mtp import load_head
    from engine.device import compute_dtype
    from engine.model.gguf_file import open_gguf
    from engine.model.model_loader import load_model
    from engine.generation.mtp_spec import TargetTap
    g = open_gguf(Path(args.model))
    if g.architecture == "gemma4":          # the memory-shared drafter: bench/gemma4_mtp_costs.py
        from bench.gemma4_mtp_costs import gemma4_mtp_costs
        return gemma4_mtp_costs(args)
    dtype = compute_dtype()
    model, info = load_model(g, dtype=dtype)
    head, _ = load_head(g, model, dtype=dtype)
    tap = TargetTap(model)
    rng = __import__("random").Random(0)
    prompt = [rng.randrange(10, 250) for _ in range(args.context)]
    cache, fed = make_prompt_cache(model), []
    generate.prefill(tap, cache, prompt, fed)
    hcache = KVCache()
    h = mx.concatenate([tap.rows[p] for p in range(len(prompt) - 1)], axis=0)[None]
    head.features(h, mx.array(prompt[1:])[None], cache=hcache)
    mx.eval(hcache.keys, hcache.values)
    reps = args.reps
    import time
    hx = h[:, -1:]
    times: dict = {n: [] for n in (1, 2, 3, 4)}
    snaps, restores, heads = [], [], []
    # interleaved (every measure once a round): on a busy machine the ratios stay fair
    for _ in range(reps):
        for n in (1, 2, 3, 4):
            t0 = time.perf_counter()
            snap = layer_cache.snapshot(cache, len(fed))
            mx.eval(list(snap.layers.values()))
            t1 = time.perf_counter()
            mx.eval(tap(mx.array(prompt[:n])[None], cache=cache))
            t2 = time.perf_counter()
            layer_cache.rollback(cache, len(fed) + n, n, snap, lambda k: None)
            mx.eval(layer_cache.arrays(cache))
            t3 = time.perf_counter()
            snaps.append(t1 - t0)
            times[n].append(t2 - t1)
            restores.append(t3 - t2)
        t0 = time.perf_counter()
        x = head.features(hx, mx.array([[prompt[-1]]]), cache=hcache)
        mx.eval(head.logits(x))
        heads.append(time.perf_counter() - t0)
        hcache.trim(1)
    t = {n: statistics.median(v) for n, v in times.items()}
    snap_s, restore_s, head_s = (statistics.median(v) for v in (snaps, restores, heads))
    dev = "GPU" if mx.default_device() == mx.gpu else "CPU"
    print(f"{Path(args.model).name} ({info.n_layer} layers + head, {info.n_embd} wide), {dev} {str(dtype)[-7:]}, "
          f"context {args.context}, medians of {reps}")
    print("| T_1 | T_2 | T_3 | T_4 | head step H | H / T_1 | snapshot | restore |")
    print("|---|---|---|---|---|---|---|---|")
    ms = lambda x: f"{x * 1e3:.2f} ms"  # noqa: E731
    print(f"| {ms(t[1])} | {ms(t[2])} | {ms(t[3])} | {ms(t[4])} | {ms(head_s)} | {head_s / t[1]:.2f} | "
          f"{ms(snap_s)} | {ms(restore_s)} |")
    rec = Run(out=args.out)
    setup = dict(model=Path(args.model).name, context=args.context, rounds=reps)
    for n in (1, 2, 3, 4):
        rec.record(f"T_{n}", t[n] * 1e3, "ms", spread=[x * 1e3 for x in times[n]], **setup)
    rec.record("head step H", head_s * 1e3, "ms", **setup)
    rec.record("H / T_1", head_s / t[1], "x", peer="T_1", **setup)
    rec.record("snapshot", snap_s * 1e3, "ms", **setup)
    rec.record("restore", restore_s * 1e3, "ms", **setup)
    print()
    print("| acceptance a | bound (1+a)/(2-a) | k=1 | k=2 | k=3 |")
    print("|---|---|---|---|---|")
    for a in (0.5, 0.6, 0.7, 0.8, 0.9, 0.95):
        cols = " | ".join(f"{mtp_speedup(a, k, t, head_s, snap_s, restore_s):.2f}x" for k in (1, 2, 3))
        print(f"| {a:.2f} | {(1 + a) / (2 - a):.2f}x | {cols} |")
    return 0


def simulate(prompt: list[int], reply: list[int], ngram_max: int, ngram_min: int, k: int) -> tuple[int, int, int]:
    """(verify passes, drafted, accepted) of greedy lookup speculation producing `reply`."""
    from engine.generation.speculative import LookupDrafter
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
        prompt = engine.prompts.prompt_tokens(req)
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
