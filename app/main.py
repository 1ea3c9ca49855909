"""Entry point of the desktop app (`strata-app`, and the PyInstaller bundle).

    strata-app                       the window
    strata-app FILE.stratasession    open a session file (as Finder does)
    strata-app --self-test [--model PATH]   load a model, generate, save + restore a session, exit 0/1
                                            (with no --model and no default model: fetch it first)
    strata-app --fetch-default-model        fetch the default model into the app's models folder (no
                                            window, no pip): exit 0 when the verified model is in place
"""
from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from pathlib import Path

from PySide6.QtCore import QEvent, QObject, QTimer, QCoreApplication
from PySide6.QtGui import QIcon
from PySide6.QtWidgets import QApplication, QFileDialog, QMessageBox
from engine.paths import resources_dir

from .paths import set_identity, settle_data_dir, AppPaths, adopt_legacy, legacy_data_dir
from .model_fetch import fetch_headless
from .self_test import run_self_test
from .single_instance import SingleInstance
from .window import MainWindow


class FileOpenQueue(QObject):
    """Turns QFileOpenEvents (macOS Finder, the Dock) into window.sessions.open_file; installed as an event
    filter on the QApplication. Files that arrive before the window exists are queued."""

    def __init__(self, parent=None):
        super().__init__(parent)
        self.window = None
        self.pending: list[str] = []

    def eventFilter(self, obj, e) -> bool:  # noqa: N802
        if e.type() == QEvent.Type.FileOpen:
            path = e.file() or e.url().toLocalFile()
            if path:
                self.open_file(path)
            return True
        return False

    def open_file(self, path: str) -> None:
        if self.window is None:
            self.pending.append(path)
        else:
            self.window.sessions.open_file(path)

    def set_window(self, window) -> None:
        self.window = window
        pending, self.pending = self.pending, []
        for p in pending:        # requests queue behind the model load on the engine thread
            window.sessions.open_file(p)


def ask_for_data_folder(why: str) -> Path | None:
    """The data folder cannot be used: say where and why, and offer to choose another (None: Quit)."""
    box = QMessageBox(QMessageBox.Icon.Critical, "Strata cannot use its data folder",
                      f"{why[:1].upper()}{why[1:]}.\n\nStrata keeps its chats, models and settings there. "
                      "Choose another folder for this run, or quit and fix that one.")
    choose = box.addButton("Choose another folder…", QMessageBox.ButtonRole.AcceptRole)
    box.addButton("Quit", QMessageBox.ButtonRole.RejectRole)
    box.setDefaultButton(choose)
    box.exec()
    if box.clickedButton() is not choose:
        return None
    picked = QFileDialog.getExistingDirectory(None, "A folder for Strata's data")
    return Path(picked) if picked else None


def make_app(argv=None) -> QApplication:
    app = QApplication.instance() or QApplication(list(argv or sys.argv[:1]))
    if getattr(app, "_strata_files", None) is None:
        app._strata_files = FileOpenQueue(app)
        app.installEventFilter(app._strata_files)
    set_identity(app)
    app.setApplicationDisplayName("Strata")
    icon = resources_dir() / "icon.png"
    if icon.exists():
        app.setWindowIcon(QIcon(str(icon)))
    return app


def start_window(app: QApplication, files: list[str], app_paths=None):
    """The window, with `files` (command line) and any Finder open of the launch queued behind the
    model load: what main() does once this process is the one Strata for its data folder."""
    queue = app._strata_files
    for f in files:
        queue.open_file(str(Path(f).expanduser().resolve()))
    app.processEvents()          # a Finder open at launch arrives now, before the window exists
    window = MainWindow(paths=app_paths)
    window.show()
    queue.set_window(window)
    return window


def quit_on_signals(app: QApplication, window) -> None:
    """SIGTERM and SIGHUP (a logout, `kill`) close the window as Quit does: the chats saved, a reply
    stopped, a model fetch cancelled and its temporary folder removed, the engine thread stopped. Qt's
    event loop runs no Python code by itself, so a timer gives the interpreter a moment to run the
    handler. (QApplication.closeAllWindows would stop at the fetch dialog, whose close box cancels.)"""
    def handler(signum, _frame):
        logging.getLogger("strata.app").info("signal %d: quitting", signum)
        window.close()
        app.quit()
    for sig in (signal.SIGTERM, getattr(signal, "SIGHUP", None)):
        if sig is not None:
            signal.signal(sig, handler)
    app._signal_timer = QTimer(app, interval=200)
    app._signal_timer.timeout.connect(lambda: None)
    app._signal_timer.start()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="strata-app", description="Strata: local LLM chat")
    parser.add_argument("--self-test", action="store_true", help="load a model, generate, save+restore, exit")
    parser.add_argument("--model", help="model file for --self-test (default: the default model)")
    parser.add_argument("--soak-tokens", type=int, default=0, metavar="N",
                        help="--self-test also streams N tokens and checks the Qt binding kept its references")
    parser.add_argument("--fetch-default-model", action="store_true",
                        help="fetch the default model (no window); exit 0 when the verified model is in place")
    parser.add_argument("files", nargs="*", help="session files or models to open")
    args, qt_args = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    if args.fetch_default_model:

        core = QCoreApplication.instance() or QCoreApplication(sys.argv[:1])
        set_identity(core)
        return fetch_headless()      # into engine.paths' models folder: the one the window uses
    if args.self_test:
        return run_self_test(args.model, soak_tokens=max(0, args.soak_tokens))
    app = make_app([sys.argv[0], *qt_args])
    unusable = settle_data_dir(ask_for_data_folder)     # before anything creates a file in it
    if unusable:
        print(f"strata-app: {unusable}", file=sys.stderr)
        return 2
    app_paths = AppPaths.default()   # the one data folder (engine.paths), handed to what uses it
    instance = SingleInstance(app_paths.data_dir)
    if not instance.acquire():
        # Another Strata has this data folder (and its chats database): give it the files, exit.
        if instance.hand_over(args.files):
            logging.getLogger("strata.app").info("handed %d file(s) to the Strata already running",
                                                 len(args.files))
            return 0
        print("strata-app: another Strata is running with this data folder but does not answer; "
              "close it and try again", file=sys.stderr)
        return 1
    instance.listen()
    if not os.environ.get("STRATA_HOME"):
        # This Strata has the data folder: bring over what an older version kept in Qt's own folder.
        moved = adopt_legacy(app_paths, legacy_data_dir())
        if moved:
            logging.getLogger("strata.app").info("moved %s from %s to %s", ", ".join(moved), legacy_data_dir(),
                                                 app_paths.data_dir)
    queue = app._strata_files
    instance.files_received.connect(lambda fs: [queue.open_file(f) for f in fs])
    window = start_window(app, args.files, app_paths)
    quit_on_signals(app, window)
    instance.activated.connect(lambda: (window.showNormal(), window.raise_(), window.activateWindow()))
    try:
        return app.exec()
    finally:
        instance.release()


if __name__ == "__main__":
    sys.exit(main())
