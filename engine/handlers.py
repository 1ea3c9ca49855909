"""What each request does, on the engine thread: the K/V identity (model, steering, K/V format), a lone
generation (through the turn API, engine/turns.py, that a batched row shares), settings, status and
counts. The prompt's tokens are engine/prompts.py's, the model load engine/model_load.py's, the
session-file requests engine/session_files/session_requests.py's.

`Engine` (engine/engine.py) owns the thread and the dispatch and holds one `RequestHandlers(engine)`; the held
conversations are `self.conversations` (engine/cache/conversations.py), the decode loop with its stop strings
and stats is engine/generation/generate.py. Everything here runs on the engine thread only.
"""
from __future__ import annotations

import dataclasses
import time
from contextlib import nullcontext
from dataclasses import asdict
import numpy as np

from engine.api import (CaptureStates, CapturedStates, Configure, CountTokens, EngineStatus, GenerateRequest,
                        Generation, TokenCount)
from engine.errors import RequestError
from engine.events import Handle, Progress, Token
from engine.steer.capture import last_token_states
from engine.generation.generate import reply
from engine.cache.kv_format import choose_for, make_cache
from engine.cache.kv_key import KVKey
from engine.limits import CacheLimitError, cache_range
from engine.model.memory_estimate import gpu_working_set, load_budget
from engine.text.image_tokens import has_images


class RequestHandlers:
    """One method per request, and the queries they share (the K/V identity, the prompt's tokens).
    What they read and replace is the engine's (`loaded`, `conversations`, `guard`, `serving`), so a
    handler never keeps a value that a load or another request has since replaced; its own state is
    the measured prefill pace (per model). Speculation's state is engine/drafts.py's."""

    def __init__(self, engine):
        self.eng = engine

    # ---- model -------------------------------------------------------------------------------
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
        return KVKey(self.eng.model_hash, self.steering_fingerprint(projection), self.eng.kv_fmt.label)

    def projection(self, requested: bool | None) -> bool:
        return bool(self.eng.steering.vector) and (
            self.eng.in_force.speed_projection if requested is None else bool(requested))

    def make_cache(self) -> list:
        return make_cache(self.eng.model, self.eng.kv_fmt)

    # ---- generation --------------------------------------------------------------------------
    def generate(self, req: GenerateRequest, handle: Handle) -> Generation:
        turn = self.eng.turns.begin_turn(req, handle)
        entry, tokens, reuse, stats = turn.entry, turn.tokens, turn.reuse, turn.stats
        cancelled = lambda: handle.cancelled  # noqa: E731
        spec, steps = self.eng.drafts.steps(req, turn.drafter, entry, tokens, turn.max_tokens, stats, cancelled,
                                       constraint=turn.constraint)
        spec.stopped = spec.stopped or turn.spec_off
        images = self.eng.loaded.vision if has_images(tokens) else None
        # where a family places text after an image by its grid (Qwen's M-RoPE), the turn's positions
        with images.text_positions(self.eng.model, entry.tokens) if images is not None else nullcontext():
            # mtp: the prompt's prefill too goes through the tap (the head reads its hidden states)
            r = reply(getattr(turn.drafter, "target", self.eng.model), entry, tokens, reuse,
                      tokenizer=self.eng.tokenizer, sampling=req.sampling,
                      n_vocab=self.eng.info.n_vocab, max_tokens=turn.max_tokens, chunk=self.eng.options.prefill_chunk,
                      on_token=lambda t, text: handle.emit(Token(t, text)),
                      on_progress=lambda d, t: handle.emit(Progress("prefill", d, t)),
                      cancelled=cancelled, steps=steps, stats=stats, pace=self.eng.turns.prefill_pace(),
                      layerwise=not self.eng.serving.distributed, constraint=turn.constraint,
                      marks=self.eng.prompts.message_marks(turn.req, entry, tokens), images=images)
        self.eng.drafts.done(req, turn.drafter, spec, r)
        if steps is not None:
            steps.close()       # speculation's finally cuts undelivered drafts now, before the checkpoint
        entry.checkpoint()      # a finished reply is a message boundary (none for full K/V)
        return self.eng.turns.end_turn(turn, r, spec)

    # The turn API (continuous batching, engine/generation/batching.py): generate split in two so a batched row
    # prepares and finishes its turn exactly as a lone request does; `batched` checks the K/V out
    # (engine/cache/conversations.py `busy`) instead of making it the live one.
    # ---- settings, status --------------------------------------------------------------------
    def configure(self, req: Configure) -> EngineStatus:
        """Applied whole or not at all: the bounds were checked when `req` was built (engine/limits.py);
        what only the loaded model can refuse (a K/V width its head size cannot take) is checked first."""
        kv_format = self._kv_format_for(req.kv_bits) if req.kv_bits is not None else None
        if req.cache_mib is not None or req.cache_slots is not None:
            parking = self.eng.conversations.parking
            cap = parking.cap_bytes >> 20 if req.cache_mib is None else req.cache_mib
            slots = parking.slots if req.cache_slots is None else req.cache_slots
            parking.set_limits(cap, slots)
            self.eng.log(f"conversation cache: {cap} MiB, {slots} slots")
        if req.disk_mib is not None and self.eng.disk is not None:
            self.eng.disk.set_cap(req.disk_mib)
            self.eng.log(f"conversation disk cache: {req.disk_mib} MiB")
        if req.speed_projection is not None:
            self.eng.in_force.speed_projection = bool(req.speed_projection)
        if req.kv_bits is not None:
            self.eng.in_force.kv_bits = req.kv_bits
            if kv_format is not None:
                self.eng.loaded = self.eng.loaded.with_kv_format(kv_format)
                self.eng.log(f"K/V: {self.eng.kv_fmt.describe()} for new conversations")
        return self.status()

    def _kv_format_for(self, bits: int):
        """The loaded model's K/V format at `bits` (None when no model is loaded: the width alone counts,
        checked with the request); a width this model cannot take is refused naming the setting."""
        if self.eng.loaded is None or self.eng.info is None:
            return None
        try:
            return choose_for(self.eng.model, bits, self.eng.info.head_dim)
        except RequestError as e:
            raise CacheLimitError(str(e), "kv_bits") from None

    def cache_limits(self):
        reading = self.eng.guard.reading()
        return cache_range(reading.total_bytes if reading is not None else None)

    def status(self) -> EngineStatus:
        reading = self.eng.guard.reading()
        convs = self.eng.conversations          # None before the engine thread opens
        live = convs.live if convs is not None else None
        return EngineStatus(
            cache_mib_max=cache_range(reading.total_bytes if reading is not None else None).max_mib,
            model=str(self.eng.model_path) if self.eng.model_path else None,
            facts=self.eng.facts,
            info=self.eng.info.__dict__ if self.eng.info else None,
            context_length=self.eng.n_ctx,
            live_tokens=len(live.tokens) if live else 0,
            live_messages=list(live.messages) if live else [],
            conversations=convs.summary() if convs is not None else [],
            parking=convs.parking.status() if convs is not None else None,
            memory=None if reading is None else {
                "total_bytes": reading.total_bytes, "available_bytes": reading.available_bytes,
                "source": reading.source},
            memory_unavailable=self.eng.guard.unavailable_reason(),
            load_budget=_load_budget(self.eng.guard),
            steering=self.eng.steering.vector.describe() if self.eng.steering and self.eng.steering.vector else None,
            steering_error=self.eng.steering_error,
            speed_projection_default=self.eng.in_force.speed_projection,
            kv_bits=self.eng.in_force.kv_bits,
            distributed=self.eng.serving.status(),
            disk=self.eng.disk.status() if self.eng.disk is not None else None,
            batch=dataclasses.replace(counts) if (counts := self.eng.scheduler.batch_counters) else None,
            vision=asdict(self.eng.loaded.vision.stats()) if self.eng.loaded is not None
            and self.eng.loaded.vision is not None else None,
        )

    def count_tokens(self, req: CountTokens) -> TokenCount:
        self.eng.require_model()
        ids = self.eng.prompts.prompt_tokens(GenerateRequest(messages=req.messages, prompt=req.prompt, tools=req.tools))
        return TokenCount(len(ids), self.eng.prompts.system_part(req, ids), list(ids))

    def capture(self, req: CaptureStates, handle: Handle) -> CapturedStates:
        self.eng.require_model()
        t0 = time.perf_counter()
        first: list = []
        states = last_token_states(self.eng, req.prompts, lambda d, t: handle.emit(Progress("capture", d, t)), first)
        return CapturedStates(last=states, first=np.stack(first) if first else None,
                              architecture=self.eng.info.architecture, seconds=time.perf_counter() - t0)

    # ---- session files -----------------------------------------------------------------------

def _load_budget(guard) -> dict | None:
    """What a model may take (engine/model/memory_estimate.py), for the app, which cannot ask MLX."""
    b = load_budget(guard, gpu_working_set())
    return None if b is None else {"bytes": b.bytes, "source": b.source}


