"""Hostile headers of the families read through engine/model/archs/ (Gemma 3/4, gpt-oss, Qwen3.5/3.6): each
refused in one line naming the key or tensor, on the estimate path (`strata models estimate`, the app's
model list) and on the load path (`strata generate`, the server's load), in bounded time and memory.

The load path runs in tests/fuzz_worker.py (a child under RLIMIT_AS, killed on a hang); the estimate path
through the real CLI in a subprocess with a deadline far above its normal second.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from engine.errors import ModelFileError
from fuzz_families import FAMILIES, arch_of, family_file, mutant
from fuzz_harness import Worker

REPO = Path(__file__).resolve().parents[2]
DEADLINE_S = 60           # a header check takes well under a second; a hang never ends

# (family, mutant label, the line's text): the cases, then their neighbours
ESTIMATE_CASES = [
    ("qwen35", "qwen35.block_count=2147483647", "'qwen35.block_count' is 2147483647, outside 1..4096"),
    ("qwen35", "qwen35.block_count=4294967295", "'qwen35.block_count' is 4294967295, outside 1..4096"),
    ("qwen35moe", "qwen35moe.block_count=4294967295", "'qwen35moe.block_count' is 4294967295"),
    ("gemma3", "gemma3.block_count=2147483647", "'gemma3.block_count' is 2147483647, outside 1..4096"),
    ("gemma4", "gemma4.block_count=4294967295", "'gemma4.block_count' is 4294967295, outside 1..4096"),
    ("gpt-oss", "gpt-oss.block_count=2147483647", "'gpt-oss.block_count' is 2147483647, outside 1..4096"),
    ("gemma4", "gemma4.block_count=3", "block_count is 3 but the file has tensors for 4 blocks"),
    ("qwen35", "tensor blk.0.ssm_dt.bias dropped", "tensor 'blk.0.ssm_dt.bias' is missing"),
]
LOAD_CASES = [
    ("gemma4", "gemma4.rope.dimension_count=4294967295", "'gemma4.rope.dimension_count' is 4294967295, outside 2..32"),
    ("gemma4", "gemma4.rope.dimension_count=nan (as float)",
     "'gemma4.rope.dimension_count' must be an integer, the file has float32"),
    ("gemma4", "gemma4.embedding_length_per_layer_input=nan (as float)",
     "'gemma4.embedding_length_per_layer_input' must be an integer, the file has float32"),
    ("gemma4", "gemma4.rope.dimension_count_swa=65535", "'gemma4.rope.dimension_count_swa' is 65535, outside 2..16"),
    ("gemma4", "gemma4.rope.dimension_count_swa=2147483647", "'gemma4.rope.dimension_count_swa' is 2147483647"),
    ("gemma4", "gemma4.rope.dimension_count_swa=3", "'gemma4.rope.dimension_count_swa' is 3: RoPE turns pairs"),
    ("qwen35", "tensor blk.0.ssm_dt.bias dropped", "tensor 'blk.0.ssm_dt.bias' is missing"),
    ("qwen35", "qwen35.block_count=4294967295", "'qwen35.block_count' is 4294967295, outside 1..4096"),
    ("qwen35", "qwen35.rope.dimension_count=65535", "'qwen35.rope.dimension_count' is 65535, outside 2..32"),
    ("qwen35moe", "tensor blk.0.ffn_up_shexp.weight ne0 halved", "tensor 'blk.0.ffn_up_shexp.weight' has shape"),
    ("gemma3", "gemma3.block_count=4294967295", "'gemma3.block_count' is 4294967295, outside 1..4096"),
    ("gemma3", "tensor blk.1.post_ffw_norm.weight dropped", "tensor 'blk.1.post_ffw_norm.weight' is missing"),
    ("gemma4", "tensor blk.0.proj.weight ne0 halved", "tensor 'blk.0.proj.weight' has shape [8, 64]"),
    ("gemma4", "gemma4.final_logit_softcapping=nan", "'gemma4.final_logit_softcapping' is nan"),
    ("gpt-oss", "gpt-oss.block_count=2147483647", "'gpt-oss.block_count' is 2147483647, outside 1..4096"),
    ("gpt-oss", "tensor blk.1.attn_sinks.weight dropped", "tensor 'blk.1.attn_sinks.weight' is missing"),
    ("gpt-oss", "gpt-oss.expert_used_count=65535", "'gpt-oss.expert_used_count' is 65535, outside 1..4"),
]


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    folder = tmp_path_factory.mktemp("families")
    return {f: family_file(f, folder) for f in ("gemma3", "gemma4", "gpt-oss", "qwen35", "qwen35moe")}


@pytest.fixture(scope="module")
def worker():
    w = Worker()
    yield w
    w.close()


def _write(sources, tmp_path: Path, family: str, label: str) -> Path:
    path = tmp_path / f"{family}-{abs(hash(label))}.gguf"
    path.write_bytes(mutant(sources[family], arch_of(family), label))
    return path


def _one_line(text: str) -> str:
    lines = [ln for ln in text.splitlines() if ln.strip()]
    assert len(lines) == 1 and "Traceback" not in text, text
    return lines[0]


@pytest.mark.parametrize("family, label, expected", ESTIMATE_CASES)
def test_models_estimate_refuses_in_one_line(sources, tmp_path, family, label, expected):
    path = _write(sources, tmp_path, family, label)
    p = subprocess.run([sys.executable, "-m", "engine.frontends.cli", "models", "estimate", str(path)],
                       capture_output=True, text=True, timeout=DEADLINE_S, cwd=REPO,
                       env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert p.returncode == 2 and p.stdout == "", (p.returncode, p.stdout, p.stderr)
    line = _one_line(p.stderr)
    assert line.startswith("strata: ") and expected in line, line


@pytest.mark.parametrize("family, label, expected", LOAD_CASES)
def test_load_refuses_in_one_line(worker, sources, tmp_path, family, label, expected):
    path = _write(sources, tmp_path, family, label)
    out = worker.run({"kind": "gguf", "path": str(path)}, timeout=DEADLINE_S)
    assert out["outcome"] == "refused", out
    assert expected in out["detail"] and path.name in out["detail"], out["detail"]
    assert worker.peak_rss < 1 << 30


def test_generate_exits_2_on_the_hung_rope_width(sources, tmp_path):
    """`strata generate` on the Gemma 4 file that used to hang in MLX's RoPE: exit 2, one line."""
    path = _write(sources, tmp_path, "gemma4", "gemma4.rope.dimension_count=4294967295")
    p = subprocess.run([sys.executable, "-m", "engine.cli", "generate", "-m", str(path), "-p", "hi", "-n", "2"],
                       capture_output=True, text=True, timeout=120, cwd=REPO,
                       env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert p.returncode == 2, p.stderr
    assert "'gemma4.rope.dimension_count' is 4294967295" in _one_line(p.stderr)


def test_the_app_lists_a_hostile_family_file_with_its_reason(sources, tmp_path):
    from app.model_list import scan_models
    d = tmp_path / "models"
    d.mkdir()
    _write(sources, d, "qwen35", "qwen35.block_count=2147483647").rename(d / "bad-qwen35.gguf")
    (d / "good-gemma4.gguf").write_bytes(sources["gemma4"].read_bytes())
    rows = {Path(m.path).name: (m, needs) for m, needs in scan_models([d], None)}
    bad, _ = rows["bad-qwen35.gguf"]
    assert "'qwen35.block_count' is 2147483647" in _one_line(bad.error)
    good, needs = rows["good-gemma4.gguf"]
    assert not good.error and needs[0] != "?", (good, needs)


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_file_passes_the_schema(tmp_path, family):
    """The tiny file of each family (laid out as llama.cpp's converter writes it) passes the checks on
    both paths: the schema refuses only what a real file would not have."""
    from engine.model import memory_estimate as me
    from engine.model.gguf_checks import check_hyperparameters
    from engine.model.gguf_file import open_gguf
    path = family_file(family, tmp_path)
    check_hyperparameters(open_gguf(path))
    me.estimate(me.read_header(path), 256)


def test_a_block_index_of_many_digits_is_not_a_block(tmp_path):
    """A tensor named blk.<5000 digits>.x is no block (int() of it would raise), so block_count refuses."""
    from engine.model.gguf_schema import HeaderView, check_blocks
    view = HeaderView("f.gguf", "llama", {"llama.block_count": 1},
                      {"blk.0.attn_norm.weight": (4,), f"blk.{'9' * 5000}.x": (4,)})
    assert check_blocks(view) == 1
    view = HeaderView("f.gguf", "llama", {"llama.block_count": 2}, {"blk.0.attn_norm.weight": (4,)})
    with pytest.raises(ModelFileError, match="block_count is 2 but the file has tensors for 1 blocks"):
        check_blocks(view)


def test_a_per_layer_array_of_another_length_is_refused():
    from engine.model.gguf_schema import ArrayLen, HeaderView, per_layer
    view = HeaderView("f.gguf", "gemma4", {"gemma4.attention.sliding_window_pattern": (True, False, True),
                                           "gemma4.feed_forward_length": ArrayLen(1 << 20)}, {})
    with pytest.raises(ModelFileError, match="'gemma4.attention.sliding_window_pattern' has 3 values for 4 layers"):
        per_layer(view, "attention.sliding_window_pattern", 4, lo=0, hi=1)
    with pytest.raises(ModelFileError, match="'gemma4.feed_forward_length' has 1048576 values for 4 layers"):
        per_layer(view, "feed_forward_length", 4, hi=1 << 17)
    assert per_layer(view, "attention.sliding_window_pattern", 3, lo=0, hi=1) == (1, 0, 1)


def test_the_server_answers_400_for_a_hostile_draft_of_these_families(tmp_path, monkeypatch):
    """A hostile qwen35 file in the models folder named as the draft (`"speculative": "draft:NAME"`): 400
    in the API's shape naming the key or tensor, and the server still serves."""
    import httpx

    from engine.engine import Engine, EngineOptions, Status
    from engine.frontends.server import ServerThread, create_app
    from gguf_factory import write_tiny_gguf
    home = tmp_path / "home"
    models = home / "models"
    models.mkdir(parents=True)
    monkeypatch.setenv("STRATA_HOME", str(home))
    target = write_tiny_gguf(models / "target.gguf", arch="llama")
    src = family_file("qwen35", tmp_path)          # the same tiny vocabulary as the target: it may draft
    cases = {"qwen35.block_count=4294967295": "'qwen35.block_count' is 4294967295",
             "qwen35.rope.dimension_count=65535": "'qwen35.rope.dimension_count' is 65535",
             "tensor blk.0.ssm_dt.bias dropped": "tensor 'blk.0.ssm_dt.bias' is missing"}
    for i, label in enumerate(cases):
        (models / f"bad{i}.gguf").write_bytes(mutant(src, "qwen35", label))
    eng = Engine(EngineOptions(model=str(target))).start()
    try:
        assert eng.call(Status(), timeout=120).model
        srv = ServerThread(create_app(eng)).start()
        try:
            body = {"model": "default", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
            for i, want in enumerate(cases.values()):
                r = httpx.post(f"{srv.base_url}/chat/completions", json={**body, "speculative": f"draft:bad{i}"},
                               timeout=DEADLINE_S)
                assert r.status_code == 400, r.text
                msg = r.json()["error"]["message"]
                assert want in _one_line(msg) and "Traceback" not in r.text, msg
            assert httpx.post(f"{srv.base_url}/chat/completions", json=body, timeout=DEADLINE_S).status_code == 200
        finally:
            srv.stop()
    finally:
        eng.stop()


def test_an_empty_dimension_is_refused_for_every_architecture(tmp_path):
    """A tensor dimension of 0 takes no bytes, so it fits the file: found by the long fuzz run as a
    ZeroDivisionError inside mlx-lm's experts (qwen3moe blk.0.ffn_down_exps ne0 = 0)."""
    from engine.model import memory_estimate as me
    src = family_file("qwen3moe", tmp_path)
    data = bytearray(src.read_bytes())
    name = b"blk.0.ffn_down_exps.weight"
    at = data.index(len(name).to_bytes(8, "little") + name) + 8 + len(name) + 4     # its ne0
    data[at:at + 8] = bytes(8)
    bad = tmp_path / "empty-dim.gguf"
    bad.write_bytes(bytes(data))
    with pytest.raises(ModelFileError, match=r"tensor 'blk\.0\.ffn_down_exps\.weight' has shape \[0, .*: a dimension of 0"):
        me.estimate(me.read_header(bad), 256)
    w = Worker()
    try:
        out = w.run({"kind": "gguf", "path": str(bad)}, timeout=DEADLINE_S)
    finally:
        w.close()
    assert out["outcome"] == "refused" and "a dimension of 0" in out["detail"], out
