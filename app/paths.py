"""Where the app keeps its files: all under the one data folder, `engine.paths.data_dir()` (STRATA_HOME
overrides it). main() resolves it once and passes an `AppPaths` to the window, the settings, the chat
database and the single-instance lock; the engine in the same process reads the same definition, so
the models folder is one place for both without touching the environment.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from engine.paths import check_data_dir, data_dir as engine_data_dir
from PySide6.QtCore import QStandardPaths


def _made(p: Path) -> Path:
    p.mkdir(parents=True, exist_ok=True)
    return p


@dataclass(frozen=True)
class AppPaths:
    data_dir: Path

    @classmethod
    def default(cls) -> "AppPaths":
        return cls(_made(engine_data_dir()))

    @property
    def models_dir(self) -> Path:
        return _made(self.data_dir / "models")

    @property
    def sessions_dir(self) -> Path:
        return _made(self.data_dir / "sessions")

    @property
    def images_dir(self) -> Path:
        """The images sent in chats, a folder per chat (app/chat_images.py)."""
        return self.data_dir / "images"

    @property
    def db_path(self) -> Path:
        return self.data_dir / "chats.sqlite3"

    @property
    def settings_path(self) -> Path:
        return self.data_dir / "settings.ini"


def settle_data_dir(choose: Callable[[str], Path | None]) -> str | None:
    """Make sure the data folder can be created and written before anything uses it: while it cannot,
    `choose(why)` is asked for another folder (the user's pick; None: they gave up), which STRATA_HOME
    then names for this process (the engine in it reads the same variable). None once a folder works,
    else the last reason (one line naming the folder)."""
    while (why := check_data_dir()) is not None:
        chosen = choose(why)
        if chosen is None:
            return why
        os.environ["STRATA_HOME"] = str(chosen)
    return None


def legacy_data_dir() -> Path | None:
    """Where the app kept its files before it used engine.paths' folder: QStandardPaths' AppDataLocation
    (the application's identity must be set: set_identity)."""
    loc = QStandardPaths.writableLocation(QStandardPaths.StandardLocation.AppDataLocation)
    return Path(loc) if loc else None


_LEGACY_ITEMS = (("settings.ini",), ("chats.sqlite3", "chats.sqlite3-wal", "chats.sqlite3-shm"), ("sessions",),
                 ("models",))


def adopt_legacy(paths: AppPaths, legacy: Path | None) -> list[str]:
    """Move what an older Strata kept in `legacy` into `paths.data_dir`, each item only where the new
    folder has none (an empty folder counts as none); a move that fails (another disk) leaves the item
    where it was. Returns the names moved."""
    if legacy is None or not legacy.is_dir() or legacy.resolve() == paths.data_dir.resolve():
        return []
    moved = []
    for group in _LEGACY_ITEMS:
        first_src, first_dst = legacy / group[0], paths.data_dir / group[0]
        if not first_src.exists():
            continue
        if first_dst.is_dir() and not any(first_dst.iterdir()):
            first_dst.rmdir()
        if first_dst.exists():
            continue
        for name in group:
            if (legacy / name).exists():
                try:
                    os.replace(legacy / name, paths.data_dir / name)
                except OSError:
                    break
                moved.append(name)
    return moved


# Shorthands for the default folder (tests, and callers not handed an AppPaths)
def data_dir() -> Path:
    return AppPaths.default().data_dir


def models_dir() -> Path:
    return AppPaths.default().models_dir


def sessions_dir() -> Path:
    return AppPaths.default().sessions_dir


def db_path() -> Path:
    return AppPaths.default().db_path


def settings_path() -> Path:
    return AppPaths.default().settings_path


def set_identity(app) -> None:
    """The application's names (Qt builds its own folders from them; the older data folder, see
    legacy_data_dir, was one). Here, not in app.main: the self-test sets them too."""
    app.setApplicationName("Strata")
    app.setOrganizationName("Strata")
