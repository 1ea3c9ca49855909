"""The LoadModel request on the engine thread: a GGUF (and the draft it names) read, checked against the
memory guard before any tensor is read, built into one LoadedModel that replaces the last one whole
(a refused load leaves the old one serving)."""
from __future__ import annotations

from engine.api import LoadModel, ModelFacts, ModelLoaded, model_id
from engine.events import Handle, Progress, Log
import mlx.core as mx
import logging
from engine.cache import kv_reserve
from engine.steer import steering
from engine.text.chat_template import generation_prompt
from engine.device import compute_dtype, on_gpu
from engine.model.gguf_file import content_hash, open_gguf, set_hash
from engine.cache.kv_format import choose_for
from engine.loaded_model import LoadedModel
from engine.model.memory_estimate import fit_for_load, gpu_working_set
from engine.model.models import resolve_model
from engine.text.reasoning import opens_think
from engine.text.tokenizer import load_tokenizer
from engine.steer.control_vector import ControlVector, ControlVectorError
from engine.vision.find import chosen as find_projector
from engine.vision.mmproj import load_projector, plan as plan_projector
from engine.vision.spans import Vision


class ModelLoad:
    """One per engine (`Engine.loads`); holds nothing but its engine."""

    def __init__(self, engine):
        self.eng = engine

    def load(self, req: LoadModel, handle: Handle) -> ModelLoaded:
        path = resolve_model(req.path)
        g = open_gguf(path)
        self.eng.drafts.release("a model load")      # drafts for the old target; its memory counts for the fit
        self.eng.drafts.forget_mtp()
        handle.emit(Progress("load", 0, len(g.reader.tensors)))
        tokenizer = load_tokenizer(g)
        dtype = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}.get(
            self.eng.options.dtype or "", compute_dtype())
        # The image projector (named, or found beside the model), checked from its header: its bytes
        # count in the fit; one that cannot serve this model refuses the load when named.
        found, named = find_projector(path, req.mmproj)
        vplan = plan_projector(found, named, g.architecture, int(g.get(f"{g.architecture}.embedding_length", 0) or 0),
                               dtype.size, req.image_max_tokens)
        # Refuse (or shrink the default context) before any tensor is read when it cannot fit.
        n_ctx, memory_line = fit_for_load(path, self.eng.options.context_length, str(dtype).rsplit(".", 1)[-1],
                                          self.eng.guard, gpu_working_set(), extra_bytes=vplan.bytes)
        progress = lambda d, t: handle.emit(Progress("load", d, t))  # noqa: E731
        model, info = self.eng.serving.load_model(g, dtype, progress)   # distributed: this rank's part
        steer_cfg = self.eng.in_force.steering if req.steering == "keep" else req.steering
        vector, steering_error = _control_vector(steer_cfg, info)
        # --kv-bits this head size or this attention cannot take: refused
        kv_format = choose_for(model, self.eng.in_force.kv_bits, info.head_dim)
        # A draft named with the load is built with it, as one unit (mlx-lm's ModelProvider): one that
        # cannot load (no such file, another vocabulary, no memory left) refuses the whole load.
        draft = self.eng.drafts.load(req.draft, path, dtype, n_ctx) if req.draft else None
        vision = _vision(vplan.path, g.architecture, info.n_embd, dtype, req.image_max_tokens)
        model_hash = set_hash(g.files)          # a split model: the whole set
        template = g.get("tokenizer.chat_template")
        facts = ModelFacts(model_path=str(path), model_id=model_id(path), name=getattr(info, "name", "") or "",
                           info=dict(info.__dict__), n_ctx=n_ctx, model_hash=model_hash,
                           distributed=self.eng.serving.status(),
                           think_open=opens_think(generation_prompt(template if isinstance(template, str) else None)),
                           vision=vision.kind if vision is not None else None)
        # Everything validated: swap in the new load whole (a failed load above leaves the old one serving).
        self.eng.in_force.steering = steer_cfg
        self.eng.loaded = LoadedModel(
            model=model, tokenizer=tokenizer, info=info, path=path, template=template,
            model_hash=model_hash, n_ctx=n_ctx, dtype=dtype, kv_format=kv_format,
            steering=steering.SteeringState(vector, speed_projection=bool(vector) and self.eng.in_force.speed_projection),
            steering_error=steering_error, facts=facts, draft=draft, vision=vision)
        self._after_swap(vector, dtype)
        self._log_load(vplan, memory_line, self._touch_kv_memory(info, dtype), handle)
        return ModelLoaded(model=str(path), info=info.__dict__, steering_error=steering_error, facts=self.eng.facts,
                           draft=str(draft.path) if draft is not None else None)

    def _after_swap(self, vector, dtype) -> None:
        if vector is not None:
            # Wrapped only when a vector is loaded: without one a decode step pays for no wrapper.
            steering.install(self.eng.model, self.eng.steering)
            # Compile the steering kernel now (seconds on a GPU's first use), not in a request.
            secs = steering.warm_up(vector, dtype)
            self.eng.log(f"control vector op ({steering.active_backend()}) compiled in {secs * 1e3:.0f} ms")
        self.eng.serving.after_load(self.eng)
        self.eng.conversations.clear()

    def _log_load(self, vplan, memory_line: str, reserved, handle: Handle) -> None:
        loaded = self.eng.loaded
        path, info, vision, n_ctx = loaded.path, loaded.info, loaded.vision, loaded.n_ctx
        self.eng.log(f"model: {path.name} ({info.architecture}, {info.n_layer} layers, "
                     f"{info.n_params / 1e6:.0f}M params, {info.file_type}), context {n_ctx}, "
                     f"compute {str(loaded.dtype).removeprefix('mlx.core.')}")
        self.eng.log(f"weights: {info.load_note}")
        if vision is not None:
            s = vision.projector.spec
            self.eng.log(f"images: {vplan.path.name} ({s.projector}, up to {s.tower.max_tokens(s)} tokens an image, "
                         f"{vision.projector.nbytes / 2**20:.1f} MiB)")
        elif vplan.skipped:
            self.eng.log(vplan.skipped)
        self.eng.log(memory_line)
        asked = self.eng.options.context_length
        if asked and asked > n_ctx and info.context_length <= n_ctx:
            # Capped to the model's own context: said on stderr (a warning), not only in the -v log.
            note = f"context: {asked} tokens asked, but {path.name} holds at most {n_ctx}: using {n_ctx}"
            logging.getLogger("strata").warning(note)
            handle.emit(Log(note))
        self.eng.log(f"K/V: {self.eng.kv_fmt.describe()}")
        self.eng.log(reserved.note)
        if self.eng.serving.describe():
            self.eng.log(self.eng.serving.describe())
        if loaded.steering.vector is not None:
            self.eng.log(loaded.steering.vector.describe())
        if loaded.steering_error:
            self.eng.log(f"control vector refused: {loaded.steering_error}; serving without it")

    def _touch_kv_memory(self, info, dtype):
        """On the CPU, one context's K/V (capped) allocated and freed at load, as llama.cpp's context
        creation does, so a restore into this new process does not pay for fresh pages (kv_reserve.py)."""
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


def _control_vector(cfg, info) -> tuple[ControlVector | None, str | None]:
    """The steering configuration's vector for this model, or why not (a vector made for another model
    must not cost the user the model: it serves without it)."""
    if cfg is None or not getattr(cfg, "files", ()):
        return None, None
    try:
        return ControlVector.load(cfg, info.n_layer, info.n_embd), None
    except ControlVectorError as e:
        return None, str(e)


def _vision(path, architecture: str, n_embd: int, dtype, image_max_tokens: int) -> Vision | None:
    """The projector at `path` (None: none) loaded for this model. The budget is part of the spans'
    identity: an image's K/V and features under another budget (another size, other tokens) are never
    taken for this one's."""
    if path is None:
        return None
    salt = content_hash(path) + (f"|{image_max_tokens}" if image_max_tokens else "")
    return Vision(load_projector(path, architecture, n_embd, dtype, image_max_tokens), dtype, salt)
