"""Random-weight model shapes for benchmarks where no real model file can travel (a lent GPU machine).

    from bench.shapes import SHAPES, build_random_model, ignore_eos
    path = build_random_model("llama1b", Path("/tmp/strata-shapes"))   # cached by name
    engine = Engine(EngineOptions(model=str(path))).start(); ignore_eos(engine)

The files come from tests/gguf_factory.write_tiny_gguf: a real GGUF (llama architecture, Q8_0
weights, the factory's tiny byte-level BPE vocabulary of a few hundred tokens) with the layer
count, width, heads and feed-forward size of the real model. Only the vocabulary is small, so the
embedding and output matrices cost nothing and the blocks are all of the work, as in the real
model. The weights are random, so EOS can come at any step: `ignore_eos` stops the engine
treating it as the end, and raw mlx-lm's generate_step never stops on it, so every run makes all
of its tokens. The output matrix is untied and its rows for the three control tokens and for the
byte tokens 0x80-0xff are zero (a zero logit, far below the largest of the other few hundred), so
greedy replies are plain ASCII text, as a chat model's are before its end marker: a reply sent back in the next turn renders to the same
tokens, and a returning conversation is matched as it would be with a real model.
"""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Shape:
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    n_ff: int
    label: str


SHAPES: dict[str, Shape] = {
    "llama1b": Shape(16, 2048, 32, 8, 8192, "Llama-3.2-1B shape (16 x 2048, 32/8 heads, ff 8192)"),
    "smollm2": Shape(30, 576, 9, 3, 1536, "SmolLM2-135M shape (30 x 576, 9/3 heads, ff 1536)"),
    # The tests' tiny model: the model's own work is next to nothing, so host work shows.
    "tiny": Shape(2, 64, 4, 2, 128, "tiny (2 x 64, 4/2 heads, ff 128)"),
}
# Qwen3.5-like hybrids (tests/gguf_factory_qwen35.py): three Gated DeltaNet layers in four, gated attention
# in the fourth. "qwen35-0.8b" is close to Qwen3.5-0.8B (24 x 1024, 8/2 attention heads of 256, 16 DeltaNet
# key and value heads of 128, ff 3584); "qwen35-tiny" is the tests' size, for CPU runs.
HYBRID_SHAPES: dict[str, dict] = {
    "qwen35-0.8b": dict(n_layer=24, n_embd=1024, n_head=8, n_head_kv=2, head_dim=256, n_ff=3584, n_k_heads=16,
                        n_v_heads=16, head_k_dim=128, n_rot=64),
    "qwen35-tiny": dict(n_layer=4, n_embd=256, n_head=2, n_head_kv=1, head_dim=128, n_ff=512, n_k_heads=2,
                        n_v_heads=4, head_k_dim=64, n_rot=32),
}
CHOICES = (*SHAPES, *HYBRID_SHAPES)


def build_random_model(name: str, folder: Path, *, context_length: int = 16384, nextn: int = 0) -> Path:
    """Write (once; reused when the file exists) the Q8_0 random-weight GGUF of shape `name`. `nextn=1`
    (the Qwen3.5-like shapes only) adds a NextN/MTP head block, as the converter writes it (`--spec mtp`)."""
    if name not in CHOICES:
        raise SystemExit(f"unknown shape {name!r}; choose from {', '.join(CHOICES)}")
    if nextn and name not in HYBRID_SHAPES:
        raise SystemExit(f"a NextN head is written for the Qwen3.5-like shapes only ({', '.join(HYBRID_SHAPES)})")
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"random-{name}{'-mtp' if nextn else ''}-q8_0-v3.gguf"
    if path.exists():
        return path
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    if name in HYBRID_SHAPES:
        return _build_hybrid(name, path, context_length, nextn)
    s = SHAPES[name]
    from tests import gguf_factory
    t0 = time.perf_counter()
    tmp = path.with_suffix(".part")
    make_weights = gguf_factory.tiny_hf_weights

    def weights_without_control_logits(*a, **kw):
        w = make_weights(*a, **kw)
        n_special = len(gguf_factory.SPECIAL_TOKENS)
        w["lm_head.weight"][:n_special] = 0.0
        # the byte tokens 0x80-0xff: alone they are broken UTF-8, which a real model rarely emits
        w["lm_head.weight"][n_special + 0x80:n_special + 0x100] = 0.0
        return w
    gguf_factory.tiny_hf_weights = weights_without_control_logits
    try:
        gguf_factory.write_tiny_gguf(tmp, "llama", n_layer=s.n_layer, n_embd=s.n_embd, n_head=s.n_head,
                                     n_head_kv=s.n_head_kv, n_ff=s.n_ff, tensor_type="Q8_0",
                                     tie_embeddings=False, context_length=context_length,
                                     name=f"random {name}")
    finally:
        gguf_factory.tiny_hf_weights = make_weights
    tmp.rename(path)
    print(f"built {path.name} ({path.stat().st_size / 1e6:.0f} MB) in {time.perf_counter() - t0:.0f} s",
          file=sys.stderr)
    return path


def _build_hybrid(name: str, path: Path, context_length: int, nextn: int = 0) -> Path:
    """A random Qwen3.5-like GGUF (Q8_0, the factory's tiny vocabulary, output rows of the control and
    high byte tokens zeroed as for the dense shapes)."""
    tests = str(ROOT / "tests")
    if tests not in sys.path:
        sys.path.insert(0, tests)             # the qwen35 factory imports gguf_factory by its own name
    import gguf_factory
    import gguf_factory_qwen35 as q
    t0 = time.perf_counter()
    tmp = path.with_suffix(".part")
    make = q._tensors

    def without_control_logits(*a, **kw):
        t = make(*a, **kw)
        n_special = len(gguf_factory.SPECIAL_TOKENS)
        t["output.weight"][:n_special] = 0.0
        t["output.weight"][n_special + 0x80:n_special + 0x100] = 0.0
        return t
    q._tensors = without_control_logits
    try:
        q.write_tiny_qwen35_gguf(tmp, "qwen35", tensor_type="Q8_0", tie_embeddings=False,
                                 context_length=context_length, name=f"random {name}", nextn=nextn,
                                 **HYBRID_SHAPES[name])
    finally:
        q._tensors = make
    tmp.rename(path)
    print(f"built {path.name} ({path.stat().st_size / 1e6:.0f} MB) in {time.perf_counter() - t0:.0f} s",
          file=sys.stderr)
    return path


def ignore_eos(engine) -> None:
    """Make the engine run every request to max_tokens (random weights emit EOS at random)."""
    from engine.engine import Call

    def clear(e):
        e.tokenizer.eos_ids = set()
    engine.call(Call(clear))
