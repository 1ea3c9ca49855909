"""Tiny GGUF writers per architecture, one line each: test_arch_features.py runs Strata's features
(parking past a sliding window, session files, speculation, control vectors, distributed) on every one.

A writer is `write(path, *, ftype="F16", seed=0) -> Path` and must produce a file llama.cpp's oracle loads.
Writers for new families live in their own tests/gguf_factory_<family>.py and add a line here."""
from __future__ import annotations

from pathlib import Path
from typing import Callable

import gguf_factory
import gguf_factory_families
import gguf_factory_gemma
import gguf_factory_gpt_oss
import gguf_factory_qwen35


def _dense(arch: str) -> Callable[..., Path]:
    def write(path, *, ftype: str = "F16", seed: int = 0) -> Path:
        src = gguf_factory.write_tiny_gguf(Path(path).with_suffix(".f16.gguf") if ftype != "F16" else path,
                                           arch, seed=seed, tensor_type="F16")
        return src if ftype == "F16" else gguf_factory.quantize_with_llama(src, path, ftype)
    return write


# architecture -> writer. Keep each tiny (2-4 layers, width <= 256): CPU MLX is slow.
ARCH_WRITERS: dict[str, Callable[..., Path]] = {
    "llama": _dense("llama"),
    "qwen3": _dense("qwen3"),
    "gpt-oss": gguf_factory_gpt_oss.write,
    "qwen35": gguf_factory_qwen35.writer("qwen35"),
    "qwen35moe": gguf_factory_qwen35.writer("qwen35moe"),
    "gemma3": gguf_factory_gemma.write_gemma3,
    "gemma4": gguf_factory_gemma.write_gemma4,
    "granite": gguf_factory_families.writer("granite"),
    "olmo2": gguf_factory_families.writer("olmo2"),
    "olmo3": gguf_factory_families.writer("olmo3"),   # GGUF olmo2 with sliding-window layers
    "mistral3": gguf_factory_families.writer("mistral3"),
    "phi3": gguf_factory_families.writer("phi3"),
}
