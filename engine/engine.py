"""The Engine: one thread owns the model, the tokenizer and every MLX object; callers submit requests.

    engine = Engine(EngineOptions(model="SmolLM2-135M-Instruct.Q4_1.gguf")).start()
    h = engine.submit(GenerateRequest(messages=[{"role": "user", "content": "Hi"}]))
    for event in h.events(): ...            # Token, Progress, Log, then Done(result) or Failed(message)

Requests: LoadModel, GenerateRequest, SaveSession, RestoreSession, Configure, Status, Call.
The Qt app runs `engine.run_forever()` inside its QThread instead of `start()`.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from .errors import Cancelled, RequestError, StrataError
from .events import Done, Failed, Handle, Log, Progress, Token
from .sampling import SamplingParams

log = logging.getLogger("strata")


@dataclass
class EngineOptions:
    model: str | None = None
    context_length: int | None = None       # None: the model's own, capped at 8192
    cache_mib: int = 1024                     # conversation parking cap (0 = off)
    cache_slots: int = 4
    steering: Any = None                      # control_vector.SteeringConfig or None
    speed_projection: bool = True             # default of the per-request switch when a vector is loaded
    prefill_chunk: int = 512
    dtype: str | None = None                  # None: float32 on the CPU, float16 on a GPU


@dataclass
class GenerateRequest:
    messages: list[dict] | None = None        # chat: rendered with the model's template
    prompt: str | None = None                 # raw text: fed as is (BOS as the GGUF says)
    sampling: SamplingParams = field(default_factory=SamplingParams)
    speed_projection: bool | None = None      # None: the engine's default
    conversation: str = ""                    # a label for logs


@dataclass
class LoadModel:
    path: str
    steering: Any = "keep"                    # "keep" the current SteeringConfig, or a new one / None


@dataclass
class SaveSession:
    path: str
    messages: list[dict] | None = None        # which conversation (live or parked); None: the live one


@dataclass
class RestoreSession:
    path: str


@dataclass
class Configure:
    cache_mib: int | None = None
    cache_slots: int | None = None
    speed_projection: bool | None = None


@dataclass
class Status:
    pass


@dataclass
class Call:
    """Run fn(engine) on the engine thread (benchmarks, `cvec train`)."""
    fn: Callable[["Engine"], Any]


class _Stop:
    pass


class Engine:
    def __init__(self, options: EngineOptions | None = None):
        from .memory_guard import MemoryGuard
        self.options = options or EngineOptions()
        self._queue: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None
        self.stopped = threading.Event()
        self._handle: Handle | None = None        # the request being served (for its log lines)
        self.guard = MemoryGuard()
        self.model = None
        self.tokenizer = None
        self.info = None
        self.model_path: Path | None = None
        self.model_hash = ""
        self.template: str | None = None
        self.steering = None                      # steering.SteeringState
        self.steering_error: str | None = None    # why the configured control vector was refused
        self.live = None                          # parking.KVEntry of the conversation holding the engine
        self.parking = None
        self.n_ctx = 0
        self.dist = None                          # distributed hook: set only when launched as a rank
        if "MLX_RANK" in __import__("os").environ:
            from . import distributed
            self.dist = distributed.detect()

    # ---- caller side -------------------------------------------------------------------------
    def start(self) -> "Engine":
        self._thread = threading.Thread(target=self.run_forever, name="strata-engine", daemon=True)
        self._thread.start()
        return self

    def submit(self, request: Any, callback: Callable | None = None) -> Handle:
        handle = Handle(request, callback)
        if self.dist is not None and self.dist.broken:   # distributed hook: the ring is gone, answer now
            handle.emit(Failed(self.dist.broken))
            return handle
        self._queue.put(handle)
        return handle

    def call(self, request: Any, timeout: float | None = None) -> dict:
        """Submit and wait: the result dict, or StrataError with the engine's message."""
        return self.submit(request).result(timeout)

    def stop(self, timeout: float = 10.0) -> None:
        self._queue.put(_Stop())
        self.stopped.wait(timeout)

    # ---- engine thread -----------------------------------------------------------------------
    def run_forever(self) -> None:
        from .limits import within_range
        from .parking import Parking
        self._log(self.guard.startup_line())
        # The CLI and the settings page check first; a value from elsewhere (a settings file written on a
        # bigger machine) is brought into range with a log line rather than refused at start.
        cap, slots, note = within_range(self.options.cache_mib, self.options.cache_slots, self._cache_range())
        if note:
            self._log(f"conversation cache: {note}")
        self.options.cache_mib, self.options.cache_slots = cap, slots
        self.parking = Parking(cap, slots, self.guard, self._log)
        if self.options.model:
            first = Handle(LoadModel(self.options.model, self.options.steering))
            first.local = True          # distributed: every rank loads its own --model, not rank 0's path
            self._serve(first)
        while True:
            # distributed hook: a follower rank serves rank 0's requests instead of its own queue.
            item = self._queue.get() if self.dist is None or self.dist.rank == 0 else self._follow()
            if isinstance(item, _Stop):
                if self.dist is not None and self.dist.rank == 0 and not self.dist.broken:
                    self.dist.stop_followers()
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
        try:
            result = self._dispatch(handle) if self.dist is None else self.dist.dispatch(self, handle)
            handle.emit(Done(result))
        except StrataError as e:
            self._log(f"error: {e}")
            handle.emit(Failed(str(e)))
        except Exception as e:  # a bug must not kill the engine thread: report it, keep serving
            log.exception("engine: unexpected error")
            handle.emit(Failed(f"internal error: {type(e).__name__}: {e}"))
        finally:
            self._handle = None

    def _follow(self):
        """A follower rank's next request: rank 0's, as a handle nobody waits on (or _Stop)."""
        from .distributed import Stop
        try:
            req = self.dist.next_request()
        except RuntimeError as e:       # rank 0 is gone: nothing left to follow
            self._log(f"distributed: lost rank 0 ({e}); stopping")
            return _Stop()
        return _Stop() if isinstance(req, Stop) else Handle(req)

    def _log(self, line: str) -> None:
        log.info(line)
        if self._handle is not None:
            self._handle.emit(Log(line))

    def _dispatch(self, handle: Handle) -> dict:
        req = handle.request
        if isinstance(req, GenerateRequest):
            return self._generate(req, handle)
        if isinstance(req, LoadModel):
            return self._load(req, handle)
        if isinstance(req, SaveSession):
            return self._save(req, handle)
        if isinstance(req, RestoreSession):
            return self._restore(req, handle)
        if isinstance(req, Configure):
            return self._configure(req)
        if isinstance(req, Status):
            return self.status()
        if isinstance(req, Call):
            return {"value": req.fn(self)}
        raise RequestError(f"unknown request {type(req).__name__}")

    # ---- model -------------------------------------------------------------------------------
    def _load(self, req: LoadModel, handle: Handle) -> dict:
        import mlx.core as mx

        from . import steering
        from .gguf_file import content_hash, open_gguf
        from .model_loader import load_model
        from .models import resolve_model
        from .tokenizer import load_tokenizer

        path = resolve_model(req.path)
        g = open_gguf(path)
        handle.emit(Progress("load", 0, len(g.reader.tensors)))
        tokenizer = load_tokenizer(g)
        dtype = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}.get(
            self.options.dtype or "", mx.float32 if mx.default_device() == mx.cpu else mx.float16)
        progress = lambda d, t: handle.emit(Progress("load", d, t))  # noqa: E731
        model, info = (load_model(g, dtype=dtype, progress=progress) if self.dist is None
                       else self.dist.load(g, dtype, progress))   # distributed hook: this rank's part
        steer_cfg = self.options.steering if req.steering == "keep" else req.steering
        vector, steering_error = None, None
        if steer_cfg is not None and getattr(steer_cfg, "files", ()):
            from .control_vector import ControlVector, ControlVectorError
            try:
                vector = ControlVector.load(steer_cfg, info.n_layer, info.n_embd)
            except ControlVectorError as e:
                # A vector made for another model must not cost the user the model: serve without it.
                steering_error = str(e)
        # Everything validated: swap in the new model (a failed load above leaves the old one serving).
        self.options.steering = steer_cfg
        self.model, self.tokenizer, self.info, self.model_path = model, tokenizer, info, path
        self.dtype = dtype
        self.steering_error = steering_error
        self.template = g.get("tokenizer.chat_template")
        self.model_hash = content_hash(path)
        self.steering = steering.SteeringState(vector, enabled=bool(vector) and self.options.speed_projection)
        steering.install(self.model, self.steering)
        if self.dist is not None:
            self.dist.after_load(self)
        self.n_ctx = min(self.options.context_length or min(info.context_length, 8192), info.context_length)
        self.live = None
        self.parking.clear()
        self._log(f"model: {path.name} ({info.architecture}, {info.n_layer} layers, "
                  f"{info.n_params / 1e6:.0f}M params, {info.file_type}), context {self.n_ctx}, "
                  f"compute {str(dtype).removeprefix('mlx.core.')}")
        self._log(f"weights: {info.load_note}")
        if self.dist is not None:
            self._log(self.dist.describe())
        if vector is not None:
            self._log(vector.describe())
        if steering_error:
            self._log(f"control vector refused: {steering_error}; serving without it")
        return {"model": str(path), "info": info.__dict__, "steering_error": steering_error}

    def _require_model(self) -> None:
        if self.model is None:
            raise RequestError("no model is loaded")

    def cache_key(self) -> str:
        """What the K/V depends on: the model's content and the steering setting in force."""
        return f"{self.model_hash}|{self.steering.fingerprint() or 'no-steering'}"

    def make_cache(self) -> list:
        from mlx_lm.models.cache import make_prompt_cache
        return make_prompt_cache(self.model)

    def prompt_tokens(self, req: GenerateRequest) -> list[int]:
        from .chat_template import render
        tok = self.tokenizer
        if req.prompt is not None:
            return tok.encode(req.prompt)
        if not req.messages:
            raise RequestError("a request needs messages or a prompt")
        bos = tok.token_text(tok.bos_id) if tok.bos_id is not None else ""
        text = render(self.template, req.messages, bos_token=bos,
                      eos_token=tok.token_text(min(tok.eos_ids)) if tok.eos_ids else "")
        # A template that writes BOS itself must not get a second one.
        add_bos = tok.add_bos and not (bos and text.startswith(bos))
        return self._continue_tokens(text, add_bos) or tok.encode(text, add_bos=add_bos)

    def _continue_tokens(self, text: str, add_bos: bool) -> list[int] | None:
        """Tokens for `text` that keep a held conversation's own tokens when `text` extends it.

        Re-tokenizing a reply does not always give back the ids the model generated; keeping
        them is what lets a follow-up reuse the whole history instead of stopping at the reply."""
        tok = self.tokenizer
        key = self.cache_key()
        held = ([self.live] if self.live is not None else []) + list(self.parking.entries)
        best = None
        for e in held:
            if e.key != key or not e.tokens or (best is not None and len(e.tokens) <= len(best)):
                continue
            ids = e.tokens[1:] if add_bos and e.tokens[0] == tok.bos_id else e.tokens
            if add_bos and ids is e.tokens:
                continue
            prefix = tok.decode(ids, skip_special=False)
            if prefix and text.startswith(prefix):
                best = e.tokens + tok.encode(text[len(prefix):], add_bos=False)
        return best

    # ---- generation --------------------------------------------------------------------------
    def _take_kv(self, tokens: list[int]):
        """The K/V to extend for `tokens`: the live one, a parked one, or a new one."""
        from .parking import MIN_PREFIX_REUSE, KVEntry, common_prefix
        key = self.cache_key()
        live = self.live
        if live is not None and live.key == key:
            n = common_prefix(live.tokens, tokens)
            if n == len(live.tokens):
                return live, n
            if not self.parking.enabled and n >= min(MIN_PREFIX_REUSE, len(live.tokens)):
                return live, n          # no parking: reuse the shared prefix, as llama.cpp does
        self.live = None
        entry, n = None, 0
        n_live = common_prefix(live.tokens, tokens) if live is not None and live.key == key else 0
        if any(e.key == key and common_prefix(e.tokens, tokens) > n_live for e in self.parking.entries):
            # Take before parking the live conversation: parking it may evict the very entry wanted.
            entry, n = self.parking.take(tokens, key, self.make_cache)
        if live is not None and self.parking.enabled:
            self.parking.park(live)
        if entry is None:
            entry, n = self.parking.take(tokens, key, self.make_cache)
        if entry is not None:
            return entry, n
        return KVEntry([], self.make_cache(), key), 0

    def _generate(self, req: GenerateRequest, handle: Handle) -> dict:
        from .generate import StepStats, decode, prefill
        from .tokenizer import StreamDecoder
        self._require_model()
        req.sampling.validate()
        self.steering.enabled = bool(self.steering.vector) and (
            self.options.speed_projection if req.speed_projection is None else req.speed_projection)
        stats = StepStats()
        tokens = self.prompt_tokens(req)
        if len(tokens) >= self.n_ctx:
            raise RequestError(f"the prompt is {len(tokens)} tokens; the context holds {self.n_ctx}")
        entry, reuse = self._take_kv(tokens)
        reuse = min(reuse, len(tokens) - 1)     # the last prompt token is always evaluated
        for c in entry.cache:
            if c.offset > reuse:
                c.trim(c.offset - reuse)
        entry.tokens = entry.tokens[:reuse]
        self.live = entry                       # from here on the live K/V is `entry`
        entry.messages = list(req.messages or [])
        stats.prompt_tokens, stats.cached_tokens = len(tokens), reuse
        cancelled = lambda: handle.cancelled  # noqa: E731
        new = tokens[reuse:-1]
        prefill(self.model, entry.cache, new, entry.tokens, chunk=self.options.prefill_chunk,
                progress=(lambda d, t: handle.emit(Progress("prefill", d, t))) if len(new) > 1 else None,
                cancelled=cancelled)
        t_prefill = time.perf_counter()
        sp = req.sampling
        max_tokens = min(sp.max_tokens, self.n_ctx - len(tokens))
        out_ids: list[int] = []
        text = ""
        stream = StreamDecoder(self.tokenizer)
        finish = "length"
        held = ""   # text held back while it could still be the start of a stop string
        for token in decode(self.model, entry.cache, tokens[-1], entry.tokens, history=tokens,
                            sampler=sp.sampler(), processors=sp.processors(), max_tokens=max_tokens,
                            stats=stats, seed=sp.seed, cancelled=cancelled):
            out_ids.append(token)
            if token in self.tokenizer.eos_ids:
                finish = "stop"
                break
            held += stream.push(token)
            emit, stop_hit = _split_stop(held, sp.stop)
            if emit:
                text += emit
                handle.emit(Token(token, emit))
            held = held[len(emit):]
            if stop_hit:
                finish = "stop"
                break
        else:
            if handle.cancelled:
                finish = "cancelled"
        if finish != "stop" or not sp.stop:
            rest = held + stream.flush()
            if rest:
                text += rest
                handle.emit(Token(out_ids[-1] if out_ids else -1, rest))
        t_end = time.perf_counter()
        n_new = len(tokens) - reuse
        stats.ttft_ms = ((stats.t_first or t_end) - stats.t_start) * 1e3
        stats.prefill_tps = n_new / max(1e-9, (stats.t_first or t_prefill) - stats.t_start)
        stats.decode_tps = (len(out_ids) - 1) / (t_end - stats.t_first) if len(out_ids) > 1 else 0.0
        entry.messages = list(req.messages or []) + ([{"role": "assistant", "content": text}] if req.messages else [])
        self._log(f"{req.conversation or 'request'}: prompt {len(tokens)} (cached {reuse}), "
                  f"{len(out_ids)} generated, ttft {stats.ttft_ms:.0f} ms, "
                  f"{stats.decode_tps:.1f} tok/s, finish {finish}")
        return {"tokens": out_ids, "text": text, "prompt_tokens": len(tokens), "cached_tokens": reuse,
                "generated_tokens": len(out_ids), "ttft_ms": round(stats.ttft_ms, 2),
                "prefill_tps": round(stats.prefill_tps, 2), "decode_tps": round(stats.decode_tps, 2),
                "finish_reason": finish, "speed_projection": self.steering.active}

    # ---- settings, status --------------------------------------------------------------------
    def _configure(self, req: Configure) -> dict:
        if req.cache_mib is not None or req.cache_slots is not None:
            from .limits import check_cache_mib, check_cache_slots
            cap = self.parking.cap_bytes >> 20 if req.cache_mib is None else check_cache_mib(req.cache_mib,
                                                                                             self._cache_range())
            slots = self.parking.slots if req.cache_slots is None else check_cache_slots(req.cache_slots)
            self.parking.set_limits(cap, slots)
            self.options.cache_mib, self.options.cache_slots = cap, slots
            self._log(f"conversation cache: {cap} MiB, {slots} slots")
        if req.speed_projection is not None:
            self.options.speed_projection = bool(req.speed_projection)
        return self.status()

    def _cache_range(self):
        from .limits import cache_range
        reading = self.guard.reading()
        return cache_range(reading.total_bytes if reading is not None else None)

    def status(self) -> dict:
        from .limits import cache_range
        reading = self.guard.reading()
        return {
            "cache_mib_max": cache_range(reading.total_bytes if reading is not None else None).max_mib,
            "model": str(self.model_path) if self.model_path else None,
            "info": self.info.__dict__ if self.info else None,
            "context_length": self.n_ctx,
            "live_tokens": len(self.live.tokens) if self.live else 0,
            "parking": self.parking.status() if self.parking else None,
            "memory": None if reading is None else {
                "total_bytes": reading.total_bytes, "available_bytes": reading.available_bytes,
                "source": reading.source},
            "memory_unavailable": self.guard.unavailable_reason(),
            "steering": self.steering.vector.describe() if self.steering and self.steering.vector else None,
            "steering_error": self.steering_error,
            "speed_projection_default": self.options.speed_projection,
            "distributed": self.dist.status() if self.dist is not None else None,
        }

    # ---- session files -----------------------------------------------------------------------
    def session_fingerprint(self) -> dict:
        from .gguf_file import text_hash
        info = self.info
        return {"model_hash": self.model_hash, "architecture": info.architecture, "n_layer": info.n_layer,
                "n_kv_heads": info.n_head_kv, "head_dim": info.head_dim,
                "tokenizer": self.tokenizer.fingerprint, "chat_template": text_hash(self.template or ""),
                "steering": self.steering.fingerprint() or "none"}

    def _save(self, req: SaveSession, handle: Handle) -> dict:
        from . import sessions
        if self.dist is not None:                 # distributed hook: rank 0 gathers every rank's layers
            return self.dist.save(self, req, handle)
        self._require_model()
        entry = self.live
        if req.messages is not None:
            held = ([self.live] if self.live is not None else []) + list(self.parking.entries)
            entry = next((e for e in held if e.messages == req.messages and e.key == self.cache_key()), None)
            if entry is None:
                raise RequestError("that conversation's K/V is no longer held by the engine "
                                   "(send a message in it first, then save)")
        if entry is None or not entry.tokens:
            raise RequestError("there is no conversation to save")
        reason = self.guard.unavailable_reason()
        if reason:
            raise RequestError(f"session save refused: {reason}")
        return sessions.save(req.path, entry, self.session_fingerprint(),
                             progress=lambda d, t: handle.emit(Progress("save", d, t)), log=self._log)

    def _restore(self, req: RestoreSession, handle: Handle) -> dict:
        from . import sessions
        if self.dist is not None:                 # distributed hook: rank 0 reads, each rank gets its layers
            return self.dist.restore(self, req, handle)
        self._require_model()
        reason = self.guard.unavailable_reason()
        if reason:
            raise RequestError(f"session restore refused: {reason}")
        entry, result = sessions.load(req.path, self.session_fingerprint(), self.make_cache,
                                      key=self.cache_key(), dtype=self.dtype,
                                      progress=lambda d, t: handle.emit(Progress("restore", d, t)),
                                      log=self._log)
        # Validated and read: only now does the live conversation step aside.
        if self.live is not None and self.parking.enabled:
            self.parking.park(self.live)
        self.live = entry
        return result


def _split_stop(text: str, stops: list[str]) -> tuple[str, bool]:
    """(text safe to emit, whether a stop string was hit). Holds back a possible stop-string start."""
    if not stops:
        return text, False
    for s in stops:
        i = text.find(s)
        if i >= 0:
            return text[:i], True
    hold = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), 0, -1):
            if text.endswith(s[:k]):
                hold = max(hold, k)
                break
    return text[:len(text) - hold], False
