"""GGUF mutants of every architecture the engine reads: a tiny file of each family, and seeded mutants
of it over every `<arch>.*` key the file carries (the keys the family reads) and every tensor it has.

Per key: integers set to 0, 3, 65535, 2^31-1, 2^32-1 (and the widest value of a 64-bit field); NaN and
+-inf (the field retyped to the float of its width); wrong types (an integer's bits read as a float, a
string, a bool); per-layer arrays with element 0 set to those values and their count changed; strings
changed. Per tensor: dropped (renamed in place, so nothing else moves), and its first dimension halved
(the data still fits the file: a shape the hyperparameters do not give).

The mutants are generated lazily (one file's bytes at a time) and labelled, so a failure is
reproduced from its label alone.
"""
from __future__ import annotations

import math
import random
import struct
from pathlib import Path
from typing import Callable, Iterator

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from fuzz_harness import GGUFLayout, layout

# GGUF value types
_U8, _I8, _U16, _I16, _U32, _I32, _F32, _BOOL, _STR, _ARR, _U64, _I64, _F64 = range(13)
_INT_FMT = {_U8: "B", _I8: "B", _U16: "H", _I16: "H", _U32: "I", _I32: "I", _U64: "Q", _I64: "Q"}
_FLOAT_OF_WIDTH = {1: None, 2: None, 4: (_F32, "f"), 8: (_F64, "d")}
INTS = (0, 3, 65535, 2**31 - 1, 2**32 - 1)
FLOATS = (math.nan, math.inf, -math.inf, 0.0, -1.0, 3.0, 65535.0, 1e30)


def _writers() -> dict[str, Callable[[Path], Path]]:
    """architecture -> a writer of its smallest valid tiny file (what the engine loads in tens of ms)."""
    import gguf_factory as gf
    import gguf_factory_families as fam
    import gguf_factory_gemma as gem
    import gguf_factory_gemma4_mtp as mtp
    import gguf_factory_gpt_oss as oss
    import gguf_factory_qwen35 as q35
    small = dict(n_embd=64, n_head=4, n_head_kv=2)
    return {
        "llama": lambda p: gf.write_tiny_gguf(p, "llama"),
        "qwen2": lambda p: gf.write_tiny_gguf(p, "qwen2"),
        "qwen3": lambda p: gf.write_tiny_gguf(p, "qwen3", tensor_type="Q8_0"),
        "qwen2moe": lambda p: gf.write_tiny_moe_gguf(p, "qwen2moe", n_embd=64, n_ff_exp=64, n_ff_shexp=128),
        "qwen3moe": lambda p: gf.write_tiny_moe_gguf(p, "qwen3moe", n_embd=64, n_ff_exp=64, n_ff_shexp=128),
        "gemma3": lambda p: gem.write_tiny_gemma3(p, head_dim=16, n_ff=128, **small),
        "gemma4": lambda p: gem.write_tiny_gemma4(p, head_dim=16, global_head_dim=32, n_ff=128,
                                                  n_embd_per_layer=16, **small),
        "gpt-oss": lambda p: oss.write_tiny_gpt_oss_gguf(p, head_dim=16, n_ff_exp=64, **small),
        "qwen35": lambda p: q35.write_tiny_qwen35_gguf(p, "qwen35", n_embd=64, head_dim=32, n_ff=128,
                                                       head_k_dim=16, n_rot=16),
        "qwen35moe": lambda p: q35.write_tiny_qwen35_gguf(p, "qwen35moe", n_embd=64, head_dim=32,
                                                          head_k_dim=16, n_rot=16, n_ff_exp=64, n_ff_shexp=64),
        "granite": lambda p: fam.write_family_gguf(p, "granite", n_embd=64, n_ff=128),
        "olmo2": lambda p: fam.write_family_gguf(p, "olmo2", n_embd=64, n_ff=128),
        "olmo3": lambda p: fam.write_family_gguf(p, "olmo3", n_embd=64, n_ff=128),
        "mistral3": lambda p: fam.write_family_gguf(p, "mistral3", n_embd=64, n_ff=128),
        "phi3": lambda p: fam.write_family_gguf(p, "phi3", n_embd=64, n_ff=128),
        # Gemma 4's MTP drafter, read beside its target (the gemma4 file above): its own job kind
        "gemma4-assistant": lambda p: mtp.write_tiny_gemma4_assistant(
            p, n_embd=32, n_ff=64, n_embd_target=64, head_dim=16, global_head_dim=32, tensor_type="F32"),
    }


FAMILIES = tuple(_writers())


def family_file(family: str, folder: Path) -> Path:
    return _writers()[family](Path(folder) / f"{family}-tiny.gguf")


def _key_spans(data: bytes, lay: GGUFLayout, prefix: str) -> Iterator[tuple[str, int, int]]:
    """(key, offset of its type field, type) of each key under `prefix`."""
    for key, (off, vtype) in lay.values.items():
        if key.startswith(prefix):
            yield key, lay.type_offsets[key], vtype


def _put(data: bytes, offset: int, fmt: str, value) -> bytes:
    d = bytearray(data)
    struct.pack_into("<" + fmt, d, offset, value)
    return bytes(d)


def _int_mutants(data: bytes, key: str, t_off: int, vtype: int) -> Iterator[tuple[str, bytes]]:
    fmt = _INT_FMT[vtype]
    v_off = t_off + 4
    width = struct.calcsize(fmt)
    for v in INTS + ((2**63 - 1, 2**64 - 1) if width == 8 else ()):
        yield f"{key}={v}", _put(data, v_off, fmt, v & ((1 << 8 * width) - 1))
    flt = _FLOAT_OF_WIDTH[width]
    if flt is not None:
        ftype, ffmt = flt
        for v in (math.nan, math.inf, -math.inf, 2.5):
            yield f"{key}={v} (as float)", _put(_put(data, t_off, "I", ftype), v_off, ffmt, v)
        yield f"{key} bits read as a float", _put(data, t_off, "I", ftype)
    yield f"{key} retyped to string", _put(data, t_off, "I", _STR)
    yield f"{key} retyped to bool", _put(data, t_off, "I", _BOOL)


def _float_mutants(data: bytes, key: str, t_off: int, vtype: int) -> Iterator[tuple[str, bytes]]:
    fmt = "f" if vtype == _F32 else "d"
    for v in FLOATS:
        yield f"{key}={v}", _put(data, t_off + 4, fmt, v)
    yield f"{key} bits read as an integer", _put(data, t_off, "I", _U32 if fmt == "f" else _U64)
    yield f"{key} retyped to string", _put(data, t_off, "I", _STR)


def _array_mutants(data: bytes, key: str, t_off: int) -> Iterator[tuple[str, bytes]]:
    etype, count = struct.unpack_from("<IQ", data, t_off + 4)
    first = t_off + 16
    if etype in _INT_FMT and count:
        for v in INTS:
            w = struct.calcsize(_INT_FMT[etype])
            yield f"{key}[0]={v}", _put(data, first, _INT_FMT[etype], v & ((1 << 8 * w) - 1))
    if etype == _BOOL and count:
        yield f"{key}[0]=2", _put(data, first, "B", 2)
    if etype in (_F32, _F64) and count:
        for v in (math.nan, math.inf, 0.0):
            yield f"{key}[0]={v}", _put(data, first, "f" if etype == _F32 else "d", v)
    for n in (0, max(0, count - 1), count + 1, 2**32 - 1):
        yield f"{key} count={n}", _put(data, t_off + 8, "Q", n)
    yield f"{key} elements retyped to float", _put(data, t_off + 4, "I", _F32)
    yield f"{key} retyped to an integer", _put(data, t_off, "I", _U32)


def _string_mutants(data: bytes, key: str, t_off: int) -> Iterator[tuple[str, bytes]]:
    (n,) = struct.unpack_from("<Q", data, t_off + 4)
    if n:
        d = bytearray(data)
        d[t_off + 12] = ord("x") if d[t_off + 12] != ord("x") else ord("y")
        yield f"{key} first letter changed", bytes(d)
    yield f"{key} length={2**32 - 1}", _put(data, t_off + 4, "Q", 2**32 - 1)
    yield f"{key} retyped to uint32", _put(data, t_off, "I", _U32)


def key_mutants(data: bytes, lay: GGUFLayout, arch: str) -> Iterator[tuple[str, bytes]]:
    """Every `<arch>.*` key of the file, each value the module doc lists."""
    for key, t_off, vtype in _key_spans(data, lay, f"{arch}."):
        if vtype in _INT_FMT:
            yield from _int_mutants(data, key, t_off, vtype)
        elif vtype in (_F32, _F64):
            yield from _float_mutants(data, key, t_off, vtype)
        elif vtype == _ARR:
            yield from _array_mutants(data, key, t_off)
        elif vtype == _STR:
            yield from _string_mutants(data, key, t_off)
        elif vtype == _BOOL:
            yield f"{key}=2", _put(data, t_off + 4, "B", 2)
            yield f"{key} retyped to string", _put(data, t_off, "I", _STR)


def tensor_mutants(data: bytes, lay: GGUFLayout) -> Iterator[tuple[str, bytes]]:
    """Every tensor of the file dropped (renamed: 'blk.0.x' -> 'xlk.0.x', 'output' -> 'xutput'), and
    its first dimension halved."""
    for name, off in lay.tensor_infos:
        start = off - len(name.encode())
        d = bytearray(data)
        d[start] = ord("x") if d[start] != ord("x") else ord("y")
        yield f"tensor {name} dropped", bytes(d)
        n_dims = struct.unpack_from("<I", data, off)[0]
        (dim0,) = struct.unpack_from("<Q", data, off + 4)
        (gtype,) = struct.unpack_from("<I", data, off + 4 + 8 * n_dims)
        block = GGML_QUANT_SIZES[GGMLQuantizationType(gtype)][0]
        if dim0 >= 2 and dim0 % 2 == 0 and (dim0 // 2) % block == 0:    # the halved rows still whole blocks
            yield f"tensor {name} ne0 halved", _put(data, off + 4, "Q", dim0 // 2)


def all_mutants(path: Path, arch: str) -> Iterator[tuple[str, bytes]]:
    data = path.read_bytes()
    lay = layout(path)
    yield from key_mutants(data, lay, arch)
    yield from tensor_mutants(data, lay)


def count_mutants(path: Path, arch: str) -> int:
    return sum(1 for _ in all_mutants(path, arch))


def sample(path: Path, arch: str, n: int | None, rng: random.Random) -> Iterator[tuple[str, bytes]]:
    """`n` of the file's mutants chosen with `rng` (all of them when n is None or larger), in file order."""
    total = count_mutants(path, arch)
    keep = set(range(total)) if n is None or n >= total else set(rng.sample(range(total), n))
    for i, m in enumerate(all_mutants(path, arch)):
        if i in keep:
            yield m


def mutant(path: Path, arch: str, label: str) -> bytes:
    """The file bytes of the mutant called `label` (KeyError when the file has no such mutant)."""
    for got, data in all_mutants(path, arch):
        if got == label:
            return data
    raise KeyError(label)


def arch_of(family: str) -> str:
    """The GGUF architecture of a family's file (OLMo 3 files say olmo2)."""
    return {"olmo3": "olmo2"}.get(family, family)


def job(family: str, path: Path, folder: Path) -> dict:
    """The worker job that reads `path` as the engine reads a file of `family`: a model through the memory
    estimate and the load, a Gemma 4 drafter beside its target (family_file("gemma4", folder))."""
    if family == "gemma4-assistant":
        return {"kind": "mtp", "path": str(path), "target": str(Path(folder) / "gemma4-tiny.gguf")}
    return {"kind": "gguf", "path": str(path), "estimate": True}
