"""Returning to a parked conversation: time to first token against the length of its history.

    python bench/turns.py [--model PATH | --random-shape tiny|smollm2|llama1b] [--histories 20 2000 8000]
                          [--rounds 10] [--reply-tokens 8]

One engine with the conversation cache on. One conversation per history length (a system prompt
and a user message of that many tokens, then a reply). Each round, for every conversation in turn
(the order rotating each round): a short unrelated request (a chat title) takes the engine, so the
conversation is parked; then the conversation's next turn (its reply so far plus a new question)
comes back. Its time to first token is the engine's own (from the request's start: chat template,
tokenizing, finding and restoring the parked K/V, the new tokens' prefill, the first token). A turn
should cost O(new tokens), so the target is ttft(history) / ttft(shortest) <= 1.2 for every history;
per-round ratios give the median and spread. After the rounds, "prompt build" times the engine's
own prompt_tokens() for each conversation's next turn alone (render, prefix check, tokenize), the
host work the turn adds before the model runs, and "model alone" times the model's forward for
32 new tokens plus one decode step on a K/V as long as the conversation's (no engine around it): what
attention over the history costs by itself (once with the same shapes every try, once with a new
token count at a new offset every try, as real turns have). A second table splits the turns' time
on the engine thread: prompt build, finding/restoring the K/V, the new tokens' prefill (which
includes mlx's clear_cache, also shown alone), and the first token after the prefill.
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
from bench.shapes import CHOICES  # noqa: E402

WORDS = ("the printing press spread from Mainz to more than two hundred cities within fifty years "
         "and books fell in price so sharply that merchants artisans and students began to read ").split()


def title(n: int) -> list[dict]:
    # A different chat each time, as the app's title requests are (the same request every time
    # would leave one more parked prefix copy of itself per round and crowd the conversations out).
    return [{"role": "system", "content": "Write a title for the chat. Five words at most."},
            {"role": "user", "content": f"Chat number {n}: a question about presses"}]


def history_text(tokenizer, n: int) -> str:
    words, i = [], 0
    while True:
        words.extend(WORDS)
        i += 1
        if len(tokenizer.encode(" ".join(words), add_bos=False)) >= n:
            break
    ids = tokenizer.encode(" ".join(words), add_bos=False)[:n]
    return tokenizer.decode(ids)


def chat(engine, messages, max_tokens, label):
    from engine.engine import GenerateRequest
    from engine.sampling import SamplingParams
    return engine.call(GenerateRequest(messages=list(messages), conversation=label,
                                       sampling=SamplingParams(max_tokens=max_tokens, temperature=0.0)))


def install_phase_timers(engine) -> dict:
    """Time the parts of each request's way to its first token (on the engine thread): prompt build,
    finding/restoring the K/V, prefill of the new tokens (and its mx.clear_cache), first token."""
    import mlx.core as mx

    from engine.generation import generate
    out: dict = {}

    def timed(name, fn):
        def wrapper(*a, **kw):
            t = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                out.setdefault("turn", {})[name] = out.get("turn", {}).get(name, 0.0) + \
                    (time.perf_counter() - t) * 1e3
        return wrapper

    def install(e):
        out.pop("turn", None)
        e.prompts.prompt_tokens = timed("build", e.prompts.prompt_tokens)
        e.turns.take_kv = timed("take_kv", e.turns.take_kv)
        generate.prefill = timed("prefill", generate.prefill)
        mx.clear_cache = timed("clear_cache", mx.clear_cache)
        first = generate.decode

        def decode(*a, **kw):
            t = time.perf_counter()
            for i, token in enumerate(first(*a, **kw)):
                if i == 0:
                    out.setdefault("turn", {})["first_token"] = (time.perf_counter() - t) * 1e3
                yield token
        generate.decode = decode
    held(engine, install)
    return out


def spread(xs):
    return f"{statistics.median(xs):.2f} [{min(xs):.2f}-{max(xs):.2f}]"


def main() -> int:
    ap = argparse.ArgumentParser()
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--model", default=None)
    src.add_argument("--random-shape", choices=CHOICES, default=None)
    ap.add_argument("--histories", type=int, nargs="+", default=[20, 2000, 8000])
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--reply-tokens", type=int, default=8)
    ap.add_argument("--cache-mib", type=int, default=4096)
    add_args(ap)
    args = ap.parse_args()
    histories = sorted(set(args.histories))

    import mlx.core as mx

    from engine.engine import Engine, EngineOptions, GenerateRequest
    from engine.model.models import default_model_path
    if args.random_shape:
        from bench.shapes import build_random_model, ignore_eos
        path = build_random_model(args.random_shape, Path(tempfile.gettempdir()) / "strata-shapes")
    else:
        path = Path(args.model or default_model_path())
    engine = Engine(EngineOptions(model=str(path), cache_mib=args.cache_mib,
                                  cache_slots=64, context_length=max(histories) + 2048)).start()
    held(engine, lambda e: None)
    if args.random_shape:
        ignore_eos(engine)
    tok = engine.tokenizer
    phases = install_phase_timers(engine)
    convs = {}
    t0 = time.perf_counter()
    for h in histories:
        msgs = [{"role": "system", "content": "You are a careful historian."},
                {"role": "user", "content": history_text(tok, h)}]
        r = chat(engine, msgs, args.reply_tokens, f"history {h}")
        msgs.append({"role": "assistant", "content": r.text})
        convs[h] = msgs
        print(f"conversation {h}: {r.prompt_tokens} prompt tokens", file=sys.stderr, flush=True)
    ttft = {h: [] for h in histories}
    cached = {h: [] for h in histories}
    phase_ms: dict = {}
    for rnd in range(args.rounds + 1):              # round 0: warm-up, dropped
        order = histories[rnd % len(histories):] + histories[:rnd % len(histories)]
        for h in order:
            chat(engine, title(rnd * len(histories) + histories.index(h)), 2, "title")
            convs[h].append({"role": "user", "content": f"And what happened in year {rnd + 1}?"})
            r = chat(engine, convs[h], args.reply_tokens, f"history {h}")
            convs[h].append({"role": "assistant", "content": r.text})
            print(f"round {rnd} history {h}: prompt {r.prompt_tokens} (cached {r.cached_tokens}), "
                  f"ttft {r.ttft_ms:.1f} ms", file=sys.stderr, flush=True)
            ph = phases.pop("turn", {})
            if rnd:
                for k, v in ph.items():
                    phase_ms.setdefault(h, {}).setdefault(k, []).append(v)
                ttft[h].append(r.ttft_ms)
                cached[h].append((r.prompt_tokens, r.cached_tokens))

    def build_times(e):
        out = {}
        for h in histories:
            req = GenerateRequest(messages=convs[h] + [{"role": "user", "content": "One more question?"}])
            xs = []
            for _ in range(20):
                t = time.perf_counter()
                e.prompts.prompt_tokens(req)
                xs.append((time.perf_counter() - t) * 1e3)
            out[h] = statistics.median(xs)
        return out

    def model_alone(e):
        # The model's own share: 32 new tokens then one decode step on a K/V of the conversation's
        # length (same engine, same stream), trimmed back after each try; median of 5.
        from engine.cache import layer_cache
        from engine.generation.generate import _stream
        out = {}
        for h in histories:
            n = len(convs[h]) and cached[h][-1][1]
            cache = e.handlers.make_cache()
            with mx.stream(_stream()):
                for a in range(0, n, 512):
                    e.model(mx.array([([5, 6, 7] * 200)[:min(512, n - a)]]), cache=cache)
                    mx.eval([c.state for c in cache])
                # back to n tokens after each try through the cache contract: a trim for full K/V, the
                # checkpoint for a recurrent state (Qwen3.5-like shapes)
                marks = []
                layer_cache.add_checkpoint(marks, cache, n)
                xs = []
                for _ in range(6):
                    t = time.perf_counter()
                    e.model(mx.array([[9] * 32]), cache=cache)
                    y = e.model(mx.array([[9]]), cache=cache)
                    mx.eval(y)
                    xs.append((time.perf_counter() - t) * 1e3)
                    cache, _ = layer_cache.rewind(cache, n + 33, n, list(marks), e.handlers.make_cache)
                same = statistics.median(xs[1:])
                xs = []
                for i in range(5):          # new shapes every time, as real turns have
                    t = time.perf_counter()
                    e.model(mx.array([[9] * (33 + i)]), cache=cache)
                    y = e.model(mx.array([[9]]), cache=cache)
                    mx.eval(y)
                    xs.append((time.perf_counter() - t) * 1e3)
                    cache, _ = layer_cache.rewind(cache, n + 34 + i, n, list(marks), e.handlers.make_cache)
            out[h] = (same, statistics.median(xs))
        return out
    prompt = held(engine, build_times)
    alone = held(engine, model_alone)
    wall = time.perf_counter() - t0
    base = histories[0]
    print(f"\n{path.name}{' (random weights, EOS ignored)' if args.random_shape else ''}; mlx {mx.__version__} "
          f"on {mx.default_device()}, {os.cpu_count()} CPUs; {args.rounds} rounds after 1 warm-up "
          f"({wall:.0f} s); reply {args.reply_tokens} tokens\n")
    print(f"| history (tokens) | prompt tokens / cached (last round) | parked ttft ms, median [min-max] "
          f"| ttft / ttft({base}), median [min-max] | prompt build ms | model alone ms, same shape / new shapes |")
    print("|---|---|---|---|---|---|")
    rec = Run(out=args.out)
    for h in histories:
        ratios = [a / b for a, b in zip(ttft[h], ttft[base])]
        p, c = cached[h][-1]
        print(f"| {h} | {p} / {c} | {spread(ttft[h])} | {spread(ratios)} | {prompt[h]:.2f} "
              f"| {alone[h][0]:.2f} / {alone[h][1]:.2f} |")
        setup = dict(model=path.name, history=h, prompt_tokens=p, cached_tokens=c, rounds=args.rounds)
        rec.record(f"parked ttft, history {h}", statistics.median(ttft[h]), "ms", spread=ttft[h], **setup)
        if h != base:
            rec.record(f"ttft history {h} / history {base}", statistics.median(ratios), "x", peer=f"history {base}",
                       spread=ratios, **setup)
        rec.record(f"prompt build, history {h}", prompt[h], "ms", **setup)
    print("\nwhere a parked turn's time goes (engine thread, ms, medians over the rounds):\n")
    names = ["build", "take_kv", "prefill", "clear_cache", "first_token"]
    print("| history | " + " | ".join(names) + " |")
    print("|---" * (len(names) + 1) + "|")
    for h in histories:
        print(f"| {h} | " + " | ".join(f"{statistics.median(phase_ms[h].get(k, [0.0])):.2f}" for k in names) + " |")
    engine.stop()
    sys.stdout.flush()
    os._exit(0)     # the engine thread never ends (mlx at-exit abort, see engine.run_forever)


if __name__ == "__main__":
    sys.exit(main())
