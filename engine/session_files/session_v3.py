"""Session file format 3: any mix of layer caches (engine/cache/layer_cache.py), each layer's kind and tensors
named in the header.

Which format a save writes: a conversation whose every layer is full K/V (16-bit `kv`, or the engine's
quantized `kv_quant` throughout) is written in format 2 as before (engine/session_files/sessions.py,
engine/session_files/session_quant.py: their tuned CPU/GPU paths, byte for byte the files earlier Strata wrote); one
with any other layer (a sliding window, a recurrent state: Gemma 3/4, gpt-oss, Qwen3.5) in format 3.
Both formats restore (sessions.load reads the version and hands a format-3 file here).

Container: the same as format 2 (safetensors: an 8-byte little-endian header length, a JSON header whose
first entry is `__metadata__` and whose first field is `checksum`, xxh3-128 over EVERY byte of the file
with its own 32 digits read as zeros), `version` "3", `kv_layout` "strata-layers-3", and one more
metadata field, `layers`: a JSON list, one object per layer in order,
    {"kind": "kv" | "kv_quant" | "rotating" | "arrays", "meta": {...}, "tensors": ["L3.0", "L3.1"]}
`meta` is the kind's meta_state (kv: offset; kv_quant: offset, group_size, bits; rotating: offset, keep,
max_size, idx; arrays: size, present). Tensors in file order: `tokens` (int32, n), then each layer's
state tensors `L<layer>.<j>` exactly as the cache holds them (float32 on the CPU, float16 on a GPU,
bfloat16 as its bits, uint32 codes): a restored conversation continues bit for bit as the live one.
Then the conversation's checkpoints (engine/cache/layer_cache.py), metadata `checkpoints`: a JSON list of
    {"n": tokens, "layers": [{"layer": 3, "kind": ..., "meta": ..., "tensors": ["C0.L3.0", ...]}]}
holding only the layers that cannot trim (each as its state after n tokens), tensors `C<k>.L<layer>.<j>`
after the layers': a follow-up whose template re-renders the last reply (sharing less than the file
holds) resumes from one of them instead of reading the whole conversation again.

Reading validates every field before anything is allocated: the header's types and ranges, the layer
list against this model's own cache (the same kinds in the same order; for full and windowed K/V the
head count and width, for recurrent states the exact shapes, both taken from a one-token probe of the
loaded model), each kind's meta against the token count (a K/V layer's offset is n; a window's kept
length is n, or between its size and n once wrapped; its write index inside it), the tensor table
equal to the one those give, the file's size; then the memory guard, then the reads (hashed in file
order), the checksum, the token ids, and finite values. Refusals are one-line SessionFileErrors, as in
format 2. The write is format 2's: a locked temporary file beside the target, fsync, rename.
"""
from __future__ import annotations

import json
import os
import re
import struct
import time
import weakref
from pathlib import Path
from typing import Callable

import mlx.core as mx
import numpy as np
import xxhash

from engine.cache import layer_cache
from engine.session_files import session_container as S
from engine.errors import SessionFileError

VERSION = 3
LAYOUT = "strata-layers-3"
# safetensors dtype name -> (numpy dtype of the stored bytes, the MLX dtype)
_DT = {"F32": (np.dtype("<f4"), mx.float32), "F16": (np.dtype("<f2"), mx.float16),
       "BF16": (np.dtype("<u2"), mx.bfloat16), "U32": (np.dtype("<u4"), mx.uint32),
       "I32": (np.dtype("<i4"), mx.int32)}
_NAME_OF = {mx.float32: "F32", mx.float16: "F16", mx.bfloat16: "BF16", mx.uint32: "U32", mx.int32: "I32"}
_FLOAT = ("F32", "F16", "BF16")
_META_KEYS = {"kv": {"offset"}, "kv_quant": {"offset", "group_size", "bits"},
              "rotating": {"offset", "keep", "max_size", "idx"}, "arrays": {"size", "present"}}


def needed(cache: list) -> bool:
    """Whether a conversation's cache needs format 3 (some layer is not full K/V of one kind)."""
    kinds = {layer_cache.kind_of(c).name for c in cache}
    return not (kinds == {"kv"} or kinds == {"kv_quant"})


# ---- the model's own layer shapes: a one-token probe ---------------------------------------------
_PROBES: dict = {}


def probe(model, make_cache: Callable[[], list]) -> list:
    """This model's cache after one token (kinds, head counts, widths, state shapes), kept per model."""
    held = _PROBES.get(id(model))
    if held is not None and held[0]() is model:
        return held[1]
    cache = make_cache()
    model(mx.array([[0]]), cache=cache)
    mx.eval(layer_cache.arrays(cache))
    _PROBES.clear()
    _PROBES[id(model)] = (weakref.ref(model), cache)
    return cache


# ---- save ----------------------------------------------------------------------------------------
def _host(a: mx.array) -> np.ndarray:
    if a.dtype == mx.bfloat16:
        a = a.view(mx.uint16)
    return np.ascontiguousarray(np.array(a))


def save(final: Path, entry, fingerprint: dict, *, t0: float, sync: bool, force: bool, progress=None,
         log: Callable[[str], None] = lambda s: None) -> dict:
    n = len(entry.tokens)
    states = layer_cache.to_states(entry.cache)
    bad = n == 0 or any(s.meta.get("offset", n) != n for s in states) or any(
        s.kind == "arrays" and not any(s.meta["present"]) for s in states)
    if bad or any(a.dtype not in _NAME_OF for s in states for a in s.tensors):
        raise SessionFileError("cannot save the session: the conversation's K/V does not match the model")
    specs, off, layers = [S.TensorSpec("tokens", "I32", (n,), 0, n * 4)], n * 4, []
    for i, s in enumerate(states):
        names = []
        for j, a in enumerate(s.tensors):
            nbytes = a.size * _DT[_NAME_OF[a.dtype]][0].itemsize
            specs.append(S.TensorSpec(f"L{i}.{j}", _NAME_OF[a.dtype], tuple(a.shape), off, off + nbytes))
            names.append(f"L{i}.{j}")
            off += nbytes
        layers.append({"kind": s.kind, "meta": s.meta, "tensors": names})
    arrays = [a for s in states for a in s.tensors]
    # The conversation's checkpoints (engine/cache/layer_cache.py) go with it: a follow-up whose template
    # re-renders the last reply shares less than the file holds, and resumes from one of these.
    cks = []
    for k, ck in enumerate(c for c in entry.checkpoints if c.n < n):
        entries = []
        for i in sorted(ck.layers):
            kind = layer_cache.kind_of(entry.cache[i])
            c = kind.restore(ck.layers[i])
            ts, names = kind.state(c), []
            for j, a in enumerate(ts):
                nbytes = a.size * _DT[_NAME_OF[a.dtype]][0].itemsize
                specs.append(S.TensorSpec(f"C{k}.L{i}.{j}", _NAME_OF[a.dtype], tuple(a.shape), off, off + nbytes))
                names.append(f"C{k}.L{i}.{j}")
                off += nbytes
            arrays.extend(ts)
            entries.append({"layer": i, "kind": kind.name, "meta": kind.meta_state(c), "tensors": names})
        cks.append({"n": ck.n, "layers": entries})
    prof = S.SaveProfile()

    def body(fd: int, digest) -> None:
        for k, a in enumerate(arrays):
            t = time.perf_counter()
            host = _host(a)
            prof.cast_ms += (time.perf_counter() - t) * 1e3
            t = time.perf_counter()
            digest.update(host)
            prof.checksum_ms += (time.perf_counter() - t) * 1e3
            S._write_all(fd, host, prof)
            if progress:
                progress(k + 1, len(arrays))

    return S.write_session(final, entry, fingerprint, specs, fingerprint.get("kv_format", S.KV_DTYPE), LAYOUT,
                           body, t0=t0, prof=prof, sync=sync, force=force, log=log, version=VERSION,
                           extra={"layers": json.dumps(layers, separators=(",", ":")),
                                  "checkpoints": json.dumps(cks, separators=(",", ":"))})


# ---- read ----------------------------------------------------------------------------------------
def _int(v, lo: int, hi: int) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and lo <= v <= hi


def _expected_tensors(name: str, i: int, layer: dict, ref, n: int, prefix: str = "") -> list[tuple[str, tuple, tuple]]:
    """[(tensor name, shape, allowed dtype names)] of layer i as the file says, checked against this
    model's probe layer `ref` and the token count n; SessionFileError on any mismatch."""
    kind, meta = layer.get("kind"), layer.get("meta")
    k = layer_cache.kind_of(ref)
    if kind != k.name:
        raise SessionFileError(f"{name}: layer {i} holds a {str(kind)[:20]} cache; this model's is {k.name}")
    if not isinstance(meta, dict) or set(meta) != _META_KEYS[kind]:
        raise SessionFileError(f"{name} is corrupted (layer {i}'s facts)")
    refs = k.state(ref)
    want_dt = [_NAME_OF.get(a.dtype) for a in refs]
    if kind in ("kv", "kv_quant", "rotating") and meta["offset"] != n:
        raise SessionFileError(f"{name} is corrupted (layer {i} holds {meta['offset']!r} of {n} tokens)")
    if kind == "kv":
        shapes = [(1, a.shape[1], n, a.shape[3]) for a in refs]
        dts = [_FLOAT] * 2
    elif kind == "kv_quant":
        if meta["group_size"] != ref.group_size or meta["bits"] != ref.bits:
            raise SessionFileError(f"{name}: layer {i} is {meta['bits']!r}-bit K/V in groups of "
                                   f"{meta['group_size']!r}; this engine's is {ref.bits}-bit in groups of {ref.group_size}")
        shapes = [(1, a.shape[1], n, a.shape[3]) for a in refs]
        dts = [(d,) for d in want_dt]
    elif kind == "rotating":
        if meta["max_size"] != ref.max_size or meta["keep"] != ref.keep:
            raise SessionFileError(f"{name}: layer {i}'s window is {meta['max_size']!r} tokens; this model's is "
                                   f"{ref.max_size}")
        kept = layer.get("_kept")
        if not (_int(kept, 1, n) and (kept == n or kept >= ref.max_size)) or not _int(meta["idx"], 0, kept):
            raise SessionFileError(f"{name} is corrupted (layer {i}'s window)")
        shapes = [(1, a.shape[1], kept, a.shape[3]) for a in refs]
        dts = [_FLOAT] * 2
    else:
        present = meta["present"]
        ref_present = [a is not None for a in ref.cache]
        if meta["size"] != len(ref.cache) or present != ref_present:
            raise SessionFileError(f"{name}: layer {i}'s recurrent state does not match this model's")
        shapes = [tuple(a.shape) for a in refs]
        dts = [_FLOAT] * len(refs)
    names = layer.get("tensors")
    if not isinstance(names, list) or names != [f"{prefix}L{i}.{j}" for j in range(len(shapes))]:
        raise SessionFileError(f"{name} is corrupted (layer {i}'s tensors)")
    return list(zip(names, shapes, dts))


def parse(name: str, raw: bytes, size: int, meta: dict, table: dict, expected: dict, ref_cache: list,
          n_vocab: int, n_ctx: int):
    """The format-3 header validated completely (before any allocation): (ParsedHeader, layers)."""
    S.check_fingerprint(name, meta, expected)
    S.check_layout(name, meta, str(expected.get("kv_format", S.KV_DTYPE)), LAYOUT)
    n = S.token_count(name, meta, n_ctx)
    try:
        layers = json.loads(meta.get("layers", ""))
    except (ValueError, RecursionError):
        raise SessionFileError(f"{name} is corrupted (its layer list is not JSON)") from None
    if not isinstance(layers, list) or not all(isinstance(x, dict) for x in layers):
        raise SessionFileError(f"{name} is corrupted (its layer list)")
    if len(layers) != len(ref_cache):
        raise SessionFileError(f"{name} holds {len(layers)} layers; this model has {len(ref_cache)}")
    # A window's kept length is read from its tensor table entry (checked against the rules above).
    specs, off = [S.TensorSpec("tokens", "I32", (n,), 0, n * 4)], n * 4
    for i, (layer, ref) in enumerate(zip(layers, ref_cache)):
        _layer_specs(name, table, i, layer, ref, n, "", specs)
    cks = _parse_checkpoints(name, meta, table, ref_cache, n, specs)
    messages = S.check_table_and_tail(name, table, specs, raw, size, meta, "its layers")
    return S.ParsedHeader(n, specs, meta, messages, raw, 8 + len(raw)), layers, cks


def _layer_specs(name: str, table: dict, i: int, layer: dict, ref, n: int, prefix: str, specs: list) -> None:
    """Layer i's tensors (`prefix`: a checkpoint's) appended to specs, each type checked, offsets following
    the last spec. A window's kept length is read from its first tensor's table entry."""
    if layer.get("kind") == "rotating":
        t = table.get(f"{prefix}L{i}.0")
        shape = t.get("shape") if isinstance(t, dict) else None
        layer["_kept"] = shape[2] if isinstance(shape, list) and len(shape) == 4 else None
    off = specs[-1].end
    for tname, shape, dts in _expected_tensors(name, i, layer, ref, n, prefix=prefix):
        t = table.get(tname)
        dt = t.get("dtype") if isinstance(t, dict) else None
        if dt not in dts:
            raise SessionFileError(f"{name} is corrupted (tensor {tname}'s type)")
        nbytes = int(np.prod(shape)) * _DT[dt][0].itemsize
        specs.append(S.TensorSpec(tname, dt, shape, off, off + nbytes))
        off += nbytes
    layer.pop("_kept", None)


def _parse_checkpoints(name: str, meta: dict, table: dict, ref_cache: list, n: int, specs: list) -> list:
    """The file's checkpoints, validated: at most MAX_CHECKPOINTS, strictly increasing token counts
    below n, each holding exactly this model's non-trimmable layers (their tensors appended to specs)."""
    try:
        cks = json.loads(meta.get("checkpoints", "[]"))
    except (ValueError, RecursionError):
        raise SessionFileError(f"{name} is corrupted (its checkpoints are not JSON)") from None
    want_layers = [i for i, c in enumerate(ref_cache) if not layer_cache.kind_of(c).trims_freely]
    if not isinstance(cks, list) or len(cks) > layer_cache.MAX_CHECKPOINTS:
        raise SessionFileError(f"{name} is corrupted (its checkpoints)")
    last = 0
    for k, ck in enumerate(cks):
        if not isinstance(ck, dict) or set(ck) != {"n", "layers"} or not _int(ck["n"], last + 1, n - 1) \
                or not isinstance(ck["layers"], list) or not all(isinstance(x, dict) for x in ck["layers"]) \
                or [x.get("layer") for x in ck["layers"]] != want_layers:
            raise SessionFileError(f"{name} is corrupted (checkpoint {k})")
        last = ck["n"]
        for layer in ck["layers"]:
            _layer_specs(name, table, layer["layer"], layer, ref_cache[layer["layer"]], ck["n"], f"C{k}.", specs)
    return cks


def load(path: str, expected: dict, make_cache: Callable[[], list], *, key: str, probe_cache: Callable[[], list],
         dtype=None, n_vocab: int = 1 << 31, n_ctx: int = 1 << 31, admit=None, progress=None,
         log: Callable[[str], None] = lambda s: None, image_span: int = 0):
    t0 = time.perf_counter()
    prof = S.RestoreProfile(cast="as stored (format 3)")
    p = Path(path).expanduser()
    name = p.name
    fd = S._open_regular(p)
    try:
        size = os.fstat(fd).st_size
        raw = S._read_raw_header(name, fd, size)
        if not raw.startswith(S._PREFIX) or not re.fullmatch(rb"[0-9a-f]{32}", raw[len(S._PREFIX):len(S._PREFIX) + S._HEX]):
            raise SessionFileError(f"{name} is corrupted (checksum field)")
        table, meta = S._meta_of(name, raw)
        ref_cache = probe_cache()
        hdr, layers, cks = parse(name, raw, size, meta, table, expected, ref_cache, n_vocab, n_ctx)
        n = hdr.n_tokens
        S.check_memory(name, n, sum(s.end - s.start for s in hdr.specs[1:]), admit)
        digest = xxhash.xxh3_128()
        digest.update(struct.pack("<Q", len(raw)))
        digest.update(raw[:len(S._PREFIX)] + S._ZERO + raw[len(S._PREFIX) + S._HEX:])
        prof.header_ms = (time.perf_counter() - t0) * 1e3
        tokens = np.empty(n, np.int32)
        if S._read_hashed(fd, tokens, hdr.data_start, digest, prof) != tokens.nbytes:
            raise SessionFileError(f"{name} is truncated (tensor tokens)")
        arrays = []
        for k, spec in enumerate(hdr.specs[1:]):
            buf = np.empty(spec.shape, _DT[spec.dtype][0])
            if S._read_hashed(fd, buf, hdr.data_start + spec.start, digest, prof) != buf.nbytes:
                raise SessionFileError(f"{name} is truncated (tensor {spec.name})")
            a = mx.array(buf)
            arrays.append(a.view(mx.bfloat16) if spec.dtype == "BF16" else a)
            if progress:
                progress(k + 1, len(hdr.specs) - 1)
    except OSError as e:
        raise SessionFileError(f"cannot read session file {p}: {e.strerror or e}") from None
    finally:
        os.close(fd)
    S.check_read(name, raw, digest, tokens, n_vocab, image_span)
    t = time.perf_counter()
    states, it = [], iter(arrays)
    for layer, ref in zip(layers, ref_cache):
        refs = layer_cache.kind_of(ref).state(ref)
        # float tensors in this engine's dtype (a GPU's float16 file on the CPU's float32, ...)
        ts = [next(it) for _ in layer["tensors"]]
        ts = [a.astype(r.dtype) if a.dtype != r.dtype else a for a, r in zip(ts, refs)]
        states.append(layer_cache.LayerState(layer["kind"], ts, layer["meta"]))
    cache = layer_cache.from_states(states)
    checkpoints = []
    for ck in cks:
        snaps = {}
        for layer in ck["layers"]:
            i = layer["layer"]
            kind = layer_cache.kind_of(ref_cache[i])
            refs = kind.state(ref_cache[i])
            ts = [next(it) for _ in layer["tensors"]]
            ts = [a.astype(r.dtype) if a.dtype != r.dtype else a for a, r in zip(ts, refs)]
            snaps[i] = kind.checkpoint(kind.from_state(ts, layer["meta"]))
        size_ck = sum(a.nbytes for snap in snaps.values() for a in layer_cache.snapshot_arrays(snap))
        checkpoints.append(layer_cache.Checkpoint(ck["n"], snaps, size_ck))
    fresh = make_cache()
    if [layer_cache.kind_of(c).name for c in fresh] != [layer_cache.kind_of(c).name for c in cache]:
        raise SessionFileError(f"{name}: this engine's cache kinds differ from the file's")
    built = layer_cache.arrays(cache) + [a for k in checkpoints for s in k.layers.values()
                                          for a in layer_cache.snapshot_arrays(s)]
    mx.eval(built)
    S.check_finite(name, [a for a in built if a.dtype != mx.uint32], ("tensor",))
    prof.build_ms += (time.perf_counter() - t) * 1e3
    ms = (time.perf_counter() - t0) * 1e3
    log(f"restored {n} tokens from {name} (format 3: {', '.join(sorted({x['kind'] for x in layers}))}) in {ms:.1f} ms")
    entry, result = S.restored(tokens, cache, key, hdr, size, ms, prof)
    entry.checkpoints = checkpoints
    entry.checkpoint()          # the restored point is a message boundary (a later Edit resumes here)
    return entry, result
