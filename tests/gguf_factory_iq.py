"""Tiny models in the IQ and ternary types, made by llama.cpp's own quantizer (llama_model_quantize, in
the oracle's worker process) from a random-weight F32 model.

IQ2_XXS, IQ2_XS, IQ2_S, IQ1_S and IQ1_M cannot be made without an importance matrix; ``tiny_imatrix``
makes one from the tiny model itself, as llama-imatrix does: for every matrix, the mean square of each
input column over a few short texts run through the F32 model (Strata's loader, MLX on the CPU). The
token embedding, which no matmul reads in an untied model, gets the final norm's output statistics
(it is the output matrix of a tied model).
"""
from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from gguf_factory import quantize_with_llama, write_tiny_gguf

TEXTS = ["Hello world, this is a small test of the model.", "The quick brown fox jumps over the lazy dog.",
         "def add(a, b):\n    return a + b\n", "Once upon a time, in a small village by the sea,"]
# mlx-lm module path (under model.layers.N.) -> GGUF tensor kind (blk.N.<kind>.weight)
_KINDS = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
          "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
          "mlp.down_proj": "ffn_down"}


class _Recorder(nn.Module):
    """A layer that adds the squares of its input (or, with `after`, its output) to a running sum per
    column."""

    def __init__(self, inner, sums: dict, name: str, after: bool = False):
        super().__init__()
        self.inner = inner
        self._sums, self._name, self._after = sums, name, after

    def __call__(self, x):
        y = self.inner(x)
        seen = y if self._after else x
        sq = mx.sum(mx.square(seen.astype(mx.float32)).reshape(-1, seen.shape[-1]), axis=0)
        total, n = self._sums.get(self._name, (0.0, 0))
        self._sums[self._name] = (total + np.array(sq), n + int(np.prod(seen.shape[:-1])))
        return y


def tiny_imatrix(src: Path) -> dict[str, np.ndarray]:
    """Importance per input column for every 2-D tensor of the F32 tiny model at `src` (see module doc)."""
    from engine.model.gguf_file import open_gguf
    from engine.model.model_loader import load_model
    from engine.text.tokenizer import load_tokenizer
    g = open_gguf(src)
    model, _ = load_model(g)
    tok = load_tokenizer(g)
    sums: dict = {}
    for i, layer in enumerate(model.model.layers):
        for path, kind in _KINDS.items():
            parent_name, attr = path.split(".")
            parent = getattr(layer, parent_name)
            setattr(parent, attr, _Recorder(getattr(parent, attr), sums, f"blk.{i}.{kind}.weight"))
    # the final norm's output is what the output matrix (the embedding, when tied) multiplies
    model.model.norm = _Recorder(model.model.norm, sums, "output.weight", after=True)
    for text in TEXTS:
        mx.eval(model(mx.array(tok.encode(text))[None]))
    imatrix = {name: (total / n).astype(np.float32) for name, (total, n) in sums.items()}
    imatrix["token_embd.weight"] = imatrix["output.weight"]
    return imatrix


def quantized_tiny(folder: Path, ftype: str, *, arch: str = "llama", pure: bool = False, seed: int = 3) -> Path:
    """A tiny model (width 256 so the 256-value IQ blocks apply) quantized to `ftype` by llama.cpp, with
    the tiny model's importance matrix; `pure`: every 2-D tensor in the type (no per-tensor mix)."""
    folder.mkdir(parents=True, exist_ok=True)
    src = folder / f"{arch}-{seed}-F32.gguf"
    if not src.exists():
        write_tiny_gguf(src, arch=arch, n_layer=2, n_embd=256, n_head=4, n_head_kv=2, n_ff=512, seed=seed)
    dst = folder / f"{arch}-{seed}-{ftype}{'-pure' if pure else ''}.gguf"
    if not dst.exists():
        quantize_with_llama(src, dst, ftype, imatrix=tiny_imatrix(src), pure=pure)
    return dst
