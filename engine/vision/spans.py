"""Images in a prompt, on the engine thread: the rendered prompt's image markers become image spans
(engine/text/image_tokens.py), and their projected embeddings are fed in place of token embeddings.

Rendering follows llama.cpp's server with libmtmd: an image part of a message becomes the media
marker in the message's text (text parts joined as they are), the chat template renders the text,
and at each marker the family's image markers wrap the image's tokens (Gemma 3: `<start_of_image>`,
256 image tokens, `<end_of_image>`), each text piece tokenized on its own (BOS before the first only).

Feeding follows llama.cpp's `mtmd_helper_eval_chunks`: an image's tokens go in as one pass whose
tokens see each other both ways (Gemma 3 decodes image chunks non-causally); on sliding-window
layers a query still sees earlier keys only within the window, later ones of the same image always.
The embeddings are not scaled by sqrt(width) as token embeddings are (llama.cpp scales token input only).

`FeatureCache`: the projected embeddings by pixel digest, least recently used first out, bounded by
count and bytes: an image sent again (another turn, another chat) is not encoded again.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import mlx.core as mx
from mlx_lm.models.base import create_attention_mask

from engine.cache import layer_cache
from engine.errors import RequestError
from engine.vision.images import DecodedImage, ImageRefused, decode_image
from engine.vision import preprocess, siglip
from engine.vision.mmproj import Projector
from engine.text.image_tokens import image_runs, image_token, is_image_ref, storable

MEDIA_MARKER = "<__media__>"        # what an image part becomes in the rendered text (libmtmd's marker)
FAMILY_MARKERS = {"gemma3": ("<start_of_image>", "<end_of_image>")}
FEATURE_CACHE_ENTRIES = 32
FEATURE_CACHE_BYTES = 256 << 20


class FeatureCache:
    """Projected image embeddings by image span id (the pixel digest hashed with the projector's:
    engine/text/image_tokens.py), least recently used out first, bounded by entries and bytes; `encodes`
    counts the images encoded (what a hit saves)."""

    def __init__(self, max_entries: int = FEATURE_CACHE_ENTRIES, max_bytes: int = FEATURE_CACHE_BYTES):
        self.max_entries, self.max_bytes = max_entries, max_bytes
        self._items: OrderedDict[int, mx.array] = OrderedDict()
        self.encodes = 0

    def __len__(self) -> int:
        return len(self._items)

    @property
    def nbytes(self) -> int:
        return sum(int(v.nbytes) for v in self._items.values())

    def get(self, key: int) -> mx.array | None:
        v = self._items.get(key)
        if v is not None:
            self._items.move_to_end(key)
        return v

    def put(self, key: int, features: mx.array) -> None:
        self._items[key] = features
        self._items.move_to_end(key)
        while self._items and (len(self._items) > self.max_entries or self.nbytes > self.max_bytes):
            self._items.popitem(last=False)


@dataclass(frozen=True)
class PromptImage:
    """An image of a prompt: its pixel digest, and its pixels when the part carried them (None for a
    reference: `tokens.image_ref`, whose span held K/V or the feature cache must supply)."""
    digest: str
    decoded: DecodedImage | None


@dataclass(frozen=True)
class VisionStats:
    """Status's `vision`: the projector, the images encoded since the load (a cache hit or a reused
    span encodes nothing) and the feature cache's fill."""
    projector: str
    path: str
    tokens_per_image: int
    images_encoded: int
    feature_cache_entries: int
    feature_cache_bytes: int


class Vision:
    """The loaded projector with its feature cache (one per model load; engine thread only). `salt`:
    the projector file's content hash, part of every image span's id (engine/text/image_tokens.py)."""

    def __init__(self, projector: Projector, dtype, salt: str = ""):
        self.projector = projector
        self.dtype = dtype
        self.salt = salt
        self.features = FeatureCache()
        self._pending: OrderedDict[int, DecodedImage] = OrderedDict()   # images of recent prompts, not encoded
        self._decoded: OrderedDict[tuple[int, int], DecodedImage] = OrderedDict()

    @property
    def kind(self) -> str:
        return self.projector.spec.projector

    @property
    def n_tokens(self) -> int:
        return self.projector.spec.n_tokens

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

    def stats(self) -> VisionStats:
        f = self.features
        return VisionStats(self.kind, str(self.projector.path), self.n_tokens, f.encodes, len(f), f.nbytes)

    def storable(self, messages: list) -> list:
        """Messages as a held conversation keeps them: image parts as references with their digest."""
        return storable(messages, lambda data: self.decode(data, "an image part").digest)

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
            return PromptImage(part["digest"], None)
        data = getattr(part.get("image"), "data", None)
        if data is None:
            raise RequestError(f"{where}: an image part needs an ImageInput (or a held image's digest)")
        img = self.decode(data, where)
        return PromptImage(img.digest, img)

    def tokens(self, tok, text: str, images: list[PromptImage], add_bos: bool, tail=None) -> list[int]:
        """The rendered prompt's tokens, each media marker replaced by its image span. `tail(ids,
        piece)`: the ids of the text after the last image given the ids before it (held token ids kept,
        as a text prompt's are), or None to tokenize it."""
        pieces = text.split(MEDIA_MARKER)
        if len(pieces) != len(images) + 1:
            raise RequestError(f"the chat template rendered {len(pieces) - 1} of the {len(images)} images "
                               f"(it drops or repeats message content)")
        begin, end = FAMILY_MARKERS[self.kind]
        ids = tok.encode(pieces[0], add_bos=add_bos)
        for i, (img, piece) in enumerate(zip(images, pieces[1:])):
            t = image_token(img.digest, self.salt)
            if img.decoded is not None:
                self._pending[t] = img.decoded
                self._pending.move_to_end(t)
            ids += tok.encode(begin, add_bos=False) + [t] * self.n_tokens + tok.encode(end, add_bos=False)
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

    def embeddings(self, token: int) -> mx.array:
        """(n_tokens, text width) embeddings of the image behind pseudo-token `token`."""
        img = self._pending.get(token)
        hit = self.features.get(token)
        if hit is not None:
            return hit
        if img is None:
            raise RequestError("an image's K/V and features are no longer held and its part carries no "
                               "pixels: send the image again")
        pixels = mx.array(preprocess.preprocess(img.rgb, self.projector.spec))
        feats = siglip.encode(self.projector, pixels).astype(self.dtype)
        mx.eval(feats)
        self.features.encodes += 1
        self.features.put(token, feats)
        self._pending.pop(token, None)
        return feats

    def feed(self, model, cache, run: list[int], fed: list[int]) -> None:
        """Feed one image run (all its tokens) into `cache`; `fed` takes the run."""
        feed_embeddings(model, cache, self.embeddings(run[0])[None])
        fed.extend(run)

    def read(self, model, cache, tokens: list[int], fed: list[int], prefill_text) -> None:
        """Read a whole token list with image runs into `cache`: text pieces through
        `prefill_text(piece)` (which extends `fed`), each image whole through `feed`."""
        done = 0
        for start, end in image_runs(tokens) + [(len(tokens), len(tokens))]:
            if start > done:
                prefill_text(tokens[done:start])
            if end > start:
                self.feed(model, cache, tokens[start:end], fed)
            done = end


def _both_ways(mask: mx.array, n: int) -> mx.array:
    """A causal (L, keys) mask whose last `n` columns (the pass's own tokens) are opened to later ones."""
    later = mx.triu(mx.ones((n, n), dtype=mx.bool_), k=1)
    own = mask[..., -n:] | later
    return own if mask.shape[-1] == n else mx.concatenate([mask[..., :-n], own], axis=-1)


def feed_embeddings(model, cache, h: mx.array) -> None:
    """Gemma 3's text blocks over (1, L, width) input embeddings, the L tokens seeing each other both
    ways (mlx-lm's gemma3_text layout: every `sliding_window_pattern`-th layer global)."""
    inner = model.model
    n = h.shape[1]
    pattern = inner.sliding_window_pattern
    gmask = _both_ways(create_attention_mask(h, cache[pattern - 1], return_array=True), n)
    smask = None
    if pattern > 1:
        smask = _both_ways(create_attention_mask(h, cache[0], window_size=inner.window_size, return_array=True), n)
    for i, (layer, c) in enumerate(zip(inner.layers, cache)):
        h = layer(h, gmask if i % pattern == pattern - 1 else smask, c)
    mx.eval(layer_cache.arrays(cache))
