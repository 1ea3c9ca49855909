"""The time left of a prompt being read: on a CPU a long paste takes minutes ("82 / 1467 tokens" alone
does not say whether to wait), so the chat's progress bar adds an estimate from the rate measured
since the read's first progress report."""
from __future__ import annotations

import time
from typing import Callable

MIN_MEASURE_S = 2.0        # the rate is measured over at least this long before an estimate is shown


def time_left_text(seconds: float) -> str:
    """"about 6 min left", rounded so that it does not flicker from report to report."""
    if seconds < 10:
        return "a few seconds left"
    if seconds < 90:
        return f"about {max(10, round(seconds / 10) * 10)} s left"
    minutes = round(seconds / 60)
    if minutes < 60:
        return f"about {minutes} min left"
    hours, minutes = divmod(minutes, 60)
    return f"about {hours} h {minutes} min left" if minutes else f"about {hours} h left"


class PrefillEta:
    """Feed it each progress report of one read (`update`); `reset` for the next read. `clock`: seconds,
    monotonic (a test passes its own)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        self._start: tuple[float, int] | None = None     # (time, tokens read) of the first report

    def reset(self) -> None:
        self._start = None

    def update(self, done: int, total: int) -> str:
        """The estimate after `done` of `total` tokens, or "" while there is too little to go on."""
        now = self.clock()
        if self._start is None or done < self._start[1]:
            self._start = (now, done)
            return ""
        t0, d0 = self._start
        if now - t0 < MIN_MEASURE_S or done <= d0 or done >= total:
            return ""
        rate = (done - d0) / (now - t0)
        return time_left_text((total - done) / rate)
