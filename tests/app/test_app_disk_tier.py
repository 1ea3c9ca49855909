"""The disk tier in the app: chat, quit, relaunch, reopen the chat from the chat library, and its next
reply is read from disk ("restored from disk (N tokens)"); the settings page's row and Clear; deleting
a chat deletes its cache."""
from __future__ import annotations

from app_fixtures import LOAD_TIMEOUT_MS, REPLY_TIMEOUT_MS, open_window, send_and_wait


def _files(home):
    d = home / "cache" / "conversations"
    return sorted(d.glob("*.kvseg")) if d.is_dir() else []


def _launch(qtbot):
    w = open_window(qtbot)
    with qtbot.waitSignal(w.library.loaded, timeout=LOAD_TIMEOUT_MS):
        w.show()
    return w


def _idle(qtbot, w):
    qtbot.waitUntil(lambda: w.engine_thread.engine.wait_idle(0), timeout=REPLY_TIMEOUT_MS)
    w.engine_thread.engine.wait_idle(60)


def test_chat_quit_relaunch_reopen_is_restored_from_disk(qtbot, app_home):
    w = _launch(qtbot)
    view = w.current_view() or w.new_tab()
    send_and_wait(qtbot, view, "Tell me about the sea and the boats in the harbour, please.")
    chat_id = view.chat.id
    _idle(qtbot, w)
    assert _files(app_home)
    w.tabs.close_tab(w.tabs.indexOf(view))          # closed: the library reopens it after the relaunch
    w.close()

    w2 = _launch(qtbot)
    try:
        assert w2.tabs.view_for(chat_id) is None
        w2.chat_library.open_chat(chat_id)
        again = w2.tabs.view_for(chat_id)
        assert again is not None
        messages = []
        again.message.connect(messages.append)
        result = send_and_wait(qtbot, again, "And the lighthouse?")
        assert result.restored_from_disk > 0 and result.cached_tokens >= result.restored_from_disk
        assert again.disk_note == f"restored from disk ({result.restored_from_disk} tokens)"
        assert again.disk_note in messages
        assert again.transcript_text().count(again.disk_note) == 1      # under the reply, not only for 6 s

        # the settings page shows what is used, and Clear empties it
        w2.refresh_status()
        qtbot.waitUntil(lambda: w2.last_status is not None and w2.last_status.disk is not None, timeout=10_000)
        _idle(qtbot, w2)
        page = w2.open_settings()
        with qtbot.waitSignal(w2.status_updated, timeout=10_000):
            w2.refresh_status()
        page.disk_used.setText(page._disk_text(w2.last_status))
        assert "used" in page.disk_used.text() and "MiB" in page.disk_used.text()
        # deleting the chat deletes its cache
        w2.chat_library.delete_chat(chat_id)
        qtbot.waitUntil(lambda: not _files(app_home), timeout=10_000)
        page.close()
    finally:
        w2.close()


def test_settings_clear_button_empties_the_disk_tier(qtbot, app_home):
    w = _launch(qtbot)
    try:
        view = w.current_view() or w.new_tab()
        send_and_wait(qtbot, view, "Write two lines about rivers.")
        _idle(qtbot, w)
        assert _files(app_home)
        page = w.open_settings()
        page.status = None
        page.disk_clear.click()
        qtbot.waitUntil(lambda: page.status is not None and page.status.disk["bytes"] == 0, timeout=10_000)
        assert page.disk_used.text() == "used 0.0 MiB by 0 conversation(s)"
        assert not _files(app_home)
        # the off switch: saved through the settings service, the engine writes nothing more
        page.disk_mib.setValue(0)
        page.submit()
        qtbot.waitUntil(lambda: w.settings.disk_mib == 0, timeout=10_000)
        with qtbot.waitSignal(w.status_updated, timeout=10_000):
            w.refresh_status()
        qtbot.waitUntil(lambda: w.last_status.disk["enabled"] is False, timeout=10_000)
        send_and_wait(qtbot, view, "And about lakes?")
        _idle(qtbot, w)
        assert not _files(app_home)
    finally:
        w.close()
