"""The left pane: models found in the models folder and the user's folders, with their metadata.

Columns fit their text, measured in each cell's own font (the loaded model's row is bold), whenever
the rows or that font change. Arch, Params and Context are hidden at first (in the row's tooltip;
the header's context menu shows them), so that Name, Quant, Size and Needs fit the pane uncut at a
window width of 1024 px; Name takes the width left."""
from __future__ import annotations

import logging
import threading
from pathlib import Path

from PySide6.QtCore import Qt, Signal
from PySide6.QtGui import QAction, QFont, QFontMetrics
from PySide6.QtWidgets import (QHBoxLayout, QHeaderView, QLabel, QPushButton, QStyle, QTreeWidget,
                               QTreeWidgetItem, QVBoxLayout, QWidget)
from engine import memory_estimate as me
from engine.memory_guard import MemoryGuard

from .gguf_meta import ModelMeta
from .model_scan import scan_models

COLUMNS = ("Name", "Arch", "Params", "Quant", "Size", "Context", "Needs")
HIDDEN_AT_FIRST = ("Arch", "Params", "Context")    # in the row's tooltip; the header's menu shows them
log = logging.getLogger("strata.app")


def memory_budget(engine_budget: dict | None):
    """The budget the engine reported in its status (on a Mac the Metal working set, which only MLX can
    read), or, before the engine has answered, the memory guard's available reading less its reserve."""
    if engine_budget:
        return me.Budget(int(engine_budget["bytes"]), str(engine_budget["source"]))
    return me.load_budget(MemoryGuard(), None)


class ModelList(QWidget):
    load_requested = Signal(str)
    _scanned = Signal(int, list)    # from the scanning thread (queued to _fill): (its number, the rows)
    scanned = Signal()              # the list is filled: emitted on the GUI thread, for listeners and tests

    def __init__(self, folders, parent: QWidget | None = None):
        """`folders()` returns the folders to scan (models folder first)."""
        super().__init__(parent)
        self.folders = folders
        self.current: str = ""
        self.errors: dict[str, str] = {}            # path -> why that listed file cannot be loaded
        self.engine_budget: dict | None = None     # the engine's status["load_budget"], once known
        self.tree = QTreeWidget(rootIsDecorated=False, alternatingRowColors=True)
        self.tree.setHeaderLabels(COLUMNS)
        header = self.tree.header()
        header.setStretchLastSection(False)
        header.setSectionResizeMode(QHeaderView.ResizeMode.Fixed)
        header.setSectionResizeMode(0, QHeaderView.ResizeMode.Stretch)      # Name: the width left
        header.setContextMenuPolicy(Qt.ContextMenuPolicy.ActionsContextMenu)
        for c, name in enumerate(COLUMNS[1:], 1):
            show = QAction(f"Show {name}", header, checkable=True, checked=name not in HIDDEN_AT_FIRST)
            show.toggled.connect(lambda on, c=c: (self.tree.setColumnHidden(c, not on), self.fit_columns()))
            header.addAction(show)
            self.tree.setColumnHidden(c, name in HIDDEN_AT_FIRST)
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
        self._scans = 0                 # refreshes started; a scan that ends after a newer one is dropped

    def refresh(self) -> None:
        folders = [Path(f) for f in self.folders()]
        engine_budget = self.engine_budget
        self._scans += 1
        number = self._scans

        def scan():
            try:
                budget = memory_budget(engine_budget)       # one memory reading for the whole list
            except Exception as e:  # noqa: BLE001 -- no reading: the estimates say "unknown"
                log.warning("model list: no memory reading: %s", e)
                budget = None
            rows = scan_models(folders, budget)
            try:
                self._scanned.emit(number, rows)
            except RuntimeError:        # the list was closed while its folder was read: nothing to fill
                log.info("model list: a scan ended after its list was closed")
        threading.Thread(target=scan, name="strata-model-scan", daemon=True).start()

    def _fill(self, number: int, metas: list[tuple[ModelMeta, tuple[str, str]]]) -> None:
        if number != self._scans:
            # Scans run on their own threads and can end out of order (a big folder read while a file
            # is added): the folder as an older scan saw it must not replace what a newer one will show.
            return
        self.tree.clear()
        self.errors = {m.path: m.error for m, _ in metas if m.error}
        for m, (needs, needs_tip) in metas:
            if m.error:         # listed with its reason (the name column has the width left)
                it = QTreeWidgetItem([f"{m.name} — cannot be loaded", "?", "?", "?", m.size_label(), "?",
                                      "—"])
                it.setForeground(0, self.palette().brush(self.palette().ColorGroup.Disabled,
                                                         self.palette().ColorRole.Text))
                about = f"{m.path}\n{m.error}"
                needs_tip = m.error
            else:
                it = QTreeWidgetItem([m.name, m.architecture, m.params_label(), m.quant_label(), m.size_label(),
                                      str(m.context_length or "?"), needs])
                about = (f"{m.name}\n{m.architecture} · {m.params_label()} parameters · {m.quantization} · "
                         f"context {m.context_length or '?'} tokens\n{m.file_bpw:.2f} bits per weight in the "
                         f"file, {m.held_bpw:.2f} as held in memory\n{m.path}")
            it.setData(0, Qt.ItemDataRole.UserRole, m.path)
            for c in range(len(COLUMNS) - 1):
                it.setToolTip(c, about)
            it.setToolTip(len(COLUMNS) - 1, needs_tip)
            self.tree.addTopLevelItem(it)
        self.empty.setVisible(not metas)
        self.mark_current(self.current)            # fits the columns to the fonts it sets
        self.scanned.emit()

    def column_text_width(self, c: int) -> int:
        """The width column `c` needs to show its header and every cell's text uncut (each in its font)."""
        style = self.tree.style()
        pad = 2 * (style.pixelMetric(QStyle.PixelMetric.PM_FocusFrameHMargin, None, self.tree) + 1)
        head = self.tree.header()
        need = (QFontMetrics(head.font()).horizontalAdvance(COLUMNS[c])
                + 2 * style.pixelMetric(QStyle.PixelMetric.PM_HeaderMargin, None, head))
        for i in range(self.tree.topLevelItemCount()):
            it = self.tree.topLevelItem(i)
            need = max(need, QFontMetrics(it.font(c)).horizontalAdvance(it.text(c)) + pad)
        return need + 4

    def fit_columns(self) -> None:
        """Every column but Name as wide as its text needs (Name stretches over the width left)."""
        for c in range(1, len(COLUMNS)):
            if not self.tree.isColumnHidden(c):
                self.tree.setColumnWidth(c, self.column_text_width(c))

    def paths(self) -> list[str]:
        return [self.tree.topLevelItem(i).data(0, Qt.ItemDataRole.UserRole) for i in range(self.tree.topLevelItemCount())]

    def loadable_paths(self) -> list[str]:
        """The listed files whose header was read (the others' rows say why not)."""
        return [p for p in self.paths() if p not in self.errors]

    def mark_current(self, path: str) -> None:
        self.current = path
        for i in range(self.tree.topLevelItemCount()):
            it = self.tree.topLevelItem(i)
            f = QFont(it.font(0))
            on = bool(path) and Path(it.data(0, Qt.ItemDataRole.UserRole)).resolve() == Path(path).resolve()
            f.setBold(on)
            for c in range(len(COLUMNS)):
                it.setFont(c, f)
        self.fit_columns()

    def _load_selected(self) -> None:
        it = self.tree.currentItem()
        if it is not None:
            self.load_requested.emit(it.data(0, Qt.ItemDataRole.UserRole))
