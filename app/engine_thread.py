"""The engine's QThread and the signal bridge: the only module in app/ that imports engine.engine.

`EngineThread.run()` imports the engine and serves requests forever on that thread (every MLX call
happens there). `EngineClient` is what the UI holds: each call returns a `Request` QObject whose
signals (token, progress, log, done, failed) are emitted on the engine thread and delivered queued
on the GUI thread. Requests made before the engine is up are held and sent when it is ready.
Requests and results are engine/api.py's (plain Python): `done` carries the typed result
(Generation, EngineStatus, SessionSaved...), read by its fields; a failure keeps its ErrorCode.
"""
from __future__ import annotations

import logging

from PySide6.QtCore import QObject, Qt, QThread, QTimer, Signal

from engine.limits import (DEFAULT_CACHE_MIB, DEFAULT_CACHE_SLOTS, SPEED_PROJECTION_DEFAULT,
                           DEFAULT_MAX_SEQUENCES)
from engine.api import (ClearDiskCache, Configure, CountTokens, ForgetConversation, GenerateRequest,
                        LoadModel, RestoreSession, SaveSession, Status)
from engine.errors import ErrorCode
from engine.events import Done, Failed, KVChanged, KVMoved, Log, Progress, Token
from engine.sampling import SamplingParams

log = logging.getLogger("strata.app")


class Request(QObject):
    """One submitted request, as Qt signals, always emitted on the GUI thread (the engine thread only
    emits the private `_event` signal, delivered queued to this object). `finished` follows done/failed."""
    token = Signal(str)
    progress = Signal(str, object, object)
    log = Signal(str)
    kv = Signal(object)                 # engine.events.KVChanged: parking figures as the request took its K/V
    kv_moved = Signal(object)           # engine.events.KVMoved: a conversation parked, refused, evicted, dropped
    done = Signal(object)
    failed = Signal(str)
    finished = Signal()
    _event = Signal(object)

    def __init__(self, kind: str, parent: QObject | None = None):
        super().__init__(parent)
        self.kind = kind             # what it asks ("save", "generate"...): the chat's progress bar reads it
        self.handle = None           # engine.events.Handle once submitted
        self._cancel = False
        self.result = None           # the engine's typed result (engine/api.py) once done
        self.error: str | None = None
        self.error_code = None       # engine.errors.ErrorCode of a failure (None: failed before the engine)
        self.error_reason = ""
        self.error_vector = None     # engine.errors.VectorSpec of a steering refusal: the vector the file needs
        self._event.connect(self._deliver, Qt.ConnectionType.QueuedConnection)

    def cancel(self) -> None:
        self._cancel = True
        if self.handle is not None:
            self.handle.cancel()

    def _callback(self, event) -> None:
        """Called on the engine thread for each event: hand it to the GUI thread, nothing else."""
        self._event.emit(event)

    def _deliver(self, event) -> None:
        if isinstance(event, Token):
            self.token.emit(event.text)
        elif isinstance(event, Progress):
            self.progress.emit(event.stage, event.done, event.total)
        elif isinstance(event, Log):
            self.log.emit(event.line)
        elif isinstance(event, KVChanged):
            self.kv.emit(event)
        elif isinstance(event, KVMoved):
            self.kv_moved.emit(event)
        elif isinstance(event, Done):
            self.result = event.result
            self.done.emit(self.result)
            self.finished.emit()
        elif isinstance(event, Failed):
            self.fail(event.message, event.code, event.reason, event.vector)

    def fail(self, message: str, code=None, reason: str = "", vector=None) -> None:
        """Failed: `code` is an engine.errors.ErrorCode (None: refused before it reached the engine);
        `vector`: a steering refusal's engine.errors.VectorSpec."""
        self.error, self.error_code, self.error_reason, self.error_vector = message, code, reason, vector
        self.failed.emit(message)
        self.finished.emit()


class EngineThread(QThread):
    ready = Signal()
    crashed = Signal(str)

    def __init__(self, cache_mib: int = DEFAULT_CACHE_MIB, cache_slots: int = DEFAULT_CACHE_SLOTS, steering=None,
                 speed_projection: bool = SPEED_PROJECTION_DEFAULT, kv_bits: int = 16, parent: QObject | None = None,
                 disk_mib: int = 0):
        """`speed_projection`: the engine's default for requests that name none (the settings' "on by
        default"); the app's own requests always name theirs. `kv_bits`: the settings' K/V cache
        precision, in force from the first conversation (a model whose head size cannot take it is
        refused at load with the engine's reason)."""
        super().__init__(parent)
        self.setObjectName("strata-engine")
        # replies of several tabs (and the server on this engine) decoded together
        self._opts = dict(cache_mib=cache_mib, cache_slots=cache_slots, speed_projection=speed_projection,
                          kv_bits=kv_bits, disk_mib=disk_mib, max_sequences=DEFAULT_MAX_SEQUENCES)
        self._steering = steering
        self.engine = None
        self._stop_asked = False

    def run(self) -> None:
        try:
            # lazy: engine.engine imports MLX, which the app's own modules never import
            from engine.engine import Engine, EngineOptions
            self.engine = Engine(EngineOptions(model=None, steering=_steering_config(self._steering),
                                               **self._opts))
        except Exception as e:  # noqa: BLE001 - shown in the window, not a traceback
            log.exception("engine start failed")
            self.crashed.emit(f"the engine could not start: {type(e).__name__}: {e}")
            return
        if self._stop_asked:            # a quit while the engine was starting (stop() saw no engine yet)
            return
        self.ready.emit()
        self.engine.run_forever()

    def stop(self, timeout_ms: int = 10000) -> None:
        # The flag first, the engine second (run() sets them in the other order): a stop during start-up
        # is seen by one of the two, and the thread ends either way (Qt aborts the process otherwise).
        self._stop_asked = True
        if self.engine is not None:
            self.engine.stop()          # queues the stop marker; run_forever returns after the current request
        self.wait(timeout_ms)


def start_server(engine, host: str, port: int, api_key: str = ""):
    """The OpenAI-compatible server (engine.frontends.server) on the app's engine: a started ServerThread, or
    StrataError (one line, e.g. the port in use). Blocks until it listens: call it off the GUI thread."""
    # lazy: the server imports the engine (MLX), which the app's own modules never import
    from engine.frontends.server import ServerThread, create_app
    return ServerThread(create_app(engine, api_key=api_key or None, host=host), host=host, port=port).start()


def _steering_config(spec):
    """settings.Steering (or None) -> engine.steer.control_vector.SteeringConfig (or None when no files)."""
    if spec is None or not getattr(spec, "files", None):
        return None
    # lazy: engine.steer.control_vector imports MLX, which the app's own modules never import
    from engine.steer.control_vector import SteeringConfig
    layer_range = (spec.layer_from, spec.layer_to) if spec.layer_from or spec.layer_to else None
    return SteeringConfig(files=tuple((p, float(s)) for p, s in spec.files), layer_range=layer_range,
                          mode=spec.mode, direction=spec.direction)


class EngineClient(QObject):
    """The UI's handle on the engine thread. `kv_changed` says the held conversations may have changed
    (a park, an eviction, a restore, a request that took or made K/V): time to ask for the status.
    `kv_state` carries the parking figures the engine sends as a reply takes its K/V (the engine's
    typed KVChanged event: the status bar is right while the reply runs, before a Status could be
    answered behind it); `kv_moved` each park, refusal, eviction or drop as it happens (KVMoved, with
    the conversation's bytes and the parking figures after it)."""
    ready = Signal()
    kv_changed = Signal()
    kv_state = Signal(object)          # engine.events.KVChanged
    kv_moved = Signal(object)          # engine.events.KVMoved

    def __init__(self, thread: EngineThread, parent: QObject | None = None):
        super().__init__(parent)
        self.thread = thread
        self._pending: list[tuple[Request, object]] = []
        self._ready = False
        self._open: set[Request] = set()        # submitted, not finished (cancel_replies)
        thread.ready.connect(self._on_ready)

    @property
    def is_ready(self) -> bool:
        return self._ready

    def cancel_replies(self) -> None:
        """Cancel every reply and title request in flight or queued (the window is closing: a long
        prompt being read must not keep the engine thread, which the engine now stops within a layer)."""
        for req in list(self._open):
            if req.kind == "generate":
                req.cancel()

    def _on_ready(self) -> None:
        self._ready = True
        pending, self._pending = self._pending, []
        for req, make in pending:
            self._send(req, make)
        self.ready.emit()

    def _submit(self, kind: str, make) -> Request:
        req = Request(kind, self)
        self._open.add(req)
        req.finished.connect(lambda r=req: self._open.discard(r))
        req.finished.connect(req.deleteLater)
        if kind in ("generate", "save", "restore", "load", "configure", "disk"):
            req.finished.connect(self.kv_changed)
        req.kv.connect(self.kv_state)
        req.kv_moved.connect(self.kv_moved)
        if self._ready:
            self._send(req, make)
        else:
            self._pending.append((req, make))
        return req

    def _send(self, req: Request, make) -> None:
        try:
            request = make()
        except Exception as e:  # noqa: BLE001 - a bad setting becomes a failed request, not a crash
            why = str(e)        # `e` is unbound once the except block ends; the lambda runs later
            QTimer.singleShot(0, req, lambda: req.fail(why))
            return
        if req._cancel:
            QTimer.singleShot(0, req, lambda: req.fail("cancelled", ErrorCode.CANCELLED))
            return
        req.handle = self.thread.engine.submit(request, callback=req._callback)

    # ---- requests ----------------------------------------------------------------------------
    def generate(self, messages: list[dict], sampling: dict, conversation: str = "",
                 speed_projection: bool | None = None, speculative: str = "off", side: bool = False,
                 overflow: str = "stop", context_limit: int = 0, tools: list[dict] | None = None,
                 constraint=None) -> Request:
        """`side`: a request of the app's own (a title) that must not cost a conversation its K/V.
        `overflow`, `context_limit`: the chat's overflow policy and its config's context (0: the model's).
        `tools`, `constraint`: a tool plan's (engine/frontends/tool_calls.py: the template's tools, a forced call's grammar)."""
        def make():
            return GenerateRequest(messages=list(messages), sampling=SamplingParams(**sampling),
                                   speed_projection=speed_projection, conversation=conversation,
                                   speculative=speculative, side=side, overflow=overflow,
                                   context_limit=context_limit, tools=tools, constraint=constraint)
        return self._submit("generate", make)

    def load_model(self, path: str, steering="keep", mmproj: str | None = None, image_max_tokens: int = 0) -> Request:
        """`mmproj`: the image projector (None: one found beside the model, "": none); `image_max_tokens`:
        the most tokens an image takes with it (0: the projector's own limit)."""
        def make():
            return LoadModel(path, steering=steering if steering == "keep" else _steering_config(steering),
                             mmproj=mmproj, image_max_tokens=image_max_tokens)
        return self._submit("load", make)

    def configure(self, cache_mib: int | None = None, cache_slots: int | None = None,
                  speed_projection: bool | None = None, kv_bits: int | None = None,
                  disk_mib: int | None = None) -> Request:
        """None leaves a value as it is; the engine takes all the values or none. `kv_bits`: the K/V
        format of conversations from now on (held ones keep theirs); refused, changing nothing, when the
        loaded model's head size cannot take it. `disk_mib`: the disk tier's cap (engine/disk/disk_tier.py),
        0 = off. The app sends it from one place: app/engine_settings.py."""
        def make():
            return Configure(cache_mib=cache_mib, cache_slots=cache_slots, speed_projection=speed_projection,
                             kv_bits=kv_bits, disk_mib=disk_mib)
        return self._submit("configure", make)

    def clear_disk_cache(self) -> Request:
        """Every conversation in the disk tier removed: result is the EngineStatus (its `disk` figures)."""
        def make():
            return ClearDiskCache()
        return self._submit("disk", make)

    def forget_conversation(self, conversation: str) -> Request:
        """A deleted chat: its K/V dropped from the disk tier and from parking."""
        def make():
            return ForgetConversation(conversation)
        return self._submit("disk", make)

    def count_prompt_tokens(self, messages: list[dict]) -> Request:
        """How many tokens these messages make as a prompt (the model's template): result.tokens, of
        which result.system_tokens are the system prompt's (the context meter's breakdown)."""
        def make():
            return CountTokens(messages=list(messages))
        return self._submit("count", make)

    def status(self) -> Request:
        def make():
            return Status()
        return self._submit("status", make)

    def save_session(self, path: str, messages: list[dict] | None = None, speed_projection: bool | None = None,
                     conversation: str = "") -> Request:
        """Save a conversation: the one whose messages these are (live or parked; read again when its
        K/V is not held, with progress "prefill"), or the live one. `speed_projection`: the steering
        its K/V has (the tab's toggle)."""
        def make():
            return SaveSession(path, messages=list(messages) if messages is not None else None,
                               speed_projection=speed_projection, conversation=conversation)
        return self._submit("save", make)

    def restore_session(self, path: str, speed_projection: bool | None = None, conversation: str = "") -> Request:
        """Restore a session file; None keeps the file's own steering (result.speed_projection)."""
        def make():
            return RestoreSession(path, speed_projection=speed_projection, conversation=conversation)
        return self._submit("restore", make)

