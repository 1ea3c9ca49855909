"""The disk tier under parking (engine/disk/disk_tier.py, engine/disk/disk_segments.py): the server journey across
a clean stop and a kill -9 (a real `strata serve` process, a real HTTP client), a torn segment, the disk
cap's eviction, the off switch, hostile files, another model's files, a deleted chat."""
from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from engine.api import ClearDiskCache, ForgetConversation, RestoreSession, SaveSession, Status
from engine.engine import Engine, EngineOptions, GenerateRequest
from engine.sampling import SamplingParams
from engine_reads import while_held
from engines import maker

ROOT = Path(__file__).resolve().parents[2]
SP = SamplingParams(max_tokens=8, temperature=0)
FIRST = [{"role": "user", "content": "Tell me about rivers and the sea. " * 6}]


def _folder(home: Path) -> Path:
    return home / "cache" / "conversations"


def _files(home: Path) -> list[Path]:
    d = _folder(home)
    return sorted(d.glob("*.kvseg")) if d.is_dir() else []


def _turns(engine, n: int, conv: str = "c1", first=FIRST):
    msgs, out = list(first), []
    for i in range(n):
        r = engine.call(GenerateRequest(messages=msgs, sampling=SP, conversation=conv))
        out.append(r)
        msgs = msgs + [{"role": "assistant", "content": r.text}, {"role": "user", "content": f"and then {i}?"}]
        engine.wait_idle(30)
    return msgs, out


def _flush(engine) -> None:
    engine.wait_idle(60)


@pytest.fixture
def make_engine(tiny_gguf):
    with maker(tiny_gguf, disk_mib=64) as make:
        yield make


# ---- the server journey: a real process, a real HTTP client ----------------------------------------
def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(model: Path, port: int, home: Path, *flags: str) -> subprocess.Popen:
    env = dict(os.environ, STRATA_HOME=str(home))
    p = subprocess.Popen([sys.executable, "-m", "engine.cli", "serve", "--model", str(model), "--port", str(port),
                          "-v", *flags], cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=2).status_code == 200:
                return p
        except httpx.HTTPError:
            pass
        if p.poll() is not None:
            raise AssertionError(f"serve exited: {p.stderr.read().decode()[-2000:]}")
        time.sleep(0.2)
    p.kill()
    raise AssertionError("serve did not start")


def _chat(port: int, messages: list[dict]) -> dict:
    r = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", timeout=60,
                   json={"messages": messages, "max_tokens": 8, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()


def restart_journey(path, strata_home, how: str, messages: list = FIRST) -> tuple[dict, dict]:
    """A real `strata serve` process on `path`, a turn (`messages`), the server stopped (SIGINT) or killed
    (SIGKILL: no clean-up of any kind) a few seconds after it, served again, the follow-up: (first, follow-up)
    replies."""
    port = _port()
    p = _serve(path, port, strata_home)
    try:
        first = _chat(port, messages)
        assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        time.sleep(3)                                     # "a few seconds after the turn"
        assert _files(strata_home), "the turn was not written in the idle time"
        if how == "stop":
            p.send_signal(signal.SIGINT)
        else:
            p.kill()
        p.wait(30)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    follow = messages + [{"role": "assistant", "content": first["choices"][0]["message"]["content"]},
                         {"role": "user", "content": "And the mountains?"}]
    p = _serve(path, port, strata_home)
    try:
        return first, _chat(port, follow)
    finally:
        p.kill()
        p.wait()


@pytest.mark.parametrize("how", ["stop", "kill -9"])
def test_server_journey_restart_is_cached(tiny_gguf, strata_home, how):
    first, again = restart_journey(tiny_gguf, strata_home, how)
    cached = again["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= first["usage"]["prompt_tokens"], again["usage"]     # the whole first turn, from disk


# ---- in-process: the same answer as RAM, writes per turn, branches -----------------------------------
def test_restored_conversation_continues_as_the_live_one(make_engine, strata_home):
    e = make_engine()
    msgs, _ = _turns(e, 3)
    ram = e.call(GenerateRequest(messages=msgs, sampling=SP, conversation="c1"))
    status = e.call(Status()).disk
    assert status["last_write"]["kind"] == "append"
    assert status["last_write"]["bytes"] < status["bytes"] / 2      # a turn writes its own tokens only
    e.stop()
    e2 = make_engine()
    r = e2.call(GenerateRequest(messages=msgs, sampling=SP, conversation="c1"))
    assert r.restored_from_disk == r.cached_tokens >= ram.cached_tokens > 0
    assert r.tokens == ram.tokens                      # the K/V as held (float32 here): the same reply


def test_eviction_writes_and_restores(make_engine, strata_home):
    e = make_engine(cache_slots=1)
    a, _ = _turns(e, 1, "a")
    _turns(e, 1, "b", first=[{"role": "user", "content": "Something else entirely, about trees. " * 5}])
    _turns(e, 1, "c", first=[{"role": "user", "content": "A third topic: the weather in spring. " * 5}])
    r = e.call(GenerateRequest(messages=a, sampling=SP, conversation="a"))   # evicted from RAM by now
    assert r.restored_from_disk > 0 and r.cached_tokens == r.restored_from_disk


def test_disk_cap_evicts_least_recently_used(make_engine, strata_home, caplog):
    caplog.set_level(logging.INFO, logger="strata")
    e = make_engine(disk_mib=1, cache_mib=0)
    one = e.call(Status()).disk
    assert one["cap_bytes"] == 1 << 20
    # tiny_gguf: 2 layers x 2 K/V heads x 16 x 2 (K, V) x 4 bytes (float32 on the CPU) = 512 B/token:
    # ~2,000 tokens per MiB, so three conversations of ~1,100 tokens cannot all stay
    for i in range(3):
        text = f"topic {i}: " + "words of a long conversation " * 130
        e.call(GenerateRequest(messages=[{"role": "user", "content": text}], sampling=SP, conversation=f"t{i}"))
        e.wait_idle(30)
    _flush(e)
    s = e.call(Status()).disk
    assert s["bytes"] <= s["cap_bytes"]
    assert s["entries"] < 3 and len(_files(strata_home)) == s["entries"]
    assert any("for the disk cap" in line for line in caplog.messages), caplog.messages
    kept = while_held(e, lambda eng: sorted(x.owner for x in eng.disk.entries.values()))
    assert "t2" in kept and "t0" not in kept, kept        # the oldest went first, the newest stayed


def test_off_switch_writes_nothing(make_engine, strata_home):
    e = make_engine(disk_mib=0)
    _turns(e, 2)
    e.stop()
    assert not _folder(strata_home).exists()


def test_torn_last_segment_falls_back_to_the_last_whole_one(make_engine, strata_home):
    e = make_engine()
    msgs, rs = _turns(e, 2)
    e.stop()
    (f,) = _files(strata_home)
    size = f.stat().st_size
    other = strata_home / "cache" / "unrelated.bin"
    other.write_bytes(b"x" * 100)
    with open(f, "r+b") as fh:                             # the last segment cut mid-write
        fh.truncate(size - 100)
    e2 = make_engine()
    lines = []
    h = e2.submit(GenerateRequest(messages=msgs, sampling=SP, conversation="c1"))
    r = h.result(60)
    lines = h.log_lines
    assert r.restored_from_disk > 0
    assert r.restored_from_disk <= rs[1].prompt_tokens          # the first turn's segment only
    assert any("restored" in x for x in lines)
    assert other.read_bytes() == b"x" * 100                    # no other file touched


def test_flipped_kv_byte_falls_back(make_engine, strata_home):
    e = make_engine()
    msgs, rs = _turns(e, 2)
    e.stop()
    (f,) = _files(strata_home)
    data = bytearray(f.read_bytes())
    data[-10] ^= 0xFF                                        # inside the last segment's K/V
    f.write_bytes(bytes(data))
    e2 = make_engine()
    h = e2.submit(GenerateRequest(messages=msgs, sampling=SP, conversation="c1"))
    r = h.result(60)
    assert 0 < r.restored_from_disk <= rs[1].prompt_tokens
    assert any("checksum mismatch" in x for x in h.log_lines)


def test_hostile_files_are_dropped_with_a_line(make_engine, strata_home):
    from engine.disk import disk_segments as ds
    d = _folder(strata_home)
    d.mkdir(parents=True)
    (d / "junk.kvseg").write_bytes(os.urandom(500))
    (d / "empty.kvseg").write_bytes(b"")
    fixed = ds._FIXED.pack(ds.MAGIC, ds.VERSION, 1 << 30, 1 << 30, 1 << 62, b"\0" * 16, b"\0" * 16)
    (d / "huge.kvseg").write_bytes(fixed + b"{}")                # lengths far past the file
    meta = ds.header_json({"key": "k", "fp": {"n_layer": "99999999", "n_kv_heads": "1", "head_dim": "1",
                                              "kv_format": "float16"}, "start": 0, "owner": "", "messages": []})
    import numpy as np
    (d / "geom.kvseg").write_bytes(b"".join(bytes(p) for p in ds.encode(meta, np.zeros(4, np.int32), [])))
    os.mkfifo(d / "fifo.kvseg")
    e = make_engine()
    assert e.call(Status()).disk["entries"] == 0
    r = e.call(GenerateRequest(messages=FIRST, sampling=SP, conversation="c1"))
    assert r.cached_tokens == 0


def test_other_model_or_steering_files_never_used(tiny_gguf, tiny_gguf_other, strata_home):
    e = Engine(EngineOptions(model=str(tiny_gguf), disk_mib=64)).start()
    e.startup.result()
    msgs, _ = _turns(e, 1)
    e.stop()
    e2 = Engine(EngineOptions(model=str(tiny_gguf_other), disk_mib=64)).start()
    e2.startup.result()
    try:
        r = e2.call(GenerateRequest(messages=msgs, sampling=SP, conversation="c1"))
        assert r.cached_tokens == 0
        # a file whose key was rewritten to this model's is refused by its full fingerprint
    finally:
        e2.stop()


@pytest.mark.parametrize("bits", [8, 4])
def test_quantized_kv_round_trips_through_the_disk_tier(tiny_gguf_wide, strata_home, bits):
    """8- and 4-bit K/V (codes, scales, biases) written, restored after a restart by the same K/V format
    only, and the follow-up equals the one the live conversation gives; a 16-bit engine never uses them."""
    def engine(kv_bits):
        e = Engine(EngineOptions(model=str(tiny_gguf_wide), kv_bits=kv_bits, disk_mib=64)).start()
        e.startup.result()
        return e
    e = engine(bits)
    try:
        msgs, _ = _turns(e, 1)
        live = e.call(GenerateRequest(messages=msgs, sampling=SP, conversation="c1"))
        _flush(e)
    finally:
        e.stop()
    e16 = engine(16)
    try:
        assert e16.call(GenerateRequest(messages=msgs, sampling=SP, conversation="c1")).restored_from_disk == 0
    finally:
        e16.stop()
    again = engine(bits)
    try:
        r = again.call(GenerateRequest(messages=msgs, sampling=SP, conversation="c1"))
        assert r.restored_from_disk > 0 and r.cached_tokens >= r.restored_from_disk
        assert r.text == live.text
    finally:
        again.stop()


def test_forget_and_clear(make_engine, strata_home):
    e = make_engine()
    _turns(e, 1, "chat-a")
    _turns(e, 1, "chat-b", first=[{"role": "user", "content": "Something else entirely, about trees. " * 5}])
    _flush(e)
    assert len(_files(strata_home)) == 2
    s = e.call(ForgetConversation("chat-a"))
    _flush(e)
    assert s.disk["entries"] == 1 and len(_files(strata_home)) == 1
    s = e.call(ClearDiskCache())
    assert s.disk["entries"] == 0 and s.disk["bytes"] == 0 and not _files(strata_home)


def test_a_restored_session_keeps_its_disk_file_across_a_restart(tiny_gguf, strata_home, tmp_path, caplog):
    """A session restored over a conversation the disk tier holds already (the app's launch with a copy
    of a chat's session: the same tokens under another chat): its idle-time write used to be a segment of
    no tokens, which failed ("memoryview: cannot cast view with zeros in shape or strides") and removed
    the file. Now the restored conversation is linked to that file and comes back from disk after a
    restart, its reply equal to a fresh read."""
    from test_disk_tier_states import fresh_read     # lazy: that module imports this one
    caplog.set_level(logging.INFO, logger="strata")
    session = tmp_path / "copy.stratasession"
    e = Engine(EngineOptions(model=str(tiny_gguf), disk_mib=64)).start()
    try:
        e.startup.result(60)
        msgs, _ = _turns(e, 2, conv="chat-1")
        e.call(SaveSession(str(session), conversation="chat-1"))
        e.stop()
        e = Engine(EngineOptions(model=str(tiny_gguf), disk_mib=64)).start()    # the app's launch
        e.startup.result(60)
        e.call(RestoreSession(str(session), conversation="chat-2"))
        e.wait_idle(30)
        _flush(e)
        assert e.call(Status()).disk["entries"] == 1
    finally:
        e.stop()
    lines = [r.getMessage() for r in caplog.records]
    assert not [x for x in lines if "failed" in x], lines
    e = Engine(EngineOptions(model=str(tiny_gguf), disk_mib=64)).start()
    try:
        e.startup.result(60)
        r = e.call(GenerateRequest(messages=msgs, sampling=SP, conversation="chat-2"))
        assert r.restored_from_disk == r.cached_tokens > 0
        assert r.tokens == fresh_read(e, r)
    finally:
        e.stop()
