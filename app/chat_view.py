"""One chat tab: the transcript (Markdown, highlighted code, copy links), the prompt box and the
Stop / Regenerate / Edit-and-resend / Copy actions. Replies stream in from the engine thread.

An Edit or a Regenerate keeps what it replaced as another branch (app/branches.py), switched with the
"< 2/3 >" links on the message where branches part; "Fork" on any message (a link, or the transcript's
context menu) asks for a new chat of the history up to it (`fork_requested`, which the tabs answer)."""
from __future__ import annotations

import html
import time
from dataclasses import dataclass

from PySide6.QtCore import QTimer, QUrl, Qt, Signal
from PySide6.QtGui import QColor, QGuiApplication, QKeyEvent, QPalette, QTextCharFormat, QTextCursor
from PySide6.QtWidgets import (QApplication, QCheckBox, QComboBox, QHBoxLayout, QLabel, QPlainTextEdit,
                               QProgressBar, QPushButton, QTextBrowser, QVBoxLayout, QWidget)

from engine.text import reasoning

from . import branches
from .alive import while_alive
from .documents import prompt as doc_prompt
from .chat_images import ChatImages
from .image_composer import ImagesPart, mime_has_images
from .context_meter import POLICY_LABELS, ContextCounter, ContextMeter
from .markdown_render import insert_message_body, insert_plain, new_block
from .prefill_eta import PrefillEta
from .store import Chat
from .titles import TitleQueue, images_named, title_for, title_messages
from .tool_turn import ToolApproval, ToolTurn
from .tools import loop as tool_loop

DEFAULT_TITLE = "New chat"
LIMIT_NOTE = "The reply stopped at the token limit"
# A tool message's status as its heading says it
TOOL_STATUS_WORDS = {"ran": "result", "error": "error", "denied": "denied", "stopped": "stopped"}
RENDER_INTERVAL_MS = 60


@dataclass
class Replaced:
    """What a Regenerate took away: put back when the new reply ends before its first token."""
    messages: list[dict]
    notes: list[str]
    note_at: list[int]


def _assistant_message(text: str, think_open: bool = False) -> dict:
    """A reply as a message: its reasoning apart from its content (a harmony reply's analysis channel,
    gpt-oss, whose template refuses channel markers in content; a <think> block, Qwen3.5, opened by the
    template when `think_open`); other text as it is."""
    ch = reasoning.split_reply(text, think_open)
    return {"role": "assistant", "content": ch.content, **({"reasoning": ch.reasoning} if ch.reasoning else {})}


class PromptEdit(QPlainTextEdit):
    """Enter sends, Shift+Enter is a newline, Escape cancels an edit. Images pasted or dropped on it
    (a picture, image files) are attached, not inserted as text: `images_given(mime)`."""
    submitted = Signal()
    escaped = Signal()
    images_given = Signal(object)

    def canInsertFromMimeData(self, source) -> bool:  # noqa: N802
        return mime_has_images(source) or super().canInsertFromMimeData(source)

    def insertFromMimeData(self, source) -> None:  # noqa: N802
        if mime_has_images(source):
            self.images_given.emit(source)
            return
        super().insertFromMimeData(source)

    def keyPressEvent(self, e: QKeyEvent) -> None:  # noqa: N802
        if e.key() in (Qt.Key.Key_Return, Qt.Key.Key_Enter):
            if e.modifiers() & Qt.KeyboardModifier.ShiftModifier:
                self.insertPlainText("\n")
            else:
                self.submitted.emit()
            return
        if e.key() == Qt.Key.Key_Escape:
            self.escaped.emit()
            return
        super().keyPressEvent(e)


class ChatView(QWidget):
    changed = Signal()                 # messages or title changed: persist
    title_changed = Signal(str)
    stats = Signal(object)               # a generate result
    message = Signal(str)              # a line for the status bar
    progress = Signal(str, object, object)
    live_speed = Signal(float)         # tok/s of the reply streaming in this tab
    live_figures = Signal(object)      # `live` changed: the figures of the reply in flight
    fork_requested = Signal(int)       # "Fork from here" on message N: a new chat of messages[:N + 1]
    cite_clicked = Signal(int, int)    # a source link: (index of the question carrying it, its number)

    def __init__(self, chat: Chat, client, presets, parent: QWidget | None = None, titles: TitleQueue | None = None,
                 images: ChatImages | None = None):
        """`presets` is the PresetManager: the tab's config (chat.config["preset"]) gives the system
        prompt, sampling and context length of its requests. `titles`: the queue every tab's title
        requests share (app/titles.py), so that a reply in any tab comes before any title. `images`:
        where the chats' images are kept (the data folder's, by default)."""
        super().__init__(parent)
        self.images = ImagesPart(lambda: self.chat.id, images, self)
        self.images.refused.connect(self.message)
        self.chat = chat
        self.client = client
        self.presets = presets
        self.titles = titles if titles is not None else TitleQueue(client, self)
        self.titles.started.connect(self._on_title_started)
        self.request = None            # the generate request in flight
        self.documents = None          # app/documents/attach.py's TabDocuments (the window gives it)
        self.title_request = None      # the title's side request in flight (tests follow its result)
        self._title_asked = False      # a chat is titled once: a stopped reply or a regenerate asks no more
        # What a Regenerate replaces (the reply, and the notes under it), until the new reply has text
        self._replaced: Replaced | None = None
        self.eta = PrefillEta()        # the time left of a prompt being read, from its measured rate
        self.streaming: str | None = None
        self.edit_index: int | None = None
        self.notes: list[str] = []     # lines shown in the transcript (e.g. "restored N tokens")
        self._note_at: list[int] = []  # each note's place: the number of messages before it
        self._open_reasoning: set[int] = set()   # replies whose reasoning is shown (message indexes)
        self.last_result = None        # this tab's last reply, an engine.api.Generation (its status bar figures)
        self.think_open = False        # the model's template opens a <think> block (the window sets it on load)
        self.disk_note = ""            # "restored from disk (N tokens)" when a reply's K/V came from the disk tier
        self.model_context = 0         # the loaded model's context (ModelFacts.n_ctx; the window sets it), 0: none
        self.tracked = None            # the request whose progress the bar shows (prefill, save)
        self._t_first = 0.0
        self._t_sent = 0.0
        self._n_streamed = 0
        # The reply in flight's figures for the status bar (tps, ttft_ms, prompt/cached tokens); {} when idle
        self.live: dict = {}
        self._code: list[str] = []
        self._tail = 0
        self._render_timer = QTimer(self, singleShot=True, interval=RENDER_INTERVAL_MS)
        self._render_timer.timeout.connect(self._render_tail)
        self._init_tools(chat)

        self.transcript = QTextBrowser(openLinks=False, openExternalLinks=False)
        self.transcript.anchorClicked.connect(self._on_anchor)
        self.transcript.setContextMenuPolicy(Qt.ContextMenuPolicy.CustomContextMenu)
        self.transcript.customContextMenuRequested.connect(self._context_menu)
        self._starts: list[tuple[int, int]] = []      # (document position, message index) of each header
        self.input = PromptEdit(placeholderText="Message (Enter sends, Shift+Enter for a new line)")
        self.input.setFixedHeight(self.input.fontMetrics().lineSpacing() * 4 + 12)
        self.input.submitted.connect(self.send_input)
        self.input.escaped.connect(self.cancel_edit)
        self.input.images_given.connect(self.images.attach_mime)
        self.images.take_drops_on(self)
        self.edit_banner = QLabel(visible=False)
        self.send_btn = QPushButton("Send", clicked=self.send_input)
        self.stop_btn = QPushButton("Stop", clicked=self.stop, enabled=False)
        self.regen_btn = QPushButton("Regenerate", clicked=self.regenerate)
        self.copy_btn = QPushButton("Copy reply", clicked=self.copy_last)
        self.projection = QCheckBox("Speed projection", toolTip="Apply the control vector to this chat")
        self.projection.setChecked(bool(chat.config.get("speed_projection", True)))
        self.projection.toggled.connect(self._on_projection)
        self._task_row()
        self.preset_box = QComboBox(toolTip="The config (system prompt, sampling, context) this chat uses")
        self.preset_box.setSizeAdjustPolicy(QComboBox.SizeAdjustPolicy.AdjustToContents)
        self.preset_box.setMaximumWidth(220)      # a long config name must not widen the window
        self._fill_presets()
        self.preset_box.activated.connect(lambda i: self.set_preset(self.preset_box.itemData(i)))
        presets.changed.connect(self._fill_presets)
        self._context_widgets()
        self._lay_out()
        self.render_all()
        self._update_buttons()

    def _task_row(self) -> None:
        """A bar in the chat being answered: the prompt being read (or a save reading it again)."""
        self.task_label = QLabel()
        self.task_bar = QProgressBar(textVisible=True, maximumHeight=16)
        self.task_cancel = QPushButton("Cancel", clicked=self.cancel_task)
        self.task_row = QWidget(visible=False)
        tl = QHBoxLayout(self.task_row)
        tl.setContentsMargins(0, 0, 0, 0)
        tl.addWidget(self.task_label)
        tl.addWidget(self.task_bar, 1)
        tl.addWidget(self.task_cancel)

    def _lay_out(self) -> None:
        buttons = QHBoxLayout()
        buttons.addWidget(QLabel("Config"))
        for w in (self.preset_box, self.projection):
            buttons.addWidget(w)
        buttons.addStretch(1)
        for w in (self.copy_btn, self.regen_btn, self.stop_btn, self.send_btn):
            buttons.addWidget(w)
        lay = QVBoxLayout(self)
        lay.setContentsMargins(6, 6, 6, 6)
        lay.addWidget(self.transcript, 1)
        lay.addWidget(self.tool_panel)
        lay.addWidget(self.task_row)
        lay.addWidget(self.edit_banner)
        lay.addWidget(self.images.row)
        lay.addWidget(self.input)
        # what goes with the next message, beside the meter of what it will fill: images, the chat's tools
        beside = QHBoxLayout()
        beside.addWidget(self.meter, 1)
        beside.addWidget(self.images.button)
        beside.addWidget(self.tools_box)
        lay.addLayout(beside)
        lay.addLayout(buttons)

    # ---- state -------------------------------------------------------------------------------
    @property
    def busy(self) -> bool:
        return self.request is not None or self.tool_turn is not None

    def _update_buttons(self) -> None:
        has_reply = any(m["role"] == "assistant" for m in self.chat.messages)
        # A question left without its reply (stopped while the prompt was read, or failed) can be asked again.
        unanswered = bool(self.chat.messages) and self.chat.messages[-1]["role"] == "user"
        self.stop_btn.setEnabled(self.busy)
        self.send_btn.setEnabled(not self.busy)
        self.regen_btn.setEnabled(not self.busy and (has_reply or unanswered))
        self.copy_btn.setEnabled(has_reply)

    # ---- config (preset) ----------------------------------------------------------------------
    @property
    def preset(self):
        return self.presets.get(self.chat.config.get("preset"))

    def _fill_presets(self) -> None:
        current = self.preset
        if self.chat.config.get("preset") not in (None, current.id):
            self.chat.config["preset"] = current.id      # its config was deleted: Default now
            self.changed.emit()
        self.preset_box.blockSignals(True)
        self.preset_box.clear()
        for p in self.presets.all():
            self.preset_box.addItem(p.name, p.id)
        self.preset_box.setCurrentIndex(max(0, self.preset_box.findData(current.id)))
        self.preset_box.blockSignals(False)

    def set_preset(self, pid: str) -> None:
        """Switch this chat to config `pid`: its system prompt and sampling apply from the next request."""
        p = self.presets.get(pid)
        self.chat.config["preset"] = p.id
        self.preset_box.setCurrentIndex(max(0, self.preset_box.findData(p.id)))
        self.projection.setChecked(p.speed_projection)      # the config's default; the toggle still rules
        self.changed.emit()

    def _on_projection(self, on: bool) -> None:
        self.chat.config["speed_projection"] = on
        self.changed.emit()

    @property
    def conversation(self) -> str:
        """This chat's label for the engine: its K/V's owner (Regenerate and Edit reuse its slot)."""
        return f"chat-{self.chat.id}"

    # ---- the context meter and the overflow policy (app/context_meter.py) -----------------------
    def _context_widgets(self) -> None:
        self.meter = ContextMeter()
        self.meter.set_policy(self.overflow)
        self.meter.policy_chosen.connect(self.set_overflow)
        self.counter = ContextCounter(self.client, self._count_messages, self.context_limits, self)
        self.counter.counted.connect(self.meter.show_reading)
        self.counter.refused.connect(self.meter.show_refusal)
        self.input.textChanged.connect(self.counter.soon)
        self.changed.connect(self.counter.soon)           # a send, a reply, an edit, a config
        self.presets.changed.connect(self.counter.soon)   # a config's system prompt or max tokens
        settings = getattr(self.presets, "settings", None)
        if settings is not None:                          # the default policy, for a chat without its own
            settings.changed.connect(self._on_setting)

    def _on_setting(self, key: str) -> None:
        if key == "overflow":
            self.meter.set_policy(self.overflow)

    @property
    def overflow(self) -> str:
        """This chat's overflow policy (engine/text/context_policy.py): its own, else the settings' default."""
        settings = getattr(self.presets, "settings", None)
        return self.chat.config.get("overflow") or getattr(settings, "overflow", "stop")

    def set_overflow(self, policy: str) -> None:
        self.chat.config["overflow"] = policy
        self.meter.set_policy(policy)
        self.changed.emit()

    def set_model_context(self, n_ctx: int) -> None:
        """A model was loaded (its ModelFacts.n_ctx): the meter counts against it."""
        self.model_context = int(n_ctx or 0)
        self.meter.set_policy(self.overflow)
        self.counter.count_now()

    def context_limits(self) -> tuple[int, int]:
        """(the context this chat may fill, its max tokens setting); 0 while no model is loaded."""
        preset = self.preset
        n = self.model_context
        if n and preset.context_length > 0:
            n = min(n, preset.context_length)
        return n, preset.max_tokens

    def _count_messages(self) -> tuple[list[dict], bool]:
        """What the next send would ask for: the history (up to a message being edited) and the typed text
        with the documents that would go with it (a whole one not sent yet, its passages)."""
        draft = self.input.toPlainText().strip()
        base = self.chat.messages[:self.edit_index] if self.edit_index is not None else self.chat.messages
        extra = [{"role": "user", "content": draft}] if draft and not self.busy else []
        srcs = self.documents.sources(draft, base) if extra and self.documents is not None else []
        if srcs:
            extra[0]["documents"] = srcs
        return self.request_messages(base + extra), bool(extra)

    # ---- the progress bar in the chat --------------------------------------------------------------
    TASKS = {"prefill": "Reading the prompt", "save": "Saving session", "restore": "Restoring session"}

    def track(self, req, label: str | None = None) -> None:
        """Show `req`'s progress in this chat's bar, with Cancel, until it ends (or streams)."""
        self.tracked = req
        self.eta.reset()
        self.task_label.setText(label or "")
        req.progress.connect(self._on_task_progress)
        req.finished.connect(lambda r=req: self._untrack(r))

    def _on_task_progress(self, stage: str, done, total) -> None:
        if self.tracked is None or not total:
            return
        reread = stage == "prefill" and getattr(self.tracked, "kind", "") == "save"
        self.task_label.setText("Reading the conversation again" if reread else self.TASKS.get(stage, stage))
        self.task_bar.setRange(0, int(total))
        self.task_bar.setValue(int(done))
        left = self.eta.update(int(done), int(total)) if stage == "prefill" else ""
        self.task_bar.setFormat("%v / %m tokens" + (f", {left}" if left else "") if stage == "prefill" else "%p%")
        self.task_row.show()

    def _untrack(self, req) -> None:
        if self.tracked is req:
            self.tracked = None
            self.task_row.hide()

    def cancel_task(self) -> None:
        if self.tracked is not None:
            self.tracked.cancel()

    def task_visible(self) -> bool:
        return not self.task_row.isHidden()

    # ---- rendering ---------------------------------------------------------------------------
    def render_all(self) -> None:
        doc = self.transcript.document()
        doc.clear()
        self._code = []
        self._starts = []
        cursor = QTextCursor(doc)
        # A note stays where it was made: after the messages there were then (a note added later
        # takes the message count of the first render that shows it).
        del self._note_at[len(self.notes):]
        self._note_at += [len(self.chat.messages)] * (len(self.notes) - len(self._note_at))
        n = len(self.chat.messages)
        for i, m in enumerate(self.chat.messages):
            for note, at in zip(self.notes, self._note_at):
                if at == i:
                    self._insert_note(cursor, note)
            if m["role"] == "system":
                continue               # a restored file's system prompt: the original never showed it
            self._starts.append((cursor.position(), i))
            self._insert_header(cursor, i, m["role"], branch=branches.info(m))
            if m.get("reasoning"):
                self._insert_reasoning(cursor, i, m["reasoning"])
            if m["role"] == "user":       # shown exactly as typed: not Markdown, not HTML
                self.images.insert_thumbnails(cursor, doc, i, m)
                insert_plain(cursor, m["content"])
                if isinstance(m.get("documents"), list) and m["documents"]:
                    new_block(cursor)
                    cursor.insertHtml(f'<p style="font-size:small">{doc_prompt.sources_html(i, m["documents"])}</p>')
            elif m["role"] == "tool":
                self._insert_tool_result(cursor, i, m)
            else:        # its citations ([1]) link to the sources of the question it answers
                insert_message_body(cursor, doc_prompt.link_citations(
                    m["content"], *doc_prompt.sources_of_reply(self.chat.messages, i)), self._code)
            for call in m.get("tool_calls") or ():
                self._insert_tool_call(cursor, call)
        for note, at in zip(self.notes, self._note_at):
            if at >= n:
                self._insert_note(cursor, note)
        if self.streaming is not None:
            self._insert_header(cursor, len(self.chat.messages), "assistant", streaming=True)
            self._tail = cursor.position()
            self._insert_streaming(cursor)
        self._scroll_to_end()

    def _insert_header(self, cursor: QTextCursor, i: int, role: str, streaming: bool = False,
                       branch: branches.BranchInfo | None = None) -> None:
        pal = QApplication.palette()
        muted = pal.color(QPalette.ColorGroup.Disabled, QPalette.ColorRole.Text).name()
        who = {"user": "You", "assistant": "Assistant", "system": "System", "tool": "Tool"}.get(role, role)
        actions = ""
        if not streaming:
            if branch is not None:      # the count in the text's colour: the muted grey is hard to read
                text = pal.color(QPalette.ColorRole.Text).name()
                actions += (f' &nbsp; <a href="prevbranch:{i}">&lt;</a> <span style="color:{text}">'
                            f'{branch.index + 1}/{branch.count}</span> <a href="nextbranch:{i}">&gt;</a>')
            actions += f' &nbsp; <a href="copy:{i}">Copy</a>'
            if role == "user":
                actions += f' &nbsp; <a href="edit:{i}">Edit</a>'
            actions += f' &nbsp; <a href="fork:{i}">Fork</a>'
        new_block(cursor)
        cursor.insertHtml(f'<p style="margin-top:10px"><b>{html.escape(who)}</b>'
                          f'<span style="color:{muted}; font-size:small">{actions}</span></p>')

    def _insert_note(self, cursor: QTextCursor, text: str) -> None:
        muted = QApplication.palette().color(QPalette.ColorGroup.Disabled, QPalette.ColorRole.Text).name()
        new_block(cursor)
        cursor.insertHtml(f'<p><i style="color:{muted}">{html.escape(text)}</i></p>')

    def _render_tail(self) -> None:
        if self.streaming is None:
            return
        if self._n_streamed > 1:
            dt = time.perf_counter() - self._t_first
            if dt > 0:
                self.live["tps"] = (self._n_streamed - 1) / dt
                self.live_speed.emit(self.live["tps"])
                self.live_figures.emit(dict(self.live))
        cursor = QTextCursor(self.transcript.document())
        cursor.setPosition(self._tail)
        cursor.movePosition(QTextCursor.MoveOperation.End, QTextCursor.MoveMode.KeepAnchor)
        cursor.removeSelectedText()
        self._insert_streaming(cursor)
        self._scroll_to_end()

    def _insert_streaming(self, cursor: QTextCursor) -> None:
        # a reply with reasoning (gpt-oss's analysis channel, a <think> block) streams it first: collapsed,
        # the reply below it
        ch = reasoning.split_reply(self.streaming, self.think_open, final=False)
        if ch.reasoning:
            self._insert_reasoning(cursor, len(self.chat.messages), ch.reasoning, streaming=not ch.content)
        insert_message_body(cursor, ch.content, self._code)

    def _insert_reasoning(self, cursor: QTextCursor, i: int, text: str, streaming: bool = False) -> None:
        """A reply's reasoning (gpt-oss's analysis channel), apart from the reply: one muted line with
        a Show/Hide link, the text itself only when opened (like a collapsed <think> block)."""
        muted = QApplication.palette().color(QPalette.ColorGroup.Disabled, QPalette.ColorRole.Text).name()
        opened = i in self._open_reasoning
        words = len(text.split())
        label = "Thinking\u2026" if streaming else "Reasoning"
        new_block(cursor)
        cursor.insertHtml(f'<p><span style="color:{muted}; font-size:small">{label} ({words} words) &nbsp; '
                          f'<a href="reasoning:{i}">{"Hide" if opened else "Show"}</a></span></p>')
        if opened:                       # as it was written: text, not Markdown nor HTML
            fmt = QTextCharFormat()
            fmt.setFontItalic(True)
            fmt.setForeground(QColor(muted))
            insert_plain(cursor, text.strip(), fmt)

    def _insert_tool_call(self, cursor: QTextCursor, call: dict) -> None:
        """A call the reply made: the tool, its server and its arguments as formatted JSON."""
        muted = QApplication.palette().color(QPalette.ColorGroup.Disabled, QPalette.ColorRole.Text).name()
        tool, server = call.get("tool") or call["function"]["name"], call.get("server", "")
        new_block(cursor)
        cursor.insertHtml(f'<p><span style="color:{muted}">Tool call:</span> <b>{html.escape(tool)}</b>'
                          f'<span style="color:{muted}"> ({html.escape(server)})</span></p>')
        fmt = QTextCharFormat()
        fmt.setFontFixedPitch(True)
        fmt.setFontFamilies(["Menlo", "monospace"])
        insert_plain(cursor, tool_loop.pretty(call["function"]["arguments"]), fmt)

    def _insert_tool_result(self, cursor: QTextCursor, i: int, m: dict) -> None:
        """A tool's answer, collapsed to its first lines with a Show all link."""
        muted = QApplication.palette().color(QPalette.ColorGroup.Disabled, QPalette.ColorRole.Text).name()
        status = TOOL_STATUS_WORDS.get(m.get("status"), "result")
        head, n = tool_loop.preview(m["content"])
        opened = i in self._open_results
        label = "Show less" if opened else f"Show all ({n} lines)"
        link = f' &nbsp; <a href="toolresult:{i}">{label}</a>' if n > 3 else ""
        new_block(cursor)
        cursor.insertHtml(f'<p><span style="color:{muted}; font-size:small">{html.escape(status)} of '
                          f'{html.escape(m.get("tool") or m.get("name", ""))} ({html.escape(m.get("server", ""))})'
                          f'{link}</span></p>')
        fmt = QTextCharFormat()
        fmt.setFontFixedPitch(True)
        fmt.setFontFamilies(["Menlo", "monospace"])
        insert_plain(cursor, m["content"] if opened else head, fmt)

    def _scroll_to_end(self) -> None:
        bar = self.transcript.verticalScrollBar()
        bar.setValue(bar.maximum())

    def transcript_text(self) -> str:
        return self.transcript.toPlainText()

    def add_note(self, text: str) -> None:
        self.notes.append(text)
        self.render_all()

    # ---- actions -----------------------------------------------------------------------------
    def send_input(self) -> None:
        text = self.input.toPlainText().strip()
        if not (text or self.images.row.items) or self.busy:
            return
        history = self.chat.messages[:self.edit_index] if self.edit_index is not None else self.chat.messages
        why = self.images.refusal(history)
        if why:                       # the text and the images stay in the box
            self.images.last_refusal = f"Not sent: {why}"
            self.message.emit(self.images.last_refusal)
            return
        self.input.clear()
        self.send(text, self.images.row.take())

    def send(self, text: str, attachments: list | None = None) -> None:
        """Send `text` with `attachments` (app.chat_images.Attachment), kept with the chat first."""
        if self.busy:
            return
        try:
            refs = self.images.keep(attachments or [])
        except OSError as e:
            self.message.emit(f"Not sent: the images could not be kept in the data folder ({e.strerror or e})")
            self.images.row.set_items(attachments or [])
            return
        at, old = len(self.chat.messages), []
        if self.edit_index is not None:
            at, old = self.edit_index, self.chat.messages[self.edit_index:]
            del self.chat.messages[self.edit_index:]
            self.cancel_edit()
            self._drop_reply_notes()
        self._close_unanswered()
        message = {"role": "user", "content": text, **({"images": refs} if refs else {})}
        srcs = self.documents.sources(text, self.chat.messages) if self.documents is not None else []
        if srcs:                       # the chat's documents: whole ones not sent yet, the passages for it
            message["documents"] = srcs
        self.chat.messages.append(message)
        branches.replace_tail(self.chat.messages, at, old)     # the edited branch is kept beside it
        self.changed.emit()
        self._tool_steps = 0
        self._generate()

    def regenerate(self) -> None:
        if self.busy:
            return
        replaced = []           # the whole last reply: its tool calls and their results too
        while self.chat.messages and self.chat.messages[-1]["role"] in ("assistant", "tool"):
            replaced.insert(0, self.chat.messages.pop())
        if not self.chat.messages:
            self.chat.messages.extend(replaced)
            return
        self._replaced = Replaced(replaced, list(self.notes), list(self._note_at))
        self._drop_reply_notes()
        self.changed.emit()
        self._tool_steps = 0
        self._generate()

    def edit(self, index: int) -> None:
        if self.busy or not (0 <= index < len(self.chat.messages)):
            return
        self.edit_index = index
        self.input.setPlainText(self.chat.messages[index]["content"])
        self.images.restore_for_edit(self.chat.messages[index])
        self.edit_banner.setText("Editing an earlier message: sending replaces it and everything after it "
                                 "(Esc cancels).")
        self.edit_banner.show()
        self.input.setFocus()

    def cancel_edit(self) -> None:
        if self.edit_index is not None:
            self.edit_index = None
            self.edit_banner.hide()

    def stop(self) -> None:
        if self.tool_turn is not None:
            self.tool_turn.stop()         # a running call is cancelled; the loop ends here
        if self.request is not None:
            self.request.cancel()
        if self.tracked is not None:
            self.tracked.cancel()

    def copy_last(self) -> None:
        for m in reversed(self.chat.messages):
            if m["role"] == "assistant":
                QGuiApplication.clipboard().setText(m["content"])
                self.message.emit("Copied the reply")
                return

    def _on_anchor(self, url: QUrl) -> None:
        kind, _, arg = url.toString().partition(":")
        if kind == "cite":
            at, _, n = arg.partition(":")
            if at.isdigit() and n.isdigit():
                self.cite_clicked.emit(int(at), int(n))
        if kind == "image":                # "image:<message>:<image>": show it whole
            i, _, j = arg.partition(":")
            if i.isdigit() and j.isdigit():
                self.images.open_image(self.chat.messages, int(i), int(j))
            return
        try:
            n = int(arg)
        except ValueError:
            return
        if kind == "copycode" and 0 <= n < len(self._code):
            QGuiApplication.clipboard().setText(self._code[n])
            self.message.emit("Copied the code block")
        elif kind == "copy" and 0 <= n < len(self.chat.messages):
            QGuiApplication.clipboard().setText(self.chat.messages[n]["content"])
            self.message.emit("Copied the message")
        elif kind == "edit":
            self.edit(n)
        elif kind == "reasoning":
            self._open_reasoning ^= {n}
            self.render_all()
        elif kind in ("prevbranch", "nextbranch") and 0 <= n < len(self.chat.messages):
            b = branches.info(self.chat.messages[n])
            if b is not None:
                self.switch_branch(n, (b.index + (1 if kind == "nextbranch" else -1)) % b.count)
        elif kind == "fork":
            self.fork(n)
        elif kind == "toolresult":
            self._open_results ^= {n}
            self.render_all()

    def message_at(self, pos) -> int | None:
        """The index of the message shown at viewport point `pos` (None above the first)."""
        at = self.transcript.cursorForPosition(pos).position()
        found = None
        for start, i in self._starts:
            if start <= at:
                found = i
        return found

    def _context_menu(self, pos) -> None:
        menu = self.transcript.createStandardContextMenu(self.transcript.viewport().mapToGlobal(pos))
        i = self.message_at(pos)
        if i is not None:
            menu.addSeparator()
            menu.addAction("Fork from here", lambda: self.fork(i))
        menu.exec(self.transcript.viewport().mapToGlobal(pos))
        menu.deleteLater()

    # ---- branches and forks ---------------------------------------------------------------------
    def switch_branch(self, index: int, to: int) -> bool:
        """Show alternative `to` of message `index` and what follows it on that branch (not while a
        reply runs). The branch left is kept."""
        if self.busy or not branches.switch(self.chat.messages, index, to):
            return False
        self.cancel_edit()
        self._drop_reply_notes()
        self._open_reasoning = {i for i in self._open_reasoning if i < index}
        self.render_all()
        self._update_buttons()
        self.changed.emit()
        return True

    def fork(self, index: int) -> None:
        """Ask for a new chat of the history up to and including message `index`."""
        if 0 <= index < len(self.chat.messages):
            self.fork_requested.emit(index)

    # ---- generation --------------------------------------------------------------------------
    def request_messages(self, messages: list[dict] | None = None) -> list[dict]:
        system = self.preset.system_prompt
        # a reply's reasoning is shown, not sent back (gpt-oss's template drops past reasoning anyway)
        # nor are the branches not shown (app/branches.py)
        msgs = [{k: v for k, v in m.items() if k != "reasoning" and k not in branches.KEYS}
                for m in (self.chat.messages if messages is None else messages)]
        if system and not (msgs and msgs[0]["role"] == "system"):
            msgs.insert(0, {"role": "system", "content": system})
        # a question's documents become its content (the same text every turn: its K/V is reused), then
        # a message's images go with that text as content parts
        msgs = self.documents.expand(msgs) if self.documents is not None else doc_prompt.expand(msgs, lambda _d: None)
        return [self.images.request_message(m) for m in msgs]

    def _generate(self) -> None:
        # The user's reply comes before any title: a title running now stops, and runs after it
        why = self.images.refusal(self.chat.messages)
        if why:
            self.notes.append(f"Not sent: {why}")
            self._end_failed(f"Not sent: {why}")
            return
        self.titles.hold(self)
        preset = self.preset
        sampling = preset.sampling()
        messages = self._tool_request(self.request_messages())
        self.streaming = ""
        if preset.context_length > 0 and self.overflow == "stop":
            # The config's context: count the prompt first (the engine's tokenizer and template), then
            # refuse a prompt that does not fit or cap the reply to what is left.
            count = self.client.count_prompt_tokens(messages)
            self.request = count
            count.done.connect(while_alive(self, lambda r: self._after_count(r, messages, sampling,
                                                                             preset.context_length)))
            count.failed.connect(self._on_failed)
            self.render_all()
            self._update_buttons()
            return
        self._submit(messages, sampling)

    def _after_count(self, r, messages: list[dict], sampling: dict, n_ctx: int) -> None:
        if self.request is None or self.request._cancel:
            self._end_failed("Stopped")
            return
        n = int(r.tokens)              # engine.api.TokenCount
        if n >= n_ctx:
            reason = f"the prompt is {n} tokens; this chat's config holds {n_ctx}"
            self.notes.append(f"Not sent: {reason}")
            self._end_failed(f"Generation failed: {reason}")
            return
        self._submit(messages, dict(sampling, max_tokens=min(sampling["max_tokens"], n_ctx - n)))

    def _submit(self, messages: list[dict], sampling: dict) -> None:
        # A dropping policy is the engine's to apply (engine/text/context_policy.py), against the config's
        # context when it names a smaller one.
        req = self.client.generate(messages, sampling, conversation=self.conversation,
                                   speed_projection=self.projection.isChecked(),
                                   speculative=self.preset.speculative, overflow=self.overflow,
                                   context_limit=max(0, self.preset.context_length), **self._tool_kw)
        self.request = req
        self._n_streamed = 0
        self._t_sent = time.perf_counter()
        self.live = {"tps": None, "ttft_ms": None}
        self.live_figures.emit(dict(self.live))
        req.kv.connect(self._on_kv)
        req.token.connect(self._on_token)
        req.progress.connect(self.progress)
        self.track(req, self.TASKS["prefill"])
        req.done.connect(self._on_done)
        req.failed.connect(self._on_failed)
        self.render_all()
        self._update_buttons()

    def _on_token(self, text: str) -> None:
        if self.streaming is None:
            return
        if self._n_streamed == 0:
            self._t_first = time.perf_counter()
            self.task_row.hide()          # the prompt is read: the reply itself shows progress now
            # from Send (as the person waited); the engine's own figure replaces it when the reply ends
            self.live["ttft_ms"] = (self._t_first - self._t_sent) * 1e3
            self.live_figures.emit(dict(self.live))
        self._n_streamed += 1
        self.streaming += text
        if not self._render_timer.isActive():
            self._render_timer.start()

    def _on_kv(self, ev) -> None:
        """engine.events.KVChanged as this reply took its K/V: its prompt and cached tokens."""
        if self.request is not None:
            self.live.update(prompt_tokens=ev.prompt_tokens, cached_tokens=ev.cached_tokens)
            self.live_figures.emit(dict(self.live))
            if getattr(ev, "restored_from_disk", 0):
                self.disk_note = f"restored from disk ({ev.restored_from_disk} tokens)"
                self.message.emit(self.disk_note)

    def _finish(self, restore: bool = False) -> None:
        """The reply is over. `restore`: it brought no text, so the reply a Regenerate replaced comes back."""
        self._render_timer.stop()
        if restore and self._replaced is not None:
            self.chat.messages.extend(self._replaced.messages)
            self.notes[:], self._note_at[:] = self._replaced.notes, self._replaced.note_at
        self._replaced = None
        self.streaming = None
        self.request = None
        self.live = {}
        self.live_figures.emit({})     # no reply in flight: the status bar drops its "(streaming)" figures
        self.render_all()
        self._update_buttons()
        self.titles.release(self)

    def _on_done(self, result) -> None:
        """`result`: engine.api.Generation."""
        stopped = result.finish_reason == "cancelled"
        if stopped and not result.text:            # stopped before its first token: no reply to keep
            self._finish(restore=True)
            self.changed.emit()
            self.message.emit("Stopped")
            return
        self._note_dropped(result)
        if not stopped and self._reply_calls(result):
            return
        self._append_reply(_assistant_message(result.text, self.think_open))
        if result.finish_reason == "length":       # shown by _finish's render, under this reply
            self.notes.append(self._limit_note(result))
        self._finish()
        self.last_result = result
        self.changed.emit()
        self.stats.emit(result)
        if stopped:
            self.message.emit("Stopped")
        elif self.chat.title == DEFAULT_TITLE and not self._title_asked:
            self.request_title()

    def _note_dropped(self, result) -> None:
        """A reply whose prompt left out earlier turns (the chat's overflow policy) says so, above it."""
        if getattr(result, "dropped_messages", 0):
            self.notes.append(f"{result.dropped_messages} earlier messages were left out of the prompt to fit "
                              f"the context ({POLICY_LABELS[self.overflow]}); {result.cached_tokens} of "
                              f"{result.prompt_tokens} prompt tokens came from the cache.")

    def _limit_note(self, result) -> str:
        n_ctx = self.context_limits()[0]
        if n_ctx and result.prompt_tokens + result.generated_tokens >= n_ctx:
            return (f"{LIMIT_NOTE} of the context ({result.prompt_tokens + result.generated_tokens} of {n_ctx} "
                    "tokens). The reply is kept; start a new chat, or choose Truncate the middle or Rolling "
                    "window under When full to go on.")
        return (f"{LIMIT_NOTE} ({result.generated_tokens} tokens): Regenerate, or raise "
                "Max tokens in the chat's config, for a longer reply.")

    def _on_failed(self, message: str) -> None:
        """The current request (count or generate) failed: stopped (its code says cancelled) or an error."""
        from engine.errors import ErrorCode
        req = self.request
        stopped = req is not None and req.error_code == ErrorCode.CANCELLED
        self._end_failed("Stopped" if stopped else f"Generation failed: {message}")

    def _end_failed(self, note: str) -> None:
        partial = self.streaming
        replaced = self._replaced
        self._finish(restore=not partial)
        if partial:
            self._replaced = replaced
            self._append_reply(_assistant_message(partial, self.think_open))
            self._replaced = None
            self.render_all()
            self.changed.emit()
        self.message.emit(note)

    def _append_reply(self, message: dict) -> None:
        """The reply joins the chat; the one a Regenerate replaced is kept as another branch of it."""
        at = len(self.chat.messages)
        self.chat.messages.append(message)
        if self._replaced is not None:
            branches.replace_tail(self.chat.messages, at, self._replaced.messages)

    def _drop_reply_notes(self) -> None:
        """The token-limit notes of replies that are gone (regenerated, edited away)."""
        at = getattr(self, "_note_at", None)
        n = len(self.chat.messages)
        keep = [i for i, t in enumerate(self.notes)
                if not (t.startswith(LIMIT_NOTE) and (at is None or i >= len(at) or at[i] > n))]
        if len(keep) != len(self.notes):
            self.notes[:] = [self.notes[i] for i in keep]
            if at is not None:
                at[:] = [at[i] for i in keep if i < len(at)]

    # ---- tools (MCP) -------------------------------------------------------------------------
    def _init_tools(self, chat: Chat) -> None:
        """Tools (MCP servers): the window hands in the ToolsService, the settings and the model's family."""
        self.tools = None              # app.tools.bridge.ToolsService, or None: no tools offered
        self.tool_settings = None      # the SettingsService (tools_allowed, tools_timeout_s, tools_step_limit)
        self.tool_format = None        # engine.frontends.tool_calls.ToolFormat of the loaded model (None: generic)
        self.tool_choice = "auto"      # the first step of a reply: 'auto', 'required' or {"name": ...}
        self.tool_turn: ToolTurn | None = None   # the calls of a reply being approved or run
        self._plan = None              # the tool plan of the request in flight (engine/frontends/tool_calls.py)
        self._box = None               # the toolbox of that request (function name -> MCP tool)
        self._tool_kw: dict = {}
        self._tool_steps = 0           # tool steps taken by the reply in flight
        self._open_results: set[int] = set()     # tool results shown whole (message indexes)
        self.tool_panel = ToolApproval()
        self.tools_box = QCheckBox("Tools", toolTip="Offer the enabled MCP servers' tools to the model in this chat")
        self.tools_box.setChecked(bool(chat.config.get("tools", True)))
        self.tools_box.toggled.connect(self._on_tools_toggled)

    def _on_tools_toggled(self, on: bool) -> None:
        self.chat.config["tools"] = on
        self.changed.emit()

    def _tool_request(self, messages: list[dict]) -> list[dict]:
        """The messages to send, with this chat's tools planned in (the model's family: tools through its
        template or described in the system prompt; calls and results in its format). Sets the plan."""
        self._plan, self._box, self._tool_kw = None, None, {}
        offered = self.tools is not None and self.tools_box.isChecked()
        box = tool_loop.Toolbox.of(self.tools.tools()) if offered else None
        choice = self.tool_choice if self._tool_steps == 0 else "auto"
        if box is not None and isinstance(choice, dict) and choice.get("name") not in box.functions:
            choice = "auto"
        try:
            p = tool_loop.plan(self.tool_format or tool_loop.tool_format(""), messages, box, choice)
        except tool_loop.tc.ToolError as e:
            self.message.emit(f"Tools not offered: {e}")
            p = tool_loop.plan(self.tool_format or tool_loop.tool_format(""), messages, None)
        if p is None:
            return messages
        self._plan, self._box = p, box
        self._tool_kw = {"tools": p.template_tools, "constraint": p.constraint}
        return p.messages

    def _reply_calls(self, result) -> bool:
        """A reply that calls tools: kept with its calls, and the calls go to approval. False: no calls."""
        p, box = self._plan, self._box
        if p is None or box is None or not p.active:
            return False
        content, calls = tool_loop.reply_calls(result.text, p)
        entries = [tool_loop.call_entry(c, box.functions[c.name], p.fmt) for c in calls if c.name in box.functions]
        if not entries:
            return False
        message = _assistant_message(content, self.think_open)
        message["tool_calls"] = entries
        self._append_reply(message)          # after a Regenerate the replaced reply stays a branch of it
        self._tool_steps += 1
        self._finish()
        self.last_result = result
        self.changed.emit()
        self.stats.emit(result)
        turn = ToolTurn(self.chat.messages, entries, self.tools, self.tool_settings, self.tool_panel, self)
        self.tool_turn = turn
        turn.changed.connect(self._on_turn_changed)
        turn.finished.connect(self._on_turn_finished)
        self._update_buttons()
        turn.start()
        return True

    def _on_turn_changed(self) -> None:
        self.changed.emit()
        self.render_all()

    def _on_turn_finished(self, go_on: bool) -> None:
        """Every call answered: the model continues, unless the reply has taken its steps; or stopped."""
        self.tool_turn = None
        self._update_buttons()
        if not go_on:
            self.message.emit("Stopped")
            return
        limit = tool_loop.DEFAULT_STEP_LIMIT if self.tool_settings is None else int(self.tool_settings.tools_step_limit)
        if self._tool_steps >= limit:
            self.add_note(f"The tools stopped at the limit of {limit} tool steps for one reply (File › Tools…).")
            return
        self._generate()

    def _close_unanswered(self) -> None:
        """Calls left without an answer (the app closed while one waited): answered as stopped, so the
        history stays one every template accepts."""
        for entry in tool_loop.unanswered(self.chat.messages):
            self.chat.messages.append(tool_loop.tool_message(entry, tool_loop.STOPPED, tool_loop.STOPPED_TEXT))

    # ---- title -------------------------------------------------------------------------------
    def request_title(self) -> None:
        """Ask for this chat's title once, as the lowest-priority work (app/titles.py's queue)."""
        first = next((m for m in self.chat.messages if m["role"] == "user"), {})
        # a question of images alone is named by its first image ("beach.jpg"), not left "New chat"
        first_user = first.get("content") or images_named(first.get("images") or [])
        reply = next((m["content"] for m in self.chat.messages if m["role"] == "assistant"), "")
        self._title_asked = self.titles.ask(self, title_messages(first_user, reply), f"title-{self.chat.id}",
                                            lambda text: self._on_title(text, first_user, reply)) or self._title_asked

    def _on_title_started(self, owner, req) -> None:
        if owner is self:
            self.title_request = req
            req.finished.connect(lambda r=req: self._title_request_ended(r))

    def _title_request_ended(self, req) -> None:
        if self.title_request is req:
            self.title_request = None

    def drop_title(self) -> None:
        """The tab goes: a title still queued is not asked for (one running finishes)."""
        self.titles.drop(self)

    def _on_title(self, text: str, first_user: str, reply: str = "") -> None:
        self.title_request = None
        # the reply without its reasoning (gpt-oss's channels, a <think> block): its tokens may be all reasoning
        text = reasoning.split_reply(text, self.think_open).content
        self.set_title(title_for(text, first_user, reply) or DEFAULT_TITLE)

    def set_title(self, title: str) -> None:
        if title != self.chat.title:
            self.chat.title = title
            self.title_changed.emit(title)
            self.changed.emit()
