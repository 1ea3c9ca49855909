"""Connections bounded: what a client that opens many connections, or sends slowly, can hold.

- At most `max_connections` open at once (kept below the process's file-descriptor limit, so the
  accept loop never runs out of descriptors for lack of a cap): one past the cap is answered 503
  (uvicorn's `limit_concurrency` answers its request) and closed after `over_cap_grace_s` if it sends none.
- A request's headers must arrive within `header_timeout_s` of the connection's start (or of the
  previous response's end), its body within `body_timeout_s` of its headers: a slow client is
  answered 408 and closed. Between requests a connection idles at most `keep_alive_s`.
- Log lines a flood could repeat without bound (the accept loop's "Too many open files", uvicorn's
  "Exceeded concurrency limit.", the 408s here) are written at most once a minute, with a count.

    config = uvicorn.Config(app, **uvicorn_options(ConnectionLimits(max_connections=8)))
"""
from __future__ import annotations

import logging
import resource
import threading
import time
from dataclasses import dataclass

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

DEFAULT_MAX_CONNECTIONS = 128
DEFAULT_HEADER_TIMEOUT_S = 10.0
DEFAULT_BODY_TIMEOUT_S = 60.0
DEFAULT_KEEP_ALIVE_S = 5.0
FD_RESERVE = 64                 # descriptors kept for the model, the disk tier, logs and the rest
LOG_INTERVAL_S = 60.0

_log = logging.getLogger("strata.server")


@dataclass(frozen=True)
class ConnectionLimits:
    max_connections: int = DEFAULT_MAX_CONNECTIONS
    header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S
    body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S
    keep_alive_s: float = DEFAULT_KEEP_ALIVE_S
    over_cap_grace_s: float = 1.0

    def effective_cap(self) -> int:
        """`max_connections`, lowered to fit the file-descriptor limit (half of what is left after
        FD_RESERVE: a connection past the cap still holds one until it is answered)."""
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft == resource.RLIM_INFINITY:
            return self.max_connections
        return max(1, min(self.max_connections, (soft - FD_RESERVE) // 2))


# ---- rate-limited log lines ------------------------------------------------------------------------
class RateLimitFilter(logging.Filter):
    """Lets through one record a minute per kind (a pattern in its message, or an OSError "too many
    open files"); the next one let through says how many were held back."""

    KINDS = ("Too many open files", "out of system resource", "Exceeded concurrency limit",
             "slow client", "over the connection cap")

    def __init__(self, interval_s: float = LOG_INTERVAL_S):
        super().__init__()
        self.interval = interval_s
        self.lock = threading.Lock()
        self.last: dict[str, float] = {}
        self.held: dict[str, int] = {}

    def _kind(self, record: logging.LogRecord) -> str | None:
        text = record.getMessage()
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, OSError) and exc.errno in (23, 24):      # ENFILE, EMFILE
            return "Too many open files"
        return next((k for k in self.KINDS if k in text), None)

    def filter(self, record: logging.LogRecord) -> bool:
        kind = self._kind(record)
        if kind is None:
            return True
        now = time.monotonic()
        with self.lock:
            if now - self.last.get(kind, -1e18) < self.interval:
                self.held[kind] = self.held.get(kind, 0) + 1
                return False
            self.last[kind] = now
            held = self.held.pop(kind, 0)
        if record.exc_info and kind == "Too many open files":
            record.exc_info, record.exc_text = None, None          # one line, not a traceback each time
            first = record.getMessage().splitlines()[0] if record.getMessage() else "accept()"
            record.msg, record.args = f"{first}: too many open files", ()
        if held:
            record.msg, record.args = f"{record.getMessage()} ({held} more like it in the last minute)", ()
        return True


_FILTER = RateLimitFilter()


def install_log_limits() -> RateLimitFilter:
    """The rate limit on the loggers a flood reaches (idempotent)."""
    for name in ("asyncio", "uvicorn.error", "strata.server"):
        logger = logging.getLogger(name)
        if _FILTER not in logger.filters:
            logger.addFilter(_FILTER)
    return _FILTER


# ---- the protocol ----------------------------------------------------------------------------------
def _raw_408() -> bytes:
    body = (b'{"error":{"message":"the request was not sent in time","type":"invalid_request_error",'
            b'"param":null,"code":"request_timeout"}}')
    return (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\nconnection: close\r\n"
            b"content-length: " + str(len(body)).encode() + b"\r\n\r\n" + body)


RAW_408 = _raw_408()


def protocol_class(limits: ConnectionLimits, cap: int) -> type:
    """uvicorn's h11 protocol with the header/body deadlines and the over-cap close."""

    class GuardedH11Protocol(H11Protocol):
        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._deadline = None
            self._phase = None
            if len(self.connections) > cap:
                # uvicorn's limit_concurrency answers its request 503; one that sends nothing goes soon
                _log.warning("a connection over the connection cap (%d) was refused", cap)
                self._arm("over cap", limits.over_cap_grace_s)
            else:
                self._follow()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self._phase != "over cap":
                self._follow()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if self._phase != "over cap":
                self._follow()

        def connection_lost(self, exc) -> None:
            self._cancel()
            super().connection_lost(exc)

        def _follow(self) -> None:
            """Arm the deadline of what the connection waits for: headers (idle) or a body."""
            state = self.conn.their_state
            phase = "headers" if state is h11.IDLE else "body" if state is h11.SEND_BODY else None
            if phase == self._phase:
                return
            self._cancel()
            if phase is not None:
                self._arm(phase, limits.header_timeout_s if phase == "headers" else limits.body_timeout_s)

        def _arm(self, phase: str, seconds: float) -> None:
            self._phase = phase
            self._deadline = self.loop.call_later(seconds, self._expire, phase)

        def _cancel(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
            self._deadline, self._phase = None, None

        def _expire(self, phase: str) -> None:
            self._deadline = None
            if self.transport.is_closing():
                return
            if phase != "over cap":
                # waiting for headers, no response is under way; waiting for a body, one may be (an
                # early 413): the 408 only where the connection has not started one
                cycle = self.cycle
                if phase == "headers" or cycle is None or not getattr(cycle, "response_started", True):
                    self.transport.write(RAW_408)
                _log.warning("a slow client was closed: its %s did not arrive within %.0f s", phase,
                             limits.header_timeout_s if phase == "headers" else limits.body_timeout_s)
            self.transport.close()

    return GuardedH11Protocol


def uvicorn_options(limits: ConnectionLimits | None = None) -> dict:
    """The uvicorn.Config keyword arguments that bound connections (the rate limit on their log lines
    installed)."""
    limits = limits or ConnectionLimits()
    cap = limits.effective_cap()
    install_log_limits()
    # uvicorn answers 503 when the open connections (this one included) or running requests reach
    # limit_concurrency: cap + 1 lets `cap` connections be served.
    return {"http": protocol_class(limits, cap), "limit_concurrency": cap + 1,
            "timeout_keep_alive": limits.keep_alive_s}
