"""The app's journeys as a new user meets them, on the real engine with a tiny GGUF and a real control
vector for it: restore after a fresh launch with default settings, a restored tab's toggle, a file
saved with a vector the app has not loaded, open at launch, a second launch, save after a restart,
side requests and slots, the per-tab status bar, the prefill bar with Cancel."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from app_fixtures import LOAD_TIMEOUT_MS, REPLY_TIMEOUT_MS, open_window, send_and_wait  # noqa: E402

pytestmark = pytest.mark.gui
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def tiny_vector(tmp_path_factory) -> Path:
    """A control vector for the tiny model (width 64), strong enough to change its replies."""
    from engine.steer.control_vector import write_control_vector
    path = tmp_path_factory.mktemp("cvec") / "tiny-concise.gguf"
    write_control_vector(path, {1: (np.random.default_rng(5).standard_normal(64) * 6).astype(np.float32)},
                         model_hint="llama")
    return path


def configure(*, vector: Path | None, speed_projection: bool, **app) -> None:
    """Settings as a user leaves them: a vector configured (or none), its "on by default" box."""
    from app import settings
    s = settings.load()
    s.steering.files = [(str(vector), 1.0)] if vector else []
    s.steering.speed_projection = speed_projection
    for k, v in app.items():
        setattr(s, k, v)
    settings.save(s)


def launch(qtbot):
    w = open_window(qtbot)
    with qtbot.waitSignal(w.library.loaded, timeout=LOAD_TIMEOUT_MS):
        w.show()
    return w


def save(qtbot, w, view, path: Path) -> dict:
    req = w.sessions.save_session(view, str(path))
    with qtbot.waitSignal(req.finished, timeout=REPLY_TIMEOUT_MS):
        pass
    assert req.error is None, req.error
    return req.result


def restore(qtbot, w, path: Path):
    with qtbot.waitSignal(w.sessions.restored, timeout=REPLY_TIMEOUT_MS) as blocker:
        w.sessions.open_file(str(path))
    return blocker.args[0]


def engine_status(w) -> dict:
    from engine.engine import Status
    return w.engine_thread.engine.call(Status(), timeout=30)


# ------------------------------------------------------------------ steering identity per conversation

def test_fresh_launch_restores_a_plain_chat_with_default_settings(qtbot, app_home, tiny_vector, tmp_path):
    """The shipped setup: a vector configured, "on by default" unticked. A plain chat's session
    restores after a restart, whatever another tab did with the projection in between."""
    configure(vector=tiny_vector, speed_projection=False)
    w = launch(qtbot)
    plain = w.current_view()
    assert not plain.projection.isChecked()
    r = send_and_wait(qtbot, plain, "Keep this plain conversation")
    assert r.speed_projection is False
    steered = w.new_tab()
    steered.projection.setChecked(True)
    assert send_and_wait(qtbot, steered, "Something steered").speed_projection is True
    path = tmp_path / "plain.stratasession"
    assert save(qtbot, w, plain, path).speed_projection is False
    w.close()

    again = launch(qtbot)
    try:
        view = restore(qtbot, again, path)
        assert not view.projection.isChecked()
        assert "speed projection off" in view.transcript_text()
        follow = send_and_wait(qtbot, view, "Go on")
        assert follow.speed_projection is False and follow.cached_tokens > 0
        # The same file restores again later, after a steered request in another tab (its first tab
        # closed: while that tab is open, opening the file again only brings it to the front).
        assert again.sessions.open_view(str(path)) is view
        again.tabs.close_tab(again.tabs.indexOf(view))
        other = again.new_tab()
        other.projection.setChecked(True)
        send_and_wait(qtbot, other, "Steered again")
        assert not restore(qtbot, again, path).projection.isChecked()
    finally:
        again.close()


def test_restore_sets_the_tabs_toggle_to_the_files_setting(qtbot, app_home, tiny_vector, tmp_path):
    configure(vector=tiny_vector, speed_projection=False)
    w = launch(qtbot)
    try:
        view = w.current_view()
        view.projection.setChecked(True)
        send_and_wait(qtbot, view, "A steered conversation")
        path = tmp_path / "steered.stratasession"
        saved = save(qtbot, w, view, path)
        assert saved.speed_projection is True and saved.reread is False
        fresh = w.new_tab()
        assert not fresh.projection.isChecked()           # new chats: the default, off
        restored = restore(qtbot, w, path)
        assert restored.projection.isChecked()            # the file's setting
        assert restored.chat.config["speed_projection"] is True
        follow = send_and_wait(qtbot, restored, "Go on")
        # Its follow-up extends the restored K/V instead of reading everything again.
        assert follow.speed_projection is True
        assert follow.cached_tokens >= saved.tokens, follow
    finally:
        w.close()


def test_a_file_needing_a_vector_not_loaded_is_refused_naming_it_and_offers_it(qtbot, app_home, tiny_vector,
                                                                              tmp_path):
    configure(vector=tiny_vector, speed_projection=True)
    w = launch(qtbot)
    send_and_wait(qtbot, w.current_view(), "Steered from the start")
    path = tmp_path / "needs-vector.stratasession"
    save(qtbot, w, w.current_view(), path)
    w.close()

    configure(vector=None, speed_projection=True)
    again = launch(qtbot)
    try:
        n = again.tabs.count()
        with qtbot.waitSignal(again.sessions.refused, timeout=REPLY_TIMEOUT_MS) as blocker:
            again.sessions.open_file(str(path))
        reason = blocker.args[0]
        assert "saved with another steering setting" in reason and tiny_vector.name in reason, reason
        assert again.tabs.count() == n
        qtbot.waitUntil(lambda: again.message_bar.action.isVisible(), timeout=REPLY_TIMEOUT_MS)
        assert again.message_bar.action.text() == "Load it and restore"
        with qtbot.waitSignal(again.sessions.restored, timeout=REPLY_TIMEOUT_MS) as blocker:
            again.message_bar.action.click()
        view = blocker.args[0]
        assert view.projection.isChecked()
        assert again.settings.steering.files == [(str(tiny_vector), 1.0)]
        assert engine_status(again).steering is not None
    finally:
        again.close()


# ------------------------------------------------------------------ open at launch, second launch

def make_file(qtbot, tmp_path, name="kept") -> Path:
    w = launch(qtbot)
    send_and_wait(qtbot, w.current_view(), f"Remember the {name} conversation")
    path = tmp_path / f"{name}.stratasession"
    save(qtbot, w, w.current_view(), path)
    w.close()
    return path


def test_open_at_launch_and_finder_opens_wait_for_the_model(qtbot, app_home, tmp_path):
    from PySide6.QtGui import QFileOpenEvent
    from PySide6.QtWidgets import QApplication

    from app.main import make_app, start_window
    first, second = make_file(qtbot, tmp_path, "first"), make_file(qtbot, tmp_path, "second")
    app = make_app()
    queue = app._strata_files
    queue.window, queue.pending = None, []
    w = start_window(app, [str(first)])             # `strata-app first.stratasession`
    qtbot.addWidget(w)
    restored, refused = [], []
    w.sessions.restored.connect(restored.append)
    w.sessions.refused.connect(refused.append)
    try:
        assert not w.library.model_path                          # the model is still loading
        QApplication.sendEvent(app, QFileOpenEvent(str(second)))   # Finder double-click meanwhile
        qtbot.waitUntil(lambda: len(restored) == 2 or bool(refused), timeout=LOAD_TIMEOUT_MS)
        assert refused == []
        assert sorted(v.chat.title for v in restored) == ["first", "second"]
        assert "no model is loaded" not in w.message_bar.text()
    finally:
        queue.window = None
        w.close()


def test_a_second_launch_hands_its_file_to_the_first(qtbot, app_home, tmp_path):
    from app.single_instance import SingleInstance
    path = make_file(qtbot, tmp_path)
    instance = SingleInstance()
    assert instance.acquire() and instance.listen()
    w = launch(qtbot)
    instance.files_received.connect(lambda fs: [w.sessions.open_file(f) for f in fs])
    env = dict(os.environ, QT_QPA_PLATFORM="offscreen", STRATA_HOME=str(app_home), PYTHONPATH=str(REPO))
    try:
        with qtbot.waitSignal(w.sessions.restored, timeout=REPLY_TIMEOUT_MS) as blocker:
            proc = subprocess.Popen([sys.executable, "-m", "app.main", str(path)], cwd=REPO, env=env,
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0, out
        assert "handed 1 file(s) to the Strata already running" in out
        assert blocker.args[0].chat.title == "kept"
        # The second launch never opened the chats database: no second window, no second engine.
        assert "model:" not in out
    finally:
        w.close()
        instance.release()


def test_a_launch_whose_first_instance_does_not_answer_exits_without_opening_the_db(app_home, tmp_path):
    """The lock is held (here by this test) but nobody listens: one line, exit 1, chats untouched."""
    from app.single_instance import SingleInstance
    instance = SingleInstance()
    assert instance.acquire()
    db = app_home / "chats.sqlite3"
    env = dict(os.environ, QT_QPA_PLATFORM="offscreen", STRATA_HOME=str(app_home), PYTHONPATH=str(REPO),
               STRATA_HANDOVER_TIMEOUT_S="1")
    try:
        proc = subprocess.run([sys.executable, "-m", "app.main"], cwd=REPO, env=env, capture_output=True,
                              text=True, timeout=60)
    finally:
        instance.release()
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines()[-1].startswith("strata-app: another Strata is running")
    assert not db.exists()


# ------------------------------------------------------------------ save any chat

def test_save_a_chat_carried_over_from_before_a_restart(qtbot, app_home, tmp_path):
    w = launch(qtbot)
    first = send_and_wait(qtbot, w.current_view(), "A chat from yesterday")
    w.close()

    again = launch(qtbot)
    try:
        view = again.views()[0]
        assert view.chat.messages[0]["content"] == "A chat from yesterday"
        req = again.sessions.save_session(view, str(tmp_path / "yesterday.stratasession"))
        stages, shown = [], []
        req.progress.connect(lambda st, d, t: (stages.append((st, d, t)), shown.append(view.task_visible())))
        with qtbot.waitSignal(req.finished, timeout=REPLY_TIMEOUT_MS):
            pass
        assert req.error is None, req.error
        assert req.result.reread is True and req.result.tokens > first.prompt_tokens
        assert stages[0][:2] == ("prefill", 0) and any(s == "save" for s, _, _ in stages)
        assert all(shown) and not view.task_visible()     # the tab's bar, gone once saved
        # The conversation is held now: its follow-up reuses it, and the file restores.
        follow = send_and_wait(qtbot, view, "And today?")
        assert follow.cached_tokens == req.result.tokens
        restored = restore(qtbot, again, tmp_path / "yesterday.stratasession")
        assert [m for m in restored.chat.messages if m["role"] != "system"] == view.chat.messages[:2]
    finally:
        again.close()


# ------------------------------------------------------------------ side requests and slots

def test_titles_take_no_slot_and_run_unsteered_and_regenerate_reuses_its_slot(qtbot, app_home, tiny_vector):
    configure(vector=tiny_vector, speed_projection=True, cache_slots=2)
    w = launch(qtbot)
    try:
        a = w.current_view()
        titles = []
        with qtbot.waitSignal(a.title_changed, timeout=REPLY_TIMEOUT_MS):
            ra = send_and_wait(qtbot, a, "Tell me about the sea")
            a.title_request.done.connect(titles.append)
        assert ra.speed_projection is True
        assert titles and titles[0].speed_projection is False      # the title ran unsteered
        st = engine_status(w)
        held_a = st.live_tokens                  # A still live: prompt and reply
        assert st.parking["entries"] == 0 and held_a >= ra.prompt_tokens + ra.generated_tokens - 1

        b = w.new_tab()
        with qtbot.waitSignal(b.title_changed, timeout=REPLY_TIMEOUT_MS):
            send_and_wait(qtbot, b, "Something else entirely")
        assert engine_status(w).parking["tokens"] == [held_a]   # only A, parked by B

        w.tabs.setCurrentWidget(a)
        r2 = send_and_wait(qtbot, a, "And more?")
        assert r2.cached_tokens == held_a
        with qtbot.waitSignal(a.stats, timeout=REPLY_TIMEOUT_MS) as blocker:
            a.regenerate()
        regen = blocker.args[0]
        assert regen.cached_tokens == r2.prompt_tokens - 1        # its own K/V, trimmed
        st = engine_status(w)
        assert st.parking["entries"] == 1 and st.live_tokens >= regen.prompt_tokens
        a.edit(0)
        edited = send_and_wait(qtbot, a, "Tell me about rivers instead")
        assert edited.cached_tokens > 0
        st = engine_status(w)
        # Still one slot for A (live) and B's parked one: no old branch kept, nothing evicted.
        assert st.parking["entries"] == 1 and st.live_tokens >= edited.prompt_tokens
        w.tabs.setCurrentWidget(b)
        rb = send_and_wait(qtbot, b, "Back to B")
        assert rb.cached_tokens > 0
    finally:
        w.close()


# ------------------------------------------------------------------ status bar per tab, prefill bar

def test_status_bar_shows_the_current_tabs_figures_live_speed_and_fresh_parking(qtbot, app_home):
    w = launch(qtbot)
    try:
        a = w.current_view()
        ra = send_and_wait(qtbot, a, "First tab")
        mine = f"cached {ra.cached_tokens}/{ra.prompt_tokens} tokens"
        assert w.status.cached.text() == mine
        b = w.new_tab()
        assert w.status.cached.text() == "cached –" and w.status.speed.text() == "– tok/s"
        # Greedy without a repetition penalty: the same long reply every run (no early EOS), long
        # enough to stream over several render ticks.
        w.settings.sampling.max_tokens = 800
        w.settings.sampling.temperature = 0.0
        w.settings.sampling.repetition_penalty = 1.0
        with qtbot.waitSignal(b.live_speed, timeout=REPLY_TIMEOUT_MS):
            b.input.setPlainText("Stream a long answer")
            b.send_input()
        assert w.status.speed.text().endswith("tok/s (streaming)")
        with qtbot.waitSignal(b.stats, timeout=REPLY_TIMEOUT_MS) as blocker:
            pass
        rb = blocker.args[0]
        assert rb.generated_tokens > 200, rb
        assert "streaming" not in w.status.speed.text()
        w.tabs.setCurrentWidget(a)
        assert w.status.cached.text() == mine
        w.tabs.setCurrentWidget(b)
        assert w.status.cached.text() == f"cached {rb.cached_tokens}/{rb.prompt_tokens} tokens"
        # B parked A: the bar says so without another request.
        qtbot.waitUntil(lambda: w.status.parked.text().startswith("parked 1 ·"), timeout=REPLY_TIMEOUT_MS)
        p = engine_status(w).parking
        assert f"{p['bytes'] / (1 << 20):.1f} / " in w.status.parked.text()
    finally:
        w.close()


LONG = " ".join(f"word{i} and the sea" for i in range(120))


def test_the_prompt_being_read_shows_a_bar_in_its_chat(qtbot, window):
    view = window.current_view()
    seen = []
    with qtbot.waitSignal(view.stats, timeout=REPLY_TIMEOUT_MS):
        view.input.setPlainText(LONG)
        view.send_input()
        view.request.progress.connect(lambda st, d, t: seen.append((st, d, t, view.task_visible())))
    prefill = [s for s in seen if s[0] == "prefill"]
    assert prefill[0][1] == 0 and prefill[1][1] == 16       # at once, then after a small first chunk
    assert len(prefill) >= 4 and all(v for *_, v in prefill)
    assert not view.task_visible()


def test_cancel_on_the_bar_stops_a_prompt_before_its_reply(qtbot, window):
    """Cancel on the chat's bar: the prompt is never answered (the engine checks between chunks;
    tests/engine/test_engine.py cancels one mid-prompt). Here the engine is held busy first, so the
    click lands while the prompt waits its turn, whatever the machine's speed."""
    import threading

    hold = window.engine_thread.engine.scheduler.hold()
    view = window.current_view()
    view.input.setPlainText(LONG)
    view.send_input()
    assert view.tracked is view.request and view.busy
    try:
        view.task_cancel.click()
    finally:
        hold.release()
    with qtbot.waitSignal(view.message, timeout=REPLY_TIMEOUT_MS) as blocker:
        pass
    assert blocker.args[0] == "Stopped"
    assert not view.busy and not view.task_visible()
    assert [m["role"] for m in view.chat.messages] == ["user"]
    # The chat goes on.
    assert send_and_wait(qtbot, view, "Shorter then").generated_tokens >= 1


def test_a_lock_left_by_a_crashed_strata_does_not_block_the_next_launch(app_home):
    """A killed Strata leaves its lock file; its process is gone, so the next launch takes it over."""
    code = ("import os; from app.single_instance import SingleInstance; "
            "i = SingleInstance(); assert i.acquire() and i.listen(); os._exit(0)")
    env = dict(os.environ, QT_QPA_PLATFORM="offscreen", STRATA_HOME=str(app_home), PYTHONPATH=str(REPO))
    subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, check=True, timeout=60)
    assert (app_home / "strata.lock").exists()
    from app.single_instance import SingleInstance
    instance = SingleInstance()
    try:
        assert instance.acquire() and instance.listen()
    finally:
        instance.release()
