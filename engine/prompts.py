"""A request's prompt as token ids, on the engine thread: the chat template's render, the held
conversations' own ids kept where the text goes on from them, image spans (engine/vision), the
overflow policy's fit to the context (engine/text/context_policy.py), the system prompt's share of a count,
and the history's message boundaries the prompt encoder checkpoints. One `Prompts(engine)` per engine;
what it reads is the engine's (`loaded`, `conversations`); its own state is the message sizes the
overflow pages remembered for the loaded tokenizer."""
from __future__ import annotations

from dataclasses import replace

from engine.cache import layer_cache
from engine.api import CountTokens, GenerateRequest
from engine.text.chat_template import render
from engine.text.context_policy import (POLICIES, OverflowRefused, message_text, reply_reserve, select as select_messages,
                                        smallest)
from engine.cache.conversations import held_run
from engine.errors import ContextTooLong, RequestError
from engine.cache.parking import common_prefix
from engine.text.image_tokens import has_image_parts, has_images, joined_text, storable, text_chars

MAX_CHARS_PER_TOKEN = 32
SIZES_KEPT = 4096                  # message sizes remembered for the overflow pages (then forgotten at once)


class Prompts:
    def __init__(self, engine):
        self.eng = engine
        self._sizes: dict[str, int] = {}    # message text -> tokens (message_size), for the tokenizer below
        self._sizes_of = None

    def prompt_tokens(self, req: GenerateRequest) -> list[int]:
        tok = self.eng.tokenizer
        # A huge body must not cost a tokenization (or a template render) to be refused: no real
        # tokenizer averages more than MAX_CHARS_PER_TOKEN characters a token.
        chars = len(req.prompt) if req.prompt is not None else sum(
            text_chars(m.get("content")) for m in req.messages or [] if isinstance(m, dict))
        if chars > self.eng.n_ctx * MAX_CHARS_PER_TOKEN:
            raise ContextTooLong(f"the prompt is {chars} characters (over {chars // MAX_CHARS_PER_TOKEN} tokens); "
                               f"the context holds {self.eng.n_ctx}")
        if req.prompt is not None:
            return tok.encode(req.prompt)
        if not req.messages:
            raise RequestError("a request needs messages or a prompt")
        if has_image_parts(req.messages):
            return self.image_prompt(req.messages, tools=getattr(req, "tools", None))
        text, add_bos = self.render_messages(req.messages, getattr(req, "tools", None))
        return (self.eng.conversations.continue_tokens(tok, text, add_bos, req.conversation, self.eng.handlers.cache_key(),
                                                       self.image_span())
                or tok.encode_prompt(text, add_bos=add_bos))

    def render_messages(self, messages: list[dict], tools=None, generation_prompt: bool = True) -> tuple[str, bool]:
        """The messages as the model's template renders them, and whether BOS goes before that text."""
        tok = self.eng.tokenizer
        bos = tok.token_text(tok.bos_id) if tok.bos_id is not None else ""
        text = render(self.eng.template, joined_text(messages), bos_token=bos,
                      eos_token=tok.token_text(min(tok.eos_ids)) if tok.eos_ids else "",
                      name=f"the chat template of {self.eng.model_path.name}" if self.eng.template else "",
                      tools=tools, add_generation_prompt=generation_prompt)
        # A template that writes BOS itself must not get a second one.
        return text, tok.add_bos and not (bos and text.startswith(bos))

    def count_messages(self, messages: list[dict], tools=None) -> int:
        """The prompt's length for `messages`, tokenized afresh (no held conversation's ids)."""
        text, add_bos = self.render_messages(messages, tools)
        return len(self.eng.tokenizer.encode_prompt(text, add_bos=add_bos))

    def fit_context(self, req: GenerateRequest, n_ctx: int) -> tuple[GenerateRequest, list[int], int]:
        """The request as it is sent, its tokens and how many messages it left out: under a dropping
        overflow policy (engine/text/context_policy.py) the turns that fit the context with the reply's
        reserve; else the request as it came."""
        if req.overflow not in POLICIES:
            raise RequestError(f"overflow must be one of {', '.join(POLICIES)} (got {req.overflow!r})")
        if req.overflow == "stop" or not req.messages or req.prompt is not None:
            return req, self.prompt_tokens(req), 0
        budget = n_ctx - reply_reserve(req.sampling.max_tokens, n_ctx)
        cap = self.eng.n_ctx * MAX_CHARS_PER_TOKEN
        if _chars(req.messages) <= cap:
            tokens = self.prompt_tokens(req)
            if len(tokens) <= budget:
                return req, tokens, 0

        # A list past prompt_tokens' character cap counts as over the budget unread, so a long chat is
        # cut by the same pages instead of being refused, in bounded work.
        def count(ms: list[dict]) -> int:
            return budget + 1 if _chars(ms) > cap else self.count_messages(ms, req.tools)
        try:
            sel = select_messages(req.messages, count, budget, req.overflow, size=self.message_size)
        except OverflowRefused as e:
            self.prompt_tokens(replace(req, messages=smallest(req.messages, req.overflow)))  # over the cap: its refusal
            raise ContextTooLong(str(e)) from None
        fitted = replace(req, messages=sel.messages) if sel.dropped else req
        return fitted, self.prompt_tokens(fitted), sel.dropped

    def message_size(self, message: dict) -> int:
        """One message's text in tokens: the overflow pages' unit (engine/text/context_policy.py), remembered
        by text so that each turn tokenizes only its new messages. A text past the character cap is not
        tokenized: its size at the cap's rate is over the context, which is all a page needs."""
        text = message_text(message) if isinstance(message, dict) else ""
        if len(text) > self.eng.n_ctx * MAX_CHARS_PER_TOKEN:
            return len(text) // MAX_CHARS_PER_TOKEN
        tok = self.eng.tokenizer
        if self._sizes_of is not tok or len(self._sizes) > SIZES_KEPT:
            self._sizes, self._sizes_of = {}, tok
        n = self._sizes.get(text)
        if n is None:
            n = self._sizes[text] = len(tok.encode(text, add_bos=False))
        return n

    def context_of(self, req: GenerateRequest) -> int:
        """The context a request may fill: the model's, or a smaller limit it names (a chat's config)."""
        limit = req.context_limit
        if not isinstance(limit, int) or isinstance(limit, bool) or limit < 0:
            raise RequestError(f"context_limit must be a whole number >= 0 (got {limit!r})")
        return min(self.eng.n_ctx, limit) if limit else self.eng.n_ctx

    def image_prompt(self, messages: list[dict], *, tools=None, add_generation_prompt: bool = True) -> list[int]:
        """A chat prompt with image parts: rendered with the media marker in place of each image, then
        tokenized with the images' spans (engine/vision/spans.py). Refused in one line when the model
        has no projector."""
        vision = self.eng.loaded.vision if self.eng.loaded is not None else None
        if vision is None:
            raise RequestError(f"{self.eng.model_path.name} reads text only: no image projector (mmproj) is "
                               f"loaded with it; put its mmproj-*.gguf beside it or name one with --mmproj")
        if self.eng.serving.distributed:
            raise RequestError("images are not read by a distributed engine yet")
        flat, images = vision.flatten(messages)
        text, add_bos = self.render_messages(flat, tools, generation_prompt=add_generation_prompt)
        return vision.tokens(self.eng.tokenizer, text, images, add_bos, tail=self._held_tail)

    def _held_tail(self, head: list[int], piece: str) -> list[int] | None:
        """The ids of `piece` (a prompt's text after its last image, `head` the ids before it) keeping
        a held conversation's own ids after that image as far as `piece` starts with their text: a
        reply's generated ids, which re-tokenizing may not give back (as continue_tokens keeps a text
        prompt's). None when no held conversation follows `head` (tokenize `piece` afresh)."""
        tok, key, best = self.eng.tokenizer, self.eng.handlers.cache_key(), []
        for e in self.eng.conversations.held():
            if e.key != key or len(e.tokens) <= len(head) or e.tokens[:len(head)] != head:
                continue
            rest = e.tokens[len(head):]
            if has_images(rest):
                continue
            # the most of it the piece starts with (a template may trim a reply's edges)
            m = held_run(tok, rest, piece, tok.decode(rest, skip_special=False))
            if m > len(best):
                best = rest[:m]
        if not best:
            return None
        return best + tok.encode(piece[len(tok.decode(best, skip_special=False)):], add_bos=False)

    def storable(self, messages: list) -> list:
        """Messages as held K/V keeps them (engine/text/image_tokens.py): image parts as references."""
        if not has_image_parts(messages):
            return list(messages)
        vision = self.eng.loaded.vision if self.eng.loaded is not None else None
        return vision.storable(messages) if vision is not None else storable(messages)

    def image_span(self) -> int:
        """The most tokens an image takes with the loaded projector (0: none loaded): a restored span
        is at most this long."""
        vision = self.eng.loaded.vision if self.eng.loaded is not None else None
        return vision.max_tokens if vision is not None else 0

    def system_part(self, req: CountTokens, tokens: list[int]) -> int:
        """How many of a count's `tokens` are its leading system messages: the prefix they share with
        those messages rendered alone (0 for a prompt, or a template that renders no system alone)."""
        msgs = req.messages or []
        n = next((i for i, m in enumerate(msgs) if not (isinstance(m, dict) and m.get("role") == "system")), len(msgs))
        if req.prompt is not None or n == 0:
            return 0
        try:
            text, add_bos = self.render_messages(msgs[:n], req.tools, generation_prompt=False)
        except RequestError:          # e.g. a template that refuses a conversation without a user message
            return 0
        return common_prefix(tokens, self.eng.tokenizer.encode_prompt(text, add_bos=add_bos))

    def message_marks(self, req: GenerateRequest, entry, tokens: list[int]) -> list[int]:
        """Where in `tokens` the prefill takes a checkpoint besides the prompt's end (engine/cache/layer_cache.py's
        policy; none for a cache that trims freely): the start and the end of the last message, as the
        history renders without a generation prompt. A template that renders a past reply otherwise
        than it was generated (Qwen3.5's dropped thinking, harmony's channels) makes the next turn
        diverge right after the last message's end, before the prompt's end: these are the points an
        Edit or the next turn shares."""
        if not req.messages or req.prompt is not None or not layer_cache.needs_checkpoints(entry.cache):
            return []
        tok = self.eng.tokenizer
        bos = tok.token_text(tok.bos_id) if tok.bos_id is not None else ""
        eos = tok.token_text(min(tok.eos_ids)) if tok.eos_ids else ""
        marks = []
        for msgs in (req.messages[:-1], req.messages):
            if not msgs:
                continue
            if has_image_parts(msgs):
                marks.append(common_prefix(tokens, self.image_prompt(msgs, tools=getattr(req, "tools", None),
                                                                     add_generation_prompt=False)))
                continue
            text = render(self.eng.template, msgs, bos_token=bos, eos_token=eos, add_generation_prompt=False,
                          tools=getattr(req, "tools", None))
            add_bos = tok.add_bos and not (bos and text.startswith(bos))
            marks.append(common_prefix(tokens, tok.encode_prompt(text, add_bos=add_bos)))
        return marks


def _chars(messages: list[dict]) -> int:
    """The characters prompt_tokens' cap counts."""
    return sum(text_chars(m.get("content")) for m in messages if isinstance(m, dict))
