"""An mmproj GGUF (llama.cpp's image projector file: `general.architecture = clip`) read into a typed
spec and MLX weights, refused with one line when it cannot serve the loaded text model.

What is checked before any tensor is read: the architecture (clip), a vision encoder, a projector
type Strata runs (engine/vision/towers), the text family that projector feeds (a gemma3 projector
serves a gemma3 text model only) and the output width against the text model's embedding width. The
keys are llama.cpp's (gguf-py's Keys.Clip / Keys.ClipVision), read as clip.cpp reads them; each
tower reads its type's own keys and defaults (`Tower.read_spec`).
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx

from engine.errors import ModelFileError
from engine.model.gguf_file import GGUFFile, open_gguf
from engine.model.quants import UnsupportedTensorType, convert_tensor
from engine.vision import towers
from engine.vision.towers import Tower


@dataclass(frozen=True)
class VisionSpec:
    """The projector's shape and preprocessing, as clip.cpp reads them from the file."""
    projector: str                  # clip.projector_type ("gemma3")
    image_size: int                 # clip.vision.image_size (gemma3: the square an image is letterboxed to)
    patch: int
    width: int                      # the ViT's embedding width
    n_ff: int
    n_layer: int
    n_head: int
    eps: float
    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    pool: int                       # patches a side merged into one token (0: the tower's default)
    text_width: int                 # the projection's output width (the text model's n_embd)
    gelu: bool                      # the MLP's activation: GELU (tanh form); else quick-GELU

    @property
    def side(self) -> int:
        return self.image_size // self.patch

    @property
    def max_patches(self) -> int:
        """The most patches one image takes (fixed-size towers: the square's)."""
        return self.side * self.side

    @property
    def tower(self) -> Tower:
        return towers.find(self.projector)


@dataclass
class Projector:
    """A loaded mmproj: its spec, its weights by GGUF name (MLX arrays) and its size in bytes."""
    path: Path
    spec: VisionSpec
    weights: dict[str, mx.array]
    nbytes: int


def _key(g: GGUFFile, key: str, default=None, required: bool = True):
    v = g.get(key, None)
    if v is None:
        if required and default is None:
            raise ModelFileError(f"{g.path.name}: the projector has no '{key}'")
        return default
    return v


class ImageBudgetError(ModelFileError):
    """An image token budget the projector type cannot take (refused even for a projector found beside
    the model: the setting is wrong, not the file)."""


def with_budget(spec: VisionSpec, max_tokens: int) -> VisionSpec:
    """The spec whose images take at most `max_tokens` tokens (0: the type's default). A fixed-size
    type (gemma3: every image 256 tokens) has nothing to set and is left as it is; a budget outside
    the type's range (llama.cpp's limits) is refused, naming the range."""
    tower = spec.tower
    if not max_tokens or tower.token_range is None:
        return spec
    lo, hi = tower.token_range
    if not lo <= max_tokens <= hi:
        raise ImageBudgetError(f"image max tokens {max_tokens}: a {spec.projector} projector takes {lo}..{hi} "
                               f"tokens an image")
    return tower.with_budget(spec, max_tokens)


def read_spec(g: GGUFFile, text_arch: str, text_width: int, max_tokens: int = 0) -> VisionSpec:
    """The file's VisionSpec (images within `max_tokens` tokens: 0, the type's default), or
    ModelFileError naming why it cannot serve this text model."""
    name = g.path.name
    if g.architecture != "clip":
        raise ModelFileError(f"{name} is not an image projector (general.architecture is "
                             f"'{g.architecture or '?'}', an mmproj file says 'clip')")
    if not bool(g.get("clip.has_vision_encoder", False)):
        raise ModelFileError(f"{name} has no vision encoder (an audio-only projector is not read)")
    ptype = str(g.get("clip.vision.projector_type", None) or g.get("clip.projector_type", "") or "")
    tower = towers.find(ptype)
    if tower is None:
        raise ModelFileError(f"{name}: projector type '{ptype or '?'}' is not supported "
                             f"(Strata runs: {', '.join(sorted(towers.names()))})")
    if text_arch not in tower.text_archs:
        raise ModelFileError(f"{name} is a {ptype} projector; the loaded model is a {text_arch} "
                             f"(it feeds {', '.join(tower.text_archs)})")
    out = int(_key(g, "clip.vision.projection_dim", 0, required=False))
    spec = VisionSpec(
        projector=ptype, image_size=int(_key(g, "clip.vision.image_size")),
        patch=int(_key(g, "clip.vision.patch_size")), width=int(_key(g, "clip.vision.embedding_length")),
        n_ff=int(_key(g, "clip.vision.feed_forward_length")), n_layer=int(_key(g, "clip.vision.block_count")),
        n_head=int(_key(g, "clip.vision.attention.head_count")),
        eps=float(_key(g, "clip.vision.attention.layer_norm_epsilon", 1e-6, required=False)),
        mean=tuple(float(x) for x in _key(g, "clip.vision.image_mean")),
        std=tuple(float(x) for x in _key(g, "clip.vision.image_std")),
        pool=int(_key(g, "clip.vision.projector.scale_factor", 0, required=False)),
        text_width=out, gelu=bool(g.get("clip.use_gelu", False)))
    _check_shape(spec, name)
    return with_budget(tower.read_spec(g, spec), max_tokens)


def _check_shape(spec: VisionSpec, name: str) -> None:
    if not (0 < spec.patch <= spec.image_size <= 8192) or spec.image_size % spec.patch:
        raise ModelFileError(f"{name}: image size {spec.image_size} is not a multiple of the patch {spec.patch}")
    if spec.pool < 0:
        raise ModelFileError(f"{name}: bad clip.vision.projector.scale_factor {spec.pool}")
    if spec.n_head <= 0 or spec.width % spec.n_head or len(spec.mean) != 3 or len(spec.std) != 3:
        raise ModelFileError(f"{name}: bad vision hyperparameters (width {spec.width}, heads {spec.n_head})")


def _dense(t, dtype) -> mx.array:
    m = convert_tensor(t, dtype)
    if not m.quantized:
        return m.weight
    if m.mode != "affine":
        return mx.dequantize(m.weight, m.scales, None, group_size=m.group_size, bits=m.bits,
                             mode=m.mode).astype(dtype)
    return mx.dequantize(m.weight, m.scales, m.biases, group_size=m.group_size, bits=m.bits).astype(dtype)


def load_projector(path: str | os.PathLike, text_arch: str, text_width: int,
                   dtype: mx.Dtype = mx.float32, max_tokens: int = 0) -> Projector:
    """Read and check an mmproj for a text model (`text_arch`, `text_width`); its weights dense in
    `dtype` (a projector is a few hundred MB at most: no quantized matmuls kept); its images within
    `max_tokens` tokens (0: the type's default)."""
    g = open_gguf(path)
    spec = read_spec(g, text_arch, text_width, max_tokens)
    weights: dict[str, mx.array] = {}
    try:
        for t in g.reader.tensors:
            if t.name.startswith(("v.", "mm.")):
                weights[t.name] = _dense(t, dtype)
    except (UnsupportedTensorType, ValueError) as e:
        raise ModelFileError(f"{g.path.name}: {e}") from None
    try:
        width_out = spec.tower.out_width(weights)
    except ModelFileError as e:
        raise ModelFileError(f"{g.path.name}: {e}") from None
    if width_out != text_width:
        raise ModelFileError(f"{g.path.name} projects to width {width_out}; the loaded model's embeddings "
                             f"are {text_width} wide (a projector of another model size)")
    if spec.text_width != width_out:
        spec = dataclasses.replace(spec, text_width=width_out)     # a tower's own spec type kept
    mx.eval(list(weights.values()))
    return Projector(Path(path), spec, weights, sum(int(w.nbytes) for w in weights.values()))


def file_bytes(path: str | os.PathLike) -> int:
    """The projector's size on disk (the memory estimate's share for it, before it loads)."""
    try:
        return Path(path).stat().st_size
    except OSError:
        return 0



@dataclass(frozen=True)
class ProjectorPlan:
    """What a load will do about images, decided from headers before any tensor is read: the file to
    load (None: none), its spec, the bytes it will take, and why a file found beside the model is
    skipped (a named one that cannot serve the model refuses the load instead)."""
    path: Path | None
    spec: VisionSpec | None = None
    bytes: int = 0
    skipped: str | None = None


def activation_bytes(spec: VisionSpec, dtype_bytes: int) -> int:
    """One image through the tower: one head's attention scores (patches^2, float32: the CPU path
    scores a head at a time, engine/vision/vit.attention; a GPU's fused attention holds none) and a few
    patch-by-width buffers, at the largest image the tower takes (`VisionSpec.max_patches`). Every head
    at once would be 16x that: 6.5 GB for Gemma 4's largest image, refusing loads that fit."""
    n = spec.max_patches
    return n * n * 4 + 6 * n * max(spec.width, spec.n_ff) * max(4, dtype_bytes)


def plan(path: Path | None, named: bool, text_arch: str, text_width: int, dtype_bytes: int,
         max_tokens: int = 0) -> ProjectorPlan:
    """The plan for loading `path` beside a text model (arch, width), its images within `max_tokens`
    tokens (0: the type's default); ModelFileError when `named` and it cannot serve the model (or
    the budget is outside the type's range, named or not), a skipped plan when it was only found
    beside it."""
    if path is None:
        return ProjectorPlan(None)
    try:
        g = open_gguf(path)
        spec = read_spec(g, text_arch, text_width, max_tokens)
        if spec.text_width and spec.text_width != text_width:
            raise ModelFileError(f"{g.path.name} projects to width {spec.text_width}; the loaded model's "
                                 f"embeddings are {text_width} wide (a projector of another model size)")
        weights = sum(int(t.n_elements) for t in g.reader.tensors) * dtype_bytes
    except ModelFileError as e:
        if named or isinstance(e, ImageBudgetError):
            raise
        return ProjectorPlan(None, skipped=f"image projector {path.name} beside the model skipped: {e}")
    return ProjectorPlan(path, spec, weights + activation_bytes(spec, dtype_bytes))
