"""The models folder: find a model by path or name, list what is there, where the default model lives.

Fetching the default model is not the engine's: it is strata_fetch (a package-index HTTP client), which
the app and the `strata models fetch-default` command call; the engine holds no HTTP code.
"""
from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Callable

from .errors import ModelFileError
from .paths import models_dir

DEFAULT_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"   # strata_fetch.default_model says where it comes from


def default_model_path() -> Path:
    return models_dir() / DEFAULT_NAME


def list_models(extra_dirs: list[str] | tuple = ()) -> list[Path]:
    """The `*.gguf` entries of the models folder (and `extra_dirs`), each once. Nothing is opened here
    (a FIFO or a link to a device is refused by name when loaded); a symlink loop is listed as itself."""
    seen, out = set(), []
    for d in [models_dir(), *map(Path, extra_dirs)]:
        try:
            found = sorted(d.glob("*.gguf")) if d.is_dir() else []
        except OSError:
            continue
        for p in found:
            try:
                r = p.resolve()
            except (OSError, RuntimeError):        # RuntimeError: a symlink loop (Python 3.11)
                r = p
            if r not in seen:
                seen.add(r)
                out.append(p)
    return out


def resolve_model(name_or_path: str) -> Path:
    p = Path(name_or_path).expanduser()
    if p.exists() or p.is_absolute() or os.sep in name_or_path:
        return p
    for candidate in (models_dir() / name_or_path, models_dir() / f"{name_or_path}.gguf"):
        if candidate.exists():
            return candidate
    matches = [m for m in list_models() if name_or_path.lower() in m.name.lower()]
    if len(matches) == 1:
        return matches[0]
    if not matches:
        raise ModelFileError(f"no model named '{name_or_path}' in {models_dir()}")
    raise ModelFileError(f"'{name_or_path}' matches several models: {', '.join(m.name for m in matches)}")


def sha256_file(path: Path, progress: Callable[[int, int], None] | None = None) -> str:
    h = hashlib.sha256()
    total, done = path.stat().st_size, 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
            done += len(chunk)
            if progress:
                progress(done, total)
    return h.hexdigest()

