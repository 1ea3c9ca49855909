"""The overflow policies on the real engine (a tiny GGUF, a 256-token context), and the server's
`strata_overflow` field through the real openai and anthropic SDKs: the reply goes on where the
history no longer fits, and the next turn's cached_tokens shows the K/V reuse the policy promises."""
from __future__ import annotations

import anthropic
import openai
import pytest

from engine.engine import CountTokens, GenerateRequest
from engine.errors import EngineError, ErrorCode
from engine.frontends.server import ServerThread, create_app
from engine.sampling import SamplingParams
from engine_reads import while_held
from engines import running

N_CTX = 256
MAX_TOKENS = 8
SYSTEM = {"role": "system", "content": "You answer in a few words."}


@pytest.fixture(scope="module")
def engine(server_model):
    with running(server_model, context_length=N_CTX) as eng:
        yield eng


def turn(t: int) -> list[dict]:
    return [{"role": "user", "content": f"Question {t}: tell me about the tea harvest number {t} please."},
            {"role": "assistant", "content": f"Answer {t}: the harvest {t} was picked early and dried well."}]


def history(turns: int) -> list[dict]:
    msgs = [SYSTEM]
    for t in range(turns):
        msgs += turn(t)
    return msgs + [{"role": "user", "content": "And the last one?"}]


def count(engine, messages) -> int:
    return engine.call(CountTokens(messages=messages)).tokens


def ask(engine, messages, policy, owner="chat-a", **kw):
    return engine.call(GenerateRequest(messages=messages, overflow=policy, conversation=owner,
                                       sampling=SamplingParams(temperature=0, max_tokens=MAX_TOKENS), **kw))


def pinned_tokens(engine, messages) -> int:
    """The tokens of `messages` as they render without a generation prompt (a prefix of any prompt
    that starts with them)."""
    def fn(e):
        text, add_bos = e.prompts.render_messages(messages, generation_prompt=False)
        return len(e.tokenizer.encode_prompt(text, add_bos=add_bos))
    return while_held(engine, fn)


def test_stop_refuses_what_does_not_fit(engine):
    msgs = history(12)
    assert count(engine, msgs) >= N_CTX
    with pytest.raises(EngineError) as e:
        ask(engine, msgs, "stop")
    assert e.value.code == ErrorCode.BAD_REQUEST and "context holds 256" in str(e.value)


@pytest.mark.parametrize("policy", ["rolling", "truncate_middle"])
def test_a_dropping_policy_answers_and_the_next_turn_reuses_its_kv(engine, policy):
    msgs = history(12)
    owner = f"chat-{policy}"
    r1 = ask(engine, msgs, policy, owner)
    assert r1.dropped_messages > 0 and r1.finish_reason in ("stop", "length")
    assert r1.prompt_tokens <= N_CTX - MAX_TOKENS
    # The next turn adds to the end: the same cut fits, so the whole previous prompt is cached.
    nxt = msgs + [{"role": "assistant", "content": r1.text}, {"role": "user", "content": "Thanks."}]
    r2 = ask(engine, nxt, policy, owner)
    assert r2.dropped_messages == r1.dropped_messages
    assert r2.cached_tokens >= r1.prompt_tokens - 1, (r1, r2)


def test_truncate_middle_keeps_the_head_cached_across_a_drop(engine):
    """A conversation held in full, then grown past the context: the drop keeps the system prompt and
    the first exchange, so those tokens come from the held K/V and only the rest is read again."""
    owner = "chat-head"
    msgs = history(2)
    r0 = ask(engine, msgs, "truncate_middle", owner)
    assert r0.dropped_messages == 0
    grown = msgs[:-1] + [m for t in range(2, 14) for m in turn(t)] + [{"role": "user", "content": "Last?"}]
    r1 = ask(engine, grown, "truncate_middle", owner)
    assert r1.dropped_messages > 0
    head = pinned_tokens(engine, [SYSTEM] + turn(0))
    assert head <= r1.cached_tokens < r1.prompt_tokens, (head, r1)
    rolled = ask(engine, grown, "rolling", "chat-roll")           # another owner, nothing held: read whole
    assert rolled.dropped_messages > 0 and rolled.cached_tokens < head


def test_context_limit_and_bad_policy(engine):
    msgs = history(2)
    n = count(engine, msgs)
    with pytest.raises(EngineError, match=f"context holds {n - 5}"):
        ask(engine, msgs, "stop", context_limit=n - 5)
    r = ask(engine, msgs, "rolling", context_limit=n)
    assert r.dropped_messages > 0 and r.prompt_tokens + min(MAX_TOKENS, n // 2) <= n
    with pytest.raises(EngineError, match="overflow must be one of stop, truncate_middle, rolling"):
        ask(engine, msgs, "middle")


def test_a_history_past_the_character_cap_is_cut_not_refused(engine):
    """The engine refuses a body of over 32 characters a token unread; under a dropping policy a long
    chat's oldest turns go first instead, so the chat goes on."""
    long = [SYSTEM] + [m for t in range(130) for m in turn(t)] + [{"role": "user", "content": "Last?"}]
    assert sum(len(m["content"]) for m in long) > N_CTX * 32
    with pytest.raises(EngineError, match="characters"):
        ask(engine, long, "stop")
    r = ask(engine, long, "rolling", "chat-long")
    assert r.dropped_messages > 200 and r.prompt_tokens <= N_CTX - MAX_TOKENS
    # cut by the token pages, not to the question alone
    assert r.prompt_tokens > count(engine, [SYSTEM, long[-1]]) + 2 * N_CTX // 8, r
    big = [SYSTEM, {"role": "user", "content": "tea " * 3000}]
    with pytest.raises(EngineError, match="characters"):
        ask(engine, big, "rolling")


ROOMY_CTX = 1024


@pytest.fixture(scope="module")
def roomy(server_model):
    """A context of many turns: a page (a quarter of it) holds several, as a real chat's does."""
    with running(server_model, context_length=ROOMY_CTX) as eng:
        yield eng


def chat_turns(engine, policy: str, n: int) -> tuple[list[dict], list]:
    """A chat grown one question at a time, each reply sent back: its messages and each turn's Generation."""
    msgs, results = [SYSTEM], []
    for t in range(n):
        msgs.append({"role": "user", "content": f"Question {t}: tell me about the tea harvest number {t} please."})
        results.append(ask(engine, msgs, policy, f"chat-pages-{policy}"))
        msgs.append({"role": "assistant", "content": results[-1].text})
    return msgs, results


@pytest.mark.parametrize("policy", ["rolling", "truncate_middle"])
def test_after_a_drop_the_history_is_read_once_not_every_turn(roomy, policy):
    """Turn after turn past the context: a turn that keeps the cut finds the whole previous prompt
    cached; a turn that moves it finds the pinned head cached and reads the rest once; and the cut
    moves a page at a time, so that happens on a few turns only."""
    msgs, results = chat_turns(roomy, policy, 40)
    assert all(r.prompt_tokens + MAX_TOKENS <= ROOMY_CTX for r in results)
    dropping = [i for i, r in enumerate(results) if r.dropped_messages]
    assert len(dropping) >= 15, [r.dropped_messages for r in results]
    pinned = pinned_tokens(roomy, msgs[:1] if policy == "rolling" else msgs[:3])   # what is never dropped
    reread = []
    for i in dropping[1:]:
        a, b = results[i - 1], results[i]
        if b.dropped_messages == a.dropped_messages:
            assert b.cached_tokens >= a.prompt_tokens, (i, a, b)         # the previous prompt, all cached
        else:
            assert b.dropped_messages > a.dropped_messages and b.cached_tokens >= pinned, (i, a, b)
            reread.append(i)
    assert len(reread) <= len(dropping) // 4, ([r.dropped_messages for r in results], reread)
    assert all(j - i > 1 for i, j in zip(reread, reread[1:]))          # never two turns running


def test_a_history_past_the_character_cap_keeps_its_cut(roomy):
    """A chat past the character cap is cut by the same token pages: the next turn keeps the cut and
    finds the whole previous prompt cached (a cut by characters alone moved every turn)."""
    long, t = [SYSTEM], 0
    while sum(len(m["content"]) for m in long) <= ROOMY_CTX * 32:     # just past the cap
        long, t = long + turn(t), t + 1
    long.append({"role": "user", "content": "Last?"})
    r1 = ask(roomy, long, "rolling", "chat-capped")
    assert r1.prompt_tokens > (ROOMY_CTX - MAX_TOKENS) // 2, r1          # the newest turns fill the context
    nxt = long + [{"role": "assistant", "content": r1.text}, {"role": "user", "content": "Thanks."}]
    r2 = ask(roomy, nxt, "rolling", "chat-capped")
    assert r1.dropped_messages > 0 and r2.dropped_messages == r1.dropped_messages, (r1, r2)
    assert r2.cached_tokens >= r1.prompt_tokens, (r1, r2)


def test_count_tokens_breaks_out_the_system_prompt(engine):
    msgs = history(2)
    c = engine.call(CountTokens(messages=msgs))
    assert 0 < c.system_tokens < c.tokens
    assert c.system_tokens == pinned_tokens(engine, [SYSTEM])
    assert engine.call(CountTokens(messages=msgs[1:])).system_tokens == 0


# ---- the server's field ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(engine):
    srv = ServerThread(create_app(engine)).start()
    yield srv
    srv.stop()


def test_openai_strata_overflow(server):
    c = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120)
    msgs = history(12)
    with pytest.raises(openai.BadRequestError) as e:          # off by default: an overflow is a 400
        c.chat.completions.create(model="tiny-server", messages=msgs, max_tokens=MAX_TOKENS)
    assert e.value.code == "context_length_exceeded"
    r = c.chat.completions.create(model="tiny-server", messages=msgs, max_tokens=MAX_TOKENS, temperature=0,
                                  extra_body={"strata_overflow": "rolling"})
    assert r.model_extra["strata"]["dropped_messages"] > 0 and r.usage.prompt_tokens <= N_CTX - MAX_TOKENS
    nxt = msgs + [{"role": "assistant", "content": r.choices[0].message.content},
                  {"role": "user", "content": "Thanks."}]
    r2 = c.chat.completions.create(model="tiny-server", messages=nxt, max_tokens=MAX_TOKENS, temperature=0,
                                   extra_body={"strata_overflow": "rolling"})
    assert r2.usage.prompt_tokens_details.cached_tokens >= r.usage.prompt_tokens - 1
    stream = c.chat.completions.create(model="tiny-server", messages=msgs, max_tokens=MAX_TOKENS, stream=True,
                                       stream_options={"include_usage": True},
                                       extra_body={"strata_overflow": "truncate_middle"})
    chunks = list(stream)
    usage = next(ch.usage for ch in chunks if ch.usage is not None)
    assert usage.completion_tokens > 0 and usage.prompt_tokens + MAX_TOKENS <= N_CTX
    with pytest.raises(openai.BadRequestError) as bad:
        c.chat.completions.create(model="tiny-server", messages=msgs, max_tokens=MAX_TOKENS,
                                  extra_body={"strata_overflow": "middle"})
    assert bad.value.body["param"] == "strata_overflow"
    c.close()


def test_anthropic_strata_overflow(server):
    c = anthropic.Anthropic(base_url=server.base_url.removesuffix("/v1"), api_key="unused", max_retries=0,
                            timeout=120)
    msgs = history(12)
    system, rest = msgs[0]["content"], msgs[1:]
    with pytest.raises(anthropic.BadRequestError) as e:          # off by default: an overflow is a 400
        c.messages.create(model="tiny-server", system=system, messages=rest, max_tokens=MAX_TOKENS)
    assert e.value.body["error"]["type"] == "invalid_request_error" and "context holds 256" in str(e.value)
    r = c.messages.create(model="tiny-server", system=system, messages=rest, max_tokens=MAX_TOKENS,
                          extra_body={"strata_overflow": "truncate_middle", "temperature": 0})
    assert r.model_extra["strata"]["dropped_messages"] > 0
    sent = r.usage.input_tokens + r.usage.cache_read_input_tokens
    assert sent + MAX_TOKENS <= N_CTX
    nxt = rest + [{"role": "assistant", "content": r.content[0].text}, {"role": "user", "content": "Thanks."}]
    r2 = c.messages.create(model="tiny-server", system=system, messages=nxt, max_tokens=MAX_TOKENS,
                           extra_body={"strata_overflow": "truncate_middle", "temperature": 0})
    assert r2.model_extra["strata"]["dropped_messages"] == r.model_extra["strata"]["dropped_messages"]
    assert r2.usage.cache_read_input_tokens >= sent - 1, (r.usage, r2.usage)    # the kept history, cached
    with pytest.raises(anthropic.BadRequestError, match="strata_overflow must be one of"):
        c.messages.create(model="tiny-server", messages=rest, max_tokens=MAX_TOKENS,
                          extra_body={"strata_overflow": 3})
    c.close()
