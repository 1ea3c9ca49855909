"""Image spans cached like text, on every path that reuses K/V, on a tiny Gemma 3 + gemma3 mmproj pair:
a chat with an image parked and brought back (A/B/A), the disk tier after an engine restart, and
session files (save, restore in a new engine); the image is not encoded again (Status's public
`vision.images_encoded` counter) and the follow-up takes >= 90% of its history from held K/V. A
different image at the same place reuses no K/V from any of them. Prompt and cached token counts
(Generation, CountTokens) include the image's tokens."""
from __future__ import annotations

import pytest

import llama_oracle
from gguf_factory_vision import write_gemma3_vision_pair

from engine.model import memory_estimate as me
from engine.api import (BatchCounters, CountTokens, EngineOptions, GenerateRequest, ImageInput, LoadModel, RestoreSession,
                        SaveSession, Status)
from engine.engine import Engine
from engine.errors import EngineError, ErrorCode
from engine.events import Progress
from engine.model.gguf_file import open_gguf
from engine.memory.memory_guard import MemoryGuard, MemoryReading
from engine.sampling import SamplingParams
from engine.vision import mmproj
from engine.text.image_tokens import image_runs
from engine_reads import while_held
from vision_chat import encoded, image, user
from engines import maker

N_GEN = 6
N_SPEC = 64         # a reply long enough for lookup to find n-grams to draft from
N_BATCH = 16        # batched replies long enough that rows joining one after another still step together


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    llama_oracle.require()
    return write_gemma3_vision_pair(tmp_path_factory.mktemp("vision-cache"))


@pytest.fixture
def make_engine(pair):
    with maker(pair[0], cache_mib=256) as make:
        yield make


def generate(eng, messages, conversation: str):
    return eng.call(GenerateRequest(messages=messages, conversation=conversation,
                                    sampling=SamplingParams(temperature=0.0, max_tokens=N_GEN)))


def tokens_of(eng, messages) -> list[int]:
    return while_held(eng, lambda e: e.prompts.prompt_tokens(GenerateRequest(messages=messages)))


def first_turn(eng, conversation: str, img: ImageInput, words: str = "Here is a photo: "):
    history = [user(words, img, " Describe it.")]
    r = generate(eng, history, conversation)
    return history + [{"role": "assistant", "content": r.text}], r


def assert_reused(r1, r2, follow_tokens: list[int]) -> None:
    """The follow-up took its history (image span included) from held K/V."""
    held = r1.prompt_tokens + len(r1.tokens)
    assert r2.cached_tokens >= 0.9 * held, (r2.cached_tokens, held)
    assert r2.cached_tokens >= image_runs(follow_tokens)[0][1], "the image span was read again"


def test_counts_include_image_tokens(make_engine):
    eng = make_engine()
    a = image(96, 64, 3)
    text_only = [{"role": "user", "content": "Look:  and say."}]
    with_image = [user("Look: ", a, " and say.")]
    n_text = eng.call(CountTokens(messages=text_only)).tokens
    n = eng.call(CountTokens(messages=with_image)).tokens
    # the marker's surrounding text is the same; the image adds <start_of_image>, 256 tokens, <end_of_image>
    assert n == n_text + 256 + 2
    r1 = generate(eng, with_image, "count")
    assert r1.prompt_tokens == n and r1.cached_tokens == 0
    follow = with_image + [{"role": "assistant", "content": r1.text}, {"role": "user", "content": "More?"}]
    want = tokens_of(eng, follow)              # before the turn: the held ids it will keep
    assert eng.call(CountTokens(messages=follow)).tokens == len(want)
    r2 = generate(eng, follow, "count")
    assert r2.prompt_tokens == len(want)
    assert r2.cached_tokens >= image_runs(want)[0][1]     # the image's 256 among them
    # the reply's own generated ids are kept after the image, as a text chat's are: all of it is reused
    assert r2.cached_tokens >= r1.prompt_tokens + len(r1.tokens) - 1, (r2.cached_tokens, r1.prompt_tokens)


def test_a_history_of_many_images_is_not_decoded_again_each_turn(make_engine):
    """Six images in a chat (more than the decoded/prepared caches' four): the follow-up sends every one
    again (as a server client does), and none is decoded, prepared or encoded again: their K/V is held."""
    eng = make_engine()
    imgs = [image(40 + 9 * i, 60 - 5 * i, 70 + i) for i in range(6)]
    history = [user("Six: ", *imgs, " Which is darkest?")]
    r1 = generate(eng, history, "six")
    vision = eng.call(Status()).vision
    assert vision["images_prepared"] == 6 and vision["images_encoded"] == 6
    follow = history + [{"role": "assistant", "content": r1.text}, {"role": "user", "content": "And the lightest?"}]
    r2 = generate(eng, follow, "six")
    again = eng.call(Status()).vision
    assert (again["images_prepared"], again["images_encoded"]) == (6, 6), again
    assert_reused(r1, r2, tokens_of(eng, follow))


def test_parked_and_brought_back(make_engine):
    eng = make_engine()
    a, b = image(150, 110, 51), image(110, 150, 52)
    hist_a, r1 = first_turn(eng, "chat-a", a)
    first_turn(eng, "chat-b", b, "Another one: ")              # chat A is parked
    assert eng.call(Status()).conversations[0]["owner"] == "chat-b"
    n = encoded(eng)
    follow = hist_a + [{"role": "user", "content": "And the colours?"}]
    r2 = generate(eng, follow, "chat-a")
    assert encoded(eng) == n, "the image was encoded again"
    assert_reused(r1, r2, tokens_of(eng, follow))


def test_disk_tier_after_a_restart(make_engine, tmp_path):
    disk = dict(disk_mib=64, disk_dir=str(tmp_path / "disk"))
    eng = make_engine(**disk)
    a = image(140, 100, 61)
    hist, r1 = first_turn(eng, "chat-d", a)
    assert eng.wait_idle(60)                   # the idle-time write (engine/disk_tier.IdleWrites)
    eng.wait_idle(60)
    eng.stop()
    again = make_engine(**disk)
    assert encoded(again) == 0
    follow = hist + [{"role": "user", "content": "And the colours?"}]
    r2 = generate(again, follow, "chat-d")
    assert encoded(again) == 0, "the image was encoded again after the restart"
    assert r2.restored_from_disk > 0
    assert_reused(r1, r2, tokens_of(again, follow))


def test_session_file_save_and_restore(make_engine, tmp_path):
    eng = make_engine()
    a = image(120, 90, 71)
    hist, r1 = first_turn(eng, "chat-s", a)
    path = str(tmp_path / "with-image.strata")
    saved = eng.call(SaveSession(path, messages=hist, conversation="chat-s"))
    assert saved.tokens == r1.prompt_tokens + len(r1.tokens) - 1 or saved.tokens >= r1.prompt_tokens
    eng.stop()
    again = make_engine()
    restored = again.call(RestoreSession(path, conversation="chat-s"))
    parts = restored.messages[0]["content"]
    assert [p["type"] for p in parts] == ["text", "image", "text"] and parts[1]["name"] == a.name
    follow = hist + [{"role": "user", "content": "And the colours?"}]
    r2 = generate(again, follow, "chat-s")
    assert encoded(again) == 0, "the image was encoded again after the restore"
    assert_reused(r1, r2, tokens_of(again, follow))


def test_a_chat_with_an_image_saved_after_a_restart_and_continued_from_the_file(make_engine, tmp_path):
    """K/V not held (a new engine): the save reads the chat again, image included; the restored
    messages keep the image as a reference (name, size, digest), and a follow-up sending them back
    (no pixels) is served from the restored K/V."""
    eng = make_engine()
    a = image(130, 70, 95)
    hist, r1 = first_turn(eng, "chat-r", a)
    eng.stop()
    again = make_engine()
    path = str(tmp_path / "reread.strata")
    saved = again.call(SaveSession(path, messages=hist, conversation="chat-r"))
    assert saved.reread and encoded(again) == 1
    again.stop()
    third = make_engine()
    restored = third.call(RestoreSession(path, conversation="chat-r"))
    follow = restored.messages + [{"role": "user", "content": "And the colours?"}]
    r2 = generate(third, follow, "chat-r")
    assert encoded(third) == 0
    assert_reused(r1, r2, tokens_of(third, follow))
    with pytest.raises(EngineError) as e:      # a reference whose span nothing holds: send the image again
        generate(third, [user("New chat: ")] + [{"role": "user", "content": restored.messages[0]["content"]}],
                 "chat-other")
    assert e.value.code == ErrorCode.BAD_REQUEST and "send the image again" in str(e.value)


def test_a_session_with_image_spans_is_refused_without_a_projector(make_engine, tmp_path):
    eng = make_engine()
    hist, _ = first_turn(eng, "chat-p", image(80, 120, 91))
    path = str(tmp_path / "img.strata")
    eng.call(SaveSession(path, messages=hist, conversation="chat-p"))
    eng.stop()
    text_only = make_engine(mmproj="")
    with pytest.raises(EngineError) as e:
        text_only.call(RestoreSession(path))
    assert e.value.code == ErrorCode.SESSION_REFUSED and "outside the vocabulary" in str(e.value)
    assert text_only.call(Status()).live_tokens == 0


def test_a_different_image_reuses_nothing_from_disk_or_a_session(make_engine, tmp_path):
    disk = dict(disk_mib=64, disk_dir=str(tmp_path / "disk"))
    eng = make_engine(**disk)
    a, b = image(100, 100, 81), image(100, 100, 82)
    hist, _ = first_turn(eng, "chat-x", a)
    path = str(tmp_path / "a.strata")
    eng.call(SaveSession(path, messages=hist, conversation="chat-x"))
    while_held(eng, lambda e: e.disk.persist(e.conversations.live))
    eng.wait_idle(60)
    eng.stop()
    swapped = [user("Here is a photo: ", b, " Describe it.")] + hist[1:] + [{"role": "user", "content": "More?"}]
    for restore in (False, True):       # the disk tier alone, then the session file alone
        again = make_engine(**(dict(disk_mib=0) if restore else disk))
        if restore:
            again.call(RestoreSession(path, conversation="chat-x"))
        r = generate(again, swapped, "chat-x")
        start = image_runs(tokens_of(again, swapped))[0][0]
        assert r.cached_tokens <= start, (restore, r.cached_tokens, start)
        assert encoded(again) == 1
        again.stop()


class _Reader:
    """A memory reading with a set available amount (a 16 GiB machine)."""

    def __init__(self, available: int):
        self.available = available

    def __call__(self) -> MemoryReading:
        return MemoryReading(total_bytes=16 << 30, available_bytes=self.available, source="test")


def test_the_memory_fit_counts_the_projector_and_one_image(pair):
    """Room for the text model at its context but not for the projector's weights and one image's
    activations too: the load with the projector is refused with the numbers, the text-only one loads."""
    model, mm = pair
    ctx = 512
    vplan = mmproj.plan(mm, True, "gemma3", 256, 4)
    weights = sum(int(t.n_elements) for t in open_gguf(mm).reader.tensors) * 4
    assert vplan.bytes == weights + mmproj.activation_bytes(vplan.spec, 4) > weights
    need = me.estimate(me.read_header(model), ctx, "float32").total_bytes
    eng = Engine(EngineOptions(context_length=ctx, cache_mib=0, dtype="float32"))
    eng.guard = MemoryGuard(reserve_bytes=1 << 30, reader=_Reader(need + (1 << 30) + vplan.bytes // 2))
    eng.start()
    try:
        with pytest.raises(EngineError) as e:
            eng.call(LoadModel(str(model), mmproj=str(mm)))
        assert e.value.code == ErrorCode.MEMORY_REFUSED and "does not fit" in str(e.value)
        assert eng.call(LoadModel(str(model), mmproj="")).facts.vision is None
    finally:
        eng.stop()


def together(eng, reqs: list[GenerateRequest]) -> list:
    """Every request queued while the engine thread is held, so they start as one batch."""
    hold = eng.scheduler.hold()
    try:
        handles = [eng.submit(r) for r in reqs]
    finally:
        hold.release()
    return [h.result(300) for h in handles]


def greedy_req(messages, conversation: str, n: int = N_BATCH) -> GenerateRequest:
    return GenerateRequest(messages=messages, conversation=conversation,
                           sampling=SamplingParams(temperature=0.0, max_tokens=n))


def batch_counters(eng) -> BatchCounters:
    return eng.call(Status()).batch or BatchCounters()


def test_image_rows_batch_with_text_rows_and_equal_their_lone_replies(make_engine):
    """Three chats with an image (the third re-sends the first's image) and two text chats sent at once
    (max_sequences 8): each image row's prompt is read into its own cache (its image fed whole, as
    alone), then it decodes in the batch's steps beside the others, while the text rows' prompts are
    read together; every reply equals the one its request gets alone, each image encoded once."""
    a, b = image(88, 120, 97), image(130, 70, 98)
    reqs = [greedy_req([user("What is this? ", a)], "img-a"),
            greedy_req([{"role": "user", "content": "Tell me about number 7."}], "text-1"),
            greedy_req([user("And this one, ", b, " what is it?")], "img-b"),
            greedy_req([{"role": "user", "content": "Count to three, slowly."}], "text-2"),
            greedy_req([user("Seen this before? ", a)], "img-a-again")]
    lone = make_engine(max_sequences=1)
    want = [lone.call(r) for r in reqs]
    lone.stop()
    batched = make_engine(max_sequences=8)
    got = together(batched, reqs)
    assert [r.tokens for r in got] == [r.tokens for r in want]
    assert [r.prompt_tokens for r in got] == [r.prompt_tokens for r in want]
    c = batch_counters(batched)
    assert c.rows == 5 and c.image_rows == 3
    assert c.read_together == 2, "the text prompts are read together, the image prompts each alone"
    assert c.peak_rows == 5 and c.shared_steps > 0, c      # all five decoded in the same steps
    assert encoded(batched) == 2, "an image sent in two chats at once is encoded once"


def test_an_image_row_cancelled_while_read_parks_what_it_fed(make_engine):
    """An image row cancelled before its image is fed (its first text chunk is in) gets Failed(cancelled)
    and parks the text it fed; the text row beside it equals its lone reply, and the chat sent again
    equals its lone reply."""
    a = image(100, 80, 71)
    img_req = greedy_req([user("What is this? ", a)], "img")
    text_req = greedy_req([{"role": "user", "content": "Tell me about number 7."}], "text")
    lone = make_engine(max_sequences=1)
    want_img, want_text = lone.call(img_req), lone.call(text_req)
    lone.stop()
    eng = make_engine(max_sequences=4)
    victim = []

    def cancel_on_progress(ev):
        if isinstance(ev, Progress) and ev.done > 0:
            victim[0].cancel()
    hold = eng.scheduler.hold()
    try:
        victim.append(eng.submit(img_req, callback=cancel_on_progress))
        other = eng.submit(text_req)
    finally:
        hold.release()
    with pytest.raises(EngineError, match="cancel"):
        victim[0].result(300)
    assert other.result(300).tokens == want_text.tokens
    held = {x["owner"]: x["tokens"] for x in eng.call(Status()).conversations}
    start = image_runs(tokens_of(eng, img_req.messages))[0][0]
    # the text before the image is one chunk: the cancel comes before the image's own pass
    assert 0 < held.get("img", 0) == start, "it parked the text it had fed, no part of the image"
    assert encoded(eng) == 0
    assert eng.call(img_req).tokens == want_img.tokens
    assert encoded(eng) == 1


def test_follow_ups_of_image_chats_batch_on_their_held_image_spans(make_engine):
    """Follow-ups of three chats with an image (held live or parked) and a text chat sent at once: the
    image spans come from held K/V (no image encoded again); two follow-ups and the text chat read their
    new text together, the third adds a new image, read by its row alone (that image alone encoded); all
    four decode together, and each reply equals its lone one."""
    a, b, c, d = image(96, 96, 61), image(64, 120, 62), image(110, 90, 63), image(70, 70, 64)
    firsts = [greedy_req([user("Here is a photo: ", a, " Describe it.")], "chat-a"),
              greedy_req([user("Another one: ", b, " Describe it.")], "chat-b"),
              greedy_req([user("A third: ", c, " Describe it.")], "chat-c")]
    more = [[{"role": "user", "content": "What colour is it mostly?"}],
            [{"role": "user", "content": "Is it bright?"}],
            [user("Compare it with this one: ", d)]]

    def follow_ups(replies) -> list[GenerateRequest]:
        return [greedy_req(f.messages + [{"role": "assistant", "content": r.text}] + m, f.conversation)
                for f, r, m in zip(firsts, replies, more)] + [
                    greedy_req([{"role": "user", "content": "Count to five."}], "text")]
    lone = make_engine(max_sequences=1)
    lone_firsts = [lone.call(r) for r in firsts]
    want = [lone.call(r) for r in follow_ups(lone_firsts)]
    lone.stop()
    eng = make_engine(max_sequences=4)
    got_firsts = [eng.call(r) for r in firsts]
    assert [r.tokens for r in got_firsts] == [r.tokens for r in lone_firsts]
    before, n_encoded = batch_counters(eng), encoded(eng)
    assert n_encoded == 3 and before.image_rows == 3
    reqs = follow_ups(got_firsts)
    spans = [image_runs(tokens_of(eng, r.messages))[0][1] for r in reqs[:3]]
    got = together(eng, reqs)
    assert [r.tokens for r in got] == [r.tokens for r in want]
    for r, first, span in zip(got, got_firsts, spans):
        assert r.cached_tokens >= span and r.cached_tokens >= 0.9 * (first.prompt_tokens + len(first.tokens))
    assert encoded(eng) == n_encoded + 1, "a held image span was encoded again"
    after = batch_counters(eng)
    assert after.image_rows == before.image_rows + 1, "a held image span was read again"
    assert after.rows == before.rows + 4 and after.read_together == before.read_together + 3
    assert after.peak_rows == 4 and after.shared_steps > before.shared_steps


def test_lookup_drafts_around_images_and_equals_plain_decoding(make_engine, pair):
    """Lookup speculation on a prompt with an image drafts from the text (the image's ids are never an
    n-gram key nor a draft token, speculative.LookupDrafter) and replies as plain decoding does; a draft
    model, which cannot read the image, decodes plainly and says why."""
    eng = make_engine()
    # a prompt on which the tiny model's greedy reply repeats a few of its n-grams (lookup finds drafts)
    said = "Say it twice: red green blue yellow. "
    msgs = [user(said, image(72, 72, 99), " " + said)]

    def ask(speculative: str, conversation: str):
        return eng.call(GenerateRequest(messages=msgs, conversation=conversation, speculative=speculative,
                                        sampling=SamplingParams(temperature=0.0, max_tokens=N_SPEC)))
    plain = ask("off", "plain")
    r = ask("lookup", "lookup")
    assert r.tokens == plain.tokens and r.speculative == "lookup"
    assert r.drafted_tokens > 0, "lookup drafted nothing around the image"
    assert "images" not in (r.speculation_stopped or "")
    d = ask(f"draft:{pair[0]}", "draft")
    assert d.tokens == plain.tokens and d.drafted_tokens == 0
    assert "cannot read the image" in d.speculation_stopped
    assert encoded(eng) == 1
    text = eng.call(GenerateRequest(messages=[{"role": "user", "content": "no image here"}], speculative="lookup",
                                    sampling=SamplingParams(temperature=0.0, max_tokens=N_GEN)))
    assert "images" not in (text.speculation_stopped or "")


def test_many_images_in_rows_read_together_are_all_fed(make_engine):
    """Three chats of three images each, sent at once: every row's images are still there when its turn
    to read them comes (more images wait in admitted rows than the engine keeps pending for a lone
    prompt, Vision.hold), and each reply equals its lone one."""
    reqs = [greedy_req([user(*[x for k in range(3) for x in (f"Picture {k}: ", image(40 + 8 * k, 36, 10 * i + k))])],
                       f"album-{i}", n=4) for i in range(3)]
    lone = make_engine(max_sequences=1)
    want = [lone.call(r).tokens for r in reqs]
    lone.stop()
    batched = make_engine(max_sequences=4)
    assert [r.tokens for r in together(batched, reqs)] == want
    assert encoded(batched) == 9 and batch_counters(batched).image_rows == 3
