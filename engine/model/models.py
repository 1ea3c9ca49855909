"""The models folder: find a model by path or name, list what is there, where the default model lives.

Fetching the default model is not the engine's: it is strata_fetch (a package-index HTTP client), which
the app and the `strata models fetch-default` command call; the engine holds no HTTP code.
"""
from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Callable

from engine.model import model_sources
from engine.errors import ModelFileError
from engine.paths import models_dir

DEFAULT_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"   # strata_fetch.default_model says where it comes from


def default_model_path() -> Path:
    return models_dir() / DEFAULT_NAME


def find_models(extra_dirs: list[str] | tuple = (), libraries: bool = True) -> model_sources.Scan:
    """The models of the models folder, `extra_dirs` and (with `libraries`) LM Studio's, the Hugging
    Face cache's and Ollama's, each file once and each split set once (engine/model/model_sources.py)."""
    roots = model_sources.folder_roots(models_dir(), extra_dirs)
    return model_sources.find(roots + (model_sources.library_roots() if libraries else []))


def list_models(extra_dirs: list[str] | tuple = (), libraries: bool = True) -> list[Path]:
    """The paths to load of `find_models`. Nothing is opened here (a FIFO or a link to a device is
    refused by name when loaded); a symlink loop is listed as itself."""
    return [m.path for m in find_models(extra_dirs, libraries).models]


def resolve_model(name_or_path: str) -> Path:
    p = Path(name_or_path).expanduser()
    if p.exists() or p.is_absolute() or os.sep in name_or_path:
        return p
    for candidate in (models_dir() / name_or_path, models_dir() / f"{name_or_path}.gguf"):
        if candidate.exists():
            return candidate
    want = name_or_path.lower()
    found = find_models().models
    matches = [m.path for m in found if want in m.path.name.lower() or want in m.label.lower()]
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

