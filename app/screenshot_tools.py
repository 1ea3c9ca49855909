"""A screenshot of a tool call waiting for approval: `python -m app.screenshot_tools OUTDIR`.

The chat holds a reply's call as the tool loop stores it (an assistant message with `tool_calls`), and
the chat tab's approval panel asks about it, as it does when a model makes that call: the tool, its
server, the arguments as editable JSON, Run / Deny / Always allow. No engine or MCP server runs (the
panel is the same either way), so it works anywhere: run it offscreen (QT_QPA_PLATFORM=offscreen) with
a STRATA_HOME of its own. Writes OUTDIR/screenshot-tools.png.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from PySide6.QtCore import QTimer

from .main import make_app
from .tools.results import ToolInfo
from .window import MainWindow

CALL = {"id": "call_7Qx2", "type": "function", "server": "files", "tool": "search_files",
        "function": {"name": "search_files", "arguments": {"path": "~/Downloads", "pattern": "*.pdf",
                                                           "modified_within_days": 7}}}
INFO = ToolInfo("files", "search_files", "Find files under a folder whose names match a pattern.",
                {"type": "object", "properties": {"path": {"type": "string"}, "pattern": {"type": "string"},
                                                  "modified_within_days": {"type": "integer"}},
                 "required": ["path", "pattern"]}, read_only=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m app.screenshot_tools")
    ap.add_argument("outdir")
    args = ap.parse_args(argv)
    out = Path(args.outdir)
    out.mkdir(parents=True, exist_ok=True)
    app = make_app(sys.argv[:1])
    w = MainWindow(offer_fetch=False, start_engine=False)
    w.resize(1280, 800)
    w.show()
    view = w.current_view() or w.new_tab()
    view.chat.title = "Recent PDFs"
    view.chat.messages[:] = [{"role": "user", "content": "Which PDFs did I download this week?"},
                             {"role": "assistant", "content": "", "tool_calls": [CALL]}]
    view.render_all()
    view.tool_panel.ask(CALL, INFO)

    def grab():
        w.grab().save(str(out / "screenshot-tools.png"))
        print("wrote", out / "screenshot-tools.png", flush=True)
        w.close()
        app.quit()
    QTimer.singleShot(700, grab)
    app.exec()
    w.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
