"""Draft model names from the server (`"speculative": "draft:NAME"`): a model in the models folder, only.

A client names a file; it never points the server at a path. The name is checked by its shape first
(no separators, no `~`, no leading dot, no `..`, no control characters, at most NAME_MAX characters:
nothing is looked up for a bad one), then looked up in the models folder alone -- never relative to
the server's working folder, never through `~`: the exact name, the name + `.gguf`, or the one model
file whose name contains it. Only regular files count (a FIFO, a device or a socket is refused without
being opened). The engine then opens it (engine/gguf_file.open_gguf) and checks it against the memory
estimate and guard before loading (engine/handlers.py).

The command line and the app pass `draft:PATH` (their user owns the file system) and do not come here.
"""
from __future__ import annotations

import os
import stat
from pathlib import Path

from engine.errors import ModelFileError, RequestError
from engine.paths import models_dir

NAME_MAX = 255          # a file name's limit on macOS and Linux


def check_name(name: object) -> str:
    """`name` if it has the shape of a file name in the models folder; RequestError (one line) if not."""
    if not isinstance(name, str) or not name.strip():
        raise RequestError("speculative draft: give a model name from the models folder")
    if len(name) > NAME_MAX:
        raise RequestError(f"speculative draft: the name is {len(name)} characters (a model name has at most "
                           f"{NAME_MAX})")
    if any(ord(c) < 32 or ord(c) == 127 for c in name):
        raise RequestError("speculative draft: the name has control characters")
    if "/" in name or "\\" in name or os.sep in name or (os.altsep and os.altsep in name) \
            or name.startswith(("~", ".")):
        raise RequestError("speculative draft: give a model name from the models folder, not a path")
    return name


def _regular(p: Path) -> bool | None:
    """True: a regular file (through a symlink); False: something else there; None: nothing there."""
    try:
        return stat.S_ISREG(os.stat(p).st_mode)
    except OSError:
        return None


def resolve(name: str, folder: Path | None = None) -> Path:
    """The model file `name` stands for in the models folder (`folder`, default paths.models_dir())."""
    check_name(name)
    folder = Path(folder) if folder is not None else models_dir()
    for candidate in (folder / name, folder / f"{name}.gguf"):
        kind = _regular(candidate)
        if kind:
            return candidate
        if kind is False:
            raise ModelFileError(f"draft model {candidate.name} is not a regular file (a folder, FIFO, device "
                                 f"or socket)")
    try:
        with os.scandir(folder) as it:
            files = sorted(e.name for e in it if e.name.lower().endswith(".gguf") and not e.name.startswith(".")
                           and _regular(folder / e.name))
    except OSError as e:
        raise ModelFileError(f"the models folder cannot be read: {e.strerror or e}") from None
    matches = [f for f in files if name.lower() in f.lower()]
    if len(matches) == 1:
        return folder / matches[0]
    if not matches:
        raise ModelFileError(f"no draft model named '{name}' in the models folder")
    shown = ", ".join(matches[:5]) + (f" and {len(matches) - 5} more" if len(matches) > 5 else "")
    raise ModelFileError(f"'{name}' matches several models: {shown}")
