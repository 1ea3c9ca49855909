"""Draft names fuzzed (issue 31): seeded names built from the pieces that went wrong (`~`, separators,
`..`, leading dots, NUL and control characters, very long names, Unicode look-alikes, names of files
outside the models folder) resolved against a real models folder holding models, a FIFO, a folder
named like a model, a symlink and a decoy outside. Each name is either a file in the models folder or
one line of refusal; nothing outside the folder is ever named, and no file's bytes are echoed."""
from __future__ import annotations

import os
import random
import time

import pytest

from engine.frontends.draft_names import resolve
from engine.errors import StrataError

DEFAULT_NAMES = 2_000
LONG_NAMES = 100_000
SECRET = b"TOPS-secret-bytes"

PIECES = ["~", "~www-data", "~/", "/", "\\", "..", "../", ".", ".hidden", "\x00", "\n", "\r", "\x7f", "\x1b[2J",
          "etc", "passwd", "secret.txt", "draft", "tiny", "model", ".gguf", ".GGUF", "fifo", "dir", "link",
          " ", "\t", "\u202e", "\u2215", "\uff0e\uff0e", "\u2044", "%2e%2e", "%2f", "*", "?", "[a]", "$HOME",
          "a" * 300, "é", "\udcff", "C:", "//", "\\\\server\\share"]


def make_name(rng: random.Random) -> str:
    n = rng.randint(1, 6)
    return "".join(rng.choice(PIECES) for _ in range(n))


@pytest.fixture
def models(tmp_path):
    folder = tmp_path / "models"
    folder.mkdir()
    for name in ("tiny-draft.gguf", "model-a.gguf", "model-b.gguf"):
        (folder / name).write_bytes(b"GGUF" + bytes(60))
    os.mkfifo(folder / "fifo.gguf")
    (folder / "dir.gguf").mkdir()
    outside = tmp_path / "secret.txt"
    outside.write_bytes(SECRET)
    (tmp_path / "decoy.gguf").write_bytes(SECRET)
    (folder / "link.gguf").symlink_to(folder / "model-a.gguf")     # a link the user made (the app's "Link")
    return folder


def run_names(folder, count: int, seed: int) -> dict:
    rng = random.Random(seed)
    tally = {"resolved": 0, "refused": 0}
    for i in range(count):
        name = make_name(rng)
        t0 = time.perf_counter()
        try:
            path = resolve(name, folder)
        except StrataError as e:
            msg = str(e)
            assert "\n" not in msg and len(msg) < 600, (i, name, msg)
            assert SECRET.decode() not in msg and "TOPS" not in msg, (i, name, msg)
            tally["refused"] += 1
        else:
            # a file of the models folder itself, never one reached through a path in the name
            assert path.parent == folder and path.is_file(), (i, name, path)
            assert path.name in {"tiny-draft.gguf", "model-a.gguf", "model-b.gguf", "link.gguf"}, (i, name, path)
            tally["resolved"] += 1
        assert time.perf_counter() - t0 < 2.0, (i, name)
    return tally


def test_fuzzed_draft_names_resolve_in_the_models_folder_or_are_refused(models):
    tally = run_names(models, DEFAULT_NAMES, seed=31)
    assert tally["resolved"] + tally["refused"] == DEFAULT_NAMES
    assert tally["resolved"] > 0 and tally["refused"] > 0      # both sides are exercised
    print(f"draft names: {DEFAULT_NAMES} tried, {tally['resolved']} resolved, {tally['refused']} refused")


@pytest.mark.fuzz_long
def test_fuzzed_draft_names_long_run(models):
    tally = run_names(models, LONG_NAMES, seed=3131)
    print(f"draft names (long): {LONG_NAMES} tried, {tally['resolved']} resolved, {tally['refused']} refused")
