"""The widgets of images in the chat: the row of attachments above the message box (thumbnails, each
removable, and the line saying why they cannot be sent), and the dialog that shows an image whole."""
from __future__ import annotations

from PySide6.QtCore import QSize, Qt, Signal
from PySide6.QtGui import QGuiApplication, QIcon, QImage, QPixmap
from PySide6.QtWidgets import (QDialog, QDialogButtonBox, QHBoxLayout, QLabel, QScrollArea, QToolButton,
                               QVBoxLayout, QWidget)

from .chat_images import THUMB_SIDE, Attachment, full_image, thumbnail


class AttachmentRow(QWidget):
    """The images attached to the message being typed. `changed` fires when one comes or goes."""
    changed = Signal()

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.items: list[Attachment] = []
        self._thumbs = QHBoxLayout()
        self._thumbs.setContentsMargins(0, 0, 0, 0)
        self.reason = QLabel(wordWrap=True, visible=False)     # why these cannot be sent (a text-only model)
        self.reason.setForegroundRole(self.palette().ColorRole.BrightText)
        lay = QVBoxLayout(self)
        lay.setContentsMargins(0, 0, 0, 0)
        lay.addLayout(self._thumbs)
        lay.addWidget(self.reason)
        self.setVisible(False)

    def add(self, att: Attachment) -> None:
        self.items.append(att)
        self._rebuild()

    def remove(self, index: int) -> None:
        if 0 <= index < len(self.items):
            del self.items[index]
            self._rebuild()

    def take(self) -> list[Attachment]:
        """The attachments, the row emptied (they were sent)."""
        items, self.items = self.items, []
        self._rebuild()
        return items

    def set_items(self, items: list[Attachment]) -> None:
        self.items = list(items)
        self._rebuild()

    def set_reason(self, text: str) -> None:
        self.reason.setText(text)
        self.reason.setVisible(bool(text) and bool(self.items))

    def _rebuild(self) -> None:
        while self._thumbs.count():
            w = self._thumbs.takeAt(0).widget()
            if w is not None:
                w.deleteLater()
        for i, att in enumerate(self.items):
            self._thumbs.addWidget(self._item(i, att))
        self._thumbs.addStretch(1)
        self.reason.setVisible(bool(self.reason.text()) and bool(self.items))
        self.setVisible(bool(self.items))
        self.changed.emit()

    def _item(self, i: int, att: Attachment) -> QWidget:
        box = QWidget()
        lay = QVBoxLayout(box)
        lay.setContentsMargins(0, 0, 0, 0)
        lay.setSpacing(0)
        pic = QToolButton(toolTip=f"{att.name} ({att.width}x{att.height})", autoRaise=True)
        pic.setIcon(QIcon(QPixmap.fromImage(thumbnail(att.data, att.digest, THUMB_SIDE // 2 * 2))))
        pic.setIconSize(QSize(THUMB_SIDE // 2 * 2, THUMB_SIDE // 2 * 2))
        pic.clicked.connect(lambda _=False, a=att: show_image(a.data, a.name, a.digest, self))
        drop = QToolButton(text="Remove", toolTip=f"Remove {att.name}", autoRaise=True)
        drop.setObjectName(f"remove-image-{i}")
        drop.clicked.connect(lambda _=False, n=i: self.remove(n))
        lay.addWidget(pic)
        lay.addWidget(drop, 0, Qt.AlignmentFlag.AlignHCenter)
        return box


class ImageDialog(QDialog):
    """An image whole, scaled down to fit the screen when larger, scrollable at full size otherwise."""

    def __init__(self, image: QImage, title: str, parent: QWidget | None = None):
        super().__init__(parent, windowTitle=title)
        self.label = QLabel(alignment=Qt.AlignmentFlag.AlignCenter)
        screen = QGuiApplication.primaryScreen()
        room = screen.availableSize() * 0.85 if screen is not None else QSize(1200, 900)
        pix = QPixmap.fromImage(image)
        if pix.width() > room.width() or pix.height() > room.height():
            pix = pix.scaled(room, Qt.AspectRatioMode.KeepAspectRatio, Qt.TransformationMode.SmoothTransformation)
        self.label.setPixmap(pix)
        area = QScrollArea(widgetResizable=True)
        area.setWidget(self.label)
        buttons = QDialogButtonBox(QDialogButtonBox.StandardButton.Close, rejected=self.reject)
        lay = QVBoxLayout(self)
        lay.addWidget(area, 1)
        lay.addWidget(buttons)
        self.resize(min(pix.width() + 40, room.width()), min(pix.height() + 80, room.height()))


def show_image(data: bytes, name: str, digest: str = "", parent: QWidget | None = None) -> ImageDialog:
    dialog = ImageDialog(full_image(data, digest), name, parent)
    dialog.setAttribute(Qt.WidgetAttribute.WA_DeleteOnClose)
    dialog.open()
    return dialog
