"""Chat titles: what the model is asked, how its answer is made a title, and the queue that keeps the
title requests out of the user's way.

A title is the lowest-priority work the app gives the engine. `TitleQueue` sends one title request at
a time and only while no chat holds the engine for a reply of the user's (`hold`/`release`); a reply
asked for while a title runs cancels that title (the engine stops it within one decode step or one
layer of a prompt being read), and the title goes back to the front of the queue, to run again once
every reply is over. Each chat asks at most once (`ask` ignores an owner already queued or running).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable

from PySide6.QtCore import QObject, Signal

# A stated task and a stated length, and one worked example as an earlier turn: small models asked for
# "a title" answered in sentences ("I'm ready to assist you. What's"); an example of the wanted shape
# steers them better than words alone.
TITLE_PROMPT = ("Name the topic of this conversation in a noun phrase of 2 to 5 words, like "
                "\"Garden pest control\" or \"Tax return questions\". Answer with the phrase only: "
                "no sentence, no quotes, no full stop.")
TITLE_MAX_TOKENS = 16
TITLE_WORDS = 6
TITLE_CHARS = 48
QUOTE_CHARS = 400          # of the first question and reply, what the title request quotes
TOPIC_ASK = "The conversation's topic, in 2 to 5 words:"
EXAMPLE = ("User: How do I bake bread at home?\nAssistant: Mix flour, water, yeast and salt, knead the dough, "
           "let it rise for an hour and bake it at 230 degrees.", "Home bread baking")

# A word a title does not end on ("How to make a cup of").
_LOOSE_END = {"a", "an", "the", "of", "and", "or", "to", "for", "in", "on", "with", "about", "at", "by", "from"}
# Words any conversation has: sharing one of them does not make a title this conversation's.
_COMMON = _LOOSE_END | set(
    "how what who why when where which the and you can are was were not but all any one get has had our out "
    "may its let use new now see way did does this that with your have from about help make like just some "
    "more want need tell give know would could should there their they them then than into here also been "
    "very much many well will shall hello thanks thank please".split())
# A reply's chatty opening, dropped before the phrase: "Sure! Here is a title: ..." -> "...".
_LEAD = re.compile(r"^(?:(?:sure|certainly|of course|okay|ok|absolutely|great)\b[\s,!.:-]*)?"
                   r"(?:(?:here(?:'s| is| are)|this is)\b[^:]*:\s*)?(?:(?:title|topic|name)\s*:\s*)?", re.I)
# A line that is only an opening ("Here is a short title"): the title is on a later line.
_ONLY_LEAD = re.compile(r"^(?:here(?:'s| is| are)|this is)\b.*\b(?:title|name|phrase)\b", re.I)
# A sentence about the assistant itself is a reply, not a title: the user's question names it instead.
_SELF_TALK = re.compile(r"^(?:i|i'm|i am|i'd|i'll|i can|i will|i would|let me|let's|as an|you)\b", re.I)
# A list's marker ("1.", "-") before the phrase.
_LIST_MARK = re.compile(r"^(?:\d+[.)]|[-*\u2022])\s+")
# A sentence's verb after its subject ("The sea is a vast world"): the subject is the topic.
_COPULA = re.compile(r"\s(?:is|are|was|were)\s|'s\s+(?:a|an|the)\s", re.I)
# ... unless the phrase is a question ("What is recursion"), which stays whole.
_QUESTION = re.compile(r"^(?:what|why|how|when|where|who|which|is|are|can|do|does|should)\b", re.I)
# A question's polite opening, dropped when the question itself becomes the title.
_ASK_LEAD = re.compile(r"^(?:(?:please|hi|hello|hey)\b[\s,!]*)*(?:(?:can|could|would|will) you\s+(?:please\s+)?|"
                       r"i (?:want|would like|'d like|need) (?:you )?to\s+|give me\s+|tell me(?: about)?\s+|"
                       r"please\s+)?", re.I)


def title_messages(first_user: str, reply: str) -> list[dict]:
    """The title request's messages: the stated task with a worked example, then the first question and
    reply, quoted."""
    # The task in the first user turn, not a system message: some templates refuse a system role
    return [{"role": "user", "content": f"{TITLE_PROMPT}\n\n{EXAMPLE[0]}\n\n{TOPIC_ASK}"},
            {"role": "assistant", "content": EXAMPLE[1]},
            {"role": "user", "content": f"User: {first_user[:QUOTE_CHARS]}\nAssistant: {reply[:QUOTE_CHARS]}\n\n"
                                        f"{TOPIC_ASK}"}]


def images_named(refs: list[dict]) -> str:
    """The text a message of images alone stands for in its title: its first image's name ("beach.jpg"),
    else "Image"."""
    names = [str(r.get("name") or "") for r in refs if r.get("name")]
    return names[0] if names else ("Image" if refs else "")


def _phrase(line: str) -> str:
    """A line cut to its first sentence (or what comes before a colon: "The Lone Lighthouse: A tale
    of ..."), without a list marker, markup, quotes and end punctuation."""
    line = _LIST_MARK.sub("", re.sub(r"[*_`#\"\u201c\u201d]", "", line).strip())
    line = re.split(r"(?<=[^\d\s][.!?])\s|:\s|,\s+(?:a|an|the)\s", line, maxsplit=1)[0]
    return line.strip(" \t'.:;,!?-")


def _subject(phrase: str) -> str:
    """A sentence's subject ("The sea is a vast world" -> "The sea"); a question or a phrase as it is."""
    verb = _COPULA.search(phrase)
    if verb is None or verb.start() == 0 or _QUESTION.match(phrase):
        return phrase
    return phrase[:verb.start()].strip(" ,;-")


def clean_title(text: str) -> str:
    """The model's answer made a title: its first line with words, without a chatty opening ("Sure",
    "Here is", "Title:"), cut to its first sentence and a sentence to its subject, at most TITLE_WORDS
    words and TITLE_CHARS characters. "" when it is no title (empty, or a sentence about the assistant: "I'm ready...")."""
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("```"):
            continue
        line = _phrase(_LEAD.sub("", re.sub(r"[*_`#\"\u201c\u201d]", "", line).strip()))
        if not re.search(r"\w", line) or _ONLY_LEAD.match(line):
            continue
        return "" if _SELF_TALK.match(line) else _shorten(_subject(line))
    return ""


def grounded(title: str, source: str) -> bool:
    """Whether the title shares a word with the conversation it names: a small model may copy the
    worked example or make up a topic ("How to make a cup of coffee" for "Hello")."""
    def words(text: str) -> set[str]:
        return {w for w in re.findall(r"\w+", text.lower()) if len(w) >= 3 and w not in _COMMON}
    return bool(words(title) & words(source))


def title_for(answer: str, first_user: str, reply: str) -> str:
    """The chat's title from the model's answer, or from the first question when the answer gives
    none that names this conversation ("" when neither has words)."""
    title = clean_title(answer)
    if title and grounded(title, f"{first_user} {reply}"):
        return title
    return fallback_title(first_user)


def fallback_title(first_user: str) -> str:
    """A title from the user's first question when the model gave none: its first line, without the
    polite opening ("Can you", "Please", "Tell me about")."""
    for line in first_user.splitlines():
        asked = _phrase(_ASK_LEAD.sub("", line.strip()))
        line = asked if re.search(r"\w", asked) else _phrase(line)     # "Hi" alone stays "Hi"
        if re.search(r"\w", line):
            return _shorten(line)
    return ""


def _shorten(phrase: str) -> str:
    """At most TITLE_WORDS words and TITLE_CHARS characters, not ending in a word that needs another
    ("How to make a cup of" -> "How to make a cup"), its first letter a capital."""
    words = " ".join(phrase.split()[:TITLE_WORDS])[:TITLE_CHARS].strip(" ,;:-").split()
    while len(words) > 1 and words[-1].lower() in _LOOSE_END:
        words.pop()
    out = " ".join(words)
    return out[:1].upper() + out[1:]


@dataclass(eq=False)
class TitleJob:
    owner: object                          # the chat view that asked (one job per owner at a time)
    messages: list[dict]
    conversation: str
    on_text: Callable[[str], None]         # the model's answer ("" when the request failed)
    request: object = None                 # the engine request while it runs
    preempted: bool = False                # cancelled for a reply of the user's: runs again later


class TitleQueue(QObject):
    """Title requests, one at a time, only while no owner `hold`s the engine for a user's reply.
    `started(owner, request)` when a title request is sent; `preempted(owner)` when a reply cancelled
    it (it is queued again); `finished(owner)` when it ended for good."""
    started = Signal(object, object)
    preempted = Signal(object)
    finished = Signal(object)

    def __init__(self, client, parent: QObject | None = None):
        super().__init__(parent)
        self.client = client
        self._jobs: list[TitleJob] = []
        self._running: TitleJob | None = None
        self._holders: set = set()

    # ---- what the chats call ---------------------------------------------------------------------
    def ask(self, owner, messages: list[dict], conversation: str, on_text: Callable[[str], None]) -> bool:
        """Queue a title for `owner` (False: it already has one queued or running)."""
        if self.pending(owner):
            return False
        self._jobs.append(TitleJob(owner, list(messages), conversation, on_text))
        if isinstance(owner, QObject):       # a view deleted while its title waits: never called back
            owner.destroyed.connect(lambda _o=None, w=owner: self._forget(w))
        self._pump()
        return True

    def pending(self, owner) -> bool:
        return any(j.owner is owner for j in self._jobs) or (self._running is not None
                                                            and self._running.owner is owner)

    def hold(self, owner) -> None:
        """`owner` sends a reply of the user's: no title runs until it is over; a running one stops now."""
        self._holders.add(owner)
        job = self._running
        if job is not None and not job.preempted:
            job.preempted = True
            job.request.cancel()

    def release(self, owner) -> None:
        """`owner`'s reply is over: the next title runs once no reply holds the engine."""
        self._holders.discard(owner)
        self._pump()

    def drop(self, owner) -> None:
        """`owner` goes away (its tab closed): its queued title is forgotten (a running one finishes; a
        reply it still holds the engine for releases as it ends)."""
        self._jobs = [j for j in self._jobs if j.owner is not owner]
        if self._running is not None and self._running.owner is owner:
            self._running.preempted = False     # cancelled for a reply: it ends for good, not queued again

    def _forget(self, owner) -> None:
        self.drop(owner)
        self._holders.discard(owner)
        if self._running is not None and self._running.owner is owner:
            self._running.on_text = lambda _text: None
        self._pump()

    # ---- the queue -------------------------------------------------------------------------------
    def _pump(self) -> None:
        if self._running is not None or self._holders or not self._jobs:
            return
        job = self._running = self._jobs.pop(0)
        job.preempted = False
        # A side request: it never takes a chat's K/V slot, and runs unsteered.
        req = self.client.generate(job.messages, {"temperature": 0.0, "max_tokens": TITLE_MAX_TOKENS},
                                   conversation=job.conversation, side=True, speed_projection=False)
        job.request = req
        req.done.connect(lambda r, j=job: self._ended(j, r.text, r.finish_reason == "cancelled"))
        req.failed.connect(lambda _m, j=job: self._ended(j, "", True))
        self.started.emit(job.owner, req)
        if self._holders:            # a reply asked for while the request was made (a slot of `started`)
            self.hold(next(iter(self._holders)))

    def _ended(self, job: TitleJob, text: str, stopped: bool) -> None:
        if self._running is not job:
            return
        self._running = None
        job.request = None
        if job.preempted:            # a reply came first: this title runs again after it
            self._jobs.insert(0, job)
            self.preempted.emit(job.owner)
        else:
            job.on_text("" if stopped else text)
            self.finished.emit(job.owner)
        self._pump()
