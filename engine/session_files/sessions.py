"""Session files: a conversation's tokens and K/V on disk, restored in another process.

Container (format version 2): safetensors. An 8-byte little-endian header length, a JSON header, then
the tensors back to back in a fixed order: `tokens` (int32, n), then `k.0`, `v.0`, `k.1`, ... (float16,
shape (1, kv_heads, n, head_dim), the cells in use only). The header's first entry is `__metadata__`
and its first field is `checksum`: 32 hex digits of xxh3-128 over EVERY byte of the file -- the length
prefix, the header (with those 32 digits read as zeros) and the tensors. So a flip anywhere, the
conversation's messages included, is refused. xxh3 is a fast unkeyed hash: it detects damage, not
forgery; a crafted file with a recomputed checksum is stopped by the validation instead (types and
ranges of every header field, the tensor table equal to the one the model's geometry gives, token ids
inside the vocabulary).

Writing: into a hidden temporary file in the same folder (`.NAME.XXXXXXXX.part`, locked with flock
while it is written), in large sequential writes from two small staging buffers (the K/V is cast to
float16 a block at a time, the next block while a writer thread writes and a hashing thread hashes
the last: never a second full-size copy), checksummed, optionally fsynced, then
renamed over the final name. A crash never leaves a half file under the final name; a killed save's
`.part` file is removed at the next engine start and at the next save into that folder (only when no
live save holds its lock).

Durability: `fsync` of the file before the rename and of the folder after it (timed on its own as
`sync_ms`). On macOS that is plain fsync, not F_FULLFSYNC: fsync orders the write against a crash of
the app or the OS; F_FULLFSYNC also flushes the drive's cache against a power cut, which costs tens of
milliseconds per save on Apple SSDs. A session file is a cache of a conversation, and a file torn by a
power cut cannot be misread -- the checksum refuses it -- so the cheaper guarantee is the one taken.

Reading: the file is opened only when it is a regular file (a FIFO or a device is refused before
open, and O_NONBLOCK keeps a file swapped for a FIFO in between from blocking), the header is
validated before anything is allocated, the memory guard is asked for the bytes the K/V will take, and
on the CPU the MLX arrays the cache keeps (padded as mlx-lm pads) are allocated first and filled in
place through numpy views: a float16 cache by reading each head straight into it, a float32 cache by
a reader thread reading each tensor into a staging buffer, hashing it and doing the first half of its
cast while this thread does the second half of the one before into the array (half_cast: numpy's
result, bit for bit). The memory is resident: the engine touched one context's K/V at load and
touches it again in idle time once restores and prefills have used it (kv_reserve.py). On a GPU MLX's
buffer cache is emptied first, four reader threads read tensors into a ring of padded host buffers, a
third hashes them in file order, and each is copied into device memory through MLX's Load primitive
(device_upload.to_device).
"""
from __future__ import annotations

import os
import struct
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable

import mlx.core as mx
import numpy as np
import xxhash

from engine.cache import layer_cache
from engine.model import half_cast
from engine.session_files import session_v3, session_quant
from engine.device import compute_dtype, on_cuda, on_gpu
from engine.model.device_upload import host_view, to_device
from engine.session_files import session_container
from engine.errors import SessionFileError
# What every format shares lives in session_container.py; its names stay importable from here.
from engine.session_files.session_container import (  # noqa: F401
                        FORMAT, VERSION, READS, KV_DTYPE, STEP, MAX_HEADER, STALE_PART_S, _PREFIX, _HEX, _ZERO, _PART, _ROLES,
                        Geometry, TensorSpec, _header_bytes, padded_cells, SaveProfile, RestoreProfile, SaveResult, ParsedHeader,
                        _write_all, _writev_all, existing_tokens, check_overwrite, write_session, _discard, _looks_like_our_part,
                        remove_stale_parts, _open_regular, pread_exact, _readinto_exact, _read_hashed, _read_heads,
                        _read_raw_header, _meta_of, validate_messages, read_header, check_fingerprint, _steer_label,
                        check_finite, check_memory, check_read, restored,
)
from engine.session_files.session_quant import QUANT_LAYOUT

KV_LAYOUT = "mlx-kvcache (batch, kv_heads, tokens, head_dim)"
STAGING_BYTES = 2 << 20            # each of the save's two staging buffers (large writes, no full-size copy)
_ST = {"I32": np.dtype("<i4"), "F16": np.dtype("<f2")}


# ---------------------------------------------------------------------------------------- layout


def layout(n_tokens: int, g: Geometry) -> list[TensorSpec]:
    """The one tensor table a file of n_tokens for this geometry may have, in file order."""
    if g.kv != KV_DTYPE:
        return session_quant.layout(n_tokens, g)
    specs, off = [], 0
    nbytes = n_tokens * 4
    specs.append(TensorSpec("tokens", "I32", (n_tokens,), off, off + nbytes))
    off += nbytes
    shape = (1, g.n_kv_heads, n_tokens, g.head_dim)
    nbytes = g.n_kv_heads * n_tokens * g.head_dim * 2
    for i in range(g.n_layer):
        for kind in ("k", "v"):
            specs.append(TensorSpec(f"{kind}.{i}", "F16", shape, off, off + nbytes))
            off += nbytes
    return specs


def restore_bytes(n_tokens: int, g: Geometry, itemsize: int) -> int:
    return 2 * g.n_layer * g.n_kv_heads * padded_cells(n_tokens) * g.head_dim * itemsize


# ---------------------------------------------------------------------------------------- timings


# ---------------------------------------------------------------------------------------- save

def _np_view(a, n: int) -> np.ndarray:
    """A numpy view of an MLX array's values: no copy for float32/float16 on the CPU. On CUDA a device
    copy, so that the live K/V stays in device memory (host_view), of the n cells in use only: a padded
    copy is up to 4x the bytes the save reads, each held while a batch of its blocks is in flight.
    bfloat16 goes through float32 (its first n cells), an array of its own that needs no second copy."""
    if a.dtype in (mx.float32, mx.float16):
        return host_view(a[:, :, :n, :] if on_cuda() else a)
    return host_view(a[:, :, :n, :].astype(mx.float32), keep_on_device=False)


def _blocks(src: np.ndarray, n: int, max_elems: int):
    """Pieces of src[0, :, :n, :] in file order (head-major), each at most max_elems elements."""
    heads, dim = src.shape[1], src.shape[3]
    rows = max(1, max_elems // dim)
    for h in range(heads):
        for t in range(0, n, rows):
            yield src[0, h, t:min(n, t + rows), :]


def save(path: str, entry, fingerprint: dict, *, sync: bool = True, force: bool = False,
         progress: Callable[[int, int], None] | None = None,
         log: Callable[[str], None] = lambda s: None) -> dict:
    t0 = time.perf_counter()
    final = Path(path).expanduser()
    if final.is_dir():
        raise SessionFileError(f"cannot save the session: {final} is a folder")
    if os.path.lexists(final) and not final.is_file():
        raise SessionFileError(f"cannot save the session: {final} exists and is not a regular file")
    if session_v3.needed(entry.cache):          # a sliding window or a recurrent state: format 3
        return session_v3.save(final, entry, fingerprint, t0=t0, sync=sync, force=force, progress=progress,
                               log=log)
    if fingerprint.get("kv_format", KV_DTYPE) != KV_DTYPE:      # 8/4-bit K/V, stored as held
        return session_quant.save(final, entry, fingerprint, t0=t0, sync=sync, force=force, progress=progress,
                                  log=log)
    g = Geometry.of(fingerprint)
    n = len(entry.tokens)
    cache = list(entry.cache[:g.n_layer])
    if n == 0 or len(cache) != g.n_layer or any(
            c.keys is None or tuple(c.keys.shape[:2]) != (1, g.n_kv_heads) or c.keys.shape[3] != g.head_dim
            or min(c.keys.shape[2], c.offset) < n or c.values.shape != c.keys.shape for c in cache):
        raise SessionFileError("cannot save the session: the conversation's K/V does not match the model")
    specs = layout(n, g)
    prof = SaveProfile()

    def body(fd: int, digest) -> None:
        _write_f16_kv(fd, digest, cache, g, n, specs[-1].end, prof, progress)

    return write_session(final, entry, fingerprint, specs, KV_DTYPE, KV_LAYOUT, body, t0=t0, prof=prof,
                         sync=sync, force=force, log=log)


def _write_f16_kv(fd: int, digest, cache: list, g: Geometry, n: int, data_end: int, prof: SaveProfile,
                  progress: Callable[[int, int], None] | None) -> None:
    """Every layer's K then V as float16, in file order (format 2's 16-bit K/V)."""
    # A float32 cache (the CPU) is cast block by block into a staging buffer; a float16 cache (a
    # GPU) is written straight from its own memory (no copy at all), a batch of blocks per writev.
    # Either way each write is up to STAGING_BYTES, in file order. A writer thread writes and a
    # hashing thread hashes one batch while this thread casts the next into the other staging
    # buffer (half_cast's numpy ops, xxhash and write(2) release the GIL), so the three overlap.
    size = min(STAGING_BYTES // 2, max(g.head_dim, data_end // 2))
    stagings = [np.empty(size, np.float16), np.empty(size, np.float16)]
    cur = 0
    pending: list[np.ndarray] = []
    fill = pending_bytes = 0
    writing: list = []          # the hash and the write of the batch in flight (at most one batch)
    casting: list = []          # casts of the batch being filled (two cast threads: the CPU's cost)

    def hash_batch(batch: list[np.ndarray]) -> None:
        t = time.perf_counter()
        for piece in batch:
            digest.update(piece)            # in file order: one hashing thread takes the batches in turn
        prof.checksum_ms += (time.perf_counter() - t) * 1e3

    def flush():
        nonlocal fill, pending_bytes, cur
        if pending:
            t = time.perf_counter()
            while casting:
                casting.pop().result()      # this batch's casts are done
            prof.cast_ms += (time.perf_counter() - t) * 1e3
            while writing:
                writing.pop().result()      # the other staging buffer is free again
            # The hash and the write of a batch run side by side (xxhash and write(2) release the GIL).
            writing.extend([hasher.submit(hash_batch, list(pending)), pool.submit(_writev_all, fd, list(pending), prof)])
            cur ^= 1
        pending.clear()
        fill = pending_bytes = 0

    total, step = 2 * g.n_layer, max(1, (2 * g.n_layer) // 20)
    with ThreadPoolExecutor(1, thread_name_prefix="session-write") as pool, \
            ThreadPoolExecutor(1, thread_name_prefix="session-hash") as hasher, \
            ThreadPoolExecutor(2, thread_name_prefix="session-cast") as casters:
        try:
            for i, c in enumerate(cache):
                for j, arr in enumerate((c.keys, c.values)):
                    t = time.perf_counter()
                    src = _np_view(arr, n)
                    prof.cast_ms += (time.perf_counter() - t) * 1e3
                    for block in _blocks(src, n, size):
                        if pending_bytes + 2 * block.size > STAGING_BYTES or fill + block.size > size:
                            flush()
                        if src.dtype == np.float16 and block.flags.c_contiguous:
                            pending.append(block)
                        else:
                            t = time.perf_counter()
                            dst = stagings[cur][fill:fill + block.size]
                            casting.append(casters.submit(half_cast.cast, dst.reshape(block.shape), block))
                            prof.cast_ms += (time.perf_counter() - t) * 1e3
                            pending.append(dst)
                            fill += block.size
                        pending_bytes += 2 * block.size
                    k = 2 * i + j + 1
                    if progress and (k % step == 0 or k == total):
                        progress(k, total)
            flush()
        finally:
            for f in casting:
                f.cancel() or f.exception()
            for f in writing:
                f.result()                  # the last batch hashed and written (or its error raised) before the fd goes


# ---------------------------------------------------------------------------------------- read


def parse_header(name: str, raw: bytes, size: int, g: Geometry, expected: dict | None = None) -> ParsedHeader:
    """A format-2 header validated completely before anything is allocated (session_container.parse_header
    with this format's tensor table)."""
    return session_container.parse_header(name, raw, size, g, expected, layout=layout, kv_layout=_kv_layout(g))


def _kv_layout(g: Geometry) -> str:
    if g.kv == KV_DTYPE:
        return KV_LAYOUT
    return QUANT_LAYOUT


_NP_OF = {mx.float32: np.float32, mx.float16: np.float16}


def load(path: str, expected: dict, make_cache: Callable[[], list], *, key: str, dtype=None,
         n_vocab: int = 1 << 31, n_ctx: int = 1 << 31,
         admit: Callable[[int], tuple[bool, str]] | None = None,
         progress: Callable[[int, int], None] | None = None, log: Callable[[str], None] = lambda s: None,
         probe_cache: Callable[[], list] | None = None, image_span: int = 0):
    """Validate everything, then build a KVEntry. Nothing live is touched; raise SessionFileError.
    A format-3 file (engine/session_files/session_v3.py) is validated against `probe_cache()`, this model's cache
    after one token. `image_span`: the loaded projector's tokens an image (0: none), the only length
    a run of image span ids may have."""
    _, head, _ = read_header(path)
    if head.get("version") == "3":
        if probe_cache is None:
            raise SessionFileError(f"{Path(path).name}: a format-3 session cannot be restored here")
        return session_v3.load(path, expected, make_cache, key=key, probe_cache=probe_cache, dtype=dtype,
                               n_vocab=n_vocab, n_ctx=n_ctx, admit=admit, progress=progress, log=log,
                               image_span=image_span)
    if expected.get("kv_format", KV_DTYPE) != KV_DTYPE:        # 8/4-bit K/V, restored as stored
        return session_quant.load(path, expected, make_cache, key=key, n_vocab=n_vocab, n_ctx=n_ctx,
                                  admit=admit, progress=progress, log=log, image_span=image_span)
    return _load_v2(Path(path).expanduser(), expected, make_cache, key, dtype,
                    Geometry.of(expected, n_vocab, n_ctx, image_span), admit, progress, log)


def _load_v2(p: Path, expected: dict, make_cache, key: str, dtype, g: Geometry, admit, progress, log):
    """A format-2 file of 16-bit K/V into this model's cache (`load` checked the format)."""
    t0 = time.perf_counter()
    prof = RestoreProfile()
    name = p.name
    dtype = dtype or compute_dtype()
    np_dtype = _NP_OF.get(dtype, np.float32)        # bfloat16: via float32, cast by MLX at the end
    prof.cast = "none (float16 file, float16 cache)" if np_dtype == np.float16 else (
        f"float16 -> {np.dtype(np_dtype).name}" + ("" if dtype in _NP_OF else f" -> {dtype}"))
    fd = _open_regular(p)
    try:
        size = os.fstat(fd).st_size
        raw = _read_raw_header(name, fd, size)
        hdr = parse_header(name, raw, size, g, expected)
        n, cells = hdr.n_tokens, padded_cells(hdr.n_tokens)
        need = restore_bytes(n, g, np.dtype(np_dtype).itemsize)
        check_memory(name, n, need, admit)
        cache = make_cache()
        if len(cache) != g.n_layer or any(layer_cache.kind_of(c).name != "kv" for c in cache):
            raise SessionFileError(f"{name}: this model's cache ({type(cache[0]).__name__ if cache else 'none'}) "
                                   f"cannot take a session file")
        digest = xxhash.xxh3_128()
        digest.update(struct.pack("<Q", len(raw)))
        digest.update(raw[:len(_PREFIX)] + _ZERO + raw[len(_PREFIX) + _HEX:])
        prof.header_ms = (time.perf_counter() - t0) * 1e3
        tokens = np.empty(n, np.int32)
        off = hdr.data_start
        if _read_hashed(fd, tokens, off, digest, prof) != tokens.nbytes:
            raise SessionFileError(f"{name} is truncated (tensor tokens)")
        # On the CPU the arrays the cache keeps are allocated once by MLX (padded as mlx-lm pads) and
        # filled in place through numpy views of their memory: no staging-to-MLX copy. On a GPU each
        # tensor is read into a padded host buffer and copied to the device (_read_to_device).
        t = time.perf_counter()
        shape_p = (1, g.n_kv_heads, cells, g.head_dim)
        in_place = not on_gpu()
        arrays: list = []
        if in_place:
            # Zeroed (the padding must be) by MLX's CPU stream thread while this one reads and casts:
            # fresh memory's page faults are a large part of a restore, and they overlap this way.
            arrays = [mx.zeros(shape_p, mx.float16 if np_dtype == np.float16 else mx.float32)
                      for _ in hdr.specs[1:]]
            mx.async_eval(arrays)
        prof.build_ms += (time.perf_counter() - t) * 1e3

        def dest(k: int) -> np.ndarray:
            """The cache's array for tensor k, as a writable numpy view (CPU)."""
            t = time.perf_counter()
            mx.eval(arrays[k])                  # allocated and zeroed by now (waits if not)
            view = _writable_view(arrays[k])
            prof.build_ms += (time.perf_counter() - t) * 1e3
            return view

        def read_heads(spec: TensorSpec, buf: np.ndarray) -> bool:
            return _read_heads(fd, buf, hdr.data_start + spec.start, n, digest, prof)

        kv = hdr.specs[1:]
        total, step = len(kv), max(1, len(kv) // 20)
        if in_place and np_dtype == np.float16:
            # No cast: each head is read straight into its place in the cache's array.
            for k, spec in enumerate(kv):
                if not read_heads(spec, dest(k)):
                    raise SessionFileError(f"{name} is truncated (tensor {spec.name})")
                if progress and (k % step == 0 or k == total - 1):
                    progress(k + 1, total)
        elif in_place:
            _read_widening(kv, read_heads, dest, (1, g.n_kv_heads, n, g.head_dim), prof, name, progress)
        else:
            arrays = _read_to_device(fd, hdr, g, digest, prof, name, progress)
    except OSError as e:
        raise SessionFileError(f"cannot read session file {p}: {e.strerror or e}") from None
    finally:
        os.close(fd)
    check_read(name, raw, digest, tokens, g.n_vocab, g.image_span)
    t = time.perf_counter()
    if arrays and arrays[0].dtype != dtype:
        arrays = [a.astype(dtype) for a in arrays]       # a GPU cache in another dtype: cast on the device
    for i, c in enumerate(cache):
        c.state = (arrays[2 * i], arrays[2 * i + 1], n)
    mx.eval(arrays)
    check_finite(name, arrays, ("K", "V"))
    prof.build_ms += (time.perf_counter() - t) * 1e3
    ms = (time.perf_counter() - t0) * 1e3
    log(f"restored {n} tokens from {name} in {ms:.1f} ms (read {prof.read_ms:.1f}, checksum "
        f"{prof.checksum_ms:.1f}, cast {prof.cast_ms:.1f}, build {prof.build_ms:.1f} ms)")
    return restored(tokens, cache, key, hdr, size, ms, prof)


def _read_widening(kv: list, read_heads, dest, shape: tuple, prof: RestoreProfile, name: str, progress) -> None:
    """A float16 file into a float32 cache (the CPU's compute dtype): the cast in two halves on two
    threads, one tensor at a time through two buffers. A reader thread reads the next tensor, hashes it
    and widens its float16 bits to float32's places (half_cast.widen_bits), while this thread scales
    the one before into the cache's array (half_cast.finish). read(2), xxhash and numpy's ops release
    the GIL. For 2,048 SmolLM2 tokens the engine's own restore took 22.6-23.6 ms so, against 25.8-37.6
    with the whole cast on this thread (bench/README.md)."""
    n, total = shape[2], len(kv)
    step = max(1, total // 20)
    staging = [np.zeros(shape, np.float16) for _ in range(2)]
    bits = [np.empty(shape, np.int32) for _ in range(2)]
    widen_ms = [0.0]                    # the reader's share of the cast (prof is this thread's)

    def read_widened(spec: TensorSpec, j: int) -> bool:
        if not read_heads(spec, staging[j]):
            return False
        t = time.perf_counter()
        half_cast.widen_bits(bits[j], staging[j])
        widen_ms[0] += (time.perf_counter() - t) * 1e3
        return True

    with ThreadPoolExecutor(1, thread_name_prefix="session-read") as pool:
        ahead = pool.submit(read_widened, kv[0], 0)
        try:
            for k, spec in enumerate(kv):
                if not ahead.result():
                    raise SessionFileError(f"{name} is truncated (tensor {spec.name})")
                # the other buffer is free: the tensor it held is in place
                ahead = pool.submit(read_widened, kv[k + 1], (k + 1) % 2) if k + 1 < total else None
                target = dest(k)[:, :, :n, :]
                t = time.perf_counter()
                half_cast.finish(target, bits[k % 2], staging[k % 2])
                prof.cast_ms += (time.perf_counter() - t) * 1e3
                if progress and (k % step == 0 or k == total - 1):
                    progress(k + 1, total)
        finally:
            if ahead is not None:
                ahead.cancel() or ahead.exception()   # never leave a read running on a closed fd
    prof.cast_ms += widen_ms[0]


GPU_BUFFERS = 6          # host buffers in flight on a GPU restore (read, hashed, copied to the device)
# Threads reading the file into them: one reader is below the page cache's speed; with 4, 8,192 tokens
# of Llama-1B restored on the H200 in 62.1-68.1 ms (three runs), with 2 in 60.8-70.2 (four runs; bench/gpu.md):
# within the machine's spread, but 2 of 3 runs at >= 4 GB/s against 1 of 4.
GPU_READERS = 4


def _read_to_device(fd: int, hdr: ParsedHeader, g: Geometry, digest, prof: RestoreProfile, name: str,
                    progress) -> list:
    """A GPU restore's K/V: float16 device arrays, padded as mlx-lm pads, one per tensor in file order.

    Three stages overlap, on a ring of GPU_BUFFERS padded host buffers: reader threads read tensors
    into free buffers (a read per head: the padding is never written and stays zero), one hashing
    thread hashes them in file order (xxh3 is a stream), and this thread copies each one to the device
    (device_upload.to_device: one host copy and a DMA on CUDA). A buffer is reused once it is both
    hashed and on the device."""
    n, cells = hdr.n_tokens, padded_cells(hdr.n_tokens)
    kv = hdr.specs[1:]
    total, step = len(kv), max(1, len(kv) // 20)
    # Device buffers from MLX's cache (what an evicted conversation freed) made the uploads slower than
    # new ones from CUDA's pool on the H200: 8,192 tokens of Llama-1B 86-103 ms after evictions against
    # 57-66 ms with nothing cached (bench/gpu.md; 74.5 against 70.1 ms without the clear in a later
    # run). So a restore starts from an empty cache.
    mx.clear_cache()
    ring = [np.zeros((1, g.n_kv_heads, cells, g.head_dim), np.float16) for _ in range(min(GPU_BUFFERS, total))]

    def read(k: int) -> bool:          # unhashed: the hashing thread takes the buffers in file order
        return _read_heads(fd, ring[k % len(ring)], hdr.data_start + kv[k].start, n, None, prof)

    def hash_after(k: int, got) -> bool:
        if not got.result():
            return False
        t = time.perf_counter()
        buf = ring[k % len(ring)]
        for h in range(g.n_kv_heads):
            digest.update(buf[0, h, :n, :])
        prof.checksum_ms += (time.perf_counter() - t) * 1e3
        return True

    arrays: list = []
    with ThreadPoolExecutor(GPU_READERS, thread_name_prefix="session-read") as readers, \
            ThreadPoolExecutor(1, thread_name_prefix="session-hash") as hasher:
        reads: dict = {}
        hashes: dict = {}

        def start(k: int) -> None:
            reads[k] = readers.submit(read, k)
            hashes[k] = hasher.submit(hash_after, k, reads[k])     # FIFO: file order
        for k in range(len(ring)):
            start(k)
        try:
            for k, spec in enumerate(kv):
                if not reads[k].result():
                    raise SessionFileError(f"{name} is truncated (tensor {spec.name})")
                t = time.perf_counter()
                arrays.append(to_device(ring[k % len(ring)]))
                prof.build_ms += (time.perf_counter() - t) * 1e3
                if not hashes.pop(k).result():
                    raise SessionFileError(f"{name} is truncated (tensor {spec.name})")
                del reads[k]
                if k + len(ring) < total:
                    start(k + len(ring))                     # its buffer is hashed and on the device
                if progress and (k % step == 0 or k == total - 1):
                    progress(k + 1, total)
        finally:
            for f in (*reads.values(), *hashes.values()):
                f.cancel() or f.exception()                  # never leave a read running on a closed fd
    return arrays


def _writable_view(a) -> np.ndarray:
    """A writable numpy view of an evaluated, freshly allocated MLX array's own memory."""
    v = np.array(a, copy=False)
    if not (v.flags.writeable and v.flags.c_contiguous and v.shape == tuple(a.shape) and not v.flags.owndata):
        raise SessionFileError("this MLX build gives no writable view of an array's memory")
    return v

