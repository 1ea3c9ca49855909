"""Where Strata keeps its files, by platform convention; STRATA_HOME overrides everything (tests use it)."""
from __future__ import annotations

import os
import sys
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
