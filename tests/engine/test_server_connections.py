"""Connections bounded, with raw sockets against a real server on a tiny model: a body shorter than its
Content-Length ends quietly, slow headers and a drip-fed body are answered 408 and closed, connections
past the cap get 503 at once, the log stays bounded, and the server answers normally afterwards. The
deadlines here are set small (ConnectionLimits) so the tests are cheap; what is checked does not depend
on the machine's speed (a hang would be a socket timeout many times the deadline)."""
from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import httpx
import pytest
from log_records import LogRecords

from engine.frontends.connections import ConnectionLimits, RateLimitFilter
from engine.frontends.server import ServerThread, create_app

HANG_S = 60.0                  # a socket read this long means the server never answered or closed


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from gguf_factory import write_tiny_gguf

    from engine.engine import Engine, EngineOptions
    path = write_tiny_gguf(tmp_path_factory.mktemp("conn-model") / "tiny-conn.gguf", arch="llama",
                           n_layer=2, n_embd=64, seed=5, context_length=1024)
    eng = Engine(EngineOptions(model=str(path), cache_mib=16)).start()
    yield eng
    eng.stop()


_LOGGERS = ("uvicorn", "asyncio", "strata")     # uvicorn.error and strata.server propagate to these


@pytest.fixture
def serve(engine):
    """serve(**limits) -> (server, log records); stopped after the test."""
    started = []
    records = LogRecords()

    def start(**limits):
        srv = ServerThread(create_app(engine), limits=ConnectionLimits(**limits)).start()
        for name in _LOGGERS:
            logging.getLogger(name).addHandler(records)
        started.append(srv)
        return srv, records

    yield start
    for name in _LOGGERS:
        logging.getLogger(name).removeHandler(records)
    for srv in started:
        srv.stop()


def _connect(srv) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", srv.port), timeout=HANG_S)
    return s


def _read_all(s: socket.socket) -> bytes:
    out = b""
    while True:
        try:
            chunk = s.recv(65536)
        except ConnectionResetError:
            return out
        if not chunk:
            return out
        out += chunk


def _served_normally(srv) -> None:
    r = httpx.post(f"http://127.0.0.1:{srv.port}/v1/chat/completions", timeout=HANG_S,
                   json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert r.status_code == 200, r.text


def _post_head(length: int) -> bytes:
    return (f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {length}\r\n\r\n").encode()


BODY = b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}'


def test_body_shorter_than_its_length_ends_quietly(serve):
    srv, records = serve()
    for _ in range(3):
        s = _connect(srv)
        s.sendall(_post_head(len(BODY) + 1) + BODY)        # one byte short, then the client hangs up
        s.shutdown(socket.SHUT_WR)
        _read_all(s)
        s.close()
    s = _connect(srv)                                        # and one that just closes mid-body
    s.sendall(_post_head(len(BODY) + 1) + BODY[:10])
    s.close()
    time.sleep(0.5)                                          # let the server see the hang-ups
    _served_normally(srv)
    assert not records.tracebacks(), records.tracebacks()


def test_slow_headers_are_answered_408_and_closed(serve):
    srv, records = serve(header_timeout_s=1.0)
    s = _connect(srv)
    s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")    # and never the rest
    reply = _read_all(s)                                     # returns once the server closes
    s.close()
    assert reply.startswith(b"HTTP/1.1 408"), reply[:200]
    s = _connect(srv)                                        # a connection that sends nothing at all
    assert _read_all(s).startswith(b"HTTP/1.1 408")
    s.close()
    _served_normally(srv)
    assert not records.tracebacks(), records.tracebacks()


def test_drip_fed_body_is_answered_408_and_closed(serve):
    srv, records = serve(body_timeout_s=1.0)
    s = _connect(srv)
    s.sendall(_post_head(len(BODY)))
    sent = 0
    s.settimeout(0.3)
    reply = b""
    while sent < len(BODY):                                  # a byte at a time, 0.3 s apart: ~20 s in all
        try:
            s.sendall(BODY[sent:sent + 1])
        except (BrokenPipeError, ConnectionResetError):
            break
        sent += 1
        try:
            chunk = s.recv(65536)
        except socket.timeout:
            continue
        reply += chunk
        if not chunk or reply:
            break
    s.settimeout(HANG_S)
    reply += _read_all(s)
    s.close()
    assert sent < len(BODY), "the server read the whole drip-fed body"
    assert reply.startswith(b"HTTP/1.1 408"), reply[:200]
    _served_normally(srv)
    assert not records.tracebacks(), records.tracebacks()


def test_connections_past_the_cap_get_503_and_the_server_recovers(serve):
    cap = 4
    srv, records = serve(max_connections=cap, header_timeout_s=HANG_S)
    idle = [_connect(srv) for _ in range(cap)]              # the cap's worth, holding their connections
    time.sleep(0.3)                                          # accepted by the server
    extra = []
    for _ in range(3 * cap):
        s = _connect(srv)
        s.sendall(b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        extra.append(s)
    replies = [_read_all(s) for s in extra]                  # each answered and closed at once
    for s in extra + idle:
        s.close()
    assert all(r.startswith(b"HTTP/1.1 503") for r in replies), [r[:60] for r in replies]
    time.sleep(0.5)
    _served_normally(srv)
    texts = records.texts()
    # one line each a minute, however many were refused
    assert sum("over the connection cap" in t for t in texts) == 1, texts
    assert sum("Exceeded concurrency limit" in t for t in texts) <= 1, texts
    assert not records.tracebacks(), records.tracebacks()


def test_rate_limit_filter_counts_what_it_held_back():
    f = RateLimitFilter(interval_s=3600)
    logger = logging.getLogger("strata.test-rate-limit")
    logger.propagate = False
    seen = LogRecords()
    logger.addHandler(seen)
    logger.addFilter(f)
    try:
        for _ in range(1000):
            try:
                raise OSError(24, "Too many open files")
            except OSError:
                logger.error("socket.accept() out of system resource\nsocket: <x>", exc_info=True)
        logger.warning("something else")
    finally:
        logger.removeFilter(f)
        logger.removeHandler(seen)
    assert len(seen.records) == 2
    assert "\n" not in seen.records[0].getMessage() and seen.records[0].exc_info is None
    assert f.held == {"Too many open files": 999}


_EXHAUST = textwrap.dedent("""
    import logging, os, resource, socket, sys, time
    sys.path.insert(0, sys.argv[1])
    from engine.frontends.server import ServerThread, create_app
    from engine.engine import Engine, EngineOptions, Status
    # after the imports: mlx-lm sets its own limit when imported
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
    eng = Engine(EngineOptions(model=sys.argv[2], cache_mib=16)).start()
    eng.call(Status())                     # loaded (and its modules imported) before the descriptors go
    httpx_warm = __import__("httpx")
    srv = ServerThread(create_app(eng)).start()
    held = []
    try:                                   # the process's descriptors used up (by anything at all)
        while True:
            held.append(os.open(os.devnull, os.O_RDONLY))
    except OSError:
        pass
    for f in held[-4:]:
        os.close(f)
    held = held[:-4]
    clients = []
    deadline = time.monotonic() + 3.5      # the accept loop retries once a second: three or four tries
    while time.monotonic() < deadline:
        try:
            clients.append(socket.create_connection(("127.0.0.1", srv.port), timeout=1))
        except OSError:
            pass
        time.sleep(0.05)
    for f in held:
        os.close(f)
    for c in clients:
        c.close()
    time.sleep(1.5)
    import httpx
    r = httpx.get(f"http://127.0.0.1:{srv.port}/v1/models", timeout=30)
    print("STATUS", r.status_code, flush=True)
    srv.stop()
    eng.stop()
""")


def test_descriptor_exhaustion_logs_one_line(tmp_path):
    from gguf_factory import write_tiny_gguf
    path = write_tiny_gguf(tmp_path / "tiny-fd.gguf", arch="llama", n_layer=1, n_embd=32, context_length=256)
    root = str(Path(__file__).resolve().parents[2])
    p = subprocess.run([sys.executable, "-c", _EXHAUST, root, str(path)], capture_output=True, text=True,
                       timeout=300, env={**os.environ, "PYTHONPATH": root})
    assert "STATUS 200" in p.stdout, p.stdout + p.stderr
    lines = [ln for ln in p.stderr.splitlines() if "open files" in ln or "out of system resource" in ln]
    assert 1 <= len(lines) <= 1, p.stderr[-3000:]
    assert "Traceback" not in p.stderr, p.stderr[-3000:]


@pytest.mark.parametrize("flags,line", [
    (["--max-connections", "0"], "strata: --max-connections must be in 1..65536, got 0"),
    (["--header-timeout", "0"], "strata: --header-timeout must be in (0, 3600] seconds, got 0.0"),
    (["--body-timeout", "nan"], "strata: --body-timeout must be in (0, 3600] seconds, got nan"),
])
def test_serve_refuses_bad_connection_flags(tiny_gguf, capsys, flags, line):
    from engine.frontends.cli import main
    code = main(["serve", "--model", str(tiny_gguf), "--port", "0", *flags])
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert code == 2 and lines == [line]
