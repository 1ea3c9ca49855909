"""The disk tier (engine/disk/disk_tier.py) for conversations whose cache has a sliding window or a recurrent
state (engine/cache/layer_cache.py `needs_checkpoints`: Gemma 3/4, gpt-oss, OLMo 3, Qwen3.5/3.6): segment
version 4 (engine/disk/disk_segments.py).

A turn's write is still append-only, split at the conversation's message boundaries (its checkpoints,
RAM parking's own restore points: generate.reply's marks, the prompt's end less its last token, each
reply's end) into one segment per boundary, up to the last boundary the next turn will share
(`boundaries`: the conversation and one more user message rendered as a prompt is; Qwen3.5's and
harmony's templates render the last reply otherwise, so the prompt's end and the reply's end would
only be cut off by the next turn's write: they are not written, and a Regenerate after a restart
resumes from the end of the last message, a few tokens earlier). Each segment holds
  * the full K/V layers' (`kv`, `kv_quant`) K/V of its tokens, as today;
  * each window layer's (`rotating`) K/V of its last min(n, window) tokens: the ring at a boundary is
    exactly the last `window` tokens' K/V in order (mlx-lm's ring is rebuilt from them: offset, write
    index at its end), and a token older than the window is never attended again. They come from the
    live ring (the last boundary) or the checkpoint's ring at that boundary;
  * each recurrent layer's (`arrays`) whole state after its last token (from the live cache or the
    checkpoint): fixed size, independent of the conversation's length.
So restoring to the end of segment k = the full layers' K/V of segments 0..k concatenated, the window
from the tails of segments k, k-1, ... (each either the whole segment or a whole window), the states
of segment k. A prompt is restored to the longest segment end it extends (below its last token):
the next turn from the last boundary it shares, an Edit from an earlier one. A torn last segment
falls back to the one before it, which is whole on its own.

Bytes per turn: the new tokens' K/V of the full layers, min(new, window) tokens of each window layer
per boundary (for a turn shorter than the window: its tokens once, like full K/V), and one recurrent
state per boundary (2 a turn for Qwen3.5's template, 4 for one that renders replies as fed).
Compaction (the writer thread, when the bytes a merge would drop -- older boundaries' states and the
windows' older tokens -- exceed the bytes the rewritten file holds, or past MAX_SEGMENTS): everything
before the latest KEEP_BOUNDARIES segments becomes one segment (its state: the last of them), the
latest segments are copied as they are. So a file keeps the latest KEEP_BOUNDARIES + 1 restore
points, as RAM parking keeps its latest MAX_CHECKPOINTS, and the rewrites cost at most as many bytes
again as the appends (a compaction drops at least as much as it writes).
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import mlx.core as mx

from engine.disk import disk_segments as ds
from engine.cache import layer_cache
from engine.model.device_upload import to_device
from engine.errors import SessionFileError
from engine.cache.parking import KVEntry, MIN_PREFIX_REUSE
from engine.session_files.sessions import check_fingerprint, check_memory
from engine.text.image_tokens import outside_vocab

KEEP_BOUNDARIES = layer_cache.MAX_CHECKPOINTS   # segments a compaction keeps as they are
MAX_SEGMENTS = 64                               # more: compacted whatever the bytes (a scan reads each head)
_NAME = {"float32": "F32", "float16": "F16", "bfloat16": "BF16", "uint32": "U32"}


def _dt(a) -> str:
    name = _NAME.get(str(a.dtype).replace("mlx.core.", ""))
    if name is None:
        raise ValueError(f"a {a.dtype} cache tensor")
    return name


def describe(cache: list) -> list | None:
    """The layer list a version-4 header holds for this cache (holding at least one token): each layer's
    kind, its tensors' dtypes and shapes (the token axis left out), a window's size. None when a layer
    is one this tier cannot hold (a window with pinned cells: no model Strata loads has one)."""
    out = []
    for c in cache:
        k = layer_cache.kind_of(c)
        if k.name == "arrays":
            ts = [None if a is None else [_dt(a), *map(int, a.shape)] for a in c.cache]
            out.append({"kind": "arrays", "t": ts})
            continue
        ts = k.state(c)
        if not ts:
            return None
        d = {"kind": k.name, "t": [[_dt(a), int(a.shape[0]), int(a.shape[1]), int(a.shape[3])] for a in ts]}
        if k.name == "kv_quant":
            d["group"], d["bits"] = int(c.group_size), int(c.bits)
        elif k.name == "rotating":
            if c.keep:
                return None
            d["max_size"], d["keep"] = int(c.max_size), 0
        out.append(d)
    return out


def same_layout(theirs: list, ours: list) -> bool:
    """A file's layer list against this model's: equal, except that a float tensor may have been held in
    another float type (cast at restore, as session files are)."""
    if len(theirs) != len(ours):
        return False
    for a, b in zip(theirs, ours):
        if {k: v for k, v in a.items() if k != "t"} != {k: v for k, v in b.items() if k != "t"} \
                or len(a["t"]) != len(b["t"]):
            return False
        for x, y in zip(a["t"], b["t"]):
            if (x is None) != (y is None):
                return False
            if x is None:
                continue
            if x[1:] != y[1:] or (x[0] != y[0] and not (x[0] in ("F32", "F16", "BF16") and y[0] in ("F32", "F16", "BF16"))):
                return False
    return True


# ---- writing: the engine thread's copy ---------------------------------------------------------------
@dataclass
class Part:
    """One segment to write: tokens [start, start + len(tokens)), its K/V region's and state region's
    host arrays in file order."""
    start: int
    tokens: np.ndarray
    kv: list
    state: list
    messages: list


def boundaries(entry, keep: int, shared: int | None = None) -> list[int]:
    """Where the segments of a write [keep, n) end: the conversation's checkpoints after `keep`, and n.
    `shared`: how much of the conversation the next turn's prompt will share (None: unknown). A
    boundary past it only serves a Regenerate (which then resumes a few tokens earlier, at the end of
    the last message) and is cut off by the next turn's write: Qwen3.5's and harmony's templates render
    the last reply otherwise, so the prompt's end and the reply's end are left out, a recurrent
    state each. Where none of this write's boundaries is within `shared` (a render that differs
    elsewhere, e.g. for tools), all are written."""
    n = len(entry.tokens)
    ends = sorted({ck.n for ck in entry.checkpoints if keep < ck.n < n}) + [n]
    if shared is not None and shared < n:
        within = [b for b in ends if b <= shared]
        if within:
            return within
    return ends


def _host(a) -> np.ndarray:
    if a.dtype == mx.bfloat16:
        a = a.view(mx.uint16)
    a = mx.contiguous(a)
    mx.eval(a)
    return np.array(a, copy=True)


def _ring_tail(c, t: int) -> list:
    """The last t tokens' (keys, values) of a RotatingKVCache, in token order. mlx-lm's own
    `_temporal_order` (0.32.2) undoes the rotation (keep = 0: describe refuses pinned cells)."""
    k, v = c._temporal_order(c.keys), c._temporal_order(c.values)
    if k.shape[2] < t:
        raise ValueError(f"a window holds {k.shape[2]} cells, {t} needed")
    return [k[..., k.shape[2] - t:, :], v[..., v.shape[2] - t:, :]]


def host_parts(entry, keep: int, stop: Callable[[], bool], shared: int | None = None) -> list[Part] | None:
    """The segments of entry's tokens [keep, end) as host arrays (end: the last of `boundaries`), one
    layer at a time; None when `stop()` says a request is waiting. ValueError when the cache does not
    hold exactly its tokens."""
    cache, n = entry.cache, len(entry.tokens)
    ends = boundaries(entry, keep, shared)
    cks = {ck.n: ck for ck in entry.checkpoints}
    starts = [keep] + ends[:-1]
    kv: list[list] = [[] for _ in ends]
    st: list[list] = [[] for _ in ends]
    for i, c in enumerate(cache):
        if stop():
            return None
        kind = layer_cache.kind_of(c)
        for p, (a, b) in enumerate(zip(starts, ends)):
            if kind.name in ds.PER_TOKEN:
                if c.offset < b:
                    raise ValueError("the conversation's K/V holds fewer cells than its tokens")
                kv[p] += [_host(x[..., a:b, :]) for x in kind.state(c)]
                continue
            src = c if b == n else kind.restore(cks[b].layers[i])
            if kind.name == "rotating":
                if src.offset != b:
                    raise ValueError(f"a window holds {src.offset} tokens at a boundary of {b}")
                kv[p] += [_host(x) for x in _ring_tail(src, min(b - a, src.max_size))]
            else:
                st[p] += [_host(x) for x in src.cache if x is not None]
    toks = np.asarray(entry.tokens, dtype="<i4")
    return [Part(a, toks[a:b].copy(), kv[p], st[p], list(entry.messages) if b == n else [])
            for p, (a, b) in enumerate(zip(starts, ends))]


def state_bytes(layers: list, n: int) -> int:
    """Of a segment of n tokens, the bytes of its window tails and recurrent states (the fixed part a
    boundary costs, beside its full layers' K/V)."""
    kv, st = ds.layer_specs(layers, n)
    full = sum(s.end - s.start for s in kv if layers[int(s.name[1:].split(".")[0])]["kind"] in ds.PER_TOKEN)
    return ds.region_bytes(kv) - full + ds.region_bytes(st)


def merged_bytes(layers: list, n: int, json_len: int) -> int:
    return ds.segment_bytes_states(json_len, n, layers)


def wants_compaction(bounds: list[tuple[int, int]], layers: list) -> bool:
    """`bounds`: (token end, byte end) per segment. Compact when merging all but the latest
    KEEP_BOUNDARIES segments would drop more bytes than the rewritten file holds (the merged run keeps
    one window and one state: what goes is the older boundaries' states and the windows' older
    tokens), or past MAX_SEGMENTS. A compaction so drops at least what it writes: the rewrites cost
    at most as many bytes again as the appends."""
    if len(bounds) <= KEEP_BOUNDARIES + 1:
        return False
    n_merged, old_end = bounds[-KEEP_BOUNDARIES - 1]
    dropped = old_end - merged_bytes(layers, n_merged, 0)
    return dropped > bounds[-1][1] - dropped or len(bounds) > MAX_SEGMENTS


def compact_job(path: Path, merged_meta: bytes, layers: list, n_merged: int, n_segs: int,
                append: Callable[[Path, int, list], int], conv: str, prefix: str) -> Callable[[], int]:
    """The writer thread's compaction of `path`: its first n_segs - KEEP_BOUNDARIES segments (n_merged
    tokens) into one, the rest copied byte for byte (`append`: disk_tier's writer). Returns the bytes
    written. `conv`, `prefix`: the conversation's id and the hash of its first n_merged token ids, which
    the file must still hold (a file swapped since it was indexed is never relabelled as this one)."""
    def job() -> int:
        fd = ds.open_file(path)
        try:
            segs, why = ds.scan(fd, os.fstat(fd).st_size)
            if why or len(segs) != n_segs or segs[-KEEP_BOUNDARIES].start != n_merged:
                raise OSError(f"not as indexed before compaction ({why or 'segments differ'})")
            if any(s.meta["conv"] != conv for s in segs) or segs[-KEEP_BOUNDARIES - 1].meta["prefix"] != prefix:
                raise OSError("not this conversation's before compaction (changed on disk)")
            old = segs[:-KEEP_BOUNDARIES]
            regions = [ds.read_region(fd, s.kv_offset, ds.layer_specs(layers, s.n)[0], s.kv_digest, "K/V")
                       for s in old]
            state = ds.read_region(fd, old[-1].state_offset, ds.layer_specs(layers, old[-1].n)[1],
                                   old[-1].state_digest, "state")
            rest_at, rest = old[-1].end, segs[-1].end - old[-1].end
            tail = np.empty(rest, np.uint8)
            if os.preadv(fd, [memoryview(tail)], rest_at) != rest:
                raise OSError("short read before compaction")
        finally:
            os.close(fd)
        kv = merge_regions(layers, [s.n for s in old], regions)
        tokens = np.concatenate([s.tokens for s in old])
        tmp = path.with_name(f".{path.stem}.compact.tmp")
        written = append(tmp, 0, ds.encode_states(merged_meta, tokens, kv, state) + [tail])
        os.replace(tmp, path)
        return written
    return job


def merge_regions(layers: list, ns: list[int], regions: list[list[np.ndarray]]) -> list[np.ndarray]:
    """The K/V region of segments of ns tokens as one segment's: full layers concatenated, each window's
    tails concatenated and cut to the merged segment's last min(total, window) tokens (each tail is
    its whole segment or a whole window, so the last `window` of the concatenation are contiguous)."""
    total, out, j = sum(ns), [], 0
    for d in layers:
        if d["kind"] == "arrays":
            continue
        for _ in d["t"]:
            cat = np.concatenate([r[j] for r in regions], axis=2)
            if d["kind"] == "rotating":
                cat = cat[:, :, cat.shape[2] - min(total, d["max_size"]):, :]
            out.append(np.ascontiguousarray(cat))
            j += 1
    return out


# ---- restoring (the engine thread) ---------------------------------------------------------------------
def restore(tier, e, m: int, make_cache: Callable[[], list], prompt: list[int] | None = None):
    """The conversation of DiskEntry e up to its last segment end at or before m, as a new KVEntry:
    (entry, tokens) or None (logged; a damaged file or one that is not e's conversation removed).
    `prompt`: the tokens it resumes (tier.verify)."""
    t0 = time.perf_counter()
    tier.flush()
    expected = tier._fp_of(e.key)
    fd = None
    try:
        if expected is None:
            raise SessionFileError("not the loaded model's")
        check_fingerprint(e.path.name, {f"fp.{k}": v for k, v in e.fp.items()}, expected)
        fd = tier._open(e.path)
        segs, why = ds.scan(fd, os.fstat(fd).st_size)
        if not segs or segs[0].version != ds.VERSION_STATES or segs[0].meta["key"] != str(e.key) \
                or segs[0].meta["fp"] != e.fp:
            raise SessionFileError(f"changed on disk ({why or 'another conversation'})")
        layers = segs[0].meta["layers"]
        ours = describe(tier._probe())
        if ours is None or not same_layout(layers, ours):
            raise SessionFileError("its layers are not this model's")
        k = max((j for j, s in enumerate(segs) if s.start + s.n <= m), default=-1)
        if k < 0 or segs[k].start + segs[k].n < min(MIN_PREFIX_REUSE, m):
            return None                       # no restore point early enough: nothing wrong with the file
        end = segs[k].start + segs[k].n
        tokens = np.concatenate([s.tokens for s in segs[:k + 1]])
        tier.verify(e, segs[:k + 1], tokens, prompt)
        if end >= tier._n_ctx or outside_vocab(tokens, tier._n_vocab, tier._image_span) is not None:
            raise SessionFileError("its token ids do not fit this model")
        kv_s, st_s = ds.layer_specs(layers, end)
        try:
            check_memory(e.path.name, end, ds.region_bytes(kv_s) + ds.region_bytes(st_s), tier._admit)
        except SessionFileError as refused:           # before any K/V is allocated
            tier.log(f"disk cache: not restored: {refused}")
            return None
        regions, state = [], None
        for j, s in enumerate(segs[:k + 1]):
            try:
                regions.append(ds.read_region(fd, s.kv_offset, ds.layer_specs(layers, s.n)[0], s.kv_digest, "K/V"))
            except ds.SegmentError as err:
                tier.log(f"disk cache: {e.path.name}: {err}; falling back to its last whole segment")
                # no segment from here on restores: the index ends before it, so the next write cuts it off
                e.bounds, e.tokens = e.bounds[:j], e.tokens[:s.start]
                break
        while regions and state is None:
            s = segs[len(regions) - 1]
            try:
                state = ds.read_region(fd, s.state_offset, ds.layer_specs(layers, s.n)[1], s.state_digest, "state")
            except ds.SegmentError as err:
                tier.log(f"disk cache: {e.path.name}: {err}; falling back to the segment before it")
                regions.pop()
                j = len(regions)            # as above: the next write cuts the file before the damaged one
                e.bounds, e.tokens = e.bounds[:j], e.tokens[:s.start]
        end = sum(s.n for s in segs[:len(regions)])
        if not regions or end < min(MIN_PREFIX_REUSE, m):
            raise SessionFileError("no whole segment left")
    except (SessionFileError, ds.SegmentError, OSError, ValueError) as err:
        tier.log(f"disk cache: {e.path.name} dropped ({str(err)[:200]})")
        tier._remove(e, "")
        return None
    finally:
        if fd is not None:
            os.close(fd)
    cache = build(layers, [s.n for s in segs[:len(regions)]], regions, state, make_cache(), tier._probe())
    entry = KVEntry(tokens[:end].tolist(), cache, e.key, messages=list(e.messages) if end == len(e.tokens) else [],
                    owner=e.owner)
    entry.checkpoint()          # the restored point is a message boundary (a later Regenerate/Edit resumes here)
    entry.disk_id = e.id
    entry.restored_from_disk = end
    e.last_used = time.time()
    tier.log(f"disk cache: restored {end} tokens from {e.path.name} (segment {len(regions)} of {len(segs)}: "
             f"windows and recurrent states) in {(time.perf_counter() - t0) * 1e3:.1f} ms")
    return entry, end


def build(layers: list, ns: list[int], regions: list[list[np.ndarray]], state: list[np.ndarray], fresh: list,
          probe: list) -> list:
    """The per-layer caches after sum(ns) tokens from the segments' regions (host arrays), each float
    tensor in this model's dtype (the probe's)."""
    m = sum(ns)
    merged = merge_regions(layers, ns, regions)
    kv_it, st_it = iter(merged), iter(state)
    out = []
    for d, c, ref in zip(layers, fresh, probe):
        kind = layer_cache.kind_of(c)
        refs = [a for a in (ref.cache if kind.name == "arrays" else kind.state(ref)) if a is not None]
        it = st_it if kind.name == "arrays" else kv_it
        ts = []
        for x, r in zip([x for x in d["t"] if x is not None], refs):
            a = to_device(np.ascontiguousarray(next(it)))     # CUDA: one DMA, no managed-memory faults
            if x[0] == "BF16":
                a = a.view(mx.bfloat16)
            ts.append(a.astype(r.dtype) if a.dtype != r.dtype else a)
        if kind.name == "kv":
            meta = {"offset": m}
        elif kind.name == "kv_quant":
            meta = {"offset": m, "group_size": d["group"], "bits": d["bits"]}
        elif kind.name == "rotating":
            w = int(ts[0].shape[2])
            meta = {"offset": m, "keep": 0, "max_size": d["max_size"], "idx": w}
        else:
            meta = {"size": len(d["t"]), "present": [x is not None for x in d["t"]]}
        out.append(kind.from_state(ts, meta))
    mx.eval(layer_cache.arrays(out))
    return out
