"""OpenAI-compatible local server: one Engine behind Starlette + uvicorn.

    strata serve [--host 127.0.0.1] [--port 8484] [--api-key KEY] [engine flags]

Endpoints: GET /v1/models (and /v1/models/{id}), POST /v1/chat/completions, POST /v1/completions
(streaming with SSE and not), POST /v1/sessions/save {"name", "messages"?, "force"?} and /v1/sessions/restore {"name": ...}.

Concurrent HTTP requests are decoded together, up to --max-sequences at once (engine/generation/batching.py);
the rest queue.
Engine events reach the event loop through the handle's callback (`call_soon_threadsafe`), never by
blocking the loop. A client that goes away - while queued, during prefill or mid-stream - cancels its
request (`Handle.cancel()`), so the engine moves on to the next one.

The endpoints are engine/frontends/openai_api.py's and anthropic_api.py's route tables; this module
holds the app (`create_app`: the routes, the middleware that guards them, the error handlers) and how
it is served. Errors use OpenAI's shape, {"error": {"message", "type", "param", "code"}}, with the
matching status.

`create_app(engine, api_key=None)` returns the Starlette app; `ServerThread(app).start()` runs it on
a background thread (tests, the bench, the Qt app's settings toggle); `cmd_serve(args)` is the CLI.
"""
from __future__ import annotations

import hmac
import ipaddress
import socket
import sys
import threading
import time

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response
import uvicorn
from urllib.parse import urlsplit

from engine.errors import StrataError
from engine.frontends.tool_calls import DEFAULT_VOLATILE_LINES
from engine.frontends import anthropic_api, openai_api
from engine.frontends.connections import ConnectionLimits, uvicorn_options
from engine.frontends.wire import (  # noqa: F401 - HTTP_OF_ERROR, engine_error and _chat_message stay importable from here
                    _chat_message, _models, APIError, engine_error, HTTP_OF_ERROR, Served, ToolFormats)
from engine.frontends.launch import check_engine_flags, loaded, start_engine
from engine.events import cancel_everything

DEFAULT_MAX_BODY = 8 << 20            # bytes; `strata serve --max-body-mib`


def create_app(engine, api_key: str | None = None, *, host: str = "127.0.0.1",
               max_body_bytes: int = DEFAULT_MAX_BODY, allowed_origins: tuple[str, ...] = (),
               loading: str | None = None, volatile_lines=None, allow_image_urls: bool = False) -> Starlette:
    """The OpenAI- and Anthropic-compatible app over a started Engine. With `api_key`, every request
    needs `Authorization: Bearer <api_key>`. `host` is the address the server listens on (the Host and
    Origin checks accept it besides loopback names); bodies over `max_body_bytes` get 413.
    `loading`: the model of the engine's start-up load, listed as loading until it is done (the
    engine thread is busy loading; this answers from the server's own state).
    `volatile_lines`: regular expressions of system-prompt lines dropped before rendering (a
    per-request header must not cost the conversation's K/V; None: tool_calls.DEFAULT_VOLATILE_LINES).
    `allow_image_urls`: fetch the http(s) image URLs requests name (bounded: frontends/image_parts.py);
    without it they are refused with a 400 naming the part."""
    volatile = tuple(DEFAULT_VOLATILE_LINES if volatile_lines is None else volatile_lines)
    middleware = [Middleware(_RequestGuard, host=host, max_body_bytes=max_body_bytes,
                             allowed_origins=tuple(allowed_origins))]
    if api_key:
        middleware.append(Middleware(_BearerAuth, api_key=api_key))
    app = Starlette(routes=[*openai_api.ROUTES, *anthropic_api.ROUTES], middleware=middleware,
                    exception_handlers={APIError: _on_api_error, HTTPException: _on_http_error, Exception: _on_error})
    app.state.engine = engine
    app.state.served = Served(engine, ToolFormats(), volatile, loading, allow_image_urls)
    return app


async def _on_api_error(request: Request, exc: APIError) -> Response:
    return exc.response()


async def _on_http_error(request: Request, exc: HTTPException) -> Response:
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
    message = {404: f"no route {request.method} {request.url.path}",
               405: f"{request.method} is not allowed on {request.url.path}"}.get(exc.status_code, exc.detail)
    return APIError(exc.status_code, message, code=code).response()


async def _on_error(request: Request, exc: Exception) -> Response:
    return APIError(500, f"internal error: {type(exc).__name__}: {exc}", type="server_error").response()


def _hostname(value: str) -> str | None:
    """The host name of a Host header value or an Origin URL ("h:port", "[::1]:port", "http://h:port")."""
    try:
        parts = urlsplit(value if "//" in value else "//" + value)
        parts.port                       # noqa: B018 - raises on a malformed port
        return (parts.hostname or "").rstrip(".").lower() or None
    except ValueError:
        return None


def _is_loopback(name: str) -> bool:
    if name == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def _is_wildcard(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_unspecified
    except ValueError:
        return False


class _RequestGuard:
    """Pure ASGI, outermost: what a web page in a browser could otherwise do to a local server.

    - `Host` must name loopback or the configured host: a DNS-rebinding page reaches 127.0.0.1 under
      its own domain name, which this refuses (403). Bound to a wildcard address, any IP literal is
      accepted too (rebinding needs a name).
    - `Origin`, when sent, must be loopback, the configured host or one given with --allow-origin: a
      cross-site page's fetch/form gets 403 (browsers send Origin on every cross-site POST).
    - POST bodies must be `application/json` (415): text/plain and form posts need no CORS preflight.
    - Bodies over `max_body_bytes` get 413: at once from Content-Length, and by counting the bytes
      as they arrive (chunked uploads), before the whole body is read.
    """

    def __init__(self, app, host: str, max_body_bytes: int, allowed_origins: tuple[str, ...]):
        self.app, self.max_body = app, int(max_body_bytes)
        self.host = (_hostname(host) or host).lower()
        self.wildcard = _is_wildcard(self.host)
        self.origins = {o.rstrip("/").lower() for o in allowed_origins}

    def _host_ok(self, name: str | None) -> bool:
        if name is None:
            return False
        if _is_loopback(name) or (name == self.host and not self.wildcard):
            return True
        if self.wildcard:
            try:
                ipaddress.ip_address(name)
                return True
            except ValueError:
                return False
        return False

    def _origin_ok(self, origin: str) -> bool:
        if origin.rstrip("/").lower() in self.origins:
            return True
        name = _hostname(origin)
        return name is not None and (_is_loopback(name) or (name == self.host and not self.wildcard))

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {}
        for k, v in scope.get("headers") or []:
            headers.setdefault(k.decode("latin-1").lower(), v.decode("latin-1"))
        error = None
        host = headers.get("host")
        if host is not None and not self._host_ok(_hostname(host)):
            error = APIError(403, f"Host '{host[:80]}' is not this server's (use localhost or "
                                  f"{self.host})", type="permission_error", code="host_not_allowed")
        elif "origin" in headers and not self._origin_ok(headers["origin"]):
            error = APIError(403, f"requests from origin '{headers['origin'][:80]}' are not allowed",
                             type="permission_error", code="origin_not_allowed")
        elif scope["method"] == "POST":
            ctype = headers.get("content-type", "").split(";")[0].strip().lower()
            length = headers.get("content-length")
            if ctype != "application/json":
                error = APIError(415, f"Content-Type must be application/json, got '{ctype[:80] or 'none'}'",
                                 code="unsupported_media_type")
            elif length is not None and (not length.strip().isdigit() or int(length) > self.max_body):
                error = APIError(413 if length.strip().isdigit() else 400,
                                 f"the request body is {length[:20]} bytes; the limit is {self.max_body}",
                                 code="request_too_large")
        if error is not None:
            await error.response()(scope, receive, send)
            return
        seen = 0

        async def counted_receive():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_body:
                    raise APIError(413, f"the request body passed the limit of {self.max_body} bytes",
                                   code="request_too_large")
            return message

        await self.app(scope, counted_receive, send)


class _BearerAuth:
    """Pure ASGI (streams pass straight through): 401 unless `Authorization: Bearer <api_key>`."""

    def __init__(self, app, api_key: str):
        self.app, self.key = app, api_key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            headers = dict(scope.get("headers") or [])
            value = headers.get(b"authorization", b"")
            scheme, _, token = value.partition(b" ")
            if b"x-api-key" in headers and not value:      # Anthropic's clients send the key this way
                scheme, token = b"bearer", headers[b"x-api-key"]
            if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self.key):
                err = APIError(401, "Incorrect or missing API key: send 'Authorization: Bearer <key>'",
                               code="invalid_api_key")
                resp = err.response()
                resp.headers["WWW-Authenticate"] = "Bearer"
                await resp(scope, receive, send)
                return
        await self.app(scope, receive, send)


# ---- running it --------------------------------------------------------------------------------
def bind_socket(host: str, port: int) -> socket.socket:
    """A listening-ready socket on host:port (port 0: a free one), or StrataError in one line."""
    try:
        family = socket.AF_INET6 if ipaddress.ip_address(host).version == 6 else socket.AF_INET
    except ValueError:
        family = socket.AF_INET                   # a host name such as "localhost"
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(2048)
    except OSError as e:
        sock.close()
        raise StrataError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    sock.set_inheritable(True)
    return sock


class ServerThread:
    """Runs an ASGI app with uvicorn on a background thread (tests, bench, the app's settings toggle).

        srv = ServerThread(create_app(engine), port=0).start();  srv.base_url  ...  srv.stop()
    """

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning",
                 limits: ConnectionLimits | None = None):
        self.sock = bind_socket(host, port)
        self.host, self.port = host, self.sock.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(app, log_level=log_level, lifespan="off",
                                                    timeout_graceful_shutdown=3, **uvicorn_options(limits)))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       name="strata-server", daemon=True)

    @property
    def base_url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/v1"

    def start(self, timeout: float = 15.0) -> "ServerThread":
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.01)
        return self

    def stop(self, timeout: float = 10.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)
        self.sock.close()


def _server_class():
    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            # Ctrl-C / SIGTERM: the replies still streaming end now (cancelled: each client gets its last
            # chunk and [DONE]), so their connections close within the graceful period; uvicorn would
            # otherwise wait it out and then cancel them under the ASGI app (a CancelledError traceback).
            cancel_everything()
            super().handle_exit(sig, frame)
    return Server


def _connection_limits(args) -> ConnectionLimits:
    """--max-connections, --header-timeout and --body-timeout checked (StrataError in one line)."""
    if not (1 <= args.max_connections <= 65536):
        raise StrataError(f"--max-connections must be in 1..65536, got {args.max_connections}")
    for flag, value in (("--header-timeout", args.header_timeout), ("--body-timeout", args.body_timeout)):
        if not (0 < value <= 3600):
            raise StrataError(f"{flag} must be in (0, 3600] seconds, got {value}")
    return ConnectionLimits(max_connections=args.max_connections, header_timeout_s=args.header_timeout,
                            body_timeout_s=args.body_timeout)


def cmd_serve(args) -> int:
    _Server = _server_class()

    if not (0 <= args.port <= 65535):
        raise StrataError(f"--port must be in 0..65535, got {args.port}")
    check_engine_flags(args)                     # before the port is taken
    if not (0 < args.max_body_mib <= 4096):
        raise StrataError(f"--max-body-mib must be in (0, 4096], got {args.max_body_mib}")
    limits = _connection_limits(args)
    sock = bind_socket(args.host, args.port)      # fail before loading the model
    try:
        loopback = ipaddress.ip_address(args.host).is_loopback
    except ValueError:
        loopback = args.host == "localhost"
    if not loopback and not args.api_key:
        print(f"strata: warning: listening on {args.host} without --api-key: anyone who can reach this "
              "machine can use the model", file=sys.stderr)
    # The server answers from the start: while the model loads, /v1/models lists it as loading and
    # /health says 503 (from what the server holds; the engine thread is busy loading), and
    # completions queue behind the load. A failed load stops the server and exits 2 with its line.
    engine = start_engine(args, wait=False)
    app = create_app(engine, api_key=args.api_key, host=args.host,
                     max_body_bytes=int(args.max_body_mib * (1 << 20)), allowed_origins=tuple(args.allow_origin),
                     loading=engine.options.model, allow_image_urls=args.allow_image_urls)
    host = f"[{args.host}]" if ":" in args.host else args.host
    server = _Server(uvicorn.Config(app, log_level="info" if args.verbose else "warning",
                                    lifespan="off", timeout_graceful_shutdown=5, **uvicorn_options(limits)))
    failure: list[BaseException] = []
    url = f"http://{host}:{sock.getsockname()[1]}/v1"

    def await_load() -> None:
        try:
            loaded(engine)
        except BaseException as e:  # noqa: BLE001 -- reported on the main thread
            failure.append(e)
            server.should_exit = True
            return
        print(f"strata: serving {_models(engine)[0]['id']} at {url}"
              f"{' (API key required)' if args.api_key else ''}", file=sys.stderr)

    threading.Thread(target=await_load, name="strata-await-load", daemon=True).start()
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
        if not failure:
            engine.stop()
    if failure:
        raise failure[0]
    return 0
