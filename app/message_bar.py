"""The line at the top of the window for things a person must read."""
from __future__ import annotations

from PySide6.QtCore import Qt
from PySide6.QtWidgets import QHBoxLayout, QLabel, QPushButton, QWidget


class MessageBar(QWidget):
    """A dismissable line at the top of the window for things a person must read (refusals, moves),
    optionally with one action button (e.g. "Load this vector")."""

    def __init__(self, parent=None):
        super().__init__(parent)
        self.label = QLabel(wordWrap=True, textInteractionFlags=Qt.TextInteractionFlag.TextSelectableByMouse)
        self.action = QPushButton(visible=False)
        self._action_slot = None
        self.action.clicked.connect(self._on_action)
        close = QPushButton("Dismiss", clicked=self.hide)
        lay = QHBoxLayout(self)
        lay.setContentsMargins(8, 4, 8, 4)
        lay.addWidget(self.label, 1)
        lay.addWidget(self.action)
        lay.addWidget(close)
        self.setAutoFillBackground(True)
        self.setBackgroundRole(self.palette().ColorRole.ToolTipBase)
        self.label.setForegroundRole(self.palette().ColorRole.ToolTipText)
        self.hide()

    def show_message(self, text: str, action: str = "", slot=None) -> None:
        self.label.setText(text)
        self._action_slot = slot if action else None
        self.action.setText(action)
        self.action.setVisible(bool(action and slot))
        self.show()

    def _on_action(self) -> None:
        slot, self._action_slot = self._action_slot, None
        self.hide()
        if slot is not None:
            slot()

    def withdraw(self, start: str) -> None:
        """Hide the line shown if it starts with `start` (what it said is over); another line stays."""
        if not self.isHidden() and self.label.text().startswith(start):
            self._action_slot = None
            self.hide()

    def text(self) -> str:
        return "" if self.isHidden() else self.label.text()
