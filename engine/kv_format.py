"""K/V storage format: 16-bit (mlx-lm's KVCache) or 8/4-bit (mlx-lm's QuantizedKVCache).

Quantized K/V uses MLX's affine quantization along head_dim: per group of `group` values a scale and
a bias. Group 64 when head_dim allows it (SmolLM2: 30 layers x 3 K/V heads x 64 -> 11,520 B/token of
8-bit codes + 720 B of float16 scales/biases = 12,240 B/token in a session file, vs 23,040 at 16 bit),
else 32. Everything that touches the cache's arrays by layout (parking's byte count and prefix copy,
session files) asks engine/layer_cache.py (the cache contract), the one place that knows the layouts.

The live cache keeps float16 scales and biases (see HalfScaleQuantizedKVCache), and session files
(engine/session_quant.py) store quantized K/V exactly as held (codes uint32, scales and biases
float16), with the format in the file's `kv_dtype` and the fingerprint's `kv_format` ("float16",
"q8g64", "q4g64", ...); a file of another format is refused with the reason (no conversion: re-quantizing 8-bit codes to 4 bits, or widening them to 16, would give a
K/V that no engine run produced).
"""
from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from .errors import RequestError
from .limits import KV_BITS as BITS   # the one list of widths (plain Python: the app reads it too)


@dataclass(frozen=True)
class KVFormat:
    bits: int = 16
    group: int = 64

    @property
    def quantized(self) -> bool:
        return self.bits < 16

    @property
    def label(self) -> str:
        """The session file's kv_dtype (16 bit keeps the name files had before K/V quantization)."""
        return "float16" if not self.quantized else f"q{self.bits}g{self.group}"

    def describe(self) -> str:
        return "16-bit K/V" if not self.quantized else f"{self.bits}-bit K/V (group {self.group})"


def choose(bits: int, head_dim: int) -> KVFormat:
    if bits not in BITS:
        raise RequestError(f"K/V bits must be one of {', '.join(map(str, BITS))} (got {bits})")
    if bits == 16:
        return KVFormat(16)
    for g in (64, 32):
        if head_dim % g == 0:
            return KVFormat(bits, g)
    raise RequestError(f"{bits}-bit K/V needs a head size that is a multiple of 32 (this model's is {head_dim})")


def describe_label(label: str | None) -> str:
    if label in (None, "", "float16"):
        return "16-bit K/V"
    try:
        bits, group = label[1:].split("g")
        return f"{int(bits)}-bit K/V (group {int(group)})"
    except ValueError:
        return f"K/V format {label!r}"


def _half_scale_cache_class():
    from mlx_lm.models.cache import QuantizedKVCache
    from mlx.utils import tree_map

    class HalfScaleQuantizedKVCache(QuantizedKVCache):
        """mlx-lm's QuantizedKVCache with float16 scales and biases whatever the compute dtype.

        On the CPU the engine computes in float32, and mlx-lm would keep float32 scales (12,960
        B/token for SmolLM2 at 8 bits). float16 ones take 12,240, and a session file can hold them
        bit for bit, so a restored conversation continues exactly as the live one would.
        (mx.quantized_matmul takes float16 scales with float32 inputs.)"""

        def update_and_fetch(self, keys, values):
            B, n_kv_heads, num_steps, k_head_dim = keys.shape
            v_head_dim = values.shape[-1]
            prev = self.offset
            if self.keys is None or (prev + num_steps) > self.keys[0].shape[-2]:
                el_per_int = 8 * mx.uint32.size // self.bits
                new_steps = (self.step + num_steps - 1) // self.step * self.step
                shape = (B, n_kv_heads, new_steps)

                def init_quant(dim):
                    return (mx.zeros((*shape, dim // el_per_int), dtype=mx.uint32),
                            mx.zeros((*shape, dim // self.group_size), dtype=mx.float16),
                            mx.zeros((*shape, dim // self.group_size), dtype=mx.float16))

                def expand_quant(x):
                    return mx.concatenate([x, mx.zeros((*shape, x.shape[-1]), dtype=x.dtype)], axis=-2)

                if self.keys is not None:
                    if prev % self.step != 0:
                        self.keys, self.values = tree_map(lambda x: x[..., :prev, :], (self.keys, self.values))
                    self.keys, self.values = tree_map(expand_quant, (self.keys, self.values))
                else:
                    self.keys, self.values = init_quant(k_head_dim), init_quant(v_head_dim)
            self.offset += num_steps
            keys = mx.quantize(keys, group_size=self.group_size, bits=self.bits)
            values = mx.quantize(values, group_size=self.group_size, bits=self.bits)
            for i in range(3):
                self.keys[i][..., prev:self.offset, :] = keys[i].astype(self.keys[i].dtype)
                self.values[i][..., prev:self.offset, :] = values[i].astype(self.values[i].dtype)
            return self.keys_and_values()

    return HalfScaleQuantizedKVCache


_HALF = None


def half_scale_cache_class():
    global _HALF
    if _HALF is None:
        _HALF = _half_scale_cache_class()
    return _HALF


def make_cache(model, fmt: KVFormat) -> list:
    """The model's own per-layer caches (mlx-lm's make_prompt_cache), its full K/V layers quantized
    when `fmt` says so (a sliding window or a recurrent state stays as the model made it: mlx-lm
    cannot quantize those). Every layer must be a kind engine/layer_cache.py knows."""
    from mlx_lm.models.cache import make_prompt_cache
    from . import layer_cache
    cache = make_prompt_cache(model)
    if fmt.quantized:
        half = half_scale_cache_class()
        cache = [half(group_size=fmt.group, bits=fmt.bits) if layer_cache.kind_of(c).name == "kv" else c
                 for c in cache]
    return layer_cache.check(cache)


# The per-layer byte count, prefix copy and arrays now live in the cache contract
# (engine/layer_cache.py); these names stay for callers of one layer.
def nbytes(c) -> int:
    from . import layer_cache
    return layer_cache.kind_of(c).nbytes(c)


def copy_prefix(src, dst, n: int) -> None:
    """dst (an empty cache of the same kind) gets its own copy of src's first n cells."""
    from . import layer_cache
    got = layer_cache.kind_of(src).copy_prefix(src, n)
    if got is None:
        raise ValueError(f"a {layer_cache.kind_of(src).name} cache cannot copy a prefix of {n}")
    vars(dst).update(vars(got))


def arrays_of(c) -> list:
    """The arrays to mx.eval after filling a cache."""
    from . import layer_cache
    return layer_cache.kind_of(c).arrays(c)


# ---- session files: engine/session_quant.py stores quantized K/V as held ------------------------
def format_of_label(label: str | None) -> KVFormat | None:
    """The KVFormat a file's kv_dtype names, or None when it is not one this engine writes."""
    if label in (None, "", "float16"):
        return KVFormat(16)
    try:
        bits, group = label[1:].split("g")
        fmt = KVFormat(int(bits), int(group))
    except ValueError:
        return None
    return fmt if label.startswith("q") and fmt.bits in (8, 4) and fmt.group in (32, 64) else None
