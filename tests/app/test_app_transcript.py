"""The transcript: text is text, and each message is rendered on its own.

- A user's message is shown exactly as typed: `What does the <div> tag do?` is not cut after "the", a
  lone `<` or `>` is itself, `&amp;` stays `&amp;`, `*stars*` stay stars (a message is not Markdown).
- A reply is Markdown whose raw HTML is text: `<script>`, `<!--` and tags are shown, never interpreted;
  links come only from Markdown. The reasoning block is text too.
- A reply that ends in a list, a quote, an open code fence or a table leaks none of it into the messages
  after it: the You/Assistant headers and later messages are in no list, quote, table or code block,
  also when the transcript is rendered again (a restart) and while a reply streams in.
"""
from __future__ import annotations

import os

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

import pytest  # noqa: E402
from PySide6.QtCore import QUrl  # noqa: E402
from PySide6.QtGui import QTextBlock, QTextCursor, QTextDocument, QTextFormat  # noqa: E402

from app_fixtures import REPLY_TIMEOUT_MS, send_and_wait  # noqa: E402
from engine import api  # noqa: E402
from fake_engine import FakeClient  # noqa: E402

pytestmark = pytest.mark.gui

TYPED = ["What does the <div> tag do?", "<script>alert(1)</script> and after it", "<!-- a comment that never ends",
         "&amp; &lt;b&gt; &#60; &copy;", "<", ">", "a < b > c", '<b>bold?</b> <a href="https://x.test">link</a>',
         "<img src=x onerror=alert(1)>", "line one <br> still\nline two <p>", "<style>p{}</style>rest",
         "<![CDATA[ x ]]> <?php echo 1; ?> </div>", "*not emphasis* # not a heading\n1. not a list\n> not a quote",
         "  indented\n\n\ntwo blank lines above"]

# (a reply, the text its Markdown renders): raw HTML is text, entities and Markdown are Markdown's
REPLIES = [
    ("What does the <div> tag do?", "What does the <div> tag do?"),
    ("Use it like <script>alert(1)</script> here", "Use it like <script>alert(1)</script> here"),
    ("<!-- not a comment\nthe next line", "<!-- not a comment\nthe next line"),
    ("&amp; is an entity, &lt;b&gt; too", "& is an entity, <b> too"),
    ("<", "<"),
    ("x < y and y > z", "x < y and y > z"),
    ('<a href="https://evil.test">click</a>', '<a href="https://evil.test">click</a>'),
    ("<b>not bold</b> but **bold**", "<b>not bold</b> but bold"),
    ("[a link](https://example.com) and `<code>`", "a link and <code>"),
]


def _view(idle_window, messages: list[dict] | None = None):
    view = idle_window.tabs.current_view()
    view.client = FakeClient()
    if messages is not None:
        view.chat.messages = messages
        view.render_all()
    return view


def _blocks(view) -> list[QTextBlock]:
    doc = view.transcript.document()
    out, b = [], doc.begin()
    while b.isValid():
        out.append(b)
        b = b.next()
    return out


def _anchors(block: QTextBlock) -> list[str]:
    return [r.format.anchorHref() for r in block.textFormats() if r.format.isAnchor()]


STREAMING = -1


def _messages(view) -> dict[int, tuple[QTextBlock, list[QTextBlock]]]:
    """Each shown message's header block and the blocks after it, up to the next header: found by the
    header's own Copy link (copy:i); the reply streaming in (a header without links) as STREAMING."""
    out: dict[int, tuple[QTextBlock, list[QTextBlock]]] = {}
    current = None
    for b in _blocks(view):
        copy = [a for a in _anchors(b) if a.startswith("copy:")]
        if copy or (b.text() == "Assistant" and view.streaming is not None):
            current = int(copy[0].split(":")[1]) if copy else STREAMING
            out[current] = (b, [])
        elif current is not None and b.text() not in view.notes:     # a note (token limit) is no message's
            out[current][1].append(b)
    return out


def _text(blocks: list[QTextBlock]) -> str:
    # toPlainText's reading: a line separator inside a paragraph (a kept line break) is a newline
    return "\n".join(b.text() for b in blocks).replace("\u2028", "\n")


def _structure(block: QTextBlock) -> list[str]:
    """What of a list, quote, table, heading or code block the block is in (empty for plain text)."""
    fmt = block.blockFormat()
    found = []
    if block.textList() is not None:
        found.append(f"list item {block.textList().itemNumber(block) + 1}")
    if fmt.intProperty(QTextFormat.Property.BlockQuoteLevel) or fmt.indent():
        found.append("quote/indent")
    if QTextCursor(block).currentTable() is not None:
        found.append("table")
    if fmt.headingLevel():
        found.append("heading")
    if fmt.hasProperty(QTextFormat.Property.BlockCodeFence) or fmt.nonBreakableLines():
        found.append("code")
    if any(r.format.fontFixedPitch() for r in block.textFormats()):
        found.append("monospace")
    return found


# ---- text is text ------------------------------------------------------------------------------------
def test_typed_messages_are_shown_exactly_as_typed(qtbot, idle_window):
    """Each message sent through the prompt box (Enter) shows its text exactly, headers and all."""
    view = _view(idle_window)
    view.client.answers["generate"] = api.Generation(text="ok", finish_reason="stop")
    for typed in TYPED:
        with qtbot.waitSignal(view.stats, timeout=5000):
            view.input.setPlainText(typed)
            view.send_input()
    shown = _messages(view)
    users = [i for i, m in enumerate(view.chat.messages) if m["role"] == "user"]
    assert [view.chat.messages[i]["content"] for i in users] == [t.strip() for t in TYPED]
    for i, typed in zip(users, TYPED):
        header, body = shown[i]
        assert header.text().startswith("You"), header.text()
        assert _text(body) == typed.strip(), (typed, _text(body))
        assert all(_structure(b) == [] for b in body), (typed, [_structure(b) for b in body])
        assert _anchors(header) == [f"copy:{i}", f"edit:{i}", f"fork:{i}"] and not any(_anchors(b) for b in body)
    plain = view.transcript_text()
    assert all(t.strip() in plain for t in TYPED)


def test_replies_render_markdown_with_html_as_text(qtbot, idle_window):
    messages = []
    for reply, _ in REPLIES:
        messages += [{"role": "user", "content": "?"}, {"role": "assistant", "content": reply}]
    view = _view(idle_window, messages)
    shown = _messages(view)
    for n, (reply, expected) in enumerate(REPLIES):
        header, body = shown[2 * n + 1]
        assert header.text().startswith("Assistant")
        assert _text(body) == expected, (reply, _text(body))
        assert all(_structure(b) in ([], ["monospace"]) for b in body), reply
    # links only where Markdown makes them: the raw <a href> is text, the [link](...) is a link
    hrefs = {a for b in _blocks(view) for a in _anchors(b)}
    assert "https://evil.test" not in hrefs and "https://x.test" not in hrefs
    assert {a for a in hrefs if "://" in a} == {"https://example.com"}


def test_a_replys_reasoning_is_text(qtbot, idle_window):
    thought = "Is <div> a tag? <!-- maybe\n&amp; **not bold** <script>x</script>"
    view = _view(idle_window, [{"role": "user", "content": "?"},
                               {"role": "assistant", "content": "Yes.", "reasoning": thought}])
    view._on_anchor(QUrl("reasoning:1"))                # Show
    header, body = _messages(view)[1]
    assert body[0].text().startswith("Reasoning (") and _anchors(body[0]) == ["reasoning:1"]
    assert _text(body[1:]) == thought + "\nYes."


def test_a_real_reply_to_a_message_with_tags_keeps_both(qtbot, window):
    """The journey on the real engine: the typed message exactly, the reply as its own Markdown alone."""
    from PySide6.QtGui import QTextDocument as Doc

    from app.markdown_render import insert_message_body
    view = window.tabs.current_view()
    for typed in ("What does the <div> tag do?", "<", "&amp; <!-- >"):
        send_and_wait(qtbot, view, typed)
        shown = _messages(view)
        i = len(view.chat.messages) - 2
        assert _text(shown[i][1]) == typed
        alone = Doc()
        insert_message_body(QTextCursor(alone), view.chat.messages[i + 1]["content"], [])
        assert _text(shown[i + 1][1]).strip("\n") == alone.toPlainText().replace("\u2028", "\n").strip("\n")


# ---- each message on its own ---------------------------------------------------------------------------
ENDINGS = {
    "list": ("Three tips:\n\n1. Read code\n2. Write code\n3. Run it", "Three tips:\nRead code\nWrite code\nRun it"),
    "quote": ("As they say:\n\n> Practice\n> every day", "As they say:\nPractice\nevery day"),
    "open fence": ("Try this:\n\n```python\nfor i in range(3):\n    print(i)", None),
    "table": ("Compare:\n\n| a | b |\n|---|---|\n| 1 | 2 |", None),
    "heading": ("# Big heading", "Big heading"),
    "bullets and a nested quote": ("- one\n  > deep\n- two", None),
}


def _conversation() -> list[dict]:
    msgs = []
    for name, (reply, _) in ENDINGS.items():
        msgs += [{"role": "user", "content": f"Tell me ({name})"}, {"role": "assistant", "content": reply},
                 {"role": "user", "content": f"And after the {name}?"},
                 {"role": "assistant", "content": f"Plain words after the {name}."}]
    return msgs


def _check_nothing_leaks(view) -> None:
    shown = _messages(view)
    msgs = view.chat.messages
    assert sorted(shown) == list(range(len(msgs))), sorted(shown)
    for i, m in enumerate(msgs):
        header, body = shown[i]
        who = "You" if m["role"] == "user" else "Assistant"
        assert header.text().startswith(who) and _structure(header) == [], (i, header.text(), _structure(header))
        if m["content"].startswith(("Tell me", "And after", "Plain words")):
            assert _text(body) == m["content"], (i, _text(body))
            assert all(_structure(b) == [] for b in body), (i, m["content"], [_structure(b) for b in body])
    for name, (reply, expected) in ENDINGS.items():
        i = next(k for k, m in enumerate(msgs) if m["content"] == reply)
        body = shown[i][1]
        if expected is not None:
            assert _text(body) == expected, (name, _text(body))
    # the list reply's list holds its three items and nothing after them
    i = next(k for k, m in enumerate(msgs) if m["content"] == ENDINGS["list"][0])
    lists = {b.textList() for b in shown[i][1] if b.textList() is not None}
    assert len(lists) == 1 and lists.pop().count() == 3
    assert [_structure(b) for b in shown[i][1] if b.text() == "Run it"] == [["list item 3"]]
    # the quote and the table are there, in their own reply only
    i = next(k for k, m in enumerate(msgs) if m["content"] == ENDINGS["quote"][0])
    assert [b.text() for b in shown[i][1] if _structure(b) == ["quote/indent"]] == ["Practice\u2028every day"]
    i = next(k for k, m in enumerate(msgs) if m["content"] == ENDINGS["table"][0])
    assert [b.text() for b in shown[i][1] if "table" in _structure(b)] == ["a", "b", "1", "2"]
    i = next(k for k, m in enumerate(msgs) if m["content"] == ENDINGS["open fence"][0])
    assert "for i in range(3):\n    print(i)" in _text(shown[i][1])


def test_a_reply_ending_in_a_list_quote_fence_or_table_leaks_into_nothing_after_it(qtbot, idle_window):
    view = _view(idle_window, _conversation())
    _check_nothing_leaks(view)
    first = view.transcript.document().toHtml()
    view.render_all()                                   # as after a restart: the same transcript again
    _check_nothing_leaks(view)
    assert view.transcript.document().toHtml() == first


@pytest.mark.parametrize("name", list(ENDINGS))
def test_each_ending_alone_leaks_into_nothing_after_it(qtbot, idle_window, name):
    reply = ENDINGS[name][0]
    view = _view(idle_window, [{"role": "user", "content": "Tell me"}, {"role": "assistant", "content": reply},
                               {"role": "user", "content": "And after?"}, {"role": "assistant", "content": "Plain."}])
    shown = _messages(view)
    for i in (2, 3):
        header, body = shown[i]
        assert _structure(header) == [] and [_structure(b) for b in body] == [[]], (name, i)
        assert _text(body) == view.chat.messages[i]["content"]


def test_nothing_leaks_while_a_reply_streams_or_after_it(qtbot, idle_window):
    """Replies ending in each construct, sent and streamed in token by token, then more messages."""
    view = _view(idle_window)
    for name, (reply, _) in ENDINGS.items():
        for text, answer in ((f"Tell me ({name})", reply), (f"And after the {name}?", f"Plain words after the {name}.")):
            view.client.answers["generate"] = api.Generation(text=answer, finish_reason="stop")
            with qtbot.waitSignal(view.stats, timeout=5000):
                view.send(text)
                for k in range(0, len(answer), 7):        # stream it: each piece rendered as it comes
                    view._on_token(answer[k:k + 7])
                    view._render_tail()
                    shown = _messages(view)
                    header, body = shown[len(view.chat.messages) - 1]
                    assert _structure(header) == [] and _text(body) == text
                    assert _structure(shown[STREAMING][0]) == []
    _check_nothing_leaks(view)


def test_a_stored_chat_with_a_list_reply_reopens_clean(qtbot, idle_window, tmp_path):
    """The chat saved and read back from the store (as at the next start) renders the same, clean."""
    from app.store import Store
    st = Store(tmp_path / "chats.sqlite3")
    view = _view(idle_window, _conversation())
    st.save_chat(view.chat)
    view.chat = st.chat(view.chat.id)
    st.close()
    view.render_all()
    _check_nothing_leaks(view)


def test_a_document_alone_renders_as_in_the_transcript(qapp):
    """The Markdown features are GitHub's with HTML off: a table still renders, a tag does not."""
    from app.markdown_render import MARKDOWN
    doc = QTextDocument()
    doc.setMarkdown("| a |\n|---|\n| <b>x</b> |", MARKDOWN)
    assert "<b>x</b>" in doc.toPlainText() and "<table" in doc.toHtml()
