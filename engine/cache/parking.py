"""Conversation parking: K/V of conversations that lost the engine, kept in RAM under a cap.

An entry holds the engine's own per-layer cache objects (moved, never copied). A request that
extends a parked conversation takes its entry back whole; one that shares only a prefix gets a copy of
that prefix and the entry stays parked.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

from engine.cache.kv_key import KVKey
from engine.cache import layer_cache
from engine.events import KVMoved


MIB = 1 << 20
# Reusing a handful of shared template tokens is not worth a copy (and would make "served from
# scratch" unobservable); below this a prefix counts as no match.
MIN_PREFIX_REUSE = 16
# (all layers, layers held here). A distributed pipeline rank holds some layers only (engine.ranks.distributed
# sets this); counting an entry as the whole model's K/V (every layer's cache has the same size) lets
# every rank make the same cap and eviction decisions. Integer arithmetic: exact on every rank.
WHOLE_MODEL_LAYERS = [1, 1]


# Tokens of context decoded again with the new ones, so that a decoder that looks at neighbours
# (SentencePiece's leading space, a character split across byte tokens) gives the same text as
# decoding the whole list.
TEXT_CONTEXT = 8


@dataclass
class KVEntry:
    tokens: list[int]
    cache: list            # mlx-lm KVCache per layer, holding exactly `tokens`
    key: KVKey             # model, steering and K/V format: K/V is only reused under an equal key
    messages: list[dict] = field(default_factory=list)
    last_used: float = field(default_factory=time.monotonic)
    # decode(tokens[skip:]) per skip (0, or 1 past a BOS), kept up to date incrementally: a follow-up
    # checks its rendered text against it without decoding the whole conversation again.
    _texts: dict = field(default_factory=dict, repr=False, compare=False)
    owner: str = ""        # the conversation it belongs to (a request's `conversation` label)
    disk_id: str = ""      # its file in the disk tier (engine/disk/disk_tier.py), "" when none yet
    restored_from_disk: int = 0   # tokens just restored from the disk tier (reported once by the reply)
    # layer_cache.Checkpoint list, oldest first: only for caches that cannot always be cut back
    # (sliding windows, recurrent states; engine/cache/layer_cache.py states the policy). Empty otherwise.
    checkpoints: list = field(default_factory=list, repr=False, compare=False)

    def nbytes(self) -> int:
        size = layer_cache.nbytes(self.cache) + sum(k.nbytes for k in self.checkpoints)
        # Distributed: each rank counts the whole model's K/V, so every rank evicts alike.
        return size * WHOLE_MODEL_LAYERS[0] // WHOLE_MODEL_LAYERS[1]

    def checkpoint(self) -> None:
        """A message boundary: the cache holds exactly `tokens`. A checkpoint where the cache needs
        them (layer_cache.add_checkpoint: none for full K/V)."""
        layer_cache.add_checkpoint(self.checkpoints, self.cache, len(self.tokens))

    def rewind(self, n: int, make_cache: Callable[[], list]) -> int:
        """Cut back to at most n tokens (trim, else the latest checkpoint at or before n, else
        nothing): the tokens now held (<= n)."""
        held = len(self.tokens)
        self.cache, m = layer_cache.rewind(self.cache, held, n, self.checkpoints, make_cache)
        if m < held:
            self.tokens = self.tokens[:m]       # a new list: its held text is dropped with it
        return m

    def text(self, tokenizer, skip: int = 0) -> str:
        """decode(tokens[skip:], skip_special=False), paying only for tokens added since last time.

        Valid while `tokens` only grows in place (prefill/decode append to it); any other change
        replaces the list (`entry.tokens = entry.tokens[:n]`), which is noticed by identity and
        costs one full decode."""
        toks = self.tokens
        n = len(toks)
        held = self._texts.get(skip)
        if held is not None and held[0] is toks and skip <= held[1] <= n:
            _, done, text = held
            if done < n:
                a = max(skip, done - TEXT_CONTEXT)
                ctx = tokenizer.decode(toks[a:done], skip_special=False)
                both = tokenizer.decode(toks[a:n], skip_special=False)
                text = text + both[len(ctx):] if both.startswith(ctx) else None
        else:
            text = None
        if text is None:
            text = tokenizer.decode(toks[skip:], skip_special=False)
        self._texts[skip] = (toks, n, text)
        return text


def common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the shared prefix; list slices compare in C (a turn's check over 8,000 tokens of
    history costs microseconds, not a Python loop)."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n            # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo


def longest_prefix(entries, key, tokens: list[int]):
    """(the entry under `key` whose tokens share the longest prefix with `tokens`, that length), or
    (None, 0) below the reuse minimum: the one prefix rule of RAM parking and the disk tier. Entries
    have `.key` and `.tokens`."""
    best, best_n = None, 0
    for e in entries:
        if e.key != key:
            continue
        n = common_prefix(e.tokens, tokens)
        if n > best_n:
            best, best_n = e, n
    if best is None or best_n < min(MIN_PREFIX_REUSE, len(best.tokens)):
        return None, 0
    return best, best_n


def copy_prefix(entry: KVEntry, n: int, make_cache: Callable[[], list]) -> tuple[list, int, list]:
    """(a copy of the entry's first m <= n tokens' cache, m, the checkpoints that go with it):
    m < n only for a cache that cannot copy that prefix (engine/cache/layer_cache.py)."""
    return layer_cache.copy_prefix(entry.cache, len(entry.tokens), n, entry.checkpoints, make_cache)


class Parking:
    def __init__(self, cap_mib: int, slots: int, guard, log: Callable[[str], None]):
        self.cap_bytes = max(0, int(cap_mib)) * MIB
        self.slots = max(1, int(slots))
        self.guard = guard
        self.log = log
        self.entries: list[KVEntry] = []
        # Called with an entry about to be evicted (the disk tier writes what it lacks: engine/disk/disk_tier.py)
        self.on_evict: Callable[[KVEntry], None] | None = None
        # Called with an events.KVMoved for each park, refusal, eviction and drop (the engine sends it
        # to the request being served: front ends react to it, not to the log line beside it).
        self.on_event: Callable | None = None

    def tell(self, kind: str, entry: KVEntry, why: str = "", nbytes: int | None = None) -> None:
        if self.on_event is None:
            return
        if nbytes is None:
            try:
                nbytes = entry.nbytes()
            except Exception:  # noqa: BLE001 - K/V dropped after an engine error may not say its size
                nbytes = 0
        self.on_event(KVMoved(kind, len(entry.tokens), nbytes, entry.owner, why, self.status()))

    @property
    def enabled(self) -> bool:
        return self.cap_bytes > 0

    def set_limits(self, cap_mib: int, slots: int) -> None:
        self.cap_bytes = max(0, int(cap_mib)) * MIB
        self.slots = max(1, int(slots))
        self._evict_until(lambda: self.total_bytes() <= self.cap_bytes and len(self.entries) <= self.slots)

    def total_bytes(self) -> int:
        return sum(e.nbytes() for e in self.entries)

    def status(self) -> dict:
        return {"entries": len(self.entries), "bytes": self.total_bytes(), "cap_bytes": self.cap_bytes,
                "slots": self.slots, "tokens": [len(e.tokens) for e in self.entries]}

    def clear(self) -> None:
        self.entries.clear()

    def park(self, entry: KVEntry) -> bool:
        t0 = time.perf_counter()
        if not self.enabled:
            return False
        if not entry.tokens:
            return False
        reason = self.guard.unavailable_reason() if self.guard else None
        if reason:
            self.log(f"not parked: {reason}")
            self.tell("not_parked", entry, reason)
            return False
        size = entry.nbytes()
        if size > self.cap_bytes:
            # Alone larger than the cap: refusing it keeps everything else parked.
            self.log(f"not parked: {len(entry.tokens)} tokens need {size / MIB:.1f} MiB, "
                     f"more than the whole cap of {self.cap_bytes / MIB:.0f} MiB")
            self.tell("not_parked", entry, "more than the whole cap", size)
            return False
        self._evict_until(lambda: self.total_bytes() + size <= self.cap_bytes and len(self.entries) < self.slots,
                          incoming=1)
        ok, why = self.guard.admit(0) if self.guard else (True, "")
        while not ok and self.entries:
            self._evict_one("the memory guard's reserve")
            ok, why = self.guard.admit(0)
        if not ok:
            self.log(f"not parked: {why}")
            self.tell("not_parked", entry, why, size)
            return False
        entry.last_used = time.monotonic()
        self.entries.append(entry)
        self.log(f"parked {len(entry.tokens)} tokens in {(time.perf_counter() - t0) * 1e3:.1f} ms "
                 f"(bytes={size}, {len(self.entries)} parked, {self.total_bytes() / MIB:.1f} of "
                 f"{self.cap_bytes / MIB:.0f} MiB)")
        self.tell("parked", entry, nbytes=size)
        return True

    def take(self, tokens: list[int], key: KVKey, make_cache: Callable[[], list]) -> tuple[KVEntry | None, int]:
        """The entry sharing the longest prefix with `tokens` (moved out if `tokens` extends it whole)."""
        best, best_n = longest_prefix(self.entries, key, tokens)
        if best is None:
            return None, 0
        t0 = time.perf_counter()
        if best_n == len(best.tokens):
            self.entries.remove(best)
            best.last_used = time.monotonic()
            self.log(f"restored {best_n} tokens (moved) in {(time.perf_counter() - t0) * 1e3:.1f} ms")
            return best, best_n
        best.last_used = time.monotonic()
        try:
            cache, m, checkpoints = copy_prefix(best, best_n, make_cache)
        except Exception as e:  # noqa: BLE001 - a broken entry must not fail every later request
            self.drop(best, f"its K/V could not be copied ({type(e).__name__}: {str(e)[:120]})")
            return None, 0
        if m < min(MIN_PREFIX_REUSE, best_n):
            return None, 0          # no checkpoint near enough (a wrapped window, a recurrent state)
        entry = KVEntry(best.tokens[:m], cache, key, checkpoints=checkpoints)
        how = "prefix copy" if m == best_n else f"checkpoint at {m} of the {best_n} shared"
        self.log(f"restored {m} of {len(best.tokens)} tokens ({how}) in "
                 f"{(time.perf_counter() - t0) * 1e3:.1f} ms")
        return entry, m

    def drop(self, entry: KVEntry, why: str) -> None:
        """Remove a parked entry that failed when used; the request that wanted it recomputes."""
        if entry in self.entries:
            self.entries.remove(entry)
        self.log(f"dropped a parked conversation of {len(entry.tokens)} tokens: {why}")
        self.tell("dropped", entry, why)

    def take_owned(self, owner: str, key: KVKey, tokens: list[int]) -> tuple[KVEntry | None, int]:
        """Move out `owner`'s own parked entry (same steering): a new branch of a conversation
        replaces its old one in the same slot instead of taking a second one."""
        for e in self.entries:
            if e.owner == owner and e.key == key:
                t0 = time.perf_counter()
                self.entries.remove(e)
                e.last_used = time.monotonic()
                n = common_prefix(e.tokens, tokens)
                how = "(moved)" if n == len(e.tokens) else f"of {len(e.tokens)} (own slot, trimmed)"
                self.log(f"restored {n} tokens {how} in {(time.perf_counter() - t0) * 1e3:.1f} ms")
                return e, n
        return None, 0

    def _evict_one(self, why: str) -> None:
        victim = min(self.entries, key=lambda e: e.last_used)
        if self.on_evict is not None:
            try:
                self.on_evict(victim)
            except Exception as e:  # noqa: BLE001 - the disk tier is an optimisation; eviction goes on
                self.log(f"disk cache: not written ({type(e).__name__}: {str(e)[:120]})")
        self.entries.remove(victim)
        self.log(f"evicted {len(victim.tokens)} tokens ({victim.nbytes() / MIB:.1f} MiB) for {why}")
        self.tell("evicted", victim, why)

    def _evict_until(self, fits: Callable[[], bool], incoming: int = 0) -> None:
        while self.entries and not fits():
            # Say which limit: a full set of slots is not "the cap" (the log once blamed the cap
            # for evictions at 104 of 2048 MiB).
            full = len(self.entries) + incoming > self.slots
            self._evict_one(f"the slot limit ({self.slots} slots)" if full else "the cap")
