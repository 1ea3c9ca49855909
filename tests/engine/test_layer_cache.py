"""The cache contract (engine/cache/layer_cache.py) on synthetic caches of each kind: mlx-lm's own cache
classes, filled through their own update paths (update_and_fetch for K/V, the slot writes a
recurrent layer makes for ArraysCache) with random tensors.

What is checked, per kind: bytes, how far back it can be cut (full and quantized K/V: to 0; a sliding
window: to anything while offset <= max_size, to nothing once wrapped; a recurrent state: to nothing),
prefix copies, checkpoint/restore (a restored cache fed the same later tokens ends bit-identical to
the one that never went back), the file state round trip, and speculation's rollback."""
from __future__ import annotations

import re

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import ArraysCache, KVCache, RotatingKVCache

from engine.cache import layer_cache as L
from engine.cache.kv_format import half_scale_cache_class
from engine.cache.parking import KVEntry

HEADS, DIM = 2, 32


def _kv(n: int, seed: int):
    rng = np.random.default_rng(seed)
    k = mx.array(rng.standard_normal((1, HEADS, n, DIM)).astype(np.float32))
    v = mx.array(rng.standard_normal((1, HEADS, n, DIM)).astype(np.float32))
    return k, v


def feed(c, start: int, n: int, *, one_by_one: bool = True) -> None:
    """Feed tokens start..start+n (token t's K/V is a function of t only, as a model's would be of
    its position and prefix): one at a time (decode's in-place path) or as one chunk (prefill's)."""
    if isinstance(c, ArraysCache):
        for t in range(start, start + n):   # a toy recurrence: state' = 0.5 state + x_t; conv = last x
            x, _ = _kv(1, 1000 + t)
            c[1] = x if c[1] is None else 0.5 * c[1] + x
            c[0] = x
        mx.eval([a for a in c.cache if a is not None])
        return
    steps = [(t, 1) for t in range(start, start + n)] if one_by_one else [(start, n)]
    for t, m in steps:
        ks, vs = zip(*[_kv(1, 1000 + i) for i in range(t, t + m)])
        c.update_and_fetch(mx.concatenate(ks, axis=2), mx.concatenate(vs, axis=2))
    mx.eval(L.kind_of(c).arrays(c))


def view(c) -> list[np.ndarray]:
    """What attention (or the recurrence) reads: K/V in temporal order, or the state arrays."""
    if isinstance(c, ArraysCache):
        return [np.array(a) for a in c.cache if a is not None]
    if isinstance(c, RotatingKVCache):
        # the window's last max_size tokens in order (a multi-token update may hold up to
        # max_size + S - 1; the mask limits attention to the window either way)
        k, v = c._temporal_order(c.keys), c._temporal_order(c.values)
        if c.offset > c.max_size:
            return [np.array(k[..., -c.max_size:, :]), np.array(v[..., -c.max_size:, :])]
        return [np.array(k[..., :c.offset, :]), np.array(v[..., :c.offset, :])]
    if isinstance(c.keys, tuple):
        return [np.array(x[..., :c.offset, :]) for x in (*c.keys, *c.values)]
    return [np.array(c.keys[..., :c.offset, :]), np.array(c.values[..., :c.offset, :])]


def same(a, b) -> bool:
    va, vb = view(a), view(b)
    return len(va) == len(vb) and all(x.shape == y.shape and np.array_equal(x, y) for x, y in zip(va, vb))


MAKERS = {
    "kv": lambda: KVCache(),
    "kv_quant": lambda: half_scale_cache_class()(group_size=32, bits=8),
    "rotating": lambda: RotatingKVCache(max_size=8),
    "arrays": lambda: ArraysCache(2),
}


def test_adapter_table_names_each_kind():
    for name, make in MAKERS.items():
        assert L.kind_of(make()).name == name
    with pytest.raises(Exception, match="not one Strata knows"):
        L.kind_of(object())


@pytest.mark.parametrize("name", ["kv", "kv_quant", "rotating"])
def test_bytes_are_the_buffers_held(name):
    c = MAKERS[name]()
    assert L.nbytes([c]) == 0
    feed(c, 0, 5)
    arrays = [c.keys, c.values] if name != "kv_quant" else [*c.keys, *c.values]
    assert L.nbytes([c]) == sum(a.nbytes for a in arrays) > 0
    assert L.nbytes([c]) == c.nbytes           # mlx-lm's own count agrees


def test_recurrent_bytes_are_its_state():
    c = ArraysCache(2)
    feed(c, 0, 3)
    assert L.nbytes([c]) == c[0].nbytes + c[1].nbytes == 2 * HEADS * DIM * 4


@pytest.mark.parametrize("name", ["kv", "kv_quant"])
def test_full_kv_trims_to_any_prefix_and_takes_no_checkpoints(name):
    c = MAKERS[name]()
    feed(c, 0, 40)
    assert L.floor([c], 40) == 0 and not L.needs_checkpoints([c])
    cks = []
    L.add_checkpoint(cks, [c], 40)
    assert cks == []                           # full K/V: trim is free, no checkpoint is ever taken
    cache, m = L.rewind([c], 40, 7, cks, lambda: [MAKERS[name]()])
    assert m == 7 and cache[0] is c and c.offset == 7
    feed(c, 7, 10)
    ref = MAKERS[name]()
    feed(ref, 0, 17)
    assert same(c, ref)


def test_rotating_trims_until_it_wraps_then_not_at_all():
    c = RotatingKVCache(max_size=8)
    feed(c, 0, 8)                              # exactly full: nothing overwritten yet
    assert L.floor([c], 8) == 0
    cache, m = L.rewind([c], 8, 3, [], lambda: [RotatingKVCache(8)])
    assert m == 3
    feed(c, 3, 4)
    ref = RotatingKVCache(8)
    feed(ref, 0, 7)
    assert same(c, ref)
    feed(c, 7, 5)                              # 12 > 8: the ring has overwritten tokens 0..3
    assert L.floor([c], 12) == 12
    with pytest.raises(ValueError, match="wrapped"):
        L.kind_of(c).trim_to(c, 12, 11)
    assert L.kind_of(c).copy_prefix(c, 5) is None
    fresh = [RotatingKVCache(8)]
    cache, m = L.rewind([c], 12, 10, [], lambda: fresh)
    assert m == 0 and cache is fresh           # no checkpoint: read again from scratch, never wrong


@pytest.mark.parametrize("one_by_one", [True, False])
def test_rotating_checkpoint_restore_continues_identically(one_by_one):
    c = RotatingKVCache(max_size=8)
    cks: list = []
    feed(c, 0, 6, one_by_one=one_by_one)
    L.add_checkpoint(cks, [c], 6)
    feed(c, 6, 9, one_by_one=one_by_one)       # 15: wrapped
    L.add_checkpoint(cks, [c], 15)
    feed(c, 15, 4, one_by_one=one_by_one)      # 19
    ref = RotatingKVCache(max_size=8)
    feed(ref, 0, 19, one_by_one=one_by_one)
    assert same(c, ref)
    # an edit at token 12: the latest checkpoint at or before is 6
    cache, m = L.rewind([c], 19, 12, cks, lambda: [RotatingKVCache(8)])
    assert m == 6 and [k.n for k in cks] == [6]
    feed(cache[0], 6, 13, one_by_one=one_by_one)
    assert same(cache[0], ref)
    # the checkpoint was not written through by the restored cache's in-place updates
    again, m2 = L.rewind(cache, 19, 12, cks, lambda: [RotatingKVCache(8)])
    assert m2 == 6 and np.array_equal(view(again[0])[0], view(_fed(RotatingKVCache(8), 6, one_by_one))[0])


def _fed(c, n, one_by_one=True):
    feed(c, 0, n, one_by_one=one_by_one)
    return c


def test_recurrent_cannot_trim_and_resumes_from_a_checkpoint():
    c = ArraysCache(2)
    cks: list = []
    feed(c, 0, 10)
    assert L.floor([c], 10) == 10 and L.needs_checkpoints([c])
    L.add_checkpoint(cks, [c], 10)
    feed(c, 10, 10)
    L.add_checkpoint(cks, [c], 20)
    feed(c, 20, 5)
    with pytest.raises(ValueError, match="recurrent"):
        L.kind_of(c).trim_to(c, 25, 24)
    assert L.kind_of(c).copy_prefix(c, 24) is None
    # regenerate at 20 (exactly a checkpoint), then an edit at 15 (the one at 10)
    cache, m = L.rewind([c], 25, 20, cks, lambda: [ArraysCache(2)])
    assert m == 20
    feed(cache[0], 20, 5)
    assert same(cache[0], _fed(ArraysCache(2), 25))
    cache, m = L.rewind(cache, 25, 15, cks, lambda: [ArraysCache(2)])
    assert m == 10 and [k.n for k in cks] == [10]
    feed(cache[0], 10, 15)
    assert same(cache[0], _fed(ArraysCache(2), 25))
    fresh = [ArraysCache(2)]
    cache, m = L.rewind(cache, 25, 5, cks, lambda: fresh)
    assert m == 0 and cache is fresh and cks == []


def test_checkpoints_are_capped_and_counted_in_the_entry_bytes():
    cache = [KVCache(), ArraysCache(2), RotatingKVCache(8)]     # a hybrid model's layer mix
    entry = KVEntry([], cache, "k")
    for turn in range(L.MAX_CHECKPOINTS + 2):
        for c in cache:
            feed(c, len(entry.tokens), 5)
        entry.tokens = entry.tokens + list(range(5))
        entry.checkpoint()
    assert [k.n for k in entry.checkpoints] == [5 * (i + 3) for i in range(L.MAX_CHECKPOINTS)]
    ck = entry.checkpoints[-1]
    assert sorted(ck.layers) == [1, 2]         # the full K/V layer is trimmed, never copied
    assert ck.nbytes == L.nbytes(cache[1:])     # the state + the window as they were
    assert entry.nbytes() == L.nbytes(cache) + sum(k.nbytes for k in entry.checkpoints)
    # the full K/V layer of a hybrid is trimmed to the checkpoint while the others are restored
    m = entry.rewind(27, lambda: [KVCache(), ArraysCache(2), RotatingKVCache(8)])
    assert m == 25 and entry.cache[0].offset == 25 and len(entry.tokens) == 25
    ref = [KVCache(), ArraysCache(2), RotatingKVCache(8)]
    for c in ref:
        feed(c, 0, 25)
    assert all(same(a, b) for a, b in zip(entry.cache, ref))


def test_prefix_copy_of_a_hybrid_uses_the_checkpoint_and_leaves_the_source_whole():
    make = lambda: [KVCache(), ArraysCache(2)]  # noqa: E731
    src = make()
    cks: list = []
    for c in src:
        feed(c, 0, 12)
    L.add_checkpoint(cks, src, 12)
    for c in src:
        feed(c, 12, 8)
    before = [view(c) for c in src]
    copy, m, kept = L.copy_prefix(src, 20, 16, cks, make)
    assert m == 12 and [k.n for k in kept] == [12]
    ref = make()
    for c in ref:
        feed(c, 0, 12)
    assert all(same(a, b) for a, b in zip(copy, ref))
    assert all(all(np.array_equal(x, y) for x, y in zip(view(c), b)) for c, b in zip(src, before))
    copy, m, kept = L.copy_prefix(src, 20, 8, cks, make)
    assert m == 0 and kept == []


@pytest.mark.parametrize("name", list(MAKERS))
def test_state_round_trip(name):
    c = MAKERS[name]()
    feed(c, 0, 13 if name != "rotating" else 11)
    states = L.to_states([c])
    assert states[0].kind == name
    back = L.from_states(states)[0]
    assert type(L.kind_of(back)) is type(L.kind_of(c)) and same(back, c)
    n = 13 if name != "rotating" else 11
    feed(back, n, 3)
    feed(c, n, 3)
    assert same(back, c)


@pytest.mark.parametrize("name", ["rotating", "arrays"])
def test_speculation_rollback_restores_and_replays(name):
    c = MAKERS[name]()
    feed(c, 0, 6)
    snap = L.snapshot([c], 6)
    assert snap is not None
    feed(c, 6, 5, one_by_one=False)            # a verify pass of 5 (wraps the window: 11 > 8)
    cache = [c]
    L.rollback(cache, 11, 3, snap, lambda k: feed(cache[0], 6, k, one_by_one=False))
    ref = MAKERS[name]()
    feed(ref, 0, 6)
    feed(ref, 6, 2, one_by_one=False)
    assert same(cache[0], ref)


def test_speculation_rollback_of_full_kv_is_a_trim():
    c = KVCache()
    feed(c, 0, 6)
    assert L.snapshot([c], 6) is None
    feed(c, 6, 5, one_by_one=False)
    L.rollback([c], 11, 3, None, lambda k: pytest.fail("full K/V must not replay"))
    assert c.offset == 8


# ---- session format 3 (engine/session_files/session_v3.py): a hybrid conversation's file round trip and refusals ----
import json  # noqa: E402
import struct  # noqa: E402

import xxhash  # noqa: E402

from engine.session_files import session_v3, sessions  # noqa: E402
from engine.errors import SessionFileError  # noqa: E402

FP = {"model_hash": "m" * 16, "architecture": "hybrid", "n_layer": 3, "n_kv_heads": HEADS, "head_dim": DIM,
      "tokenizer": "t", "chat_template": "c", "steering": "none", "steering_vector": "none",
      "kv_format": "float16"}


def hybrid():
    return [KVCache(), ArraysCache(2), RotatingKVCache(max_size=8)]


def _probe():
    cache = hybrid()
    for c in cache:
        feed(c, 0, 1)
    return cache


def _conversation(n: int = 30) -> KVEntry:
    entry = KVEntry([], hybrid(), "k", messages=[{"role": "user", "content": "hi"}])
    for t0 in range(0, n, 10):
        for c in entry.cache:
            feed(c, t0, 10)
        entry.tokens = entry.tokens + list(range(t0, t0 + 10))
        entry.checkpoint()
    return entry


def _save(path, entry):
    return sessions.save(str(path), entry, dict(FP), sync=False)


def _load(path):
    return sessions.load(str(path), dict(FP), hybrid, key="k", n_vocab=100, n_ctx=1000, probe_cache=_probe)


def test_format3_round_trip_keeps_every_layer_and_the_checkpoints(tmp_path):
    entry = _conversation()
    path = tmp_path / "h.stratasession"
    _save(path, entry)
    _, meta, _ = sessions.read_header(str(path))
    assert meta["version"] == "3" and meta["kv_layout"] == session_v3.LAYOUT
    assert [x["kind"] for x in json.loads(meta["layers"])] == ["kv", "arrays", "rotating"]
    assert [c["n"] for c in json.loads(meta["checkpoints"])] == [10, 20]   # 30 is the file's end
    back, result = _load(path)
    assert back.tokens == entry.tokens and result["restored_tokens"] == 30
    assert all(same(a, b) for a, b in zip(back.cache, entry.cache))
    assert [k.n for k in back.checkpoints] == [10, 20, 30]
    # resuming from the file's checkpoint at 10 continues exactly as the live conversation would
    m = back.rewind(15, hybrid)
    assert m == 10
    ref = hybrid()
    for a, b in zip(back.cache, ref):
        feed(b, 0, 25)
        feed(a, 10, 15)
    assert all(same(a, b) for a, b in zip(back.cache, ref))


def test_full_kv_conversations_keep_format_2(tmp_path):
    entry = KVEntry(list(range(12)), [KVCache() for _ in range(3)], "k", messages=[])
    for c in entry.cache:
        feed(c, 0, 12)
    assert not session_v3.needed(entry.cache)
    _save(tmp_path / "f.stratasession", entry)
    assert sessions.read_header(str(tmp_path / "f.stratasession"))[1]["version"] == "2"


def _rewrite(path, edit) -> None:
    """Edit a file's metadata and recompute its checksum (a crafted file: only validation stops it)."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    head = json.loads(raw[8:8 + n])
    edit(head["__metadata__"], head)
    head["__metadata__"]["checksum"] = "0" * 32
    hb = json.dumps(head, separators=(",", ":")).encode()
    hb += b" " * (-len(hb) % 8)
    body = raw[8 + n:]
    d = xxhash.xxh3_128()
    d.update(struct.pack("<Q", len(hb)))
    d.update(hb)
    d.update(body)
    hb = hb.replace(b"0" * 32, d.hexdigest().encode(), 1)
    path.write_bytes(struct.pack("<Q", len(hb)) + hb + body)


def _layers(edit):
    def f(meta, head):
        layers = json.loads(meta["layers"])
        edit(layers)
        meta["layers"] = json.dumps(layers)
    return f


REFUSALS = {
    "flipped byte": (lambda p: p.write_bytes(p.read_bytes()[:-5] + b"\x01" + p.read_bytes()[-4:]), "checksum mismatch"),
    "truncated": (lambda p: p.write_bytes(p.read_bytes()[:-7]), "truncated"),
    "layer kind": (lambda p: _rewrite(p, _layers(lambda ls: ls[1].update(kind="kv"))),
                   "layer 1 holds a kv cache; this model's is arrays"),
    "window size": (lambda p: _rewrite(p, _layers(lambda ls: ls[2]["meta"].update(max_size=16))),
                    "layer 2's window is 16 tokens; this model's is 8"),
    "offset": (lambda p: _rewrite(p, _layers(lambda ls: ls[0]["meta"].update(offset=29))), "layer 0 holds 29 of 30"),
    "layer count": (lambda p: _rewrite(p, _layers(lambda ls: ls.pop())), "holds 2 layers; this model has 3"),
    "checkpoint order": (lambda p: _rewrite(p, lambda m, h: m.update(checkpoints=json.dumps(
        [dict(c, n=10) for c in json.loads(m["checkpoints"])]))), "corrupted (checkpoint 1)"),
    "checkpoint past the end": (lambda p: _rewrite(p, lambda m, h: m.update(checkpoints=json.dumps(
        [dict(c, n=30 if c["n"] == 20 else c["n"]) for c in json.loads(m["checkpoints"])]))),
        "corrupted (checkpoint 1)"),
    "state shape": (lambda p: _rewrite(p, lambda m, h: h["L1.0"].update(shape=[1, 1, HEADS, 2 * DIM]) or None),
                    "corrupted"),
    "future version": (lambda p: _rewrite(p, lambda m, h: m.update(version="4")), "newer than this Strata reads (3)"),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_format3_refusals(tmp_path, case):
    path = tmp_path / "h.stratasession"
    _save(path, _conversation())
    damage, why = REFUSALS[case]
    damage(path)
    with pytest.raises(SessionFileError, match=re.escape(why)):
        _load(path)
