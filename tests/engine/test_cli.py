"""`strata generate`: output formats, and every bad input exits 2 with one line naming the problem."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest

from engine.frontends.cli import main

STRATA = [sys.executable, "-m", "engine.cli"]


def rewrite_gguf(src: Path, dst: Path, *, arch: str | None = None, drop_prefix: str | None = None,
                 retype: str | None = None) -> Path:
    """Copy a GGUF with a change: another architecture name, some keys dropped, or one tensor
    stored as NVFP4 (a type Strata does not read)."""
    r = gguf.GGUFReader(src)
    old_arch = r.fields["general.architecture"].contents()
    w = gguf.GGUFWriter(str(dst), arch or old_arch)
    for key, field in r.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        if drop_prefix and key.startswith(drop_prefix):
            continue
        if arch and key.startswith(old_arch + "."):
            key = arch + key[len(old_arch):]
        vtype = field.types[0]
        value = field.contents()
        if vtype == gguf.GGUFValueType.ARRAY:
            w.add_array(key, value)
        else:
            w.add_key_value(key, value, vtype)
    for t in r.tensors:
        if retype and t.name == retype:
            rows, cols = int(t.shape[1]), int(t.shape[0])
            blocks = np.zeros((rows, cols // 64, 36), dtype=np.uint8)
            w.add_tensor(t.name, blocks.reshape(rows, -1),
                         raw_dtype=gguf.GGMLQuantizationType.NVFP4)
        else:
            w.add_tensor(t.name, np.array(t.data), raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


def run_main(capsys, *args) -> tuple[int, str, str]:
    code = main(["generate", *args])
    out, err = capsys.readouterr()
    return code, out, err


def test_json_output_has_the_documented_fields(tiny_gguf, capsys):
    code, out, err = run_main(capsys, "--model", str(tiny_gguf), "--prompt", "Hello", "--json",
                              "--max-tokens", "5", "--temperature", "0.7", "--seed", "3")
    assert code == 0, err
    obj = json.loads(out)
    for key in ("tokens", "text", "prompt_tokens", "cached_tokens", "ttft_ms", "prefill_tps", "decode_tps"):
        assert key in obj
    assert len(obj["tokens"]) == 5 and obj["cached_tokens"] == 0


def test_raw_mode_feeds_text_without_template(tiny_gguf, capsys):
    _, out_raw, _ = run_main(capsys, "--model", str(tiny_gguf), "--prompt", "Hello", "--raw", "--json",
                             "--max-tokens", "2")
    _, out_chat, _ = run_main(capsys, "--model", str(tiny_gguf), "--prompt", "Hello", "--json",
                              "--max-tokens", "2")
    assert json.loads(out_raw)["prompt_tokens"] < json.loads(out_chat)["prompt_tokens"]


def test_streaming_text_goes_to_stdout_and_stats_to_stderr(tiny_gguf, capsys):
    code, out, err = run_main(capsys, "--model", str(tiny_gguf), "--prompt", "Hi", "--max-tokens", "4",
                              "--temperature", "0.8", "--seed", "1")
    assert code == 0
    assert "generated" in err and "tok/s" in err
    assert "tok/s" not in out


def bad_inputs(tmp_path: Path, tiny_gguf: Path) -> dict[str, tuple[Path, str]]:
    not_gguf = tmp_path / "notes.gguf"
    not_gguf.write_text("just some text, not a model\n")
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(tiny_gguf.read_bytes()[: tiny_gguf.stat().st_size // 2])
    return {
        "missing": (tmp_path / "nope.gguf", "model file not found"),
        "not a gguf": (not_gguf, "is not a GGUF file"),
        "truncated": (truncated, "truncated"),
        "architecture": (rewrite_gguf(tiny_gguf, tmp_path / "mamba.gguf", arch="mamba"),
                         "architecture 'mamba' is not supported"),
        "tensor type": (rewrite_gguf(tiny_gguf, tmp_path / "nvfp4.gguf", retype="blk.0.ffn_up.weight"),
                        "NVFP4"),
        "tokenizer": (rewrite_gguf(tiny_gguf, tmp_path / "notok.gguf", drop_prefix="tokenizer."),
                      "missing tokenizer metadata"),
    }


@pytest.mark.parametrize("case", ["missing", "not a gguf", "truncated", "architecture", "tensor type",
                                  "tokenizer"])
def test_bad_model_exits_2_with_one_line(case, tmp_path, tiny_gguf, capsys):
    path, message = bad_inputs(tmp_path, tiny_gguf)[case]
    code, out, err = run_main(capsys, "--model", str(path), "--prompt", "Hi", "--max-tokens", "1")
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code == 2
    assert len(lines) == 1, err
    assert lines[0].startswith("strata: ") and message in lines[0]
    assert "Traceback" not in err


def test_real_process_exit_code_and_no_traceback(tmp_path, tiny_gguf):
    path, message = bad_inputs(tmp_path, tiny_gguf)["truncated"]
    p = subprocess.run([*STRATA, "generate", "--model", str(path), "--prompt", "Hi"],
                       capture_output=True, text=True, timeout=120, cwd=Path(__file__).resolve().parents[2])
    assert p.returncode == 2
    err_lines = [ln for ln in p.stderr.splitlines() if ln.strip() and "PyTorch was not found" not in ln]
    assert len(err_lines) == 1 and message in err_lines[0], p.stderr


def test_successful_run_exits_0(tiny_gguf):
    # Guards against mlx's abort at exit after sampling on a thread that ended (see Engine.run_forever).
    p = subprocess.run([*STRATA, "generate", "--model", str(tiny_gguf), "--prompt", "Hi", "--max-tokens", "3",
                        "--temperature", "0.9", "--seed", "1", "--json"],
                       capture_output=True, text=True, timeout=120, cwd=Path(__file__).resolve().parents[2])
    assert p.returncode == 0, p.stderr
    assert len(json.loads(p.stdout)["tokens"]) == 3


@pytest.mark.parametrize("flags, why", [
    (["--conversation-cache-mib", "-5"], "got -5 MiB"),
    (["--conversation-cache-mib", "999999999"], "got 999999999 MiB"),
    (["--conversation-cache-slots", "0"], "--conversation-cache-slots must be 1 to 64; got 0"),
])
def test_bad_cache_size_exits_2_with_one_line(flags, why, tiny_gguf, capsys):
    """One rule (engine.limits): 0 to half of this machine's RAM, checked before the model is loaded."""
    from engine.limits import machine_cache_range
    code, out, err = run_main(capsys, "--model", str(tiny_gguf), "--prompt", "Hi", "--max-tokens", "1", *flags)
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code == 2 and out == "" and len(lines) == 1, err
    assert lines[0].startswith("strata: --conversation-cache") and why in lines[0]
    if "mib" in flags[0]:
        assert f"must be {machine_cache_range().describe()}" in lines[0]


@pytest.mark.parametrize("ctx", ["0", "-3", "15"])
def test_a_context_below_16_exits_2_before_the_load(ctx, tiny_gguf, capsys):
    """--ctx 0 used to mean "the model's own" silently, and a negative one loaded the model first."""
    code, out, err = run_main(capsys, "--model", str(tiny_gguf), "--prompt", "Hi", "--max-tokens", "1",
                              "--ctx", ctx)
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code == 2 and out == "" and lines == [f"strata: --ctx must be at least 16 tokens (omit it for the "
                                                 f"model's own); got {ctx}"], err


def test_cache_size_at_the_limit_is_taken(tiny_gguf, capsys):
    from engine.limits import machine_cache_range
    top = machine_cache_range().max_mib
    code, out, err = run_main(capsys, "--model", str(tiny_gguf), "--prompt", "Hi", "--max-tokens", "1", "--json",
                              "--conversation-cache-mib", str(top))
    assert code == 0, err
    code, _, err = run_main(capsys, "--model", str(tiny_gguf), "--prompt", "Hi", "--max-tokens", "1",
                            "--conversation-cache-mib", str(top + 1))
    assert code == 2 and f"got {top + 1} MiB" in err


def test_serve_refuses_bad_cache_size_before_taking_the_port(tiny_gguf, capsys):
    import socket
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    code = main(["serve", "--model", str(tiny_gguf), "--port", str(port), "--conversation-cache-mib", "-5"])
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("strata: --conversation-cache-mib must be 0 to ")
    with socket.socket() as again:                      # the port was never taken
        again.bind(("127.0.0.1", port))


def test_sampling_flags_and_replay_steps_take_the_sampling_table():
    """generate's sampling flags and a replay step's sampling: engine/sampling.FIELDS' types and
    defaults (a replay step's reply length aside), no second copy."""
    import argparse

    from engine.frontends.cli import add_sampling_flags
    from engine.frontends.replay import REPLAY_MAX_TOKENS, step_sampling
    from engine.sampling import FIELDS, SamplingParams
    p = argparse.ArgumentParser()
    add_sampling_flags(p)
    args = p.parse_args([])
    assert {f.name: getattr(args, f.name) for f in FIELDS} == {f.name: f.default for f in FIELDS}
    assert p.parse_args(["--temp", "0.5", "-n", "7", "--repeat-penalty", "1.2"]).repetition_penalty == 1.2
    assert step_sampling({"user": "hi"}) == SamplingParams(max_tokens=REPLAY_MAX_TOKENS)
    assert step_sampling({"user": "hi", "top_k": 5, "temperature": 1}) == SamplingParams(
        max_tokens=REPLAY_MAX_TOKENS, top_k=5, temperature=1.0)
