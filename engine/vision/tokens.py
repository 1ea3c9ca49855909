"""Image spans in a token list (plain Python): an image enters a prompt as a run of one negative
pseudo-token id derived from its pixels' digest, as many as the projector's tokens for it.

Because the id is the image's identity, everything that reuses K/V by comparing token lists (live,
parked, the disk tier, Edit's held runs) keys an image by its pixels with no change: the same image at
the same place shares its K/V, a different one (another digest, another id) never does. The ids are
below 0, outside every vocabulary, so no text decodes to them and no sampler produces them. A
collision needs two digests equal in 31 bits (about 1 in 2e9 for a pair of images)."""
from __future__ import annotations

ID_SPACE = (1 << 31) - 1


def image_token(digest: str) -> int:
    """The pseudo-token id of the image whose pixel digest (hex) is `digest`: in [-ID_SPACE, -1]."""
    return -1 - (int(digest[:16], 16) % ID_SPACE)


def is_image_token(t: int) -> bool:
    return -ID_SPACE <= t < 0


def has_images(tokens: list[int]) -> bool:
    return bool(tokens) and min(tokens) < 0


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


def storable(messages) -> list:
    """Messages as a conversation keeps them (status, the disk tier's JSON): an image part's bytes
    replaced by its file name and size (the pixels live in the image span and the feature cache)."""
    out = []
    for m in messages or ():
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, list):
            parts = []
            for p in content:
                if isinstance(p, dict) and p.get("type") == "image":
                    img = p.get("image")
                    data = getattr(img, "data", b"") or b""
                    parts.append({"type": "image", "name": getattr(img, "name", ""), "bytes": len(data)})
                else:
                    parts.append(p)
            m = {**m, "content": parts}
        out.append(m)
    return out
