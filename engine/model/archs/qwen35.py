"""Qwen3.5 / Qwen3.6 GGUFs (`qwen35`, `qwen35moe`) on mlx-lm's `qwen3_5` / `qwen3_5_moe` classes.

Three blocks of four (all but every `full_attention_interval`-th) are Gated DeltaNet layers holding a
fixed recurrent state and a short convolution state (mlx-lm's `ArraysCache`); the others are gated
full attention (the Q projection is doubled: per head [query, gate], the output multiplied by
sigmoid(gate)), with partial RoPE (`rope.dimension_count` of `key_length`). The MoE variant has
routed experts (softmax, top-k renormalised) plus a sigmoid-gated shared expert in every block.

What llama.cpp's converter (convert_hf_to_gguf.py, Qwen3NextModel and _LinearAttentionVReorderBase)
does to the Hugging Face tensors, and how it is undone here:

* `ssm_a` = -exp(A_log)                       -> A_log = log(-ssm_a) (every value must be < 0)
* `ssm_dt.bias` = dt_bias; `ssm_conv1d` squeezed to [d_conv, conv_dim] -> Conv1d (conv_dim, d_conv, 1)
* every RMSNorm weight but the DeltaNet's gated norm (`ssm_norm`) stored as 1 + w: exactly what
  mlx-lm's classes use once its own sanitize has added the 1, so the file's values load as they are
  (mlx-lm adds it only when the conv1d weight is un-squeezed, i.e. a raw HF checkpoint)
* in_proj_qkvz split into `attn_qkv` (q, k, v) and `attn_gate` (z); in_proj_b/a = `ssm_beta`/`ssm_alpha`
* when there are more value heads than key heads, the value heads are reordered from grouped by key
  head ([k0: v0..v(r-1)], [k1: ...]) to tiled ([v0: k0..k(n-1)], ...) in qkv's V rows, z, beta,
  alpha, A_log, dt_bias, conv1d's V channels and out_proj's input columns. mlx-lm's recurrence (like
  HF) pairs value head h with key head h // r, so the grouped order is restored here; quantized
  tensors are permuted in whole rows or whole 32-column groups, never re-quantized.
* the NextN/MTP block (`{arch}.nextn_predict_layers`, tensors under blk.{n_layer}) is counted in
  block_count; the main model is the first block_count - nextn layers (the head: qwen35_mtp.py).

RoPE: llama.cpp runs interleaved M-RoPE with `rope.dimension_sections`; a text token's position is
the same in the three first sections and the fourth is empty, so it is plain NEOX RoPE on the first
`rope.dimension_count` dims, which is mlx-lm's nn.RoPE(partial dims, traditional=False).
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

import mlx.core as mx
from mlx_lm.models import qwen3_5, qwen3_5_moe

from engine.errors import ModelFileError
from engine.model.archs import Architecture
from engine.model.archs.common import DENSE_BLOCK_NAMES, TOP_NAMES, first_layer

_BLOCK_RE = re.compile(r"blk\.(\d+)\.(\w+)")

# GGUF block tensor -> attribute path under `language_model.model.layers.N` (mlx-lm qwen3_5 naming)
_LAYER_NAMES = {
    **DENSE_BLOCK_NAMES, "post_attention_norm": "post_attention_layernorm",
    "attn_qkv": "linear_attn.in_proj_qkv", "attn_gate": "linear_attn.in_proj_z",
    "ssm_beta": "linear_attn.in_proj_b", "ssm_alpha": "linear_attn.in_proj_a",
    "ssm_conv1d": "linear_attn.conv1d", "ssm_norm": "linear_attn.norm", "ssm_out": "linear_attn.out_proj",
    # MoE
    "ffn_gate_inp": "mlp.gate", "ffn_gate_exps": "mlp.switch_mlp.gate_proj",
    "ffn_up_exps": "mlp.switch_mlp.up_proj", "ffn_down_exps": "mlp.switch_mlp.down_proj",
    "ffn_gate_up_exps": "mlp.switch_mlp.gate_up_proj",          # fused; split in fix_weights
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj", "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj", "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
_ROOT = "language_model."


@dataclass(frozen=True)
class Qwen35Shape:
    """The hybrid layout read from the file (what the loader, the memory estimate and the MTP head use)."""
    n_layer: int                 # main blocks (block_count - nextn)
    n_nextn: int                 # NextN/MTP blocks after them
    full_attention_interval: int
    n_k_heads: int               # ssm.group_count
    n_v_heads: int               # ssm.time_step_rank
    head_k_dim: int              # ssm.state_size
    head_v_dim: int              # ssm.inner_size / n_v_heads
    d_conv: int                  # ssm.conv_kernel
    n_rot: int                   # rope.dimension_count

    @property
    def conv_dim(self) -> int:
        return 2 * self.n_k_heads * self.head_k_dim + self.n_v_heads * self.head_v_dim

    def is_linear(self, layer: int) -> bool:
        return (layer + 1) % self.full_attention_interval != 0


def _int_key(g, suffix: str, default=None) -> int:
    v = g.arch_key(suffix, default)
    try:
        if v is None or isinstance(v, bool):
            raise TypeError
        n = int(v)
        if n != v or n < 0:
            raise ValueError
    except (TypeError, ValueError, OverflowError):
        raise ModelFileError(f"{g.path.name}: missing or bad '{g.architecture}.{suffix}' "
                             f"(a {g.architecture} file needs it)") from None
    return n


def shape_of(g, head_dim: int | None = None) -> Qwen35Shape:
    name, arch = g.path.name, g.architecture
    n_block = _int_key(g, "block_count")
    n_nextn = _int_key(g, "nextn_predict_layers", 0)
    interval = _int_key(g, "full_attention_interval", 4)
    n_k, n_v = _int_key(g, "ssm.group_count"), _int_key(g, "ssm.time_step_rank")
    d_state, d_inner = _int_key(g, "ssm.state_size"), _int_key(g, "ssm.inner_size")
    d_conv = _int_key(g, "ssm.conv_kernel")
    if head_dim is None:
        head_dim = _int_key(g, "attention.key_length")
    n_rot = _int_key(g, "rope.dimension_count", head_dim)
    if not 0 <= n_nextn < n_block:
        raise ModelFileError(f"{name}: {arch}.nextn_predict_layers {n_nextn} must be below block_count {n_block}")
    if interval < 1:
        raise ModelFileError(f"{name}: {arch}.full_attention_interval must be >= 1 (got {interval})")
    if min(n_k, n_v, d_state, d_inner, d_conv) < 1 or n_v % n_k or d_inner % n_v:
        raise ModelFileError(f"{name}: bad {arch}.ssm.* sizes (group_count {n_k}, time_step_rank {n_v}, "
                             f"state_size {d_state}, inner_size {d_inner}, conv_kernel {d_conv}): the value "
                             f"heads must be a multiple of the key heads and divide inner_size")
    if d_inner // n_v != d_state:
        # llama.cpp sizes the recurrent state as state_size x state_size per head
        raise ModelFileError(f"{name}: {arch} value head size {d_inner // n_v} != key head size {d_state} "
                             "is not supported (llama.cpp assumes them equal)")
    if not (0 < n_rot <= head_dim and n_rot % 2 == 0):
        raise ModelFileError(f"{name}: {arch}.rope.dimension_count {n_rot} must be even and within the "
                             f"head size {head_dim}")
    return Qwen35Shape(n_block - n_nextn, n_nextn, interval, n_k, n_v, d_state, d_inner // n_v, d_conv, n_rot)


def _tensor_shape(g, tname: str) -> tuple[int, ...] | None:
    t = g.tensors().get(tname)
    return None if t is None else tuple(int(x) for x in reversed(list(t.shape)))


@dataclass(frozen=True)
class _MoeShape:
    n_expert: int
    n_used: int
    n_ff_exp: int
    n_ff_shexp: int


def _moe_shape(g, shape: Qwen35Shape) -> _MoeShape:
    name, arch = g.path.name, g.architecture
    n_expert, n_used = _int_key(g, "expert_count"), _int_key(g, "expert_used_count")
    if n_expert < 1 or not 0 < n_used <= n_expert:
        raise ModelFileError(f"{name}: {arch} needs expert_count > 0 and 0 < expert_used_count <= expert_count "
                             f"(got {n_expert} and {n_used})")
    scale = g.arch_key("expert_weights_scale", 0.0)
    if scale not in (0, 0.0, 1, 1.0, None):
        raise ModelFileError(f"{name}: {arch}.expert_weights_scale = {scale} is not supported")
    down = _tensor_shape(g, "blk.0.ffn_down_exps.weight")          # (E, n_embd, n_ff_exp)
    if down is None or len(down) != 3 or down[0] != n_expert:
        raise ModelFileError(f"{name}: {arch} with {n_expert} experts needs blk.N.ffn_down_exps.weight of "
                             f"{n_expert} experts (found {down})")
    sh = _tensor_shape(g, "blk.0.ffn_up_shexp.weight")
    if sh is None:
        raise ModelFileError(f"{name}: {arch} needs the shared expert (blk.N.ffn_up_shexp.weight)")
    return _MoeShape(n_expert, n_used, down[2], sh[0])


@dataclass
class Qwen35Args:
    """mlx-lm's outer ModelArgs for qwen3_5 (model_type, text_config) plus the text fields Strata's
    loader reads from any ModelArgs (ModelInfo, the pipeline split)."""
    model_type: str
    text_config: dict
    hidden_size: int = 0
    num_hidden_layers: int = 0
    num_attention_heads: int = 0
    num_key_value_heads: int = 0
    head_dim: int = 0
    intermediate_size: int = 0
    vocab_size: int = 0
    tie_word_embeddings: bool = True
    shape: Qwen35Shape | None = None
    moe: _MoeShape | None = None
    extra: dict = field(default_factory=dict)


def _sections(g) -> list[int] | None:
    """`rope.dimension_sections` (t, h, w), or None when the file has none."""
    v = g.arch_key("rope.dimension_sections", None)
    try:
        return [int(x) for x in list(v)[:3]] if v is not None and len(v) >= 3 else None
    except (TypeError, ValueError):
        return None


def model_args(g, common: dict, head_dim: int):
    shape = shape_of(g, head_dim)
    moe = _moe_shape(g, shape) if g.architecture == "qwen35moe" else None
    text = dict(common)
    text.update(
        model_type="qwen3_5_moe" if moe else "qwen3_5", num_hidden_layers=shape.n_layer, head_dim=head_dim,
        linear_num_value_heads=shape.n_v_heads, linear_num_key_heads=shape.n_k_heads,
        linear_key_head_dim=shape.head_k_dim, linear_value_head_dim=shape.head_v_dim,
        linear_conv_kernel_dim=shape.d_conv, full_attention_interval=shape.full_attention_interval,
        attention_bias=False,
        rope_parameters={"type": "default", "rope_theta": common["rope_theta"],
                         "partial_rotary_factor": shape.n_rot / head_dim,
                         # the image positions' sections (engine/vision/text_mrope.py); text ignores them
                         "mrope_section": _sections(g)},
    )
    text.pop("rope_theta", None)
    if moe:
        text.update(num_experts=moe.n_expert, num_experts_per_tok=moe.n_used, decoder_sparse_step=1,
                    moe_intermediate_size=moe.n_ff_exp, shared_expert_intermediate_size=moe.n_ff_shexp,
                    norm_topk_prob=True)
        family = qwen3_5_moe
    else:
        family = qwen3_5
    args = Qwen35Args(text["model_type"], text, common["hidden_size"], shape.n_layer,
                      common["num_attention_heads"], common["num_key_value_heads"], head_dim,
                      moe.n_ff_exp if moe else common["intermediate_size"], common["vocab_size"],
                      common["tie_word_embeddings"], shape, moe)
    return family.Model, args


def tensor_name(gguf_name: str, args: Qwen35Args) -> str | None:
    base, _, kind = gguf_name.rpartition(".")
    if base in TOP_NAMES:
        return f"{_ROOT}{TOP_NAMES[base]}.{kind}"
    m = _BLOCK_RE.fullmatch(base)
    if m is None:
        m = _BLOCK_RE.fullmatch(gguf_name)          # blk.N.ssm_a has no .weight
        if m is None or m.group(2) != "ssm_a":
            return None
        layer, part = int(m.group(1)), "ssm_a"
    else:
        layer, part = int(m.group(1)), m.group(2)
    if layer >= args.shape.n_layer:
        return None                                  # the NextN/MTP block: engine/model/archs/qwen35_mtp.py
    prefix = f"{_ROOT}model.layers.{layer}."
    if part == "ssm_a":
        return prefix + "linear_attn.A_log"
    if part == "ssm_dt":
        return prefix + "linear_attn.dt_bias"
    if part in _LAYER_NAMES:
        return f"{prefix}{_LAYER_NAMES[part]}.{kind}"
    return None


def _tiled_to_grouped(x: mx.array, axis: int, n_k: int, r: int) -> mx.array:
    """Undo the converter's V-head reorder along `axis` (units of any width: head rows, packed words,
    scale groups): GGUF order (r, n_k, unit) -> HF/mlx-lm order (n_k, r, unit)."""
    axis = axis % x.ndim
    shape = list(x.shape)
    y = x.reshape(*shape[:axis], r, n_k, shape[axis] // (r * n_k), *shape[axis + 1:])
    return mx.swapaxes(y, axis, axis + 1).reshape(shape)


def fix_weights(weights: dict, qparams: dict, g, args: Qwen35Args) -> None:
    name, s = g.path.name, args.shape
    r = s.n_v_heads // s.n_k_heads
    key_dim = s.n_k_heads * s.head_k_dim
    for i in range(s.n_layer):
        p = f"{_ROOT}model.layers.{i}."
        if not s.is_linear(i) or not any(k.startswith(p) for k in weights):
            continue            # a full-attention block, or (distributed) one another rank holds
        la = p + "linear_attn."
        a = weights.get(la + "A_log")
        if a is None:
            raise ModelFileError(f"{name}: missing tensor 'blk.{i}.ssm_a' (layer {i} is a DeltaNet layer)")
        a = a.astype(mx.float32)
        if not bool(mx.all(a < 0).item()):
            raise ModelFileError(f"{name}: tensor 'blk.{i}.ssm_a' must be -exp(A_log), all negative")
        weights[la + "A_log"] = mx.log(-a)
        conv = weights.get(la + "conv1d.weight")
        if conv is None or conv.shape != (s.conv_dim, s.d_conv):
            raise ModelFileError(f"{name}: tensor 'blk.{i}.ssm_conv1d.weight' has shape "
                                 f"{None if conv is None else list(reversed(conv.shape))}, the hyperparameters "
                                 f"need {[s.d_conv, s.conv_dim]}")
        if la + "conv1d" in qparams:
            raise ModelFileError(f"{name}: a quantized 'blk.{i}.ssm_conv1d.weight' is not supported")
        weights[la + "conv1d.weight"] = conv.reshape(s.conv_dim, s.d_conv, 1)
        if r > 1:
            _regroup_v_heads(weights, qparams, la, s, r, key_dim, name, i)
    fix_moe_weights(weights, qparams)


def fix_moe_weights(weights: dict, qparams: dict) -> None:
    """The shared expert's gate vector as nn.Linear(n_embd, 1); fused expert gate/up stacks split."""
    for key in [k for k in weights if k.endswith(".shared_expert_gate.weight")]:
        if weights[key].ndim == 1:               # llama.cpp's {n_embd} vector -> nn.Linear(n_embd, 1)
            weights[key] = weights[key].reshape(1, -1)
    for prefix in sorted({k.rsplit(".", 1)[0] for k in weights if ".switch_mlp.gate_up_proj." in k}):
        # fused experts (E, 2 * n_ff, n_embd): gate rows first, then up (llama.cpp's build_moe_ffn)
        out = prefix.replace("gate_up_proj", "")
        for kind in ("weight", "scales", "biases"):
            w = weights.pop(f"{prefix}.{kind}", None)
            if w is not None:
                half = w.shape[1] // 2
                weights[f"{out}gate_proj.{kind}"], weights[f"{out}up_proj.{kind}"] = w[:, :half], w[:, half:]
        if prefix in qparams:
            q = qparams.pop(prefix)
            qparams[f"{out}gate_proj"] = qparams[f"{out}up_proj"] = q


def _regroup_v_heads(weights, qparams, la, s: Qwen35Shape, r: int, key_dim: int, name: str, i: int) -> None:
    n_k = s.n_k_heads

    def rows(prefix: str, start: int = 0) -> None:
        # rows [start:] of every array of this parameter are value heads (or their channels)
        for kind in ("weight", "scales", "biases"):
            k = f"{prefix}.{kind}"
            if k in weights:
                w = weights[k]
                weights[k] = mx.concatenate([w[:start], _tiled_to_grouped(w[start:], 0, n_k, r)], axis=0) \
                    if start else _tiled_to_grouped(w, 0, n_k, r)

    rows(la + "in_proj_qkv", 2 * key_dim)
    rows(la + "in_proj_z")
    rows(la + "in_proj_b")
    rows(la + "in_proj_a")
    weights[la + "A_log"] = _tiled_to_grouped(weights[la + "A_log"], 0, n_k, r)
    weights[la + "dt_bias"] = _tiled_to_grouped(weights[la + "dt_bias"], 0, n_k, r)
    conv = weights[la + "conv1d.weight"]
    weights[la + "conv1d.weight"] = mx.concatenate(
        [conv[:2 * key_dim], _tiled_to_grouped(conv[2 * key_dim:], 0, n_k, r)], axis=0)
    # out_proj's input columns: whole value heads; a quantized one moves whole 32-column groups
    q = qparams.get(la + "out_proj")
    if q is not None and s.head_v_dim % q["group_size"]:
        raise ModelFileError(f"{name}: blk.{i}.ssm_out is quantized in groups of {q['group_size']}, which "
                             f"split its value heads of {s.head_v_dim}; it cannot be regrouped")
    for kind in ("weight", "scales", "biases"):
        k = f"{la}out_proj.{kind}"
        if k in weights:
            weights[k] = _tiled_to_grouped(weights[k], 1, n_k, r)


def _a_log_in_float32(model, g, args: Qwen35Args) -> bool:
    """A_log back in float32 after a float16/bfloat16 load, as mlx-lm's own loader keeps it (its
    cast_predicate): the decay exp(-exp(A_log) * softplus(.)) is sensitive to A_log's rounding (bf16:
    ~0.4%), and it is a few values per layer. Read again from the file's ssm_a. True when it did."""
    s = args.shape
    r = s.n_v_heads // s.n_k_heads
    changed = False
    for i, layer in enumerate(model.layers, start=first_layer(model)):
        if not layer.is_linear or layer.linear_attn.A_log.dtype == mx.float32:
            continue
        a = mx.array(g.tensors()[f"blk.{i}.ssm_a"].data).astype(mx.float32).reshape(-1)
        a_log = mx.log(-a)
        layer.linear_attn.A_log = _tiled_to_grouped(a_log, 0, s.n_k_heads, r) if r > 1 else a_log
        changed = True
    return changed


def after_load(model, g, args: Qwen35Args) -> str:
    s = args.shape
    f32 = _a_log_in_float32(model, g, args)
    n_attn = sum(not s.is_linear(i) for i in range(s.n_layer))
    note = (f"hybrid: {s.n_layer - n_attn} Gated DeltaNet + {n_attn} gated attention layers "
            f"(every {s.full_attention_interval}th), RoPE on {s.n_rot} of {args.head_dim} dims")
    if s.n_v_heads != s.n_k_heads:
        note += f"; value heads regrouped ({s.n_v_heads} over {s.n_k_heads} key heads)"
    if args.moe:
        m = args.moe
        note += (f"; MoE: {m.n_expert} experts x {m.n_ff_exp}, top-{m.n_used} of softmax (renormalised), "
                 f"shared expert {m.n_ff_shexp} wide")
    if s.n_nextn:
        note += f"; {s.n_nextn} NextN/MTP block(s) not loaded into the main model"
    if f32:
        note += "; A_log kept in float32"
    return note


ARCH = Architecture(name="qwen35", model_args=model_args, tensor_name=tensor_name, own_names=True,
                    fix_weights=fix_weights, after_load=after_load)
