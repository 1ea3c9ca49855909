"""Gemma 3 and Gemma 4 GGUF files (text models) onto mlx-lm's `gemma3_text` and `gemma4_text`.

What llama.cpp's converter and graph do, and what that means here:
- Norms: the Gemma 3 converter stores every RMSNorm weight as 1+w (Gemma3RMSNorm scales by 1+w);
  mlx-lm's gemma3_text adds the 1 itself, so 1 is taken off at load. The Gemma 4 converter stores
  the weights as they are (its norm_shift is 0) and mlx-lm's gemma4_text uses them as they are.
- Tensor names: GGUF `ffn_norm` is Gemma's pre-feed-forward norm (not the post-attention norm of the
  llama table), `post_attention_norm` and `post_ffw_norm` the post-norms: this module names every
  tensor itself (`own_names`).
- Attention scale: Gemma 3 scales queries by 1/sqrt(head size) (1/sqrt(n_embd/n_head) for the
  62-layer 27B, as llama.cpp's load_hparams picks by layer count); Gemma 4 by 1.
- Sliding window: Gemma 3 makes every 6th layer global (llama.cpp's fixed pattern, unless the file
  says `sliding_window_pattern`); local layers use RoPE base `rope.freq_base_swa` (10,000 when the
  file has none), global ones `rope.freq_base`. Gemma 4 lists each layer (`sliding_window_pattern`
  as a bool array, true = sliding), has its own head size for local layers (`key_length_swa`) and
  proportional RoPE on global layers through `rope_freqs.weight` (factor 1e30 = not rotated).
- Gemma 4: per-layer token embeddings (`embedding_length_per_layer_input` > 0), the last
  `shared_kv_layers` layers reusing the K/V of the last earlier layer of their kind (no K/V tensors
  of their own), a double-wide FFN there (per-layer `feed_forward_length`), a per-layer output scale,
  V normed without weight, final logit soft-capping; the mixture-of-experts variant (26B-A4B):
  experts beside the dense FFN, a router on the RMS-normed stream (softmax over the top k, a scale
  per expert), the fused gate/up expert stack split at load.
"""
from __future__ import annotations

import functools
import re

import numpy as np
import math
import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import gemma3_text, gemma4_text

from engine.model.archs import Architecture
from engine.errors import ModelFileError
from engine.model.archs.common import DENSE_BLOCK_NAMES, FactorRoPE

_BLOCK = {
    **DENSE_BLOCK_NAMES, "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm", "post_ffw_norm": "post_feedforward_layernorm",
    # Gemma 4's per-layer embedding path
    "inp_gate": "per_layer_input_gate", "proj": "per_layer_projection", "post_norm": "post_per_layer_input_norm",
    # Gemma 4's mixture-of-experts blocks (26B-A4B): the dense FFN above runs beside the experts
    "pre_ffw_norm_2": "pre_feedforward_layernorm_2", "post_ffw_norm_1": "post_feedforward_layernorm_1",
    "post_ffw_norm_2": "post_feedforward_layernorm_2",
    "ffn_gate_exps": "experts.switch_glu.gate_proj", "ffn_up_exps": "experts.switch_glu.up_proj",
    "ffn_down_exps": "experts.switch_glu.down_proj",
    "ffn_gate_up_exps": "experts.switch_glu." + "gate_up_proj",   # split in fix_weights
}
# (block tensor, kind) -> name: the router's tensors are not weights of one module each
_ROUTER = {("ffn_gate_inp", "weight"): "router.proj.weight", ("ffn_gate_inp", "scale"): "router.scale",
           ("ffn_down_exps", "scale"): "router.per_expert_scale"}
_TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head",
        "per_layer_token_embd": "model.embed_tokens_per_layer",
        "per_layer_model_proj": "model.per_layer_model_projection",
        "per_layer_proj_norm": "model.per_layer_projection_norm"}
_GEMMA3_GLOBAL_EVERY = 6        # llama.cpp: hparams.set_swa_pattern(6) for LLM_ARCH_GEMMA3
_DEFAULT_SWA_BASE = 10_000.0    # llama.cpp's rope_freq_base_train_swa when the file has none


def tensor_name(gguf_name: str, args) -> str | None:
    base, _, kind = gguf_name.rpartition(".")
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)", base)
    if m:
        if m.group(2) == "layer_output_scale":          # a (1,) array, not a module's weight
            return f"model.layers.{m.group(1)}.layer_scalar"
        if (m.group(2), kind) in _ROUTER:
            return f"model.layers.{m.group(1)}.{_ROUTER[m.group(2), kind]}"
        if m.group(2) in _BLOCK:
            return f"model.layers.{m.group(1)}.{_BLOCK[m.group(2)]}.{kind}"
        return None
    if base in _TOP:
        return f"{_TOP[base]}.{kind}"
    return None                 # rope_freqs: read by after_load


def _per_layer(g, key: str, n_layer: int, default=None) -> list:
    """A key that may be one value or one per layer (llama.cpp's get_key_or_arr)."""
    v = g.arch_key(key, default)
    if v is None:
        raise ModelFileError(f"{g.path.name}: missing metadata '{g.architecture}.{key}'")
    if isinstance(v, (list, np.ndarray)):
        v = [x.item() if hasattr(x, "item") else x for x in v]
        if len(v) != n_layer:
            raise ModelFileError(f"{g.path.name}: '{g.architecture}.{key}' has {len(v)} values "
                                 f"for {n_layer} layers")
        return v
    return [v] * n_layer


def _window(g, common: dict) -> int | None:
    w = g.arch_key("attention.sliding_window")
    if w is None or int(w) == 0:
        return None
    w = int(w)
    if w > common["max_position_embeddings"]:
        raise ModelFileError(f"{g.path.name}: sliding window {w} is larger than the context "
                             f"{common['max_position_embeddings']}")
    return w


def _linear_scale(g) -> float:
    """The global layers' linear RoPE factor (Gemma 3 4B/12B/27B: 8; llama.cpp keeps the sliding
    layers at 1), from rope.scaling.type/factor; 1 without."""
    kind = g.arch_key("rope.scaling.type")
    if kind in (None, "none"):
        return 1.0
    factor = g.arch_key("rope.scaling.factor", 1.0)
    try:
        factor = float(factor)
    except (TypeError, ValueError):
        factor = -1.0
    if kind != "linear" or not 0.0 < factor < 1e6:
        raise ModelFileError(f"{g.path.name}: RoPE scaling {kind!r} x{factor} is not supported for "
                             f"{g.architecture} (linear is)")
    return factor


def _gemma3_args(g, common: dict, head_dim: int):
    n_layer = common["num_hidden_layers"]
    window = _window(g, common)
    pattern = g.arch_key("attention.sliding_window_pattern")
    if window is None:
        # no window in the file: the converter wrote none because every layer is global
        pattern = 1
    elif pattern is None:
        pattern = _GEMMA3_GLOBAL_EVERY
    elif isinstance(pattern, (list, np.ndarray)):
        raise ModelFileError(f"{g.path.name}: a per-layer gemma3.attention.sliding_window_pattern is "
                             "not supported (Gemma 3 files give one period)")
    pattern = int(pattern)
    if not 1 <= pattern <= n_layer:
        # mlx-lm takes the global layers' mask from layer pattern-1: it must exist
        raise ModelFileError(f"{g.path.name}: sliding window pattern {pattern} needs at least that many "
                             f"layers, the file has {n_layer}")
    if g.arch_key("final_logit_softcapping") and window is None:
        # llama.cpp soft-caps a Gemma 3 without sliding layers; mlx-lm's gemma3_text never does
        raise ModelFileError(f"{g.path.name}: a Gemma 3 without sliding window layers but with logit "
                             "soft-capping is not supported")
    n_embd, n_head = common["hidden_size"], common["num_attention_heads"]
    # llama.cpp: 1/sqrt(n_embd/n_head) for the 27B (62 layers), 1/sqrt(head size) otherwise
    scalar = n_embd // n_head if n_layer == 62 else head_dim
    args = gemma3_text.ModelArgs(**{k: v for k, v in common.items() if k != "tie_word_embeddings"},
                     head_dim=head_dim, query_pre_attn_scalar=scalar,
                     rope_local_base_freq=float(g.arch_key("rope.freq_base_swa", _DEFAULT_SWA_BASE)),
                     sliding_window=window or common["max_position_embeddings"],
                     sliding_window_pattern=pattern,
                     rope_scaling={"rope_type": "linear", "factor": scale} if (scale := _linear_scale(g)) != 1.0
                     else None)
    args.tie_word_embeddings = common["tie_word_embeddings"]
    return gemma3_text.Model, args


def _gemma4_args(g, common: dict, head_dim: int):
    name = g.path.name
    tensors = g.tensors()
    n_layer = common["num_hidden_layers"]
    moe = [f"blk.{i}.ffn_gate_inp.weight" in tensors for i in range(n_layer)]
    n_expert, n_used = int(g.arch_key("expert_count", 0)), int(g.arch_key("expert_used_count", 0))
    n_ff_exp = int(g.arch_key("expert_feed_forward_length", 0))
    if any(moe) and not all(moe):
        raise ModelFileError(f"{name}: experts in some Gemma 4 layers only (mlx-lm's gemma4_text has them "
                             "in every layer or none)")
    if any(moe) and not (0 < n_used <= n_expert and n_ff_exp > 0):
        raise ModelFileError(f"{name}: Gemma 4 experts need expert_count, expert_used_count (1..count) "
                             "and expert_feed_forward_length")
    swa = [bool(x) for x in _per_layer(g, "attention.sliding_window_pattern", n_layer)]
    window = _window(g, common)
    if window is None and any(swa):
        raise ModelFileError(f"{name}: sliding layers but no gemma4.attention.sliding_window")
    n_shared = int(g.arch_key("attention.shared_kv_layers", 0))
    first_shared = n_layer - n_shared
    if not 0 <= n_shared < n_layer:
        raise ModelFileError(f"{name}: {n_shared} K/V-sharing layers of {n_layer}")
    for kind in set(swa[first_shared:]):
        if kind not in swa[:first_shared]:
            # mlx-lm and llama.cpp reuse the last earlier layer of the same kind
            raise ModelFileError(f"{name}: a K/V-sharing {'sliding' if kind else 'global'} layer has no "
                                 "earlier layer of its kind to share")
    n_ff = [int(x) for x in _per_layer(g, "feed_forward_length", n_layer)]
    double = n_shared > 0 and n_ff[-1] == 2 * n_ff[0]
    if any(n_ff[i] != n_ff[0] * (2 if double and i >= first_shared else 1) for i in range(n_layer)):
        raise ModelFileError(f"{name}: per-layer feed_forward_length {n_ff} is not Gemma 4's "
                             "(one width, doubled in the K/V-sharing layers)")
    n_head = common["num_attention_heads"]
    kv_heads = [int(x) for x in _per_layer(g, "attention.head_count_kv", n_layer, n_head)]
    kv_local = [k for k, s in zip(kv_heads, swa) if s] or kv_heads
    kv_global = [k for k, s in zip(kv_heads, swa) if not s] or kv_heads
    k_eq_v = any(not s and f"blk.{i}.attn_v.weight" not in tensors and i < first_shared
                 for i, s in enumerate(swa))
    if len(set(kv_local)) > 1 or len(set(kv_global)) > 1 or (kv_local[0] != kv_global[0] and not k_eq_v):
        raise ModelFileError(f"{name}: K/V head counts {kv_heads} are not Gemma 4's")
    for k in set(kv_heads):
        if n_head % k:
            raise ModelFileError(f"{name}: {k} K/V heads do not divide {n_head} attention heads")
    head_swa = int(g.arch_key("attention.key_length_swa", head_dim))
    if int(g.arch_key("attention.value_length_swa", head_swa)) != head_swa or \
            int(g.arch_key("attention.value_length", head_dim)) != head_dim:
        raise ModelFileError(f"{name}: Gemma 4 needs equal key and value head sizes")
    n_pl = g.arch_key("embedding_length_per_layer_input")
    if n_pl is None:        # llama.cpp requires it (0 = no per-layer embeddings)
        raise ModelFileError(f"{name}: missing metadata 'gemma4.embedding_length_per_layer_input'")
    n_pl = int(n_pl)
    pl_rows = tensors.get("per_layer_token_embd.weight")
    softcap = g.arch_key("final_logit_softcapping")
    base = common["rope_theta"]
    base_swa = float(g.arch_key("rope.freq_base_swa", _DEFAULT_SWA_BASE))
    fields = {k: v for k, v in common.items() if k not in ("rope_theta", "intermediate_size")}
    fields["num_key_value_heads"] = kv_local[0]
    args = gemma4_text.ModelArgs(
        **fields, head_dim=head_swa, global_head_dim=head_dim, num_global_key_value_heads=kv_global[0],
        num_kv_shared_layers=n_shared, hidden_size_per_layer_input=n_pl,
        vocab_size_per_layer_input=int(pl_rows.shape[-1]) if pl_rows is not None else common["vocab_size"],
        intermediate_size=n_ff[0], use_double_wide_mlp=double, attention_k_eq_v=k_eq_v,
        sliding_window=window or common["max_position_embeddings"],
        layer_types=["sliding_attention" if s else "full_attention" for s in swa],
        final_logit_softcapping=float(softcap) if softcap else None,
        # plain RoPE here; after_load sets the rotated widths and global layers' factors from the file
        rope_parameters={"full_attention": {"rope_theta": base, "rope_type": "default",
                                            "linear_factor": _linear_scale(g)},
                         "sliding_attention": {"rope_theta": base_swa, "rope_type": "default"}},
        enable_moe_block=any(moe), num_experts=n_expert or None, top_k_experts=n_used or None,
        moe_intermediate_size=n_ff_exp or None)
    return gemma4_text.Model, args


def model_args(g, common: dict, head_dim: int):
    if g.architecture == "gemma4":
        return _gemma4_args(g, common, head_dim)
    return _gemma3_args(g, common, head_dim)


def _exact_embedding_scale(weights: dict, args) -> None:
    """gemma3_text scales the embeddings by sqrt(n_embd) rounded to bfloat16 (34.0 for Gemma 3 1B's
    1152, not 33.94), llama.cpp by sqrt(n_embd) itself: the embedding rows take the ratio, and a tied
    output head (the same rows) is given it back through the final norm (mlx-lm scales by 1+w).
    Measured on a 1152-wide F32 file (test_arch_gemma): |dlogit| median against llama.cpp 0.0028 -> 0.0013."""
    exact = math.sqrt(args.hidden_size)
    ratio = exact / mx.array(exact, dtype=mx.bfloat16).astype(mx.float32).item()
    if ratio == 1.0:
        return
    parts = [k for k in ("model.embed_tokens.weight", "model.embed_tokens.scales", "model.embed_tokens.biases")
             if k in weights and mx.issubdtype(weights[k].dtype, mx.floating)]
    for k in parts:                     # dense rows, or a quantized table's scales and biases
        weights[k] = (weights[k].astype(mx.float32) * ratio).astype(weights[k].dtype)
    if "lm_head.weight" not in weights and "model.norm.weight" in weights:
        w = weights["model.norm.weight"]
        weights["model.norm.weight"] = ((1.0 + w.astype(mx.float32)) / ratio - 1.0).astype(w.dtype)


def fix_weights(weights: dict, qparams: dict, g, args) -> None:
    if g.architecture == "gemma3":
        for k in list(weights):
            if k.endswith("norm.weight"):           # stored 1+w; gemma3_text adds the 1 itself
                weights[k] = weights[k] - 1.0
        _exact_embedding_scale(weights, args)
        return
    for i in range(args.num_hidden_layers):         # llama.cpp: no output scale tensor = scale 1
        weights.setdefault(f"model.layers.{i}.layer_scalar", mx.ones((1,)))
        _split_gate_up(weights, qparams, f"model.layers.{i}.experts.switch_glu.")
        if args.enable_moe_block:                   # no per-expert scale tensor = scale 1
            weights.setdefault(f"model.layers.{i}.router.per_expert_scale", mx.ones((args.num_experts,)))


def _split_gate_up(weights: dict, qparams: dict, prefix: str) -> None:
    """The fused expert gate/up stack (GGUF ffn_gate_up_exps: gate rows first, as Gemma4's
    experts.gate_up_proj) into gemma4_text's gate_proj and up_proj; a quantized stack's scales and
    biases split the same way (rows are independent)."""
    fused = prefix + "gate_up_proj"
    if f"{fused}.weight" not in weights:
        return
    for kind in ("weight", "scales", "biases"):
        if f"{fused}.{kind}" in weights:
            gate, up = mx.split(weights.pop(f"{fused}.{kind}"), 2, axis=-2)
            weights[f"{prefix}gate_proj.{kind}"] = mx.contiguous(gate)
            weights[f"{prefix}up_proj.{kind}"] = mx.contiguous(up)
    if fused in qparams:
        q = qparams.pop(fused)
        qparams[prefix + "gate_proj"] = q
        qparams[prefix + "up_proj"] = dict(q)


class _QuantInfo:
    """What mlx-lm's scaled_dot_product_attention reads of a quantized cache (bits, group size)."""

    def __init__(self, bits: int, group_size: int):
        self.bits, self.group_size = bits, group_size


@functools.lru_cache(maxsize=None)
def _sharing_attention(base: type) -> type:
    """gemma4_text's Attention for a K/V-sharing layer, also when the shared K/V is quantized (Strata's
    8/4-bit K/V): mlx-lm hands such a layer the source layer's quantized (packed, scales, biases)
    tuples but no cache, so its attention call has no bits to read and fails. This one reads them
    from the tuples' shapes and calls the same attention function (the module's, as patched)."""
    class SharingAttention(base):
        def __call__(self, x, mask=None, cache=None, shared_kv=None, offset=None):
            if shared_kv is None or not isinstance(shared_kv[0], tuple):
                return super().__call__(x, mask, cache, shared_kv=shared_kv, offset=offset)
            keys, values = shared_kv
            B, L, _ = x.shape
            q = self.q_norm(self.q_proj(x).reshape(B, L, self.n_heads, self.head_dim)).transpose(0, 2, 1, 3)
            q = self.rope(q, offset=offset)
            info = _QuantInfo(keys[0].shape[-1] * 32 // self.head_dim, self.head_dim // keys[1].shape[-1])
            out = gemma4_text.scaled_dot_product_attention(q, keys, values, cache=info, scale=self.scale,
                                                           mask=mask)
            return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1)), shared_kv, offset
    return SharingAttention


def after_load(model, g, args) -> str:
    if g.architecture != "gemma4":
        return ""
    for layer in model.model.layers:
        if not layer.self_attn.has_kv:
            layer.self_attn.__class__ = _sharing_attention(type(layer.self_attn))
    t = g.tensors().get("rope_freqs.weight")
    factors = mx.array(np.asarray(t.data, dtype=np.float32).reshape(-1)) if t is not None else None
    n_rot = int(g.arch_key("rope.dimension_count", args.global_head_dim))
    n_rot_swa = int(g.arch_key("rope.dimension_count_swa", args.head_dim))
    full = args.rope_parameters["full_attention"]
    for layer in model.model.layers:
        attn = layer.self_attn
        if attn.is_sliding:
            attn.rope = nn.RoPE(n_rot_swa, traditional=False,
                                base=args.rope_parameters["sliding_attention"]["rope_theta"])
        elif factors is not None:
            if factors.size * 2 != attn.head_dim:
                raise ModelFileError(f"{g.path.name}: rope_freqs.weight has {factors.size} factors for a "
                                     f"global head size of {attn.head_dim}")
            # linear scaling divides the positions: the same as multiplying every period
            attn.rope = FactorRoPE(attn.head_dim, full["rope_theta"], False, factors * full["linear_factor"])
        else:
            attn.rope = nn.RoPE(n_rot, traditional=False, base=full["rope_theta"],
                                scale=1.0 / full["linear_factor"])
    return "global layers: RoPE factors from rope_freqs.weight" if factors is not None else ""


ARCH = Architecture(name="gemma", model_args=model_args, tensor_name=tensor_name, own_names=True,
                    fix_weights=fix_weights, after_load=after_load)
