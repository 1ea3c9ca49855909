"""The OpenAI-compatible server, end to end: a real Engine on a tiny GGUF, uvicorn on a free loopback
port in a background thread, the official `openai` client (and raw httpx for malformed requests)."""
from __future__ import annotations

import json
import logging
import threading
import time

import httpx
import numpy as np
import openai
import pytest

from engine.engine import Configure, Engine, EngineOptions, GenerateRequest, Status
from engine.sampling import SamplingParams
from engine.frontends.server import ServerThread, create_app

API_KEY = "sk-test-strata"
LONG_SYSTEM = ("You are a careful assistant who answers questions about the history of tea, the way it "
               "is grown, picked, dried and brewed in different countries. ") * 6


# ---- fixtures ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def model_path(server_model):
    return server_model


@pytest.fixture(scope="module")
def engine(model_path):
    eng = Engine(EngineOptions(model=str(model_path))).start()
    assert eng.call(Status()).model == str(model_path)
    yield eng
    eng.stop()


@pytest.fixture(scope="module")
def server(engine):
    srv = ServerThread(create_app(engine)).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def auth_server(engine):
    srv = ServerThread(create_app(engine, api_key=API_KEY)).start()
    yield srv
    srv.stop()


@pytest.fixture
def client(server):
    c = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120)
    yield c
    c.close()


@pytest.fixture
def engine_log():
    """Lines the engine logs while the test runs (it logs through the 'strata' logger)."""
    lines: list[str] = []

    class _H(logging.Handler):
        def emit(self, record):
            lines.append(record.getMessage())

    logger = logging.getLogger("strata")
    handler, old_level = _H(level=logging.INFO), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    yield lines
    logger.removeHandler(handler)
    logger.setLevel(old_level)


def chat(client, content, **kw):
    kw.setdefault("temperature", 0)
    kw.setdefault("max_tokens", 12)
    return client.chat.completions.create(model="default", messages=[{"role": "user", "content": content}], **kw)


def streamed_chat(client, messages, **kw):
    kw.setdefault("temperature", 0)
    stream = client.chat.completions.create(model="default", messages=messages, stream=True,
                                            stream_options={"include_usage": True}, **kw)
    text, finish, usage = "", None, None
    for ch in stream:
        if ch.usage is not None:
            usage = ch.usage
        for c in ch.choices:
            text += c.delta.content or ""
            finish = c.finish_reason or finish
    return text, finish, usage


def wait_for(pred, timeout=30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.05)
    return False


def assert_serving(client):
    r = chat(client, "still there?", max_tokens=3)
    assert r.choices[0].finish_reason in ("length", "stop")


# ---- basics ------------------------------------------------------------------------------------
def test_models_lists_the_loaded_model(client, model_path):
    models = client.models.list().data
    assert [m.id for m in models] == [model_path.stem]
    assert models[0].owned_by == "strata"
    assert client.models.retrieve(model_path.name).id == model_path.stem


def test_chat_streamed_equals_non_streamed_for_greedy(client, engine):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
    r = client.chat.completions.create(model="default", messages=messages, temperature=0, max_tokens=24)
    text = r.choices[0].message.content
    assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason == "length" and text
    assert r.usage.completion_tokens == 24
    assert r.usage.total_tokens == r.usage.prompt_tokens + 24
    assert r.usage.prompt_tokens_details.cached_tokens >= 0
    # the engine's own answer for the same request
    direct = engine.call(GenerateRequest(messages=messages, sampling=SamplingParams(max_tokens=24)))
    assert direct.text == text

    s_text, s_finish, usage = streamed_chat(client, messages, max_tokens=24)
    assert s_text == text and s_finish == "length"
    assert usage.completion_tokens == 24 and usage.prompt_tokens == r.usage.prompt_tokens
    # the same prompt again: the live K/V serves all but the last prompt token
    assert usage.prompt_tokens_details.cached_tokens == usage.prompt_tokens - 1


def test_completions_raw_prompt_streamed_and_not(client, engine):
    prompt = "Once upon a time there was"
    r = client.completions.create(model="default", prompt=prompt, max_tokens=20, temperature=0)
    assert r.object == "text_completion" and r.choices[0].finish_reason == "length"
    direct = engine.call(GenerateRequest(prompt=prompt, sampling=SamplingParams(max_tokens=20)))
    assert r.choices[0].text == direct.text
    assert r.usage.prompt_tokens == direct.prompt_tokens
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="default", prompt=prompt, max_tokens=20, temperature=0, stream=True) if c.choices)
    assert streamed == r.choices[0].text
    # OpenAI's default for this endpoint: 16 tokens
    assert client.completions.create(model="default", prompt=prompt, temperature=0).usage.completion_tokens == 16


def test_sampling_parameters_reach_the_engine(client):
    a = chat(client, "Tell me a story", temperature=1.0, top_p=0.9, seed=7, max_tokens=16)
    b = chat(client, "Tell me a story", temperature=1.0, top_p=0.9, seed=7, max_tokens=16)
    c = chat(client, "Tell me a story", temperature=1.0, top_p=0.9, seed=8, max_tokens=16)
    assert a.choices[0].message.content == b.choices[0].message.content
    assert a.choices[0].message.content != c.choices[0].message.content
    # max_completion_tokens (the newer name) is honoured
    r = client.chat.completions.create(model="default", messages=[{"role": "user", "content": "Hi"}],
                                       temperature=0, max_completion_tokens=5)
    assert r.usage.completion_tokens == 5
    # stop strings: cut before the first occurrence, finish "stop", same when streamed
    full = a.choices[0].message.content
    stop = full[5:7]
    assert stop.strip() and stop in full
    expected = full[:full.index(stop)]
    for stops in (stop, [stop, "\x00never"]):
        r = chat(client, "Tell me a story", temperature=1.0, top_p=0.9, seed=7, max_tokens=16, stop=stops)
        assert r.choices[0].message.content == expected and r.choices[0].finish_reason == "stop"
    text, finish, _ = streamed_chat(client, [{"role": "user", "content": "Tell me a story"}], temperature=1.0,
                                    top_p=0.9, seed=7, max_tokens=16, stop=stop)
    assert (text, finish) == (expected, "stop")


def test_content_parts_and_developer_role(client):
    plain = chat(client, "Hello there").choices[0].message.content
    parts = client.chat.completions.create(
        model="default", temperature=0, max_tokens=12,
        messages=[{"role": "user", "content": [{"type": "text", "text": "Hello "}, {"type": "text", "text": "there"}]}])
    assert parts.choices[0].message.content == plain
    sys_ = client.chat.completions.create(model="default", temperature=0, max_tokens=8, messages=[
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}])
    dev = client.chat.completions.create(model="default", temperature=0, max_tokens=8, messages=[
        {"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Hi"}])
    assert dev.choices[0].message.content == sys_.choices[0].message.content


# ---- speed projection --------------------------------------------------------------------------
def test_experimental_speed_projection_switches_the_vector(tmp_path_factory, model_path):
    from engine.steer.control_vector import SteeringConfig, write_control_vector
    cv = tmp_path_factory.mktemp("cvec") / "strong.gguf"
    write_control_vector(cv, {1: np.random.default_rng(0).normal(0, 4.0, 64).astype(np.float32)})
    eng = Engine(EngineOptions(model=str(model_path),
                               steering=SteeringConfig(files=((str(cv), 1.0),)))).start()
    srv = ServerThread(create_app(eng)).start()
    try:
        c = openai.OpenAI(base_url=srv.base_url, api_key="x", max_retries=0, timeout=120)
        plain = eng.call(GenerateRequest(messages=[{"role": "user", "content": "Hello there"}],
                                         sampling=SamplingParams(max_tokens=12), speed_projection=False))
        off = chat(c, "Hello there", extra_body={"experimental_speed_projection": False})
        on = chat(c, "Hello there", extra_body={"experimental_speed_projection": True})
        default = chat(c, "Hello there")                     # the engine's default: on
        assert off.model_extra["strata"]["speed_projection"] is False
        assert on.model_extra["strata"]["speed_projection"] is True
        assert default.model_extra["strata"]["speed_projection"] is True
        assert off.choices[0].message.content == plain.text
        assert on.choices[0].message.content != plain.text
        assert default.choices[0].message.content == on.choices[0].message.content
        r = httpx.post(f"{srv.base_url}/chat/completions", json={
            "messages": [{"role": "user", "content": "x"}], "experimental_speed_projection": "yes"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "experimental_speed_projection"
    finally:
        srv.stop()
        eng.stop()


# ---- errors ------------------------------------------------------------------------------------
def _error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    return err


def test_malformed_json_is_400_and_the_server_keeps_serving(server, client):
    url = f"{server.base_url}/chat/completions"
    for raw in (b"{not json", b"", b"\xff\xfe", b'{"messages": [}'):
        err = _error(httpx.post(url, content=raw, headers={"Content-Type": "application/json"}), 400)
        assert err["type"] == "invalid_request_error"
    assert "JSON object" in _error(httpx.post(url, json=[1, 2]), 400)["message"]
    # No Content-Type: refused before parsing (a web page's text/plain post needs no CORS preflight).
    _error(httpx.post(f"{server.base_url}/completions", content=b"nope"), 415)
    assert_serving(client)


def test_bad_parameters_are_400(server, client):
    url = f"{server.base_url}/chat/completions"
    msgs = [{"role": "user", "content": "hi"}]
    cases = [({"messages": msgs, "temperature": -1}, "temperature"),
             ({"messages": msgs, "temperature": "hot"}, "temperature"),
             ({"messages": msgs, "top_p": 0}, "top_p"),
             ({"messages": msgs, "max_tokens": 0}, "max_tokens"),
             ({"messages": msgs, "n": 2}, "n"),
             ({"messages": msgs, "stop": 5}, "stop"),
             ({"messages": msgs, "seed": 1.5}, "seed"),
             ({"messages": []}, "messages"),
             ({}, "messages"),
             ({"messages": [{"content": "no role"}]}, "messages[0]"),
             ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
             ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
              "messages[0].content[0].image_url.url"),
             ({"messages": msgs, "tools": "f"}, "tools"),
             ({"messages": msgs, "tools": [{"type": "function", "function": {"name": "f g"}}]}, "tools[0].function.name")]
    for body, param in cases:
        assert _error(httpx.post(url, json=body), 400)["param"] == param, body
    assert _error(httpx.post(f"{server.base_url}/completions", json={"prompt": [1, 2, 3]}), 400)["param"] == "prompt"
    assert _error(httpx.get(f"{server.base_url}/nowhere"), 404)["code"] == "not_found"
    assert _error(httpx.get(url), 405)["code"] == "method_not_allowed"
    assert_serving(client)


def test_unknown_model_is_404_and_known_names_are_accepted(server, client, model_path, engine):
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}])
    assert e.value.status_code == 404 and e.value.code == "model_not_found" and e.value.param == "model"
    err = _error(httpx.post(f"{server.base_url}/completions", json={"model": "nope", "prompt": "x"}), 404)
    assert err["code"] == "model_not_found"
    for name in (model_path.stem, model_path.name, "default", engine.info.name):
        r = client.chat.completions.create(model=name, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        assert r.model == model_path.stem
    assert_serving(client)


def test_prompt_longer_than_the_context_is_400(server, client, engine):
    long = "tea " * (engine.n_ctx + 100)
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as e:
            r = client.chat.completions.create(model="default", messages=[{"role": "user", "content": long}],
                                               stream=stream)
            list(r) if stream else None
        assert e.value.status_code == 400 and e.value.code == "context_length_exceeded"
        assert f"the context holds {engine.n_ctx}" in e.value.message
    err = _error(httpx.post(f"{server.base_url}/completions", json={"prompt": long, "stream": True}), 400)
    assert err["code"] == "context_length_exceeded" and err["param"] == "prompt"
    assert_serving(client)


def test_auth_with_a_key(auth_server, model_path):
    url = f"{auth_server.base_url}/models"
    err = _error(httpx.get(url), 401)
    assert err["code"] == "invalid_api_key"
    _error(httpx.get(url, headers={"Authorization": "Bearer wrong"}), 401)
    _error(httpx.get(url, headers={"Authorization": API_KEY}), 401)           # no scheme
    _error(httpx.post(f"{auth_server.base_url}/chat/completions",
                      json={"messages": [{"role": "user", "content": "hi"}]}), 401)
    assert httpx.get(url, headers={"Authorization": f"Bearer {API_KEY}"}).status_code == 200
    bad = openai.OpenAI(base_url=auth_server.base_url, api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    good = openai.OpenAI(base_url=auth_server.base_url, api_key=API_KEY, max_retries=0, timeout=120)
    assert good.models.list().data[0].id == model_path.stem
    text, _, _ = streamed_chat(good, [{"role": "user", "content": "hi"}], max_tokens=4)
    assert text == good.chat.completions.create(model="default", messages=[{"role": "user", "content": "hi"}],
                                                temperature=0, max_tokens=4).choices[0].message.content


# ---- concurrency, disconnects, parking ---------------------------------------------------------
def test_concurrent_clients_get_their_own_answers(server):
    jobs = [("chat", "Hello there", False), ("chat", "What is the capital of France?", True),
            ("chat", "Write a poem about the sea", False), ("chat", "Tell me a story", True),
            ("raw", "Once upon a time", False), ("raw", "The cat sat on the", True),
            ("seeded", "Count to ten", False), ("seeded", "Count to twenty", True)]

    def run(c, job):
        kind, text, stream = job
        kw = {"max_tokens": 16, "temperature": 0}
        if kind == "seeded":
            kw.update(temperature=1.0, seed=hash(text) % 1000)
        if kind == "raw":
            if stream:
                return "".join(ch.choices[0].text for ch in c.completions.create(
                    model="default", prompt=text, stream=True, **kw) if ch.choices)
            return c.completions.create(model="default", prompt=text, **kw).choices[0].text
        if stream:
            return streamed_chat(c, [{"role": "user", "content": text}], **kw)[0]
        return chat(c, text, **kw).choices[0].message.content

    c0 = openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0, timeout=300)
    sequential = [run(c0, job) for job in jobs]
    assert len(set(sequential)) >= 5, sequential          # the answers tell the requests apart

    results: dict[int, str] = {}
    errors: list[BaseException] = []
    barrier = threading.Barrier(len(jobs))

    def worker(i):
        c = openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0, timeout=300)
        try:
            barrier.wait()
            results[i] = [run(c, jobs[i]) for _ in range(2)]   # each client asks twice in a row
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not errors, errors
    assert [results[i] for i in range(len(jobs))] == [[answer] * 2 for answer in sequential]


def test_client_disconnect_mid_stream_frees_the_engine(client, engine, engine_log):
    big = engine.n_ctx - 100
    stream = client.chat.completions.create(model="default", messages=[{"role": "user", "content": "Go on"}],
                                            temperature=0, max_tokens=big, stream=True)
    got = 0
    rid = None
    for ch in stream:
        rid = ch.id
        got += 1
        if got == 4:
            break
    stream.close()                                           # the client goes away mid-stream
    t0 = time.monotonic()
    r = chat(client, "Are you free?", max_tokens=4)
    follow_up_s = time.monotonic() - t0
    assert r.choices[0].finish_reason == "length"
    assert wait_for(lambda: any(line.startswith(f"http {rid}:") for line in engine_log))
    done = [line for line in engine_log if line.startswith(f"http {rid}:")]
    assert "finish cancelled" in done[0], done
    generated = int(done[0].split(" generated")[0].rsplit(", ", 1)[1])
    assert generated < big
    assert follow_up_s < 60


def test_client_disconnect_of_a_non_streamed_request_frees_the_engine(server, client, engine, engine_log):
    big = engine.n_ctx - 100
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.base_url}/chat/completions", timeout=httpx.Timeout(5.0, read=0.5), json={
            "messages": [{"role": "user", "content": "Keep talking"}], "temperature": 0, "max_tokens": big})
    assert wait_for(lambda: any("finish cancelled" in line for line in engine_log))
    line = next(line for line in engine_log if "finish cancelled" in line)
    assert line.startswith("http chatcmpl-")
    assert int(line.split(" generated")[0].rsplit(", ", 1)[1]) < big
    assert_serving(client)


def test_client_disconnect_while_queued_is_skipped(server, client, engine, engine_log):
    big = engine.n_ctx - 100
    first = client.chat.completions.create(model="default", messages=[{"role": "user", "content": "First"}],
                                           temperature=0, max_tokens=big, stream=True)
    first_id = next(iter(first)).id                         # the engine is busy with the first one
    with pytest.raises(httpx.ReadTimeout):                   # queued behind it, then gone
        httpx.post(f"{server.base_url}/chat/completions", timeout=httpx.Timeout(5.0, read=0.3), json={
            "messages": [{"role": "user", "content": "Second"}], "temperature": 0, "max_tokens": big})
    first.close()
    assert_serving(client)
    # the first stopped mid-decode; the queued one was refused before its prefill ("error: cancelled")
    lines = [line for line in engine_log if "finish cancelled" in line or line == "error: cancelled"]
    assert len(lines) == 2 and lines[0].startswith(f"http {first_id}:") and lines[1] == "error: cancelled"


def test_title_call_scenario_shows_cached_tokens_with_parking(client, engine):
    def conversation():
        convo = [{"role": "system", "content": LONG_SYSTEM}, {"role": "user", "content": "Where does tea come from?"}]
        first = client.chat.completions.create(model="default", messages=convo, temperature=0, max_tokens=16)
        # the side request (a chat UI asking for a title) takes the engine in between
        title = client.chat.completions.create(model="default", temperature=0, max_tokens=6, messages=[
            {"role": "user", "content": "Give a three word title for: Where does tea come from?"}])
        assert title.usage.prompt_tokens_details.cached_tokens == 0
        convo += [{"role": "assistant", "content": first.choices[0].message.content},
                  {"role": "user", "content": "And how is it dried?"}]
        follow = client.chat.completions.create(model="default", messages=convo, temperature=0, max_tokens=8)
        return first, follow

    first, follow = conversation()
    cached = follow.usage.prompt_tokens_details.cached_tokens
    # the whole first exchange (prompt + reply) is reused from the parked K/V
    assert cached >= first.usage.prompt_tokens + first.usage.completion_tokens - 1
    assert cached < follow.usage.prompt_tokens

    engine.call(Configure(cache_mib=0))                      # parking off: the side request evicts it
    try:
        _, follow_off = conversation()
        assert follow_off.usage.prompt_tokens_details.cached_tokens == 0
        # (the texts may differ: with the K/V held, the reply keeps the ids the model generated;
        # without it the reply is re-tokenized, which can give other ids)
    finally:
        engine.call(Configure(cache_mib=EngineOptions().cache_mib))


# ---- sessions ----------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["../escape", "a/b", "a\\b", "..", "x..y", ".hidden", "", " ", "a b", "é",
                                  "x" * 65, "name\x00", 42, None])
def test_bad_session_names_are_400(server, client, name, strata_home):
    for action in ("save", "restore"):
        err = _error(httpx.post(f"{server.base_url}/sessions/{action}", json={"name": name}), 400)
        assert err["code"] == "invalid_session_name" and err["param"] == "name"
    assert not any(strata_home.rglob("*.stratasession"))
    assert_serving(client)


def test_session_save_and_restore(server, client, engine, strata_home):
    url = server.base_url
    convo = [{"role": "system", "content": LONG_SYSTEM}, {"role": "user", "content": "Where does tea come from?"}]
    first = client.chat.completions.create(model="default", messages=convo, temperature=0, max_tokens=12)
    r = httpx.post(f"{url}/sessions/save", json={"name": "tea-chat_1.v2"})
    assert r.status_code == 200, r.text
    saved = r.json()
    path = strata_home / "sessions" / "tea-chat_1.v2.stratasession"
    assert saved["path"] == str(path) and path.is_file()
    assert saved["session_bytes"] == path.stat().st_size and saved["tokens"] > first.usage.prompt_tokens

    chat(client, "Something else entirely", max_tokens=4)    # another conversation takes the engine
    engine.call(Configure(cache_mib=0))                      # ... and nothing stays parked
    engine.call(Configure(cache_mib=EngineOptions().cache_mib))
    r = httpx.post(f"{url}/sessions/restore", json={"name": "tea-chat_1.v2"})
    assert r.status_code == 200, r.text
    restored = r.json()
    assert restored["restored_tokens"] == saved["tokens"]
    assert restored["messages"][:2] == convo
    assert restored["messages"][2] == {"role": "assistant", "content": first.choices[0].message.content}
    follow = client.chat.completions.create(model="default", temperature=0, max_tokens=4, messages=[
        *restored["messages"], {"role": "user", "content": "And how is it dried?"}])
    assert follow.usage.prompt_tokens_details.cached_tokens >= saved["tokens"] - 1

    err = _error(httpx.post(f"{url}/sessions/restore", json={"name": "never-saved"}), 404)
    assert err["code"] == "session_not_found"
    (strata_home / "sessions" / "junk.stratasession").write_bytes(b"this is not a session")
    err = _error(httpx.post(f"{url}/sessions/restore", json={"name": "junk"}), 400)
    assert err["code"] == "session_refused" and "not a Strata session file" in err["message"]
    assert_serving(client)


def test_session_save_names_its_conversation_by_messages(server, client, strata_home):
    """With several clients the engine's last conversation may be someone else's: saving by messages
    picks the right one even while it is parked."""
    url = server.base_url
    mine = [{"role": "system", "content": LONG_SYSTEM}, {"role": "user", "content": "Name three rivers."}]
    reply = client.chat.completions.create(model="default", messages=mine, temperature=0, max_tokens=8)
    mine.append({"role": "assistant", "content": reply.choices[0].message.content})
    chat(client, "Someone else's question", max_tokens=3)          # mine is parked now
    r = httpx.post(f"{url}/sessions/save", json={"name": "rivers", "messages": mine})
    assert r.status_code == 200, r.text
    restored = httpx.post(f"{url}/sessions/restore", json={"name": "rivers"}).json()
    assert restored["messages"] == mine
    # A conversation whose K/V is not held is read again, then saved.
    r = httpx.post(f"{url}/sessions/save", json={"name": "gone", "messages": [
        {"role": "user", "content": "a conversation the engine never saw"}]})
    assert r.status_code == 200 and r.json()["reread"] is True, r.text
    assert_serving(client)


def test_session_save_over_a_longer_one_needs_force(server, client, strata_home):
    """A save over a file holding a longer conversation is refused (the file is kept) until the client
    resends it with "force": true."""
    url = server.base_url
    long = [{"role": "system", "content": LONG_SYSTEM}, {"role": "user", "content": "Tell me about tea."}]
    client.chat.completions.create(model="default", messages=long, temperature=0, max_tokens=6)
    first = httpx.post(f"{url}/sessions/save", json={"name": "kept"})
    assert first.status_code == 200, first.text
    path = strata_home / "sessions" / "kept.stratasession"
    before = path.read_bytes()

    chat(client, "Short one", max_tokens=3)                  # a shorter conversation is the last one now
    err = _error(httpx.post(f"{url}/sessions/save", json={"name": "kept"}), 400)
    assert err["code"] == "session_overwrite" and err["param"] == "name"
    assert "longer conversation" in err["message"] and str(first.json()["tokens"]) in err["message"]
    assert path.read_bytes() == before
    err = _error(httpx.post(f"{url}/sessions/save", json={"name": "kept", "force": "yes"}), 400)
    assert err["code"] == "invalid_force" and err["param"] == "force"
    assert path.read_bytes() == before

    r = httpx.post(f"{url}/sessions/save", json={"name": "kept", "force": True})
    assert r.status_code == 200, r.text
    assert r.json()["tokens"] < first.json()["tokens"]
    restored = httpx.post(f"{url}/sessions/restore", json={"name": "kept"}).json()
    assert restored["restored_tokens"] == r.json()["tokens"]
    assert restored["messages"][0] == {"role": "user", "content": "Short one"}
    assert not list((strata_home / "sessions").glob(".*.part"))
    assert_serving(client)


def test_session_restore_refuses_another_models_file(server, client, tiny_gguf, strata_home):
    other = Engine(EngineOptions(model=str(tiny_gguf))).start()
    try:
        other.call(GenerateRequest(prompt="A conversation on another model", sampling=SamplingParams(max_tokens=4)))
        from engine.engine import SaveSession
        (strata_home / "sessions").mkdir(exist_ok=True)
        other.call(SaveSession(str(strata_home / "sessions" / "other.stratasession")))
    finally:
        other.stop()
    r = httpx.post(f"{server.base_url}/sessions/restore", json={"name": "other"})
    err = _error(r, 400)
    assert err["code"] == "session_refused" and "another model" in err["message"]
    assert_serving(client)


def test_no_model_yet_is_503_then_requests_wait_for_the_load(model_path):
    from engine.engine import LoadModel
    eng = Engine(EngineOptions()).start()                    # no model
    srv = ServerThread(create_app(eng)).start()
    try:
        c = openai.OpenAI(base_url=srv.base_url, api_key="x", max_retries=0, timeout=120)
        assert c.models.list().data == []
        with pytest.raises(openai.InternalServerError) as e:
            chat(c, "hi")
        assert e.value.status_code == 503 and e.value.code == "model_not_loaded"
        eng.submit(LoadModel(str(model_path)))               # a request sent now queues behind the load
        r = chat(c, "hi", max_tokens=3)
        assert r.model == model_path.stem and r.usage.completion_tokens == 3
    finally:
        srv.stop()
        eng.stop()


def test_saving_with_nothing_to_save_returns_the_reason(tmp_path, model_path):
    eng = Engine(EngineOptions(model=str(model_path))).start()
    srv = ServerThread(create_app(eng)).start()
    try:
        err = _error(httpx.post(f"{srv.base_url}/sessions/save", json={"name": "empty"}), 400)
        assert err["code"] == "session_refused" and "no conversation" in err["message"]
    finally:
        srv.stop()
        eng.stop()


def test_streamed_chunks_are_openai_shaped(server):
    with httpx.stream("POST", f"{server.base_url}/chat/completions", json={
            "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 5, "temperature": 0,
            "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(c["object"] == "chat.completion.chunk" and c["id"] == chunks[0]["id"] for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length" and chunks[-1]["choices"][0]["delta"] == {}
