"""Image spans in a token list (plain Python): an image enters a prompt as a run of one negative
pseudo-token id derived from its pixels' digest, as many as the projector's tokens for it.

Because the id is the image's identity, everything that reuses K/V by comparing token lists (live,
parked, the disk tier, Edit's held runs) keys an image by its pixels with no change: the same image at
the same place shares its K/V, a different one (another digest, another id) never does. The ids are
below 0, outside every vocabulary, so no text decodes to them and no sampler produces them. A
collision needs two digests equal in 31 bits (about 1 in 2e9 for a pair of images).

The id also hashes the projector file's identity (`salt`): an image's K/V depends on the projector that
encoded it, so a span written under one mmproj (a parked entry, a disk segment, a session file) is never
reused under another; the text before it still is."""
from __future__ import annotations

import hashlib

ID_SPACE = (1 << 31) - 1


def image_token(digest: str, salt: str = "") -> int:
    """The pseudo-token id of the image whose pixel digest (hex) is `digest`, encoded by the projector
    whose content hash is `salt`: in [-ID_SPACE, -1]."""
    h = hashlib.blake2b(f"{salt}|{digest}".encode(), digest_size=8).digest()
    return -1 - (int.from_bytes(h, "little") % ID_SPACE)


def is_image_token(t: int) -> bool:
    return -ID_SPACE <= t < 0


def has_images(tokens: list[int]) -> bool:
    return bool(tokens) and min(tokens) < 0


def text_only(tokens: list[int]) -> list[int]:
    """`tokens` less their image ids: a repetition penalty's context. An image id is no row of the
    logits, and MLX's gather does not check bounds: a penalty window reaching back into an image (a
    short question after it) read and wrote outside the logits and crashed the engine."""
    return [t for t in tokens if t >= 0] if has_images(tokens) else list(tokens)


def whole_image_start(tokens: list[int], n: int) -> int:
    """`n` (a count of leading tokens to keep) moved back to the start of the image run it would cut:
    an image is fed whole (its tokens attend to each other both ways), never resumed halfway."""
    if 0 < n < len(tokens) and tokens[n] < 0 and tokens[n - 1] == tokens[n]:
        while n > 0 and tokens[n - 1] == tokens[n]:
            n -= 1
    return n


def image_runs(tokens: list[int]) -> list[tuple[int, int]]:
    """(start, end) of each image run in `tokens`."""
    runs, i, n = [], 0, len(tokens)
    while i < n:
        if tokens[i] < 0:
            j = i
            while j < n and tokens[j] == tokens[i]:
                j += 1
            runs.append((i, j))
            i = j
        else:
            i += 1
    return runs


def has_image_parts(messages) -> bool:
    """Whether any message's content is a list with an image part."""
    for m in messages or ():
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, list) and any(isinstance(p, dict) and p.get("type") == "image" for p in content):
            return True
    return False


def text_chars(content) -> int:
    """Characters of a message's text (a list of parts counts its text parts only)."""
    if isinstance(content, list):
        return sum(len(str(p.get("text") or "")) for p in content if isinstance(p, dict) and p.get("type") == "text")
    return len(str(content or ""))


def joined_text(messages: list) -> list:
    """Messages whose list content holds text parts only, each with that text joined into one string (as
    the servers join them): a chat template that does not iterate over parts renders every message."""
    out = []
    for m in messages:
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, list) and content and all(
                isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
            m = {**m, "content": "".join(p["text"] for p in content)}
        out.append(m)
    return out


def image_ref(name: str, nbytes: int, digest: str, tokens: int = 0) -> dict:
    """An image part as a held conversation keeps it (status, the disk tier, session files): its name,
    size, pixel digest and the tokens it takes (0: not known), not its bytes. Sent back in a prompt it
    stands for the image's span, which held K/V (or the feature cache) must then supply."""
    ref = {"type": "image", "name": name, "bytes": nbytes, "digest": digest}
    return {**ref, "tokens": tokens} if tokens else ref


def is_image_ref(part) -> bool:
    return isinstance(part, dict) and part.get("type") == "image" and isinstance(part.get("digest"), str) \
        and "image" not in part


def valid_parts(content) -> bool:
    """Whether a held message's list content is text parts and image references only."""
    return isinstance(content, list) and all(
        isinstance(p, dict) and ((p.get("type") == "text" and isinstance(p.get("text"), str))
                                 or (is_image_ref(p) and isinstance(p.get("name", ""), str)
                                     and isinstance(p.get("bytes", 0), int) and isinstance(p.get("tokens", 0), int)
                                     and len(p["digest"]) <= 128))
        for p in content)


def storable(messages, identify=None) -> list:
    """Messages as a conversation keeps them (status, the disk tier's JSON, session files): an image
    part's bytes replaced by its reference (`image_ref`; `identify(data)` gives the pixel digest and
    the tokens the image takes; the pixels live in the image span and the feature cache)."""
    out = []
    for m in messages or ():
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, list):
            parts = []
            for p in content:
                if isinstance(p, dict) and p.get("type") == "image" and not is_image_ref(p):
                    img = p.get("image")
                    data = getattr(img, "data", b"") or b""
                    digest, n = identify(data) if identify is not None and data else ("", 0)
                    parts.append(image_ref(getattr(img, "name", ""), len(data), digest, n))
                else:
                    parts.append(p)
            m = {**m, "content": parts}
        out.append(m)
    return out


def outside_vocab(tokens, n_vocab: int, span: int = 0) -> int | None:
    """The first bad id of `tokens` (a numpy array or a list), None when there is none: ids are the
    vocabulary's, or image spans' (runs of at most `span` equal negative ids: the most tokens the
    loaded projector makes of an image; 0, no projector, allows none). A restored file's ids are
    checked with it."""
    if len(tokens) == 0:
        return None
    lo, hi = (int(tokens.min()), int(tokens.max())) if hasattr(tokens, "min") else (min(tokens), max(tokens))
    if hi >= n_vocab:
        return hi
    if lo >= 0:
        return None
    if lo < -ID_SPACE or span <= 0:
        return lo
    ids = tokens.tolist() if hasattr(tokens, "tolist") else list(tokens)
    return next((ids[a] for a, b in image_runs(ids) if b - a > span), None)
