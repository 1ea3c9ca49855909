"""What the engine thread sends back to callers, and the handle a caller holds for one request."""
from __future__ import annotations

import queue
import threading
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Callable, Iterator

from engine.errors import EngineError, ErrorCode, VectorSpec


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
class KVChanged:
    """The held conversations changed during a request (a park, an eviction, a take): the parking
    figures as they are now (parking.Parking.status()), and for a reply its prompt and cached tokens."""
    parking: dict
    conversation: str = ""
    prompt_tokens: int = 0
    cached_tokens: int = 0
    restored_from_disk: int = 0     # of cached_tokens, how many the disk tier restored (engine/disk/disk_tier.py)


class KVMove(str, Enum):
    """What happened to a held conversation's K/V (KVMoved.kind)."""
    PARKED = "parked"            # it lost the engine and RAM parking took it
    NOT_PARKED = "not_parked"    # it lost the engine and parking refused it (over the cap, the memory guard)
    EVICTED = "evicted"          # parking let it go for a limit (slots, the cap, the guard's reserve)
    DROPPED = "dropped"          # forgotten: it failed when used, or a newer copy superseded it

    def __str__(self) -> str:
        return self.value


@dataclass
class KVMoved:
    """A held conversation's K/V was parked, refused, evicted or dropped during a request: what a front
    end reacts to (the app's status bar), never the log line that says the same for people."""
    kind: KVMove
    tokens: int                     # the conversation's tokens
    nbytes: int                     # its K/V's bytes (what parking counts against its cap)
    owner: str = ""                 # the conversation it belongs to (a request's `conversation`)
    why: str = ""                   # for evicted / not parked / dropped: the limit or the failure
    parking: dict = field(default_factory=dict)   # parking.Parking.status() after the move

    def __post_init__(self):
        self.kind = KVMove(self.kind)


@dataclass
class Done:
    result: Any = None      # the request's typed result (engine/api.py: Generation, EngineStatus, ...)


@dataclass
class Failed:
    message: str                                   # one line, for people
    code: ErrorCode = ErrorCode.BAD_REQUEST        # what a program branches on (never the message)
    reason: str = ""                               # finer kind, e.g. SessionRefusal.OVERWRITE: ask, then force
    vector: VectorSpec | None = None               # SessionRefusal.STEERING: the control vector the file needs

    def __post_init__(self):
        self.code = ErrorCode(self.code)

    def error(self) -> EngineError:
        return EngineError(self.code, self.message, self.reason, vector=self.vector)


Event = Token | Progress | Log | KVChanged | KVMoved | Done | Failed


# Set once, at interpreter exit (engine/at_exit.py): every request is then cancelled.
_EVERYTHING_CANCELLED = threading.Event()


def cancel_everything() -> None:
    """Cancel every request, running or queued, of every engine in this process (at exit)."""
    _EVERYTHING_CANCELLED.set()


ENGINE_STOPPED = "engine_stopped"   # Failed.reason once the engine thread has ended on an error (Engine.failure)


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
        return self._cancel.is_set() or _EVERYTHING_CANCELLED.is_set()

    def events(self, timeout: float | None = None) -> Iterator[Event]:
        while True:
            event = self._q.get(timeout=timeout)
            yield event
            if isinstance(event, (Done, Failed)):
                return

    def result(self, timeout: float | None = None) -> Any:
        """The Done result (engine/api.py's type for the request); raises EngineError (code, reason,
        the engine's one-line message) on failure."""
        if not self.finished.wait(timeout):
            raise TimeoutError("engine did not answer in time")
        if isinstance(self.outcome, Failed):
            raise self.outcome.error()
        return self.outcome.result
