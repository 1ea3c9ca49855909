"""The model list shows models found where other apps keep them, each with its source label; a split set
is one row of the size of all its parts; projector and drafter files are not rows."""
from __future__ import annotations

import os
import shutil
from pathlib import Path

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

import pytest  # noqa: E402

from app.model_list import COLUMNS, NEEDS, SOURCE, ModelList  # noqa: E402
from gguf_factory import write_tiny_gguf  # noqa: E402
from gguf_factory_split import hostile_sets, write_split  # noqa: E402
from library_trees import hf_cache, lm_studio, ollama  # noqa: E402

pytestmark = pytest.mark.gui
SCAN_TIMEOUT_MS = 120_000


@pytest.fixture()
def folders(tmp_path, tiny_model):
    models = tmp_path / "strata-models"
    models.mkdir()
    parts = write_split(tiny_model, models, 3, stem="Tiny-Q8_0")
    other = write_tiny_gguf(tmp_path / "other.gguf", arch="llama", seed=1)
    shutil.copyfile(other, models / "mmproj-Tiny-Q8_0-f16.gguf")
    home = Path(os.environ["STRATA_LIBRARY_HOME"])
    lm_studio(home, {"pub/repo/lm-model.gguf": other})
    hf_cache(home / ".cache" / "huggingface" / "hub", "org/Tiny-GGUF", {"hf-model.gguf": tiny_model})
    ollama(home / ".ollama" / "models", "tiny", "3b", tiny_model)
    return models, parts


def _rows(tree) -> dict[str, object]:
    return {Path(tree.topLevelItem(i).data(0, 256)).name: tree.topLevelItem(i)
            for i in range(tree.topLevelItemCount())}


def test_the_model_list_says_where_each_model_lives(qtbot, folders):
    models, parts = folders
    ml = ModelList(lambda: [str(models)])
    qtbot.addWidget(ml)
    with qtbot.waitSignal(ml.scanned, timeout=SCAN_TIMEOUT_MS):
        ml.refresh()
    rows = _rows(ml.tree)
    assert not ml.tree.isColumnHidden(SOURCE)          # models from elsewhere: the Source column shows
    by_source = {it.text(SOURCE): name for name, it in rows.items()}
    assert by_source.pop("LM Studio") == "lm-model.gguf"
    assert by_source.pop("Hugging Face (org/Tiny-GGUF)") == "hf-model.gguf"
    assert by_source.pop("Ollama (tiny:3b)").startswith("sha256-")
    assert by_source.pop("Strata") == parts[0].name
    assert by_source == {}                              # the other parts and the projector are no rows
    split = rows[parts[0].name]
    assert split.text(COLUMNS.index("Size")) == f"{sum(p.stat().st_size for p in parts) / (1 << 20):.0f} MB"
    tip = split.toolTip(0)
    assert "3 files" in tip and "vision projector: mmproj-Tiny-Q8_0-f16.gguf" in tip and "Strata" in tip
    assert split.text(NEEDS) != "—" and not ml.errors
    blob = next(name for name in rows if name.startswith("sha256-"))
    assert "Ollama (tiny:3b)" in rows[blob].toolTip(0)
    # what loads when the settings name no model: the models folder's first, then library models that fit
    assert ml.first_choices()[0] == str(parts[0]) and len(ml.first_choices()) == 4
    ml.engine_budget = {"bytes": 1 << 20, "source": "test"}       # nothing fits in 1 MiB
    with qtbot.waitSignal(ml.scanned, timeout=SCAN_TIMEOUT_MS):
        ml.refresh()
    assert ml.first_choices() == [str(parts[0])]


def test_only_the_models_folder_keeps_the_source_column_hidden(qtbot, tmp_path, tiny_model):
    models = tmp_path / "only"
    models.mkdir()
    shutil.copyfile(tiny_model, models / "tiny.gguf")
    ml = ModelList(lambda: [str(models)])
    qtbot.addWidget(ml)
    with qtbot.waitSignal(ml.scanned, timeout=SCAN_TIMEOUT_MS):
        ml.refresh()
    assert ml.tree.topLevelItemCount() == 1 and ml.tree.isColumnHidden(SOURCE)
    assert ml.tree.topLevelItem(0).text(SOURCE) == "Strata"


@pytest.mark.parametrize("case", ["missing", "two-models", "counts"])
def test_a_broken_split_set_is_one_row_naming_the_part_at_fault(qtbot, tmp_path, tiny_model, case):
    """A part missing, parts of two models, counts that disagree: one row, its reason one line naming
    the part (the header is read in the list's worker, as for any file)."""
    first, part = hostile_sets(tiny_model, tmp_path / "sets")[case]
    ml = ModelList(lambda: [str(first.parent)])
    qtbot.addWidget(ml)
    with qtbot.waitSignal(ml.scanned, timeout=SCAN_TIMEOUT_MS):
        ml.refresh()
    assert ml.paths() == [str(first)] and ml.first_choices() == []
    why = ml.errors[str(first)]
    assert part in why and "\n" not in why
    assert "cannot be loaded" in ml.tree.topLevelItem(0).text(0)


def test_missing_unreadable_and_fifo_folders_never_hold_the_start(qtbot, app_home, tiny_model):
    """The window starts and loads its model with a missing folder, a chmod 0 folder, FIFOs named
    .gguf (in a folder of the user's and as an Ollama manifest) and a dangling Hub link among the
    places it looks: a FIFO opened for reading would wait for a writer forever, so a load that comes
    at all shows none was. A folder added in Settings afterwards is walked as a library is."""
    from app import settings as app_settings
    from app_fixtures import LOAD_TIMEOUT_MS, open_window
    mine, locked = app_home / "mine", app_home / "locked"
    (mine / "sub").mkdir(parents=True)
    locked.mkdir()
    os.mkfifo(mine / "fifo.gguf")
    os.mkfifo(mine / "sub" / "deep-fifo.gguf")
    shutil.copyfile(tiny_model, locked / "locked.gguf")
    locked.chmod(0)
    home = Path(os.environ["STRATA_LIBRARY_HOME"])
    ollama(home / ".ollama" / "models", "tiny", "3b", tiny_model)
    manifest = home / ".ollama" / "models" / "manifests" / "registry.ollama.ai" / "library" / "fifo"
    manifest.mkdir(parents=True)
    os.mkfifo(manifest / "latest")
    hub = hf_cache(home / ".cache" / "huggingface" / "hub", "org/Gone", {"gone.gguf": tiny_model})
    shutil.rmtree(hub / "blobs")                                   # its snapshot link dangles
    s = app_settings.load()
    s.model_folders = [str(app_home / "no-such-folder"), str(mine), str(locked)]
    app_settings.save(s)
    w = open_window(qtbot)
    try:
        with qtbot.waitSignal(w.library.loaded, timeout=LOAD_TIMEOUT_MS) as blocker:
            w.show()
        assert Path(blocker.args[0]).name == tiny_model.name
        names = {Path(p).name for p in w.models.paths()}
        assert tiny_model.name in names and "fifo.gguf" not in names and "deep-fifo.gguf" not in names
        assert any(n.startswith("sha256-") for n in names) and "gone.gguf" not in names
        # a folder laid out as LM Studio's, added in Settings: found through the settings' changed signal
        added = lm_studio(app_home / "other-home", {"pub/repo/nested.gguf": tiny_model})
        with qtbot.waitSignal(w.models.scanned, timeout=SCAN_TIMEOUT_MS):
            w.settings.set("model_folders", [str(added)])
        rows = _rows(w.models.tree)
        assert rows["nested.gguf"].text(SOURCE) == "Folder"
        assert w.library.model_path == blocker.args[0]             # the loaded model stays loaded
    finally:
        locked.chmod(0o755)
        w.close()


def test_the_first_model_loads_before_the_libraries_are_read(qtbot, app_home, tiny_model):
    """At start the models folder's and the user's folders' models are listed first and the model
    loads from them; the libraries' (however slow their folders or headers) join the list after."""
    from app_fixtures import LOAD_TIMEOUT_MS, open_window
    home = Path(os.environ["STRATA_LIBRARY_HOME"])
    lm_studio(home, {"pub/repo/lm-model.gguf": tiny_model})
    events: list[str] = []
    w = open_window(qtbot)
    w.models.own_scanned.connect(lambda: events.append("own"))
    w.models.scanned.connect(lambda: events.append("all"))
    # what the list held when the load was asked for (the library's own handler runs first)
    w.library.bus.busy.connect(lambda what: events.append(
        f"{what} with {sorted(Path(p).name for p in w.models.paths())}"))
    try:
        with qtbot.waitSignal(w.library.loaded, timeout=LOAD_TIMEOUT_MS) as blocker:
            w.show()
        qtbot.waitUntil(lambda: "all" in events, timeout=SCAN_TIMEOUT_MS)
        assert Path(blocker.args[0]).name == tiny_model.name
        assert events[:3] == [f"load with {[tiny_model.name]}", "own", "all"], events
        assert "lm-model.gguf" in {Path(p).name for p in w.models.paths()}
    finally:
        w.close()


def test_the_libraries_are_listed_or_not_as_settings_say(qtbot, app_home, tiny_model):
    """The Settings page's libraries box is saved as `model_libraries`; through the settings' changed
    signal the list drops the libraries' models, and lists them again when it is checked."""
    from app import settings as app_settings
    from app_fixtures import LOAD_TIMEOUT_MS, open_window
    home = Path(os.environ["STRATA_LIBRARY_HOME"])
    lm_studio(home, {"pub/repo/lm-model.gguf": tiny_model})
    w = open_window(qtbot)
    try:
        with qtbot.waitSignal(w.library.loaded, timeout=LOAD_TIMEOUT_MS):
            w.show()
        qtbot.waitUntil(lambda: "lm-model.gguf" in {Path(p).name for p in w.models.paths()},
                        timeout=SCAN_TIMEOUT_MS)
        page = w.open_settings()
        assert page.libraries.isChecked()
        page.libraries.setChecked(False)
        with qtbot.waitSignal(w.models.scanned, timeout=SCAN_TIMEOUT_MS):
            page.submit()
        assert app_settings.load().model_libraries is False
        assert [Path(p).name for p in w.models.paths()] == [tiny_model.name]
        with qtbot.waitSignal(w.models.scanned, timeout=SCAN_TIMEOUT_MS):
            w.settings.set("model_libraries", True)
        assert "lm-model.gguf" in {Path(p).name for p in w.models.paths()}
    finally:
        w.close()


def test_an_ollama_blob_that_does_not_read_is_named_by_its_tag(qtbot, tmp_path, tiny_model):
    """A blob is named sha256-<hex>: a row whose header gives no name says Ollama's model:tag."""
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(tiny_model.read_bytes()[:100])
    home = Path(os.environ["STRATA_LIBRARY_HOME"])
    ollama(home / ".ollama" / "models", "broken", "1b", truncated)
    models = tmp_path / "empty"
    models.mkdir()
    ml = ModelList(lambda: [str(models)])
    qtbot.addWidget(ml)
    with qtbot.waitSignal(ml.scanned, timeout=SCAN_TIMEOUT_MS):
        ml.refresh()
    (path,) = ml.paths()
    assert Path(path).name.startswith("sha256-") and path in ml.errors
    assert ml.tree.topLevelItem(0).text(0) == "broken:1b — cannot be loaded"


@pytest.mark.parametrize("case", ["missing", "two-models", "counts"])
def test_loading_a_hostile_set_in_the_app_is_refused_in_one_line(qtbot, window, tmp_path, tiny_model, case):
    """The engine refuses the set (the real engine, on its thread): the message bar gets one line naming
    the part at fault, and the model that was loaded stays loaded."""
    first, part = hostile_sets(tiny_model, tmp_path / "sets")[case]
    loaded = window.library.model_path
    with qtbot.waitSignal(window.library.bus.error, timeout=120_000) as blocker:
        window.library.load_model(str(first))
    line = blocker.args[0]
    assert line.startswith(f"Could not load {first.name}: ") and part in line and "\n" not in line
    assert window.library.model_path == loaded
