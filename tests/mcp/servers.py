"""Helpers for the tests' real MCP servers (tool_server.py): the stdio server's config and a
streamable-HTTP server run as a subprocess on a free 127.0.0.1 port."""
from __future__ import annotations

import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

from app.tools.config import ServerConfig

SERVER = Path(__file__).with_name("tool_server.py")


def stdio_config(name: str = "t", mode: str = "stdio", enabled: bool = True) -> ServerConfig:
    return ServerConfig(name, command=sys.executable, args=(str(SERVER), mode), enabled=enabled)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def http_server(deadline_s: float = 60.0):
    """A streamable-HTTP tool server; yields its /mcp URL once it accepts connections."""
    port = _free_port()
    proc = subprocess.Popen([sys.executable, str(SERVER), "http", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        end = time.monotonic() + deadline_s
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > end:
                    raise RuntimeError("the HTTP tool server did not start") from None
                time.sleep(0.1)
        yield f"http://127.0.0.1:{port}/mcp"
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
