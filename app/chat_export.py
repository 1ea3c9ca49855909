"""A chat as Markdown or JSON (the chat library's Export). Plain functions of a store Chat.

Markdown: the title as a heading, a line with the model and dates, then each message under a role
heading ("## User", "## Assistant", "## System") with its text verbatim (it is Markdown already).
JSON: {"title", "model", "created", "updated", "messages": [{"role", "content"}]}, the times as ISO 8601
local time with the UTC offset.
"""
from __future__ import annotations

import json
import os
import re
import tempfile
from datetime import datetime
from pathlib import Path

from .store import Chat

ROLE_HEADINGS = {"user": "User", "assistant": "Assistant", "system": "System"}


def iso_time(t: float) -> str:
    return datetime.fromtimestamp(t).astimezone().isoformat(timespec="seconds")


def to_markdown(chat: Chat) -> str:
    meta = []
    if chat.model:
        meta.append(f"Model: {chat.model}")
    meta.append(f"Created: {iso_time(chat.created)}")
    meta.append(f"Last used: {iso_time(chat.updated or chat.created)}")
    parts = [f"# {chat.title}", "", " · ".join(meta)]
    for m in chat.messages:
        role = m["role"]
        parts += ["", f"## {ROLE_HEADINGS.get(role, role.capitalize())}", "", m["content"]]
    return "\n".join(parts) + "\n"


def to_json(chat: Chat) -> str:
    return json.dumps({
        "title": chat.title,
        "model": chat.model,
        "created": iso_time(chat.created),
        "updated": iso_time(chat.updated or chat.created),
        "messages": [{"role": m["role"], "content": m["content"]} for m in chat.messages],
    }, ensure_ascii=False, indent=2) + "\n"


FORMATS = {"markdown": (to_markdown, ".md"), "json": (to_json, ".json")}


def file_name(chat: Chat, fmt: str) -> str:
    """A file name for the export: the title without characters file systems refuse."""
    stem = re.sub(r'[\\/:*?"<>|\x00-\x1f\s]+', " ", chat.title).strip(" .") or "chat"
    return stem[:80] + FORMATS[fmt][1]


def export_chat(chat: Chat, path: str | Path, fmt: str) -> Path:
    """Write `chat` to `path` as `fmt` ("markdown" or "json"), UTF-8, all or nothing (a temporary file
    renamed into place)."""
    text = FORMATS[fmt][0](chat)
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=".strata-export-", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="\n") as f:
            f.write(text)
        os.chmod(tmp, 0o644)              # mkstemp's file is private; an export is an ordinary file
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path
