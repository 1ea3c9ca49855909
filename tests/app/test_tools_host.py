"""The MCP host (app/tools/host.py) against real MCP servers written with the SDK's server side
(tests/mcp/tool_server.py): over stdio and over streamable HTTP on 127.0.0.1. It lists tools with
their schemas and read-only hints, calls them, times a slow one out, cancels one, caps a large result,
and turns a failing tool, a line that is not JSON-RPC and a crashed process into typed results (the
host and its other servers carry on). Deadlines here are generous bounds on a hang, not timings."""
from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "mcp"))

from app.tools.config import ServerConfig                       # noqa: E402
from app.tools.host import McpHost                               # noqa: E402
from app.tools.results import (ERR_BAD_JSON, ERR_CANCELLED, ERR_CRASHED, ERR_NOT_READY, ERR_TIMEOUT,  # noqa: E402
                               ERR_TOOL, ERR_UNKNOWN_TOOL, FAILED, READY, STOPPED)
from servers import http_server, stdio_config                    # noqa: E402

HANG_S = 60          # a call or a start that takes this long has hung


@pytest.fixture
def host():
    h = McpHost(result_cap=5000)
    yield h
    h.close()


@pytest.fixture
def stdio_host(host):
    state = host.start(stdio_config("t")).result(HANG_S)
    assert state.status == READY, state
    return host


def test_stdio_server_lists_its_tools_with_schemas_and_hints(stdio_host):
    tools = {t.name: t for t in stdio_host.tools()}
    assert {"add", "echo", "slow", "fail", "big", "crash", "bad_json", "peek"} <= set(tools)
    add = tools["add"]
    assert add.server == "t" and add.key == "t/add" and add.description == "Add two integers"
    assert add.input_schema["properties"]["a"]["type"] == "integer" and set(add.input_schema["required"]) == {"a", "b"}
    assert tools["peek"].read_only and not add.read_only
    assert stdio_host.state("t").line() == f"ready, {len(tools)} tools"
    # the server's start-up line on stderr is kept
    assert "tool server starting (stdio)" in stdio_host.state("t").stderr_tail


def test_calls_with_arguments_and_a_failing_tool(stdio_host):
    assert stdio_host.call("t", "add", {"a": 2, "b": 40}).result(HANG_S).text == "42"
    r = stdio_host.call("t", "echo", {"text": "héllo"}).result(HANG_S)
    assert r.ok and r.text == "echo: héllo"
    r = stdio_host.call("t", "fail", {"message": "disk full"}).result(HANG_S)
    assert r.error == ERR_TOOL and "it failed: disk full" in r.text
    r = stdio_host.call("t", "nope", {}).result(HANG_S)
    assert r.error == ERR_UNKNOWN_TOOL and "'nope'" in r.text
    r = stdio_host.call("elsewhere", "add", {}).result(HANG_S)
    assert r.error == ERR_NOT_READY


def test_a_large_result_is_capped_with_a_note(stdio_host):
    r = stdio_host.call("t", "big", {"n": 20000}).result(HANG_S)
    assert r.ok and r.truncated
    assert r.text.startswith("abcdefghij") and "[result cut: 20000 characters, the first 5000 shown]" in r.text
    assert len(r.text) < 5200
    small = stdio_host.call("t", "big", {"n": 100}).result(HANG_S)
    assert not small.truncated and len(small.text) == 100


def test_a_slow_call_times_out_and_the_server_still_answers(stdio_host):
    r = stdio_host.call("t", "slow", {"seconds": 30}, timeout=0.5).result(HANG_S)
    assert r.error == ERR_TIMEOUT and "within 0.5 s" in r.text
    assert stdio_host.call("t", "add", {"a": 1, "b": 1}).result(HANG_S).text == "2"


def test_a_call_is_cancelled(stdio_host):
    call = stdio_host.call("t", "slow", {"seconds": 30})
    time.sleep(0.2)
    call.cancel()
    r = call.result(HANG_S)
    assert r.error == ERR_CANCELLED and "stopped by the user" in r.text
    assert stdio_host.call("t", "add", {"a": 1, "b": 2}).result(HANG_S).text == "3"


def test_a_line_that_is_not_json_rpc_becomes_an_error_result(stdio_host):
    r = stdio_host.call("t", "bad_json", {}, timeout=HANG_S).result(HANG_S * 2)
    assert r.error == ERR_BAD_JSON and "not valid JSON-RPC" in r.text and "this is {not json" in r.text
    assert stdio_host.call("t", "add", {"a": 5, "b": 5}).result(HANG_S).text == "10"


def test_a_crash_mid_call_is_a_result_and_the_server_shows_failed(host):
    changes = []
    host.on_change = changes.append
    assert host.start(stdio_config("t")).result(HANG_S).status == READY
    assert host.start(stdio_config("u")).result(HANG_S).status == READY
    r = host.call("t", "crash", {}, timeout=HANG_S).result(HANG_S * 2)
    assert r.error == ERR_CRASHED and "stopped while running 'crash'" in r.text and "goodbye" in r.text
    end = time.monotonic() + HANG_S
    while host.state("t").status != FAILED and time.monotonic() < end:
        time.sleep(0.05)
    state = host.state("t")
    assert state.status == FAILED and state.tools == () and "about to crash: goodbye" in state.stderr_tail
    assert any(s.name == "t" and s.status == FAILED for s in changes)
    assert host.call("t", "add", {"a": 1, "b": 1}).result(HANG_S).error == ERR_NOT_READY
    # the other server is untouched, and a restart brings the crashed one back
    assert host.call("u", "add", {"a": 1, "b": 1}).result(HANG_S).text == "2"
    assert host.start(stdio_config("t")).result(HANG_S).status == READY
    assert host.call("t", "add", {"a": 1, "b": 1}).result(HANG_S).text == "2"


def test_a_server_that_dies_at_start_fails_with_its_stderr(host):
    state = host.start(stdio_config("d", mode="die")).result(HANG_S)
    assert state.status == FAILED and "exited while starting" in state.error
    assert "fatal: cannot open the database" in state.stderr_tail
    assert state.line().startswith("failed: ")


def test_a_missing_command_fails_in_one_line(host):
    state = host.start(ServerConfig("m", command="/nonexistent/strata-mcp-server")).result(HANG_S)
    assert state.status == FAILED and "\n" not in state.error and state.error


def test_stderr_is_a_bounded_ring(host):
    """A server that writes without end keeps only its last lines, each cut short."""
    script = ("import sys\nfor i in range(5000): sys.stderr.write(f'line {i} ' + 'x' * 2000 + '\\n')\n"
              "sys.stderr.flush()\nsys.exit(1)\n")
    state = host.start(ServerConfig("noisy", command=sys.executable, args=("-c", script))).result(HANG_S)
    assert state.status == FAILED
    tail = state.stderr_tail
    assert 0 < len(tail) <= 40 and all(len(x) <= 400 for x in tail)
    assert tail[-1].startswith("line 4999 ")


def test_stop_ends_the_server(stdio_host):
    stdio_host.stop("t").result(HANG_S)
    assert stdio_host.state("t").status == STOPPED and stdio_host.tools() == []
    assert stdio_host.call("t", "add", {"a": 1, "b": 1}).result(HANG_S).error == ERR_NOT_READY


def test_streamable_http_server(host):
    with http_server() as url:
        state = host.start(ServerConfig("w", url=url, headers={"X-Client": "strata"})).result(HANG_S)
        assert state.status == READY and any(t.name == "add" and t.server == "w" for t in state.tools)
        assert host.call("w", "add", {"a": 20, "b": 22}).result(HANG_S).text == "42"
        assert host.call("w", "slow", {"seconds": 30}, timeout=0.5).result(HANG_S).error == ERR_TIMEOUT
        call = host.call("w", "slow", {"seconds": 30})
        time.sleep(0.2)
        call.cancel()
        assert call.result(HANG_S).error == ERR_CANCELLED
        assert host.call("w", "big", {"n": 9000}).result(HANG_S).truncated
        assert host.call("w", "echo", {"text": "still here"}).result(HANG_S).text == "echo: still here"


def test_an_http_server_that_is_not_there_fails(host):
    state = host.start(ServerConfig("gone", url="http://127.0.0.1:9/mcp")).result(HANG_S)
    assert state.status == FAILED and state.error


def test_the_host_never_runs_on_the_callers_thread(stdio_host):
    """Calls are made from any thread and answered on the host's own."""
    results = []
    threads = [threading.Thread(target=lambda i=i: results.append(
        stdio_host.call("t", "add", {"a": i, "b": 1}).result(HANG_S).text)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(HANG_S)
    assert sorted(results) == ["1", "2", "3", "4"]
