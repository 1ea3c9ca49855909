"""One Strata per data folder: a second launch hands its files to the first and exits.

The first launch holds a QLockFile in the data folder (so the chats database is never opened by two
processes) and listens on a QLocalServer named after that folder. A later launch finds the lock
taken, connects, sends its files' absolute paths (one JSON line), waits for the "ok" line and exits.
A launch that finds the lock held but nobody answering (the first one is still starting) retries
for a few seconds, then gives up with one line; it never opens the database itself.
"""
from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

from PySide6.QtCore import QLockFile, QObject, Signal
from PySide6.QtNetwork import QLocalServer, QLocalSocket

from . import paths

# How long a second launch keeps trying while the first one is still starting (tests shorten it).
HANDOVER_TIMEOUT_S = float(os.environ.get("STRATA_HANDOVER_TIMEOUT_S", "10"))


def server_name(data_dir: Path | None = None) -> str:
    folder = str((data_dir or paths.data_dir()).resolve())
    # Short: on macOS the name becomes a socket path, limited to about 100 bytes.
    return "strata-" + hashlib.sha1(folder.encode()).hexdigest()[:16]


class SingleInstance(QObject):
    files_received = Signal(list)        # paths another launch handed over
    activated = Signal()                 # another launch asked to be shown (with or without files)

    def __init__(self, data_dir: Path | None = None, parent: QObject | None = None):
        super().__init__(parent)
        self.data_dir = data_dir or paths.data_dir()
        self.name = server_name(self.data_dir)
        self.lock = QLockFile(str(self.data_dir / "strata.lock"))
        self.lock.setStaleLockTime(0)    # stale only when its process is gone (no timeout)
        self.server: QLocalServer | None = None

    def acquire(self) -> bool:
        """True when this process is the one Strata for the folder (a lock left by a dead
        process is taken over)."""
        return self.lock.tryLock(0)

    def listen(self) -> bool:
        QLocalServer.removeServer(self.name)      # a socket file left by a crashed first instance
        self.server = QLocalServer(self)
        self.server.setSocketOptions(QLocalServer.SocketOption.UserAccessOption)
        self.server.newConnection.connect(self._on_connection)
        return self.server.listen(self.name)

    def release(self) -> None:
        if self.server is not None:
            self.server.close()
            self.server = None
        self.lock.unlock()

    def _on_connection(self) -> None:
        while self.server is not None and self.server.hasPendingConnections():
            sock = self.server.nextPendingConnection()
            buf = bytearray()

            def read(sock=sock, buf=buf):
                buf.extend(bytes(sock.readAll()))
                if b"\n" not in buf:
                    return
                line = bytes(buf).split(b"\n", 1)[0]
                try:
                    files = [str(f) for f in json.loads(line).get("files", [])]
                except (ValueError, AttributeError):
                    files = []
                sock.write(b"ok\n")
                sock.flush()
                sock.disconnectFromServer()
                self.activated.emit()
                if files:
                    self.files_received.emit(files)
            sock.readyRead.connect(read)
            sock.disconnected.connect(sock.deleteLater)
            if sock.bytesAvailable():
                read()

    def hand_over(self, files: list[str], timeout_s: float = HANDOVER_TIMEOUT_S) -> bool:
        """Send `files` to the running instance; True once it said it has them."""
        payload = (json.dumps({"files": [str(Path(f).resolve()) for f in files]}) + "\n").encode()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            sock = QLocalSocket()
            sock.connectToServer(self.name)
            if sock.waitForConnected(500):
                sock.write(payload)
                sock.flush()
                reply = bytearray()
                while b"\n" not in reply and time.monotonic() < deadline:
                    if not sock.waitForReadyRead(500):
                        if sock.state() != QLocalSocket.LocalSocketState.ConnectedState:
                            break
                        continue
                    reply.extend(bytes(sock.readAll()))
                sock.abort()
                if reply.startswith(b"ok"):
                    return True
            time.sleep(0.2)            # the first instance is still starting: try again
        return False
