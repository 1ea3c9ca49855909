"""The Engine: one thread owns the model, the tokenizer and every MLX object; callers submit requests.

    engine = Engine(EngineOptions(model="SmolLM2-135M-Instruct.Q4_1.gguf")).start()
    engine.startup.result()                 # the start-up load: ModelLoaded, or EngineError with its message
    h = engine.submit(GenerateRequest(messages=[{"role": "user", "content": "Hi"}]))
    for event in h.events(): ...            # Token, Progress, Log, then Done(result) or Failed(message, code)

The requests, results and errors are engine/api.py (re-exported here). This class owns the thread
and the dispatch; what each request does is engine/handlers.py, the held conversations
engine/conversations.py, the decode loop engine/generate.py.
The Qt app runs `engine.run_forever()` inside its QThread instead of `start()`.
"""
from __future__ import annotations

import atexit
import logging
import queue
import threading
import weakref
from typing import Any, Callable

# mlx-lm makes MLX streams (its generation stream) when first imported. Imported here, with the engine
# module, they belong to the importing thread as they always did; first imported lazily on the engine
# thread instead, a CLI that exits right after a refused load aborts in MLX's thread teardown
# ("terminate called without an active exception"). engine/sampling.py stays MLX-free for the app.
import mlx_lm.generate  # noqa: F401,E402

from .api import (Call, CallResult, CaptureStates, Configure, CountTokens, EngineOptions,  # noqa: F401 - re-exported
                  GenerateRequest, LoadModel, ModelFacts, RestoreSession, SaveSession, SessionSteering, Status,
                  ClearDiskCache, ForgetConversation)
from .errors import Cancelled, EngineError, ErrorCode, ModelNotLoaded, RequestError, StrataError
from .events import ENGINE_STOPPED, Done, Failed, Handle, Log
from .handlers import RequestHandlers
from .loaded_model import LoadedModel
from .serving import Serving, for_this_process

log = logging.getLogger("strata")
DRAFT_IDLE_S = 30.0     # a draft model no request used for this long is released (engine/handlers.py)


class _Stop:
    pass


_ENGINES: "weakref.WeakSet[Engine]" = weakref.WeakSet()


EXIT_WAIT_S = 10.0      # at interpreter exit, how long the engine threads get to stop their work


@atexit.register
def _quiet_at_exit() -> None:
    """At interpreter exit no engine thread may be inside MLX. A daemon thread that comes back from MLX
    (which runs with the GIL released) while the interpreter finalizes is ended by pthread_exit, and
    that unwinding through MLX's C++ frames aborts the process ("terminate called without an active
    exception", exit 134 instead of the caller's: Ctrl-C on `strata generate` mid-reply did it every
    time, as did a script exiting during the idle-time K/V top-up). So the idle-time work stops, every
    request still running or queued is cancelled (a reply stops between tokens, a CPU prefill between
    layers) and each engine thread is given up to EXIT_WAIT_S to be back waiting for a request."""
    import time
    from .events import cancel_everything
    cancel_everything()
    engines = list(_ENGINES)
    for engine in engines:
        engine._idle_work = False
    deadline = time.monotonic() + EXIT_WAIT_S
    for engine in engines:
        t = engine._thread      # None for run_forever() on the caller's thread (the Qt app stops its own)
        if t is not None and t.is_alive() and not engine.stopped.is_set():
            engine.idle.wait(max(0.0, deadline - time.monotonic()))


def _loaded(name: str, default=None) -> property:
    """A read-only view of one field of the engine's LoadedModel (`default` while none is loaded)."""
    return property(lambda self: default if self.loaded is None else getattr(self.loaded, name),
                    doc=f"LoadedModel.{name} of what is loaded ({default!r} when nothing is)")


class Engine:
    def __init__(self, options: EngineOptions | None = None):
        from .memory_guard import MemoryGuard
        self.options = options or EngineOptions()
        self._queue: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None
        self.stopped = threading.Event()
        # Set while the engine waits for a request with nothing else to do (no idle-time K/V top-up
        # running): benches wait for it before timing a peer in the same process.
        self.idle = threading.Event()
        self.kv_topup = None                      # kv_reserve.TopUp on the CPU, set at each model load
        self._idle_work = True                    # False from interpreter exit on (_quiet_at_exit)
        self._topping_up = False
        _ENGINES.add(self)
        self._handle: Handle | None = None        # the request being served (for its log lines)
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
        # The engine's state the handlers (engine/handlers.py, which hold none of their own) keep up to date:
        self._pace = None                         # (model, generate.PrefillPace) measured for the loaded model
        self._verdicts = None                     # speculative.Verdicts: what each draft pair measured
        self.draft = None                         # speculative.DraftModel a request named (not the load's)
        # The start-up load (options.model): its handle is the starter's, whose result() is the load's.
        self.startup: Handle | None = Handle(LoadModel(self.options.model, self.options.steering,
                                                       self.options.draft)) if self.options.model else None
        # How requests are served (engine/serving.py): this process alone, or every rank of a distributed
        # group in lockstep (engine/distributed.py); asked, never told apart.
        self.serving: Serving = for_this_process()
        self.handlers = RequestHandlers(self)     # what each request does (engine/handlers.py): no state

    # ---- caller side (any thread) ------------------------------------------------------------
    def start(self) -> "Engine":
        self._thread = threading.Thread(target=self.run_forever, name="strata-engine", daemon=True)
        self._thread.start()
        return self

    def submit(self, request: Any, callback: Callable | None = None) -> Handle:
        handle = Handle(request, callback)
        if self.serving.broken:                   # a distributed ring is gone: answered now
            handle.emit(Failed(self.serving.broken, ErrorCode.UNAVAILABLE, "distributed"))
            return handle
        if self.failure is not None:              # the engine thread is gone: answered now
            handle.emit(Failed(self.failure, ErrorCode.UNAVAILABLE, ENGINE_STOPPED))
            return handle
        self.idle.clear()
        self._waiting.add(handle)
        self._queue.put(handle)
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
        another thread meanwhile may still be queued."""
        return self.idle.wait(timeout)

    def stop(self, timeout: float = 10.0) -> None:
        self._queue.put(_Stop())
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
            self.idle.set()

    def _fail_waiting(self) -> None:
        """Every handle submitted and not answered (the start-up load's too) fails with `failure`."""
        with self._fail_lock:           # a submit on another thread may call it too: one Failed each
            self._fail_pending()

    def _fail_pending(self) -> None:
        handles = list(self._waiting)
        if self.startup is not None:
            handles.append(self.startup)
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if isinstance(item, Handle):
                handles.append(item)
        for h in handles:
            if not h.finished.is_set():
                h.emit(Failed(self.failure or "the engine stopped", ErrorCode.UNAVAILABLE, ENGINE_STOPPED))

    def _run(self) -> None:
        from .allocator import keep_freed_memory, release_freed_memory
        from .conversations import Conversations
        from .limits import within_range
        from .parking import Parking
        self._log(keep_freed_memory())
        self._log(self.guard.startup_line())
        # The CLI and the settings page check first; a value from elsewhere (a settings file written on a
        # bigger machine) is brought into range with a log line rather than refused at start.
        cap, slots, note = within_range(self.options.cache_mib, self.options.cache_slots, self.handlers._cache_range())
        if note:
            self._log(f"conversation cache: {note}")
        self.options.cache_mib, self.options.cache_slots = cap, slots
        self.conversations = Conversations(Parking(cap, slots, self.guard, self._log), self._log)
        self.conversations.parking.on_event = self._emit
        from . import disk_tier
        self.disk = disk_tier.attach(self)
        self.handlers._clean_session_folder()
        if self.startup is not None:
            self.startup.local = True   # distributed: every rank loads its own --model, not rank 0's path
            self._serve(self.startup)
        while True:
            # A distributed follower rank serves rank 0's requests instead of its own queue.
            item = self._next_request() if self.serving.leads else self._follow()
            # issue 34: generate requests run as rows of one batch (engine/batching.py) while any is
            # live; it hands back the first request that had to wait for the batch to end (or None).
            from . import batching
            while item is not None and batching.enabled(self) and batching.batchable(self, item):
                item = batching.run(self, item)
            if item is None:
                continue
            if isinstance(item, _Stop):
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
                return
            self._serve(item)

    def _serve(self, handle: Handle) -> None:
        self._handle = handle
        failed = None
        try:
            if handle.cancelled and isinstance(handle.request, (GenerateRequest, SaveSession)):
                raise Cancelled("cancelled")  # cancelled while it waited: it must not park, take or read K/V
            # The serving strategy (engine/serving.py) calls back only public members (dispatch, log, ...).
            result = self.serving.dispatch(self, handle)
            handle.emit(Done(result))
        except StrataError as e:
            self._log(f"error: {e}")
            err = EngineError.of(e)
            failed = Failed(err.message, err.code, err.reason, err.vector)
        except Exception as e:  # a bug must not kill the engine thread: report it, keep serving
            log.exception("engine: unexpected error")
            # The live K/V may be half-updated by what failed: the next request recomputes instead.
            if isinstance(handle.request, (GenerateRequest, RestoreSession)) and self.conversations is not None:
                self.conversations.drop_suspect(self.info.n_vocab if self.info else 0)
            err = EngineError.of(e)
            failed = Failed(err.message, err.code)
        finally:
            self._handle = None
        if failed is not None:
            # The failed work's MLX arrays (a refused load's weights, held by the exception's frames)
            # are freed here, on this thread, before the caller hears of it: a CLI exits right after a
            # refusal, and MLX arrays freed under the interpreter's exit abort the process ("terminate
            # called without an active exception", exit 134 instead of 2).
            if isinstance(handle.request, (LoadModel, RestoreSession)):   # rare, and they hold the most
                import gc
                gc.collect()
            handle.emit(failed)

    def _next_request(self):
        """The next queued request; while there is none, the disk tier's writes (disk_tier.idle) and
        the K/V top-up's steps (kv_reserve.TopUp)."""
        if self.disk is not None and self._idle_work and self._queue.empty():
            from .disk_tier import idle
            idle(self)
        topup = self.kv_topup
        self._topping_up = True
        try:
            if topup is not None and self._idle_work and self._queue.empty() \
                    and topup.wanted(self.conversations.held_bytes()):
                while self._queue.empty() and self._idle_work:
                    done = topup.step()
                    if done:
                        self._log(done)
                        break
                topup.release()             # a request came first: what was touched so far is free again
        except Exception as e:              # an optimisation: never worth the engine thread
            if topup is not None:
                topup.release()
            self.kv_topup = None
            self._log(f"K/V memory: idle-time top-up stopped ({e!r})")
        finally:
            self._topping_up = False
        self.idle.set()
        while True:
            try:    # a draft a request loaded waits DRAFT_IDLE_S for a request, then is released
                item = self._queue.get(timeout=DRAFT_IDLE_S if self.draft is not None else None)
                break
            except queue.Empty:
                self.idle.clear()
                self._topping_up = True             # before _idle_work is read: see _quiet_at_exit
                try:
                    if self._idle_work:
                        self.handlers._release_draft(f"no request used it for {DRAFT_IDLE_S:g} s")
                except Exception as e:  # noqa: BLE001 -- never worth the engine thread
                    self.draft = None
                    self._log(f"draft model: release failed ({e!r})")
                finally:
                    self._topping_up = False
                    self.idle.set()
        self.idle.clear()
        return item

    def _follow(self):
        """A follower rank's next request: rank 0's, as a handle nobody waits on (or _Stop)."""
        try:
            req = self.serving.next_request()
        except RuntimeError as e:       # rank 0 is gone: nothing left to follow
            self._log(f"distributed: lost rank 0 ({e}); stopping")
            return _Stop()
        return _Stop() if req is None else Handle(req)

    def log(self, line: str) -> None:
        """A line for the engine log and, as a Log event, for the request being served (engine thread)."""
        log.info(line)
        self._emit(Log(line))

    _log = log          # the engine's own name for it

    def require_model(self) -> None:
        """ModelNotLoaded unless a model is loaded (engine thread)."""
        if self.model is None:
            raise ModelNotLoaded()

    def _emit(self, event) -> None:
        """An event for the request being served (a log line, a KVMoved); none is served: dropped."""
        if self._handle is not None:
            self._handle.emit(event)

    def dispatch(self, handle: Handle):
        """Run one request's handler now, on the engine thread (the distributed strategy calls it on every
        rank around its collectives); callers on other threads submit() instead."""
        from . import disk_tier as disk_requests
        req, h = handle.request, self.handlers
        handlers = {
            GenerateRequest: lambda: h._generate(req, handle),
            LoadModel: lambda: h._load(req, handle),
            SaveSession: lambda: h._save(req, handle),
            RestoreSession: lambda: h._restore(req, handle),
            Configure: lambda: h._configure(req),
            Status: h.status,
            CountTokens: lambda: h._count_tokens(req),
            SessionSteering: lambda: h._session_steering(req),
            CaptureStates: lambda: h._capture(req, handle),
            Call: lambda: CallResult(req.fn(self)),
            ClearDiskCache: lambda: disk_requests.clear_request(self),
            ForgetConversation: lambda: disk_requests.forget_request(self, req),
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

    # ---- what other engine modules ask of the loaded model (engine/handlers.py answers) ------
    def cache_key(self, projection: bool | None = None):
        return self.handlers.cache_key(projection)

    def steering_fingerprint(self, projection: bool | None = None) -> str:
        return self.handlers.steering_fingerprint(projection)

    def session_fingerprint(self, steering_fp: str | None = None) -> dict:
        return self.handlers.session_fingerprint(steering_fp)

    def make_cache(self) -> list:
        return self.handlers.make_cache()

    def prompt_tokens(self, req: GenerateRequest) -> list[int]:
        return self.handlers.prompt_tokens(req)

    def status(self):
        return self.handlers.status()

    # ---- the held conversations (engine thread; engine/conversations.py) ---------------------
    @property
    def live(self):
        return self.conversations.live if self.conversations is not None else None

    @live.setter
    def live(self, entry) -> None:
        self.conversations.live = entry

    @property
    def parking(self):
        return self.conversations.parking if self.conversations is not None else None
