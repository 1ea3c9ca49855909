"""What a model load produced is one value (issue 28 item 4): engine/loaded_model.LoadedModel, replaced
whole by each load and by a K/V format change, never edited in place; a refused load leaves the one
serving untouched. The real engine on two tiny generated GGUFs (random weights)."""
from __future__ import annotations

import dataclasses

import pytest

from engine.engine import Configure, Engine, EngineOptions, LoadModel
from engine.errors import EngineError
from engine.loaded_model import LoadedModel
from gguf_factory import write_tiny_gguf


def loaded(engine: Engine) -> LoadedModel:
    return engine.loaded            # an inline engine: this thread is its engine thread


def test_each_load_swaps_one_value_whole(tmp_path):
    a = write_tiny_gguf(tmp_path / "a.gguf", seed=1)
    b = write_tiny_gguf(tmp_path / "b.gguf", seed=2, n_layer=3, n_head=2, n_head_kv=2)   # head size 32: 8-bit K/V fits
    engine = Engine(EngineOptions(model=str(a))).inline()
    try:
        engine.startup.result(120)
        first = loaded(engine)
        assert first.path == a and first.info.n_layer == 2 and first.facts is engine.model_facts()
        with pytest.raises(dataclasses.FrozenInstanceError):
            first.n_ctx = 1                                          # type: ignore[misc]

        engine.call(LoadModel(str(b)), timeout=120)
        second = loaded(engine)
        assert second is not first and second.path == b and second.info.n_layer == 3
        assert second.model is not first.model and second.model_hash != first.model_hash
        assert first.path == a and first.info.n_layer == 2           # the old value is as it was
        # The engine's views read the one value.
        e = engine
        views = (e.model, e.tokenizer, e.n_ctx, e.dtype, e.model_hash, e.kv_fmt)
        assert views == (second.model, second.tokenizer, second.n_ctx, second.dtype, second.model_hash,
                         second.kv_format)

        with pytest.raises(EngineError):
            engine.call(LoadModel(str(tmp_path / "missing.gguf")), timeout=60)
        assert loaded(engine) is second                             # a refused load changes nothing

        engine.call(Configure(kv_bits=8), timeout=60)
        third = loaded(engine)
        assert third is not second and third.kv_format.bits == 8 and second.kv_format.bits == 16
        assert third.model is second.model and third.facts is second.facts   # the same weights, a new value
    finally:
        engine.stop()
