"""A chat tab's images: attaching them to the message being typed (button, paste, drop), refusing them
at once for a model that reads text only, keeping them with the chat when sent, showing them in the
transcript and sending them to the engine as engine.api.ImageInput content parts.

ChatView owns one ImagesPart (`view.images`) and calls it at the few places images matter; the rest of
the tab knows nothing of images."""
from __future__ import annotations

import html
from pathlib import Path

from PySide6.QtCore import QEvent, QObject, QUrl, Signal
from PySide6.QtGui import QImage, QTextCursor, QTextDocument
from PySide6.QtWidgets import QFileDialog, QPushButton, QWidget

from engine.api import ImageInput
from engine.vision.images import ImageRefused

from .chat_images import (IMAGE_SUFFIXES, MAX_ATTACHMENTS, THUMB_SIDE, Attachment, ChatImages,
                          attachment_from_file, attachment_from_qimage, is_image_file, message_images, thumbnail)
from .image_widgets import AttachmentRow, show_image
from .markdown_render import new_block
from .paths import AppPaths


def mime_image_files(mime) -> list[Path]:
    if mime is None or not mime.hasUrls():
        return []
    return [Path(u.toLocalFile()) for u in mime.urls() if u.isLocalFile() and is_image_file(Path(u.toLocalFile()))]


def mime_has_images(mime) -> bool:
    """A paste or drop that brings images (a picture on the clipboard, or image files)."""
    return mime is not None and (mime.hasImage() or bool(mime_image_files(mime)))


def text_only_reason(model_name: str) -> str:
    who = model_name or "The loaded model"
    return (f"{who} reads text only (no image projector, mmproj, was loaded with it): "
            "images cannot be sent to it")


class ImagesPart(QObject):
    """`chat_id()` names the chat the images are kept with; `store` is the data folder's images."""
    refused = Signal(str)          # an attachment or a send refused: the one-line reason

    def __init__(self, chat_id, store: ChatImages | None = None, parent: QWidget | None = None):
        super().__init__(parent)
        self.chat_id = chat_id
        self.store = store if store is not None else ChatImages(AppPaths.default().images_dir)
        self.vision: str | None = None     # the loaded model's projector (ModelFacts.vision); None: text only
        self.model_name = ""
        self.row = AttachmentRow()
        self.row.changed.connect(self._show_reason)
        self.button = QPushButton("Image…", toolTip="Attach images to the message (or paste them, or drop "
                                  "them on the chat)", clicked=self.attach_dialog)
        self.last_refusal = ""
        self._thumbs: dict[str, QImage] = {}

    # ---- the model -----------------------------------------------------------------------------
    def set_model(self, vision: str | None, model_name: str) -> None:
        self.vision, self.model_name = vision, model_name
        self._show_reason()

    def refusal(self, history: list[dict]) -> str:
        """Why the attached images (or the chat's earlier ones) cannot be sent now; "" when they can."""
        if self.vision is not None:
            return ""
        if self.row.items or any(message_images(m) for m in history):
            return text_only_reason(self.model_name)
        return ""

    def _show_reason(self) -> None:
        self.row.set_reason(text_only_reason(self.model_name) if self.vision is None else "")

    # ---- attaching -----------------------------------------------------------------------------
    def attach_dialog(self) -> None:
        pattern = " ".join(f"*{s}" for s in IMAGE_SUFFIXES)
        paths, _ = QFileDialog.getOpenFileNames(self.parent(), "Attach images", str(Path.home()),
                                                f"Images ({pattern})")
        self.attach_files([Path(p) for p in paths])

    def attach_files(self, paths: list[Path]) -> int:
        """Attach image files; each refusal is said (one line). Returns how many were attached."""
        n = 0
        for p in paths:
            n += self._attach(lambda p=p: attachment_from_file(p))
        return n

    def take_drops_on(self, widget: QWidget) -> None:
        """Images dropped anywhere on `widget` (the chat: its transcript, not only the message box) are
        attached; other drops (a session file, a model) go on to the widgets around it."""
        widget.setAcceptDrops(True)
        widget.installEventFilter(self)

    def eventFilter(self, obj: QObject, e: QEvent) -> bool:  # noqa: N802
        t = e.type()
        if t in (QEvent.Type.DragEnter, QEvent.Type.DragMove, QEvent.Type.Drop) and mime_has_images(e.mimeData()):
            e.acceptProposedAction()
            if t == QEvent.Type.Drop:
                self.attach_mime(e.mimeData())
            return True
        return super().eventFilter(obj, e)

    def attach_mime(self, mime) -> int:
        """A paste or a drop: the image files it names, else its picture."""
        files = mime_image_files(mime)
        if files:
            return self.attach_files(files)
        if mime.hasImage():
            image = mime.imageData()
            return self._attach(lambda: attachment_from_qimage(QImage(image)))
        return 0

    def _attach(self, make) -> int:
        if len(self.row.items) >= MAX_ATTACHMENTS:
            self._refuse(f"A message takes at most {MAX_ATTACHMENTS} images")
            return 0
        try:
            att = make()
        except ImageRefused as e:
            self._refuse(f"Not attached: {e}")
            return 0
        self.row.add(att)
        if self.vision is None:            # said at once, not at Send
            self._refuse(text_only_reason(self.model_name))
        return 1

    def _refuse(self, text: str) -> None:
        self.last_refusal = text
        self.refused.emit(text)

    # ---- sending -------------------------------------------------------------------------------
    def keep(self, attachments: list[Attachment]) -> list[dict]:
        """The attachments stored with the chat: their references for the message dict."""
        return [self.store.store(self.chat_id(), a) for a in attachments]

    def request_message(self, m: dict) -> dict:
        """A stored message as the engine reads it: with images, content is a list of parts (the
        images, then the text); an image whose file is gone becomes a line saying so."""
        refs = message_images(m)
        if not refs:
            return m
        parts: list[dict] = []
        for r in refs:
            name = str(r.get("name") or r.get("file"))
            try:
                parts.append({"type": "image", "image": ImageInput(self.store.read(self.chat_id(), r), name)})
            except (OSError, ValueError):
                parts.append({"type": "text", "text": f"[image not found: {name}]"})
        if m.get("content"):
            parts.append({"type": "text", "text": m["content"]})
        return {k: v for k, v in m.items() if k != "images"} | {"content": parts}

    def restore_for_edit(self, m: dict) -> None:
        """An edited message's images back in the row (sending the edit keeps them)."""
        items = []
        for r in message_images(m):
            try:
                items.append(self.store.attachment(self.chat_id(), r))
            except (OSError, ValueError):
                pass
        self.row.set_items(items)

    # ---- the transcript ------------------------------------------------------------------------
    def insert_thumbnails(self, cursor: QTextCursor, doc: QTextDocument, i: int, m: dict) -> None:
        """A sent message's images as thumbnails (a link each: click shows it whole)."""
        cells = []
        for j, r in enumerate(message_images(m)):
            thumb = self._thumb(r)
            if thumb is None:
                cells.append(f"<i>[image not found: {_esc(r.get('name') or r.get('file'))}]</i>")
                continue
            url = f"thumb:{j}:{r.get('digest', '')}"
            doc.addResource(QTextDocument.ResourceType.ImageResource, QUrl(url), thumb)
            cells.append(f'<a href="image:{i}:{j}"><img src="{url}" width="{thumb.width()}" '
                         f'height="{thumb.height()}"></a>')
        if cells:
            new_block(cursor)            # a line of their own: inserted HTML would join the header's line
            cursor.insertHtml(" &nbsp; ".join(cells))

    def _thumb(self, r: dict) -> QImage | None:
        key = str(r.get("digest") or r.get("file"))
        if key not in self._thumbs:
            try:
                self._thumbs[key] = thumbnail(self.store.read(self.chat_id(), r), str(r.get("digest", "")),
                                              THUMB_SIDE * 2)
            except (OSError, ValueError):
                return None
        return self._thumbs[key]

    def open_image(self, messages: list[dict], i: int, j: int):
        """Show image j of message i whole (the transcript's link)."""
        refs = message_images(messages[i]) if 0 <= i < len(messages) else []
        if not 0 <= j < len(refs):
            return None
        name = str(refs[j].get("name") or refs[j].get("file"))
        try:
            return show_image(self.store.read(self.chat_id(), refs[j]), name, str(refs[j].get("digest", "")),
                              self.parent())
        except OSError:
            self._refuse(f"{name}: the image file is gone from the data folder")
        except ValueError as e:                      # ImageRefused: the stored file was damaged since
            self._refuse(f"{name}: {e}")
        return None


def _esc(v) -> str:
    return html.escape(str(v))
