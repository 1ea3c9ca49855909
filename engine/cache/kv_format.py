"""K/V storage format: 16-bit (mlx-lm's KVCache) or 8/4-bit (mlx-lm's QuantizedKVCache).

Quantized K/V uses MLX's affine quantization along head_dim: per group of `group` values a scale and
a bias. Group 64 when head_dim allows it (SmolLM2: 30 layers x 3 K/V heads x 64 -> 11,520 B/token of
8-bit codes + 720 B of float16 scales/biases = 12,240 B/token in a session file, vs 23,040 at 16 bit),
else 32. Everything that touches the cache's arrays by layout (parking's byte count and prefix copy,
session files) asks engine/cache/layer_cache.py (the cache contract), the one place that knows the layouts.

The live cache keeps float16 scales and biases (see HalfScaleQuantizedKVCache), and session files
(engine/session_files/session_quant.py) store quantized K/V exactly as held (codes uint32, scales and biases
float16), with the format in the file's `kv_dtype` and the fingerprint's `kv_format` ("float16",
"q8g64", "q4g64", ...); a file of another format is refused with the reason (no conversion: re-quantizing 8-bit codes to 4 bits, or widening them to 16, would give a
K/V that no engine run produced).
"""
from __future__ import annotations

from dataclasses import dataclass
from mlx_lm.models.cache import make_prompt_cache


from engine.cache import layer_cache
from engine.errors import RequestError
# the engine's quantized K/V class (float16 scales and biases) lives with the cache contract
from engine.cache.layer_cache import half_scale_cache_class  # noqa: F401 - kv_format.half_scale_cache_class for callers
from engine.limits import KV_BITS as BITS   # the one list of widths (plain Python: the app reads it too)


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


def choose_for(model, bits: int, head_dim: int) -> KVFormat:
    """choose(), and the refusal of a quantized format the model's attention cannot read: mlx-lm's
    quantized attention has no attention sinks (gpt-oss: 'Quantized SDPA does not support attention
    sinks' at the first step, an internal error, before this check)."""
    fmt = choose(bits, head_dim)
    layers = getattr(model, "layers", None) or []
    if fmt.quantized and any(getattr(getattr(la, "self_attn", None), "sinks", None) is not None for la in layers):
        raise RequestError(f"{fmt.describe()} is not available for this model: mlx-lm's quantized attention "
                           "has no attention sinks (gpt-oss); use 16-bit K/V")
    return fmt


def describe_label(label: str | None) -> str:
    if label in (None, "", "float16"):
        return "16-bit K/V"
    try:
        bits, group = label[1:].split("g")
        return f"{int(bits)}-bit K/V (group {int(group)})"
    except ValueError:
        return f"K/V format {label!r}"


def make_cache(model, fmt: KVFormat) -> list:
    """The model's own per-layer caches (mlx-lm's make_prompt_cache), its full K/V layers quantized
    when `fmt` says so (a sliding window or a recurrent state stays as the model made it: mlx-lm
    cannot quantize those). Every layer must be a kind engine/cache/layer_cache.py knows."""
    cache = make_prompt_cache(model)
    if fmt.quantized:
        half = half_scale_cache_class()
        cache = [half(group_size=fmt.group, bits=fmt.bits) if layer_cache.kind_of(c).name == "kv" else c
                 for c in cache]
    return layer_cache.check(cache)


# The per-layer byte count, prefix copy and arrays now live in the cache contract
# (engine/cache/layer_cache.py); these names stay for callers of one layer.
def nbytes(c) -> int:
    return layer_cache.kind_of(c).nbytes(c)


def copy_prefix(src, dst, n: int) -> None:
    """dst (an empty cache of the same kind) gets its own copy of src's first n cells."""
    got = layer_cache.kind_of(src).copy_prefix(src, n)
    if got is None:
        raise ValueError(f"a {layer_cache.kind_of(src).name} cache cannot copy a prefix of {n}")
    vars(dst).update(vars(got))


def arrays_of(c) -> list:
    """The arrays to mx.eval after filling a cache."""
    return layer_cache.kind_of(c).arrays(c)


# ---- session files: engine/session_files/session_quant.py stores quantized K/V as held ------------------------
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
