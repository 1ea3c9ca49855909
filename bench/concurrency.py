"""Many streams at once (issue 34): Strata's batched engine vs raw mlx-lm's BatchGenerator, same weights.

    python bench/concurrency.py [--model PATH | --random-shape llama1b|smollm2|tiny] [--streams 1,2,4,8,16]
                                [--prompt-tokens 128] [--gen 128] [--rounds 3] [--join-streams 8]

For each stream count N, each round runs N streams at once through each peer (the order flipping
every round; one warm-up round first, dropped):
* Strata: N GenerateRequests queued while the engine thread is held (Scheduler.hold), then let go,
  so all N start together as they would from N clients; tokens timed as they arrive (the handle's
  callback, on the engine thread);
* mlx-lm: one BatchGenerator (mlx_lm/generate.py, the engine behind mlx-lm's server's batching) on
  the same weights from Strata's loader in the engine's dtype, the N prompts inserted at once, stepped
  with next() on the main thread until every stream has its tokens.
Each stream's prompt is --prompt-tokens ids (a fresh first token per stream and round), greedy, EOS
ignored by both (every stream makes exactly --gen tokens). Figures per N (medians over rounds):
  aggregate tok/s = N x gen / (last token - start)          (prefill included: what N clients see)
  decode tok/s    = N x (gen - 1) / (last token - last stream's first token)   (all N decoding)
  slowest stream  = the slowest stream's own decode tok/s x N / the one-stream decode tok/s
                    (the CPU target: >= 0.9, no stream slower than 1/N of running alone by > 10%)
(Running BatchGenerator on the engine's own thread instead changed nothing measurable: bench/gpu.md.)
Then the join test: --join-streams - 1 streams decoding (long replies), one more stream submitted;
its time to first token against the same prompt's on an idle engine (target: within 2x), for both.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.engine import machine, prompt_ids, spread  # noqa: E402
from bench.harness import Run, add_args, held  # noqa: E402


class Gate:
    """The engine thread held between requests until release(): requests queued meanwhile join at once."""

    def __init__(self, engine):
        self.hold = engine.scheduler.hold()

    def release(self):
        self.hold.release()


def strata_run(engine, prompts: list[list[int]], gen: int):
    """N streams at once: (start, [first token times], [last token times])."""
    from engine.engine import GenerateRequest
    from engine.events import Token
    from engine.sampling import SamplingParams
    tok = engine.tokenizer
    n = len(prompts)
    first = [0.0] * n
    last = [0.0] * n

    def timer(i):
        def on(ev):
            if isinstance(ev, Token):
                t = time.perf_counter()
                if not first[i]:
                    first[i] = t
                last[i] = t
        return on
    gate = Gate(engine)
    hs = [engine.submit(GenerateRequest(prompt=tok.decode(p, skip_special=False), conversation=f"s{i}",
                                        sampling=SamplingParams(max_tokens=gen, temperature=0.0)),
                        callback=timer(i)) for i, p in enumerate(prompts)]
    t0 = time.perf_counter()
    gate.release()
    for h in hs:
        r = h.result(3600)
        if r.generated_tokens != gen:
            raise SystemExit(f"Strata stopped after {r.generated_tokens} of {gen} tokens")
    return t0, first, last


def mlx_run(model, prompts: list[list[int]], gen: int):
    import mlx.core as mx  # noqa: F401
    from mlx_lm.generate import BatchGenerator
    n = len(prompts)
    first = [0.0] * n
    last = [0.0] * n
    count = [0] * n
    t0 = time.perf_counter()
    bg = BatchGenerator(model, max_tokens=gen, stop_tokens=None, completion_batch_size=max(32, n),
                        prefill_batch_size=max(8, n))
    uids = bg.insert(prompts, max_tokens=[gen] * n)
    index = {u: i for i, u in enumerate(uids)}
    while sum(count) < n * gen:
        for r in bg.next_generated():
            i = index[r.uid]
            t = time.perf_counter()
            if not first[i]:
                first[i] = t
            last[i] = t
            count[i] += 1
    bg.close()
    return t0, first, last


def figures(t0, first, last, gen):
    n = len(first)
    end = max(last)
    agg = n * gen / (end - t0)
    dec = n * (gen - 1) / max(1e-9, end - max(first))
    per = [(gen - 1) / max(1e-9, b - a) for a, b in zip(first, last)]
    return agg, dec, min(per)


def strata_join(engine, prompts, join_prompt, gen_long, gen):
    """TTFT of `join_prompt` submitted while len(prompts) streams decode."""
    from engine.engine import GenerateRequest
    from engine.events import Token
    from engine.sampling import SamplingParams
    tok = engine.tokenizer
    started = threading.Event()
    decoding: set[int] = set()

    def note(i):
        def on(ev):
            if isinstance(ev, Token):
                decoding.add(i)
                if len(decoding) == len(prompts):
                    started.set()
        return on
    hs = [engine.submit(GenerateRequest(prompt=tok.decode(p, skip_special=False), conversation=f"j{i}",
                                        sampling=SamplingParams(max_tokens=gen_long, temperature=0.0)),
                        callback=note(i))
          for i, p in enumerate(prompts)]
    started.wait(600)
    time.sleep(0.2)         # every stream of the batch is decoding
    first = []
    t0 = time.perf_counter()
    h = engine.submit(GenerateRequest(prompt=tok.decode(join_prompt, skip_special=False), conversation="joiner",
                                      sampling=SamplingParams(max_tokens=gen, temperature=0.0)),
                      callback=lambda ev: first.append(time.perf_counter()) if isinstance(ev, Token) else None)
    h.result(3600)
    for x in hs:
        x.cancel()
    for x in hs:
        try:
            x.result(600)
        except Exception:  # noqa: BLE001
            pass
    return (first[0] - t0) * 1e3


def strata_idle_ttft(engine, join_prompt, gen):
    from engine.engine import GenerateRequest
    from engine.sampling import SamplingParams
    r = engine.call(GenerateRequest(prompt=engine.tokenizer.decode(join_prompt, skip_special=False),
                                    conversation="idle", sampling=SamplingParams(max_tokens=gen, temperature=0.0)),
                    3600)
    return r.ttft_ms


def mlx_join(model, prompts, join_prompt, gen_long, gen):
    from mlx_lm.generate import BatchGenerator
    n = len(prompts)
    bg = BatchGenerator(model, max_tokens=gen_long, stop_tokens=None, completion_batch_size=max(32, n + 1),
                        prefill_batch_size=max(8, n + 1))
    if prompts:                 # the batch is decoding before the new stream comes
        bg.insert(prompts, max_tokens=[gen_long] * n)
        for _ in range(3):
            while not bg.next_generated():
                pass
    t0 = time.perf_counter()
    (uid,) = bg.insert([join_prompt], max_tokens=[gen])
    while True:
        got = [r for r in bg.next_generated() if r.uid == uid]
        if got:
            ms = (time.perf_counter() - t0) * 1e3
            break
    bg.close()
    return ms


def main() -> int:
    ap = argparse.ArgumentParser()
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--model", default=None)
    src.add_argument("--random-shape", "--model-shape", dest="random_shape", default=None,
                     help="a shape of bench/shapes.py (llama1b, also llama-1b; smollm2; tiny; the hybrid and family shapes): "
                          "random weights")
    ap.add_argument("--shape-dir", default=os.path.join(tempfile.gettempdir(), "strata-shapes"))
    ap.add_argument("--streams", default="1,2,4,8,16")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--gen", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--join-streams", type=int, default=8, help="batch size the joining stream makes (0: skip)")
    add_args(ap)
    args = ap.parse_args()
    streams = [int(x) for x in args.streams.split(",")]
    if args.gen < 2 or args.prompt_tokens < 2 or min(streams) < 1:
        raise SystemExit("need --gen >= 2, --prompt-tokens >= 2, streams >= 1")

    from engine.engine import Engine, EngineOptions, Status
    from engine.model.gguf_file import open_gguf
    from engine.model.model_loader import load_model
    from engine.model.models import default_model_path
    from bench.shapes import ignore_eos
    shape = {"llama-1b": "llama1b"}.get(args.random_shape or "", args.random_shape or "")
    if shape:
        from bench.shapes import build_random_model
        path = build_random_model(shape, Path(args.shape_dir))
    else:
        path = Path(args.model or default_model_path())
    top = max(streams + [args.join_streams])
    engine = Engine(EngineOptions(model=str(path), cache_mib=0, max_sequences=top)).start()
    engine.startup.result()
    dtype = held(engine, lambda e: e.dtype)
    ignore_eos(engine)      # both peers run every stream to --gen tokens
    model, _ = load_model(open_gguf(path), dtype=dtype)
    base = prompt_ids(engine.tokenizer, args.prompt_tokens)
    # the engine's tokenizer round trip, so both peers get the very ids the engine reads
    vocab = sorted({t for t in base})

    def prompts_for(n, rnd):
        out = []
        for i in range(n):
            p = base[:]
            p[0] = vocab[(rnd * 31 + i * 7) % len(vocab)]
            text = engine.tokenizer.decode(p, skip_special=False)
            out.append(engine.tokenizer.encode(text))
        return out

    def snap():
        return engine.call(Status()).batch

    rows = {}
    steps_of = {}           # N -> (steps, build, wait, rows seconds, Strata's wall) over its timed rounds
    t_bench = time.perf_counter()
    for n in streams:
        names = ["strata", "mlx-lm"]
        res = {k: [] for k in names}
        for rnd in range(args.rounds + 1):
            ps = prompts_for(n, rnd + 100 * n)
            order = names if rnd % 2 == 0 else names[::-1]
            for name in order:
                if name == "strata":
                    before = snap()
                    run = strata_run(engine, ps, args.gen)
                    after = snap()
                    if rnd > 0 and before is not None and after is not None:
                        d = [after.steps - before.steps, after.build_s - before.build_s,
                             after.wait_s - before.wait_s, after.rows_s - before.rows_s, max(run[2]) - run[0]]
                        steps_of[n] = [a + b for a, b in zip(steps_of.get(n, [0] * 5), d)]
                else:
                    run = mlx_run(model, ps, args.gen)
                f = figures(*run, args.gen)
                print(f"N={n} round {rnd} {name}: aggregate {f[0]:.1f} tok/s, decode {f[1]:.1f} tok/s, "
                      f"slowest stream {f[2]:.1f} tok/s", file=sys.stderr, flush=True)
                if rnd > 0:
                    res[name].append(f)
        rows[n] = res
    one = {k: statistics.median(x[1] for x in rows[min(streams)][k]) for k in ("strata", "mlx-lm")} \
        if min(streams) == 1 else None

    join = None
    if args.join_streams > 1:
        jp = prompts_for(args.join_streams, 7)
        idle_s = strata_idle_ttft(engine, jp[-1], 8)
        join_s = strata_join(engine, jp[:-1], jp[-1], 10 * args.gen, 8)
        idle_m = mlx_join(model, [], jp[-1], 8, 8)
        join_m = mlx_join(model, jp[:-1], jp[-1], 10 * args.gen, 8)
        join = (idle_s, join_s, idle_m, join_m)
    wall = time.perf_counter() - t_bench
    c = engine.call(Status()).batch

    label = path.name if not shape else f"{path.name} (random weights)"
    print(f"\n{machine()}; compute {str(dtype).removeprefix('mlx.core.')}")
    print(f"model {label}, prompt {len(base)} tokens, {args.gen} generated per stream, EOS ignored, greedy; "
          f"{args.rounds} alternating rounds after 1 warm-up per N ({wall:.0f} s)\n")
    print("| streams | Strata aggregate tok/s | mlx-lm aggregate tok/s | Strata decode tok/s | mlx-lm decode tok/s "
          "| decode Strata / mlx-lm, median [min-max] | Strata vs 1 stream | slowest stream x N / alone |")
    print("|---|---|---|---|---|---|---|---|")
    rec = Run(out=args.out)
    setup = dict(model=label, prompt_tokens=len(base), gen=args.gen, rounds=args.rounds)
    for n in streams:
        s, m = rows[n]["strata"], rows[n]["mlx-lm"]
        agg_s, agg_m = statistics.median(x[0] for x in s), statistics.median(x[0] for x in m)
        dec_s, dec_m = statistics.median(x[1] for x in s), statistics.median(x[1] for x in m)
        ratio = [a[1] / b[1] for a, b in zip(s, m)]
        vs1 = f"{dec_s / one['strata']:.2f}x" if one else "-"
        slow = f"{statistics.median(x[2] for x in s) * n / one['strata']:.2f}" if one else "-"
        print(f"| {n} | {agg_s:.1f} | {agg_m:.1f} | {dec_s:.1f} | {dec_m:.1f} | {spread(ratio)} | {vs1} | {slow} |")
        for who, agg, dec in (("strata", agg_s, dec_s), ("mlx-lm", agg_m, dec_m)):
            rec.record(f"{who} aggregate, {n} streams", agg, "tok/s", streams=n, **setup)
            rec.record(f"{who} decode, {n} streams", dec, "tok/s", streams=n, **setup)
        rec.record(f"decode strata / mlx-lm, {n} streams", statistics.median(ratio), "x", peer="mlx-lm BatchGenerator",
                   spread=ratio, streams=n, **setup)
        if one:
            rec.record(f"slowest stream x N / alone, {n} streams", statistics.median(x[2] for x in s) * n / one["strata"],
                       "x", streams=n, **setup)
    if join:
        idle_s, join_s, idle_m, join_m = join
        print(f"\njoining stream's time to first token ({args.join_streams - 1} streams decoding, its prompt "
              f"{len(base)} tokens): Strata {join_s:.0f} ms (idle engine {idle_s:.0f} ms, {join_s / idle_s:.2f}x); "
              f"mlx-lm BatchGenerator {join_m:.0f} ms (idle {idle_m:.0f} ms, {join_m / idle_m:.2f}x)")
        rec.record("joining stream ttft / idle, strata", join_s / idle_s, "x", peer="idle engine",
                   streams=args.join_streams, join_ms=join_s, idle_ms=idle_s, **setup)
        rec.record("joining stream ttft / idle, mlx-lm", join_m / idle_m, "x", peer="idle BatchGenerator",
                   streams=args.join_streams, join_ms=join_m, idle_ms=idle_m, **setup)
    if c is not None:
        print(f"Strata batch counters: {c}")
    if steps_of:
        # Where a step's time goes on the engine thread: queueing it (host), waiting for the previous
        # step's tokens (the device; ~0 means the host is the bound), handing tokens to rows; "other" is
        # the rest of the wall time per step (prefill passes, the scheduler's loop, joins and leaves).
        print("\n| streams | steps | build ms/step | wait ms/step | rows ms/step | other ms/step |")
        print("|---|---|---|---|---|---|")
        for n in streams:
            if n in steps_of and steps_of[n][0]:
                k, b_s, w_s, r_s, wall_s = steps_of[n]
                print(f"| {n} | {k} | {1e3 * b_s / k:.2f} | {1e3 * w_s / k:.2f} | {1e3 * r_s / k:.2f} "
                      f"| {1e3 * (wall_s - b_s - w_s - r_s) / k:.2f} |")
    for n in streams:
        for k in rows[n]:
            print(f"raw N={n} {k}: aggregate {[round(x[0], 1) for x in rows[n][k]]}, "
                  f"decode {[round(x[1], 1) for x in rows[n][k]]}, slowest {[round(x[2], 1) for x in rows[n][k]]}")
    engine.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
