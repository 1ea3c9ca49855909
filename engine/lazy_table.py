"""A table of modules by name, each imported on first use: the architectures (engine/model/archs) and
the projector types (engine/vision/towers) keep one module per entry, so a file of one kind imports
that module alone (and mlx-lm's classes inside it) when it is loaded."""
from __future__ import annotations

import importlib


def entry(package: str, modules: dict[str, str], key: str | None, attr: str):
    """`attr` of the module `modules[key]` under `package`, imported now if it was not; None for a
    key the table does not hold."""
    mod = modules.get(key or "")
    if mod is None:
        return None
    return getattr(importlib.import_module(f"{package}.{mod}"), attr)
