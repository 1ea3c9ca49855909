"""What the MCP host hands back, as typed values (no Qt, no SDK types): a server's state, a tool as
the model and the approval see it, a call's outcome."""
from __future__ import annotations

from dataclasses import dataclass, field

# A server's life
STOPPED, STARTING, READY, FAILED = "stopped", "starting", "ready", "failed"

# Why a call gave no result of the tool's own (ToolResult.error)
ERR_TIMEOUT = "timeout"               # no answer within the call's timeout
ERR_CRASHED = "crashed"               # the server's process or connection ended
ERR_BAD_JSON = "bad_json"             # the server wrote something that is not JSON-RPC
ERR_NOT_READY = "not_ready"           # the server is not running (stopped, starting, failed)
ERR_UNKNOWN_TOOL = "unknown_tool"     # the server lists no such tool
ERR_PROTOCOL = "protocol"             # the server answered with an MCP error
ERR_CANCELLED = "cancelled"           # the user stopped it
ERR_TOOL = "tool_error"               # the tool itself reported an error (isError)


@dataclass(frozen=True)
class ToolInfo:
    server: str
    name: str
    description: str = ""
    input_schema: dict = field(default_factory=lambda: {"type": "object", "properties": {}})
    read_only: bool = False           # the server's readOnlyHint annotation (a hint, not a promise)
    title: str = ""

    @property
    def key(self) -> str:
        """How settings name it ("always allow" is per tool of a server)."""
        return f"{self.server}/{self.name}"


@dataclass(frozen=True)
class ServerState:
    name: str
    status: str = STOPPED
    tools: tuple[ToolInfo, ...] = ()
    error: str = ""                   # why it failed (one line)
    stderr_tail: tuple[str, ...] = () # the last lines its process wrote to stderr

    def line(self) -> str:
        """The state in a few words, as Settings shows it."""
        if self.status == READY:
            n = len(self.tools)
            return f"ready, {n} tool{'s' if n != 1 else ''}"
        if self.status == FAILED:
            return f"failed: {self.error}" if self.error else "failed"
        return self.status


@dataclass(frozen=True)
class ToolResult:
    text: str                         # what goes back to the model as the tool message
    error: str | None = None          # one of ERR_*, None: the tool answered
    truncated: bool = False           # the text was cut at the size cap (a note says so in `text`)

    @property
    def ok(self) -> bool:
        return self.error is None
