"""Sampling settings of a request, turned into mlx-lm's samplers and logits processors.

Plain Python at import: mlx-lm is imported inside the two methods that build samplers, so the app
(which never imports MLX) can read the fields, bounds and validation from here.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from .errors import RequestError

MAX_TEMPERATURE = 100.0
MAX_TOP_K = 1 << 24              # above any vocabulary; >= the vocabulary means "no top_k"
MAX_REPETITION_PENALTY = 100.0
MAX_SEED = (1 << 64) - 1
MAX_TOKENS = 1 << 24
MAX_STOP = 16
MAX_STOP_CHARS = 1024


class SamplingError(RequestError):
    """A sampling field out of its type or range; `param` names it (the server's error shape wants it)."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


def _int(value, name: str, lo: int, hi: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise SamplingError(name, f"{name} must be an integer, got {value!r:.40}")
    if not lo <= value <= hi:
        raise SamplingError(name, f"{name} must be in {lo}..{hi}, got {value}")


def _float(value, name: str, lo: float, hi: float, *, lo_open: bool = False, hi_open: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise SamplingError(name, f"{name} must be a number, got {value!r:.40}")
    if not math.isfinite(value):
        raise SamplingError(name, f"{name} must be a finite number, got {value}")
    if (value <= lo if lo_open else value < lo) or (value >= hi if hi_open else value > hi):
        raise SamplingError(name, f"{name} must be in {'(' if lo_open else '['}{lo:g}, {hi:g}"
                                  f"{')' if hi_open else ']'}, got {value:g}")


@dataclass
class SamplingParams:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    max_tokens: int = 256
    stop: list[str] = field(default_factory=list)

    def validate(self) -> None:
        """Type and range of every field: the one place the server, the CLI and the engine check them.
        Raises SamplingError (a RequestError naming the field) on the first bad one."""
        _float(self.temperature, "temperature", 0.0, MAX_TEMPERATURE)
        _float(self.top_p, "top_p", 0.0, 1.0, lo_open=True)
        _int(self.top_k, "top_k", 0, MAX_TOP_K)
        _float(self.min_p, "min_p", 0.0, 1.0, hi_open=True)
        _float(self.repetition_penalty, "repetition_penalty", 0.0, MAX_REPETITION_PENALTY, lo_open=True)
        if self.seed is not None:
            _int(self.seed, "seed", 0, MAX_SEED)
        _int(self.max_tokens, "max_tokens", 1, MAX_TOKENS)
        if not isinstance(self.stop, list) or not all(isinstance(x, str) for x in self.stop):
            raise SamplingError("stop", "stop must be a list of strings")
        if len(self.stop) > MAX_STOP or any(len(x) > MAX_STOP_CHARS for x in self.stop):
            raise SamplingError("stop", f"stop takes at most {MAX_STOP} strings of at most {MAX_STOP_CHARS} characters")

    def sampler(self, vocab_size: int | None = None):
        # top_k at or above the vocabulary keeps every token: the same as no top_k (and mlx's
        # argpartition refuses a k past the axis).
        from mlx_lm.sample_utils import make_sampler
        top_k = 0 if vocab_size is not None and self.top_k >= vocab_size else self.top_k
        return make_sampler(temp=self.temperature, top_p=self.top_p if self.top_p < 1 else 0.0,
                            min_p=self.min_p, top_k=top_k)

    def processors(self):
        if self.repetition_penalty == 1.0:
            return []
        from mlx_lm.sample_utils import make_logits_processors
        return make_logits_processors(repetition_penalty=self.repetition_penalty)
