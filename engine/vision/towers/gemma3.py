"""The gemma3 projector (SigLIP ViT + Gemma 3's multimodal projector), computing what clip.cpp's
`clip_graph_siglip` computes:

  patch conv (with bias) -> + learned positions -> pre-LN blocks (engine/vision/vit.py) ->
  post-LayerNorm -> 2-D average pool (pool x pool patches) -> RMSNorm (soft_emb_norm) -> @ input_projection

Preprocessing is libmtmd's fixed-size one (engine/vision/preprocess.py's letterbox): every image is
`clip.vision.image_size` square and takes (side / pool)^2 tokens (256 for Gemma 3), between
`<start_of_image>` and `<end_of_image>`, its tokens seeing each other both ways.
"""
from __future__ import annotations

import dataclasses

import mlx.core as mx
import numpy as np

from engine.errors import ModelFileError
from engine.vision import vit
from engine.vision.feed import feed_gemma3
from engine.vision.preprocess import letterbox, normalize
from engine.vision.towers import ImageFeatures, PreparedImage, Tower

DEFAULT_POOL = 4        # clip.cpp's when `clip.vision.projector.scale_factor` is absent (Gemma 3's own)


def read_spec(g, spec):
    spec = dataclasses.replace(spec, pool=spec.pool or DEFAULT_POOL)
    if spec.side % spec.pool:
        raise ModelFileError(f"{g.path.name}: {spec.side} patches a side do not pool by {spec.pool}")
    return spec


def n_tokens(spec) -> int:
    return (spec.side // spec.pool) ** 2


def prepare(rgb: np.ndarray, spec) -> PreparedImage:
    side = spec.side // spec.pool
    return PreparedImage(normalize(letterbox(rgb, spec.image_size), spec), (side, side), n_tokens(spec))


def encode(proj, prepared: PreparedImage) -> mx.array:
    """The prepared image -> (n_tokens, text_width) embeddings."""
    s, w = proj.spec, proj.weights
    x = vit.patch_embed(mx.array(prepared.pixels).astype(w["v.patch_embd.weight"].dtype), w, s.patch)
    x = x + w["v.position_embd.weight"]
    act = vit.gelu(s.gelu)
    for i in range(s.n_layer):
        x = vit.block(x, w, i, s.n_head, s.eps, act)
    x = vit.layer_norm(x, w, "v.post_ln", s.eps)
    side, k = s.side, s.pool
    x = x.reshape(side // k, k, side // k, k, s.width).mean(axis=(1, 3)).reshape(-1, s.width)
    x = mx.fast.rms_norm(x, w["mm.soft_emb_norm.weight"], s.eps)
    return vit.matmul(x, w["mm.input_projection.weight"])


def feed(model, cache, features: ImageFeatures) -> None:
    feed_gemma3(model, cache, features.embeddings[None])


def out_width(weights: dict) -> int:
    proj = weights.get("mm.input_projection.weight")
    if proj is None:
        raise ModelFileError("the projector has no mm.input_projection.weight")
    return int(proj.shape[-1])


TOWER = Tower(name="gemma3", text_archs=("gemma3",), markers=("<start_of_image>", "<end_of_image>"),
              read_spec=read_spec, out_width=out_width, prepare=prepare, encode=encode, feed=feed,
              max_tokens=n_tokens)
