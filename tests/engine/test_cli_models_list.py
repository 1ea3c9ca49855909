"""`strata models list` / `models estimate` / `generate` over split sets and the libraries found in place."""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from engine.frontends.cli import main
from gguf_factory import write_tiny_gguf
from gguf_factory_split import hostile_sets, write_split
from library_trees import hf_cache, lm_studio, ollama


@pytest.fixture()
def library(strata_home, tmp_path):
    """A models folder with a split set, its projector and a plain file; LM Studio, the Hugging Face
    cache and Ollama in the library home the tests use (conftest: STRATA_LIBRARY_HOME)."""
    src = write_tiny_gguf(tmp_path / "src" / "tiny.gguf", arch="llama", seed=0)
    other = write_tiny_gguf(tmp_path / "src" / "other.gguf", arch="llama", seed=1)
    models = strata_home / "models"
    models.mkdir(exist_ok=True)
    parts = write_split(src, models, 2, stem="Tiny-Q8_0")
    shutil.copyfile(other, models / "mmproj-Tiny-Q8_0-f16.gguf")
    shutil.copyfile(other, models / "plain.gguf")
    home = Path(os.environ["STRATA_LIBRARY_HOME"])
    lm_studio(home, {"pub/repo/lm.gguf": other})
    hf_cache(home / ".cache" / "huggingface" / "hub", "org/Tiny-GGUF", {"hf.gguf": src})
    ollama(home / ".ollama" / "models", "tiny", "3b", src)
    return parts


def _lines(capsys, *argv) -> tuple[int, list[str], str]:
    code = main(list(argv))
    cap = capsys.readouterr()
    return code, cap.out.splitlines(), cap.err


def test_models_list_shows_each_model_once_with_where_it_lives(library, capsys):
    code, lines, err = _lines(capsys, "models", "list")
    assert code == 0 and err == ""
    rows = dict(line.split("\t", 1) for line in lines)
    names = {Path(p).name: where for p, where in rows.items()}
    assert names.pop(library[0].name) == "Strata (2 parts, projector mmproj-Tiny-Q8_0-f16.gguf)"
    assert names.pop("plain.gguf") == "Strata"
    assert names.pop("lm.gguf") == "LM Studio"
    assert names.pop("hf.gguf") == "Hugging Face org/Tiny-GGUF"
    (blob, where), = names.items()
    assert blob.startswith("sha256-") and where == "Ollama tiny:3b"
    code, lines, _ = _lines(capsys, "models", "list", "--no-libraries", "--paths")
    assert [Path(x).name for x in lines] == [library[0].name, "plain.gguf"]


def test_a_library_model_is_found_by_its_library_name_and_a_split_set_estimated(library, capsys):
    code, lines, err = _lines(capsys, "models", "estimate", "tiny:3b")
    assert code == 0 and lines[0].startswith("sha256-") and "llama" in lines[0]
    code, lines, err = _lines(capsys, "models", "estimate", str(library[0]))
    assert code == 0 and lines[0].startswith(library[0].name)


def test_generate_refuses_a_broken_set_in_one_line(library, capsys):
    library[1].unlink()
    code = main(["generate", "--model", str(library[0]), "--prompt", "Hi", "--max-tokens", "1"])
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert code == 2 and len(err) == 1 and library[1].name in err[0] and "missing" in err[0]


@pytest.mark.parametrize("case", ["missing", "two-models", "counts"])
def test_a_hostile_set_is_one_line_naming_its_part_and_exit_2(strata_home, tmp_path, capsys, case):
    """A part missing, parts of two models, counts that disagree: `generate` and `models estimate` each
    exit 2 with one line on stderr naming the part at fault; `models list` still lists the set once."""
    src = write_tiny_gguf(tmp_path / "src.gguf", arch="llama", seed=0)
    first, part = hostile_sets(src, tmp_path / "sets")[case]
    for argv in (["generate", "--model", str(first), "--prompt", "Hi", "--max-tokens", "1"],
                 ["models", "estimate", str(first)]):
        code = main(argv)
        cap = capsys.readouterr()
        err = [ln for ln in cap.err.splitlines() if ln.strip()]
        assert code == 2 and len(err) == 1 and part in err[0], (argv, cap.err)
        assert err[0].startswith("strata: ") and cap.out == ""
    code, lines, _ = _lines(capsys, "models", "list", "--no-libraries", "--folder", str(first.parent))
    assert code == 0 and lines[-1] == f"{first}\tFolder (3 parts)"
