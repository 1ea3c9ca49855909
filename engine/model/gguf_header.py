"""A validating scan of a GGUF header, run before gguf-py (or anything else) allocates for it.

gguf-py trusts every count in the file: an array count of 2^40 makes it loop and allocate until memory
runs out, an invalid UTF-8 string ends in UnicodeDecodeError much later. This scan walks the header
once with struct reads on a memory map and checks, before anything is built from it:

- every count and length (KV count, tensor count, key and string lengths, array counts, n_dims, dims)
  against the bytes left in the file and against sane maxima;
- every string is valid UTF-8; arrays are not nested; value types are known;
- the keys the engine reads have the type it expects (a `general.architecture` retyped as an array is
  refused here, not discovered as a crash later);
- each tensor's type is known, its row length fits its block size and its data lies inside the file.

Every failure is a ModelFileError of one line naming the file.
"""
from __future__ import annotations

import mmap
import os
import re
import stat
import struct
import time
from dataclasses import dataclass, field
from pathlib import Path

from engine.errors import ModelFileError

MAX_KV = 1 << 16             # llama.cpp's own models carry < 100; a bound keeps a corrupt count cheap
MAX_TENSORS = 1 << 20
MAX_KEY_LEN = 1 << 16
MAX_DIMS = 4                  # GGML_MAX_DIMS
MAX_ARRAY = 1 << 28           # > any real vocabulary or merges list, < what would exhaust memory
DEFAULT_ALIGNMENT = 32
SCAN_SECONDS = 10.0           # per file: a real header (a 256k vocabulary) scans in well under a second


def _kind_of(mode: int) -> str:
    return ("a folder" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode) else
            "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else
            "a socket" if stat.S_ISSOCK(mode) else "not a regular file")


def open_regular(path: Path):
    """`path` opened for reading (binary, buffered) when, after following links, it is a regular file;
    else ModelFileError of one line. Opened without blocking (a FIFO's open would wait for a writer)
    and checked on the open descriptor, so nothing can swap the file in between."""
    path = Path(path)
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        raise ModelFileError(f"cannot read {path}: {e.strerror or e}") from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise ModelFileError(f"{path.name} is not a model file: it is {_kind_of(mode)}, not a regular file")
        if hasattr(os, "set_blocking"):
            os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise

# GGUF value types: id -> (name, fixed size or None for strings/arrays)
_U8, _I8, _U16, _I16, _U32, _I32, _F32, _BOOL, _STR, _ARR, _U64, _I64, _F64 = range(13)
_FIXED = {_U8: "B", _I8: "b", _U16: "H", _I16: "h", _U32: "I", _I32: "i", _F32: "f", _BOOL: "?",
          _U64: "Q", _I64: "q", _F64: "d"}
_TYPE_NAMES = {_U8: "uint8", _I8: "int8", _U16: "uint16", _I16: "int16", _U32: "uint32", _I32: "int32",
               _F32: "float32", _BOOL: "bool", _STR: "string", _ARR: "array", _U64: "uint64", _I64: "int64",
               _F64: "float64"}
_INTS = frozenset({_U8, _I8, _U16, _I16, _U32, _I32, _U64, _I64})
_NUMS = _INTS | {_F32, _F64}

# What the engine reads, and the type it needs. "int"/"num"/"bool-ish" accept any width.
_GENERAL = {
    "general.architecture": "str", "general.name": "str", "general.file_type": "int",
    "general.alignment": "u32",
    "tokenizer.ggml.model": "str", "tokenizer.ggml.pre": "str", "tokenizer.chat_template": "str",
    "tokenizer.ggml.tokens": "str[]", "tokenizer.ggml.merges": "str[]", "tokenizer.ggml.scores": "num[]",
    "tokenizer.ggml.token_type": "int[]",
    "tokenizer.ggml.bos_token_id": "int", "tokenizer.ggml.eos_token_id": "int",
    "tokenizer.ggml.eot_token_id": "int", "tokenizer.ggml.unknown_token_id": "int",
    "tokenizer.ggml.padding_token_id": "int",
    "tokenizer.ggml.add_bos_token": "flag", "tokenizer.ggml.add_space_prefix": "flag",
    "split.no": "int", "split.count": "int", "split.tensors.count": "int",     # engine/model/gguf_split.py
}
# `<arch>.<suffix>` keys (any architecture prefix)
_ARCH = {
    "block_count": "int", "context_length": "int", "embedding_length": "int", "feed_forward_length": "int*",
    "attention.head_count": "int", "attention.head_count_kv": "int*", "attention.key_length": "int",
    "attention.value_length": "int", "vocab_size": "int",
    "attention.layer_norm_rms_epsilon": "num", "rope.freq_base": "num",
    # the keys of the families read through engine/model/archs/ (checked for range in gguf_family_checks)
    "attention.sliding_window": "int", "attention.sliding_window_pattern": "flag*",
    "attention.shared_kv_layers": "int", "attention.key_length_swa": "int", "attention.value_length_swa": "int",
    "embedding_length_per_layer_input": "int", "embedding_length_out": "int",
    "rope.dimension_count": "int", "rope.dimension_count_swa": "int", "rope.freq_base_swa": "num",
    "final_logit_softcapping": "num", "expert_count": "int", "expert_used_count": "int",
    "expert_feed_forward_length": "int", "expert_shared_feed_forward_length": "int",
    "expert_weights_scale": "num", "nextn_predict_layers": "int", "full_attention_interval": "int",
    "ssm.group_count": "int", "ssm.time_step_rank": "int", "ssm.state_size": "int", "ssm.inner_size": "int",
    "ssm.conv_kernel": "int", "rope.scaling.type": "str", "rope.scaling.factor": "num",
    "rope.scaling.original_context_length": "int", "rope.scaling.yarn_beta_fast": "num",
    "rope.scaling.yarn_beta_slow": "num", "rope.scaling.yarn_log_multiplier": "num",
    "rope.scaling.attn_factor": "num", "rope.scaling.finetuned": "flag", "logit_scale": "num",
    "embedding_scale": "num", "residual_scale": "num", "attention.scale": "num",
    "attention.temperature_scale": "num",
}
_KIND_TEXT = {"str": "a string", "u32": "a uint32", "int": "an integer", "num": "a number",
              "flag": "a bool", "str[]": "an array of strings", "num[]": "an array of numbers",
              "int[]": "an array of integers", "int*": "an integer or one per layer",
              "flag*": "a bool or integer, or one per layer"}


@dataclass
class TensorInfo:
    name: str
    shape: tuple[int, ...]        # GGUF order: ne0 (the row length) first
    ggml_type: int
    offset: int                   # from the start of the data section
    n_bytes: int


@dataclass
class HeaderScan:
    version: int
    kv_types: dict[str, tuple[int, int | None]] = field(default_factory=dict)   # key -> (type, elem type)
    tensors: dict[str, TensorInfo] = field(default_factory=dict)
    data_start: int = 0


def _kind_ok(kind: str, vtype: int, etype: int | None) -> bool:
    if kind.endswith("*"):      # llama.cpp's get_key_or_arr: one value, or one per layer (Gemma 4)
        return _kind_ok(kind[:-1], vtype, etype) or _kind_ok(kind[:-1] + "[]", vtype, etype)
    if kind.endswith("[]"):
        if vtype != _ARR:
            return False
        kind = kind[:-2]
        vtype = etype
    return {"str": vtype == _STR, "u32": vtype == _U32, "int": vtype in _INTS, "num": vtype in _NUMS,
            "flag": vtype == _BOOL or vtype in _INTS}[kind]


def expected_kind(key: str) -> str | None:
    if key in _GENERAL:
        return _GENERAL[key]
    prefix, _, suffix = key.partition(".")
    if prefix not in ("general", "tokenizer") and suffix in _ARCH:
        return _ARCH[suffix]
    return None


class _Cursor:
    def __init__(self, buf, name: str, endian: str):
        self.buf, self.name, self.e = buf, name, endian
        self.pos, self.size = 0, len(buf)

    def fail(self, what: str) -> ModelFileError:
        return ModelFileError(f"{self.name} is truncated or corrupt: {what}")

    def need(self, n: int, what: str) -> None:
        if n < 0 or n > self.size - self.pos:
            raise self.fail(f"{what} at byte {self.pos} needs {n} bytes, the file has "
                            f"{max(0, self.size - self.pos)} left")

    def unpack(self, fmt: str, what: str):
        n = struct.calcsize(fmt)
        self.need(n, what)
        (v,) = struct.unpack_from(self.e + fmt, self.buf, self.pos)
        self.pos += n
        return v

    def string(self, what: str, max_len: int | None = None) -> str:
        n = self.unpack("Q", f"{what} length")
        if max_len is not None and n > max_len:
            raise self.fail(f"{what} length {n} is over the limit of {max_len}")
        self.need(n, what)
        raw = self.buf[self.pos:self.pos + n]
        self.pos += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise self.fail(f"{what} is not valid UTF-8 (byte {self.pos - n + e.start})") from None

    def skip_string(self, what: str) -> None:
        # Array elements: length-checked and UTF-8-checked without keeping a Python str each.
        n = self.unpack("Q", f"{what} length")
        self.need(n, what)
        start = self.pos
        self.pos += n
        try:
            self.buf[start:self.pos].decode("utf-8")
        except UnicodeDecodeError:
            raise self.fail(f"{what} is not valid UTF-8") from None


def scan_header(path: Path) -> HeaderScan:
    """Validate `path`'s header (the magic is already checked); ModelFileError on the first problem."""
    name = path.name
    try:
        with open_regular(path) as f:
            size = os.fstat(f.fileno()).st_size
            if size < 24:
                raise ModelFileError(f"{name} is truncated or corrupt: {size} bytes, a GGUF header needs at least 24")
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
                return _scan(mm, name, size)
    except OSError as e:
        raise ModelFileError(f"cannot read {path}: {e.strerror or e}") from None


def _scan_kv(c: "_Cursor", scan: HeaderScan, n_kv: int, size: int, in_time) -> int:
    """The key/value section, every value's type and size checked (an array's count against what the
    file holds); the keys' types into `scan`. Returns the file's alignment."""
    name = c.name
    alignment = DEFAULT_ALIGNMENT
    for i in range(n_kv):
        in_time(i)
        key = c.string(f"key #{i}", MAX_KEY_LEN)
        if key in scan.kv_types:
            raise c.fail(f"key '{key[:80]}' appears twice")
        vtype = c.unpack("I", f"type of '{key[:80]}'")
        etype = None
        if vtype == _ARR:
            etype = c.unpack("I", f"element type of '{key[:80]}'")
            count = c.unpack("Q", f"element count of '{key[:80]}'")
            if etype == _ARR:
                raise c.fail(f"'{key[:80]}' is an array of arrays (not supported)")
            if etype not in _TYPE_NAMES:
                raise c.fail(f"'{key[:80]}' has unknown element type {etype}")
            elem = 8 if etype == _STR else struct.calcsize(_FIXED[etype])
            if count > MAX_ARRAY or count * elem > size - c.pos:
                raise c.fail(f"'{key[:80]}' claims {count} elements, more than the file holds")
            if etype == _STR:
                for j in range(count):
                    in_time(j)
                    c.skip_string(f"'{key[:80]}'[{j}]")
            else:
                c.pos += count * elem
        elif vtype == _STR:
            value = c.string(f"value of '{key[:80]}'")
            if key == "general.architecture" and not re.fullmatch(r"[A-Za-z0-9_-]{1,64}", value):
                raise c.fail(f"general.architecture {value[:40]!r} is not an architecture name")
        elif vtype in _FIXED:
            value = c.unpack(_FIXED[vtype], f"value of '{key[:80]}'")
            if key == "general.alignment" and vtype == _U32:
                if value == 0 or value & (value - 1) or value > 1 << 16:
                    raise c.fail(f"general.alignment {value} is not a power of two up to 65536")
                alignment = value
        else:
            raise c.fail(f"'{key[:80]}' has unknown value type {vtype}")
        kind = expected_kind(key)
        if kind is not None and not _kind_ok(kind, vtype, etype):
            got = _TYPE_NAMES.get(vtype, str(vtype)) + (f" of {_TYPE_NAMES[etype]}" if etype is not None else "")
            raise ModelFileError(f"{name}: metadata '{key}' must be {_KIND_TEXT[kind]}, the file has {got}")
        scan.kv_types[key] = (vtype, etype)

    return alignment


def _scan_tensors(c: "_Cursor", scan: HeaderScan, n_tensors: int, in_time) -> list:
    """The tensor infos, each name, shape and type checked; into `scan.tensors`, and returned in order."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    sizes = {int(k): v for k, v in GGML_QUANT_SIZES.items()}
    infos = []
    for i in range(n_tensors):
        in_time(i)
        tname = c.string(f"tensor #{i} name", MAX_KEY_LEN)
        n_dims = c.unpack("I", f"n_dims of tensor '{tname[:80]}'")
        if not 1 <= n_dims <= MAX_DIMS:
            raise c.fail(f"tensor '{tname[:80]}' has {n_dims} dimensions (1 to {MAX_DIMS} allowed)")
        c.need(8 * n_dims, f"dims of tensor '{tname[:80]}'")
        shape = struct.unpack_from(f"{c.e}{n_dims}Q", c.buf, c.pos)
        c.pos += 8 * n_dims
        gtype = c.unpack("I", f"type of tensor '{tname[:80]}'")
        offset = c.unpack("Q", f"offset of tensor '{tname[:80]}'")
        if gtype not in sizes:
            raise c.fail(f"tensor '{tname[:80]}' has unknown type {gtype}")
        if tname in scan.tensors:
            raise c.fail(f"tensor '{tname[:80]}' appears twice")
        block, type_size = sizes[gtype]
        if shape[0] % block:
            raise c.fail(f"tensor '{tname[:80]}' rows of {shape[0]} do not fit "
                         f"{GGMLQuantizationType(gtype).name} blocks of {block}")
        n_el = 1
        for d in shape:
            n_el *= d                      # Python ints: no overflow, checked against the file below
        info = TensorInfo(tname, tuple(shape), gtype, offset, n_el // block * type_size)
        scan.tensors[tname] = info
        infos.append(info)
    return infos


def _scan(buf, name: str, size: int) -> HeaderScan:
    (version,) = struct.unpack_from("<I", buf, 4)
    endian = "<"
    if version & 0xFFFF == 0 and version != 0:   # a big-endian file, as gguf-py detects it
        endian = ">"
        (version,) = struct.unpack_from(">I", buf, 4)
    if version not in (2, 3):
        raise ModelFileError(f"{name}: GGUF version {version} is not supported (2 and 3 are)")
    c = _Cursor(buf, name, endian)
    c.pos = 8
    deadline = time.monotonic() + SCAN_SECONDS

    def in_time(j: int) -> None:
        if j & 0xFFFF == 0 and time.monotonic() > deadline:
            raise ModelFileError(f"{name}: the header takes longer than {SCAN_SECONDS:.0f} s to read "
                                 f"(at byte {c.pos}); not a model file")
    n_tensors = c.unpack("Q", "tensor count")
    n_kv = c.unpack("Q", "key/value count")
    # The smallest KV is 8 (key length) + 1 (key) + 4 (type) + 1 (a uint8); the smallest tensor info
    # 8 (name length) + 4 (n_dims) + 4 (type) + 8 (offset).
    if n_kv > MAX_KV or n_kv * 14 > size - c.pos:
        raise c.fail(f"key/value count {n_kv} cannot fit in the file (limit {MAX_KV})")
    if n_tensors > MAX_TENSORS or n_tensors * 24 > size - c.pos:
        raise c.fail(f"tensor count {n_tensors} cannot fit in the file (limit {MAX_TENSORS})")
    scan = HeaderScan(version)
    alignment = _scan_kv(c, scan, n_kv, size, in_time)
    infos = _scan_tensors(c, scan, n_tensors, in_time)
    data_start = c.pos + (-c.pos % alignment)
    scan.data_start = data_start
    for t in infos:
        if t.offset % alignment:
            raise c.fail(f"tensor '{t.name[:80]}' offset {t.offset} is not aligned to {alignment}")
        end = data_start + t.offset + t.n_bytes
        if end > size:
            raise ModelFileError(f"{name} is truncated: tensor '{t.name[:80]}' ends at byte {end}, "
                                 f"file has {size}")
    return scan
