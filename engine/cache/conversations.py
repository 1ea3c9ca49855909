"""The conversations the engine holds K/V for: the live one and the parked ones (engine thread only).

`live` is the one conversation holding the engine (a `parking.KVEntry`: tokens, K/V, messages,
owner, key = kv_key.KVKey: model, steering, K/V format). A conversation that loses the engine is parked in RAM
(`parking.Parking`: a cap in MiB and a slot count, least recently used evicted first, each park
checked by the memory guard). This module picks what a prompt extends (`take`), which held tokens
a rendered prompt keeps (`continue_tokens`), and finds a conversation by its messages (`find`).

The K/V identity (`key`) and a fresh cache (`make_cache`) come from the loaded model, so they are
passed in: this object knows conversations, not models.
"""
from __future__ import annotations

from typing import Callable

from engine.cache.kv_key import KVKey
from engine.cache.parking import MIN_PREFIX_REUSE, KVEntry, Parking, common_prefix, TEXT_CONTEXT
from engine.cache import layer_cache
from engine.text.prompt_encoder import shared_chars
from engine.text.image_tokens import has_images, is_image_token, outside_vocab


class Conversations:
    def __init__(self, parking: Parking, log: Callable[[str], None]):
        self.parking = parking
        self.live: KVEntry | None = None
        # conversations checked out by the batch (engine/generation/batching.py), neither live nor
        # parked while their replies run; each comes back whole (check_in) when its reply ends.
        self.busy: list[KVEntry] = []
        self._log = log
        self.disk = None            # the disk tier under parking (engine/disk_tier.DiskTier), or None

    # ---- what is held ------------------------------------------------------------------------
    def held(self) -> list[KVEntry]:
        return ([self.live] if self.live is not None else []) + list(self.parking.entries)

    def held_bytes(self) -> int:
        """K/V bytes held, live, parked and checked out by the batch."""
        return sum(e.nbytes() for e in self.held() + self.busy)

    def clear(self) -> None:
        """A new model: nothing held is valid any more."""
        self.live = None
        self.busy = []
        self.parking.clear()

    def check_out(self, entry: KVEntry) -> None:
        """`entry` (just taken) joins the batch: not live, not parked, not taken again."""
        if self.live is entry:
            self.live = None
        self.busy.append(entry)

    def check_in(self, entry: KVEntry) -> None:
        """a batched reply ended: its conversation takes the engine as a lone reply's
        would (the live one, if another, is parked)."""
        self.busy = [e for e in self.busy if e is not entry]     # by identity: KVEntry's == compares arrays
        self.make_live(entry)

    def make_live(self, entry: KVEntry) -> None:
        """`entry` takes the engine; the live conversation (if another) is parked."""
        if self.live is not None and self.live is not entry and self.parking.enabled:
            self.parking.park(self.live)
        self.live = entry

    def find(self, messages: list[dict], keys: set[KVKey] | None = None, owner: str = "") -> KVEntry | None:
        """The held conversation to save (one of `keys`, when given). By its id when the caller names one
        (`owner`: the app's chat), its messages then only confirming that the K/V is of this very turn;
        by its messages alone otherwise (an OpenAI-style client names a conversation by sending it)."""
        return next((e for e in self.held() if (not owner or e.owner == owner) and e.messages == messages
                     and (keys is None or e.key in keys)), None)

    def drop(self, entry: KVEntry, why: str) -> None:
        """Forget a held K/V (live or parked) that fails when used, so it cannot fail later requests."""
        if entry is self.live:
            self.live = None
            self._log(f"dropped the live conversation of {len(entry.tokens)} tokens: {why}")
            self.parking.tell("dropped", entry, why)
        elif not isinstance(entry, KVEntry):        # a disk tier entry (engine/disk_tier.DiskEntry)
            self.disk.drop(entry, why)
        else:
            self.parking.drop(entry, why)

    def drop_suspect(self, n_vocab: int) -> None:
        """After an unexpected error in a request: the live K/V may be half-updated, and a parked entry
        with token ids outside the vocabulary would fail every later request. Drop them, with a log line."""
        if self.live is not None:
            self._log(f"dropped the live conversation's K/V ({len(self.live.tokens)} tokens) after an engine error")
            self.parking.tell("dropped", self.live, "an engine error")
            self.live = None

        def sound(e) -> bool:
            try:
                return all(0 <= int(t) < n_vocab or is_image_token(int(t)) for t in e.tokens)
            except (TypeError, ValueError, OverflowError):
                return False
        for e in list(self.parking.entries):
            if not sound(e):
                self.parking.entries.remove(e)
                self._log(f"dropped a parked conversation ({len(e.tokens)} tokens) holding invalid token ids")
                self.parking.tell("dropped", e, "invalid token ids")

    def summary(self) -> list[dict]:
        """One line of facts per held conversation (live first): owner, tokens, whether live."""
        busy = {id(e) for e in self.busy}
        return [{"owner": e.owner, "tokens": len(e.tokens), "live": e is self.live or id(e) in busy}
                for e in self.busy + self.held()]

    # ---- which K/V a prompt extends ----------------------------------------------------------
    def take(self, tokens: list[int], owner: str, key: KVKey, make_cache: Callable[[], list]) -> tuple[KVEntry, int]:
        """The K/V to extend for `tokens` and how many of its tokens it keeps: the live one, a parked
        one, or a new one. The caller makes it live.

        `owner` names the conversation: a new branch of it (Regenerate, Edit and resend) takes its
        own K/V back and trims it instead of keeping the old branch in a second slot.

        A conversation on disk (engine/disk/disk_tier.py) sharing a longer prefix than anything held in RAM
        is restored instead (the same prefix rule)."""
        if self.disk is not None and self.disk.enabled:
            got = self._take_from_disk(tokens, owner, key, make_cache)
            if got is not None:
                return got
        live, parking = self.live, self.parking
        if live is not None and live.key == key:
            n = common_prefix(live.tokens, tokens)
            if n == len(live.tokens):
                return live, n
            if owner and live.owner == owner:
                return live, n          # the same conversation, another branch: its slot, trimmed
            if not parking.enabled and n >= min(MIN_PREFIX_REUSE, len(live.tokens)):
                return live, n          # no parking: reuse the shared prefix, as llama.cpp does
        self.live = None
        if owner:
            own, n = parking.take_owned(owner, key, tokens)
            if own is not None:
                if live is not None and parking.enabled:
                    parking.park(live)
                return own, n
        entry, n = None, 0
        n_live = common_prefix(live.tokens, tokens) if live is not None and live.key == key else 0
        if any(e.key == key and common_prefix(e.tokens, tokens) > n_live for e in parking.entries):
            # Take before parking the live conversation: parking it may evict the very entry wanted.
            entry, n = parking.take(tokens, key, make_cache)
        if live is not None and parking.enabled:
            parking.park(live)
        if entry is None:
            entry, n = parking.take(tokens, key, make_cache)
        if entry is not None:
            return entry, n
        return KVEntry([], make_cache(), key), 0

    def _take_from_disk(self, tokens: list[int], owner: str, key: KVKey, make_cache) -> tuple[KVEntry, int] | None:
        """The disk tier's conversation for `tokens` when it shares more than RAM holds (else None)."""
        in_ram = [e for e in self.held() if e.key == key]
        ram = max((_reach(e, common_prefix(e.tokens, tokens), len(tokens)) for e in in_ram), default=0)
        found, m = self.disk.best(tokens, key)
        if found is None or m <= ram:
            return None
        got = self.disk.restore(found, m, make_cache, tokens)
        if got is None:
            return None
        if self.live is not None and self.parking.enabled:
            self.parking.park(self.live)
        self.live = None
        for e in list(self.parking.entries):    # the same conversation's older K/V: superseded
            if owner and e.owner == owner and e.key == key:
                self.parking.drop(e, "superseded by its copy on disk")
        return got

    def continue_tokens(self, tok, text: str, add_bos: bool, owner: str, key: KVKey,
                        image_span: int = 0) -> list[int] | None:
        """Tokens for `text` that keep a held conversation's own tokens as far as `text` follows them.

        Re-tokenizing a reply does not always give back the ids the model generated; keeping
        them is what lets a follow-up reuse the whole history instead of stopping at the reply.
        Each held entry keeps the text its tokens decode to (KVEntry.text, extended as it grows),
        so the check is a string comparison and only the new part of `text` is tokenized. A new
        branch of `owner`'s conversation (Regenerate, Edit) keeps the longest run of its held tokens
        that the text starts with. Another named conversation's held run counts too (a fork of a chat
        goes on from its parent's tokens, so it shares the parent's K/V and answers as the parent did),
        but only up to the start of a special token inside it: the text from a special token on
        tokenizes the same whatever came before it (engine/text/prompt_encoder.py), whereas another
        conversation's tokens cut mid-word would give this one an unnatural tokenization.. `image_span`: the loaded projector's
        tokens an image (0: none): entries holding image spans of that length are passed over (no text
        decodes to them: a prompt with images keys them itself); any other negative id is a bad entry, dropped."""
        candidates = []
        best, best_n = None, 0
        on_disk = [e for e in self.disk.entries.values() if e.key == key] \
            if self.disk is not None and self.disk.enabled else []
        for e in self.held() + on_disk:           # whole entries first: a string comparison each
            spans = has_images(e.tokens) and outside_vocab(e.tokens, 1 << 31, image_span) is None
            if e.key != key or not e.tokens or spans:
                continue
            starts_bos = tok.bos_id is not None and e.tokens[0] == tok.bos_id
            if add_bos and not starts_bos:
                continue
            lead = 1 if add_bos else 0
            try:
                prefix = e.text(tok, skip=lead)
            except Exception as err:  # noqa: BLE001 - e.g. a token id outside the vocabulary
                self.drop(e, f"its tokens cannot be decoded ({type(err).__name__}: {str(err)[:120]})")
                continue
            candidates.append((e, lead, e.tokens[lead:]))
            if len(e.tokens) > best_n and prefix and text.startswith(prefix):
                best, best_n = e.tokens + tok.encode(text[len(prefix):], add_bos=False), len(e.tokens)
        if best is not None:
            return best
        cuts = tok.cut_ids() if owner else frozenset()
        for e, lead, ids in candidates:           # then the longest held run the text starts with
            own = owner and e.owner == owner
            if not own and not cuts:
                continue
            lo = held_run(tok, ids, text, e.text(tok, skip=lead))
            if not own:
                lo = before_special(ids, lo, cuts)
            if lo >= MIN_PREFIX_REUSE and lead + lo > best_n:
                prefix = tok.decode(ids[:lo], skip_special=False)
                best, best_n = e.tokens[:lead + lo] + tok.encode(text[len(prefix):], add_bos=False), lead + lo
        return best


def _reach(e: KVEntry, shared: int, n_prompt: int) -> int:
    """How much of the `shared` prefix a held conversation keeps for a prompt of n_prompt tokens (what
    its rewind gives): all of it where its cache trims there, else its latest checkpoint at or before
    (a window or a recurrent state), else nothing. The disk tier's `reach` is the same rule on its
    segment ends: the one that keeps more serves the prompt."""
    n = min(shared, n_prompt - 1)
    if n >= len(e.tokens) or layer_cache.floor(e.cache, len(e.tokens)) <= n:
        return shared
    return max((ck.n for ck in e.checkpoints if ck.n <= n), default=0)


def before_special(ids: list[int], lo: int, cuts: frozenset[int]) -> int:
    """The largest j < lo where ids[j] is one of the special tokens `cuts` (0 when none): ids[:j] ends
    where a message boundary starts, so the rest of the text is tokenized as it would be anyway."""
    for j in range(min(lo, len(ids)) - 1, -1, -1):
        if ids[j] in cuts:
            return j
    return 0


def held_run(tok, ids: list[int], text: str, full: str) -> int:
    """The most of `ids` whose text `text` starts with: the largest m with text.startswith(decode(ids[:m])),
    `full` being decode(ids). An Edit or a template that renders a past reply otherwise diverges near
    the end, so the search runs from the end: the text of ids[:m] is `full` less the text of ids[m:]
    (decoded with TEXT_CONTEXT tokens before it, as KVEntry.text extends), which costs the tail, not
    the history (a whole-prefix binary search decoded ~14 x 8,000 tokens: 47 ms on this box). One
    decode of the result confirms it; a tokenizer where the tail's text does not add up gets the
    whole-prefix binary search."""
    n = len(ids)
    k = shared_chars(full, text)

    def fits(m: int) -> bool:        # the text of ids[:m] is within the shared part
        if m == 0:
            return True
        a = max(0, m - TEXT_CONTEXT)
        ctx = tok.decode(ids[a:m], skip_special=False)
        both = tok.decode(ids[a:], skip_special=False)
        if not both.startswith(ctx):
            raise ValueError
        return len(full) - (len(both) - len(ctx)) <= k

    try:
        hi, step = n, 1                  # fits(hi) is False, or hi == n
        while hi > 0 and not fits(max(0, hi - step)):
            hi, step = max(0, hi - step), step * 2
        lo = max(0, hi - step)           # fits(lo)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if fits(mid):
                lo = mid
            else:
                hi = mid - 1
        if text.startswith(tok.decode(ids[:lo], skip_special=False)):
            return lo
    except ValueError:
        pass
    lo, hi = 0, n                        # decode(ids[:lo]) is a prefix of text
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if text.startswith(tok.decode(ids[:mid], skip_special=False)):
            lo = mid
        else:
            hi = mid - 1
    return lo
