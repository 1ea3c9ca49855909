"""A model's image projector is a choice the user can make per model (the model list's row menu):
automatic (an mmproj-*.gguf beside it), none (text only) or a file picked anywhere. The real engine
loads the tiny Gemma 3 of tests/gguf_factory_vision.py with each choice; the choice survives a restart,
and a file that cannot serve the model is refused by name while the model goes on as it was."""
from __future__ import annotations

import json
import shutil

import pytest

from app_fixtures import LOAD_TIMEOUT_MS, open_window
from gguf_factory_vision import write_gemma3_vision_pair

from app.model_choices import AUTO, FILE_NAME, NONE

pytestmark = pytest.mark.gui


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return write_gemma3_vision_pair(tmp_path_factory.mktemp("projector-choice"))


def _open(qtbot):
    w = open_window(qtbot)
    with qtbot.waitSignal(w.library.loaded, timeout=LOAD_TIMEOUT_MS):
        w.show()
    return w


def _choose_in_menu(w, model: str, label: str) -> None:
    sub = next(a.menu() for a in w.library.models.row_menu(model).actions() if a.menu() is not None)
    next(a for a in sub.actions() if a.text() == label).trigger()


def _wait_loaded(qtbot, w):
    return qtbot.waitSignal(w.library.loaded, timeout=LOAD_TIMEOUT_MS)


def test_journey_a_models_projector_is_chosen_kept_and_refused_by_name(qtbot, app_home, pair, tmp_path):
    model = app_home / "models" / pair[0].name
    shutil.copyfile(pair[0], model)                  # the model alone in the models folder
    picked = tmp_path / "elsewhere" / "vision.gguf"  # its projector somewhere else, under another name
    picked.parent.mkdir()
    shutil.copyfile(pair[1], picked)
    from app import settings
    s = settings.load()
    s.model = str(model)
    settings.save(s)
    w = _open(qtbot)
    try:
        assert w.library.model_path == str(model) and w.library.vision is None   # nothing beside it
        menu = w.library.models.row_menu(str(model))
        assert [a.text() for a in menu.actions()][:2] == ["Load", "Image projector"]
        with _wait_loaded(qtbot, w):
            w.library.models.projector_chosen.emit(str(model), str(picked))       # "Choose file…"
        assert w.library.vision == "gemma3"
        with _wait_loaded(qtbot, w):
            _choose_in_menu(w, str(model), "None (text only)")
        assert w.library.vision is None and w.library.choices.projector(str(model)) == NONE
        with _wait_loaded(qtbot, w):
            w.library.models.projector_chosen.emit(str(model), str(picked))
        assert w.library.vision == "gemma3"
        # a file that is not a projector: refused by name, the model goes on with its projector
        with qtbot.waitSignal(w.bus.error, timeout=LOAD_TIMEOUT_MS) as told:
            w.library.models.projector_chosen.emit(str(model), str(model))
        assert "not an image projector" in told.args[0] and model.name in told.args[0]
        qtbot.wait(50)                                # the refusal reaches the library after the bus
        assert w.library.vision == "gemma3" and w.library.choices.projector(str(model)) == str(picked)
    finally:
        w.close()
    saved = json.loads((app_home / FILE_NAME).read_text())
    assert saved == {"projectors": {str(model): str(picked)}}

    w = _open(qtbot)                                  # a restart: the choice is the model's
    try:
        assert w.library.vision == "gemma3"
        with _wait_loaded(qtbot, w):
            _choose_in_menu(w, str(model), "Automatic")
        assert w.library.vision is None and w.library.choices.projector(str(model)) is AUTO
    finally:
        w.close()


def test_the_image_tokens_setting_reloads_the_model_and_is_refused_outside_its_range(qtbot, app_home, tmp_path):
    from gguf_factory_vision_qwen3vl import write_qwen3vl_vision_pair
    from app import settings
    model, mm = write_qwen3vl_vision_pair(app_home / "models")
    s = settings.load()
    s.model = str(model)
    s.image_max_tokens = 24
    settings.save(s)
    w = _open(qtbot)
    try:
        assert w.library.vision == "qwen3vl_merger"
        status = w.client.status()
        qtbot.waitUntil(lambda: status.result is not None, timeout=LOAD_TIMEOUT_MS)
        assert status.result.vision["tokens_per_image"] == 24
        with _wait_loaded(qtbot, w):
            w.settings.set("image_max_tokens", 0)             # the projector's own limit: loaded again
        status = w.client.status()
        qtbot.waitUntil(lambda: status.result is not None, timeout=LOAD_TIMEOUT_MS)
        assert status.result.vision["tokens_per_image"] > 24
        with qtbot.waitSignal(w.bus.error, timeout=LOAD_TIMEOUT_MS) as told:
            w.settings.set("image_max_tokens", 5000)
        assert "takes 8..4096 tokens an image" in told.args[0] and w.library.vision == "qwen3vl_merger"
    finally:
        w.close()
