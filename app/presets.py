"""Configs (presets): a system prompt, sampling settings, a context length, the speed projection
default and the speculative decoding (off, prompt lookup or a draft model: "draft:PATH"), under a
name. A chat tab uses one (`chat.config["preset"]`).

"Default" always exists: it is the settings page's sampling defaults (QSettings), so it cannot be
renamed or deleted. Every other config is a row of the `presets` table in the chat database.
"""
from __future__ import annotations

import uuid
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from PySide6.QtCore import QObject, Qt, Signal
from PySide6.QtWidgets import (QCheckBox, QComboBox, QDialog, QDialogButtonBox, QFileDialog, QGridLayout,
                               QHBoxLayout, QInputDialog, QLabel,
                               QLineEdit, QListWidget, QListWidgetItem, QMessageBox, QPushButton, QVBoxLayout,
                               QWidget)

from engine.limits import SPEED_PROJECTION_DEFAULT
from engine.sampling import APP_KEYS

from .sampling_form import SamplingForm
from .settings import Sampling
from .paths import models_dir

DEFAULT_ID = "default"
DEFAULT_NAME = "Default"
NAME_MAX = 60
SPECULATIVE_CHOICES = (("Off", "off"), ("Prompt lookup", "lookup"), ("Model's MTP head", "mtp"))
SAMPLING_KEYS = APP_KEYS             # engine/sampling.py's table
PICK_DRAFT = "pick-draft"            # the combobox's "Draft model…" entry: opens a file dialog, never stored
SPECULATIVE_TIP = ("Draft tokens cheaply and check them all in one pass of the model: the same output, faster "
                   "when most drafts are accepted (the status bar shows how many were).\n"
                   "Prompt lookup drafts from the conversation itself: good when replies repeat the prompt "
                   "(editing code). A draft model is a small GGUF with the same vocabulary as the chat's model "
                   "(e.g. a small model of the same family); one with another vocabulary is refused.\n"
                   "The model's MTP head drafts with the next-token head some models ship (Qwen3.5/3.6: in the "
                   "GGUF or an mtp-*.gguf beside it; Gemma 4: its assistant GGUF saved beside it as mtp-*.gguf); "
                   "a model without one is refused with the reason.")


def speculative_label(value: str) -> str:
    """What the config's combobox and summary call a speculative setting: "Draft: <file name>" for a
    draft model (its folder is in the tooltip), else the choice's label."""
    if value.startswith("draft:"):
        return f"Draft: {Path(value[6:]).name}"
    return next((label for label, v in SPECULATIVE_CHOICES if v == value), value)


@dataclass
class Preset(Sampling):
    """A config: the settings' Sampling fields (system prompt, sampling, context length), a name, the
    speed projection of chats using it and their speculative decoding."""
    id: str = DEFAULT_ID
    name: str = DEFAULT_NAME
    speed_projection: bool = SPEED_PROJECTION_DEFAULT
    speculative: str = "off"         # "off" | "lookup" | "draft:PATH" | "mtp" (engine/generation/speculative.py)

    @property
    def is_default(self) -> bool:
        return self.id == DEFAULT_ID

    def sampling(self) -> dict:
        return self.request_sampling()

    def sampling_values(self) -> Sampling:
        """The Sampling part alone."""
        return Sampling(**{f.name: getattr(self, f.name) for f in fields(Sampling)})

    def data(self) -> dict:
        d = asdict(self)
        del d["id"], d["name"]
        return d

    @classmethod
    def from_data(cls, pid: str, name: str, data: dict) -> "Preset":
        p = cls(id=pid, name=name)
        for f in fields(cls):
            if f.name in ("id", "name") or f.name not in data:
                continue
            default = getattr(p, f.name)
            try:
                value = data[f.name]
                setattr(p, f.name, value if isinstance(default, bool) and isinstance(value, bool)
                        else type(default)(value))
            except (TypeError, ValueError, OverflowError):
                pass
        return p


# The settings keys Default is made of
DEFAULT_KEYS = ("speculative", "steering.speed_projection")


class PresetManager(QObject):
    """All configs: Default (from the settings, a SettingsService) first, then the stored ones in
    creation order. `changed` fires when any of them changed, Default's through the settings too."""
    changed = Signal()

    def __init__(self, store, settings, parent: QObject | None = None):
        super().__init__(parent)
        self.store = store
        self.settings = settings
        settings.changed.connect(self._on_setting)

    def _on_setting(self, key: str) -> None:
        if key.startswith("sampling.") or key in DEFAULT_KEYS:
            self.changed.emit()

    def default(self) -> Preset:
        s = self.settings
        return Preset(**asdict(s.sampling), id=DEFAULT_ID, name=DEFAULT_NAME,
                      speed_projection=s.steering.speed_projection, speculative=s.speculative)

    def all(self) -> list[Preset]:
        return [self.default()] + [Preset.from_data(pid, name, d) for pid, name, d in self.store.presets()]

    def find(self, pid: str | None) -> Preset | None:
        return next((p for p in self.all() if p.id == pid), None)

    def get(self, pid: str | None) -> Preset:
        """The config with this id, or Default (a deleted or unknown id falls back to it)."""
        return self.find(pid) or self.default()

    def names(self) -> list[str]:
        return [p.name for p in self.all()]

    def check_name(self, name: str, pid: str | None = None) -> str:
        """'' when `name` is usable for config `pid`, else the reason."""
        name = name.strip()
        if not name:
            return "a config needs a name"
        if len(name) > NAME_MAX:
            return f"a config name has at most {NAME_MAX} characters"
        if any(p.name.lower() == name.lower() and p.id != pid for p in self.all()):
            return f"there is already a config named {name!r}"
        return ""

    def _unique(self, base: str) -> str:
        names = {n.lower() for n in self.names()}
        if base.lower() not in names:
            return base
        n = 2
        while f"{base} {n}".lower() in names:
            n += 1
        return f"{base} {n}"

    def create(self, name: str = "", base: Preset | None = None, **values) -> Preset:
        src = base or self.default()
        p = Preset.from_data(uuid.uuid4().hex[:12], "", src.data())
        p.name = name.strip() or self._unique("Config")
        reason = self.check_name(p.name)
        if reason:
            raise ValueError(reason)
        for k, v in values.items():
            if k in ("id", "name") or not hasattr(p, k):
                raise ValueError(f"unknown config field {k!r}")
            setattr(p, k, v)
        self.store.save_preset(p.id, p.name, p.data())
        self.changed.emit()
        return p

    def duplicate(self, pid: str) -> Preset:
        src = self.get(pid)
        return self.create(self._unique(f"{src.name} copy"), base=src)

    def rename(self, pid: str, name: str) -> None:
        p = self.find(pid)
        if p is None:
            raise ValueError("no such config")
        if p.is_default:
            raise ValueError("the Default config cannot be renamed")
        reason = self.check_name(name, pid)
        if reason:
            raise ValueError(reason)
        self.store.save_preset(pid, name.strip(), p.data())
        self.changed.emit()

    def delete(self, pid: str) -> None:
        if pid == DEFAULT_ID:
            raise ValueError("the Default config cannot be deleted")
        self.store.delete_preset(pid)
        self.changed.emit()

    def update(self, p: Preset) -> None:
        """Store a config's values (Default's go to the settings' sampling defaults)."""
        if p.is_default:
            s = self.settings.snapshot()
            s.sampling = p.sampling_values()
            s.steering.speed_projection = p.speed_projection
            s.speculative = p.speculative
            self.settings.update(s)             # `changed` comes from the settings' keys
            return
        reason = self.check_name(p.name, p.id)
        if reason:
            raise ValueError(reason)
        self.store.save_preset(p.id, p.name, p.data())
        self.changed.emit()


class PresetDialog(QDialog):
    """Edit one config."""

    def __init__(self, manager: PresetManager, preset: Preset, parent: QWidget | None = None,
                 models_dir: Path | str | None = None):
        """`models_dir`: where the draft model file dialog opens (the model library's folder)."""
        super().__init__(parent)
        self.manager, self.preset = manager, preset
        self.models_dir = models_dir
        self.setWindowTitle(f"Config: {preset.name}")
        self.name = QLineEdit(preset.name, maxLength=NAME_MAX, enabled=not preset.is_default)
        self.sampling_form = SamplingForm(preset.sampling_values(), prompt_lines=5)
        self.speed = QCheckBox("Speed projection on in chats using this config", checked=preset.speed_projection)
        self.spec = QComboBox(toolTip=SPECULATIVE_TIP)
        for label, value in SPECULATIVE_CHOICES:
            self.spec.addItem(label, value)
        self.spec.addItem("Draft model…", PICK_DRAFT)
        if preset.speculative.startswith("draft:"):
            self._set_draft(preset.speculative)
        else:
            self.spec.setCurrentIndex(max(0, self.spec.findData(preset.speculative)))
        self._spec_index = self.spec.currentIndex()
        self.spec.currentIndexChanged.connect(self._on_spec_changed)
        self.error = QLabel(wordWrap=True, visible=False)
        form = self.sampling_form.form
        form.insertRow(0, "Name", self.name)
        form.addRow("", self.speed)
        form.addRow("Speculative decoding", self.spec)
        if preset.is_default:
            form.addRow("", QLabel("Default is also the settings page's sampling defaults.", wordWrap=True))
        self.buttons = QDialogButtonBox(QDialogButtonBox.StandardButton.Save | QDialogButtonBox.StandardButton.Cancel)
        self.buttons.accepted.connect(self.submit)
        self.buttons.rejected.connect(self.reject)
        lay = QVBoxLayout(self)
        lay.addWidget(self.sampling_form)
        lay.addWidget(self.error)
        lay.addWidget(self.buttons)

    def _set_draft(self, value: str) -> None:
        """Show and select `value` ("draft:PATH") as the one "Draft: <file name>" entry, before "Draft model…"."""
        i = next((i for i in range(self.spec.count()) if str(self.spec.itemData(i)).startswith("draft:")), -1)
        if i < 0:
            i = self.spec.findData(PICK_DRAFT)
            self.spec.insertItem(i, "", value)
        self.spec.setItemText(i, speculative_label(value))
        self.spec.setItemData(i, value)
        self.spec.setItemData(i, value[6:], Qt.ItemDataRole.ToolTipRole)
        self.spec.setCurrentIndex(i)

    def _on_spec_changed(self, index: int) -> None:
        if self.spec.itemData(index) != PICK_DRAFT:
            self._spec_index = index
            return
        self.spec.blockSignals(True)        # the entry is an action: never left selected
        try:
            path = self.pick_draft()
            if path:
                self._set_draft(f"draft:{path}")
            else:
                self.spec.setCurrentIndex(self._spec_index)     # cancelled: the choice before it
            self._spec_index = self.spec.currentIndex()
        finally:
            self.spec.blockSignals(False)

    def pick_draft(self) -> str:
        """A draft model's path from a file dialog opened in the model library's folder ("" cancelled).
        Not checked here: the engine loads it with the first request and refuses one with another
        vocabulary by name, shown in the chat like any request error."""
        start = self.models_dir
        if start is None:
            start = models_dir()
        current = str(self.spec.itemData(self._spec_index) or "")      # the choice before "Draft model…"
        if current.startswith("draft:"):                                 # another draft: start beside this one
            start = Path(current[6:]).parent
        path, _ = QFileDialog.getOpenFileName(self, "Draft model", str(start), "GGUF models (*.gguf)")
        return path

    def values(self) -> Preset:
        p = Preset.from_data(self.preset.id, self.name.text().strip(), self.preset.data())
        for k, v in asdict(self.sampling_form.values()).items():
            setattr(p, k, v)
        p.speed_projection = self.speed.isChecked()
        value = self.spec.currentData()
        p.speculative = value if value and value != PICK_DRAFT else "off"
        return p

    def submit(self) -> None:
        try:
            self.manager.update(self.values())
        except ValueError as e:
            self.error.setText(f"Not saved: {e}")
            self.error.show()
            return
        self.accept()


class PresetPane(QWidget):
    """The "Configs" list under the model list: new, duplicate, rename, delete, edit, new chat with it."""
    new_chat_requested = Signal(str)        # preset id

    def __init__(self, manager: PresetManager, parent: QWidget | None = None, models_dir: Path | None = None):
        super().__init__(parent)
        self.manager = manager
        self.models_dir = models_dir         # where a config's draft model dialog opens
        self.list = QListWidget()
        self.list.itemDoubleClicked.connect(lambda _it: self.edit_selected())
        self.list.currentRowChanged.connect(lambda _r: self._update_buttons())
        self.error = QLabel(wordWrap=True, visible=False)
        self.new_btn = QPushButton("New", clicked=self.new_preset, toolTip="A new config (a copy of Default)")
        self.dup_btn = QPushButton("Duplicate", clicked=self.duplicate_selected)
        self.rename_btn = QPushButton("Rename", clicked=self.rename_selected)
        self.delete_btn = QPushButton("Delete", clicked=self.delete_selected)
        self.edit_btn = QPushButton("Edit…", clicked=self.edit_selected)
        self.chat_btn = QPushButton("New chat", clicked=self._new_chat, toolTip="Open a chat tab using this config")
        head = QHBoxLayout()
        head.addWidget(QLabel("<b>Configs</b>"))
        head.addStretch(1)
        head.addWidget(self.chat_btn)
        row = QGridLayout()               # two rows of buttons: one row of five made the window wider than 1024 px
        for i, b in enumerate((self.new_btn, self.dup_btn, self.rename_btn, self.delete_btn, self.edit_btn)):
            row.addWidget(b, i // 3, i % 3)
        lay = QVBoxLayout(self)
        lay.setContentsMargins(6, 6, 0, 6)
        lay.addLayout(head)
        lay.addWidget(self.list, 1)
        lay.addWidget(self.error)
        lay.addLayout(row)
        manager.changed.connect(self.refresh)
        self.refresh()

    def refresh(self) -> None:
        keep = self.current_id()
        self.list.blockSignals(True)
        self.list.clear()
        for p in self.manager.all():
            it = QListWidgetItem(p.name)
            it.setData(Qt.ItemDataRole.UserRole, p.id)
            it.setToolTip(_summary(p))
            self.list.addItem(it)
        self.list.blockSignals(False)
        self.select(keep or DEFAULT_ID)

    def select(self, pid: str) -> None:
        for i in range(self.list.count()):
            if self.list.item(i).data(Qt.ItemDataRole.UserRole) == pid:
                self.list.setCurrentRow(i)
                break
        else:
            self.list.setCurrentRow(0)
        self._update_buttons()

    def current_id(self) -> str:
        it = self.list.currentItem()
        return it.data(Qt.ItemDataRole.UserRole) if it is not None else ""

    def _update_buttons(self) -> None:
        custom = bool(self.current_id()) and self.current_id() != DEFAULT_ID
        self.rename_btn.setEnabled(custom)
        self.delete_btn.setEnabled(custom)

    def show_error(self, text: str) -> None:
        self.error.setText(text)
        self.error.setVisible(bool(text))

    def _new_chat(self) -> None:
        self.new_chat_requested.emit(self.current_id() or DEFAULT_ID)

    def new_preset(self) -> Preset:
        p = self.manager.create()
        self.select(p.id)
        self.show_error("")
        return p

    def duplicate_selected(self) -> Preset:
        p = self.manager.duplicate(self.current_id() or DEFAULT_ID)
        self.select(p.id)
        self.show_error("")
        return p

    def rename_selected(self, name: str | None = None) -> None:
        pid = self.current_id()
        p = self.manager.find(pid)
        if p is None or p.is_default:
            return
        if name is None:
            name, ok = QInputDialog.getText(self, "Rename config", "Name:", text=p.name)
            if not ok:
                return
        try:
            self.manager.rename(pid, name)
            self.show_error("")
        except ValueError as e:
            self.show_error(f"Not renamed: {e}")

    def delete_selected(self, confirm: bool = True) -> None:
        p = self.manager.find(self.current_id())
        if p is None or p.is_default:
            return
        if confirm and QMessageBox.question(
                self, "Delete config", f"Delete the config {p.name!r}? Chats using it switch to Default.") \
                != QMessageBox.StandardButton.Yes:
            return
        self.manager.delete(p.id)
        self.show_error("")

    def edit_selected(self) -> PresetDialog:
        dlg = PresetDialog(self.manager, self.manager.get(self.current_id()), self, models_dir=self.models_dir)
        dlg.setModal(False)
        dlg.show()
        return dlg


def _summary(p: Preset) -> str:
    ctx = p.context_length or "model's own"
    prompt = p.system_prompt.strip().replace("\n", " ")
    return (f"temperature {p.temperature:g}, top-p {p.top_p:g}, top-k {p.top_k}, min-p {p.min_p:g}, "
            f"repetition {p.repetition_penalty:g}, max {p.max_tokens} tokens, context {ctx}, "
            f"speed projection {'on' if p.speed_projection else 'off'}, "
            f"speculative decoding {speculative_label(p.speculative)}\n"
            f"System: {prompt[:120] + ('…' if len(prompt) > 120 else '') if prompt else '(none)'}")
