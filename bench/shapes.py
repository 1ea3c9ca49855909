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

FAMILY_SHAPES (issue 29: Gemma 3 1B's layout, gpt-oss-20b's block) come from the family factories
(tests/gguf_factory_gemma.py, tests/gguf_factory_gpt_oss.py) with `fast_random`: their block weights
are drawn as quantized blocks (tests/gguf_random_blocks.py), so a 3 GB file builds in seconds.
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


@dataclass(frozen=True)
class FamilyShape:
    """A shape of another family's factory (tests/gguf_factory_gemma.py, tests/gguf_factory_gpt_oss.py):
    `kwargs` for its writer, the block weights written as random quantized blocks (fast_random)."""
    family: str          # "gemma3" | "gpt-oss"
    kwargs: dict
    label: str


# Issue 29's speed item. Gemma 3 1B's layout as the real GGUF has it (llama.cpp's converter): 26 layers of
# 1152, 4 query heads / 1 K/V head of 256, GELU-gated FFN of 6912, q/k norms, pre- and post-norms stored
# as 1+w, no final soft-capping (Gemma 3 dropped Gemma 2's), a 512-token window on five local layers to
# one global (no sliding_window_pattern key: llama.cpp's and the loader's every-6th default), RoPE base
# 10k local (no freq_base_swa key: the default) and 1M global. Q8_0 everywhere.
# gpt-oss-20b's block (2880 wide, 64 query / 8 K/V heads of 64, Q/K/V/O biases, a sink logit per head,
# a 128-token window on the even blocks, YaRN x32 over 4096, base 150k; experts of 2880 with biases and
# the clamped SwiGLU, top-4 routing), as llama.cpp's MXFP4_MOE writes it: experts MXFP4, the rest Q8_0,
# router and biases F32. 8 experts instead of 32: a token's work is its top 4 experts whatever the count,
# so decode does the real model's per-token work (its weight reads too), and a prefill the same matmuls
# (only fewer, larger expert groups); the file is 3.2 GB instead of 12 (the real 24 layers) and builds in
# seconds (19 s on the 2-CPU box). The "-l2" variant keeps 2 of the 24 blocks for the 2-CPU box.
FAMILY_SHAPES: dict[str, FamilyShape] = {
    "gemma3-1b": FamilyShape("gemma3", dict(n_layer=26, n_embd=1152, n_head=4, n_head_kv=1, head_dim=256,
                                            n_ff=6912, sliding_window=512, pattern=None, rope_theta=1e6),
                             "Gemma-3-1B layout (26 x 1152, 4/1 heads of 256, ff 6912, window 512 on 5 of 6 "
                             "layers, RoPE 10k/1M), Q8_0"),
    # the 2-CPU box: Gemma 3 1B reads a 128-token prompt in ~110 s there (MLX's CPU quantized matmul),
    # too slow for 6 alternating rounds; one 5-local-1-global period of its layers is the same work per layer
    "gemma3-1b-l6": FamilyShape("gemma3", dict(n_layer=6, n_embd=1152, n_head=4, n_head_kv=1, head_dim=256,
                                               n_ff=6912, sliding_window=512, pattern=None, rope_theta=1e6),
                                "Gemma-3-1B layout, 6 of its 26 layers (5 local, 1 global), Q8_0"),
    "gpt-oss-20b-e8": FamilyShape("gpt-oss", dict(n_layer=24, n_embd=2880, n_head=64, n_head_kv=8, head_dim=64,
                                                  n_expert=8, n_expert_used=4, n_ff_exp=2880, sliding_window=128),
                                  "gpt-oss-20b's 24 blocks with 8 of its 32 experts (2880 wide, 64/8 heads of 64, "
                                  "sinks, window 128 on even blocks, top-4 of 8 experts of 2880), MXFP4 experts, "
                                  "rest Q8_0"),
    # the 2-CPU box: 4 blocks read a 128-token prompt in ~45 s there; two (one windowed, one full) keep
    # 6 alternating rounds within minutes
    "gpt-oss-20b-e8-l2": FamilyShape("gpt-oss", dict(n_layer=2, n_embd=2880, n_head=64, n_head_kv=8, head_dim=64,
                                                     n_expert=8, n_expert_used=4, n_ff_exp=2880,
                                                     sliding_window=128),
                                     "gpt-oss-20b's block, 2 of its 24 layers (one windowed, one full), 8 of its "
                                     "32 experts (top-4), MXFP4 experts, rest Q8_0"),
    # the tests' sizes, windows of 16 that a 128-token prompt wraps: the model's work is next to nothing,
    # so the engine's host work per chunk and per step (windows, checkpoints, sinks) shows
    "gemma3-tiny": FamilyShape("gemma3", dict(n_layer=6, n_embd=128, n_head=2, n_head_kv=1, head_dim=64, n_ff=256,
                                              sliding_window=16, pattern=None, rope_theta=1e6),
                               "tiny gemma3 (6 x 128, 2/1 heads of 64, ff 256, window 16 on 5 of 6 layers)"),
    "gpt-oss-tiny": FamilyShape("gpt-oss", dict(n_layer=2, n_embd=128, n_head=4, n_head_kv=2, head_dim=32, n_expert=4,
                                                n_expert_used=2, n_ff_exp=128, sliding_window=16),
                                "tiny gpt-oss (2 x 128, 4/2 heads of 32, top-2 of 4 experts of 128, window 16)"),
}
CHOICES = (*SHAPES, *HYBRID_SHAPES, *FAMILY_SHAPES)


def build_random_model(name: str, folder: Path, *, context_length: int = 16384, nextn: int = 0) -> Path:
    """Write (once; reused when the file exists) the random-weight GGUF of shape `name` (Q8_0; gpt-oss's
    experts MXFP4). `nextn=1`
    (the Qwen3.5-like shapes only) adds a NextN/MTP head block, as the converter writes it (`--spec mtp`)."""
    if name not in CHOICES:
        raise SystemExit(f"unknown shape {name!r}; choose from {', '.join(CHOICES)}")
    if nextn and name not in HYBRID_SHAPES:
        raise SystemExit(f"a NextN head is written for the Qwen3.5-like shapes only ({', '.join(HYBRID_SHAPES)})")
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / (f"random-{name}-v1.gguf" if name in FAMILY_SHAPES else
                     f"random-{name}{'-mtp' if nextn else ''}-q8_0-v3.gguf")
    if path.exists():
        return path
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    if name in HYBRID_SHAPES:
        return _build_hybrid(name, path, context_length, nextn)
    if name in FAMILY_SHAPES:
        return _build_family(name, path, context_length)
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


def _build_family(name: str, path: Path, context_length: int) -> Path:
    t0 = time.perf_counter()
    tmp = path.with_suffix(".part")
    write_family(FAMILY_SHAPES[name], tmp, context_length=context_length, name=f"random {name}")
    tmp.rename(path)
    print(f"built {path.name} ({path.stat().st_size / 1e6:.0f} MB) in {time.perf_counter() - t0:.0f} s",
          file=sys.stderr)
    return path


def dead_rows(family: str) -> list[int]:
    """The output rows a FamilyShape file zeroes: the control tokens and the byte tokens 0x80-0xff."""
    tests = str(ROOT / "tests")
    if tests not in sys.path:
        sys.path.insert(0, tests)             # the family factories import gguf_factory by its own name
    import gguf_factory
    if family == "gemma3":
        import gguf_factory_gemma as g
        v = g.vocab("gemma3")
        n_control = len(g.SPM_SPECIALS) + len(g.GEMMA3_TURN)
        # <0x80>..<0xFF>: alone they are broken UTF-8, which a real model rarely emits
        return [*range(n_control), *range(v["tokens"].index("<0x80>"), v["tokens"].index("<0xFF>") + 1)]
    if family == "gpt-oss":
        import gguf_factory_gpt_oss as g
        _, types, _ = g.vocab()
        n_special = len(gguf_factory.SPECIAL_TOKENS)
        return ([i for i, ty in enumerate(types) if ty == gguf_factory.TOKEN_TYPE_CONTROL]
                + list(range(n_special + 0x80, n_special + 0x100)))   # the byte tokens 0x80-0xff, as SHAPES
    raise SystemExit(f"no factory for family {family!r}")


def write_family(s: FamilyShape, path: Path, *, context_length: int = 16384, name: str | None = None) -> Path:
    """A random GGUF of shape `s` at `path`: its factory with fast_random (the block weights drawn as
    quantized blocks: Q8_0, gpt-oss's experts MXFP4), output rows of the control tokens and the high
    byte tokens zeroed."""
    dead = dead_rows(s.family)
    if s.family == "gemma3":
        import gguf_factory_gemma as g
        write = g.write_tiny_gemma3
    else:
        import gguf_factory_gpt_oss as g
        write = g.write_tiny_gpt_oss_gguf

    def zero_dead_rows(t):
        t["output.weight"][dead] = 0.0
    extra = {"mxfp4_experts": True} if s.family == "gpt-oss" else {}
    return write(path, tensor_type="Q8_0", context_length=context_length, name=name, fast_random=True,
                 edit=zero_dead_rows, **extra, **s.kwargs)


def ignore_eos(engine) -> None:
    """Make the engine run every request to max_tokens (random weights emit EOS at random)."""

    def clear(e):
        e.tokenizer.eos_ids = set()
    from bench.harness import held   # lazy: the factories above need no harness
    held(engine, clear)
