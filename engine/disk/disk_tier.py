"""The disk tier under parking: conversations' K/V in the data folder's cache, found automatically.

    RAM (live + parked, engine/cache/parking.py)  --end of a turn, idle / an eviction / stop-->  disk (this module)
    a prompt that extends a conversation on disk (same key, the parking prefix rule)  <--restore--

Files: `<data folder>/cache/conversations/<id>.kvseg`, one per conversation, append-only segments
(engine/disk/disk_segments.py). A turn appends only the tokens it added; a new branch of the same
conversation (Regenerate, Edit: the same owner) cuts the file back to the last segment boundary it
shares and appends from there; a file of more than COMPACT_SEGMENTS segments is rewritten as one by
the writer thread (into a temporary file renamed over it). Bounded by a cap in MiB: the least recently
used files go first. A conversation with a sliding window or a recurrent state is written as segment
version 4 (engine/disk/disk_states.py): a segment per message boundary, each restorable on its own.

Threads: everything here runs on the engine thread except `_Writer`, which owns the files. The engine
thread copies the new tokens' K/V slice to host memory (numpy; float16 for 16-bit K/V, codes as held
for 8/4-bit) in its idle time -- between requests, one layer at a time, abandoned when a request
arrives -- or when parking evicts a conversation, and hands the copy to the writer thread, which
hashes it and writes it (pwritev). Nothing happens on the decode path. The engine thread keeps the
index (tokens, segment boundaries, sizes) and updates it when it queues a write, so it never waits
for the disk except before a restore (the writer's queue drained first) and at stop.

Every read checks what it reads before its K/V is used, not only the scan at start: a segment names
its conversation (the file's id) and a hash of the token ids up to its end, which must match the index
entry, and its token ids must be the prompt's it resumes; a file swapped, replaced or linked in while
the engine runs (another conversation's K/V under this one's name) is dropped with a log line and the
turn reads its prompt afresh. Files are opened without following symbolic links, regular files only.

No fsync: a kill -9 leaves the written pages to the OS; a power cut may tear the last segment, which
its checksum detects (the conversation falls back to its last whole segment). Files are validated
field by field before anything is allocated; a file of another model, steering setting or K/V format
(the key, then the full fingerprint) is never used.
"""
from __future__ import annotations

import logging
import os
import queue
import secrets
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import xxhash
import mlx.core as mx

from engine.cache import kv_format, layer_cache
from engine.disk import disk_segments as ds
from engine.disk import disk_states
from engine.session_files.session_quant import restore_bytes as quant_bytes
from engine.cache.kv_key import KVKey
from engine.cache.parking import MIB, MIN_PREFIX_REUSE, KVEntry, common_prefix
from engine.paths import data_dir, unusable_folder
from engine.text.chat_template import render
from engine.model.device_upload import to_device
from engine.errors import SessionFileError, StrataError
from engine.limits import check_disk_mib
from engine.session_files.session_v3 import probe as cache_probe
from engine.session_files.sessions import check_fingerprint, check_memory, padded_cells, restore_bytes
from engine.text.image_tokens import has_image_parts, outside_vocab

COMPACT_SEGMENTS = 16      # more segments than this: rewritten as one when the writer is idle
MIN_TOKENS = MIN_PREFIX_REUSE


@dataclass
class DiskEntry:
    id: str
    path: Path
    key: KVKey
    owner: str
    fp: dict
    tokens: list[int]
    bounds: list[tuple[int, int]]          # (token end, byte end) of each segment, as queued
    messages: list = field(default_factory=list)
    last_used: float = 0.0
    # segment version 4 (engine/disk/disk_states.py: a window or a recurrent state): its layer list; None for
    # full K/V
    layers: list | None = None

    _texts: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def size(self) -> int:
        return self.bounds[-1][1] if self.bounds else 0

    def text(self, tokenizer, skip: int = 0) -> str:
        """decode(tokens[skip:]) as KVEntry.text gives it (kept until the tokens change): a follow-up
        after a restart keeps this conversation's own token ids (Conversations.continue_tokens)."""
        held = self._texts.get(skip)
        if held is None or held[0] is not self.tokens:
            held = (self.tokens, tokenizer.decode(self.tokens[skip:], skip_special=False))
            self._texts[skip] = held
        return held[1]


@dataclass
class WriteStats:
    """What the last write put on disk against the file it went to (bench/cache.py reports it)."""
    tokens: int = 0
    bytes: int = 0
    file_bytes: int = 0
    kind: str = ""           # append | rewrite | compact
    total_bytes: int = 0     # written since start
    state_bytes: int = 0     # of `bytes`: windows' K/V and recurrent states at boundaries (version 4)
    segments: int = 0        # segments the last write appended (version 4: one per message boundary)


class _Writer(threading.Thread):
    """The one thread that writes, compacts and deletes cache files, in the order queued."""

    def __init__(self, log: Callable[[str], None], failed: set, lock: threading.Lock):
        super().__init__(name="strata-disk-writer", daemon=True)
        self.q: queue.Queue = queue.Queue()
        self.log, self.failed, self.lock = log, failed, lock

    def run(self) -> None:
        while True:
            job = self.q.get()
            try:
                if job is None:
                    return
                job()
            except Exception as e:  # noqa: BLE001 - a failed write drops that conversation, nothing else
                eid = getattr(job, "entry_id", "")
                with self.lock:
                    self.failed.add(eid)
                self.log(f"disk cache: {getattr(job, 'what', 'a job')} failed ({type(e).__name__}: {str(e)[:160]})")
            finally:
                self.q.task_done()


class DiskTier:
    def __init__(self, folder: Path, cap_mib: int, log: Callable[[str], None]):
        self.folder = Path(folder)
        self.cap_bytes = max(0, int(cap_mib)) * MIB
        self.log = log
        self.entries: dict[str, DiskEntry] = {}
        self.stats = WriteStats()
        self._failed: set[str] = set()
        self._lock = threading.Lock()
        self._writer: _Writer | None = None
        # The loaded model's context (use_model): fingerprint of a key, dtype, vocabulary, context, guard
        self._fp_of: Callable[[KVKey], dict | None] = lambda key: None
        self._model: Callable[[], tuple] = lambda: (None, 1 << 31, 1 << 31, None)
        # this model's cache after one token (session_v3.probe): what a version-4 file's layers must be
        self._probe: Callable[[], list] = lambda: []
        # how much of a conversation its next turn's prompt shares (None: unknown): disk_states.boundaries
        self._next_shares: Callable[[KVEntry], int | None] = lambda entry: None

    # ---- set-up ---------------------------------------------------------------------------------
    @property
    def enabled(self) -> bool:
        return self.cap_bytes > 0

    def use_model(self, fp_of: Callable[[KVKey], dict | None], model: Callable[[], tuple],
                  probe: Callable[[], list] | None = None,
                  next_shares: Callable[[KVEntry], int | None] | None = None) -> None:
        """`fp_of(key)`: the fingerprint K/V of that key must have (None: not the loaded model's);
        `model()`: (compute dtype, vocabulary size, context length, the memory guard's admit);
        `probe()`: the loaded model's cache after one token (version-4 files' layers are checked on it)."""
        self._fp_of, self._model = fp_of, model
        if probe is not None:
            self._probe = probe
        if next_shares is not None:
            self._next_shares = next_shares

    @staticmethod
    def _open(p: Path) -> int:
        return _open_regular(p)

    @property
    def _dtype(self):
        return self._model()[0]

    @property
    def _n_vocab(self) -> int:
        return self._model()[1]

    @property
    def _n_ctx(self) -> int:
        return self._model()[2]

    @property
    def _admit(self):
        return self._model()[3]

    @property
    def _image_span(self) -> int:
        m = self._model()
        return m[4] if len(m) > 4 else 0

    def _start_writer(self) -> _Writer:
        if self._writer is None or not self._writer.is_alive():
            self._writer = _Writer(self.log, self._failed, self._lock)
            self._writer.start()
        return self._writer

    def _queue(self, job) -> None:
        self._start_writer().q.put(job)

    def flush(self) -> None:
        """Wait until every queued write is on disk (before a restore, at stop; tests)."""
        if self._writer is not None and self._writer.is_alive():
            self._writer.q.join()

    def close(self) -> None:
        self.flush()
        if self._writer is not None and self._writer.is_alive():
            self._writer.q.put(None)
            self._writer.join(10)
        self._writer = None

    def scan(self) -> None:
        """Index the folder: each file's whole segments (head checksums checked, K/V checked at restore).
        A file with no whole segment is dropped (one log line); a torn tail is cut at the next write."""
        self.entries.clear()
        if not self.enabled or not self.folder.is_dir():
            return
        for p in sorted(self.folder.iterdir()):
            if p.name.startswith(".") and p.name.endswith(".tmp"):
                _unlink(p)                              # a compaction killed midway
                continue
            if p.suffix != ds.SUFFIX:
                continue
            e = self._scan_file(p)
            if e is not None:
                self.entries[e.id] = e
        self._evict_until(0)
        if self.entries:
            self.log(f"disk cache: {len(self.entries)} conversations, {self.used_bytes() / MIB:.1f} MiB "
                     f"of {self.cap_bytes / MIB:.0f} MiB in {self.folder}")

    def _scan_file(self, p: Path) -> DiskEntry | None:
        try:
            fd = _open_regular(p)
        except OSError as e:
            self.log(f"disk cache: {p.name} dropped ({e.strerror or e})")
            return None
        try:
            st = os.fstat(fd)
            segs, why = ds.scan(fd, st.st_size)
        except OSError as e:
            segs, why = [], f"unreadable ({e.strerror or e})"
        finally:
            os.close(fd)
        if not segs:
            self.log(f"disk cache: {p.name} dropped ({why or 'empty'})")
            _unlink(p)
            return None
        if why:
            self.log(f"disk cache: {p.name}: {why}; falling back to its last whole segment "
                     f"({segs[-1].start + segs[-1].n} tokens)")
        first, last = segs[0].meta, segs[-1].meta
        if first["conv"] != p.stem:
            self.log(f"disk cache: {p.name} dropped (it holds another conversation's segments)")
            _unlink(p)
            return None
        tokens = np.concatenate([s.tokens for s in segs]).tolist()
        key = KVKey.parse(first["key"])          # the text form the header holds (str(KVKey))
        if key is None:
            self.log(f"disk cache: {p.name} dropped (its K/V key is not one)")
            _unlink(p)
            return None
        layers = first.get("layers") if segs[0].version == ds.VERSION_STATES else None
        return DiskEntry(p.stem, p, key, last.get("owner", ""), first["fp"], tokens,
                         [(s.start + s.n, s.end) for s in segs], last.get("messages", []), st.st_mtime,
                         layers=layers)

    # ---- figures ---------------------------------------------------------------------------------
    def used_bytes(self) -> int:
        return sum(e.size for e in self.entries.values())

    def status(self) -> dict:
        return {"enabled": self.enabled, "entries": len(self.entries), "bytes": self.used_bytes(),
                "cap_bytes": self.cap_bytes, "folder": str(self.folder),
                "last_write": {"tokens": self.stats.tokens, "bytes": self.stats.bytes,
                               "file_bytes": self.stats.file_bytes, "kind": self.stats.kind,
                               "state_bytes": self.stats.state_bytes, "segments": self.stats.segments},
                "written_bytes": self.stats.total_bytes}

    def set_cap(self, cap_mib: int) -> None:
        """0 turns the tier off: nothing is read or written (the files stay until Clear, or until it is
        turned on again and they are indexed anew)."""
        was = self.enabled
        self.cap_bytes = max(0, int(cap_mib)) * MIB
        if self.enabled and not was:
            unusable = unusable_folder(self.folder)
            if unusable:
                self.log(f"disk cache: stays off: {unusable}")
                self.cap_bytes = 0
        if not self.enabled:
            self.flush()
            self.entries.clear()
        elif not was:
            self.scan()
        else:
            self._evict_until(0)

    # ---- removal ---------------------------------------------------------------------------------
    def _remove(self, e: DiskEntry, why: str) -> None:
        self.entries.pop(e.id, None)
        path = e.path
        job = lambda: _unlink(path)      # noqa: E731
        job.what, job.entry_id = f"removing {path.name}", e.id
        self._queue(job)
        if why:
            self.log(f"disk cache: removed {len(e.tokens)} tokens ({e.size / MIB:.1f} MiB) for {why}")

    def drop(self, e: DiskEntry, why: str) -> None:
        """A cached conversation that fails when used: removed, with a log line."""
        self.log(f"disk cache: dropped {e.path.name} ({len(e.tokens)} tokens): {why}")
        self._remove(e, "")

    def clear(self) -> int:
        """Every cached conversation removed (the settings page's Clear): the bytes freed."""
        freed = self.used_bytes()
        for e in list(self.entries.values()):
            self._remove(e, "")
        self.flush()
        if self.folder.is_dir():        # files not indexed (another model's are indexed too): ours by name
            for p in self.folder.iterdir():
                if p.suffix == ds.SUFFIX or p.name.endswith(".tmp"):
                    _unlink(p)
        self.log(f"disk cache: cleared ({freed / MIB:.1f} MiB)")
        return freed

    def forget(self, owner: str) -> int:
        """A deleted chat: its cached conversations removed. The number removed."""
        gone = [e for e in self.entries.values() if owner and e.owner == owner]
        for e in gone:
            self._remove(e, f"its chat ({owner}) was deleted")
        return len(gone)

    def _evict_until(self, incoming: int, keep: DiskEntry | None = None) -> bool:
        """Least recently used files out until `incoming` more bytes fit (never `keep`)."""
        while self.used_bytes() + incoming > self.cap_bytes:
            others = [e for e in self.entries.values() if e is not keep]
            if not others:
                return False
            self._remove(min(others, key=lambda e: e.last_used), "the disk cap")
        return True

    def _drop_failed(self) -> None:
        with self._lock:
            failed, self._failed = set(self._failed), set()
            if self._writer is not None:
                self._writer.failed = self._failed
        for eid in failed:
            e = self.entries.get(eid)
            if e is not None:
                self._remove(e, "a failed write")

    # ---- writing (engine thread: the copy; the writer thread: the bytes) -----------------------------
    def unsaved(self, entry: KVEntry) -> bool:
        """Whether `entry` holds tokens its file does not (or has no file)."""
        if not self.enabled or len(entry.tokens) < MIN_TOKENS:
            return False
        if layer_cache.needs_checkpoints(entry.cache):
            # A sliding window or a recurrent state: segment version 4 (engine/disk/disk_states.py), unless a
            # layer is one it cannot describe (a window with pinned cells: none of the loaded families)
            try:
                if disk_states.describe(entry.cache) is None:
                    return False
            except ValueError:
                return False
        if getattr(entry, "disk_skip", -1) == len(entry.tokens):     # cleared: written again once it grows
            return False
        e = self.entries.get(getattr(entry, "disk_id", ""))
        # a conversation cut back to a prefix of its file (restored from an earlier boundary, a cancelled
        # turn) is held there already: writing it would be a segment of no tokens
        return e is None or e.key != entry.key or e.tokens[:len(entry.tokens)] != entry.tokens

    def persist(self, entry: KVEntry, stop: Callable[[], bool] = lambda: False) -> bool:
        """Queue a write of what `entry` holds that its file lacks. False when `stop()` said to give way
        (a request came) before the copy was done, or the entry cannot be written."""
        if not self.unsaved(entry):
            return True
        self._drop_failed()
        fp = self._fp_of(entry.key)
        if fp is None:
            return False
        try:
            g = ds.geometry(fp)
        except ds.SegmentError:
            return False
        n = len(entry.tokens)
        e = self.entries.get(getattr(entry, "disk_id", ""))
        if e is None and entry.owner:
            e = next((x for x in self.entries.values() if x.owner == entry.owner and x.key == entry.key), None)
        if e is None:
            # No file of its own, but it goes on from one: appended to the longest file it extends whole
            # rather than written again as a second. The server names each request anew, and RAM parking
            # gives a follow-up that shares part of a held conversation a copy of that part: with a
            # window or a recurrent state the file stops at the last boundary its next turn shares
            # (disk_states.boundaries), which that copy extends. (A full K/V file holds the whole held
            # conversation, which a copy of a part of it never extends.)
            e = max((x for x in self.entries.values() if x.key == entry.key and len(x.tokens) >= MIN_TOKENS
                     and common_prefix(x.tokens, entry.tokens) == len(x.tokens)),
                    key=lambda x: len(x.tokens), default=None)
        keep_tokens = keep_bytes = 0
        if e is not None and e.key == entry.key:
            p = common_prefix(e.tokens, entry.tokens)
            if p == len(e.tokens):
                keep_tokens, keep_bytes = e.bounds[-1]                       # the conversation goes on: append
            elif e.owner and e.owner == entry.owner:
                # a new branch of the same conversation: back to the last segment boundary it shares
                for t_end, b_end in e.bounds:
                    if t_end <= p:
                        keep_tokens, keep_bytes = t_end, b_end
            else:
                e = None
        else:
            e = None
        if e is not None and keep_tokens >= n:
            # Its file holds every token already (a session restored over a conversation on disk, under
            # another chat or this one's): nothing to write, only the link to the file kept. A write
            # would be a segment of no tokens.
            self._adopt(entry, e)
            return True
        if layer_cache.needs_checkpoints(entry.cache):
            if e is not None and e.layers is None:
                e, keep_tokens, keep_bytes = None, 0, 0
            return self._persist_states(entry, e, keep_tokens, keep_bytes, fp, stop)
        if e is not None and e.layers is not None:
            e, keep_tokens, keep_bytes = None, 0, 0
        t0 = time.perf_counter()
        store = _store_of(entry.cache)
        kv = _host_copy(entry.cache, keep_tokens, n, g, store, stop)
        if kv is None:
            return False
        copy_ms = (time.perf_counter() - t0) * 1e3
        if e is None:
            eid = secrets.token_hex(8)
            e = DiskEntry(eid, self.folder / f"{eid}{ds.SUFFIX}", entry.key, entry.owner, fp, [], [])
        meta = ds.header_json({"key": str(entry.key), "fp": fp, "start": keep_tokens, "owner": entry.owner or e.owner,
                               "store": store, "messages": list(entry.messages), "conv": e.id,
                               "prefix": ds.prefix_hash(entry.tokens[:n])})
        seg = ds.segment_bytes(len(meta), n - keep_tokens, g, store)
        if not self._make_room(entry, e, n, keep_bytes + seg):
            return False
        e.tokens = list(entry.tokens)
        e.bounds = [b for b in e.bounds if b[0] <= keep_tokens] + [(n, keep_bytes + seg)]
        e.messages, e.owner, e.last_used = list(entry.messages), entry.owner or e.owner, time.time()
        self.entries[e.id] = e
        entry.disk_id = e.id
        kind = "append" if keep_tokens else "rewrite"
        tokens = np.asarray(entry.tokens[keep_tokens:], dtype="<i4")
        path, file_bytes, stats, log = e.path, keep_bytes + seg, self.stats, self.log

        def job() -> None:
            t = time.perf_counter()
            pieces = ds.encode(meta, tokens, kv)
            written = _append(path, keep_bytes, pieces)
            stats.tokens, stats.bytes, stats.file_bytes, stats.kind = len(tokens), written, file_bytes, kind
            stats.state_bytes, stats.segments = 0, 1
            stats.total_bytes += written
            log(f"disk cache: wrote {len(tokens)} tokens ({written / 1024:.0f} KiB, {kind}) to {path.name}, "
                f"now {file_bytes / MIB:.2f} MiB; copy {copy_ms:.1f} ms (engine), write "
                f"{(time.perf_counter() - t) * 1e3:.1f} ms (writer)")
        job.what, job.entry_id = f"writing {path.name}", e.id
        self._queue(job)
        if len(e.bounds) > COMPACT_SEGMENTS:
            self._compact(e, g, store)
        return True

    @staticmethod
    def _adopt(entry: KVEntry, e: DiskEntry) -> None:
        """`entry` is held whole by e's file: linked to it (its next turn appends there)."""
        entry.disk_id = e.id
        e.owner, e.last_used = entry.owner or e.owner, time.time()
        if len(entry.messages) and len(e.tokens) == len(entry.tokens):
            e.messages = list(entry.messages)

    def _make_room(self, entry: KVEntry, e: DiskEntry, n: int, size: int) -> bool:
        """Room for e's file at `size` bytes (least recently used files out); False, with its file removed,
        when it alone is larger than the cap."""
        if size > self.cap_bytes:
            self.log(f"disk cache: {n} tokens need {size / MIB:.1f} MiB, more than the whole cap "
                     f"of {self.cap_bytes / MIB:.0f} MiB; not written")
            if e.id in self.entries:
                self._remove(e, "")
            entry.disk_id = ""
            return False
        self.entries.pop(e.id, None)                # its old size must not count while room is made
        self._evict_until(size)
        return True

    def _persist_states(self, entry: KVEntry, e: DiskEntry | None, keep_tokens: int, keep_bytes: int, fp: dict,
                        stop: Callable[[], bool]) -> bool:
        """persist() for a conversation with a window or a recurrent state (engine/disk/disk_states.py): the new
        tokens [keep_tokens, n) as one segment per message boundary, appended at keep_bytes."""
        layers = disk_states.describe(entry.cache)
        if layers is None:
            return False
        if e is not None and e.layers != layers:
            e, keep_tokens, keep_bytes = None, 0, 0
        t0 = time.perf_counter()
        try:
            shared = self._next_shares(entry)
        except Exception as err:  # noqa: BLE001 - unknown: every boundary written
            self.log(f"disk cache: the next turn's prompt not rendered ({type(err).__name__}: {str(err)[:120]})")
            shared = None
        parts = disk_states.host_parts(entry, keep_tokens, stop, shared)
        if parts is None:
            return False
        if e is not None and parts[-1].start + len(parts[-1].tokens) <= keep_tokens:
            self._adopt(entry, e)                        # what the next turn shares is on disk already
            return True
        copy_ms = (time.perf_counter() - t0) * 1e3
        n = parts[-1].start + len(parts[-1].tokens)      # < len(entry.tokens): the rest is not shared
        if e is None:
            eid = secrets.token_hex(8)
            e = DiskEntry(eid, self.folder / f"{eid}{ds.SUFFIX}", entry.key, entry.owner, fp, [], [], layers=layers)
        owner = entry.owner or e.owner
        metas = [ds.header_json({"key": str(entry.key), "fp": fp, "start": p.start, "owner": owner,
                                 "messages": p.messages, "layers": layers, "conv": e.id,
                                 "prefix": ds.prefix_hash(entry.tokens[:p.start + len(p.tokens)])}) for p in parts]
        sizes = [ds.segment_bytes_states(len(mj), len(p.tokens), layers) for mj, p in zip(metas, parts)]
        seg = sum(sizes)
        if not self._make_room(entry, e, n, keep_bytes + seg):
            return False
        kept = sum(1 for t, _ in e.bounds if t <= keep_tokens)
        ends, at = [], keep_bytes
        for p, size in zip(parts, sizes):
            at += size
            ends.append((p.start + len(p.tokens), at))
        e.bounds = e.bounds[:kept] + ends
        e.tokens, e.layers = list(entry.tokens[:n]), layers
        if n < len(entry.tokens):
            entry.disk_skip = len(entry.tokens)       # written as far as it serves: again once it grows
        e.messages = list(entry.messages) if n == len(entry.tokens) else []
        e.owner, e.last_used = owner, time.time()
        self.entries[e.id] = e
        entry.disk_id = e.id
        kind = "append" if keep_tokens else "rewrite"
        state_bytes = sum(disk_states.state_bytes(layers, len(p.tokens)) for p in parts)
        path, file_bytes, stats, log = e.path, at, self.stats, self.log

        def job() -> None:
            t = time.perf_counter()
            pieces = []
            for mj, p in zip(metas, parts):
                pieces += ds.encode_states(mj, p.tokens, p.kv, p.state)
            written = _append(path, keep_bytes, pieces)
            stats.tokens, stats.bytes, stats.file_bytes, stats.kind = n - keep_tokens, written, file_bytes, kind
            stats.state_bytes, stats.segments = state_bytes, len(parts)
            stats.total_bytes += written
            log(f"disk cache: wrote {n - keep_tokens} tokens in {len(parts)} segments ({written / 1024:.0f} KiB, "
                f"of which windows and states {state_bytes / 1024:.0f} KiB, {kind}) to {path.name}, now "
                f"{file_bytes / MIB:.2f} MiB; copy {copy_ms:.1f} ms (engine), write "
                f"{(time.perf_counter() - t) * 1e3:.1f} ms (writer)")
        job.what, job.entry_id = f"writing {path.name}", e.id
        self._queue(job)
        if disk_states.wants_compaction(e.bounds, layers):
            self._compact_states(e)
        return True

    def _compact_states(self, e: DiskEntry) -> None:
        """Queue the rewrite of all but e's latest KEEP_BOUNDARIES segments as one (engine/disk/disk_states.py)."""
        keep = disk_states.KEEP_BOUNDARIES
        n_segs = len(e.bounds)
        n_merged, old_end = e.bounds[-keep - 1]
        meta = ds.header_json({"key": str(e.key), "fp": e.fp, "start": 0, "owner": e.owner, "messages": [],
                               "layers": e.layers, "conv": e.id, "prefix": ds.prefix_hash(e.tokens[:n_merged])})
        size = ds.segment_bytes_states(len(meta), n_merged, e.layers)
        e.bounds = [(n_merged, size)] + [(t, b - old_end + size) for t, b in e.bounds[-keep:]]
        run = disk_states.compact_job(e.path, meta, e.layers, n_merged, n_segs, _append,
                                      e.id, ds.prefix_hash(e.tokens[:n_merged]))
        path, stats, log, merged = e.path, self.stats, self.log, n_segs - keep

        def job() -> None:
            written = run()
            stats.bytes, stats.kind = written, "compact"
            stats.total_bytes += written
            log(f"disk cache: compacted {merged} segments of {path.name} into one, {keep} kept "
                f"({written / MIB:.2f} MiB written)")
        job.what, job.entry_id = f"compacting {path.name}", e.id
        self._queue(job)

    def _compact(self, e: DiskEntry, g, store: str) -> None:
        """Queue the rewrite of e's segments as one (by the writer thread: it reads the file, not the engine)."""
        meta = ds.header_json({"key": str(e.key), "fp": e.fp, "start": 0, "owner": e.owner, "store": store,
                               "messages": e.messages, "conv": e.id, "prefix": ds.prefix_hash(e.tokens)})
        n = len(e.tokens)
        size = ds.segment_bytes(len(meta), n, g, store)
        specs = ds.kv_specs(1, g, store)
        e.bounds = [(n, size)]
        path, stats, log, eid, held = e.path, self.stats, self.log, e.id, list(e.tokens)

        def job() -> None:
            fd = _open_regular(path)
            try:
                segs, why = ds.scan(fd, os.fstat(fd).st_size)
                if why or sum(s.n for s in segs) != n:
                    raise OSError(f"not whole before compaction ({why or 'tokens differ'})")
                # never relabel another conversation's K/V (a file swapped since it was indexed) as this one's
                if any(s.meta["conv"] != eid for s in segs) \
                        or np.concatenate([s.tokens for s in segs]).tolist() != held:
                    raise OSError("not this conversation's before compaction (changed on disk)")
                parts = [ds.read_kv(fd, s, g) for s in segs]
            finally:
                os.close(fd)
            kv = [np.concatenate([p[i] for p in parts], axis=2).astype(ds._NP[specs[i].dtype], copy=False)
                  for i in range(len(parts[0]))]
            tokens = np.concatenate([s.tokens for s in segs])
            tmp = path.with_name(f".{path.stem}.compact.tmp")
            written = _append(tmp, 0, ds.encode(meta, tokens, kv))
            os.replace(tmp, path)
            stats.bytes, stats.kind = written, "compact"
            stats.total_bytes += written
            log(f"disk cache: compacted {len(segs)} segments of {path.name} into one ({written / MIB:.2f} MiB)")
        job.what, job.entry_id = f"compacting {path.name}", e.id
        self._queue(job)

    def idle_step(self, held: list[KVEntry], stop: Callable[[], bool]) -> None:
        """The engine's idle time: the held conversations' new tokens copied and queued, newest first."""
        if not self.enabled:
            return
        for entry in sorted(held, key=lambda x: -x.last_used):
            if stop():
                return
            if self.unsaved(entry):
                self.persist(entry, stop)

    def persist_all(self, held: list[KVEntry]) -> None:
        for entry in held:
            try:
                self.persist(entry)
            except Exception as e:  # noqa: BLE001 - the cache is an optimisation
                self.log(f"disk cache: not written ({type(e).__name__}: {str(e)[:120]})")

    # ---- finding and restoring -------------------------------------------------------------------
    def best(self, tokens: list[int], key: KVKey) -> tuple[DiskEntry | None, int]:
        """The file that restores the longest prefix of `tokens` under `key`, and that length: parking's
        prefix rule (parking.longest_prefix), checkpoints included: a file of version 4 restores to a
        segment end (a message boundary) at or before the shared prefix and the prompt's last token."""
        if not self.enabled:
            return None, 0
        self._drop_failed()
        best, best_n = None, 0
        for e in self.entries.values():
            if e.key != key:
                continue
            n = self.reach(e, common_prefix(e.tokens, tokens), len(tokens))
            if n > best_n:
                best, best_n = e, n
        if best is None or best_n < min(MIN_PREFIX_REUSE, len(best.tokens)):
            return None, 0
        return best, best_n

    @staticmethod
    def reach(e: DiskEntry, shared: int, n_prompt: int) -> int:
        """How much of the `shared` prefix e restores for a prompt of n_prompt tokens."""
        if e.layers is None:
            return shared
        limit = min(shared, n_prompt - 1)
        return max((t for t, _ in e.bounds if t <= limit), default=0)

    @staticmethod
    def verify(e: DiskEntry, segs: list, tokens: np.ndarray, prompt: list[int] | None) -> None:
        """SessionFileError unless `segs`, read from e's file just now, are e's conversation: each names
        e's id, each token hash up to its end is that of e's indexed tokens, and the token ids they give
        (`tokens`, the ones about to be restored) are e's and the prompt's. The index was right when the
        file was written; a file swapped, replaced or linked in since then is caught here."""
        indexed = np.asarray(e.tokens, dtype="<i4")
        running, at = xxhash.xxh3_128(), 0         # segments run from token 0 on: one pass over the ids
        for s in segs:
            if s.meta.get("conv") != e.id:
                raise SessionFileError("it holds another conversation's K/V (swapped or replaced on disk)")
            end = s.start + s.n
            if s.start != at or end > len(indexed):
                break                              # past the index (cut back after a damaged segment)
            running.update(indexed[at:end])
            at = end
            if s.meta.get("prefix") != running.hexdigest():
                raise SessionFileError("its token ids are not its index entry's (changed on disk)")
        n = len(tokens)
        held = tokens.tolist()
        if held != e.tokens[:n] or (prompt is not None and held != list(prompt[:n])):
            raise SessionFileError("its token ids are not the prompt's (changed on disk)")

    def restore(self, e: DiskEntry, m: int, make_cache: Callable[[], list],
                prompt: list[int] | None = None) -> tuple[KVEntry, int] | None:
        """The first `m` tokens of e's conversation as a new KVEntry (None: not usable; logged). `prompt`:
        the tokens it resumes (what is read must be their first m, checked with verify)."""
        if e.layers is not None:
            return disk_states.restore(self, e, m, make_cache, prompt)
        t0 = time.perf_counter()
        self.flush()
        expected = self._fp_of(e.key)
        try:
            if expected is None:
                raise SessionFileError("not the loaded model's")
            # model, geometry, tokenizer, template, K/V format, steering: the session files' check
            check_fingerprint(e.path.name, {f"fp.{k}": v for k, v in e.fp.items()}, expected)
            g = ds.geometry(e.fp, self._n_vocab, self._n_ctx)
            fd = _open_regular(e.path)
            try:
                segs, why = ds.scan(fd, os.fstat(fd).st_size)
                segs = [s for s in segs if s.start < m]
                if not segs or segs[0].meta["key"] != str(e.key) or segs[0].meta["fp"] != e.fp:
                    raise SessionFileError(f"changed on disk ({why or 'another conversation'})")
                m = min(m, segs[-1].start + segs[-1].n)
                tokens = np.concatenate([s.tokens for s in segs])[:m]
                self.verify(e, segs, tokens, prompt)
                if len(tokens) < m or m >= self._n_ctx or outside_vocab(tokens, self._n_vocab, self._image_span) is not None:
                    raise SessionFileError("its token ids do not fit this model")
                if g.kv == "float16":
                    need = restore_bytes(m, g, np.dtype(_np_dtype(self._dtype)).itemsize)
                else:
                    need = quant_bytes(m, g)
                try:
                    check_memory(e.path.name, m, need, self._admit)      # before any K/V is allocated
                except SessionFileError as refused:
                    self.log(f"disk cache: not restored: {refused}")
                    return None
                # Each segment's tensors go to the device as they are read (device_upload: one DMA on
                # CUDA, no managed-memory page faults); they are joined and padded to the cache's cells
                # there, where a copy costs nothing next to the read.
                pieces: list[list] = [[] for _ in ds.kv_specs(m, g)]
                # as the session restore does: uploads into buffers MLX cached were slower than into new ones
                mx.clear_cache()
                whole = 0
                for s in segs:
                    k = min(s.n, m - s.start)
                    sent: list = []
                    try:
                        ds.read_kv_streamed(fd, s, g, k, lambda a: sent.append(to_device(a)))
                    except ds.SegmentError as err:
                        self.log(f"disk cache: {e.path.name}: {err}; falling back to its last whole segment "
                                 f"({whole} tokens)")
                        break
                    for acc, a in zip(pieces, sent):
                        acc.append(a)
                    whole = s.start + k
            finally:
                os.close(fd)
            if whole < min(MIN_PREFIX_REUSE, m):
                raise SessionFileError("no whole segment left")
            m = whole
        except (SessionFileError, ds.SegmentError, OSError, ValueError) as err:
            msg = str(err)
            self.log(f"disk cache: {e.path.name} dropped ({msg[:200]})")
            self._remove(e, "")
            return None
        cache = make_cache()
        pad = padded_cells(m) - m
        arrays = []
        for acc in pieces:
            a = acc[0] if len(acc) == 1 else mx.concatenate(acc, axis=2)
            if pad:
                a = mx.concatenate([a, mx.zeros((*a.shape[:2], pad, a.shape[3]), a.dtype)], axis=2)
            arrays.append(a)
        del pieces
        if g.kv == "float16":
            arrays = [a.astype(self._dtype) if a.dtype != self._dtype else a for a in arrays]
            for i, c in enumerate(cache):
                c.state = (arrays[2 * i], arrays[2 * i + 1], m)
        else:
            fmt = kv_format.format_of_label(g.kv)
            for i, c in enumerate(cache):
                a = arrays[6 * i:6 * i + 6]
                c.state = (tuple(a[:3]), tuple(a[3:]), m, fmt.group, fmt.bits)
        mx.eval([kv_format.arrays_of(c) for c in cache])
        entry = KVEntry(tokens[:m].tolist(), cache, e.key, messages=list(e.messages) if m == len(e.tokens) else [],
                        owner=e.owner)
        entry.disk_id = e.id
        entry.restored_from_disk = m
        e.last_used = time.time()
        self.log(f"disk cache: restored {m} tokens from {e.path.name} in {(time.perf_counter() - t0) * 1e3:.1f} ms")
        return entry, m


# ---- the engine's hooks (engine/engine.py, engine/scheduler.py) ---------------------------------------
def attach(engine) -> DiskTier | None:
    """The engine's disk tier, made at start (none for a distributed rank: each holds some layers only)."""
    if engine.serving.distributed:
        return None
    try:
        cap = check_disk_mib(engine.options.disk_mib, "--conversation-disk-mib")
    except Exception as e:  # noqa: BLE001 - a bad setting from elsewhere: off, with a log line
        engine.log(f"disk cache: off ({e})")
        cap = 0
    folder = Path(engine.options.disk_dir) if engine.options.disk_dir else data_dir() / "cache" / "conversations"
    disk = DiskTier(folder, cap, engine.log)

    def fp_of(key: KVKey) -> dict | None:
        if engine.info is None or key.model_hash != engine.model_hash:
            return None
        fp = engine.sessions.fingerprint(key.steering)
        fp["kv_format"] = key.kv_format
        # the model's content (its hash, over every part of a split set) is its identity here: its file's
        # name, there for a session file's refusal, would make the same model under another name (a link,
        # a library's path) write segments that disagree with its file's first
        fp.pop("model", None)
        return {k: str(v) for k, v in fp.items()}

    def probe() -> list:
        return cache_probe(engine.model, engine.handlers.make_cache)

    def next_shares(entry: KVEntry) -> int | None:
        """How much of `entry` the next turn's prompt shares: its messages and one more user message,
        rendered as prompts.prompt_tokens renders a prompt (held token ids kept: continue_tokens), the
        shared prefix with its tokens. None where it has no chat messages ending in a reply."""
        msgs = entry.messages
        if not msgs or not isinstance(msgs[-1], dict) or msgs[-1].get("role") != "assistant":
            return None
        if has_image_parts(msgs):         # image references: their spans' ids, from the held digests
            try:
                toks = engine.prompts.image_prompt(list(msgs) + [{"role": "user", "content": "..."}],
                                                    add_generation_prompt=False)
            except StrataError:
                return None               # a projector no longer loaded: no span of it will be asked for
            return common_prefix(entry.tokens, toks)
        tok = engine.tokenizer
        bos = tok.token_text(tok.bos_id) if tok.bos_id is not None else ""
        eos = tok.token_text(min(tok.eos_ids)) if tok.eos_ids else ""
        text = render(engine.template, list(msgs) + [{"role": "user", "content": "..."}], bos_token=bos,
                      eos_token=eos, add_generation_prompt=False)
        add_bos = tok.add_bos and not (bos and text.startswith(bos))
        toks = engine.conversations.continue_tokens(tok, text, add_bos, entry.owner, entry.key,
                                                    engine.prompts.image_span()) \
            or tok.encode(text, add_bos=add_bos)
        return common_prefix(entry.tokens, toks)

    disk.use_model(fp_of, lambda: (engine.dtype, engine.info.n_vocab if engine.info else 1 << 31,
                                   engine.n_ctx or 1 << 31, engine.guard.admit, engine.prompts.image_span()),
                   probe, next_shares)
    if cap:
        unusable = unusable_folder(folder)
        if unusable:
            # only the cache's folder fails: the engine serves without it (the data folder itself is
            # checked at start by the front ends)
            logging.getLogger("strata").warning(f"disk cache: off: {unusable}")
            disk.set_cap(0)
        else:
            disk.scan()
    engine.conversations.disk = disk
    engine.conversations.parking.on_evict = disk.persist
    return disk


class IdleWrites:
    """The scheduler's idle task (engine/scheduler.py): while the engine waits for a request, the held
    conversations' new tokens go to disk, one layer's copy at a time, until a request comes."""

    def __init__(self, engine):
        self.engine = engine

    def due_in(self) -> float | None:
        return None

    def run(self, interrupted) -> None:
        engine = self.engine
        disk = engine.disk
        if disk is None or not disk.enabled or engine.model is None:
            return
        try:
            disk.idle_step(engine.conversations.held(), stop=interrupted)
        except Exception as e:  # noqa: BLE001 - an optimisation: never worth the engine thread
            engine.log(f"disk cache: idle-time write failed ({type(e).__name__}: {str(e)[:160]})")


def stop(engine) -> None:
    """The engine stops: what the held conversations lack on disk is written, and the writer drained."""
    disk = engine.disk
    if disk is None:
        return
    if disk.enabled and engine.model is not None:
        disk.persist_all(engine.conversations.held())
    disk.close()


def clear_request(engine):
    if engine.disk is not None:
        engine.disk.clear()
        for e in engine.conversations.held():       # held in RAM: not written back until they grow
            e.disk_id, e.disk_skip = "", len(e.tokens)
    return engine.handlers.status()


def forget_request(engine, req):
    if engine.disk is not None:
        engine.disk.forget(req.conversation)
    if engine.conversations is not None and req.conversation:
        live = engine.conversations.live
        if live is not None and live.owner == req.conversation:
            engine.conversations.drop(live, "its chat was deleted")
        for e in list(engine.conversations.parking.entries):
            if e.owner == req.conversation:
                engine.conversations.parking.drop(e, "its chat was deleted")
    return engine.handlers.status()


# ---- helpers -------------------------------------------------------------------------------------
def _np_dtype(dtype):
    return np.float16 if dtype == mx.float16 else np.float32


def _store_of(cache: list) -> str:
    """How 16-bit K/V is stored: in the cache's own precision (float32 on the CPU; bfloat16 widened)."""
    arrays = kv_format.arrays_of(cache[0]) if cache else []
    return "float16" if arrays and arrays[0].dtype == mx.float16 else "float32"


def _host_copy(cache: list, a: int, b: int, g, store: str, stop: Callable[[], bool]) -> list[np.ndarray] | None:
    """Cells [a, b) of every layer's K/V as numpy host arrays in the segment's order (16-bit K/V in
    `store`, quantized as held), one layer at a time; None when `stop()` says a request is waiting."""
    out: list[np.ndarray] = []
    for c in cache[:g.n_layer]:
        if stop():
            return None
        arrays = kv_format.arrays_of(c)
        if not arrays or c.offset < b:
            raise ValueError("the conversation's K/V holds fewer cells than its tokens")
        sl = [x[..., a:b, :] for x in arrays]
        if g.kv == "float16":
            sl = [s.astype(mx.float16 if store == "float16" else mx.float32) for s in sl]
        sl = [mx.contiguous(s) for s in sl]
        mx.eval(sl)
        out += [np.array(s, copy=True) for s in sl]
    return out


def _append(path: Path, at: int, pieces: list) -> int:
    """The pieces written at byte `at` of path (cut there first): the bytes written. Never through a
    symbolic link, never into anything but a regular file (disk_segments.open_file)."""
    fd = ds.open_file(path, write=True)
    try:
        size = os.fstat(fd).st_size
        if size < at:
            raise OSError(f"{path.name} is shorter ({size} bytes) than its last whole segment ends ({at})")
        if size != at:
            os.ftruncate(fd, at)
        # an empty piece (a region of no tensors) writes nothing; memoryview cannot cast one
        views = [memoryview(p).cast("B") for p in pieces if (p.nbytes if isinstance(p, np.ndarray) else len(p))]
        total = sum(len(v) for v in views)
        off = at
        while views:
            k = os.pwritev(fd, views[:512], off)
            off += k
            while views and k >= len(views[0]):
                k -= len(views[0])
                views.pop(0)
            if views and k:
                views[0] = views[0][k:]
        return total
    finally:
        os.close(fd)


def _open_regular(p: Path) -> int:
    return ds.open_file(p)


def _unlink(p: Path) -> None:
    try:
        os.unlink(p)
    except FileNotFoundError:
        pass
