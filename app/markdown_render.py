"""Render a message into a QTextDocument at a cursor: Markdown prose (Qt's own parser) and fenced
code blocks highlighted with Pygments, each with a "Copy code" link. Colours come from the palette
(the code style is picked by whether the palette is dark).

Text is text: raw HTML in a reply is read as text (MarkdownNoHTML: `<div>` is shown, never inserted as
HTML, which dropped what followed it), links come only from Markdown; a user's message is not Markdown
at all but shown exactly as typed (`insert_plain`). Each part starts in a block of its own with the
default formats (`new_block`), so no list, quote, code block, table or heading of one message carries
into the next.

A single line break inside a paragraph is kept, as chat apps do (Markdown itself would join the lines:
a poem became one paragraph): `keep_line_breaks` turns it into a line separator (U+2028, a break
within the paragraph, no paragraph spacing) wherever the next line does not start a block of its own."""
from __future__ import annotations

import html
import re

from PySide6.QtGui import QPalette, QTextBlockFormat, QTextCharFormat, QTextCursor, QTextDocument
from PySide6.QtWidgets import QApplication

# GitHub's dialect (tables, strikethrough, task lists, autolinks), raw HTML read as text
MARKDOWN = QTextDocument.MarkdownFeature.MarkdownDialectGitHub | QTextDocument.MarkdownFeature.MarkdownNoHTML
FENCE = re.compile(r"^```[ \t]*([\w+#.-]*)[^\n]*\n(.*?)(?:^```[ \t]*$|\Z)", re.S | re.M)
LINE_BREAK = "\u2028"          # Qt: a line break inside the paragraph (HTML's <br>)
# A line that starts a block of its own (or ends one), so the line break before it stays Markdown's:
# list items, headings, quotes, fences, setext underlines / rules, tables, indented code (HTML is text).
_BLOCK_START = re.compile(r" {0,3}(?:[-*+][ \t]|\d{1,9}[.)](?:[ \t]|$)|#{1,6}(?:[ \t]|$)|>|```|~~~|\|"
                          r"|=+[ \t]*$|-+[ \t]*$|(?:[*_-][ \t]*){3,}$)")
_TABLE_DELIM = re.compile(r" {0,3}\|?[ \t]*:?-+:?[ \t]*(?:\|[ \t]*:?-+:?[ \t]*)*\|?[ \t]*$")
_FENCE_LINE = re.compile(r" {0,3}(?:```|~~~)")
_QUOTE = re.compile(r"( {0,3}(?:>[ \t]?)*)(.*)", re.S)       # (the quote markers, the rest)
_HEADING = re.compile(r" {0,3}#{1,6}(?:[ \t]|$)")
_RULE = re.compile(r" {0,3}(?:=+|-+|(?:[*_-][ \t]*){3,})[ \t]*$")    # a rule or a setext underline
_INDENTED = re.compile(r"(?: {4}|\t)")


def keep_line_breaks(md: str) -> str:
    """`md` with each single line break inside a paragraph (or a quote's) made a real one (LINE_BREAK).
    Left alone: blank lines (paragraphs), lines inside fenced or indented code, heading, rule and table
    lines, a break already hard (two spaces or a backslash), and the break before a line that starts a
    block."""
    lines = md.split("\n")
    out: list[str] = []
    in_fence = in_indented = joined = False
    prev_blank = True
    for i, line in enumerate(lines):
        if joined and not line[:1].isalpha():   # the rest of a joined line: no quote marker, no indent
            line = _QUOTE.match(line).group(2).lstrip(" \t")
        if line[:1].isalpha():
            in_indented = False
        elif _FENCE_LINE.match(line):
            in_fence = not in_fence
        elif not in_fence:
            if prev_blank and _INDENTED.match(line):
                in_indented = True
            elif line.strip() and not _INDENTED.match(line):
                in_indented = False
        joined = i + 1 < len(lines) and not in_fence and not in_indented and _joins(line, lines[i + 1])
        out.append(line + (LINE_BREAK if joined else "\n" if i + 1 < len(lines) else ""))
        prev_blank = not line.strip()
    return "".join(out)


def _joins(line: str, nxt: str) -> bool:
    """Whether the break between `line` and `nxt` is a soft break inside a paragraph: the same quote
    depth, neither blank, `line` no heading, rule or fence, `nxt` no start of a block, no table."""
    if line[:1].isalpha() and nxt[:1].isalpha():        # prose (most lines): no marker, no block start
        return not line.endswith(("  ", "\\")) and not ("|" in line and "|" in nxt)
    (q1, line), (q2, nxt) = _QUOTE.match(line).groups(), _QUOTE.match(nxt).groups()
    if q1.count(">") != q2.count(">") or not line.strip() or not nxt.strip():
        return False
    if line.endswith(("  ", "\\")) or _FENCE_LINE.match(line) or _HEADING.match(line) or _RULE.match(line):
        return False
    if _BLOCK_START.match(nxt) or _TABLE_DELIM.match(nxt) or ("|" in line and "|" in nxt):
        return False
    return True


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
        # lazy: pygments is optional (without it code shows as plain text) and only code blocks need it
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


def new_block(cursor: QTextCursor) -> None:
    """Move `cursor` to the end of the document and start a block of the default formats there (the
    first block: only the character format reset): nothing of what came before (a list, a quote, a code
    block, a table, a heading, a link) carries into what is inserted next. The end of the document is
    always in its root frame, after any table."""
    cursor.movePosition(QTextCursor.MoveOperation.End)
    if cursor.position() == 0:
        cursor.setCharFormat(QTextCharFormat())
        return
    cursor.insertBlock(QTextBlockFormat(), QTextCharFormat())


def insert_plain(cursor: QTextCursor, text: str, fmt: QTextCharFormat | None = None) -> None:
    """`text` exactly as it is (no Markdown, no HTML), in blocks of its own: a user's message."""
    new_block(cursor)
    cursor.insertText(text.replace("\r\n", "\n"), fmt or QTextCharFormat())


def insert_message_body(cursor: QTextCursor, text: str, code_store: list[str]) -> None:
    """Insert the rendered text at the end of the document, in blocks of its own; code blocks are
    appended to `code_store` (copy links)."""
    pal = QApplication.palette()
    code_bg = pal.color(QPalette.ColorRole.AlternateBase).name()
    link = pal.color(QPalette.ColorRole.Link).name()
    for kind, lang, body in split_blocks(text):
        if kind == "md":
            if body.strip():
                new_block(cursor)
                cursor.insertMarkdown(keep_line_breaks(body), MARKDOWN)
            continue
        code_store.append(body)
        label = html.escape(lang or "code")
        new_block(cursor)
        cursor.insertHtml(
            f'<table width="100%" cellpadding="6" cellspacing="0" bgcolor="{code_bg}"><tr><td>'
            f'<span style="font-size:small">{label} · <a style="color:{link}" '
            f'href="copycode:{len(code_store) - 1}">Copy code</a></span>'
            f'<pre style="font-family:monospace">{highlight(body, lang)}</pre></td></tr></table>')
        cursor.movePosition(QTextCursor.MoveOperation.End)
