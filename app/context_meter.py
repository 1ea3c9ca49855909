"""The context meter under each chat: how much of the model's context the chat fills (its system prompt,
its messages with the one being typed, the reply's reserve), the breakdown on hover, a warning before a
send that would overflow, and the chat's overflow policy (engine/text/context_policy.py) beside it.

The figures are the engine's: a CountTokens request (the model's tokenizer and template), asked through
the engine thread and never estimated here. Counts are debounced and the answer to an older one is
dropped, so typing costs one count per pause."""
from __future__ import annotations

from dataclasses import dataclass

from PySide6.QtCore import QObject, Qt, QTimer, Signal
from PySide6.QtWidgets import QComboBox, QHBoxLayout, QLabel, QProgressBar, QWidget

from engine.text.context_policy import DEFAULT_POLICY, POLICIES, reply_reserve

from .alive import while_alive

POLICY_LABELS = {"stop": "Stop at the limit", "truncate_middle": "Truncate the middle",
                 "rolling": "Rolling window"}
POLICY_HELP = {
    "stop": "Nothing is left out: a message that does not fit is not sent, and a reply stops where the "
            "context ends (it is kept). The whole conversation stays cached.",
    "truncate_middle": "The system prompt and the first exchange stay; the oldest turns after them are left "
                       "out. Their K/V stays cached; after a drop the rest is read once, then cached again.",
    "rolling": "The oldest turns are left out (the system prompt stays). After a drop everything past the "
               "system prompt is read once, then cached again.",
}
COUNT_DELAY_MS = 300


@dataclass(frozen=True)
class Reading:
    """One count, as the meter shows it (tokens)."""
    n_ctx: int                    # the context the chat may fill (the model's, or its config's smaller one)
    system: int                   # the system prompt's part of the prompt
    total: int                    # the whole prompt: system prompt, messages (and the one typed), template
    reserve: int                  # room kept for the reply (the max tokens setting, at most half the context)
    drafted: bool = False         # `total` includes the message being typed

    @property
    def messages(self) -> int:
        return self.total - self.system

    @property
    def over(self) -> int:
        """Tokens past the context once the reply's reserve is added (> 0: this send overflows)."""
        return self.total + self.reserve - self.n_ctx


def policy_warning(r: Reading, policy: str) -> str:
    """What a send would do when it overflows under `policy` ("" when it fits)."""
    if r.over <= 0:
        return ""
    if policy == "stop":
        if r.total >= r.n_ctx:
            return f"Too long to send: {r.total} tokens, the context holds {r.n_ctx}."
        return f"Over by {r.over}: the reply may stop at the end of the context."
    what = "after the first exchange" if policy == "truncate_middle" else "of the conversation"
    return f"Over by {r.over}: the oldest turns {what} will be left out."


class ContextMeter(QWidget):
    """A bar, its figures and the policy box. `policy_chosen(str)` when the person picks another policy."""
    policy_chosen = Signal(str)

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.reading: Reading | None = None
        self.policy = DEFAULT_POLICY
        self.bar = QProgressBar(textVisible=False, maximumHeight=10, maximumWidth=120, objectName="contextBar")
        self.label = QLabel("Context –", objectName="contextLabel")
        self.warning = QLabel(objectName="contextWarning", visible=False)
        self.warning.setStyleSheet("color: #b35c00")
        self.policy_box = QComboBox(objectName="overflowPolicy",
                                    toolTip="What this chat sends when it outgrows the context")
        for p in POLICIES:
            self.policy_box.addItem(POLICY_LABELS[p], p)
            self.policy_box.setItemData(self.policy_box.count() - 1, POLICY_HELP[p], Qt.ItemDataRole.ToolTipRole)
        self.policy_box.activated.connect(lambda i: self.policy_chosen.emit(self.policy_box.itemData(i)))
        lay = QHBoxLayout(self)
        lay.setContentsMargins(0, 0, 0, 0)
        for w in (self.bar, self.label, self.warning):
            lay.addWidget(w)
        lay.addStretch(1)
        lay.addWidget(QLabel("When full"))
        lay.addWidget(self.policy_box)

    def set_policy(self, policy: str) -> None:
        self.policy = policy if policy in POLICIES else DEFAULT_POLICY
        self.policy_box.setCurrentIndex(max(0, self.policy_box.findData(self.policy)))
        self._show()

    def show_reading(self, r: Reading | None) -> None:
        self.reading = r
        self._show()

    def show_refusal(self, message: str) -> None:
        """The engine could not count the chat: say why where the figures go."""
        self.reading = None
        self._show()
        self.label.setText("Context ?")
        self.warning.setText(message)
        self.warning.show()

    def warning_text(self) -> str:
        return "" if self.warning.isHidden() else self.warning.text()

    def _show(self) -> None:
        r = self.reading
        if r is None or r.n_ctx <= 0:
            self.label.setText("Context –")
            self.bar.setRange(0, 1)
            self.bar.setValue(0)
            self.setToolTip("The context fills as the chat grows (counted once a model is loaded)")
            self.warning.hide()
            return
        self.bar.setRange(0, r.n_ctx)
        self.bar.setValue(min(r.n_ctx, r.total + r.reserve))
        self.label.setText(f"Context {r.total + r.reserve:,} / {r.n_ctx:,}")
        self.setToolTip("\n".join([
            f"System prompt: {r.system:,} tokens",
            f"Messages{' (with the one being typed)' if r.drafted else ''}: {r.messages:,} tokens",
            f"Reply reserve (max tokens): {r.reserve:,} tokens",
            f"Context: {r.n_ctx:,} tokens, {max(0, r.n_ctx - r.total - r.reserve):,} free",
            f"When full: {POLICY_LABELS[self.policy]}. {POLICY_HELP[self.policy]}"]))
        text = policy_warning(r, self.policy)
        self.warning.setText(text)
        self.warning.setVisible(bool(text))


class ContextCounter(QObject):
    """Asks the engine for a chat's count (debounced; the newest answer only) and hands the meter a
    Reading. `messages()` gives what the next request would send (with the typed message, if any),
    `limits()` the context and the max tokens setting: (n_ctx, max_tokens), n_ctx 0 when unknown."""
    counted = Signal(object)          # Reading, or None: nothing to count (no model, no messages)
    refused = Signal(str)             # the engine refused the count (e.g. a history far past the context)

    def __init__(self, client, messages, limits, parent: QObject | None = None):
        super().__init__(parent)
        self.client = client
        self._messages = messages
        self._limits = limits
        self._asked = 0               # the newest count asked; an older answer is dropped
        self.pending = None           # the count request in flight (tests wait on it)
        self._timer = QTimer(self, singleShot=True, interval=COUNT_DELAY_MS)
        self._timer.timeout.connect(self.count_now)

    def soon(self) -> None:
        self._timer.start()

    def count_now(self) -> None:
        self._timer.stop()
        n_ctx, max_tokens = self._limits()
        messages, drafted = self._messages()
        if n_ctx <= 0 or not messages or not getattr(self.client, "is_ready", True):
            self.counted.emit(None)
            return
        self._asked += 1
        ticket = self._asked
        req = self.client.count_prompt_tokens(messages)
        self.pending = req
        req.done.connect(while_alive(self, lambda r, t=ticket: self._on_count(t, r, n_ctx, max_tokens, drafted)))
        req.failed.connect(while_alive(self, lambda m, t=ticket: self._on_refused(t, m)))

    def _on_refused(self, ticket: int, message: str) -> None:
        if ticket == self._asked:
            self.pending = None
            self.refused.emit(message)

    def _on_count(self, ticket: int, r, n_ctx: int, max_tokens: int, drafted: bool) -> None:
        if ticket != self._asked:
            return
        self.pending = None
        self.counted.emit(Reading(n_ctx, int(getattr(r, "system_tokens", 0)), int(r.tokens),
                                  reply_reserve(max_tokens, n_ctx), drafted))
