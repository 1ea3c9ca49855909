"""Images in a prompt, on the engine thread: the rendered prompt's image markers become image spans
(engine/text/image_tokens.py), and their projected embeddings are fed in place of token embeddings.

Rendering follows llama.cpp's server with libmtmd: an image part of a message becomes the media
marker in the message's text (text parts joined as they are), the chat template renders the text,
and at each marker the family's image markers (`Tower.markers`; Gemma 3: `<start_of_image>` ...
`<end_of_image>`) wrap the image's tokens, as many as the tower makes of that image, each text piece
tokenized on its own (BOS before the first only). Feeding is the tower's (`Tower.feed`): an image's
tokens go in as one pass, as llama.cpp's `mtmd_helper_eval_chunks` feeds them.

`FeatureCache`: the encoded images by span id, least recently used first out, bounded by count and
bytes: an image sent again (another turn, another chat) is not encoded again.
"""
from __future__ import annotations

from collections import OrderedDict
from contextlib import nullcontext
from dataclasses import dataclass

import mlx.core as mx

from engine.errors import RequestError
from engine.vision.images import DecodedImage, ImageRefused, decode_image
from engine.vision.mmproj import Projector
from engine.vision.towers import ImageFeatures, PreparedImage
from engine.text.image_tokens import image_runs, image_token, is_image_ref, storable

MEDIA_MARKER = "<__media__>"        # what an image part becomes in the rendered text (libmtmd's marker)
FEATURE_CACHE_ENTRIES = 32
FEATURE_CACHE_BYTES = 256 << 20
IDENTITIES = 1024                   # image parts' bytes remembered (a digest, a count and a grid each)


class FeatureCache:
    """Encoded images by image span id (the pixel digest hashed with the projector's:
    engine/text/image_tokens.py), least recently used out first, bounded by entries and bytes; `encodes`
    counts the images encoded (what a hit saves)."""

    def __init__(self, max_entries: int = FEATURE_CACHE_ENTRIES, max_bytes: int = FEATURE_CACHE_BYTES):
        self.max_entries, self.max_bytes = max_entries, max_bytes
        self._items: OrderedDict[int, ImageFeatures] = OrderedDict()
        self.encodes = 0

    def __len__(self) -> int:
        return len(self._items)

    @property
    def nbytes(self) -> int:
        return sum(v.nbytes for v in self._items.values())

    def get(self, key: int) -> ImageFeatures | None:
        v = self._items.get(key)
        if v is not None:
            self._items.move_to_end(key)
        return v

    def put(self, key: int, features: ImageFeatures) -> None:
        self._items[key] = features
        self._items.move_to_end(key)
        while self._items and (len(self._items) > self.max_entries or self.nbytes > self.max_bytes):
            self._items.popitem(last=False)


@dataclass(frozen=True)
class Unprepared:
    """An image part's bytes whose pixels are prepared only if the image must be encoded: a history's
    image is usually fed from held K/V or the feature cache, and preparing it (decode, resize,
    normalise) on every turn made a six-photo chat's follow-up 5-6x slower than a text one's."""
    data: bytes
    where: str


@dataclass(frozen=True)
class Identity:
    """What an image part's bytes come to: its pixel digest, the tokens and the patch grid it takes."""
    digest: str
    n_tokens: int
    grid: tuple[int, int]


@dataclass(frozen=True)
class PromptImage:
    """An image of a prompt: its pixel digest, its pixels prepared for the tower, or its bytes to prepare
    when needed (`Unprepared`), when the part carried them (None for a reference:
    `image_tokens.image_ref`, whose span held K/V or the feature cache must supply), the tokens it takes
    (a reference says; 0: it does not) and its grid (None: a reference)."""
    digest: str
    prepared: PreparedImage | Unprepared | None
    n_tokens: int
    grid: tuple[int, int] | None = None


@dataclass(frozen=True)
class VisionStats:
    """Status's `vision`: the projector, the most tokens an image takes, the images encoded since the
    load (a cache hit or a reused span encodes nothing), the feature cache's fill and the image parts
    decoded and prepared since the load (a part seen before is not, unless it must be encoded)."""
    projector: str
    path: str
    tokens_per_image: int
    images_encoded: int
    feature_cache_entries: int
    feature_cache_bytes: int
    images_prepared: int


class Vision:
    """The loaded projector with its feature cache (one per model load; engine thread only). `salt`:
    the projector file's content hash, part of every image span's id (engine/text/image_tokens.py)."""

    def __init__(self, projector: Projector, dtype, salt: str = ""):
        self.projector = projector
        self.dtype = dtype
        self.salt = salt
        self.tower = projector.spec.tower
        self.features = FeatureCache()
        # images of recent prompts, not encoded: pixels prepared, or a seen part's bytes to prepare if needed
        self._pending: OrderedDict[int, PreparedImage | Unprepared] = OrderedDict()
        self._decoded: OrderedDict[tuple[int, int], DecodedImage] = OrderedDict()
        self._prepared: OrderedDict[str, PreparedImage] = OrderedDict()
        # an image part's bytes (their hash) -> what they came to: a part seen before is not decoded again
        self._identities: OrderedDict[tuple[int, int], Identity] = OrderedDict()
        self.prepares = 0
        # image span id -> the text positions it takes (towers with `n_pos`: its grid is not in the ids)
        self._n_pos: OrderedDict[int, int] = OrderedDict()

    @property
    def kind(self) -> str:
        return self.projector.spec.projector

    @property
    def max_tokens(self) -> int:
        """The most tokens one image takes (a restored span longer than this is refused)."""
        return self.tower.max_tokens(self.projector.spec)

    def decode(self, data: bytes, where: str) -> DecodedImage:
        """An image part's bytes decoded (kept for the few next calls: a request renders its prompt
        more than once); a refusal is a RequestError naming the part."""
        key = (len(data), hash(bytes(data)))
        hit = self._decoded.get(key)
        if hit is not None:
            return hit
        try:
            img = decode_image(data)
        except ImageRefused as e:
            raise RequestError(f"{where}: {e}") from None
        self._decoded[key] = img
        while len(self._decoded) > 4:
            self._decoded.popitem(last=False)
        return img

    def prepare(self, img: DecodedImage) -> PreparedImage:
        """The image as the tower reads it (kept for the few next calls, as `decode`)."""
        hit = self._prepared.get(img.digest)
        if hit is None:
            hit = self._prepared[img.digest] = self.tower.prepare(img.rgb, self.projector.spec)
            while len(self._prepared) > 4:
                self._prepared.popitem(last=False)
        return hit

    def stats(self) -> VisionStats:
        f = self.features
        return VisionStats(self.kind, str(self.projector.path), self.max_tokens, f.encodes, len(f), f.nbytes,
                           self.prepares)

    def storable(self, messages: list) -> list:
        """Messages as a held conversation keeps them: image parts as references with their digest
        and the tokens they take (and, for a tower whose text positions follow the grid, `grid`:
        [rows, cols], so a reference sent back places the text after it without the pixels)."""
        grids: dict[str, tuple[int, int]] = {}

        def identify(data: bytes) -> tuple[str, int]:
            known = self.identify(data, "an image part")
            grids[known.digest] = known.grid
            return known.digest, known.n_tokens
        out = storable(messages, identify)
        return _with_grids(out, grids) if self.tower.n_pos is not None else out

    def flatten(self, messages: list[dict]) -> tuple[list[dict], list[PromptImage]]:
        """Messages with each list content made text (images as the media marker) and the images in order."""
        out, images = [], []
        for i, m in enumerate(messages):
            content = m.get("content") if isinstance(m, dict) else None
            if not isinstance(content, list):
                out.append(m)
                continue
            text = []
            for j, part in enumerate(content):
                kind = part.get("type") if isinstance(part, dict) else None
                if kind == "text":
                    text.append(str(part.get("text") or ""))
                elif kind == "image":
                    images.append(self._image_of(part, f"messages[{i}].content[{j}]"))
                    text.append(MEDIA_MARKER)
                else:
                    raise RequestError(f"messages[{i}].content[{j}]: unknown part type {kind!r}")
            out.append({**m, "content": "".join(text)})
        return out, images

    def _image_of(self, part: dict, where: str) -> PromptImage:
        if is_image_ref(part):
            grid = part.get("grid")
            if isinstance(grid, list) and len(grid) == 2 and all(isinstance(x, int) and x > 0 for x in grid):
                self._note_grid(image_token(part["digest"], self.salt), (grid[0], grid[1]))
            return PromptImage(part["digest"], None, int(part.get("tokens") or 0))
        data = getattr(part.get("image"), "data", None)
        if data is None:
            raise RequestError(f"{where}: an image part needs an ImageInput (or a held image's digest)")
        known, prepared = self._identity(data, where)
        return PromptImage(known.digest, prepared or Unprepared(bytes(data), where), known.n_tokens, known.grid)

    def identify(self, data: bytes, where: str) -> Identity:
        """What an image part's bytes come to (decoded and prepared the first time they are seen)."""
        return self._identity(data, where)[0]

    def _identity(self, data: bytes, where: str) -> tuple[Identity, PreparedImage | None]:
        """The part's identity, and its prepared pixels when it had to be prepared for that (first seen)."""
        # Python's hash of a bytes object (SipHash, keyed per process) is kept in the object: a request
        # renders its prompt more than once, and each sighting of the same bytes costs nothing again
        data = bytes(data)
        key = (len(data), hash(data))
        known = self._identities.get(key)
        if known is not None:
            self._identities.move_to_end(key)
            return known, None
        prepared, digest = self._prepare_part(data, where)
        known = self._identities[key] = Identity(digest, prepared.n_tokens, prepared.grid)
        while len(self._identities) > IDENTITIES:
            self._identities.popitem(last=False)
        return known, prepared

    def _prepare_part(self, data: bytes, where: str) -> tuple[PreparedImage, str]:
        """The part's pixels as the tower reads them, and their digest."""
        img = self.decode(data, where)
        self.prepares += 1
        try:
            return self.prepare(img), img.digest
        except RequestError as e:       # a tower's refusal of the image (a strip too thin for its tokens)
            raise RequestError(f"{where}: {e}") from None

    def _span_length(self, img: PromptImage, token: int) -> int:
        """Tokens the image takes: its own count, else (a reference that does not say) its cached
        features', else the most an image takes."""
        if img.n_tokens:
            return img.n_tokens
        hit = self.features.get(token)
        return int(hit.embeddings.shape[0]) if hit is not None else self.max_tokens

    def tokens(self, tok, text: str, images: list[PromptImage], add_bos: bool, tail=None) -> list[int]:
        """The rendered prompt's tokens, each media marker replaced by its image span. `tail(ids,
        piece)`: the ids of the text after the last image given the ids before it (held token ids kept,
        as a text prompt's are), or None to tokenize it."""
        pieces = text.split(MEDIA_MARKER)
        if len(pieces) != len(images) + 1:
            raise RequestError(f"the chat template rendered {len(pieces) - 1} of the {len(images)} images "
                               f"(it drops or repeats message content)")
        begin, end = self.tower.markers
        ids = tok.encode(pieces[0], add_bos=add_bos)
        for i, (img, piece) in enumerate(zip(images, pieces[1:])):
            t = image_token(img.digest, self.salt)
            if img.prepared is not None:
                if not (isinstance(img.prepared, Unprepared) and isinstance(self._pending.get(t), PreparedImage)):
                    self._pending[t] = img.prepared
                self._pending.move_to_end(t)
                self._note_grid(t, img.grid)
            ids += tok.encode(begin, add_bos=False) + [t] * self._span_length(img, t) + tok.encode(end, add_bos=False)
            last = i == len(images) - 1 and tail is not None
            ids += (tail(ids, piece) if last else None) or tok.encode(piece, add_bos=False)
        while len(self._pending) > max(8, len(images)):     # this prompt's images always stay
            self._pending.popitem(last=False)
        return ids

    def check_available(self, tokens: list[int]) -> None:
        """RequestError unless every image span in `tokens` can be fed: its pixels came with the
        prompt, or its features are cached (an image reference whose K/V is no longer held needs one)."""
        for start, _ in image_runs(tokens):
            t = tokens[start]
            if t not in self._pending and self.features.get(t) is None:
                raise RequestError("an image's K/V and features are no longer held and its part carries no "
                                   "pixels: send the image again")

    def hold(self, tokens: list[int]) -> dict[int, ImageFeatures | PreparedImage | Unprepared]:
        """What feeding each image span of `tokens` needs (its features when encoded, else its prepared
        pixels), for a caller that feeds it later: a batch row reads its prompt after other prompts
        were rendered and images encoded, which may push it out of the bounded caches here."""
        held = {}
        for start, _ in image_runs(tokens):
            t = tokens[start]
            got = self.features.get(t)
            got = got if got is not None else self._pending.get(t)
            if got is not None:
                held[t] = got
        return held

    def embeddings(self, token: int, held: ImageFeatures | PreparedImage | Unprepared | None = None) -> ImageFeatures:
        """The encoded image behind pseudo-token `token`: (n_tokens, text width) embeddings. `held`: what
        `hold` gave for it (the cached features win over held pixels: encoded once)."""
        if isinstance(held, ImageFeatures):
            return held
        prepared = held if held is not None else self._pending.get(token)
        hit = self.features.get(token)
        if hit is not None:
            self._note_grid(token, hit.grid)
            return hit
        if prepared is None:
            raise RequestError("an image's K/V and features are no longer held and its part carries no "
                               "pixels: send the image again")
        if isinstance(prepared, Unprepared):
            prepared = self._prepare_part(prepared.data, prepared.where)[0]
        emb = self.tower.encode(self.projector, prepared).astype(self.dtype)
        mx.eval(emb)
        feats = ImageFeatures(emb, prepared.grid)
        self.features.encodes += 1
        self.features.put(token, feats)
        self._pending.pop(token, None)
        return feats

    def feed(self, model, cache, run: list[int], fed: list[int], held=None) -> None:
        """Feed one image run (all its tokens) into `cache`; `fed` takes the run. `held`: `hold`'s entry
        for it, if the caller kept one."""
        feats = self.embeddings(run[0], held)
        if feats.embeddings.shape[0] != len(run):
            raise RequestError(f"an image span of {len(run)} tokens holds an image of {feats.embeddings.shape[0]}: "
                               f"send the image again")
        self.tower.feed(model, cache, feats)
        fed.extend(run)

    def read(self, model, cache, tokens: list[int], fed: list[int], prefill_text) -> None:
        """Read a whole token list with image runs into `cache`: text pieces through
        `prefill_text(piece)` (which extends `fed`), each image whole through `feed`."""
        done = 0
        with self.text_positions(model, fed):
            for start, end in image_runs(tokens) + [(len(tokens), len(tokens))]:
                if start > done:
                    prefill_text(tokens[done:start])
                if end > start:
                    self.feed(model, cache, tokens[start:end], fed)
                done = end

    def _note_grid(self, token: int, grid: tuple[int, int]) -> None:
        if self.tower.n_pos is not None:
            self._n_pos[token] = self.tower.n_pos(grid)
            self._n_pos.move_to_end(token)
            while len(self._n_pos) > 4096:
                self._n_pos.popitem(last=False)

    def shift(self, fed: list[int]) -> int:
        """The text positions the images in `fed` (a cache's tokens) took less than their tokens (0 for a
        tower whose images take as many positions as tokens). RequestError when an image's grid is not
        known (a reference whose pixels and features are both gone)."""
        if self.tower.n_pos is None:
            return 0
        total = 0
        for a, b in image_runs(fed):
            n = self._n_pos.get(fed[a])
            if n is None:
                hit = self.features.get(fed[a])
                if hit is None:
                    raise RequestError("an image's size is no longer known (its pixels and features are gone), and "
                                       "the text after it is placed by it: send the image again")
                self._note_grid(fed[a], hit.grid)
                n = self._n_pos[fed[a]]
            total += n - (b - a)
        return total

    def text_positions(self, model, fed: list[int]):
        """The text model's positions for one turn of a conversation whose cache holds `fed`: the
        tower's (`Tower.positions`, shifted past the images already in it), or nothing to change."""
        if self.tower.positions is None:
            return nullcontext()
        return self.tower.positions(model, self.shift(fed))


def _with_grids(messages: list, grids: dict[str, tuple[int, int]]) -> list:
    """`messages` with each image reference whose digest `grids` knows given its `grid` [rows, cols]."""
    out = []
    for m in messages:
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, list):
            m = {**m, "content": [{**p, "grid": list(grids[p["digest"]])}
                                  if is_image_ref(p) and p.get("digest") in grids and "grid" not in p else p
                                  for p in content]}
        out.append(m)
    return out
