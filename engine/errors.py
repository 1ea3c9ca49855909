"""Errors the engine reports: one line each, no traceback, and a code a program can act on.

Every refusal is a `StrataError` whose class names its `ErrorCode` (and, for a refused session,
its `reason`). A failed request reaches its caller as `events.Failed(message, code, reason)`, and
`Handle.result()` raises it as an `EngineError`: callers branch on `.code`/`.reason`, never on
the message text (which is for people). Plain Python: the app imports it.
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from pathlib import Path


class ErrorCode(str, Enum):
    """What kind of failure a request met (a str, so it compares and serialises as its value)."""
    BAD_REQUEST = "bad_request"            # the request (a flag, a parameter, a file named in it) is refused
    MODEL_NOT_LOADED = "model_not_loaded"  # no model is loaded (yet, or its load failed)
    SESSION_REFUSED = "session_refused"    # a session save/restore refused; `reason` says why (SessionRefusal)
    MEMORY_REFUSED = "memory_refused"      # it would not fit in memory, or memory cannot be read
    CANCELLED = "cancelled"                # the caller cancelled it
    UNAVAILABLE = "unavailable"            # the engine cannot serve (a distributed rank was lost)
    INTERNAL = "internal"                  # a bug: the engine keeps serving, suspect K/V is dropped

    def __str__(self) -> str:
        return self.value


class SessionRefusal(str, Enum):
    """Why a session request was refused (`EngineError.reason` with ErrorCode.SESSION_REFUSED)."""
    FILE = "file"                # the file: missing, corrupt, another model, another steering...
    OVERWRITE = "overwrite"      # the save would replace a longer conversation: ask, then save with force
    STEERING = "steering"        # saved with another steering setting: load the vector it names, then retry
    KV_FORMAT = "kv_format"      # saved with another K/V precision: switch the engine's (--kv-bits / Settings)

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class VectorSpec:
    """A control vector as a session file names it (its files with their scales, the layer range, the
    mode and the direction): what a steering refusal carries, so a front end can offer to load it
    without reading the file again."""
    files: tuple[tuple[str, float], ...] = ()
    layer_range: tuple[int, int] | None = None
    mode: str = "add"
    direction: str = "per-layer"

    @classmethod
    def of(cls, spec: dict) -> "VectorSpec | None":
        """From the dict a session file's header holds (None when it names no files)."""
        files = tuple((str(p), float(sc)) for p, sc in spec.get("files") or [])
        if not files:
            return None
        lr = spec.get("layer_range")
        return cls(files, (int(lr[0]), int(lr[1])) if lr else None, str(spec.get("mode") or "add"),
                   str(spec.get("direction") or "per-layer"))

    def describe(self) -> str:
        names = ", ".join(f"{Path(p).name} x{sc:g}" for p, sc in self.files)
        layers = f", layers {self.layer_range[0]}..{self.layer_range[1]}" if self.layer_range else ""
        return f"{names} ({self.mode}{layers})"


class StrataError(Exception):
    """A problem with the user's input (a file, a flag, a request) that the engine refuses cleanly."""
    error_code: ErrorCode = ErrorCode.BAD_REQUEST
    reason: str = ""             # a finer kind within the code (e.g. "context_length", SessionRefusal)

    def __init__(self, *args):
        # One line, always: messages often quote a library's own (multi-line) error text.
        if len(args) == 1 and isinstance(args[0], str) and ("\n" in args[0] or "\r" in args[0]):
            args = (" ".join(args[0].split()),)
        super().__init__(*args)


class EngineError(StrataError):
    """A failed request as its caller sees it: `code` (ErrorCode), `reason` and a one-line message;
    `vector`: for a steering refusal, the control vector the session file needs (as data)."""

    def __init__(self, code: ErrorCode | str, message: str, reason: str = "", vector: "VectorSpec | None" = None):
        super().__init__(message)
        self.code = ErrorCode(code)
        self.error_code = self.code
        self.reason = str(reason or "")
        self.message = str(self)
        self.vector = vector

    @classmethod
    def of(cls, exc: BaseException) -> "EngineError":
        """The EngineError a raised exception stands for (anything not a StrataError is internal)."""
        if isinstance(exc, EngineError):
            return exc
        if isinstance(exc, StrataError):
            return cls(exc.error_code, str(exc), exc.reason, vector=getattr(exc, "vector", None))
        return cls(ErrorCode.INTERNAL, f"internal error: {type(exc).__name__}: {exc}")


class ModelFileError(StrataError):
    """A model file that cannot be used: missing, not a GGUF, truncated, unsupported."""


class ModelNotLoaded(StrataError):
    """A request that needs a model when none is loaded."""
    error_code = ErrorCode.MODEL_NOT_LOADED

    def __init__(self, message: str = "no model is loaded"):
        super().__init__(message)


class MemoryRefused(StrataError):
    """Refused for memory: it would not fit, or the machine's memory cannot be read."""
    error_code = ErrorCode.MEMORY_REFUSED


class SessionFileError(StrataError):
    """A session file that is refused; the live conversation stays untouched."""
    error_code = ErrorCode.SESSION_REFUSED
    reason = SessionRefusal.FILE.value


class SessionOverwriteRefused(SessionFileError):
    """A save that would replace a session file holding a longer conversation (or a file that is not a
    session): the caller asks the person, then sends the save again with force=True."""
    reason = SessionRefusal.OVERWRITE.value

    def __init__(self, message: str, *, path: str, existing_tokens: int | None, new_tokens: int):
        super().__init__(message)
        self.path, self.existing_tokens, self.new_tokens = path, existing_tokens, new_tokens


class SessionSteeringRefused(SessionFileError):
    """A session file saved with another steering setting than the engine can apply now; the message
    names the control vector it needs, and `vector` carries it as data (None: the file names none)."""
    reason = SessionRefusal.STEERING.value

    def __init__(self, message: str, vector: VectorSpec | None = None):
        super().__init__(message)
        self.vector = vector


class SessionFormatRefused(SessionFileError):
    """A session file holding another K/V precision than the engine runs (never converted); the
    message names both. How to switch is the front end's to say (the CLI's flag, the app's setting)."""
    reason = SessionRefusal.KV_FORMAT.value


class RequestError(StrataError):
    """A malformed request (prompt too long, bad parameter)."""


class ContextTooLong(RequestError):
    """A prompt (or conversation) longer than the context holds."""
    reason = "context_length"


class Cancelled(StrataError):
    """The caller cancelled the request."""
    error_code = ErrorCode.CANCELLED
