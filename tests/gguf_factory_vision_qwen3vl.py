"""Tiny, real qwen3vl_merger mmproj GGUFs (the Qwen3-VL / Qwen3.5 / Qwen3.6 image projector), laid out
as llama.cpp's converter (convert_hf_to_gguf.py, Qwen3VLVisionModel) writes them.

``write_qwen3vl_mmproj``: ``general.architecture = clip``, ``clip.projector_type = qwen3vl_merger``:
the checkpoint's 3-D patch conv split into its two frames (``v.patch_embd.weight`` and
``v.patch_embd.weight.1``, numpy (width, 3, patch, patch)), ``v.patch_embd.bias``, the learned
position table ``v.position_embd.weight`` (side^2 rows, side = image_size / patch), pre-LN blocks with
a fused, biased ``attn_qkv`` and a GELU MLP, ``v.post_ln``, the merger ``mm.0`` (4 width -> 4 width)
and ``mm.2`` (4 width -> text width), optionally DeepStack mergers ``v.deepstack.N.{norm,fc1,fc2}``.
Keys as gguf-py's Keys.ClipVision, ``clip.vision.spatial_merge_size`` = 2, ``clip.use_gelu``.

``write_qwen3vl_vision_pair``: the tiny Qwen3.5 text model (tests/gguf_factory_qwen35.py, its
vocabulary holding ``<|vision_start|>``/``<|vision_end|>``) and an mmproj of its width.

Sizes: 4-pixel patches merged 2x2, so a token is an 8 x 8 pixel block; the default position table
is 8 x 8 patches (a 32-pixel image takes it as it is, others resize it).
"""
from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

import gguf_factory_qwen35

MEAN = (0.5, 0.5, 0.5)          # Qwen-VL's normalisation
STD = (0.5, 0.5, 0.5)


def qwen3vl_tensors(rng: np.random.Generator, *, n_embd: int, n_ff: int, n_layer: int, patch: int, side: int,
                    n_text: int, deepstack: tuple[int, ...]) -> dict[str, np.ndarray]:
    """The projector's tensors by GGUF name (numpy shapes as gguf-py writes them)."""
    def normal(shape, std):
        return (rng.standard_normal(shape, dtype=np.float32) * np.float32(std)).astype(np.float32)

    def norm(n):
        return (1.0 + normal((n,), 0.1)).astype(np.float32), normal((n,), 0.05)

    conv_std = 1.0 / np.sqrt(2 * 3 * patch * patch)
    t = {"v.patch_embd.weight": normal((n_embd, 3, patch, patch), conv_std),
         "v.patch_embd.weight.1": normal((n_embd, 3, patch, patch), conv_std),
         "v.patch_embd.bias": normal((n_embd,), 0.1),
         "v.position_embd.weight": normal((side * side, n_embd), 0.5)}
    for i in range(n_layer):
        p = f"v.blk.{i}."
        t[p + "attn_qkv.weight"] = normal((3 * n_embd, n_embd), 1.0 / np.sqrt(n_embd))
        t[p + "attn_qkv.bias"] = normal((3 * n_embd,), 0.05)
        t[p + "attn_out.weight"] = normal((n_embd, n_embd), 1.0 / np.sqrt(n_embd))
        t[p + "attn_out.bias"] = normal((n_embd,), 0.05)
        t[p + "ln1.weight"], t[p + "ln1.bias"] = norm(n_embd)
        t[p + "ln2.weight"], t[p + "ln2.bias"] = norm(n_embd)
        t[p + "ffn_up.weight"] = normal((n_ff, n_embd), 1.0 / np.sqrt(n_embd))
        t[p + "ffn_up.bias"] = normal((n_ff,), 0.05)
        t[p + "ffn_down.weight"] = normal((n_embd, n_ff), 1.0 / np.sqrt(n_ff))
        t[p + "ffn_down.bias"] = normal((n_embd,), 0.05)
    t["v.post_ln.weight"], t["v.post_ln.bias"] = norm(n_embd)
    wide = 4 * n_embd

    def merger(prefix_in: str, prefix_out: str):
        t[prefix_in + ".weight"] = normal((wide, wide), 1.0 / np.sqrt(wide))
        t[prefix_in + ".bias"] = normal((wide,), 0.05)
        # projected rows near the text embeddings' scale (the text model reads them unscaled)
        t[prefix_out + ".weight"] = normal((n_text, wide), 2.0 / np.sqrt(wide))
        t[prefix_out + ".bias"] = normal((n_text,), 0.05)

    merger("mm.0", "mm.2")
    for i in deepstack:
        p = f"v.deepstack.{i}."
        t[p + "norm.weight"], t[p + "norm.bias"] = norm(wide)
        merger(p + "fc1", p + "fc2")
    return t


def write_qwen3vl_mmproj(path, *, n_text: int = 256, n_embd: int = 32, n_ff: int = 64, n_layer: int = 2,
                         n_head: int = 2, image_size: int = 32, patch: int = 4, deepstack: tuple[int, ...] = (),
                         min_pixels: int = 0, max_pixels: int = 0, tensor_type: str = "F32", seed: int = 0,
                         projector_type: str = "qwen3vl_merger", edit=None) -> Path:
    """A tiny qwen3vl_merger mmproj for a text model of width `n_text`. `deepstack`: the ViT layers
    whose outputs DeepStack mergers project; `min_pixels`/`max_pixels` written when set.
    `tensor_type`: F32 or F16 for the 2-D weights (norms, biases F32). `edit(tensors)`: changes the tensor
    dict before writing (a damaged file)."""
    rng = np.random.default_rng(seed + 2000)
    t = qwen3vl_tensors(rng, n_embd=n_embd, n_ff=n_ff, n_layer=n_layer, patch=patch, side=image_size // patch,
                        n_text=n_text, deepstack=deepstack)
    if edit is not None:
        edit(t)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    w = gguf.GGUFWriter(str(path), "clip")
    w.add_type(gguf.GGUFType.MMPROJ)
    w.add_name(f"Tiny qwen3vl mmproj {n_layer}x{n_embd} seed {seed}")
    w.add_file_type(gguf.LlamaFileType.ALL_F32 if tensor_type == "F32" else gguf.LlamaFileType.MOSTLY_F16)
    w.add_bool(gguf.Keys.Clip.HAS_VISION_ENCODER, True)
    w.add_string(gguf.Keys.Clip.PROJECTOR_TYPE, projector_type)
    v = gguf.Keys.ClipVision
    for key, value in ((v.IMAGE_SIZE, image_size), (v.PATCH_SIZE, patch), (v.EMBEDDING_LENGTH, n_embd),
                       (v.FEED_FORWARD_LENGTH, n_ff), (v.PROJECTION_DIM, n_text), (v.BLOCK_COUNT, n_layer),
                       (v.Attention.HEAD_COUNT, n_head), (v.SPATIAL_MERGE_SIZE, 2)):
        w.add_uint32(key, value)
    if min_pixels:
        w.add_uint32(v.IMAGE_MIN_PIXELS, min_pixels)
    if max_pixels:
        w.add_uint32(v.IMAGE_MAX_PIXELS, max_pixels)
    w.add_float32(v.Attention.LAYERNORM_EPS, 1e-6)
    w.add_array(v.IMAGE_MEAN, list(MEAN))
    w.add_array(v.IMAGE_STD, list(STD))
    w.add_bool(v.USE_GELU, True)
    if deepstack:
        w.add_array(v.IS_DEEPSTACK_LAYERS, [i in deepstack for i in range(n_layer)])
    for name, arr in t.items():
        w.add_tensor(name, arr.astype(np.float16 if arr.ndim >= 2 and tensor_type == "F16" else np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def write_qwen3vl_vision_pair(folder, *, seed: int = 0, text_kw: dict | None = None,
                              mmproj_kw: dict | None = None, mmproj_name: str = "mmproj-tiny-qwen35.gguf"
                              ) -> tuple[Path, Path]:
    """(text model, mmproj) side by side in `folder`, as people download them."""
    folder = Path(folder)
    text_kw = {"n_embd": 256, "tensor_type": "F32", "image_tokens": True, **(text_kw or {})}
    model = gguf_factory_qwen35.write_tiny_qwen35_gguf(folder / "tiny-qwen35-vision.gguf", seed=seed, **text_kw)
    mmproj = write_qwen3vl_mmproj(folder / mmproj_name, n_text=text_kw["n_embd"], seed=seed, **(mmproj_kw or {}))
    return model, mmproj
