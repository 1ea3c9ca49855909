"""The Engine: one thread owns the model, the tokenizer and every MLX object; callers submit requests.

    engine = Engine(EngineOptions(model="SmolLM2-135M-Instruct.Q4_1.gguf")).start()
    h = engine.submit(GenerateRequest(messages=[{"role": "user", "content": "Hi"}]))
    for event in h.events(): ...            # Token, Progress, Log, then Done(result) or Failed(message)

Requests: LoadModel, GenerateRequest, SaveSession, RestoreSession, Configure, Status, Call.
The Qt app runs `engine.run_forever()` inside its QThread instead of `start()`.
"""
from __future__ import annotations

import json
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

# mlx-lm makes MLX streams (its generation stream) when first imported. Imported here, with the engine
# module, they belong to the importing thread as they always did; first imported lazily on the engine
# thread instead, a CLI that exits right after a refused load aborts in MLX's thread teardown
# ("terminate called without an active exception"). engine/sampling.py stays MLX-free for the app.
import mlx_lm.generate  # noqa: F401,E402

from .errors import RequestError, SessionFileError, StrataError
from .events import Done, Failed, Handle, Log, Progress, Token
from .limits import DEFAULT_CACHE_MIB, DEFAULT_CACHE_SLOTS
from .sampling import SamplingParams

log = logging.getLogger("strata")
MAX_CHARS_PER_TOKEN = 32


@dataclass
class EngineOptions:
    model: str | None = None
    context_length: int | None = None       # None: the model's own, capped at 8192
    cache_mib: int = DEFAULT_CACHE_MIB        # conversation parking cap (0 = off)
    cache_slots: int = DEFAULT_CACHE_SLOTS
    steering: Any = None                      # control_vector.SteeringConfig or None
    speed_projection: bool = True             # default of the per-request switch when a vector is loaded
    prefill_chunk: int = 512
    dtype: str | None = None                  # None: float32 on the CPU, float16 on a GPU
    kv_bits: int = 16                         # K/V storage: 16, 8 or 4 bits (engine/kv_format.py)


@dataclass
class GenerateRequest:
    messages: list[dict] | None = None        # chat: rendered with the model's template
    prompt: str | None = None                 # raw text: fed as is (BOS as the GGUF says)
    sampling: SamplingParams = field(default_factory=SamplingParams)
    speed_projection: bool | None = None      # None: the engine's default
    conversation: str = ""                    # a label for logs; also the K/V's owner (a new branch of
                                              # the same conversation, e.g. Regenerate, reuses its slot)
    side: bool = False                        # a side request (titles, counts): never parks, takes or
                                              # evicts a conversation's K/V; projection off unless asked
    speculative: str = "off"                  # "off" | "lookup" | "draft:PATH" (engine/speculative.py)


@dataclass
class LoadModel:
    path: str
    steering: Any = "keep"                    # "keep" the current SteeringConfig, or a new one / None


@dataclass
class SaveSession:
    path: str
    messages: list[dict] | None = None        # which conversation (live or parked); None: the live one
    force: bool = False                       # replace a file holding a longer conversation (else refused
                                              # with Failed.code "session_overwrite": ask, then resend)
    sync: bool = True                         # fsync before the rename (False: benchmarks only)
    # The steering applied to that conversation's K/V (its identity): None takes whichever held K/V
    # has these messages. When none is held, the conversation is read again with this setting
    # (None: the engine's default) and then saved.
    speed_projection: bool | None = None
    conversation: str = ""                    # the owner given to K/V read again for the save


@dataclass
class RestoreSession:
    path: str
    # None: restore with the file's own steering when this engine can apply it (the result's
    # "speed_projection" says which); True/False: refuse a file saved with another setting.
    speed_projection: bool | None = None
    conversation: str = ""                    # the owner of the restored K/V


@dataclass
class Configure:
    kv_bits: int | None = None                # K/V format of conversations from now on
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
        self.draft = None                         # speculative.DraftModel loaded for `draft:PATH` requests
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
        self._clean_session_folder()
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
        if handle.cancelled and isinstance(handle.request, (GenerateRequest, SaveSession)):
            # Cancelled while it waited its turn: it must not park, take or read any K/V.
            self._handle = handle
            self._log("error: cancelled")
            self._handle = None
            handle.emit(Failed("cancelled"))
            return
        self._handle = handle
        try:
            result = self._dispatch(handle) if self.dist is None else self.dist.dispatch(self, handle)
            handle.emit(Done(result))
        except StrataError as e:
            self._log(f"error: {e}")
            handle.emit(Failed(str(e), getattr(e, "code", "")))
        except Exception as e:  # a bug must not kill the engine thread: report it, keep serving
            log.exception("engine: unexpected error")
            # The live K/V may be half-updated by what failed: the next request recomputes instead.
            if isinstance(handle.request, (GenerateRequest, RestoreSession)):
                self._drop_suspect_entries()
            handle.emit(Failed(f"internal error: {type(e).__name__}: {e}"))
        finally:
            self._handle = None

    def _drop_suspect_entries(self) -> None:
        """After an unexpected error in a request: the live K/V may be half-updated, and a parked entry
        with token ids outside the vocabulary would fail every later request. Drop them, with a log line."""
        if self.live is not None:
            self._log(f"dropped the live conversation's K/V ({len(self.live.tokens)} tokens) after an engine error")
            self.live = None
        n_vocab = self.info.n_vocab if self.info else 0
        def sound(e) -> bool:
            try:
                return all(0 <= int(t) < n_vocab for t in e.tokens)
            except (TypeError, ValueError, OverflowError):
                return False
        for e in list(self.parking.entries if self.parking else []):
            if not sound(e):
                self.parking.entries.remove(e)
                self._log(f"dropped a parked conversation ({len(e.tokens)} tokens) holding invalid token ids")

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
        from .memory_estimate import fit_for_load, gpu_working_set
        from .model_loader import load_model
        from .models import resolve_model
        from .tokenizer import load_tokenizer

        path = resolve_model(req.path)
        g = open_gguf(path)
        handle.emit(Progress("load", 0, len(g.reader.tensors)))
        tokenizer = load_tokenizer(g)
        dtype = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}.get(
            self.options.dtype or "", mx.float32 if mx.default_device() == mx.cpu else mx.float16)
        # Refuse (or shrink the default context) before any tensor is read when it cannot fit.
        n_ctx, memory_line = fit_for_load(path, self.options.context_length, str(dtype).rsplit(".", 1)[-1],
                                          self.guard, gpu_working_set())
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
        from .kv_format import choose
        choose(self.options.kv_bits, info.head_dim)   # --kv-bits this model's head size cannot take: refused
        # Everything validated: swap in the new model (a failed load above leaves the old one serving).
        self.options.steering = steer_cfg
        self.model, self.tokenizer, self.info, self.model_path = model, tokenizer, info, path
        self.dtype = dtype
        self.steering_error = steering_error
        self.template = g.get("tokenizer.chat_template")
        self.model_hash = content_hash(path)
        self.steering = steering.SteeringState(vector, enabled=bool(vector) and self.options.speed_projection)
        if vector is not None:
            # Wrapped only when a vector is loaded: without one a decode step pays for no wrapper.
            steering.install(self.model, self.steering)
            # Compile the steering kernel now (seconds on a GPU's first use), not in a request.
            secs = steering.warm_up(vector, dtype)
            self._log(f"control vector op ({steering.active_backend()}) compiled in {secs * 1e3:.0f} ms")
        if self.dist is not None:
            self.dist.after_load(self)
        self.n_ctx = n_ctx
        self.live = None
        self.parking.clear()
        self._log(f"model: {path.name} ({info.architecture}, {info.n_layer} layers, "
                  f"{info.n_params / 1e6:.0f}M params, {info.file_type}), context {self.n_ctx}, "
                  f"compute {str(dtype).removeprefix('mlx.core.')}")
        self._log(f"weights: {info.load_note}")
        self._log(memory_line)
        self._log(f"K/V: {self.kv_fmt.describe()}")
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

    def steering_fingerprint(self, projection: bool | None = None) -> str:
        """The steering identity of K/V computed with `projection` (None: the setting in force):
        the loaded vector's fingerprint when it is applied, '' when not."""
        vector = self.steering.vector if self.steering else None
        if vector is None:
            return ""
        on = self.steering.enabled if projection is None else projection
        return vector.fingerprint() if on else ""

    def cache_key(self, projection: bool | None = None) -> str:
        """What the K/V depends on: the model's content, the steering applied to it and the K/V format
        (model|steering[|format]; the steering part is read back by _save)."""
        fmt = self.kv_fmt
        return (f"{self.model_hash}|{self.steering_fingerprint(projection) or 'no-steering'}"
                + (f"|{fmt.label}" if fmt.quantized else ""))

    @property
    def kv_fmt(self):
        from .kv_format import choose
        return choose(self.options.kv_bits, self.info.head_dim)

    def _projection(self, requested: bool | None) -> bool:
        return bool(self.steering.vector) and (
            self.options.speed_projection if requested is None else bool(requested))

    def make_cache(self) -> list:
        from .kv_format import make_cache
        return make_cache(self.model, self.kv_fmt)

    def prompt_tokens(self, req: GenerateRequest) -> list[int]:
        from .chat_template import render
        tok = self.tokenizer
        # A huge body must not cost a tokenization (or a template render) to be refused: no real
        # tokenizer averages more than MAX_CHARS_PER_TOKEN characters a token.
        chars = len(req.prompt) if req.prompt is not None else sum(
            len(str(m.get("content") or "")) for m in req.messages or [] if isinstance(m, dict))
        if chars > self.n_ctx * MAX_CHARS_PER_TOKEN:
            raise RequestError(f"the prompt is {chars} characters (over {chars // MAX_CHARS_PER_TOKEN} tokens); "
                               f"the context holds {self.n_ctx}")
        if req.prompt is not None:
            return tok.encode(req.prompt)
        if not req.messages:
            raise RequestError("a request needs messages or a prompt")
        bos = tok.token_text(tok.bos_id) if tok.bos_id is not None else ""
        text = render(self.template, req.messages, bos_token=bos,
                      eos_token=tok.token_text(min(tok.eos_ids)) if tok.eos_ids else "",
                      name=f"the chat template of {self.model_path.name}" if self.template else "")
        # A template that writes BOS itself must not get a second one.
        add_bos = tok.add_bos and not (bos and text.startswith(bos))
        return self._continue_tokens(text, add_bos, req.conversation) or tok.encode(text, add_bos=add_bos)

    def _continue_tokens(self, text: str, add_bos: bool, owner: str = "") -> list[int] | None:
        """Tokens for `text` that keep a held conversation's own tokens as far as `text` follows them.

        Re-tokenizing a reply does not always give back the ids the model generated; keeping
        them is what lets a follow-up reuse the whole history instead of stopping at the reply.
        Each held entry keeps the text its tokens decode to (KVEntry.text, extended as it grows),
        so the check is a string comparison and only the new part of `text` is tokenized. A new
        branch of `owner`'s conversation (Regenerate, Edit) keeps the longest run of its held tokens
        that the text starts with (only its own: another conversation's tokens cut mid-word would
        give this one an unnatural tokenization)."""
        from .parking import MIN_PREFIX_REUSE
        tok = self.tokenizer
        key = self.cache_key()
        candidates = []
        best, best_n = None, 0
        for e in self._held():                    # whole entries first: a string comparison each
            if e.key != key or not e.tokens:
                continue
            starts_bos = tok.bos_id is not None and e.tokens[0] == tok.bos_id
            if add_bos and not starts_bos:
                continue
            lead = 1 if add_bos else 0
            try:
                prefix = e.text(tok, skip=lead)
            except Exception as err:  # noqa: BLE001 - e.g. a token id outside the vocabulary
                self._drop_held(e, f"its tokens cannot be decoded ({type(err).__name__}: {str(err)[:120]})")
                continue
            candidates.append((e, lead, e.tokens[lead:]))
            if len(e.tokens) > best_n and prefix and text.startswith(prefix):
                best, best_n = e.tokens + tok.encode(text[len(prefix):], add_bos=False), len(e.tokens)
        if best is not None:
            return best
        for e, lead, ids in candidates:           # then the longest held run the text starts with
            if not owner or e.owner != owner:
                continue
            lo, hi = 0, len(ids)                  # decode(ids[:lo]) is a prefix of text
            while lo < hi:
                mid = (lo + hi + 1) // 2
                if text.startswith(tok.decode(ids[:mid], skip_special=False)):
                    lo = mid
                else:
                    hi = mid - 1
            if lo >= MIN_PREFIX_REUSE and lead + lo > best_n:
                prefix = tok.decode(ids[:lo], skip_special=False)
                best, best_n = e.tokens[:lead + lo] + tok.encode(text[len(prefix):], add_bos=False), lead + lo
        return best

    def _drop_held(self, entry, why: str) -> None:
        """Forget a held K/V (live or parked) that fails when used, so it cannot fail later requests."""
        if entry is self.live:
            self.live = None
            self._log(f"dropped the live conversation of {len(entry.tokens)} tokens: {why}")
        else:
            self.parking.drop(entry, why)

    # ---- generation --------------------------------------------------------------------------
    def _take_kv(self, tokens: list[int], owner: str = ""):
        """The K/V to extend for `tokens`: the live one, a parked one, or a new one.

        `owner` names the conversation: a new branch of it (Regenerate, Edit and resend) takes its
        own K/V back and trims it instead of keeping the old branch in a second slot."""
        from .parking import MIN_PREFIX_REUSE, KVEntry, common_prefix
        key = self.cache_key()
        live = self.live
        if live is not None and live.key == key:
            n = common_prefix(live.tokens, tokens)
            if n == len(live.tokens):
                return live, n
            if owner and live.owner == owner:
                return live, n          # the same conversation, another branch: its slot, trimmed
            if not self.parking.enabled and n >= min(MIN_PREFIX_REUSE, len(live.tokens)):
                return live, n          # no parking: reuse the shared prefix, as llama.cpp does
        self.live = None
        if owner:
            own, n = self.parking.take_owned(owner, key, tokens)
            if own is not None:
                if live is not None and self.parking.enabled:
                    self.parking.park(live)
                return own, n
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
        from .parking import KVEntry
        self._require_model()
        req.sampling.validate()
        drafter = self._spec_drafter(req)        # speculative decoding hook (validates before any work)
        # A side request's steering is off unless it asks: a title must not read like a steered reply.
        asked = req.speed_projection if req.speed_projection is not None or not req.side else False
        self.steering.enabled = self._projection(asked)
        stats = StepStats()
        tokens = self.prompt_tokens(req)
        if len(tokens) >= self.n_ctx:
            raise RequestError(f"the prompt is {len(tokens)} tokens; the context holds {self.n_ctx}")
        if req.side:
            # Its own throwaway K/V: the conversations (live and parked) keep their places.
            entry, reuse = KVEntry([], self.make_cache(), self.cache_key()), 0
        else:
            entry, reuse = self._take_kv(tokens, req.conversation)
            entry.owner = req.conversation or entry.owner
        reuse = min(reuse, len(tokens) - 1)     # the last prompt token is always evaluated
        for c in entry.cache:
            if c.offset > reuse:
                c.trim(c.offset - reuse)
        if reuse < len(entry.tokens):
            entry.tokens = entry.tokens[:reuse]     # a new list: its held text is dropped with it
        if not req.side:
            self.live = entry                   # from here on the live K/V is `entry`
        entry.messages = list(req.messages or [])
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
        spec, steps = self._spec_steps(req, drafter, entry, tokens, max_tokens, stats, cancelled)
        for token in steps or decode(self.model, entry.cache, tokens[-1], entry.tokens, history=tokens,
                            sampler=sp.sampler(self.info.n_vocab), processors=sp.processors(), max_tokens=max_tokens,
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
                  f"{stats.decode_tps:.1f} tok/s, finish {finish}" + spec.log_suffix())
        return {**spec.result(), "tokens": out_ids, "text": text, "prompt_tokens": len(tokens), "cached_tokens": reuse,
                "generated_tokens": len(out_ids), "ttft_ms": round(stats.ttft_ms, 2),
                "prefill_tps": round(stats.prefill_tps, 2), "decode_tps": round(stats.decode_tps, 2),
                "finish_reason": finish, "speed_projection": self.steering.active}

    # ---- speculative decoding hooks (the loop and drafters live in speculative.py) -------------
    def _spec_drafter(self, req: GenerateRequest):
        """The drafter a request asks for (None: off); a draft model is loaded once and kept."""
        from . import speculative
        mode = speculative.parse_spec(req.speculative)
        if mode.kind == "off":
            return None
        if mode.kind == "lookup":
            return speculative.LookupDrafter()
        from .models import resolve_model
        path = resolve_model(mode.draft_path)
        d = self.draft
        if d is None or d.path != path or d.target_path != self.model_path:
            self.draft = None
            self.draft = speculative.load_draft(str(path), self.model_path, self.dtype, self.n_ctx, self._log)
        return self.draft

    def _spec_steps(self, req, drafter, entry, tokens, max_tokens, stats, cancelled):
        from . import speculative
        spec = speculative.SpecStats(speculative.parse_spec(req.speculative).label)
        if drafter is None:
            return spec, None
        sp = req.sampling
        return spec, speculative.decode(
            self.model, entry.cache, tokens[-1], entry.tokens, history=tokens, sampling=sp,
            processors=sp.processors(), max_tokens=max_tokens, stats=stats, spec=spec, drafter=drafter,
            seed=sp.seed, cancelled=cancelled)

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
        if req.kv_bits is not None:
            from .kv_format import choose
            if self.info is not None:
                choose(int(req.kv_bits), self.info.head_dim)      # refused here, before anything changes
            elif int(req.kv_bits) not in (16, 8, 4):
                choose(int(req.kv_bits), 64)
            self.options.kv_bits = int(req.kv_bits)
            if self.info is not None:
                self._log(f"K/V: {self.kv_fmt.describe()} for new conversations")
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
            "load_budget": _load_budget(self.guard),
            "steering": self.steering.vector.describe() if self.steering and self.steering.vector else None,
            "steering_error": self.steering_error,
            "speed_projection_default": self.options.speed_projection,
            "kv_bits": self.options.kv_bits,
            "distributed": self.dist.status() if self.dist is not None else None,
        }

    # ---- session files -----------------------------------------------------------------------
    def session_fingerprint(self, steering_fp: str | None = None) -> dict:
        """What a session file must match. `steering_fp`: the steering applied to the conversation's
        K/V (None: the setting in force); the vector's files and settings are named alongside so a
        refusal elsewhere can say which vector to load."""
        from .gguf_file import text_hash
        info = self.info
        steer = self.steering_fingerprint() if steering_fp is None else steering_fp
        vector = self.steering.vector if self.steering else None
        cfg = self.options.steering
        described = "none"
        if steer and vector is not None and steer == vector.fingerprint() and cfg is not None:
            described = json.dumps({"files": [[str(p), float(sc)] for p, sc in cfg.files],
                                    "layer_range": list(cfg.layer_range) if cfg.layer_range else None,
                                    "mode": cfg.mode, "direction": cfg.direction})
        return {"model_hash": self.model_hash, "architecture": info.architecture, "n_layer": info.n_layer,
                "n_kv_heads": info.n_head_kv, "head_dim": info.head_dim,
                "tokenizer": self.tokenizer.fingerprint, "chat_template": text_hash(self.template or ""),
                "steering": steer or "none", "steering_vector": described,
                "kv_format": self.kv_fmt.label}

    def _held(self) -> list:
        return ([self.live] if self.live is not None else []) + list(self.parking.entries)

    def _save(self, req: SaveSession, handle: Handle) -> dict:
        from . import sessions
        if self.dist is not None:                 # distributed hook: rank 0 gathers every rank's layers
            return self.dist.save(self, req, handle)
        self._require_model()
        reason = self.guard.unavailable_reason()
        if reason:
            raise RequestError(f"session save refused: {reason}")
        entry, reread = self.live, False
        if req.messages is not None:
            keys = None if req.speed_projection is None else {self.cache_key(self._projection(req.speed_projection))}
            entry = next((e for e in self._held() if e.messages == req.messages
                          and (keys is None or e.key in keys)), None)
            if entry is None:
                entry, reread = self._read_again(req, handle), True
        if entry is None or not entry.tokens:
            raise RequestError("there is no conversation to save")
        steer = entry.key.split("|")[1]
        result = sessions.save(req.path, entry, self.session_fingerprint("" if steer == "no-steering" else steer),
                               sync=req.sync, force=req.force, progress=lambda d, t: handle.emit(Progress("save", d, t)), log=self._log)
        return {**result, "reread": reread, "speed_projection": steer != "no-steering"}

    def _read_again(self, req: SaveSession, handle: Handle):
        """A conversation whose K/V is no longer held (evicted, or from before a restart): read its
        messages again, with the steering asked for, into a new live K/V (progress "prefill",
        cancellable), then it is saved like any other."""
        from .chat_template import render
        from .generate import prefill
        from .parking import KVEntry
        if not req.messages or not any(m.get("role") != "system" for m in req.messages):
            raise RequestError("there is no conversation to save")
        self.steering.enabled = self._projection(req.speed_projection)
        tok = self.tokenizer
        bos = tok.token_text(tok.bos_id) if tok.bos_id is not None else ""
        # As it was held after its last reply: no generation prompt at the end, so a follow-up
        # (rendered with one) extends these tokens.
        text = render(self.template, req.messages, bos_token=bos, add_generation_prompt=False,
                      eos_token=tok.token_text(min(tok.eos_ids)) if tok.eos_ids else "")
        add_bos = tok.add_bos and not (bos and text.startswith(bos))
        tokens = tok.encode(text, add_bos=add_bos)
        if len(tokens) >= self.n_ctx:
            raise RequestError(f"the conversation is {len(tokens)} tokens; the context holds {self.n_ctx}")
        self._log(f"{req.conversation or 'save'}: K/V not held, reading {len(tokens)} tokens again")
        entry = KVEntry([], self.make_cache(), self.cache_key(), messages=list(req.messages),
                        owner=req.conversation)
        prefill(self.model, entry.cache, tokens, entry.tokens, chunk=self.options.prefill_chunk,
                progress=lambda d, t: handle.emit(Progress("prefill", d, t)), cancelled=lambda: handle.cancelled)
        if self.live is not None and self.parking.enabled:
            self.parking.park(self.live)
        self.live = entry
        return entry

    def _clean_session_folder(self) -> None:
        """Temporary files of saves killed in an earlier run (only those no live save holds)."""
        from . import sessions
        from .paths import sessions_dir
        folder = sessions_dir()
        if folder.is_dir():
            sessions.remove_stale_parts(folder, self._log)

    def _restore(self, req: RestoreSession, handle: Handle) -> dict:
        from . import sessions
        if self.dist is not None:                 # distributed hook: rank 0 reads, each rank gets its layers
            return self.dist.restore(self, req, handle)
        self._require_model()
        reason = self.guard.unavailable_reason()
        if reason:
            raise RequestError(f"session restore refused: {reason}")
        # Validated (every field, the checksum over every byte, token ids, the memory guard) before
        # it is kept: a refused file never becomes the live or a parked entry.
        name = Path(req.path).expanduser().name
        _, meta, _ = sessions.read_header(req.path)
        theirs = meta.get("fp.steering") or "none"
        expected = self.session_fingerprint("")
        # Model, geometry and tokenizer first: a file from another model is refused for that.
        sessions.check_fingerprint(name, meta, dict(expected, steering=theirs))
        projection = self._session_projection(name, theirs, meta.get("fp.steering_vector"), req.speed_projection)
        steer = self.steering_fingerprint(projection)
        entry, result = sessions.load(req.path, dict(expected, steering=steer or "none"), self.make_cache,
                                      key=self.cache_key(projection), dtype=self.dtype,
                                      n_vocab=self.info.n_vocab, n_ctx=self.n_ctx, admit=self.guard.admit,
                                      progress=lambda d, t: handle.emit(Progress("restore", d, t)),
                                      log=self._log)
        entry.owner = req.conversation
        # Validated and read: only now does the live conversation step aside.
        if self.live is not None and self.parking.enabled:
            self.parking.park(self.live)
        self.live = entry
        return {**result, "speed_projection": bool(steer), "steering": None if not steer else {
            "fingerprint": steer, **_vector_spec(meta.get("fp.steering_vector"))}}

    def _session_projection(self, name: str, theirs: str, spec: str | None, asked: bool | None) -> bool:
        """The projection setting that reproduces a file's steering, or a one-line refusal that
        names the vector the file needs."""
        vector = self.steering.vector if self.steering else None
        ours = vector.fingerprint() if vector is not None else ""
        if asked is not None:
            asked = bool(asked) and vector is not None     # no vector: the switch changes nothing
        if theirs == "none" and not asked:
            return False
        if theirs != "none" and theirs == ours and asked is not False:
            return True
        now = "no control vector" if not ours else f"control vector {ours[:12]}"
        if asked is not None:
            now = f"now {now} with the projection {'on' if asked else 'off'}"
        else:
            now = f"now {now}"
        if theirs == "none":
            raise SessionFileError(f"{name} was saved with another steering setting (no control vector; {now})")
        named = _describe_vector(_vector_spec(spec))
        hint = f"load {named} to restore it" if named else "load the control vector it was saved with"
        raise SessionFileError(f"{name} was saved with another steering setting (control vector "
                               f"{theirs[:12]}{': ' + named if named else ''}; {now}); {hint}")


def _vector_spec(raw: str | None) -> dict:
    """The steering a session file names (files, layer_range, mode, direction), {} when none."""
    if not raw or raw == "none":
        return {}
    try:
        spec = json.loads(raw)
    except ValueError:
        return {}
    return spec if isinstance(spec, dict) else {}


def _describe_vector(spec: dict) -> str:
    files = spec.get("files") or []
    if not files:
        return ""
    names = ", ".join(f"{Path(str(p)).name} x{float(sc):g}" for p, sc in files)
    lr = spec.get("layer_range")
    layers = f", layers {lr[0]}..{lr[1]}" if lr else ""
    return f"{names} ({spec.get('mode', 'add')}{layers})"


def _load_budget(guard) -> dict | None:
    """What a model may take (engine/memory_estimate.py), for the app, which cannot ask MLX."""
    from .memory_estimate import gpu_working_set, load_budget
    b = load_budget(guard, gpu_working_set())
    return None if b is None else {"bytes": b.bytes, "source": b.source}


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
