"""Where a Gemma 3 / Gemma 4 model (and gpt-oss: its even blocks slide) keeps K/V, from the GGUF header
alone (plain Python, for the memory estimate): global layers grow with the context, sliding layers
hold a window (mlx-lm's RotatingKVCache: up to the window, plus one prefill chunk while a chunk goes
in), and Gemma 4's last `shared_kv_layers` layers hold none (they read an earlier layer's).

The rules are engine/model/archs/gemma.py's (llama.cpp's): Gemma 3 makes every `pattern`-th layer global
(6 unless the file says `sliding_window_pattern`; every layer when there is no window), Gemma 4 lists
each layer (true = sliding) and has its own head size on sliding layers (`key_length_swa`).
"""
from __future__ import annotations

from dataclasses import dataclass

from engine.errors import ModelFileError
from engine.model.gguf_schema import check_blocks

ARCHITECTURES = ("gemma3", "gemma4", "gpt-oss")
_GEMMA3_GLOBAL_EVERY = 6


@dataclass(frozen=True)
class GemmaLayout:
    global_values: int          # K and V values per token, all global layers together
    window_values: int          # K and V values per token of window, all sliding layers together
    window: int                 # tokens a sliding layer holds (window + one prefill chunk)

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        return self.global_values * dtype_bytes

    def window_bytes(self, dtype_bytes: int) -> int:
        return self.window_values * self.window * dtype_bytes


def _per_layer(h, key: str, n_layer: int, default) -> list[int]:
    v = h.metadata.get(f"{h.architecture}.{key}", default)
    if isinstance(v, tuple):        # memory_estimate keeps small per-layer arrays as tuples
        if len(v) != n_layer:
            raise ModelFileError(f"{h.path.name}: '{h.architecture}.{key}' has {len(v)} values for {n_layer} layers")
        return [int(x) for x in v]
    return [int(h.arch_int(key, default))] * n_layer


def layout(h, chunk: int) -> GemmaLayout | None:
    """The layout of header `h` (memory_estimate.GGUFHeader), or None for another architecture.
    `chunk`: the prefill chunk a sliding layer's cache holds on top of its window."""
    if h.architecture not in ARCHITECTURES:
        return None
    n_layer = check_blocks(h.view())        # bounded by the tensor table, not by the header's word
    n_embd, n_head = h.arch_int("embedding_length"), h.arch_int("attention.head_count")
    if n_layer < 1 or n_head < 1:
        raise ModelFileError(f"{h.path.name}: missing '{h.architecture}.*' hyperparameters")
    head = h.arch_int("attention.key_length", n_embd // n_head) or n_embd // n_head
    head_v = h.arch_int("attention.value_length", head) or head
    kv_heads = _per_layer(h, "attention.head_count_kv", n_layer, n_head)
    window = h.arch_int("attention.sliding_window", 0)
    if h.architecture == "gemma3":
        pattern = h.arch_int("attention.sliding_window_pattern", _GEMMA3_GLOBAL_EVERY) if window else 1
        sliding = [pattern > 1 and (i + 1) % pattern != 0 for i in range(n_layer)]
        heads = [(head, head_v)] * n_layer
        with_kv = n_layer
    elif h.architecture == "gpt-oss":
        # llama.cpp's swa pattern 2 (engine/model/archs/gpt_oss.py): the even blocks slide
        sliding = [i % 2 == 0 for i in range(n_layer)]
        heads = [(head, head_v)] * n_layer
        with_kv = n_layer
    else:
        sliding = [bool(x) for x in _per_layer(h, "attention.sliding_window_pattern", n_layer, 0)]
        swa = h.arch_int("attention.key_length_swa", head) or head
        swa_v = h.arch_int("attention.value_length_swa", swa) or swa
        heads = [(swa, swa_v) if s else (head, head_v) for s in sliding]
        with_kv = n_layer - h.arch_int("attention.shared_kv_layers", 0)
    per_layer = [kv_heads[i] * (heads[i][0] + heads[i][1]) for i in range(max(0, with_kv))]
    return GemmaLayout(sum(v for v, s in zip(per_layer, sliding) if not s),
                       sum(v for v, s in zip(per_layer, sliding) if s), window + chunk)
