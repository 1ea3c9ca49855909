"""Render a message into a QTextDocument at a cursor: Markdown prose (Qt's own parser) and fenced
code blocks highlighted with Pygments, each with a "Copy code" link. Colours come from the palette
(the code style is picked by whether the palette is dark)."""
from __future__ import annotations

import html
import re

from PySide6.QtGui import QPalette, QTextCursor, QTextDocument
from PySide6.QtWidgets import QApplication

FENCE = re.compile(r"^```[ \t]*([\w+#.-]*)[^\n]*\n(.*?)(?:^```[ \t]*$|\Z)", re.S | re.M)


def split_blocks(text: str) -> list[tuple[str, str, str]]:
    """[(kind, lang, body)]: kind "md" or "code"; an unclosed fence (still streaming) runs to the end."""
    out, pos = [], 0
    for m in FENCE.finditer(text):
        if m.start() > pos:
            out.append(("md", "", text[pos:m.start()]))
        out.append(("code", m.group(1), m.group(2).rstrip("\n")))
        pos = m.end()
    if pos < len(text):
        out.append(("md", "", text[pos:]))
    return out


def is_dark(palette: QPalette | None = None) -> bool:
    pal = palette or QApplication.palette()
    return pal.color(QPalette.ColorRole.Window).lightness() < 128


def highlight(code: str, lang: str) -> str:
    """Pygments HTML (inline styles) for the code, without a wrapper."""
    try:
        from pygments import highlight as pyg
        from pygments.formatters import HtmlFormatter
        from pygments.lexers import TextLexer, get_lexer_by_name, guess_lexer
        try:
            lexer = get_lexer_by_name(lang) if lang else guess_lexer(code)
        except Exception:  # noqa: BLE001 - unknown language: plain text
            lexer = TextLexer()
        style = "monokai" if is_dark() else "default"
        return pyg(code, lexer, HtmlFormatter(noclasses=True, nowrap=True, style=style))
    except ImportError:
        return html.escape(code)


def insert_message_body(cursor: QTextCursor, text: str, code_store: list[str]) -> None:
    """Insert the rendered text at the cursor; code blocks are appended to `code_store` (copy links)."""
    pal = QApplication.palette()
    code_bg = pal.color(QPalette.ColorRole.AlternateBase).name()
    link = pal.color(QPalette.ColorRole.Link).name()
    for kind, lang, body in split_blocks(text):
        if kind == "md":
            if body.strip():
                cursor.insertMarkdown(body, QTextDocument.MarkdownFeature.MarkdownDialectGitHub)
            continue
        code_store.append(body)
        label = html.escape(lang or "code")
        cursor.insertBlock()
        cursor.insertHtml(
            f'<table width="100%" cellpadding="6" cellspacing="0" bgcolor="{code_bg}"><tr><td>'
            f'<span style="font-size:small">{label} · <a style="color:{link}" '
            f'href="copycode:{len(code_store) - 1}">Copy code</a></span>'
            f'<pre style="font-family:monospace">{highlight(body, lang)}</pre></td></tr></table>')
        cursor.movePosition(QTextCursor.MoveOperation.End)
