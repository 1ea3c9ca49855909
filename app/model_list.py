"""The left pane: models found in the models folder and the user's folders, with their metadata."""
from __future__ import annotations

import threading
from pathlib import Path

from PySide6.QtCore import Qt, Signal
from PySide6.QtGui import QFont
from PySide6.QtWidgets import (QHBoxLayout, QLabel, QPushButton, QTreeWidget, QTreeWidgetItem, QVBoxLayout,
                               QWidget)

from .gguf_meta import ModelMeta, read_meta

COLUMNS = ("Name", "Arch", "Params", "Quant", "Size", "Context", "Needs")


def memory_budget(engine_budget: dict | None):
    """The budget the engine reported in its status (on a Mac the Metal working set, which only MLX can
    read), or, before the engine has answered, the memory guard's available reading less its reserve."""
    from engine import memory_estimate as me
    from engine.memory_guard import MemoryGuard
    if engine_budget:
        return me.Budget(int(engine_budget["bytes"]), str(engine_budget["source"]))
    return me.load_budget(MemoryGuard(), None)


def memory_needs(path: Path, budget) -> tuple[str, str]:
    """(column text, tooltip) of the memory estimate at the engine's default context
    (engine/memory_estimate.py: plain Python, no mlx) against `budget` (memory_budget)."""
    from engine import memory_estimate as me
    from engine.errors import StrataError
    try:
        h = me.read_header(path)
        fit = me.check_fit(h, me.default_context(h), me.platform_dtype(), budget)
    except StrataError as e:
        return "?", str(e)
    text = me.gib(fit.estimate.total_bytes)
    return (text if fit.fits else f"{text} (too big)"), fit.line()


def find_models(folders: list[Path]) -> list[Path]:
    seen, out = set(), []
    for d in folders:
        if d.is_dir():
            for p in sorted(d.glob("*.gguf")):
                r = p.resolve()
                if r not in seen:
                    seen.add(r)
                    out.append(p)
    return out


class ModelList(QWidget):
    load_requested = Signal(str)
    _scanned = Signal(list)         # from the scanning thread (queued to _fill)
    scanned = Signal()              # the list is filled: emitted on the GUI thread, for listeners and tests

    def __init__(self, folders, parent: QWidget | None = None):
        """`folders()` returns the folders to scan (models folder first)."""
        super().__init__(parent)
        self.folders = folders
        self.current: str = ""
        self.engine_budget: dict | None = None     # the engine's status["load_budget"], once known
        self.tree = QTreeWidget(rootIsDecorated=False, alternatingRowColors=True)
        self.tree.setHeaderLabels(COLUMNS)
        self.tree.itemDoubleClicked.connect(lambda it, _c: self.load_requested.emit(it.data(0, Qt.ItemDataRole.UserRole)))
        self.load_btn = QPushButton("Load", clicked=self._load_selected)
        self.refresh_btn = QPushButton("Refresh", clicked=self.refresh)
        self.empty = QLabel("No models yet. Drop a .gguf file here, add a folder in Settings, "
                            "or fetch the default model.", wordWrap=True)
        title = QLabel("<b>Models</b>")
        row = QHBoxLayout()
        row.addWidget(title)
        row.addStretch(1)
        row.addWidget(self.refresh_btn)
        row.addWidget(self.load_btn)
        lay = QVBoxLayout(self)
        lay.setContentsMargins(6, 6, 0, 6)
        lay.addLayout(row)
        lay.addWidget(self.tree, 1)
        lay.addWidget(self.empty)
        self._scanned.connect(self._fill)

    def refresh(self) -> None:
        folders = [Path(f) for f in self.folders()]
        engine_budget = self.engine_budget

        def scan():
            budget = memory_budget(engine_budget)           # one memory reading for the whole list
            self._scanned.emit([(read_meta(p), memory_needs(p, budget)) for p in find_models(folders)])
        threading.Thread(target=scan, name="strata-model-scan", daemon=True).start()

    def _fill(self, metas: list[tuple[ModelMeta, tuple[str, str]]]) -> None:
        self.tree.clear()
        for m, (needs, needs_tip) in metas:
            it = QTreeWidgetItem([m.name, m.architecture, m.params_label(), m.quantization, m.size_label(),
                                  str(m.context_length or "?"), needs])
            it.setData(0, Qt.ItemDataRole.UserRole, m.path)
            it.setToolTip(0, m.path + (f"\n{m.error}" if m.error else ""))
            it.setToolTip(len(COLUMNS) - 1, needs_tip)
            self.tree.addTopLevelItem(it)
        for c in range(len(COLUMNS)):
            self.tree.resizeColumnToContents(c)
        self.tree.setColumnWidth(0, min(self.tree.columnWidth(0), 170))
        self.empty.setVisible(not metas)
        self.mark_current(self.current)
        self.scanned.emit()

    def paths(self) -> list[str]:
        return [self.tree.topLevelItem(i).data(0, Qt.ItemDataRole.UserRole) for i in range(self.tree.topLevelItemCount())]

    def mark_current(self, path: str) -> None:
        self.current = path
        for i in range(self.tree.topLevelItemCount()):
            it = self.tree.topLevelItem(i)
            f = QFont(it.font(0))
            on = bool(path) and Path(it.data(0, Qt.ItemDataRole.UserRole)).resolve() == Path(path).resolve()
            f.setBold(on)
            for c in range(len(COLUMNS)):
                it.setFont(c, f)

    def _load_selected(self) -> None:
        it = self.tree.currentItem()
        if it is not None:
            self.load_requested.emit(it.data(0, Qt.ItemDataRole.UserRole))
