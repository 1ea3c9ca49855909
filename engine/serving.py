"""How requests are served: by this process alone (`LocalServing`), or by every rank of a distributed
group in lockstep (`distributed.Distributed`, the same interface). The engine holds one, `Engine.serving`,
and asks it instead of asking which kind it is: `_serve` hands it each request, the model load asks it
for the model, and the single-process paths (the CPU's layer-by-layer prefill, continuous batching, the
disk tier, the K/V reserve, mtp) check `distributed`, one flag, rather than a missing object.

A strategy drives the engine through its public members only (`dispatch`, `log`, `require_model`, the
loaded model's views, `conversations`, `guard`): tests/test_imports.py keeps the imports one-way.
"""
from __future__ import annotations

import os
from typing import Any, Protocol
from engine.model.model_loader import load_model
from engine.ranks import distributed


class Serving(Protocol):
    distributed: bool           # several processes in lockstep: the single-process paths are off
    leads: bool                 # takes requests from its own queue (False: a follower rank, serving rank 0's)
    broken: str | None          # why nothing can be served any more (a rank lost): submit() fails at once

    def dispatch(self, engine, handle) -> Any:
        """Serve one request on the engine thread: its result (around engine.dispatch)."""

    def next_request(self) -> Any:
        """A follower's next request (rank 0's), or None once rank 0 stops."""

    def stop(self) -> None:
        """The engine stops: the followers are told."""

    def load_model(self, g, dtype, progress) -> tuple:
        """(the model this process holds, the whole model's ModelInfo) for an open GGUF."""

    def after_load(self, engine) -> None:
        """Hooks on the model just loaded (the engine's `loaded` is already the new one)."""

    def status(self) -> dict | None:
        """What Status and ModelFacts report (None: one process)."""

    def describe(self) -> str | None:
        """The load's log line about it (None: nothing to say)."""


class LocalServing:
    """This process alone: each request served as it comes."""
    distributed = False
    leads = True
    broken = None

    def dispatch(self, engine, handle):
        return engine.dispatch(handle)

    def next_request(self):
        raise RuntimeError("a single process follows no other")

    def stop(self) -> None:
        pass

    def load_model(self, g, dtype, progress):
        return load_model(g, dtype=dtype, progress=progress)

    def after_load(self, engine) -> None:
        pass

    def status(self) -> None:
        return None

    def describe(self) -> None:
        return None


def for_this_process() -> Serving:
    """Distributed when launched as a rank of a group of two or more (MLX_RANK set), else local."""
    if "MLX_RANK" in os.environ:
        group = distributed.detect()
        if group is not None:
            return group
    return LocalServing()
