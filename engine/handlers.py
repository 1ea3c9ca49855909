"""What each request does, on the engine thread: the model and its load, the K/V identity (model,
steering, K/V format), generation, session files, settings and status.

`Engine` (engine/engine.py) owns the thread and the dispatch and holds one `RequestHandlers(engine)`; the held
conversations are `self.conversations` (engine/conversations.py), the decode loop with its stop strings
and stats is engine/generate.py. Everything here runs on the engine thread only.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

from .api import (CaptureStates, CapturedStates, Configure, CountTokens, EngineStatus, GenerateRequest,
                  Generation, LoadModel, ModelFacts, ModelLoaded, RestoreSession, SaveSession,
                  SessionRestored, SessionSaved, SessionSteering, SessionSteeringInfo, TokenCount, model_id)
from .errors import ContextTooLong, MemoryRefused, RequestError, SessionSteeringRefused, VectorSpec
from .events import Handle, KVChanged, Progress, Token

MAX_CHARS_PER_TOKEN = 32


class RequestHandlers:
    """One method per request, and the queries they share (the K/V identity, the prompt's tokens).
    What they read and replace is the engine's (`loaded`, `conversations`, `guard`, `serving`), so a
    handler never keeps a value that a load or another request has since replaced; its own state is
    the measured prefill pace (per model). Speculation's state is engine/drafts.py's."""

    def __init__(self, engine):
        self.eng = engine
        self._pace = None           # (model, generate.PrefillPace) measured for the loaded model

    # ---- model -------------------------------------------------------------------------------
    def load(self, req: LoadModel, handle: Handle) -> ModelLoaded:
        import mlx.core as mx

        from . import steering
        from .device import compute_dtype
        from .gguf_file import content_hash, open_gguf
        from .memory_estimate import fit_for_load, gpu_working_set
        from .models import resolve_model
        from .tokenizer import load_tokenizer

        path = resolve_model(req.path)
        g = open_gguf(path)
        self.eng.drafts.release("a model load")      # drafts for the old target; its memory counts for the fit
        self.eng.drafts.forget_mtp()
        handle.emit(Progress("load", 0, len(g.reader.tensors)))
        tokenizer = load_tokenizer(g)
        dtype = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}.get(
            self.eng.options.dtype or "", compute_dtype())
        # Refuse (or shrink the default context) before any tensor is read when it cannot fit.
        n_ctx, memory_line = fit_for_load(path, self.eng.options.context_length, str(dtype).rsplit(".", 1)[-1],
                                          self.eng.guard, gpu_working_set())
        progress = lambda d, t: handle.emit(Progress("load", d, t))  # noqa: E731
        model, info = self.eng.serving.load_model(g, dtype, progress)   # distributed: this rank's part
        steer_cfg = self.eng.options.steering if req.steering == "keep" else req.steering
        vector, steering_error = None, None
        if steer_cfg is not None and getattr(steer_cfg, "files", ()):
            from .control_vector import ControlVector, ControlVectorError
            try:
                vector = ControlVector.load(steer_cfg, info.n_layer, info.n_embd)
            except ControlVectorError as e:
                # A vector made for another model must not cost the user the model: serve without it.
                steering_error = str(e)
        from .kv_format import choose_for
        from .loaded_model import LoadedModel
        # --kv-bits this head size or this attention cannot take: refused
        kv_format = choose_for(model, self.eng.options.kv_bits, info.head_dim)
        # A draft named with the load is built with it, as one unit (mlx-lm's ModelProvider): one that
        # cannot load (no such file, another vocabulary, no memory left) refuses the whole load.
        draft = self.eng.drafts.load(req.draft, path, dtype, n_ctx) if req.draft else None
        model_hash = content_hash(path)
        from .chat_template import generation_prompt
        from .reasoning import opens_think
        template = g.get("tokenizer.chat_template")
        facts = ModelFacts(model_path=str(path), model_id=model_id(path), name=getattr(info, "name", "") or "",
                           info=dict(info.__dict__), n_ctx=n_ctx, model_hash=model_hash,
                           distributed=self.eng.serving.status(),
                           think_open=opens_think(generation_prompt(template if isinstance(template, str) else None)))
        # Everything validated: swap in the new load whole (a failed load above leaves the old one serving).
        self.eng.options.steering = steer_cfg
        self.eng.loaded = LoadedModel(
            model=model, tokenizer=tokenizer, info=info, path=path, template=template,
            model_hash=model_hash, n_ctx=n_ctx, dtype=dtype, kv_format=kv_format,
            steering=steering.SteeringState(vector, speed_projection=bool(vector) and self.eng.options.speed_projection),
            steering_error=steering_error, facts=facts, draft=draft)
        if vector is not None:
            # Wrapped only when a vector is loaded: without one a decode step pays for no wrapper.
            steering.install(self.eng.model, self.eng.steering)
            # Compile the steering kernel now (seconds on a GPU's first use), not in a request.
            secs = steering.warm_up(vector, dtype)
            self.eng.log(f"control vector op ({steering.active_backend()}) compiled in {secs * 1e3:.0f} ms")
        self.eng.serving.after_load(self.eng)
        self.eng.conversations.clear()
        reserved = self._touch_kv_memory(info, dtype)
        self.eng.log(f"model: {path.name} ({info.architecture}, {info.n_layer} layers, "
                  f"{info.n_params / 1e6:.0f}M params, {info.file_type}), context {self.eng.n_ctx}, "
                  f"compute {str(dtype).removeprefix('mlx.core.')}")
        self.eng.log(f"weights: {info.load_note}")
        self.eng.log(memory_line)
        asked = self.eng.options.context_length
        if asked and asked > n_ctx and info.context_length <= n_ctx:
            # Capped to the model's own context: said on stderr (a warning), not only in the -v log.
            import logging

            from .events import Log
            note = (f"context: {asked} tokens asked, but {path.name} holds at most {n_ctx}: "
                    f"using {n_ctx}")
            logging.getLogger("strata").warning(note)
            handle.emit(Log(note))
        self.eng.log(f"K/V: {self.eng.kv_fmt.describe()}")
        self.eng.log(reserved.note)
        if self.eng.serving.describe():
            self.eng.log(self.eng.serving.describe())
        if vector is not None:
            self.eng.log(vector.describe())
        if steering_error:
            self.eng.log(f"control vector refused: {steering_error}; serving without it")
        return ModelLoaded(model=str(path), info=info.__dict__, steering_error=steering_error, facts=self.eng.facts,
                           draft=str(draft.path) if draft is not None else None)

    def _touch_kv_memory(self, info, dtype):
        """On the CPU, one context's K/V (capped) allocated and freed at load, as llama.cpp's context
        creation does, so a restore into this new process does not pay for fresh pages (kv_reserve.py)."""
        from . import kv_reserve
        from .device import on_gpu
        self.eng.kv_topup.use(None)
        if on_gpu():
            return kv_reserve.Reserved.none("the K/V lives in GPU memory")
        if self.eng.serving.distributed or self.eng.kv_fmt.quantized:
            return kv_reserve.Reserved.none("distributed or quantized K/V")
        reserved = kv_reserve.touch(self.eng.n_ctx, info.n_layer, info.n_head_kv, info.head_dim, dtype,
                                    admit=self.eng.guard.admit)
        # ... and touched again in idle time once restores or prefills have used it (kv_reserve.IdleTopUp)
        self.eng.kv_topup.use(kv_reserve.TopUp.of(reserved, admit=self.eng.guard.admit))
        return reserved

    def steering_fingerprint(self, projection: bool | None = None) -> str:
        """The steering identity of K/V computed with `projection` (None: the setting in force):
        the loaded vector's fingerprint when it is applied, '' when not."""
        vector = self.eng.steering.vector if self.eng.steering else None
        if vector is None:
            return ""
        on = self.eng.steering.speed_projection if projection is None else projection
        return vector.fingerprint() if on else ""

    def cache_key(self, projection: bool | None = None):
        """What the K/V depends on (a kv_key.KVKey): the model's content, the steering applied to it
        (under `projection`; None: the setting in force) and the K/V format."""
        from .kv_key import KVKey
        return KVKey(self.eng.model_hash, self.steering_fingerprint(projection), self.eng.kv_fmt.label)

    def _projection(self, requested: bool | None) -> bool:
        return bool(self.eng.steering.vector) and (
            self.eng.options.speed_projection if requested is None else bool(requested))

    def make_cache(self) -> list:
        from .kv_format import make_cache
        return make_cache(self.eng.model, self.eng.kv_fmt)

    def prompt_tokens(self, req: GenerateRequest) -> list[int]:
        from .chat_template import render
        tok = self.eng.tokenizer
        # A huge body must not cost a tokenization (or a template render) to be refused: no real
        # tokenizer averages more than MAX_CHARS_PER_TOKEN characters a token.
        chars = len(req.prompt) if req.prompt is not None else sum(
            len(str(m.get("content") or "")) for m in req.messages or [] if isinstance(m, dict))
        if chars > self.eng.n_ctx * MAX_CHARS_PER_TOKEN:
            raise ContextTooLong(f"the prompt is {chars} characters (over {chars // MAX_CHARS_PER_TOKEN} tokens); "
                               f"the context holds {self.eng.n_ctx}")
        if req.prompt is not None:
            return tok.encode(req.prompt)
        if not req.messages:
            raise RequestError("a request needs messages or a prompt")
        bos = tok.token_text(tok.bos_id) if tok.bos_id is not None else ""
        text = render(self.eng.template, req.messages, bos_token=bos,
                      eos_token=tok.token_text(min(tok.eos_ids)) if tok.eos_ids else "",
                      name=f"the chat template of {self.eng.model_path.name}" if self.eng.template else "",
                      tools=getattr(req, "tools", None))
        # A template that writes BOS itself must not get a second one.
        add_bos = tok.add_bos and not (bos and text.startswith(bos))
        return (self.eng.conversations.continue_tokens(tok, text, add_bos, req.conversation, self.cache_key())
                or tok.encode_prompt(text, add_bos=add_bos))

    def prefill_pace(self):
        """The loaded model's measured prefill speed (generate.PrefillPace: the CPU's chunk cap), kept
        from request to request and started afresh for each model."""
        from .generate import PrefillPace
        pace = self._pace
        if pace is None or pace[0] is not self.eng.model:
            pace = self._pace = (self.eng.model, PrefillPace(self.eng.info.n_layer if self.eng.info else 1))
        return pace[1]

    def take_kv(self, tokens: list[int], owner: str = ""):
        """The K/V to extend for `tokens` (engine/conversations.py) under the current K/V identity."""
        return self.eng.conversations.take(tokens, owner, self.cache_key(), self.make_cache)

    # ---- generation --------------------------------------------------------------------------
    def generate(self, req: GenerateRequest, handle: Handle) -> Generation:
        from .generate import reply
        turn = self.begin_turn(req, handle)
        entry, tokens, reuse, stats = turn.entry, turn.tokens, turn.reuse, turn.stats
        cancelled = lambda: handle.cancelled  # noqa: E731
        spec, steps = self.eng.drafts.steps(req, turn.drafter, entry, tokens, turn.max_tokens, stats, cancelled,
                                       constraint=turn.constraint)
        # mtp: the prompt's prefill too goes through the tap (the head reads its hidden states)
        r = reply(getattr(turn.drafter, "target", self.eng.model), entry, tokens, reuse, tokenizer=self.eng.tokenizer,
                  sampling=req.sampling,
                  n_vocab=self.eng.info.n_vocab, max_tokens=turn.max_tokens, chunk=self.eng.options.prefill_chunk,
                  on_token=lambda t, text: handle.emit(Token(t, text)),
                  on_progress=lambda d, t: handle.emit(Progress("prefill", d, t)),
                  cancelled=cancelled, steps=steps, stats=stats, pace=self.prefill_pace(),
                  layerwise=not self.eng.serving.distributed, constraint=turn.constraint,
                  marks=self.message_marks(req, entry, tokens))
        self.eng.drafts.done(req, turn.drafter, spec, r)
        if steps is not None:
            steps.close()       # speculation's finally cuts undelivered drafts now, before the checkpoint
        entry.checkpoint()      # a finished reply is a message boundary (none for full K/V)
        return self.end_turn(turn, r, spec)

    def message_marks(self, req: GenerateRequest, entry, tokens: list[int]) -> list[int]:
        """Where in `tokens` the prefill takes a checkpoint besides the prompt's end (engine/layer_cache.py's
        policy; none for a cache that trims freely): the start and the end of the last message, as the
        history renders without a generation prompt. A template that renders a past reply otherwise
        than it was generated (Qwen3.5's dropped thinking, harmony's channels) makes the next turn
        diverge right after the last message's end, before the prompt's end: these are the points an
        Edit or the next turn shares."""
        from . import layer_cache
        from .chat_template import render
        from .parking import common_prefix
        if not req.messages or req.prompt is not None or not layer_cache.needs_checkpoints(entry.cache):
            return []
        tok = self.eng.tokenizer
        bos = tok.token_text(tok.bos_id) if tok.bos_id is not None else ""
        eos = tok.token_text(min(tok.eos_ids)) if tok.eos_ids else ""
        marks = []
        for msgs in (req.messages[:-1], req.messages):
            if not msgs:
                continue
            text = render(self.eng.template, msgs, bos_token=bos, eos_token=eos, add_generation_prompt=False,
                          tools=getattr(req, "tools", None))
            add_bos = tok.add_bos and not (bos and text.startswith(bos))
            marks.append(common_prefix(tokens, tok.encode_prompt(text, add_bos=add_bos)))
        return marks

    # The turn API (continuous batching, engine/batching.py): generate split in two so a batched row
    # prepares and finishes its turn exactly as a lone request does; `batched` checks the K/V out
    # (engine/conversations.py `busy`) instead of making it the live one.
    def begin_turn(self, req: GenerateRequest, handle: Handle, batched: bool = False):
        """Everything before the reply's prefill: validation, the prompt's tokens, the K/V taken and
        trimmed to what it reuses (a `Turn`)."""
        from .generate import StepStats
        from .parking import KVEntry
        self.eng.require_model()
        req.sampling.validate()
        drafter = self.eng.drafts.drafter_for(req)        # speculative decoding hook (validates before any work)
        constraint = None
        if req.constraint is not None:           # the grammar (engine/constraints.py), before any work
            from .constraints import compile as compile_constraint
            constraint = compile_constraint(req.constraint, self.eng.tokenizer)
        # A side request's steering is off unless it asks: a title must not read like a steered reply.
        asked = req.speed_projection if req.speed_projection is not None or not req.side else False
        self.eng.steering.speed_projection = self._projection(asked)
        stats = StepStats()
        tokens = self.prompt_tokens(req)
        if len(tokens) >= self.eng.n_ctx:
            raise ContextTooLong(f"the prompt is {len(tokens)} tokens; the context holds {self.eng.n_ctx}")
        if req.side:
            # Its own throwaway K/V: the conversations (live and parked) keep their places.
            entry, reuse = KVEntry([], self.make_cache(), self.cache_key()), 0
        else:
            entry, reuse = self.take_kv(tokens, req.conversation)
            entry.owner = req.conversation or entry.owner
        reuse = min(reuse, len(tokens) - 1)     # the last prompt token is always evaluated
        # Cut back through the cache contract: a trim, or for a cache that cannot be cut back there
        # (a recurrent state, a wrapped window) its latest checkpoint at or before, else from scratch.
        reuse = entry.rewind(reuse, self.make_cache)
        if batched and not req.side:
            self.eng.conversations.check_out(entry)   # held by the batch (engine/batching.py) until it ends
        elif not req.side:
            self.eng.conversations.live = entry     # from here on the live K/V is `entry`
        from_disk, entry.restored_from_disk = min(entry.restored_from_disk, reuse), 0
        if self.eng.parking is not None:            # the status bar's figures while the reply runs
            handle.emit(KVChanged(self.eng.parking.status(), req.conversation, len(tokens), reuse, from_disk))
        entry.messages = list(req.messages or [])
        max_tokens = min(req.sampling.max_tokens, self.eng.n_ctx - len(tokens))
        return Turn(req, entry, tokens, reuse, max_tokens, stats, drafter, constraint, from_disk,
                    self.eng.steering.active)

    def end_turn(self, turn: "Turn", r, spec=None) -> Generation:
        """The reply's messages on its K/V entry, the log line and the Generation."""
        req, stats, tokens = turn.req, turn.stats, turn.tokens
        turn.entry.messages = list(req.messages or []) + (
            [{"role": "assistant", "content": r.text}] if req.messages else [])
        self.eng.log(f"{req.conversation or 'request'}: prompt {len(tokens)} (cached {turn.reuse}), "
                  f"{len(r.tokens)} generated, ttft {stats.ttft_ms:.0f} ms, "
                  f"{stats.decode_tps:.1f} tok/s, finish {r.finish}" + (spec.log_suffix() if spec else ""))
        return Generation.from_dict(spec.result() if spec else {}, tokens=r.tokens, text=r.text,
                                    prompt_tokens=len(tokens), cached_tokens=turn.reuse,
                                    generated_tokens=len(r.tokens),
                                    ttft_ms=round(stats.ttft_ms, 2), prefill_tps=round(stats.prefill_tps, 2),
                                    decode_tps=round(stats.decode_tps, 2), finish_reason=r.finish,
                                    speed_projection=turn.projection, restored_from_disk=turn.from_disk)

    # ---- settings, status --------------------------------------------------------------------
    def configure(self, req: Configure) -> EngineStatus:
        """Applied whole or not at all: the bounds were checked when `req` was built (engine/limits.py);
        what only the loaded model can refuse (a K/V width its head size cannot take) is checked first."""
        kv_format = self._kv_format_for(req.kv_bits) if req.kv_bits is not None else None
        if req.cache_mib is not None or req.cache_slots is not None:
            cap = self.eng.parking.cap_bytes >> 20 if req.cache_mib is None else req.cache_mib
            slots = self.eng.parking.slots if req.cache_slots is None else req.cache_slots
            self.eng.parking.set_limits(cap, slots)
            self.eng.options.cache_mib, self.eng.options.cache_slots = cap, slots
            self.eng.log(f"conversation cache: {cap} MiB, {slots} slots")
        if req.disk_mib is not None and self.eng.disk is not None:
            self.eng.options.disk_mib = req.disk_mib
            self.eng.disk.set_cap(self.eng.options.disk_mib)
            self.eng.log(f"conversation disk cache: {self.eng.options.disk_mib} MiB")
        if req.speed_projection is not None:
            self.eng.options.speed_projection = bool(req.speed_projection)
        if req.kv_bits is not None:
            self.eng.options.kv_bits = req.kv_bits
            if kv_format is not None:
                self.eng.loaded = self.eng.loaded.with_kv_format(kv_format)
                self.eng.log(f"K/V: {self.eng.kv_fmt.describe()} for new conversations")
        return self.status()

    def _kv_format_for(self, bits: int):
        """The loaded model's K/V format at `bits` (None when no model is loaded: the width alone counts,
        checked with the request); a width this model cannot take is refused naming the setting."""
        from .kv_format import choose_for
        from .limits import CacheLimitError
        if self.eng.loaded is None or self.eng.info is None:
            return None
        try:
            return choose_for(self.eng.model, bits, self.eng.info.head_dim)
        except RequestError as e:
            raise CacheLimitError(str(e), "kv_bits") from None

    def cache_limits(self):
        from .limits import cache_range
        reading = self.eng.guard.reading()
        return cache_range(reading.total_bytes if reading is not None else None)

    def status(self) -> EngineStatus:
        from .limits import cache_range
        reading = self.eng.guard.reading()
        live = self.eng.live
        return EngineStatus(
            cache_mib_max=cache_range(reading.total_bytes if reading is not None else None).max_mib,
            model=str(self.eng.model_path) if self.eng.model_path else None,
            facts=self.eng.facts,
            info=self.eng.info.__dict__ if self.eng.info else None,
            context_length=self.eng.n_ctx,
            live_tokens=len(live.tokens) if live else 0,
            live_messages=list(live.messages) if live else [],
            conversations=self.eng.conversations.summary() if self.eng.conversations is not None else [],
            parking=self.eng.parking.status() if self.eng.parking else None,
            memory=None if reading is None else {
                "total_bytes": reading.total_bytes, "available_bytes": reading.available_bytes,
                "source": reading.source},
            memory_unavailable=self.eng.guard.unavailable_reason(),
            load_budget=_load_budget(self.eng.guard),
            steering=self.eng.steering.vector.describe() if self.eng.steering and self.eng.steering.vector else None,
            steering_error=self.eng.steering_error,
            speed_projection_default=self.eng.options.speed_projection,
            kv_bits=self.eng.options.kv_bits,
            distributed=self.eng.serving.status(),
            disk=self.eng.disk.status() if getattr(self.eng, "disk", None) is not None else None,
        )

    def count_tokens(self, req: CountTokens) -> TokenCount:
        self.eng.require_model()
        return TokenCount(len(self.prompt_tokens(GenerateRequest(messages=req.messages, prompt=req.prompt,
                                                                 tools=req.tools))))

    def session_steering(self, req: SessionSteering) -> SessionSteeringInfo:
        from .sessions import read_header
        return SessionSteeringInfo(_vector_spec(read_header(req.path)[1].get("fp.steering_vector")))

    def capture(self, req: CaptureStates, handle: Handle) -> CapturedStates:
        import numpy as np

        from .capture import last_token_states
        self.eng.require_model()
        t0 = time.perf_counter()
        first: list = []
        states = last_token_states(self.eng, req.prompts, lambda d, t: handle.emit(Progress("capture", d, t)), first)
        return CapturedStates(last=states, first=np.stack(first) if first else None,
                              architecture=self.eng.info.architecture, seconds=time.perf_counter() - t0)

    # ---- session files -----------------------------------------------------------------------
    def session_fingerprint(self, steering_fp: str | None = None) -> dict:
        """What a session file must match. `steering_fp`: the steering applied to the conversation's
        K/V (None: the setting in force); the vector's files and settings are named alongside so a
        refusal elsewhere can say which vector to load."""
        from .gguf_file import text_hash
        info = self.eng.info
        steer = self.steering_fingerprint() if steering_fp is None else steering_fp
        vector = self.eng.steering.vector if self.eng.steering else None
        cfg = self.eng.options.steering
        described = "none"
        if steer and vector is not None and steer == vector.fingerprint() and cfg is not None:
            described = json.dumps({"files": [[str(p), float(sc)] for p, sc in cfg.files],
                                    "layer_range": list(cfg.layer_range) if cfg.layer_range else None,
                                    "mode": cfg.mode, "direction": cfg.direction})
        return {"model_hash": self.eng.model_hash, "architecture": info.architecture, "n_layer": info.n_layer,
                "n_kv_heads": info.n_head_kv, "head_dim": info.head_dim,
                "tokenizer": self.eng.tokenizer.fingerprint, "chat_template": text_hash(self.eng.template or ""),
                "steering": steer or "none", "steering_vector": described,
                "kv_format": self.eng.kv_fmt.label}

    def save(self, req: SaveSession, handle: Handle) -> SessionSaved:
        from . import sessions
        self.eng.require_model()
        reason = self.eng.guard.unavailable_reason()
        if reason:
            raise MemoryRefused(f"session save refused: {reason}")
        entry, reread = self.eng.live, False
        if req.messages is not None:
            keys = None if req.speed_projection is None else {self.cache_key(self._projection(req.speed_projection))}
            entry = self.eng.conversations.find(req.messages, keys, req.conversation)
            if entry is None:
                entry, reread = self._read_again(req, handle), True
        if entry is None or not entry.tokens:
            raise RequestError("there is no conversation to save")
        steer = entry.key.steering                # the steering its K/V was computed with
        result = sessions.save(req.path, entry, self.session_fingerprint(steer),
                               sync=req.sync, force=req.force, progress=lambda d, t: handle.emit(Progress("save", d, t)), log=self.eng.log)
        return SessionSaved.from_dict(result, reread=reread, speed_projection=entry.key.steered)

    def _read_again(self, req: SaveSession, handle: Handle):
        """A conversation whose K/V is no longer held (evicted, or from before a restart): read its
        messages again, with the steering asked for, into a new live K/V (progress "prefill",
        cancellable), then it is saved like any other."""
        from .chat_template import render
        from .generate import prefill
        from .parking import KVEntry
        if not req.messages or not any(m.get("role") != "system" for m in req.messages):
            raise RequestError("there is no conversation to save")
        self.eng.steering.speed_projection = self._projection(req.speed_projection)
        tok = self.eng.tokenizer
        bos = tok.token_text(tok.bos_id) if tok.bos_id is not None else ""
        # As it was held after its last reply: no generation prompt at the end, so a follow-up
        # (rendered with one) extends these tokens.
        text = render(self.eng.template, req.messages, bos_token=bos, add_generation_prompt=False,
                      eos_token=tok.token_text(min(tok.eos_ids)) if tok.eos_ids else "")
        add_bos = tok.add_bos and not (bos and text.startswith(bos))
        tokens = tok.encode_prompt(text, add_bos=add_bos)
        if len(tokens) >= self.eng.n_ctx:
            raise ContextTooLong(f"the conversation is {len(tokens)} tokens; the context holds {self.eng.n_ctx}")
        self.eng.log(f"{req.conversation or 'save'}: K/V not held, reading {len(tokens)} tokens again")
        entry = KVEntry([], self.make_cache(), self.cache_key(), messages=list(req.messages),
                        owner=req.conversation)
        prefill(self.eng.model, entry.cache, tokens, entry.tokens, chunk=self.eng.options.prefill_chunk,
                progress=lambda d, t: handle.emit(Progress("prefill", d, t)), cancelled=lambda: handle.cancelled,
                pace=self.prefill_pace(), layerwise=not self.eng.serving.distributed)
        self.eng.conversations.make_live(entry)
        return entry

    def clean_session_folder(self) -> None:
        """Temporary files of saves killed in an earlier run (only those no live save holds)."""
        from . import sessions
        from .paths import sessions_dir
        folder = sessions_dir()
        if folder.is_dir():
            sessions.remove_stale_parts(folder, self.eng.log)

    def restore(self, req: RestoreSession, handle: Handle) -> SessionRestored:
        from . import sessions
        self.eng.require_model()
        reason = self.eng.guard.unavailable_reason()
        if reason:
            raise MemoryRefused(f"session restore refused: {reason}")
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
                                      key=self.cache_key(projection), dtype=self.eng.dtype,
                                      n_vocab=self.eng.info.n_vocab, n_ctx=self.eng.n_ctx, admit=self.eng.guard.admit,
                                      progress=lambda d, t: handle.emit(Progress("restore", d, t)),
                                      log=self.eng.log, probe_cache=self._cache_probe)
        entry.owner = req.conversation
        # Validated and read: only now does the live conversation step aside.
        self.eng.conversations.make_live(entry)
        return SessionRestored.from_dict(result, speed_projection=bool(steer), steering=None if not steer else {
            "fingerprint": steer, **_vector_spec(meta.get("fp.steering_vector"))})

    def _cache_probe(self) -> list:
        """This model's cache after one token: what a format-3 session file's layers are checked against."""
        from .session_v3 import probe
        return probe(self.eng.model, self.make_cache)

    def _session_projection(self, name: str, theirs: str, spec: str | None, asked: bool | None) -> bool:
        """The projection setting that reproduces a file's steering, or a one-line refusal that
        names the vector the file needs."""
        vector = self.eng.steering.vector if self.eng.steering else None
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
            raise SessionSteeringRefused(f"{name} was saved with another steering setting (no control vector; {now})")
        needed = VectorSpec.of(_vector_spec(spec))      # the refusal carries it: the app offers it as is
        named = needed.describe() if needed is not None else ""
        hint = f"load {named} to restore it" if named else "load the control vector it was saved with"
        raise SessionSteeringRefused(f"{name} was saved with another steering setting (control vector "
                                     f"{theirs[:12]}{': ' + named if named else ''}; {now}); {hint}", needed)


@dataclass
class Turn:
    """One generate request between begin_turn and end_turn: its K/V entry (holding tokens[:reuse]),
    the prompt's tokens, the reply's length cap and timing, and what was decided before any work."""
    req: GenerateRequest
    entry: object                   # parking.KVEntry
    tokens: list[int]
    reuse: int
    max_tokens: int
    stats: object                   # generate.StepStats
    drafter: object = None
    constraint: object = None
    from_disk: int = 0
    projection: bool = False        # the control vector applies to this turn's K/V


def _vector_spec(raw: str | None) -> dict:
    """The steering a session file names (files, layer_range, mode, direction), {} when none."""
    if not raw or raw == "none":
        return {}
    try:
        spec = json.loads(raw)
    except ValueError:
        return {}
    return spec if isinstance(spec, dict) else {}


def _load_budget(guard) -> dict | None:
    """What a model may take (engine/memory_estimate.py), for the app, which cannot ask MLX."""
    from .memory_estimate import gpu_working_set, load_budget
    b = load_budget(guard, gpu_working_set())
    return None if b is None else {"bytes": b.bytes, "source": b.source}


