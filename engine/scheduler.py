"""The engine thread's one scheduler: it alone owns the request queue and decides what runs next.

    scheduler.put(handle)            any thread: a request (engine/api.py) joins the queue
    scheduler.run(engine)            the engine thread: requests, batches of generate requests
                                     (engine/generation/batching.py), and idle tasks while nothing is queued
    scheduler.add_idle(task)         idle work (the disk tier's writes, the K/V top-up, the draft's release)
    scheduler.hold()                 any thread: the engine thread held between requests until released,
                                     so requests queued meanwhile start together (benches, tests)

Batching drives its rows through the same object (`take_nowait`, `serve`, `serving_as`): what it reads
from the queue and answers between two decode steps is decided by the scheduler's rules, not by a
second loop over the queue. An idle task runs only while the queue is empty and is told to stop the
moment a request arrives (`interrupted`); a task with a deadline (`due_in`) runs when the engine has
waited that long for a request.
"""
from __future__ import annotations

import contextlib
import queue
import threading
from typing import Callable, Iterator, Protocol

from engine.events import Handle


class Stop:
    """The request that ends the engine thread (Engine.stop)."""


HOLD_MAX_S = 600.0      # a hold nobody releases ends by itself: the engine is never stuck for good


class Hold:
    """The engine thread held still between two requests (`Scheduler.hold`) until `release()`."""

    def __init__(self):
        self.reached = threading.Event()        # the engine thread is held
        self._released = threading.Event()

    def release(self) -> None:
        self._released.set()

    def wait_released(self) -> None:
        self._released.wait(HOLD_MAX_S)


class IdleTask(Protocol):
    """Work done while no request waits. `run` returns when it is done or `interrupted()` turns true.
    A timed task (`add_idle(task, timed=True)`) runs once the engine has waited `due_in()` seconds for
    a request (None: nothing to do now); an untimed one whenever the queue is empty."""

    def run(self, interrupted: Callable[[], bool]) -> None: ...

    def due_in(self) -> float | None: ...


class Scheduler:
    def __init__(self, serve: Callable[[Handle], None]):
        self._serve_one = serve
        self._queue: queue.Queue = queue.Queue()
        self._current: Handle | None = None
        self._tasks: list[IdleTask] = []
        self._timed: list[IdleTask] = []
        # Set while the engine waits for a request with nothing else to do (benches wait for it before
        # timing a peer in the same process; tests before reading what the idle work wrote).
        self.idle = threading.Event()
        self.idle_allowed = True          # False from interpreter exit on: no new idle work starts
        self.in_idle_work = False         # an idle task is inside MLX (interpreter exit waits for it)
        self.batch_counters = None        # api.BatchCounters, made by the first batch
        self.batch_memo: dict = {}        # batching's per-model facts, keyed by what they were made for

    # ---- any thread ------------------------------------------------------------------------------
    def put(self, item) -> None:
        self.idle.clear()
        self._queue.put(item)

    def hold(self, timeout: float = 60.0) -> Hold:
        """Hold the engine thread once it is between requests (after what is queued before the hold);
        returns when it is held. Requests submitted before `release()` queue behind it and are read
        together: a batch's streams all joining at once."""
        hold = Hold()
        self.put(hold)
        if not hold.reached.wait(timeout):
            hold.release()
            raise TimeoutError(f"the engine thread was not free to hold within {timeout:g} s")
        return hold

    def pending(self) -> bool:
        return not self._queue.empty()

    def drain(self) -> list:
        """Everything still queued, taken out (the engine thread has ended: each is answered)."""
        items = []
        while (item := self.take_nowait()) is not None:
            items.append(item)
        return items

    # ---- the engine thread -----------------------------------------------------------------------
    def add_idle(self, task: IdleTask, timed: bool = False) -> None:
        (self._timed if timed else self._tasks).append(task)

    def take_nowait(self):
        """The next queued item, or None: for batching, which reads requests between two steps."""
        try:
            return self._queue.get_nowait()
        except queue.Empty:
            return None

    def serve(self, handle: Handle) -> None:
        """Run one request to its end now (its events and Done/Failed go to its handle)."""
        with self.serving_as(handle):
            self._serve_one(handle)

    @contextlib.contextmanager
    def serving_as(self, handle: Handle) -> Iterator[None]:
        """The engine's log lines and events go to `handle` meanwhile (a batched row's turn)."""
        before, self._current = self._current, handle
        try:
            yield
        finally:
            self._current = before

    def emit(self, event) -> None:
        """An event for the request being served (a log line, a KVMoved); none is served: dropped."""
        if self._current is not None:
            self._current.emit(event)

    def next_request(self):
        """The next queued request; while there is none, the idle tasks, then a wait that the timed
        tasks bound."""
        self._run_idle_tasks()
        self.idle.set()
        while True:
            armed = [(t, w) for t, w in ((t, t.due_in()) for t in self._timed) if w is not None]
            wait = min((w for _, w in armed), default=None)
            try:
                item = self._queue.get(timeout=wait)
                break
            except queue.Empty:
                self.idle.clear()
                self._run_tasks([t for t, w in armed if w <= wait])
                self.idle.set()
        self.idle.clear()
        return item

    def idle_work(self, timed: bool = False) -> None:
        """The idle tasks run now (an engine served on the caller's thread: Engine.inline); timed: the
        armed timed tasks too, as if the engine had waited their time for a request."""
        self._run_idle_tasks()
        if timed:
            self._run_tasks([t for t in self._timed if t.due_in() is not None])

    def _run_idle_tasks(self) -> None:
        for task in self._tasks:
            if not self.idle_allowed or self.pending():
                return
            self._run_tasks([task])

    def _run_tasks(self, tasks) -> None:
        interrupted = lambda: self.pending() or not self.idle_allowed  # noqa: E731
        for task in tasks:
            self.in_idle_work = True            # before idle_allowed is read: see engine/at_exit.py
            try:
                if self.idle_allowed:
                    task.run(interrupted)
            finally:
                self.in_idle_work = False

    def run(self, batched: Callable[[object], bool], run_batch: Callable[[object], object],
            next_item: Callable[[], object], on_stop: Callable[[], None]) -> None:
        """The engine thread's loop until a Stop: each request served in turn, generate requests that
        can share a decode step as one batch (`run_batch` returns the first request that had to wait for
        the batch to end, or None)."""
        while True:
            item = next_item()
            while item is not None and batched(item):
                item = run_batch(item)
            if item is None:
                continue
            if isinstance(item, Hold):
                item.reached.set()
                item.wait_released()
                continue
            if isinstance(item, Stop):
                on_stop()
                return
            self.serve(item)
