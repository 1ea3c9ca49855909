"""Tiny, real mmproj GGUF files (image projectors), laid out as llama.cpp's converter writes them.

``write_gemma3_mmproj``: ``general.architecture = clip``, ``clip.projector_type = gemma3``: a SigLIP
ViT (patch conv with bias, learned positions, pre-LN blocks with biased q/k/v/out and a GELU MLP,
post-LN), then a 2-D average pool (``clip.vision.projector.scale_factor`` patches a side), the
soft-embedding RMSNorm (stored as its effective scale, the converter bakes Gemma's 1+w in) and the
input projection (``mm.input_projection.weight``, numpy (vision width, text width): the converter
keeps Hugging Face's x @ W layout, which clip.cpp transposes). Tensor names and keys are gguf-py's
(MODEL_TENSOR.V_ENC_*, V_MM_*; Keys.ClipVision).

``write_gemma3_vision_pair``: the text model (tests/gguf_factory_gemma.py's tiny Gemma 3, with the
image markers ``<start_of_image>``/``<end_of_image>`` in its vocabulary) and an mmproj of its width.

Sizes: a 64-pixel image in 4-pixel patches is 16 x 16 patches, pooled 1 x 1 (no pooling) ... the
default pools 32 x 32 patches (128-pixel image) by 2 to 16 x 16 = 256 tokens, Gemma 3's count.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

import gguf
import gguf_factory_gemma

MEAN = (0.48145466, 0.4578275, 0.40821073)     # CLIP's, so the normalisation is not the identity
STD = (0.26862954, 0.26130258, 0.27577711)


def gemma3_mmproj_tensors(rng: np.random.Generator, *, n_embd: int, n_ff: int, n_layer: int, patch: int,
                          n_patches: int, n_text: int) -> dict[str, np.ndarray]:
    """The gemma3 projector's tensors by GGUF name (numpy shapes as gguf-py writes them)."""
    def normal(shape, std):
        return (rng.standard_normal(shape, dtype=np.float32) * np.float32(std)).astype(np.float32)

    def norm(n, center=1.0):
        return (center + normal((n,), 0.1)).astype(np.float32)

    t = {
        "v.patch_embd.weight": normal((n_embd, 3, patch, patch), 1.0 / np.sqrt(3 * patch * patch)),
        "v.patch_embd.bias": normal((n_embd,), 0.1),
        "v.position_embd.weight": normal((n_patches, n_embd), 0.5),
    }
    for i in range(n_layer):
        p = f"v.blk.{i}."
        for name in ("attn_q", "attn_k", "attn_v", "attn_out"):
            t[p + name + ".weight"] = normal((n_embd, n_embd), 1.0 / np.sqrt(n_embd))
            t[p + name + ".bias"] = normal((n_embd,), 0.05)
        t[p + "ln1.weight"], t[p + "ln1.bias"] = norm(n_embd), normal((n_embd,), 0.05)
        t[p + "ln2.weight"], t[p + "ln2.bias"] = norm(n_embd), normal((n_embd,), 0.05)
        t[p + "ffn_up.weight"] = normal((n_ff, n_embd), 1.0 / np.sqrt(n_embd))
        t[p + "ffn_up.bias"] = normal((n_ff,), 0.05)
        t[p + "ffn_down.weight"] = normal((n_embd, n_ff), 1.0 / np.sqrt(n_ff))
        t[p + "ffn_down.bias"] = normal((n_embd,), 0.05)
    t["v.post_ln.weight"], t["v.post_ln.bias"] = norm(n_embd), normal((n_embd,), 0.05)
    t["mm.soft_emb_norm.weight"] = norm(n_embd)
    # the projected rows land near the text embeddings' scale: the text model does not scale them
    # by sqrt(width) as it does token embeddings, so ~2 (its scaled embeddings' std) keeps an image
    # as loud as text in the residual stream
    t["mm.input_projection.weight"] = normal((n_embd, n_text), 2.0 / np.sqrt(n_embd))
    return t


def write_gemma3_mmproj(path, *, n_text: int = 256, n_embd: int = 64, n_ff: int = 128, n_layer: int = 2,
                        n_head: int = 2, image_size: int = 128, patch: int = 4, pool: int = 2,
                        tensor_type: str = "F32", seed: int = 0, projector_type: str = "gemma3",
                        mean=MEAN, std=STD) -> Path:
    """A tiny gemma3 mmproj for a text model of width `n_text`: (image_size/patch/pool)^2 tokens an
    image (the defaults: 256). `tensor_type`: F32 or F16 for the 2-D weights (norms, biases F32)."""
    rng = np.random.default_rng(seed + 1000)
    side = image_size // patch
    t = gemma3_mmproj_tensors(rng, n_embd=n_embd, n_ff=n_ff, n_layer=n_layer, patch=patch,
                              n_patches=side * side, n_text=n_text)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    w = gguf.GGUFWriter(str(path), "clip")
    w.add_type(gguf.GGUFType.MMPROJ)
    w.add_name(f"Tiny gemma3 mmproj {n_layer}x{n_embd} seed {seed}")
    w.add_file_type(gguf.LlamaFileType.ALL_F32 if tensor_type == "F32" else gguf.LlamaFileType.MOSTLY_F16)
    w.add_bool(gguf.Keys.Clip.HAS_VISION_ENCODER, True)
    w.add_string(gguf.Keys.Clip.PROJECTOR_TYPE, projector_type)
    v = gguf.Keys.ClipVision
    w.add_uint32(v.IMAGE_SIZE, image_size)
    w.add_uint32(v.PATCH_SIZE, patch)
    w.add_uint32(v.EMBEDDING_LENGTH, n_embd)
    w.add_uint32(v.FEED_FORWARD_LENGTH, n_ff)
    w.add_uint32(v.PROJECTION_DIM, n_text)
    w.add_uint32(v.BLOCK_COUNT, n_layer)
    w.add_uint32(v.Attention.HEAD_COUNT, n_head)
    w.add_float32(v.Attention.LAYERNORM_EPS, 1e-6)
    w.add_array(v.IMAGE_MEAN, [float(x) for x in mean])
    w.add_array(v.IMAGE_STD, [float(x) for x in std])
    w.add_uint32(v.Projector.SCALE_FACTOR, pool)
    w.add_bool(v.USE_GELU, True)
    for name, arr in t.items():
        if arr.ndim >= 2 and tensor_type == "F16":
            w.add_tensor(name, arr.astype(np.float16))
        else:
            w.add_tensor(name, arr.astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def write_gemma3_vision_pair(folder, *, seed: int = 0, text_kw: dict | None = None,
                             mmproj_kw: dict | None = None, mmproj_name: str = "mmproj-tiny-gemma3.gguf"
                             ) -> tuple[Path, Path]:
    """(text model, mmproj) side by side in `folder`, as people download them."""
    folder = Path(folder)
    text_kw = {"n_embd": 256, "tensor_type": "F32", "image_tokens": True, **(text_kw or {})}
    model = gguf_factory_gemma.write_tiny_gemma3(folder / "tiny-gemma3-vision.gguf", seed=seed, **text_kw)
    mmproj = write_gemma3_mmproj(folder / mmproj_name, n_text=text_kw["n_embd"], seed=seed, **(mmproj_kw or {}))
    return model, mmproj
