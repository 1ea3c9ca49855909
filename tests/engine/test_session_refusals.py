"""Session files against hostile input (issue 12): every byte under the checksum, every header field
validated by type and range, crafted files with a valid checksum refused, only regular files opened,
the memory guard before a restore, temporary files of killed saves cleaned, and no overwrite of a
longer conversation without force. Real files, the real engine on tiny generated GGUFs.

The checksum is recomputed here from the format's description (xxh3-128 over the 8-byte length, the
header with its 32 checksum digits read as '0', and the tensors), not with the engine's code, so a
crafted file is what an attacker would write.
"""
from __future__ import annotations

import hashlib
import json
import os
import struct
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import xxhash

from engine.session_files import sessions
from engine.engine import GenerateRequest, RestoreSession, SaveSession, Status
from engine.errors import SessionFileError, StrataError
from engine.memory.memory_guard import GiB, MemoryGuard, MemoryReading
from engine.sampling import SamplingParams
from test_parking import A_SYSTEM, ask, start, words
from engine_reads import while_held

REPO = Path(__file__).resolve().parents[2]
PREFIX = b'{"__metadata__":{"checksum":"'


# ------------------------------------------------------------------------------------- file helpers

def split(raw: bytes) -> tuple[dict, bytes]:
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def assemble(head: dict, data: bytes, *, checksum: bool = True) -> bytes:
    """A session file from a header dict (metadata first, checksum first) and data, checksummed."""
    meta = dict(head["__metadata__"])
    meta.pop("checksum", None)
    ordered = {"__metadata__": {"checksum": "0" * 32, **meta}, **{k: v for k, v in head.items() if k != "__metadata__"}}
    hb = json.dumps(ordered, separators=(",", ":"), ensure_ascii=False).encode()
    hb += b" " * (-len(hb) % 8)
    prefix = struct.pack("<Q", len(hb))
    if checksum:
        digest = xxhash.xxh3_128(prefix + hb + data).hexdigest().encode()
        hb = hb.replace(b"0" * 32, digest, 1)
    return prefix + hb + data


def restore_all(engine, path: Path, blobs: list[bytes]) -> list[str]:
    """Restore each blob (written to `path`) in-process on the engine thread: 'OK' or the refusal, or
    'CRASH <type>: ...' for anything that is not a SessionFileError (a traceback in the CLI)."""
    def run(e):
        out = []
        for b in blobs:
            path.write_bytes(b)
            try:
                sessions.load(str(path), e.sessions.fingerprint(), e.handlers.make_cache,
                              key=e.handlers.cache_key(), dtype=e.dtype,
                              n_vocab=e.info.n_vocab, n_ctx=e.n_ctx, admit=e.guard.admit)
                out.append("OK")
            except SessionFileError as x:
                out.append(str(x))
            except Exception as x:  # noqa: BLE001 -- what the test looks for
                out.append(f"CRASH {type(x).__name__}: {x}")
        return out
    return while_held(engine, run)


@pytest.fixture(scope="module")
def conv(tiny_gguf, tmp_path_factory):
    d = tmp_path_factory.mktemp("refusals")
    engine = start(tiny_gguf, cache_mib=64)
    msgs = [{"role": "system", "content": A_SYSTEM}, {"role": "user", "content": words(40)}]
    r, _ = ask(engine, msgs, "A", n=8)
    msgs.append({"role": "assistant", "content": r.text})
    good = d / "good.stratasession"
    engine.call(SaveSession(str(good)))
    yield {"engine": engine, "dir": d, "good": good, "raw": good.read_bytes(), "messages": msgs,
           "n_vocab": engine.info.n_vocab, "n_ctx": engine.n_ctx}
    engine.stop()


def test_the_good_file_restores_and_the_checksum_spec_matches(conv):
    head, data = split(conv["raw"])
    assert conv["raw"][8:8 + len(PREFIX)] == PREFIX
    assert assemble(head, data) == conv["raw"]          # the format as documented, byte for byte
    assert head["__metadata__"]["version"] == "2"
    assert restore_all(conv["engine"], conv["dir"] / "x.stratasession", [conv["raw"]]) == ["OK"]


# ------------------------------------------------------------------------------------- mutations

def _flips(raw: bytes, positions) -> list[bytes]:
    out = []
    for i in positions:
        b = bytearray(raw)
        b[i] ^= 1 << (i % 8)
        out.append(bytes(b))
    return out


def test_every_header_byte_flipped_is_refused_in_one_line(conv):
    """One bit of every byte of the length prefix and the header (messages included): all refused."""
    raw = conv["raw"]
    (n,) = struct.unpack("<Q", raw[:8])
    outcomes = restore_all(conv["engine"], conv["dir"] / "flip.stratasession", _flips(raw, range(8 + n)))
    crashes = [o for o in outcomes if o.startswith("CRASH")]
    accepted = outcomes.count("OK")
    print(f"{len(outcomes)} header flips: {accepted} accepted, {len(crashes)} crashes, "
          f"{len(outcomes) - accepted - len(crashes)} refused")
    assert not crashes, crashes[:5]
    assert accepted == 0
    assert all("\n" not in o for o in outcomes)


@pytest.mark.parametrize("gpu_path", [False, True], ids=["cpu-restore", "gpu-restore-forced"])
def test_data_flips_and_truncations_are_refused(conv, monkeypatch, gpu_path):
    """Both restore paths (the GPU's reader/hasher/upload pipeline forced here on the CPU) hash every
    data byte and refuse each flip and truncation."""
    import engine.model.device_upload as device_upload
    monkeypatch.setattr(sessions, "on_gpu", lambda: gpu_path)
    monkeypatch.setattr(device_upload, "on_cuda", lambda: gpu_path)
    raw = conv["raw"]
    (n,) = struct.unpack("<Q", raw[:8])
    positions = range(8 + n, len(raw), max(1, (len(raw) - 8 - n) // 300))
    blobs = _flips(raw, positions) + [raw[:k] for k in (0, 4, 8, 9, 8 + n - 1, 8 + n, len(raw) - 1)]
    blobs.append(raw + b"\0" * 16)                      # bytes after the data, checksum not recomputed
    outcomes = restore_all(conv["engine"], conv["dir"] / "data.stratasession", blobs)
    assert not [o for o in outcomes if o.startswith("CRASH")]
    assert outcomes.count("OK") == 0
    assert sum(o.endswith("is corrupted (checksum mismatch)") for o in outcomes) >= len(positions)


def _crafted(conv) -> dict[str, tuple[bytes, str]]:
    """Files an attacker would write: valid checksum, one field out of type or range."""
    head, data = split(conv["raw"])
    meta = head["__metadata__"]
    n = int(meta["n_tokens"])
    V = conv["n_vocab"]
    toks = np.frombuffer(data[:4 * n], np.int32).copy()

    def with_tokens(last):
        t = toks.copy()
        t[-1] = last
        return t.tobytes() + data[4 * n:]

    def edit(fn):
        h = json.loads(json.dumps(head))
        fn(h)
        return h

    def set_meta(**kw):
        return edit(lambda h: h["__metadata__"].update(kw))

    msgs = json.loads(meta["messages"])
    hd = head["k.0"]["shape"][3]
    cases = {
        "last token -1": (assemble(head, with_tokens(-1)), f"is corrupted (token id -1 is outside the vocabulary of {V})"),
        "token = vocab": (assemble(head, with_tokens(V)), f"is corrupted (token id {V} is outside the vocabulary of {V})"),
        "token 2^31-1": (assemble(head, with_tokens(2**31 - 1)), "outside the vocabulary"),
        "K shape: head_dim halved": (assemble(edit(lambda h: h["k.0"].update(shape=[1, 2, n, hd // 2])), data),
                                     "its tensor table does not match"),
        "all K/V of another geometry": (
            assemble(edit(lambda h: [h[k].update(shape=[1, 1, n, hd]) for k in h if k[:2] in ("k.", "v.")]), data),
            "its tensor table does not match"),
        "K dtype F32": (assemble(edit(lambda h: h["k.1"].update(dtype="F32")), data), "its tensor table does not match"),
        "offsets overlap": (assemble(edit(lambda h: h["v.0"].update(data_offsets=[0, h["v.0"]["data_offsets"][1]])),
                                     data), "its tensor table does not match"),
        "an extra tensor": (assemble(edit(lambda h: h.update(extra={"dtype": "F16", "shape": [1], "data_offsets": [0, 2]})),
                                     data), "its tensor table does not match"),
        "a missing tensor": (assemble(edit(lambda h: h.pop("v.1")), data), "its tensor table does not match"),
        "n_tokens + 1": (assemble(set_meta(n_tokens=str(n + 1)), data), "its tensor table does not match"),
        "n_tokens text": (assemble(set_meta(n_tokens="many"), data), "is corrupted (bad token count 'many')"),
        "n_tokens 0": (assemble(set_meta(n_tokens="0"), data), "holds no tokens"),
        "n_tokens 10^9": (assemble(set_meta(n_tokens=str(10**9)), data),
                          f"holds 1000000000 tokens; the context holds {conv['n_ctx']}"),
        "metadata number": (assemble(edit(lambda h: h["__metadata__"].update(n_tokens=n)), data),
                            "is corrupted (header metadata is not all text)"),
        "messages not JSON": (assemble(set_meta(messages="[{"), data), "is corrupted (its messages are not JSON)"),
        "messages deep": (assemble(set_meta(messages="[" * 100000 + "]" * 100000), data),
                          "is corrupted (its messages are not JSON)"),
        "role -> sole": (assemble(set_meta(messages=json.dumps([{"sole": m["role"], "content": m["content"]}
                                                                for m in msgs])), data),
                         "is corrupted (message 0 has no valid role)"),
        "content a number": (assemble(set_meta(messages=json.dumps([{"role": "user", "content": 5}])), data),
                             "is corrupted (message 0 has no text content)"),
        "messages an object": (assemble(set_meta(messages="{}"), data), "is corrupted (the messages are not a list)"),
        "a lone surrogate in a message": (
            assemble(set_meta(messages=json.dumps(msgs[:-1] + [dict(msgs[-1], content="ab\ud800cd")])), data),
            "is corrupted (message 2 holds text that is not valid Unicode (a lone surrogate))"),
        "a lone surrogate in a field": (
            assemble(set_meta(messages=json.dumps([dict(msgs[0], name="\udfff")] + msgs[1:])), data),
            "is corrupted (message 0 holds text that is not valid Unicode (a lone surrogate))"),
        "bytes after the data": (assemble(head, data + b"\0" * 16), "is corrupted (16 bytes after its data)"),
        "another kv dtype": (assemble(set_meta(kv_dtype="bfloat16"), data), ": incompatible K/V layout (bfloat16"),
        "another format": (assemble(set_meta(format="other"), data), "is not a Strata session file"),
        "version 1": (assemble(set_meta(version="1"), data),
                      "has session format version 1, which this Strata no longer reads"),
        "version x": (assemble(set_meta(version="2x"), data), "is corrupted (bad format version '2x')"),
    }
    # Format 1's layout (tensors first, metadata last, checksum over the tensors only).
    v1 = {k: v for k, v in head.items() if k != "__metadata__"}
    v1["__metadata__"] = {**{k: v for k, v in meta.items() if k != "checksum"}, "version": "1",
                          "checksum": xxhash.xxh3_64(data[4 * n:]).hexdigest()}
    hb = json.dumps(v1, separators=(",", ":")).encode()
    hb += b" " * (-len(hb) % 8)
    cases["a format 1 file"] = (struct.pack("<Q", len(hb)) + hb + data,
                                "has session format version 1, which this Strata no longer reads")
    # A header nested 100,000 deep (valid JSON, checksum recomputed).
    deep = b'{"__metadata__":{"checksum":"' + b"0" * 32 + b'","format":"strata-session","x":' + \
        b"[" * 100000 + b"]" * 100000 + b"}}"
    deep += b" " * (-len(deep) % 8)
    pre = struct.pack("<Q", len(deep))
    deep = deep.replace(b"0" * 32, xxhash.xxh3_128(pre + deep).hexdigest().encode(), 1)
    cases["a header nested 100,000 deep"] = (pre + deep, "is not a Strata session file (unreadable header)")
    return cases


def test_crafted_files_with_a_valid_checksum_are_refused_by_validation(conv):
    cases = _crafted(conv)
    outcomes = restore_all(conv["engine"], conv["dir"] / "crafted.stratasession", [b for b, _ in cases.values()])
    for (case, (_, want)), got in zip(cases.items(), outcomes):
        assert want in got, (case, got)
        assert got.startswith("crafted.stratasession") and "\n" not in got, (case, got)


def test_a_refused_crafted_file_does_not_poison_the_engine(conv):
    """Issue 12 item 6: a last token of -1 with a recomputed checksum used to be accepted and then break
    every later request. Now it is refused, the live conversation is untouched, and a good file and the
    next requests work."""
    engine, d = conv["engine"], conv["dir"]
    bad = d / "minus-one.stratasession"
    bad.write_bytes(_crafted(conv)["last token -1"][0])
    before = engine.call(Status())
    with pytest.raises(StrataError, match=r"token id -1 is outside the vocabulary"):
        engine.call(RestoreSession(str(bad)))
    after = engine.call(Status())
    assert (after.live_tokens, after.parking) == (before.live_tokens, before.parking)
    r = engine.call(RestoreSession(str(conv["good"])))
    msgs = conv["messages"] + [{"role": "user", "content": "Go on."}]
    out, _ = ask(engine, msgs, "A", n=4)
    assert out.cached_tokens == r.restored_tokens
    out, _ = ask(engine, [{"role": "user", "content": "Another topic."}], "B", n=4)
    assert out.generated_tokens == 4


def test_a_session_with_a_lone_surrogate_is_refused_over_http_before_it_takes_effect(conv, strata_home):
    """A session file whose messages hold "\\ud800" (valid JSON, checksum recomputed) restored through the
    server (real HTTP): a 400 naming the problem, where it used to answer 500 after the restore had taken
    effect; the engine holds what it held, and the good file still restores."""
    import httpx

    from engine.frontends.server import ServerThread, create_app
    engine = conv["engine"]
    folder = strata_home / "sessions"
    folder.mkdir()
    (folder / "bad.stratasession").write_bytes(_crafted(conv)["a lone surrogate in a message"][0])
    (folder / "good.stratasession").write_bytes(conv["raw"])
    ask(engine, [{"role": "user", "content": "Something held before the restore."}], "B", n=4)
    before = engine.call(Status())
    srv = ServerThread(create_app(engine)).start()
    try:
        r = httpx.post(f"{srv.base_url}/sessions/restore", json={"name": "bad"}, timeout=600)
        assert r.status_code == 400, r.text
        assert "not valid Unicode" in r.json()["error"]["message"]
        after = engine.call(Status())
        assert (after.live_tokens, after.parking) == (before.live_tokens, before.parking)
        ok = httpx.post(f"{srv.base_url}/sessions/restore", json={"name": "good"}, timeout=600)
        assert ok.status_code == 200 and ok.json()["messages"] == conv["messages"], ok.text
    finally:
        srv.stop()


def test_a_bad_parked_entry_is_dropped_after_the_error_it_causes(tiny_gguf):
    """Whatever puts an entry with invalid token ids into parking (a bug), the next request drops it with
    a log line when it fails to read it (its prefix check decodes the held tokens), is itself served
    from a fresh K/V, and so are the requests after it."""
    engine = start(tiny_gguf, cache_mib=64)
    try:
        ask(engine, [{"role": "user", "content": words(20)}], "A", n=4)
        ask(engine, [{"role": "user", "content": words(20, 7)}], "B", n=4)      # A is parked

        def poison(e):
            bad = e.conversations.parking.entries[0]
            bad.tokens = bad.tokens[:-1] + [-1]     # a new list, as every trim makes
            return len(e.conversations.parking.entries)
        assert while_held(engine, poison) == 1
        h = engine.submit(GenerateRequest(messages=[{"role": "user", "content": words(20, 3)}],
                                          sampling=SamplingParams(max_tokens=2)))
        assert h.result(120).generated_tokens == 2
        assert any(l.startswith("dropped a parked conversation") for l in h.log_lines), h.log_lines
        held = while_held(engine, lambda e: [t for x in e.conversations.parking.entries for t in x.tokens])
        assert held and min(held) >= 0                  # B parked, A gone
        for k in range(2):
            out, _ = ask(engine, [{"role": "user", "content": words(20, 11 + k)}], "C", n=2)
            assert out.generated_tokens == 2
    finally:
        engine.stop()


# ------------------------------------------------------------------------------------- not a regular file

def test_a_fifo_or_a_device_is_refused_at_once(conv, tmp_path):
    engine = conv["engine"]
    fifo = tmp_path / "pipe.stratasession"
    os.mkfifo(fifo)
    for path, name in ((fifo, "pipe.stratasession"), (Path("/dev/zero"), "zero")):
        t0 = time.monotonic()
        with pytest.raises(StrataError) as err:
            engine.call(RestoreSession(str(path)), timeout=20)
        assert str(err.value) == f"{name} is not a regular file (a pipe, socket or device): not a session file"
        assert time.monotonic() - t0 < 10
    # And on the command line (a fresh process): exit 2, one line, no hang.
    p = subprocess.run([sys.executable, "-m", "engine.cli", "generate", "--model", str(conv["engine"].model_path),
                        "--restore-session", str(fifo), "--prompt", "hi", "-n", "1"], cwd=REPO,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2
    assert p.stderr.strip().splitlines() == [
        "strata: pipe.stratasession is not a regular file (a pipe, socket or device): not a session file"]


# ------------------------------------------------------------------------------------- memory guard

class Reader:
    def __init__(self, available: int):
        self.available = available

    def __call__(self) -> MemoryReading:
        return MemoryReading(total_bytes=16 * GiB, available_bytes=self.available, source="test")


def test_restore_asks_the_memory_guard_first(tiny_gguf, conv):
    """Available RAM one byte short of reserve + what the restore needs: refused with the numbers; with
    room for it: restored."""
    reader = Reader(8 * GiB)
    guard = MemoryGuard(reader=reader)
    engine = start(tiny_gguf, guard=guard, cache_mib=64)
    try:
        _, meta, _ = sessions.read_header(str(conv["good"]))
        n = int(meta["n_tokens"])
        need = while_held(engine, lambda e: sessions.restore_bytes(
            n, sessions.Geometry.of(e.sessions.fingerprint()), 4 if "float32" in str(e.dtype) else 2))
        reader.available = guard.reserve_bytes + need - 1
        with pytest.raises(StrataError) as err:
            engine.call(RestoreSession(str(conv["good"])))
        msg = str(err.value)
        assert msg.startswith(f"good.stratasession was not restored: its {n} tokens need {need / (1 << 20):.1f} "
                              f"MiB of K/V memory and the memory guard says no (needs "), msg
        assert engine.call(Status()).live_tokens == 0
        reader.available = guard.reserve_bytes + need + (1 << 20)
        assert engine.call(RestoreSession(str(conv["good"]))).restored_tokens == n
    finally:
        engine.stop()


# ------------------------------------------------------------------------------------- temporary files

def test_engine_start_removes_parts_of_killed_saves(tiny_gguf, strata_home):
    folder = strata_home / "sessions"
    folder.mkdir()
    old = time.time() - 600
    stale = folder / ".chat.stratasession.k1ll3d00.part"
    stale.write_bytes(struct.pack("<Q", 1 << 20) + PREFIX + b"0" * 1000)
    os.utime(stale, (old, old))
    fresh = folder / ".chat.stratasession.fresh000.part"       # could be a save that just began
    fresh.write_bytes(b"")
    keep = folder / "chat.stratasession"
    keep.write_bytes(b"a finished file is never touched")
    os.utime(keep, (old, old))
    engine = start(tiny_gguf, cache_mib=0)
    try:
        assert not stale.exists() and fresh.exists() and keep.exists()
    finally:
        engine.stop()


# ------------------------------------------------------------------------------------- overwrite

def test_saving_less_over_a_longer_session_needs_force(tiny_gguf, tmp_path):
    engine = start(tiny_gguf, cache_mib=64)
    try:
        target = tmp_path / "long.stratasession"
        msgs = [{"role": "user", "content": words(60)}]
        r, _ = ask(engine, msgs, "A", n=8)
        engine.call(SaveSession(str(target)))
        long_n = int(sessions.read_header(str(target))[1]["n_tokens"])
        sha = hashlib.sha256(target.read_bytes()).hexdigest()
        engine.call(RestoreSession(str(target)))
        # A turn that cannot reuse it (another conversation), then a save to the file it came from.
        ask(engine, [{"role": "user", "content": "hi"}], "B", n=2)
        short_n = engine.call(Status()).live_tokens
        with pytest.raises(StrataError) as err:
            engine.call(SaveSession(str(target)))
        assert err.value.code == "session_refused" and err.value.reason == "overwrite"
        assert str(err.value) == (f"long.stratasession holds a longer conversation ({long_n} tokens) than this "
                                  f"one ({short_n}); not replaced (use --force to replace it)")
        assert hashlib.sha256(target.read_bytes()).hexdigest() == sha
        assert engine.call(SaveSession(str(target), force=True)).tokens == short_n
        assert int(sessions.read_header(str(target))[1]["n_tokens"]) == short_n
        # Longer content replaces it without asking.
        ask(engine, [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
                     {"role": "user", "content": words(10)}], "B", n=2)
        engine.call(SaveSession(str(target)))
        # A file that is not a session is not replaced without force either.
        notes = tmp_path / "notes.txt"
        notes.write_text("my notes")
        with pytest.raises(StrataError, match=r"^notes.txt exists and is not a Strata session file; not replaced"):
            engine.call(SaveSession(str(notes)))
        assert notes.read_text() == "my notes"
        engine.call(SaveSession(str(notes), force=True))
        assert sessions.read_header(str(notes))[1]["format"] == "strata-session"
    finally:
        engine.stop()


def test_cli_save_over_a_longer_session_exits_2_without_force(tiny_gguf, tmp_path):
    target = tmp_path / "s.stratasession"
    base = [sys.executable, "-m", "engine.cli", "generate", "--model", str(tiny_gguf), "-n", "4", "--json"]
    run = lambda *a: subprocess.run([*base, *a], cwd=REPO, capture_output=True, text=True, timeout=180)  # noqa: E731
    p = run("--prompt", words(50), "--save-session", str(target))
    assert p.returncode == 0, p.stderr
    sha = hashlib.sha256(target.read_bytes()).hexdigest()
    p = run("--prompt", "hi", "--save-session", str(target))
    assert p.returncode == 2
    assert len(p.stderr.strip().splitlines()) == 1
    assert p.stderr.startswith("strata: s.stratasession holds a longer conversation (")
    assert hashlib.sha256(target.read_bytes()).hexdigest() == sha
    p = run("--prompt", "hi", "--save-session", str(target), "--force")
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["session_bytes"] == target.stat().st_size


def test_save_without_sync_writes_the_same_bytes(conv, tmp_path):
    engine = conv["engine"]
    engine.call(RestoreSession(str(conv["good"])))
    a = engine.call(SaveSession(str(tmp_path / "a.stratasession")))
    b = engine.call(SaveSession(str(tmp_path / "b.stratasession"), sync=False))
    assert a.synced and not b.synced and b.sync_ms == 0
    assert (tmp_path / "a.stratasession").read_bytes() == (tmp_path / "b.stratasession").read_bytes() == conv["raw"]


# ------------------------------------------------------------------------------------- seeded fuzzing

def _mutants(raw: bytes, count: int, seed: int) -> list[bytes]:
    """Seeded mutations of a good file: byte runs overwritten, bytes inserted or deleted (in the header,
    the data or the length), truncations, header splices. Each differs from the original."""
    rng = np.random.default_rng(seed)
    (n,) = struct.unpack("<Q", raw[:8])
    out = []
    while len(out) < count:
        b = bytearray(raw)
        kind = rng.integers(6)
        in_header = rng.random() < 0.8
        lo, hi = (0, 8 + n) if in_header else (8 + n, len(raw))
        i = int(rng.integers(lo, hi))
        k = int(rng.integers(1, 9))
        if kind == 0:                                    # overwrite a run of bytes
            b[i:i + k] = rng.integers(0, 256, min(k, len(b) - i), dtype=np.uint8).tobytes()
        elif kind == 1:                                  # insert bytes
            b[i:i] = rng.integers(0, 256, k, dtype=np.uint8).tobytes()
        elif kind == 2:                                  # delete bytes
            del b[i:i + k]
        elif kind == 3:                                  # truncate
            del b[i:]
        elif kind == 4:                                  # a JSON-ish token swapped in
            tok = [b'"', b"{", b"}", b"[", b"]", b":", b",", b"0", b"-1", b"1e999", b"null", b"\\u0000", b"\xff"]
            t = tok[int(rng.integers(len(tok)))]
            b[i:i + len(t)] = t
        else:                                            # the length prefix
            b[:8] = struct.pack("<Q", int(rng.integers(0, 2 * (8 + n) + 64)))
        if bytes(b) != raw:
            out.append(bytes(b))
    return out


@pytest.mark.slow
def test_seeded_mutations_are_refused_without_crash_hang_or_growth(conv):
    """STRATA_FUZZ_SESSIONS mutants (default 1,500, a few seconds; raise it for a longer run): every one a
    one-line refusal, none accepted, none slower than 2 s, the process's peak RSS grows < 64 MiB."""
    count = int(os.environ.get("STRATA_FUZZ_SESSIONS", "1500"))
    blobs = _mutants(conv["raw"], count, seed=12)

    def hwm() -> int:
        for line in open("/proc/self/status"):
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
        return 0
    before = hwm()
    t0 = time.monotonic()
    outcomes = restore_all(conv["engine"], conv["dir"] / "fuzz.stratasession", blobs)
    per_input = (time.monotonic() - t0) / len(blobs)
    crashes = [o for o in outcomes if o.startswith("CRASH")]
    accepted = outcomes.count("OK")
    print(f"{len(blobs)} mutants: {len(blobs) - accepted - len(crashes)} refused, {accepted} accepted, "
          f"{len(crashes)} crashes; {per_input * 1e3:.2f} ms each; peak RSS +{(hwm() - before) >> 20} MiB")
    assert not crashes, crashes[:5]
    assert accepted == 0
    assert all("\n" not in o and o for o in outcomes)
    assert per_input < 2.0
    assert hwm() - before < 64 << 20


# ------------------------------------------------------------------ issue 31 item 7: NaN/Inf K/V

def _poisoned(raw: bytes, tensor: str, value: float, index: int = 3) -> bytes:
    """`raw` with one float16 of `tensor` (a cell of the first head, within the tokens) set to `value`,
    the checksum recomputed: only the finite check can refuse it."""
    head, data = split(raw)
    assert head[tensor]["dtype"] == "F16", head[tensor]
    a = head[tensor]["data_offsets"][0]
    d = bytearray(data)
    d[a + 2 * index:a + 2 * index + 2] = np.float16(value).tobytes()
    return assemble(head, bytes(d))


@pytest.fixture(scope="module")
def quant_files(tiny_gguf_wide, tmp_path_factory):
    """8- and 4-bit session files (head size 32: groups of 32) with their engines."""
    d = tmp_path_factory.mktemp("quant-refusals")
    out = {}
    for bits in (8, 4):
        engine = start(tiny_gguf_wide, kv_bits=bits)
        ask(engine, [{"role": "system", "content": A_SYSTEM}, {"role": "user", "content": words(30)}], "Q", n=6)
        f = d / f"q{bits}.stratasession"
        engine.call(SaveSession(str(f)))
        out[bits] = (engine, f.read_bytes())
    yield d, out
    for engine, _ in out.values():
        engine.stop()


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")], ids=["nan", "inf", "-inf"])
def test_16_bit_k_v_with_nan_or_inf_is_refused(conv, value):
    blobs = [_poisoned(conv["raw"], t, value) for t in ("k.0", "v.1")]
    outcomes = restore_all(conv["engine"], conv["dir"] / "nan.stratasession", blobs)
    assert outcomes == ["nan.stratasession: layer 0's K holds NaN or infinite values (a damaged or crafted "
                        "file): refused",
                        "nan.stratasession: layer 1's V holds NaN or infinite values (a damaged or crafted "
                        "file): refused"], outcomes


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("value", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_quantized_scales_and_biases_with_nan_or_inf_are_refused(quant_files, bits, value):
    d, files = quant_files
    engine, raw = files[bits]
    cases = {"k.0.s": "layer 0's K scales", "k.1.b": "layer 1's K biases", "v.2.s": "layer 2's V scales",
             "v.0.b": "layer 0's V biases"}
    outcomes = restore_all(engine, d / f"bad{bits}.stratasession", [_poisoned(raw, t, value) for t in cases])
    for want, got in zip(cases.values(), outcomes):
        assert got == f"bad{bits}.stratasession: {want} holds NaN or infinite values (a damaged or crafted file): " \
                      "refused", got
    assert restore_all(engine, d / f"good{bits}.stratasession", [raw]) == ["OK"]


def test_a_nan_file_through_the_engine_keeps_the_live_conversation(conv):
    engine, d = conv["engine"], conv["dir"]
    bad = d / "nan-live.stratasession"
    bad.write_bytes(_poisoned(conv["raw"], "v.0", float("nan")))
    before = engine.call(Status())
    with pytest.raises(StrataError, match=r"layer 0's V holds NaN or infinite values"):
        engine.call(RestoreSession(str(bad)))
    after = engine.call(Status())
    assert (after.live_tokens, after.parking) == (before.live_tokens, before.parking)


def test_a_q8g32_file_at_8_bits_names_the_group_not_a_flag(tmp_path):
    """A file of 8-bit K/V in groups of 32 for a model whose 8-bit K/V uses groups of 64 (head size 64):
    no --kv-bits restores it, and the refusal says why instead of '(restore it with --kv-bits 8)'."""
    from gguf_factory import write_tiny_gguf
    model = write_tiny_gguf(tmp_path / "head64.gguf", arch="llama", n_layer=2, n_embd=128, n_head=2, n_head_kv=2,
                            n_ff=128, seed=3)
    engine = start(model, kv_bits=8)
    try:
        ask(engine, [{"role": "user", "content": words(20)}], "G", n=4)
        f = tmp_path / "g64.stratasession"
        engine.call(SaveSession(str(f)))
        head, data = split(f.read_bytes())
        meta = head["__metadata__"]
        assert meta["kv_dtype"] == "q8g64"
        assert meta["fp.kv_format"] == "q8g64"
        meta.update({"kv_dtype": "q8g32", "fp.kv_format": "q8g32"})
        crafted = tmp_path / "g32.stratasession"
        crafted.write_bytes(assemble(head, data))
        with pytest.raises(StrataError) as e:
            engine.call(RestoreSession(str(crafted)))
        msg = str(e.value)
        assert "groups of 32" in msg and "groups of 64" in msg and "no --kv-bits setting restores it" in msg, msg
        assert getattr(e.value, "reason", "") != "kv_format"       # the CLI adds no '--kv-bits' hint
    finally:
        engine.stop()
