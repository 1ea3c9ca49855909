"""The settings that reach the engine, on one route: SettingsService.changed -> this controller ->
the engine's Configure request.

Whoever changes one of ENGINE_KEYS (the settings page, a restored session, a test) changes it through
the SettingsService; the controller hears `changed`, gathers the keys changed together (one `update`)
into one Configure and sends it. Configure checks the bounds as it is built (engine/limits.py, the one
rule) and the engine applies it whole or not at all. A refusal puts those keys back to what the engine
runs with (saved again, so the settings file and the engine agree) and says so with `refused(key,
message)`: the settings page shows it next to the field. There is one controller per SettingsService
(`EngineSettings.of`)."""
from __future__ import annotations

from PySide6.QtCore import QObject, QTimer, Signal

from engine.api import Configure          # plain Python: no mlx
from engine.errors import StrataError

from .settings import SettingsService

# settings key -> Configure field
ENGINE_KEYS = {"cache_mib": "cache_mib", "cache_slots": "cache_slots", "disk_mib": "disk_mib",
               "kv_bits": "kv_bits", "steering.speed_projection": "speed_projection"}
_KEY_OF_FIELD = {f: k for k, f in ENGINE_KEYS.items()}


class EngineSettings(QObject):
    """`applied(status)`: the engine took a change (its EngineStatus); `refused(key, message)`: it did
    not (nothing of that change is in force; `key` is the settings key the refusal is about)."""
    applied = Signal(object)
    refused = Signal(str, str)

    def __init__(self, client, settings: SettingsService, parent: QObject | None = None):
        super().__init__(parent)
        self.client, self.settings = client, settings
        self._held = {k: settings.get(k) for k in ENGINE_KEYS}     # what the engine was started with
        self._pending: dict[str, object] = {}
        self._in_flight = 0
        self._putting_back = False
        settings.changed.connect(self._on_changed)

    @classmethod
    def of(cls, settings: SettingsService, client) -> "EngineSettings":
        """The controller of `settings`, made by the first caller (the window) and found by the others."""
        found = settings.findChild(cls)
        return found if found is not None else cls(client, settings, parent=settings)

    def held(self, key: str):
        """The value the engine runs with (the last one it took)."""
        return self._held[key]

    @property
    def busy(self) -> bool:
        """A change is waiting to be sent or for the engine's answer."""
        return bool(self._pending) or self._in_flight > 0

    def _on_changed(self, key: str) -> None:
        if key not in ENGINE_KEYS or self._putting_back:
            return
        if not self._pending:
            # The keys of one update arrive one signal each: sent together on the next turn of the loop
            QTimer.singleShot(0, self, self._send)
        self._pending[key] = self.settings.get(key)

    def _send(self) -> None:
        batch, self._pending = self._pending, {}
        batch = {k: v for k, v in batch.items() if v != self._held[k]}
        if not batch:
            return
        fields = {ENGINE_KEYS[k]: v for k, v in batch.items()}
        try:
            Configure(**fields)               # the bounds (engine/limits.py), before anything is sent
        except StrataError as e:
            self._refuse(batch, getattr(e, "reason", ""), str(e))
            return
        self._in_flight += 1
        req = self.client.configure(**fields)
        req.done.connect(lambda status, b=batch: self._took(b, status))
        req.failed.connect(lambda message, b=batch, r=req: self._refuse(b, r.error_reason, message))
        req.finished.connect(self._finished)

    def _finished(self) -> None:
        self._in_flight -= 1

    def _took(self, batch: dict, status) -> None:
        self._held.update(batch)
        self.applied.emit(status)

    def _refuse(self, batch: dict, field: str, message: str) -> None:
        """Nothing of `batch` is in force: the settings say what the engine runs with again."""
        # A refusal that names no field: past the bounds (checked before sending) the engine can refuse
        # only the K/V width, which the loaded model may not take
        key = _KEY_OF_FIELD.get(field) or ("kv_bits" if "kv_bits" in batch else next(iter(batch)))
        self._putting_back = True
        try:
            new = self.settings.snapshot()
            for k in batch:
                _set(new, k, self._held[k])
            self.settings.update(new)
        finally:
            self._putting_back = False
        self.refused.emit(key, message)


def _set(settings, key: str, value) -> None:
    *head, last = key.split(".")
    obj = settings
    for part in head:
        obj = getattr(obj, part)
    setattr(obj, last, value)
