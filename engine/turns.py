"""The turn API a generate request and a batched row share, on the engine thread: `begin_turn` (the
prompt fitted to the context, the K/V taken or made and cut back to what it reuses, the drafter and
the grammar decided before any work), `end_turn` (the reply's messages on its K/V, the log line, the
Generation), and the measured prefill pace per model. One `Turns(engine, handlers)` per engine
(engine/handlers.py runs a lone request through it; engine/generation/batching.py a batch's rows)."""
from __future__ import annotations

from dataclasses import dataclass

from engine.api import GenerateRequest, Generation
from engine.generation.constraints import compile as compile_constraint
from engine.errors import ContextTooLong
from engine.events import Handle, KVChanged
from engine.generation.generate import PrefillPace, StepStats
from engine.cache.parking import KVEntry
from engine.text.image_tokens import has_images, whole_image_start


class Turns:
    def __init__(self, engine, handlers):
        self.eng = engine
        self.handlers = handlers    # the K/V identity and a new cache (engine/handlers.py)
        self._pace = None           # (model, generate.PrefillPace) measured for the loaded model

    def prefill_pace(self):
        """The loaded model's measured prefill speed (generate.PrefillPace: the CPU's chunk cap), kept
        from request to request and started afresh for each model."""
        pace = self._pace
        if pace is None or pace[0] is not self.eng.model:
            pace = self._pace = (self.eng.model, PrefillPace(self.eng.info.n_layer if self.eng.info else 1))
        return pace[1]

    def take_kv(self, tokens: list[int], owner: str = ""):
        """The K/V to extend for `tokens` (engine/cache/conversations.py) under the current K/V identity."""
        return self.eng.conversations.take(tokens, owner, self.handlers.cache_key(), self.handlers.make_cache)

    def begin_turn(self, req: GenerateRequest, handle: Handle, batched: bool = False):
        """Everything before the reply's prefill: validation, the prompt's tokens, the K/V taken and
        trimmed to what it reuses (a `Turn`)."""
        self.eng.require_model()
        req.sampling.validate()
        drafter = self.eng.drafts.drafter_for(req)        # speculative decoding hook (validates before any work)
        constraint = None
        if req.constraint is not None:           # the grammar (engine/generation/constraints.py), before any work
            constraint = compile_constraint(req.constraint, self.eng.tokenizer)
        # A side request's steering is off unless it asks: a title must not read like a steered reply.
        asked = req.speed_projection if req.speed_projection is not None or not req.side else False
        self.eng.steering.speed_projection = self.handlers.projection(asked)
        stats = StepStats()
        n_ctx = self.eng.prompts.context_of(req)
        req, tokens, dropped = self.eng.prompts.fit_context(req, n_ctx)
        spec_off = ""
        if drafter is not None and has_images(tokens):
            # A draft model and the MTP head read token ids, which an image span is not: the reply
            # decodes plainly and says why. Lookup drafts from the text around the images.
            spec_off = self.eng.drafts.off_for_images(drafter)
            drafter = None if spec_off else drafter
        if len(tokens) >= n_ctx:
            raise ContextTooLong(f"the prompt is {len(tokens)} tokens; the context holds {n_ctx}")
        if req.side:
            # Its own throwaway K/V: the conversations (live and parked) keep their places.
            entry, reuse = KVEntry([], self.handlers.make_cache(), self.handlers.cache_key()), 0
        else:
            entry, reuse = self.take_kv(tokens, req.conversation)
            entry.owner = req.conversation or entry.owner
        reuse = min(reuse, len(tokens) - 1)     # the last prompt token is always evaluated
        reuse = whole_image_start(tokens, reuse)    # an image is fed whole, never resumed halfway
        # Cut back through the cache contract: a trim, or for a cache that cannot be cut back there
        # (a recurrent state, a wrapped window) its latest checkpoint at or before, else from scratch.
        reuse = entry.rewind(reuse, self.handlers.make_cache)
        if has_images(tokens[reuse:]):
            self.eng.loaded.vision.check_available(tokens[reuse:])    # refused before any K/V changes
        if batched and not req.side:
            self.eng.conversations.check_out(entry)   # held by the batch (engine/generation/batching.py) until it ends
        elif not req.side:
            self.eng.conversations.live = entry     # from here on the live K/V is `entry`
        from_disk, entry.restored_from_disk = min(entry.restored_from_disk, reuse), 0
        if self.eng.conversations is not None:      # the status bar's figures while the reply runs
            handle.emit(KVChanged(self.eng.conversations.parking.status(), req.conversation, len(tokens), reuse,
                                  from_disk))
        entry.messages = self.eng.prompts.storable(req.messages or [])
        max_tokens = min(req.sampling.max_tokens, n_ctx - len(tokens))
        return Turn(req, entry, tokens, reuse, max_tokens, stats, drafter, constraint, from_disk,
                    self.eng.steering.active, dropped, spec_off)

    def end_turn(self, turn: "Turn", r, spec=None) -> Generation:
        """The reply's messages on its K/V entry, the log line and the Generation."""
        req, stats, tokens = turn.req, turn.stats, turn.tokens
        turn.entry.messages = self.eng.prompts.storable(req.messages or []) + (
            [{"role": "assistant", "content": r.text}] if req.messages else [])
        self.eng.log(f"{req.conversation or 'request'}: prompt {len(tokens)} (cached {turn.reuse}), "
                  f"{len(r.tokens)} generated, ttft {stats.ttft_ms:.0f} ms, "
                  f"{stats.decode_tps:.1f} tok/s, finish {r.finish}" + (spec.log_suffix() if spec else ""))
        return Generation.from_dict(spec.result() if spec else {}, tokens=r.tokens, text=r.text,
                                    prompt_tokens=len(tokens), cached_tokens=turn.reuse,
                                    generated_tokens=len(r.tokens),
                                    ttft_ms=round(stats.ttft_ms, 2), prefill_tps=round(stats.prefill_tps, 2),
                                    decode_tps=round(stats.decode_tps, 2), finish_reason=r.finish,
                                    speed_projection=turn.projection, restored_from_disk=turn.from_disk,
                                    dropped_messages=turn.dropped)


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
    dropped: int = 0                # messages the overflow policy left out (turn.req has the rest)
    spec_off: str = ""              # why speculation asked for is off for this turn (images in the prompt)
