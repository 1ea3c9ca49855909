"""bench/harness.py: every bench figure one JSON line (machine, device, commit, command, figure, value),
read back by `harness.py show`, and whole runs kept as indexed raw logs by `harness.py log`. Real files in
tmp_path, the real scripts run as their own processes; the end-to-end run is bench/engine.py on the tiny
random shape (seconds on this CPU).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
from bench.harness import BASE_FIELDS, Run  # noqa: E402

HARNESS = REPO / "bench" / "harness.py"


def _lines(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text(encoding="utf-8").splitlines() if x.strip()]


def _run(*args: str, env_extra: dict | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    env.pop("BENCH_RESULTS", None)
    env.pop("BENCH_COMMAND", None)
    env.update(env_extra or {})
    return subprocess.run([sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=timeout)


def _head() -> str:
    return subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()


def test_two_figures_are_two_json_lines_with_every_field(tmp_path, capsys):
    out = tmp_path / "r.jsonl"
    run = Run(out=out, argv=["bench/demo.py", "--rounds", "3"])
    run.record("decode", 12.5, "tok/s", spread=[11.0, 12.5, 14.0], rounds=3,
               line="decode 12.5 tok/s")
    run.record("decode / mlx-lm", 1.02, "x", peer="mlx-lm")
    rows = _lines(out)
    assert len(rows) == 2
    for r in rows:
        assert set(BASE_FIELDS) <= set(r)
        assert set(r["machine"]) >= {"hostname", "cpu", "cores", "ram_gib", "load_1m"}
        assert r["machine"]["cores"] == os.cpu_count() and r["machine"]["ram_gib"] > 0
        assert r["device"]                              # MLX's device, or "none (no mlx)"
        head = _head()
        if head:                                        # a git checkout: HEAD, "+dirty" when tracked files changed
            assert r["commit"] in (head, head + "+dirty")
        assert r["command"] == "bench/demo.py --rounds 3"
        assert r["bench"] == "demo"
    assert (rows[0]["figure"], rows[0]["value"], rows[0]["unit"]) == ("decode", 12.5, "tok/s")
    assert rows[0]["spread"] == {"min": 11.0, "median": 12.5, "max": 14.0} and rows[0]["rounds"] == 3
    assert (rows[1]["figure"], rows[1]["peer"]) == ("decode / mlx-lm", "mlx-lm") and "spread" not in rows[1]
    assert capsys.readouterr().out == "decode 12.5 tok/s\n"     # the script's own line, once


def test_results_go_to_the_env_file_and_base_fields_stay_fixed(tmp_path, monkeypatch):
    monkeypatch.setenv("BENCH_RESULTS", str(tmp_path / "env.jsonl"))
    Run(argv=["bench/demo.py"]).record("x", 1, "ms")
    assert [r["figure"] for r in _lines(tmp_path / "env.jsonl")] == ["x"]
    with pytest.raises(ValueError, match="commit"):         # a figure cannot claim other code than was run
        Run(out=tmp_path / "r.jsonl", argv=["d"]).record("x", 1, "ms", commit="abc")
    assert not (tmp_path / "r.jsonl").exists()


def test_show_prints_the_latest_of_each_figure(tmp_path):
    out = tmp_path / "r.jsonl"
    Run(out=out, argv=["bench/alpha.py"]).record("decode", 10.0, "tok/s", spread=[9.0, 10.0, 11.0])
    Run(out=out, argv=["bench/alpha.py"]).record("decode", 20.0, "tok/s")
    Run(out=out, argv=["bench/beta.py"]).record("restore", 3.25, "ms")
    got = _run(str(HARNESS), "show", "--file", str(out), timeout=120)
    assert got.returncode == 0, got.stderr
    table = got.stdout.splitlines()
    assert table[0].split()[:4] == ["bench", "figure", "value", "unit"]
    assert any(ln.split()[:4] == ["alpha", "decode", "20", "tok/s"] for ln in table)
    assert any(ln.split()[:4] == ["beta", "restore", "3.25", "ms"] for ln in table)
    assert len(table) == 3                                  # the older decode line is not the latest
    only = _run(str(HARNESS), "show", "--file", str(out), "--bench", "beta", timeout=120).stdout
    assert "restore" in only and "decode" not in only
    every = _run(str(HARNESS), "show", "--file", str(out), "--all", timeout=120).stdout.splitlines()
    assert len(every) == 4 and any("9-11" in ln for ln in every)
    missing = _run(str(HARNESS), "show", "--file", str(tmp_path / "none.jsonl"), timeout=120)
    assert missing.returncode == 2 and "no results file" in missing.stderr
    out.write_text(out.read_text() + "not json\n")
    bad = _run(str(HARNESS), "show", "--file", str(out), timeout=120)
    assert bad.returncode != 0 and "r.jsonl:4: not a JSON line" in bad.stderr


def test_log_keeps_a_run_headed_by_its_command_and_indexes_it(tmp_path):
    raw = tmp_path / "results" / "raw"
    raw.mkdir(parents=True)
    index = tmp_path / "results" / "README.md"
    index.write_text("| file | session, call | what | holds |\n|---|---|---|---|\n")
    cmd = [sys.executable, "-c", "print('figure 1'); import sys; sys.exit(3)"]
    got = _run(str(HARNESS), "log", "s14-run2-demo", "--dir", str(raw), "--", *cmd, timeout=120)
    assert got.returncode == 3 and "figure 1" in got.stdout      # the command's output and exit code pass through
    text = (raw / "s14-run2-demo.txt").read_text().splitlines()
    assert text[0].startswith("# ") and "print(" in text[0] and text[1:] == ["figure 1"]
    assert index.read_text().splitlines()[-1].startswith("| [s14-run2-demo.txt](raw/s14-run2-demo.txt) | 14, 2 |")
    again = _run(str(HARNESS), "log", "s14-run2-demo", "--dir", str(raw), "--", "true", timeout=120)
    assert again.returncode == 2 and "never overwritten" in again.stderr
    assert (raw / "s14-run2-demo.txt").read_text().splitlines()[1:] == ["figure 1"]


def _engine_args(tmp_path) -> list[str]:
    return ["--random-shape", "tiny", "--shape-dir", str(tmp_path / "shapes"), "--rounds", "1", "--gen", "4",
            "--prompt-tokens", "16", "--no-llama", "--out", str(tmp_path / "r.jsonl")]


def test_engine_bench_end_to_end_records_its_table(tmp_path):
    got = _run("bench/engine.py", *_engine_args(tmp_path))
    assert got.returncode == 0, got.stderr[-3000:]
    assert "| strata |" in got.stdout and "| mlx-lm |" in got.stdout       # the human table unchanged
    rows = {r["figure"]: r for r in _lines(tmp_path / "r.jsonl")}
    assert {"strata prefill", "strata decode", "mlx-lm prefill", "mlx-lm decode", "strata prefill / mlx-lm",
            "strata decode / mlx-lm"} == set(rows)
    ratio = rows["strata decode / mlx-lm"]
    assert ratio["bench"] == "engine" and ratio["unit"] == "x" and ratio["peer"] == "mlx-lm"
    assert ratio["value"] > 0 and ratio["rounds"] == 1 and ratio["prompt_tokens"] == 16
    assert ratio["command"].startswith("bench/engine.py --random-shape tiny")
    assert ratio["device"].startswith("Device(cpu")               # MLX on this machine's CPU
    # the recorded tok/s are the table's (one decimal there)
    strata_row = next(ln for ln in got.stdout.splitlines() if ln.startswith("| strata |"))
    assert strata_row.split("|")[3].strip() == f"{rows['strata decode']['value']:.1f}"


def test_a_wrapper_records_its_own_command(tmp_path):
    """bench/trace_run.py runs a script in its own process with switches of its own: those are the A/B."""
    got = _run("bench/trace_run.py", "--every", "600", "--no-merge", "bench/engine.py", *_engine_args(tmp_path))
    assert got.returncode == 0, got.stderr[-3000:]
    rows = _lines(tmp_path / "r.jsonl")
    assert rows and all(r["bench"] == "engine" for r in rows)
    assert all(r["command"].startswith("bench/trace_run.py --every 600 --no-merge bench/engine.py") for r in rows)
