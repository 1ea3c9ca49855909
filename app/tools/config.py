"""The MCP servers' config: `mcp.json` in the data folder, in the `mcpServers` format LM Studio, Claude
Desktop and Cursor share, so a file people already have can be copied or imported as is:

    {"mcpServers": {
        "files": {"command": "npx", "args": ["-y", "@modelcontextprotocol/server-filesystem", "/tmp"],
                  "env": {"TOKEN": "..."}, "enabled": true},
        "web":   {"url": "http://127.0.0.1:8000/mcp", "headers": {"Authorization": "Bearer ..."}}}}

A server with `command` talks over stdio, one with `url` over streamable HTTP. `enabled` is Strata's own
key and false when absent: no server runs until the user turns it on (an imported file starts all off).
Each bad entry is one line in `ConfigLoad.problems`; the good ones load. Plain Python (no Qt).
"""
from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field, replace
from pathlib import Path

CONFIG_NAME = "mcp.json"
MAX_CONFIG_BYTES = 1 << 20            # a config file is a few KiB; anything past this is not one
NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9 _.-]{0,63}")


@dataclass(frozen=True)
class ServerConfig:
    name: str
    command: str = ""                 # stdio: the executable
    args: tuple[str, ...] = ()
    env: dict = field(default_factory=dict)
    url: str = ""                     # streamable HTTP: the endpoint
    headers: dict = field(default_factory=dict)
    enabled: bool = False

    @property
    def transport(self) -> str:
        return "http" if self.url else "stdio"

    def to_json(self) -> dict:
        """The entry as `mcpServers` writes it (only the keys its transport uses)."""
        if self.url:
            out: dict = {"url": self.url}
            if self.headers:
                out["headers"] = dict(self.headers)
        else:
            out = {"command": self.command, "args": list(self.args)}
            if self.env:
                out["env"] = dict(self.env)
        out["enabled"] = self.enabled
        return out


@dataclass
class ConfigLoad:
    servers: list[ServerConfig] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)     # one line per entry (or file) not loaded
    # The entries not loaded, as the file had them: written back unchanged, for the user to mend
    unloaded: dict = field(default_factory=dict)
    unreadable: bool = False                              # the file is there but no config could be read


def _str_map(value, what: str) -> dict:
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        raise ValueError(f"'{what}' must be an object of strings")
    return dict(value)


def parse_entry(name, entry) -> ServerConfig:
    """One `mcpServers` entry as a ServerConfig, or ValueError with the reason (one line)."""
    if not isinstance(name, str) or not NAME_RE.fullmatch(name):
        raise ValueError("the name must be 1-64 letters, digits, spaces, '_', '-' or '.'")
    if not isinstance(entry, dict):
        raise ValueError("the entry must be an object")
    enabled = entry.get("enabled", False)
    if not isinstance(enabled, bool):
        raise ValueError("'enabled' must be true or false")
    command, url = entry.get("command"), entry.get("url")
    if (command is None) == (url is None):
        raise ValueError("give either 'command' (stdio) or 'url' (streamable HTTP)")
    if url is not None:
        if not isinstance(url, str) or not re.match(r"https?://[^\s/]+", url):
            raise ValueError("'url' must be an http:// or https:// address")
        return ServerConfig(name, url=url, headers=_str_map(entry.get("headers"), "headers"), enabled=enabled)
    if not isinstance(command, str) or not command.strip():
        raise ValueError("'command' must be a non-empty string")
    args = entry.get("args", [])
    if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
        raise ValueError("'args' must be a list of strings")
    return ServerConfig(name, command=command, args=tuple(args), env=_str_map(entry.get("env"), "env"),
                        enabled=enabled)


def parse_config(data) -> ConfigLoad:
    """A parsed JSON document's servers; each bad entry a line of `problems`, the rest kept."""
    out = ConfigLoad()
    if not isinstance(data, dict) or not isinstance(data.get("mcpServers", {}), dict):
        out.problems.append("the file must be a JSON object with an 'mcpServers' object")
        return out
    for name, entry in data.get("mcpServers", {}).items():
        try:
            out.servers.append(parse_entry(name, entry))
        except ValueError as e:
            out.problems.append(f"server {name!r}: {e}")
            out.unloaded[name] = entry
    return out


def read_config(path: Path) -> ConfigLoad:
    """The servers of a config file; a missing file is an empty config, an unreadable one a problem."""
    path = Path(path)
    if not path.exists():
        return ConfigLoad()
    try:
        if path.stat().st_size > MAX_CONFIG_BYTES:
            return ConfigLoad(problems=[f"{path.name}: larger than {MAX_CONFIG_BYTES >> 10} KiB, not read"],
                              unreadable=True)
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as e:
        return ConfigLoad(problems=[f"{path.name}: cannot be read ({e})"], unreadable=True)
    except json.JSONDecodeError as e:
        return ConfigLoad(problems=[f"{path.name}: not JSON (line {e.lineno}, column {e.colno}: {e.msg})"],
                          unreadable=True)
    loaded = parse_config(data)
    loaded.unreadable = not isinstance(data, dict) or not isinstance(data.get("mcpServers", {}), dict)
    return loaded


def write_config(path: Path, servers: list[ServerConfig], unloaded: dict | None = None) -> None:
    """Write the servers (atomically: a crash leaves the old file whole). Owner-only: it holds secrets.
    `unloaded`: entries the last read could not load, kept as they were (a server of that name wins)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    entries = {name: entry for name, entry in (unloaded or {}).items()}
    entries.update({s.name: s.to_json() for s in servers})
    text = json.dumps({"mcpServers": entries}, indent=2, ensure_ascii=False)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text + "\n")
    os.replace(tmp, path)


# ---- import from other apps -------------------------------------------------------------------------
@dataclass(frozen=True)
class ImportSource:
    app: str
    path: Path


def default_sources(home: Path | None = None) -> list[ImportSource]:
    """Where LM Studio and Claude Desktop keep their MCP configs (macOS paths; `home` for tests)."""
    home = Path(home) if home is not None else Path.home()
    return [ImportSource("LM Studio", home / ".lmstudio" / "mcp.json"),
            ImportSource("Claude Desktop",
                         home / "Library" / "Application Support" / "Claude" / "claude_desktop_config.json")]


@dataclass
class ImportResult:
    servers: list[ServerConfig]                            # the merged list (existing ones first)
    added: list[str] = field(default_factory=list)         # "name (from App)"
    skipped: list[str] = field(default_factory=list)       # names already present
    problems: list[str] = field(default_factory=list)      # "App: ..." one line each
    found: list[str] = field(default_factory=list)         # the apps whose file was there


def import_servers(existing: list[ServerConfig], sources: list[ImportSource]) -> ImportResult:
    """The servers of each source file that exists, added after `existing` (a name already present is
    kept as it is, and the import's one skipped), every imported server disabled."""
    out = ImportResult(list(existing))
    names = {s.name for s in existing}
    for src in sources:
        if not src.path.is_file():
            continue
        out.found.append(src.app)
        loaded = read_config(src.path)
        out.problems += [f"{src.app}: {p}" for p in loaded.problems]
        for s in loaded.servers:
            if s.name in names:
                out.skipped.append(s.name)
                continue
            names.add(s.name)
            out.servers.append(replace(s, enabled=False))
            out.added.append(f"{s.name} (from {src.app})")
    return out


def config_notice(problems: list[str], unreadable: bool = False) -> str:
    """What the app says of a config's problems: one line each."""
    if unreadable:
        head = f"MCP servers: {CONFIG_NAME} was not read (a change saved moves it aside to {CONFIG_NAME}.unreadable):"
    else:
        head = f"MCP servers not loaded (the others were; {CONFIG_NAME} keeps these entries as they are):"
    return "\n".join([head, *problems])


def set_aside(path: Path) -> Path:
    """Move an unreadable config out of the way (before a save replaces it): `mcp.json.unreadable`,
    numbered when that exists. Returns where it went."""
    path = Path(path)
    target, n = path.with_name(path.name + ".unreadable"), 1
    while target.exists():
        n += 1
        target = path.with_name(f"{path.name}.unreadable-{n}")
    os.replace(path, target)
    return target


def masked(value: str) -> str:
    """A secret as shown: its length hinted, never its characters."""
    return "\u2022" * min(len(value), 8) if value else ""
