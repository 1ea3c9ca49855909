"""The session-file requests on the engine thread: SaveSession, RestoreSession, SessionSteering, and
what a file must match (`fingerprint`). The file formats are engine/session_files/sessions.py (format 2),
engine/session_files/session_v3.py and engine/session_files/session_quant.py; the K/V identity and the prompt's tokens are the
request handlers' (engine/handlers.py)."""
from __future__ import annotations

import json
from pathlib import Path

from engine.api import RestoreSession, SaveSession, SessionRestored, SessionSaved, SessionSteering, SessionSteeringInfo
from engine.errors import ContextTooLong, MemoryRefused, RequestError, SessionSteeringRefused, VectorSpec
from engine.events import Handle, Progress
from engine.session_files import sessions
from engine.text.chat_template import render
from engine.generation.generate import prefill
from engine.model.gguf_file import text_hash
from engine.model.gguf_split import set_label
from engine.cache.parking import KVEntry
from engine.paths import sessions_dir
from engine.session_files.session_v3 import probe
from engine.session_files.sessions import read_header
from engine.text.image_tokens import has_image_parts, has_images


class SessionRequests:
    """One per engine (`Engine.sessions`): its engine, and the request handlers that answer the K/V
    identity and make a cache."""

    def __init__(self, engine, handlers):
        self.eng = engine
        self.handlers = handlers

    def fingerprint(self, steering_fp: str | None = None) -> dict:
        """What a session file must match. `steering_fp`: the steering applied to the conversation's
        K/V (None: the setting in force); the vector's files and settings are named alongside so a
        refusal elsewhere can say which vector to load."""
        info = self.eng.info
        steer = self.handlers.steering_fingerprint() if steering_fp is None else steering_fp
        vector = self.eng.steering.vector if self.eng.steering else None
        cfg = self.eng.in_force.steering
        described = "none"
        if steer and vector is not None and steer == vector.fingerprint() and cfg is not None:
            described = json.dumps({"files": [[str(p), float(sc)] for p, sc in cfg.files],
                                    "layer_range": list(cfg.layer_range) if cfg.layer_range else None,
                                    "mode": cfg.mode, "direction": cfg.direction})
        # "model" is for people (a refusal names the file or split set it was saved with); the hash,
        # over every part of a split set, is what must match
        return {"model_hash": self.eng.model_hash, "model": set_label(self.eng.model_path),
                "architecture": info.architecture, "n_layer": info.n_layer,
                "n_kv_heads": info.n_head_kv, "head_dim": info.head_dim,
                "tokenizer": self.eng.tokenizer.fingerprint, "chat_template": text_hash(self.eng.template or ""),
                "steering": steer or "none", "steering_vector": described,
                "kv_format": self.eng.kv_fmt.label}

    def save(self, req: SaveSession, handle: Handle) -> SessionSaved:
        self.eng.require_model()
        reason = self.eng.guard.unavailable_reason()
        if reason:
            raise MemoryRefused(f"session save refused: {reason}")
        entry, reread = self.eng.conversations.live, False
        if req.messages is not None:
            keys = None if req.speed_projection is None else {self.handlers.cache_key(self.handlers.projection(req.speed_projection))}
            entry = self.eng.conversations.find(self.eng.prompts.storable(req.messages), keys, req.conversation)
            if entry is None:
                entry, reread = self._read_again(req, handle), True
        if entry is None or not entry.tokens:
            raise RequestError("there is no conversation to save")
        steer = entry.key.steering                # the steering its K/V was computed with
        result = sessions.save(req.path, entry, self.fingerprint(steer),
                               sync=req.sync, force=req.force, progress=lambda d, t: handle.emit(Progress("save", d, t)), log=self.eng.log)
        return SessionSaved.from_dict(result, reread=reread, speed_projection=entry.key.steered)

    def _read_again(self, req: SaveSession, handle: Handle):
        """A conversation whose K/V is no longer held (evicted, or from before a restart): read its
        messages again, with the steering asked for, into a new live K/V (progress "prefill",
        cancellable), then it is saved like any other."""
        if not req.messages or not any(m.get("role") != "system" for m in req.messages):
            raise RequestError("there is no conversation to save")
        self.eng.steering.speed_projection = self.handlers.projection(req.speed_projection)
        tok = self.eng.tokenizer
        bos = tok.token_text(tok.bos_id) if tok.bos_id is not None else ""
        # As it was held after its last reply: no generation prompt at the end, so a follow-up
        # (rendered with one) extends these tokens.
        if has_image_parts(req.messages):    # image parts: their spans (engine/vision/spans.py)
            tokens = self.eng.prompts.image_prompt(req.messages, add_generation_prompt=False)
        else:
            text = render(self.eng.template, req.messages, bos_token=bos, add_generation_prompt=False,
                          eos_token=tok.token_text(min(tok.eos_ids)) if tok.eos_ids else "")
            add_bos = tok.add_bos and not (bos and text.startswith(bos))
            tokens = tok.encode_prompt(text, add_bos=add_bos)
        if len(tokens) >= self.eng.n_ctx:
            raise ContextTooLong(f"the conversation is {len(tokens)} tokens; the context holds {self.eng.n_ctx}")
        self.eng.log(f"{req.conversation or 'save'}: K/V not held, reading {len(tokens)} tokens again")
        entry = KVEntry([], self.handlers.make_cache(), self.handlers.cache_key(),
                        messages=self.eng.prompts.storable(req.messages), owner=req.conversation)

        def read(part: list[int]) -> None:
            prefill(self.eng.model, entry.cache, part, entry.tokens, chunk=self.eng.options.prefill_chunk,
                    progress=lambda d, t: handle.emit(Progress("prefill", d, t)), cancelled=lambda: handle.cancelled,
                    pace=self.eng.turns.prefill_pace(), layerwise=not self.eng.serving.distributed)
        if has_images(tokens):
            self.eng.loaded.vision.read(self.eng.model, entry.cache, tokens, entry.tokens, read)
        else:
            read(tokens)
        self.eng.conversations.make_live(entry)
        return entry

    def clean_folder(self) -> None:
        """Temporary files of saves killed in an earlier run (only those no live save holds)."""
        folder = sessions_dir()
        if folder.is_dir():
            sessions.remove_stale_parts(folder, self.eng.log)

    def restore(self, req: RestoreSession, handle: Handle) -> SessionRestored:
        self.eng.require_model()
        reason = self.eng.guard.unavailable_reason()
        if reason:
            raise MemoryRefused(f"session restore refused: {reason}")
        # Validated (every field, the checksum over every byte, token ids, the memory guard) before
        # it is kept: a refused file never becomes the live or a parked entry.
        name = Path(req.path).expanduser().name
        _, meta, _ = sessions.read_header(req.path)
        theirs = meta.get("fp.steering") or "none"
        expected = self.fingerprint("")
        # Model, geometry and tokenizer first: a file from another model is refused for that.
        sessions.check_fingerprint(name, meta, dict(expected, steering=theirs))
        projection = self._session_projection(name, theirs, meta.get("fp.steering_vector"), req.speed_projection)
        steer = self.handlers.steering_fingerprint(projection)
        entry, result = sessions.load(req.path, dict(expected, steering=steer or "none"), self.handlers.make_cache,
                                      key=self.handlers.cache_key(projection), dtype=self.eng.dtype,
                                      n_vocab=self.eng.info.n_vocab, n_ctx=self.eng.n_ctx, admit=self.eng.guard.admit,
                                      progress=lambda d, t: handle.emit(Progress("restore", d, t)),
                                      log=self.eng.log, probe_cache=self._cache_probe,
                                      image_span=self.eng.prompts.image_span())
        entry.owner = req.conversation
        # Validated and read: only now does the live conversation step aside.
        self.eng.conversations.make_live(entry)
        return SessionRestored.from_dict(result, speed_projection=bool(steer), steering=None if not steer else {
            "fingerprint": steer, **_vector_spec(meta.get("fp.steering_vector"))})

    def _cache_probe(self) -> list:
        """This model's cache after one token: what a format-3 session file's layers are checked against."""
        return probe(self.eng.model, self.handlers.make_cache)

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



    def steering(self, req: SessionSteering) -> SessionSteeringInfo:
        return SessionSteeringInfo(_vector_spec(read_header(req.path)[1].get("fp.steering_vector")))


def _vector_spec(raw: str | None) -> dict:
    """The steering a session file names (files, layer_range, mode, direction), {} when none."""
    if not raw or raw == "none":
        return {}
    try:
        spec = json.loads(raw)
    except ValueError:
        return {}
    return spec if isinstance(spec, dict) else {}
