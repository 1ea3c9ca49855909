"""Random quantized weights written straight as GGUF blocks, for benchmark-size random files.

Drawing float32 normals and quantizing them with gguf-py runs at ~20 M weights/s for Q8_0 and ~9 M/s
for MXFP4 (measured on the 2-vCPU dev box): a Gemma-3-1B-shaped file (0.7 G weights) took half a
minute, a gpt-oss-20b-shaped one (24 layers of 32 experts) would take over half an hour. A bench only
needs random weights of about the right spread, so `RandomBlocks` writes the blocks themselves:
uniform random codes under one scale per block, drawn as bytes (~1 G weights/s). The factories take
`fast_random=True` to use it for their block weight matrices; the small tensors (embedding, output
head, norms, biases) stay ordinary float arrays, so a caller can still edit them.

* Q8_0: 32 int8 codes uniform in [-127, 127] (std 73.6) under the f16 scale std/73.6.
* MXFP4: 16 bytes of random E2M1 nibbles (rms 5.85 in gguf-py's doubled kvalues) under an e8m0
  scale byte; each block draws the exponent at or above log2(std / 5.85) so that the mean square
  over blocks is std^2.
* F32/F16: float normals (small test files; no speed-up needed).

The spread is the factory's (std), the distribution uniform instead of normal: matmul outputs sum
thousands of them, so the activations are as random as with normal weights.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import gguf
import numpy as np

_Q8_STD = math.sqrt(((2 * 127 + 1) ** 2 - 1) / 12)         # uniform integers in [-127, 127]
_MXFP4_RMS = math.sqrt(sum(v * v for v in gguf.quants.MXFP4.kvalues) / 16)


@dataclass(frozen=True)
class RandomBlocks:
    """A random weight of `shape` (numpy order: ..., rows, row length) and spread `std`, made only when
    encoded; `seed` fixes it (the factory draws it from its own generator, so a file is reproducible)."""
    shape: tuple[int, ...]
    std: float
    seed: int

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def floats(self) -> np.ndarray:
        rng = np.random.default_rng(self.seed)
        return rng.standard_normal(self.shape, dtype=np.float32) * np.float32(self.std)

    def encode(self, qtype: gguf.GGMLQuantizationType) -> tuple[np.ndarray, gguf.GGMLQuantizationType | None]:
        """(data, raw_dtype) for GGUFWriter.add_tensor, as gguf_factory._encode returns them."""
        rng = np.random.default_rng(self.seed)
        *lead, n = self.shape
        if qtype == gguf.GGMLQuantizationType.Q8_0 and n % 32 == 0:
            codes = rng.integers(-127, 128, size=(*lead, n // 32, 32), dtype=np.int8).view(np.uint8)
            scale = np.full((*lead, n // 32, 1), self.std / _Q8_STD, dtype=np.float16).view(np.uint8)
            return np.concatenate([scale, codes], axis=-1).reshape(*lead, n // 32 * 34), qtype
        if qtype == gguf.GGMLQuantizationType.MXFP4 and n % 32 == 0:
            x = math.log2(self.std / _MXFP4_RMS)
            e0 = math.floor(x)
            p_up = (4.0 ** (x - e0) - 1.0) / 3.0                 # P(exponent e0+1): mean square = std^2
            e = (128 + e0 + (rng.random((*lead, n // 32, 1), dtype=np.float32) < p_up)).astype(np.uint8)
            nibbles = rng.integers(0, 256, size=(*lead, n // 32, 16), dtype=np.uint8)
            return np.concatenate([e, nibbles], axis=-1).reshape(*lead, n // 32 * 17), qtype
        if qtype == gguf.GGMLQuantizationType.F16:
            return self.floats().astype(np.float16), None
        if qtype == gguf.GGMLQuantizationType.F32:
            return self.floats(), None
        raise ValueError(f"RandomBlocks: no fast encoding for {qtype.name} with rows of {n}")


def draw(rng: np.random.Generator, shape, std: float) -> RandomBlocks:
    """A RandomBlocks whose seed comes from the factory's generator (one draw, whatever the size)."""
    return RandomBlocks(tuple(int(s) for s in shape), float(std), int(rng.integers(2 ** 63)))
