"""Projector types (an mmproj's `clip.projector_type`): one module per type under engine/vision/towers/,
each exposing a `TOWER` (a `Tower`). engine/vision/mmproj.py and spans.py ask `find(type)`; nothing
else branches on a projector type. A module is imported only when a file of its type is read.

A tower is everything that differs between projector types: the spec keys it reads, how an image
becomes the pixels it reads and how many tokens it gives (llama.cpp's libmtmd preprocessing for that
type), the encoder itself, the text markers around an image's tokens, and how the image's embeddings
are fed into the text model (which tokens see which, the positions they take)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import mlx.core as mx
import numpy as np

from engine import lazy_table

# engine/vision/mmproj.py's VisionSpec and Projector, and an open GGUF file: named here, not imported
# (mmproj imports this module to find a type's tower; the types would make a circle of the two)
VisionSpec = Projector = GGUFFile = Any

# clip.projector_type -> module under engine/vision/towers/ (add a line per type)
_MODULES: dict[str, str] = {"gemma3": "gemma3", "gemma4v": "gemma4v", "pixtral": "pixtral", "qwen3vl_merger": "qwen3vl"}


@dataclass(frozen=True)
class PreparedImage:
    """An image as a tower reads it: its pixels (float32, normalised, (H, W, 3)), the grid of patches
    the encoder sees (rows, cols) and the tokens it becomes in the prompt."""
    pixels: np.ndarray
    grid: tuple[int, int]
    n_tokens: int


@dataclass(frozen=True)
class ImageFeatures:
    """An encoded image: its embeddings (n_tokens, text width) and the patch grid they came from
    (what a tower that positions image tokens in 2-D needs again when it feeds them)."""
    embeddings: mx.array
    grid: tuple[int, int]

    @property
    def nbytes(self) -> int:
        return int(self.embeddings.nbytes)


@dataclass(frozen=True)
class Tower:
    """What Strata needs to know about one projector type.

    text_archs: the text architectures (GGUF general.architecture) its embeddings feed.
    markers: the text around an image's tokens in the prompt (libmtmd's, for the family).
    read_spec(g, base) -> the spec with the type's own keys and defaults read, checked (ModelFileError).
    out_width(weights) -> the width the projection outputs (the text model's embedding width).
    prepare(rgb, spec) -> PreparedImage: libmtmd's preprocessing for the type, pixel for pixel.
    encode(projector, prepared) -> (n_tokens, text width) embeddings.
    feed(model, cache, features): the text model reads the image's embeddings into `cache`.
    max_tokens(spec) -> the most tokens one image can take (a restored span longer than it is refused).
    token_range: (fewest, most) tokens an image may be given as its budget (llama.cpp's limits for the
        type: `--image-max-tokens` within them), None for a fixed-size tower (every image the same).
    with_budget(spec, n) -> the spec whose images take at most `n` tokens (n within token_range).
    n_pos(grid) -> the text positions an image of that token grid takes, where a family's text goes on
        after an image from other than its token count (Qwen's M-RoPE: max(rows, cols)); None: as many
        as its tokens.
    positions(model, shift) -> a context manager: the text model's positions shifted by `shift` (the
        positions the conversation's images so far took less than their tokens) for one turn; `feed`
        moves the shift on. Set with n_pos.
    """
    name: str
    text_archs: tuple[str, ...]
    markers: tuple[str, str]
    read_spec: Callable[[GGUFFile, VisionSpec], VisionSpec]
    out_width: Callable[[dict], int]
    prepare: Callable[[np.ndarray, VisionSpec], PreparedImage]
    encode: Callable[[Projector, PreparedImage], mx.array]
    feed: Callable[[object, list, ImageFeatures], None]
    max_tokens: Callable[[VisionSpec], int]
    n_pos: Callable[[tuple[int, int]], int] | None = None
    positions: Callable[[object, int], object] | None = None
    token_range: tuple[int, int] | None = None
    with_budget: Callable[[VisionSpec, int], VisionSpec] | None = None


def names() -> tuple[str, ...]:
    return tuple(_MODULES)


def find(projector_type: str | None) -> Tower | None:
    return lazy_table.entry(__name__, _MODULES, projector_type, "TOWER")
