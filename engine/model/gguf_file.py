"""Open a GGUF file with gguf-py (memory-mapped) and turn every failure into one clear line."""
from __future__ import annotations

import hashlib
import json
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGUFReader, GGUFValueType
import xxhash

from engine.errors import ModelFileError
from engine.model import gguf_split
from engine.model.gguf_header import HeaderScan, scan_header
from engine.model.memory_estimate import read_header
from engine.paths import data_dir

GGUF_MAGIC = b"GGUF"


class SplitReader:
    """The gguf-py readers of a split model's parts (engine/model/gguf_split.py) read as one: the first part's
    metadata, every part's tensors in part order, each a view of its own part's memory map."""

    def __init__(self, readers: list[GGUFReader]):
        self.readers = tuple(readers)
        self.fields = readers[0].fields
        self.tensors = [t for r in readers for t in r.tensors]


@dataclass
class GGUFFile:
    path: Path                    # the file opened: a split model's first part
    reader: GGUFReader | SplitReader
    header: Any = None            # gguf_header.HeaderScan: the validated header (types, tensor shapes)
    parts: tuple[Path, ...] = ()  # a split model's files, first part first; () for a single file

    @property
    def files(self) -> tuple[Path, ...]:
        """The files the model's tensors are in: its parts, or the one file."""
        return self.parts or (self.path,)

    @property
    def architecture(self) -> str:
        return str(self.get("general.architecture", ""))

    def get(self, key: str, default: Any = None) -> Any:
        field = self.reader.fields.get(key)
        if field is None:
            return default
        if field.types and field.types[0] == GGUFValueType.ARRAY and len(field.types) > 1 \
                and field.types[-1] != GGUFValueType.STRING:
            # Numeric arrays: one numpy view instead of a Python list of 49k scalars.
            return np.concatenate([field.parts[i] for i in field.data]) if field.data else np.array([])
        return field.contents()

    def arch_key(self, suffix: str, default: Any = None) -> Any:
        return self.get(f"{self.architecture}.{suffix}", default)

    def require(self, key: str) -> Any:
        value = self.get(key)
        if value is None:
            raise ModelFileError(f"{self.path.name}: missing metadata '{key}'")
        return value

    def tensors(self) -> dict:
        return {t.name: t for t in self.reader.tensors}


def open_gguf(path: str | os.PathLike) -> GGUFFile:
    """`path` opened with gguf-py, its header validated first; a split model's first part opens the
    whole set, every part checked as one model (engine/model/gguf_split.py) and memory-mapped."""
    p = Path(path)
    reader, header = _open_one(p)
    count = reader.fields.get(gguf_split.SPLIT_COUNT)
    if count is None or not count.data or int(count.contents()) <= 1:
        return GGUFFile(p, reader, header)
    # the set read and checked by the plain header reader first (a missing or foreign part named before
    # any part is mapped), then each part opened as a file of its own
    parts = read_header(p).parts
    opened = [(reader, header)] + [_open_one(q) for q in parts[1:]]
    merged = HeaderScan(header.version, header.kv_types,
                        {name: t for _, h in opened for name, t in h.tensors.items()}, header.data_start)
    return GGUFFile(p, SplitReader([r for r, _ in opened]), merged, tuple(parts))


def _open_one(p: Path) -> tuple[GGUFReader, HeaderScan]:
    """One GGUF file opened with gguf-py after its header has been validated."""
    try:
        found = p.exists()
    except OSError as e:                 # a name too long, ...
        raise ModelFileError(f"cannot read {str(p)[:200]}: {e.strerror or e}") from None
    if not found:
        raise ModelFileError(f"model file not found: {p}")
    if p.is_dir():
        raise ModelFileError(f"{p} is a folder, not a GGUF file")
    try:
        # Opened without blocking and checked by its descriptor: a FIFO (or a device, a socket) is
        # refused at once rather than blocking the engine thread for good, or read without end.
        fd = os.open(p, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise ModelFileError(f"{p.name} is not a regular file (a FIFO, device or socket): not a GGUF file")
            magic = os.read(fd, 4)
        finally:
            os.close(fd)
    except OSError as e:
        raise ModelFileError(f"cannot read {p}: {e.strerror or e}") from None
    if magic != GGUF_MAGIC:
        raise ModelFileError(f"{p.name} is not a GGUF file (bad magic {magic!r})")
    header = scan_header(p)          # counts, lengths, UTF-8, key types: checked before gguf-py allocates
    try:
        reader = GGUFReader(p, "r")
    except Exception as e:  # gguf-py raises ValueError/IndexError/OverflowError on short files
        raise ModelFileError(f"{p.name} is truncated or corrupt ({type(e).__name__}: {str(e)[:120]})") from None
    size = p.stat().st_size
    for t in reader.tensors:
        end = int(t.data_offset) + int(t.n_bytes)
        if end > size:
            raise ModelFileError(f"{p.name} is truncated: tensor '{t.name}' ends at byte {end}, file has {size}")
    return reader, header


def set_hash(files: tuple[Path, ...] | list[Path]) -> str:
    """The content identity of a model: its file's content_hash, or for a split set a hash of every
    part's, in order (sessions and cached K/V of one set never restore into another)."""
    if len(files) == 1:
        return content_hash(files[0])
    h = xxhash.xxh3_128(b"gguf-split")
    for f in files:
        h.update(content_hash(f).encode("ascii"))
    return h.hexdigest()


_hash_cache: dict[tuple[str, int, int], str] = {}


def content_hash(path: str | os.PathLike) -> str:
    """xxh3-128 of the whole file, cached per (path, size, mtime) so a 5 GB model is hashed once."""

    p = Path(path).resolve()
    st = p.stat()
    key = (str(p), st.st_size, st.st_mtime_ns)
    cache_file = _hash_cache_file()
    if key not in _hash_cache and cache_file.exists():
        try:
            disk = json.loads(cache_file.read_text())
            if disk.get("|".join(map(str, key))):
                _hash_cache[key] = disk["|".join(map(str, key))]
        except (OSError, ValueError):
            pass
    if key not in _hash_cache:
        h = xxhash.xxh3_128()
        with open(p, "rb") as f:
            while chunk := f.read(1 << 24):
                h.update(chunk)
        _hash_cache[key] = h.hexdigest()
        try:
            disk = json.loads(cache_file.read_text()) if cache_file.exists() else {}
            disk["|".join(map(str, key))] = _hash_cache[key]
            cache_file.parent.mkdir(parents=True, exist_ok=True)
            cache_file.write_text(json.dumps(disk))
        except (OSError, ValueError):
            pass
    return _hash_cache[key]


def _hash_cache_file() -> Path:
    return data_dir() / "model-hashes.json"


def text_hash(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]
