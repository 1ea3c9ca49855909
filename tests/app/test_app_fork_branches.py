"""Fork and branches in the app, on the real engine with a tiny GGUF and greedy sampling:
- "Fork" on a middle message opens a new chat of the history up to it, titled "<parent> (fork)", its
  parent shown in the library; its first reply reads the shared history from the parent's K/V (parked
  in RAM, or only on disk after a relaunch) and is the parent's reply at that point;
- a Regenerate and an Edit keep what they replaced as branches, "< 1/2 >" switches them (a third
  alternative shows "< 2/3 >"), a follow-up on a switched branch reuses the K/V it shares with the
  branch last answered, and all of it survives reopening the store;
- Export writes the branch shown as Markdown and the whole tree as JSON."""
from __future__ import annotations

import json

import pytest

from app import branches
from app.chat_export import export_chat
from app_fixtures import LOAD_TIMEOUT_MS, REPLY_TIMEOUT_MS, open_window, send_and_wait

QUESTIONS = ["Tell me about the sea and the boats in the harbour, please.",
             "And what does the lighthouse keeper do at night?",
             "What happens to the boats in a storm?"]


@pytest.fixture
def greedy_home(app_home):
    from app import settings
    s = settings.load()
    s.sampling.temperature = 0.0
    settings.save(s)
    return app_home


def _launch(qtbot, **kw):
    w = open_window(qtbot, **kw)
    if kw.get("start_engine", True):
        with qtbot.waitSignal(w.library.loaded, timeout=LOAD_TIMEOUT_MS):
            w.show()
    else:
        w.show()
    return w


def _idle(qtbot, w):
    """The engine idle and its disk writes done (the parent's K/V on disk)."""
    qtbot.waitUntil(lambda: w.engine_thread.engine.wait_idle(0), timeout=REPLY_TIMEOUT_MS)


def _parent(qtbot, w):
    view = w.current_view() or w.new_tab()
    results = [send_and_wait(qtbot, view, q) for q in QUESTIONS]
    qtbot.waitUntil(lambda: view.title_request is None, timeout=REPLY_TIMEOUT_MS)
    return view, results


def _fork_and_ask(qtbot, w, view):
    """Fork at the first reply (a middle message) and ask the parent's second question there."""
    before = w.tabs.count()
    view.fork(1)
    fork = w.current_view()
    assert w.tabs.count() == before + 1 and fork is not view
    assert fork.chat.title == view.chat.title + " (fork)"
    assert fork.chat.messages == [branches.plain(m) for m in view.chat.messages[:2]]
    assert branches.fork_origin(fork.chat.config) == branches.ForkOrigin(view.chat.id, 1)
    return fork, send_and_wait(qtbot, fork, QUESTIONS[1])


def test_fork_from_a_middle_message_answers_from_the_parents_parked_kv(qtbot, greedy_home):
    w = _launch(qtbot)
    try:
        view, parent = _parent(qtbot, w)
        fork, r = _fork_and_ask(qtbot, w, view)
        assert r.prompt_tokens == parent[1].prompt_tokens
        assert r.cached_tokens >= 0.9 * r.prompt_tokens, (r.cached_tokens, r.prompt_tokens)
        assert r.text == parent[1].text                  # greedy: the parent's reply at that point
        # the library names the parent, and its link opens it
        lib = w.chat_library
        lib.refresh()
        lib.select(fork.chat.id)
        line = f"Forked from “{view.chat.title}” at message 2"
        assert lib.fork_text(fork.chat.id) == line and not lib.fork_label.isHidden()
        assert line in lib.item_for(fork.chat.id).toolTip(0)
        assert lib.fork_text(view.chat.id) == ""
        lib.fork_label.linkActivated.emit(view.chat.id)
        assert w.current_view() is view
        # the parent is untouched, and its K/V is held whole (the fork took a copy of its prefix)
        assert len(view.chat.messages) == 6
        from engine.api import Status
        held = {c["owner"]: c["tokens"] for c in w.engine_thread.engine.call(Status(), timeout=30).conversations}
        assert held[view.conversation] == parent[2].prompt_tokens + len(parent[2].tokens) - 1
        assert held[fork.conversation] == r.prompt_tokens + len(r.tokens) - 1
    finally:
        w.close()


def test_fork_after_a_relaunch_restores_the_parents_prefix_from_disk(qtbot, greedy_home):
    w = _launch(qtbot)
    view, parent = _parent(qtbot, w)
    chat_id = view.chat.id
    _idle(qtbot, w)
    w.close()

    w2 = _launch(qtbot)
    try:
        again = w2.chat_library.open_chat(chat_id)
        fork, r = _fork_and_ask(qtbot, w2, again)
        assert r.restored_from_disk > 0
        assert r.cached_tokens >= 0.9 * r.prompt_tokens, (r.cached_tokens, r.prompt_tokens)
        assert r.text == parent[1].text
    finally:
        w2.close()


def _regenerate(qtbot, view):
    with qtbot.waitSignal(view.stats, timeout=REPLY_TIMEOUT_MS) as blocker:
        view.regenerate()
    return blocker.args[0]


def _edit(qtbot, view, index: int, text: str):
    view.edit(index)
    return send_and_wait(qtbot, view, text)


def _contents(view) -> list[str]:
    return [m["content"] for m in view.chat.messages]


def test_edit_and_regenerate_keep_branches_that_switch_and_survive_reopening(qtbot, app_home, tmp_path):
    w = _launch(qtbot)
    try:
        view = w.current_view() or w.new_tab()
        first = send_and_wait(qtbot, view, QUESTIONS[0])
        r1 = view.chat.messages[1]["content"]
        regen = _regenerate(qtbot, view)
        assert regen.cached_tokens >= first.prompt_tokens - 1
        r1b = view.chat.messages[1]["content"]
        assert branches.info(view.chat.messages[1]) == branches.BranchInfo(1, 2)
        assert "< 2/2 >" in view.transcript_text()
        # the switcher: the first reply back, then the regenerated one
        view.transcript.anchorClicked.emit(_url("prevbranch:1"))
        assert _contents(view) == [QUESTIONS[0], r1] and "< 1/2 >" in view.transcript_text()
        # a follow-up on the switched branch reuses the K/V of the question they share
        follow = send_and_wait(qtbot, view, QUESTIONS[2])
        assert follow.cached_tokens >= first.prompt_tokens - 1
        assert len(view.chat.messages) == 4
        # an Edit of the first question: a second branch at message 0
        edited = _edit(qtbot, view, 0, QUESTIONS[1])
        assert edited.prompt_tokens > 0
        assert _contents(view)[0] == QUESTIONS[1] and len(view.chat.messages) == 2
        assert branches.info(view.chat.messages[0]) == branches.BranchInfo(1, 2)
        assert view.switch_branch(0, 0)
        assert _contents(view)[:3] == [QUESTIONS[0], r1, QUESTIONS[2]] and len(view.chat.messages) == 4
        assert branches.info(view.chat.messages[1]) == branches.BranchInfo(0, 2)
        assert view.switch_branch(1, 1)
        assert _contents(view) == [QUESTIONS[0], r1b]
        shown = list(view.chat.messages)
        chat_id = view.chat.id
        # Export: Markdown the branch shown, JSON every branch
        md = export_chat(view.chat, tmp_path / "c.md", "markdown").read_text(encoding="utf-8")
        assert QUESTIONS[0] in md and r1b in md and QUESTIONS[1] not in md and QUESTIONS[2] not in md
        data = json.loads(export_chat(view.chat, tmp_path / "c.json", "json").read_text(encoding="utf-8"))
        assert [m["content"] for m in data["messages"]] == [QUESTIONS[0], r1b]
        nodes = data["tree"]["messages"]
        assert sorted(n["content"] for n in nodes.values() if n["role"] == "user") == \
            sorted([QUESTIONS[0], QUESTIONS[2], QUESTIONS[1]])
        assert len(nodes) == 7       # q1 r1 q3 r3 / r1b / q2 r2
        assert nodes[data["tree"]["currentId"]]["content"] == r1b
    finally:
        w.close()

    w2 = _launch(qtbot, start_engine=False)          # the store reopened
    try:
        again = w2.tabs.view_for(chat_id)
        assert again is not None and again.chat.messages == shown
        assert "< 2/2 >" in again.transcript_text()
        assert again.switch_branch(0, 1)
        assert _contents(again)[0] == QUESTIONS[1]
    finally:
        w2.close()


def test_a_third_alternative_and_a_follow_up_on_a_switched_branch_reuse_the_shared_kv(qtbot, app_home):
    """An Edit in the middle of a chat, then two Regenerates: "< 2/3 >" on the reply; switching back to
    the first question's branch and going on there reuses the K/V both branches share (the first turn)."""
    w = _launch(qtbot)
    try:
        view = w.current_view() or w.new_tab()
        first = send_and_wait(qtbot, view, QUESTIONS[0])
        send_and_wait(qtbot, view, QUESTIONS[1])
        r2 = view.chat.messages[3]["content"]
        edited = _edit(qtbot, view, 2, QUESTIONS[2])
        assert edited.cached_tokens > first.prompt_tokens        # the first turn, question and reply
        for _ in range(2):
            _regenerate(qtbot, view)
        assert branches.info(view.chat.messages[3]) == branches.BranchInfo(2, 3)
        assert branches.info(view.chat.messages[2]) == branches.BranchInfo(1, 2)
        view.transcript.anchorClicked.emit(_url("prevbranch:3"))
        assert "< 2/3 >" in view.transcript_text() and "< 2/2 >" in view.transcript_text()
        shown = view.chat.messages[3]["content"]
        assert view.switch_branch(2, 0)
        assert _contents(view) == [QUESTIONS[0], view.chat.messages[1]["content"], QUESTIONS[1], r2]
        assert "< 1/2 >" in view.transcript_text() and "/3 >" not in view.transcript_text()
        follow = send_and_wait(qtbot, view, "Thank you, and the fishermen?")
        assert first.prompt_tokens < follow.cached_tokens < follow.prompt_tokens
        assert follow.cached_tokens >= edited.cached_tokens - 2
        # back on the edited branch: its three replies are there, the one shown before still shown
        assert view.switch_branch(2, 1)
        assert _contents(view)[2:] == [QUESTIONS[2], shown]
        assert branches.info(view.chat.messages[3]) == branches.BranchInfo(1, 3)
        # the first turn; Q1, its reply and the follow-up turn; Q2 and its three replies
        assert len(branches.tree(view.chat.messages)["messages"]) == 2 + 4 + 4
    finally:
        w.close()


def _url(text: str):
    from PySide6.QtCore import QUrl
    return QUrl(text)


def test_fork_link_and_context_menu_target_the_message_under_the_pointer(qtbot, idle_window):
    w = idle_window
    view = w.current_view() or w.new_tab()
    view.chat.messages[:] = [{"role": "user", "content": "alpha question"},
                             {"role": "assistant", "content": "beta answer"},
                             {"role": "user", "content": "gamma question"}]
    w.show()
    w.resize(1000, 800)
    view.render_all()
    qtbot.waitExposed(view.transcript)
    for i, word in enumerate(("alpha", "beta", "gamma")):
        cursor = view.transcript.document().find(word)
        point = view.transcript.cursorRect(cursor).center()
        assert view.message_at(point) == i
    asked = []
    view.fork_requested.connect(asked.append)
    view.transcript.anchorClicked.emit(_url("fork:1"))
    assert asked == [1]
    fork = w.tabs.fork_chat(view.chat.id, 1)
    assert [m["content"] for m in fork.chat.messages] == ["alpha question", "beta answer"]
    assert w.tabs.fork_chat(view.chat.id, 7) is None
