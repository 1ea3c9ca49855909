"""A process that exits while its engine is mid-reply exits with its own status, never MLX's abort.

Ctrl-C on `strata generate` while tokens streamed ended in SIGABRT ("terminate called without an
active exception") every time: the daemon engine thread came back from MLX while the interpreter
finalized and was unwound through MLX's C++ frames. engine/at_exit.py now cancels every
request and waits (bounded) for the engine thread to be back waiting for one. Real processes, real
signals, a real GGUF: the exit status is what is checked.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import REPO

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from gguf_factory import write_tiny_gguf
    # 4 x 256 in float32: slow enough on the CPU that a reply of thousands of tokens is still running
    return write_tiny_gguf(tmp_path_factory.mktemp("exit") / "exit.gguf", n_layer=4, n_embd=256, n_head=4,
                           n_head_kv=2, n_ff=512, context_length=32768, seed=3)


def _env():
    return {**os.environ, "PYTHONPATH": str(REPO)}


def _default_sigint():
    signal.signal(signal.SIGINT, signal.SIG_DFL)    # pytest's shell may have started us with it ignored


@pytest.mark.parametrize("attempt", range(3))
def test_ctrl_c_mid_reply_exits_130(model, attempt):
    # Greedy: this model's greedy reply runs hundreds of tokens without EOS. A sampled one could end
    # (EOS at 23 tokens in one CI run) before the read below, and the signal then found an exited process.
    p = subprocess.Popen([sys.executable, "-m", "engine.cli", "generate", "--model", str(model), "--prompt",
                          "Once upon a time", "-n", "20000", "--temperature", "0"],
                         cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         preexec_fn=_default_sigint)
    try:
        want = 40 + 20 * attempt
        got = p.stdout.read(want)    # tokens are streaming: the engine thread is in MLX
        assert len(got) == want and p.poll() is None, p.stderr.read().decode()[-800:]
        p.send_signal(signal.SIGINT)
        _, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
    err = err.decode()
    assert "terminate called" not in err, err[-800:]
    assert p.returncode == 130, (p.returncode, err[-800:])


SCRIPT = """
import sys
from engine.engine import Engine, EngineOptions, GenerateRequest
from engine.sampling import SamplingParams
eng = Engine(EngineOptions(model=sys.argv[1])).start()
eng.startup.result(120)
h = eng.submit(GenerateRequest(prompt="Once upon a time", sampling=SamplingParams(max_tokens=20000, temperature=0.8)))
for ev in h.events(60):
    if type(ev).__name__ == "Token":
        break
print("leaving mid-reply", flush=True)
"""


def test_a_script_that_leaves_mid_reply_exits_0(model):
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-c", SCRIPT, str(model)], cwd=REPO, env=_env(), capture_output=True,
                       text=True, timeout=120)
    assert "terminate called" not in p.stderr, p.stderr[-800:]
    assert p.returncode == 0 and "leaving mid-reply" in p.stdout, (p.returncode, p.stderr[-800:])
    assert time.monotonic() - t0 < 100


def test_ctrl_c_on_the_server_ends_a_live_stream_and_exits_130(model):
    """`strata serve` with a reply streaming to a real client: Ctrl-C ends the stream (its last event
    says why), the server exits 130 within its graceful period, with no traceback."""
    import socket

    import httpx
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    p = subprocess.Popen([sys.executable, "-m", "engine.cli", "serve", "--model", str(model), "--port", str(port)],
                         cwd=REPO, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                         preexec_fn=_default_sigint)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            try:
                if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline and p.poll() is None, "the server did not come up"
            time.sleep(0.2)
        lines = []
        # greedy, as above: a sampled reply can meet EOS before the tenth event
        body = {"stream": True, "max_tokens": 20000, "temperature": 0,
                "messages": [{"role": "user", "content": "Tell a long story"}]}
        with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=60) as r:
            t0 = None
            for line in r.iter_lines():
                lines.append(line)
                if t0 is None and len(lines) >= 10:
                    p.send_signal(signal.SIGINT)      # tokens are streaming
                    t0 = time.monotonic()
        assert t0 is not None, f"the reply ended by itself after {len(lines)} lines"
        ended_s = time.monotonic() - t0
        _, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
    assert "Traceback" not in err and "terminate called" not in err, err[-1500:]
    assert p.returncode == 130, (p.returncode, err[-800:])
    # a hang bound (a second or two on a quiet machine; the reply asked for 20,000 tokens would run on)
    assert ended_s < 30, f"the stream ran on {ended_s:.1f} s after Ctrl-C"
    events = [x for x in lines if x]
    assert events[-1] == "data: [DONE]", events[-3:]     # the stream was ended, not cut
    import json
    last = json.loads(events[-2][len("data: "):])
    # the reply's own last chunk (the OpenAI wire has no "cancelled": the server says "stop")
    assert last["choices"][0]["finish_reason"] == "stop", last
