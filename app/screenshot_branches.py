"""Screenshots of branches and a fork on the real app: `python -m app.screenshot_branches OUTDIR [--model PATH]`.

1. One question answered, then regenerated twice, the second reply shown: the chat tab with the
   "< 2/3 >" switcher on it (OUTDIR/screenshot-branches.png).
2. Back on the third reply (the branch whose K/V the engine holds), "Fork" on it, a follow-up asked in
   the fork, and the window with the fork selected in the chat library: its parent named under the
   list, the reply's cached tokens in the status bar (OUTDIR/screenshot-fork.png).
Run it offscreen (QT_QPA_PLATFORM=offscreen) or under Xvfb, with a STRATA_HOME of its own.
"""
from __future__ import annotations

import sys

from PySide6.QtCore import QTimer

from .screenshot import fresh_view, grab_to, run_window, shot_args, shot_window

QUESTION = "Name three rivers in Europe."
FOLLOW_UP = "Which of them is the longest?"
ALTERNATIVES = 3


def main(argv=None) -> int:
    args, out = shot_args("python -m app.screenshot_branches", argv)
    app, w = shot_window(args.model, args.max_tokens)
    rc = [1]
    replies = [0]

    def grab(name: str, widget=None) -> None:
        grab_to(out, name, widget or w)

    def finish():
        rc[0] = 0
        w.close()
        app.quit()

    def when_titled(view, then) -> None:
        """`then()` once the view's title request is over (the shot shows the chat's title)."""
        if view.title_request is None and not view.busy:
            QTimer.singleShot(600, then)
        else:
            QTimer.singleShot(200, lambda: when_titled(view, then))

    def fork_shot(view):
        view.switch_branch(1, ALTERNATIVES - 1)
        view.fork(1)
        fork = w.current_view()
        fork.stats.connect(lambda _r: when_titled(fork, lambda: library_shot(fork)))
        fork.input.setPlainText(FOLLOW_UP)
        fork.send_input()

    def library_shot(fork):
        w.find_chat()
        w.chat_library.refresh()
        w.chat_library.select(fork.chat.id)
        QTimer.singleShot(600, lambda: (grab("screenshot-fork.png"), finish()))

    def switcher_shot(view):
        view.switch_branch(1, 1)
        QTimer.singleShot(600, lambda: (grab("screenshot-branches.png", view), fork_shot(view)))

    def on_reply(view):
        replies[0] += 1
        if replies[0] < ALTERNATIVES:
            QTimer.singleShot(300, view.regenerate)
        elif replies[0] == ALTERNATIVES:
            when_titled(view, lambda: switcher_shot(view))

    def on_loaded(_p):
        view = fresh_view(w)
        view.stats.connect(lambda _r: on_reply(view))
        view.input.setPlainText(QUESTION)
        view.send_input()

    w.library.loaded.connect(on_loaded)
    return run_window(app, w, args.timeout, rc)


if __name__ == "__main__":
    sys.exit(main())
