"""An extraction in a child process, never on a thread of the app: a PDF that loops, or takes memory
without bound, is killed past EXTRACT_SECONDS or MEMORY_LIMIT and its file refused with one line;
Cancel kills it at once, wherever pypdf is. Progress (pages read of pages) comes back through the pipe.

Memory is bounded twice, as the model list's header reader is (app/model_scan.py): RLIMIT_AS in the
child where the system enforces it (Linux), and the child's resident memory watched from here (psutil)."""
from __future__ import annotations

import multiprocessing
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import psutil

from ..child_limits import limit_address_space
from .extract import DocumentError, Extracted, extract

EXTRACT_SECONDS = 180.0     # one file, start of the child included: a 1000-page PDF reads in ~10-20 s
MEMORY_LIMIT = 1 << 30      # bytes over the child's start: a 64 MiB PDF's objects and text fit well inside
WATCH_SECONDS = 0.05        # how often the child is looked at (cancel, memory, time)


@dataclass(frozen=True)
class Outcome:
    doc: Extracted | None = None
    error: str = ""            # one line when the file was not read ("" with a document, or cancelled)
    cancelled: bool = False


def _child(conn, path: str, limit: int) -> None:
    try:
        _read(conn, path, limit)
    except (BrokenPipeError, EOFError, OSError):
        pass                 # the app stopped listening (cancelled, closed): nothing to tell


def _read(conn, path: str, limit: int) -> None:
    limit_address_space(limit)      # else the watch from the app still bounds it
    try:
        doc = extract(path, progress=lambda done, total: conn.send(("progress", done, total)))
        conn.send(("done", doc))
    except DocumentError as e:
        conn.send(("error", str(e)))
    except MemoryError:
        conn.send(("error", f"{Path(path).name} needs more memory than a document may take "
                            f"({limit >> 20} MiB); not read"))
    except Exception as e:  # noqa: BLE001 -- anything else pypdf raises: one line, the app goes on
        conn.send(("error", f"{Path(path).name} cannot be read ({type(e).__name__})"))


def _rss(pid: int) -> Callable[[], int]:
    try:
        proc = psutil.Process(pid)
    except psutil.Error:
        return lambda: 0

    def rss() -> int:
        try:
            return proc.memory_info().rss
        except psutil.Error:
            return 0
    return rss


def extract_bounded(path: str | Path, progress: Callable[[int, int], None] | None = None,
                    cancelled: Callable[[], bool] = lambda: False, seconds: float = EXTRACT_SECONDS,
                    memory: int = MEMORY_LIMIT) -> Outcome:
    """`path` read by a child process within `seconds` and `memory`; `cancelled()` is asked every
    WATCH_SECONDS and kills the child when true."""
    name = Path(path).name
    ctx = multiprocessing.get_context("spawn")    # never fork: the app has threads (Qt's, the engine's)
    ours, theirs = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child, args=(theirs, str(path), memory), name="strata-document-read", daemon=True)
    proc.start()
    theirs.close()
    rss, base, deadline = _rss(proc.pid), 0, time.monotonic() + seconds
    try:
        while True:
            if cancelled():
                return Outcome(cancelled=True)
            try:
                msg = ours.recv() if ours.poll(WATCH_SECONDS) else None
            except (EOFError, OSError):
                return Outcome(error=f"{name} could not be read: the reader stopped (exit code {proc.exitcode})")
            if msg is not None and msg[0] != "progress":
                return Outcome(doc=msg[1]) if msg[0] == "done" else Outcome(error=msg[1])
            if msg is not None and progress is not None:
                progress(msg[1], msg[2])
            # the bounds are checked after every message too: a reader that keeps reporting pages is
            # still stopped at its time and memory bounds
            base = base or rss()           # its size once started: the bound is `memory` over it
            if base and rss() - base > memory:
                return Outcome(error=f"{name} needs more memory than a document may take ({memory >> 20} MiB); not read")
            if time.monotonic() > deadline:
                return Outcome(error=f"{name} takes longer than {seconds:g} s to read; not read")
    finally:
        if proc.is_alive():
            proc.kill()
        proc.join(5)
        ours.close()
