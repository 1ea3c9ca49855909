"""What the model list shows for a GGUF file, read from its header only (no tensors, no mlx).

engine/memory_estimate.read_header parses just the header (arrays skipped), ~100x faster than
gguf-py's GGUFReader; results are cached per (path, size, mtime).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from engine.errors import StrataError
from engine.model.gguf_split import split_name
from engine.model.memory_estimate import platform_dtype, read_header, weight_sizes
_FILE_TYPES = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 7: "Q8_0", 8: "Q5_0", 9: "Q5_1", 10: "Q2_K",
               11: "Q3_K_S", 12: "Q3_K_M", 13: "Q3_K_L", 14: "Q4_K_S", 15: "Q4_K_M", 16: "Q5_K_S",
               17: "Q5_K_M", 18: "Q6_K", 19: "IQ2_XXS", 20: "IQ2_XS", 21: "Q2_K_S", 22: "IQ3_XS",
               23: "IQ3_XXS", 24: "IQ1_S", 25: "IQ4_NL", 26: "IQ3_S", 27: "IQ3_M", 28: "IQ2_S", 29: "IQ2_M",
               30: "IQ4_XS", 31: "IQ1_M", 32: "BF16", 36: "TQ1_0", 37: "TQ2_0", 38: "MXFP4_MOE"}


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
    source: str = ""            # where it lives (engine/model/model_sources.py: Strata, Folder, LM Studio, ...)
    label: str = ""             # the library's own name for it (Ollama's model:tag, a Hub repository)
    parts: int = 1              # files of a split set
    companions: str = ""        # its vision projector / MTP drafter files found beside it, for the tooltip
    real: str = ""              # the file `path` reaches, resolved off the window's thread ("" unknown)
    file_bpw: float = 0.0       # bits per weight in the file ...
    held_bpw: float = 0.0       # ... and as Strata holds the weights (engine/memory_estimate.weight_sizes)

    def where(self) -> str:
        """The source label a row shows: 'LM Studio', 'Ollama (llama3.2:3b)', ..."""
        return f"{self.source} ({self.label})" if self.source and self.label else self.source

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


_cache: dict[tuple[str, int, float], ModelMeta] = {}


def read_meta(path: str | Path) -> ModelMeta:
    """The row of `path`; a file that cannot be read (not a regular file, a bad header) gets `error`,
    one line, and its file name as its name. Never raises."""
    p = Path(path)
    try:
        st = p.stat()
        key = (str(p.resolve()), st.st_size, st.st_mtime)
    except (OSError, RuntimeError) as e:       # RuntimeError: a symlink loop (Python 3.11)
        return ModelMeta(str(p), p.name, error=f"cannot read {p.name}: {getattr(e, 'strerror', None) or e}")
    if key in _cache:
        return _cache[key]
    meta = ModelMeta(str(p), p.stem, size_bytes=st.st_size)
    try:
        h = read_header(p)        # the engine's header reader (plain Python: no mlx, no tensor data)
        if h.parts:               # a split set: every part read and checked, the size of them all
            meta.size_bytes, meta.parts = sum(f.stat().st_size for f in h.parts), len(h.parts)
        kv = h.metadata
        arch = h.architecture or "?"
        context_length = h.arch_int("context_length", 0)
    except StrataError as e:
        meta.name, meta.error = p.name, str(e)
    except OSError as e:          # a part gone between its check and its size
        meta.name, meta.error = p.name, f"cannot read {p.name}: {e.strerror or e}"
    else:
        meta.architecture = arch
        meta.name = str(kv.get("general.name") or p.stem)[:200]
        meta.context_length = context_length
        ft = kv.get("general.file_type")
        meta.quantization = _FILE_TYPES.get(ft, f"type {ft}") if ft is not None else _guess_quant(p.name)
        meta.n_params = sum(t.n_elements for t in h.tensors)
        sizes = weight_sizes(h, platform_dtype())
        meta.file_bpw, meta.held_bpw = sizes.file_bpw, sizes.held_bpw
    if meta.parts > 1 or split_name(p) is not None:
        return meta               # a set is checked again each time: another part may have changed
    if len(_cache) >= 1024:
        _cache.clear()
    _cache[key] = meta
    return meta


def _guess_quant(filename: str) -> str:
    for q in sorted(_FILE_TYPES.values(), key=len, reverse=True):
        if q.lower() in filename.lower():
            return q
    return "?"
