"""Session files of quantized K/V (--kv-bits 8|4): the same container as engine/session_files/sessions.py (format 2),
with the K/V stored exactly as the live cache holds it.

Tensors per layer i, in file order: `k.i.q` (uint32, the packed codes: shape (1, kv_heads, n,
head_dim * bits / 32)), `k.i.s` and `k.i.b` (float16 scales and biases: (1, kv_heads, n, head_dim /
group)), then the same for `v.i`. The header's `kv_dtype` names the format (`q8g64`, `q4g32`, ...; see
engine/cache/kv_format.py), `kv_layout` is QUANT_LAYOUT, and the fingerprint's `kv_format` is compared before
anything else about the K/V: a file of another format is refused naming both (no conversion: widening
8-bit codes or re-quantizing them would give a K/V that no engine run produced).

Everything sessions.py guarantees holds here through the same code: the checksum over every byte
(length prefix, header, tensors), the exact tensor table (parse_header compares it with layout(),
which branches here) validated before anything is allocated, the memory guard asked for the real
bytes of the padded codes, scales and biases, token ids inside the vocabulary, the atomic write
(a locked `.part`, fsync, rename, fsync of the folder). Only the K/V loops differ: nothing is cast
(codes are uint32 and scales/biases float16 in the cache and in the file, whatever the compute
dtype), so each head's cells are written from the cache's memory and read into their padded place.
"""
from __future__ import annotations

import os
import struct
import time
from pathlib import Path
from typing import Callable

import mlx.core as mx
import numpy as np
import xxhash

from engine.model.device_upload import host_view, to_device
from engine.errors import SessionFileError
from engine.cache.kv_format import KVFormat, describe_label, format_of_label
from engine.session_files import session_container as S
from engine.session_files.session_container import TensorSpec, padded_cells

QUANT_LAYOUT = "mlx-quantizedkvcache (batch, kv_heads, tokens, packed codes | groups)"
_PARTS = (("q", "U32", np.dtype("<u4")), ("s", "F16", np.dtype("<f2")), ("b", "F16", np.dtype("<f2")))


def fmt_of(label: str) -> KVFormat:
    fmt = format_of_label(label)
    if fmt is None or not fmt.quantized:
        raise SessionFileError(f"K/V format {str(label)[:20]!r} is not one session files store")
    return fmt


def widths(head_dim: int, fmt: KVFormat) -> tuple[int, int, int]:
    """Last-axis width of the codes, scales and biases for one head's cell."""
    return head_dim * fmt.bits // 32, head_dim // fmt.group, head_dim // fmt.group


def cell_bytes(g, fmt: KVFormat) -> int:
    """Bytes one token's K and V take over all layers (codes + scales + biases)."""
    q, s, b = widths(g.head_dim, fmt)
    return 2 * g.n_layer * g.n_kv_heads * (4 * q + 2 * s + 2 * b)


def layout(n_tokens: int, g) -> list:
    """The one tensor table a quantized file of n_tokens for this geometry (g.kv: its format) may have."""
    fmt = fmt_of(g.kv)
    specs, off = [TensorSpec("tokens", "I32", (n_tokens,), 0, n_tokens * 4)], n_tokens * 4
    for i in range(g.n_layer):
        for kind in ("k", "v"):
            for (suffix, st, dt), width in zip(_PARTS, widths(g.head_dim, fmt)):
                nbytes = g.n_kv_heads * n_tokens * width * dt.itemsize
                specs.append(TensorSpec(f"{kind}.{i}.{suffix}", st, (1, g.n_kv_heads, n_tokens, width),
                                        off, off + nbytes))
                off += nbytes
    return specs


def restore_bytes(n_tokens: int, g) -> int:
    return padded_cells(n_tokens) * cell_bytes(g, fmt_of(g.kv))


def _fits(c, g, fmt: KVFormat, n: int) -> bool:
    """The layer's cache holds at least n cells of this format and geometry."""
    if getattr(c, "keys", None) is None or getattr(c, "bits", None) != fmt.bits \
            or getattr(c, "group_size", None) != fmt.group or c.offset < n:
        return False
    for parts in (c.keys, c.values):
        if len(parts) != 3:
            return False
        for arr, width, (_, _, dt) in zip(parts, widths(g.head_dim, fmt), _PARTS):
            if tuple(arr.shape[:2]) != (1, g.n_kv_heads) or arr.shape[2] < n or arr.shape[3] != width \
                    or np.dtype(dt) != np.dtype(str(arr.dtype).split(".")[-1]):
                return False
    return True


def save(final: Path, entry, fingerprint: dict, *, t0: float, sync: bool = True, force: bool = False,
         progress: Callable[[int, int], None] | None = None,
         log: Callable[[str], None] = lambda s: None) -> dict:
    """sessions.save for quantized K/V (the target path already checked there): the tensors as held."""
    prof = S.SaveProfile()
    g = S.Geometry.of(fingerprint)
    fmt = fmt_of(g.kv)
    n = len(entry.tokens)
    cache = list(entry.cache[:g.n_layer])
    if n == 0 or len(cache) != g.n_layer or not all(_fits(c, g, fmt, n) for c in cache):
        raise SessionFileError(f"cannot save the session: the conversation's K/V does not match the model "
                               f"in {describe_label(g.kv)}")

    def body(fd: int, digest) -> None:
        total = 6 * g.n_layer
        step = max(1, total // 20)
        k = 0
        for c in cache:
            for parts in (c.keys, c.values):
                for arr in parts:
                    t = time.perf_counter()
                    src = host_view(arr)                # the cache's memory (a device copy on CUDA)
                    prof.cast_ms += (time.perf_counter() - t) * 1e3
                    pieces = [src[0, h, :n, :] for h in range(g.n_kv_heads)]   # each contiguous
                    t = time.perf_counter()
                    for piece in pieces:
                        digest.update(piece)
                    prof.checksum_ms += (time.perf_counter() - t) * 1e3
                    S._writev_all(fd, pieces, prof)
                    k += 1
                    if progress and (k % step == 0 or k == total):
                        progress(k, total)

    return S.write_session(final, entry, fingerprint, layout(n, g), fmt.label, QUANT_LAYOUT, body, t0=t0,
                           prof=prof, sync=sync, force=force, log=log)


def load(path: str, expected: dict, make_cache: Callable[[], list], *, key: str,
         n_vocab: int = 1 << 31, n_ctx: int = 1 << 31,
         admit: Callable[[int], tuple[bool, str]] | None = None,
         progress: Callable[[int, int], None] | None = None, log: Callable[[str], None] = lambda s: None,
         image_span: int = 0):
    """sessions.load for a quantized engine: validate everything, then build a KVEntry."""
    t0 = time.perf_counter()
    prof = S.RestoreProfile(cast="none (codes uint32, scales and biases float16 in file and cache)")
    p = Path(path).expanduser()
    name = p.name
    g = S.Geometry.of(expected, n_vocab, n_ctx, image_span)
    fmt = fmt_of(g.kv)
    fd = S._open_regular(p)
    try:
        size = os.fstat(fd).st_size
        raw = S._read_raw_header(name, fd, size)
        hdr = S.parse_header(name, raw, size, g, expected, layout=layout,
                             kv_layout=QUANT_LAYOUT)      # the exact table of layout() above
        n, cells = hdr.n_tokens, S.padded_cells(hdr.n_tokens)
        need = restore_bytes(n, g)
        S.check_memory(name, n, need, admit)
        cache = make_cache()
        if len(cache) != g.n_layer or not all(getattr(c, "bits", None) == fmt.bits
                                              and getattr(c, "group_size", None) == fmt.group for c in cache):
            raise SessionFileError(f"{name}: this model's cache ({type(cache[0]).__name__ if cache else 'none'}) "
                                   f"cannot take a {fmt.describe()} session file")
        digest = xxhash.xxh3_128()
        digest.update(struct.pack("<Q", len(raw)))
        digest.update(raw[:len(S._PREFIX)] + S._ZERO + raw[len(S._PREFIX) + S._HEX:])
        prof.header_ms = (time.perf_counter() - t0) * 1e3
        tokens = np.empty(n, np.int32)
        arrays = []
        total, step = len(hdr.specs), max(1, len(hdr.specs) // 20)
        dtypes = {st: dt for _, st, dt in _PARTS}
        for k, spec in enumerate(hdr.specs):
            off = hdr.data_start + spec.start
            if spec.name == "tokens":
                padded = None
                complete = S._read_hashed(fd, tokens, off, digest, prof) == tokens.nbytes
            else:
                # Read each head straight into its place in the padded buffer the cache keeps.
                padded = np.zeros((1, g.n_kv_heads, cells, spec.shape[3]), dtypes[spec.dtype])
                complete = S._read_heads(fd, padded, off, n, digest, prof)
            if not complete:
                raise SessionFileError(f"{name} is truncated (tensor {spec.name})")
            if padded is not None:
                t = time.perf_counter()
                arrays.append(to_device(padded))     # on CUDA: device memory, not managed pages
                prof.build_ms += (time.perf_counter() - t) * 1e3
            if progress and (k % step == 0 or k == total - 1):
                progress(k + 1, total)
    except OSError as e:
        raise SessionFileError(f"cannot read session file {p}: {e.strerror or e}") from None
    finally:
        os.close(fd)
    S.check_read(name, raw, digest, tokens, g.n_vocab, g.image_span)
    t = time.perf_counter()
    for i, c in enumerate(cache):
        a = arrays[6 * i:6 * i + 6]
        c.state = (tuple(a[:3]), tuple(a[3:]), n, fmt.group, fmt.bits)
    mx.eval(arrays)
    S.check_finite(name, arrays, ("K codes", "K scales", "K biases", "V codes", "V scales", "V biases"))
    prof.build_ms += (time.perf_counter() - t) * 1e3
    ms = (time.perf_counter() - t0) * 1e3
    log(f"restored {n} tokens ({fmt.describe()}) from {name} in {ms:.1f} ms (read {prof.read_ms:.1f}, "
        f"checksum {prof.checksum_ms:.1f}, build {prof.build_ms:.1f} ms)")
    return S.restored(tokens, cache, key, hdr, size, ms, prof)
