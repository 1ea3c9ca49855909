"""A disk-tier file changed under the running engine (engine/disk/disk_tier.py `verify`, disk_segments.open_file):
conversation A's segment file swapped with B's, replaced by a copy of B's, or made a symbolic link to
B's while the engine runs. A's next turn must never resume from B's K/V: the file is dropped with a log
line and the prompt is read afresh (no token restored, the reply equal to a fresh read). For full K/V
(the tiny llama) and for windows and recurrent states (gemma3, qwen35: segment version 4); an old
segment version is dropped with a line at start. A real `strata serve` process for the swap, too."""
from __future__ import annotations

import logging
import os
import shutil
import struct
import time
from pathlib import Path

import pytest

from engine.api import Status
from engine.engine import Engine, EngineOptions
from test_disk_tier import _chat, _files, _port, _serve
from test_disk_tier_states import FIRST, ask, fresh_read, model, start, turns  # noqa: F401 - `model`: a fixture
from engine_reads import while_held

OTHER = [{"role": "system", "content": "You are a patient storyteller."},
         {"role": "user", "content": "Something else entirely: the trees of a northern forest. " * 5}]
HOW = ["swap", "replace", "symlink"]


def _paths(engine) -> dict[str, Path]:
    return while_held(engine, lambda e: {x.owner: x.path for x in e.disk.entries.values()})


def tamper(a: Path, b: Path, how: str) -> None:
    """A's file made B's conversation: the two files exchanged, A's overwritten in place with B's bytes,
    or A's a symbolic link to B's."""
    if how == "swap":
        tmp = a.with_name("swap.tmp")
        os.rename(a, tmp)
        os.rename(b, a)
        os.rename(tmp, b)
    elif how == "replace":
        shutil.copyfile(b, a)
    else:
        os.unlink(a)
        os.symlink(b, a)


def _two_conversations(engine):
    """A and B, each one turn, both written to disk; A's follow-up messages."""
    a_msgs, _ = turns(engine, 1, FIRST, conv="a")
    turns(engine, 1, OTHER, conv="b")
    paths = _paths(engine)
    assert set(paths) == {"a", "b"}, paths
    return a_msgs, paths


def _tampered_file_is_never_used(e, how: str) -> dict:
    """Conversation a's file changed `how` while the engine runs: a's next turn restores nothing from
    disk, says the file was dropped, and replies as a fresh read. The two files' paths."""
    a_msgs, paths = _two_conversations(e)
    tamper(paths["a"], paths["b"], how)
    r, lines = ask(e, a_msgs, conv="a")
    assert r.restored_from_disk == 0, (r.cached_tokens, lines)      # (RAM may lend the shared system prompt)
    assert any("dropped" in x and paths["a"].name in x for x in lines), lines
    assert r.tokens == fresh_read(e, r)
    return paths


@pytest.mark.parametrize("how", HOW)
def test_full_kv_file_changed_while_running_is_never_used(tiny_gguf, tmp_path, how):
    e = Engine(EngineOptions(model=str(tiny_gguf), disk_mib=64, cache_mib=0, disk_dir=str(tmp_path))).start()
    try:
        e.startup.result(60)
        paths = _tampered_file_is_never_used(e, how)
        if how == "symlink":
            assert paths["b"].is_file()                     # the link removed, never what it points to
    finally:
        e.stop()


@pytest.mark.parametrize("how", HOW)
def test_window_or_state_file_changed_while_running_is_never_used(model, tmp_path, how):
    name, (path, opts) = model
    if name == "gemma3+q8" and how != "swap":
        pytest.skip("the 8-bit K/V variant is covered by the swap; the file handling is the same")
    e = start((path, {**opts, "cache_mib": 0}), tmp_path)
    try:
        _tampered_file_is_never_used(e, how)
    finally:
        e.stop()


def test_a_file_renamed_to_another_conversations_name_is_dropped_at_scan(tiny_gguf, tmp_path, caplog):
    """B's file renamed to A's name while the engine is down: its segments name B, not the file: dropped
    at start with a line (never indexed as A's)."""
    e = Engine(EngineOptions(model=str(tiny_gguf), disk_mib=64, cache_mib=0, disk_dir=str(tmp_path))).start()
    try:
        e.startup.result(60)
        _, paths = _two_conversations(e)
    finally:
        e.stop()
    os.replace(paths["b"], paths["a"])
    caplog.set_level(logging.INFO, logger="strata")
    e = Engine(EngineOptions(model=str(tiny_gguf), disk_mib=64, disk_dir=str(tmp_path))).start()
    try:
        e.startup.result(60)
        assert e.call(Status()).disk["entries"] == 0
    finally:
        e.stop()
    lines = [r.getMessage() for r in caplog.records]
    assert any(paths["a"].name in x and "another conversation" in x for x in lines), lines
    assert not paths["a"].exists()


def test_an_older_segment_version_is_dropped_with_a_line(tiny_gguf, tmp_path, caplog):
    """A file of segment version 1 (before each segment named its conversation): dropped at start with a
    line saying so, never read."""
    e = Engine(EngineOptions(model=str(tiny_gguf), disk_mib=64, disk_dir=str(tmp_path))).start()
    try:
        e.startup.result(60)
        msgs, _ = turns(e, 1, FIRST)
    finally:
        e.stop()
    (f,) = tmp_path.glob("*.kvseg")
    data = bytearray(f.read_bytes())
    data[8:12] = struct.pack("<I", 1)                   # the fixed part's version field
    f.write_bytes(bytes(data))
    caplog.set_level(logging.INFO, logger="strata")
    e = Engine(EngineOptions(model=str(tiny_gguf), disk_mib=64, disk_dir=str(tmp_path))).start()
    try:
        e.startup.result(60)
        r, _ = ask(e, msgs)
    finally:
        e.stop()
    lines = [r.getMessage() for r in caplog.records]
    assert r.restored_from_disk == 0
    assert any("segment version 1, written by an older Strata" in x for x in lines), lines


def test_server_swap_while_running_reads_afresh(tiny_gguf, strata_home):
    """The campaign's journey: a real `strata serve` process (no RAM parking, so A's next turn can only
    come from disk), A's and B's files swapped while it runs: A's next turn reports no cached tokens and
    answers as a server with no disk tier does. (The follow-up's assistant message is fixed text: a
    random reply's text need not tokenize back to its ids, and both servers must read the same prompt.)"""
    a_msgs = [{"role": "user", "content": "Tell me about rivers and the sea. " * 6}]
    b_msgs = [{"role": "user", "content": "Something else entirely: the trees of a northern forest. " * 5}]
    follow = a_msgs + [{"role": "assistant", "content": "Rivers run down to the sea."},
                       {"role": "user", "content": "And the mountains?"}]
    port = _port()
    p = _serve(tiny_gguf, port, strata_home, "--conversation-cache-mib", "0")
    try:
        _chat(port, a_msgs)
        (a,) = _settled_files(strata_home, 1)
        _chat(port, b_msgs)
        (b,) = [f for f in _settled_files(strata_home, 2) if f != a]
        tamper(a, b, "swap")
        got = _chat(port, follow)
    finally:
        p.kill()
        p.wait()
    assert got["usage"]["prompt_tokens_details"]["cached_tokens"] == 0, got["usage"]
    shutil.rmtree(strata_home / "cache")
    p = _serve(tiny_gguf, port, strata_home, "--conversation-disk-mib", "0")
    try:
        fresh = _chat(port, follow)
    finally:
        p.kill()
        p.wait()
    assert got["usage"]["prompt_tokens"] == fresh["usage"]["prompt_tokens"]
    assert got["choices"][0]["message"]["content"] == fresh["choices"][0]["message"]["content"]


def _settled_files(home: Path, n: int) -> list[Path]:
    """The segment files once there are n and their sizes hold still for a second (the idle-time write
    done; a generous deadline for a loaded machine, not a timing)."""
    deadline = time.monotonic() + 120
    last = None
    while True:
        files = _files(home)
        sizes = [f.stat().st_size for f in files]
        if len(files) >= n and sizes == last:
            return files
        assert time.monotonic() < deadline, "the turns were not written"
        last = sizes
        time.sleep(1.0)
