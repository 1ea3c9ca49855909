"""Images in the chat: checked when attached, kept with the chat in the data folder, read back to send.

An attachment is checked at once with engine.vision.images.decode_image (Pillow, bounded by the declared size
before decoding, no MLX), so a damaged file or a bomb is refused when it is attached, not when the
model reads it. A sent message keeps its images as files under `images/<chat id>/<digest><ext>` in the
data folder (the digest names the decoded pixels: the same picture attached twice is one file), and
references them from the message dict: `images: [{"file", "name", "digest", "width", "height"}]`.
A chat's folder goes when the chat is deleted for good (after its Undo), and a deleted chat's folder
the app closed before removing is swept at the next start.
"""
from __future__ import annotations

import os
import re
import shutil
import tempfile
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image
from PySide6.QtCore import QBuffer, QByteArray, QIODevice
from PySide6.QtGui import QImage

from engine.vision.images import MAX_IMAGE_BYTES, DecodedImage, ImageRefused, decode_image

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".gif", ".webp", ".bmp", ".tif", ".tiff")
MAX_ATTACHMENTS = 8            # a message's images (the server's bound on a request too)
THUMB_SIDE = 96
_EXT = {"PNG": ".png", "JPEG": ".jpg", "GIF": ".gif", "WEBP": ".webp", "BMP": ".bmp", "TIFF": ".tif"}
_CHAT_ID = re.compile(r"[0-9A-Za-z_-]{1,64}")


@dataclass(frozen=True)
class Attachment:
    """An image checked and ready to send: the file's bytes as given, what decode_image saw."""
    data: bytes
    name: str
    digest: str
    width: int
    height: int
    ext: str


def is_image_file(path: Path) -> bool:
    return path.suffix.lower() in IMAGE_SUFFIXES


def attachment_from_bytes(data: bytes, name: str) -> Attachment:
    """The image checked (ImageRefused with the one-line reason, the name first)."""
    try:
        img = decode_image(data)
    except ImageRefused as e:
        raise ImageRefused(f"{name}: {e}") from None
    _remember(img)
    return Attachment(bytes(data), name, img.digest, img.width, img.height, _EXT.get(img.format, ".img"))


def attachment_from_file(path: Path) -> Attachment:
    """A file on disk, its size checked before it is read."""
    path = Path(path)
    try:
        size = path.stat().st_size
        if size > MAX_IMAGE_BYTES:
            raise ImageRefused(f"{path.name}: the image is {size / 2**20:.1f} MiB; at most "
                               f"{MAX_IMAGE_BYTES / 2**20:.0f} MiB is read")
        data = path.read_bytes()
    except OSError as e:
        raise ImageRefused(f"{path.name}: the file cannot be read ({e.strerror or e})") from None
    return attachment_from_bytes(data, path.name)


def attachment_from_qimage(image: QImage, name: str = "pasted image.png") -> Attachment:
    """A picture from the clipboard (no file behind it), kept as PNG."""
    if image.isNull():
        raise ImageRefused(f"{name}: the clipboard's image is empty")
    buf = QByteArray()
    dev = QBuffer(buf)
    dev.open(QIODevice.OpenModeFlag.WriteOnly)
    image.save(dev, "PNG")
    dev.close()
    return attachment_from_bytes(bytes(buf.data()), name)


# ---- pixels for the screen ---------------------------------------------------------------------
_DECODED: OrderedDict[str, DecodedImage] = OrderedDict()     # digest -> pixels, a few recent ones
_DECODED_MAX = 4


def _remember(img: DecodedImage) -> None:
    _DECODED[img.digest] = img
    _DECODED.move_to_end(img.digest)
    while len(_DECODED) > _DECODED_MAX:
        _DECODED.popitem(last=False)


def _decoded(data: bytes, digest: str = "") -> DecodedImage:
    got = _DECODED.get(digest) if digest else None
    if got is None:
        got = decode_image(data)
        _remember(got)
    return got


def to_qimage(rgb: np.ndarray) -> QImage:
    h, w = rgb.shape[:2]
    rgb = np.ascontiguousarray(rgb)
    return QImage(rgb.data, w, h, 3 * w, QImage.Format.Format_RGB888).copy()


def thumbnail(data: bytes, digest: str = "", side: int = THUMB_SIDE) -> QImage:
    """The picture upright (EXIF) as decode_image reads it, fitted in side x side."""
    im = Image.fromarray(_decoded(data, digest).rgb)
    im.thumbnail((side, side))
    return to_qimage(np.asarray(im))


def full_image(data: bytes, digest: str = "") -> QImage:
    return to_qimage(_decoded(data, digest).rgb)


# ---- the data folder ---------------------------------------------------------------------------
class ChatImages:
    """The images of every chat under `root` (the data folder's images/)."""

    def __init__(self, root: Path):
        self.root = Path(root)

    def folder(self, chat_id: str) -> Path:
        if not _CHAT_ID.fullmatch(chat_id or ""):
            raise ValueError(f"not a chat id: {chat_id!r}")
        return self.root / chat_id

    def store(self, chat_id: str, att: Attachment) -> dict:
        """Keep the attachment with the chat (once per picture); its reference for the message dict."""
        folder = self.folder(chat_id)
        folder.mkdir(parents=True, exist_ok=True)
        name = att.digest[:32] + att.ext
        dest = folder / name
        if not dest.exists():
            fd, tmp = tempfile.mkstemp(prefix=".strata-image-", dir=folder)
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(att.data)
                os.replace(tmp, dest)
            except BaseException:
                Path(tmp).unlink(missing_ok=True)
                raise
        return {"file": name, "name": att.name, "digest": att.digest, "width": att.width, "height": att.height}

    def path(self, chat_id: str, ref: dict) -> Path:
        name = Path(str(ref.get("file", ""))).name          # a name, never a path out of the folder
        return self.folder(chat_id) / name

    def read(self, chat_id: str, ref: dict) -> bytes:
        """The stored file's bytes (OSError when it is gone)."""
        return self.path(chat_id, ref).read_bytes()

    def attachment(self, chat_id: str, ref: dict) -> Attachment:
        """A stored image as an attachment again (an edited message's images back in the input)."""
        data = self.read(chat_id, ref)
        ext = Path(str(ref.get("file", ""))).suffix or ".img"
        return Attachment(data, str(ref.get("name") or ref.get("file")), str(ref.get("digest", "")),
                          int(ref.get("width", 0)), int(ref.get("height", 0)), ext)

    def copy_chat(self, src_id: str, dest_id: str, messages: list[dict]) -> int:
        """The image files `messages` name, from chat `src_id`'s folder into `dest_id`'s (a fork: its
        copied messages name them, and the parent's go when the parent is deleted); a file already gone
        stays gone. How many were copied."""
        n = 0
        for ref in (r for m in messages for r in message_images(m)):
            src, dest = self.path(src_id, ref), self.path(dest_id, ref)
            if dest.exists() or not src.is_file():
                continue
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src, dest)
            n += 1
        return n

    def remove_chat(self, chat_id: str) -> None:
        try:
            shutil.rmtree(self.folder(chat_id), ignore_errors=True)
        except ValueError:
            pass

    # A deleted chat's folder is marked first and removed once its Undo is over; a mark left by an app
    # that closed meanwhile is swept at the next start. Only marked folders are ever swept: a chat
    # database that failed to open (no chats listed) must not cost every chat its images.
    DELETED_MARK = ".deleted"

    def mark_deleted(self, chat_id: str) -> None:
        folder = self.folder(chat_id)
        if folder.is_dir():
            (folder / self.DELETED_MARK).touch()

    def unmark(self, chat_id: str) -> None:
        (self.folder(chat_id) / self.DELETED_MARK).unlink(missing_ok=True)

    def sweep(self, exists) -> list[str]:
        """Remove the marked folders of chats `exists(id)` denies; their ids."""
        if not self.root.is_dir():
            return []
        gone = [p.name for p in self.root.iterdir()
                if (p / self.DELETED_MARK).is_file() and _CHAT_ID.fullmatch(p.name) and not exists(p.name)]
        for name in gone:
            shutil.rmtree(self.root / name, ignore_errors=True)
        return gone


def message_images(m: dict) -> list[dict]:
    """A message's image references (a stored message's `images`, each a dict), [] for none."""
    refs = m.get("images")
    return [r for r in refs if isinstance(r, dict) and r.get("file")] if isinstance(refs, list) else []
