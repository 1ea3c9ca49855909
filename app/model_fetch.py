"""First run without a model: fetch the default model (engine.models, no mlx) with progress and cancel."""
from __future__ import annotations

from .qt_compat import emit

import threading

from PySide6.QtCore import QObject, Signal


class ModelFetch(QObject):
    progress = Signal(str, object, object)
    done = Signal(str)
    failed = Signal(str)

    def __init__(self, parent=None):
        super().__init__(parent)
        self._cancel = threading.Event()
        self.thread: threading.Thread | None = None

    def start(self) -> None:
        self.thread = threading.Thread(target=self._run, name="strata-fetch", daemon=True)
        self.thread.start()

    def cancel(self) -> None:
        self._cancel.set()

    def _run(self) -> None:
        from engine.errors import StrataError
        from engine.models import fetch_default
        try:
            path = fetch_default(progress=lambda s, d, t: emit(self.progress, s, int(d), int(t)),
                                 cancelled=self._cancel.is_set)
        except StrataError as e:
            emit(self.failed, str(e))
        except Exception as e:  # noqa: BLE001 - shown to the person, not a traceback
            emit(self.failed, f"{type(e).__name__}: {e}")
        else:
            emit(self.done, str(path))
