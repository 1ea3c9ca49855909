"""A real MCP server for the tests, written with the SDK's server side (MCPServer):

    python tool_server.py stdio             # over stdin/stdout
    python tool_server.py http PORT         # streamable HTTP on 127.0.0.1:PORT/mcp
    python tool_server.py die               # writes to stderr and exits before answering (a failed start)

Tools: add, echo, slow (sleeps), fail (the tool raises), big (a large result), crash (the process exits
mid-call), bad_json (writes a line that is not JSON-RPC on stdout), peek (read-only: readOnlyHint)."""
from __future__ import annotations

import asyncio
import os
import sys
from typing import Annotated

from mcp.server.mcpserver import MCPServer
from pydantic import Field
from mcp.server.mcpserver.exceptions import ToolError
from mcp.types import ToolAnnotations

server = MCPServer("strata-test-tools")
# The SDK's stdio server moves its protocol channel off fd 1 while it serves (stray prints go to stderr);
# a copy taken first still reaches the client, for the tool that must write a line that is not JSON-RPC.
WIRE = os.dup(1)


# Bounded arguments: a tiny random model whose call the grammar forces writes short ones
Small = Annotated[int, Field(ge=0, le=99)]
Word = Annotated[str, Field(max_length=8)]


@server.tool(description="Add two integers")
def add(a: Small, b: Small) -> str:
    return str(a + b)


@server.tool(description="Echo the text back")
def echo(text: str) -> str:
    return f"echo: {text}"


@server.tool(description="Sleep, then answer")
async def slow(seconds: Annotated[float, Field(ge=0, le=120)]) -> str:
    await asyncio.sleep(seconds)
    return f"slept {seconds}"


@server.tool(description="Always fails")
def fail(message: str) -> str:
    raise ToolError(f"it failed: {message}")


@server.tool(description="A large result")
def big(n: Annotated[int, Field(ge=0, le=1_000_000)]) -> str:
    return "".join(chr(ord("a") + i % 26) for i in range(n))


@server.tool(description="The server process exits mid-call")
def crash(why: Word = "") -> str:
    print("about to crash: goodbye", file=sys.stderr, flush=True)
    os._exit(3)


@server.tool(description="Answers with a line that is not JSON-RPC (and never properly)")
async def bad_json() -> str:
    os.write(WIRE, b"this is {not json\n")
    await asyncio.sleep(60)
    return "too late"


@server.tool(description="Reads nothing, changes nothing", annotations=ToolAnnotations(read_only_hint=True))
def peek(word: Word = "") -> str:
    return "nothing changed"


if __name__ == "__main__":
    mode = sys.argv[1] if len(sys.argv) > 1 else "stdio"
    print(f"tool server starting ({mode})", file=sys.stderr, flush=True)
    if mode == "die":
        print("fatal: cannot open the database", file=sys.stderr, flush=True)
        sys.exit(2)
    if mode == "http":
        server.run("streamable-http", host="127.0.0.1", port=int(sys.argv[2]))
    else:
        server.run("stdio")
