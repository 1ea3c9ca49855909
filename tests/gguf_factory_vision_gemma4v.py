"""Tiny, real gemma4v mmproj GGUF files (Gemma 4's vision encoder), laid out as llama.cpp's converter
(conversion/gemma.py's Gemma4VisionAudioModel, vision half) writes them.

``write_gemma4v_mmproj``: ``general.architecture = clip``, ``clip.vision.projector_type = gemma4v``;
the patch conv without bias (``v.patch_embd.weight``, (width, 3, p, p)), the learned position tables
(``v.position_embd.weight``, numpy (2, positions, width): columns then rows, F32), RMS-norm blocks
(``ln1``, ``attn_q/k/v/out`` without bias, per-head ``attn_q_norm``/``attn_k_norm``,
``attn_post_norm``, ``ln2``, ``ffn_gate``/``ffn_up``/``ffn_down``, ``ffn_post_norm``, the layer
scalar ``out_scale``), Gemma4ClippableLinear clamps as 1-element tensors beside some weights
(``.input_min``/``.input_max``/``.output_min``/``.output_max``: the converter unsqueezes HF's
scalars), ``v.std_bias``/``v.std_scale`` and ``mm.input_projection.weight`` (numpy (text width,
vision width): nn.Linear's layout, which clip.cpp multiplies as it is). Keys as the converter writes:
no ``clip.use_gelu`` (so clip.cpp runs the FFN with quick GELU), ``clip.vision.image_size`` 224
(unused), no scale factor unless given (clip.cpp pools 3 x 3 then).

``write_gemma4v_pair``: the text model (tests/gguf_factory_gemma.py's tiny Gemma 4, with
``<|image>``/``<image|>`` in its vocabulary) and an mmproj of its width.

Sizes: 2-pixel patches pooled 3 x 3 make a token of 6 x 6 pixels; llama.cpp's budget of 70 to 1,120
tokens an image is then 2,520 to 40,320 pixels (about 50 x 50 to 200 x 200).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

import gguf
import gguf_factory_gemma
from gguf_factory_vision import MEAN, STD

# (tensor of block 0, clamp kind, value): clamps that bite on the tiny tower's activations (its
# inputs are RMS-normed, about +-3), so the clipped path is compared with llama.cpp's
CLAMPS = (("attn_q", "input_max", 1.5), ("attn_q", "input_min", -1.5), ("ffn_down", "output_max", 0.8),
          ("ffn_down", "output_min", -0.8))


def gemma4v_tensors(rng: np.random.Generator, *, n_embd: int, n_ff: int, n_layer: int, n_head: int,
                    patch: int, positions: int, n_text: int) -> dict[str, np.ndarray]:
    """The gemma4v projector's tensors by GGUF name (numpy shapes as gguf-py writes them)."""
    def normal(shape, std):
        return (rng.standard_normal(shape, dtype=np.float32) * np.float32(std)).astype(np.float32)

    def norm(n, center=1.0):
        return (center + normal((n,), 0.1)).astype(np.float32)

    d = n_embd // n_head
    t = {"v.patch_embd.weight": normal((n_embd, 3, patch, patch), 1.0 / np.sqrt(3 * patch * patch)),
         "v.position_embd.weight": normal((2, positions, n_embd), 0.5)}
    for i in range(n_layer):
        p = f"v.blk.{i}."
        for name in ("attn_q", "attn_k", "attn_v", "attn_out"):
            t[p + name + ".weight"] = normal((n_embd, n_embd), 1.0 / np.sqrt(n_embd))
        t[p + "attn_q_norm.weight"], t[p + "attn_k_norm.weight"] = norm(d, 1.2), norm(d, 1.2)
        for name in ("ln1", "attn_post_norm", "ln2", "ffn_post_norm"):
            t[p + name + ".weight"] = norm(n_embd)
        t[p + "ffn_gate.weight"] = normal((n_ff, n_embd), 1.0 / np.sqrt(n_embd))
        t[p + "ffn_up.weight"] = normal((n_ff, n_embd), 1.0 / np.sqrt(n_embd))
        t[p + "ffn_down.weight"] = normal((n_embd, n_ff), 1.0 / np.sqrt(n_ff))
        t[p + "out_scale.weight"] = np.array([0.9 + 0.1 * i], dtype=np.float32)
    for name, kind, value in CLAMPS:
        t[f"v.blk.0.{name}.{kind}"] = np.array([value], dtype=np.float32)
    t["v.std_bias"] = normal((n_embd,), 0.3)
    t["v.std_scale"] = norm(n_embd, 0.5)
    # the projected rows near the text embeddings' scale (llama.cpp does not scale embeddings input)
    t["mm.input_projection.weight"] = normal((n_text, n_embd), 2.0 / np.sqrt(n_embd))
    return t


def write_gemma4v_mmproj(path, *, n_text: int = 256, n_embd: int = 32, n_ff: int = 64, n_layer: int = 2,
                         n_head: int = 2, patch: int = 2, pool: int | None = None, positions: int = 256,
                         tensor_type: str = "F32", seed: int = 0, projector_type: str = "gemma4v",
                         mean=MEAN, std=STD) -> Path:
    """A tiny gemma4v mmproj for a text model of width `n_text`. `pool`: written as the scale factor
    (None: absent, clip.cpp's 3). `tensor_type`: F32 or F16 for the 2-D weights (norms, position
    tables and clamps F32, as the converter keeps them)."""
    rng = np.random.default_rng(seed + 2000)
    t = gemma4v_tensors(rng, n_embd=n_embd, n_ff=n_ff, n_layer=n_layer, n_head=n_head, patch=patch,
                        positions=positions, n_text=n_text)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    w = gguf.GGUFWriter(str(path), "clip")
    w.add_type(gguf.GGUFType.MMPROJ)
    w.add_name(f"Tiny gemma4v mmproj {n_layer}x{n_embd} seed {seed}")
    w.add_file_type(gguf.LlamaFileType.ALL_F32 if tensor_type == "F32" else gguf.LlamaFileType.MOSTLY_F16)
    w.add_bool(gguf.Keys.Clip.HAS_VISION_ENCODER, True)
    v = gguf.Keys.ClipVision
    w.add_string(v.PROJECTOR_TYPE, projector_type)
    w.add_uint32(v.PROJECTION_DIM, n_text)
    w.add_uint32(v.IMAGE_SIZE, 224)
    w.add_uint32(v.PATCH_SIZE, patch)
    w.add_uint32(v.EMBEDDING_LENGTH, n_embd)
    w.add_uint32(v.FEED_FORWARD_LENGTH, n_ff)
    w.add_uint32(v.BLOCK_COUNT, n_layer)
    w.add_uint32(v.Attention.HEAD_COUNT, n_head)
    w.add_array(v.IMAGE_MEAN, [float(x) for x in mean])
    w.add_array(v.IMAGE_STD, [float(x) for x in std])
    w.add_float32(v.Attention.LAYERNORM_EPS, 1e-6)
    if pool is not None:
        w.add_uint32(v.Projector.SCALE_FACTOR, pool)
    for name, arr in t.items():
        wide = arr.ndim >= 2 and name != "v.position_embd.weight"
        w.add_tensor(name, arr.astype(np.float16 if wide and tensor_type == "F16" else np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def write_gemma4v_pair(folder, *, seed: int = 0, text_kw: dict | None = None, mmproj_kw: dict | None = None,
                       mmproj_name: str = "mmproj-tiny-gemma4.gguf") -> tuple[Path, Path]:
    """(text model, mmproj) side by side in `folder`, as people download them."""
    folder = Path(folder)
    text_kw = {"n_embd": 256, "tensor_type": "F32", "image_tokens": True, **(text_kw or {})}
    model = gguf_factory_gemma.write_tiny_gemma4(folder / "tiny-gemma4-vision.gguf", seed=seed, **text_kw)
    mmproj = write_gemma4v_mmproj(folder / mmproj_name, n_text=text_kw["n_embd"], seed=seed, **(mmproj_kw or {}))
    return model, mmproj
