"""One Strata per data folder: a second launch hands its files to the first and exits.

The first launch holds a QLockFile in the data folder (so the chats database is never opened by two
processes) and listens on a QLocalServer named after that folder. A later launch finds the lock
taken, connects, sends its files' absolute paths (one JSON line), waits for the "ok" line and exits.
A launch that finds the lock held but nobody answering (the first one is still starting) retries
for a few seconds, then gives up with one line; it never opens the database itself.

The channel is a local socket only this user can open, but what arrives on it is still checked: one
line of at most MAX_LINE bytes within LINE_SECONDS, a JSON object whose "files" is a list of at most
MAX_FILES absolute paths (strings without NUL). Anything else is answered "refused", logged in one
line and dropped (no file is opened, the window is not raised).
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from pathlib import Path

from PySide6.QtCore import QLockFile, QObject, QTimer, Signal
from PySide6.QtNetwork import QLocalServer, QLocalSocket

from . import paths

# How long a second launch keeps trying while the first one is still starting (tests shorten it).
HANDOVER_TIMEOUT_S = float(os.environ.get("STRATA_HANDOVER_TIMEOUT_S", "10"))
MAX_LINE = 1 << 20          # bytes of one hand-over line (256 paths of 4 KiB fit)
MAX_FILES = 256
LINE_SECONDS = 10.0         # a connection that has not sent its line by then is closed
log = logging.getLogger("strata.app")


def parse_handover(line: bytes) -> list[str]:
    """The files of a hand-over line; ValueError of one line for anything but
    {"files": [absolute path, ...]} (at most MAX_FILES)."""
    if len(line) > MAX_LINE:
        raise ValueError(f"a line of more than {MAX_LINE} bytes")
    try:
        msg = json.loads(line)
    except RecursionError:
        raise ValueError("JSON nested too deeply") from None
    except ValueError as e:                 # UnicodeDecodeError and JSONDecodeError too
        raise ValueError(f"not JSON ({str(e).splitlines()[0][:80]})") from None
    if not isinstance(msg, dict):
        raise ValueError(f"a JSON {type(msg).__name__}, not an object")
    files = msg.get("files", [])
    if not isinstance(files, list):
        raise ValueError(f'"files" is a {type(files).__name__}, not a list')
    if len(files) > MAX_FILES:
        raise ValueError(f'{len(files)} files (at most {MAX_FILES})')
    for f in files:
        if not isinstance(f, str) or not f or "\x00" in f or not os.path.isabs(f):
            raise ValueError(f'"files" holds {str(f)[:60]!r}, not an absolute path')
    return list(files)


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
            state = {"done": False}
            timer = QTimer(sock, singleShot=True, interval=int(LINE_SECONDS * 1000))

            def refuse(why: str, sock=sock, state=state, timer=timer):
                state["done"] = True
                timer.stop()
                log.warning("single instance: refused a hand-over: %s", why)
                sock.write(b"refused\n")
                sock.flush()
                sock.disconnectFromServer()

            def read(sock=sock, buf=buf, state=state, timer=timer):
                if state["done"]:
                    sock.readAll()
                    return
                # never more than one byte past the limit is held
                buf.extend(bytes(sock.read(MAX_LINE + 1 - len(buf))))
                if b"\n" not in buf:
                    if len(buf) > MAX_LINE:
                        refuse(f"no end of line within {MAX_LINE} bytes")
                    return
                state["done"] = True
                timer.stop()
                line = bytes(buf).split(b"\n", 1)[0]
                try:
                    files = parse_handover(line)
                except ValueError as e:
                    refuse(str(e))
                    return
                sock.write(b"ok\n")
                sock.flush()
                sock.disconnectFromServer()
                self.activated.emit()
                if files:
                    self.files_received.emit(files)
            timer.timeout.connect(lambda state=state, refuse=refuse: state["done"] or refuse(
                f"no line within {LINE_SECONDS:g} s"))
            timer.start()
            sock.readyRead.connect(read)
            sock.disconnected.connect(sock.deleteLater)
            if sock.bytesAvailable():
                read()

    def hand_over(self, files: list[str], timeout_s: float = HANDOVER_TIMEOUT_S) -> bool:
        """Send `files` to the running instance; True once it said it has them."""
        payload = (json.dumps({"files": [str(Path(f).resolve()) for f in files][:MAX_FILES]}) + "\n").encode()
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
                if reply.startswith(b"refused"):
                    return False
            time.sleep(0.2)            # the first instance is still starting: try again
        return False
