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

import errno
import fcntl
import json
import os
import re
import stat
import struct
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import mlx.core as mx
import numpy as np
import xxhash

from . import half_cast
from .device import compute_dtype, on_cuda, on_gpu
from .device_upload import drop_host_copies, host_view, to_device
from .errors import SessionFileError, SessionFormatRefused, SessionOverwriteRefused, StrataError

FORMAT = "strata-session"
VERSION = 2                        # what a full-K/V conversation is written in (format 3: engine/session_v3.py)
READS = (2, 3)                     # the versions restored: 2 here (and session_quant.py), 3 in session_v3.py
KV_DTYPE = "float16"
KV_LAYOUT = "mlx-kvcache (batch, kv_heads, tokens, head_dim)"
STEP = 256                         # mlx-lm's KVCache grows in steps of 256 cells: restore pads the same way
STAGING_BYTES = 2 << 20            # each of the save's two staging buffers (large writes, no full-size copy)
MAX_HEADER = 64 << 20              # a header is metadata and messages: far below this
STALE_PART_S = 2.0                 # a .part younger than this may be a save that has not locked it yet
_PREFIX = b'{"__metadata__":{"checksum":"'
_HEX = 32                          # xxh3-128 in hex
_ZERO = b"0" * _HEX
_PART = re.compile(r"^\..+\.[A-Za-z0-9_]{8}\.part$")
_ROLES = ("system", "user", "assistant", "tool")
_ST = {"I32": np.dtype("<i4"), "F16": np.dtype("<f2")}


# ---------------------------------------------------------------------------------------- layout

@dataclass(frozen=True)
class Geometry:
    """What a file must match to be restored into this model."""
    n_layer: int
    n_kv_heads: int
    head_dim: int
    n_vocab: int
    n_ctx: int
    kv: str = KV_DTYPE          # the K/V format (kv_format.KVFormat.label): quantized ones: session_quant.py

    @classmethod
    def of(cls, fingerprint: dict, n_vocab: int = 1 << 31, n_ctx: int = 1 << 31) -> "Geometry":
        return cls(int(fingerprint["n_layer"]), int(fingerprint["n_kv_heads"]), int(fingerprint["head_dim"]),
                   int(n_vocab), int(n_ctx), str(fingerprint.get("kv_format", KV_DTYPE)))


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str          # safetensors name: I32 or F16
    shape: tuple[int, ...]
    start: int          # offsets in the data section
    end: int

    def as_json(self) -> dict:
        return {"dtype": self.dtype, "shape": list(self.shape), "data_offsets": [self.start, self.end]}


def layout(n_tokens: int, g: Geometry) -> list[TensorSpec]:
    """The one tensor table a file of n_tokens for this geometry may have, in file order."""
    if g.kv != KV_DTYPE:
        from . import session_quant
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


def _header_bytes(specs: list[TensorSpec], metadata: dict[str, str], checksum: bytes = _ZERO) -> bytes:
    head = {"__metadata__": {"checksum": checksum.decode(), **metadata}}
    for s in specs:
        head[s.name] = s.as_json()
    raw = json.dumps(head, separators=(",", ":"), ensure_ascii=False).encode()
    return raw + b" " * (-len(raw) % 8)    # safetensors allows space padding; keeps the data aligned


def padded_cells(n_tokens: int) -> int:
    """Cells the restored cache allocates: a multiple of mlx-lm's step with room for one more token, so
    the next token is written in place instead of growing (copying) the whole cache."""
    return (n_tokens // STEP + 1) * STEP


def restore_bytes(n_tokens: int, g: Geometry, itemsize: int) -> int:
    return 2 * g.n_layer * g.n_kv_heads * padded_cells(n_tokens) * g.head_dim * itemsize


# ---------------------------------------------------------------------------------------- timings

@dataclass
class SaveProfile:
    """Where a save's time went (ms)."""
    prepare_ms: float = 0.0     # checks, header, temporary file
    cast_ms: float = 0.0        # K/V -> float16 staging (a cast only when the cache is not float16)
    checksum_ms: float = 0.0
    write_ms: float = 0.0       # write(2) calls (in the writer thread: overlaps the cast)
    sync_ms: float = 0.0        # fsync of the file and of its folder (0 with sync=False)
    rename_ms: float = 0.0
    writes: int = 0


@dataclass
class RestoreProfile:
    """Where a restore's time went (ms)."""
    header_ms: float = 0.0      # open, header read, validation, memory guard
    read_ms: float = 0.0        # read(2) (float32: in the reader thread, overlapping the cast)
    checksum_ms: float = 0.0
    cast_ms: float = 0.0        # float16 -> compute dtype into the padded buffer (float32: both threads' shares)
    build_ms: float = 0.0       # allocating the cache's MLX arrays (CPU) or copying into them, the cache objects
    reads: int = 0
    cast: str = ""


@dataclass
class SaveResult:
    path: str
    session_bytes: int
    save_ms: float
    sync_ms: float
    tokens: int
    synced: bool
    profile: SaveProfile = field(default_factory=SaveProfile)

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass
class ParsedHeader:
    n_tokens: int
    specs: list[TensorSpec]
    meta: dict[str, str]
    messages: list[dict]
    raw: bytes                  # the header as read (its checksum digits included)
    data_start: int


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


def _write_all(fd: int, data, prof: SaveProfile) -> None:
    t = time.perf_counter()
    view = memoryview(data).cast("B")
    while view:
        k = os.write(fd, view)
        view = view[k:]
    prof.write_ms += (time.perf_counter() - t) * 1e3
    prof.writes += 1


def _writev_all(fd: int, pieces: list, prof: SaveProfile) -> None:
    t = time.perf_counter()
    views = [memoryview(p).cast("B") for p in pieces]
    while views:
        k = os.writev(fd, views[:512])          # IOV_MAX is 1024 on Linux and macOS
        prof.writes += 1
        while views and k >= len(views[0]):
            k -= len(views[0])
            views.pop(0)
        if views and k:
            views[0] = views[0][k:]
    prof.write_ms += (time.perf_counter() - t) * 1e3


def existing_tokens(path: Path) -> int | None:
    """Tokens held by the session file at path (any format version), or None when it is not one."""
    try:
        fd = _open_regular(path)
    except SessionFileError:
        return None
    try:
        size = os.fstat(fd).st_size
        head = pread_exact(fd, 8, 0)
        if len(head) < 8:
            return None
        (n,) = struct.unpack("<Q", head)
        if n == 0 or n > min(MAX_HEADER, size - 8):
            return None
        meta = json.loads(pread_exact(fd, n, 8)).get("__metadata__")
        if not isinstance(meta, dict) or meta.get("format") != FORMAT:
            return None
        return int(meta["n_tokens"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError):
        return None
    finally:
        os.close(fd)


def check_overwrite(final: Path, n_tokens: int, force: bool) -> None:
    """Saving over a session that holds a longer conversation (or over a file that is not a session)
    replaces it with less: refused unless forced (the app asks; the CLI has --force)."""
    if force or not os.path.lexists(final):
        return
    held = existing_tokens(final)
    if held is None:
        raise SessionOverwriteRefused(
            f"{final.name} exists and is not a Strata session file; not replaced (use --force to replace it)",
            path=str(final), existing_tokens=None, new_tokens=n_tokens)
    if held > n_tokens:
        raise SessionOverwriteRefused(
            f"{final.name} holds a longer conversation ({held} tokens) than this one ({n_tokens}); "
            f"not replaced (use --force to replace it)", path=str(final), existing_tokens=held,
            new_tokens=n_tokens)


def save(path: str, entry, fingerprint: dict, *, sync: bool = True, force: bool = False,
         progress: Callable[[int, int], None] | None = None,
         log: Callable[[str], None] = lambda s: None) -> dict:
    t0 = time.perf_counter()
    final = Path(path).expanduser()
    if final.is_dir():
        raise SessionFileError(f"cannot save the session: {final} is a folder")
    if os.path.lexists(final) and not final.is_file():
        raise SessionFileError(f"cannot save the session: {final} exists and is not a regular file")
    from . import session_v3
    if session_v3.needed(entry.cache):          # a sliding window or a recurrent state: format 3
        return session_v3.save(final, entry, fingerprint, t0=t0, sync=sync, force=force, progress=progress,
                               log=log)
    if fingerprint.get("kv_format", KV_DTYPE) != KV_DTYPE:      # 8/4-bit K/V, stored as held
        from . import session_quant
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


def write_session(final: Path, entry, fingerprint: dict, specs: list, kv_dtype: str, kv_layout: str,
                  body: Callable[[int, object], None], *, t0: float, prof: SaveProfile, sync: bool, force: bool,
                  log: Callable[[str], None], version: int = VERSION, extra: dict | None = None) -> dict:
    """What every save shares, whatever its K/V format: the messages checked, the overwrite rule, the
    header (checksum placeholder), a locked temporary file beside the target, header and token ids,
    then `body(fd, digest)` writes the K/V tensors in file order (hashing them), then the checksum in
    place, fsync, rename and the folder's fsync. A failure leaves no temporary file behind."""
    n = len(entry.tokens)
    why = validate_messages(entry.messages)     # a file this Strata would refuse is never written
    if why is not None:
        raise SessionFileError(f"cannot save the session: {why}")
    messages = json.dumps(entry.messages, ensure_ascii=False)
    check_overwrite(final, n, force)
    metadata = {"format": FORMAT, "version": str(version), "n_tokens": str(n), "kv_dtype": kv_dtype,
                "kv_layout": kv_layout, **(extra or {}), "messages": messages,
                **{f"fp.{k}": str(v) for k, v in fingerprint.items()}}
    header = _header_bytes(specs, metadata)
    prefix = struct.pack("<Q", len(header))
    tokens = np.asarray(entry.tokens, dtype=np.int32)
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise SessionFileError(f"cannot save the session to {final}: {e.strerror or e}") from None
    remove_stale_parts(final.parent, log)
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{final.name}.", suffix=".part", dir=final.parent)
    except OSError as e:
        raise SessionFileError(f"cannot save the session to {final}: {e.strerror or e}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)         # "a live save owns this": cleaners skip locked parts
        digest = xxhash.xxh3_128()
        digest.update(prefix)
        digest.update(header)
        prof.prepare_ms = (time.perf_counter() - t0) * 1e3
        _write_all(fd, prefix + header, prof)
        digest.update(tokens)
        _write_all(fd, tokens, prof)
        body(fd, digest)
        drop_host_copies()                      # CUDA: the device copies body read (host_view)
        # The checksum replaces its placeholder: same width, so nothing else moves.
        os.pwrite(fd, digest.hexdigest().encode(), 8 + len(_PREFIX))
        if sync:
            t = time.perf_counter()
            os.fsync(fd)
            prof.sync_ms += (time.perf_counter() - t) * 1e3
        t = time.perf_counter()
        os.close(fd)
        fd = -1
        os.replace(tmp, final)
        prof.rename_ms = (time.perf_counter() - t) * 1e3
        if sync:
            t = time.perf_counter()
            dir_fd = os.open(final.parent, os.O_RDONLY)
            try:
                os.fsync(dir_fd)
            finally:
                os.close(dir_fd)
            prof.sync_ms += (time.perf_counter() - t) * 1e3
    except OSError as e:
        _discard(fd, tmp)
        raise SessionFileError(f"cannot save the session to {final}: {e.strerror or e}") from None
    except BaseException:
        _discard(fd, tmp)
        raise
    size = 8 + len(header) + specs[-1].end
    ms = (time.perf_counter() - t0) * 1e3
    from .kv_format import describe_label
    what = "" if kv_dtype == KV_DTYPE else f" ({describe_label(kv_dtype)})"
    log(f"saved {n} tokens{what} to {final.name}: {size} B in {ms:.1f} ms "
        f"({'sync ' + format(prof.sync_ms, '.1f') + ' ms' if sync else 'not synced'})")
    return SaveResult(str(final), size, round(ms, 2), round(prof.sync_ms, 2), n, sync, prof).as_dict()


def _discard(fd: int, tmp: str) -> None:
    if fd >= 0:
        try:
            os.close(fd)
        except OSError:
            pass
    Path(tmp).unlink(missing_ok=True)


def _looks_like_our_part(head: bytes) -> bool:
    """The first bytes of a save's temporary file: empty, or a header length < 4 GiB then our prefix."""
    return head[4:8] == b"\0\0\0\0"[:len(head[4:8])] and head[8:] == _PREFIX[:len(head[8:])]


def remove_stale_parts(folder: Path, log: Callable[[str], None] = lambda s: None) -> int:
    """Remove the temporary files of saves that were killed: `.NAME.XXXXXXXX.part` files in folder that
    no live save holds (flock), older than a couple of seconds, and that are ours (empty, or starting
    with a session header). Returns how many were removed; never raises."""
    removed = 0
    try:
        candidates = [p for p in Path(folder).iterdir() if _PART.match(p.name)]
    except OSError:
        return 0
    now = time.time()
    for part in candidates:
        try:
            fd = os.open(part, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0))
        except OSError:
            continue
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or now - st.st_mtime < STALE_PART_S:
                continue
            if not _looks_like_our_part(os.pread(fd, 8 + len(_PREFIX), 0)):
                continue            # not a session being written: someone else's file
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                continue            # a save in progress holds it
            part.unlink()
            removed += 1
            log(f"removed {part.name} ({st.st_size} B), left by an interrupted save")
        except OSError:
            pass
        finally:
            os.close(fd)
    return removed


# ---------------------------------------------------------------------------------------- read

def _open_regular(p: Path) -> int:
    """An fd for p when p is a regular file; SessionFileError otherwise (without blocking on a FIFO)."""
    try:
        st = os.stat(p)
    except FileNotFoundError:
        raise SessionFileError(f"session file not found: {p}") from None
    except OSError as e:
        raise SessionFileError(f"cannot read session file {p}: {e.strerror or e}") from None
    if stat.S_ISDIR(st.st_mode):
        raise SessionFileError(f"{p} is a folder, not a session file")
    if not stat.S_ISREG(st.st_mode):
        raise SessionFileError(f"{p.name} is not a regular file (a pipe, socket or device): not a session file")
    try:
        # O_NONBLOCK: if the path was swapped for a FIFO since the stat, open must not wait for a writer.
        fd = os.open(p, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        if e.errno == errno.EISDIR:
            raise SessionFileError(f"{p} is a folder, not a session file") from None
        raise SessionFileError(f"cannot read session file {p}: {e.strerror or e}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise SessionFileError(f"{p.name} is not a regular file (a pipe, socket or device): not a session file")
        fl = fcntl.fcntl(fd, fcntl.F_GETFL)
        fcntl.fcntl(fd, fcntl.F_SETFL, fl & ~os.O_NONBLOCK)
    except BaseException:
        os.close(fd)
        raise
    return fd


def pread_exact(fd: int, n: int, off: int) -> bytes:
    """Up to `n` bytes at `off` (fewer only at the end of the file): os.pread until done."""
    out = bytearray()
    while len(out) < n:
        chunk = os.pread(fd, n - len(out), off + len(out))
        if not chunk:
            break
        out += chunk
    return bytes(out)


def _readinto_exact(fd: int, buf: np.ndarray, off: int) -> int:
    view = memoryview(buf).cast("B")
    got = 0
    while got < len(view):
        k = os.preadv(fd, [view[got:]], off + got)
        if k <= 0:
            break
        got += k
    return got


def _read_hashed(fd: int, buf: np.ndarray, off: int, digest, prof: RestoreProfile) -> int:
    """Read buf's bytes from off (timed) and, when they all came and a digest is given, hash them.
    Returns the bytes read."""
    t = time.perf_counter()
    got = _readinto_exact(fd, buf, off)
    prof.read_ms += (time.perf_counter() - t) * 1e3
    prof.reads += 1
    if got == buf.nbytes and digest is not None:
        t = time.perf_counter()
        digest.update(buf)
        prof.checksum_ms += (time.perf_counter() - t) * 1e3
    return got


def _read_heads(fd: int, buf: np.ndarray, off: int, n: int, digest, prof: RestoreProfile) -> bool:
    """A (1, heads, n, dim) tensor stored from `off` into buf[0, :, :n, :] (buf may be padded past n),
    a read per head, each hashed in file order unless digest is None. False when the file ran short."""
    for h in range(buf.shape[1]):
        part = buf[0, h, :n, :]
        if _read_hashed(fd, part, off, digest, prof) != part.nbytes:
            return False
        off += part.nbytes
    return True


def _read_raw_header(name: str, fd: int, size: int) -> bytes:
    if size < 8:
        raise SessionFileError(f"{name} is not a Strata session file (too short)")
    (n,) = struct.unpack("<Q", pread_exact(fd, 8, 0))
    if n < len(_PREFIX) or n > MAX_HEADER or n > size - 8:
        raise SessionFileError(f"{name} is not a Strata session file")
    raw = pread_exact(fd, n, 8)
    if len(raw) != n:
        raise SessionFileError(f"{name} is truncated")
    return raw


def _meta_of(name: str, raw: bytes) -> tuple[dict, dict[str, str]]:
    """(tensor table, metadata) of a raw header, typed; SessionFileError otherwise."""
    try:
        table = json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError):
        raise SessionFileError(f"{name} is not a Strata session file (unreadable header)") from None
    meta = table.pop("__metadata__", None) if isinstance(table, dict) else None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise SessionFileError(f"{name} is not a Strata session file")
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
        raise SessionFileError(f"{name} is corrupted (header metadata is not all text)")
    version = meta.get("version", "")
    if not re.fullmatch(r"[0-9]{1,6}", version):
        raise SessionFileError(f"{name} is corrupted (bad format version {version[:20]!r})")
    if int(version) > max(READS):
        raise SessionFileError(f"{name} has session format version {int(version)}, newer than this "
                               f"Strata reads ({max(READS)}); update Strata")
    if int(version) < min(READS):
        raise SessionFileError(f"{name} has session format version {int(version)}, which this Strata no longer "
                               f"reads (it reads {min(READS)} and {max(READS)}: version 1 left its header outside "
                               f"the checksum); save the conversation again")
    return table, meta


def validate_messages(messages) -> str | None:
    """Why messages are not a conversation (None when they are)."""
    if not isinstance(messages, list):
        return "the messages are not a list"
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not all(isinstance(k, str) for k in m):
            return f"message {i} is not an object"
        if m.get("role") not in _ROLES:
            return f"message {i} has no valid role"
        if not isinstance(m.get("content"), str):
            return f"message {i} has no text content"
    return None


def parse_header(name: str, raw: bytes, size: int, g: Geometry, expected: dict | None = None) -> ParsedHeader:
    """Validate a raw header completely (type and range of every field) before anything is allocated."""
    if not raw.startswith(_PREFIX) or raw[len(_PREFIX) + _HEX:len(_PREFIX) + _HEX + 1] != b'"':
        # Either not ours at all, or the checksum field itself was damaged.
        _meta_of(name, raw)            # says "not a session file" / the version when it can
        raise SessionFileError(f"{name} is corrupted (checksum field)")
    if not re.fullmatch(rb"[0-9a-f]{32}", raw[len(_PREFIX):len(_PREFIX) + _HEX]):
        raise SessionFileError(f"{name} is corrupted (checksum field)")
    table, meta = _meta_of(name, raw)
    if meta.get("version") != str(VERSION):
        raise SessionFileError(f"{name}: format {meta.get('version')} holds layer kinds this model's cache "
                               f"does not have")
    if expected is not None:
        check_fingerprint(name, meta, expected)
    if meta.get("kv_dtype") != g.kv or meta.get("kv_layout") != _kv_layout(g):
        raise SessionFileError(f"{name}: incompatible K/V layout ({meta.get('kv_dtype', '?')[:20]}, "
                               f"{meta.get('kv_layout', '?')[:60]})")
    nt = meta.get("n_tokens", "")
    if not re.fullmatch(r"[0-9]{1,10}", nt):
        raise SessionFileError(f"{name} is corrupted (bad token count {nt[:20]!r})")
    n = int(nt)
    if n < 1:
        raise SessionFileError(f"{name} holds no tokens")
    if n >= g.n_ctx:
        raise SessionFileError(f"{name} holds {n} tokens; the context holds {g.n_ctx} "
                               f"(a longer --ctx may restore it)")
    specs = layout(n, g)
    if table != {s.name: s.as_json() for s in specs} or list(table) != [s.name for s in specs]:
        raise SessionFileError(f"{name} is corrupted (its tensor table does not match {n} tokens of "
                               f"{g.n_layer} layers x {g.n_kv_heads} K/V heads x {g.head_dim} {g.kv})")
    want = 8 + len(raw) + specs[-1].end
    if size < want:
        raise SessionFileError(f"{name} is truncated ({size} of {want} bytes)")
    if size > want:
        raise SessionFileError(f"{name} is corrupted ({size - want} bytes after its data)")
    try:
        messages = json.loads(meta.get("messages", ""))
    except (ValueError, RecursionError):
        raise SessionFileError(f"{name} is corrupted (its messages are not JSON)") from None
    why = validate_messages(messages)
    if why:
        raise SessionFileError(f"{name} is corrupted ({why})")
    return ParsedHeader(n, specs, meta, messages, raw, 8 + len(raw))


def _kv_layout(g: Geometry) -> str:
    if g.kv == KV_DTYPE:
        return KV_LAYOUT
    from .session_quant import QUANT_LAYOUT
    return QUANT_LAYOUT


def read_header(path: str) -> tuple[dict, dict, int]:
    """(tensor table, metadata, data start) of a session file, structurally checked (no model needed)."""
    p = Path(path).expanduser()
    fd = _open_regular(p)
    try:
        raw = _read_raw_header(p.name, fd, os.fstat(fd).st_size)
    finally:
        os.close(fd)
    table, meta = _meta_of(p.name, raw)
    return table, meta, 8 + len(raw)


def check_fingerprint(name: str, meta: dict, expected: dict) -> None:
    fp = {k[3:]: v for k, v in meta.items() if k.startswith("fp.")}
    geometry = ("n_layer", "n_kv_heads", "head_dim")
    theirs = {k: fp.get(k) for k in geometry}
    ours = {k: str(expected[k]) for k in geometry}
    if theirs != ours:
        def short(v):
            return str(v)[:12]
        raise SessionFileError(
            f"{name}: incompatible K/V geometry (file: {short(fp.get('n_layer'))} layers x "
            f"{short(fp.get('n_kv_heads'))} K/V heads x {short(fp.get('head_dim'))}, {str(meta.get('kv_dtype'))[:12]}; "
            f"model: {expected['n_layer']} x {expected['n_kv_heads']} x {expected['head_dim']}, "
            f"{expected.get('kv_format', KV_DTYPE)})")
    if fp.get("model_hash") != expected["model_hash"] or fp.get("architecture") != expected["architecture"]:
        raise SessionFileError(f"{name} was saved with another model (content {str(fp.get('model_hash'))[:12]}, "
                               f"loaded model {expected['model_hash'][:12]})")
    if fp.get("tokenizer") != expected["tokenizer"] or fp.get("chat_template") != expected["chat_template"]:
        raise SessionFileError(f"{name} was saved with another tokenizer or chat template")
    theirs, ours = fp.get("kv_format", KV_DTYPE), str(expected.get("kv_format", KV_DTYPE))
    if theirs != ours:
        # Refused, not converted: widening 8-bit codes or re-quantizing them would give a K/V that
        # no engine run produced.
        from .kv_format import describe_label, format_of_label
        fmt = format_of_label(theirs)
        if fmt is None:
            raise SessionFileError(f"{name} holds {describe_label(theirs[:20])}; this engine runs "
                                   f"{describe_label(ours)}")
        from .kv_format import choose
        try:
            group = choose(fmt.bits, int(expected["head_dim"])).group
        except (StrataError, ValueError, TypeError):
            group = None
        if fmt.quantized and group != fmt.group:
            # No --kv-bits restores it: this model's head size decides the group of its quantized K/V.
            raise SessionFileError(f"{name} holds {fmt.bits}-bit K/V in groups of {fmt.group}; this model's "
                                   f"{fmt.bits}-bit K/V uses groups of {group} (its head size is "
                                   f"{expected['head_dim']}), so no --kv-bits setting restores it")
        raise SessionFormatRefused(f"{name} holds {describe_label(theirs)}; this engine runs {describe_label(ours)}")
    if fp.get("steering") != str(expected["steering"]):
        raise SessionFileError(f"{name} was saved with another steering setting "
                               f"({_steer_label(fp.get('steering'))}; now {_steer_label(expected['steering'])})")


def _steer_label(fp) -> str:
    return "no control vector" if fp in (None, "none", "") else f"control vector {str(fp)[:12]}"


_NP_OF = {mx.float32: np.float32, mx.float16: np.float16}


def load(path: str, expected: dict, make_cache: Callable[[], list], *, key: str, dtype=None,
         n_vocab: int = 1 << 31, n_ctx: int = 1 << 31,
         admit: Callable[[int], tuple[bool, str]] | None = None,
         progress: Callable[[int, int], None] | None = None, log: Callable[[str], None] = lambda s: None,
         probe_cache: Callable[[], list] | None = None):
    """Validate everything, then build a KVEntry. Nothing live is touched; raise SessionFileError.
    A format-3 file (engine/session_v3.py) is validated against `probe_cache()`, this model's cache
    after one token."""
    from . import layer_cache

    _, head, _ = read_header(path)
    if head.get("version") == "3":
        from . import session_v3
        if probe_cache is None:
            raise SessionFileError(f"{Path(path).name}: a format-3 session cannot be restored here")
        return session_v3.load(path, expected, make_cache, key=key, probe_cache=probe_cache, dtype=dtype,
                               n_vocab=n_vocab, n_ctx=n_ctx, admit=admit, progress=progress, log=log)
    t0 = time.perf_counter()
    prof = RestoreProfile()
    p = Path(path).expanduser()
    name = p.name
    if expected.get("kv_format", KV_DTYPE) != KV_DTYPE:        # 8/4-bit K/V, restored as stored
        from . import session_quant
        return session_quant.load(path, expected, make_cache, key=key, n_vocab=n_vocab, n_ctx=n_ctx,
                                  admit=admit, progress=progress, log=log)
    g = Geometry.of(expected, n_vocab, n_ctx)
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
            # float32 (the CPU's compute dtype): the cast in two halves on two threads, one tensor at
            # a time through two buffers. A reader thread reads the next tensor, hashes it and widens
            # its float16 bits to float32's places (half_cast.widen_bits), while this thread scales the
            # one before into the cache's array (half_cast.finish). read(2), xxhash and numpy's ops
            # release the GIL. For 2,048 SmolLM2 tokens the engine's own restore took 22.6-23.6 ms so,
            # against 25.8-37.6 with the whole cast on this thread (bench/README.md, session 7).
            staging = [np.zeros((1, g.n_kv_heads, n, g.head_dim), np.float16) for _ in range(2)]
            bits = [np.empty(staging[0].shape, np.int32) for _ in range(2)]
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
        else:
            arrays = _read_to_device(fd, hdr, g, digest, prof, name, progress)
    except OSError as e:
        raise SessionFileError(f"cannot read session file {p}: {e.strerror or e}") from None
    finally:
        os.close(fd)
    check_read(name, raw, digest, tokens, g.n_vocab)
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


def check_finite(name: str, arrays: list, parts: tuple[str, ...]) -> None:
    """Refuse restored K/V (or quantized K/V's scales and biases) holding NaN or an infinity: a file
    whose checksum was recomputed over such values would restore and generate token 0 or garbage.
    One reduction per tensor, evaluated together on the device (the padding is zeros); integer codes
    are skipped (every bit pattern is a value). `parts` names a layer's tensors in file order."""
    checked = [(k, a) for k, a in enumerate(arrays) if mx.issubdtype(a.dtype, mx.floating)]
    if not checked:
        return
    bad = mx.stack([mx.any(mx.logical_not(mx.isfinite(a))) for _, a in checked]).tolist()
    if any(bad):
        k = checked[bad.index(True)][0]
        layer, part = divmod(k, len(parts))
        raise SessionFileError(f"{name}: layer {layer}'s {parts[part]} holds NaN or infinite values "
                               "(a damaged or crafted file): refused")


GPU_BUFFERS = 6          # host buffers in flight on a GPU restore (read, hashed, copied to the device)
# Threads reading the file into them: one reader is below the page cache's speed; with 4, 8,192 tokens
# of Llama-1B restored on the H200 in 62.1-68.1 ms (three runs), with 2 in 60.8-70.2 (four runs; bench/gpu.md,
# session 6): within the machine's spread, but 2 of 3 runs at >= 4 GB/s against 1 of 4.
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
    # 57-66 ms with nothing cached (bench/gpu.md, session 5; 74.5 against 70.1 ms without the clear in
    # session 6). So a restore starts from an empty cache.
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


def check_memory(name: str, n: int, need: int, admit) -> None:
    """Before any K/V is allocated: the memory guard's word on the `need` bytes a restore will hold."""
    if admit is not None:
        ok, why = admit(need)
        if not ok:
            raise SessionFileError(f"{name} was not restored: its {n} tokens need "
                                   f"{need / (1 << 20):.1f} MiB of K/V memory and the memory guard says no "
                                   f"({why})")


def check_read(name: str, raw: bytes, digest, tokens: np.ndarray, n_vocab: int) -> None:
    """Once every byte is read: the header's checksum against them, then every token id against
    the vocabulary (16-bit and quantized restores alike)."""
    if digest.hexdigest().encode() != raw[len(_PREFIX):len(_PREFIX) + _HEX]:
        raise SessionFileError(f"{name} is corrupted (checksum mismatch)")
    lo, hi = int(tokens.min()), int(tokens.max())
    if lo < 0 or hi >= n_vocab:
        bad = lo if lo < 0 else hi
        raise SessionFileError(f"{name} is corrupted (token id {bad} is outside the vocabulary of {n_vocab})")


def restored(tokens: np.ndarray, cache: list, key: str, hdr, size: int, ms: float, prof) -> tuple:
    """The restored entry and the result fields both restores report."""
    from .parking import KVEntry
    entry = KVEntry(tokens.tolist(), cache, key, messages=hdr.messages)
    return entry, {"restored_tokens": len(tokens), "restore_ms": round(ms, 2), "messages": hdr.messages,
                   "session_bytes": size, "profile": asdict(prof)}


def _writable_view(a) -> np.ndarray:
    """A writable numpy view of an evaluated, freshly allocated MLX array's own memory."""
    v = np.array(a, copy=False)
    if not (v.flags.writeable and v.flags.c_contiguous and v.shape == tuple(a.shape) and not v.flags.owndata):
        raise SessionFileError("this MLX build gives no writable view of an array's memory")
    return v

