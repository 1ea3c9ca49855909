"""The Qt side of the MCP host: `ToolsService` owns the config file and the host, and turns the host's
thread-side callbacks into signals delivered on the GUI thread. Everything of substance is in the
Qt-free modules beside it (config, host, results)."""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from PySide6.QtCore import QObject, Qt, Signal

from .config import (CONFIG_NAME, ImportResult, ServerConfig, default_sources, import_servers, read_config, set_aside,
                     write_config)
from .host import DEFAULT_CALL_TIMEOUT_S, CallHandle, McpHost
from .results import ServerState, ToolInfo, ToolResult


class ToolCall(QObject):
    """One tool call in flight: `finished(ToolResult)` on the GUI thread; `cancel()` stops it."""
    finished = Signal(object)
    _done = Signal(object)

    def __init__(self, handle: CallHandle, parent: QObject | None = None):
        super().__init__(parent)
        self.handle = handle
        self.result: ToolResult | None = None
        self._done.connect(self._deliver, Qt.ConnectionType.QueuedConnection)
        handle.future.add_done_callback(lambda f: self._done.emit(f.result()))

    def cancel(self) -> None:
        self.handle.cancel()

    def _deliver(self, result: ToolResult) -> None:
        self.result = result
        self.finished.emit(result)


class ToolsService(QObject):
    """The app's MCP servers: their config (`mcp.json` in the data folder), their processes (only the
    enabled ones run) and their states. `state_changed(ServerState)` and `servers_changed()` fire on
    the GUI thread."""
    state_changed = Signal(object)
    servers_changed = Signal()
    _state = Signal(object)

    def __init__(self, data_dir: Path, parent: QObject | None = None, home: Path | None = None):
        super().__init__(parent)
        self.path = Path(data_dir) / CONFIG_NAME
        self.home = home                      # where other apps' configs are looked for (tests: a folder)
        self._state.connect(self.state_changed, Qt.ConnectionType.QueuedConnection)
        self.host = McpHost(on_change=self._state.emit)
        loaded = read_config(self.path)
        self.servers: list[ServerConfig] = loaded.servers
        self.problems: list[str] = loaded.problems
        self.unloaded: dict = loaded.unloaded          # bad entries: written back as they were
        self.unreadable = loaded.unreadable            # the file is moved aside before the first save
        self.set_aside_to: Path | None = None

    # ---- config --------------------------------------------------------------------------------
    def server(self, name: str) -> ServerConfig | None:
        return next((s for s in self.servers if s.name == name), None)

    def put(self, config: ServerConfig, old_name: str | None = None) -> None:
        """Add or replace a server (by `old_name`, else its own name), save, and (re)start or stop it."""
        key = old_name or config.name
        if old_name and old_name != config.name:
            self.host.stop(old_name)
        self.servers = [s for s in self.servers if s.name not in (key, config.name)] + [config]
        self._save()
        self._apply(config)

    def remove(self, name: str) -> None:
        self.servers = [s for s in self.servers if s.name != name]
        self.host.stop(name)
        self._save()

    def set_enabled(self, name: str, on: bool) -> None:
        cfg = self.server(name)
        if cfg is not None and cfg.enabled != on:
            self.put(replace(cfg, enabled=on))

    def import_found(self) -> ImportResult:
        """Servers from LM Studio's and Claude Desktop's configs, where found, added disabled."""
        result = import_servers(self.servers, default_sources(self.home))
        if result.added:
            self.servers = result.servers
            self._save()
        return result

    def _save(self) -> None:
        if self.unreadable and self.path.exists():
            self.set_aside_to = set_aside(self.path)
        self.unreadable = False
        names = {s.name for s in self.servers}          # a server given a bad entry's name replaces it
        self.unloaded = {k: v for k, v in self.unloaded.items() if k not in names}
        write_config(self.path, self.servers, self.unloaded)
        self.servers_changed.emit()

    # ---- processes ------------------------------------------------------------------------------
    def start_enabled(self) -> None:
        for cfg in self.servers:
            if cfg.enabled:
                self.host.start(cfg)

    def _apply(self, cfg: ServerConfig) -> None:
        if cfg.enabled:
            self.host.start(cfg)
        else:
            self.host.stop(cfg.name)

    def state(self, name: str) -> ServerState:
        return self.host.state(name)

    def tools(self) -> list[ToolInfo]:
        """The tools of every enabled, ready server."""
        enabled = {s.name for s in self.servers if s.enabled}
        return [t for t in self.host.tools() if t.server in enabled]

    def call(self, server: str, tool: str, arguments: dict, timeout: float = DEFAULT_CALL_TIMEOUT_S) -> ToolCall:
        return ToolCall(self.host.call(server, tool, arguments, timeout), self)

    def close(self) -> None:
        self.host.close()
