"""A screenshot of the context meter on the real app: `python -m app.screenshot_context OUTDIR [--model PATH]`.

A chat on a config of a small context (512 tokens) under the rolling window: questions are sent until
a reply's prompt left earlier turns out (its note in the transcript), then one more is typed, and
once the meter has the engine's count for it (with its warning) the window is written to
OUTDIR/screenshot-context.png. Run it offscreen (QT_QPA_PLATFORM=offscreen) or under Xvfb, with a
STRATA_HOME of its own.
"""
from __future__ import annotations

import sys

from PySide6.QtCore import QTimer

from .screenshot import fresh_view, grab_to, run_window, shot_args, shot_window

QUESTIONS = ["What is a river delta?", "Why do rivers meander?", "Name three long rivers in Europe.",
             "How do locks on a canal work?", "What lives in a river estuary?", "Why is river water fresh?",
             "How is a waterfall formed?", "What is a flood plain?", "How do bridges cross wide rivers?",
             "What is the source of the Danube?"]
NEXT = "Which of these rivers would you visit first, and why?"


def main(argv=None) -> int:
    args, out = shot_args("python -m app.screenshot_context", argv,
                          lambda ap: ap.add_argument("--context", type=int, default=512), max_tokens=False)
    app, w = shot_window(args.model, 48)
    rc = [1]
    state = {"asked": 0, "view": None}

    def grab_when_counted(reading) -> None:
        if reading is None or not reading.drafted:
            return
        state["view"].counter.counted.disconnect(grab_when_counted)
        QTimer.singleShot(300, lambda: (grab_to(out, "screenshot-context.png", w), finish()))

    def finish() -> None:
        rc[0] = 0
        w.close()
        app.quit()

    def ask_next(result=None) -> None:
        view = state["view"]
        if (result is not None and result.dropped_messages) or state["asked"] >= len(QUESTIONS):
            view.counter.counted.connect(grab_when_counted)
            view.input.setPlainText(NEXT)
            view.counter.count_now()
            return
        view.input.setPlainText(QUESTIONS[state["asked"]])
        state["asked"] += 1
        view.send_input()

    def on_loaded(_p) -> None:
        preset = w.presets.create("Short context", context_length=args.context, max_tokens=48, temperature=0.2)
        view = fresh_view(w)
        view.set_preset(preset.id)
        view.set_overflow("rolling")
        state["view"] = view
        view.stats.connect(lambda r: QTimer.singleShot(0, lambda: ask_next(r)))
        ask_next()

    w.library.loaded.connect(on_loaded)
    return run_window(app, w, args.timeout, rc)


if __name__ == "__main__":
    sys.exit(main())
