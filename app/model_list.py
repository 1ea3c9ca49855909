"""The left pane: models found in the models folder and the user's folders, with their metadata.

Columns fit their text, measured in each cell's own font (the loaded model's row is bold), whenever
the rows or that font change. Arch, Params and Context are hidden at first (in the row's tooltip;
the header's context menu shows them), so that Name, Quant, Size and Needs fit the pane uncut at a
window width of 1024 px; Name takes the width left."""
from __future__ import annotations

import logging
import os
import threading
from pathlib import Path
from typing import Callable

from PySide6.QtCore import Qt, Signal
from PySide6.QtGui import QAction, QFont, QFontMetrics
from PySide6.QtWidgets import (QFileDialog, QHBoxLayout, QHeaderView, QLabel, QMenu, QPushButton, QStyle,
                               QTreeWidget, QTreeWidgetItem, QVBoxLayout, QWidget)
from engine.model import memory_estimate as me
from engine.model import model_sources
from engine.memory.memory_guard import MemoryGuard

from .gguf_meta import ModelMeta
from .model_choices import AUTO, NONE, projector_label
from .model_scan import scan_models

COLUMNS = ("Name", "Arch", "Params", "Quant", "Size", "Context", "Needs", "Source")
NEEDS, SOURCE = COLUMNS.index("Needs"), COLUMNS.index("Source")
# in the row's tooltip; the header's menu shows them. Source shows itself once a model from anywhere but
# the models folder is listed (LM Studio, the Hugging Face cache, Ollama, a folder of the user's).
HIDDEN_AT_FIRST = ("Arch", "Params", "Context", "Source")
log = logging.getLogger("strata.app")


def memory_budget(engine_budget: dict | None):
    """The budget the engine reported in its status (on a Mac the Metal working set, which only MLX can
    read), or, before the engine has answered, the memory guard's available reading less its reserve."""
    if engine_budget:
        return me.Budget(int(engine_budget["bytes"]), str(engine_budget["source"]))
    return me.load_budget(MemoryGuard(), None)


class ModelList(QWidget):
    load_requested = Signal(str)
    projector_chosen = Signal(str, object)   # (model path, AUTO / NONE / a projector file): a row's menu
    _scanned = Signal(int, list)    # from the scanning thread (queued to _fill): (its number, the rows)
    scanned = Signal()              # the list is filled: emitted on the GUI thread, for listeners and tests
    # The first scan shows the models folder's and the user's folders' models first (own_scanned), then
    # every library's too (scanned): the first model loads without waiting on another app's library
    _own = Signal(int, list)
    own_scanned = Signal()

    def __init__(self, folders, parent: QWidget | None = None, libraries: Callable[[], bool] = lambda: True,
                 projector: Callable[[str], str | None] = lambda _path: AUTO):
        """`folders()` returns the folders to scan (models folder first); `libraries()` whether to look
        in the other apps' libraries too (engine/model/model_sources.py); `projector(path)` a model's
        image projector choice (app/model_choices.py), shown in its row's menu."""
        super().__init__(parent)
        self.folders = folders
        self.libraries = libraries
        self.projector = projector
        self.current: str = ""
        self.errors: dict[str, str] = {}            # path -> why that listed file cannot be loaded
        self.sources: dict[str, str] = {}           # path -> where it lives (engine/model/model_sources.py)
        self.too_big: set[str] = set()              # paths whose estimate does not fit in memory
        # path -> the file it reaches, resolved on the scanning thread (model_scan): the window's thread
        # never waits on a listed folder (a library on a network volume that stopped answering)
        self.real: dict[str, str] = {}
        self.engine_budget: dict | None = None     # the engine's status["load_budget"], once known
        self.tree = QTreeWidget(rootIsDecorated=False, alternatingRowColors=True)
        self.tree.setHeaderLabels(COLUMNS)
        header = self.tree.header()
        header.setStretchLastSection(False)
        header.setSectionResizeMode(QHeaderView.ResizeMode.Fixed)
        header.setSectionResizeMode(0, QHeaderView.ResizeMode.Stretch)      # Name: the width left
        header.setContextMenuPolicy(Qt.ContextMenuPolicy.ActionsContextMenu)
        self.show_actions: dict[str, QAction] = {}
        for c, name in enumerate(COLUMNS[1:], 1):
            show = QAction(f"Show {name}", header, checkable=True, checked=name not in HIDDEN_AT_FIRST)
            show.toggled.connect(lambda on, c=c: (self.tree.setColumnHidden(c, not on), self.fit_columns()))
            header.addAction(show)
            self.show_actions[name] = show
            self.tree.setColumnHidden(c, name in HIDDEN_AT_FIRST)
        self.tree.itemDoubleClicked.connect(lambda it, _c: self.load_requested.emit(it.data(0, Qt.ItemDataRole.UserRole)))
        self.tree.setContextMenuPolicy(Qt.ContextMenuPolicy.CustomContextMenu)
        self.tree.customContextMenuRequested.connect(self._row_menu)
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
        self._own.connect(self._fill_own)
        self._scans = 0                 # refreshes started; a scan that ends after a newer one is dropped
        self._filled = False            # a whole scan (libraries too) has filled the list

    def refresh(self) -> None:
        folders = [Path(f) for f in self.folders()]
        engine_budget = self.engine_budget
        own_first = not self._filled
        look_in_libraries = self.libraries()
        self._scans += 1
        number = self._scans

        def scan():
            try:
                budget = memory_budget(engine_budget)       # one memory reading for the whole list
            except Exception as e:  # noqa: BLE001 -- no reading: the estimates say "unknown"
                log.warning("model list: no memory reading: %s", e)
                budget = None
            libraries = model_sources.library_roots() if look_in_libraries else []
            try:
                if own_first and libraries:
                    self._own.emit(number, scan_models(folders, budget))
                self._scanned.emit(number, scan_models(folders, budget, libraries=libraries))
            except RuntimeError:        # the list was closed while its folder was read: nothing to fill
                log.info("model list: a scan ended after its list was closed")
        threading.Thread(target=scan, name="strata-model-scan", daemon=True).start()

    def _fill_own(self, number: int, metas: list[tuple[ModelMeta, tuple[str, str]]]) -> None:
        if number == self._scans:
            self._show(metas)
            self.own_scanned.emit()

    def _fill(self, number: int, metas: list[tuple[ModelMeta, tuple[str, str]]]) -> None:
        if number != self._scans:
            # Scans run on their own threads and can end out of order (a big folder read while a file
            # is added): the folder as an older scan saw it must not replace what a newer one will show.
            return
        self._show(metas)
        self._filled = True
        self.empty.setVisible(not metas)
        self.scanned.emit()

    def _show(self, metas: list[tuple[ModelMeta, tuple[str, str]]]) -> None:
        self.tree.clear()
        self.real = {m.path: m.real for m, _ in metas if m.real}
        self.errors = {m.path: m.error for m, _ in metas if m.error}
        self.sources = {m.path: m.source for m, _ in metas}
        self.too_big = {m.path for m, (needs, _) in metas if needs.endswith("(too big)")}
        for m, (needs, needs_tip) in metas:
            where = f"\n{m.where()}" if m.source else ""
            if m.error:         # listed with its reason (the name column has the width left)
                it = QTreeWidgetItem([f"{m.name} — cannot be loaded", "?", "?", "?", m.size_label(), "?",
                                      "—", m.where()])
                it.setForeground(0, self.palette().brush(self.palette().ColorGroup.Disabled,
                                                         self.palette().ColorRole.Text))
                about = f"{m.path}{where}\n{m.error}"
                needs_tip = m.error
            else:
                it = QTreeWidgetItem([m.name, m.architecture, m.params_label(), m.quantization, m.size_label(),
                                      str(m.context_length or "?"), needs, m.where()])
                parts = f" · {m.parts} files" if m.parts > 1 else ""
                extra = f"\n{m.companions}" if m.companions else ""
                about = (f"{m.name}\n{m.architecture} · {m.params_label()} parameters · {m.quantization} · "
                         f"context {m.context_length or '?'} tokens{parts}{where}\n{m.file_bpw:.2f} bits per weight in the "
                         f"file, {m.held_bpw:.2f} as held in memory\n{m.path}{extra}")
            it.setData(0, Qt.ItemDataRole.UserRole, m.path)
            for c in range(len(COLUMNS)):
                it.setToolTip(c, about)
            it.setToolTip(NEEDS, needs_tip)
            self.tree.addTopLevelItem(it)
        self.mark_current(self.current)            # fits the columns to the fonts it sets
        if any(m.source not in ("", model_sources.STRATA) for m, _ in metas):
            self.show_actions["Source"].setChecked(True)     # models from elsewhere: say where each lives

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

    def first_choices(self) -> list[str]:
        """What to load when the settings name no model: the models of Strata's folder and the user's,
        then those found in another app's library that fit in memory (never a library's first model
        just because it sorts first, whatever its size)."""
        own = (model_sources.STRATA, model_sources.FOLDER, "")
        loadable = self.loadable_paths()
        return ([p for p in loadable if self.sources.get(p, "") in own] +
                [p for p in loadable if self.sources.get(p, "") not in own and p not in self.too_big])

    def mark_current(self, path: str) -> None:
        self.current = path
        # the loaded model's file was just read by the engine: resolving it here does not wait on a
        # dead volume; the rows' were resolved on the scanning thread
        target = (self.real.get(path) or os.path.realpath(path)) if path else ""
        for i in range(self.tree.topLevelItemCount()):
            it = self.tree.topLevelItem(i)
            f = QFont(it.font(0))
            row = it.data(0, Qt.ItemDataRole.UserRole)
            on = bool(path) and self.real.get(row, row) == target
            f.setBold(on)
            for c in range(len(COLUMNS)):
                it.setFont(c, f)
        self.fit_columns()

    def row_menu(self, path: str) -> QMenu:
        """A row's menu: Load, and the image projector it loads with (checked: the current choice)."""
        menu = QMenu(self)
        menu.addAction("Load", lambda: self.load_requested.emit(path)).setEnabled(path not in self.errors)
        sub = menu.addMenu("Image projector")
        sub.setToolTipsVisible(True)
        chosen = self.projector(path)
        for label, choice in (("Automatic", AUTO), ("None (text only)", NONE)):
            act = sub.addAction(label, lambda c=choice: self.projector_chosen.emit(path, c))
            act.setCheckable(True)
            act.setChecked(chosen == choice)
            act.setToolTip(projector_label(choice))
        other = sub.addAction("Choose file…", lambda: self._pick_projector(path))
        other.setCheckable(True)
        if chosen not in (AUTO, NONE):
            other.setChecked(True)
            other.setText(f"File: {Path(chosen).name}")
            other.setToolTip(chosen)
        return menu

    def _row_menu(self, pos) -> None:
        it = self.tree.itemAt(pos)
        if it is not None:
            self.row_menu(it.data(0, Qt.ItemDataRole.UserRole)).exec(self.tree.viewport().mapToGlobal(pos))

    def _pick_projector(self, path: str) -> None:
        got, _ = QFileDialog.getOpenFileName(self, "Image projector (mmproj) for " + Path(path).name,
                                             str(Path(path).parent), "GGUF image projector (*.gguf)")
        if got:
            self.projector_chosen.emit(path, got)

    def _load_selected(self) -> None:
        it = self.tree.currentItem()
        if it is not None:
            self.load_requested.emit(it.data(0, Qt.ItemDataRole.UserRole))
