"""What one model load produced, as one value: the engine holds a `LoadedModel` (or None) and replaces it
whole at each load (a failed load leaves the previous one serving, untouched), instead of a dozen loose
attributes set one by one. Plain Python: the MLX objects inside are only referenced here.

Mutable parts it references stay the engine thread's: the SteeringState's per-request switch, the
model's weights, the draft's K/V. A draft model named by the load (`LoadModel.draft`) is part of it, as
mlx-lm's ModelProvider loads a draft with its model: built with the model, dropped with it. A request
naming another draft loads that one for itself (engine/drafts.py, `Engine.drafts.named`).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.api import ModelFacts


@dataclass(frozen=True)
class LoadedModel:
    model: Any                  # the mlx-lm Model (a PipelineModel/TensorModel part when distributed)
    tokenizer: Any              # tokenizer.Tokenizer
    info: Any                   # gguf_file.ModelInfo
    path: Path                  # the GGUF file
    template: str | None        # its chat template (tokenizer.chat_template), None when it has none
    model_hash: str             # gguf_file.set_hash: the K/V identity's model part
    n_ctx: int                  # the context this load allows (fit to memory and the model)
    dtype: Any                  # mx.Dtype of compute and of 16-bit K/V
    kv_format: Any              # kv_format.KVFormat of new conversations (Configure swaps it)
    steering: Any               # steering.SteeringState shared by the model's SteeredLayers
    steering_error: str | None  # why the configured control vector was refused (served without it)
    facts: ModelFacts           # the immutable summary other threads may read (Engine.model_facts)
    draft: Any = None           # speculative.DraftModel loaded with the model (LoadModel.draft), or None
    vision: Any = None          # vision.spans.Vision: the image projector loaded with it (LoadModel.mmproj), or None

    def with_kv_format(self, kv_format) -> "LoadedModel":
        """The same load with another K/V format for new conversations (held ones keep theirs)."""
        return dataclasses.replace(self, kv_format=kv_format)


@dataclass
class InForce:
    """The engine's settings in force (`Engine.in_force`): started from its immutable EngineOptions and
    changed by Configure and loads: the K/V width of new conversations, the projection's default, and
    the control-vector config a load keeps ("keep")."""
    kv_bits: int
    speed_projection: bool
    steering: Any

    @classmethod
    def of(cls, options) -> "InForce":
        return cls(options.kv_bits, options.speed_projection, options.steering)
