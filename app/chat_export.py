"""A chat as Markdown or JSON (the chat library's Export). Plain functions of a store Chat.

Markdown: the title as a heading, a line with the model and dates, then each message under a role
heading ("## User", "## Assistant", "## System") with its text verbatim (it is Markdown already), except
that a code fence a message leaves open (a reply cut mid-block) is closed at its end, so the next heading
is not read as code.
Both write the branch shown (app/branches.py); JSON adds every branch as "tree" (Open WebUI's history).
JSON: {"title", "model", "created", "updated", "messages": [{"role", "content"}], "tree": {"messages": {id:
{"id", "parentId", "childrenIds", "role", "content"}}, "currentId"}}, the times as ISO 8601 local time with
the UTC offset. A question sent with documents lists its sources (names, places and the passages it
used) after its text, and as its "documents" in JSON.
A message's images: in Markdown, image links before its text to copies of the files in a folder beside
the export (`<name>_files/`); in JSON, `images: [{"name", "width", "height", "digest", "media_type",
"data"}]` with the file's bytes in base64. An image whose file is gone is said so in place.
Tool calls and results: a reply's calls follow it (tool, server, the arguments as a JSON block), a
tool's answer is its own section in a fence; the JSON keeps their keys.
Any text is written: a lone surrogate (which UTF-8 cannot hold) becomes U+FFFD, as in the store.
"""
from __future__ import annotations

import base64
import json
import mimetypes
import os
import re
import shutil
import tempfile
import urllib.parse
from datetime import datetime
from pathlib import Path

from .branches import tree
from .documents.prompt import export_markdown
from .chat_images import ChatImages, message_images
from .store import Chat, valid_text

ROLE_HEADINGS = {"user": "User", "assistant": "Assistant", "system": "System", "tool": "Tool result"}
# A message's keys the JSON export keeps beside role and content (tool calls and their answers)
TOOL_KEYS = ("tool_calls", "tool_call_id", "name", "status", "server", "tool")
NAME_MAX_BYTES = 255          # UTF-8 bytes: APFS's and Linux's name limit (a name within it fits HFS+ too)
NAME_MAX_CHARS = 80           # a suggested name stays readable in the save dialog
# A fence line as CommonMark reads it: up to 3 spaces, 3 or more backticks or tildes, the rest
_FENCE = re.compile(r"( {0,3})(`{3,}|~{3,})(.*)")


def iso_time(t: float) -> str:
    return datetime.fromtimestamp(t).astimezone().isoformat(timespec="seconds")


def to_markdown(chat: Chat, image_link=None) -> str:
    """`image_link(ref)`: the relative link of a message's image (None: its file is gone)."""
    meta = []
    if chat.model:
        meta.append(f"Model: {chat.model}")
    meta.append(f"Created: {iso_time(chat.created)}")
    meta.append(f"Last used: {iso_time(chat.updated or chat.created)}")
    parts = [f"# {chat.title}", "", " · ".join(meta)]
    for m in chat.messages:
        role = m["role"]
        heading = ROLE_HEADINGS.get(role, role.capitalize())
        if role == "tool":
            heading += f": {m.get('tool') or m.get('name', '')} ({m.get('server', '')}, {m.get('status', 'ran')})"
            parts += ["", f"## {heading}", "", _fenced(m["content"])]
            continue
        parts += ["", f"## {heading}", ""]
        for ref in message_images(m):
            link = image_link(ref) if image_link is not None else None
            name = _md_text(str(ref.get("name") or ref.get("file")))
            parts += [f"![{name}]({link})" if link else f"*[image not found: {name}]*", ""]
        parts.append(close_fence(m["content"]))
        if isinstance(m.get("documents"), list) and m["documents"]:     # the question's sources, quoted
            parts += ["", export_markdown(m["documents"])]
        for call in m.get("tool_calls") or ():
            parts += ["", f"Tool call: `{call.get('tool') or call['function']['name']}` ({call.get('server', '')})", "",
                      _fenced(json.dumps(call["function"]["arguments"], indent=2, ensure_ascii=False), "json")]
    return "\n".join(parts) + "\n"


def _fenced(text: str, info: str = "") -> str:
    """`text` verbatim in a code fence longer than any backtick run in it."""
    run = max((len(r) for r in re.findall(r"`+", text)), default=0)
    fence = "`" * max(3, run + 1)
    return f"{fence}{info}\n{text}\n{fence}"


def close_fence(text: str) -> str:
    """`text` with a fenced code block left open at its end closed by a fence of the same kind and
    length, indented as its opening (so it also closes a fence inside a list item). A fence inside a
    quote or deeper in a list is not looked at: the blank line and heading after a message end those
    containers, and their code with them."""
    opened: tuple[str, str, int] | None = None          # (indent, character, length)
    for line in text.split("\n"):
        m = _FENCE.match(line)
        if m is None:
            continue
        indent, fence, rest = m.groups()
        if opened is None:
            if not (fence[0] == "`" and "`" in rest):    # a backtick in the info string: inline code
                opened = (indent, fence[0], len(fence))
        elif fence[0] == opened[1] and len(fence) >= opened[2] and not rest.strip():
            opened = None
    if opened is None:
        return text
    indent, char, n = opened
    return text + ("" if text.endswith("\n") else "\n") + indent + char * n


def _md_text(name: str) -> str:
    return re.sub(r"([\\\[\]*_`])", r"\\\1", name)


def to_json(chat: Chat, read_image=None) -> str:
    """`read_image(ref)`: a message's image file as bytes (OSError: it is gone)."""
    def message(m: dict) -> dict:
        out = {"role": m["role"], "content": m["content"], **{k: m[k] for k in TOOL_KEYS if k in m}}
        refs = message_images(m)
        if refs:
            out["images"] = [_json_image(r, read_image) for r in refs]
        if isinstance(m.get("documents"), list):
            out["documents"] = m["documents"]
        return out
    return json.dumps({
        "title": chat.title,
        "model": chat.model,
        "created": iso_time(chat.created),
        "updated": iso_time(chat.updated or chat.created),
        "messages": [message(m) for m in chat.messages],
        "tree": tree(chat.messages),
    }, ensure_ascii=False, indent=2) + "\n"


def _json_image(ref: dict, read_image) -> dict:
    name = str(ref.get("name") or ref.get("file"))
    out = {"name": name, "width": ref.get("width"), "height": ref.get("height"), "digest": ref.get("digest"),
           "media_type": mimetypes.guess_type(str(ref.get("file")))[0] or "application/octet-stream"}
    try:
        out["data"] = base64.b64encode(read_image(ref)).decode("ascii")
    except (OSError, ValueError, TypeError):
        out["missing"] = True
    return out


def _image_copier(chat: Chat, path: Path, images: ChatImages | None):
    """The Markdown's image_link: copies each image into `<stem>_files/` beside `path`, once."""
    if images is None or not any(message_images(m) for m in chat.messages):
        return None
    folder = path.parent / f"{path.stem}_files"

    def link(ref: dict) -> str | None:
        src = images.path(chat.id, ref)
        if not src.is_file():
            return None
        folder.mkdir(exist_ok=True)
        dest = folder / src.name
        if not dest.exists():
            shutil.copyfile(src, dest)
        return urllib.parse.quote(f"{folder.name}/{src.name}")
    return link


FORMATS = {"markdown": (to_markdown, ".md"), "json": (to_json, ".json")}


def file_name(chat: Chat, fmt: str, limit: int = NAME_MAX_BYTES) -> str:
    """A file name for the export: the title without characters file systems refuse, at most
    NAME_MAX_CHARS characters and `limit` UTF-8 bytes with its extension (cut at a character boundary:
    300 emoji would be 1,200 bytes, "File name too long")."""
    ext = FORMATS[fmt][1]
    stem = re.sub(r'[\\/:*?"<>|\x00-\x1f\s]+', " ", valid_text(chat.title)).strip(" .")
    stem = stem[:NAME_MAX_CHARS].encode("utf-8")[:limit - len(ext.encode("utf-8"))]
    # "ignore" drops the part of a character the byte cut split; a joiner left at the end goes too
    stem = stem.decode("utf-8", "ignore").rstrip(" .\u200d")
    return (stem or "chat") + ext


def export_chat(chat: Chat, path: str | Path, fmt: str, images: ChatImages | None = None) -> Path:
    """Write `chat` to `path` as `fmt` ("markdown" or "json"), UTF-8, all or nothing (a temporary file
    renamed into place). `images`: where the chat's images are (Markdown copies them beside it)."""
    path = Path(path)
    if fmt == "markdown":
        text = valid_text(to_markdown(chat, _image_copier(chat, path, images)))
    else:
        text = valid_text(to_json(chat, (lambda r: images.read(chat.id, r)) if images is not None else None))
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
