"""An engine started on a model for a test module and stopped with it (a fixture's `with` block)."""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

from engine.api import EngineOptions
from engine.engine import Engine


@contextmanager
def running(model, **options) -> Iterator[Engine]:
    """An Engine on `model` with `options` (EngineOptions' fields), stopped when the block ends."""
    eng = Engine(EngineOptions(model=str(model), **options)).start()
    try:
        yield eng
    finally:
        eng.stop()


@contextmanager
def maker(model, **defaults) -> Iterator:
    """`make(**options)`: an Engine on `model` started (its load done) with `defaults` overlaid by
    `options`; every engine made is stopped when the block ends."""
    made: list[Engine] = []

    def make(**options) -> Engine:
        eng = Engine(EngineOptions(model=str(model), **{**defaults, **options})).start()
        made.append(eng)
        eng.startup.result()
        return eng
    try:
        yield make
    finally:
        for eng in made:
            eng.stop()
