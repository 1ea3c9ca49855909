"""Build an mlx-lm model from a GGUF file: metadata -> ModelArgs, GGUF tensor names -> mlx-lm names."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import mlx.core as mx
import mlx.nn as nn
import gguf as gguf_py
from mlx_lm.generate import generation_stream
from mlx_lm.models import llama, qwen2, qwen3
from mlx_lm.models.cache import make_prompt_cache

from engine.model import attention
from engine.model import archs, moe, quants
from engine.model.archs.common import (FactorRoPE, apply_rope_factors, common_args,  # noqa: F401 - re-exported
                                       DENSE_BLOCK_NAMES, TOP_NAMES, add_tensor, load_checked, mapped_name)
from engine.device import on_gpu
from engine.errors import ModelFileError
from engine.model.gguf_checks import check_hyperparameters
from engine.model.gguf_file import GGUFFile

# llama also covers Mixtral-style files (llama.expert_count > 0); the MoE ones live in engine/model/moe.py
SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3", "qwen2moe", "qwen3moe")

_BLOCK_NAMES = {**DENSE_BLOCK_NAMES, "ffn_norm": "post_attention_layernorm"}


def mlx_name(gguf_name: str) -> str | None:
    return mapped_name(gguf_name, _BLOCK_NAMES, TOP_NAMES)  # None e.g. for rope_freqs: not an mlx-lm weight


def warm_up(model) -> float:
    """Run the model once at load on a GPU, with a throwaway cache. MLX builds each kernel on its
    first use (CUDA: compiled at run time; Metal: specialized), and otherwise the first request pays
    for it: 0.4-17 s on an H200, 31.7 s for the first returning turn (bench/gpu.md). The shapes touch
    a prefill chunk past the explicit-attention limit (the fused kernel), a short chunk (the explicit
    form) and a decode step. Not on the CPU, which builds nothing at run time. Returns seconds."""
    t0 = time.perf_counter()
    cache = make_prompt_cache(model)
    # on the stream every request steps on: evaluated on the engine thread's default stream, this
    # hung on the H200 (a stack dump every 15 s for 75 s, bench/trace_run.py)
    with mx.stream(generation_stream):
        for n in (attention.EXPLICIT_MAX_QUERIES + 1, 8, 1):
            logits = model(mx.zeros((1, n), dtype=mx.int32), cache=cache)
            mx.eval(logits - mx.logsumexp(logits[:, -1:], axis=-1, keepdims=True))
    del cache, logits
    mx.clear_cache()
    return time.perf_counter() - t0


@dataclass
class ModelInfo:
    architecture: str
    name: str
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_ff: int
    n_vocab: int
    context_length: int
    file_type: str
    n_params: int
    load_note: str
    n_expert: int = 0  # mixture of experts: experts per block (0 = dense)
    n_expert_used: int = 0


def supported() -> tuple[str, ...]:
    return SUPPORTED_ARCHITECTURES + archs.names()


def model_args(g: GGUFFile):
    arch = g.architecture
    if arch == "gemma4-assistant":      # engine/model/archs/gemma4_mtp.py
        raise ModelFileError(f"{g.path.name}: a Gemma 4 MTP drafter, not a model: load its gemma4 model and "
                             "use --spec mtp (found beside it as mtp-*.gguf) or mtp:PATH")
    if arch not in supported():
        raise ModelFileError(f"{g.path.name}: architecture '{arch or '(none)'}' is not supported "
                             f"(supported: {', '.join(supported())})")
    check_hyperparameters(g)   # before anything is sized from them: one line for a bad value
    common, head_dim = common_args(g)
    plugin = archs.find(arch)
    if plugin is not None:
        return plugin.model_args(g, common, head_dim)
    if moe.is_moe(g):
        return moe.model_args(g, common, head_dim)[:2]
    if arch == "llama":
        # llama.cpp's converter permutes Q/K rows so that adjacent pairs rotate together: that is
        # exactly MLX's "traditional" RoPE, so the rows need no un-permuting.
        return llama.Model, llama.ModelArgs(**common, head_dim=head_dim, rope_traditional=True)
    if arch == "qwen2":
        return qwen2.Model, qwen2.ModelArgs(**common)
    return qwen3.Model, qwen3.ModelArgs(**common, head_dim=head_dim)


def load_model(g: GGUFFile, *, dtype=mx.float32,
               progress: Callable[[int, int], None] | None = None, part=None) -> tuple[nn.Module, ModelInfo]:
    """part: a pipeline_model.PipelinePart when this process holds only some layers (distributed)."""
    model_cls, args = model_args(g)
    plugin = archs.find(g.architecture)
    spec = moe.moe_spec(g) if plugin is None and moe.is_moe(g) else None
    t0 = time.perf_counter()
    weights: dict[str, mx.array] = {}
    qparams: dict[str, dict] = {}
    notes = []
    tensors = g.reader.tensors
    n_params = 0
    for i, t in enumerate(tensors):
        if plugin is not None:
            name = None if plugin.own_names else mlx_name(t.name)
            name = name or (plugin.tensor_name(t.name, args) if plugin.tensor_name else None)
        else:
            name = mlx_name(t.name) or (moe.mlx_name(t.name, spec) if spec else None)
        if name is not None and part is not None:   # distributed: another rank's tensor is never read
            name = part.local_name(name, args.tie_word_embeddings)
        if name is None:
            continue
        notes.append(add_tensor(weights, qparams, name, t, dtype, g.path.name).note)
        n_params += int(t.n_elements)
        if progress:
            progress(i + 1, len(tensors))
    if spec:
        moe.fix_weights(weights, qparams, spec)
    if plugin is not None and plugin.fix_weights:
        plugin.fix_weights(weights, qparams, g, args)
    model = model_cls(args) if part is None else part.build(model_cls, args)
    if part is not None:        # distributed: this rank's blocks, renumbered from 0 (see PipelinePart)
        qparams = part.localize(qparams)
    if qparams:
        nn.quantize(model, class_predicate=lambda path, module: qparams.get(path, False))
    weights = model.sanitize(weights)
    if part is not None:
        weights = part.localize(weights)
    load_checked(model, weights, dtype, f"{g.path.name}: tensors do not match a {args.model_type} model")
    note = f"{quants.summarize(notes)}; loaded in {time.perf_counter() - t0:.1f} s"
    if plugin is not None and plugin.after_load:
        extra = plugin.after_load(model, g, args)
        note += f"; {extra}" if extra else ""
    elif apply_rope_factors(model, g, args):
        note += "; RoPE frequency factors from rope_freqs.weight"
    if attention.install(model):
        note += "; short chunks: explicit attention (cuDNN plans fused attention per shape)"
    if part is None and on_gpu():
        note += f"; kernels warmed up in {warm_up(model) * 1e3:.0f} ms"
    if spec:
        note += f"; {spec.describe()}"
    ft = g.get("general.file_type")
    try:
        file_type = gguf_py.LlamaFileType(int(ft)).name.removeprefix("MOSTLY_") if ft is not None else "?"
    except ValueError:
        file_type = str(ft)
    info = ModelInfo(args.model_type, str(g.get("general.name", g.path.stem)), args.num_hidden_layers,
                     args.hidden_size, args.num_attention_heads, args.num_key_value_heads,
                     getattr(args, "head_dim", None) or args.hidden_size // args.num_attention_heads,
                     args.intermediate_size, args.vocab_size, int(g.arch_key("context_length", 4096)),
                     file_type, n_params, note)
    if spec:
        info.n_expert, info.n_expert_used, info.n_ff = spec.n_expert, spec.n_expert_used, spec.n_ff_exp
    else:       # the families mlx-lm builds its own experts for (gpt-oss, qwen35moe): the class's names
        info.n_expert = int(getattr(args, "num_local_experts", 0) or getattr(args, "num_experts", 0) or 0)
        info.n_expert_used = int(getattr(args, "num_experts_per_tok", 0) or 0) if info.n_expert else 0
    return model, info
