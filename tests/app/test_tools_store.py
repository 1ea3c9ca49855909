"""Tool calls and results in the saved chat: the store keeps them (real SQLite file), the library's
search finds a chat by a tool's name, its arguments or its result (the index as written and as
rebuilt), the Markdown/JSON export holds them, and a reopened chat shows them."""
from __future__ import annotations

import json
import sqlite3

from PySide6.QtCore import QUrl

from app.chat_export import to_json, to_markdown
from app.store import Chat, Store

CALL = {"id": "call_1", "type": "function", "function": {"name": "lookup", "arguments": {"city": "Reykjavik"}},
        "server": "geo", "tool": "lookup"}
RESULT = {"role": "tool", "tool_call_id": "call_1", "name": "lookup", "content": "line one\nline two\nline three\n"
          "line four\nfjord weather: windy", "status": "ran", "server": "geo", "tool": "lookup"}


def tool_chat() -> Chat:
    return Chat(title="Trip", messages=[
        {"role": "user", "content": "How is the weather?"},
        {"role": "assistant", "content": "", "tool_calls": [dict(CALL)]},
        dict(RESULT),
        {"role": "assistant", "content": "Windy."}])


def test_calls_and_results_round_trip_and_are_searchable(tmp_path):
    st = Store(tmp_path / "c.sqlite3")
    chat = tool_chat()
    st.save_chat(chat)
    st.save_chat(Chat(title="Other", messages=[{"role": "user", "content": "nothing here"}]))
    assert st.chat(chat.id).messages == chat.messages
    for words in ("reykjavik", "lookup", "fjord windy"):        # an argument, the tool, the result
        assert [s.id for s in st.search(words)] == [chat.id], words
    st.close()
    # the index dropped (damaged, say) is built again from the stored messages, calls included
    db = sqlite3.connect(tmp_path / "c.sqlite3")
    db.execute("DROP TABLE chats_fts")
    db.commit()
    db.close()
    again = Store(tmp_path / "c.sqlite3")
    assert [s.id for s in again.search("reykjavik")] == [chat.id]
    assert again.chat(chat.id).messages[2] == RESULT
    again.close()


def test_export_holds_calls_and_results():
    chat = tool_chat()
    md = to_markdown(chat)
    assert "Tool call: `lookup` (geo)" in md and '"city": "Reykjavik"' in md
    assert "## Tool result: lookup (geo, ran)" in md and "fjord weather: windy" in md
    data = json.loads(to_json(chat))["messages"]
    assert data[1]["tool_calls"] == [CALL] and data[2] == RESULT


def test_a_reopened_chat_shows_calls_and_results_collapsed(qtbot, idle_window, fake_client):
    from app.chat_view import ChatView
    view = ChatView(tool_chat(), fake_client, idle_window.presets)
    qtbot.addWidget(view)
    view.render_all()
    text = view.transcript_text()
    assert "Tool call: lookup (geo)" in text and '"city": "Reykjavik"' in text
    assert "result of lookup (geo)" in text and "line three" in text
    assert "fjord weather" not in text and "Show all (5 lines)" in text      # collapsed to its first lines
    view.transcript.anchorClicked.emit(QUrl("toolresult:2"))                # the Show all link
    assert "fjord weather: windy" in view.transcript_text() and "Show less" in view.transcript_text()
