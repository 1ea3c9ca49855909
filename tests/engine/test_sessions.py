"""Session files (issue 3): restore in a fresh process, the refusal matrix, atomic writes under kill -9,
K/V bytes per token, no shadow copy while saving, and one round trip on the real SmolLM2.

Fresh processes are real subprocesses (`python -m engine.cli ...` or a small `python -c` program).
Sampled comparisons use temperature 0.8 with a fixed seed (random tiny weights make greedy output
degenerate); one comparison is greedy. See test_parking.py for what "held" means.
"""
from __future__ import annotations

import hashlib
import json
import os
import signal
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from engine.engine import RestoreSession, SaveSession, Status
from engine.errors import StrataError
from engine.session_files.sessions import read_header
from test_parking import A_SYSTEM, ask, held, start, words

REPO = Path(__file__).resolve().parents[2]
U1 = "Tell me the whole story of the little boat: " + words(60)
U2 = "And what did the boy find in the nets that morning?"
U3 = "How did the day end for Margaret and the boy?"


def run(args: list[str], *, timeout: float = 180, check: bool = True) -> subprocess.CompletedProcess:
    p = subprocess.run([sys.executable, *args], cwd=REPO, capture_output=True, text=True, timeout=timeout,
                       env={**os.environ, "PYTHONUNBUFFERED": "1"})
    if check and p.returncode != 0:
        raise AssertionError(f"{args[:3]} exited {p.returncode}:\n{p.stderr[-3000:]}")
    return p


def cli(*args: str, **kw) -> subprocess.CompletedProcess:
    return run(["-m", "engine.cli", *args], **kw)


def header_meta(path: Path) -> tuple[dict, dict, int]:
    return read_header(str(path))


# ------------------------------------------------------------------------------- fresh-process restore

def _reference(model: Path, temperature: float, seed3: int | None) -> dict:
    """The never-saved run: A's three turns in one engine."""
    engine = start(model, cache_mib=64)
    try:
        msgs = [{"role": "system", "content": A_SYSTEM}, {"role": "user", "content": U1}]
        out = {}
        for i, (user, seed) in enumerate(((None, 11), (U2, 12), (U3, seed3))):
            if user:
                msgs.append({"role": "user", "content": user})
            t = 0.8 if i < 2 else temperature
            r, _ = ask(engine, msgs, "A", n=16, temperature=t, seed=seed if t > 0 else None)
            msgs.append({"role": "assistant", "content": r.text})
            out[f"r{i + 1}"] = r
            if i == 1:
                out["held"] = engine.call(Status()).live_tokens
        return out
    finally:
        engine.stop()


def test_restore_in_a_fresh_process_continues_token_for_token(tiny_gguf, tmp_path):
    sess = tmp_path / "a.stratasession"
    script = tmp_path / "save.jsonl"
    script.write_text("\n".join(json.dumps(s) for s in [
        {"conversation": "A", "system": A_SYSTEM, "user": U1, "max_tokens": 16, "temperature": 0.8, "seed": 11},
        {"conversation": "A", "user": U2, "max_tokens": 16, "temperature": 0.8, "seed": 12,
         "save_session": str(sess)},
    ]) + "\n")
    saved = [json.loads(l) for l in cli("replay", str(script), "--model", str(tiny_gguf), "--json").stdout.splitlines()]
    ref_sampled = _reference(tiny_gguf, 0.8, 13)
    ref_greedy = _reference(tiny_gguf, 0.0, None)
    # The saving process ran the same two turns as the reference.
    assert [s["tokens"] for s in saved] == [ref_sampled["r1"].tokens, ref_sampled["r2"].tokens]
    h = ref_sampled["held"]
    assert h == held(ref_sampled["r2"], 16)
    _, meta, _ = header_meta(sess)
    assert int(meta["n_tokens"]) == h and saved[1]["session_bytes"] == sess.stat().st_size
    for temperature, ref, extra in ((0.8, ref_sampled, ["--temperature", "0.8", "--seed", "13"]),
                                    (0.0, ref_greedy, [])):
        # (the disk tier off: the first loop's process leaves its longer conversation on disk)
        out = json.loads(cli("generate", "--model", str(tiny_gguf), "--restore-session", str(sess),
                             "--prompt", U3, "-n", "16", "--json", "--conversation-disk-mib", "0", *extra).stdout)
        # Nothing is re-evaluated: the follow-up reuses every saved token (the restored history ends
        # with A's last fed token; the follow-up's prompt extends it).
        assert out["cached_tokens"] == h, temperature
        assert out["prompt_tokens"] == ref["r3"].prompt_tokens
        assert out["tokens"] == ref["r3"].tokens, temperature
        assert out["restore_ms"] > 0


# ------------------------------------------------------------------------------- the refusal matrix

@pytest.fixture(scope="module")
def matrix(tiny_gguf, tiny_gguf_other, tiny_gguf_wide, tmp_path_factory):
    """A live conversation A in one engine, its good session file, and files from elsewhere."""
    d = tmp_path_factory.mktemp("sessions")
    files = {}
    for name, model, kw in (("other-model", tiny_gguf_other, {}), ("other-geometry", tiny_gguf_wide, {})):
        e = start(model, cache_mib=64, **kw)
        ask(e, [{"role": "user", "content": U1}], "X")
        files[name] = d / f"{name}.stratasession"
        e.call(SaveSession(str(files[name])))
        e.stop()
    # Steered: the same model with a control vector on.
    from engine.steer.control_vector import SteeringConfig, write_control_vector
    vec = d / "steer.gguf"
    write_control_vector(vec, {1: np.random.default_rng(3).standard_normal(64).astype(np.float32) * 4},
                         model_hint="llama")
    e = start(tiny_gguf, cache_mib=64, steering=SteeringConfig(files=((str(vec), 1.0),)))
    ask(e, [{"role": "user", "content": U1}], "X", speed_projection=True)
    files["other-steering"] = d / "steered.stratasession"
    e.call(SaveSession(str(files["other-steering"])))
    e.stop()

    engine = start(tiny_gguf, cache_mib=64)
    msgs = [{"role": "system", "content": A_SYSTEM}, {"role": "user", "content": U1}]
    r, _ = ask(engine, msgs, "A")
    msgs += [{"role": "assistant", "content": r.text}, {"role": "user", "content": U2}]
    r, _ = ask(engine, msgs, "A")
    msgs.append({"role": "assistant", "content": r.text})
    good = d / "good.stratasession"
    engine.call(SaveSession(str(good)))
    raw = good.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])

    files["random-bytes"] = d / "random.stratasession"
    files["random-bytes"].write_bytes(np.random.default_rng(0).bytes(4096))
    files["text-file"] = d / "notes.txt"
    files["text-file"].write_text("These are my notes about the little boat.\n" * 20)
    files["empty-file"] = d / "empty.stratasession"
    files["empty-file"].write_bytes(b"")
    files["truncated"] = d / "truncated.stratasession"
    files["truncated"].write_bytes(raw[: 8 + n + (len(raw) - 8 - n) // 2])
    flipped = bytearray(raw)
    lo, hi = header["v.1"]["data_offsets"]
    flipped[8 + n + (lo + hi) // 2] ^= 0x01       # one bit of one K/V value
    files["flipped-byte"] = d / "flipped.stratasession"
    files["flipped-byte"].write_bytes(bytes(flipped))
    # A future format version: a real edit of the header (JSON re-serialized, length prefix rewritten).
    future = json.loads(raw[8:8 + n])
    future["__metadata__"]["version"] = "4"        # 3 is read (engine/session_files/session_v3.py)
    fh = json.dumps(future, separators=(",", ":")).encode()
    fh += b" " * (-len(fh) % 8)
    files["future-version"] = d / "future.stratasession"
    files["future-version"].write_bytes(struct.pack("<Q", len(fh)) + fh + raw[8 + n:])
    # A safetensors file that is not a session (MLX wrote it).
    import mlx.core as mx
    files["other-safetensors"] = d / "weights.safetensors"
    mx.save_safetensors(str(files["other-safetensors"]), {"w": mx.zeros((4, 4))})
    # Unreadable: tests run as root here, where chmod 000 does not stop reads, so a folder and a
    # missing path stand for it (and chmod 000 is checked too when not root).
    files["a-folder"] = d / "folder.stratasession"
    files["a-folder"].mkdir()
    files["missing"] = d / "missing.stratasession"
    if os.geteuid() != 0:
        files["unreadable"] = d / "unreadable.stratasession"
        files["unreadable"].write_bytes(raw)
        files["unreadable"].chmod(0)
    yield {"engine": engine, "messages": msgs, "good": good, "files": files}
    engine.stop()


REFUSALS = {
    "random-bytes": "random.stratasession is not a Strata session file",
    "text-file": "notes.txt is not a Strata session file",
    "empty-file": "empty.stratasession is not a Strata session file (too short)",
    "other-safetensors": "weights.safetensors is not a Strata session file",
    "truncated": "truncated.stratasession is truncated (",
    "flipped-byte": "flipped.stratasession is corrupted (checksum mismatch)",
    "other-model": "other-model.stratasession was saved with another model",
    "other-geometry": "other-geometry.stratasession: incompatible K/V geometry (file: 3 layers x 2 K/V heads x 32",
    "other-steering": "steered.stratasession was saved with another steering setting (control vector",
    "future-version": "future.stratasession has session format version 4, newer than this Strata reads (3)",
    "a-folder": "folder.stratasession is a folder, not a session file",
    "missing": "session file not found: ",
    "unreadable": "cannot read session file ",
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_refused_restore_leaves_the_live_conversation(matrix, case):
    if case not in matrix["files"]:
        pytest.skip("running as root: chmod 000 does not stop root from reading (folder/missing cover it)")
    engine, msgs = matrix["engine"], matrix["messages"]
    before = engine.call(Status())
    with pytest.raises(StrataError) as err:
        engine.call(RestoreSession(str(matrix["files"][case])))
    assert REFUSALS[case] in str(err.value), str(err.value)
    assert "\n" not in str(err.value)
    after = engine.call(Status())
    assert after.live_tokens == before.live_tokens and after.parking == before.parking
    # Still serving, and the live conversation continues with all its tokens cached.
    msgs.append({"role": "user", "content": f"Go on ({case})."})
    r, logs = ask(engine, msgs, "A", n=4)
    msgs.append({"role": "assistant", "content": r.text})
    assert r.cached_tokens == before.live_tokens, logs
    assert not any(l.startswith("parked") for l in logs)


def test_the_good_file_restores_and_a_refused_file_exits_2_on_the_cli(matrix, tiny_gguf):
    engine = matrix["engine"]
    _, meta, _ = header_meta(matrix["good"])
    r = engine.call(RestoreSession(str(matrix["good"])))
    assert r.restored_tokens == int(meta["n_tokens"])
    assert engine.call(Status()).live_tokens == int(meta["n_tokens"])
    p = cli("generate", "--model", str(tiny_gguf), "--restore-session", str(matrix["files"]["flipped-byte"]),
            "--prompt", "hi", "-n", "2", check=False)
    assert p.returncode == 2
    assert p.stderr.strip().splitlines() == ["strata: flipped.stratasession is corrupted (checksum mismatch)"]
    assert p.stdout == ""


# ------------------------------------------------------------------------------- big caches, in children

CHILD = r"""
import gc, json, os, sys, threading, time
from engine.engine import Engine, EngineOptions, GenerateRequest, SaveSession, Status
from engine.sampling import SamplingParams
model, path, mode = sys.argv[1], sys.argv[2], sys.argv[3]
if mode == "rss":       # no free K/V memory held for reuse (kv_reserve), where a second copy could hide
    from engine.cache import kv_reserve
    kv_reserve.touch = lambda *a, **k: kv_reserve.Reserved.none("off: every byte a save allocates must show")
engine = Engine(EngineOptions(model=model, cache_mib=0)).start()
assert engine.call(Status()).model
tok = engine.tokenizer
ids = tok.encode("The little boat left the harbor early in the morning, when the sea was still. " * 20)[:64]
r = engine.call(GenerateRequest(prompt=tok.decode(ids), sampling=SamplingParams(max_tokens=1)))
n = engine.call(Status()).live_tokens

def status_kb(field):
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024

if mode == "rss":
    entry_bytes = engine.conversations.live.nbytes()
    # On CUDA a process's first save grows RSS by ~20 MiB once (the first host reads of CUDA managed
    # memory; 1.5-1.7 MiB for each later save, probe on the H200): a first save, then what malloc holds
    # free handed back, so that a second copy in the measured save would still need new pages.
    from engine.device import on_cuda
    if on_cuda():
        from engine.memory.allocator import release_freed_memory
        engine.call(SaveSession(path + ".first"))
        release_freed_memory()
    gc.collect()
    peak = [0]
    stop = threading.Event()
    try:       # Linux: reset the high-water mark, read VmHWM after the save (exact)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        method = "VmHWM"
    except OSError:
        method = "sampled"
    def sample():
        while not stop.is_set():
            peak[0] = max(peak[0], status_kb("VmRSS"))
            time.sleep(0.0005)
    before = status_kb("VmRSS")
    t = threading.Thread(target=sample); t.start()
    res = engine.call(SaveSession(path))
    stop.set(); t.join()
    hwm = status_kb("VmHWM") if method == "VmHWM" else peak[0]
    print(json.dumps({"before": before, "peak": max(hwm, peak[0]), "method": method, "tokens": n,
                      "entry_bytes": entry_bytes, "file_bytes": res.session_bytes}), flush=True)
    sys.exit(0)

i = 0
while True:
    print(f"SAVING {i} {n}", flush=True)
    engine.call(SaveSession(path))
    print(f"SAVED {i}", flush=True)
    i += 1
"""


def _child(model: Path, path: Path, mode: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", CHILD, str(model), str(path), mode], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})


def _parts(folder: Path, final: Path) -> list[Path]:
    return sorted(folder.glob(f".{final.name}.*.part"))


def _kill_during_save(model: Path, folder: Path, after_first_save: bool) -> tuple[list[str], str | None]:
    final = folder / "big.stratasession"
    child = _child(model, final, "loop")
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(l.strip() for l in child.stdout), daemon=True)
    reader.start()
    first_sha = None
    deadline = time.monotonic() + 240
    try:
        if after_first_save:
            while not final.exists():               # the first save is complete (renamed into place)
                assert child.poll() is None, child.stderr.read()
                assert time.monotonic() < deadline
                time.sleep(0.002)
            first_sha = hashlib.sha256(final.read_bytes()).hexdigest()
            # The next save's temporary file has to be a new one (the first one was renamed).
        while not _parts(folder, final):            # a save is in flight
            assert child.poll() is None, child.stderr.read()
            assert time.monotonic() < deadline
            time.sleep(0.0005)
        os.kill(child.pid, signal.SIGKILL)
    finally:
        if child.poll() is None and not _parts(folder, final):
            child.kill()
        child.wait(30)
        reader.join(10)
    assert child.returncode == -signal.SIGKILL
    return lines, first_sha


def _restores(model: Path, final: Path) -> int:
    engine = start(model, cache_mib=0)
    try:
        r = engine.call(RestoreSession(str(final)))
        ask(engine, [{"role": "user", "content": "hi"}], "X", n=2)    # still serving
        return r.restored_tokens
    finally:
        engine.stop()


@pytest.mark.parametrize("when", ["during the first save", "during a later save"])
def test_kill_9_during_a_save_leaves_no_half_file(big_kv_gguf, tmp_path, when):
    later = when == "during a later save"
    folder = tmp_path / "saves"
    folder.mkdir()
    lines, first_sha = _kill_during_save(big_kv_gguf, folder, after_first_save=later)
    final = folder / "big.stratasession"
    # The marker: the child was inside a save when it died (its last line is SAVING k with no SAVED k),
    # and that save's temporary file is still there (it is renamed only once complete).
    assert lines and lines[-1].startswith("SAVING "), lines
    k = int(lines[-1].split()[1])
    assert (k >= 1) if later else (k == 0), lines
    leftovers = _parts(folder, final)
    assert leftovers, "no temporary file: the kill did not land during a save"
    # Nothing half-written under the final name: either no file, or the previous complete one.
    names = sorted(p.name for p in folder.iterdir())
    assert names == sorted([p.name for p in leftovers] + ([final.name] if later else [])), names
    assert not any(p.name.startswith(final.name) and p.name != final.name for p in folder.iterdir())
    if not later:
        return
    assert hashlib.sha256(final.read_bytes()).hexdigest() == first_sha
    n = int(lines[-1].split()[2])
    # "Restart": a new engine (this process, not the killed one) restores it and keeps serving.
    assert _restores(big_kv_gguf, final) == n


def test_no_shadow_copy_while_saving(big_kv_gguf, tmp_path):
    """Peak RSS during the save of a ~32 MB K/V (see big_kv_gguf) grows by less than 25% of the K/V
    bytes the file holds (fp16, the cells in use: stricter than the 256 MiB the fp32 cache holds in
    memory). A second full-size copy -- even an fp16 one -- would be >= 100% of that."""
    final = tmp_path / "rss.stratasession"
    child = _child(big_kv_gguf, final, "rss")
    out, err = child.communicate(timeout=240)
    assert child.returncode == 0, err[-3000:]
    m = json.loads(out.strip().splitlines()[-1])
    table, meta, start_ = header_meta(final)
    kv_bytes = sum(hi - lo for name, t in table.items() if name[:2] in ("k.", "v.")
                   for lo, hi in [t["data_offsets"]])
    assert kv_bytes == m["tokens"] * 32 * 2 * 32 * 128 * 2      # layers x (K,V) x heads x dim x fp16
    assert m["entry_bytes"] >= 2 * kv_bytes                      # fp32 in memory, padded to 256 cells
    growth = m["peak"] - m["before"]
    print(f"peak RSS growth {growth / 2**20:.2f} MiB for {kv_bytes / 2**20:.1f} MiB of K/V in the file "
          f"({m['entry_bytes'] / 2**20:.0f} MiB in memory), {m['method']}")
    assert growth < 0.25 * kv_bytes, (f"peak RSS grew {growth / 2**20:.1f} MiB while saving "
                                      f"{kv_bytes / 2**20:.1f} MiB of K/V ({m['method']})")


# ------------------------------------------------------------------------------- the real SmolLM2

@pytest.fixture(scope="module")
def real_session(real_model, tmp_path_factory):
    """~100 tokens of history on the real model (greedy), saved; the never-saved follow-up of 8 tokens."""
    d = tmp_path_factory.mktemp("real")
    engine = start(real_model, cache_mib=64)
    try:
        msgs = [{"role": "system", "content": "You are a helpful assistant."},
                {"role": "user", "content": "In two sentences: why do boats float? Mention density, water "
                                            "displacement and Archimedes, and give one everyday example."}]
        r, _ = ask(engine, msgs, "A", n=48, temperature=0.0, seed=None)
        msgs += [{"role": "assistant", "content": r.text}]
        h = engine.call(Status()).live_tokens
        sess = d / "real.stratasession"
        engine.call(SaveSession(str(sess)))
        follow = "And why do ships made of steel float?"
        ref, _ = ask(engine, msgs + [{"role": "user", "content": follow}], "A", n=8, temperature=0.0, seed=None)
        return {"path": sess, "held": h, "follow": follow, "ref": ref}
    finally:
        engine.stop()


@pytest.mark.real_model
def test_real_model_kv_bytes_per_token(real_session):
    """SmolLM2-135M: 30 layers x 3 K/V heads x head_dim 64, fp16 K and V = 23,040 B/token, llama.cpp's."""
    path = real_session["path"]
    table, meta, data_start = header_meta(path)
    n = int(meta["n_tokens"])
    kv = sum(t["data_offsets"][1] - t["data_offsets"][0] for name, t in table.items() if name != "tokens")
    assert meta["kv_dtype"] == "float16"
    assert kv / n == 30 * 2 * 3 * 64 * 2 == 23040
    # The whole file minus its header: the K/V plus the token ids (4 B each).
    assert (path.stat().st_size - data_start) / n == 23040 + 4


@pytest.mark.real_model
def test_real_model_round_trip_in_a_fresh_process(real_session, real_model):
    out = json.loads(cli("generate", "--model", str(real_model), "--restore-session", str(real_session["path"]),
                         "--prompt", real_session["follow"], "-n", "8", "--json", timeout=600).stdout)
    assert out["cached_tokens"] == real_session["held"]
    assert out["prompt_tokens"] == real_session["ref"].prompt_tokens
    assert out["tokens"] == real_session["ref"].tokens


def test_next_save_removes_a_stale_part_file_of_an_interrupted_save(tmp_path):
    """A save killed after its header leaves `.NAME.XXXXXXXX.part`; the next save of any name in that
    folder removes it (it is unlocked and older than a few seconds), and leaves other files alone."""
    import fcntl
    import os
    import time

    from engine.cache.parking import KVEntry
    from engine.session_files.sessions import _PREFIX, save
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache
    final = tmp_path / "conv.stratasession"
    old = time.time() - 3600
    stale = tmp_path / ".older-chat.stratasession.ab12CD_9.part"     # another name in the same folder
    stale.write_bytes(struct.pack("<Q", 4096) + _PREFIX + b"0123")
    empty = tmp_path / ".conv.stratasession.zz99YY00.part"             # killed before its first write
    empty.write_bytes(b"")
    foreign = tmp_path / ".notes.txt.abcdefgh.part"                    # matches the name, is not ours
    foreign.write_bytes(b"someone else's partial download")
    locked = tmp_path / ".live.stratasession.LOCKED00.part"            # a save in progress holds it
    locked.write_bytes(struct.pack("<Q", 4096) + _PREFIX)
    young = tmp_path / ".young.stratasession.young000.part"            # just created, not locked yet
    young.write_bytes(b"")
    for p in (stale, empty, foreign, locked):
        os.utime(p, (old, old))
    holder = os.open(locked, os.O_RDONLY)
    fcntl.flock(holder, fcntl.LOCK_EX)
    try:
        cache = [KVCache()]
        cache[0].update_and_fetch(mx.zeros((1, 2, 4, 8)), mx.zeros((1, 2, 4, 8)))
        entry = KVEntry([1, 2, 3, 4], cache, "k")
        fp = dict(model_hash="m", architecture="llama", n_layer=1, n_kv_heads=2, head_dim=8, tokenizer="t",
                  chat_template="c", steering="none")
        lines = []
        save(str(final), entry, fp, log=lines.append)
    finally:
        os.close(holder)
    assert final.exists() and not stale.exists() and not empty.exists()
    assert foreign.exists() and locked.exists() and young.exists()
    assert sum("left by an interrupted save" in ln for ln in lines) == 2, lines
