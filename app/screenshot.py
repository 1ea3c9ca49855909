"""Screenshots of the real app: `python -m app.screenshot OUTDIR [--model PATH] [--message TEXT]`.

Opens the window, loads the model, sends one message, waits for the reply (and its title), then
writes OUTDIR/main-window.png, OUTDIR/chat-library.png (the side list of chats, searched),
OUTDIR/main-window-dark.png (Settings > Appearance: Dark) and OUTDIR/settings.png. Run it under Xvfb
(xvfb-run) or offscreen.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from PySide6.QtCore import QTimer

from .main import make_app
from .window import MainWindow


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m app.screenshot")
    ap.add_argument("outdir")
    ap.add_argument("--model")
    ap.add_argument("--message", default="Write a Python function that checks if a number is prime.")
    ap.add_argument("--max-tokens", type=int, default=120)
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--search", default="", help="text typed into the chat library's search field")
    args = ap.parse_args(argv)
    out = Path(args.outdir)
    out.mkdir(parents=True, exist_ok=True)
    app, w = shot_window(args.model, args.max_tokens)
    rc = [1]

    def grab_settings():
        page = w.open_settings()
        page.resize(980, 640)
        QTimer.singleShot(600, lambda: (page.grab().save(str(out / "settings.png")), print("wrote", out / "settings.png"),
                                        page.reject(), finish()))

    def finish():
        rc[0] = 0
        w.close()
        app.quit()

    def save(widget, name):
        widget.grab().save(str(out / name))
        print("wrote", out / name)

    def grab_library():
        w.find_chat()
        if args.search:
            w.chat_library.search.setText(args.search)
        QTimer.singleShot(500, lambda: (save(w, "chat-library.png"), grab_dark()))

    def grab_dark():
        w.settings.set("theme", "dark")
        QTimer.singleShot(600, lambda: (save(w, "main-window-dark.png"), w.settings.set("theme", "light"),
                                        grab_settings()))

    def after_reply(_r):
        QTimer.singleShot(800, lambda: (save(w, "main-window.png"), grab_library()))

    def on_loaded(_p):
        view = fresh_view(w)
        view.title_changed.connect(after_reply)
        view.input.setPlainText(args.message)
        view.send_input()

    w.library.loaded.connect(on_loaded)
    return run_window(app, w, args.timeout, rc)


def shot_window(model: str | None, max_tokens: int):
    """The app and its window as the screenshots show them: 1280 x 800, replies at temperature 0.2."""
    app = make_app(sys.argv[:1])
    w = MainWindow(offer_fetch=False)
    w.settings.sampling.max_tokens = max_tokens
    w.settings.sampling.temperature = 0.2
    if model:
        w.settings.value.model = model
    w.resize(1280, 800)
    w.show()
    return app, w


def shot_args(prog: str, argv, extra=None, max_tokens: bool = True) -> tuple[argparse.Namespace, Path]:
    """A screenshot script's arguments: OUTDIR (made), --model, --max-tokens, --timeout, and what
    `extra(parser)` adds."""
    ap = argparse.ArgumentParser(prog=prog)
    ap.add_argument("outdir")
    if extra is not None:
        extra(ap)
    ap.add_argument("--model")
    if max_tokens:
        ap.add_argument("--max-tokens", type=int, default=60)
    ap.add_argument("--timeout", type=float, default=540)
    args = ap.parse_args(argv)
    out = Path(args.outdir)
    out.mkdir(parents=True, exist_ok=True)
    return args, out


def grab_to(out: Path, name: str, widget) -> None:
    """`widget` as it is drawn now, saved as out/name."""
    widget.grab().save(str(out / name))
    print("wrote", out / name, flush=True)


def fresh_view(w):
    """The current tab, or a new one when it already holds a chat."""
    view = w.current_view()
    return w.new_tab() if view.chat.messages else view


def run_window(app, w, timeout_s: float, rc: list) -> int:
    """Run the event loop until the shots are taken (or `timeout_s` passes), then stop the window's engine:
    the exit code the shots left in rc[0]."""
    QTimer.singleShot(int(timeout_s * 1000), lambda: (print("timed out"), app.quit()))
    app.exec()
    w.shutdown()
    return rc[0]


if __name__ == "__main__":
    sys.exit(main())
