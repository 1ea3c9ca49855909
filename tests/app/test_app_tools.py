"""Tools in the chat, end to end: the real window on the real engine (a tiny GGUF) with a real MCP
server (tests/mcp/tool_server.py over stdio, enabled in the data folder's mcp.json). The model's first
call is forced by the grammar (ChatView.tool_choice: engine/frontends/tool_calls.py's forced call, as the
server's tool_choice), so a random tiny model still makes a valid one; what follows is the app's own
loop: the approval with the arguments editable, Run, the result shown and sent back, the model's
continuation; Deny; Always allow then revoke; a timeout; a crashed server; Stop mid-call; saved,
reopened and exported."""
from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "mcp"))

from gguf_factory import write_tiny_gguf                                   # noqa: E402
from app_fixtures import LOAD_TIMEOUT_MS, REPLY_TIMEOUT_MS, open_window   # noqa: E402
from servers import http_server, stdio_config                             # noqa: E402

from app.tools.config import write_config                                 # noqa: E402
from app.tools.loop import DENIED_TEXT, STOPPED_TEXT                      # noqa: E402

CALL_MS = 60_000           # a hang bound for a tool call or a server start, not a timing


@pytest.fixture(scope="module")
def long_tiny_model(tmp_path_factory):
    """The tiny model with room for a few tool steps: the tools' descriptions alone take ~1,000 of its
    byte-sized tokens, and a random model's continuations run to max_tokens."""
    return write_tiny_gguf(tmp_path_factory.mktemp("tiny-8k") / "tiny-llama.gguf", arch="llama", n_layer=2,
                           n_embd=64, context_length=8192)


@pytest.fixture
def tool_window(qtbot, app_home, long_tiny_model):
    from app import settings
    for old in (app_home / "models").glob("*.gguf"):
        old.unlink()
    shutil.copyfile(long_tiny_model, app_home / "models" / long_tiny_model.name)
    s = settings.load()
    s.sampling.max_tokens = 120         # room for a forced call's JSON (the tiny model writes ~1 character a token)
    settings.save(s)
    write_config(app_home / "mcp.json", [stdio_config("t")])
    w = open_window(qtbot)
    with qtbot.waitSignal(w.library.loaded, timeout=LOAD_TIMEOUT_MS):
        w.show()
    qtbot.waitUntil(lambda: w.tools.state("t").status == "ready", timeout=CALL_MS)
    yield w
    w.close()


def ask(qtbot, view, text: str, tool: str):
    """Send `text` with the model's first call forced to `tool`; returns once the approval shows (or,
    for an allowed tool, once the call ran)."""
    view.tool_choice = {"name": tool}
    view.send(text)


def ask_in_new_tab(qtbot, w, text: str, tool: str):
    """A new chat asking `text` with the call forced to `tool`; returns its view once the approval shows."""
    view = w.new_tab()
    with qtbot.waitSignal(view.tool_panel.asked, timeout=REPLY_TIMEOUT_MS):
        ask(qtbot, view, text, tool)
    return view


def wait_idle(qtbot, view):
    qtbot.waitUntil(lambda: not view.busy, timeout=REPLY_TIMEOUT_MS)


def tool_messages(view):
    return [m for m in view.chat.messages if m["role"] == "tool"]


def test_approve_with_edited_arguments_runs_and_the_model_continues(qtbot, tool_window):
    w = tool_window
    view = w.new_tab()
    panel = view.tool_panel
    kv = []                   # each request's K/V figures (engine.events.KVChanged, through the view)
    view.live_figures.connect(lambda f: kv.append((f["prompt_tokens"], f["cached_tokens"])) if "cached_tokens" in f else None)
    with qtbot.waitSignal(panel.asked, timeout=REPLY_TIMEOUT_MS) as asked:
        ask(qtbot, view, "What is 2 plus 40?", "add")
    entry = asked.args[0]
    assert entry["server"] == "t" and entry["tool"] == "add" and set(entry["function"]["arguments"]) == {"a", "b"}
    assert panel.isVisible() and "add" in panel.title.text() and "<b>t</b>" in panel.title.text()
    assert json.loads(panel.args.toPlainText()) == entry["function"]["arguments"]     # formatted, editable
    assert view.busy and view.stop_btn.isEnabled() and not view.send_btn.isEnabled()
    assert "Tool call:" in view.transcript_text() and "add" in view.transcript_text()
    # arguments that break the schema are refused in the panel, nothing runs
    panel.args.setPlainText('{"a": "two", "b": 40}')
    panel.run_btn.click()
    assert panel.error.isVisible() and "expected integer" in panel.error.text() and not tool_messages(view)
    panel.args.setPlainText('{"a": 2, "b": 40}')
    panel.run_btn.click()
    qtbot.waitUntil(lambda: len(tool_messages(view)) == 1, timeout=CALL_MS)
    wait_idle(qtbot, view)
    call_msg, result, final = view.chat.messages[1], view.chat.messages[2], view.chat.messages[3]
    assert call_msg["role"] == "assistant" and call_msg["tool_calls"][0]["function"]["arguments"] == {"a": 2, "b": 40}
    assert result == {"role": "tool", "tool_call_id": call_msg["tool_calls"][0]["id"], "name": "add",
                      "content": "42", "status": "ran", "server": "t", "tool": "add"}
    assert final["role"] == "assistant" and not final.get("tool_calls")       # the model continued
    assert len(view.chat.messages) == 4 and panel.isHidden()
    # the continuation took the conversation's K/V: the whole first prompt (and the call) was not read again
    first, cont = list(dict.fromkeys(kv))
    assert cont[0] > first[0] and cont[1] >= first[0]
    text = view.transcript_text()
    assert "result of add (t)" in text and "42" in text and '"b": 40' in text
    # saved: a reopened chat shows the call and its result; the export has them
    w.tabs.store.save_chat(view.chat)
    stored = w.tabs.store.chat(view.chat.id)
    assert stored.messages[1]["tool_calls"] == call_msg["tool_calls"] and stored.messages[2] == result
    from app.chat_export import to_json, to_markdown
    md = to_markdown(stored)
    assert "## Tool result: add (t, ran)" in md and "Tool call: `add` (t)" in md and '"a": 2' in md
    assert json.loads(to_json(stored))["messages"][2]["tool_call_id"] == result["tool_call_id"]


def test_deny_sends_a_declined_result(qtbot, tool_window):
    view = ask_in_new_tab(qtbot, tool_window, "Add 1 and 1", "add")
    view.tool_panel.deny_btn.click()
    wait_idle(qtbot, view)
    (denied,) = tool_messages(view)
    assert denied["status"] == "denied" and denied["content"] == DENIED_TEXT
    assert view.chat.messages[-1]["role"] == "assistant"           # the model was told, and went on
    assert "denied of add (t)" in view.transcript_text()
    # Regenerate replaces the whole reply, its call and the call's answer included
    view.tool_choice = "auto"
    view.regenerate()
    wait_idle(qtbot, view)
    assert [m["role"] for m in view.chat.messages] == ["user", "assistant"] and not tool_messages(view)


def test_regenerate_into_a_tool_call_keeps_the_replaced_reply_as_a_branch(qtbot, tool_window):
    from app import branches
    view = ask_in_new_tab(qtbot, tool_window, "Add 1 and 1", "add")
    view.tool_panel.deny_btn.click()
    wait_idle(qtbot, view)
    first = [dict(m) for m in view.chat.messages[1:]]        # the call, its denied answer, the continuation
    with qtbot.waitSignal(view.tool_panel.asked, timeout=REPLY_TIMEOUT_MS):
        view.regenerate()                                    # the new reply calls a tool too (forced)
    view.tool_panel.deny_btn.click()
    wait_idle(qtbot, view)
    assert branches.info(view.chat.messages[1]) == branches.BranchInfo(1, 2)
    assert branches.switch(view.chat.messages, 1, 0)         # the first reply back, whole
    assert [branches.plain(m) for m in view.chat.messages[1:]] == first


def test_always_allow_then_revoke(qtbot, tool_window):
    w = tool_window
    view = ask_in_new_tab(qtbot, w, "peek", "peek")
    view.tool_panel.always_btn.click()
    wait_idle(qtbot, view)
    assert w.settings.tools_allowed == ["t/peek"]
    assert tool_messages(view)[-1]["content"] == "nothing changed"
    asked = []
    view.tool_panel.asked.connect(asked.append)
    ask(qtbot, view, "peek again", "peek")          # allowed: runs without asking
    qtbot.waitUntil(lambda: len(tool_messages(view)) == 2, timeout=REPLY_TIMEOUT_MS)
    wait_idle(qtbot, view)
    assert asked == [] and tool_messages(view)[-1]["status"] == "ran"
    page = w.open_tools()                           # revoked on the Tools page
    assert page.allowed.item(0).text() == "t/peek"
    page.allowed.setCurrentRow(0)
    page.revoke_btn.click()
    assert w.settings.tools_allowed == [] and page.allowed.count() == 0
    page.close()
    with qtbot.waitSignal(view.tool_panel.asked, timeout=REPLY_TIMEOUT_MS):
        ask(qtbot, view, "and again", "peek")
    view.tool_panel.deny_btn.click()
    wait_idle(qtbot, view)


def test_a_call_past_its_timeout_is_an_error_result(qtbot, tool_window):
    w = tool_window
    w.settings.set("tools_timeout_s", 0.5)
    view = ask_in_new_tab(qtbot, w, "wait", "slow")
    view.tool_panel.args.setPlainText('{"seconds": 30}')
    view.tool_panel.run_btn.click()
    wait_idle(qtbot, view)
    (res,) = tool_messages(view)
    assert res["status"] == "error" and "gave no answer within 0.5 s" in res["content"]
    assert view.chat.messages[-1]["role"] == "assistant"


def test_a_server_crash_is_a_result_and_the_chat_goes_on(qtbot, tool_window):
    w = tool_window
    view = ask_in_new_tab(qtbot, w, "crash", "crash")
    view.tool_panel.run_btn.click()
    wait_idle(qtbot, view)
    (res,) = tool_messages(view)
    assert res["status"] == "error" and "stopped while running 'crash'" in res["content"]
    assert view.chat.messages[-1]["role"] == "assistant"
    qtbot.waitUntil(lambda: w.tools.state("t").status == "failed", timeout=CALL_MS)
    assert "about to crash: goodbye" in w.tools.state("t").stderr_tail
    # the server gone, the chat still talks (no tools offered, the history's calls still rendered)
    view.tool_choice = "auto"
    view.send("hello")
    wait_idle(qtbot, view)
    assert view.chat.messages[-1]["role"] == "assistant"


def test_stop_mid_call_ends_the_loop_at_once(qtbot, tool_window):
    w = tool_window
    view = ask_in_new_tab(qtbot, w, "wait long", "slow")
    view.tool_panel.args.setPlainText('{"seconds": 60}')
    view.tool_panel.run_btn.click()
    assert view.tool_turn is not None and view.tool_turn.running is not None
    view.stop()
    assert not view.busy and view.send_btn.isEnabled()               # at once, not when the call ends
    (res,) = tool_messages(view)
    assert res["status"] == "stopped" and res["content"] == STOPPED_TEXT
    assert view.chat.messages[-1] is res                             # no continuation
    # the running call was cancelled on the server's side: the server answers the next one at once
    assert w.tools.host.call("t", "add", {"a": 1, "b": 2}).result(CALL_MS / 1000).text == "3"


def test_the_step_limit_ends_the_loop_with_a_note(qtbot, tool_window):
    w = tool_window
    w.settings.set("tools_step_limit", 1)
    view = ask_in_new_tab(qtbot, w, "add", "add")
    view.tool_panel.run_btn.click()
    qtbot.waitUntil(lambda: len(tool_messages(view)) == 1, timeout=CALL_MS)
    wait_idle(qtbot, view)
    assert view.chat.messages[-1]["role"] == "tool"                  # no continuation past the limit
    assert any("stopped at the limit of 1 tool steps" in n for n in view.notes)
    assert "stopped at the limit of 1 tool steps" in view.transcript_text()


def test_a_streamable_http_server_beside_the_stdio_one(qtbot, tool_window):
    """Two servers with a tool of the same name: the second is offered as server_tool, and its call goes
    to its own server (streamable HTTP on 127.0.0.1)."""
    from app.tools.config import ServerConfig
    w = tool_window
    with http_server() as url:
        w.tools.put(ServerConfig("h", url=url, enabled=True))
        qtbot.waitUntil(lambda: w.tools.state("h").status == "ready", timeout=CALL_MS)
        view = w.new_tab()
        with qtbot.waitSignal(view.tool_panel.asked, timeout=REPLY_TIMEOUT_MS) as asked:
            ask(qtbot, view, "add over http", "h_add")
        assert asked.args[0]["server"] == "h" and asked.args[0]["tool"] == "add"
        assert "<b>h</b>" in view.tool_panel.title.text()
        view.tool_panel.args.setPlainText('{"a": 20, "b": 22}')
        view.tool_panel.run_btn.click()
        qtbot.waitUntil(lambda: len(tool_messages(view)) == 1, timeout=CALL_MS)
        wait_idle(qtbot, view)
        (res,) = tool_messages(view)
        assert res["server"] == "h" and res["name"] == "h_add" and res["content"] == "42" and res["status"] == "ran"
        assert view.chat.messages[-1]["role"] == "assistant"
        w.tools.set_enabled("h", False)


def test_a_chat_with_tools_off_offers_none(qtbot, tool_window):
    view = tool_window.new_tab()
    view.tools_box.setChecked(False)
    assert view.chat.config["tools"] is False                        # kept with the chat
    asked = []
    view.tool_panel.asked.connect(asked.append)
    ask(qtbot, view, "What is 2 plus 40?", "add")                    # a forced call asked for, but no tools
    wait_idle(qtbot, view)
    assert asked == [] and not tool_messages(view)
    assert view.chat.messages[-1]["role"] == "assistant" and "tool_calls" not in view.chat.messages[-1]
