"""Work-arounds for the Qt binding in use.

PySide6 6.12 on CPython 3.11 returns the bool of `SignalInstance.emit()` without a new reference, so
every emit from Python decrements `True`'s refcount; after enough emits (a few hundred streamed tokens)
the interpreter aborts with "bool_dealloc: deallocating True or False". `emit(signal, *args)` emits and
gives the reference back. The leak is measured once at import, so a fixed PySide6 needs no change here.
"""
from __future__ import annotations

import ctypes
import sys

from PySide6.QtCore import QObject, Signal


class _Probe(QObject):
    sig = Signal()


def _measure_leak(n: int = 32) -> bool:
    probe = _Probe()
    before = sys.getrefcount(True)
    for _ in range(n):
        probe.sig.emit()
    lost = before - sys.getrefcount(True)
    if lost > 0:  # give back what the probe took
        for _ in range(lost):
            ctypes.pythonapi.Py_IncRef(ctypes.py_object(True))
    return lost >= n // 2


EMIT_LEAKS = _measure_leak()


def emit(signal, *args):
    result = signal.emit(*args)
    if EMIT_LEAKS and isinstance(result, bool):
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(result))
    return result
