"""The disk tier for conversations with a sliding window (Gemma 3: a tiny real gemma3 GGUF, window 32) or
a recurrent state (Qwen3.5: a tiny real qwen35 GGUF, DeltaNet layers): segment version 4
(engine/disk/disk_states.py). After a restart (a new Engine on the same data folder) the next turn is
restored from disk, reusing exactly what the same conversation held in RAM reuses, and its greedy reply
equals a fresh read of the same prompt; an Edit restores from an earlier boundary; a torn last segment
falls back to the one before it; compaction keeps the latest boundaries and still restores exactly."""
from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from engine.disk import disk_segments as ds
from engine.disk import disk_states
from engine.api import RestoreSession, SaveSession, Status
from engine.engine import Engine, EngineOptions, GenerateRequest
from engine.sampling import SamplingParams
from engine_reads import while_held

SP = SamplingParams(max_tokens=8, temperature=0)
WINDOW = 32
FIRST = [{"role": "system", "content": "You are a patient storyteller."},
         {"role": "user", "content": "Tell me about rivers and the sea. " * 6}]


@pytest.fixture(scope="module", params=["gemma3", "gemma3+q8", "qwen35"])
def model(request, tmp_path_factory) -> tuple[str, tuple]:
    """(name, (GGUF path, engine options)). gemma3+q8: 8-bit K/V, i.e. its global layers quantized
    (codes, scales and biases written as held) beside windows mlx-lm keeps in 16/32-bit."""
    import gguf_factory_gemma
    import gguf_factory_qwen35
    d = tmp_path_factory.mktemp("states")
    if request.param.startswith("gemma3"):    # sliding, global, sliding, global: windows of 32 tokens
        path = gguf_factory_gemma.write_tiny_gemma3(d / "g3.gguf", sliding_window=WINDOW)
        return request.param, (path, {"kv_bits": 8} if request.param.endswith("q8") else {})
    return "qwen35", (gguf_factory_qwen35.write_tiny_qwen35_gguf(d / "q35.gguf"), {})   # 3 DeltaNet + 1 attention


def start(path, folder: Path, disk_mib: int = 64) -> Engine:
    path, opts = path if isinstance(path, tuple) else (path, {})
    e = Engine(EngineOptions(model=str(path), disk_mib=disk_mib, disk_dir=str(folder), **opts)).start()
    e.startup.result(timeout=300)
    return e


def turns(engine, n: int, msgs=FIRST, conv: str = "c1"):
    msgs, out = list(msgs), []
    for i in range(n):
        r = engine.call(GenerateRequest(messages=msgs, sampling=SP, conversation=conv), timeout=300)
        out.append(r)
        msgs = msgs + [{"role": "assistant", "content": r.text}, {"role": "user", "content": f"And then, part {i}?"}]
        engine.wait_idle(30)
        engine.wait_idle(60)
    return msgs, out


def ask(engine, msgs, conv: str = "c1"):
    h = engine.submit(GenerateRequest(messages=msgs, sampling=SP, conversation=conv))
    return h.result(timeout=300), h.log_lines


def fresh_read(engine, r) -> list[int]:
    """On the engine thread: the reply to exactly the live conversation's prompt tokens of `r`, from an
    empty cache (no reuse at all)."""
    def run(e):
        from engine.generation.generate import reply
        from engine.cache.parking import KVEntry
        tokens = list(e.conversations.live.tokens[:r.prompt_tokens])
        entry = KVEntry([], e.handlers.make_cache(), e.handlers.cache_key())
        return reply(e.model, entry, tokens, 0, tokenizer=e.tokenizer, sampling=SP, n_vocab=e.info.n_vocab,
                     max_tokens=SP.max_tokens, chunk=e.options.prefill_chunk, on_token=lambda *a: None,
                     on_progress=lambda *a: None, cancelled=lambda: False).tokens
    return while_held(engine, run)


def segments(folder: Path) -> list:
    (f,) = sorted(folder.glob("*.kvseg"))
    fd = os.open(f, os.O_RDONLY)
    try:
        segs, why = ds.scan(fd, os.fstat(fd).st_size)
    finally:
        os.close(fd)
    return segs


def test_restart_restores_what_ram_would_and_equals_a_fresh_read(model, tmp_path):
    """Three turns (gemma3: past the window several times over), the folder copied as they left it; the
    next turn from RAM in that engine, and after a restart on the copy from disk: as many tokens
    restored as RAM reuses, the same reply, equal to a fresh read. (Compared within one engine state:
    the prompt's token ids come from the held conversations, disk entries among them, and a random
    reply's text need not give back its ids.)"""
    import shutil
    name, path = model
    e = start(path, tmp_path / "disk")
    try:
        msgs, rs = turns(e, 3)
        s = e.call(Status()).disk
        assert s["entries"] == 1 and s["last_write"]["segments"] >= 1 and s["last_write"]["state_bytes"] > 0
        # a turn writes its own tokens and the fixed state at its boundaries, not the whole file again
        assert s["last_write"]["bytes"] < s["bytes"] and s["last_write"]["kind"] == "append"
        shutil.copytree(tmp_path / "disk", tmp_path / "copy")
        ram_r, _ = ask(e, msgs)
    finally:
        e.stop()
    assert ram_r.restored_from_disk == 0 and ram_r.cached_tokens > 0
    if name.startswith("gemma3"):
        assert rs[-1].prompt_tokens > 4 * WINDOW
    segs = segments(tmp_path / "copy")
    assert all(s.version == ds.VERSION_STATES for s in segs)
    kinds = {d["kind"] for d in segs[0].meta["layers"]}
    assert kinds == {"gemma3": {"kv", "rotating"}, "gemma3+q8": {"kv_quant", "rotating"}, "qwen35": {"kv", "arrays"}}[name]
    e = start(path, tmp_path / "copy")
    try:
        r, lines = ask(e, msgs)
        assert r.restored_from_disk == r.cached_tokens == ram_r.cached_tokens, (r, ram_r.cached_tokens)
        assert any("disk cache: restored" in x for x in lines)
        assert r.tokens == ram_r.tokens == fresh_read(e, r)
    finally:
        e.stop()


def test_an_edit_restores_from_an_earlier_boundary(model, tmp_path):
    """After a restart, the second user message edited: the prompt extends only an earlier segment end
    (the start of that message, a boundary the turn took): restored from there, the reply equals a
    fresh read."""
    name, path = model
    e = start(path, tmp_path)
    try:
        msgs, rs = turns(e, 3)
    finally:
        e.stop()
    ends = [s.start + s.n for s in segments(tmp_path)]
    e = start(path, tmp_path)
    try:
        edit = msgs[:3] + [{"role": "user", "content": "And then, part 0? (edited: tell me about boats)"}]
        r, _ = ask(e, edit)
        assert 0 < r.restored_from_disk == r.cached_tokens < rs[1].prompt_tokens, (r, ends)
        assert r.restored_from_disk in ends and r.restored_from_disk < ends[-1]
        assert r.tokens == fresh_read(e, r)
    finally:
        e.stop()


def test_regenerate_after_a_restart(model, tmp_path):
    """The last reply regenerated after a restart (the same messages as the last turn's prompt). A
    write stops at the last boundary the next turn shares (disk_states.boundaries): where the template
    renders the last reply otherwise (Qwen3.5 here) the prompt's end and the reply's end are not on
    disk, and the Regenerate resumes from the end of the last message, a few tokens earlier; the reply
    equals a fresh read."""
    name, path = model
    e = start(path, tmp_path)
    try:
        msgs, rs = turns(e, 2)
        held = while_held(e, lambda x: len(x.conversations.live.tokens))
    finally:
        e.stop()
    ends = [s.start + s.n for s in segments(tmp_path)]
    if name == "qwen35":
        assert ends[-1] < rs[-1].prompt_tokens - 1 < held        # stopped before the prompt's end
    e = start(path, tmp_path)
    try:
        r, _ = ask(e, msgs[:-2])
        assert 0 < r.restored_from_disk == r.cached_tokens <= rs[-1].prompt_tokens - 1
        assert r.restored_from_disk in ends
        assert r.tokens == fresh_read(e, r)
    finally:
        e.stop()


def test_torn_last_segment_falls_back_to_the_one_before(model, tmp_path):
    name, path = model
    e = start(path, tmp_path / "d")
    try:
        msgs, rs = turns(e, 2)
    finally:
        e.stop()
    segs = segments(tmp_path / "d")
    assert len(segs) >= 2
    (f,) = (tmp_path / "d").glob("*.kvseg")
    other = tmp_path / "d" / "unrelated.bin"
    other.write_bytes(b"x" * 100)
    with open(f, "r+b") as fh:                             # the last segment cut mid-write
        fh.truncate(f.stat().st_size - 100)
    e = start(path, tmp_path / "d")
    try:
        r, lines = ask(e, msgs)
        assert 0 < r.restored_from_disk <= segs[-2].start + segs[-2].n
        assert r.restored_from_disk in [s.start + s.n for s in segs[:-1]]
        assert r.tokens == fresh_read(e, r)
    finally:
        e.stop()
    assert other.read_bytes() == b"x" * 100                # no other file touched


def test_flipped_state_byte_falls_back(model, tmp_path):
    """A flipped byte at the end of the segment a restore uses (its window tail or recurrent state, the
    last bytes of the segment): its digest refuses it, the segment before it restores (each segment end
    restores on its own) and the reply equals a fresh read."""
    import shutil
    name, path = model
    e = start(path, tmp_path / "d")
    try:
        msgs, _ = turns(e, 2)
    finally:
        e.stop()
    shutil.copytree(tmp_path / "d", tmp_path / "copy")
    e = start(path, tmp_path / "d")
    try:
        whole, _ = ask(e, msgs)
    finally:
        e.stop()
    segs = segments(tmp_path / "copy")
    used = next(i for i, s in enumerate(segs) if s.start + s.n == whole.restored_from_disk)
    assert used >= 1
    (f,) = (tmp_path / "copy").glob("*.kvseg")
    data = bytearray(f.read_bytes())
    data[segs[used].end - 5] ^= 0xFF
    f.write_bytes(bytes(data))
    e = start(path, tmp_path / "copy")
    try:
        r, lines = ask(e, msgs)
        assert 0 < r.restored_from_disk == segs[used - 1].start + segs[used - 1].n
        assert any("checksum mismatch" in x for x in lines)
        assert r.tokens == fresh_read(e, r)
        e.wait_idle(30)
    finally:
        e.stop()
    # the turn's write cut the damaged segment off: the next return restores past it, with no mismatch
    follow = msgs + [{"role": "assistant", "content": r.text}, {"role": "user", "content": "And at night?"}]
    e = start(path, tmp_path / "copy")
    try:
        again, lines = ask(e, follow)
        assert again.restored_from_disk > r.restored_from_disk
        assert not any("checksum mismatch" in x for x in lines)
        assert again.tokens == fresh_read(e, again)
    finally:
        e.stop()


def test_compaction_keeps_the_latest_boundaries(tmp_path, tmp_path_factory, monkeypatch):
    """Qwen3.5: each boundary's recurrent state is most of a segment, so after some turns the older
    boundaries' states a compaction would drop outweigh the file it writes: the file is rewritten as
    one merged segment plus the latest KEEP_BOUNDARIES, and a restart still restores from the newest
    boundary exactly. (KEEP_BOUNDARIES is 2 here instead of 8, so that a few turns of the tiny model
    reach the rule.)"""
    import gguf_factory_qwen35
    monkeypatch.setattr(disk_states, "KEEP_BOUNDARIES", 2)
    path = gguf_factory_qwen35.write_tiny_qwen35_gguf(tmp_path_factory.mktemp("q") / "q35.gguf")
    e = start(path, tmp_path)
    try:
        msgs, rs = turns(e, 6)
        written = e.call(Status()).disk["written_bytes"]
    finally:
        e.stop()
    segs = segments(tmp_path)
    # compacted: the first segment runs past every boundary of the first turn (merged)
    assert segs[0].n > rs[0].prompt_tokens + len(rs[0].tokens)
    (f,) = tmp_path.glob("*.kvseg")
    assert written > f.stat().st_size
    e = start(path, tmp_path)
    try:
        r, _ = ask(e, msgs)
        assert r.restored_from_disk == r.cached_tokens > rs[-1].prompt_tokens // 2
        assert r.tokens == fresh_read(e, r)
    finally:
        e.stop()


@pytest.mark.parametrize("arch", ["gemma4", "gpt-oss", "olmo3", "qwen35moe"])
def test_every_window_or_state_family_restores_after_a_restart(arch, tmp_path):
    """The other registered families with a window or a recurrent state (tests/arch_cases.py's writers:
    Gemma 4 with K/V-sharing layers, gpt-oss's windows with attention sinks, OLMo 3's, Qwen3.5's MoE):
    written, restored after a restart, the reply equal to a fresh read."""
    import arch_cases
    path = arch_cases.ARCH_WRITERS[arch](tmp_path / f"{arch}.gguf")
    e = start(path, tmp_path / "d")
    try:
        kinds = while_held(e, lambda x: [(type(c).__name__, getattr(c, "max_size", 0))
                                         for c in x.handlers.make_cache()])
        msgs, rs = turns(e, 2)
    finally:
        e.stop()
    windows = [w for k, w in kinds if k == "RotatingKVCache"]
    assert windows or any(k == "ArraysCache" for k, _ in kinds)
    assert rs[-1].prompt_tokens > 2 * max(windows, default=0)         # past every window
    assert all(s.version == ds.VERSION_STATES for s in segments(tmp_path / "d"))
    e = start(path, tmp_path / "d")
    try:
        r, _ = ask(e, msgs)
        assert r.restored_from_disk == r.cached_tokens > 0
        assert r.tokens == fresh_read(e, r)
    finally:
        e.stop()


def test_a_file_whose_layers_are_not_the_models_is_dropped(model, tmp_path):
    """A whole, checksummed version-4 file under this model's key and fingerprint whose layer list says
    other widths (a file of another build of the model, or a crafted one): its layers are checked
    against a one-token probe of the loaded model before anything is read: dropped with a line, the
    prompt read again."""
    import numpy as np
    name, path = model
    e = start(path, tmp_path)
    try:
        msgs, _ = turns(e, 1)
    finally:
        e.stop()
    (seg,) = segments(tmp_path)[:1]
    layers = [dict(d, t=[None if x is None else [*x[:-1], x[-1] * 2] for x in d["t"]]) for d in seg.meta["layers"]]
    meta = dict(seg.meta, layers=layers)
    kv, st = ds.layer_specs(layers, seg.n)
    zeros = [np.zeros(s.shape, ds._NP[s.dtype]) for s in kv], [np.zeros(s.shape, ds._NP[s.dtype]) for s in st]
    (f,) = tmp_path.glob("*.kvseg")
    f.write_bytes(b"".join(bytes(memoryview(p).cast("B")) for p in ds.encode_states(ds.header_json(meta), seg.tokens,
                                                                                     *zeros)))
    e = start(path, tmp_path)
    try:
        assert e.call(Status()).disk["entries"] == 1          # whole and checksummed: indexed
        r, lines = ask(e, msgs)
        assert r.cached_tokens == 0 and r.restored_from_disk == 0
        assert any("its layers are not this model's" in x for x in lines), lines
    finally:
        e.stop()


def test_a_client_naming_each_request_anew_keeps_one_file(model, tmp_path):
    """The server names each request anew (`http <id>`), and a follow-up that shares only part of the
    held conversation (Qwen3.5's template re-renders the last reply; a random reply's text need not give
    back its ids) gets a copy of that part from RAM parking, with no file of its own. The file stops at
    the last boundary the next turn shares, which that copy extends whole: the turn is appended to it,
    not written again whole as a second file; after a restart the next turn restores from it."""
    name, path = model
    e = start(path, tmp_path)
    try:
        msgs = list(FIRST)
        for i in range(3):
            r = e.call(GenerateRequest(messages=msgs, sampling=SP, conversation=f"http {i}"), timeout=300)
            msgs += [{"role": "assistant", "content": r.text}, {"role": "user", "content": f"And then, part {i}?"}]
            e.wait_idle(30)
            e.wait_idle(60)
            s = e.call(Status()).disk
            assert s["entries"] == 1 and len(list(tmp_path.glob("*.kvseg"))) == 1, s
            if i:
                assert s["last_write"]["kind"] == "append" and s["last_write"]["bytes"] < s["bytes"] / 2
    finally:
        e.stop()
    e = start(path, tmp_path)
    try:
        r, _ = ask(e, msgs, conv="http 9")
        assert r.restored_from_disk == r.cached_tokens > 0
        assert r.tokens == fresh_read(e, r)
    finally:
        e.stop()


@pytest.mark.parametrize("how", ["stop", "kill -9"])
def test_server_journey_with_a_recurrent_state(tmp_path_factory, strata_home, how):
    """The server journey (a real `strata serve` process, a real HTTP client) on a Qwen3.5 file: a turn,
    the server stopped or killed (SIGKILL) a few seconds after it, served again: the next turn's
    `cached_tokens` come from disk."""
    import gguf_factory_qwen35
    from test_disk_tier import restart_journey
    path = gguf_factory_qwen35.write_tiny_qwen35_gguf(tmp_path_factory.mktemp("srv") / "q35.gguf")
    first, again = restart_journey(path, strata_home, how, FIRST)
    cached = again["usage"]["prompt_tokens_details"]["cached_tokens"]
    # a new process: every cached token is from disk. Measured: 134 of the first prompt's 147, the end
    # of its user message, where the next turn diverges (this template renders the last reply
    # otherwise; its generation prompt, with an empty think block, is the other 13 tokens)
    assert cached > first["usage"]["prompt_tokens"] // 2, again["usage"]


def test_a_restored_session_keeps_its_disk_file_across_a_restart(model, tmp_path, caplog):
    """A session of this conversation restored under another chat in a new engine (the app's launch with
    a copy of a chat's session): its idle-time write links it to the file on disk or appends to it, never
    fails; after a restart the follow-up comes back from disk and equals a fresh read."""
    caplog.set_level(logging.INFO, logger="strata")
    name, path = model
    session = tmp_path / "copy.stratasession"
    e = start(path, tmp_path / "d")
    try:
        msgs, _ = turns(e, 2, conv="chat-1")
        e.call(SaveSession(str(session), conversation="chat-1"), timeout=300)
    finally:
        e.stop()
    e = start(path, tmp_path / "d")
    try:
        e.call(RestoreSession(str(session), conversation="chat-2"), timeout=300)
        e.wait_idle(60)
        e.wait_idle(60)
        s = e.call(Status()).disk
        assert s["entries"] >= 1 and s["bytes"] > 0, s
    finally:
        e.stop()
    lines = [r.getMessage() for r in caplog.records]
    assert any("disk cache:" in x for x in lines), lines      # the records are the engine's log
    assert not [x for x in lines if "failed" in x], lines
    e = start(path, tmp_path / "d")
    try:
        r, lines = ask(e, msgs, conv="chat-2")
        assert r.restored_from_disk == r.cached_tokens > 0, lines
        assert r.tokens == fresh_read(e, r)
    finally:
        e.stop()
