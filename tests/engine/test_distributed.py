"""One model over several processes on 127.0.0.1 (MLX ring backend on the CPU), against one process.

Each test starts its own ranks (tests/dist_harness.py: MLX_RANK/MLX_HOSTFILE, free ports) with
bounded waits, and kills them all at the end.
"""
from __future__ import annotations

import signal
import time

import pytest

from dist_harness import json_line, run_ranks, run_single, start_ranks

PROMPT = ["-p", "Hello there, how are you?", "-n", "12", "--json"]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from gguf_factory import write_tiny_gguf
    d = tmp_path_factory.mktemp("dist-models")
    return {
        "llama": write_tiny_gguf(d / "llama.gguf", arch="llama", n_layer=4, n_embd=64, n_head=4, n_head_kv=2,
                                 n_ff=128, seed=3),
        "llama-untied": write_tiny_gguf(d / "llama-untied.gguf", arch="llama", n_layer=3, n_embd=64, n_head=4,
                                        n_head_kv=2, n_ff=128, seed=4, tie_embeddings=False),
        "qwen2": write_tiny_gguf(d / "qwen2.gguf", arch="qwen2", n_layer=4, n_embd=64, n_head=4, n_head_kv=2,
                                 n_ff=128, seed=5),
        "qwen3": write_tiny_gguf(d / "qwen3.gguf", arch="qwen3", n_layer=4, n_embd=64, n_head=4, n_head_kv=2,
                                 n_ff=128, seed=6),
    }


def test_split_layers():
    from engine.ranks.pipeline_model import split_layers
    assert split_layers(30, 2) == [(0, 15), (15, 30)]
    assert split_layers(4, 3) == [(0, 2), (2, 3), (3, 4)]
    with pytest.raises(ValueError):
        split_layers(2, 3)


def _tokens(out: str) -> list[int]:
    return json_line(out)["tokens"]


@pytest.mark.parametrize("arch,n", [("llama", 2), pytest.param("llama-untied", 3, marks=pytest.mark.slow),
                                    pytest.param("qwen2", 2, marks=pytest.mark.slow),
                                    pytest.param("qwen3", 3, marks=pytest.mark.slow)])
def test_pipeline_greedy_equals_one_process(models, tmp_path, arch, n):
    args = ["generate", "-m", str(models[arch]), *PROMPT]
    single = _tokens(run_single(args))
    out, ranks = run_ranks(n, [*args, "-v"], tmp_path)
    assert _tokens(out) == single
    # Each rank holds its own contiguous layers, and says so in the load log.
    for r in range(n):
        assert f"distributed: pipeline over {n} ranks" in ranks.log(r)
        assert f"this is rank {r}" in ranks.log(r)


def test_pipeline_sampling_with_seed_equals_one_process(models, tmp_path):
    args = ["generate", "-m", str(models["llama"]), *PROMPT, "--temp", "1.0", "--seed", "7"]
    assert _tokens(run_ranks(2, args, tmp_path)[0]) == _tokens(run_single(args))


@pytest.mark.slow
def test_tensor_parallel_greedy_equals_one_process(models, tmp_path):
    args = ["generate", "-m", str(models["qwen3"]), *PROMPT]
    out, ranks = run_ranks(2, [*args, "-v"], tmp_path, extra_env={"STRATA_DIST_MODE": "tensor"})
    assert _tokens(out) == _tokens(run_single(args))
    assert "tensor parallel over 2 ranks" in ranks.log(0)
    # Session files: each rank's K/V heads gathered into the single-process file, and scattered back.
    m = str(models["qwen3"])
    # The disk tier off: each run starts cold, so every cached token comes from the session file
    cold = ["--conversation-disk-mib", "0"]
    first = ["generate", "-m", m, "-p", "Tell me about the sea.", "-n", "6", "--json", *cold]
    follow = ["generate", "-m", m, "-p", "And the sky?", "-n", "8", "--json", *cold]
    s_single, s_dist = tmp_path / "single.stratasession", tmp_path / "tp.stratasession"
    run_single([*first, "--save-session", str(s_single)])
    run_ranks(2, [*first, "--save-session", str(s_dist)], tmp_path, extra_env={"STRATA_DIST_MODE": "tensor"})
    want = _tokens(run_single([*follow, "--restore-session", str(s_single)]))
    assert _tokens(run_single([*follow, "--restore-session", str(s_dist)])) == want
    assert _tokens(run_ranks(2, [*follow, "--restore-session", str(s_single)], tmp_path,
                             extra_env={"STRATA_DIST_MODE": "tensor"})[0]) == want


@pytest.mark.slow
def test_real_model_pipeline_greedy(real_model, tmp_path):
    args = ["generate", "-m", str(real_model), "-p", "What is the capital of France?", "-n", "8", "--json"]
    assert _tokens(run_ranks(2, args, tmp_path, timeout=240)[0]) == _tokens(run_single(args, timeout=240))


@pytest.mark.parametrize("n", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_session_portable_between_single_and_distributed(models, tmp_path, n):
    """A session saved by n ranks restores in one process and vice versa; the follow-up tokens agree."""
    m = str(models["llama"])
    cold = ["--conversation-disk-mib", "0"]     # every run cold: each cached token from the session file
    first = ["generate", "-m", m, "-p", "Tell me about the sea.", "-n", "6", "--json", *cold]
    follow = ["generate", "-m", m, "-p", "And the sky?", "-n", "8", "--json", *cold]
    s_single, s_dist = tmp_path / "single.stratasession", tmp_path / "dist.stratasession"
    run_single([*first, "--save-session", str(s_single)])
    run_ranks(n, [*first, "--save-session", str(s_dist)], tmp_path)
    assert s_dist.exists()
    single_single = json_line(run_single([*follow, "--restore-session", str(s_single)]))
    dist_single = json_line(run_single([*follow, "--restore-session", str(s_dist)]))
    single_dist = json_line(run_ranks(n, [*follow, "--restore-session", str(s_single)], tmp_path)[0])
    assert dist_single["tokens"] == single_single["tokens"] == single_dist["tokens"]
    # The whole conversation came from the file every time (nothing re-computed but the new turn).
    assert dist_single["cached_tokens"] == single_single["cached_tokens"] == single_dist["cached_tokens"] > 0


def _get(url: str, timeout: float = 5.0):
    import httpx
    return httpx.get(url, timeout=timeout)


def _chat(base: str, timeout: float = 30.0):
    import httpx
    return httpx.post(f"{base}/chat/completions", timeout=timeout,
                      json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "temperature": 0})


def _serve(models, tmp_path, env=None):
    from dist_harness import free_ports
    port = free_ports(1)[0]
    ranks = start_ranks(2, ["serve", "-m", str(models["llama"]), "--port", str(port), "-v"], tmp_path, env)
    base = f"http://127.0.0.1:{port}/v1"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            # the server answers while the model loads (the model listed as "loading"): wait for it
            r = _get(f"{base}/models", 1)
            if r.status_code == 200 and r.json()["data"] and "status" not in r.json()["data"][0]:
                return ranks, base
        except Exception:   # not listening yet
            pass
        assert all(p.poll() is None for p in ranks.procs), ranks.log(0)[-2000:] + ranks.log(1)[-2000:]
        time.sleep(0.3)
    ranks.kill()
    raise AssertionError("the server did not start:\n" + ranks.log(0)[-2000:])


@pytest.mark.parametrize("how", ["kill", pytest.param("hang", marks=pytest.mark.slow)])
def test_lost_rank_gives_503_in_bounded_time(models, tmp_path, how):
    ranks, base = _serve(models, tmp_path, {"STRATA_DIST_TIMEOUT": "4"})
    with ranks:
        models_body = _get(f"{base}/models").json()["data"][0]
        assert models_body["distributed"]["mode"] == "pipeline"
        assert models_body["distributed"]["split"] == [[0, 2], [2, 4]]
        assert _chat(base).status_code == 200            # both ranks serve
        follower = ranks.procs[1]
        if how == "kill":
            follower.kill()
            follower.wait(10)
        else:
            follower.send_signal(signal.SIGSTOP)        # alive but silent: only the watchdog can tell
        t0 = time.monotonic()
        r = _chat(base, timeout=30)
        assert r.status_code == 503, r.text
        assert r.json()["error"]["message"].startswith("distributed:")
        assert time.monotonic() - t0 < 20
        t0 = time.monotonic()
        r = _chat(base, timeout=10)                      # later requests: at once, same answer
        assert r.status_code == 503 and time.monotonic() - t0 < 3
        assert _get(f"{base}/models").status_code == 200  # the server itself keeps answering


def test_parking_a_b_a_in_lockstep(models, tmp_path):
    """A, then B (A parks), then A again (A's K/V comes back moved): same tokens, same reuse as one
    process, and the follower parked and restored its own layers on the same steps."""
    import json
    script = tmp_path / "aba.jsonl"
    script.write_text("\n".join(json.dumps(s) for s in [
        {"conversation": "A", "user": "Tell me about cats.", "max_tokens": 6},
        {"conversation": "B", "user": "Tell me about dogs, please.", "max_tokens": 6},
        {"conversation": "A", "user": "And their tails?", "max_tokens": 6}]))
    args = ["replay", "-m", str(models["llama"]), str(script), "--json"]

    def steps(out: str) -> list[dict]:
        return [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    single = steps(run_single(args))
    out, ranks = run_ranks(2, [*args, "-v"], tmp_path)
    dist = steps(out)
    assert [s["tokens"] for s in dist] == [s["tokens"] for s in single]
    assert [s["cached_tokens"] for s in dist] == [s["cached_tokens"] for s in single]
    assert dist[2]["cached_tokens"] > 0
    assert any("restored" in e and "(moved)" in e for e in dist[2]["events"])
    follower = ranks.log(1)
    assert "parked" in follower and "(moved)" in follower


def test_ranks_with_different_model_files_refuse(models, tmp_path):
    """Every rank loads its own --model; different files would compute garbage, so rank 0 refuses."""
    from dist_harness import _env, write_hostfile
    import subprocess
    import sys
    hostfile = write_hostfile(tmp_path / "hosts.json", 2)
    procs = [subprocess.Popen([sys.executable, "-m", "engine.cli", "generate", "-m", str(models[m]), "-p", "hi",
                               "-n", "2"], env=_env(r, hostfile, None), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
             for r, m in enumerate(("llama", "qwen2"))]
    try:
        _, err = procs[0].communicate(timeout=60)
        assert procs[0].returncode == 2
        assert "the ranks loaded different model files" in err
        procs[1].wait(30)                       # the follower stops once rank 0 is gone
    finally:
        for p in procs:
            p.kill()
            p.wait(10)


@pytest.mark.parametrize("mode", ["pipeline", pytest.param("tensor", marks=pytest.mark.slow)])
def test_cancel_stops_every_rank_after_the_same_token(models, tmp_path, mode):
    """A streaming client that goes away cancels the generation on rank 0; the flag travels with the
    next step, so the follower stops too and the next request is served in step."""
    import re

    import httpx
    ranks, base = _serve(models, tmp_path, {"STRATA_DIST_MODE": mode})
    with ranks:
        before = _chat(base).json()["choices"][0]["message"]["content"]
        with httpx.stream("POST", f"{base}/chat/completions", timeout=30,
                          json={"messages": [{"role": "user", "content": "Write a long story."}],
                                "max_tokens": 1800, "temperature": 0, "stream": True}) as r:
            for i, _ in enumerate(r.iter_lines()):
                if i > 4:
                    break                   # leaving the block closes the connection
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and "finish cancelled" not in ranks.log(1):
            time.sleep(0.2)
        logs = [ranks.log(0), ranks.log(1)]
        assert all("finish cancelled" in log for log in logs), logs[1][-2000:]
        generated = [re.findall(r"(\d+) generated, [^\n]*finish cancelled", log)[-1] for log in logs]
        assert generated[0] == generated[1] and int(generated[0]) < 1800
        after = _chat(base)
        assert after.status_code == 200 and after.json()["choices"][0]["message"]["content"] == before


def test_a_rank_reads_only_its_own_tensors(models, monkeypatch):
    """Rank 1 of 3 on a 3-layer untied model: layer 1 only, no embeddings, norm or output head."""
    import mlx.nn as nn

    from engine.model import quants
    from engine.model.gguf_file import open_gguf
    from engine.model.model_loader import load_model
    from engine.ranks.pipeline_model import PipelinePart
    read = []
    convert = quants.convert_tensor
    monkeypatch.setattr(quants, "convert_tensor", lambda t, **kw: (read.append(t.name), convert(t, **kw))[1])
    g = open_gguf(models["llama-untied"])
    model, info = load_model(g, part=PipelinePart(1, 3, 1, 2, 3))
    assert read and all(name.startswith("blk.1.") for name in read)
    names = [k for k, _ in nn.utils.tree_flatten(model.parameters())]
    assert names and all(k.startswith("model.layers.0.") for k in names)
    assert info.n_layer == 3                        # the model's geometry, not the part's
    read.clear()
    last, _ = load_model(g, part=PipelinePart(2, 3, 2, 3, 3))
    assert {n.split(".")[0] for n in read} == {"blk", "output_norm", "output"}
    assert "lm_head" in last and "embed_tokens" not in last.model


def test_server_sessions_and_a_failed_save_in_step(models, tmp_path, strata_home):
    """Over HTTP with 2 ranks: save and restore a session; a save onto a folder fails on rank 0 only
    (followers write nothing), and the request fails with the file's message without breaking the ring."""
    import httpx
    ranks, base = _serve(models, tmp_path)
    with ranks:
        first = _chat(base).json()["choices"][0]["message"]["content"]
        ok = httpx.post(f"{base}/sessions/save", json={"name": "good"}, timeout=30)
        assert ok.status_code == 200 and ok.json()["tokens"] > 0
        (strata_home / "sessions" / "bad.stratasession").mkdir(parents=True)
        bad = httpx.post(f"{base}/sessions/save", json={"name": "bad"}, timeout=30)
        assert bad.status_code == 400 and "is a folder" in bad.json()["error"]["message"]
        back = httpx.post(f"{base}/sessions/restore", json={"name": "good"}, timeout=30)
        assert back.status_code == 200
        again = _chat(base)                           # still in step: the same greedy reply
        assert again.status_code == 200 and again.json()["choices"][0]["message"]["content"] == first
        assert "distributed: rank(s)" not in ranks.log(0)
