"""The app's settings, persisted with QSettings (an INI file in the data folder, so STRATA_HOME isolates tests).

`Settings` is the value (a dataclass); `SettingsService` is the one object the app holds it in: every
change goes through `update(new)` or `set(key, value)`, is saved, and emits `changed(key)` once for each
dotted key that changed ("cache_mib", "sampling.temperature", "steering.files"). The parts of the app
listen to the keys they care about; nobody compares old and new settings themselves.

Nothing here is a second definition: the sampling fields and their defaults are engine/sampling.py's
table (`APP_FIELDS`), the cache defaults engine/limits.py's, the data folder engine/paths.py's (handed in
as an `AppPaths`)."""
from __future__ import annotations

import copy
import json
from dataclasses import asdict, dataclass, field, fields, is_dataclass
from pathlib import Path

from PySide6.QtCore import QObject, QSettings, Signal

from engine.limits import (DEFAULT_CACHE_MIB, DEFAULT_CACHE_SLOTS, DEFAULT_DISK_MIB,   # plain Python: no mlx
                           KV_BITS, SPEED_PROJECTION_DEFAULT)
from engine.text.context_policy import DEFAULT_POLICY, POLICIES
from engine.sampling import APP_KEYS, CHAT_DEFAULTS
from engine.paths import resources_dir

from .paths import AppPaths

DEFAULT_SYSTEM_PROMPT = "You are a helpful assistant."
THEMES = ("system", "light", "dark")


@dataclass
class Sampling:
    """A chat's sampling: the fields of engine/sampling.py's table the app shows (their defaults are
    the table's `chat_default`), a system prompt and a context length."""
    temperature: float = CHAT_DEFAULTS["temperature"]
    top_p: float = CHAT_DEFAULTS["top_p"]
    top_k: int = CHAT_DEFAULTS["top_k"]
    min_p: float = CHAT_DEFAULTS["min_p"]
    repetition_penalty: float = CHAT_DEFAULTS["repetition_penalty"]
    max_tokens: int = CHAT_DEFAULTS["max_tokens"]
    system_prompt: str = DEFAULT_SYSTEM_PROMPT
    context_length: int = 0      # 0 = the model's own

    def request_sampling(self) -> dict:
        """What a generate request takes: the table's fields."""
        return {k: getattr(self, k) for k in APP_KEYS}


@dataclass
class Steering:
    files: list[tuple[str, float]] = field(default_factory=list)   # (path, scale)
    layer_from: int = 0          # 0 = all layers
    layer_to: int = 0
    mode: str = "add"            # add | project
    direction: str = "per-layer"  # per-layer | single:L
    speed_projection: bool = SPEED_PROJECTION_DEFAULT  # new chats (the Default config) start with it


# Keys written by older versions: read when the new one is absent
_OLD_KEYS = {"steering/speed_projection": "steering/on_by_default"}


@dataclass
class Settings:
    cache_mib: int = DEFAULT_CACHE_MIB
    cache_slots: int = DEFAULT_CACHE_SLOTS
    disk_mib: int = DEFAULT_DISK_MIB      # the disk tier under parking (engine/disk/disk_tier.py), 0 = off
    # K/V cache precision (engine/cache/kv_format.py): 16, 8 or 4 bits per value. A settings file from before
    # it existed has no key and loads as 16, the format every older session file holds.
    kv_bits: int = 16
    speculative: str = "off"              # the Default config's speculative decoding (app/presets.py)
    model: str = ""
    model_folders: list[str] = field(default_factory=list)   # walked with their subfolders (model_sources)
    model_libraries: bool = True          # also list LM Studio's, the Hugging Face cache's and Ollama's models
    # The most tokens one image takes with a dynamic-size image projector (engine LoadModel.image_max_tokens:
    # within the projector type's range, else the load is refused); 0 = the projector's own limit
    image_max_tokens: int = 0
    server_enabled: bool = False          # the OpenAI-compatible server (engine.frontends.server) on the app's engine
    server_host: str = "127.0.0.1"
    server_port: int = 8484
    server_api_key: str = ""              # empty: no key
    theme: str = "system"                 # system | light | dark (app/theme.py)
    # What a chat sends once it outgrows the context, unless it chose its own (engine/text/context_policy.py)
    overflow: str = DEFAULT_POLICY
    # Tools in the chat (MCP servers, app/tools/): the tools that run without asking ("server/tool"), a
    # call's timeout, and how many tool steps one reply may take before the loop stops
    tools_allowed: list[str] = field(default_factory=list)
    tools_timeout_s: float = 30.0
    tools_step_limit: int = 8
    sampling: Sampling = field(default_factory=Sampling)
    steering: Steering = field(default_factory=Steering)


def _qsettings(paths: AppPaths | None = None) -> QSettings:
    return QSettings(str((paths or AppPaths.default()).settings_path), QSettings.Format.IniFormat)


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


def _value(q: QSettings, key: str):
    if not q.contains(key) and key in _OLD_KEYS:
        key = _OLD_KEYS[key]
    return q.value(key)


def load(paths: AppPaths | None = None) -> Settings:
    q = _qsettings(paths)
    s = defaults()
    for f in fields(Settings):
        if f.name in ("sampling", "steering"):
            continue
        # "general/" was the group once: Qt's INI format writes it as [%General] and reads it back as
        # "General/", so those values never came back in a new process. Read them as a fallback.
        key = f"app/{f.name}" if q.contains(f"app/{f.name}") else f"General/{f.name}"
        setattr(s, f.name, _coerce(q.value(key), getattr(s, f.name)))
    if s.kv_bits not in KV_BITS:
        s.kv_bits = 16      # a hand-edited value the engine would refuse at start: the default instead
    if s.theme not in THEMES:
        s.theme = "system"
    if s.overflow not in POLICIES:
        s.overflow = DEFAULT_POLICY     # a hand-edited value the engine would refuse: the default instead
    for f in fields(Sampling):
        setattr(s.sampling, f.name, _coerce(q.value(f"sampling/{f.name}"), getattr(s.sampling, f.name)))
    for f in fields(Steering):
        if f.name == "files":
            continue
        setattr(s.steering, f.name, _coerce(_value(q, f"steering/{f.name}"), getattr(s.steering, f.name)))
    if not q.contains("steering/files"):
        return s            # never saved: keep the shipped default vector
    files = _coerce(q.value("steering/files"), [])
    s.steering.files = []
    for item in files:
        path, _, scale = str(item).rpartition("|")
        if path:
            s.steering.files.append((path, _coerce(scale, 1.0)))
    return s


def save(s: Settings, paths: AppPaths | None = None) -> None:
    q = _qsettings(paths)
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
    for old in _OLD_KEYS.values():
        q.remove(old)
    q.sync()


def changed_keys(old: Settings, new: Settings) -> list[str]:
    """The dotted keys whose values differ: a section's fields one by one ("steering.files")."""
    keys = []
    for f in fields(Settings):
        a, b = getattr(old, f.name), getattr(new, f.name)
        if is_dataclass(a):
            keys += [f"{f.name}.{g.name}" for g in fields(a) if getattr(a, g.name) != getattr(b, g.name)]
        elif a != b:
            keys.append(f.name)
    return keys


_FIELDS = frozenset(f.name for f in fields(Settings))


class SettingsService(QObject):
    """The app's one settings object. Read it like a `Settings` (`service.cache_mib`,
    `service.steering.files`) or take a copy to edit (`snapshot()`); change it with `update(new)` or
    `set("sampling.temperature", 0.3)`. Each change is saved at once (with `paths`; None saves nothing,
    for tests of a page alone) and `changed(key)` fires for each dotted key that changed, in field order."""
    changed = Signal(str)

    def __init__(self, value: Settings | None = None, paths: AppPaths | None = None, persist: bool = True,
                 parent: QObject | None = None):
        super().__init__(parent)
        self._paths = paths
        self._persist = persist
        self._value = value if value is not None else load(paths)

    @property
    def value(self) -> Settings:
        """The current settings (read them; change them through update/set)."""
        return self._value

    def __getattr__(self, name: str):
        # Only reached for names the QObject does not have: the Settings fields.
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self._value, name)

    def __setattr__(self, name: str, value) -> None:
        if name in _FIELDS:
            raise AttributeError(f"settings change through set({name!r}, value) or update(new), which save and "
                                 "tell the listeners")
        super().__setattr__(name, value)

    def snapshot(self) -> Settings:
        """A copy to edit and hand back to `update`."""
        return copy.deepcopy(self._value)

    def get(self, key: str):
        obj = self._value
        for part in key.split("."):
            obj = getattr(obj, part)
        return obj

    def set(self, key: str, value) -> list[str]:
        """Change one dotted key ("server_enabled", "steering.files")."""
        new = self.snapshot()
        *head, last = key.split(".")
        obj = new
        for part in head:
            obj = getattr(obj, part)
        if not hasattr(obj, last):
            raise KeyError(key)
        setattr(obj, last, value)
        return self.update(new)

    def update(self, new: Settings) -> list[str]:
        """Make `new` the settings: save them and emit `changed` for each key that differs. Returns the keys."""
        keys = changed_keys(self._value, new)
        if not keys:
            return []
        self._value = copy.deepcopy(new)
        if self._persist:
            save(self._value, self._paths)
        for key in keys:
            self.changed.emit(key)
        return keys
