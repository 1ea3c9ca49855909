"""Seeded fuzzing of what a stranger can hand Strata: GGUF headers, chat templates, server requests.

Each input must end as a clear one-line refusal or a correct result: never a traceback, never a hang
(per-input timeout, the worker is killed), never past the memory cap (the worker runs under
RLIMIT_AS = fuzz_harness.MEMORY_CAP). The default run takes about two minutes; the `fuzz_long`
marker runs ~20x more inputs:

    pytest tests/engine/test_fuzz.py -s                 # default
    pytest tests/engine/test_fuzz.py -s -m fuzz_long    # long

The schema campaign covers every architecture the engine reads (tests/fuzz_families.py): the default
run a seeded sample of each family's key and tensor mutants, the long one all of them plus
STRATA_FUZZ_FAMILY_RANDOM (default 2,000) random header mutants per family, each through the memory
estimate and the load.

Each test prints its tally (the README's Reliability section quotes them). Seeds are fixed, so a
crash is reproduced from the label printed with it.
"""
from __future__ import annotations

import itertools
import json
import math
import os
import random
from pathlib import Path

import httpx
import pytest

from engine.engine import Engine, EngineOptions, Status
from engine.frontends.server import ServerThread, create_app
from fuzz_families import FAMILIES, arch_of, family_file, job, sample
from fuzz_harness import (HOSTILE_TEMPLATES, Tally, Worker, layout, random_mutant, random_template,
                          targeted_mutants)

GGUF_TIMEOUT_S = 30.0          # one load of a tiny model takes ~25 ms
TEMPLATE_TIMEOUT_S = 10.0      # the render budget in the worker is 1 s


def _fuzz_gguf(sources: list[Path], n_random: int, seed: int, tmp_path: Path) -> Tally:
    tally = Tally()
    worker = Worker()
    rng = random.Random(seed)
    path = tmp_path / "mutant.gguf"
    try:
        for src in sources:
            original = src.read_bytes()
            lay = layout(src)
            targeted = targeted_mutants(original, lay, arch=src.stem.split("-")[0])
            # one random mutant at a time: 5,000 copies of the file held at once would be gigabytes
            randoms = (random_mutant(original, lay, rng) for _ in range(n_random))
            for label, data in itertools.chain(targeted, randoms):
                path.write_bytes(data)
                tally.add(f"{src.name} {label}", worker.run({"kind": "gguf", "path": str(path)}, GGUF_TIMEOUT_S))
    finally:
        tally.peak_rss = worker.peak_rss
        worker.close()
    return tally


def _sources(tmp_path: Path) -> list[Path]:
    from gguf_factory import write_tiny_gguf
    return [write_tiny_gguf(tmp_path / "llama-tiny.gguf", arch="llama"),
            write_tiny_gguf(tmp_path / "qwen3-tiny.gguf", arch="qwen3", tensor_type="Q8_0")]


def _report(tally: Tally, name: str) -> None:
    print("\n" + tally.line(name))
    assert not tally.crashes, "\n".join(tally.crashes[:5])
    assert tally.peak_rss < 1 << 30


def test_fuzz_gguf_headers(tmp_path):
    tally = _fuzz_gguf(_sources(tmp_path), 300, seed=12, tmp_path=tmp_path)
    _report(tally, "gguf headers")
    assert tally.refused > tally.tried // 2 and tally.accepted > 0


@pytest.mark.fuzz_long
def test_fuzz_gguf_headers_long(tmp_path):
    _report(_fuzz_gguf(_sources(tmp_path), 5000, seed=1212, tmp_path=tmp_path), "gguf headers (long)")


# ---- every architecture's schema: each family's tiny file, mutated over its keys and tensors ---------
FAMILY_SAMPLE = 20             # schema mutants per architecture in the default run (16 architectures)


def _fuzz_families(tmp_path: Path, per_family: int | None, n_random: int, seed: int) -> Tally:
    """Each family's original (must load), `per_family` of its schema mutants (all: None) and `n_random`
    random header mutants, through the estimate and the load in the worker."""
    tally = Tally()
    worker = Worker()
    rng = random.Random(seed)
    n = 0
    try:
        for family in FAMILIES:
            src = family_file(family, tmp_path / "src")
            original = src.read_bytes()
            lay = layout(src)
            ok = worker.run(job(family, src, tmp_path / "src"), GGUF_TIMEOUT_S)
            assert ok["outcome"] == "accepted", (family, ok)
            randoms = (random_mutant(original, lay, rng) for _ in range(n_random))
            for label, data in itertools.chain(sample(src, arch_of(family), per_family, rng), randoms):
                # a fresh name each: the estimate's header cache keys on (path, size, mtime)
                path = tmp_path / f"m{n}.gguf"
                n += 1
                path.write_bytes(data)
                tally.add(f"{family} {label}", worker.run(job(family, path, tmp_path / "src"), GGUF_TIMEOUT_S))
                path.unlink()
    finally:
        tally.peak_rss = worker.peak_rss
        worker.close()
    return tally


def test_fuzz_gguf_families(tmp_path):
    tally = _fuzz_families(tmp_path, FAMILY_SAMPLE, 0, seed=14)
    _report(tally, "gguf schema, every architecture")
    assert tally.tried == FAMILY_SAMPLE * len(FAMILIES) and tally.refused > tally.tried // 2


@pytest.mark.fuzz_long
def test_fuzz_gguf_families_long(tmp_path):
    """Every schema mutant of every family, and STRATA_FUZZ_FAMILY_RANDOM random ones per family."""
    n_random = int(os.environ.get("STRATA_FUZZ_FAMILY_RANDOM", "2000"))
    _report(_fuzz_families(tmp_path, None, n_random, seed=1414), "gguf schema, every architecture (long)")


def _fuzz_templates(n_random: int, seed: int) -> Tally:
    tally = Tally()
    worker = Worker()
    rng = random.Random(seed)
    jobs = list(HOSTILE_TEMPLATES) + [random_template(rng) for _ in range(n_random)]
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi " * 50}]
    try:
        for source in jobs:
            tally.add(repr(source[:80]), worker.run({"kind": "template", "source": source, "messages": messages},
                                                    TEMPLATE_TIMEOUT_S))
    finally:
        tally.peak_rss = worker.peak_rss
        worker.close()
    return tally


def test_fuzz_templates():
    tally = _fuzz_templates(400, seed=12)
    _report(tally, "chat templates")
    assert tally.refused > 0 and tally.accepted > 0


@pytest.mark.fuzz_long
def test_fuzz_templates_long():
    _report(_fuzz_templates(8000, seed=1212), "chat templates (long)")


# ---- the server --------------------------------------------------------------------------------
_VALUES = [None, 0, 1, -1, 2, 7, 0.5, 1.5, 2**31, 2**64, 2**70, -2**63, 1e308, "NaN", "Infinity", "-Infinity",
           "", "x", "a" * 5000, [], [1], {}, {"a": 1}, True, False, "DEEP"]
_FIELDS = ["temperature", "top_p", "top_k", "min_p", "repetition_penalty", "seed", "max_tokens",
           "max_completion_tokens", "stop", "n", "stream", "model", "messages", "prompt", "logprobs",
           "response_format", "tools", "stream_options", "experimental_speed_projection", "name"]
_CTYPES = ["application/json", "application/json; charset=utf-8", "text/plain", "", "APPLICATION/JSON",
           "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", "application/jsonx"]
_HOSTS = [None, "localhost:{port}", "127.0.0.1:{port}", "evil.example", "evil.example:{port}", "[::1]:{port}",
          "127.0.0.1.nip.io", "", "localhost.:{port}", "::::"]
_ORIGINS = [None, None, "http://localhost:3000", "http://evil.example", "null", "http://127.0.0.1",
            "file://", "http://[::1]:8080", "not a url"]
_PATHS = ["/chat/completions", "/completions", "/sessions/save", "/sessions/restore", "/models", "/nope"]
_OK = {200, 400, 403, 404, 405, 413, 415, 499, 503}


def _value(rng: random.Random):
    return rng.choice(_VALUES)          # "DEEP" becomes 20,000 nested lists in _encode


def _encode(body: dict) -> bytes:
    raw = json.dumps(body, allow_nan=True)
    for word in ("NaN", "Infinity", "-Infinity"):            # as the JSON extensions, not strings
        raw = raw.replace(f'"{word}"', word)
    if '"DEEP"' in raw:
        raw = raw.replace('"DEEP"', "[" * 20000 + "]" * 20000, 1)
    return raw.encode()


def _request(rng: random.Random, port: int) -> tuple[str, str, bytes, dict]:
    path = rng.choice(_PATHS)
    body: dict = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    if path == "/completions":
        body = {"prompt": "Once upon", "max_tokens": 4}
    elif path.startswith("/sessions"):
        body = {"name": "fuzz"}
    for _ in range(rng.randrange(0, 4)):
        body[rng.choice(_FIELDS)] = _value(rng)
    if isinstance(body.get("max_tokens"), int) and body["max_tokens"] > 16:
        body["max_tokens"] = 16                                   # keep accepted generations short
    raw = _encode(body)
    r = rng.random()
    if r < 0.08:
        raw = raw[: rng.randrange(len(raw) + 1)]                  # truncated JSON
    elif r < 0.12:
        raw = bytes(rng.randrange(256) for _ in range(rng.randrange(64)))
    headers = {"Content-Type": rng.choice(_CTYPES) if rng.random() < 0.3 else "application/json"}
    if rng.random() < 0.25:
        host = rng.choice(_HOSTS)
        if host is not None:
            headers["Host"] = host.format(port=port)
    if rng.random() < 0.25:
        origin = rng.choice(_ORIGINS)
        if origin is not None:
            headers["Origin"] = origin
    method = "GET" if path == "/models" or rng.random() < 0.05 else "POST"
    return method, path, raw, headers


def _check_response(r: httpx.Response, label: str) -> str | None:
    if r.status_code not in _OK:
        return f"{label}: status {r.status_code}: {r.text[:300]}"
    if r.status_code != 200:
        try:
            msg = r.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            return f"{label}: status {r.status_code} without OpenAI's error shape: {r.text[:300]}"
        if not isinstance(msg, str) or "\n" in msg or "Traceback" in msg or "internal error" in msg:
            return f"{label}: bad error message {msg!r:.300}"
    return None


@pytest.fixture(scope="module")
def fuzz_server(tmp_path_factory):
    from gguf_factory import write_tiny_gguf
    path = write_tiny_gguf(tmp_path_factory.mktemp("fuzz") / "tiny-fuzz.gguf", arch="llama")
    eng = Engine(EngineOptions(model=str(path), context_length=256, cache_mib=16)).start()
    assert eng.call(Status()).model == str(path)
    srv = ServerThread(create_app(eng, max_body_bytes=256 << 10)).start()
    yield srv
    srv.stop()
    eng.stop()


def _fuzz_server(srv, n: int, seed: int) -> Tally:
    import psutil
    me = psutil.Process()
    rng = random.Random(seed)
    tally = Tally()
    # The server runs in this process, with whatever the tests before it left there (a full `make test`
    # brings this pytest process past 1 GiB on its own): the bound is on what the requests add.
    start_rss = me.memory_info().rss
    base = f"http://127.0.0.1:{srv.port}/v1"
    with httpx.Client(timeout=60) as client:
        for i in range(n):
            method, path, raw, headers = _request(rng, srv.port)
            label = f"#{i} {method} {path} {headers} {raw[:120]!r}"
            try:
                r = client.request(method, base + path, content=raw if method == "POST" else None, headers=headers)
            except httpx.HTTPError as e:
                # h11 refuses some header values on the client side (e.g. an empty Host): not sent.
                if isinstance(e, httpx.LocalProtocolError):
                    continue
                tally.add(label, {"outcome": "crash", "detail": f"{type(e).__name__}: {e}"})
                continue
            tally.peak_rss = max(tally.peak_rss, me.memory_info().rss - start_rss)   # the server's growth
            problem = _check_response(r, label)
            tally.add(label, {"outcome": "crash", "detail": problem} if problem else
                      {"outcome": "accepted" if r.status_code == 200 else "refused"})
        # and the server still serves
        ok = client.post(base + "/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                            "max_tokens": 2})
        assert ok.status_code == 200, ok.text
    return tally


def test_fuzz_server_requests(fuzz_server):
    tally = _fuzz_server(fuzz_server, 300, seed=12)
    _report(tally, "server requests")        # "peak RSS" here: what the requests added to this process
    assert tally.peak_rss < 256 << 20
    assert tally.refused > 0 and tally.accepted > 0


@pytest.mark.fuzz_long
def test_fuzz_server_requests_long(fuzz_server):
    _report(_fuzz_server(fuzz_server, 5000, seed=1212), "server requests (long)")


def test_fuzz_values_stay_json():
    # The generator's NaN/Infinity words become JSON extensions that Python's json reads back.
    assert math.isnan(json.loads(_encode({"x": "NaN"}))["x"])
