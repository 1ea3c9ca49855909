"""The light/dark/system choice (Settings > Appearance).

`apply(theme)` asks Qt for the colour scheme (QStyleHints.setColorScheme, Qt 6.8+): on macOS and
Windows the platform then draws the whole app, menus and title bars in it. Where the platform takes no
request (many Linux desktops, the offscreen platform of the tests) the app's palette is set instead, so
the choice always shows. "system" gives the choice back to the platform.
"""
from __future__ import annotations

from PySide6.QtCore import Qt
from PySide6.QtGui import QColor, QGuiApplication, QPalette

THEMES = (("System", "system"), ("Light", "light"), ("Dark", "dark"))

_started_with: QPalette | None = None      # the platform's palette, before any choice here
_palette_set = False                       # whether apply() set the app's palette itself


def is_dark(palette: QPalette) -> bool:
    return palette.color(QPalette.ColorRole.Window).lightness() < 128


def current() -> str:
    """"dark" or "light": what the app shows now."""
    return "dark" if is_dark(QGuiApplication.palette()) else "light"


def _palette(dark: bool) -> QPalette:
    R = QPalette.ColorRole
    if dark:
        window, base, alt, text, button, mid = "#2b2b2b", "#1f1f1f", "#303030", "#e6e6e6", "#353535", "#4a4a4a"
        tip_base, tip_text, link = "#3c3c3c", "#f0f0f0", "#7fb0ff"
    else:
        window, base, alt, text, button, mid = "#efefef", "#ffffff", "#f5f5f5", "#1a1a1a", "#e8e8e8", "#b8b8b8"
        tip_base, tip_text, link = "#ffffdc", "#1a1a1a", "#0b57d0"
    p = QPalette()
    for role, colour in ((R.Window, window), (R.WindowText, text), (R.Base, base), (R.AlternateBase, alt),
                         (R.Text, text), (R.Button, button), (R.ButtonText, text), (R.ToolTipBase, tip_base),
                         (R.ToolTipText, tip_text), (R.PlaceholderText, mid), (R.Mid, mid), (R.Link, link),
                         (R.Highlight, "#3d6fd6"), (R.HighlightedText, "#ffffff"), (R.BrightText, "#ff5555")):
        p.setColor(role, QColor(colour))
    for role in (R.WindowText, R.Text, R.ButtonText):
        # greyed-out text stays legible on a button (the border colour `mid` was near-invisible in dark)
        p.setColor(QPalette.ColorGroup.Disabled, role, QColor("#8a8a8a" if dark else "#9a9a9a"))
    return p


def apply(theme: str, app: QGuiApplication | None = None) -> str:
    """Show the app in `theme` ("system", "light" or "dark"); returns what it shows now ("light"/"dark")."""
    global _started_with, _palette_set
    app = app or QGuiApplication.instance()
    if app is None:
        return "light"
    if _started_with is None:
        _started_with = QPalette(app.palette())
    hints = app.styleHints()
    can_ask = hasattr(hints, "setColorScheme")
    if theme not in ("light", "dark"):
        if can_ask:
            hints.unsetColorScheme()
        if _palette_set:
            app.setPalette(_started_with)
            _palette_set = False
        return current()
    if can_ask:
        hints.setColorScheme(Qt.ColorScheme.Dark if theme == "dark" else Qt.ColorScheme.Light)
    if current() != theme:                 # the platform took no request: the palette says it
        app.setPalette(_palette(theme == "dark"))
        _palette_set = True
    return current()
