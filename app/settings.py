"""The app's settings, persisted with QSettings (an INI file in the data folder, so STRATA_HOME isolates tests)."""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from PySide6.QtCore import QSettings

from engine.limits import DEFAULT_CACHE_MIB, DEFAULT_CACHE_SLOTS   # plain Python: no mlx

from . import paths


@dataclass
class Sampling:
    temperature: float = 0.7
    top_p: float = 0.95
    top_k: int = 40
    min_p: float = 0.05
    repetition_penalty: float = 1.1
    max_tokens: int = 512
    system_prompt: str = "You are a helpful assistant."
    context_length: int = 0      # 0 = the model's own


@dataclass
class Steering:
    files: list[tuple[str, float]] = field(default_factory=list)   # (path, scale)
    layer_from: int = 0          # 0 = all layers
    layer_to: int = 0
    mode: str = "add"            # add | project
    direction: str = "per-layer"  # per-layer | single:L
    on_by_default: bool = True


@dataclass
class Settings:
    cache_mib: int = DEFAULT_CACHE_MIB
    cache_slots: int = DEFAULT_CACHE_SLOTS
    model: str = ""
    model_folders: list[str] = field(default_factory=list)
    server_enabled: bool = False          # the OpenAI-compatible server (engine.server) on the app's engine
    server_host: str = "127.0.0.1"
    server_port: int = 8484
    server_api_key: str = ""              # empty: no key
    sampling: Sampling = field(default_factory=Sampling)
    steering: Steering = field(default_factory=Steering)


def _qsettings() -> QSettings:
    return QSettings(str(paths.settings_path()), QSettings.Format.IniFormat)


def _coerce(value, default):
    if value is None:
        return default
    try:
        if isinstance(default, bool):
            return value if isinstance(value, bool) else str(value).lower() in ("1", "true", "yes")
        if isinstance(default, int):
            return int(value)
        if isinstance(default, float):
            return float(value)
        if isinstance(default, list):
            return list(value) if isinstance(value, (list, tuple)) else ([value] if value else [])
        return str(value)
    except (TypeError, ValueError):
        return default


def defaults() -> Settings:
    """The code's defaults overlaid with resources/default-settings.json (shipped with the app).

    It ships the default model's speed projection configured but off: a chat turns it on with its
    toggle (it halves reply length on SmolLM2 but worsens answers; see bench/README.md). Relative
    control-vector paths are inside resources/."""
    from engine.paths import resources_dir
    s = Settings()
    try:
        data = json.loads((resources_dir() / "default-settings.json").read_text())
    except (OSError, ValueError):
        return s
    for section, target in (("sampling", s.sampling), ("steering", s.steering)):
        for key, value in (data.pop(section, None) or {}).items():
            if key == "files":
                value = [(str(resources_dir() / p) if not Path(p).is_absolute() else p, float(sc))
                         for p, sc in value]
            if hasattr(target, key):
                setattr(target, key, value)
    for key, value in data.items():
        if hasattr(s, key):
            setattr(s, key, value)
    return s


def load() -> Settings:
    q = _qsettings()
    s = defaults()
    for f in fields(Settings):
        if f.name in ("sampling", "steering"):
            continue
        # "general/" was the group once: Qt's INI format writes it as [%General] and reads it back as
        # "General/", so those values never came back in a new process. Read them as a fallback.
        key = f"app/{f.name}" if q.contains(f"app/{f.name}") else f"General/{f.name}"
        setattr(s, f.name, _coerce(q.value(key), getattr(s, f.name)))
    for f in fields(Sampling):
        setattr(s.sampling, f.name, _coerce(q.value(f"sampling/{f.name}"), getattr(s.sampling, f.name)))
    for f in fields(Steering):
        if f.name == "files":
            continue
        setattr(s.steering, f.name, _coerce(q.value(f"steering/{f.name}"), getattr(s.steering, f.name)))
    if not q.contains("steering/files"):
        return s            # never saved: keep the shipped default vector
    files = _coerce(q.value("steering/files"), [])
    s.steering.files = []
    for item in files:
        path, _, scale = str(item).rpartition("|")
        if path:
            s.steering.files.append((path, _coerce(scale, 1.0)))
    return s


def save(s: Settings) -> None:
    q = _qsettings()
    for k, v in asdict(s).items():
        if k in ("sampling", "steering"):
            continue
        q.setValue(f"app/{k}", v)
    for k, v in asdict(s.sampling).items():
        q.setValue(f"sampling/{k}", v)
    for k, v in asdict(s.steering).items():
        if k != "files":
            q.setValue(f"steering/{k}", v)
    q.setValue("steering/files", [f"{p}|{scale}" for p, scale in s.steering.files])
    q.sync()
