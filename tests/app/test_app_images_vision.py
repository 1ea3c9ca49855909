"""Images in the window with a model that reads them: a tiny Gemma 3 with its gemma3 mmproj beside it in
the models folder (tests/gguf_factory_vision.py), the real engine thread. An attached image is sent and
counted (the reply's prompt holds the image's tokens), a follow-up reuses it (cached, not read again),
and after a restart the chat is shown with its thumbnail and goes on with the image still in it.

The tiny vision model's factory comes with the engine's projector (engine/vision/): where the tree has
no projector yet the module is skipped, saying so. (The text-only refusal journey is in
test_app_images.py.)"""
from __future__ import annotations

import shutil

import pytest

from app_fixtures import LOAD_TIMEOUT_MS, open_window, send_and_wait

gguf_factory_vision = pytest.importorskip(
    "gguf_factory_vision", reason="no image projector in this tree yet (tests/gguf_factory_vision.py and "
                                  "engine/vision/ come with it): images cannot be read by a model")

from test_app_images import _file, _png  # noqa: E402

pytestmark = pytest.mark.gui
IMAGE_TOKENS = 256          # gemma3's tokens an image


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return gguf_factory_vision.write_gemma3_vision_pair(tmp_path_factory.mktemp("vision-pair-app"))


def _open(qtbot):
    w = open_window(qtbot)
    with qtbot.waitSignal(w.library.loaded, timeout=LOAD_TIMEOUT_MS):
        w.show()
    return w


def test_journey_an_image_is_read_counted_reused_and_kept_across_a_restart(qtbot, app_home, pair, tmp_path):
    from app import settings
    for f in pair:                                    # the model and its mmproj side by side
        shutil.copyfile(f, app_home / "models" / f.name)
    s = settings.load()
    s.model = str(app_home / "models" / pair[0].name)
    s.sampling.temperature = 0.0
    s.sampling.max_tokens = 4
    settings.save(s)
    w = _open(qtbot)
    try:
        view = w.current_view()
        assert w.library.vision == "gemma3" and not view.images.row.reason.isVisibleTo(view)
        plain = send_and_wait(qtbot, view, "Hello")
        assert view.images.attach_files([_file(tmp_path, "photo.png", _png(57, 41, seed=3))]) == 1
        first = send_and_wait(qtbot, view, "What is in this picture?")
        assert first.prompt_tokens >= plain.prompt_tokens + IMAGE_TOKENS
        follow = send_and_wait(qtbot, view, "And the colours?")
        assert follow.cached_tokens >= first.prompt_tokens - 1     # the image's span reused, not read again
        cid = view.chat.id
        ref = view.chat.messages[2]["images"][0]
    finally:
        w.close()

    w = _open(qtbot)                                  # a restart: the same data folder
    try:
        view = w.tabs.view_for(cid)
        assert view is not None and view.chat.messages[2]["images"] == [ref]
        assert 'href="image:2:0"' in view.transcript.toHtml()
        again = send_and_wait(qtbot, view, "Once more?")
        # the image is still in the prompt (without it, this prompt would be ~250 tokens shorter than the last)
        assert again.prompt_tokens > follow.prompt_tokens and len(view.chat.messages) == 8
    finally:
        w.close()


def test_journey_pasted_and_dropped_images_with_a_short_question_then_a_restart(qtbot, app_home, pair, tmp_path):
    """A new chat: a picture pasted (no file) and a file dropped on the message box, a question of two
    characters after them with the app's own sampling (its repetition penalty's window reaches back into
    the images: it crashed the engine at the first decode step before the penalty left image ids out);
    then a restart and the chat goes on with both images in its prompt."""
    from PySide6.QtCore import QMimeData, Qt
    from PySide6.QtGui import QImage
    from app import settings
    from test_app_images import _drop, _urls
    for f in pair:
        shutil.copyfile(f, app_home / "models" / f.name)
    s = settings.load()
    s.model = str(app_home / "models" / pair[0].name)
    s.sampling.max_tokens = 4
    settings.save(s)
    assert s.sampling.repetition_penalty != 1.0       # the app's default: the penalty runs
    w = _open(qtbot)
    try:
        view = w.current_view()
        pic = QImage(48, 32, QImage.Format.Format_RGB32)
        pic.fill(Qt.GlobalColor.darkGreen)
        mime = QMimeData()
        mime.setImageData(pic)
        view.input.insertFromMimeData(mime)
        assert _drop(view.input.viewport(), _urls(_file(tmp_path, "dropped.png", _png(33, 65, seed=5))))
        assert len(view.images.row.items) == 2
        first = send_and_wait(qtbot, view, "Hi")
        assert first.prompt_tokens >= 2 * IMAGE_TOKENS and first.generated_tokens > 0
        cid, refs = view.chat.id, view.chat.messages[-2]["images"]
        assert len(refs) == 2
    finally:
        w.close()

    w = _open(qtbot)
    try:
        view = w.tabs.view_for(cid)
        assert view is not None and view.chat.messages[-2]["images"] == refs
        again = send_and_wait(qtbot, view, "Ok?")
        assert again.prompt_tokens > first.prompt_tokens and again.generated_tokens > 0
    finally:
        w.close()
