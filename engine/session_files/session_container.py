"""What every session file format shares (engine/session_files/sessions.py describes the container; format 2's K/V
there and in engine/session_files/session_quant.py, format 3's in engine/session_files/session_v3.py): the header's checksum field,
reading and validating a header, the fingerprint check, the atomic write (`write_session`), stale
temporary files, the reads (hashed in file order) and the last checks (checksum, token ids, finite
values). The format modules import this one; it imports none of them (no import circle).
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
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import mlx.core as mx
import numpy as np
import xxhash

from engine.model.device_upload import drop_host_copies
from engine.errors import SessionFileError, SessionFormatRefused, SessionOverwriteRefused, StrataError
from engine.cache.kv_format import describe_label, choose, format_of_label
from engine.cache.parking import KVEntry
from engine.text.image_tokens import outside_vocab, valid_parts

FORMAT = "strata-session"
VERSION = 2                        # what a full-K/V conversation is written in (format 3: engine/session_files/session_v3.py)
READS = (2, 3)                     # the versions restored: 2 here (and session_quant.py), 3 in session_v3.py
KV_DTYPE = "float16"
STEP = 256                         # mlx-lm's KVCache grows in steps of 256 cells: restore pads the same way
MAX_HEADER = 64 << 20              # a header is metadata and messages: far below this
STALE_PART_S = 2.0                 # a .part younger than this may be a save that has not locked it yet
_PREFIX = b'{"__metadata__":{"checksum":"'
_HEX = 32                          # xxh3-128 in hex
_ZERO = b"0" * _HEX
_PART = re.compile(r"^\..+\.[A-Za-z0-9_]{8}\.part$")
_ROLES = ("system", "user", "assistant", "tool")


@dataclass(frozen=True)
class Geometry:
    """What a file must match to be restored into this model."""
    n_layer: int
    n_kv_heads: int
    head_dim: int
    n_vocab: int
    n_ctx: int
    kv: str = KV_DTYPE          # the K/V format (kv_format.KVFormat.label): quantized ones: session_quant.py
    image_span: int = 0         # the loaded projector's tokens an image (0: none): image spans' length

    @classmethod
    def of(cls, fingerprint: dict, n_vocab: int = 1 << 31, n_ctx: int = 1 << 31, image_span: int = 0) -> "Geometry":
        return cls(int(fingerprint["n_layer"]), int(fingerprint["n_kv_heads"]), int(fingerprint["head_dim"]),
                   int(n_vocab), int(n_ctx), str(fingerprint.get("kv_format", KV_DTYPE)), int(image_span))


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str          # safetensors name: I32 or F16
    shape: tuple[int, ...]
    start: int          # offsets in the data section
    end: int

    def as_json(self) -> dict:
        return {"dtype": self.dtype, "shape": list(self.shape), "data_offsets": [self.start, self.end]}


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
        if not isinstance(m.get("content"), str) and not valid_parts(m.get("content")):
            return f"message {i} has no text content"     # nor text parts and image references
        if not _encodable(m):
            return f"message {i} holds text that is not valid Unicode (a lone surrogate)"
    return None


def _encodable(value) -> bool:
    """Whether every string in `value` (keys too, nested lists and objects) encodes as UTF-8: a lone
    surrogate ("\\ud800" in JSON) parses but cannot be written, shown or sent anywhere."""
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError:
                return False
        elif isinstance(v, dict):
            stack.extend(v.keys())
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)
    return True


def check_layout(name: str, meta: dict[str, str], kv_dtype: str, kv_layout: str) -> None:
    """The file's K/V element type and layout are the ones this reader restores, or SessionFileError."""
    if meta.get("kv_dtype") != kv_dtype or meta.get("kv_layout") != kv_layout:
        raise SessionFileError(f"{name}: incompatible K/V layout ({meta.get('kv_dtype', '?')[:20]}, "
                               f"{meta.get('kv_layout', '?')[:60]})")


def token_count(name: str, meta: dict[str, str], n_ctx: int) -> int:
    """The header's token count, checked before anything is sized from it: 1 to n_ctx - 1."""
    nt = meta.get("n_tokens", "")
    if not re.fullmatch(r"[0-9]{1,10}", nt):
        raise SessionFileError(f"{name} is corrupted (bad token count {nt[:20]!r})")
    n = int(nt)
    if n < 1:
        raise SessionFileError(f"{name} holds no tokens")
    if n >= n_ctx:
        raise SessionFileError(f"{name} holds {n} tokens; the context holds {n_ctx} (a longer --ctx may restore it)")
    return n


def parse_header(name: str, raw: bytes, size: int, g: Geometry, expected: dict | None = None, *,
                 layout: Callable[[int, Geometry], list[TensorSpec]], kv_layout: str) -> ParsedHeader:
    """Validate a format-2 raw header completely (type and range of every field) before anything is
    allocated; `layout(n, g)` is the one tensor table its format allows, `kv_layout` its layout name."""
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
    check_layout(name, meta, g.kv, kv_layout)
    n = token_count(name, meta, g.n_ctx)
    specs = layout(n, g)
    messages = check_table_and_tail(name, table, specs, raw, size, meta,
                                    f"{n} tokens of {g.n_layer} layers x {g.n_kv_heads} K/V heads x {g.head_dim} {g.kv}")
    return ParsedHeader(n, specs, meta, messages, raw, 8 + len(raw))


def check_table_and_tail(name: str, table: dict, specs: list, raw: bytes, size: int, meta: dict, what: str) -> list:
    """Both formats' last header checks: the tensor table is exactly `specs` (in order), the file's size
    is the header's plus the data's, and the messages parse and validate. Returns the messages."""
    if table != {s.name: s.as_json() for s in specs} or list(table) != [s.name for s in specs]:
        raise SessionFileError(f"{name} is corrupted (its tensor table does not match {what})")
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
    return messages


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
        saved, loaded = _model_label(fp.get("model")), _model_label(expected.get("model"))
        raise SessionFileError(f"{name} was saved with another model ({saved}content "
                               f"{str(fp.get('model_hash'))[:12]}, loaded model {loaded}"
                               f"{expected['model_hash'][:12]})")
    if fp.get("tokenizer") != expected["tokenizer"] or fp.get("chat_template") != expected["chat_template"]:
        raise SessionFileError(f"{name} was saved with another tokenizer or chat template")
    theirs, ours = fp.get("kv_format", KV_DTYPE), str(expected.get("kv_format", KV_DTYPE))
    if theirs != ours:
        # Refused, not converted: widening 8-bit codes or re-quantizing them would give a K/V that
        # no engine run produced.
        fmt = format_of_label(theirs)
        if fmt is None:
            raise SessionFileError(f"{name} holds {describe_label(theirs[:20])}; this engine runs "
                                   f"{describe_label(ours)}")
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


def _model_label(name) -> str:
    """A fingerprint's model name as the start of a refusal's parenthesis ('' when it has none: older
    files), one line and bounded (a file's metadata is untrusted)."""
    if not isinstance(name, str) or not name:
        return ""
    return " ".join(name.split())[:80] + ", "


def _steer_label(fp) -> str:
    return "no control vector" if fp in (None, "none", "") else f"control vector {str(fp)[:12]}"


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


def check_memory(name: str, n: int, need: int, admit) -> None:
    """Before any K/V is allocated: the memory guard's word on the `need` bytes a restore will hold."""
    if admit is not None:
        ok, why = admit(need)
        if not ok:
            raise SessionFileError(f"{name} was not restored: its {n} tokens need "
                                   f"{need / (1 << 20):.1f} MiB of K/V memory and the memory guard says no "
                                   f"({why})")


def check_read(name: str, raw: bytes, digest, tokens: np.ndarray, n_vocab: int, image_span: int = 0) -> None:
    """Once every byte is read: the header's checksum against them, then every token id against
    the vocabulary or, `image_span` > 0 (a projector loaded), as an image span of that many tokens
    (16-bit and quantized restores alike)."""
    if digest.hexdigest().encode() != raw[len(_PREFIX):len(_PREFIX) + _HEX]:
        raise SessionFileError(f"{name} is corrupted (checksum mismatch)")
    bad = outside_vocab(tokens, n_vocab, image_span)
    if bad is not None:
        raise SessionFileError(f"{name} is corrupted (token id {bad} is outside the vocabulary of {n_vocab})")


def restored(tokens: np.ndarray, cache: list, key: str, hdr, size: int, ms: float, prof) -> tuple:
    """The restored entry and the result fields both restores report."""
    entry = KVEntry(tokens.tolist(), cache, key, messages=hdr.messages)
    return entry, {"restored_tokens": len(tokens), "restore_ms": round(ms, 2), "messages": hdr.messages,
                   "session_bytes": size, "profile": asdict(prof)}
