"""The MCP servers' config (app/tools/config.py): the mcpServers format read and written, one clear
line per bad entry while the rest load, servers off until enabled, and the import from LM Studio's and
Claude Desktop's files (real files in a stand-in home folder)."""
from __future__ import annotations

import json
import os
import stat

from app.tools.config import (ImportSource, ServerConfig, default_sources, import_servers, masked, read_config,
                              write_config)


def _write(path, data):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return path


def test_both_transports_load_and_are_off_unless_enabled(tmp_path):
    p = _write(tmp_path / "mcp.json", {"mcpServers": {
        "files": {"command": "npx", "args": ["-y", "server-fs", "/tmp"], "env": {"TOKEN": "s3cret"}},
        "web": {"url": "https://example.com/mcp", "headers": {"Authorization": "Bearer x"}, "enabled": True}}})
    got = read_config(p)
    assert got.problems == []
    files, web = got.servers
    assert files == ServerConfig("files", command="npx", args=("-y", "server-fs", "/tmp"), env={"TOKEN": "s3cret"})
    assert files.transport == "stdio" and not files.enabled
    assert web.transport == "http" and web.enabled and web.headers == {"Authorization": "Bearer x"}


def test_bad_entries_are_one_line_each_and_the_rest_load(tmp_path):
    p = _write(tmp_path / "mcp.json", {"mcpServers": {
        "good": {"command": "uvx", "args": ["mcp-server-time"]},
        "both": {"command": "x", "url": "http://a"},
        "neither": {"args": []},
        "args": {"command": "x", "args": "not a list"},
        "env": {"command": "x", "env": {"A": 1}},
        "flag": {"command": "x", "enabled": "yes"},
        "ftp": {"url": "ftp://host/mcp"},
        "list": ["command"],
        "bad/name": {"command": "x"}}})
    got = read_config(p)
    assert [s.name for s in got.servers] == ["good"]
    assert len(got.problems) == 8 and all("\n" not in line for line in got.problems)
    text = "\n".join(got.problems)
    for needle in ("'both': give either 'command' (stdio) or 'url'", "'args' must be a list of strings",
                   "'env' must be an object of strings", "'enabled' must be true or false",
                   "'url' must be an http:// or https:// address", "'list': the entry must be an object",
                   "'bad/name': the name must be"):
        assert needle in text, needle


def test_a_broken_file_is_one_problem_and_a_missing_one_is_empty(tmp_path):
    got = read_config(_write(tmp_path / "mcp.json", '{"mcpServers": {"a": {"command": "x",}}}'))
    assert got.servers == [] and len(got.problems) == 1 and got.problems[0].startswith("mcp.json: not JSON (line 1")
    assert read_config(_write(tmp_path / "b.json", "[1, 2]")).problems == [
        "the file must be a JSON object with an 'mcpServers' object"]
    missing = read_config(tmp_path / "none.json")
    assert missing.servers == [] and missing.problems == []
    huge = _write(tmp_path / "huge.json", '{"mcpServers": {}, "pad": "' + "x" * (2 << 20) + '"}')
    assert "not read" in read_config(huge).problems[0]


def test_written_back_as_mcp_servers_owner_only(tmp_path):
    servers = [ServerConfig("a", command="x", args=("1",), env={"K": "v"}, enabled=True),
               ServerConfig("b", url="http://127.0.0.1:1/mcp")]
    p = tmp_path / "sub" / "mcp.json"
    write_config(p, servers)
    assert read_config(p).servers == servers
    data = json.loads(p.read_text())
    assert data == {"mcpServers": {"a": {"command": "x", "args": ["1"], "env": {"K": "v"}, "enabled": True},
                                   "b": {"url": "http://127.0.0.1:1/mcp", "enabled": False}}}
    assert stat.S_IMODE(os.stat(p).st_mode) == 0o600


def test_import_from_lm_studio_and_claude_desktop(tmp_path):
    home = tmp_path / "home"
    lm, claude = (s.path for s in default_sources(home))
    assert lm == home / ".lmstudio" / "mcp.json"
    assert claude == home / "Library" / "Application Support" / "Claude" / "claude_desktop_config.json"
    _write(lm, {"mcpServers": {"time": {"command": "uvx", "args": ["mcp-server-time"]},
                               "hf": {"url": "https://huggingface.co/mcp", "headers": {"Authorization": "Bearer t"}},
                               "broken": {"command": 3}}})
    # Claude Desktop's file holds other settings too; its servers may say enabled: they come in off
    _write(claude, {"globalShortcut": "Ctrl+Space", "mcpServers": {
        "fs": {"command": "npx", "args": ["-y", "@modelcontextprotocol/server-filesystem", "/Users/me"],
               "enabled": True},
        "time": {"command": "other"}}})
    existing = [ServerConfig("mine", command="my-server")]
    got = import_servers(existing, default_sources(home))
    assert got.found == ["LM Studio", "Claude Desktop"]
    assert [s.name for s in got.servers] == ["mine", "time", "hf", "fs"]
    assert got.added == ["time (from LM Studio)", "hf (from LM Studio)", "fs (from Claude Desktop)"]
    assert got.skipped == ["time"]
    assert got.problems == ["LM Studio: server 'broken': 'command' must be a non-empty string"]
    assert not any(s.enabled for s in got.servers)
    assert next(s for s in got.servers if s.name == "time").command == "uvx"     # the first one found kept


def test_import_finds_nothing_in_an_empty_home(tmp_path):
    got = import_servers([], default_sources(tmp_path))
    assert got.found == [] and got.servers == [] and got.added == []
    src = [ImportSource("X", _write(tmp_path / "x.json", "not json"))]
    assert import_servers([], src).problems[0].startswith("X: x.json: not JSON")


def test_masked_values_show_no_characters():
    assert masked("s3cret-token-value") == "\u2022" * 8 and masked("ab") == "\u2022\u2022" and masked("") == ""


def test_a_save_keeps_the_entries_it_could_not_load(tmp_path):
    """Nothing lost: the bad entries go back into the file as they were, for the user to mend; a server
    given a bad entry's name replaces it."""
    from app.tools.bridge import ToolsService
    bad = {"command": "x", "args": "not a list"}
    p = _write(tmp_path / "mcp.json", {"mcpServers": {"good": {"command": "uvx"}, "bad": bad, "ftp": {"url": "ftp://h"}}})
    service = ToolsService(tmp_path, home=tmp_path / "home")
    try:
        assert [s.name for s in service.servers] == ["good"] and len(service.problems) == 2
        service.put(ServerConfig("new", command="npx"))
        data = json.loads(p.read_text())["mcpServers"]
        assert data["bad"] == bad and data["ftp"] == {"url": "ftp://h"} and set(data) == {"good", "bad", "ftp", "new"}
        assert [s.name for s in read_config(p).servers] == ["good", "new"]
        service.put(ServerConfig("bad", command="x", args=("fixed",)))
        assert json.loads(p.read_text())["mcpServers"]["bad"] == {"command": "x", "args": ["fixed"], "enabled": False}
    finally:
        service.close()


def test_an_unreadable_file_is_moved_aside_before_a_save(tmp_path):
    from app.tools.bridge import ToolsService
    p = _write(tmp_path / "mcp.json", '{"mcpServers": {"a": {"command": "x"},}')     # a trailing comma
    service = ToolsService(tmp_path, home=tmp_path / "home")
    try:
        assert service.servers == [] and service.unreadable and "not JSON" in service.problems[0]
        assert p.read_text() == '{"mcpServers": {"a": {"command": "x"},}'             # reading changes nothing
        service.put(ServerConfig("new", command="npx"))
        assert (tmp_path / "mcp.json.unreadable").read_text() == '{"mcpServers": {"a": {"command": "x"},}'
        assert [s.name for s in read_config(p).servers] == ["new"]
    finally:
        service.close()
