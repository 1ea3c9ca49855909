"""Sampling settings of a request, turned into mlx-lm's samplers and logits processors."""
from __future__ import annotations

from dataclasses import dataclass, field

from mlx_lm.sample_utils import make_logits_processors, make_sampler

from .errors import RequestError


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
        checks = [
            (self.temperature >= 0, "temperature must be >= 0"),
            (0 < self.top_p <= 1, "top_p must be in (0, 1]"),
            (self.top_k >= 0, "top_k must be >= 0"),
            (0 <= self.min_p < 1, "min_p must be in [0, 1)"),
            (self.repetition_penalty > 0, "repetition_penalty must be > 0"),
            (self.max_tokens >= 1, "max_tokens must be >= 1"),
        ]
        for ok, message in checks:
            if not ok:
                raise RequestError(message)

    def sampler(self):
        return make_sampler(temp=self.temperature, top_p=self.top_p if self.top_p < 1 else 0.0,
                            min_p=self.min_p, top_k=self.top_k)

    def processors(self):
        if self.repetition_penalty == 1.0:
            return []
        return make_logits_processors(repetition_penalty=self.repetition_penalty)
