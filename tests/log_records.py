"""A logging handler that keeps every record, for tests that assert what the server logged (no traceback,
no error line, a flood's line only once) rather than how fast it did."""
from __future__ import annotations

import logging


class LogRecords(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record):
        self.records.append(record)

    def texts(self, start: int = 0) -> list[str]:
        return [r.getMessage() + (f" {r.exc_info[1]!r}" if r.exc_info else "") for r in self.records[start:]]

    def tracebacks(self, start: int = 0) -> list[str]:
        """Records from `start` on with a traceback, one written into the text, or at error level."""
        return [f"{r.name}: {text[:300]}" for r, text in zip(self.records[start:], self.texts(start))
                if r.exc_info or "Traceback" in text or r.levelno >= logging.ERROR]
