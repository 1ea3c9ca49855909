"""bench/shapes.py's family shapes (issue 29's speed item: bench/engine.py --random-shape gemma3-1b,
gpt-oss-20b-e8): their files are written from quantized random blocks (tests/gguf_random_blocks.py), not
quantized floats. Checked here on tiny variants of the same writers: the blocks decode (gguf-py) to the
spread the factory asks for; the file is one of the named architecture that Strata's loader holds as a
real one (Q8_0 affine 8-bit, the experts on MLX's mxfp4, the weights equal to the file's decoded ones;
mlx-lm's own window caches); the bench's premise holds: greedy never picks a zeroed output row, so the
engine makes all its tokens as plain text.
"""
from __future__ import annotations

import sys
from pathlib import Path

import gguf
import mlx.core as mx
import numpy as np
import pytest

from gguf_random_blocks import RandomBlocks

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
from bench.shapes import FAMILY_SHAPES, dead_rows, ignore_eos, write_family  # noqa: E402

Q8_0, MXFP4 = gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.MXFP4

# the layouts of gemma3-1b and gpt-oss-20b-e8 at test size (bench/shapes.py's own tiny shapes)
TINY = {"gemma3": FAMILY_SHAPES["gemma3-tiny"], "gpt-oss": FAMILY_SHAPES["gpt-oss-tiny"]}


@pytest.mark.parametrize("qtype", [Q8_0, MXFP4], ids=["Q8_0", "MXFP4"])
@pytest.mark.parametrize("std", [0.01, 0.06, 0.4])
def test_random_blocks_decode_to_the_asked_spread(qtype, std):
    data, raw = RandomBlocks((4, 96, 256), std, seed=3).encode(qtype)
    assert raw == qtype
    x = gguf.quants.dequantize(data, qtype)
    assert x.shape == (4, 96, 256)
    # measured: within 0.2% (Q8_0) and 0.9% (MXFP4: the per-block exponent draw) of std; |mean| <= 0.003 std
    assert abs(x.std() / std - 1) < 0.05
    assert abs(x.mean()) < 0.02 * std
    again, _ = RandomBlocks((4, 96, 256), std, seed=3).encode(qtype)
    assert np.array_equal(again, data)                  # the seed fixes the file


def _mlx_weight(module) -> np.ndarray:
    """A quantized module's weight as MLX decodes it (what the model computes with)."""
    w = mx.dequantize(module.weight, module.scales, getattr(module, "biases", None), group_size=module.group_size,
                      bits=module.bits, mode=getattr(module, "mode", "affine"))
    return np.array(w.astype(mx.float32))


@pytest.mark.parametrize("family", ["gemma3", "gpt-oss"])
def test_family_shape_file_loads_as_its_architecture(family, tmp_path):
    from mlx_lm.models.cache import KVCache, RotatingKVCache

    from engine.engine import Engine, EngineOptions
    from engine.api import GenerateRequest
    from engine.model.gguf_file import open_gguf
    from engine.model.model_loader import load_model
    from engine.sampling import SamplingParams
    s = TINY[family]
    path = write_family(s, tmp_path / f"{family}.gguf", context_length=1024, name=s.label)
    r = gguf.GGUFReader(str(path))
    assert bytes(r.fields["general.architecture"].parts[-1]).decode() == family
    t = {x.name: x for x in r.tensors}
    n_layer = s.kwargs["n_layer"]
    dead = dead_rows(family)
    head = t["output.weight"]
    head = head.data if head.tensor_type == gguf.GGMLQuantizationType.F32 else \
        gguf.quants.dequantize(head.data, head.tensor_type)
    assert not head[dead].any() and np.abs(np.delete(head, dead, axis=0)).min(axis=1).max() > 0

    model, _ = load_model(open_gguf(path), dtype=mx.float32)
    assert type(model).__module__.endswith("gemma3_text" if family == "gemma3" else "gpt_oss")
    kinds = [type(c) for c in model.make_cache()]
    if family == "gemma3":      # no pattern key: every 6th layer global (llama.cpp's default)
        assert kinds == [RotatingKVCache] * 5 + [KVCache]
    else:                       # even blocks windowed
        assert kinds == [RotatingKVCache, KVCache]
    # the held weights are the file's, decoded: Q8_0 as MLX's affine 8-bit (scale and zero per 32),
    # MXFP4 repacked exactly
    q = t["blk.0.attn_q.weight"]
    assert q.tensor_type == Q8_0
    held = _mlx_weight(model.layers[0].self_attn.q_proj)
    np.testing.assert_allclose(held, gguf.quants.dequantize(q.data, Q8_0), rtol=0, atol=1e-6)
    if family == "gpt-oss":
        up = t["blk.1.ffn_up_exps.weight"]
        assert up.tensor_type == MXFP4
        proj = model.layers[1].mlp.experts.up_proj
        assert proj.mode == "mxfp4"
        assert np.array_equal(_mlx_weight(proj), gguf.quants.dequantize(up.data, MXFP4))
    del model

    engine = Engine(EngineOptions(model=str(path), cache_mib=0)).start()
    try:
        ignore_eos(engine)
        gen = engine.call(GenerateRequest(prompt="The history of the printing press begins",
                                          sampling=SamplingParams(max_tokens=40)))
        assert gen.generated_tokens == 40           # past the 16-token window
        assert not set(gen.tokens) & set(dead)
        assert gen.text.isascii()
    finally:
        engine.stop()

