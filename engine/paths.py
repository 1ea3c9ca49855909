"""Where Strata keeps its files, by platform convention; STRATA_HOME overrides everything (tests use it)."""
from __future__ import annotations

import errno
import os
import sys
import tempfile
from pathlib import Path

SESSION_EXTENSION = ".stratasession"   # the one definition: engine, server and app read it


def data_dir() -> Path:
    home = os.environ.get("STRATA_HOME")
    if home:
        return Path(home).expanduser()
    if sys.platform == "darwin":
        return Path.home() / "Library" / "Application Support" / "Strata"
    xdg = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(xdg) / "strata"


def unusable_folder(folder: Path) -> str | None:
    """Why `folder` cannot be created or written (one line naming it), or None when it can: made
    (with its parents) if missing, then a file created and removed in it."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".strata-probe-"):
            pass
    except OSError as e:
        return f"{folder} cannot be used: {_why(e, folder)}"
    return None


def _why(e: OSError, folder: Path) -> str:
    if e.errno == errno.EEXIST or (e.errno == errno.ENOTDIR and folder.is_file()):
        return "it is a file, not a folder"
    if e.errno == errno.ENOTDIR:
        return "a part of its path is a file, not a folder"
    if e.errno in (errno.EACCES, errno.EPERM):
        return "no permission to write there"
    if e.errno == errno.EROFS:
        return "it is on a read-only file system"
    return e.strerror or str(e)


def check_data_dir() -> str | None:
    """Why the data folder (data_dir) cannot be used, as one line with what to do, or None."""
    why = unusable_folder(data_dir())
    if why is None:
        return None
    return f"the data folder {why} (set STRATA_HOME to a folder you can write)"


def models_dir() -> Path:
    return data_dir() / "models"


def sessions_dir() -> Path:
    return data_dir() / "sessions"


def bundle_root() -> Path:
    """The folder holding shaders/ and resources/: the repo root, or PyInstaller's unpack dir."""
    frozen = getattr(sys, "_MEIPASS", None)
    return Path(frozen) if frozen else Path(__file__).resolve().parent.parent


def resources_dir() -> Path:
    return bundle_root() / "resources"
