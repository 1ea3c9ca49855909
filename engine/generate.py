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
    prompt_tokens: int = 0
    cached_tokens: int = 0
    generated: int = 0
    ttft_ms: float = 0.0
    prefill_tps: float = 0.0
    decode_tps: float = 0.0
    t_start: float = field(default_factory=time.perf_counter)
    t_first: float = 0.0


FIRST_CHUNK = 16   # tokens in the first prefill chunk


def chunk_sizes(total: int, chunk: int) -> list[int]:
    """The prefill schedule: 16, 16, 32, 64, ... (each chunk as large as all before it) up to `chunk`.
    Small first chunks put the first progress report (and the first chance to cancel) within a
    moment of the start even on a slow machine; doubling reaches full-size chunks after a few steps,
    and the running totals (16, 32, 64, ..., 512, 1024) stay on mlx-lm's 256-cell cache steps, so the
    K/V is allocated as with full-size chunks. Fixed, not timed: the same prompt is always computed
    the same way (replies repeat with a seed)."""
    sizes, n = [], 0
    while n < total:
        size = min(max(n, FIRST_CHUNK), chunk) if chunk > 0 else total
        sizes.append(min(size, total - n))
        n += sizes[-1]
    return sizes


def prefill(model, cache, tokens: list[int], fed: list[int], *, chunk: int = 512,
            progress: Callable[[int, int], None] | None = None, cancelled=lambda: False) -> None:
    """Feed `tokens` into the cache in chunks (all of them; the caller keeps the last one back).
    `progress(0, total)` comes first, then one call per chunk."""
    done = 0
    if progress and tokens:
        progress(0, len(tokens))
    for size in chunk_sizes(len(tokens), chunk):
        if cancelled():
            from .errors import Cancelled
            raise Cancelled("cancelled")
        part = tokens[done:done + size]
        model(mx.array(part)[None], cache=cache)
        mx.eval([c.state for c in cache])
        fed.extend(part)
        done += len(part)
        if progress:
            progress(done, len(tokens))


def decode(model, cache, last_token: int, fed: list[int], *, history: list[int], sampler,
           processors, max_tokens: int, stats: StepStats, seed: int | None = None,
           cancelled=lambda: False) -> Iterator[int]:
    """Yield up to max_tokens sampled ids; `fed` always equals the tokens the cache holds."""
    if seed is not None:
        mx.random.seed(seed)
    context = list(history)

    def step(token: int):
        logits = model(mx.array([token])[None], cache=cache)[:, -1, :]
        fed.append(token)
        if processors:
            ctx = mx.array(context)
            for p in processors:
                logits = p(ctx, logits)
        logprobs = logits - mx.logsumexp(logits, keepdims=True)
        return sampler(logprobs)

    y = step(last_token)
    mx.async_eval(y)
    n = 0
    while n < max_tokens:
        if cancelled():
            return
        token = y.item()
        if n == 0:
            stats.t_first = time.perf_counter()
        context.append(token)
        n += 1
        stats.generated = n
        if n < max_tokens:
            y = step(token)
            mx.async_eval(y)
        yield token
