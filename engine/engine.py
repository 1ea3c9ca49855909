"""The Engine: one thread owns the model, the tokenizer and every MLX object; callers submit requests.

    engine = Engine(EngineOptions(model="SmolLM2-135M-Instruct.Q4_1.gguf")).start()
    engine.startup.result()                 # the start-up load: ModelLoaded, or EngineError with its message
    h = engine.submit(GenerateRequest(messages=[{"role": "user", "content": "Hi"}]))
    for event in h.events(): ...            # Token, Progress, Log, then Done(result) or Failed(message, code)

The requests, results and errors are engine/api.py (re-exported here). This class owns the thread
and the dispatch; what each request does is engine/handlers.py, the held conversations
engine/cache/conversations.py, the decode loop engine/generation/generate.py.
The Qt app runs `engine.run_forever()` inside its QThread instead of `start()`.
"""
from __future__ import annotations

import gc
import logging
import threading
import weakref
from typing import Any, Callable

# mlx-lm makes MLX streams (its generation stream) when first imported. Imported here, with the engine
# module, they belong to the importing thread as they always did; first imported lazily on the engine
# thread instead, a CLI that exits right after a refused load aborts in MLX's thread teardown
# ("terminate called without an active exception"). engine/sampling.py stays MLX-free for the app.
import mlx_lm.generate  # noqa: F401,E402

from engine.api import (CaptureStates, Configure, CountTokens, EngineOptions,  # noqa: F401 - re-exported
                        GenerateRequest, LoadModel, ModelFacts, RestoreSession, SaveSession, SessionSteering, Status,
                        ClearDiskCache, ForgetConversation)
from engine import at_exit
from engine.disk import disk_tier
from engine.generation import batching
from engine.memory.allocator import keep_freed_memory, release_freed_memory
from engine.cache.conversations import Conversations
from engine.drafts import Drafts
from engine.errors import Cancelled, EngineError, ErrorCode, ModelNotLoaded, RequestError, StrataError
from engine.events import ENGINE_STOPPED, Done, Failed, Handle, Log
from engine.handlers import RequestHandlers
from engine.prompts import Prompts
from engine.turns import Turns
from engine.cache.kv_reserve import IdleTopUp
from engine.loaded_model import InForce
from engine.loaded_model import LoadedModel
from engine.limits import within_range
from engine.memory.memory_guard import MemoryGuard
from engine.model_load import ModelLoad
from engine.cache.parking import Parking
from engine.scheduler import Scheduler, Stop
from engine.serving import Serving, for_this_process
from engine.session_files.session_requests import SessionRequests

log = logging.getLogger("strata")


def _loaded(name: str, default=None) -> property:
    """A read-only view of one field of the engine's LoadedModel (`default` while none is loaded)."""
    return property(lambda self: default if self.loaded is None else getattr(self.loaded, name),
                    doc=f"LoadedModel.{name} of what is loaded ({default!r} when nothing is)")


class Engine:
    def __init__(self, options: EngineOptions | None = None):
        self.options = options or EngineOptions()
        # The settings in force, started from the options and changed by Configure and loads.
        self.in_force = InForce.of(self.options)
        self._thread: threading.Thread | None = None
        self.is_inline = False                    # served on the caller's thread (inline())
        self.stopped = threading.Event()
        # What runs next on the engine thread, and the only owner of the request queue.
        self.scheduler = Scheduler(self._serve)
        at_exit.watch(self)
        # Why the engine thread ended on an error (None while it runs): every request waiting or
        # submitted later fails at once with it, and the server's /health reports it.
        self.failure: str | None = None
        self._waiting: "weakref.WeakSet[Handle]" = weakref.WeakSet()   # submitted, not yet answered
        self._fail_lock = threading.Lock()
        self.guard = MemoryGuard()
        self.conversations = None                 # conversations.Conversations, made on the engine thread
        self.disk = None                          # disk_tier.DiskTier under parking, made on the engine thread
        # What is loaded: one LoadedModel value (engine/loaded_model.py) replaced whole at each load;
        # model, tokenizer, info, n_ctx, dtype, ... below read it.
        self.loaded: LoadedModel | None = None
        self.drafts = Drafts(self)                # speculation's state: a named draft, the MTP head, verdicts
        # On the CPU, the K/V memory touched again in idle time (kv_reserve.py); each load sets its TopUp.
        self.kv_topup = IdleTopUp(lambda: self.conversations.held_bytes(), self.log)
        # The start-up load (options.model): its handle is the starter's, whose result() is the load's.
        self.startup: Handle | None = Handle(LoadModel(self.options.model, self.options.steering,
                                                       self.options.draft, self.options.mmproj,
                                                       self.options.image_max_tokens)) \
            if self.options.model else None
        # How requests are served (engine/serving.py): this process alone, or every rank of a distributed
        # group in lockstep (engine/ranks/distributed.py); asked, never told apart.
        self.serving: Serving = for_this_process()
        self.handlers = RequestHandlers(self)     # what each request does (engine/handlers.py)
        self.prompts = Prompts(self)              # a request's prompt as token ids (engine/prompts.py)
        self.turns = Turns(self, self.handlers)   # a generation's begin/end, lone or batched (engine/turns.py)
        self.loads = ModelLoad(self)              # LoadModel (engine/model_load.py)
        self.sessions = SessionRequests(self, self.handlers)  # SaveSession, RestoreSession, SessionSteering

    # ---- caller side (any thread) ------------------------------------------------------------
    def start(self) -> "Engine":
        self._thread = threading.Thread(target=self.run_forever, name="strata-engine", daemon=True)
        self._thread.start()
        return self

    def has_own_thread(self) -> bool:
        """Serving on a thread of its own (start()) that has not stopped."""
        return self._thread is not None and self._thread.is_alive() and not self.stopped.is_set()

    def inline(self) -> "Engine":
        """Serve on the caller's thread instead of one of the engine's own: each request is served as it is
        submitted (the start-up load now), so that thread is the engine thread, the only one touching the
        engine's objects. For white-box tests and benches that read `conversations`, `model`, ... between
        requests or time raw mlx-lm beside the engine on the same thread; idle work runs on `idle_work()`."""
        self.is_inline = True
        self._open()
        return self

    def idle_work(self, timed: bool = False) -> None:
        """The idle tasks (the disk tier's writes, the K/V top-up) run now, on an inline engine; timed: the
        timed ones too (a named draft's release) as if their time had passed."""
        self.scheduler.idle_work(timed)

    def submit(self, request: Any, callback: Callable | None = None) -> Handle:
        handle = Handle(request, callback)
        if self.is_inline:
            self.scheduler.serve(handle)
            return handle
        if self.serving.broken:                   # a distributed ring is gone: answered now
            handle.emit(Failed(self.serving.broken, ErrorCode.UNAVAILABLE, "distributed"))
            return handle
        if self.failure is not None:              # the engine thread is gone: answered now
            handle.emit(Failed(self.failure, ErrorCode.UNAVAILABLE, ENGINE_STOPPED))
            return handle
        self._waiting.add(handle)
        self.scheduler.put(handle)
        if self.failure is not None:              # it died between the check and the put
            self._fail_waiting()
        return handle

    def call(self, request: Any, timeout: float | None = None):
        """Submit and wait: the request's result (engine/api.py), or EngineError."""
        return self.submit(request).result(timeout)

    def model_facts(self) -> ModelFacts | None:
        """What is loaded as of the last load (an immutable value the engine thread replaces whole):
        for a front end's per-request checks that must not queue behind a generation (the server's
        model id). Anything else goes through Status."""
        return self.facts

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Wait until the engine waits for a request with its idle-time work done (True), or for
        `timeout` (False). For a caller that has the results it waited for: a request submitted from
        another thread meanwhile may still be queued. The disk tier's writes that idle work queued are
        on disk when it returns True."""
        if not self.scheduler.idle.wait(timeout):
            return False
        if self.disk is not None:
            self.disk.flush()
        return True

    def stop(self, timeout: float = 10.0) -> None:
        if self.is_inline:
            return self._on_stop() if not self.stopped.is_set() else None
        self.scheduler.put(Stop())
        self.stopped.wait(timeout)

    # ---- engine thread -----------------------------------------------------------------------
    def run_forever(self) -> None:
        """Serve requests until stopped. Should the thread end on an error instead (a bug, a folder
        that cannot be used, anything), the start-up load and every request waiting or submitted later
        fail at once with its one line (`failure`), rather than wait for a thread that is gone."""
        try:
            self._run()
        except BaseException as e:
            self.failure = f"the engine stopped: {type(e).__name__}: {' '.join(str(e).split())[:300]}"
            log.error("engine: %s", self.failure, exc_info=not isinstance(e, (KeyboardInterrupt, SystemExit)))
            self._fail_waiting()
            self.stopped.set()
            self.scheduler.idle.set()

    def _fail_waiting(self) -> None:
        """Every handle submitted and not answered (the start-up load's too) fails with `failure`."""
        with self._fail_lock:           # a submit on another thread may call it too: one Failed each
            handles = list(self._waiting) + [h for h in self.scheduler.drain() if isinstance(h, Handle)]
            if self.startup is not None:
                handles.append(self.startup)
            for h in handles:
                if not h.finished.is_set():
                    h.emit(Failed(self.failure or "the engine stopped", ErrorCode.UNAVAILABLE, ENGINE_STOPPED))

    def _run(self) -> None:
        self._open()
        # A distributed follower rank serves rank 0's requests instead of its own queue.
        self.scheduler.run(
            batched=lambda item: batching.enabled(self) and batching.batchable(self, item),
            run_batch=lambda item: batching.run(self, item),
            next_item=self.scheduler.next_request if self.serving.leads else self._follow,
            on_stop=self._on_stop)

    def _open(self) -> None:
        """What the engine thread makes before serving (the parking, the disk tier, the idle tasks), then
        the start-up load."""
        self.log(keep_freed_memory())
        self.log(self.guard.startup_line())
        # The CLI and the settings page check first; a value from elsewhere (a settings file written on a
        # bigger machine) is brought into range with a log line rather than refused at start.
        cap, slots, note = within_range(self.options.cache_mib, self.options.cache_slots, self.handlers.cache_limits())
        if note:
            self.log(f"conversation cache: {note}")
        self.conversations = Conversations(Parking(cap, slots, self.guard, self.log), self.log)
        self.conversations.parking.on_event = self.scheduler.emit
        self.disk = disk_tier.attach(self)
        # Idle work, in this order: the disk tier's writes, then the K/V top-up; the named draft's
        # release once no request came for DRAFT_IDLE_S.
        self.scheduler.add_idle(disk_tier.IdleWrites(self))
        self.scheduler.add_idle(self.kv_topup)
        self.scheduler.add_idle(self.drafts.idle_release, timed=True)
        self.sessions.clean_folder()
        if self.startup is not None:
            self.startup.local = True   # distributed: every rank loads its own --model, not rank 0's path
            self.scheduler.serve(self.startup)

    def _on_stop(self) -> None:
        self.serving.stop()
        disk_tier.stop(self)                # what the held conversations lack on disk, written
        release_freed_memory()
        self.stopped.set()
        if threading.current_thread() is self._thread:
            # mlx 0.32.4 aborts the process at exit ("terminate called without an active
            # exception") once a thread that ran compiled functions or random sampling has
            # ended; a daemon engine thread that never ends avoids it. Callers running
            # run_forever() on their own thread (the Qt app) handle exit themselves.
            threading.Event().wait()

    def _serve(self, handle: Handle) -> None:
        """One request to its end (the scheduler's `serve`, which routes the engine's events to it)."""
        failed = None
        try:
            if handle.cancelled and isinstance(handle.request, (GenerateRequest, SaveSession)):
                raise Cancelled("cancelled")  # cancelled while it waited: it must not park, take or read K/V
            # The serving strategy (engine/serving.py) calls back only public members (dispatch, log, ...).
            result = self.serving.dispatch(self, handle)
            handle.emit(Done(result))
        except StrataError as e:
            self.log(f"error: {e}")
            err = EngineError.of(e)
            failed = Failed(err.message, err.code, err.reason, err.vector)
        except Exception as e:  # a bug must not kill the engine thread: report it, keep serving
            log.exception("engine: unexpected error")
            # The live K/V may be half-updated by what failed: the next request recomputes instead.
            if isinstance(handle.request, (GenerateRequest, RestoreSession)) and self.conversations is not None:
                self.conversations.drop_suspect(self.info.n_vocab if self.info else 0)
            err = EngineError.of(e)
            failed = Failed(err.message, err.code)
        if failed is not None:
            # The failed work's MLX arrays (a refused load's weights, held by the exception's frames)
            # are freed here, on this thread, before the caller hears of it: a CLI exits right after a
            # refusal, and MLX arrays freed under the interpreter's exit abort the process ("terminate
            # called without an active exception", exit 134 instead of 2).
            if isinstance(handle.request, (LoadModel, RestoreSession)):   # rare, and they hold the most
                gc.collect()
            handle.emit(failed)

    def _follow(self):
        """A follower rank's next request: rank 0's, as a handle nobody waits on (or _Stop)."""
        try:
            req = self.serving.next_request()
        except RuntimeError as e:       # rank 0 is gone: nothing left to follow
            self.log(f"distributed: lost rank 0 ({e}); stopping")
            return Stop()
        return Stop() if req is None else Handle(req)

    def log(self, line: str) -> None:
        """A line for the engine log and, as a Log event, for the request being served (engine thread)."""
        log.info(line)
        self.scheduler.emit(Log(line))

    def require_model(self) -> None:
        """ModelNotLoaded unless a model is loaded (engine thread)."""
        if self.model is None:
            raise ModelNotLoaded()

    def dispatch(self, handle: Handle):
        """Run one request's handler now, on the engine thread (the distributed strategy calls it on every
        rank around its collectives); callers on other threads submit() instead."""
        req, h = handle.request, self.handlers
        handlers = {
            GenerateRequest: lambda: h.generate(req, handle),
            LoadModel: lambda: self.loads.load(req, handle),
            SaveSession: lambda: self.sessions.save(req, handle),
            RestoreSession: lambda: self.sessions.restore(req, handle),
            Configure: lambda: h.configure(req),
            Status: h.status,
            CountTokens: lambda: h.count_tokens(req),
            SessionSteering: lambda: self.sessions.steering(req),
            CaptureStates: lambda: h.capture(req, handle),
            ClearDiskCache: lambda: disk_tier.clear_request(self),
            ForgetConversation: lambda: disk_tier.forget_request(self, req),
        }
        serve = handlers.get(type(req))
        if serve is None:
            raise RequestError(f"unknown request {type(req).__name__}")
        return serve()

    # ---- what is loaded (engine/loaded_model.py: read-only views of the one value) ----------
    model = _loaded("model")
    tokenizer = _loaded("tokenizer")
    info = _loaded("info")
    model_path = _loaded("path")
    template = _loaded("template")
    model_hash = _loaded("model_hash", "")
    n_ctx = _loaded("n_ctx", 0)
    dtype = _loaded("dtype")
    steering = _loaded("steering")
    steering_error = _loaded("steering_error")
    facts = _loaded("facts")          # what is loaded, one immutable value (Engine.model_facts)
    kv_fmt = _loaded("kv_format")     # the K/V format of new conversations (the load's, swapped by Configure)
