"""The sampling form: a system prompt, one spin box per field of engine/sampling.py's table that the
app shows (their ranges, steps and labels from the table), and a context length. The settings page's
sampling defaults and a config's dialog are this one widget."""
from __future__ import annotations

from PySide6.QtWidgets import QDoubleSpinBox, QFormLayout, QPlainTextEdit, QSpinBox, QWidget

from engine.sampling import APP_FIELDS

from .settings import Sampling


def spin(lo, hi, value, step=1, decimals=None, suffix=""):
    """A QSpinBox (decimals None) or QDoubleSpinBox holding `value`."""
    if decimals is None:
        w = QSpinBox(minimum=lo, maximum=hi, singleStep=step, suffix=suffix)
    else:
        w = QDoubleSpinBox(minimum=lo, maximum=hi, singleStep=step, decimals=decimals, suffix=suffix)
    w.setValue(value)
    return w


class SamplingForm(QWidget):
    """Edits a `Sampling`: `values()` gives it back. Each table field's spin box is an attribute of its
    name (`form.temperature`, `form.max_tokens`...); `form.form` is the QFormLayout, for a caller's own
    rows around these."""

    def __init__(self, value: Sampling | None = None, prompt_lines: int = 3, parent: QWidget | None = None):
        super().__init__(parent)
        value = value or Sampling()
        self.system_prompt = QPlainTextEdit(value.system_prompt)
        self.system_prompt.setFixedHeight(self.system_prompt.fontMetrics().lineSpacing() * prompt_lines + 12)
        self.form = QFormLayout(self)
        self.form.setContentsMargins(0, 0, 0, 0)
        self.form.addRow("System prompt", self.system_prompt)
        self.spins: dict[str, QSpinBox | QDoubleSpinBox] = {}
        for f in APP_FIELDS:
            lo, hi, step, decimals = f.form
            w = spin(lo, hi, getattr(value, f.name), step, decimals)
            self.spins[f.name] = w
            setattr(self, f.name, w)
            self.form.addRow(f.label, w)
        self.context_length = spin(0, 1 << 20, value.context_length, 512)
        self.context_length.setSpecialValueText("model's own")
        self.form.addRow("Context length", self.context_length)

    def set_values(self, value: Sampling) -> None:
        self.system_prompt.setPlainText(value.system_prompt)
        for name, w in self.spins.items():
            w.setValue(getattr(value, name))
        self.context_length.setValue(value.context_length)

    def values(self) -> Sampling:
        return Sampling(system_prompt=self.system_prompt.toPlainText(), context_length=self.context_length.value(),
                        **{name: w.value() for name, w in self.spins.items()})
