"""Hostile inputs from issue 12, one by one: GGUF headers, chat templates, sampling flags, the local
server's body/Host/Origin/Content-Type rules, and an engine error that must not poison later requests.

GGUF mutants are loaded in tests/fuzz_worker.py (a child under RLIMIT_AS, killed on a hang), so a
regression shows up as a failed test, not as a machine out of memory.
"""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from engine.text import chat_template
from engine.text.chat_template import render
from engine.engine import Engine, EngineOptions, GenerateRequest, Status
from engine.errors import RequestError, StrataError
from engine.events import Log
from engine.sampling import MAX_SEED, SamplingError, SamplingParams
from engine.frontends.server import ServerThread, create_app
from fuzz_harness import HOSTILE_TEMPLATES, Worker, layout, targeted_mutants
from engine_reads import while_held

STRATA = [sys.executable, "-m", "engine.cli"]
CHAT = [{"role": "user", "content": "Hello there, how are you?"}]


# ---- GGUF --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def worker():
    w = Worker()
    yield w
    w.close()


def _mutant(tiny_gguf, tmp_path, label: str) -> Path:
    original = tiny_gguf.read_bytes()
    data = dict(targeted_mutants(original, layout(tiny_gguf)))[label]
    path = tmp_path / f"{label.replace(' ', '_').replace('=', '-')[:60]}.gguf"
    path.write_bytes(data)
    return path


@pytest.mark.parametrize("label, expected", [
    ("block_count=131074", "'llama.block_count' is 131074, outside 1..4096"),
    ("block_count=3", "block_count is 3 but the file has tensors for 2 blocks"),
    ("tokenizer.ggml.token_type count=100000000", "claims 100000000 elements, more than the file holds"),
    ("tokenizer.ggml.token_type count=1099511627776", "more than the file holds"),
    ("tokenizer.ggml.token_type count=9223372036854775808", "more than the file holds"),
    ("general.architecture retyped to 4", "metadata 'general.architecture' must be a string"),
    ("general.architecture retyped to 9", "truncated or corrupt"),
    ("tokenizer.ggml.token_type retyped to 6", "must be an array of integers"),
    ("general.name invalid UTF-8", "'general.name' is not valid UTF-8"),
    ("token 0 invalid UTF-8", "'tokenizer.ggml.tokens'[0] is not valid UTF-8"),
    ("head_count=0", "'llama.attention.head_count' is 0"),
    ("head_count=3", "2 K/V heads do not divide 3 attention heads"),
    ("embedding_length=2147483648", "'llama.embedding_length' is 2147483648"),
    ("embedding_length=63", "4 attention heads do not divide the width 63"),
    ("rms_eps=0.0", "layer_norm_rms_epsilon' is 0.0, it must be finite, > 0.0"),
    ("rms_eps=nan", "it must be finite"),
    ("tensor_count=4611686018427387904", "tensor count 4611686018427387904 cannot fit"),
    ("token_embd.weight n_dims=100", "has 100 dimensions"),
    ("token_embd.weight dim0=0", "tensor 'token_embd.weight' has shape [0, 579]"),
])
def test_issue_gguf_mutants_are_refused_in_one_line(worker, tiny_gguf, tmp_path, label, expected):
    out = worker.run({"kind": "gguf", "path": str(_mutant(tiny_gguf, tmp_path, label))}, timeout=30)
    assert out["outcome"] == "refused", out
    assert expected in out["detail"] and "\n" not in out["detail"]


def test_every_targeted_gguf_mutant_is_refused(worker, tiny_gguf, tmp_path):
    path = tmp_path / "m.gguf"
    for label, data in targeted_mutants(tiny_gguf.read_bytes(), layout(tiny_gguf)):
        path.write_bytes(data)
        out = worker.run({"kind": "gguf", "path": str(path)}, timeout=30)
        assert out["outcome"] == "refused", (label, out)
    assert worker.peak_rss < 512 << 20


def test_fewer_embedding_rows_than_tokens_is_refused_in_one_line(worker, tmp_path):
    """A file whose vocab_size and embeddings are consistent but hold fewer rows than the tokenizer has
    tokens: a token past them would be read outside the embeddings (MLX's gather checks no bounds)."""
    from gguf_factory import tiny_vocab_size, write_tiny_gguf
    path = write_tiny_gguf(tmp_path / "short.gguf", embedding_rows=tiny_vocab_size() - 40)
    out = worker.run({"kind": "gguf", "path": str(path)}, timeout=60)
    assert out["outcome"] == "refused", out
    assert f"fewer than the tokenizer's {tiny_vocab_size()} tokens" in out["detail"] and "\n" not in out["detail"]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_valid_models_still_load(worker, tmp_path, arch):
    from gguf_factory import write_tiny_gguf
    path = write_tiny_gguf(tmp_path / f"{arch}.gguf", arch=arch)
    assert worker.run({"kind": "gguf", "path": str(path)}, timeout=60)["outcome"] == "accepted"


def test_real_model_header_passes_the_checks(real_model):
    from engine.model.gguf_checks import check_hyperparameters
    from engine.model.gguf_file import open_gguf
    hp = check_hyperparameters(open_gguf(real_model))
    assert (hp.n_layer, hp.n_embd, hp.n_head, hp.n_head_kv, hp.n_vocab) == (30, 576, 9, 3, 49152)


@pytest.mark.parametrize("label", ["block_count=131074", "rms_eps=0.0", "general.architecture retyped to 9"])
def test_cli_refuses_a_mutant_with_exit_2_and_one_line(tiny_gguf, tmp_path, label):
    path = _mutant(tiny_gguf, tmp_path, label)
    p = subprocess.run([*STRATA, "generate", "-m", str(path), "-p", "hi", "-n", "2"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2, p.stderr
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("strata: ") and path.name in lines[0], p.stderr


# ---- chat templates ----------------------------------------------------------------------------
@pytest.fixture
def short_budget(monkeypatch):
    monkeypatch.setattr(chat_template, "TIME_BUDGET_S", 0.5)


@pytest.mark.parametrize("source", HOSTILE_TEMPLATES)
def test_hostile_templates_are_bounded_and_one_line(short_budget, source):
    t0 = time.monotonic()
    try:
        text = render(source, CHAT, name="the chat template of x.gguf")
        assert len(text) <= chat_template.MAX_OUTPUT
    except RequestError as e:
        assert str(e).startswith("the chat template of x.gguf failed: ") and "\n" not in str(e)
    assert time.monotonic() - t0 < 5.0        # a hang bound: 10x the 0.5 s budget, for a loaded machine


def test_the_issues_template_attacks_are_refused(short_budget):
    for source, why in [
        ("{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}", "longer than"),
        ("{{ 'a' * 10**9 }}", "over the limit"),
        ("{{ messages|tojson(indent=10**8) }}", "over the limit"),
        ("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", "recursion too deep"),
        ("{% include 'other.jinja' %}", "cannot include other templates"),
        ("{{ range(10**9)|list }}", "over the limit"),
        ("x" * (chat_template.MAX_SOURCE + 1), "KiB are refused"),
        ("{% if x %}" * 20000 + "{% endif %}" * 20000, "failed: "),     # deep nesting: the compiler's own limit
    ]:
        with pytest.raises(RequestError, match=why):
            render(source, CHAT)


def test_real_templates_render_the_same():
    text = render(None, CHAT)
    assert text == "<|im_start|>user\nHello there, how are you?<|im_end|>\n<|im_start|>assistant\n"
    long = [{"role": "user" if i % 2 else "assistant", "content": "word " * 200} for i in range(200)]
    assert render(None, long).count("<|im_start|>") == 201


# ---- sampling: one set of bounds for the server, the CLI and the engine ------------------------
@pytest.mark.parametrize("field, value", [
    ("seed", -1), ("seed", MAX_SEED + 1), ("seed", 1.5), ("top_k", 10**20), ("top_k", -1),
    ("temperature", float("nan")), ("temperature", float("inf")), ("repetition_penalty", float("inf")),
    ("repetition_penalty", 0.0), ("top_p", 0.0), ("min_p", 1.0), ("max_tokens", 0), ("max_tokens", 2**40),
    ("temperature", "hot"), ("stop", ["x"] * 17),
])
def test_sampling_bounds(field, value):
    with pytest.raises(SamplingError) as e:
        SamplingParams(**{field: value}).validate()
    assert e.value.param == field
    SamplingParams(seed=MAX_SEED, top_k=10**6).validate()


@pytest.mark.parametrize("flags", [["--seed", "-1"], ["--top-k", str(10**20)], ["--temperature", "nan"],
                                   ["--repeat-penalty", "inf"], ["--max-tokens", "0"]])
def test_cli_bad_sampling_flags_exit_2_before_loading(flags, capsys):
    from engine.frontends.cli import main
    t0 = time.monotonic()
    assert main(["generate", "-m", "/nonexistent.gguf", "-p", "hi", *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("strata: ") and "\n" not in err and "model file not found" not in err
    assert time.monotonic() - t0 < 5


# ---- the engine: an error in one request does not poison the next ---------------------------
@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from gguf_factory import write_tiny_gguf
    path = write_tiny_gguf(tmp_path_factory.mktemp("hostile") / "tiny-hostile.gguf", arch="llama",
                           context_length=512)
    eng = Engine(EngineOptions(model=str(path), cache_mib=64)).start()
    assert eng.call(Status()).model == str(path)
    yield eng
    eng.stop()


def _gen(engine, messages=CHAT, n=3):
    return engine.call(GenerateRequest(messages=messages, sampling=SamplingParams(max_tokens=n)), timeout=60)


def test_a_bad_parked_entry_is_dropped_and_the_request_recomputes(engine):
    from engine.cache.parking import KVEntry
    _gen(engine)
    other = [{"role": "user", "content": "Something else entirely, with its own words."}]

    def plant(eng):
        # A parked conversation whose tokens cannot be decoded (a crafted session's last token -1).
        live = eng.conversations.live
        bad = KVEntry(list(live.tokens[:-1]) + [-1], live.cache, eng.handlers.cache_key(), list(CHAT))
        eng.conversations.live = None
        eng.conversations.parking.entries.append(bad)
    while_held(engine, plant)
    h = engine.submit(GenerateRequest(messages=other, sampling=SamplingParams(max_tokens=3)))
    logs = [e.line for e in h.events() if isinstance(e, Log)]
    assert h.result(5).generated_tokens == 3
    assert any(line.startswith("dropped a parked conversation") for line in logs), logs
    assert engine.call(Status()).parking["tokens"].count(0) == 0
    assert _gen(engine).generated_tokens == 3


def test_a_live_entry_that_fails_is_dropped_after_the_error(engine):
    import mlx.core as mx
    r = _gen(engine)
    assert r.generated_tokens == 3

    def break_live(eng):
        # K/V of the wrong geometry (a crafted session): the next prefill that uses it fails.
        for c in eng.conversations.live.cache:
            if c.keys is not None:
                c.state = (mx.zeros((1, 1, c.offset, 3)), mx.zeros((1, 1, c.offset, 3)), c.offset)
    while_held(engine, break_live)
    follow = CHAT + [{"role": "assistant", "content": r.text}, {"role": "user", "content": "More?"}]
    h = engine.submit(GenerateRequest(messages=follow, sampling=SamplingParams(max_tokens=3)))
    with pytest.raises(StrataError, match="internal error"):
        h.result(60)
    assert _gen(engine, follow).generated_tokens == 3        # recomputed, not failed again
    assert _gen(engine, follow).generated_tokens == 3


def test_a_huge_prompt_is_refused_before_tokenizing(engine):
    t0 = time.monotonic()
    with pytest.raises(StrataError, match="the context holds 512"):
        engine.call(GenerateRequest(prompt="x" * 10_000_000, sampling=SamplingParams(max_tokens=1)))
    assert time.monotonic() - t0 < 2


# ---- the server --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(engine):
    srv = ServerThread(create_app(engine, max_body_bytes=64 << 10)).start()
    yield srv
    srv.stop()


def _err(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert isinstance(err["message"], str) and "\n" not in err["message"]
    return err


def test_body_limit_413_from_content_length_and_from_counting(server):
    url = f"{server.base_url}/chat/completions"
    big = json.dumps({"messages": [{"role": "user", "content": "x" * (100 << 10)}]}).encode()
    assert _err(httpx.post(url, content=big, headers={"Content-Type": "application/json"}), 413)["code"] \
        == "request_too_large"

    def chunks():                        # no Content-Length: chunked, counted as it arrives
        yield b'{"messages": [{"role": "user", "content": "'
        for _ in range(200):
            yield b"x" * 1024
        yield b'"}]}'
    _err(httpx.post(url, content=chunks(), headers={"Content-Type": "application/json"}), 413)
    ok = httpx.post(url, json={"messages": CHAT, "max_tokens": 2}, timeout=60)
    assert ok.status_code == 200, ok.text


def test_a_web_page_cannot_drive_the_server(server, strata_home):
    """The issue's curl: text/plain + a foreign Origin + a rebinding Host: nothing is written."""
    url = f"{server.base_url}/sessions/save"
    r = httpx.post(url, content=b'{"name":"planted"}', headers={
        "Content-Type": "text/plain", "Origin": "http://evil.example", "Host": f"evil.example:{server.port}"})
    _err(r, 403)
    _err(httpx.post(url, content=b'{"name":"planted"}', headers={
        "Content-Type": "application/json", "Host": f"evil.example:{server.port}"}), 403)
    _err(httpx.post(url, content=b'{"name":"planted"}', headers={
        "Content-Type": "application/json", "Origin": "http://evil.example"}), 403)
    _err(httpx.post(url, content=b'{"name":"planted"}', headers={"Content-Type": "text/plain"}), 415)
    _err(httpx.post(url, content=b'name=planted',
                    headers={"Content-Type": "application/x-www-form-urlencoded"}), 415)
    _err(httpx.get(f"{server.base_url}/models", headers={"Host": "attacker.test"}), 403)
    assert not list(strata_home.rglob("planted*"))
    # Loopback names and loopback origins are fine.
    for headers in ({"Host": f"localhost:{server.port}"}, {"Origin": f"http://localhost:{server.port}"},
                    {"Origin": "http://127.0.0.1:3000"}, {"Host": f"[::1]:{server.port}"}):
        assert httpx.get(f"{server.base_url}/models", headers=headers).status_code == 200, headers


def test_a_configured_host_and_origin_are_accepted(engine):
    srv = ServerThread(create_app(engine, host="0.0.0.0", allowed_origins=("https://chat.example",)),
                       host="127.0.0.1").start()
    try:
        url = f"{srv.base_url}/models"
        assert httpx.get(url, headers={"Host": f"192.168.1.20:{srv.port}"}).status_code == 200
        assert httpx.get(url, headers={"Origin": "https://chat.example"}).status_code == 200
        _err(httpx.get(url, headers={"Host": f"rebind.example:{srv.port}"}), 403)
        _err(httpx.get(url, headers={"Origin": "http://192.168.1.20"}), 403)
    finally:
        srv.stop()


@pytest.mark.parametrize("raw, param", [
    ('{"messages": %s, "seed": -1}', "seed"),
    ('{"messages": %s, "seed": 1180591620717411303424}', "seed"),
    ('{"messages": %s, "top_k": 100000000000000000000}', "top_k"),
    ('{"messages": %s, "repetition_penalty": Infinity}', "repetition_penalty"),
    ('{"messages": %s, "temperature": NaN}', "temperature"),
    ('{"messages": %s, "max_tokens": 1e400}', "max_tokens"),
])
def test_bad_sampling_fields_are_400_naming_the_field(server, raw, param):
    r = httpx.post(f"{server.base_url}/chat/completions", content=(raw % json.dumps(CHAT)).encode(),
                   headers={"Content-Type": "application/json"})
    assert _err(r, 400)["param"] == param


def test_deep_json_is_400(server):
    url = f"{server.base_url}/chat/completions"
    for deep in (b'{"messages": ' + b"[" * 30_000 + b"]" * 30_000 + b"}", b"[" * 30_000 + b"]" * 30_000):
        assert _err(httpx.post(url, content=deep, headers={"Content-Type": "application/json"}), 400)["code"] \
            in ("invalid_json", None)


def test_a_huge_prompt_is_400_context_length(server):
    r = httpx.post(f"{server.base_url}/completions", json={"prompt": "y" * 60_000, "max_tokens": 1})
    assert _err(r, 400)["code"] == "context_length_exceeded"
