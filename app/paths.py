"""Where the app keeps its files: all under the one data folder, `engine.paths.data_dir()` (STRATA_HOME
overrides it). main() resolves it once and passes an `AppPaths` to the window, the settings, the chat
database and the single-instance lock; the engine in the same process reads the same definition, so
the models folder is one place for both without touching the environment.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


def _made(p: Path) -> Path:
    p.mkdir(parents=True, exist_ok=True)
    return p


@dataclass(frozen=True)
class AppPaths:
    data_dir: Path

    @classmethod
    def default(cls) -> "AppPaths":
        from engine.paths import data_dir
        return cls(_made(data_dir()))

    @property
    def models_dir(self) -> Path:
        return _made(self.data_dir / "models")

    @property
    def sessions_dir(self) -> Path:
        return _made(self.data_dir / "sessions")

    @property
    def db_path(self) -> Path:
        return self.data_dir / "chats.sqlite3"

    @property
    def settings_path(self) -> Path:
        return self.data_dir / "settings.ini"


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
