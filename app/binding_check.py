"""Does the Qt binding keep its references? The Qt calls the app makes, N times, and the references to
`None`, `True` and `False` the interpreter lost meanwhile.

PySide6-Essentials 6.12.0 on CPython 3.11 dropped a reference to `None` on Qt calls that return
nothing and to `True`/`False` on `emit()`; the interpreter then aborted ("none_dealloc",
"bool_dealloc") after a few hundred streamed tokens. The pinned binding must lose none: the guard
test (tests/app/test_qt_binding.py) and the bundle's `--self-test` both run this, so a binding that
regresses fails before a user meets it. On CPython 3.12+ these objects are immortal and nothing can be
lost; the check still runs the calls.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass

from PySide6.QtCore import QObject, Signal
from PySide6.QtGui import QStandardItem, QStandardItemModel, QTextCursor
from PySide6.QtWidgets import (QApplication, QLabel, QPlainTextEdit, QProgressBar, QPushButton, QStatusBar,
                               QTextBrowser, QTreeWidget, QTreeWidgetItem)


@dataclass(frozen=True)
class ReferenceLoss:
    iterations: int
    none: int            # references to None lost (negative: gained, i.e. held by new objects)
    true: int
    false: int

    @property
    def worst(self) -> int:
        return max(self.none, self.true, self.false)


class _Signals(QObject):
    token = Signal(str)
    flag = Signal(bool)
    progress = Signal(str, object, object)
    done = Signal(object)
    bare = Signal()


def _counts() -> tuple[int, int, int]:
    return sys.getrefcount(None), sys.getrefcount(True), sys.getrefcount(False)


def reference_loss(iterations: int = 20_000) -> ReferenceLoss:
    """Run the app's kinds of Qt call `iterations` times (progress bars, labels, text appends and cursor
    moves, buttons enabled and disabled, the status bar, item-model and tree updates, signal emits with
    and without arguments, received by a slot) and count the references lost. Needs a QApplication."""
    if QApplication.instance() is None:
        raise RuntimeError("reference_loss needs a QApplication")
    bar, label, button, status = QProgressBar(), QLabel(), QPushButton("Send"), QStatusBar()
    browser, edit = QTextBrowser(), QPlainTextEdit()
    model = QStandardItemModel(0, 2)
    tree = QTreeWidget()
    tree.setColumnCount(2)
    item = QTreeWidgetItem(tree, ["model", "0"])
    sig = _Signals()
    received = []
    sig.token.connect(received.append)
    sig.flag.connect(button.setEnabled)
    sig.progress.connect(lambda s, d, t: bar.setValue(int(d)))
    sig.done.connect(lambda r: label.setText(str(r)))
    sig.bare.connect(lambda: None)
    # One round first: objects created on first use (caches, the slot wrappers) hold references that
    # are not losses.
    _round(0, bar, label, button, status, browser, edit, model, item, sig)
    received.clear()
    before = _counts()
    for i in range(iterations):
        _round(i, bar, label, button, status, browser, edit, model, item, sig)
        if len(received) > 256:
            received.clear()
            browser.clear()
            edit.clear()
            model.removeRows(0, model.rowCount())
    received.clear()
    after = _counts()
    for w in (bar, label, button, status, browser, edit, tree):
        w.deleteLater()
    return ReferenceLoss(iterations, *(b - a for b, a in zip(before, after)))


def _round(i, bar, label, button, status, browser, edit, model, item, sig) -> None:
    bar.setRange(0, 1000)
    bar.setValue(i % 1000)
    bar.setVisible(i % 2 == 0)
    label.setText(f"{i} tok/s")
    label.setToolTip("speed")
    button.setEnabled(i % 2 == 0)
    status.showMessage("Reading prompt", 100)
    cursor = browser.textCursor()
    cursor.movePosition(QTextCursor.MoveOperation.End)
    cursor.insertText("x")
    browser.setTextCursor(cursor)
    edit.appendPlainText("token")
    if i % 64 == 0:
        edit.setPlainText("")
    model.appendRow([QStandardItem(str(i)), QStandardItem("x")])
    item.setText(1, str(i))
    item.setToolTip(0, "tip")
    sig.token.emit("t")
    sig.flag.emit(i % 2 == 0)
    sig.progress.emit("prefill", i, 1000)
    sig.done.emit(None)
    sig.bare.emit()
