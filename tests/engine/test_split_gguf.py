"""Split GGUF models (`<name>-00001-of-0000N.gguf`): a set loads as one model and generates what the
unsplit file does; a set that is not one model is refused in one line naming the part."""
from __future__ import annotations

import os
import shutil

import numpy as np
import pytest
from gguf import GGUFValueType

import llama_oracle
from engine.model import memory_estimate as me
from engine.engine import (Engine, EngineOptions, GenerateRequest, LoadModel, RestoreSession, SaveSession,
                           Status)
from engine.errors import ModelFileError, StrataError
from engine.model.gguf_file import content_hash, open_gguf, set_hash
from engine.sampling import SamplingParams
from gguf_factory import write_tiny_gguf
from gguf_factory_split import DROP, write_split

PROMPT = "Once upon a time, in a small village by the sea,"


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("split")
    src = write_tiny_gguf(d / "tiny.gguf", arch="llama", n_layer=2, n_embd=64, n_head=4, n_head_kv=2,
                          n_ff=128, seed=0)
    parts = write_split(src, d / "set", 3)
    return src, parts


def _greedy(path, n=16) -> list[int]:
    eng = Engine(EngineOptions(model=str(path), cache_mib=16)).start()
    try:
        return eng.call(GenerateRequest(prompt=PROMPT, sampling=SamplingParams(max_tokens=n))).tokens
    finally:
        eng.stop()


def test_a_split_set_loads_as_one_model_and_generates_what_the_unsplit_file_does(models):
    src, parts = models
    assert _greedy(parts[0]) == _greedy(src)


def test_the_set_is_mapped_part_by_part_and_estimated_whole(models):
    src, parts = models
    g, whole = open_gguf(parts[0]), open_gguf(src)
    assert g.files == tuple(parts) and whole.files == (src,)
    assert [t.name for t in g.reader.tensors] == [t.name for t in whole.reader.tensors]
    # each tensor a view of its own part's map, byte for byte the unsplit file's
    for a, b in zip(g.reader.tensors, whole.reader.tensors):
        assert np.array_equal(np.asarray(a.data), np.asarray(b.data))
    assert {os.path.realpath(t.data.base.filename) for t in g.reader.tensors if hasattr(t.data.base, "filename")} \
        <= {str(p.resolve()) for p in parts}
    h, hw = me.read_header(parts[0]), me.read_header(src)
    assert h.parts == tuple(parts) and hw.parts == ()
    assert me.estimate(h, 512).weights_bytes == me.estimate(hw, 512).weights_bytes
    assert me.estimate(h, 512).total_bytes == me.estimate(hw, 512).total_bytes


def test_the_fingerprint_names_the_whole_set(models, tmp_path):
    src, parts = models
    eng = Engine(EngineOptions(model=str(parts[0]), cache_mib=16)).start()
    try:
        facts = eng.call(Status()).facts
    finally:
        eng.stop()
    assert facts.model_hash == set_hash(parts)
    assert facts.model_id == "tiny"                 # clients see the set's name, not its first part's
    assert facts.model_hash not in (content_hash(src), content_hash(parts[0]))
    # a set that differs in its last part only is another model
    other = write_split(write_tiny_gguf(tmp_path / "tiny.gguf", arch="llama", seed=1), tmp_path / "o", 3)
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    for p in parts[:2]:
        shutil.copy(p, mixed / p.name)
    shutil.copy(other[2], mixed / other[2].name)
    assert set_hash(sorted(mixed.iterdir())) != set_hash(parts)


def _mixed_set(parts, tmp_path):
    """A set named `mixed` of `parts`' first two parts and the last part of another model of the same
    shape: it loads (nothing in its headers tells), and is another model by its content."""
    other = write_split(write_tiny_gguf(tmp_path / "o.gguf", arch="llama", n_layer=2, n_embd=64, n_head=4,
                                        n_head_kv=2, n_ff=128, seed=1), tmp_path / "o", 3)
    out = []
    for no, src in enumerate([parts[0], parts[1], other[2]], 1):
        out.append(tmp_path / "mixed" / f"mixed-{no:05d}-of-00003.gguf")
        out[-1].parent.mkdir(exist_ok=True)
        shutil.copy(src, out[-1])
    return out


def test_a_session_and_disk_kv_of_a_set_come_back_on_that_set_only(models, tmp_path, strata_home):
    """Saved on a split set: a session file restores on that set and its disk-tier K/V is found again
    after a restart; on a set of other content the session is refused naming the set it was saved
    with, and its K/V on disk is not used."""
    _, parts = models
    msgs = [{"role": "user", "content": PROMPT}]
    sp, sess = SamplingParams(max_tokens=4), tmp_path / "s.stratasession"
    eng = Engine(EngineOptions(model=str(parts[0]), cache_mib=16, disk_mib=64)).start()
    try:
        eng.call(GenerateRequest(messages=msgs, sampling=sp, conversation="c1"))
        eng.call(SaveSession(str(sess), conversation="c1"))
    finally:
        eng.stop()
    eng = Engine(EngineOptions(model=str(parts[0]), cache_mib=16, disk_mib=64)).start()
    try:
        r = eng.call(GenerateRequest(messages=msgs, sampling=sp, conversation="c1"))
        assert r.restored_from_disk == r.cached_tokens > 0
        eng.call(RestoreSession(str(sess), conversation="c2"))
    finally:
        eng.stop()
    mixed = _mixed_set(parts, tmp_path)
    eng = Engine(EngineOptions(model=str(mixed[0]), cache_mib=16, disk_mib=64)).start()
    try:
        with pytest.raises(StrataError) as e:
            eng.call(RestoreSession(str(sess), conversation="c3"))
        line = str(e.value)
        assert "another model" in line and "tiny (3 parts)" in line and "mixed (3 parts)" in line
        assert "\n" not in line
        r = eng.call(GenerateRequest(messages=msgs, sampling=sp, conversation="c1"))
        assert r.cached_tokens == 0
    finally:
        eng.stop()


def test_disk_kv_follows_the_set_s_content_not_its_name(models, tmp_path, strata_home):
    """The same set under another name (a link, a library's copy) is the same model on the disk tier:
    the segments a turn appends there agree with its file's first, and all of them come back."""
    _, parts = models
    renamed = []
    for no, p in enumerate(parts, 1):
        renamed.append(tmp_path / "renamed" / f"renamed-{no:05d}-of-00003.gguf")
        renamed[-1].parent.mkdir(exist_ok=True)
        shutil.copy(p, renamed[-1])
    sp, msgs, got = SamplingParams(max_tokens=4), [{"role": "user", "content": PROMPT}], []
    for model in (parts[0], renamed[0], parts[0]):
        eng = Engine(EngineOptions(model=str(model), cache_mib=16, disk_mib=64)).start()
        try:
            r = eng.call(GenerateRequest(messages=msgs, sampling=sp, conversation="c1"))
        finally:
            eng.stop()
        got.append(r.restored_from_disk)
        msgs = msgs + [{"role": "assistant", "content": r.text}, {"role": "user", "content": f"and {len(got)}?"}]
    assert got[0] == 0 and 0 < got[1] < got[2], got


def test_a_metadata_only_first_part_loads(models, tmp_path):
    src, _ = models
    parts = write_split(src, tmp_path, 3, first_without_tensors=True)
    g = open_gguf(parts[0])
    assert len(g.reader.tensors) == len(open_gguf(src).reader.tensors)


@pytest.mark.skipif(not llama_oracle.available(), reason="llama-cpp-python (the oracle) is not installed")
def test_llama_cpp_reads_the_factory_s_sets_and_agrees(models):
    """The factory writes sets llama.cpp loads (as gguf-split's): the same greedy ids as from the unsplit
    file, and Strata's last logits on the set within float rounding of llama.cpp's (F32 weights)."""
    src, parts = models
    ids = list(range(3, 40))
    one = llama_oracle.Llama(model_path=str(src), n_ctx=128, verbose=False, n_threads=2)
    ref = llama_oracle.greedy(one, ids, 12)
    one.close()
    split = llama_oracle.Llama(model_path=str(parts[0]), n_ctx=128, verbose=False, n_threads=2)
    assert llama_oracle.greedy(split, ids, 12) == ref
    split.close()
    theirs = llama_oracle.logits(llama_oracle.cached_llama(parts[0]), ids)[-1]
    ours = llama_oracle.strata_logits(parts[0], ids)[-1]
    scale = float(np.abs(theirs).max())
    assert float(np.abs(theirs - ours).max()) < 2e-3 * scale + 1e-3


# ---- hostile sets ---------------------------------------------------------------------------------

def _refused(path) -> str:
    """The one line open_gguf, the header reader and the engine's load each give for `path`."""
    with pytest.raises(ModelFileError) as e:
        open_gguf(path)
    with pytest.raises(ModelFileError) as e2:
        me.read_header(path)
    line = str(e.value)
    assert "\n" not in line and str(e2.value) == line
    return line


def test_a_missing_part_is_named(models, tmp_path):
    src, _ = models
    parts = write_split(src, tmp_path, 3)
    parts[1].unlink()
    line = _refused(parts[0])
    assert "part 2 of 3" in line and parts[1].name in line and "missing" in line


def test_parts_of_two_models_are_refused_naming_the_part(models, tmp_path):
    src, parts = models
    # the same number of tensors and parts, another width: caught by the part's norms
    narrow = write_split(write_tiny_gguf(tmp_path / "narrow.gguf", arch="llama", n_embd=32, n_head=4,
                                         n_head_kv=2, n_ff=64), tmp_path / "n", 3, stem="tiny")
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    shutil.copy(parts[0], mixed / parts[0].name)
    shutil.copy(parts[1], mixed / parts[1].name)
    shutil.copy(narrow[2], mixed / narrow[2].name)
    line = _refused(mixed / parts[0].name)
    assert narrow[2].name in line and "two models" in line
    # a deeper model: its split.tensors.count differs
    deep = write_split(write_tiny_gguf(tmp_path / "deep.gguf", arch="llama", n_layer=3), tmp_path / "d", 3,
                       stem="tiny")
    shutil.copy(deep[2], mixed / deep[2].name)
    line = _refused(mixed / parts[0].name)
    assert deep[2].name in line and "split.tensors.count" in line


def test_counts_that_disagree_are_refused(models, tmp_path):
    src, _ = models
    parts = write_split(src, tmp_path / "a", 3, keys={2: {"split.count": 4}})
    line = _refused(parts[0])
    assert parts[2].name in line and "split.count is 4" in line
    parts = write_split(src, tmp_path / "b", 3, keys={1: {"split.tensors.count": 7}})
    assert parts[1].name in _refused(parts[0]) and "split.tensors.count is 7" in _refused(parts[0])
    # the first part's own count must match its name
    parts = write_split(src, tmp_path / "c", 3, keys={0: {"split.count": 2}})
    assert "00001-of-00002" in _refused(parts[0])
    # more tensors declared than the parts hold
    parts = write_split(src, tmp_path / "d", 3, keys={i: {"split.tensors.count": 99} for i in range(3)})
    assert "99" in _refused(parts[0]) and "hold 20 tensors" in _refused(parts[0])


def test_an_index_twice_or_a_tensor_twice_is_refused(models, tmp_path):
    src, _ = models
    parts = write_split(src, tmp_path / "a", 3, keys={2: {"split.no": 1}})
    line = _refused(parts[0])
    assert parts[2].name in line and "split.no says part 2" in line and "part 3" in line
    shares = [list(range(0, 7)), list(range(7, 14)), list(range(13, 20))]   # tensor 13 in parts 2 and 3
    parts = write_split(src, tmp_path / "b", 3, shares=shares)
    line = _refused(parts[0])
    assert parts[2].name in line and f"is also in {parts[1].name}" in line


def test_a_part_that_is_not_a_part_or_disagrees_on_metadata(models, tmp_path):
    src, _ = models
    parts = write_split(src, tmp_path / "a", 3, keys={1: {"split.no": DROP}})
    assert parts[1].name in _refused(parts[0]) and "not a part" in _refused(parts[0])
    parts = write_split(src, tmp_path / "b", 3,
                        keys={2: {"general.architecture": ("qwen2", GGUFValueType.STRING)}})
    line = _refused(parts[0])
    assert parts[2].name in line and "general.architecture" in line


def test_a_later_part_or_a_renamed_first_part_is_refused(models, tmp_path):
    _, parts = models
    line = _refused(parts[1])
    assert "part 2 of 3" in line and parts[0].name in line
    renamed = tmp_path / "model.gguf"
    shutil.copy(parts[0], renamed)
    assert "-00001-of-00003.gguf" in _refused(renamed)


def test_the_engine_refuses_a_broken_set_and_keeps_serving(models, tmp_path):
    src, parts = models
    broken = write_split(src, tmp_path, 3)
    broken[2].unlink()
    eng = Engine(EngineOptions(model=str(parts[0]), cache_mib=16)).start()
    try:
        with pytest.raises(StrataError) as e:
            eng.call(LoadModel(str(broken[0])))
        assert broken[2].name in str(e.value)
        assert eng.call(Status()).model == str(parts[0])
    finally:
        eng.stop()
