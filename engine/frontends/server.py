"""OpenAI-compatible local server: one Engine behind Starlette + uvicorn.

    strata serve [--host 127.0.0.1] [--port 8484] [--api-key KEY] [engine flags]

Endpoints: GET /v1/models (and /v1/models/{id}), POST /v1/chat/completions, POST /v1/completions
(streaming with SSE and not), POST /v1/sessions/save {"name", "messages"?, "force"?} and /v1/sessions/restore {"name": ...}.

Concurrent HTTP requests are decoded together, up to --max-sequences at once (engine/batching.py);
the rest queue.
Engine events reach the event loop through the handle's callback (`call_soon_threadsafe`), never by
blocking the loop. A client that goes away - while queued, during prefill or mid-stream - cancels its
request (`Handle.cancel()`), so the engine moves on to the next one.

Errors use OpenAI's shape, {"error": {"message", "type", "param", "code"}}, with the matching status.

`create_app(engine, api_key=None)` returns the Starlette app; `ServerThread(app).start()` runs it on
a background thread (tests, the bench, the Qt app's settings toggle); `cmd_serve(args)` is the CLI.
"""
from __future__ import annotations

import hmac
import ipaddress
import re
import socket
import sys
import threading
import time
import uuid
from pathlib import Path

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ..api import GenerateRequest, RestoreSession, SaveSession
from ..errors import ErrorCode, SessionRefusal, StrataError
from ..events import ENGINE_STOPPED, Done, Failed, Token
from ..paths import SESSION_EXTENSION
from ..sampling import SamplingError
from .wire import (  # noqa: F401 - HTTP_OF_ERROR and the parsers stay importable from here
    _await_watching, _bool, _Bridge, _chat_message, _check_model, _content_text, _EngineStream, _finish,
    _json_body, _messages, _model_id, _models, _number, _plain, _response_format, _sampling, _speculative,
    _sse, _stop, _timings, _usage, API_CODE_OF_REASON, APIError, chat_plan, engine_error, HTTP_OF_ERROR,
    MAX_STOP, reply_stream, think_stream, tool_error, ToolFormats)

SESSION_NAME_MAX = 64
_SESSION_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
DEFAULT_MAX_BODY = 8 << 20            # bytes; `strata serve --max-body-mib`
COMPLETIONS_DEFAULT_MAX_TOKENS = 16   # OpenAI's default for the legacy completions endpoint


def create_app(engine, api_key: str | None = None, *, host: str = "127.0.0.1",
               max_body_bytes: int = DEFAULT_MAX_BODY, allowed_origins: tuple[str, ...] = (),
               loading: str | None = None, volatile_lines=None) -> Starlette:
    """The OpenAI-compatible app over a started Engine. With `api_key`, every request needs
    `Authorization: Bearer <api_key>`. `host` is the address the server listens on (the Host and
    Origin checks accept it besides loopback names); bodies over `max_body_bytes` get 413.
    `loading`: the model of the engine's start-up load, listed as loading until it is done (the
    engine thread is busy loading; this answers from the server's own state).
    `volatile_lines`: regular expressions of system-prompt lines dropped before rendering (a
    per-request header must not cost the conversation's K/V; None: tool_calls.DEFAULT_VOLATILE_LINES)."""
    from ..tool_calls import DEFAULT_VOLATILE_LINES, ToolError
    volatile = tuple(DEFAULT_VOLATILE_LINES if volatile_lines is None else volatile_lines)
    formats = ToolFormats()

    def fingerprint() -> str:
        facts = engine.model_facts()
        return f"strata-{((facts.model_hash if facts else '') or 'none')[:12]}"

    def still_loading() -> bool:
        startup = getattr(engine, "startup", None)
        return bool(loading) and engine.model_facts() is None and startup is not None \
            and not startup.finished.is_set() and not getattr(engine, "failure", None)

    async def list_models(request: Request) -> Response:
        models = _models(engine)
        if not models and still_loading():
            from ..api import model_id
            models = [{"id": model_id(loading), "object": "model", "created": 0, "owned_by": "strata",
                       "status": "loading"}]
        return JSONResponse({"object": "list", "data": models})

    async def health(request: Request) -> Response:
        """llama.cpp's /health: 200 {"status": "ok"} with a model loaded, else 503 in the API's shape
        (the engine's own line once its thread has ended on an error)."""
        failure = getattr(engine, "failure", None)
        if failure:
            raise APIError(503, failure, type="server_error", code=ENGINE_STOPPED)
        if engine.model_facts() is not None:
            return JSONResponse({"status": "ok"})
        if still_loading():
            raise APIError(503, "the model is loading", type="unavailable_error", code="model_loading")
        raise APIError(503, "no model is loaded", type="server_error", code="model_not_loaded")

    async def get_model(request: Request) -> Response:
        _check_model(engine, {"model": request.path_params["model"]})
        models = _models(engine)
        if not models:
            raise APIError(503, "no model is loaded", type="server_error", code="model_not_loaded")
        return JSONResponse(models[0])

    async def generate(request: Request, chat: bool) -> Response:
        body = await _json_body(request)
        model_id = _check_model(engine, body)
        plan = fmt = None
        if chat:
            fmt = _response_format(body)      # a ConstraintSpec or None (engine/constraints.py)
            from ..tool_calls import openai_messages
            try:
                messages, plan = chat_plan(engine, formats, openai_messages(body.get("messages")), body.get("tools"),
                                           body.get("tool_choice"), volatile=volatile,
                                           parallel=_bool(body, "parallel_tool_calls", True))
            except ToolError as e:
                raise tool_error(e) from None
            prompt, param = None, "messages"
        else:
            prompt = body.get("prompt")
            if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
                prompt = prompt[0]
            if not isinstance(prompt, str):
                raise APIError(400, "'prompt' must be a string (token arrays and batches are not supported)",
                               param="prompt", code="invalid_type" if prompt is not None else
                               "missing_required_parameter")
            if body.get("echo") or body.get("suffix"):
                raise APIError(400, "'echo' and 'suffix' are not supported", param="echo",
                               code="unsupported_parameter")
            messages, param = None, "prompt"
        facts = engine.model_facts()
        sampling = _sampling(body, ((facts.n_ctx if facts else 0) or 8192) if chat else COMPLETIONS_DEFAULT_MAX_TOKENS)
        stream = _bool(body, "stream", False)
        opts = body.get("stream_options")
        include_usage = bool(stream and isinstance(opts, dict) and opts.get("include_usage"))
        speed = _bool(body, "experimental_speed_projection", None)
        speculative = _speculative(body)
        try:
            sampling.validate()                  # the engine's own checks (engine/sampling.py), as 400
        except SamplingError as e:
            raise APIError(400, str(e), param=e.param, code="invalid_value") from None
        except StrataError as e:
            raise APIError(400, str(e), code="invalid_value") from None

        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        created = int(time.time())
        # A forced tool call (tool_choice 'required' or named) is decoded under its grammar.
        constraint = (plan.constraint if plan is not None else None) or fmt
        bridge = _Bridge(engine, GenerateRequest(messages=messages, prompt=prompt, sampling=sampling,
                                                 speed_projection=speed, conversation=f"http {rid}",
                                                 speculative=speculative, constraint=constraint,
                                                 tools=plan.template_tools if plan is not None else None))
        handle = bridge.handle

        if not stream:
            outcome = await _await_watching(request, handle, bridge.outcome())
            if isinstance(outcome, Failed):
                raise engine_error(outcome, param)
            model_id = model_id or _model_id(engine)
            res = outcome.result
            if chat:
                message, finish = _chat_message(res.text, _finish(res), plan, formats.get(engine).think_open)
                choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": finish}
            else:
                choice = {"index": 0, "text": res.text, "logprobs": None, "finish_reason": _finish(res)}
            return JSONResponse({"id": rid, "object": "chat.completion" if chat else "text_completion",
                                 "created": created, "model": model_id, "system_fingerprint": fingerprint(),
                                 "choices": [choice], "usage": _usage(res),
                                 "strata": {**_timings(res, body.get("speculative")), **({"tool_choice": plan.note} if plan and plan.note else {})}})

        # Streaming: wait for the engine to take the request (its first event) before answering, so
        # a refused request (prompt too long) still gets its status code and JSON error.
        first = await _await_watching(request, handle, bridge.get())
        if isinstance(first, Failed):
            raise engine_error(first, param)
        model_id = model_id or _model_id(engine)
        obj = "chat.completion.chunk" if chat else "text_completion"

        def chunk(text: str | None, finish: str | None = None, role: bool = False) -> dict:
            if chat:
                delta = {} if text is None else {"content": text}
                if role:
                    delta = {"role": "assistant", "content": ""}
                c = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            else:
                c = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
            return {"id": rid, "object": obj, "created": created, "model": model_id,
                    "system_fingerprint": fingerprint(), "choices": [c]}

        from ..tool_calls import StreamParser, finish_calls, new_call_id
        parser = StreamParser(plan.fmt, plan.tools) if plan is not None and plan.active else None
        calls_sent: list = []
        # the reasoning (a harmony model's analysis channel, a <think> block) as delta.reasoning_content,
        # the rest as delta.content
        fmt = formats.get(engine)
        channels = reply_stream(fmt) if chat and parser is None else None

        def channel_chunks(items):
            for kind, value in items:
                c = chunk(value)
                if kind == "reasoning":
                    c["choices"][0]["delta"] = {"reasoning_content": value}
                yield _sse(c)

        # the tool-call parser's text keeps a <think> block: told apart as without tools
        think = think_stream(fmt) if parser is not None and fmt.name != "harmony" else None

        def out(items):
            """Parsed stream items as chunks: content (and reasoning) deltas, and each call as
            delta.tool_calls. None: the reply's end."""
            if items is None:
                if think is not None:
                    yield from channel_chunks(think.finish())
                return
            for kind, value in items:
                if kind == "text":
                    if think is not None:
                        yield from channel_chunks(think.feed(value))
                    else:
                        yield _sse(chunk(value))
                    continue
                if not finish_calls(plan, calls_sent + [value])[len(calls_sent):]:
                    continue
                k = len(calls_sent)
                calls_sent.append(value)
                for part in ({"index": k, "id": value.id or new_call_id(plan.fmt), "type": "function",
                              "function": {"name": value.name, "arguments": ""}},
                             {"index": k, "function": {"arguments": value.arguments_json}}):
                    c = chunk(None)
                    c["choices"][0]["delta"] = {"tool_calls": [part]}
                    yield _sse(c)

        async def events():
            if chat:
                yield _sse(chunk(None, role=True))
            ev = first
            while True:
                if isinstance(ev, Token):
                    text, ev = bridge.drain_tokens(ev)
                    if text:
                        if channels is not None:
                            for line in channel_chunks(channels.feed(text)):
                                yield line
                        elif parser is None:
                            yield _sse(chunk(text))
                        else:
                            for line in out(parser.feed(text)):
                                yield line
                    if ev is None:
                        ev = await bridge.get()
                    continue
                if isinstance(ev, Done):
                    res = ev.result
                    if parser is not None:
                        for line in out(parser.finish()):
                            yield line
                        for line in out(None):
                            yield line
                    if channels is not None:
                        for line in channel_chunks(channels.finish()):
                            yield line
                    last = chunk(None, "tool_calls" if calls_sent else _finish(res))
                    last["strata"] = _timings(res, body.get("speculative"))
                    yield _sse(last)
                    if include_usage:
                        yield _sse({"id": rid, "object": obj, "created": created, "model": model_id,
                                    "system_fingerprint": fingerprint(), "choices": [], "usage": _usage(res)})
                    yield "data: [DONE]\n\n"
                    return
                if isinstance(ev, Failed):
                    yield _sse(engine_error(ev, param).body())
                    yield "data: [DONE]\n\n"
                    return
                ev = await bridge.get()               # Progress

        return _EngineStream(events(), handle)

    async def chat_completions(request: Request) -> Response:
        return await generate(request, chat=True)

    async def completions(request: Request) -> Response:
        return await generate(request, chat=False)

    def session_path(body: dict) -> tuple[str, Path]:
        from ..paths import sessions_dir
        name = body.get("name")
        if not isinstance(name, str) or not name:
            raise APIError(400, "'name' must be a non-empty string", param="name", code="invalid_session_name")
        if (len(name) > SESSION_NAME_MAX or not _SESSION_NAME.fullmatch(name) or ".." in name):
            raise APIError(400, f"invalid session name {name[:80]!r}: use 1-{SESSION_NAME_MAX} letters, digits, "
                                "'.', '_' or '-', starting with a letter or digit, without '..'",
                           param="name", code="invalid_session_name")
        return name, sessions_dir() / f"{name}{SESSION_EXTENSION}"

    async def save_session(request: Request) -> Response:
        body = await _json_body(request)
        name, path = session_path(body)
        # With several clients, "the last conversation served" may be someone else's: a client names
        # its conversation by sending its messages (as it would to continue it, replies included).
        messages = _messages(body) if body.get("messages") is not None else None
        force = body.get("force", False)
        if not isinstance(force, bool):
            raise APIError(400, "'force' must be true or false", param="force", code="invalid_force")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise APIError(500, f"cannot create the sessions folder: {e.strerror}", type="server_error") from None
        outcome = await _Bridge(engine, SaveSession(str(path), messages=messages, force=force)).outcome()
        if isinstance(outcome, Failed):
            # A file holding a longer conversation is kept unless the client resends with "force": true.
            overwrite = outcome.code == ErrorCode.SESSION_REFUSED and outcome.reason == SessionRefusal.OVERWRITE
            code = "session_overwrite" if overwrite else "session_refused"
            raise APIError(400, outcome.message, param="name", code=code)
        return JSONResponse({"object": "session", "name": name, "path": str(path), **_plain(outcome.result)})

    async def restore_session(request: Request) -> Response:
        name, path = session_path(await _json_body(request))
        if not path.is_file():
            raise APIError(404, f"no session named '{name}'", param="name", code="session_not_found")
        outcome = await _Bridge(engine, RestoreSession(str(path))).outcome()
        if isinstance(outcome, Failed):
            raise APIError(400, outcome.message, param="name", code="session_refused")
        # The restored conversation's messages: send them back (plus a new turn) to continue it.
        return JSONResponse({"object": "session", "name": name, "path": str(path), **_plain(outcome.result),
                             "messages": outcome.result.messages})

    from .anthropic_api import routes as anthropic_routes

    async def on_api_error(request: Request, exc: APIError) -> Response:
        return exc.response()

    async def on_http_error(request: Request, exc: HTTPException) -> Response:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        message = {404: f"no route {request.method} {request.url.path}",
                   405: f"{request.method} is not allowed on {request.url.path}"}.get(exc.status_code, exc.detail)
        return APIError(exc.status_code, message, code=code).response()

    async def on_error(request: Request, exc: Exception) -> Response:
        return APIError(500, f"internal error: {type(exc).__name__}: {exc}", type="server_error").response()

    routes = [
        Route("/v1/models", list_models, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/v1/health", health, methods=["GET"]),
        Route("/v1/models/{model:path}", get_model, methods=["GET"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/sessions/save", save_session, methods=["POST"]),
        Route("/v1/sessions/restore", restore_session, methods=["POST"]),
        *anthropic_routes(engine, formats, volatile),
    ]
    middleware = [Middleware(_RequestGuard, host=host, max_body_bytes=max_body_bytes,
                             allowed_origins=tuple(allowed_origins))]
    if api_key:
        middleware.append(Middleware(_BearerAuth, api_key=api_key))
    app = Starlette(routes=routes, middleware=middleware,
                    exception_handlers={APIError: on_api_error, HTTPException: on_http_error, Exception: on_error})
    app.state.engine = engine
    return app


def _hostname(value: str) -> str | None:
    """The host name of a Host header value or an Origin URL ("h:port", "[::1]:port", "http://h:port")."""
    from urllib.parse import urlsplit
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
    from ..errors import StrataError
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

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning"):
        import uvicorn
        self.sock = bind_socket(host, port)
        self.host, self.port = host, self.sock.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(app, log_level=log_level, lifespan="off",
                                                    timeout_graceful_shutdown=3))
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
    import uvicorn

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            # Ctrl-C / SIGTERM: the replies still streaming end now (cancelled: each client gets its last
            # chunk and [DONE]), so their connections close within the graceful period; uvicorn would
            # otherwise wait it out and then cancel them under the ASGI app (a CancelledError traceback).
            from ..events import cancel_everything
            cancel_everything()
            super().handle_exit(sig, frame)
    return Server


def cmd_serve(args) -> int:
    import uvicorn
    _Server = _server_class()

    from .launch import check_engine_flags, loaded, start_engine
    from ..errors import StrataError
    if not (0 <= args.port <= 65535):
        raise StrataError(f"--port must be in 0..65535, got {args.port}")
    check_engine_flags(args)                     # before the port is taken
    if not (0 < args.max_body_mib <= 4096):
        raise StrataError(f"--max-body-mib must be in (0, 4096], got {args.max_body_mib}")
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
                     loading=engine.options.model)
    host = f"[{args.host}]" if ":" in args.host else args.host
    server = _Server(uvicorn.Config(app, log_level="info" if args.verbose else "warning",
                                    lifespan="off", timeout_graceful_shutdown=5))
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
