"""A screenshot of images in a chat, on the real app:
`python -m app.screenshot_images OUTDIR IMAGE... --question TEXT [--model PATH]`.

Attaches each IMAGE to a new chat (as Image… does), sends TEXT and, after the reply, writes
OUTDIR/screenshot-images.png (the question with its thumbnails in the transcript, the reply, the context
meter counting the image's tokens). The model needs its image projector (an mmproj-*.gguf beside it).
Run it offscreen (QT_QPA_PLATFORM=offscreen) or under Xvfb, with a STRATA_HOME of its own.
"""
from __future__ import annotations

import sys
from pathlib import Path

from PySide6.QtCore import QTimer

from .screenshot import fresh_view, grab_to, run_window, shot_args, shot_window


def main(argv=None) -> int:
    def own(ap) -> None:
        ap.add_argument("images", nargs="+")
        ap.add_argument("--question", required=True)
    args, out = shot_args("python -m app.screenshot_images", argv, own)
    app, w = shot_window(args.model, args.max_tokens)
    rc = [1]

    def finish() -> None:
        grab_to(out, "screenshot-images.png", w)
        rc[0] = 0
        w.close()
        app.quit()

    def on_loaded(_p) -> None:
        view = fresh_view(w)
        if view.images.attach_files([Path(p) for p in args.images]) != len(args.images):
            print("an image was refused", file=sys.stderr)
            app.quit()
            return
        view.input.setPlainText(args.question)
        view.stats.connect(lambda _r: QTimer.singleShot(500, finish))
        view.send_input()

    w.library.loaded.connect(on_loaded)
    return run_window(app, w, args.timeout, rc)


if __name__ == "__main__":
    sys.exit(main())
