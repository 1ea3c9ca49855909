"""app/branches.py: a chat's alternatives kept at the message where branches part, switching between
them, the Open WebUI tree of every branch, forks and their recorded parent; and the chat store keeping
all of it (a real SQLite file)."""
from __future__ import annotations

import json

from app import branches
from app.chat_export import to_json, to_markdown
from app.store import Chat, Store


def u(t: str) -> dict:
    return {"role": "user", "content": t}


def a(t: str) -> dict:
    return {"role": "assistant", "content": t}


def _edited_and_regenerated() -> list[dict]:
    """q1 answered r1, regenerated as r1b; then q1 edited to q2, answered r2."""
    msgs = [u("q1"), a("r1")]
    old = msgs[1:]
    del msgs[1:]
    msgs.append(a("r1b"))
    branches.replace_tail(msgs, 1, old)
    old = msgs[0:]
    del msgs[0:]
    msgs += [u("q2"), a("r2")]
    branches.replace_tail(msgs, 0, old)
    return msgs


def _shown(msgs: list[dict]) -> list[str]:
    return [m["content"] for m in msgs]


def test_switching_shows_each_branch_and_keeps_the_others():
    msgs = _edited_and_regenerated()
    assert _shown(msgs) == ["q2", "r2"]
    assert branches.info(msgs[0]) == branches.BranchInfo(1, 2)
    assert branches.info(msgs[1]) is None
    assert branches.switch(msgs, 0, 0)
    assert _shown(msgs) == ["q1", "r1b"]              # the old question with the reply it had last
    assert branches.info(msgs[1]) == branches.BranchInfo(1, 2)
    assert branches.switch(msgs, 1, 0)
    assert _shown(msgs) == ["q1", "r1"]
    assert branches.switch(msgs, 0, 1)
    assert _shown(msgs) == ["q2", "r2"]
    assert branches.switch(msgs, 0, 0) and _shown(msgs) == ["q1", "r1"]     # its own switch kept
    assert not branches.switch(msgs, 0, 0) and not branches.switch(msgs, 0, 5) and not branches.switch(msgs, 9, 0)


def test_a_third_alternative_joins_the_same_set():
    msgs = [u("q"), a("r1")]
    for text in ("r2", "r3"):
        old = msgs[1:]
        del msgs[1:]
        msgs.append(a(text))
        branches.replace_tail(msgs, 1, old)
    assert branches.info(msgs[1]) == branches.BranchInfo(2, 3)
    branches.switch(msgs, 1, 0)
    assert _shown(msgs) == ["q", "r1"] and branches.info(msgs[1]) == branches.BranchInfo(0, 3)


def test_damaged_branch_keys_read_as_no_alternatives():
    for bad in ({"siblings": "x", "branch": 0}, {"siblings": [None, 3], "branch": 0},
                {"siblings": [None, [a("x")]], "branch": 1}, {"siblings": [None, [a("x")]], "branch": True}):
        m = {**a("r"), **bad}
        assert branches.info(m) is None
        assert not branches.switch([u("q"), m], 1, 1)


def test_tree_is_open_webui_history_of_every_branch():
    msgs = _edited_and_regenerated()
    t = branches.tree(msgs)
    nodes = t["messages"]
    assert sorted(n["content"] for n in nodes.values()) == ["q1", "q2", "r1", "r1b", "r2"]
    roots = [n for n in nodes.values() if n["parentId"] is None]
    assert [n["content"] for n in roots] == ["q1", "q2"]
    q1 = roots[0]
    assert [nodes[c]["content"] for c in q1["childrenIds"]] == ["r1", "r1b"]
    assert nodes[t["currentId"]]["content"] == "r2"
    for n in nodes.values():                          # parent and children agree
        for c in n["childrenIds"]:
            assert nodes[c]["parentId"] == n["id"]


def test_fork_takes_the_shown_history_up_to_a_message_and_names_its_parent():
    parent = Chat(title="Boats", messages=_edited_and_regenerated() + [u("q3"), a("r3")],
                  config={"preset": "default", "speed_projection": False, "session": "/x.strata"})
    f = branches.fork(parent, 2)
    assert f.id != parent.id and f.title == "Boats (fork)"
    assert f.messages == [u("q2"), a("r2"), u("q3")]          # no alternatives carried
    assert f.config == {"preset": "default", "speed_projection": False,
                        "forked_from": {"chat": parent.id, "message": 2}}
    assert branches.fork_origin(f.config) == branches.ForkOrigin(parent.id, 2)
    assert branches.fork_origin({}) is None
    assert branches.fork_origin({"forked_from": {"chat": 3, "message": 1}}) is None
    assert branches.fork_origin({"forked_from": {"chat": "x", "message": -1}}) is None
    f.messages[0]["content"] = "changed"
    assert parent.messages[0]["content"] == "q2"              # a copy


def test_the_store_keeps_the_tree_and_the_fork_origin(tmp_path):
    path = tmp_path / "chats.sqlite3"
    s = Store(path)
    chat = Chat(title="T", messages=_edited_and_regenerated())
    s.save_chat(chat)
    f = branches.fork(chat, 0)
    s.save_chat(f)
    s.close()
    s2 = Store(path)
    again = s2.chat(chat.id)
    assert again.messages == chat.messages
    assert branches.switch(again.messages, 0, 0) and _shown(again.messages) == ["q1", "r1b"]
    assert branches.fork_origin(s2.chat(f.id).config) == branches.ForkOrigin(chat.id, 0)
    s2.close()


def test_export_markdown_writes_the_branch_shown_json_the_whole_tree():
    chat = Chat(title="T", messages=_edited_and_regenerated())
    md = to_markdown(chat)
    assert "q2" in md and "r2" in md and "q1" not in md and "r1" not in md.replace("r1b", "")
    data = json.loads(to_json(chat))
    assert [m["content"] for m in data["messages"]] == ["q2", "r2"]
    assert data["tree"] == branches.tree(chat.messages)
    assert all(set(m) == {"role", "content"} for m in data["messages"])
