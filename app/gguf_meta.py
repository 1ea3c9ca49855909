"""What the model list shows for a GGUF file, read from its header only (no tensors, no mlx).

Parsing just the header keys is ~100x faster than gguf-py's GGUFReader (which decodes the tokenizer
arrays); results are cached per (path, size, mtime).
"""
from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_WANT = {"general.architecture", "general.name", "general.file_type", "general.size_label"}
_FILE_TYPES = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 7: "Q8_0", 8: "Q5_0", 9: "Q5_1", 10: "Q2_K",
               11: "Q3_K_S", 12: "Q3_K_M", 13: "Q3_K_L", 14: "Q4_K_S", 15: "Q4_K_M", 16: "Q5_K_S",
               17: "Q5_K_M", 18: "Q6_K", 32: "BF16"}


@dataclass
class ModelMeta:
    path: str
    name: str
    architecture: str = "?"
    n_params: int = 0
    quantization: str = "?"
    size_bytes: int = 0
    context_length: int = 0
    error: str = ""

    def params_label(self) -> str:
        n = self.n_params
        if n >= 1e9:
            return f"{n / 1e9:.1f}B"
        if n >= 1e6:
            return f"{n / 1e6:.0f}M"
        if n >= 1e3:
            return f"{n / 1e3:.0f}K"
        return str(n) if n else "?"

    def size_label(self) -> str:
        b = self.size_bytes
        return f"{b / (1 << 30):.2f} GB" if b >= 1 << 30 else f"{b / (1 << 20):.0f} MB"


class _Reader:
    def __init__(self, f):
        self.f = f

    def unpack(self, fmt: str):
        size = struct.calcsize(fmt)
        data = self.f.read(size)
        if len(data) != size:
            raise ValueError("truncated header")
        return struct.unpack(fmt, data)[0]

    def string(self) -> str:
        n = self.unpack("<Q")
        if n > 1 << 24:
            raise ValueError("implausible string length")
        return self.f.read(n).decode("utf-8", "replace")

    def value(self, vtype: int, keep: bool):
        if vtype in _SCALARS:
            return self.unpack(_SCALARS[vtype])
        if vtype == 8:
            return self.string()
        if vtype == 9:
            itype, n = self.unpack("<I"), self.unpack("<Q")
            if itype in _SCALARS and not keep:
                self.f.seek(struct.calcsize(_SCALARS[itype]) * n, 1)
                return None
            if itype == 8 and not keep:
                for _ in range(n):
                    self.f.seek(self.unpack("<Q"), 1)
                return None
            return [self.value(itype, keep) for _ in range(n)]
        raise ValueError(f"unknown GGUF value type {vtype}")


_cache: dict[tuple[str, int, float], ModelMeta] = {}


def read_meta(path: str | Path) -> ModelMeta:
    p = Path(path)
    try:
        st = p.stat()
    except OSError as e:
        return ModelMeta(str(p), p.stem, error=e.strerror or str(e))
    key = (str(p.resolve()), st.st_size, st.st_mtime)
    if key in _cache:
        return _cache[key]
    meta = ModelMeta(str(p), p.stem, size_bytes=st.st_size)
    try:
        with open(p, "rb") as f:
            r = _Reader(f)
            if f.read(4) != b"GGUF":
                raise ValueError("not a GGUF file")
            version = r.unpack("<I")
            if version < 2:
                raise ValueError(f"GGUF version {version} is too old")
            n_tensors, n_kv = r.unpack("<Q"), r.unpack("<Q")
            kv = {}
            for _ in range(n_kv):
                k = r.string()
                vtype = r.unpack("<I")
                keep = k in _WANT or k.endswith(".context_length")
                v = r.value(vtype, keep)
                if keep:
                    kv[k] = v
            total = 0
            for _ in range(n_tensors):
                r.string()
                n_dims = r.unpack("<I")
                count = 1
                for _ in range(n_dims):
                    count *= r.unpack("<Q")
                r.unpack("<I")
                r.unpack("<Q")
                total += count
        arch = str(kv.get("general.architecture", "?"))
        meta.architecture = arch
        meta.name = str(kv.get("general.name") or p.stem)
        meta.context_length = int(kv.get(f"{arch}.context_length", 0) or 0)
        ft = kv.get("general.file_type")
        meta.quantization = _FILE_TYPES.get(ft, f"type {ft}") if ft is not None else _guess_quant(p.name)
        meta.n_params = total
    except (OSError, ValueError, struct.error, UnicodeDecodeError) as e:
        meta.error = str(e)
    _cache[key] = meta
    return meta


def _guess_quant(filename: str) -> str:
    for q in sorted(_FILE_TYPES.values(), key=len, reverse=True):
        if q.lower() in filename.lower():
            return q
    return "?"
