"""What speculative decoding keeps between requests, in one home: the draft model a request named (not
the load's: that one is part of LoadedModel), the MTP head, and what each draft pair measured.

    drafts.drafter_for(req)      the drafter a request asks for (None: off); loads a named draft once
    drafts.steps(...)            the speculative step iterator for a turn (engine/generation/speculative.py)
    drafts.done(...)             what the reply measured, remembered
    drafts.release(why)          the named draft's memory given back
    drafts.idle_release          a timed idle task (engine/scheduler.py): unused for DRAFT_IDLE_S, released

Engine thread only. The loop and the drafters themselves are engine/generation/speculative.py and engine/generation/mtp_spec.py.
"""
from __future__ import annotations

import gc
from pathlib import Path
from typing import Callable

import mlx.core as mx

from engine.generation import mtp_spec, speculative
from engine.memory.allocator import release_freed_memory
from engine.api import GenerateRequest
from engine.errors import MemoryRefused, RequestError
from engine.model.memory_estimate import fit_for_load, gpu_working_set
from engine.model.models import resolve_model

DRAFT_IDLE_S = 30.0     # a draft model no request used for this long is released


class Drafts:
    def __init__(self, engine):
        self._eng = engine                  # read only: what is loaded, the guard, the log
        self.named = None                   # speculative.DraftModel a request named (not the load's)
        self._mtp = None                    # mtp_spec's loaded head, for one target and head file
        self._verdicts = speculative.Verdicts()
        self.idle_release = _IdleRelease(self)

    @property
    def mtp_note(self) -> str:
        return self._mtp.note if self._mtp is not None else ""

    @property
    def mtp_head(self):
        """The loaded MTP head (mtp_spec's), None before a request asked for mtp."""
        return self._mtp.head if self._mtp is not None else None

    @property
    def mtp_path(self) -> Path | None:
        return self._mtp.path if self._mtp is not None else None

    def forget_mtp(self) -> None:
        """An MTP head holds the old target: let go before another load."""
        self._mtp = None

    # ---- the drafter a request asks for ----------------------------------------------------------
    def drafter_for(self, req: GenerateRequest):
        """The drafter a request asks for (None: off); a draft model is loaded once and kept."""
        mode = speculative.parse_spec(req.speculative)
        if mode.kind == "off":
            return None
        if mode.kind == "lookup":
            return speculative.LookupDrafter()
        if mode.kind == "mtp":
            return self._mtp_drafter(mode.draft_path)
        eng = self._eng
        path = _draft_path(mode.draft_path)
        if eng.loaded.draft is not None and eng.loaded.draft.path == path:
            return eng.loaded.draft        # the draft loaded with the model
        # Another draft than the load's is loaded now, for the requests that name it (released after
        # DRAFT_IDLE_S unused, or by a load), not refused: the draft is a request's field in the API
        # (the server's `speculative: draft:NAME`, an app config's draft) and refusing it would break every
        # client that names its own; only the load's draft is held as long as the model.
        d = self.named
        stale = d is None or d.path != path or d.target_path != eng.model_path
        del d
        if stale:
            self.release("another draft asked for")   # its memory counts for the new one's fit
            self.named = self.load(str(path), eng.model_path, eng.dtype, eng.n_ctx)
        return self.named

    @staticmethod
    def off_for_images(drafter) -> str:
        """Why `drafter` does not draft over a prompt with images ("": it does). Lookup's n-grams skip
        the image spans (speculative.LookupDrafter); a draft model's own prefill and the MTP head's
        embeddings read token ids, and an image span has none they could read."""
        if isinstance(drafter, speculative.LookupDrafter):
            return ""
        if getattr(drafter, "samples_drafts", False):
            return "off for a prompt with images (the MTP head reads text token embeddings, not the image)"
        return "off for a prompt with images (a draft model cannot read the image)"

    def load(self, name: str, target: Path, dtype, n_ctx: int):
        """A draft GGUF for `target` (speculative.load_draft: the same vocabulary, refused by name
        otherwise), through the load's memory estimate and guard before any tensor is read."""
        return speculative.load_draft(str(_draft_path(name)), target, dtype, n_ctx, self._eng.log,
                                      admit=lambda p: self._admit_draft(p, n_ctx, dtype))

    def _mtp_drafter(self, head_path: str | None):
        """A drafter over the model's NextN/MTP head (engine/generation/mtp_spec.py); the head is loaded once per
        target (and head file) and kept; each request gets its own head K/V."""
        eng = self._eng
        if eng.serving.distributed:
            raise RequestError("speculative mtp is not available on a distributed engine")
        h = self._mtp
        if h is None or h.model is not eng.model or h.head_path != head_path:
            self._mtp = None
            self._mtp = mtp_spec.load_mtp(eng.model_path, eng.model, eng.dtype, head_path, eng.log,
                                          admit=self._admit_head)
        return mtp_spec.drafter_for(self._mtp.head, eng.model, self._mtp.path)

    def _admit_head(self, nbytes: int) -> None:
        """A sibling head file's tensors go through the memory guard (MemoryRefused, one line)."""
        ok, line = self._eng.guard.admit(nbytes)
        if not ok:
            raise MemoryRefused(f"mtp head: {line}")

    def _admit_draft(self, path, n_ctx: int, dtype) -> None:
        """A draft model goes through the load's memory estimate and guard (MemoryRefused, one line)."""
        try:
            _, line = fit_for_load(path, n_ctx, str(dtype).rsplit(".", 1)[-1], self._eng.guard, gpu_working_set())
        except MemoryRefused as e:
            raise type(e)(f"draft model: {e}") from None
        self._eng.log(f"draft {line}")

    def release(self, why: str) -> None:
        """Drop the named draft model (no request uses it any more) and give its memory back."""
        d, self.named = self.named, None
        if d is None:
            return
        name = d.path.name
        del d
        gc.collect()
        mx.clear_cache()
        release_freed_memory()
        self._eng.log(f"draft model {name} released ({why})")

    # ---- a turn's speculation --------------------------------------------------------------------
    def steps(self, req, drafter, entry, tokens, max_tokens, stats, cancelled, constraint=None):
        """(SpecStats, the speculative step iterator or None for plain decoding)."""
        spec = speculative.SpecStats(speculative.parse_spec(req.speculative).label)
        if drafter is None:
            return spec, None
        eng = self._eng
        sp = req.sampling
        key = self._key(drafter, sp)
        spec.plain_tps_hint = self._verdicts.plain_tps.get(str(eng.model_path), 0.0)
        if key is not None:
            why = self._verdicts.slower(key)
            if why:     # measured slower in an earlier reply: plain from the start, saying why
                spec.stopped = f"off for this model and draft: slower than plain decoding in an earlier reply ({why})"
                return spec, None
            spec.speedup_hint = self._verdicts.speedup(key)
        # mtp: the target through the tap that keeps its hidden states (engine/generation/mtp_spec.py)
        return spec, speculative.decode(
            getattr(drafter, "target", eng.model), entry.cache, tokens[-1], entry.tokens, history=tokens, sampling=sp,
            processors=sp.processors(), max_tokens=max_tokens, stats=stats, spec=spec, drafter=drafter,
            seed=sp.seed, cancelled=cancelled, constraint=constraint)

    def _key(self, drafter, sampling):
        """The Verdicts key of a draft-model request (None for lookup: its drafts depend on the text)."""
        path = getattr(drafter, "path", None)
        return None if path is None else (str(self._eng.model_path), str(path), sampling.temperature > 0)

    def done(self, req, drafter, spec, result) -> None:
        """Remember what this reply measured: the plain decode speed, and a draft pair's verdict."""
        if drafter is None or (spec.stopped and not spec.passes):
            if result.finish != "cancelled" and len(result.tokens) > 8:
                self._verdicts.note_plain(str(self._eng.model_path), result.stats.decode_tps)
        key = self._key(drafter, req.sampling) if drafter is not None else None
        if key is not None and spec.passes:
            self._verdicts.record(key, spec)


class _IdleRelease:
    """The scheduler's timed idle task: a named draft no request used for DRAFT_IDLE_S is released."""

    def __init__(self, drafts: Drafts):
        self.drafts = drafts

    def due_in(self) -> float | None:
        return DRAFT_IDLE_S if self.drafts.named is not None else None

    def run(self, interrupted: Callable[[], bool]) -> None:
        try:
            self.drafts.release(f"no request used it for {DRAFT_IDLE_S:g} s")
        except Exception as e:  # noqa: BLE001 -- never worth the engine thread
            self.drafts.named = None
            self.drafts._eng.log(f"draft model: release failed ({e!r})")


def _draft_path(name: str) -> Path:
    """A draft model's file (models.resolve_model), a one-line RequestError for a name the file system refuses."""
    try:
        return resolve_model(name)
    except OSError as e:                # a name too long for the file system, ...
        raise RequestError(f"draft model: {e.strerror or e}") from None
