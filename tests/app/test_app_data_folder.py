"""The app's data folder cannot be used (a regular file where a folder of its path goes): before anything
is created in it the app says where and why and offers another folder (app/paths.settle_data_dir,
app/main.ask_for_data_folder); the folder the user picks is the one the app and its engine use."""
from __future__ import annotations

import os
from pathlib import Path

from PySide6.QtCore import QTimer
from PySide6.QtWidgets import QApplication, QFileDialog, QMessageBox

from app.main import ask_for_data_folder
from app.paths import AppPaths, settle_data_dir


def _blocked(tmp_path: Path, monkeypatch) -> Path:
    (tmp_path / "a-file").write_text("not a folder")
    home = tmp_path / "a-file" / "strata"
    monkeypatch.setenv("STRATA_HOME", str(home))
    return home


def test_a_chosen_folder_replaces_an_unusable_one(tmp_path, monkeypatch):
    home = _blocked(tmp_path, monkeypatch)
    asked: list[str] = []
    good = tmp_path / "elsewhere"
    assert settle_data_dir(lambda why: asked.append(why) or good) is None
    assert len(asked) == 1 and str(home) in asked[0] and "a part of its path is a file" in asked[0]
    assert os.environ["STRATA_HOME"] == str(good)
    assert AppPaths.default().data_dir == good and good.is_dir()       # the engine reads the same variable


def test_giving_up_returns_the_reason_and_creates_nothing(tmp_path, monkeypatch):
    home = _blocked(tmp_path, monkeypatch)
    why = settle_data_dir(lambda why: None)
    assert why is not None and str(home) in why
    assert os.environ["STRATA_HOME"] == str(home)
    assert (tmp_path / "a-file").read_text() == "not a folder"


def _answer(button_text: str, seen: list[str]) -> None:
    """Click `button_text` in the message box once it is shown (it is modal: exec() waits)."""
    def click() -> None:
        box = QApplication.activeModalWidget()
        if not isinstance(box, QMessageBox):
            QTimer.singleShot(20, click)
            return
        seen.append(box.text())
        next(b for b in box.buttons() if b.text() == button_text).click()
    QTimer.singleShot(0, click)


def test_the_box_says_where_and_why_and_quit_gives_up(qtbot, tmp_path):
    seen: list[str] = []
    _answer("Quit", seen)
    why = f"the data folder {tmp_path}/a-file/strata cannot be used: a part of its path is a file, not a folder"
    assert ask_for_data_folder(why) is None
    assert seen and f"{tmp_path}/a-file/strata" in seen[0] and "a part of its path is a file" in seen[0]


def test_the_box_offers_another_folder(qtbot, tmp_path, monkeypatch):
    seen: list[str] = []
    good = tmp_path / "picked"
    good.mkdir()
    # the platform's folder picker stands for the user's pick (a native dialog cannot be driven here)
    monkeypatch.setattr(QFileDialog, "getExistingDirectory", staticmethod(lambda *a, **k: str(good)))
    _answer("Choose another folder…", seen)
    assert ask_for_data_folder("the data folder /x cannot be used: no permission to write there") == good
