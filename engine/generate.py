"""The stepping loop: prefill the new part of the prompt into the live K/V, then decode token by token.

Written here rather than calling mlx_lm.generate_step so the engine knows exactly which tokens the
K/V holds (`fed`), which parking and session files depend on; the model call, caches, samplers and
pipelining (submit step n+1 before handing out token n) are mlx-lm's.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Iterator

import mlx.core as mx


@dataclass
class StepStats:
    ttft_ms: float = 0.0
    prefill_tps: float = 0.0
    decode_tps: float = 0.0
    t_start: float = field(default_factory=time.perf_counter)
    t_first: float = 0.0


def _stream():
    """mlx-lm's generation stream (one per thread, on the default device): the engine steps on the
    same stream raw mlx-lm does, so the two are measured alike."""
    from mlx_lm.generate import generation_stream
    return generation_stream


FIRST_CHUNK = 16   # tokens in the first prefill chunk


def chunk_sizes(total: int, chunk: int, first: int = FIRST_CHUNK) -> list[int]:
    """The prefill schedule: 16, 16, 32, 64, ... (each chunk as large as all before it) up to `chunk`.
    Small first chunks put the first progress report (and the first chance to cancel) within a
    moment of the start even on a slow machine; doubling reaches full-size chunks after a few steps,
    and the running totals (16, 32, 64, ..., 512, 1024) stay on mlx-lm's 256-cell cache steps, so the
    K/V is allocated as with full-size chunks. Fixed, not timed: the same prompt is always computed
    the same way (replies repeat with a seed)."""
    sizes, n = [], 0
    while n < total:
        size = min(max(n, first), chunk) if chunk > 0 else total
        sizes.append(min(size, total - n))
        n += sizes[-1]
    return sizes


def prefill(model, cache, tokens: list[int], fed: list[int], *, chunk: int = 512,
            progress: Callable[[int, int], None] | None = None, cancelled=lambda: False) -> None:
    """Feed `tokens` into the cache in chunks (all of them; the caller keeps the last one back).
    `progress(0, total)` comes first, then one call per chunk."""
    done = 0
    # The doubling start is for progress on a slow machine (the CPU: ~50 ms per 16 SmolLM2 tokens).
    # On a GPU a full chunk takes milliseconds and the small ones only add syncs and launches (an
    # H200: prefill 0.84-1.0x raw mlx-lm with them), so chunks are full-size from the first.
    first = FIRST_CHUNK if mx.default_device() == mx.cpu else chunk
    if progress and tokens:
        progress(0, len(tokens))
    for size in chunk_sizes(len(tokens), chunk, first):
        if cancelled():
            from .errors import Cancelled
            raise Cancelled("cancelled")
        part = tokens[done:done + size]
        with mx.stream(_stream()):
            model(mx.array(part)[None], cache=cache)
            mx.eval([c.state for c in cache])
        fed.extend(part)
        done += len(part)
        if progress:
            progress(done, len(tokens))
    if len(tokens) >= chunk:
        # as mlx-lm does after a prefill: a full chunk's activations go back to the system. Not
        # after a turn's few new tokens, where it only costs time (~1.4 ms on an H200).
        mx.clear_cache()


def decode(model, cache, last_token: int, fed: list[int], *, history: list[int], sampler,
           processors, max_tokens: int, stats: StepStats, seed: int | None = None,
           cancelled=lambda: False) -> Iterator[int]:
    """Yield up to max_tokens sampled ids; `fed` always equals the tokens the cache holds.

    mlx-lm's order: step n+1's graph is built from the still-lazy token n and submitted
    (mx.async_eval) before the host waits for token n, so the device never waits for Python.
    Building step n+1 feeds token n to the cache, so `fed` takes token n as soon as its value is
    read, before it is handed out; the last token (n == max_tokens) is never fed. A consumer that
    stops early (EOS, a stop string, cancel) leaves the cache holding exactly `fed`."""
    if seed is not None:
        mx.random.seed(seed)
    stream = _stream()
    ctx = mx.array(history, dtype=mx.int32) if processors else None

    def step(tok: mx.array, first: bool = False) -> mx.array:
        nonlocal ctx
        with mx.stream(stream):
            logits = model(tok[None], cache=cache)[:, -1, :]
            if processors:
                if not first:           # the prompt's last token is already in `history`
                    ctx = mx.concatenate([ctx, tok.astype(mx.int32)])
                for p in processors:
                    logits = p(ctx, logits)
            logprobs = logits - mx.logsumexp(logits, keepdims=True)
            return sampler(logprobs)

    y = step(mx.array([last_token]), first=True)
    fed.append(last_token)
    mx.async_eval(y)
    n = 0
    while n < max_tokens:
        if cancelled():
            return
        fed_next = n + 1 < max_tokens
        if fed_next:
            next_y = step(y)            # from the lazy token n: queued behind it on the device
            mx.async_eval(next_y)
        token = y.item()
        if n == 0:
            stats.t_first = time.perf_counter()
        if fed_next:
            fed.append(token)
        n += 1
        if n % 256 == 0:
            mx.clear_cache()
        yield token
        if fed_next:
            y = next_y
