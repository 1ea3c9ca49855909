"""Screenshots of documents in a chat, on the real app:
`python -m app.screenshot_documents OUTDIR FILE... --question TEXT [--source N] [--model PATH]`.

Attaches each FILE to a new chat (as Attach… does), and once every one is settled (whole, by passages,
or refused) sends TEXT. It then writes OUTDIR/screenshot-documents.png at once (the question with its
sources under it, the notes saying how each file went in, the documents row above the message box) and,
after the reply, OUTDIR/screenshot-documents-source.png (the passage that source [N] links to, [1] unless
given). Run it
offscreen (QT_QPA_PLATFORM=offscreen) or under Xvfb, with a STRATA_HOME of its own.
"""
from __future__ import annotations

import sys

from PySide6.QtCore import QTimer, QUrl

from .screenshot import fresh_view, grab_to, run_window, shot_args, shot_window


def main(argv=None) -> int:
    def own(ap) -> None:
        ap.add_argument("files", nargs="+")
        ap.add_argument("--question", required=True)
        ap.add_argument("--source", type=int, default=1, help="the source whose passage is shown")
    args, out = shot_args("python -m app.screenshot_documents", argv, own)
    app, w = shot_window(args.model, args.max_tokens)
    rc = [1]

    def save(widget, name: str) -> None:
        grab_to(out, name, widget)

    def finish():
        rc[0] = 0
        w.close()
        app.quit()

    def after_reply(view, at: int) -> None:
        view.transcript.anchorClicked.emit(QUrl(f"cite:{at}:{args.source}"))
        dialog = view.documents.passage_dialog
        QTimer.singleShot(400, lambda: (save(dialog, "screenshot-documents-source.png"), dialog.close(), finish()))

    def ask(view) -> None:
        view.input.setPlainText(args.question)
        view.send_input()
        at = len(view.chat.messages) - 1
        save(w, "screenshot-documents.png")      # now: the question and its sources, before the reply
        view.stats.connect(lambda _r: QTimer.singleShot(300, lambda: after_reply(view, at)))

    def on_loaded(_p):
        view = fresh_view(w)
        settled: list[object] = []

        def one_more(_x) -> None:
            settled.append(_x)
            if len(settled) == len(args.files):
                QTimer.singleShot(300, lambda: ask(view))
        view.documents.decided.connect(one_more)
        view.documents.refused.connect(one_more)
        for f in args.files:
            view.documents.attach(f)

    w.library.loaded.connect(on_loaded)
    return run_window(app, w, args.timeout, rc)


if __name__ == "__main__":
    sys.exit(main())
