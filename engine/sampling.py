"""Sampling settings of a request, turned into mlx-lm's samplers and logits processors.

Plain Python at import: mlx-lm is imported inside the two methods that build samplers, so the app
(which never imports MLX) can read the fields, bounds and validation from here.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from engine.errors import RequestError

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


@dataclass(frozen=True)
class SamplingField:
    """One numeric sampling field: its type, the engine's range and default, and what the front ends
    use of it. The one definition: SamplingParams, its validation, the server's request parsing and the
    app's settings, configs and sampling form all read this table.

    `lo`/`hi` (with `lo_open`/`hi_open`) are the engine's range; `api_default`/`api_hi` are the
    OpenAI-compatible server's (its defaults are OpenAI's, and its temperature stops at 2);
    `chat_default` is the app's default (the Default config) and `form` the app's spin box
    (lo, hi, step, decimals or None for an integer), None when the app has no field for it."""
    name: str
    label: str
    kind: type                      # int | float
    default: float | int | None     # SamplingParams' default
    lo: float | int
    hi: float | int | None
    lo_open: bool = False
    hi_open: bool = False
    api_default: float | int | None = None
    api_hi: float | int | None = None
    chat_default: float | int | None = None
    form: tuple | None = None       # (lo, hi, step, decimals | None)


FIELDS: tuple[SamplingField, ...] = (
    SamplingField("temperature", "Temperature", float, 0.0, 0, MAX_TEMPERATURE,
                  api_default=1.0, api_hi=2, chat_default=0.7, form=(0.0, 5.0, 0.05, 2)),
    SamplingField("top_p", "Top-p", float, 1.0, 0, 1.0, lo_open=True,
                  api_default=1.0, api_hi=1, chat_default=0.95, form=(0.01, 1.0, 0.05, 2)),
    SamplingField("top_k", "Top-k", int, 0, 0, MAX_TOP_K,
                  api_default=0, chat_default=40, form=(0, 1000, 1, None)),
    SamplingField("min_p", "Min-p", float, 0.0, 0, 1.0, hi_open=True,
                  api_default=0.0, api_hi=0.999999, chat_default=0.05, form=(0.0, 0.99, 0.01, 2)),
    SamplingField("repetition_penalty", "Repetition penalty", float, 1.0, 0, MAX_REPETITION_PENALTY,
                  lo_open=True, api_default=1.0, chat_default=1.1, form=(0.5, 3.0, 0.05, 2)),
    SamplingField("seed", "Seed", int, None, 0, MAX_SEED),
    SamplingField("max_tokens", "Max tokens", int, 256, 1, MAX_TOKENS,
                  chat_default=512, form=(1, 32768, 64, None)),
)
FIELD = {f.name: f for f in FIELDS}
APP_FIELDS: tuple[SamplingField, ...] = tuple(f for f in FIELDS if f.form is not None)   # the app's form, in order
APP_KEYS: tuple[str, ...] = tuple(f.name for f in APP_FIELDS)
CHAT_DEFAULTS: dict = {f.name: f.chat_default for f in APP_FIELDS}


def check_field(f: SamplingField, value) -> None:
    """Type and engine range of one field's value (None is fine for a field whose default is None)."""
    if value is None and f.default is None:
        return
    if f.kind is int:
        _int(value, f.name, f.lo, f.hi)
    else:
        _float(value, f.name, f.lo, f.hi, lo_open=f.lo_open, hi_open=f.hi_open)


@dataclass
class SamplingParams:
    temperature: float = FIELD["temperature"].default
    top_p: float = FIELD["top_p"].default
    top_k: int = FIELD["top_k"].default
    min_p: float = FIELD["min_p"].default
    repetition_penalty: float = FIELD["repetition_penalty"].default
    seed: int | None = FIELD["seed"].default
    max_tokens: int = FIELD["max_tokens"].default
    stop: list[str] = field(default_factory=list)

    def validate(self) -> None:
        """Type and range of every field: the one place the server, the CLI and the engine check them.
        Raises SamplingError (a RequestError naming the field) on the first bad one."""
        for f in FIELDS:
            check_field(f, getattr(self, f.name))
        if not isinstance(self.stop, list) or not all(isinstance(x, str) for x in self.stop):
            raise SamplingError("stop", "stop must be a list of strings")
        if len(self.stop) > MAX_STOP or any(len(x) > MAX_STOP_CHARS for x in self.stop):
            raise SamplingError("stop", f"stop takes at most {MAX_STOP} strings of at most {MAX_STOP_CHARS} characters")

    def sampler(self, vocab_size: int | None = None):
        # top_k at or above the vocabulary keeps every token: the same as no top_k (and mlx's
        # argpartition refuses a k past the axis).
        # lazy: mlx_lm imports MLX, which the app (it imports this module) never loads
        from mlx_lm.sample_utils import make_sampler
        top_k = 0 if vocab_size is not None and self.top_k >= vocab_size else self.top_k
        return make_sampler(temp=self.temperature, top_p=self.top_p if self.top_p < 1 else 0.0,
                            min_p=self.min_p, top_k=top_k)

    def processors(self):
        if self.repetition_penalty == 1.0:
            return []
        # lazy: mlx_lm imports MLX, which the app (it imports this module) never loads
        from mlx_lm.sample_utils import make_logits_processors
        return make_logits_processors(repetition_penalty=self.repetition_penalty)
