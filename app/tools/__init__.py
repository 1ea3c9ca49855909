"""Tools in the chat through MCP servers: the config (config.py), the host running the `mcp` SDK on its
own asyncio thread (host.py), typed results (results.py), the tool loop's plain logic (loop.py) and the
Qt bridge (bridge.py, the only module here importing Qt)."""
