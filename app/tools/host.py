"""The MCP host: the `mcp` SDK's clients on an asyncio loop of their own thread, never the engine's
thread nor the window's. Callers on any thread start and stop servers, read their states and tools,
and call tools; each call is a `CallHandle` (a future of a `ToolResult`, cancellable). Every failure a
server can cause (a crash, a timeout, a line that is not JSON-RPC, an MCP error) becomes a ToolResult
naming it, never an exception out of the host.

No Qt here: `on_change(ServerState)` is called on the host's thread at each state change (the Qt
bridge, app/tools/bridge.py, turns it into a signal)."""
from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import os
import threading
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Callable

import httpx2
from mcp import ClientSession
from mcp.client.stdio import StdioServerParameters, stdio_client
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.exceptions import MCPError
from mcp.types import PaginatedRequestParams
from mcp_types.jsonrpc import CONNECTION_CLOSED

from .config import ServerConfig
from .results import (ERR_BAD_JSON, ERR_CANCELLED, ERR_CRASHED, ERR_NOT_READY, ERR_PROTOCOL, ERR_TIMEOUT, ERR_TOOL,
                      ERR_UNKNOWN_TOOL, FAILED, READY, STARTING, STOPPED, ServerState, ToolInfo, ToolResult)

DEFAULT_CALL_TIMEOUT_S = 30.0
START_TIMEOUT_S = 30.0                # a server that has not listed its tools by then has failed
RESULT_CAP_CHARS = 32_000             # what one tool result may send back to the model
STDERR_LINES = 40                     # a server's stderr kept: its last lines, each cut at STDERR_LINE_CHARS
STDERR_LINE_CHARS = 400


class StderrRing:
    """A server process's stderr, read on a thread of its own into a bounded ring of lines (the
    process may write without end: only the last lines, each cut short, are kept). `ended` is set at
    EOF: the process (and anything it started holding the pipe) has exited."""

    def __init__(self, lines: int = STDERR_LINES, on_end: Callable[[], None] | None = None):
        self.lines: deque[str] = deque(maxlen=lines)
        self._lock = threading.Lock()
        self._on_end = on_end
        r, w = os.pipe()
        self.write_end = os.fdopen(w, "w")           # handed to the process as its stderr
        self._read_fd = r
        self.ended = threading.Event()
        threading.Thread(target=self._read, name="strata-mcp-stderr", daemon=True).start()

    def _read(self) -> None:
        partial = b""
        try:
            while chunk := os.read(self._read_fd, 65536):
                *done, partial = (partial + chunk).split(b"\n")
                partial = partial[:STDERR_LINE_CHARS * 4]   # an endless line stays bounded
                with self._lock:
                    self.lines.extend(x.decode("utf-8", "replace")[:STDERR_LINE_CHARS] for x in done)
        finally:
            if partial:
                with self._lock:
                    self.lines.append(partial.decode("utf-8", "replace")[:STDERR_LINE_CHARS])
            os.close(self._read_fd)
            self.ended.set()
            if self._on_end is not None:
                self._on_end()

    def close_write_end(self) -> None:
        """Ours, once the process has its copy: EOF then means the process is gone."""
        if not self.write_end.closed:
            self.write_end.close()

    def tail(self) -> tuple[str, ...]:
        with self._lock:
            return tuple(x for x in self.lines if x.strip())


@dataclass(eq=False)
class _Pending:
    task: asyncio.Task | None = None
    reason: str | None = None         # why the host cancelled it (ERR_*), None: the caller did


@dataclass
class _Server:
    config: ServerConfig
    state: ServerState
    stop: asyncio.Event = field(default_factory=asyncio.Event)
    ended: asyncio.Event = field(default_factory=asyncio.Event)    # the process or connection went away
    session: ClientSession | None = None
    ring: StderrRing | None = None
    task: asyncio.Task | None = None
    calls: set = field(default_factory=set)                         # _Pending
    bad_line: str = ""


class CallHandle:
    """A tool call in flight: `future` resolves to a ToolResult (never raises); `cancel()` stops it
    (the result then says cancelled)."""

    def __init__(self, future: concurrent.futures.Future, cancel: Callable[[], None]):
        self.future = future
        self._cancel = cancel

    def cancel(self) -> None:
        self._cancel()

    def result(self, timeout: float | None = None) -> ToolResult:
        return self.future.result(timeout)

    def done(self) -> bool:
        return self.future.done()


def describe(e: BaseException) -> str:
    """An exception as one short line (an exception group: its first leaf)."""
    while isinstance(e, BaseExceptionGroup) and e.exceptions:
        e = e.exceptions[0]
    text = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return f"{type(e).__name__}: {text}"[:300] if text else type(e).__name__


def _bad_line(e: Exception) -> str:
    """What a line that failed to parse held (pydantic keeps the input), else the error's own line."""
    try:
        got = e.errors()[0].get("input")        # pydantic's ValidationError
    except Exception:  # noqa: BLE001 - any other exception: described below
        got = None
    return f"got {str(got)[:120]!r}" if isinstance(got, (str, bytes)) else describe(e)


def result_text(result, cap: int = RESULT_CAP_CHARS) -> tuple[str, bool]:
    """A CallToolResult's content as the text the model reads (images and other blocks named, not
    inlined), cut at `cap` characters with a note. (text, truncated)."""
    parts = []
    for block in result.content or []:
        kind = getattr(block, "type", "")
        if kind == "text":
            parts.append(block.text)
        elif kind in ("image", "audio"):
            size = len(getattr(block, 'data', '')) * 3 // 4          # base64: 4 characters per 3 bytes
            parts.append(f"[{kind}: {getattr(block, 'mime_type', '?')}, {size} bytes]")
        else:
            parts.append(f"[{kind or 'content'} block]")
    if not parts and result.structured_content is not None:
        parts.append(json.dumps(result.structured_content, ensure_ascii=False))
    text = "\n".join(parts)
    if len(text) <= cap:
        return text, False
    return text[:cap] + f"\n[result cut: {len(text)} characters, the first {cap} shown]", True


def tool_info(server: str, tool) -> ToolInfo:
    ann = getattr(tool, "annotations", None)
    schema = tool.input_schema if isinstance(tool.input_schema, dict) else {"type": "object", "properties": {}}
    return ToolInfo(server, tool.name, tool.description or "", schema,
                    bool(ann is not None and ann.read_only_hint), (ann.title if ann is not None else None) or "")


class McpHost:
    def __init__(self, on_change: Callable[[ServerState], None] | None = None,
                 result_cap: int = RESULT_CAP_CHARS, start_timeout: float = START_TIMEOUT_S):
        self.on_change = on_change
        self.result_cap = result_cap
        self.start_timeout = start_timeout
        self._states: dict[str, ServerState] = {}
        self._lock = threading.Lock()
        self._servers: dict[str, _Server] = {}      # the loop thread's own
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="strata-mcp", daemon=True)
        self._thread.start()

    # ---- any thread -------------------------------------------------------------------------------
    def states(self) -> list[ServerState]:
        with self._lock:
            return list(self._states.values())

    def state(self, name: str) -> ServerState:
        with self._lock:
            return self._states.get(name, ServerState(name))

    def tools(self) -> list[ToolInfo]:
        """Every ready server's tools."""
        return [t for s in self.states() if s.status == READY for t in s.tools]

    def start(self, config: ServerConfig) -> concurrent.futures.Future:
        """Start (or restart) a server; the future resolves to its state once ready or failed."""
        return asyncio.run_coroutine_threadsafe(self._start(config), self._loop)

    def stop(self, name: str) -> concurrent.futures.Future:
        return asyncio.run_coroutine_threadsafe(self._stop(name), self._loop)

    def call(self, server: str, tool: str, arguments: dict, timeout: float = DEFAULT_CALL_TIMEOUT_S) -> CallHandle:
        future: concurrent.futures.Future = concurrent.futures.Future()
        pending = _Pending()

        def begin():
            pending.task = self._loop.create_task(self._call(server, tool, arguments, timeout, pending))
            pending.task.add_done_callback(lambda t: future.set_result(_outcome(t, tool)))

        def cancel():
            if pending.task is not None and not pending.task.done():
                pending.task.cancel()

        self._loop.call_soon_threadsafe(begin)
        return CallHandle(future, lambda: self._loop.call_soon_threadsafe(cancel))

    def close(self, timeout: float = 10.0) -> None:
        """Stop every server and the loop's thread."""
        if not self._thread.is_alive():
            return
        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(self._stop_all(), self._loop).result(timeout)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout)

    # ---- the loop's thread --------------------------------------------------------------------------
    def _publish(self, srv: _Server, **changes) -> None:
        srv.state = replace(srv.state, **changes)
        if srv.ring is not None:
            srv.state = replace(srv.state, stderr_tail=srv.ring.tail())
        with self._lock:
            self._states[srv.config.name] = srv.state
        if self.on_change is not None:
            self.on_change(srv.state)

    async def _start(self, config: ServerConfig) -> ServerState:
        await self._stop(config.name)
        srv = _Server(config, ServerState(config.name))
        self._servers[config.name] = srv
        self._publish(srv, status=STARTING)
        ready = asyncio.Event()
        srv.task = asyncio.create_task(self._serve(srv, ready))
        await ready.wait()
        return srv.state

    async def _stop(self, name: str) -> None:
        srv = self._servers.pop(name, None)
        if srv is None:
            return
        srv.stop.set()
        if srv.task is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(asyncio.shield(srv.task), 10)
        self._publish(srv, status=STOPPED, tools=(), error="")

    async def _stop_all(self) -> None:
        for name in list(self._servers):
            await self._stop(name)

    def _transport(self, srv: _Server):
        cfg = srv.config
        if cfg.transport == "http":
            return streamable_http_client(cfg.url, http_client=httpx2.AsyncClient(
                headers=dict(cfg.headers), timeout=httpx2.Timeout(30.0, read=300.0)))
        loop = self._loop
        srv.ring = StderrRing(on_end=lambda: loop.call_soon_threadsafe(self._ended, srv, "the server's process exited"))
        params = StdioServerParameters(command=cfg.command, args=list(cfg.args), env=dict(cfg.env) or None)
        return stdio_client(params, errlog=srv.ring.write_end)

    async def _on_message(self, srv: _Server, message) -> None:
        """The session's incoming items: a transport exception is a line that was not JSON-RPC."""
        if isinstance(message, Exception):
            srv.bad_line = _bad_line(message)
            self._fail_calls(srv, ERR_BAD_JSON)

    def _fail_calls(self, srv: _Server, reason: str) -> None:
        for p in list(srv.calls):
            if p.task is not None and not p.task.done():
                p.reason = reason
                p.task.cancel()

    def _ended(self, srv: _Server, why: str) -> None:
        if srv.stop.is_set() or srv.ended.is_set():
            return
        srv.ended.set()
        self._fail_calls(srv, ERR_CRASHED)

    async def _serve(self, srv: _Server, ready: asyncio.Event) -> None:
        """A server's whole life: connect, initialize, list its tools, then wait for stop (or its end)."""
        try:
            async with contextlib.AsyncExitStack() as stack:
                read, write = await stack.enter_async_context(self._transport(srv))
                if srv.ring is not None:
                    srv.ring.close_write_end()
                session = await stack.enter_async_context(ClientSession(
                    read, write, message_handler=lambda m: self._on_message(srv, m)))
                tools = await asyncio.wait_for(self._initialize(srv, session), self.start_timeout)
                srv.session = session
                self._publish(srv, status=READY, tools=tools, error="")
                ready.set()
                await _first(srv.stop.wait(), srv.ended.wait())
                srv.session = None
                if not srv.stop.is_set():
                    self._publish(srv, status=FAILED, tools=(), error="the server exited")
        except Exception as e:  # noqa: BLE001 - any failure of a server is its state, shown to the user
            srv.session = None
            if not srv.stop.is_set():
                await asyncio.sleep(0.05)       # let the stderr reader catch the process's last lines
                why = ("did not answer in time" if isinstance(e, TimeoutError) else
                       "its process exited while starting" if srv.ring is not None and srv.ring.ended.is_set() else
                       describe(e))
                self._publish(srv, status=FAILED, tools=(), error=why)
        finally:
            if srv.ring is not None:
                srv.ring.close_write_end()
            ready.set()

    async def _initialize(self, srv: _Server, session: ClientSession) -> tuple[ToolInfo, ...]:
        await session.initialize()
        tools, cursor = [], None
        for _ in range(100):               # pages: bounded, a server cannot page forever
            listed = await session.list_tools(params=PaginatedRequestParams(cursor=cursor) if cursor else None)
            tools += [tool_info(srv.config.name, t) for t in listed.tools]
            cursor = listed.next_cursor
            if not cursor:
                break
        return tuple(tools)

    async def _call(self, server: str, tool: str, arguments: dict, timeout: float, pending: _Pending) -> ToolResult:
        srv = self._servers.get(server)
        if srv is None or srv.session is None or srv.state.status != READY:
            status = srv.state.line() if srv is not None else "not started"
            return ToolResult(f"Error: the MCP server '{server}' is not running ({status}).", ERR_NOT_READY)
        if not any(t.name == tool for t in srv.state.tools):
            return ToolResult(f"Error: the MCP server '{server}' has no tool '{tool}'.", ERR_UNKNOWN_TOOL)
        srv.calls.add(pending)
        try:
            res = await asyncio.wait_for(srv.session.call_tool(tool, arguments), timeout)
        except asyncio.CancelledError:
            return self._cancelled(srv, tool, pending.reason)
        except TimeoutError:
            return ToolResult(f"Error: the tool '{tool}' of '{server}' gave no answer within {timeout:g} s "
                              "(the call was abandoned).", ERR_TIMEOUT)
        except MCPError as e:
            if e.code == CONNECTION_CLOSED:
                srv.calls.discard(pending)      # the host's crash notice must not cancel the wait below
                await self._settle(srv)         # the process's last stderr lines, then the crash result
                return self._cancelled(srv, tool, ERR_CRASHED)
            return ToolResult(f"Error: the MCP server '{server}' refused the call: {e.message}", ERR_PROTOCOL)
        except Exception as e:  # noqa: BLE001 - a broken connection is the call's result, not a traceback
            if srv.ended.is_set() or srv.stop.is_set():
                return self._cancelled(srv, tool, ERR_CRASHED)
            return ToolResult(f"Error: the call to '{tool}' of '{server}' failed: {describe(e)}", ERR_CRASHED)
        finally:
            srv.calls.discard(pending)
        text, cut = result_text(res, self.result_cap)
        if res.is_error:
            return ToolResult(f"Error from the tool '{tool}': {text}", ERR_TOOL, cut)
        return ToolResult(text, None, cut)

    async def _settle(self, srv: _Server, wait_s: float = 2.0) -> None:
        """A connection that closed under a call: give the process's stderr a moment to reach its end."""
        if srv.ring is not None:
            end = asyncio.get_running_loop().time() + wait_s
            while not srv.ring.ended.is_set() and asyncio.get_running_loop().time() < end:
                await asyncio.sleep(0.02)

    def _cancelled(self, srv: _Server, tool: str, reason: str | None) -> ToolResult:
        name = srv.config.name
        if reason == ERR_BAD_JSON:
            return ToolResult(f"Error: the MCP server '{name}' wrote a message that is not valid JSON-RPC "
                              f"({srv.bad_line}).", ERR_BAD_JSON)
        if reason == ERR_CRASHED:
            tail = srv.ring.tail()[-3:] if srv.ring is not None else ()
            last = f" Its last output: {' | '.join(tail)}" if tail else ""
            return ToolResult(f"Error: the MCP server '{name}' stopped while running '{tool}'.{last}", ERR_CRASHED)
        return ToolResult(f"The call to '{tool}' was stopped by the user.", ERR_CANCELLED)


def _outcome(task: asyncio.Task, tool: str) -> ToolResult:
    """A call task's result; a cancellation that escaped it, or a bug, still answers as a result."""
    if task.cancelled():
        return ToolResult(f"The call to '{tool}' was stopped by the user.", ERR_CANCELLED)
    if task.exception() is not None:
        return ToolResult(f"Error: the call to '{tool}' failed: {describe(task.exception())}", ERR_CRASHED)
    return task.result()


async def _first(*aws) -> None:
    """Wait until the first of `aws` finishes; cancel the others."""
    tasks = [asyncio.ensure_future(a) for a in aws]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in tasks:
            t.cancel()
