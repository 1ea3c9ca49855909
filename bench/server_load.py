"""Load check of `strata serve`: N sequential, then M concurrent short chat requests against a real
server (uvicorn on a free loopback port, the official openai client), on the default model.

    python bench/server_load.py [-n 8] [-m 4] [--max-tokens 16] [--model PATH] [--stream] [--max-sequences 8]

Prints a Markdown table: requests, wall time, throughput (requests/s, generated tokens/s),
client-side latency p50/p95 (the concurrent requests' latency includes their wait in the engine's
queue beyond --max-sequences, decoded together as the server does: engine/generation/batching.py; 1 = one
request at a time), the engine's mean time to first token, and the
mean time the engine itself spent per request (ttft + decode, from the response's `strata` timings;
client latency minus this is the HTTP/queue share; non-streaming only).
"""
from __future__ import annotations

import argparse
import os
import platform
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.harness import Run, add_args  # noqa: E402

PROMPTS = ["Name a fruit.", "What is 2 + 2?", "Say hello in French.", "Name a colour.", "What is the capital of Italy?",
           "Give me a synonym for happy.", "Name a planet.", "What do bees make?", "Name an ocean.",
           "What is the opposite of cold?"]


def percentile(values: list[float], p: float) -> float:
    """Nearest-rank percentile (honest for small samples: always an observed value)."""
    s = sorted(values)
    k = max(0, min(len(s) - 1, int(-(-p * len(s) // 100)) - 1))
    return s[k]


def one_request(client, i: int, max_tokens: int, stream: bool) -> dict:
    messages = [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}]
    t0 = time.perf_counter()
    if stream:
        ttft, tokens = None, 0
        for ch in client.chat.completions.create(model="default", messages=messages, max_tokens=max_tokens,
                                                 temperature=0, stream=True, stream_options={"include_usage": True}):
            if ttft is None and ch.choices and ch.choices[0].delta.content:
                ttft = time.perf_counter() - t0
            if ch.usage is not None:
                tokens = ch.usage.completion_tokens
        return {"latency": time.perf_counter() - t0, "tokens": tokens, "ttft": ttft}
    r = client.chat.completions.create(model="default", messages=messages, max_tokens=max_tokens, temperature=0)
    st, n = r.model_extra["strata"], r.usage.completion_tokens
    engine_s = (st["ttft_ms"] + (1e3 * (n - 1) / st["decode_tps"] if n > 1 and st["decode_tps"] else 0)) / 1e3
    return {"latency": time.perf_counter() - t0, "tokens": n, "ttft": st["ttft_ms"] / 1e3, "engine": engine_s}


def run_sequential(client, n: int, max_tokens: int, stream: bool) -> tuple[list[dict], float]:
    t0 = time.perf_counter()
    out = [one_request(client, i, max_tokens, stream) for i in range(n)]
    return out, time.perf_counter() - t0


def run_concurrent(base_url: str, m: int, max_tokens: int, stream: bool) -> tuple[list[dict], float]:
    import openai
    out: list[dict | None] = [None] * m
    errors: list[BaseException] = []
    barrier = threading.Barrier(m + 1)

    def worker(i):
        client = openai.OpenAI(base_url=base_url, api_key="bench", max_retries=0, timeout=600)
        barrier.wait()
        try:
            out[i] = one_request(client, i, max_tokens, stream)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(m)]
    for t in threads:
        t.start()
    barrier.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    if errors:
        raise errors[0]
    return out, wall


def row(mode: str, results: list[dict], wall: float) -> str:
    lat = [r["latency"] * 1e3 for r in results]
    tokens = sum(r["tokens"] for r in results)
    ttft = [r["ttft"] * 1e3 for r in results if r["ttft"] is not None]
    eng = [r["engine"] * 1e3 for r in results if r.get("engine") is not None]
    mean = lambda v: f"{sum(v) / len(v):.0f}" if v else "-"  # noqa: E731
    return (f"| {mode} | {len(results)} | {wall:.2f} | {len(results) / wall:.2f} | {tokens / wall:.1f} | "
            f"{percentile(lat, 50):.0f} | {percentile(lat, 95):.0f} | {mean(ttft)} | {mean(eng)} |")


def record(rec: Run, mode: str, results: list[dict], wall: float, **setup) -> None:
    """A table row's headline figures, one JSON line each (bench/harness.py)."""
    lat = [r["latency"] * 1e3 for r in results]
    rec.record(f"{mode} req/s", len(results) / wall, "req/s", requests=len(results), **setup)
    rec.record(f"{mode} gen tok/s", sum(r["tokens"] for r in results) / wall, "tok/s", requests=len(results), **setup)
    rec.record(f"{mode} p50 latency", percentile(lat, 50), "ms", p95=percentile(lat, 95), requests=len(results),
               **setup)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-n", type=int, default=8, help="sequential requests")
    ap.add_argument("-m", type=int, default=4, help="concurrent requests (one client thread each)")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--model", default=None, help="GGUF (default: the default model under STRATA_HOME)")
    ap.add_argument("--stream", action="store_true", help="stream the replies (SSE)")
    from engine.limits import DEFAULT_MAX_SEQUENCES
    ap.add_argument("--max-sequences", type=int, default=DEFAULT_MAX_SEQUENCES,
                    help="requests decoded together (the server's default; 1 = one at a time)")
    add_args(ap)
    args = ap.parse_args(argv)

    import mlx.core as mx
    import openai

    from engine.engine import Engine, EngineOptions
    from engine.model.models import default_model_path
    from engine.frontends.server import ServerThread, create_app

    model = Path(args.model) if args.model else default_model_path()
    if not model.exists():
        print(f"server_load: no model at {model} (run `strata models fetch-default` or pass --model)",
              file=sys.stderr)
        return 2
    engine = Engine(EngineOptions(model=str(model), max_sequences=args.max_sequences)).start()
    engine.startup.result()                    # the start-up load, or EngineError with its message
    server = ServerThread(create_app(engine)).start()
    try:
        client = openai.OpenAI(base_url=server.base_url, api_key="bench", max_retries=0, timeout=600)
        t0 = time.perf_counter()
        one_request(client, 0, args.max_tokens, args.stream)        # warm-up (first compile), not counted
        warm = time.perf_counter() - t0
        seq, seq_wall = run_sequential(client, args.n, args.max_tokens, args.stream)
        conc, conc_wall = run_concurrent(server.base_url, args.m, args.max_tokens, args.stream)
    finally:
        server.stop()
        engine.stop()

    print(f"model {model.name}, {platform.machine()} {os.cpu_count()} CPUs, mlx {mx.__version__} "
          f"({mx.default_device()}), max_tokens {args.max_tokens}, temperature 0, "
          f"{'streaming' if args.stream else 'non-streaming'}, warm-up {warm:.1f} s")
    print()
    print("| mode | requests | wall s | req/s | gen tok/s | p50 ms | p95 ms | mean ttft ms | mean engine ms |")
    print("|---|---|---|---|---|---|---|---|---|")
    print(row("sequential", seq, seq_wall))
    print(row(f"concurrent ({args.m} clients)", conc, conc_wall))
    rec = Run(out=args.out)
    setup = dict(model=model.name, max_tokens=args.max_tokens, stream=args.stream, max_sequences=args.max_sequences)
    record(rec, "sequential", seq, seq_wall, **setup)
    record(rec, f"concurrent ({args.m} clients)", conc, conc_wall, **setup)
    return 0


if __name__ == "__main__":
    sys.exit(main())
