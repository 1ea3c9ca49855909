"""The message bus: how the controllers report to a person without knowing the window's widgets.

`status(text, ms)` is a passing note for the status bar ("Loaded tiny.gguf"), `error(text)` and
`info(text)` are for the message bar at the top of the window (things a person must read: refusals,
files moved aside); `offer(text, action, slot)` is a message-bar line with one action button ("Load it
and restore"). `withdraw(start)` takes back a message-bar line that is no longer true (a failure since
retried with success). `busy(stage)`, `progress(stage, done, total)` and `idle()` drive the status bar's one
progress bar. The window connects the bars once (`MessageBus.attach`); a test connects its own lists.
"""
from __future__ import annotations

from PySide6.QtCore import QObject, Signal


class MessageBus(QObject):
    status = Signal(str, int)            # (text, milliseconds shown; 0 = until replaced)
    error = Signal(str)
    info = Signal(str)
    offer = Signal(str, str, object)     # (text, action label, slot: () -> None)
    busy = Signal(str)                   # a stage (status_bar.STAGES) with no figures yet
    progress = Signal(str, object, object)   # (stage, done, total): byte counts can pass 2**31
    idle = Signal()                      # the work the progress bar showed is over
    withdraw = Signal(str)               # a message-bar line starting so is no longer true: it goes

    def say(self, text: str, ms: int = 5000) -> None:
        """A passing status-bar note."""
        self.status.emit(text, ms)

    def tell(self, text: str, action: str = "", slot=None) -> None:
        """A message-bar line a person must read; with `action`/`slot` it offers one button."""
        if action and slot is not None:
            self.offer.emit(text, action, slot)
        else:
            self.error.emit(text)

    def attach(self, message_bar, status_bar) -> None:
        """Show the bus's messages on the window's message bar and status bar."""
        self.error.connect(lambda text: message_bar.show_message(text))
        self.info.connect(lambda text: message_bar.show_message(text))
        self.offer.connect(lambda text, action, slot: message_bar.show_message(text, action, slot))
        self.status.connect(lambda text, ms: status_bar.showMessage(text, ms))
        self.busy.connect(status_bar.busy)
        self.progress.connect(status_bar.show_progress)
        self.idle.connect(status_bar.hide_progress)
        self.withdraw.connect(message_bar.withdraw)
