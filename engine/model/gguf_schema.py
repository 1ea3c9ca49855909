"""The declared schema of the families read through engine/model/archs/ (Gemma 3, Gemma 4, gpt-oss, Qwen3.5 /
Qwen3.6): every header value they read, checked for its range and against the tensor table, and every
tensor they need, checked for its presence and shape, before anything is sized from them.

A hostile header would otherwise reach the layout code with a block count of 2^32 - 1 (a per-layer list
of four billion entries: a hang, or MemoryError), a RoPE width of 65535 (MLX: "dims must be even"), a
NaN width (a ValueError deep in the loader), or a missing per-block tensor (a KeyError in fix_weights).

Plain Python (no numpy, no mlx): the memory estimate and the app's model list run these checks on the
header alone (memory_estimate.GGUFHeader), the loader on the opened file (gguf_checks). Both hand over a
HeaderView; each failure is a ModelFileError of one line naming the key or the tensor.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from engine.errors import ModelFileError

MAX_WIDTH = 1 << 17            # embedding / feed-forward width: 8x the largest current models
MAX_LAYERS = 1 << 12
MAX_HEAD_DIM = 1 << 12
MAX_HEADS = 1 << 12
MAX_CONTEXT = 1 << 24          # 16M positions; current models stop at 1-10M
MAX_VOCAB = 1 << 24
MAX_EXPERTS = 1 << 12          # 32x the largest current mixtures
MAX_CONV_KERNEL = 1 << 8       # the DeltaNet's short convolution: 4 in every current model
MAX_THETA = 1e12
MAX_FACTOR = 1e6               # RoPE scaling factors, soft-caps, multipliers
# a block index of at most 9 digits: int() of a longer digit run is refused by Python itself
BLOCK_RE = re.compile(r"blk\.(\d{1,9})\.")


@dataclass(frozen=True)
class ArrayLen:
    """An array value too long to be a per-layer one (more than MAX_LAYERS elements): its length only."""
    n: int


@dataclass(frozen=True)
class HeaderView:
    """What the checks read of a GGUF header, from either reader."""
    file: str                                   # the file's name, for the messages
    arch: str
    values: Mapping[str, Any]                   # "<arch>.<suffix>" -> int / float / bool / str, a tuple
                                                # (an array of up to MAX_LAYERS elements) or ArrayLen
    tensors: Mapping[str, tuple[int, ...]]      # name -> shape, GGUF order (ne0 first)

    def raw(self, suffix: str, default: Any = None) -> Any:
        return self.values.get(f"{self.arch}.{suffix}", default)

    def key(self, suffix: str) -> str:
        return f"'{self.arch}.{suffix}'"

    def bad(self, what: str) -> ModelFileError:
        return ModelFileError(f"{self.file}: {what}")


# ---- values --------------------------------------------------------------------------------------
def _whole(view: HeaderView, suffix: str, v: Any, lo: int, hi: int) -> int:
    if isinstance(v, (tuple, ArrayLen)):
        raise view.bad(f"{view.key(suffix)} must be one value, the file has an array")
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise view.bad(f"{view.key(suffix)} must be an integer, got {v!r:.40}")
    if isinstance(v, float):
        if not (math.isfinite(v) and v.is_integer()):
            raise view.bad(f"{view.key(suffix)} is {v}, not a whole number")
        v = int(v)
    if not lo <= v <= hi:
        raise view.bad(f"{view.key(suffix)} is {v}, outside {lo}..{hi}")
    return v


def int_key(view: HeaderView, suffix: str, default: int | None = None, *, lo: int = 1, hi: int) -> int:
    """`<arch>.<suffix>` as a whole number in lo..hi; `default` when absent (None: required)."""
    v = view.raw(suffix, default)
    if v is None:
        raise view.bad(f"missing metadata {view.key(suffix)}")
    return _whole(view, suffix, v, lo, hi)


def float_key(view: HeaderView, suffix: str, default: float, *, lo: float, hi: float,
              lo_open: bool = True) -> float:
    """`<arch>.<suffix>` as a finite number in (lo, hi] (or [lo, hi] when not lo_open)."""
    v = view.raw(suffix, default)
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise view.bad(f"{view.key(suffix)} must be a number, got {v!r:.40}")
    v = float(v)
    if not (math.isfinite(v) and (lo < v if lo_open else lo <= v) and v <= hi):
        raise view.bad(f"{view.key(suffix)} is {v}; it must be finite, {'>' if lo_open else '>='} {lo} "
                       f"and <= {hi}")
    return v


def per_layer(view: HeaderView, suffix: str, n_layer: int, default: int | None = None, *,
              lo: int = 1, hi: int) -> tuple[int, ...]:
    """A key that is one value or one per layer (llama.cpp's get_key_or_arr), as n_layer values."""
    v = view.raw(suffix, default)
    if v is None:
        raise view.bad(f"missing metadata {view.key(suffix)}")
    if isinstance(v, (tuple, ArrayLen)):
        n = v.n if isinstance(v, ArrayLen) else len(v)
        if n != n_layer:
            raise view.bad(f"{view.key(suffix)} has {n} values for {n_layer} layers")
        return tuple(_whole(view, suffix, int(x) if isinstance(x, bool) else x, lo, hi) for x in v)
    return (_whole(view, suffix, int(v) if isinstance(v, bool) else v, lo, hi),) * n_layer


def rope_dims(view: HeaderView, suffix: str, head: int) -> int:
    """A RoPE width: 2..the head size, even (RoPE turns pairs); the head size when absent."""
    n = int_key(view, suffix, head, lo=2, hi=head)
    if n % 2:
        raise view.bad(f"{view.key(suffix)} is {n}: RoPE turns pairs of dimensions, it must be even")
    return n


# ---- the shared part -----------------------------------------------------------------------------
def check_blocks(view: HeaderView) -> int:
    """block_count within MAX_LAYERS and exactly the blocks whose tensors are present: every per-layer
    structure is sized from it, so it is bounded by the file itself."""
    n_layer = int_key(view, "block_count", hi=MAX_LAYERS)
    present = {int(m.group(1)) for t in view.tensors if (m := BLOCK_RE.match(t))}
    if present != set(range(n_layer)):
        extra = sorted(present - set(range(n_layer)))[:3]
        missing = sorted(set(range(n_layer)) - present)[:3]
        raise view.bad(f"block_count is {n_layer} but the file has tensors for {len(present)} blocks"
                       + (f" (unexpected blocks {extra})" if extra else "")
                       + (f" (missing blocks {missing})" if missing else ""))
    return n_layer


@dataclass(frozen=True)
class Common:
    """The hyperparameters every family has, checked (the ranges gguf_checks gives them)."""
    n_layer: int
    n_embd: int
    n_head: int
    head: int                   # key_length, or width / heads
    context: int


def common(view: HeaderView) -> Common:
    n_layer = check_blocks(view)
    n_embd = int_key(view, "embedding_length", hi=MAX_WIDTH)
    n_head = int_key(view, "attention.head_count", hi=MAX_HEADS)
    if view.raw("attention.key_length") is None:
        head = n_embd // n_head
        if head < 1:
            raise view.bad(f"{n_head} attention heads are more than the width {n_embd}")
    else:
        head = int_key(view, "attention.key_length", hi=MAX_HEAD_DIM)
    context = int_key(view, "context_length", 4096, hi=MAX_CONTEXT)
    _value_length(view)
    return Common(n_layer, n_embd, n_head, head, context)


def _value_length(view: HeaderView) -> None:
    """value_length sizes the K/V in the memory estimate: a head size like key_length."""
    if view.raw("attention.value_length") is not None:
        int_key(view, "attention.value_length", hi=MAX_HEAD_DIM)


def _same(view: HeaderView, suffix: str, want: int, what: str) -> None:
    """An optional key that must agree with what the tensors (or key_length) say: the estimate reads it."""
    if view.raw(suffix) is not None and int_key(view, suffix, hi=MAX_WIDTH) != want:
        raise view.bad(f"{view.key(suffix)} is {view.raw(suffix)}, but {what} is {want}")


def tensor(view: HeaderView, name: str, *shape: int, required: bool = True) -> None:
    """Tensor `name` present (unless not required) with exactly `shape` (GGUF order)."""
    got = view.tensors.get(name)
    if got is None:
        if required:
            raise view.bad(f"tensor '{name}' is missing (a {view.arch} model needs it)")
        return
    if tuple(got) != shape:
        raise view.bad(f"tensor '{name}' has shape {list(got)}, the hyperparameters need {list(shape)}")


def _finite_numbers(view: HeaderView, suffixes: tuple[str, ...]) -> None:
    for s in suffixes:
        if view.raw(s) is not None:
            float_key(view, s, 0.0, lo=-MAX_FACTOR, hi=MAX_FACTOR, lo_open=False)


def _experts(view: HeaderView, required: bool) -> tuple[int, int]:
    n_expert = int_key(view, "expert_count", None if required else 0, lo=1 if required else 0, hi=MAX_EXPERTS)
    if n_expert == 0:
        return 0, 0
    return n_expert, int_key(view, "expert_used_count", lo=1, hi=n_expert)


# ---- the families --------------------------------------------------------------------------------
def _gemma_common(view: HeaderView, c: Common) -> int:
    """What Gemma 3 and 4 share: window, soft-cap, the sliding layers' RoPE base. Returns the window."""
    # within the context: checked where it is used (engine/model/archs/gemma.py), bounded here
    window = int_key(view, "attention.sliding_window", 0, lo=0, hi=MAX_CONTEXT)
    float_key(view, "final_logit_softcapping", 0.0, lo=0.0, hi=MAX_FACTOR, lo_open=False)
    float_key(view, "rope.freq_base_swa", 10000.0, lo=0.0, hi=MAX_THETA)
    if view.raw("rope.scaling.factor") is not None:
        float_key(view, "rope.scaling.factor", 1.0, lo=0.0, hi=MAX_FACTOR)
    return window


def _gemma3(view: HeaderView, c: Common) -> None:
    window = _gemma_common(view, c)
    pattern = view.raw("attention.sliding_window_pattern")
    if window and pattern is not None:
        int_key(view, "attention.sliding_window_pattern", lo=1, hi=c.n_layer)
    if int_key(view, "attention.value_length", c.head, hi=MAX_HEAD_DIM) != c.head:
        raise view.bad(f"{view.key('attention.value_length')} must equal the key length {c.head}")
    rope_dims(view, "rope.dimension_count", c.head)
    n_ff = int_key(view, "feed_forward_length", hi=MAX_WIDTH)
    n_kv = int_key(view, "attention.head_count_kv", c.n_head, hi=c.n_head)
    n, q, kv = c.n_embd, c.n_head * c.head, n_kv * c.head
    for i in range(c.n_layer):
        p = f"blk.{i}."
        for part in ("attn_norm", "post_attention_norm", "ffn_norm", "post_ffw_norm"):
            tensor(view, p + part + ".weight", n)
        tensor(view, p + "attn_q.weight", n, q)
        tensor(view, p + "attn_k.weight", n, kv)
        tensor(view, p + "attn_v.weight", n, kv)
        tensor(view, p + "attn_q_norm.weight", c.head)
        tensor(view, p + "attn_k_norm.weight", c.head)
        tensor(view, p + "attn_output.weight", q, n)
        _dense_ffn(view, p, n, n_ff)
    tensor(view, "output_norm.weight", n)


def _dense_ffn(view: HeaderView, p: str, n: int, n_ff: int) -> None:
    tensor(view, p + "ffn_gate.weight", n, n_ff)
    tensor(view, p + "ffn_up.weight", n, n_ff)
    tensor(view, p + "ffn_down.weight", n_ff, n)


@dataclass(frozen=True)
class _Gemma4Layers:
    sliding: tuple[int, ...]
    n_ff: tuple[int, ...]
    kv_heads: tuple[int, ...]
    head_swa: int
    n_shared: int
    n_per_layer: int


def _gemma4_layers(view: HeaderView, c: Common) -> _Gemma4Layers:
    sliding = per_layer(view, "attention.sliding_window_pattern", c.n_layer, lo=0, hi=1)
    n_ff = per_layer(view, "feed_forward_length", c.n_layer, hi=MAX_WIDTH)
    kv = per_layer(view, "attention.head_count_kv", c.n_layer, c.n_head, hi=c.n_head)
    head_swa = int_key(view, "attention.key_length_swa", c.head, hi=MAX_HEAD_DIM)
    if int_key(view, "attention.value_length_swa", head_swa, hi=MAX_HEAD_DIM) != head_swa or \
            int_key(view, "attention.value_length", c.head, hi=MAX_HEAD_DIM) != c.head:
        raise view.bad("Gemma 4 needs equal key and value head sizes (attention.value_length, value_length_swa)")
    n_shared = int_key(view, "attention.shared_kv_layers", 0, lo=0, hi=c.n_layer - 1)
    n_pl = int_key(view, "embedding_length_per_layer_input", lo=0, hi=MAX_WIDTH)
    rope_dims(view, "rope.dimension_count", c.head)
    rope_dims(view, "rope.dimension_count_swa", head_swa)
    return _Gemma4Layers(sliding, n_ff, kv, head_swa, n_shared, n_pl)


def _gemma4(view: HeaderView, c: Common) -> None:
    _gemma_common(view, c)
    lay = _gemma4_layers(view, c)
    n_expert, _ = _experts(view, required=False)
    if n_expert:
        int_key(view, "expert_feed_forward_length", hi=MAX_WIDTH)
    n = c.n_embd
    for i in range(c.n_layer):
        p, hd = f"blk.{i}.", lay.head_swa if lay.sliding[i] else c.head
        q, kv = c.n_head * hd, lay.kv_heads[i] * hd
        for part in ("attn_norm", "post_attention_norm", "ffn_norm", "post_ffw_norm"):
            tensor(view, p + part + ".weight", n)
        tensor(view, p + "attn_q.weight", n, q)
        tensor(view, p + "attn_q_norm.weight", hd)
        tensor(view, p + "attn_output.weight", q, n)
        if i < c.n_layer - lay.n_shared:      # the K/V-sharing layers have none of their own
            tensor(view, p + "attn_k.weight", n, kv)
            tensor(view, p + "attn_k_norm.weight", hd)
            # a global layer may take V = K (31B): no attn_v there
            tensor(view, p + "attn_v.weight", n, kv, required=bool(lay.sliding[i]))
        _dense_ffn(view, p, n, lay.n_ff[i])
        tensor(view, p + "layer_output_scale.weight", 1, required=False)
        if lay.n_per_layer:
            tensor(view, p + "inp_gate.weight", n, lay.n_per_layer)
            tensor(view, p + "proj.weight", lay.n_per_layer, n)
            tensor(view, p + "post_norm.weight", n)
    tensor(view, "output_norm.weight", n)
    if lay.n_per_layer:
        rows = view.tensors.get("per_layer_token_embd.weight")
        if rows is None or len(rows) != 2 or rows[0] != c.n_layer * lay.n_per_layer or rows[1] < 1:
            raise view.bad(f"tensor 'per_layer_token_embd.weight' has shape {None if rows is None else list(rows)}, "
                           f"the hyperparameters need [{c.n_layer * lay.n_per_layer}, vocabulary]")
        tensor(view, "per_layer_model_proj.weight", n, c.n_layer * lay.n_per_layer)
        tensor(view, "per_layer_proj_norm.weight", lay.n_per_layer)


def _gpt_oss(view: HeaderView, c: Common) -> None:
    int_key(view, "attention.sliding_window", lo=1, hi=MAX_CONTEXT)    # <= the context: archs/gpt_oss.py
    n_expert, _ = _experts(view, required=True)
    if view.raw("rope.scaling.type") is not None:
        float_key(view, "rope.scaling.factor", 1.0, lo=0.0, hi=MAX_FACTOR)
        int_key(view, "rope.scaling.original_context_length", 4096, hi=MAX_CONTEXT)
        float_key(view, "rope.scaling.yarn_beta_fast", 32.0, lo=0.0, hi=MAX_FACTOR)
        float_key(view, "rope.scaling.yarn_beta_slow", 1.0, lo=0.0, hi=MAX_FACTOR)
    n_kv = int_key(view, "attention.head_count_kv", c.n_head, hi=c.n_head)
    up = view.tensors.get("blk.0.ffn_up_exps.weight")
    if up is None or len(up) != 3 or not 1 <= up[1] <= MAX_WIDTH:
        raise view.bad(f"tensor 'blk.0.ffn_up_exps.weight' has shape {None if up is None else list(up)}, "
                       f"the hyperparameters need [{c.n_embd}, n_ff, {n_expert}]")
    n, ff, e, q, kv = c.n_embd, up[1], n_expert, c.n_head * c.head, n_kv * c.head
    _same(view, "expert_feed_forward_length", ff, "the experts' width in blk.0.ffn_up_exps.weight")
    _same(view, "attention.value_length", c.head, "the key length")
    for i in range(c.n_layer):
        p = f"blk.{i}."
        tensor(view, p + "attn_norm.weight", n)
        tensor(view, p + "post_attention_norm.weight", n)
        for part, rows in (("attn_q", q), ("attn_k", kv), ("attn_v", kv)):
            tensor(view, p + part + ".weight", n, rows)
            tensor(view, p + part + ".bias", rows)
        tensor(view, p + "attn_output.weight", q, n)
        tensor(view, p + "attn_output.bias", n)
        tensor(view, p + "attn_sinks.weight", c.n_head)
        tensor(view, p + "ffn_gate_inp.weight", n, e)
        tensor(view, p + "ffn_gate_inp.bias", e)
        for part in ("ffn_gate_exps", "ffn_up_exps"):
            tensor(view, p + part + ".weight", n, ff, e)
            tensor(view, p + part + ".bias", ff, e)
        tensor(view, p + "ffn_down_exps.weight", ff, n, e)
        tensor(view, p + "ffn_down_exps.bias", n, e)
    tensor(view, "output_norm.weight", n)
    tensor(view, "output.weight", n, view.tensors.get("token_embd.weight", (0, 0))[-1])


@dataclass(frozen=True)
class _Hybrid:
    n_layer: int                # main blocks
    interval: int
    n_k: int
    n_v: int
    d_state: int
    d_inner: int
    d_conv: int

    @property
    def conv_dim(self) -> int:
        return 2 * self.n_k * self.d_state + self.d_inner


def hybrid(view: HeaderView, n_block: int) -> _Hybrid:
    """Qwen3.5/3.6's layer layout keys, checked (engine/model/hybrid_layout.py and archs/qwen35.py size from them)."""
    n_nextn = int_key(view, "nextn_predict_layers", 0, lo=0, hi=n_block - 1)
    n_layer = n_block - n_nextn
    interval = int_key(view, "full_attention_interval", 4, hi=n_layer)
    n_k = int_key(view, "ssm.group_count", hi=MAX_HEADS)
    n_v = int_key(view, "ssm.time_step_rank", hi=MAX_HEADS)
    d_state = int_key(view, "ssm.state_size", hi=MAX_HEAD_DIM)
    d_inner = int_key(view, "ssm.inner_size", hi=MAX_WIDTH)
    d_conv = int_key(view, "ssm.conv_kernel", hi=MAX_CONV_KERNEL)
    if n_v % n_k or d_inner % n_v or d_inner // n_v != d_state:
        raise view.bad(f"bad {view.arch}.ssm.* sizes (group_count {n_k}, time_step_rank {n_v}, state_size "
                       f"{d_state}, inner_size {d_inner}): the value heads must be a multiple of the key "
                       "heads, each of state_size values")
    return _Hybrid(n_layer, interval, n_k, n_v, d_state, d_inner, d_conv)


def _qwen35(view: HeaderView, c: Common) -> None:
    h = hybrid(view, c.n_layer)
    rope_dims(view, "rope.dimension_count", c.head)
    n_kv = int_key(view, "attention.head_count_kv", c.n_head, hi=c.n_head)
    moe = view.arch == "qwen35moe"
    n_expert = _experts(view, required=True)[0] if moe else 0
    if moe:
        _finite_numbers(view, ("expert_weights_scale",))
    n, q, kv = c.n_embd, c.n_head * c.head, n_kv * c.head
    _same(view, "attention.value_length", c.head, "the key length")
    n_ff = 0 if moe else int_key(view, "feed_forward_length", hi=MAX_WIDTH)
    for i in range(h.n_layer):
        p = f"blk.{i}."
        tensor(view, p + "attn_norm.weight", n)
        tensor(view, p + "post_attention_norm.weight", n)
        if (i + 1) % h.interval:
            _deltanet(view, p, n, h)
        else:
            tensor(view, p + "attn_q.weight", n, 2 * q)       # per head [query, gate]
            tensor(view, p + "attn_k.weight", n, kv)
            tensor(view, p + "attn_v.weight", n, kv)
            tensor(view, p + "attn_q_norm.weight", c.head)
            tensor(view, p + "attn_k_norm.weight", c.head)
            tensor(view, p + "attn_output.weight", q, n)
        if moe:
            _qwen35_experts(view, p, n, n_expert)
        else:
            _dense_ffn(view, p, n, n_ff)
    tensor(view, "output_norm.weight", n)


def _deltanet(view: HeaderView, p: str, n: int, h: _Hybrid) -> None:
    tensor(view, p + "attn_qkv.weight", n, h.conv_dim)
    tensor(view, p + "attn_gate.weight", n, h.d_inner)
    tensor(view, p + "ssm_beta.weight", n, h.n_v)
    tensor(view, p + "ssm_alpha.weight", n, h.n_v)
    tensor(view, p + "ssm_a", h.n_v)
    tensor(view, p + "ssm_dt.bias", h.n_v)
    tensor(view, p + "ssm_conv1d.weight", h.d_conv, h.conv_dim)
    tensor(view, p + "ssm_norm.weight", h.d_state)
    tensor(view, p + "ssm_out.weight", h.d_inner, n)


def _qwen35_experts(view: HeaderView, p: str, n: int, e: int) -> None:
    down = view.tensors.get(p + "ffn_down_exps.weight")
    if down is None or len(down) != 3 or not 1 <= down[0] <= MAX_WIDTH:
        raise view.bad(f"tensor '{p}ffn_down_exps.weight' has shape {None if down is None else list(down)}, "
                       f"the hyperparameters need [n_ff, {n}, {e}]")
    ff = down[0]
    tensor(view, p + "ffn_down_exps.weight", ff, n, e)
    tensor(view, p + "ffn_gate_inp.weight", n, e)
    if p + "ffn_gate_up_exps.weight" in view.tensors:       # fused: gate rows, then up rows
        tensor(view, p + "ffn_gate_up_exps.weight", n, 2 * ff, e)
    else:
        tensor(view, p + "ffn_gate_exps.weight", n, ff, e)
        tensor(view, p + "ffn_up_exps.weight", n, ff, e)
    sh = view.tensors.get(p + "ffn_up_shexp.weight")
    if sh is None or len(sh) != 2 or not 1 <= sh[1] <= MAX_WIDTH:
        raise view.bad(f"tensor '{p}ffn_up_shexp.weight' has shape {None if sh is None else list(sh)}, "
                       f"the hyperparameters need [{n}, n_ff]")
    tensor(view, p + "ffn_up_shexp.weight", n, sh[1])
    tensor(view, p + "ffn_gate_shexp.weight", n, sh[1])
    tensor(view, p + "ffn_down_shexp.weight", sh[1], n)
    tensor(view, p + "ffn_gate_inp_shexp.weight", n)
    _same(view, "expert_feed_forward_length", ff, f"the experts' width in {p}ffn_down_exps.weight")
    _same(view, "expert_shared_feed_forward_length", sh[1], f"the shared expert's width in {p}ffn_up_shexp.weight")


def _gemma4_assistant(view: HeaderView, c: Common) -> None:
    """Gemma 4's MTP drafter (engine/model/archs/gemma4_mtp.py): its blocks read the target's K/V, so it has
    per-block sizes and RoPE widths but no K/V tensors; the target match is checked at its load."""
    int_key(view, "embedding_length_out", hi=MAX_WIDTH)
    per_layer(view, "attention.sliding_window_pattern", c.n_layer, lo=0, hi=1)
    per_layer(view, "feed_forward_length", c.n_layer, hi=MAX_WIDTH)
    per_layer(view, "attention.head_count_kv", c.n_layer, c.n_head, hi=c.n_head)
    head_swa = int_key(view, "attention.key_length_swa", c.head, hi=MAX_HEAD_DIM)
    int_key(view, "attention.value_length_swa", head_swa, hi=MAX_HEAD_DIM)
    int_key(view, "attention.sliding_window", 0, lo=0, hi=MAX_CONTEXT)
    rope_dims(view, "rope.dimension_count", c.head)
    rope_dims(view, "rope.dimension_count_swa", head_swa)
    float_key(view, "rope.freq_base", 10000.0, lo=0.0, hi=MAX_THETA)
    float_key(view, "rope.freq_base_swa", 10000.0, lo=0.0, hi=MAX_THETA)
    float_key(view, "attention.layer_norm_rms_epsilon", 1e-6, lo=0.0, hi=1.0)
    for i in range(c.n_layer):
        tensor(view, f"blk.{i}.attn_norm.weight", c.n_embd)


_FAMILIES: dict[str, Callable[[HeaderView, Common], None]] = {
    "gemma3": _gemma3, "gemma4": _gemma4, "gpt-oss": _gpt_oss, "qwen35": _qwen35, "qwen35moe": _qwen35,
    "gemma4-assistant": _gemma4_assistant,
}
# numbers the other families read as they are (engine/model/archs/family_rope.positive checks its own)
_FINITE = ("attention.temperature_scale", "rope.scaling.yarn_log_multiplier", "rope.scaling.attn_factor",
           "expert_weights_scale")


def check_view(view: HeaderView) -> None:
    """Every value `view`'s architecture reads, and every tensor it needs; ModelFileError on the first
    problem. Other architectures get the block count and the finite numbers (gguf_checks has the rest)."""
    # an empty dimension holds no bytes, so it fits any file; the layers sized from it divide by it
    empty = next((n for n, shape in view.tensors.items() if 0 in shape), None)
    if empty is not None:
        raise view.bad(f"tensor '{empty}' has shape {list(view.tensors[empty])}: a dimension of 0")
    family = _FAMILIES.get(view.arch)
    if family is None:
        check_blocks(view)
        _value_length(view)
        _finite_numbers(view, _FINITE)
        if view.raw("rope.scaling.original_context_length") is not None:     # 0: not set (mistral3)
            int_key(view, "rope.scaling.original_context_length", lo=0, hi=MAX_CONTEXT)
        return
    family(view, common(view))
