"""Models found where other apps keep them (engine/model/model_sources.py), on generated folder trees: LM Studio's
layout, the Hugging Face cache's snapshot links into blobs, Ollama's manifests and blobs; links in loops,
dangling links, unreadable and oversized folders; nothing in a library is ever written."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from engine.model import memory_estimate as me
from engine.model import model_sources as ms
from engine.model.gguf_file import open_gguf
from gguf_factory import write_tiny_gguf
from gguf_factory_split import write_split
from library_trees import hf_cache, lm_studio, ollama

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("lib-src")
    tiny = write_tiny_gguf(d / "tiny.gguf", arch="llama", seed=0)
    other = write_tiny_gguf(d / "other.gguf", arch="llama", seed=1)
    parts = write_split(tiny, d / "set", 3, stem="Tiny-Q8_0")
    return {"tiny": tiny, "other": other, "parts": parts}


def _found(home: Path, **env) -> ms.Scan:
    return ms.find(ms.library_roots({"STRATA_LIBRARY_HOME": str(home), **env}))


def _tree_state(root: Path) -> dict:
    """Every entry under `root` (links not followed): kind, size, mtime; to show nothing was written."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for n in dirnames + filenames:
            st = os.lstat(os.path.join(dirpath, n))
            out[os.path.join(dirpath, n)] = (st.st_mode, st.st_size, st.st_mtime_ns)
    return out


def test_lm_studio_folders_split_sets_once_and_companions_paired(tmp_path, files):
    home = tmp_path / "home"
    lm_studio(home, {"bartowski/Tiny-GGUF/tiny-Q4.gguf": files["tiny"],
                     "bartowski/Tiny-GGUF/mmproj-tiny-f16.gguf": files["other"],
                     **{f"unsloth/Tiny-GGUF/{p.name}": p for p in files["parts"]},
                     "unsloth/Tiny-GGUF/mtp-Tiny-Q8_0.gguf": files["other"]})
    lm_studio(home, {"old/Repo/other.gguf": files["other"]}, old=True)
    before = _tree_state(home)
    scan = _found(home)
    by_name = {m.path.name: m for m in scan.models}
    assert set(by_name) == {"tiny-Q4.gguf", "Tiny-Q8_0-00001-of-00003.gguf", "other.gguf"}
    assert {m.source for m in scan.models} == {"LM Studio"} and scan.notes == []
    assert by_name["tiny-Q4.gguf"].mmproj.name == "mmproj-tiny-f16.gguf"
    split = by_name["Tiny-Q8_0-00001-of-00003.gguf"]
    assert split.parts == 3 and split.mtp.name == "mtp-Tiny-Q8_0.gguf"
    assert len(me.read_header(split.path).parts) == 3          # the set as found loads whole
    assert _tree_state(home) == before


def test_hugging_face_cache_snapshot_links_into_blobs(tmp_path, files):
    hub = tmp_path / "hub"
    hf_cache(hub, "org/Tiny-GGUF", {"tiny-Q4.gguf": files["tiny"],
                                    **{f"Q8_0/{p.name}": p for p in files["parts"]}}, revisions=2)
    hf_cache(hub, "org/Other", {"other.gguf": files["other"]})
    before = _tree_state(hub)
    scan = _found(tmp_path / "nohome", HF_HUB_CACHE=str(hub))
    names = sorted((m.label, m.path.name) for m in scan.models)
    # two revisions link the same blobs: each model once
    assert names == [("org/Other", "other.gguf"), ("org/Tiny-GGUF", "Tiny-Q8_0-00001-of-00003.gguf"),
                     ("org/Tiny-GGUF", "tiny-Q4.gguf")]
    split = next(m for m in scan.models if m.parts == 3)
    assert split.path.is_symlink()                 # loaded through the snapshot's links, parts found beside it
    g = open_gguf(split.path)
    assert len(g.files) == 3 and all(f.is_symlink() for f in g.files)
    assert _tree_state(hub) == before
    # HF_HOME/hub when HF_HUB_CACHE is not set
    (tmp_path / "hfhome").mkdir()
    os.symlink(hub, tmp_path / "hfhome" / "hub")
    assert len(_found(tmp_path / "nohome", HF_HOME=str(tmp_path / "hfhome")).models) == 3


def test_ollama_manifests_name_their_blobs(tmp_path, files):
    store = tmp_path / "home" / ".ollama" / "models"
    blob = ollama(store, "tiny", "latest", files["tiny"], projector=files["other"])
    ollama(store, "other", "q8", files["other"], namespace="someone")
    # a manifest whose blob is gone, one that is not JSON, one far too large, one that is a FIFO
    gone = ollama(store, "gone", "latest", write_tiny_gguf(tmp_path / "gone.gguf", seed=3))
    gone.unlink()
    bad = store / "manifests" / "registry.ollama.ai" / "library" / "bad"
    bad.mkdir(parents=True)
    (bad / "latest").write_text("{not json")
    (bad / "huge").write_bytes(b" " * (ms.MANIFEST_BYTES + 10))
    os.mkfifo(bad / "fifo")
    before = _tree_state(store)
    t0 = time.monotonic()
    scan = _found(tmp_path / "home")
    assert time.monotonic() - t0 < 60                 # the FIFO is never waited on (a hang is minutes)
    by_label = {m.label: m for m in scan.models}
    assert set(by_label) == {"tiny:latest", "someone/other:q8"}
    assert by_label["tiny:latest"].path == blob and by_label["tiny:latest"].source == "Ollama"
    assert by_label["tiny:latest"].mmproj is not None and by_label["tiny:latest"].mmproj != blob
    assert me.read_header(blob).architecture == "llama"      # the blob is the GGUF, no suffix needed
    assert any("latest" in n for n in scan.notes) and any("huge" in n for n in scan.notes)
    assert _tree_state(store) == before


def test_loops_dangling_links_and_deep_trees_are_bounded(tmp_path, files):
    home = tmp_path / "home"
    root = lm_studio(home, {"pub/repo/tiny.gguf": files["tiny"]})
    os.symlink(root, root / "pub" / "up")                       # a folder link back up the tree
    os.symlink("self", root / "pub" / "self")                   # a link to itself
    os.symlink("nowhere.gguf", root / "pub" / "repo" / "dangling.gguf")
    os.symlink("loop.gguf", root / "pub" / "repo" / "loop.gguf")
    deep = root.joinpath(*[f"d{i}" for i in range(ms.MAX_DEPTH + 3)])
    deep.mkdir(parents=True)
    shutil.copyfile(files["other"], deep / "too-deep.gguf")
    scan = _found(home)
    assert [m.path.name for m in scan.models] == ["tiny.gguf"]


def test_the_same_file_is_listed_once_where_it_was_first_found(tmp_path, files):
    home = tmp_path / "home"
    root = lm_studio(home, {"pub/repo/tiny.gguf": files["tiny"]})
    mine = tmp_path / "mine"
    mine.mkdir()
    os.symlink(root / "pub" / "repo" / "tiny.gguf", mine / "linked.gguf")
    os.link(root / "pub" / "repo" / "tiny.gguf", mine / "hardlinked.gguf")
    roots = ms.folder_roots(tmp_path / "strata-models", [str(mine)]) + \
        ms.library_roots({"STRATA_LIBRARY_HOME": str(home)})
    scan = ms.find(roots)
    assert [(m.path.name, m.source) for m in scan.models] == [("hardlinked.gguf", "Folder")]


def test_a_folder_the_user_adds_is_walked_as_a_library_is(tmp_path, files):
    """A folder of the user's laid out as LM Studio's (`<publisher>/<repository>/<file>.gguf`) is found
    whole: its split set once, its projector paired; Strata's own folder is read flat."""
    mine = lm_studio(tmp_path / "copied-home", {"pub/repo/tiny.gguf": files["tiny"],
                                                 "pub/repo/mmproj-tiny.gguf": files["other"],
                                                 **{f"pub/split/{p.name}": p for p in files["parts"]}})
    strata = tmp_path / "strata-models"
    (strata / "sub").mkdir(parents=True)
    shutil.copyfile(files["other"], strata / "sub" / "deep.gguf")
    scan = ms.find(ms.folder_roots(strata, [str(mine)]))
    assert [(m.path.name, m.source, m.parts) for m in scan.models] == \
        [("tiny.gguf", "Folder", 1), ("Tiny-Q8_0-00001-of-00003.gguf", "Folder", 3)]
    assert scan.models[0].mmproj.name == "mmproj-tiny.gguf" and scan.notes == []


def test_an_oversized_or_slow_root_is_left_with_a_note(tmp_path, files):
    home = tmp_path / "home"
    root = lm_studio(home, {"pub/repo/tiny.gguf": files["tiny"]})
    wide = root / "wide"
    wide.mkdir()
    for i in range(ms.MAX_ENTRIES + 10):
        (wide / f"f{i}").touch()
    scan = _found(home)
    assert any("only partly read" in n for n in scan.notes)
    # a root out of time (a zero budget stands for a slow disk) is left at once, with a note
    t0 = time.monotonic()
    scan = ms.find(ms.library_roots({"STRATA_LIBRARY_HOME": str(home)}), seconds=0.0)
    assert time.monotonic() - t0 < 30 and any("too slow" in n or "longer than" in n for n in scan.notes)


SCAN_AS_USER = """
import json, sys
from engine.model import model_sources as ms
scan = ms.find(ms.library_roots({"STRATA_LIBRARY_HOME": sys.argv[1]}))
print(json.dumps({"models": [str(m.path) for m in scan.models], "notes": scan.notes}))
"""


def test_an_unreadable_folder_is_noted_and_the_rest_found(tmp_path, files):
    home = tmp_path / "home"
    root = lm_studio(home, {"pub/ok/tiny.gguf": files["tiny"], "pub/locked/other.gguf": files["other"]})
    hub = home / ".cache" / "huggingface" / "hub"
    hf_cache(hub, "org/Locked", {"x.gguf": files["other"]})
    (root / "pub" / "locked").chmod(0)
    (hub / "models--org--Locked" / "snapshots").chmod(0)
    cmd = [sys.executable, "-c", SCAN_AS_USER, str(home)]
    if os.geteuid() == 0:
        # root reads a chmod 0 folder: the scan runs without the capabilities that let it
        if not shutil.which("setpriv"):
            pytest.skip("running as root without setpriv: a chmod 0 folder stays readable")
        drop = "-dac_override,-dac_read_search"
        cmd = ["setpriv", f"--inh-caps={drop}", f"--bounding-set={drop}", "--"] + cmd
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=REPO,
                             env={**os.environ, "PYTHONPATH": str(REPO)})
    finally:
        (root / "pub" / "locked").chmod(0o755)
        (hub / "models--org--Locked" / "snapshots").chmod(0o755)
    assert out.returncode == 0, out.stderr[-2000:]
    res = json.loads(out.stdout)
    assert [Path(p).name for p in res["models"]] == ["tiny.gguf"]
    assert any("locked" in n and "cannot read" in n for n in res["notes"])
    assert any("Locked" in n for n in res["notes"])


def test_where_to_look_comes_from_the_environment(tmp_path):
    env = {"STRATA_LIBRARY_HOME": str(tmp_path)}
    roots = {r.source + ":" + str(r.path) for r in ms.library_roots(env)}
    assert f"LM Studio:{tmp_path}/.lmstudio/models" in roots
    assert f"LM Studio:{tmp_path}/.cache/lm-studio/models" in roots
    assert f"Hugging Face:{tmp_path}/.cache/huggingface/hub" in roots
    assert f"Ollama:{tmp_path}/.ollama/models" in roots
    roots = {str(r.path) for r in ms.library_roots({**env, "HF_HUB_CACHE": "/x/hub", "HF_HOME": "/y",
                                                    "OLLAMA_MODELS": "/z"})}
    assert {"/x/hub", "/z"} <= roots and "/y/hub" not in roots
    assert "/y/hub" in {str(r.path) for r in ms.library_roots({**env, "HF_HOME": "/y"})}
    assert ms.library_roots({**env, "STRATA_LIBRARIES": "off"}) == []
    # nothing there: nothing found, nothing said
    assert ms.find(ms.library_roots(env)) == ms.Scan()


def test_group_folder_pairs_and_splits(tmp_path):
    names = ["A-00002-of-00002.gguf", "A-00001-of-00002.gguf", "B-00002-of-00003.gguf",
             "B-00003-of-00003.gguf", "mmproj-A-f16.gguf", "mtp-B.gguf", "C.gguf", "MMPROJ-C.gguf"]
    found = ms.group_folder([tmp_path / n for n in names], "Folder")
    by = {m.path.name: m for m in found}
    # B's first part is absent: listed once by the first part there (its load names the missing one)
    assert set(by) == {"A-00001-of-00002.gguf", "B-00002-of-00003.gguf", "C.gguf"}
    assert by["A-00001-of-00002.gguf"].mmproj.name == "mmproj-A-f16.gguf"
    assert by["B-00002-of-00003.gguf"].mtp.name == "mtp-B.gguf"
    assert by["C.gguf"].mmproj.name == "MMPROJ-C.gguf"
