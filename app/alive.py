"""Callbacks that die with their receiver. A lambda connected to a request's signal keeps its receiver
(the chat view, the meter) reachable from Python after Qt deleted it, and an answer arriving after the
view closed would then run on a deleted object ("Signal source has been deleted" when it emits).
Qt drops a bound method's connection with its object by itself; a callback that needs extra arguments
goes through `while_alive` instead."""
from __future__ import annotations

from typing import Callable

import shiboken6
from PySide6.QtCore import QObject


def while_alive(receiver: QObject, fn: Callable[..., object]) -> Callable[..., None]:
    """`fn`, called only while `receiver`'s Qt object exists."""
    def call(*args) -> None:
        if shiboken6.isValid(receiver):
            fn(*args)
    return call
