"""What each request does, on the engine thread: the K/V identity (model, steering, K/V format), the
prompt's tokens, generation (the turn API a batched row shares), settings and status. The model load is
engine/model_load.py, the session-file requests engine/session_requests.py.

`Engine` (engine/engine.py) owns the thread and the dispatch and holds one `RequestHandlers(engine)`; the held
conversations are `self.conversations` (engine/conversations.py), the decode loop with its stop strings
and stats is engine/generate.py. Everything here runs on the engine thread only.
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import asdict, dataclass, replace
import numpy as np

from .api import (CaptureStates, CapturedStates, Configure, CountTokens, EngineStatus, GenerateRequest,
                  Generation, TokenCount)
from .errors import ContextTooLong, RequestError
from .events import Handle, KVChanged, Progress, Token
from . import layer_cache
from .capture import last_token_states
from .chat_template import render
from .generate import PrefillPace, StepStats, reply
from .kv_format import choose_for, make_cache
from .kv_key import KVKey
from .limits import CacheLimitError, cache_range
from .memory_estimate import gpu_working_set, load_budget
from .parking import KVEntry, common_prefix
from .constraints import compile as compile_constraint
from .context_policy import (POLICIES, OverflowRefused, message_text, reply_reserve, select as select_messages,
                             smallest)
from .conversations import held_run
from .vision.tokens import has_image_parts, has_images, storable, text_chars, whole_image_start

MAX_CHARS_PER_TOKEN = 32
SIZES_KEPT = 4096                  # message sizes remembered for the overflow pages (then forgotten at once)


class RequestHandlers:
    """One method per request, and the queries they share (the K/V identity, the prompt's tokens).
    What they read and replace is the engine's (`loaded`, `conversations`, `guard`, `serving`), so a
    handler never keeps a value that a load or another request has since replaced; its own state is
    the measured prefill pace (per model). Speculation's state is engine/drafts.py's."""

    def __init__(self, engine):
        self.eng = engine
        self._pace = None           # (model, generate.PrefillPace) measured for the loaded model
        self._sizes: dict[str, int] = {}    # message text -> tokens (message_size), for the tokenizer below
        self._sizes_of = None

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

    def prompt_tokens(self, req: GenerateRequest) -> list[int]:
        tok = self.eng.tokenizer
        # A huge body must not cost a tokenization (or a template render) to be refused: no real
        # tokenizer averages more than MAX_CHARS_PER_TOKEN characters a token.
        chars = len(req.prompt) if req.prompt is not None else sum(
            text_chars(m.get("content")) for m in req.messages or [] if isinstance(m, dict))
        if chars > self.eng.n_ctx * MAX_CHARS_PER_TOKEN:
            raise ContextTooLong(f"the prompt is {chars} characters (over {chars // MAX_CHARS_PER_TOKEN} tokens); "
                               f"the context holds {self.eng.n_ctx}")
        if req.prompt is not None:
            return tok.encode(req.prompt)
        if not req.messages:
            raise RequestError("a request needs messages or a prompt")
        if has_image_parts(req.messages):
            return self.image_prompt(req.messages, tools=getattr(req, "tools", None))
        text, add_bos = self.render_messages(req.messages, getattr(req, "tools", None))
        return (self.eng.conversations.continue_tokens(tok, text, add_bos, req.conversation, self.cache_key(),
                                                       self.image_span())
                or tok.encode_prompt(text, add_bos=add_bos))

    def render_messages(self, messages: list[dict], tools=None, generation_prompt: bool = True) -> tuple[str, bool]:
        """The messages as the model's template renders them, and whether BOS goes before that text."""
        tok = self.eng.tokenizer
        bos = tok.token_text(tok.bos_id) if tok.bos_id is not None else ""
        text = render(self.eng.template, messages, bos_token=bos,
                      eos_token=tok.token_text(min(tok.eos_ids)) if tok.eos_ids else "",
                      name=f"the chat template of {self.eng.model_path.name}" if self.eng.template else "",
                      tools=tools, add_generation_prompt=generation_prompt)
        # A template that writes BOS itself must not get a second one.
        return text, tok.add_bos and not (bos and text.startswith(bos))

    def count_messages(self, messages: list[dict], tools=None) -> int:
        """The prompt's length for `messages`, tokenized afresh (no held conversation's ids)."""
        text, add_bos = self.render_messages(messages, tools)
        return len(self.eng.tokenizer.encode_prompt(text, add_bos=add_bos))

    def fit_context(self, req: GenerateRequest, n_ctx: int) -> tuple[GenerateRequest, list[int], int]:
        """The request as it is sent, its tokens and how many messages it left out: under a dropping
        overflow policy (engine/context_policy.py) the turns that fit the context with the reply's
        reserve; else the request as it came."""
        if req.overflow not in POLICIES:
            raise RequestError(f"overflow must be one of {', '.join(POLICIES)} (got {req.overflow!r})")
        if req.overflow == "stop" or not req.messages or req.prompt is not None:
            return req, self.prompt_tokens(req), 0
        budget = n_ctx - reply_reserve(req.sampling.max_tokens, n_ctx)
        cap = self.eng.n_ctx * MAX_CHARS_PER_TOKEN
        if _chars(req.messages) <= cap:
            tokens = self.prompt_tokens(req)
            if len(tokens) <= budget:
                return req, tokens, 0

        # A list past prompt_tokens' character cap counts as over the budget unread, so a long chat is
        # cut by the same pages instead of being refused, in bounded work.
        def count(ms: list[dict]) -> int:
            return budget + 1 if _chars(ms) > cap else self.count_messages(ms, req.tools)
        try:
            sel = select_messages(req.messages, count, budget, req.overflow, size=self.message_size)
        except OverflowRefused as e:
            self.prompt_tokens(replace(req, messages=smallest(req.messages, req.overflow)))  # over the cap: its refusal
            raise ContextTooLong(str(e)) from None
        fitted = replace(req, messages=sel.messages) if sel.dropped else req
        return fitted, self.prompt_tokens(fitted), sel.dropped

    def message_size(self, message: dict) -> int:
        """One message's text in tokens: the overflow pages' unit (engine/context_policy.py), remembered
        by text so that each turn tokenizes only its new messages. A text past the character cap is not
        tokenized: its size at the cap's rate is over the context, which is all a page needs."""
        text = message_text(message) if isinstance(message, dict) else ""
        if len(text) > self.eng.n_ctx * MAX_CHARS_PER_TOKEN:
            return len(text) // MAX_CHARS_PER_TOKEN
        tok = self.eng.tokenizer
        if self._sizes_of is not tok or len(self._sizes) > SIZES_KEPT:
            self._sizes, self._sizes_of = {}, tok
        n = self._sizes.get(text)
        if n is None:
            n = self._sizes[text] = len(tok.encode(text, add_bos=False))
        return n

    def context_of(self, req: GenerateRequest) -> int:
        """The context a request may fill: the model's, or a smaller limit it names (a chat's config)."""
        limit = req.context_limit
        if not isinstance(limit, int) or isinstance(limit, bool) or limit < 0:
            raise RequestError(f"context_limit must be a whole number >= 0 (got {limit!r})")
        return min(self.eng.n_ctx, limit) if limit else self.eng.n_ctx

    def image_prompt(self, messages: list[dict], *, tools=None, add_generation_prompt: bool = True) -> list[int]:
        """A chat prompt with image parts: rendered with the media marker in place of each image, then
        tokenized with the images' spans (engine/vision/spans.py). Refused in one line when the model
        has no projector."""
        vision = self.eng.loaded.vision if self.eng.loaded is not None else None
        if vision is None:
            raise RequestError(f"{self.eng.model_path.name} reads text only: no image projector (mmproj) is "
                               f"loaded with it; put its mmproj-*.gguf beside it or name one with --mmproj")
        if self.eng.serving.distributed:
            raise RequestError("images are not read by a distributed engine yet")
        flat, images = vision.flatten(messages)
        text, add_bos = self.render_messages(flat, tools, generation_prompt=add_generation_prompt)
        return vision.tokens(self.eng.tokenizer, text, images, add_bos, tail=self._held_tail)

    def _held_tail(self, head: list[int], piece: str) -> list[int] | None:
        """The ids of `piece` (a prompt's text after its last image, `head` the ids before it) keeping
        a held conversation's own ids after that image as far as `piece` starts with their text: a
        reply's generated ids, which re-tokenizing may not give back (as continue_tokens keeps a text
        prompt's). None when no held conversation follows `head` (tokenize `piece` afresh)."""
        tok, key, best = self.eng.tokenizer, self.cache_key(), []
        for e in self.eng.conversations.held():
            if e.key != key or len(e.tokens) <= len(head) or e.tokens[:len(head)] != head:
                continue
            rest = e.tokens[len(head):]
            if has_images(rest):
                continue
            # the most of it the piece starts with (a template may trim a reply's edges)
            m = held_run(tok, rest, piece, tok.decode(rest, skip_special=False))
            if m > len(best):
                best = rest[:m]
        if not best:
            return None
        return best + tok.encode(piece[len(tok.decode(best, skip_special=False)):], add_bos=False)

    def storable(self, messages: list) -> list:
        """Messages as held K/V keeps them (engine/vision/tokens.py): image parts as references."""
        if not has_image_parts(messages):
            return list(messages)
        vision = self.eng.loaded.vision if self.eng.loaded is not None else None
        return vision.storable(messages) if vision is not None else storable(messages)

    def image_span(self) -> int:
        """Tokens an image takes with the loaded projector (0: none loaded): a restored image span's length."""
        vision = self.eng.loaded.vision if self.eng.loaded is not None else None
        return vision.n_tokens if vision is not None else 0

    def prefill_pace(self):
        """The loaded model's measured prefill speed (generate.PrefillPace: the CPU's chunk cap), kept
        from request to request and started afresh for each model."""
        pace = self._pace
        if pace is None or pace[0] is not self.eng.model:
            pace = self._pace = (self.eng.model, PrefillPace(self.eng.info.n_layer if self.eng.info else 1))
        return pace[1]

    def take_kv(self, tokens: list[int], owner: str = ""):
        """The K/V to extend for `tokens` (engine/conversations.py) under the current K/V identity."""
        return self.eng.conversations.take(tokens, owner, self.cache_key(), self.make_cache)

    # ---- generation --------------------------------------------------------------------------
    def generate(self, req: GenerateRequest, handle: Handle) -> Generation:
        turn = self.begin_turn(req, handle)
        entry, tokens, reuse, stats = turn.entry, turn.tokens, turn.reuse, turn.stats
        cancelled = lambda: handle.cancelled  # noqa: E731
        spec, steps = self.eng.drafts.steps(req, turn.drafter, entry, tokens, turn.max_tokens, stats, cancelled,
                                       constraint=turn.constraint)
        spec.stopped = spec.stopped or turn.spec_off
        # mtp: the prompt's prefill too goes through the tap (the head reads its hidden states)
        r = reply(getattr(turn.drafter, "target", self.eng.model), entry, tokens, reuse, tokenizer=self.eng.tokenizer,
                  sampling=req.sampling,
                  n_vocab=self.eng.info.n_vocab, max_tokens=turn.max_tokens, chunk=self.eng.options.prefill_chunk,
                  on_token=lambda t, text: handle.emit(Token(t, text)),
                  on_progress=lambda d, t: handle.emit(Progress("prefill", d, t)),
                  cancelled=cancelled, steps=steps, stats=stats, pace=self.prefill_pace(),
                  layerwise=not self.eng.serving.distributed, constraint=turn.constraint,
                  marks=self.message_marks(turn.req, entry, tokens),
                  images=self.eng.loaded.vision if has_images(tokens) else None)
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
        if not req.messages or req.prompt is not None or not layer_cache.needs_checkpoints(entry.cache):
            return []
        tok = self.eng.tokenizer
        bos = tok.token_text(tok.bos_id) if tok.bos_id is not None else ""
        eos = tok.token_text(min(tok.eos_ids)) if tok.eos_ids else ""
        marks = []
        for msgs in (req.messages[:-1], req.messages):
            if not msgs:
                continue
            if has_image_parts(msgs):
                marks.append(common_prefix(tokens, self.image_prompt(msgs, tools=getattr(req, "tools", None),
                                                                     add_generation_prompt=False)))
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
        self.eng.require_model()
        req.sampling.validate()
        drafter = self.eng.drafts.drafter_for(req)        # speculative decoding hook (validates before any work)
        constraint = None
        if req.constraint is not None:           # the grammar (engine/constraints.py), before any work
            constraint = compile_constraint(req.constraint, self.eng.tokenizer)
        # A side request's steering is off unless it asks: a title must not read like a steered reply.
        asked = req.speed_projection if req.speed_projection is not None or not req.side else False
        self.eng.steering.speed_projection = self.projection(asked)
        stats = StepStats()
        n_ctx = self.context_of(req)
        req, tokens, dropped = self.fit_context(req, n_ctx)
        spec_off = ""
        if drafter is not None and has_images(tokens):
            # Drafters read token ids (a draft model's own prefill, lookup's n-grams, the MTP head's
            # embeddings), none of which image spans are: the reply decodes plainly and says why.
            drafter, spec_off = None, "off for a prompt with images (drafters read text tokens only)"
        if len(tokens) >= n_ctx:
            raise ContextTooLong(f"the prompt is {len(tokens)} tokens; the context holds {n_ctx}")
        if req.side:
            # Its own throwaway K/V: the conversations (live and parked) keep their places.
            entry, reuse = KVEntry([], self.make_cache(), self.cache_key()), 0
        else:
            entry, reuse = self.take_kv(tokens, req.conversation)
            entry.owner = req.conversation or entry.owner
        reuse = min(reuse, len(tokens) - 1)     # the last prompt token is always evaluated
        reuse = whole_image_start(tokens, reuse)    # an image is fed whole, never resumed halfway
        # Cut back through the cache contract: a trim, or for a cache that cannot be cut back there
        # (a recurrent state, a wrapped window) its latest checkpoint at or before, else from scratch.
        reuse = entry.rewind(reuse, self.make_cache)
        if has_images(tokens[reuse:]):
            self.eng.loaded.vision.check_available(tokens[reuse:])    # refused before any K/V changes
        if batched and not req.side:
            self.eng.conversations.check_out(entry)   # held by the batch (engine/batching.py) until it ends
        elif not req.side:
            self.eng.conversations.live = entry     # from here on the live K/V is `entry`
        from_disk, entry.restored_from_disk = min(entry.restored_from_disk, reuse), 0
        if self.eng.parking is not None:            # the status bar's figures while the reply runs
            handle.emit(KVChanged(self.eng.parking.status(), req.conversation, len(tokens), reuse, from_disk))
        entry.messages = self.storable(req.messages or [])
        max_tokens = min(req.sampling.max_tokens, n_ctx - len(tokens))
        return Turn(req, entry, tokens, reuse, max_tokens, stats, drafter, constraint, from_disk,
                    self.eng.steering.active, dropped, spec_off)

    def end_turn(self, turn: "Turn", r, spec=None) -> Generation:
        """The reply's messages on its K/V entry, the log line and the Generation."""
        req, stats, tokens = turn.req, turn.stats, turn.tokens
        turn.entry.messages = self.storable(req.messages or []) + (
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

    # ---- settings, status --------------------------------------------------------------------
    def configure(self, req: Configure) -> EngineStatus:
        """Applied whole or not at all: the bounds were checked when `req` was built (engine/limits.py);
        what only the loaded model can refuse (a K/V width its head size cannot take) is checked first."""
        kv_format = self._kv_format_for(req.kv_bits) if req.kv_bits is not None else None
        if req.cache_mib is not None or req.cache_slots is not None:
            cap = self.eng.parking.cap_bytes >> 20 if req.cache_mib is None else req.cache_mib
            slots = self.eng.parking.slots if req.cache_slots is None else req.cache_slots
            self.eng.parking.set_limits(cap, slots)
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
        ids = self.prompt_tokens(GenerateRequest(messages=req.messages, prompt=req.prompt, tools=req.tools))
        return TokenCount(len(ids), self.system_part(req, ids), list(ids))

    def system_part(self, req: CountTokens, tokens: list[int]) -> int:
        """How many of a count's `tokens` are its leading system messages: the prefix they share with
        those messages rendered alone (0 for a prompt, or a template that renders no system alone)."""
        msgs = req.messages or []
        n = next((i for i, m in enumerate(msgs) if not (isinstance(m, dict) and m.get("role") == "system")), len(msgs))
        if req.prompt is not None or n == 0:
            return 0
        try:
            text, add_bos = self.render_messages(msgs[:n], req.tools, generation_prompt=False)
        except RequestError:          # e.g. a template that refuses a conversation without a user message
            return 0
        return common_prefix(tokens, self.eng.tokenizer.encode_prompt(text, add_bos=add_bos))

    def capture(self, req: CaptureStates, handle: Handle) -> CapturedStates:
        self.eng.require_model()
        t0 = time.perf_counter()
        first: list = []
        states = last_token_states(self.eng, req.prompts, lambda d, t: handle.emit(Progress("capture", d, t)), first)
        return CapturedStates(last=states, first=np.stack(first) if first else None,
                              architecture=self.eng.info.architecture, seconds=time.perf_counter() - t0)

    # ---- session files -----------------------------------------------------------------------
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


def _chars(messages: list[dict]) -> int:
    """The characters prompt_tokens' cap counts."""
    return sum(text_chars(m.get("content")) for m in messages if isinstance(m, dict))


def _load_budget(guard) -> dict | None:
    """What a model may take (engine/memory_estimate.py), for the app, which cannot ask MLX."""
    b = load_budget(guard, gpu_working_set())
    return None if b is None else {"bytes": b.bytes, "source": b.source}


