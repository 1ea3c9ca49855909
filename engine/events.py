"""What the engine thread sends back to callers, and the handle a caller holds for one request."""
from __future__ import annotations

import queue
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator


@dataclass
class Token:
    id: int
    text: str


@dataclass
class Progress:
    stage: str        # "load", "prefill", "save", "restore"
    done: int
    total: int


@dataclass
class Log:
    line: str


@dataclass
class Done:
    result: dict = field(default_factory=dict)


@dataclass
class Failed:
    message: str
    code: str = ""    # a refusal the caller may act on, e.g. "session_overwrite" (ask, then save with force)


Event = Token | Progress | Log | Done | Failed


class Handle:
    """One submitted request. Iterate `events()` or call `result()`; `cancel()` stops it between tokens."""

    def __init__(self, request: Any, callback: Callable[[Event], None] | None = None):
        self.request = request
        self._q: queue.Queue = queue.Queue()
        self._cancel = threading.Event()
        self._callback = callback
        self.finished = threading.Event()
        self.outcome: Done | Failed | None = None
        self.log_lines: list[str] = []     # the engine's log lines for this request (park/restore...)

    def emit(self, event: Event) -> None:
        if isinstance(event, (Done, Failed)):
            self.outcome = event
        elif isinstance(event, Log):
            self.log_lines.append(event.line)
        if self._callback is not None:
            self._callback(event)
        self._q.put(event)
        if isinstance(event, (Done, Failed)):
            self.finished.set()

    def cancel(self) -> None:
        self._cancel.set()

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    def events(self, timeout: float | None = None) -> Iterator[Event]:
        while True:
            event = self._q.get(timeout=timeout)
            yield event
            if isinstance(event, (Done, Failed)):
                return

    def result(self, timeout: float | None = None) -> dict:
        """The Done result; raises StrataError with the engine's one-line message on failure."""
        from .errors import StrataError
        if not self.finished.wait(timeout):
            raise TimeoutError("engine did not answer in time")
        if isinstance(self.outcome, Failed):
            err = StrataError(self.outcome.message)
            err.code = self.outcome.code
            raise err
        return self.outcome.result
