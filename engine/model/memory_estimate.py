"""How much memory a GGUF model will take in Strata, before loading it: plain Python (no mlx, no
numpy), reading the GGUF header only, so the app's model list can use it too.

    total = weights + K/V + overhead

* **weights** -- every tensor as the loader (engine/model/quants.py) will hold it in MLX: F32/F16/BF16 as
  dense arrays of the compute dtype; Q8_0/Q4_0/Q4_1/Q5_0/Q5_1/Q4_K/Q5_K as packed 8/4/5-bit values
  plus a scale and a bias (compute dtype) per group of 32; Q6_K/Q3_K/Q2_K and the IQ/TQ types at the
  bits engine/model/quants.py holds them in (HELD_BITS: IQ3_S 4, IQ3_XXS 6, IQ1_S and TQ* 2, the others
  8); 1-D quantized tensors dense. MoE expert stacks are counted like any other tensor (all experts stay
  resident). ``weight_sizes`` sets the held bytes beside the file's own (bits per weight), so the
  model list and ``strata models estimate`` say what a file really costs in memory.
* **K/V** -- n_layer x n_head_kv x (key_length + value_length) x the K/V dtype (= the compute dtype:
  mlx-lm's cache stores what the model computes) per token, for the context rounded up to mlx-lm's
  256-token cache step. A hybrid recurrent model (Qwen3.5/3.6) keeps K/V in its attention layers only
  and a fixed recurrent + convolution state per sequence in the others (engine/model/hybrid_layout.py).
  Gemma 3/4 keep K/V growing with the context in their global layers only; a sliding layer holds its
  window plus one prefill chunk, and Gemma 4's K/V-sharing layers none (engine/model/gemma_layout.py).
* **overhead** (stated, not measured per model) -- 300 MiB for the runtime (MLX, Python, tokenizer),
  plus what one prefill chunk of 512 tokens materialises: its logits (chunk x vocab, float32), the
  attention scores of one layer (chunk x n_head x context, compute dtype) and the FFN activations
  (chunk x 3 x width: the dense width, or top-k x the expert width plus the shared expert's).
  The scores are counted on every backend although MLX's fused attention on Metal may never
  materialise them, so on a Mac the long-context estimate errs high. Measured on the CPU backend:
  a 2 x 512-token prefill peaks at 19.6 MiB over the weights where this counts 24.1 MiB (tiny MoE,
  context 1024; tests/engine/test_memory_estimate.py).

The budget (``budget()``): on a Mac with Metal, MLX's ``max_recommended_working_set_size`` (the
unified memory the GPU may wire); elsewhere (Linux, the CPU backend) the memory guard's available
reading minus its reserve. The app never imports mlx: its model list uses the budget the engine
reports in its status (``load_budget``), or the guard's reading until the engine has answered.
"""
from __future__ import annotations

import math
import os
import struct
import time
from dataclasses import dataclass, replace
from pathlib import Path

from engine.model import gemma_layout, gguf_split, hybrid_layout
from engine.errors import MemoryRefused, ModelFileError, StrataError
from engine.model.gguf_schema import ArrayLen, HeaderView, check_view

MiB, GiB = 1 << 20, 1 << 30
RUNTIME_OVERHEAD = 300 * MiB
PREFILL_CHUNK = 512
KV_STEP = 256                 # mlx-lm's KVCache grows in steps of 256 tokens
MIN_CONTEXT = 256
GROUP = 32
MAX_COUNT = 1 << 40           # no hyperparameter (context, width, heads, vocabulary) comes near this
HEADER_SECONDS = 10.0         # per file: a real header (a 256k vocabulary) reads in well under a second

# GGML type id -> (name, bits per value as held in MLX, or None = dense in the compute dtype)
_TYPES = {0: ("F32", None), 1: ("F16", None), 30: ("BF16", None),
          8: ("Q8_0", 8), 2: ("Q4_0", 4), 3: ("Q4_1", 4), 6: ("Q5_0", 5), 7: ("Q5_1", 5),
          12: ("Q4_K", 4), 13: ("Q5_K", 5), 14: ("Q6_K", 8), 11: ("Q3_K", 8), 10: ("Q2_K", 8),
          20: ("IQ4_NL", 8), 23: ("IQ4_XS", 8), 18: ("IQ3_XXS", 6), 21: ("IQ3_S", 4), 16: ("IQ2_XXS", 8),
          17: ("IQ2_XS", 8), 22: ("IQ2_S", 8), 19: ("IQ1_S", 2), 29: ("IQ1_M", 8), 34: ("TQ1_0", 2),
          35: ("TQ2_0", 2)}
# GGML type id -> (values per block, bytes per block) in the file (gguf-py's GGML_QUANT_SIZES, kept here
# because this module imports neither numpy nor gguf)
FILE_BLOCKS = {0: (1, 4), 1: (1, 2), 30: (1, 2), 8: (32, 34), 2: (32, 18), 3: (32, 20), 6: (32, 22),
                7: (32, 24), 12: (256, 144), 13: (256, 176), 14: (256, 210), 11: (256, 110), 10: (256, 84),
                20: (32, 18), 23: (256, 136), 18: (256, 98), 21: (256, 110), 16: (256, 66), 17: (256, 74),
                22: (256, 82), 19: (256, 50), 29: (256, 56), 34: (256, 54), 35: (256, 66), 39: (32, 17)}
_MXFP4 = 39        # gpt-oss's experts: held as MLX mxfp4 (engine/model/quants.py), not dequantized
_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_PER_LAYER_TYPES = (0, 1, 2, 3, 4, 5, 7, 10, 11)    # integer and bool arrays kept as tuples up to:
MAX_PER_LAYER = 4096


class ModelTooLarge(MemoryRefused):
    """Loading this model at this context would not fit in memory; the message has the numbers."""


@dataclass(frozen=True)
class TensorInfo:
    name: str
    ggml_type: int
    shape: tuple[int, ...]      # GGUF order (ne0 first)

    @property
    def n_elements(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class GGUFHeader:
    path: Path
    metadata: dict              # scalars and strings; arrays as their length, but small integer/bool ones
                                # (per-layer values: Gemma 4's sliding pattern, feed-forward widths) as tuples
    tensors: tuple[TensorInfo, ...]
    array_keys: frozenset[str] = frozenset()    # the keys whose value is an array (in `metadata` as a
                                                # tuple, or as its length when long or not integers)
    parts: tuple[Path, ...] = ()                # a split model's files, first part first (engine/model/gguf_split.py);
                                                # () for a single file

    @property
    def files(self) -> tuple[Path, ...]:
        """The files the model's tensors are in: its parts, or the one file."""
        return self.parts or (self.path,)

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", ""))

    def view(self) -> HeaderView:
        """The header as engine/gguf_schema checks it."""
        prefix = f"{self.architecture}."
        values = {k: (ArrayLen(int(v)) if k in self.array_keys and not isinstance(v, tuple) else v)
                  for k, v in self.metadata.items() if k.startswith(prefix)}
        return HeaderView(self.path.name, self.architecture, values, {t.name: t.shape for t in self.tensors})

    def arch_int(self, suffix: str, default: int = 0) -> int:
        """An `<arch>.<suffix>` count: a whole number from 0 to MAX_COUNT (a float one is taken when it is
        whole; inf, NaN, fractions, negatives and absurd sizes are refused in one line)."""
        key = f"{self.architecture}.{suffix}"
        v = self.metadata.get(key, default)
        if isinstance(v, tuple) and v:      # one value per layer: the largest (the estimate errs high)
            v = max(v)
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise ModelFileError(f"{self.path.name}: '{key}' is not a number")
        if isinstance(v, float) and not (math.isfinite(v) and v.is_integer()):
            raise ModelFileError(f"{self.path.name}: '{key}' is {v!r}, not a whole number")
        if not 0 <= v <= MAX_COUNT:
            raise ModelFileError(f"{self.path.name}: '{key}' is {int(v)}: out of range (0 to {MAX_COUNT})")
        return int(v)


class _Reader:
    """Reads with every length checked against the bytes left in the file, no recursion (arrays of
    arrays are refused, as engine/model/gguf_header.py does) and a deadline (HEADER_SECONDS)."""

    def __init__(self, f, size: int):
        self.f, self.size = f, size
        self.deadline = time.monotonic() + HEADER_SECONDS

    def left(self) -> int:
        return self.size - self.f.tell()

    def in_time(self, i: int) -> None:
        if i & 0xFFFF == 0 and time.monotonic() > self.deadline:
            raise ValueError(f"the header takes longer than {HEADER_SECONDS:.0f} s to read")

    def unpack(self, fmt: str):
        size = struct.calcsize(fmt)
        data = self.f.read(size)
        if len(data) != size:
            raise ValueError("truncated header")
        return struct.unpack(fmt, data)[0]

    def string(self) -> str:
        n = self.unpack("<Q")
        if n > 1 << 24 or n > self.left():
            raise ValueError("implausible string length")
        return self.f.read(n).decode("utf-8")          # strict, as engine/model/gguf_header.py

    def value(self, vtype: int):
        """Scalars and strings as values; arrays skipped and returned as their length."""
        if vtype in _SCALARS:
            return self.unpack(_SCALARS[vtype])
        if vtype == 8:
            return self.string()
        if vtype == 9:
            itype, n = self.unpack("<I"), self.unpack("<Q")
            if itype in _PER_LAYER_TYPES and n <= MAX_PER_LAYER:
                if struct.calcsize(_SCALARS[itype]) * n > self.left():
                    raise ValueError(f"an array of {n} elements is longer than the file")
                return tuple(self.unpack(_SCALARS[itype]) for _ in range(n))
            if itype in _SCALARS:
                span = struct.calcsize(_SCALARS[itype]) * n
                if span > self.left():
                    raise ValueError(f"an array of {n} elements is longer than the file")
                self.f.seek(span, 1)
            elif itype == 8:
                if n * 8 > self.left():
                    raise ValueError(f"an array of {n} strings is longer than the file")
                for i in range(n):
                    self.in_time(i)
                    m = self.unpack("<Q")
                    if m > self.left():
                        raise ValueError("implausible string length")
                    self.f.seek(m, 1)
            elif itype == 9:
                raise ValueError("an array of arrays (not supported)")
            else:
                raise ValueError(f"unknown GGUF array element type {itype}")
            return n
        raise ValueError(f"unknown GGUF value type {vtype}")


_HEADERS: dict[tuple[str, int, int], GGUFHeader] = {}


def read_header(path: str | Path) -> GGUFHeader:
    """The metadata and tensor table of a GGUF model (no tensor data is read): one file, or a split set
    opened by its first part (every part read and checked by engine/model/gguf_split.py, the tensors of all
    parts in one table, `parts` naming the files)."""
    h = _read_one(path)
    if not gguf_split.is_split(h):
        return h
    parts = gguf_split.read_parts(h, _read_one)
    return GGUFHeader(h.path, h.metadata, tuple(t for part in parts for t in part.tensors), h.array_keys,
                      tuple(part.path for part in parts))


def _read_one(path: str | Path) -> GGUFHeader:
    """One file's header, kept per (path, size, mtime): the model list's metadata, its estimate and a
    load's fit check read a file once."""
    p = Path(path)
    try:
        st = p.stat()
    except OSError as e:
        raise ModelFileError(f"cannot read {p}: {e.strerror or e}") from None
    key = (str(p.resolve()), st.st_size, st.st_mtime_ns)
    if key not in _HEADERS:
        if len(_HEADERS) >= 256:
            _HEADERS.clear()
        _HEADERS[key] = _read_header(p)
    return _HEADERS[key]


def _read_header(p: Path) -> GGUFHeader:
    from engine.model.gguf_header import _KIND_TEXT, _TYPE_NAMES, _kind_ok, expected_kind, open_regular
    try:
        with open_regular(p) as f:         # a FIFO, a device or a folder: refused, never waited on
            if f.read(4) != b"GGUF":
                raise ModelFileError(f"{p.name} is not a GGUF file")
            r = _Reader(f, os.fstat(f.fileno()).st_size)
            version = r.unpack("<I")
            if version < 2:
                raise ModelFileError(f"{p.name}: GGUF version {version} is too old")
            n_tensors, n_kv = r.unpack("<Q"), r.unpack("<Q")
            if n_tensors > 1 << 24 or n_kv > 1 << 24 or (n_tensors + n_kv) * 13 > r.left():
                raise ValueError("implausible tensor or key count")
            meta, arrays = {}, set()
            for i in range(n_kv):
                r.in_time(i)
                key = r.string()
                vtype = r.unpack("<I")
                etype = None
                if vtype == 9:                 # peek the element type, for the key's type check
                    etype = r.unpack("<I")
                    r.f.seek(-4, 1)
                    arrays.add(key)
                meta[key] = r.value(vtype)
                kind = expected_kind(key)
                if kind is not None and not _kind_ok(kind, vtype, etype):
                    got = _TYPE_NAMES.get(vtype, str(vtype)) + (f" of {_TYPE_NAMES.get(etype, etype)}"
                                                                 if etype is not None else "")
                    raise ModelFileError(f"{p.name}: metadata '{key[:80]}' must be "
                                         f"{_KIND_TEXT[kind]}, the file has {got}")
            tensors = []
            for i in range(n_tensors):
                r.in_time(i)
                name = r.string()
                n_dims = r.unpack("<I")
                if n_dims > 8:
                    raise ValueError(f"tensor '{name[:80]}' has {n_dims} dimensions")
                shape = tuple(r.unpack("<Q") for _ in range(n_dims))
                ggml_type = r.unpack("<I")
                r.unpack("<Q")  # data offset
                tensors.append(TensorInfo(name, ggml_type, shape))
    except OSError as e:
        raise ModelFileError(f"cannot read {p}: {e.strerror or e}") from None
    except MemoryError:
        raise ModelFileError(f"{p.name}: its header does not fit in the memory the reader may use") from None
    except (ValueError, struct.error, UnicodeDecodeError, OverflowError) as e:
        raise ModelFileError(f"{p.name} is truncated or corrupt ({e})") from None
    return GGUFHeader(p, meta, tuple(tensors), frozenset(arrays))


def tensor_bytes(t: TensorInfo, dtype_bytes: int) -> int:
    """Bytes of one tensor as engine/model/quants.py holds it in MLX."""
    n = t.n_elements
    if t.ggml_type == _MXFP4 and len(t.shape) >= 2:
        return n // 2 + n // GROUP          # MLX's mxfp4: 4-bit codes, one uint8 exponent a group, no biases
    name, bits = _TYPES.get(t.ggml_type, ("?", None))
    if bits is None or len(t.shape) < 2:
        return n * dtype_bytes
    return n * bits // 8 + 2 * (n // GROUP) * dtype_bytes


def file_tensor_bytes(t: TensorInfo) -> int:
    """Bytes of one tensor in the file (0 for a type this module does not know)."""
    block, size = FILE_BLOCKS.get(t.ggml_type, (1, 0))
    return t.n_elements // block * size


@dataclass(frozen=True)
class WeightSizes:
    """The weights as the file stores them and as Strata holds them, for people: bits per weight."""
    n_weights: int
    file_bytes: int
    held_bytes: int

    @property
    def file_bpw(self) -> float:
        return 8 * self.file_bytes / self.n_weights if self.n_weights else 0.0

    @property
    def held_bpw(self) -> float:
        return 8 * self.held_bytes / self.n_weights if self.n_weights else 0.0

    def line(self) -> str:
        return f"{self.file_bpw:.2f} bits/weight in the file, {self.held_bpw:.2f} held"


def weight_sizes(h: GGUFHeader, dtype: str = "float16") -> WeightSizes:
    """Every tensor's file bytes and held bytes (computing in `dtype`), summed."""
    db = _DTYPE_BYTES[dtype]
    return WeightSizes(sum(t.n_elements for t in h.tensors), sum(file_tensor_bytes(t) for t in h.tensors),
                       sum(tensor_bytes(t, db) for t in h.tensors))


@dataclass(frozen=True)
class MemoryEstimate:
    weights_bytes: int
    kv_bytes_per_token: int
    n_ctx: int
    kv_dtype: str
    fixed_overhead_bytes: int      # runtime + the context-independent part of one prefill chunk
    scores_bytes_per_token: int    # attention scores of one chunk, per token of context
    state_bytes: int = 0           # recurrent + convolution states of a hybrid model (engine/model/hybrid_layout.py):
                                   # fixed per sequence, whatever the context
    window_bytes: int = 0          # K/V of sliding-window layers (Gemma 3/4, engine/model/gemma_layout.py): fixed too

    @property
    def kv_bytes(self) -> int:
        return self.kv_bytes_per_token * _kv_slots(self.n_ctx)

    @property
    def overhead_bytes(self) -> int:
        return self.fixed_overhead_bytes + self.scores_bytes_per_token * self.n_ctx

    @property
    def total_bytes(self) -> int:
        return self.weights_bytes + self.kv_bytes + self.state_bytes + self.window_bytes + self.overhead_bytes

    def at_context(self, n_ctx: int) -> "MemoryEstimate":
        return MemoryEstimate(self.weights_bytes, self.kv_bytes_per_token, n_ctx, self.kv_dtype,
                              self.fixed_overhead_bytes, self.scores_bytes_per_token, self.state_bytes,
                              self.window_bytes)

    def largest_context(self, budget_bytes: int, limit: int) -> int:
        """The largest context (a multiple of the 256-token cache step, <= limit) whose total fits
        in budget_bytes; 0 when not even MIN_CONTEXT fits."""
        per_token = self.kv_bytes_per_token + self.scores_bytes_per_token
        room = budget_bytes - self.weights_bytes - self.fixed_overhead_bytes - self.state_bytes - self.window_bytes
        if room <= 0 or per_token <= 0:
            return 0
        n = min(limit, room // per_token) // KV_STEP * KV_STEP
        while n >= MIN_CONTEXT and self.at_context(n).total_bytes > budget_bytes:
            n -= KV_STEP
        return n if n >= MIN_CONTEXT else 0

    def line(self) -> str:
        state = f" + recurrent state {gib(self.state_bytes)}" if self.state_bytes else ""
        state += f" + sliding-window K/V {gib(self.window_bytes)}" if self.window_bytes else ""
        return (f"needs {gib(self.total_bytes)}: weights {gib(self.weights_bytes)} + K/V {gib(self.kv_bytes)} "
                f"({self.n_ctx} tokens, {self.kv_dtype}){state} + overhead {gib(self.overhead_bytes)}")


def _kv_slots(n_ctx: int) -> int:
    return -(-n_ctx // KV_STEP) * KV_STEP


def gib(n: int) -> str:
    """A byte count for people: GiB from 1 GiB up, MiB below."""
    return f"{n / GiB:.2f} GiB" if abs(n) >= GiB else f"{n / MiB:.1f} MiB"


def default_context(h: GGUFHeader, requested: int | None = None) -> int:
    """The engine's rule: the requested context, else the model's capped at 8192; never beyond the
    model's own."""
    model_ctx = h.arch_int("context_length", 4096) or 4096
    return min(requested or min(model_ctx, 8192), model_ctx)


def estimate(h: GGUFHeader, n_ctx: int, dtype: str = "float32") -> MemoryEstimate:
    """The estimate for header ``h`` at context ``n_ctx``, computing (and caching K/V) in ``dtype``."""
    if dtype not in _DTYPE_BYTES:
        raise StrataError(f"unknown compute dtype {dtype!r}")
    db = _DTYPE_BYTES[dtype]
    # the block count tied to the tensor table and each family's keys checked: the layouts below size
    # per-layer lists from them
    check_view(h.view())
    n_embd = h.arch_int("embedding_length")
    n_head = h.arch_int("attention.head_count")
    n_layer = h.arch_int("block_count")
    if not (n_embd > 0 and n_head > 0 and n_layer > 0):
        raise ModelFileError(f"{h.path.name}: missing '{h.architecture}.*' hyperparameters")
    n_head_kv = h.arch_int("attention.head_count_kv", n_head) or n_head
    k_len = h.arch_int("attention.key_length", n_embd // n_head) or n_embd // n_head
    v_len = h.arch_int("attention.value_length", k_len) or k_len
    n_vocab = h.arch_int("vocab_size", 0) or int(h.metadata.get("tokenizer.ggml.tokens", 0) or 0)
    n_expert = h.arch_int("expert_count", 0)
    if n_expert > 0:
        up = next((t for t in h.tensors if t.name == "blk.0.ffn_up_exps.weight"), None)
        n_ff_exp = up.shape[1] if up is not None and len(up.shape) == 3 else h.arch_int("expert_feed_forward_length")
        ffn_width = h.arch_int("expert_used_count", 1) * n_ff_exp + h.arch_int("expert_shared_feed_forward_length", 0)
    else:
        ffn_width = h.arch_int("feed_forward_length", 4 * n_embd)
    weights = sum(tensor_bytes(t, db) for t in h.tensors)
    hybrid = hybrid_layout.layout(h)        # Qwen3.5/3.6: K/V in the attention layers only, plus a fixed state
    kv_layers = hybrid.n_attention if hybrid else n_layer
    # Qwen3.5/3.6's NextN/MTP head (its weights are in `weights`): its own K/V, one attention layer, while
    # `--spec mtp` drafts (engine/generation/mtp_spec.py); other archs count their NextN blocks in block_count already
    kv_layers += h.arch_int("nextn_predict_layers", 0) if hybrid else 0
    kv_per_token = kv_layers * n_head_kv * (k_len + v_len) * db
    gemma = gemma_layout.layout(h, PREFILL_CHUNK)   # Gemma 3/4: global layers grow, sliding ones hold a window
    if gemma:
        kv_per_token = gemma.kv_bytes_per_token(db)
    chunk = PREFILL_CHUNK
    fixed = RUNTIME_OVERHEAD + chunk * n_vocab * 4 + chunk * 3 * ffn_width * db + chunk * 4 * n_embd * db
    return MemoryEstimate(weights, kv_per_token, n_ctx, dtype, fixed, 2 * chunk * n_head * db,
                          hybrid.state_bytes(db) if hybrid else 0, gemma.window_bytes(db) if gemma else 0)


@dataclass(frozen=True)
class Budget:
    bytes: int
    source: str                 # e.g. "meminfo available 12.3 GiB - reserve 1.6 GiB"


def budget(reading, reserve_bytes: int, gpu_working_set: int | None = None) -> Budget:
    """What a model may take. On a Mac with Metal: the unified memory the GPU may wire (MLX's
    max_recommended_working_set_size), as the issue asks -- macOS makes room for it by compressing
    and paging out other apps, which the guard's conservative available reading does not count.
    Elsewhere: the guard's available reading (Linux: /proc/meminfo MemAvailable; else psutil)
    minus the guard's reserve."""
    if gpu_working_set:
        return Budget(int(gpu_working_set), f"Metal recommended working set less what MLX holds: "
                                            f"{gib(gpu_working_set)}")
    avail = reading.available_bytes - reserve_bytes
    source = f"{reading.source}: {gib(reading.available_bytes)} available - {gib(reserve_bytes)} reserve"
    return Budget(max(0, avail), source)


@dataclass(frozen=True)
class Fit:
    estimate: MemoryEstimate
    budget: Budget | None       # None: the memory reading failed (then nothing is refused)
    largest_context: int        # the largest context that fits (0: none), given the model's limit

    @property
    def fits(self) -> bool:
        return self.budget is None or self.estimate.total_bytes <= self.budget.bytes

    def line(self) -> str:
        if self.budget is None:
            return f"{self.estimate.line()}; available memory unknown"
        verdict = "fits" if self.fits else "does not fit"
        more = ""
        if not self.fits:
            more = (f"; the largest context that fits is {self.largest_context}" if self.largest_context
                    else "; no context fits")
        return f"{self.estimate.line()}; {verdict} in {gib(self.budget.bytes)} ({self.budget.source}){more}"


def check_fit(h: GGUFHeader, n_ctx: int, dtype: str, budget_: Budget | None, extra_bytes: int = 0) -> Fit:
    """`extra_bytes`: what loads with the model besides its own weights (an image projector and one
    image's activations), counted with the weights."""
    est = estimate(h, n_ctx, dtype)
    if extra_bytes:
        est = replace(est, weights_bytes=est.weights_bytes + extra_bytes)
    model_ctx = h.arch_int("context_length", 4096) or 4096
    largest = est.largest_context(budget_.bytes, model_ctx) if budget_ is not None else n_ctx
    return Fit(est, budget_, largest)


def platform_dtype() -> str:
    """The compute dtype the engine will pick, guessed without importing mlx (for the app): float16
    on Apple silicon (Metal), float32 elsewhere (the CPU backend)."""
    import platform
    import sys
    return "float16" if sys.platform == "darwin" and platform.machine() == "arm64" else "float32"


def gpu_working_set() -> int | None:
    """On Metal: MLX's max_recommended_working_set_size (what the GPU may wire) less what MLX
    already holds (the loaded model, its K/V, parked conversations: the old model stays until a
    new one has loaded); else None. Imports mlx: for the engine side only."""
    try:
        import mlx.core as mx
        if not mx.metal.is_available():
            return None
        info = mx.device_info() if hasattr(mx, "device_info") else mx.metal.device_info()
        ws = int(info.get("max_recommended_working_set_size") or 0)
        held = mx.get_active_memory() if hasattr(mx, "get_active_memory") else mx.metal.get_active_memory()
        return max(1, ws - int(held)) if ws else None
    except Exception:  # noqa: BLE001 -- an unreadable limit is just not used
        return None


def load_budget(guard, gpu_ws: int | None) -> Budget | None:
    """The budget from the guard (and the Metal working set); None when neither can be read."""
    reading = guard.reading()
    if reading is None and not gpu_ws:
        return None
    return budget(reading, guard.reserve_bytes or 0, gpu_ws)


def fit_for_load(path, requested_ctx: int | None, dtype: str, guard, gpu_ws: int | None,
                 extra_bytes: int = 0) -> tuple[int, str]:
    """(context to load with, one log line), or ModelTooLarge. An explicit context that does not fit
    is refused with the largest that does; the default context shrinks to fit when some context does
    (the log line says so). Nothing is refused when the guard cannot read the available memory."""
    h = read_header(path)
    n_ctx = default_context(h, requested_ctx)
    b = load_budget(guard, gpu_ws)
    fit = check_fit(h, n_ctx, dtype, b, extra_bytes)
    if fit.fits:
        return n_ctx, f"memory: {fit.line()}"
    if requested_ctx is None and fit.largest_context:
        n = fit.largest_context
        return n, f"memory: context reduced from {n_ctx} to {n} to fit: {check_fit(h, n, dtype, b, extra_bytes).line()}"
    raise ModelTooLarge(f"{h.path.name} at context {n_ctx} {fit.line()}")
