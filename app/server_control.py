"""The settings page's server toggle: the OpenAI-compatible server (engine.frontends.server) on the app's own
engine, started and stopped off the GUI thread.

It follows the settings: the engine's readiness and each change of a server key apply
`server_config(settings)`. `apply(config)` says what is wanted: (host, port, api_key) or None for off.
Starts and stops run one at a time on a helper thread; the latest wish wins. `state` is emitted after
each change: {"running": bool, "host", "port", "error": "" or the one-line reason it is off}. A start
that fails is told on the bus and turns the setting off (it stays off until turned on again).
"""
from __future__ import annotations

import logging
import threading

from PySide6.QtCore import QObject, Qt, Signal
from .engine_thread import start_server

log = logging.getLogger("strata.app")


SERVER_KEYS = ("server_enabled", "server_host", "server_port", "server_api_key")


class ServerControl(QObject):
    state = Signal(object)
    _started = Signal(object, object, str)     # (config, ServerThread or None, error)
    _stopped = Signal()

    def __init__(self, client, settings, bus, parent: QObject | None = None):
        super().__init__(parent)
        self.client = client
        self.settings = settings
        self.bus = bus
        self.wanted: tuple | None = None
        self.config: tuple | None = None         # what the running server serves
        self.server = None
        self.busy = False
        self.error = ""
        self.closed = False
        self._started.connect(self._on_started, Qt.ConnectionType.QueuedConnection)
        self._stopped.connect(self._on_stopped, Qt.ConnectionType.QueuedConnection)
        client.ready.connect(self.apply_settings)
        settings.changed.connect(lambda key: key in SERVER_KEYS and self.apply_settings())

    def engine(self):
        """The app's engine once it is ready, else None."""
        return self.client.thread.engine if self.client.is_ready else None

    def apply_settings(self) -> None:
        self.apply(server_config(self.settings))

    @property
    def running(self) -> bool:
        return self.server is not None

    @property
    def port(self) -> int:
        return self.server.port if self.server is not None else 0

    def apply(self, config: tuple | None) -> None:
        """config: (host, port, api_key) to serve, None to stop."""
        self.wanted = tuple(config) if config is not None else None
        self._reconcile()

    def _reconcile(self) -> None:
        if self.busy:
            return
        if self.server is not None and self.config != self.wanted:
            self.busy = True
            server, self.server, self.config = self.server, None, None
            threading.Thread(target=self._stop_worker, args=(server,), name="strata-server-stop",
                             daemon=True).start()
        elif self.server is None and self.wanted is not None:
            engine = self.engine()
            if engine is None:
                return                           # started again once the engine is ready
            self.busy = True
            threading.Thread(target=self._start_worker, args=(engine, self.wanted), name="strata-server-start",
                             daemon=True).start()

    def _start_worker(self, engine, config) -> None:
        host, port, key = config
        try:
            server = start_server(engine, host, int(port), key)
        except Exception as e:  # noqa: BLE001 - StrataError's one line ("cannot listen on ..."), or the like
            self._started.emit(config, None, str(e) or type(e).__name__)
            return
        self._started.emit(config, server, "")

    def _stop_worker(self, server) -> None:
        try:
            server.stop()
        except Exception:  # noqa: BLE001
            log.exception("server stop failed")
        self._stopped.emit()

    def _on_started(self, config, server, error: str) -> None:
        self.busy = False
        if self.closed:
            if server is not None:
                server.stop()
            return
        if server is None:
            self.error = error
            if self.wanted == config:
                self.wanted = None               # a failed start leaves it off
            self.bus.tell(f"The local server is off: {error}")
            if self.settings.server_enabled:
                self.settings.set("server_enabled", False)      # it stays off until turned on again
        else:
            self.error = ""
            self.server, self.config = server, config
            log.info("server on %s", server.base_url)
        self._report()
        self._reconcile()

    def _on_stopped(self) -> None:
        self.busy = False
        self._report()
        self._reconcile()

    def _report(self) -> None:
        host, port = (self.config[0], self.server.port) if self.server is not None else ("", 0)
        self.state.emit({"running": self.server is not None, "host": host, "port": port, "error": self.error,
                          "busy": self.busy})

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop now, on this thread (the window is closing)."""
        self.wanted = None
        self.closed = True
        if self.server is not None:
            server, self.server, self.config = self.server, None, None
            server.stop(timeout)


def server_config(s) -> tuple | None:
    """What the server runs with from the settings: (host, port, API key), or None when it is off."""
    return (s.server_host.strip() or "127.0.0.1", int(s.server_port), s.server_api_key) if s.server_enabled else None
