"""A data folder that cannot be used, and an engine thread that dies: real `strata` processes on real
folders (a regular file in the way), real HTTP.

  * STRATA_HOME under a regular file: `strata serve` and `strata generate` exit 2 at start with one line
    naming the folder and why (they used to hang: the engine thread died, /health said "loading"
    forever and requests waited for it);
  * only the disk cache's folder unusable (a file named `cache` in the data folder): the server serves
    with the disk tier off and says so on stderr;
  * an engine thread that ends on an error: /health reports it, the request it was serving, the ones
    waiting and every later one fail at once with its line (in-process: nothing in a real process
    ends the thread on purpose).
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from engine.api import Status
from engine.engine import Engine, EngineOptions
from engine.errors import EngineError
from engine.scheduler import Hold
from engine.frontends.server import ServerThread, create_app
from test_disk_tier import _chat, _port

ROOT = Path(__file__).resolve().parents[2]
DEADLINE = 120          # seconds: a start-up check takes a second or two; a hang never ends


def _strata(home: Path, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, STRATA_HOME=str(home))
    return subprocess.run([sys.executable, "-m", "engine.cli", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=DEADLINE)


def _blocked_home(tmp_path: Path) -> Path:
    (tmp_path / "a-file").write_text("not a folder")
    return tmp_path / "a-file" / "strata"


@pytest.mark.parametrize("command", ["serve", "generate"])
def test_a_data_folder_under_a_file_is_one_line_and_exit_2(tiny_gguf, tmp_path, command):
    home = _blocked_home(tmp_path)
    extra = ["--port", "0"] if command == "serve" else ["--prompt", "Hello", "--max-tokens", "2"]
    p = _strata(home, command, "--model", str(tiny_gguf), *extra)
    assert p.returncode == 2, p.stderr[-2000:]
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1, p.stderr
    assert str(home) in lines[0] and "a part of its path is a file, not a folder" in lines[0], lines[0]
    assert "Traceback" not in p.stderr


def test_a_read_only_data_folder_is_one_line_and_exit_2(tiny_gguf, tmp_path):
    if os.geteuid() == 0:
        pytest.skip("running as root: a read-only mode does not stop root's writes (the folder under a file "
                    "is the case tested for it)")
    home = tmp_path / "ro"
    home.mkdir()
    home.chmod(0o500)
    try:
        p = _strata(home, "generate", "--model", str(tiny_gguf), "--prompt", "Hello", "--max-tokens", "2")
    finally:
        home.chmod(0o700)
    assert p.returncode == 2 and "no permission to write there" in p.stderr, p.stderr[-2000:]


def test_only_the_cache_folder_unusable_serves_with_the_disk_tier_off(tiny_gguf, strata_home):
    (strata_home / "cache").write_text("a file where the cache folder goes")
    port = _port()
    env = dict(os.environ, STRATA_HOME=str(strata_home))
    p = subprocess.Popen([sys.executable, "-m", "engine.cli", "serve", "--model", str(tiny_gguf), "--port", str(port)],
                         cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        _wait_healthy(port, p)
        r = _chat(port, [{"role": "user", "content": "Hello there"}])
        assert r["usage"]["completion_tokens"] > 0
    finally:
        p.send_signal(signal.SIGINT)
        _, err = p.communicate(timeout=DEADLINE)
    assert p.returncode in (0, 130), err[-2000:]      # stopped by the SIGINT (130: it says so)
    assert "disk cache: off:" in err and "a part of its path is a file, not a folder" in err, err[-2000:]
    assert (strata_home / "cache").read_text() == "a file where the cache folder goes"


def _wait_healthy(port: int, p: subprocess.Popen) -> None:
    deadline = time.monotonic() + DEADLINE
    while time.monotonic() < deadline:
        assert p.poll() is None, "the server exited"
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise AssertionError("the server did not become healthy")


class Dying(Hold):
    """A hold of the engine thread that, once released, ends the thread (an error no request handler
    catches: what any bug outside a request would do)."""

    def wait_released(self) -> None:
        super().wait_released()
        raise SystemExit("the engine thread ends here")


def test_a_dead_engine_thread_fails_every_request_and_health_says_why(tiny_gguf):
    engine = Engine(EngineOptions(model=str(tiny_gguf))).start()
    engine.startup.result(DEADLINE)
    srv = ServerThread(create_app(engine)).start()
    base = f"http://127.0.0.1:{srv.port}"
    try:
        dying = Dying()
        engine.scheduler.put(dying)
        assert dying.reached.wait(DEADLINE)
        replies: list = []
        waiting = threading.Thread(target=lambda: replies.append(httpx.post(
            f"{base}/v1/chat/completions", timeout=DEADLINE,
            json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4})))
        waiting.start()
        queued = engine.submit(Status())
        dying.release()
        waiting.join(DEADLINE)
        assert not waiting.is_alive(), "a request waiting on the dead engine hung"
        (r,) = replies
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_stopped", r.text
        assert "the engine stopped: SystemExit" in r.json()["error"]["message"]
        with pytest.raises(EngineError, match="the engine stopped"):
            queued.result(DEADLINE)
        with pytest.raises(EngineError, match="the engine stopped"):
            engine.call(Status(), timeout=DEADLINE)          # a later request: at once, not a hang
        health = httpx.get(f"{base}/health", timeout=DEADLINE)
        assert health.status_code == 503 and health.json()["error"]["code"] == "engine_stopped", health.text
    finally:
        srv.stop()
        engine.stop()
