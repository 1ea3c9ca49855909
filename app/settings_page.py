"""The settings page: conversation cache (checked by the engine's memory guard) and K/V cache precision,
control vectors, sampling defaults, model folders, the local server, the appearance. Whole numbers are
typed, not clamped: a value out of range or not a number is refused with a message under its field
(every problem named at the bottom) and nothing is saved. The page saves to the SettingsService
(app/settings.py); the values that reach the engine go there from app/engine_settings.py, which hears
the service's `changed` like every other part: the page closes once the engine took them, or shows its
refusal next to the field. The page scrolls; its message and buttons stay below, on screen."""
from __future__ import annotations

import copy
import re

from PySide6.QtCore import QSize, Qt, Signal
from PySide6.QtWidgets import (QCheckBox, QComboBox, QDialog, QDialogButtonBox, QFileDialog, QFormLayout, QFrame,
                               QGroupBox, QHBoxLayout, QLabel, QLineEdit, QListWidget, QListWidgetItem, QPushButton,
                               QScrollArea, QVBoxLayout, QWidget)

from engine.text.context_policy import POLICIES
from engine.limits import DISK_MIB_MAX, KV_BITS, SLOTS_MAX, cache_range, machine_cache_range
from engine.errors import ErrorCode, SessionRefusal

from .context_meter import POLICY_HELP, POLICY_LABELS
from .engine_settings import ENGINE_KEYS, EngineSettings
from .sampling_form import SamplingForm, spin
from .settings import Settings, SettingsService
from .theme import THEMES


_WHOLE = re.compile(r"[+-]?[0-9]+")     # ASCII digits only: int() would take other scripts' digits too
KV_BITS_CHOICES = tuple((f"{b}-bit" + (" (default)" if b == 16 else ""), b) for b in KV_BITS)
# What the engine does (engine/handlers.py configure, engine/cache/conversations.py, engine/session_files/sessions.py): the
# format is part of a conversation's K/V identity, so held K/V is never converted, and a session file
# is restored only by an engine running the format it holds.
KV_BITS_TIP = ("How the engine stores each token's keys and values. 8-bit takes a little over half the memory "
               "per token of 16-bit, 4-bit a little over a quarter: longer contexts and more parked "
               "conversations fit, for a little quality (replies can differ slightly; 4-bit more so).\n"
               "Applies to conversations from now on. Conversations already held in memory keep the format they "
               "were made with; one continued after a change has its prompt read again in the new format. "
               "Session files keep the format they were saved with and restore only while this setting matches "
               "it. A model whose head size cannot take 8- or 4-bit is refused with the reason.")

# Where a person changes the precision: what a hint names (the CLI's --kv-bits is no use in the window)
KV_BITS_CONTROL = "Settings > K/V cache precision"


def refusal_hint(code, reason: str) -> str:
    """What to add to an engine refusal shown in the window, from its code and reason (never its text):
    a session of another K/V precision names the setting to change."""
    if code == ErrorCode.SESSION_REFUSED and reason == SessionRefusal.KV_FORMAT:
        return f". To restore it, set {KV_BITS_CONTROL} to the file's precision, then restore it again."
    return ""


class NumberField(QWidget):
    """A whole number typed as text, checked against its range when the page is saved, never clamped
    or cut while typing: `problem()` says what is wrong ("" when nothing), shown in `message` under the
    field, wrapped and whole. The box is wide enough for its largest value. `value()`/`setValue()`/
    `minimum()`/`maximum()` as a spin box has them."""

    def __init__(self, lo: int, hi: int, value: int, unit: str = "", label: str = "", parent=None):
        super().__init__(parent)
        self.lo, self.hi, self.unit, self.label = lo, hi, unit, label
        self.edit = QLineEdit(str(value), objectName="numberEdit")
        self.edit.setMinimumWidth(self.readable_width())
        self.edit.setMaximumWidth(max(110, self.readable_width()))
        self.message = QLabel(wordWrap=True, visible=False, objectName="fieldError")
        self.message.setStyleSheet("color: #c62828;")
        self.edit.textEdited.connect(lambda _t: self.show_problem(""))
        row = QHBoxLayout()
        row.setContentsMargins(0, 0, 0, 0)
        row.addWidget(self.edit)
        if unit:
            row.addWidget(QLabel(unit.strip()))
        row.addStretch(1)            # the field stays at the left
        lay = QVBoxLayout(self)
        lay.setContentsMargins(0, 0, 0, 0)
        lay.setSpacing(2)
        lay.addLayout(row)
        lay.addWidget(self.message)  # under the field, the row's whole width: a long message wraps, never cut

    def readable_width(self) -> int:
        """The box's least width: its largest value (and a sign) with room for the frame and cursor."""
        digits = max(len(str(self.hi)), len(str(self.lo)), 4) + 1
        return self.edit.fontMetrics().horizontalAdvance("0" * digits) + 16

    def lineEdit(self) -> QLineEdit:  # noqa: N802 - as QSpinBox names it
        return self.edit

    def text(self) -> str:
        return self.edit.text()

    def minimum(self) -> int:
        return self.lo

    def maximum(self) -> int:
        return self.hi

    def setValue(self, value: int) -> None:  # noqa: N802
        self.edit.setText(str(int(value)))
        self.show_problem("")

    def value(self) -> int | None:
        """The number typed, or None when it is not a whole number (out-of-range values are kept,
        however large: see problem)."""
        text = self.edit.text().strip()
        if not _WHOLE.fullmatch(text):
            return None
        try:
            return int(text)
        except ValueError:           # past Python's digit limit for int(): far out of any range
            return None

    def problem(self) -> str:
        text = self.edit.text().strip()
        if not text:
            return "a number is needed"
        if not _WHOLE.fullmatch(text):
            return f"{text[:40]!r} is not a whole number"
        v = self.value()
        if v is None or not self.lo <= v <= self.hi:
            shown = text if len(text) <= 24 else f"a {len(text.lstrip('+-'))}-digit number"
            return f"must be {self.lo} to {self.hi}{self.unit}; got {shown}{self.unit if len(text) <= 24 else ''}"
        return ""

    def show_problem(self, text: str) -> None:
        self.message.setText(text)
        self.message.setVisible(bool(text))

    def check(self) -> str:
        """Show this field's problem next to it; returns it ("" when the value is good)."""
        p = self.problem()
        self.show_problem(p)
        return p


class SettingsPage(QDialog):
    saved = Signal(object, object)       # (new Settings, old Settings)

    def __init__(self, settings: SettingsService | Settings, client, status=None, parent: QWidget | None = None):
        """`settings`: the app's SettingsService (a plain Settings gets its own service, saved to the
        default data folder: a page alone in a test)."""
        super().__init__(parent)
        if not isinstance(settings, SettingsService):
            settings = SettingsService(settings, parent=self)
        self.settings = settings
        self.setWindowTitle("Strata Settings")
        self.client = client
        self.status = status               # the last engine.api.EngineStatus, or None
        self._drop_confirmed: tuple[int, int, int] | None = None
        self._waiting: Settings | None = None   # saved, waiting for the engine to take its part
        # The engine's settings reach it through the service's `changed` (app/engine_settings.py)
        self.engine = EngineSettings.of(settings, client) if client is not None else None
        if self.engine is not None:
            self.engine.applied.connect(self._took)
            self.engine.refused.connect(self._refused)
        self.old = settings.snapshot()
        s = copy.deepcopy(self.old)
        self.error = QLabel(wordWrap=True, visible=False, objectName="settingsError")
        cache, steer = self._cache_group(s, status), self._steering_group(s)
        samp, srv, fold, look = self._sampling_group(s), self._server_group(s), self._folders_group(s), self._look_group(s)
        self.buttons = QDialogButtonBox(QDialogButtonBox.StandardButton.Save | QDialogButtonBox.StandardButton.Cancel)
        self.buttons.accepted.connect(self.submit)
        self.buttons.rejected.connect(self.reject)
        left, right = QVBoxLayout(), QVBoxLayout()
        left.addWidget(cache)
        left.addWidget(samp)
        right.addWidget(steer)
        right.addWidget(fold)
        right.addWidget(srv)
        right.addWidget(look)
        right.addStretch(1)
        self._lay_out(left, right)

    def _cache_group(self, s: Settings, status) -> QGroupBox:
        """Conversation cache: the range is what the engine takes (engine.limits: 0..half of RAM)."""
        self.cache_range = self._cache_range(status)
        top = self.cache_range.max_mib if self.cache_range.max_mib is not None else 1 << 22
        self.cache_mib = NumberField(0, top, s.cache_mib, " MiB")
        self.cache_mib.setToolTip(f"Conversation cache cap: {self.cache_range.describe()}; 0 turns it off")
        self.cache_slots = NumberField(1, SLOTS_MAX, s.cache_slots)
        self.cache_slots.setToolTip(f"How many conversations are kept parked: 1 to {SLOTS_MAX}")
        self.guard = QLabel(self._guard_text(status), wordWrap=True)
        # The disk tier under parking (engine/disk/disk_tier.py): its cap, what it holds, and Clear
        self.disk_mib = NumberField(0, DISK_MIB_MAX, s.disk_mib, " MiB")
        self.disk_mib.setToolTip("Conversations' K/V kept on disk (the data folder's cache), found again after "
                                 "an eviction or a restart instead of reading the conversation again; 0 turns it off")
        self.disk_used = QLabel(self._disk_text(status), objectName="diskUsed")
        self.disk_clear = QPushButton("Clear", objectName="diskClear", clicked=self._clear_disk)
        self.disk_clear.setEnabled(self.client is not None)
        disk_row = QHBoxLayout()          # under the cap's row: the cap's message has the row's width
        disk_row.addWidget(self.disk_used, 1)
        disk_row.addWidget(self.disk_clear)
        # K/V precision (engine/cache/kv_format.py): the engine checks it against the loaded model's head size
        self.kv_bits = QComboBox(objectName="kvBits", toolTip=KV_BITS_TIP)
        for label, bits in KV_BITS_CHOICES:
            self.kv_bits.addItem(label, bits)
        self.kv_bits.setCurrentIndex(max(0, self.kv_bits.findData(s.kv_bits)))
        self.kv_bits_message = QLabel(wordWrap=True, visible=False, objectName="fieldError")
        self.kv_bits_message.setStyleSheet("color: #c62828;")
        self.kv_bits.currentIndexChanged.connect(lambda _i: self.kv_bits_message.hide())
        kv_box = QVBoxLayout()
        kv_box.addWidget(self.kv_bits)
        kv_box.addWidget(self.kv_bits_message)
        cache = QGroupBox("Conversation cache")
        f = QFormLayout(cache)
        f.addRow("Cap (0 = off)", self.cache_mib)
        f.addRow("Slots", self.cache_slots)
        f.addRow("On disk (0 = off)", self.disk_mib)
        f.addRow("", disk_row)
        f.addRow("K/V cache precision", kv_box)
        f.addRow("Memory guard", self.guard)
        return cache

    def _steering_group(self, s: Settings) -> QGroupBox:
        """Control vectors: files, layers, mode, direction, on by default."""
        st = s.steering
        self.cv_list = QListWidget(maximumHeight=80)
        for path, scale in st.files:
            self._add_cv(path, scale)
        self.cv_scale = spin(-10.0, 10.0, 1.0, 0.1, decimals=2)
        add_cv = QPushButton("Add file…", clicked=self._pick_cv)
        rm_cv = QPushButton("Remove", clicked=lambda: self.cv_list.takeItem(self.cv_list.currentRow()))
        cv_row = QHBoxLayout()
        cv_row.addWidget(QLabel("scale"))
        cv_row.addWidget(self.cv_scale)
        cv_row.addWidget(add_cv)
        cv_row.addWidget(rm_cv)
        self.layer_from = NumberField(0, 999, st.layer_from)
        self.layer_to = NumberField(0, 999, st.layer_to)
        layers = QHBoxLayout()
        layers.addWidget(self.layer_from)
        layers.addWidget(QLabel("to"))
        layers.addWidget(self.layer_to)
        layers.addWidget(QLabel("(0 to 0 = all layers)"))
        self.mode = QComboBox()
        self.mode.addItems(["add", "project"])
        self.mode.setCurrentText(st.mode)
        self.direction = QLineEdit(st.direction, placeholderText="per-layer or single:L")
        self.cv_on = QCheckBox("On by default in new chats", checked=st.speed_projection)
        steer = QGroupBox("Speed projection (control vectors)")
        f = QFormLayout(steer)
        f.addRow("Files", self.cv_list)
        f.addRow("", cv_row)
        f.addRow("Layers", layers)
        f.addRow("Mode", self.mode)
        f.addRow("Direction", self.direction)
        f.addRow("", self.cv_on)
        return steer

    def _sampling_group(self, s: Settings) -> QGroupBox:
        """Sampling defaults: the form a config's dialog uses too."""
        self.sampling_form = SamplingForm(s.sampling, prompt_lines=2)
        samp = QGroupBox("Sampling defaults (the Default config)")
        lay = QVBoxLayout(samp)
        lay.addWidget(self.sampling_form)
        # A new chat's overflow policy (each chat can choose its own under its meter)
        self.overflow = QComboBox(objectName="overflow", toolTip="What a chat sends once it outgrows the context")
        for p in POLICIES:
            self.overflow.addItem(POLICY_LABELS[p], p)
            self.overflow.setItemData(self.overflow.count() - 1, POLICY_HELP[p], Qt.ItemDataRole.ToolTipRole)
        self.overflow.setCurrentIndex(max(0, self.overflow.findData(s.overflow)))
        row = QFormLayout()
        row.addRow("When a chat is full", self.overflow)
        lay.addLayout(row)
        return samp

    def _server_group(self, s: Settings) -> QGroupBox:
        """The OpenAI-compatible server."""
        self.server_on = QCheckBox("Serve the loaded model over the OpenAI API", checked=s.server_enabled)
        self.server_host = QLineEdit(s.server_host, placeholderText="127.0.0.1")
        self.server_port = NumberField(1, 65535, s.server_port)
        self.server_key = QLineEdit(s.server_api_key, placeholderText="none (no key needed)")
        self.server_key.setEchoMode(QLineEdit.EchoMode.PasswordEchoOnEdit)
        self.server_url = QLabel(wordWrap=True, textInteractionFlags=Qt.TextInteractionFlag.TextSelectableByMouse)
        for w in (self.server_host, self.server_key):
            w.textChanged.connect(self._update_server_url)
        self.server_port.edit.textChanged.connect(self._update_server_url)
        self.server_on.toggled.connect(self._update_server_url)
        srv = QGroupBox("Local server (OpenAI-compatible)")
        f = QFormLayout(srv)
        f.addRow("", self.server_on)
        f.addRow("Host", self.server_host)
        f.addRow("Port", self.server_port)
        f.addRow("API key", self.server_key)
        f.addRow("", self.server_url)
        self._update_server_url()
        return srv

    def _folders_group(self, s: Settings) -> QGroupBox:
        """Model folders."""
        self.folders = QListWidget(maximumHeight=70)
        self.folders.addItems(s.model_folders)
        self.folders.setToolTip("Each folder is searched with its subfolders: a folder laid out as LM Studio's "
                                "(publisher/repository/file.gguf) can be added whole. Files are read where "
                                "they are, never copied or moved.")
        self.libraries = QCheckBox("Also list the models of LM Studio, the Hugging Face cache and Ollama",
                                   checked=s.model_libraries, objectName="modelLibraries")
        self.libraries.setToolTip("Read where those apps keep them (never copied, moved or changed); each "
                                  "model's Source column says where it lives.")
        self.image_tokens = NumberField(0, 4096, s.image_max_tokens)
        self.image_tokens.setToolTip("The most tokens one image takes in a chat with a model that reads images "
                                     "and sizes them (Gemma 4: 70 to 1120, Qwen3.5/3.6: 8 to 4096, Mistral 3: "
                                     "8 to 1024; a larger picture is scaled down: fewer tokens, less detail). "
                                     "0: the model's own limit. Gemma 3 always takes 256.")
        add_f = QPushButton("Add folder…", clicked=self._pick_folder)
        rm_f = QPushButton("Remove", clicked=lambda: self.folders.takeItem(self.folders.currentRow()))
        fold = QGroupBox("Model folders")
        fl = QVBoxLayout(fold)
        fl.addWidget(self.folders)
        row = QHBoxLayout()
        row.addStretch(1)
        row.addWidget(add_f)
        row.addWidget(rm_f)
        fl.addLayout(row)
        fl.addWidget(self.libraries)
        tokens = QFormLayout()
        tokens.addRow("Image tokens (most per image, 0 = the model's)", self.image_tokens)
        fl.addLayout(tokens)
        return fold

    def _look_group(self, s: Settings) -> QGroupBox:
        """Appearance (app/theme.py)."""
        self.theme = QComboBox(objectName="theme")
        for label, value in THEMES:
            self.theme.addItem(label, value)
        self.theme.setCurrentIndex(max(0, self.theme.findData(s.theme)))
        look = QGroupBox("Appearance")
        QFormLayout(look).addRow("Theme", self.theme)
        return look

    def _lay_out(self, left: QVBoxLayout, right: QVBoxLayout) -> None:
        """The two columns scroll; the message and Save/Cancel stay below them, always on screen (the
        page fits a 1024x700 screen)."""
        content = QWidget(objectName="settingsContent")
        cols = QHBoxLayout(content)
        cols.addLayout(left)
        cols.addLayout(right)
        self.scroll = QScrollArea(widgetResizable=True, frameShape=QFrame.Shape.NoFrame)
        self.scroll.setWidget(content)
        lay = QVBoxLayout(self)
        lay.addWidget(self.scroll, 1)
        lay.addWidget(self.error)
        lay.addWidget(self.buttons)
        want = content.sizeHint() + QSize(24, self.buttons.sizeHint().height() + 48)
        screen = self.screen().availableGeometry().size() if self.screen() is not None else QSize(1024, 700)
        self.resize(min(want.width(), screen.width(), 1000), min(want.height(), screen.height() - 40, 680))

    @staticmethod
    def _cache_range(status):
        """The engine's range when it has told us, else this machine's (the same rule, engine.limits)."""
        m = status.memory if status is not None else None
        return cache_range(m["total_bytes"]) if m else machine_cache_range()

    @classmethod
    def _guard_text(cls, status) -> str:
        if status is None:
            return "no reading yet (the engine is starting)"
        if status.memory_unavailable:
            return f"refusing work: {status.memory_unavailable}"
        m = status.memory
        if not m:
            return "no reading on this machine"
        p = status.parking or {}
        return (f"{m['available_bytes'] / (1 << 30):.1f} GiB available of {m['total_bytes'] / (1 << 30):.1f} GiB "
                f"({m['source']}); the cap may be {cls._cache_range(status).describe()}. "
                f"Parked now: {p.get('entries', 0)} conversations, {p.get('bytes', 0) / (1 << 20):.1f} MiB.")

    @staticmethod
    def _disk_text(status) -> str:
        d = status.disk if status is not None else None
        if not d:
            return "used: no reading yet"
        return f"used {d['bytes'] / (1 << 20):.1f} MiB by {d['entries']} conversation(s)"

    def _clear_disk(self) -> None:
        """Every conversation on disk removed (the engine's ClearDiskCache); the used size shown again."""
        if self.client is None:
            return
        self.disk_clear.setEnabled(False)
        req = self.client.clear_disk_cache()
        req.done.connect(self._disk_cleared)
        req.failed.connect(lambda m: (self.disk_clear.setEnabled(True), self.show_error(m)))

    def _disk_cleared(self, status) -> None:
        self.status = status
        self.disk_used.setText(self._disk_text(status))
        self.disk_clear.setEnabled(True)

    def _update_server_url(self) -> None:
        host = self.server_host.text().strip() or "127.0.0.1"
        url = f"http://{f'[{host}]' if ':' in host else host}:{self.server_port.text().strip()}/v1"
        note = "" if host in ("127.0.0.1", "localhost", "::1") or self.server_key.text() else \
            " — reachable from other machines without a key: set one"
        self.server_url.setText((f"Clients use {url}" if self.server_on.isChecked() else f"Off ({url} when on)") + note)

    def _add_cv(self, path: str, scale: float) -> None:
        it = QListWidgetItem(f"{path}  × {scale:g}")
        it.setData(256, (path, float(scale)))
        self.cv_list.addItem(it)

    def _pick_cv(self) -> None:
        path, _ = QFileDialog.getOpenFileName(self, "Control vector", "", "Control vectors (*.gguf)")
        if path:
            self._add_cv(path, self.cv_scale.value())

    def _pick_folder(self) -> None:
        d = QFileDialog.getExistingDirectory(self, "Model folder")
        if d:
            self.folders.addItem(d)

    def number_fields(self) -> dict[str, NumberField]:
        return {"Cap": self.cache_mib, "Slots": self.cache_slots, "On disk": self.disk_mib, "Layers from": self.layer_from,
                "Layers to": self.layer_to, "Port": self.server_port, "Image tokens": self.image_tokens}

    def check_fields(self) -> str:
        """Each number field's problem shown next to it; all of them, each named, or ""."""
        return "; ".join(f"{name} {p}" for name, w in self.number_fields().items() if (p := w.check()))

    def values(self) -> Settings:
        """The page's values over the current settings (a key the page does not show, like the model
        loaded meanwhile, stays as it is now). The number fields must be checked first."""
        s = self.settings.snapshot()
        s.cache_mib, s.cache_slots = self.cache_mib.value(), self.cache_slots.value()
        s.kv_bits = int(self.kv_bits.currentData())
        s.disk_mib = self.disk_mib.value()
        s.steering.files = [tuple(self.cv_list.item(i).data(256)) for i in range(self.cv_list.count())]
        s.steering.layer_from, s.steering.layer_to = self.layer_from.value(), self.layer_to.value()
        s.steering.mode = self.mode.currentText()
        s.steering.direction = self.direction.text().strip() or "per-layer"
        s.steering.speed_projection = self.cv_on.isChecked()
        s.sampling = self.sampling_form.values()
        s.server_enabled, s.server_port = self.server_on.isChecked(), self.server_port.value()
        s.server_host, s.server_api_key = self.server_host.text().strip() or "127.0.0.1", self.server_key.text().strip()
        s.model_folders = [self.folders.item(i).text() for i in range(self.folders.count())]
        s.model_libraries = self.libraries.isChecked()
        s.image_max_tokens = self.image_tokens.value()
        s.theme = self.theme.currentData()
        s.overflow = self.overflow.currentData()
        return s

    def show_error(self, text: str) -> None:
        self.error.setText(f"Not saved: {text}")
        self.error.show()
        self.buttons.setEnabled(True)

    def clear_error(self) -> None:
        self.error.clear()
        self.error.hide()

    def submit(self) -> None:
        """Save the page. The values that reach the engine go to it through the settings' `changed`
        (app/engine_settings.py): the page closes once the engine took them, or shows its refusal next
        to the field (the engine's keys are then as they were; the rest is saved)."""
        problem = self.check_fields()
        if problem:
            self.show_error(problem)
            return
        new = self.values()
        if not (new.steering.direction == "per-layer" or new.steering.direction.startswith("single:")):
            self.show_error(f"direction {new.steering.direction!r} is not 'per-layer' or 'single:L'")
            return
        self.clear_error()
        drops = " ".join(d for d in (self._drops(new), self._disk_drops(new)) if d)
        if drops and self._drop_confirmed != (new.cache_mib, new.cache_slots, new.disk_mib):
            # A lower cap evicts parked conversations, or deletes cached ones from disk, at once: say
            # so, and save on the second press.
            self._drop_confirmed = (new.cache_mib, new.cache_slots, new.disk_mib)
            self.error.setText(f"{drops} Press Save again to go ahead.")
            self.error.show()
            return
        to_engine = self.engine is not None and any(
            _get(new, k) != self.engine.held(k) for k in ENGINE_KEYS)
        if not to_engine:
            self._commit(new)
            return
        self.buttons.setEnabled(False)
        self._waiting = new
        self.settings.update(new)          # the engine's part goes out from the controller

    def _took(self, status) -> None:
        """The engine took the new values: show its reading and close."""
        if self._waiting is None:
            return
        if status is not None:
            self.guard.setText(self._guard_text(status))
        new, self._waiting = self._waiting, None
        self._commit(new)

    def _refused(self, key: str, message: str) -> None:
        """The engine refused: the message next to the field and at the bottom; the page stays open."""
        if self._waiting is None:
            return
        self._waiting = None
        field = {"cache_mib": self.cache_mib, "cache_slots": self.cache_slots, "disk_mib": self.disk_mib}.get(key)
        if field is not None:
            field.show_problem(message)
        elif key == "kv_bits":
            self.kv_bits_message.setText(message)
            self.kv_bits_message.show()
        self.show_error(message)

    def _drops(self, new: Settings) -> str:
        """What the new limits would evict from the parked conversations (per the last status), or ""."""
        p = (self.status.parking if self.status is not None else None) or {}
        entries, nbytes = int(p.get("entries") or 0), int(p.get("bytes") or 0)
        if not entries or (new.cache_mib, new.cache_slots) == (self.old.cache_mib, self.old.cache_slots):
            return ""
        if new.cache_mib == 0:
            return f"Turning the cache off drops the {entries} parked conversation(s) ({nbytes / (1 << 20):.1f} MiB)."
        if nbytes > new.cache_mib << 20:
            return (f"{nbytes / (1 << 20):.1f} MiB of conversations are parked: a {new.cache_mib} MiB cap "
                    "drops some of them.")
        if entries > new.cache_slots:
            return f"{entries} conversations are parked: {new.cache_slots} slot(s) drop {entries - new.cache_slots}."
        return ""

    def _disk_drops(self, new: Settings) -> str:
        """What a lower disk cap would delete from the disk tier (per the last status), or "". Off (0)
        deletes nothing: the files stay until Clear (engine/disk/disk_tier.py set_cap)."""
        d = (self.status.disk if self.status is not None else None) or {}
        entries, nbytes = int(d.get("entries") or 0), int(d.get("bytes") or 0)
        if not entries or new.disk_mib == 0 or new.disk_mib == self.old.disk_mib or nbytes <= new.disk_mib << 20:
            return ""
        return (f"{nbytes / (1 << 20):.1f} MiB of conversations are cached on disk: a {new.disk_mib} MiB cap "
                "deletes some of them.")

    def _commit(self, new: Settings) -> None:
        self.clear_error()
        self.settings.update(new)
        self.saved.emit(new, self.old)
        self.accept()


def _get(settings: Settings, key: str):
    obj = settings
    for part in key.split("."):
        obj = getattr(obj, part)
    return obj
