"""A small fake of app/engine_thread.EngineClient for widget tests where the engine adds nothing: each
call is recorded in `calls` as (method, args, kwargs) and answered on the next turn of the event loop
with `answers[method]` (a result for `done`, or a `Refusal` for `failed`), else the method's typed
engine.api result with its defaults (DEFAULTS)."""
from __future__ import annotations

from dataclasses import dataclass

from PySide6.QtCore import QObject, QTimer, Signal

from app.engine_thread import Request
from engine import api
from engine.errors import ErrorCode


@dataclass
class Refusal:
    message: str
    code: str | None = None          # engine.errors.ErrorCode (None: refused before the engine)
    reason: str = ""
    vector: object = None            # engine.errors.VectorSpec of a steering refusal


# What each method answers when the test set nothing: the engine.api result with its defaults.
DEFAULTS = {
    "generate": lambda: api.Generation(),
    "load_model": lambda: api.ModelLoaded(model="", info={}),
    "configure": lambda: api.EngineStatus(),
    "status": lambda: api.EngineStatus(),
    "count_prompt_tokens": lambda: api.TokenCount(tokens=0),
    "save_session": lambda: api.SessionSaved(),
    "restore_session": lambda: api.SessionRestored(),
}


class FakeRequest(Request):
    """engine_thread.Request (its signals and fields), answered by the test instead of an engine."""

    def __init__(self, kind: str, answer, parent: QObject | None = None):
        super().__init__(kind, parent)
        QTimer.singleShot(0, self, lambda: self._answer(answer))

    def _answer(self, answer) -> None:
        if self._cancel:
            return
        if isinstance(answer, Refusal):
            self.error = answer.message
            self.error_code = None if answer.code is None else ErrorCode(answer.code)
            self.error_reason = answer.reason
            self.error_vector = answer.vector
            self.failed.emit(answer.message)
        else:
            self.result = answer
            self.done.emit(answer)
        self.finished.emit()


class FakeClient(QObject):
    ready = Signal()
    kv_changed = Signal()

    def __init__(self, parent: QObject | None = None):
        super().__init__(parent)
        self.calls: list[tuple[str, tuple, dict]] = []
        self.answers: dict[str, object] = {}
        self.is_ready = True

    def names(self) -> list[str]:
        return [name for name, _a, _k in self.calls]

    def _call(self, name: str, *args, **kw) -> FakeRequest:
        self.calls.append((name, args, kw))
        if name in self.answers:
            answer = self.answers[name]
            answer = answer(*args, **kw) if callable(answer) else answer
        else:
            answer = DEFAULTS[name]() if name in DEFAULTS else None
        return FakeRequest(name, answer, self)

    def generate(self, messages, sampling, conversation="", **kw):
        return self._call("generate", messages, sampling, conversation=conversation, **kw)

    def load_model(self, path, steering="keep", **kw):
        return self._call("load_model", path, steering=steering, **kw)

    def configure(self, **kw):
        return self._call("configure", **kw)

    def count_prompt_tokens(self, messages):
        return self._call("count_prompt_tokens", messages)

    def status(self):
        return self._call("status")

    def save_session(self, path, **kw):
        return self._call("save_session", path, **kw)

    def restore_session(self, path, **kw):
        return self._call("restore_session", path, **kw)

