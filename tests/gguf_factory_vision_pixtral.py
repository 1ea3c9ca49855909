"""Tiny, real pixtral mmproj GGUF files (Mistral 3 / Mistral Small 3.1 / Pixtral vision), laid out as
llama.cpp's converter (LlavaVisionModel) writes them, beside a tiny Ministral 3 text model.

``write_pixtral_mmproj``: ``general.architecture = clip``, ``clip.projector_type = pixtral``: the
Pixtral ViT (patch conv without bias, ``v.pre_ln`` RMSNorm, RMSNorm blocks with bias-free q/k/v/out,
2-D RoPE over patch rows and columns, a SiLU-gated MLP: ``clip.use_silu``), then Mistral Small 3.1's
patch merger when ``clip.vision.spatial_merge_size`` > 1 (``mm.input_norm`` RMSNorm, merge x merge
patches unfolded into one row, ``mm.patch_merger``), the two-layer GELU projector (``mm.1``, ``mm.2``;
biases as Pixtral 12B has them, none as Mistral Small 3.1) and the ``[IMG_BREAK]`` row
(``v.token_embd.img_break``, the text model's embedding of that token, which the converter copies).
Tensor names and keys are gguf-py's (MODEL_TENSOR.V_*, Keys.ClipVision); weights are random in the
file's own layout (the converter's q/k row permutation does not matter for random rows).

``write_pixtral_vision_pair``: the text model (tests/gguf_factory_families.py's ``mistral3-vision``:
Ministral 3 with ``[IMG]``, ``[IMG_BREAK]``, ``[IMG_END]`` in its vocabulary; or ``llama-mistral-vision``,
the GGUF architecture of Mistral Small 3.1/3.2's and Pixtral 12B's text) and an mmproj of its width.

Sizes: 4-pixel patches merged 2 x 2: an image is resized to multiples of 8 pixels within
8 .. 1024 tokens (llama.cpp's limits for pixtral), so a 128 x 128 image is 16 x 16 tokens plus 15
[IMG_BREAK] rows.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

import gguf
import gguf_factory_families
from gguf_factory_vision import MEAN, STD


def pixtral_mmproj_tensors(rng: np.random.Generator, *, n_embd: int, n_ff: int, n_layer: int, patch: int,
                           merge: int, n_text: int, bias: bool, img_break: np.ndarray) -> dict[str, np.ndarray]:
    """The pixtral projector's tensors by GGUF name (numpy shapes as gguf-py writes them)."""
    def normal(shape, std):
        return (rng.standard_normal(shape, dtype=np.float32) * np.float32(std)).astype(np.float32)

    def norm(n):
        return (1.0 + normal((n,), 0.1)).astype(np.float32)

    t = {"v.patch_embd.weight": normal((n_embd, 3, patch, patch), 1.0 / np.sqrt(3 * patch * patch)),
         "v.pre_ln.weight": norm(n_embd)}
    for i in range(n_layer):
        p = f"v.blk.{i}."
        for name in ("attn_q", "attn_k", "attn_v"):
            t[p + name + ".weight"] = normal((n_embd, n_embd), 1.0 / np.sqrt(n_embd))
        t[p + "attn_out.weight"] = normal((n_embd, n_embd), 2.0 / np.sqrt(n_embd))
        t[p + "ln1.weight"], t[p + "ln2.weight"] = norm(n_embd), norm(n_embd)
        t[p + "ffn_gate.weight"] = normal((n_ff, n_embd), 1.0 / np.sqrt(n_embd))
        t[p + "ffn_up.weight"] = normal((n_ff, n_embd), 1.0 / np.sqrt(n_embd))
        t[p + "ffn_down.weight"] = normal((n_embd, n_ff), 2.0 / np.sqrt(n_ff))
    if merge > 1:
        t["mm.input_norm.weight"] = norm(n_embd)
        t["mm.patch_merger.weight"] = normal((n_embd, n_embd * merge * merge), 1.0 / np.sqrt(n_embd * merge * merge))
    # the projected rows land near the text embeddings' scale (2 / sqrt(width) a value, as the
    # factory's token embeddings), so an image is as loud as text in the residual stream
    t["mm.1.weight"] = normal((n_text, n_embd), 1.0 / np.sqrt(n_embd))
    t["mm.2.weight"] = normal((n_text, n_text), 2.0 / np.sqrt(n_text))
    if bias:
        t["mm.1.bias"], t["mm.2.bias"] = normal((n_text,), 0.05), normal((n_text,), 0.05)
    t["v.token_embd.img_break"] = img_break.astype(np.float32)
    return t


def write_pixtral_mmproj(path, *, n_text: int = 256, n_embd: int = 64, n_ff: int = 128, n_layer: int = 2,
                         n_head: int = 2, image_size: int = 128, patch: int = 4, merge: int = 2,
                         bias: bool = False, img_break: np.ndarray | None = None, seed: int = 0,
                         tensor_type: str = "F32", projector_type: str = "pixtral", act: str = "silu",
                         drop: tuple[str, ...] = ()) -> Path:
    """A tiny pixtral mmproj for a text model of width `n_text`. `merge` 1 writes no merger and no
    spatial_merge_size key (Pixtral 12B), 2 Mistral Small 3.1's. `img_break`: the [IMG_BREAK] row
    (None: a random one; llama.cpp refuses a pixtral file without it). `tensor_type`: F32 or F16 for
    2-D weights. `act`: the gated MLP's activation, "silu" (clip.use_silu), "gelu" (clip.use_gelu) or
    "quick" (neither key: quick-GELU). `drop`: tensor names left out (files a loader must refuse)."""
    rng = np.random.default_rng(seed + 2000)
    if img_break is None:
        img_break = rng.standard_normal(n_text).astype(np.float32) * np.float32(2.0 / np.sqrt(n_text))
    t = pixtral_mmproj_tensors(rng, n_embd=n_embd, n_ff=n_ff, n_layer=n_layer, patch=patch, merge=merge,
                               n_text=n_text, bias=bias, img_break=img_break)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    w = gguf.GGUFWriter(str(path), "clip")
    w.add_type(gguf.GGUFType.MMPROJ)
    w.add_name(f"Tiny pixtral mmproj {n_layer}x{n_embd} seed {seed}")
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
    w.add_float32(v.Attention.LAYERNORM_EPS, 1e-5)
    w.add_array(v.IMAGE_MEAN, [float(x) for x in MEAN])
    w.add_array(v.IMAGE_STD, [float(x) for x in STD])
    if act != "quick":
        w.add_bool(v.USE_SILU if act == "silu" else v.USE_GELU, True)
    if merge > 1:
        w.add_uint32(v.SPATIAL_MERGE_SIZE, merge)
    for name, arr in t.items():
        if name in drop:
            continue
        w.add_tensor(name, arr.astype(np.float16 if arr.ndim >= 2 and tensor_type == "F16" else np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def img_break_row(model: Path, family: str = "mistral3-vision") -> np.ndarray:
    """The text model's embedding row of [IMG_BREAK] (what the converter copies into the mmproj)."""
    toks, _ = gguf_factory_families.family_tokens(family)
    r = gguf.GGUFReader(str(model))
    emb = next(t for t in r.tensors if t.name == "token_embd.weight")
    return np.array(emb.data, dtype=np.float32).reshape(-1, int(emb.shape[0]))[toks.index("[IMG_BREAK]")]


def write_pixtral_vision_pair(folder, *, seed: int = 0, text_kw: dict | None = None, mmproj_kw: dict | None = None,
                              mmproj_name: str = "mmproj-tiny-pixtral.gguf", family: str = "mistral3-vision"
                              ) -> tuple[Path, Path]:
    """(text model, mmproj) side by side in `folder`, as people download them. `family`:
    "mistral3-vision" (Ministral 3) or "llama-mistral-vision" (Mistral Small 3.1's GGUF architecture llama)."""
    folder = Path(folder)
    text_kw = {"n_embd": 256, "tensor_type": "F32", **(text_kw or {})}
    model = gguf_factory_families.write_family_gguf(folder / f"tiny-{family}.gguf", family, seed=seed, **text_kw)
    kw = {"img_break": img_break_row(model, family), **(mmproj_kw or {})}
    mmproj = write_pixtral_mmproj(folder / mmproj_name, n_text=text_kw["n_embd"], seed=seed, **kw)
    return model, mmproj
