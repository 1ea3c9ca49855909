"""The disk tier's file format (engine/disk/disk_tier.py): one file per conversation, a run of append-only
segments, each checksummed on its own.

A segment holds the K/V of the tokens a turn added (tokens [start, start + n)):

    64-byte fixed part   magic "STRKVSG1", version (u32), JSON length (u32), n tokens (u32),
                         K/V length (u64), head digest (16), K/V digest (16), 4 zero bytes
    JSON                 key, fingerprint (engine/handlers.py session_fingerprint), start, owner, messages,
                         conv (the conversation's id: its file's name) and prefix (xxh3-128 of the
                         conversation's token ids [0, start + n), int32): what a read checks against
                         the index entry and the prompt it resumes, so a file swapped, replaced or
                         linked in while the engine runs never lends another conversation's K/V
    tokens               int32, n
    K/V                  the session file's tensor table (engine/session_files/sessions.py `layout`) for n tokens,
                         minus its `tokens`: per layer K then V (1, kv_heads, n, head_dim) in the cache's
                         own precision (`store`: float32 on the CPU, float16 on a GPU: a restore gives
                         back exactly the K/V the engine held, so a reply continues as it would have),
                         or the 8/4-bit codes, scales and biases as held (engine/session_files/session_quant.py)

Version 3 (full K/V; 1 before the conv and prefix fields, dropped with a log line) and version 4
(engine/disk/disk_states.py; 2 before them): a conversation whose cache has a sliding window or a recurrent
state (Gemma 3/4, gpt-oss, OLMo 3, Qwen3.5). The fixed part is followed by 24 more bytes (the state
region's length, u64, and its digest, 16); the JSON names every layer (`layers`: kind, tensor dtypes
and shapes, a window's size); the K/V region holds, per layer in order, the full K/V layers' tensors
for the segment's n tokens (as held: float32 on the CPU, float16/bfloat16 on a GPU, 8/4-bit codes,
scales and biases) and each window layer's K/V for the segment's last min(n, window) tokens (older
ones are never attended again); then the state region: each recurrent layer's whole state after the
segment's last token. A segment's end is a message boundary, restorable on its own: the full layers
from every segment up to it, the window from the tails of the segments before it, the state from it.

The head digest (xxh3-128) covers the fixed part (digests read as zeros), the JSON and the tokens; the
K/V digest covers the K/V (version 4's state region has its own digest). So a scan reads only the small parts and checks them; a restore checks the
K/V it reads. A torn segment (a write cut by a kill or a power cut: short, or its digest wrong) ends
the conversation's valid run: it falls back to its last whole segment. Every field is checked for
type and range before anything is allocated (a hostile cache folder costs a log line, never the engine).
"""
from __future__ import annotations

import errno
import json
import os
import stat
import struct
from dataclasses import dataclass

import numpy as np
import xxhash
from concurrent.futures import ThreadPoolExecutor

from engine.session_files.sessions import Geometry, TensorSpec, layout, pread_exact, validate_messages
from engine.cache.kv_format import format_of_label

MAGIC = b"STRKVSG1"
VERSION = 3                        # full K/V only
VERSION_STATES = 4                 # windows and recurrent states (engine/disk/disk_states.py)
# Versions 1 and 2 lack the conv and prefix fields: dropped with a log line, never read (their K/V
# cannot be told apart from another conversation's once a file is swapped).
OLD_VERSIONS = (1, 2)
MAX_CONV = 64                      # a conversation id (disk_tier names files with 16 hex digits)
SUFFIX = ".kvseg"
_FIXED = struct.Struct("<8sIIIQ16s16s4x")      # 64 bytes
FIXED_BYTES = _FIXED.size
_STATE = struct.Struct("<Q16s")                # version 4: the state region's length and digest
FIXED_STATES_BYTES = FIXED_BYTES + _STATE.size
MAX_JSON = 16 << 20                # fingerprint and messages: far below this
MAX_TOKENS = 1 << 22               # per segment (a context is far below)
_NP = {"I32": np.dtype("<i4"), "F16": np.dtype("<f2"), "U32": np.dtype("<u4"), "F32": np.dtype("<f4"),
       "BF16": np.dtype("<u2")}          # bfloat16 as its bits (version 4 stores tensors as held)
STORES = ("float16", "float32")    # how 16-bit-format K/V is stored (the cache's own dtype)
_ZERO16 = b"\0" * 16
_FP_INTS = {"n_layer": 4096, "n_kv_heads": 4096, "head_dim": 65536}


class SegmentError(Exception):
    """A segment that is not whole or not ours; the message is one line."""


def prefix_hash(tokens) -> str:
    """The `prefix` field: xxh3-128 (hex) of token ids as little-endian int32."""
    return xxhash.xxh3_128(np.ascontiguousarray(tokens, dtype="<i4")).hexdigest()


_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0) | os.O_NONBLOCK


def open_file(path, write: bool = False) -> int:
    """An fd for a cache file that is a regular file itself: a symbolic link is refused, not followed
    (O_NOFOLLOW; it could lend another conversation's file or write through to anything), and so is a
    FIFO, socket or device (O_NONBLOCK: the open never waits for a FIFO's other end). OSError, one line."""
    flags = (os.O_RDWR | os.O_CREAT) if write else os.O_RDONLY
    try:
        fd = os.open(path, flags | _NOFOLLOW, 0o600)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise OSError(f"{os.path.basename(path)} is a symbolic link, not a cache file") from None
        raise
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(f"{os.path.basename(path)} is not a regular file")
    except BaseException:
        os.close(fd)
        raise
    return fd


def _valid_conv(conv) -> bool:
    return isinstance(conv, str) and 0 < len(conv) <= MAX_CONV and conv.isascii() and conv.isalnum()


@dataclass
class Segment:
    offset: int            # of its fixed part in the file
    end: int               # byte after its K/V
    start: int             # first token index
    tokens: np.ndarray     # int32 (n,)
    meta: dict             # key, fp, start, owner, messages
    kv_offset: int
    kv_len: int
    kv_digest: bytes
    version: int = VERSION
    state_offset: int = 0  # version 4: the state region (recurrent layers' state after the last token)
    state_len: int = 0
    state_digest: bytes = b""

    @property
    def n(self) -> int:
        return len(self.tokens)


def geometry(fp: dict, n_vocab: int = 1 << 31, n_ctx: int = 1 << 31) -> Geometry:
    """The K/V geometry a fingerprint names, checked for type and range (SegmentError)."""
    for k, hi in _FP_INTS.items():
        v = fp.get(k)
        if not isinstance(v, str) or not v.isdigit() or not 1 <= int(v) <= hi:
            raise SegmentError(f"bad {k} {str(v)[:20]!r}")
    if format_of_label(fp.get("kv_format")) is None:
        raise SegmentError(f"bad K/V format {str(fp.get('kv_format'))[:20]!r}")
    return Geometry.of(fp, n_vocab, n_ctx)


def kv_specs(n: int, g: Geometry, store: str = "float16") -> list[TensorSpec]:
    """The K/V tensors of n tokens, offsets from the start of the segment's K/V."""
    specs = layout(n, g)[1:]
    out, off = [], 0
    for s in specs:
        wide = store == "float32" and s.dtype == "F16" and g.kv == "float16"
        size = (s.end - s.start) * (2 if wide else 1)
        out.append(TensorSpec(s.name, "F32" if wide else s.dtype, s.shape, off, off + size))
        off += size
    return out


def kv_bytes(n: int, g: Geometry, store: str = "float16") -> int:
    specs = kv_specs(n, g, store)
    return specs[-1].end if specs else 0


def header_json(meta: dict) -> bytes:
    return json.dumps(meta, separators=(",", ":"), ensure_ascii=False).encode()


# ---- version 4: the layer list and its tensors -------------------------------------------------------
LAYER_KINDS = ("kv", "kv_quant", "rotating", "arrays")
PER_TOKEN = ("kv", "kv_quant")            # every token's K/V kept (the tails of `rotating`: the window's)
_LAYER_KEYS = {"kv": {"kind", "t"}, "kv_quant": {"kind", "t", "group", "bits"},
               "rotating": {"kind", "t", "max_size", "keep"}, "arrays": {"kind", "t"}}
MAX_STATE_TENSOR = 1 << 34


def _int(v, lo: int, hi: int) -> bool:
    return type(v) is int and lo <= v <= hi


def check_layers(layers) -> list:
    """A version-4 header's layer list, checked for type and range (SegmentError): each layer
    {"kind", "t": [[dtype, B, heads, width], ...] (arrays: [dtype, *shape] or null per slot), and a
    window's max_size/keep or quantized K/V's group/bits}."""
    if not isinstance(layers, list) or not 0 < len(layers) <= 4096:
        raise SegmentError("bad layer list")
    for i, d in enumerate(layers):
        if not isinstance(d, dict) or d.get("kind") not in LAYER_KINDS or set(d) != _LAYER_KEYS[d["kind"]]:
            raise SegmentError(f"bad layer {i}")
        kind, t = d["kind"], d["t"]
        if not isinstance(t, list) or not 0 < len(t) <= 6:
            raise SegmentError(f"bad layer {i}")
        if kind == "rotating" and not (_int(d["max_size"], 1, 1 << 24) and d["keep"] == 0):
            raise SegmentError(f"bad window in layer {i}")
        if kind == "kv_quant" and not (_int(d["group"], 1, 4096) and _int(d["bits"], 1, 16)):
            raise SegmentError(f"bad quantization in layer {i}")
        for x in t:
            if x is None and kind == "arrays":
                continue
            if not isinstance(x, list) or not x or x[0] not in _NP or x[0] == "I32":
                raise SegmentError(f"bad tensor in layer {i}")
            dims = x[1:]
            if (kind != "arrays" and len(dims) != 3) or not 1 <= len(dims) <= 6 \
                    or not all(_int(v, 1, 1 << 20) for v in dims):
                raise SegmentError(f"bad tensor shape in layer {i}")
            if kind == "arrays" and int(np.prod(dims)) * _NP[x[0]].itemsize > MAX_STATE_TENSOR:
                raise SegmentError(f"bad tensor shape in layer {i}")
        if kind == "arrays" and all(x is None for x in t):
            raise SegmentError(f"bad layer {i} (no state)")
    return layers


def layer_specs(layers: list, n: int) -> tuple[list[TensorSpec], list[TensorSpec]]:
    """(the K/V region's tensors for a segment of n tokens, the state region's), offsets from each
    region's start: L<i>.<j> (1, heads, n or min(n, window), width) per full/window layer, S<i>.<j>
    each recurrent layer's present state tensors."""
    kv, st, a, b = [], [], 0, 0
    for i, d in enumerate(layers):
        kind = d["kind"]
        for j, x in enumerate(d["t"]):
            if x is None:
                continue
            dt = x[0]
            if kind == "arrays":
                shape = tuple(x[1:])
                size = int(np.prod(shape)) * _NP[dt].itemsize
                st.append(TensorSpec(f"S{i}.{j}", dt, shape, b, b + size))
                b += size
            else:
                t = n if kind in PER_TOKEN else min(n, d["max_size"])
                shape = (x[1], x[2], t, x[3])
                size = x[1] * x[2] * t * x[3] * _NP[dt].itemsize
                kv.append(TensorSpec(f"L{i}.{j}", dt, shape, a, a + size))
                a += size
    return kv, st


def region_bytes(specs: list[TensorSpec]) -> int:
    return specs[-1].end if specs else 0


def segment_bytes_states(json_len: int, n: int, layers: list) -> int:
    kv, st = layer_specs(layers, n)
    return FIXED_STATES_BYTES + json_len + 4 * n + region_bytes(kv) + region_bytes(st)


def encode_states(meta_json: bytes, tokens: np.ndarray, kv: list[np.ndarray], state: list[np.ndarray]) -> list:
    """A version-4 segment's pieces in file order (digests computed here: the writer thread calls it)."""
    return _encode(VERSION_STATES, meta_json, tokens, kv, state)


def read_region(fd: int, offset: int, specs: list[TensorSpec], digest: bytes, what: str) -> list[np.ndarray]:
    """A region's tensors (numpy, as stored), its digest checked (SegmentError: short or wrong)."""
    size = region_bytes(specs)
    buf = np.empty(size, np.uint8)
    view, a = memoryview(buf), 0
    while a < size:
        k = os.preadv(fd, [view[a:]], offset + a)
        if k <= 0:
            raise SegmentError(f"torn {what} at byte {offset}")
        a += k
    if xxhash.xxh3_128(buf).digest() != digest:
        raise SegmentError(f"{what} checksum mismatch at byte {offset}")
    return [buf[s.start:s.end].view(_NP[s.dtype]).reshape(s.shape) for s in specs]


def segment_bytes(json_len: int, n: int, g: Geometry, store: str = "float16") -> int:
    return FIXED_BYTES + json_len + 4 * n + kv_bytes(n, g, store)


def encode(meta_json: bytes, tokens: np.ndarray, kv: list[np.ndarray]) -> list:
    """The segment's pieces in file order (the digests computed here: a writer thread calls it)."""
    return _encode(VERSION, meta_json, tokens, kv, None)


def _encode(version: int, meta_json: bytes, tokens: np.ndarray, kv: list[np.ndarray], state: list | None) -> list:
    """Version 3: fixed part, JSON, tokens, K/V. Version 4: the fixed part's state extension after it,
    and the state region (its own digest) after the K/V."""
    tokens = np.ascontiguousarray(tokens, dtype="<i4")
    kv_digest, state_digest = xxhash.xxh3_128(), xxhash.xxh3_128()
    kv_len = state_len = 0
    for a in kv:
        kv_digest.update(a)
        kv_len += a.nbytes
    for a in state or ():
        state_digest.update(a)
        state_len += a.nbytes
    fixed = _FIXED.pack(MAGIC, version, len(meta_json), len(tokens), kv_len, _ZERO16, _ZERO16)
    head = xxhash.xxh3_128()
    head.update(fixed)
    if state is not None:
        head.update(_STATE.pack(state_len, _ZERO16))
    head.update(meta_json)
    head.update(tokens)
    fixed = _FIXED.pack(MAGIC, version, len(meta_json), len(tokens), kv_len, head.digest(), kv_digest.digest())
    if state is None:
        return [fixed, meta_json, tokens, *kv]
    return [fixed, _STATE.pack(state_len, state_digest.digest()), meta_json, tokens, *kv, *state]


def _check_meta(meta, start: int, first: dict | None, version: int = VERSION) -> dict:
    if not isinstance(meta, dict):
        raise SegmentError("its header is not an object")
    key, fp, owner = meta.get("key"), meta.get("fp"), meta.get("owner", "")
    if not isinstance(key, str) or not 0 < len(key) < 4096:
        raise SegmentError("bad key")
    if not _valid_conv(meta.get("conv")):
        raise SegmentError("bad conversation id")
    if not isinstance(meta.get("prefix"), str) or len(meta["prefix"]) != 32:
        raise SegmentError("bad token hash")
    if not isinstance(owner, str) or len(owner) > 4096:
        raise SegmentError("bad owner")
    if not isinstance(fp, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in fp.items()):
        raise SegmentError("bad fingerprint")
    if meta.get("store", "float16") not in STORES:
        raise SegmentError("bad K/V precision")
    if meta.get("start") != start or type(meta.get("start")) is not int:
        raise SegmentError(f"starts at token {str(meta.get('start'))[:20]}, expected {start}")
    why = validate_messages(meta.get("messages", []))
    if why:
        raise SegmentError(why)
    if first is not None and (key != first["key"] or fp != first["fp"]):
        raise SegmentError("its key differs from the first segment's")
    if first is not None and meta["conv"] != first["conv"]:
        raise SegmentError("another conversation's segment")
    if version == VERSION_STATES:
        check_layers(meta.get("layers"))
        if first is not None and meta["layers"] != first.get("layers"):
            raise SegmentError("its layers differ from the first segment's")
    elif "layers" in meta:
        raise SegmentError("a layer list in a version-3 segment")
    return meta


def scan(fd: int, size: int) -> tuple[list[Segment], str | None]:
    """The file's whole segments in order (head digests checked; K/V digests are checked when read),
    and why the run ended early (None: it ran to the end of the file). Every segment of a file has
    the first one's version."""
    segs: list[Segment] = []
    off, start, first = 0, 0, None
    running = xxhash.xxh3_128()          # the token ids so far: each segment's `prefix` is checked on it
    while off < size:
        try:
            if size - off < FIXED_BYTES:
                raise SegmentError(f"torn at byte {off} ({size - off} bytes of a segment)")
            raw = pread_exact(fd, FIXED_BYTES, off)
            magic, version, jlen, n, kv_len, hd, kd = _FIXED.unpack(raw)
            if magic != MAGIC:
                raise SegmentError(f"not a segment at byte {off}")
            if version in OLD_VERSIONS:
                raise SegmentError(f"segment version {version}, written by an older Strata (this one reads "
                                   f"{VERSION} and {VERSION_STATES})")
            if version not in (VERSION, VERSION_STATES) or (segs and version != segs[0].version):
                raise SegmentError(f"segment version {version} (this Strata reads {VERSION} and {VERSION_STATES})")
            if not 0 < jlen <= MAX_JSON or not 0 < n <= MAX_TOKENS:
                raise SegmentError(f"bad lengths at byte {off}")
            state_len, sd, fixed_len = 0, b"", FIXED_BYTES
            if version == VERSION_STATES:
                if size - off < FIXED_STATES_BYTES:
                    raise SegmentError(f"torn at byte {off} ({size - off} bytes of a segment)")
                state_len, sd = _STATE.unpack(pread_exact(fd, _STATE.size, off + FIXED_BYTES))
                fixed_len = FIXED_STATES_BYTES
            end = off + fixed_len + jlen + 4 * n + kv_len + state_len
            if end > size:
                raise SegmentError(f"torn at byte {off} (needs {end - size} more bytes)")
            body = pread_exact(fd, jlen + 4 * n, off + fixed_len)
            head = xxhash.xxh3_128()
            head.update(_FIXED.pack(magic, version, jlen, n, kv_len, _ZERO16, _ZERO16))
            if version == VERSION_STATES:
                head.update(_STATE.pack(state_len, _ZERO16))
            head.update(body)
            if head.digest() != hd:
                raise SegmentError(f"checksum mismatch at byte {off}")
            try:
                meta = json.loads(body[:jlen])
            except (ValueError, UnicodeDecodeError, RecursionError):
                raise SegmentError("unreadable header") from None
            meta = _check_meta(meta, start, first, version)
            g = geometry(meta["fp"])
            if version == VERSION_STATES:
                kv_s, st_s = layer_specs(meta["layers"], n)
                if kv_len != region_bytes(kv_s) or state_len != region_bytes(st_s):
                    raise SegmentError(f"K/V length {kv_len} does not match {n} tokens")
            elif kv_len != kv_bytes(n, g, meta.get("store", "float16")):
                raise SegmentError(f"K/V length {kv_len} does not match {n} tokens")
            tokens = np.frombuffer(body[jlen:], dtype="<i4").copy()
            running.update(tokens)
            if running.hexdigest() != meta["prefix"]:
                raise SegmentError(f"the token hash at byte {off} does not match the tokens before it")
            kv_off = off + fixed_len + jlen + 4 * n
            segs.append(Segment(off, end, start, tokens, meta, kv_off, kv_len, kd, version,
                                kv_off + kv_len, state_len, sd))
            first = first or meta
            off, start = end, start + n
        except SegmentError as e:
            return segs, str(e)
    return segs, None


READ_THREADS = 4
READ_MIN_PIECE = 8 << 20
_pool = None


def _readers():
    global _pool
    if _pool is None:
        _pool = ThreadPoolExecutor(READ_THREADS, thread_name_prefix="disk-tier-read")
    return _pool


def read_kv(fd: int, seg: Segment, g: Geometry) -> list[np.ndarray]:
    """The segment's K/V tensors (numpy, file layout), its digest checked (SegmentError)."""
    parts, check = read_kv_unchecked(fd, seg, g)
    check()
    return parts


RING_BUFFERS = 6         # host buffers in flight on a streamed read (read, hashed, handed on)


def read_kv_streamed(fd: int, seg: Segment, g: Geometry, keep: int, send) -> None:
    """The segment's K/V tensors, each cut to its first `keep` tokens, handed to `send(host_array)` in
    file order on this thread as they arrive; raises SegmentError when the file is short or its digest is
    wrong, which it knows only at the end: nothing `send` made may be used before this returns.

    The session restore's scheme (engine/session_files/sessions.py `_read_to_device`): reader threads fill a small
    ring of reused host buffers a tensor at a time, one thread hashes them in file order (xxh3 is a
    stream, so the digest is the whole K/V's), and the caller's upload of tensor k overlaps the reads of
    the next ones. A single buffer for the whole segment (264 MB at 8,000 tokens of Llama-1B) cost its
    page faults and serialized the read before the upload (bench/gpu.md)."""
    specs = kv_specs(seg.n, g, seg.meta.get("store", "float16"))
    if not specs:
        return
    size = max(s.end - s.start for s in specs)
    ring = [np.empty(size, np.uint8) for _ in range(min(RING_BUFFERS, len(specs)))]
    digest = xxhash.xxh3_128()

    def read(k: int) -> bool:
        s, view = specs[k], memoryview(ring[k % len(ring)])
        a, b = 0, s.end - s.start
        while a < b:
            n = os.preadv(fd, [view[a:b]], seg.kv_offset + s.start + a)
            if n <= 0:
                return False
            a += n
        return True

    def hash_after(k: int, got) -> bool:
        if not got.result():
            return False
        digest.update(memoryview(ring[k % len(ring)])[:specs[k].end - specs[k].start])
        return True

    with ThreadPoolExecutor(1, thread_name_prefix="disk-tier-hash") as hasher:
        reads: dict = {}
        hashes: dict = {}

        def start(k: int) -> None:
            reads[k] = _readers().submit(read, k)
            hashes[k] = hasher.submit(hash_after, k, reads[k])       # FIFO: file order
        for k in range(len(ring)):
            start(k)
        try:
            for k, s in enumerate(specs):
                if not reads.pop(k).result():
                    raise SegmentError(f"torn K/V at byte {seg.offset}")
                a = ring[k % len(ring)][:s.end - s.start].view(_NP[s.dtype]).reshape(s.shape)
                send(a if keep >= seg.n else np.ascontiguousarray(a[:, :, :keep, :]))
                if not hashes.pop(k).result():
                    raise SegmentError(f"torn K/V at byte {seg.offset}")
                if k + len(ring) < len(specs):
                    start(k + len(ring))                       # its buffer is hashed and handed on
        finally:
            for f in (*reads.values(), *hashes.values()):
                f.cancel() or f.exception()                    # never leave a read running on a closed fd
    if digest.digest() != seg.kv_digest:
        raise SegmentError(f"K/V checksum mismatch in the segment at byte {seg.offset}")


def read_kv_unchecked(fd: int, seg: Segment, g: Geometry):
    """(the segment's K/V tensors, check): `check()` raises SegmentError unless their digest matches.
    The digest is computed on a reader thread meanwhile, so a restore sends the tensors to the device
    while it runs (xxh3 over 264 MB takes ~20 ms); nothing may be used before check() returns."""
    specs = kv_specs(seg.n, g, seg.meta.get("store", "float16"))
    buf = np.empty(seg.kv_len, np.uint8)
    view = memoryview(buf)
    # A large segment is read in pieces on READ_THREADS threads (os.preadv releases the GIL): one thread
    # reads the page cache at a few GB/s, a restore's budget at 8,000 tokens of Llama-1B is ~100 ms.
    k = min(READ_THREADS, seg.kv_len // READ_MIN_PIECE) or 1
    cuts = [seg.kv_len * i // k for i in range(k + 1)]

    def read(a: int, b: int) -> bool:
        while a < b:
            n = os.preadv(fd, [view[a:b]], seg.kv_offset + a)
            if n <= 0:
                return False
            a += n
        return True
    if k == 1:
        whole = read(0, seg.kv_len)
    else:
        whole = all(_readers().map(lambda i: read(cuts[i], cuts[i + 1]), range(k)))
    if not whole:
        raise SegmentError(f"torn K/V at byte {seg.offset}")
    digest = _readers().submit(lambda: xxhash.xxh3_128(buf).digest())

    def check() -> None:
        if digest.result() != seg.kv_digest:
            raise SegmentError(f"K/V checksum mismatch in the segment at byte {seg.offset}")
    return [buf[s.start:s.end].view(_NP[s.dtype]).reshape(s.shape) for s in specs], check
