"""Images in the chat, the app's half: attach (file, paste, drop on the message box, where a session file
still restores), refused at once for a text-only model, kept with the chat in the data folder as real
files, sent as engine.api.ImageInput content parts, shown as thumbnails (click: whole), exported
(Markdown with the files beside it, JSON with base64) and deleted with the chat after its Undo.
Widget tests run on tests/fake_engine.py; the journeys on the real engine with the tiny text model."""
from __future__ import annotations

import base64
import io
import json
import os
import urllib.parse

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
from PIL import Image  # noqa: E402
from PySide6.QtCore import QMimeData, QPoint, QPointF, Qt, QUrl  # noqa: E402
from PySide6.QtGui import QDragEnterEvent, QDropEvent, QImage  # noqa: E402
from PySide6.QtWidgets import QApplication, QToolButton  # noqa: E402

from app_fixtures import open_window  # noqa: E402
from engine.api import ImageInput  # noqa: E402

pytestmark = pytest.mark.gui


def _png(w: int = 40, h: int = 30, seed: int = 0) -> bytes:
    a = np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(a).save(buf, "PNG")
    return buf.getvalue()


def _file(tmp_path, name: str, data: bytes):
    p = tmp_path / name
    p.write_bytes(data)
    return p


def _vision_view(idle_window, fake_client, tmp_path, vision="gemma3"):
    from app.chat_images import ChatImages
    from app.chat_view import ChatView
    from app.store import Chat
    view = ChatView(Chat(), fake_client, idle_window.presets, images=ChatImages(tmp_path / "images"))
    view.images.set_model(vision, "tiny-vision.gguf")
    return view


def _sent_messages(fake_client) -> list[dict]:
    gens = [a for name, a, kw in fake_client.calls if name == "generate" and not kw.get("side")]
    return gens[-1][0] if gens else []


def test_an_attached_image_is_kept_with_the_chat_and_sent_as_an_image_part(qtbot, idle_window, fake_client,
                                                                            tmp_path):
    view = _vision_view(idle_window, fake_client, tmp_path)
    data = _png()
    assert view.images.attach_files([_file(tmp_path, "cat.png", data)]) == 1
    assert view.images.row.isVisibleTo(view) and len(view.images.row.items) == 1
    assert not view.images.row.reason.isVisibleTo(view)            # a vision model: nothing to say
    view.input.setPlainText("What is in this picture?")
    with qtbot.waitSignal(view.stats, timeout=5000):
        view.send_input()
    user = view.chat.messages[0]
    assert user["content"] == "What is in this picture?" and not view.images.row.items
    (ref,) = user["images"]
    assert (ref["name"], ref["width"], ref["height"]) == ("cat.png", 40, 30)
    kept = tmp_path / "images" / view.chat.id / ref["file"]
    assert kept.read_bytes() == data                                  # the file as given, in the chat's folder
    sent = [m for m in _sent_messages(fake_client) if m["role"] == "user"][0]
    parts = sent["content"]
    assert parts[0]["type"] == "image" and isinstance(parts[0]["image"], ImageInput)
    assert parts[0]["image"].data == data and parts[0]["image"].name == "cat.png"
    assert parts[1] == {"type": "text", "text": "What is in this picture?"}
    # the transcript shows the thumbnail as a link; following it shows the image whole
    assert 'href="image:0:0"' in view.transcript.toHtml()
    dialog = view.images.open_image(view.chat.messages, 0, 0)
    assert dialog is not None and dialog.label.pixmap().width() == 40
    dialog.close()
    # Edit brings the message's image back into the row with its text; the edit is sent with it
    view.edit(0)
    assert [a.data for a in view.images.row.items] == [data]
    view.input.setPlainText("And now?")
    with qtbot.waitSignal(view.stats, timeout=5000):
        view.send_input()
    assert len(view.chat.messages) == 2 and view.chat.messages[0]["images"] == [ref]


def test_a_chat_begun_with_an_image_alone_is_named_by_the_image(qtbot, idle_window, fake_client, tmp_path):
    """No words sent, only a picture: the title request quotes the image's name for the question, and
    when the model's title names nothing of the chat, the image's name is the title (not "New chat")."""
    from engine.api import Generation
    from test_app_titles_and_stops import replies, titles_asked
    view = _vision_view(idle_window, fake_client, tmp_path)
    fake_client.answers["generate"] = replies(Generation(text="Red.", finish_reason="stop"),
                                              "I'm ready to assist you")
    assert view.images.attach_files([_file(tmp_path, "beach.png", _png())]) == 1
    with qtbot.waitSignal(view.title_changed, timeout=5000) as blocker:
        view.send_input()
    assert view.chat.messages[0]["content"] == "" and blocker.args[0] == "Beach.png"
    title_ask = next(a for n, a, kw in fake_client.calls if n == "generate" and kw.get("side"))[0]
    assert "User: beach.png" in title_ask[-1]["content"] and titles_asked(fake_client) == 1


def test_a_stored_reference_never_reaches_out_of_the_chats_folder(idle_window, fake_client, tmp_path):
    """A message dict from a hand-edited database naming '../..' files: only the name inside the chat's
    folder is read, and its absence is said in place (the prompt says so too), nothing else opened."""
    view = _vision_view(idle_window, fake_client, tmp_path)
    (tmp_path / "secret.png").write_bytes(_png())
    view.chat.messages = [{"role": "user", "content": "x", "images": [{"file": "../../secret.png", "name": "s"}]}]
    view.render_all()
    assert "[image not found: s]" in view.transcript_text()
    sent = view.request_messages()[-1]["content"]
    assert sent[0] == {"type": "text", "text": "[image not found: s]"}


def test_a_text_only_model_refuses_at_attach_and_at_send(qtbot, idle_window, fake_client, tmp_path):
    view = _vision_view(idle_window, fake_client, tmp_path, vision=None)
    said = []
    view.message.connect(said.append)
    view.images.attach_files([_file(tmp_path, "dog.png", _png())])
    assert len(view.images.row.items) == 1                            # attached, and said at once
    assert "tiny-vision.gguf reads text only" in said[-1] and view.images.row.reason.isVisibleTo(view)
    view.input.setPlainText("describe it")
    view.send_input()
    assert said[-1].startswith("Not sent: tiny-vision.gguf reads text only")
    assert not fake_client.calls and view.chat.messages == []          # nothing sent, nothing lost
    assert view.input.toPlainText() == "describe it" and len(view.images.row.items) == 1
    # a model with a projector loaded later: the same message goes
    view.images.set_model("gemma3", "v.gguf")
    assert not view.images.row.reason.isVisibleTo(view)
    with qtbot.waitSignal(view.stats, timeout=5000):
        view.send_input()
    assert view.chat.messages[0]["images"][0]["name"] == "dog.png"


def test_bad_images_are_refused_in_one_line_and_not_attached(idle_window, fake_client, tmp_path):
    view = _vision_view(idle_window, fake_client, tmp_path)
    bad = [_file(tmp_path, "notes.png", b"plain text, not a picture"),
           _file(tmp_path, "cut.png", _png(64, 64)[:300]),
           _file(tmp_path, "bomb.png", _bomb())]
    for p in bad:
        assert view.images.attach_files([p]) == 0
        assert view.images.last_refusal.startswith(f"Not attached: {p.name}: ") and "\n" not in view.images.last_refusal
    assert "MP" in view.images.last_refusal and view.images.row.items == []
    for i in range(9):
        view.images.attach_files([_file(tmp_path, f"p{i}.png", _png(8, 8, i))])
    assert len(view.images.row.items) == 8 and "at most 8 images" in view.images.last_refusal


def _bomb() -> bytes:
    import struct
    import zlib
    d = bytearray(_png(8, 8))
    struct.pack_into(">II", d, 16, 60000, 60000)
    struct.pack_into(">I", d, 29, zlib.crc32(bytes(d[12:29])))
    return bytes(d)


def test_paste_and_drop_attach_images_while_a_session_file_still_restores(qtbot, idle_window, tmp_path):
    view = idle_window.current_view()
    # paste: a picture on the clipboard (no file), then a copied image file
    pic = QImage(20, 10, QImage.Format.Format_RGB32)
    pic.fill(Qt.GlobalColor.red)
    mime = QMimeData()
    mime.setImageData(pic)
    assert view.input.canInsertFromMimeData(mime)
    view.input.insertFromMimeData(mime)
    assert [(a.width, a.height) for a in view.images.row.items] == [(20, 10)] and view.input.toPlainText() == ""
    QApplication.clipboard().setMimeData(_urls(_file(tmp_path, "copied.jpg", _jpeg())))
    view.input.paste()
    assert view.images.row.items[-1].name == "copied.jpg"
    # drop an image file on the message box: attached, its path not typed in
    assert _drop(view.input.viewport(), _urls(_file(tmp_path, "dropped.png", _png())))
    assert view.images.row.items[-1].name == "dropped.png" and view.input.toPlainText() == ""
    # a session file dropped on the same box is the session controller's (it waits for the model)
    assert _drop(view.input.viewport(), _urls(_file(tmp_path, "old.stratasession", b"not yet")))
    assert len(view.images.row.items) == 3
    assert any(p.endswith("old.stratasession") for p in idle_window.sessions.pending_files)
    # the Remove button under a thumbnail takes that image away
    view.images.row.findChild(QToolButton, "remove-image-0").click()
    assert [a.name for a in view.images.row.items] == ["copied.jpg", "dropped.png"]


def test_images_dropped_on_the_transcript_are_attached_and_a_session_file_still_restores(qtbot, idle_window,
                                                                                          tmp_path):
    """The chat's largest area, not only the message box, takes dropped images (as LM Studio's chat does);
    a session file dropped there still goes to the session controller."""
    view = idle_window.current_view()
    before = len(view.images.row.items)
    assert _drop(view.transcript.viewport(), _urls(_file(tmp_path, "on-transcript.png", _png(seed=4))))
    assert view.images.row.items[-1].name == "on-transcript.png" and len(view.images.row.items) == before + 1
    pic = QImage(12, 8, QImage.Format.Format_RGB32)
    pic.fill(Qt.GlobalColor.blue)
    mime = QMimeData()
    mime.setImageData(pic)
    assert _drop(view.transcript.viewport(), mime)                 # a picture dragged from another app
    assert (view.images.row.items[-1].width, view.images.row.items[-1].height) == (12, 8)
    assert _drop(view.transcript.viewport(), _urls(_file(tmp_path, "there.stratasession", b"not yet")))
    assert any(p.endswith("there.stratasession") for p in idle_window.sessions.pending_files)
    assert len(view.images.row.items) == before + 2
    assert not _drop(view.transcript.viewport(), _urls(_file(tmp_path, "data.bin", b"\x00\x01")))   # nobody's


def _jpeg() -> bytes:
    buf = io.BytesIO()
    Image.open(io.BytesIO(_png())).save(buf, "JPEG")
    return buf.getvalue()


def _urls(*paths) -> QMimeData:
    mime = QMimeData()
    mime.setUrls([QUrl.fromLocalFile(str(p)) for p in paths])
    return mime


def _drop(target, mime: QMimeData) -> bool:
    pos = QPoint(5, 5)
    enter = QDragEnterEvent(pos, Qt.DropAction.CopyAction, mime, Qt.MouseButton.LeftButton,
                            Qt.KeyboardModifier.NoModifier)
    QApplication.sendEvent(target, enter)
    if not enter.isAccepted():
        return False
    drop = QDropEvent(QPointF(pos), Qt.DropAction.CopyAction, mime, Qt.MouseButton.LeftButton,
                      Qt.KeyboardModifier.NoModifier)
    QApplication.sendEvent(target, drop)
    return drop.isAccepted()


# ---- journeys ----------------------------------------------------------------------------------
def test_journey_a_text_only_model_says_so_when_an_image_is_attached(qtbot, window, tmp_path):
    """The real engine's tiny text model (no projector: ModelFacts.vision is None): attaching says so at
    once, Send is refused with that reason, and the text chat goes on."""
    from app_fixtures import send_and_wait
    view = window.current_view()
    assert window.library.vision is None
    said = []
    view.message.connect(said.append)
    view.images.attach_files([_file(tmp_path, "photo.png", _png())])
    model = window.library.model_path.rsplit("/", 1)[-1]
    assert f"{model} reads text only" in said[-1] and view.images.row.reason.isVisibleTo(view)
    view.input.setPlainText("what is this?")
    view.send_input()
    assert said[-1].startswith("Not sent:") and view.chat.messages == [] and not view.busy
    view.images.row.remove(0)
    send_and_wait(qtbot, view, "hello")
    assert view.chat.messages[0] == {"role": "user", "content": "hello"}


def test_journey_a_chat_with_images_is_stored_reopened_exported_and_deleted(qtbot, app_home, tmp_path,
                                                                           monkeypatch):
    """Real files in the data folder: a chat with two images survives a restart (thumbnails shown), is
    exported both ways, survives a delete while its Undo lasts, and its folder goes when the Undo ends."""
    from PySide6.QtWidgets import QMessageBox
    from app.chat_export import export_chat
    w = open_window(qtbot, start_engine=False)
    view = w.current_view()
    a, b = _png(seed=1), _jpeg()
    for name, data in (("one.png", a), ("two.jpg", b)):
        view.images.attach_files([_file(tmp_path, name, data)])
    refs = view.images.keep(view.images.row.take())
    view.chat.messages += [{"role": "user", "content": "two pictures", "images": refs},
                           {"role": "assistant", "content": "I see them."}]
    view.set_title("Pictures")
    view.changed.emit()
    cid = view.chat.id
    folder = app_home / "images" / cid
    assert sorted(p.name for p in folder.iterdir()) == sorted(r["file"] for r in refs)
    w.close()

    w = open_window(qtbot, start_engine=False)                       # a restart: the same data folder
    view = w.tabs.view_for(cid)
    assert view is not None and view.chat.messages[0]["images"] == refs
    assert view.transcript.toHtml().count('href="image:0:') == 2
    sent = view.request_messages()
    parts = [m for m in sent if m["role"] == "user"][0]["content"]
    assert [p["image"].data for p in parts if p["type"] == "image"] == [a, b]

    (tmp_path / "out").mkdir()
    md = export_chat(w.store.chat(cid), tmp_path / "out" / "Pictures.md", "markdown", w.tabs.images)
    text = md.read_text(encoding="utf-8")
    links = [line[line.index("(") + 1:-1] for line in text.splitlines() if line.startswith("![")]
    assert [(md.parent / urllib.parse.unquote(link)).read_bytes() for link in links] == [a, b]
    js = json.loads(export_chat(w.store.chat(cid), tmp_path / "out" / "p.json", "json", w.tabs.images).read_text())
    imgs = js["messages"][0]["images"]
    assert [base64.b64decode(i["data"]) for i in imgs] == [a, b] and imgs[1]["media_type"] == "image/jpeg"

    lib = w.chat_library
    monkeypatch.setattr(QMessageBox, "question", lambda *a, **k: QMessageBox.StandardButton.Yes)
    assert lib.delete_dialog(cid)
    assert folder.is_dir()                                           # Undo is still possible
    lib.undo_delete()
    assert w.store.chat(cid) is not None and len(list(folder.iterdir())) == 2
    lib._undo_timer.setInterval(50)
    assert lib.delete_dialog(cid)
    with qtbot.waitSignal(lib._undo_timer.timeout, timeout=5000):
        pass
    assert not folder.exists()
    w.close()


def test_an_mmproj_in_the_models_folder_is_listed_as_an_image_projector_not_a_broken_model(tmp_path):
    """The mmproj-*.gguf people download beside a vision model: its row says what it is (not a missing
    key of a model header), and it is never offered as a model to load."""
    import gguf
    from app.model_scan import read_row
    from engine.model.memory_estimate import Budget
    path = tmp_path / "mmproj-tiny.gguf"
    w = gguf.GGUFWriter(str(path), "clip")
    w.add_string("clip.projector_type", "gemma3")
    w.add_tensor("v.patch_embd.weight", np.zeros((4, 4), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    meta, (column, tip) = read_row(path, Budget(8 << 30, "test"))
    assert meta.architecture == "clip" and column == "?"
    assert meta.error == tip == "mmproj-tiny.gguf: an image projector (mmproj), not a chat model: it is loaded " \
                                "with the model beside it"


def test_a_fork_has_its_own_copies_of_the_images_its_messages_name(tmp_path):
    """A fork's copied messages name image files: they are copied into the fork's own folder, so the
    fork sends the same image parts and keeps them once the parent and its folder are deleted."""
    from app import branches
    from app.chat_images import ChatImages, attachment_from_bytes
    from app.store import Chat
    images = ChatImages(tmp_path / "images")
    parent = Chat(title="parent")
    data = _png(seed=3)
    ref = images.store(parent.id, attachment_from_bytes(data, "cat.png"))
    parent.messages = [{"role": "user", "content": "What is it?", "images": [ref]},
                       {"role": "assistant", "content": "A cat."}]
    fork = branches.fork(parent, 1)
    assert images.copy_chat(parent.id, fork.id, fork.messages) == 1
    images.remove_chat(parent.id)
    assert images.read(fork.id, fork.messages[0]["images"][0]) == data
    assert images.copy_chat(parent.id, fork.id, fork.messages) == 0      # the parent's are gone: nothing to copy
