"""Issue 31 (items 4, 5, 6's MoE case, 8's server and context cases): hostile draft names, a refused load's
exit code, a FIFO for a model, an inf expert count, a context over the model's, the server during a load.

Each case: one line, exit 2 or 4xx in the API's shape, bounded time, and the live K/V kept. The server
cases run the real server (uvicorn on a loopback port) with httpx; the exit-code cases run the real CLI.
"""
from __future__ import annotations

import concurrent.futures
import logging
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from engine import drafts as drafts_mod
from engine.engine import Engine, EngineOptions, GenerateRequest, Status
from engine.errors import ModelFileError, StrataError
from engine.frontends.server import ServerThread, create_app
from engine.memory.memory_guard import GiB, MemoryGuard, MemoryReading

MiB = 1 << 20
from engine.sampling import SamplingParams
from engine_reads import while_held

REPO = Path(__file__).resolve().parents[2]
SYSTEM = ("You are a careful assistant who answers questions about the history of tea, the way it is grown, "
          "picked, dried and brewed in different countries. ") * 4


def _corrupt_shape(path: Path, tensor: str = "blk.1.ffn_down.weight") -> Path:
    """Swap a 2-D tensor's dimensions in the header: the header stays valid (same byte count), mlx-lm's
    load_weights check fails."""
    b = bytearray(path.read_bytes())
    name = tensor.encode()
    i = b.index(struct.pack("<Q", len(name)) + name) + 8 + len(name)
    (nd,) = struct.unpack_from("<I", b, i)
    dims = struct.unpack_from(f"<{nd}Q", b, i + 4)
    struct.pack_into(f"<{nd}Q", b, i + 4, *reversed(dims))
    path.write_bytes(bytes(b))
    return path


@pytest.fixture(scope="module")
def home(tmp_path_factory):
    """A STRATA_HOME whose models folder holds the target, a draft and a FIFO named like a model."""
    from gguf_factory import write_tiny_gguf
    h = tmp_path_factory.mktemp("hostile-home")
    models = h / "models"
    models.mkdir()
    write_tiny_gguf(models / "tiny-target.gguf", arch="llama", n_layer=2, n_embd=64, seed=5, context_length=2048)
    write_tiny_gguf(models / "tiny-draft.gguf", arch="llama", n_layer=1, n_embd=64, seed=7, context_length=2048)
    os.mkfifo(models / "fifo.gguf")
    return h


@pytest.fixture(autouse=True)
def _models_home(home, strata_home, monkeypatch):
    """The module's models folder for every test (after conftest's per-test STRATA_HOME)."""
    monkeypatch.setenv("STRATA_HOME", str(home))


@pytest.fixture(scope="module")
def engine(home):
    eng = Engine(EngineOptions(model=str(home / "models" / "tiny-target.gguf"))).start()
    assert eng.call(Status(), timeout=120).model
    yield eng
    eng.stop()


@pytest.fixture(scope="module")
def server(engine):
    srv = ServerThread(create_app(engine)).start()
    yield srv
    srv.stop()


def _post(srv, body: dict, timeout: float = 60) -> tuple[httpx.Response, float]:
    t0 = time.monotonic()
    r = httpx.post(f"{srv.base_url}/chat/completions", json=body, timeout=timeout)
    return r, time.monotonic() - t0


def _turn(srv, messages, **extra) -> dict:
    r, _ = _post(srv, {"model": "default", "messages": messages, "max_tokens": 4, "temperature": 0, **extra})
    assert r.status_code == 200, r.text
    return r.json()


def _one_line_error(r: httpx.Response, status: int) -> str:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) >= {"message", "type", "param", "code"}, err
    assert "\n" not in err["message"] and len(err["message"]) < 300, err["message"]
    assert "Traceback" not in r.text
    return err["message"]


# ---- item 4: draft names ----------------------------------------------------------------------
def test_draft_names_resolve_in_the_models_folder_only(server, engine, home, tmp_path, monkeypatch):
    """~, absolute, `..` and working-folder names, a FIFO, control characters and a 5,000-character name:
    400 at once in the API's shape, the file's bytes never echoed, and the parked conversation's next
    turn still reads its K/V."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "secret.txt").write_bytes(b"TOPSECRET contents of the server's working folder")
    shutil.copy(home / "models" / "tiny-draft.gguf", tmp_path / "cwd-draft.gguf")   # a GGUF there must not load
    convo = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "How is green tea dried?"}]
    first = _turn(server, convo)
    convo += [first["choices"][0]["message"], {"role": "user", "content": "And black tea?"}]
    hostile = {
        "draft:~www-data": "not a path", "draft:~": "not a path", "draft:~/x.gguf": "not a path",
        "draft:/etc/passwd": "not a path", "draft:../models/tiny-draft.gguf": "not a path",
        "draft:..": "not a path", "draft:.hidden": "not a path", "draft:a\\b": "not a path",
        "draft:secret.txt": "no draft model named", "draft:cwd-draft.gguf": "no draft model named",
        "draft:cwd-draft": "no draft model named",
        "draft:fifo.gguf": "not a regular file", "draft:fifo": "not a regular file",
        "draft:tiny\x00.gguf": "control characters", "draft:ti\nny": "control characters",
        "draft:" + "a" * 5000: "characters", "draft:" + "b" * 256: "at most 255",
        "draft:nosuch": "no draft model named", "draft:tiny": "matches several models",
    }
    for spec, want in hostile.items():
        r, secs = _post(server, {"model": "default", "messages": convo, "max_tokens": 4, "speculative": spec})
        msg = _one_line_error(r, 400)
        assert want in msg and "TOPS" not in msg and str(home) not in msg, (spec[:40], msg)
        assert r.json()["error"]["param"] == "speculative"
        assert secs < 5, (spec[:40], secs)
    follow = _turn(server, convo)
    assert follow["usage"]["prompt_tokens_details"]["cached_tokens"] > 0, follow["usage"]   # K/V kept


def test_a_draft_from_the_models_folder_is_used_and_released_when_idle(server, engine, monkeypatch, home):
    monkeypatch.setattr(drafts_mod, "DRAFT_IDLE_S", 0.3)
    out = _turn(server, [{"role": "user", "content": "Hello there"}], speculative="draft:tiny-draft")
    assert "speculative" in out["usage"], out["usage"]
    assert engine.drafts.named is None or engine.drafts.named.path.name == "tiny-draft.gguf"
    deadline = time.monotonic() + 10      # the engine thread waits DRAFT_IDLE_S (read at its next wait)
    while engine.drafts.named is not None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert engine.drafts.named is None, "the draft was not released"


def test_a_draft_goes_through_the_memory_estimate_and_guard(server, engine, home):
    """With little memory free the draft is refused before any tensor is read (400 memory_refused), and
    the conversation's K/V stays."""
    convo = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Where does oolong come from?"}]
    first = _turn(server, convo)
    convo += [first["choices"][0]["message"], {"role": "user", "content": "Why?"}]
    old = engine.guard
    tight = MemoryGuard(reserve_bytes=GiB, reader=lambda: MemoryReading(16 * GiB, GiB + MiB, "test reading"))
    while_held(engine, lambda e: e.drafts.release("test"))
    engine.guard = tight
    try:
        r, secs = _post(server, {"model": "default", "messages": convo, "max_tokens": 4,
                                 "speculative": "draft:tiny-draft.gguf"})
    finally:
        engine.guard = old
    msg = _one_line_error(r, 400)
    assert r.json()["error"]["code"] == "memory_refused" and msg.startswith("draft model:"), msg
    assert "does not fit" in msg and engine.drafts.named is None and secs < 10
    follow = _turn(server, convo)
    assert follow["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


def test_engine_side_draft_paths_fifo_and_long_names(engine, home):
    """The CLI and the app pass draft:PATH: a FIFO is refused at once (not opened for reading), a name
    too long for the file system is one line, and neither drops the live K/V."""
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Tell me about matcha."}]
    engine.call(GenerateRequest(messages=msgs, sampling=SamplingParams(max_tokens=2, temperature=0)), timeout=120)
    before = engine.call(Status()).live_tokens
    for spec, want in ((f"draft:{home / 'models' / 'fifo.gguf'}", "not a regular file"),
                       ("draft:" + "x" * 5000, "too long"),
                       (f"draft:{home / 'models' / 'nothing.gguf'}", "not found")):
        t0 = time.monotonic()
        with pytest.raises(StrataError) as e:
            engine.call(GenerateRequest(messages=msgs, sampling=SamplingParams(max_tokens=2), speculative=spec),
                        timeout=30)
        assert want in str(e.value) and "\n" not in str(e.value) and len(str(e.value)) < 400, str(e.value)[:300]
        assert time.monotonic() - t0 < 5
    assert engine.call(Status()).live_tokens == before


# ---- items 5, 4 (FIFO model), 6 (MoE): the command line exits 2 every time -----------------------
def _cli(*args, timeout=120) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "engine.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=REPO)


def test_refusals_exit_2_every_time(tmp_path, home):
    """A GGUF whose tensor shapes fail mlx-lm's weight check (header valid), ten runs: each exits 2 with
    the one line, never 134 ("terminate called without an active exception"). Beside them: a FIFO named
    as the model (refused at once, not opened for reading)."""
    from gguf_factory import write_tiny_gguf
    bad = _corrupt_shape(write_tiny_gguf(tmp_path / "bad-shape.gguf", n_layer=2, n_embd=64, n_ff=128))
    runs = [("bad-shape", str(bad))] * 10 + [("fifo", str(home / "models" / "fifo.gguf"))]
    t0 = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        done = list(pool.map(lambda r: (r[0], _cli("generate", "--model", r[1], "--prompt", "hi", "-n", "2")), runs))
    for kind, p in done:
        lines = p.stderr.strip().splitlines()
        assert p.returncode == 2 and len(lines) == 1, (kind, p.returncode, p.stderr[-600:])
        assert lines[0].startswith("strata: ") and "terminate" not in p.stderr
        assert {"bad-shape": "tensors do not match a llama model",
                "fifo": "is not a regular file"}[kind] in lines[0], (kind, lines[0])
    print(f"{len(runs)} refusals in {time.monotonic() - t0:.1f} s, all exit 2")


def test_moe_expert_count_inf_is_one_line_in_the_loader(tmp_path):
    """The loader's own reading (also behind the estimate: a draft, a distributed rank, cvec train)."""
    import gguf

    from engine.model.gguf_file import open_gguf
    from engine.model.model_loader import load_model
    from gguf_factory import write_tiny_moe_gguf
    real = gguf.GGUFWriter.add_expert_count
    for arch in ("qwen3moe", "mixtral"):
        gguf.GGUFWriter.add_expert_count = lambda w, n: w.add_float32(f"{w.arch}.expert_count", float("inf"))
        try:
            p = write_tiny_moe_gguf(tmp_path / f"{arch}-inf.gguf", arch=arch, n_embd=64, n_ff_exp=64, n_ff_shexp=64)
        finally:
            gguf.GGUFWriter.add_expert_count = real
        with pytest.raises(ModelFileError, match="expert_count") as e:
            load_model(open_gguf(p))
        assert "\n" not in str(e.value)


# ---- item 8: a context over the model's is said; the server answers during a load --------------
def test_a_context_over_the_model_s_is_capped_with_a_warning(home, caplog):
    with caplog.at_level(logging.WARNING, logger="strata"):
        eng = Engine(EngineOptions(model=str(home / "models" / "tiny-draft.gguf"), context_length=10_000_000)).start()
        try:
            assert eng.call(Status(), timeout=120).model
            assert eng.n_ctx == 2048
        finally:
            eng.stop()
    said = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert any("10000000 tokens asked" in s and "at most 2048" in s for s in said), said


SLOW_SERVE = """
import sys, time
from engine.model_load import ModelLoad
real = ModelLoad.load
def slow(self, req, handle):
    time.sleep(float(sys.argv[1]))
    return real(self, req, handle)
ModelLoad.load = slow
from engine.frontends.cli import main
sys.exit(main(["serve", "--model", sys.argv[2], "--port", sys.argv[3]]))
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_server_answers_models_and_health_while_the_model_loads(home, tmp_path):
    port = _free_port()
    model = home / "models" / "tiny-target.gguf"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    p = subprocess.Popen([sys.executable, "-c", SLOW_SERVE, "6", str(model), str(port)], env=env, cwd=REPO,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline, seen = time.monotonic() + 60, None
        while time.monotonic() < deadline:
            try:
                seen = httpx.get(f"{base}/v1/models", timeout=2)
                break
            except httpx.TransportError:
                time.sleep(0.1)
        assert seen is not None and seen.status_code == 200, "no answer while loading"
        data = seen.json()["data"]
        assert data == [{"id": "tiny-target", "object": "model", "created": 0, "owned_by": "strata",
                         "status": "loading"}], data
        t0 = time.monotonic()
        h = httpx.get(f"{base}/health", timeout=2)
        assert time.monotonic() - t0 < 2
        assert h.status_code == 503 and h.json()["error"]["code"] == "model_loading", h.text
        deadline = time.monotonic() + 60
        while httpx.get(f"{base}/health", timeout=5).status_code != 200:
            assert time.monotonic() < deadline and p.poll() is None
            time.sleep(0.2)
        data = httpx.get(f"{base}/v1/models", timeout=5).json()["data"]
        assert data[0]["id"] == "tiny-target" and "status" not in data[0]
    finally:
        p.send_signal(signal.SIGINT)
        try:
            p.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            p.kill()
            p.communicate()


def test_serve_with_a_refused_model_exits_2_in_one_line(tmp_path):
    from gguf_factory import write_tiny_gguf
    bad = _corrupt_shape(write_tiny_gguf(tmp_path / "bad-serve.gguf", n_layer=2, n_embd=64, n_ff=128))
    p = _cli("serve", "--model", str(bad), "--port", str(_free_port()), timeout=90)
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2 and len(lines) == 1 and "tensors do not match" in lines[0], (p.returncode, p.stderr[-600:])
