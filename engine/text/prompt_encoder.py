"""A conversation's prompt tokenized in O(its new text), not O(its whole history).

Why: every turn renders the whole conversation and tokenizes it again (the prompt, and for models
with checkpoints the history's message ends: prompts.message_marks), so a turn's host work grew
with the history: at 8,000 tokens ~80 ms on this CPU box, ~44 ms on the H200's host, a fifth of a
parked turn's time to first token there (bench/turns.py, bench/gpu.md).

How: the `tokenizers` library splits its input at special tokens before anything else (normalizer,
pre-tokenizer and model see only the text between two of them), so the ids of a text up to the start
of a special token do not depend on what follows it. The encoder keeps the last few texts it
tokenized with the positions of their special tokens; a new text that shares a prefix with one of
them reuses its ids up to the last special token inside the shared part and tokenizes only the rest.
Chat templates put a special token at every message boundary, so only the new messages are read.

Only special tokens that match exactly (no lstrip/rstrip, not normalized, not single-word) are cut
at, and the property is checked on probe strings when the encoder is made: a tokenizer that breaks it
is tokenized whole, as before (tests/engine/test_prompt_encoder.py runs every factory vocabulary).
"""
from __future__ import annotations

from array import array
from bisect import bisect_right
from collections import OrderedDict

KEEP = 16                # texts remembered: a few conversations' prompts and their message ends


def shared_chars(a: str, b: str) -> int:
    """Length of the common prefix of two strings (slices compare in C)."""
    lo, hi = 0, min(len(a), len(b))
    if a[:hi] == b[:hi]:
        return hi
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


class _Held:
    __slots__ = ("ids", "pos", "idx")

    def __init__(self, ids: array, pos: list[int], idx: list[int]):
        # the text's ids (no BOS), packed: 4 bytes an id where a list takes 8 and more (tests/engine/
        # test_prompt_encoder.py measures the whole encoder at 4.5 bytes a held token, 10.2 with lists)
        self.ids = ids
        self.pos = pos          # character positions where a cut special token starts (ascending)
        self.idx = idx          # the index of that token in ids


class PromptEncoder:
    def __init__(self, backend):
        self.backend = backend
        self.held: OrderedDict[str, _Held] = OrderedDict()
        self.cut_ids = _exact_specials(backend)
        if self.cut_ids and not _splits_exactly(backend, self.cut_ids):
            self.cut_ids = frozenset()
        self.reused = 0         # tokens taken from a held text instead of tokenized (tests read it)

    def encode(self, text: str) -> list[int]:
        """The ids of `text` (no BOS added), equal to backend.encode(text, add_special_tokens=False).ids."""
        if not self.cut_ids:
            return self.backend.encode(text, add_special_tokens=False).ids
        best_idx, best = 0, None
        for t, h in self.held.items():
            j = bisect_right(h.pos, shared_chars(t, text)) - 1
            if j >= 0 and h.idx[j] > best_idx:
                best_idx, best = h.idx[j], (h, j)
        if best is None:
            tail, pos, idx = self._encode(text, 0, 0)
            ids = array("i", tail)
        else:
            h, j = best
            cut = h.pos[j]
            tail, tpos, tidx = self._encode(text[cut:], cut, h.idx[j])
            ids = h.ids[:h.idx[j]]
            ids.extend(tail)
            pos, idx = h.pos[:j] + tpos, h.idx[:j] + tidx
            self.reused += h.idx[j]
        self.held[text] = _Held(ids, pos, idx)
        self.held.move_to_end(text)
        while len(self.held) > KEEP:
            self.held.popitem(last=False)
        return ids.tolist()

    def _encode(self, text: str, at: int, first: int) -> tuple[list[int], list[int], list[int]]:
        enc = self.backend.encode(text, add_special_tokens=False)
        ids = enc.ids
        cuts = [(enc.offsets[i][0] + at, i + first) for i, t in enumerate(ids) if t in self.cut_ids]
        return ids, [c[0] for c in cuts], [c[1] for c in cuts]


def _exact_specials(backend) -> frozenset[int]:
    out = set()
    for i, t in backend.get_added_tokens_decoder().items():
        if t.special and not (t.lstrip or t.rstrip or t.normalized or t.single_word) and t.content:
            out.add(i)
    return frozenset(out)


def _splits_exactly(backend, cut_ids: frozenset[int]) -> bool:
    """encode(a + s + b) == encode(a) + encode(s + b) for special tokens s and texts around them that
    stress the usual merges (spaces, newlines, multi-byte characters, digits next to the cut)."""
    specials = [backend.id_to_token(i) for i in sorted(cut_ids)][:4]
    around = ["Hello world", " ", "\n\n", "é中 ", "12 3", "", "  x"]
    for s in specials:
        for a in around:
            for b in around:
                whole = backend.encode(a + s + b, add_special_tokens=False).ids
                parts = backend.encode(a, add_special_tokens=False).ids + \
                    backend.encode(s + b, add_special_tokens=False).ids
                if whole != parts:
                    return False
    return True
