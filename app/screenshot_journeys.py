"""Screenshots of two journeys on the real app: `python -m app.screenshot_journeys OUTDIR [--model PATH]`.

1. A chat with its speed projection on is saved as a session and restored: the restored tab, its
   toggle set from the file (OUTDIR/screenshot-restored.png).
2. A long prompt being read: the bar in the answering chat, with Cancel (OUTDIR/screenshot-prefill.png).
Run it offscreen (QT_QPA_PLATFORM=offscreen) or under Xvfb, with a STRATA_HOME of its own.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from PySide6.QtCore import QTimer

from .screenshot import fresh_view, run_window, shot_window

LONG_PROMPT = ("Summarise the following notes in three bullet points.\n\n" + " ".join(
    f"Note {i}: the river keeper checked the lock gates at dawn, logged the water level, and "
    f"wrote down which barges passed before noon." for i in range(1, 40)))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m app.screenshot_journeys")
    ap.add_argument("outdir")
    ap.add_argument("--model")
    ap.add_argument("--timeout", type=float, default=540)
    args = ap.parse_args(argv)
    out = Path(args.outdir)
    out.mkdir(parents=True, exist_ok=True)
    session = Path(tempfile.mkdtemp()) / "rivers.stratasession"
    app, w = shot_window(args.model, 40)
    rc = [1]

    def finish():
        rc[0] = 0
        w.close()
        app.quit()

    def grab(name: str) -> None:
        w.grab().save(str(out / name))
        print("wrote", out / name, flush=True)

    def prefill_shot():
        view = w.new_tab()
        shot = [False]

        def on_progress(stage, done, total):
            if stage == "prefill" and not shot[0] and total and done >= total // 3:
                shot[0] = True
                grab("screenshot-prefill.png")
                view.task_cancel.click()
        view.input.setPlainText(LONG_PROMPT)
        view.send_input()
        view.request.progress.connect(on_progress)
        view.request.finished.connect(lambda: QTimer.singleShot(200, finish))

    def on_restored(view):
        QTimer.singleShot(700, lambda: (grab("screenshot-restored.png"), prefill_shot()))

    w.sessions.restored.connect(on_restored)
    w.sessions.saved.connect(lambda p: w.sessions.open_file(p))

    def on_loaded(_p):
        view = fresh_view(w)
        view.projection.setChecked(True)
        view.stats.connect(lambda _r: w.sessions.save_session(view, str(session)))
        view.input.setPlainText("Name three rivers in Europe.")
        view.send_input()

    w.library.loaded.connect(on_loaded)
    return run_window(app, w, args.timeout, rc)


if __name__ == "__main__":
    sys.exit(main())
