"""The model list's scan: each model file's header read in a child process (no Qt, no mlx here).

A header read runs in one worker process for the whole scan (and kept for the next one), never on a
thread of the app: a file that reads too long, or one whose header would take memory without bound
(strings claiming gigabytes in a huge sparse file), gets its worker killed and a reason on its row,
and a new worker takes the files after it. Nothing is left running in the app after a timeout.

The worker's memory is bounded twice: RLIMIT_AS where the system enforces it (Linux: the read fails
with MemoryError inside the worker and the row says so), and a watch of the worker's resident memory
from the app (psutil, where installed: macOS does not enforce RLIMIT_AS)."""
from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from engine.model import memory_estimate as me
from engine.model import model_sources
from engine.errors import StrataError

from .child_limits import limit_address_space
from .gguf_meta import ModelMeta, read_meta

FILE_SECONDS = 5.0          # one file's header read (and estimate) past this is listed as not read
MEMORY_LIMIT = 2 << 30      # bytes a worker may take: a real header (a 256k vocabulary) needs a few MiB
START_SECONDS = 60.0        # a worker's start (a fresh Python, importing the header reader): generous
WATCH_SECONDS = 0.1         # how often the worker's memory is looked at while it reads
log = logging.getLogger("strata.app")

Row = tuple[ModelMeta, tuple[str, str]]
RowReader = Callable[[Path, object], Row]


def memory_needs(path: Path, budget) -> tuple[str, str]:
    """(column text, tooltip) of the memory estimate at the engine's default context
    (engine/model/memory_estimate.py: plain Python, no mlx) against `budget` (a memory_estimate.Budget)."""
    try:
        h = me.read_header(path)
        fit = me.check_fit(h, me.default_context(h), me.platform_dtype(), budget)
    except StrataError as e:
        return "?", str(e)
    except Exception as e:  # noqa: BLE001 -- one file's surprise stays on its row, with a log line
        log.warning("model list: %s: %s: %s", Path(path).name, type(e).__name__, e)
        return "?", f"{Path(path).name}: cannot estimate ({type(e).__name__})"
    text = me.gib(fit.estimate.total_bytes)
    return (text if fit.fits else f"{text} (too big)"), fit.line()


def read_row(p: Path, budget) -> Row:
    """One file's row: its metadata and its memory estimate (run in the worker)."""
    meta = read_meta(p)
    if meta.error:
        return meta, ("?", meta.error)
    if meta.architecture == "clip":    # an mmproj: read with the model it sits beside, never loaded alone
        why = f"{Path(p).name}: an image projector (mmproj), not a chat model: it is loaded with the model beside it"
        return dataclasses.replace(meta, error=why), ("?", why)
    needs = memory_needs(p, budget)
    if needs[0] == "?":            # the header reads but cannot be estimated (a negative K/V length...)
        meta = dataclasses.replace(meta, error=needs[1])
    return meta, needs


def find_models(folders: list[Path], libraries: list[model_sources.Root] | tuple = ()) -> model_sources.Scan:
    """The models of `folders` (the first is Strata's models folder, the others the user's: their
    `*.gguf` entries) and of `libraries` (engine/model/model_sources.py: LM Studio, the Hugging Face cache,
    Ollama), each file once, a split set once, projectors and drafters paired with their model. Nothing
    is opened: an entry of a folder that is not a regular file (a FIFO, a folder, a link to a device or
    in a loop) is listed too, and its row says why it cannot be loaded."""
    roots = model_sources.folder_roots(folders[0], folders[1:]) if folders else []
    scan = model_sources.find(roots + list(libraries))
    for note in scan.notes:
        log.warning("model list: %s", note)
    return scan


def with_source(row: Row, found: model_sources.FoundModel) -> Row:
    """`row` (read in the worker) with where its model lives and what was found beside it."""
    meta, needs = row
    companions = "; ".join(f"{what}: {p.name}" for what, p in (("vision projector", found.mmproj),
                                                                 ("MTP drafter", found.mtp)) if p is not None)
    # a blob's file name (Ollama's sha256-<hex>) says nothing: a model without general.name is called by
    # its library's name for it
    name = found.label if found.label and meta.name in (found.path.name, found.path.stem) else meta.name
    return dataclasses.replace(meta, name=name, source=found.source, label=found.label, companions=companions,
                               real=os.path.realpath(found.path)), needs


def _failed_row(p: Path, why: str) -> Row:
    return ModelMeta(str(p), p.name, error=f"{p.name}: {why}"), ("?", "")


# ---- the worker process -------------------------------------------------------------------------
def _limit_memory(limit: int) -> None:
    why = limit_address_space(limit)
    if why:
        log.warning("model list: no memory limit for the header reader: %s", why)


def _serve(conn, reader: RowReader, limit: int) -> None:
    """The worker's loop: a path (and the memory budget) in, its row (or the reason it failed) out,
    until the app closes the pipe."""
    _limit_memory(limit)
    conn.send("ready")
    while True:
        try:
            p, budget = conn.recv()
        except (EOFError, OSError):
            return
        try:
            row = reader(Path(p), budget)
        except MemoryError:
            row = _failed_row(Path(p), f"not read: its header needs more than {limit >> 20} MiB")
        except Exception as e:  # noqa: BLE001 -- the row says it, the scan goes on
            row = _failed_row(Path(p), f"cannot read ({type(e).__name__}: {str(e)[:200]})")
        conn.send(row)


@dataclass
class _Worker:
    process: multiprocessing.process.BaseProcess
    conn: object                     # the app's end of the pipe
    reader: RowReader
    limit: int
    rss: Callable[[], int] | None = None   # the worker's resident bytes (psutil), None without psutil
    base_rss: int = 0                        # ... when it was ready: the bound is `limit` over it

    @classmethod
    def start(cls, reader: RowReader, limit: int) -> "_Worker":
        # spawn, never fork: the app has threads (Qt's, the engine's), and macOS spawns anyway
        ctx = multiprocessing.get_context("spawn")
        ours, theirs = ctx.Pipe()
        proc = ctx.Process(target=_serve, args=(theirs, reader, limit), name="strata-model-read",
                           daemon=True)
        proc.start()
        theirs.close()
        w = cls(proc, ours, reader, limit)
        if not ours.poll(START_SECONDS) or ours.recv() != "ready":
            w.kill()
            raise OSError(f"the header reader did not start within {START_SECONDS:g} s")
        w.rss = _rss_reader(proc.pid)
        w.base_rss = w.rss() if w.rss is not None else 0
        return w

    def fits(self, reader: RowReader, limit: int) -> bool:
        return self.process.is_alive() and (self.reader, self.limit) == (reader, limit)

    def kill(self) -> None:
        self.process.kill()
        self.process.join(5)
        self.conn.close()

    def read(self, p: Path, budget, seconds: float) -> Row:
        """`p`'s row; a read past `seconds`, past the memory bound or that ends the worker kills it
        (the row says why: the caller starts another for the next file)."""
        self.conn.send((str(p), budget))
        deadline = time.monotonic() + seconds
        while True:
            try:
                if self.conn.poll(min(WATCH_SECONDS, max(0.0, deadline - time.monotonic()))):
                    return self.conn.recv()
            except (EOFError, OSError):
                self.kill()
                return _failed_row(p, f"not read: the header reader stopped (exit code {self.process.exitcode})")
            if self.rss is not None and (used := self.rss() - self.base_rss) > self.limit:
                self.kill()
                return _failed_row(p, f"not read: its header needs more memory than the reader may use "
                                      f"(over {self.limit >> 20} MiB: {used >> 20} MiB)")
            if time.monotonic() >= deadline:
                self.kill()
                return _failed_row(p, f"not read: it takes longer than {seconds:g} s")


def _rss_reader(pid: int) -> Callable[[], int] | None:
    """The worker's resident bytes, read on demand (psutil, a dependency of the app), or None when it
    cannot be read."""
    try:
        import psutil    # lazy: the worker never needs it; without it RLIMIT_AS (Linux) is the only bound
        proc = psutil.Process(pid)
    except Exception:  # noqa: BLE001 -- not installed, or the worker already gone
        return None

    def rss() -> int:
        try:
            return proc.memory_info().rss
        except Exception:  # noqa: BLE001 -- gone meanwhile: the pipe says so next
            return 0
    return rss


_lock = threading.Lock()      # one scan at a time uses the worker
_worker: _Worker | None = None


def scan_models(folders: list[Path], budget, file_seconds: float = FILE_SECONDS, reader: RowReader = read_row,
                memory_limit: int = MEMORY_LIMIT, libraries: list[model_sources.Root] | tuple = ()) -> list[Row]:
    """A row (metadata, (needs, tooltip)) per model (find_models), each read by the worker process within
    `file_seconds` and `memory_limit`: a file past either is listed as not read, its worker killed, and
    the scan goes on with a new one. `reader` is a module-level function (it is sent to the worker)."""
    found = find_models(folders, libraries).models
    rows: list[Row] = []
    with _lock:
        no_worker = ""                 # why no worker could start: said on every row, not tried again
        for f in found:
            p = f.path
            worker = no_worker or _ready_worker(reader, memory_limit)
            if isinstance(worker, str):
                no_worker, row = worker, _failed_row(p, worker)
            else:
                row = worker.read(p, budget, file_seconds)
            if row[0].error:
                log.warning("model list: %s", row[0].error)
            rows.append(with_source(row, f))
    return rows


def _ready_worker(reader: RowReader, limit: int) -> "_Worker | str":
    """The running worker, or a new one; a reason (str) when none can start (each row then says it)."""
    global _worker
    if _worker is not None and _worker.fits(reader, limit):
        return _worker
    if _worker is not None:
        _worker.kill()
    _worker = None
    try:
        _worker = _Worker.start(reader, limit)
    except (OSError, ValueError, EOFError, RuntimeError) as e:
        log.warning("model list: the header reader did not start: %s: %s", type(e).__name__, e)
        return f"not read: the header reader could not start ({type(e).__name__})"
    return _worker
