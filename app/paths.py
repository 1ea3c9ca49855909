"""Where the app keeps its files: QStandardPaths by platform convention; STRATA_HOME overrides all.

The engine (engine.paths) reads STRATA_HOME too; `export_home()` makes it agree with the app when
the app picked a QStandardPaths folder, so the models folder is one place for both.
"""
from __future__ import annotations

import os
from pathlib import Path

from PySide6.QtCore import QStandardPaths


def data_dir() -> Path:
    home = os.environ.get("STRATA_HOME")
    if home:
        path = Path(home).expanduser()
    else:
        loc = QStandardPaths.writableLocation(QStandardPaths.StandardLocation.AppDataLocation)
        path = Path(loc) if loc else Path.home() / ".strata"
    path.mkdir(parents=True, exist_ok=True)
    return path


def export_home() -> None:
    """Point the engine's paths at the app's data folder (same process, same files)."""
    os.environ["STRATA_HOME"] = str(data_dir())


def models_dir() -> Path:
    p = data_dir() / "models"
    p.mkdir(parents=True, exist_ok=True)
    return p


def sessions_dir() -> Path:
    p = data_dir() / "sessions"
    p.mkdir(parents=True, exist_ok=True)
    return p


def db_path() -> Path:
    return data_dir() / "chats.sqlite3"


def settings_path() -> Path:
    return data_dir() / "settings.ini"
