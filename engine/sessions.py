"""Session files: a conversation's tokens and K/V on disk, restored in another process.

Container: safetensors (tensors `tokens`, `k.<layer>`, `v.<layer>`; K/V as float16, shape
(1, kv_heads, tokens, head_dim), the cells in use only) with string metadata: format, version, the
fingerprint (model content hash, geometry, tokenizer, chat template, steering) and an xxh3-64 checksum
over the tensor bytes. Written layer by layer (no second full-size copy of the cache in memory) into a
temporary file in the same folder, fsynced, then renamed: a crash never leaves a half file under the
final name.
"""
from __future__ import annotations

import json
import os
import struct
import tempfile
import time
from pathlib import Path
from typing import Callable

import mlx.core as mx
import numpy as np
import xxhash

from .errors import SessionFileError

FORMAT = "strata-session"
VERSION = 1
KV_DTYPE = "float16"
KV_LAYOUT = "mlx-kvcache (batch, kv_heads, tokens, head_dim)"
EXTENSION = ".stratasession"
_CHECKSUM_PLACEHOLDER = "0" * 16
_MAX_HEADER = 64 << 20
_ST_DTYPES = {"F16": np.float16, "I32": np.int32, "U32": np.uint32}


def _tensor_plan(entry, n_layer: int):
    """(name, numpy dtype, shape, producer) for every tensor, in file order."""
    from .kv_format import layer_tensors     # 16-bit or quantized K/V layouts
    n = len(entry.tokens)
    plan = [("tokens", "I32", (n,), lambda: np.asarray(entry.tokens, dtype=np.int32))]
    for i, c in enumerate(entry.cache[:n_layer]):
        plan += layer_tensors(i, c, n)
    return plan


def _header(plan, metadata: dict) -> bytes:
    header, offset = {}, 0
    for name, dtype, shape, _ in plan:
        nbytes = int(np.prod(shape)) * np.dtype(_ST_DTYPES[dtype]).itemsize
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    header["__metadata__"] = {k: str(v) for k, v in metadata.items()}
    raw = json.dumps(header, separators=(",", ":")).encode()
    return raw + b" " * (-len(raw) % 8)    # safetensors allows space padding; keeps data aligned


def save(path: str, entry, fingerprint: dict, *, progress: Callable[[int, int], None] | None = None,
         log: Callable[[str], None] = lambda s: None) -> dict:
    t0 = time.perf_counter()
    final = Path(path).expanduser()
    if final.is_dir():
        raise SessionFileError(f"cannot save the session: {final} is a folder")
    final.parent.mkdir(parents=True, exist_ok=True)
    metadata = {"format": FORMAT, "version": VERSION, "n_tokens": len(entry.tokens),
                "kv_dtype": fingerprint.get("kv_format", KV_DTYPE),
                "kv_layout": KV_LAYOUT, "messages": json.dumps(entry.messages, ensure_ascii=False),
                "checksum": _CHECKSUM_PLACEHOLDER, **{f"fp.{k}": v for k, v in fingerprint.items()}}
    plan = _tensor_plan(entry, int(fingerprint["n_layer"]))
    header = _header(plan, metadata)
    _remove_stale_parts(final, log)
    fd, tmp = tempfile.mkstemp(prefix=f".{final.name}.", suffix=".part", dir=final.parent)
    try:
        digest = xxhash.xxh3_64()
        with os.fdopen(fd, "wb") as f:
            f.write(struct.pack("<Q", len(header)))
            f.write(header)
            for i, (_, _, _, produce) in enumerate(plan):
                data = produce().tobytes()   # one layer at a time: no full-size shadow copy
                digest.update(data)
                f.write(data)
                if progress:
                    progress(i + 1, len(plan))
            metadata["checksum"] = digest.hexdigest()
            final_header = _header(plan, metadata)
            assert len(final_header) == len(header)   # same width: the checksum replaces its placeholder
            f.seek(8)
            f.write(final_header)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
        dir_fd = os.open(final.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    except OSError as e:
        Path(tmp).unlink(missing_ok=True)
        raise SessionFileError(f"cannot save the session to {final}: {e.strerror or e}") from None
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    size = final.stat().st_size
    ms = (time.perf_counter() - t0) * 1e3
    log(f"saved {len(entry.tokens)} tokens to {final.name}: {size} B in {ms:.1f} ms")
    return {"path": str(final), "session_bytes": size, "save_ms": round(ms, 2), "tokens": len(entry.tokens)}


def _remove_stale_parts(final: Path, log: Callable[[str], None]) -> None:
    """A save killed mid-write leaves its hidden temporary file; the next save of that name removes it.
    Only files older than a minute: a save in progress in another process keeps its own."""
    now = time.time()
    for part in final.parent.glob(f".{final.name}.*.part"):
        try:
            if now - part.stat().st_mtime > 60:
                part.unlink()
                log(f"removed {part.name}, left by an interrupted save")
        except OSError:
            pass


def read_header(path: str) -> tuple[dict, dict, int]:
    """(tensor table, metadata, data start) or SessionFileError saying why the file is refused."""
    p = Path(path).expanduser()
    try:
        size = p.stat().st_size
        with open(p, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise SessionFileError(f"{p.name} is not a Strata session file (too short)")
            (n,) = struct.unpack("<Q", head)
            if n == 0 or n > _MAX_HEADER or n > size - 8:
                raise SessionFileError(f"{p.name} is not a Strata session file")
            raw = f.read(n)
    except FileNotFoundError:
        raise SessionFileError(f"session file not found: {p}") from None
    except IsADirectoryError:
        raise SessionFileError(f"{p} is a folder, not a session file") from None
    except OSError as e:
        raise SessionFileError(f"cannot read session file {p}: {e.strerror or e}") from None
    try:
        table = json.loads(raw)
        meta = table.pop("__metadata__")
    except (ValueError, KeyError, UnicodeDecodeError):
        raise SessionFileError(f"{p.name} is not a Strata session file") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise SessionFileError(f"{p.name} is not a Strata session file")
    try:
        version = int(meta.get("version", "0"))
    except ValueError:
        raise SessionFileError(f"{p.name} is not a Strata session file (bad version)") from None
    if version > VERSION:
        raise SessionFileError(f"{p.name} has session format version {version}, newer than this "
                               f"Strata reads ({VERSION}); update Strata")
    end = max((t["data_offsets"][1] for t in table.values()), default=0)
    if size < 8 + n + end:
        raise SessionFileError(f"{p.name} is truncated ({size} of {8 + n + end} bytes)")
    return table, meta, 8 + n


def check_fingerprint(name: str, meta: dict, expected: dict) -> None:
    fp = {k[3:]: v for k, v in meta.items() if k.startswith("fp.")}
    geometry = ("n_layer", "n_kv_heads", "head_dim")
    theirs = {k: fp.get(k) for k in geometry}
    ours = {k: str(expected[k]) for k in geometry}
    ours_kv = expected.get("kv_format", KV_DTYPE)
    if theirs == ours and meta.get("kv_layout") == KV_LAYOUT and meta.get("kv_dtype") != ours_kv:
        from .kv_format import describe_label
        raise SessionFileError(f"{name} holds {describe_label(meta.get('kv_dtype'))}; this engine runs "
                               f"{describe_label(ours_kv)} (restore it with the --kv-bits it was saved with)")
    if theirs != ours or meta.get("kv_layout") != KV_LAYOUT or meta.get("kv_dtype") != ours_kv:
        raise SessionFileError(
            f"{name}: incompatible K/V geometry (file: {fp.get('n_layer')} layers x {fp.get('n_kv_heads')} "
            f"K/V heads x {fp.get('head_dim')}, {meta.get('kv_dtype')}; model: {expected['n_layer']} x "
            f"{expected['n_kv_heads']} x {expected['head_dim']}, {KV_DTYPE})")
    if fp.get("model_hash") != expected["model_hash"] or fp.get("architecture") != expected["architecture"]:
        raise SessionFileError(f"{name} was saved with another model (content {str(fp.get('model_hash'))[:12]}, "
                               f"loaded model {expected['model_hash'][:12]})")
    if fp.get("tokenizer") != expected["tokenizer"] or fp.get("chat_template") != expected["chat_template"]:
        raise SessionFileError(f"{name} was saved with another tokenizer or chat template")
    if fp.get("steering") != str(expected["steering"]):
        raise SessionFileError(f"{name} was saved with another steering setting "
                               f"({_steer_label(fp.get('steering'))}; now {_steer_label(expected['steering'])})")


def _steer_label(fp) -> str:
    return "no control vector" if fp in (None, "none", "") else f"control vector {str(fp)[:12]}"


def load(path: str, expected: dict, make_cache: Callable[[], list], *, key: str, dtype=None,
         progress: Callable[[int, int], None] | None = None, log: Callable[[str], None] = lambda s: None):
    """Validate everything, then build a KVEntry. Nothing live is touched; raise SessionFileError."""
    from .parking import KVEntry
    t0 = time.perf_counter()
    p = Path(path).expanduser()
    table, meta, start = read_header(str(p))
    check_fingerprint(p.name, meta, expected)
    from . import kv_format
    n_layer = int(expected["n_layer"])
    fmt = kv_format.format_of_label(meta.get("kv_dtype"))
    names = ["tokens"] + [nm for i in range(n_layer) for nm in kv_format.layer_names(i, fmt)]
    if any(nm not in table or table[nm].get("dtype") not in _ST_DTYPES for nm in names):
        raise SessionFileError(f"{p.name} is corrupted (missing or malformed tensors)")
    digest = xxhash.xxh3_64()
    arrays = {}
    try:
        with open(p, "rb") as f:
            for i, nm in enumerate(sorted(names, key=lambda nm: table[nm]["data_offsets"][0])):
                lo, hi = table[nm]["data_offsets"]
                f.seek(start + lo)
                data = f.read(hi - lo)
                digest.update(data)
                arr = np.frombuffer(data, dtype=_ST_DTYPES[table[nm]["dtype"]])
                if arr.size != int(np.prod(table[nm]["shape"])):
                    raise SessionFileError(f"{p.name} is corrupted (tensor {nm} has the wrong size)")
                arrays[nm] = arr.reshape(table[nm]["shape"])
                if progress:
                    progress(i + 1, len(names))
    except OSError as e:
        raise SessionFileError(f"cannot read session file {p}: {e.strerror or e}") from None
    t_read = time.perf_counter()
    if digest.hexdigest() != meta.get("checksum"):
        raise SessionFileError(f"{p.name} is corrupted (checksum mismatch)")
    tokens = arrays["tokens"].tolist()
    cache = make_cache()
    dtype = dtype or _compute_dtype()
    for i, c in enumerate(cache):
        why = kv_format.restore_layer(i, c, arrays, len(tokens), fmt, dtype)
        if why:
            raise SessionFileError(f"{p.name} is corrupted ({why})")
    mx.eval([kv_format.arrays_of(c) for c in cache])
    try:
        messages = json.loads(meta.get("messages", "[]"))
    except ValueError:
        messages = []
    ms = (time.perf_counter() - t0) * 1e3
    log(f"restored {len(tokens)} tokens from {p.name} in {ms:.1f} ms (read+check "
        f"{(t_read - t0) * 1e3:.1f} ms)")
    entry = KVEntry(tokens, cache, key, messages=messages)
    return entry, {"restored_tokens": len(tokens), "restore_ms": round(ms, 2), "messages": messages,
                   "session_bytes": p.stat().st_size}


def _compute_dtype():
    return mx.float32 if mx.default_device() == mx.cpu else mx.float16
