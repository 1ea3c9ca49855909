"""Issue 31, the app's side: hostile model-folder files (item 2), chats databases (item 3), the
single-instance channel (item 6) and "Copy into models" (item 8's first case).

Each case asserts a one-line message, bounded time and nothing lost: the files it was given are
untouched (bytes and, where it matters, the name), a database's chats are kept. Each surface also has
a seeded fuzz run (counts printed with -s; the README's Reliability section quotes them); the long
runs are behind the `fuzz_long` marker:

    pytest tests/app/test_hostile_app.py -s                 # default (well under a minute)
    pytest tests/app/test_hostile_app.py -s -m fuzz_long    # long
"""
from __future__ import annotations

import hashlib
import json
import logging
import math
import multiprocessing
import os
import random
import shutil
import socket
import sqlite3
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

import pytest  # noqa: E402

from app_fixtures import LOAD_TIMEOUT_MS, open_window  # noqa: E402
from fuzz_harness import Tally, layout, random_mutant  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
FILE_BOUND_S = 6.0            # one model file's row, with the scan's per-file bound of 5 s


def _one_line(text: str) -> None:
    assert text and "\n" not in text and "Traceback" not in text, text


def _digest(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


# ================================================================ raw GGUF headers (item 2)
def _s(x: str | bytes) -> bytes:
    b = x.encode() if isinstance(x, str) else x
    return struct.pack("<Q", len(b)) + b


def _kv(key: str, vtype: int, payload: bytes) -> bytes:
    return _s(key) + struct.pack("<I", vtype) + payload


def u32(k, v):
    return _kv(k, 4, struct.pack("<I", v))


def i32(k, v):
    return _kv(k, 5, struct.pack("<i", v))


def f32(k, v):
    return _kv(k, 6, struct.pack("<f", v))


def f64(k, v):
    return _kv(k, 12, struct.pack("<d", v))


def text(k, v):
    return _kv(k, 8, _s(v))


def gguf(kvs: list[bytes], n_tensors: int = 0, tail: bytes = b"") -> bytes:
    return b"GGUF" + struct.pack("<IQQ", 3, n_tensors, len(kvs)) + b"".join(kvs) + tail


BASE = [text("general.architecture", "llama"), u32("llama.block_count", 2), u32("llama.embedding_length", 64),
        u32("llama.attention.head_count", 4)]


def _nested(depth: int) -> bytes:
    return _kv("x.nested", 9, struct.pack("<IQ", 9, 1) * depth + struct.pack("<IQ", 4, 0))


HOSTILE_HEADERS = {
    "inf-context": gguf(BASE + [f32("llama.context_length", math.inf)]),
    "inf-width": gguf(BASE[:2] + [f32("llama.embedding_length", math.inf)] + BASE[3:]),
    "nan-heads": gguf(BASE[:3] + [f64("llama.attention.head_count", math.nan)]),
    "negative-context": gguf(BASE + [i32("llama.context_length", -4096)]),
    "negative-kv": gguf(BASE + [i32("llama.attention.key_length", -64), i32("llama.attention.value_length", -64)]),
    "negative-layers": gguf(BASE[:1] + [i32("llama.block_count", -2)] + BASE[2:]),
    "inf-experts": gguf(BASE + [f32("llama.expert_count", math.inf)]),
    "huge-experts": gguf(BASE + [_kv("llama.expert_count", 10, struct.pack("<Q", 1 << 63))]),
    "nested-100000": gguf(BASE + [_nested(100_000)]),
    "nested-2": gguf(BASE + [_nested(1)]),
    "array-count-2^60": gguf(BASE + [_kv("x.arr", 9, struct.pack("<IQ", 4, 1 << 60))]),
    "string-array-2^40": gguf(BASE + [_kv("tokenizer.ggml.tokens", 9, struct.pack("<IQ", 8, 1 << 40))]),
    "string-length-2^62": gguf(BASE + [_kv("x.s", 8, struct.pack("<Q", 1 << 62))]),
    "key-count-2^60": b"GGUF" + struct.pack("<IQQ", 3, 0, 1 << 60),
    "tensor-count-2^40": b"GGUF" + struct.pack("<IQQ", 3, 1 << 40, 0),
    "unknown-type": gguf(BASE + [_kv("x.t", 99, b"")]),
    "arch-as-array": gguf([_kv("general.architecture", 9, struct.pack("<IQ", 4, 0))] + BASE[1:]),
    "bad-magic": b"GGUX" + b"\0" * 60,
    "version-1": b"GGUF" + struct.pack("<IQQ", 1, 0, 0),
    "empty": b"",
    "three-bytes": b"GGU",
    "header-only": b"GGUF" + struct.pack("<I", 3),
    "non-utf8-key": gguf(BASE + [_s(b"\xff\xfe") + struct.pack("<II", 4, 1)]),
    "dims-9": gguf(BASE, 1, _s("t") + struct.pack("<I", 9) + struct.pack("<9Q", *[1] * 9) + struct.pack("<IQ", 0, 0)),
}


@pytest.fixture
def tiny_file(tmp_path_factory, tiny_model):
    return tiny_model


def _folder_with(tmp_path: Path, tiny_model: Path, name: str, make) -> tuple[Path, Path, Path]:
    d = tmp_path / "models"
    d.mkdir(exist_ok=True)
    good = d / "zzz-good.gguf"            # sorts after the bad file: the bad one is met first
    shutil.copyfile(tiny_model, good)
    bad = d / f"aaa-{name}.gguf"
    make(bad)
    return d, good, bad


def _special_cases(tmp_path: Path) -> dict:
    target = tmp_path / "elsewhere"
    target.mkdir(exist_ok=True)
    return {
        "fifo": lambda p: os.mkfifo(p),
        "link-to-dev-zero": lambda p: os.symlink("/dev/zero", p),
        "link-to-dev-urandom": lambda p: os.symlink("/dev/urandom", p),
        "folder": lambda p: p.mkdir(),
        "symlink-loop": lambda p: os.symlink(p.name, p),
        "dangling-link": lambda p: os.symlink(target / "gone.gguf", p),
        "unreadable": lambda p: (p.write_bytes(b"GGUF" + b"\0" * 40), p.chmod(0)),
        "link-to-folder": lambda p: os.symlink(target, p),
    }


def _all_cases(tmp_path):
    cases = {name: (lambda data: (lambda p: p.write_bytes(data)))(data) for name, data in HOSTILE_HEADERS.items()}
    cases.update(_special_cases(tmp_path))
    return cases


def _snapshot(d: Path) -> dict:
    out = {}
    for p in sorted(d.iterdir()):
        st = os.lstat(p)
        out[p.name] = (st.st_mode, st.st_size, st.st_mtime_ns)
    return out


def test_model_folder_hostile_files_listed_with_their_reason(tmp_path, tiny_model):
    """Item 2: each bad file is listed with a one-line reason within the per-file bound, the good model
    beside it is listed as loadable, nothing in the folder changes."""
    from app.model_list import scan_models
    if os.geteuid() == 0:
        pass                       # root reads a chmod 0 file: that case is then a plain corrupt header
    for name, make in _all_cases(tmp_path).items():
        case = tmp_path / name
        case.mkdir()
        d, good, bad = _folder_with(case, tiny_model, name, make)
        before = _snapshot(d)
        t0 = time.monotonic()
        rows = scan_models([d], None)
        took = time.monotonic() - t0
        assert took < FILE_BOUND_S, (name, took)
        by_path = {Path(m.path).name: (m, needs) for m, needs in rows}
        assert set(by_path) == {good.name, bad.name}, (name, by_path)
        m_good, needs_good = by_path[good.name]
        assert not m_good.error and m_good.architecture == "llama" and needs_good[0] != "?", name
        m_bad, _ = by_path[bad.name]
        assert m_bad.error, name
        _one_line(m_bad.error)
        assert _snapshot(d) == before, name
        if name == "unreadable":
            bad.chmod(0o644)


def test_models_estimate_refuses_hostile_headers_exit_2(tmp_path, capsys):
    """`strata models estimate` on each hostile file: exit 2, one line, no traceback, bounded."""
    from engine.frontends.cli import main
    for name, make in _all_cases(tmp_path).items():
        p = tmp_path / f"{name}.gguf"
        make(p)
        box = []
        t = threading.Thread(target=lambda: box.append(main(["models", "estimate", str(p)])), daemon=True)
        t0 = time.monotonic()
        t.start()
        t.join(FILE_BOUND_S * 2)
        assert box, f"{name}: models estimate did not return within {FILE_BOUND_S * 2} s"
        out, err = capsys.readouterr()
        assert box[0] == 2 and out == "", (name, box, out, err)
        _one_line(err.strip())
        assert err.startswith("strata: "), (name, err)
        assert time.monotonic() - t0 < FILE_BOUND_S * 2
        if name == "unreadable":
            p.chmod(0o644)


def test_models_estimate_cli_exit_code(tmp_path):
    """The same through the real entry point: exit 2 and one line (here: +inf context, negative K/V)."""
    for name in ("inf-context", "negative-kv", "nested-100000"):
        p = tmp_path / f"{name}.gguf"
        p.write_bytes(HOSTILE_HEADERS[name])
        proc = subprocess.run([sys.executable, "-m", "engine.frontends.cli", "models", "estimate", str(p)],
                              cwd=REPO, capture_output=True, text=True, timeout=60,
                              env=dict(os.environ, PYTHONPATH=str(REPO)))
        assert proc.returncode == 2 and proc.stdout == "", (name, proc)
        _one_line(proc.stderr.strip())


def test_scan_bounds_a_file_that_reads_forever(tmp_path, tiny_model):
    """The per-file time bound: a file whose read never ends is listed as not read and its reader is
    killed (not left running), the others load."""
    from app import model_scan
    from scan_readers import read_slowly
    d = tmp_path / "models"
    d.mkdir()
    shutil.copyfile(tiny_model, d / "good.gguf")
    (d / "aaa-slow.gguf").write_bytes(b"GGUF")
    rows = model_scan.scan_models([d], None, file_seconds=0.5, reader=read_slowly)
    errors = {Path(m.path).name: m.error for m, _ in rows}
    assert "takes longer than 0.5 s" in errors["aaa-slow.gguf"] and errors["good.gguf"] == ""
    # The slow file's reader is gone: only the worker that read good.gguf is left
    children = [p for p in multiprocessing.active_children() if p.name == "strata-model-read"]
    assert len(children) == 1


def _sparse_gguf_of_huge_strings(path: Path, n_keys: int, key_bytes: int) -> None:
    """A sparse GGUF whose keys are `key_bytes`-long strings (zeros, valid UTF-8): every length fits in
    the file, so a reader that keeps what it reads holds n_keys x key_bytes."""
    with open(path, "wb") as f:
        f.write(b"GGUF" + struct.pack("<IQQ", 3, 0, n_keys))
        for i in range(n_keys):
            f.write(struct.pack("<Q", key_bytes))
            f.write(bytes([65 + i % 26, 48 + i // 26]))     # a distinct start: each key is kept
            f.seek(key_bytes - 2, 1)
            f.write(struct.pack("<IB", 0, 1))              # the value: uint8 1
        f.truncate(f.tell() + 4096)


def _rss_now() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/statm for the app's RSS")
def test_scan_kills_a_reader_that_takes_memory_without_bound(tmp_path, tiny_model):
    """A header whose strings claim 1.5 GiB: the reader is stopped at its memory bound (here 400 MiB),
    the file is listed with the reason, the good model beside it reads, and the app's own memory stays
    where it was (the read happens in the worker process)."""
    from app import model_scan
    d = tmp_path / "models"
    d.mkdir()
    shutil.copyfile(tiny_model, d / "good.gguf")
    _sparse_gguf_of_huge_strings(d / "hog.gguf", n_keys=96, key_bytes=16 << 20)
    peak, base, stop = [0], _rss_now(), threading.Event()

    def watch():
        while not stop.is_set():
            peak[0] = max(peak[0], _rss_now())
            time.sleep(0.02)
    t = threading.Thread(target=watch, daemon=True)
    t.start()
    try:
        rows = model_scan.scan_models([d], None, file_seconds=60, memory_limit=400 << 20)
    finally:
        stop.set()
        t.join()
    errors = {Path(m.path).name: m.error for m, _ in rows}
    assert errors["good.gguf"] == ""
    assert errors["hog.gguf"].startswith("hog.gguf") and "memory" in errors["hog.gguf"], errors
    _one_line(errors["hog.gguf"])
    assert peak[0] - base < 200 << 20, (peak[0] - base) >> 20


def test_engine_list_models_survives_a_symlink_loop(tmp_path, monkeypatch, tiny_model):
    from engine.model import models
    d = tmp_path / "m"
    d.mkdir()
    os.symlink("loop.gguf", d / "loop.gguf")
    os.mkfifo(d / "fifo.gguf")
    shutil.copyfile(tiny_model, d / "good.gguf")
    monkeypatch.setattr(models, "models_dir", lambda: d)
    names = [p.name for p in models.list_models()]
    assert "good.gguf" in names


@pytest.mark.gui
def test_app_loads_the_good_model_beside_bad_files(qtbot, app_home):
    """Item 2's journey: a FIFO named aaa.gguf, a +inf context and 100,000 nested arrays beside the
    model: the list shows all four, the model loads, one message names the bad files."""
    models = app_home / "models"
    os.mkfifo(models / "aaa.gguf")
    (models / "aab-inf.gguf").write_bytes(HOSTILE_HEADERS["inf-context"])
    (models / "aac-nested.gguf").write_bytes(HOSTILE_HEADERS["nested-100000"])
    before = _snapshot(models)
    w = open_window(qtbot)
    try:
        with qtbot.waitSignal(w.library.loaded, timeout=LOAD_TIMEOUT_MS) as blocker:
            w.show()
        assert Path(blocker.args[0]).name == "tiny-llama.gguf"
        assert w.models.tree.topLevelItemCount() == 4
        assert len(w.models.errors) == 3
        for path, why in w.models.errors.items():
            _one_line(why)
        shown = [w.models.tree.topLevelItem(i).text(0) for i in range(4)]
        assert sum("cannot be loaded" in s for s in shown) == 3
        assert "3 files in the model folders cannot be loaded" in w.status.currentMessage() or \
            w.library._told_bad.keys() == w.models.errors.keys()
    finally:
        w.close()
    assert {k: v for k, v in _snapshot(models).items() if not k.startswith(".")} == \
        {k: v for k, v in before.items() if not k.startswith(".")}


def _fuzz_model_files(tiny_model: Path, n: int, seed: int, tmp_path: Path) -> Tally:
    """Seeded mutants of a real GGUF through the model list's row reader (metadata + estimate)."""
    from app import gguf_meta
    from app.model_scan import read_row as _read_row
    from engine.model import memory_estimate
    tally = Tally()
    rng = random.Random(seed)
    original = tiny_model.read_bytes()
    lay = layout(tiny_model)
    cases = [(f"hostile {k}", v) for k, v in HOSTILE_HEADERS.items()]
    cases += [random_mutant(original, lay, rng) for _ in range(n)]
    path = tmp_path / "mutant.gguf"
    slowest = 0.0
    for label, data in cases:
        path.write_bytes(data)
        gguf_meta._cache.clear()
        memory_estimate._HEADERS.clear()
        t0 = time.monotonic()
        try:
            meta, needs = _read_row(path, None)
        except Exception as e:  # noqa: BLE001 -- what the fuzz counts
            tally.add(label, {"outcome": "crash", "detail": f"{type(e).__name__}: {e}"})
            continue
        slowest = max(slowest, time.monotonic() - t0)
        if meta.error or "\n" in needs[1]:
            ok = "\n" not in meta.error
            tally.add(label, {"outcome": "refused" if ok else "multi-line", "detail": meta.error})
        else:
            tally.add(label, {"outcome": "accepted"})
    assert slowest < FILE_BOUND_S, slowest
    return tally


def test_fuzz_model_folder_files(tmp_path, tiny_model):
    tally = _fuzz_model_files(tiny_model, 1500, seed=31, tmp_path=tmp_path)
    print("\n" + tally.line("model-folder files"))
    assert not tally.crashes, "\n".join(tally.crashes[:5])
    assert tally.refused > 0 and tally.accepted > 0


@pytest.mark.fuzz_long
def test_fuzz_model_folder_files_long(tmp_path, tiny_model):
    tally = _fuzz_model_files(tiny_model, 20000, seed=3131, tmp_path=tmp_path)
    print("\n" + tally.line("model-folder files (long)"))
    assert not tally.crashes, "\n".join(tally.crashes[:5])


# ================================================================ chats databases (item 3)
def _good_db(path: Path, n_chats: int = 3) -> list[str]:
    """A Strata database with chats and a preset, written by the Store itself; the chat ids."""
    from app.store import Chat, Store
    st = Store(path)
    ids = []
    for i in range(n_chats):
        c = Chat(title=f"kept {i}", messages=[{"role": "user", "content": f"zebra {i}"},
                                              {"role": "assistant", "content": "stripes"}],
                 config={"preset": "default"})
        st.save_chat(c)
        ids.append(c.id)
    st.save_preset("p1", "Terse", {"temperature": 0.5})
    st.db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    st.close()
    return ids


def _db_digest(path: Path) -> dict:
    return {s: _digest(Path(str(path) + s)) for s in ("", "-wal") if Path(str(path) + s).exists()}


FOREIGN = {
    "chats-without-title": "CREATE TABLE chats (id TEXT PRIMARY KEY, name TEXT, position INTEGER, config TEXT, "
                           "created REAL); INSERT INTO chats VALUES ('a', 'theirs', 0, '{}', 1);",
    "foreign-presets": "CREATE TABLE chats (id TEXT PRIMARY KEY, title TEXT NOT NULL, position INTEGER NOT NULL, "
                       "config TEXT NOT NULL DEFAULT '{}', created REAL NOT NULL); "
                       "CREATE TABLE presets (key TEXT, value BLOB); INSERT INTO presets VALUES ('x', X'00');",
    "chats-is-a-view": "CREATE TABLE t (id, title, position, config, created); "
                       "CREATE VIEW chats AS SELECT * FROM t;",
    "other-tables-only": "CREATE TABLE invoices (id INTEGER PRIMARY KEY, amount REAL); "
                         "INSERT INTO invoices VALUES (1, 9.5);",
    "chats-not-keyed": "CREATE TABLE chats (id TEXT, title TEXT, position INTEGER, config TEXT, created REAL);",
    "fts-of-another-shape": "CREATE TABLE chats (id TEXT PRIMARY KEY, title TEXT NOT NULL, position INTEGER NOT "
                            "NULL, config TEXT NOT NULL DEFAULT '{}', created REAL NOT NULL); "
                            "CREATE TABLE chats_fts (a, b);",
}


def test_foreign_database_left_alone_and_chats_kept_beside(tmp_path):
    """A valid SQLite file of another shape at the chats path: never altered, named in one line; the
    chats go to chats-strata.sqlite3, the same file at the next start."""
    from app.store import Chat, Store
    for name, sql in FOREIGN.items():
        db = tmp_path / name / "chats.sqlite3"
        db.parent.mkdir()
        con = sqlite3.connect(db)
        con.executescript(sql)
        con.commit()
        con.close()
        before = _db_digest(db)
        t0 = time.monotonic()
        st = Store(db)
        assert time.monotonic() - t0 < 5
        _one_line(st.notice)
        assert "is not a Strata chat database" in st.notice and "left as it is" in st.notice, st.notice
        assert st.path.name == "chats-strata.sqlite3" and st.persistent
        assert st.chats() == [] and st.presets() == []
        st.save_chat(Chat(title="mine"))
        st.close()
        assert _db_digest(db) == before, name
        st = Store(db)                            # the next start: the same database beside it
        assert [c.title for c in st.chats()] == ["mine"] and st.path.name == "chats-strata.sqlite3"
        st.close()
        assert _db_digest(db) == before, name
        assert sorted(p.name for p in db.parent.iterdir() if ".corrupt-" in p.name) == []


BAD_VALUES = [
    ("UPDATE presets SET data='1e999'", None),
    ("UPDATE presets SET data='{\"temperature\": 1e999, \"max_tokens\": 1e999}'", None),
    ("UPDATE presets SET data='{\"max_tokens\": 100000000000000000000000000000000000000000000000000000000}'", None),
    ("UPDATE presets SET data='{\"temperature\": NaN, \"top_p\": Infinity, \"system_prompt\": [1]}'", None),
    ("UPDATE presets SET data=?", "[" * 100_000 + "]" * 100_000),
    ("UPDATE presets SET data=X'fffe00', name=X'00ff'", None),
    ("UPDATE presets SET data=7, name=5", None),
    ("UPDATE chats SET config='[1,2]'", None),
    ("UPDATE chats SET config='{\"preset\": [1,2], \"session\": 5, \"speed_projection\": \"yes\"}'", None),
    ("UPDATE chats SET config='{\"session\": \"a\\u0000b\"}'", None),
    ("UPDATE chats SET config=?", '{"a":' * 50_000 + "1" + "}" * 50_000),
    ("UPDATE chats SET title=X'00ff', model=5, created='yesterday', updated='1e999'", None),
    ("UPDATE chats SET title=3.5, open='maybe'", None),
    ("UPDATE messages SET content=X'ff00', role=7", None),
    ("UPDATE messages SET content=12", None),
    ("UPDATE chats SET config=?", "x" * (2 << 20)),
]


def test_bad_values_in_a_strata_database_read_as_defaults(tmp_path):
    """A preset whose data holds 1e999, a chat whose config is [1,2], blobs and numbers where text
    belongs, 100,000-deep JSON: every chat and preset still reads, nothing is raised, nothing moved."""
    from app.presets import Preset
    from app.store import Store
    for i, (sql, arg) in enumerate(BAD_VALUES):
        db = tmp_path / f"v{i}" / "chats.sqlite3"
        db.parent.mkdir()
        ids = _good_db(db)
        con = sqlite3.connect(db)
        con.execute(sql, (arg,) if arg is not None else ())
        con.commit()
        con.close()
        st = Store(db)
        assert st.notice == "" and st.path == db, sql
        chats = st.chats()
        assert sorted(c.id for c in chats) == sorted(ids), sql
        for c in chats:
            assert isinstance(c.title, str) and isinstance(c.config, dict)
            assert all(isinstance(m["content"], str) and isinstance(m["role"], str) for m in c.messages)
            assert isinstance(c.config.get("session", ""), str) and "\x00" not in c.config.get("session", "")
        assert len(st.library()) == len(ids) and isinstance(st.search("zebra"), list)
        for pid, name, data in st.presets():
            p = Preset.from_data(pid, name, data)
            assert all(math.isfinite(v) for v in (p.temperature, p.top_p) if isinstance(v, float))
        st.save_chat(chats[0])                    # and it writes
        st.close()


@pytest.mark.gui
def test_app_starts_on_each_hostile_database(qtbot, app_home):
    """Item 3's start-up cases on the real window: it opens (no traceback, no exit), shows one line
    where something was not as it should be, and the user's file is untouched or copied aside."""
    from app import paths
    db = paths.AppPaths.default().db_path
    cases = [("chats-without-title", FOREIGN["chats-without-title"], "not a Strata chat database"),
             ("foreign-presets", FOREIGN["foreign-presets"], "not a Strata chat database"),
             ("preset-1e999", None, ""), ("config-[1,2]", None, "")]
    for name, sql, expect in cases:
        for p in db.parent.glob("chats*"):
            p.unlink()
        if sql is not None:
            con = sqlite3.connect(db)
            con.executescript(sql)
            con.commit()
            con.close()
        else:
            _good_db(db)
            con = sqlite3.connect(db)
            con.execute("UPDATE presets SET data='1e999'" if name == "preset-1e999" else "UPDATE chats SET config='[1,2]'")
            con.commit()
            con.close()
        before = _db_digest(db)
        w = open_window(qtbot, start_engine=False)
        try:
            if expect:
                _one_line(w.message_bar.text())
                assert expect in w.message_bar.text(), (name, w.message_bar.text())
                assert _db_digest(db) == before
            else:
                assert w.message_bar.text() == "" and w.tabs.count() >= 3, name
            assert len(w.presets.all()) >= 1
        finally:
            w.close()


_LOCKER = r"""
import sqlite3, sys, time
con = sqlite3.connect(sys.argv[1], isolation_level=None)
if sys.argv[2] == "exclusive-mode":
    con.execute("PRAGMA locking_mode=EXCLUSIVE")
con.execute("BEGIN EXCLUSIVE")
con.execute("UPDATE chats SET title=title")
print("locked", flush=True)
sys.stdin.readline()
con.execute("ROLLBACK")
"""


@pytest.mark.parametrize("how", ["write-transaction", "exclusive-mode"])
def test_locked_database_left_alone_and_named(tmp_path, how):
    """A healthy database another process holds locked: never renamed nor replaced; the app starts
    within the busy timeout, says the database is in use, and shows its chats where it can read them."""
    from app.store import Chat, Store
    db = tmp_path / "chats.sqlite3"
    ids = _good_db(db)
    locker = subprocess.Popen([sys.executable, "-c", _LOCKER, str(db), how], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert locker.stdout.readline().strip() == "locked"
        t0 = time.monotonic()
        st = Store(db)
        assert time.monotonic() - t0 < 10
        _one_line(st.notice)
        assert "in use by another program (locked)" in st.notice and "not saved" in st.notice
        assert not st.persistent and st.moved_aside is None
        if how == "write-transaction":              # WAL: readers go on while another process writes
            assert sorted(c.id for c in st.chats()) == sorted(ids)
        st.save_chat(Chat(title="this session"))  # works (in memory), never raises
        st.close()
        assert sorted(p.name for p in tmp_path.iterdir() if ".corrupt" in p.name) == []
    finally:
        locker.stdin.write("\n")
        locker.stdin.flush()
        locker.wait(30)
    st = Store(db)                                # the lock gone: the same file, every chat there
    assert st.notice == "" and sorted(c.id for c in st.chats()) == sorted(ids)
    st.close()


def _corrupt(path: Path, how: str) -> None:
    data = bytearray(path.read_bytes())
    if how == "garbage":
        path.write_bytes(b"definitely not sqlite " * 200)
    elif how == "truncated":
        path.write_bytes(bytes(data[:len(data) // 2 + 100]))
    elif how == "header":
        data[16:24] = b"\xff" * 8              # page size and format bytes
        path.write_bytes(bytes(data))
    elif how == "pages":
        for off in range(4096, len(data), 997):
            data[off] ^= 0x5A
        path.write_bytes(bytes(data))


# A file that is not SQLite at all ("garbage") is another program's, left as it is: test_app_chat_files.py
@pytest.mark.parametrize("how", ["truncated", "header", "pages"])
def test_corrupt_database_copied_aside_and_user_told(tmp_path, how):
    from app.store import Chat, Store
    db = tmp_path / "chats.sqlite3"
    _good_db(db)
    _corrupt(db, how)
    original = db.read_bytes()
    st = Store(db)
    _one_line(st.notice)
    assert st.moved_aside is not None and st.moved_aside.read_bytes() == original
    assert "a copy was kept aside" in st.notice and str(st.moved_aside) in st.notice
    st.save_chat(Chat(title="new"))
    st.close()
    assert Store(db).chats()[0].title == "new"


def test_unusable_database_path_left_alone(tmp_path):
    """The path is a folder (or cannot be opened): left as it is, chats in memory, one line."""
    from app.store import Chat, Store
    db = tmp_path / "chats.sqlite3"
    db.mkdir()
    (db / "keep.txt").write_text("mine")
    st = Store(db)
    _one_line(st.notice)
    assert not st.persistent and "left as it is" in st.notice
    st.save_chat(Chat(title="x"))
    st.close()
    assert (db / "keep.txt").read_text() == "mine"


def _db_mutant(src: bytes, rng: random.Random, path: Path) -> str:
    """One seeded hostile database at `path`: byte damage, hostile values, or a schema change."""
    path.write_bytes(src)
    for s in ("-wal", "-shm"):
        Path(str(path) + s).unlink(missing_ok=True)
    kind = rng.choice(["bytes", "bytes", "values", "values", "values", "schema", "truncate"])
    if kind == "bytes":
        data = bytearray(src)
        for _ in range(rng.randint(1, 12)):
            i = rng.randrange(len(data))
            data[i] = rng.randrange(256)
        path.write_bytes(bytes(data))
        return kind
    if kind == "truncate":
        path.write_bytes(src[:rng.randrange(len(src))])
        return kind
    con = sqlite3.connect(path)
    try:
        if kind == "values":
            hostile = [None, 1e308, -1, 1 << 62, "1e999", "NaN", "[1,2]", "{}", "null", b"\xff\x00", "",
                       "x" * rng.choice([1, 1000, 300_000]), "[" * 5000, '{"preset": {"a": 1}}',
                       '{"temperature": 1e999}', '{"session": "\\u0000"}', "\x00", 3.5, '"text"']
            table, cols = rng.choice([("chats", ["title", "config", "model", "created", "updated", "open",
                                                 "position"]),
                                      ("messages", ["role", "content", "idx"]),
                                      ("presets", ["name", "data", "position"])])
            for _ in range(rng.randint(1, 4)):
                col = rng.choice(cols)
                try:
                    con.execute(f"UPDATE {table} SET {col}=? WHERE rowid IN (SELECT rowid FROM {table} "
                                f"ORDER BY random() LIMIT 1)", (rng.choice(hostile),))
                except sqlite3.Error:
                    pass
        else:
            sql = rng.choice([
                "ALTER TABLE chats RENAME COLUMN title TO name",
                "ALTER TABLE presets RENAME TO old_presets",
                "DROP TABLE messages",
                "DROP TABLE chats_fts",
                "ALTER TABLE messages RENAME COLUMN content TO body",
                "CREATE TABLE extra (a)",
                "DROP TABLE presets; CREATE TABLE presets (a, b)",
                "ALTER TABLE chats RENAME TO c2; CREATE VIEW chats AS SELECT * FROM c2",
                "DELETE FROM chats_fts",
                "DROP TABLE chats; DROP TABLE messages; DROP TABLE presets; DROP TABLE chats_fts",
            ])
            try:
                con.executescript(sql)
            except sqlite3.Error:
                pass
        con.commit()
    finally:
        con.close()
    return kind


def _fuzz_databases(n: int, seed: int, tmp_path: Path) -> Tally:
    from app.presets import Preset
    from app.store import Chat, Store
    tally = Tally()
    rng = random.Random(seed)
    src_path = tmp_path / "src.sqlite3"
    _good_db(src_path, n_chats=4)
    src = src_path.read_bytes()
    for i in range(n):
        d = tmp_path / f"f{i % 4}"
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir()
        db = d / "chats.sqlite3"
        kind = _db_mutant(src, rng, db)
        given = db.read_bytes()
        label = f"db #{i} ({kind})"
        t0 = time.monotonic()
        later: list[str] = []
        try:
            st = Store(db)
            st.on_error = later.append
            st.chats()
            st.library()
            st.search("zebra stripes")
            for pid, name, data in st.presets():
                Preset.from_data(pid, name, data)
            st.save_chat(Chat(title="fuzz", messages=[{"role": "user", "content": "hi"}]))
            st.close()
        except Exception as e:  # noqa: BLE001 -- what the fuzz counts
            tally.add(label, {"outcome": "crash", "detail": f"{type(e).__name__}: {e}"})
            continue
        problem = ""
        if time.monotonic() - t0 > 10:
            problem = "slow"
        elif "\n" in st.notice or any("\n" in m for m in later):
            problem = "multi-line notice"
        elif st.moved_aside is not None and st.moved_aside.read_bytes() != given:
            problem = "the copy aside differs from the file"
        elif st.moved_aside is None and st.path != db and db.read_bytes() != given:
            problem = "a foreign file was altered"
        if problem:
            tally.add(label, {"outcome": "crash", "detail": problem})
        else:
            tally.add(label, {"outcome": "refused" if st.notice or later else "accepted"})
            tally.failed_later = getattr(tally, "failed_later", 0) + bool(later)
    return tally


def test_fuzz_chats_databases(tmp_path):
    tally = _fuzz_databases(300, seed=31, tmp_path=tmp_path)
    print("\n" + tally.line("chats databases").replace("refused", "named (notice)").replace("accepted", "opened")
          + f", {getattr(tally, 'failed_later', 0)} failed after opening (one line)")
    assert not tally.crashes, "\n".join(tally.crashes[:5])
    assert tally.refused > 0 and tally.accepted > 0


@pytest.mark.fuzz_long
def test_fuzz_chats_databases_long(tmp_path):
    tally = _fuzz_databases(2000, seed=3131, tmp_path=tmp_path)
    print("\n" + tally.line("chats databases (long)").replace("refused", "named (notice)").replace("accepted", "opened")
          + f", {getattr(tally, 'failed_later', 0)} failed after opening (one line)")
    assert not tally.crashes, "\n".join(tally.crashes[:5])


# ================================================================ the single-instance channel (item 6)
@pytest.fixture
def channel(qtbot, tmp_path, monkeypatch):
    """A listening SingleInstance of its own data folder; send(bytes) -> (reply, files, activated)."""
    from app import single_instance
    from app.main import make_app
    make_app()
    monkeypatch.setattr(single_instance, "LINE_SECONDS", 1.0)
    inst = single_instance.SingleInstance(tmp_path / "data")
    (tmp_path / "data").mkdir()
    assert inst.acquire() and inst.listen()
    addr = inst.server.fullServerName()
    got: dict = {"files": [], "activated": 0}
    inst.files_received.connect(lambda fs: got["files"].append(fs))
    inst.activated.connect(lambda: got.__setitem__("activated", got["activated"] + 1))

    def send(data: bytes, timeout: float = 5.0, close_write: bool = False):
        got["files"].clear()
        got["activated"] = 0
        box: list = []

        def client():
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.settimeout(timeout)
            try:
                s.connect(addr)
                try:
                    s.sendall(data)
                except OSError:            # the server closed early (a refused over-long line)
                    pass
                reply = b""
                while not reply.endswith(b"\n"):
                    chunk = s.recv(64)
                    if not chunk:
                        break
                    reply += chunk
                box.append(reply)
            except OSError as e:
                box.append(f"error {e}".encode())
            finally:
                s.close()
        t = threading.Thread(target=client, daemon=True)
        t0 = time.monotonic()
        t.start()
        qtbot.waitUntil(lambda: bool(box), timeout=int(timeout * 1000) + 2000)
        qtbot.wait(20)                          # any signal the reply queued
        return box[0], list(got["files"]), got["activated"], time.monotonic() - t0

    yield send
    inst.release()


CHANNEL_HOSTILE = {
    "files-int": b'{"files": 5}\n',
    "files-string": b'{"files": "abcdefghij"}\n',
    "deep-200k": b'{"files": ' + b"[" * 200_000 + b"]" * 200_000 + b"}\n",
    "deep-object": b'{"a":' * 100_000 + b"1" + b"}" * 100_000 + b"\n",
    "not-json": b"hello\n",
    "non-utf8": b'{"files": ["/\xff\xfe"]}\n',
    "array": b"[]\n",
    "null": b"null\n",
    "files-ints": b'{"files": [1, 2]}\n',
    "relative": b'{"files": ["chat.stratasession"]}\n',
    "empty-path": b'{"files": [""]}\n',
    "nul-in-path": b'{"files": ["/tmp/a\\u0000b"]}\n',
    "too-many": (json.dumps({"files": [f"/tmp/{i}" for i in range(1000)]}) + "\n").encode(),
    "empty-line": b"\n",
    "nan": b'{"files": NaN}\n',
}


@pytest.mark.gui
def test_single_instance_channel_refuses_hostile_lines(channel, caplog):
    """{"files": 5}, 200,000-deep JSON, a string for the list (once: ten one-letter files)...: each
    answered "refused" at once, one log line, no file opened, the window not raised."""
    for name, data in CHANNEL_HOSTILE.items():
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="strata.app"):
            reply, files, activated, took = channel(data)
        assert reply == b"refused\n" and files == [] and activated == 0, (name, reply, files)
        assert took < 3, (name, took)
        lines = [r.getMessage() for r in caplog.records if "single instance" in r.getMessage()]
        assert len(lines) == 1, (name, lines)
        _one_line(lines[0])


@pytest.mark.gui
def test_single_instance_channel_bounds_the_line(channel, caplog):
    """No end of line within 1 MiB: refused without holding more; a line that never comes: closed
    after LINE_SECONDS. A valid hand-over still works after them."""
    from app.single_instance import MAX_LINE
    with caplog.at_level(logging.WARNING, logger="strata.app"):
        reply, files, _, took = channel(b"x" * (MAX_LINE + 4096))
        assert reply == b"refused\n" and files == [] and took < 5
        reply, files, _, took = channel(b'{"files": [')
        # closed by the 1 s deadline, not before it; a hang meets the client's 5 s timeout (no reply)
        assert reply == b"refused\n" and files == [] and took > 0.8
    assert sum("single instance" in r.getMessage() for r in caplog.records) == 2
    reply, files, activated, _ = channel(b'{"files": ["/tmp/a.stratasession"]}\n')
    assert reply == b"ok\n" and files == [["/tmp/a.stratasession"]] and activated == 1
    reply, files, activated, _ = channel(b"{}\n")
    assert reply == b"ok\n" and files == [] and activated == 1


def _fuzz_channel(send, n: int, seed: int) -> Tally:
    tally = Tally()
    rng = random.Random(seed)
    atoms = [b"{", b"}", b"[", b"]", b'"files"', b":", b",", b'"/tmp/x"', b"5", b"null", b"true", b'"a"',
             b"\\u0000", b"\xff", b"1e999", b"NaN", b" ", b'"'] + list(CHANNEL_HOSTILE.values())[:4]
    valid = b'{"files": ["/tmp/a.stratasession", "/tmp/b.gguf"]}'
    for i in range(n):
        kind = rng.choice(["atoms", "bytes", "mutate"])
        if kind == "atoms":
            data = b"".join(rng.choice(atoms) for _ in range(rng.randint(1, 30)))
        elif kind == "bytes":
            data = bytes(rng.randrange(256) for _ in range(rng.randint(0, 200)))
        else:
            b = bytearray(valid)
            for _ in range(rng.randint(1, 4)):
                b[rng.randrange(len(b))] = rng.randrange(256)
            data = bytes(b)
        data = data.split(b"\n")[0] + b"\n"
        try:
            msg = json.loads(data)
            expect_ok = (isinstance(msg, dict) and isinstance(msg.get("files", []), list)
                         and all(isinstance(f, str) and f.startswith("/") and "\x00" not in f
                                 for f in msg.get("files", [])))
        except (ValueError, RecursionError):
            expect_ok = False
        reply, files, activated, took = send(data)
        label = f"channel #{i} ({kind}) {data[:60]!r}"
        if took > 3 or reply not in (b"ok\n", b"refused\n"):
            tally.add(label, {"outcome": "crash", "detail": f"{reply!r} after {took:.1f} s"})
        elif (reply == b"ok\n") != expect_ok or (reply == b"refused\n" and (files or activated)):
            tally.add(label, {"outcome": "crash", "detail": f"answered {reply!r}, files {files}"})
        else:
            tally.add(label, {"outcome": "accepted" if reply == b"ok\n" else "refused"})
    return tally


@pytest.mark.gui
def test_fuzz_single_instance_channel(channel):
    tally = _fuzz_channel(channel, 300, seed=31)
    print("\n" + tally.line("single-instance channel"))
    assert not tally.crashes, "\n".join(tally.crashes[:5])
    assert tally.refused > 0


@pytest.mark.gui
@pytest.mark.fuzz_long
def test_fuzz_single_instance_channel_long(channel):
    tally = _fuzz_channel(channel, 3000, seed=3131)
    print("\n" + tally.line("single-instance channel (long)"))
    assert not tally.crashes, "\n".join(tally.crashes[:5])


# ================================================================ Copy into models (item 8, first case)
def _models_listing(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir())


def test_copy_into_models_refuses_what_is_not_a_model_file(tmp_path, tiny_model):
    """A symlink to /dev/zero (5.6 GB copied before), a FIFO, a folder, a text file, a truncated GGUF:
    refused in one line at once, nothing written, no .part; a real model copies."""
    from app.model_library import copy_model_file
    models = tmp_path / "models"
    models.mkdir()
    src = tmp_path / "src"
    src.mkdir()
    os.symlink("/dev/zero", src / "zero.gguf")
    os.mkfifo(src / "fifo.gguf")
    (src / "dir.gguf").mkdir()
    (src / "notes.gguf").write_text("not a model")
    (src / "inf.gguf").write_bytes(HOSTILE_HEADERS["inf-context"][:-3])
    os.symlink("loop.gguf", src / "loop.gguf")
    for name in ("zero.gguf", "fifo.gguf", "dir.gguf", "notes.gguf", "inf.gguf", "loop.gguf"):
        t0 = time.monotonic()
        with pytest.raises((ValueError, OSError)) as e:
            copy_model_file(src / name, models / name)
        assert time.monotonic() - t0 < 2, name
        _one_line(str(e.value))
        assert _models_listing(models) == [], (name, _models_listing(models))
    copy_model_file(tiny_model, models / "tiny.gguf")
    assert _digest(models / "tiny.gguf") == _digest(tiny_model) and _models_listing(models) == ["tiny.gguf"]


def test_copy_into_models_bounds_size_and_cleans_up(tmp_path, tiny_model, monkeypatch):
    """No room on the disk: refused before a byte is written; a file that grows while copied, or a
    failure mid-copy: the .part is removed; a killed copy's .part is removed at the next start."""
    from app import model_library
    from app.model_library import COPY_PREFIX, copy_model_file, remove_stale_copies
    models = tmp_path / "models"
    models.mkdir()
    real_usage = shutil.disk_usage
    monkeypatch.setattr(model_library.shutil, "disk_usage",
                        lambda p: real_usage(p)._replace(free=1 << 20))
    with pytest.raises(ValueError, match="free"):
        copy_model_file(tiny_model, models / "a.gguf")
    monkeypatch.setattr(model_library.shutil, "disk_usage", real_usage)
    assert _models_listing(models) == []
    growing = tmp_path / "growing.gguf"
    shutil.copyfile(tiny_model, growing)

    class Grows:
        def __init__(self, f):
            self.f, self.n = f, 0

        def __enter__(self):
            return self

        def __exit__(self, *a):
            self.f.close()

        def __getattr__(self, name):
            return getattr(self.f, name)

        def read(self, n):
            data = self.f.read(n)
            if not data and self.n == 0:      # past the size at open: more bytes appear
                self.n = 1
                return b"x"
            return data
    import engine.model.gguf_header as gh
    real_regular = gh.open_regular
    monkeypatch.setattr(gh, "open_regular", lambda p: Grows(real_regular(p)))
    with pytest.raises(ValueError, match="grew"):
        copy_model_file(growing, models / "g.gguf", chunk=4096)
    monkeypatch.setattr(gh, "open_regular", real_regular)
    assert _models_listing(models) == []
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True).stdout.strip()
    (models / f"{COPY_PREFIX}{dead}-old.gguf.part").write_bytes(b"x" * 100)
    (models / f"{COPY_PREFIX}{os.getppid()}-live.gguf.part").write_bytes(b"x")      # alive: kept
    (models / "user-download.gguf.part").write_bytes(b"x")                            # not ours: kept
    assert remove_stale_copies(models) == [f"{COPY_PREFIX}{dead}-old.gguf.part"]
    assert _models_listing(models) == sorted([f"{COPY_PREFIX}{os.getppid()}-live.gguf.part",
                                             "user-download.gguf.part"])


@pytest.mark.gui
def test_app_copy_of_a_link_to_dev_zero_is_refused(qtbot, idle_window, tmp_path):
    window = idle_window
    src = tmp_path / "zero.gguf"
    os.symlink("/dev/zero", src)
    before = _models_listing(window.paths.models_dir)
    window.library.add_model_file(src, how="copy")
    qtbot.waitUntil(lambda: "Could not add zero.gguf" in window.message_bar.text(), timeout=5000)
    _one_line(window.message_bar.text())
    assert "not a regular file" in window.message_bar.text()
    assert _models_listing(window.paths.models_dir) == before
    window.library.add_model_file(src, how="link")
    assert "Could not link zero.gguf" in window.message_bar.text()
    assert _models_listing(window.paths.models_dir) == before
