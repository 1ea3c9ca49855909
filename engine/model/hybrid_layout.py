"""Which layers of a hybrid recurrent GGUF keep K/V and what the others hold instead, from the header
alone (plain Python: the memory estimate and the app's model list use it, no mlx).

Qwen3.5 / Qwen3.6 (`qwen35`, `qwen35moe`): of the block_count - nextn_predict_layers main blocks,
every `full_attention_interval`-th is full attention (K/V per token); the others are Gated DeltaNet
layers, each holding per sequence, whatever its length (mlx-lm's ArraysCache of two arrays):

* the convolution state: (ssm.conv_kernel - 1) x conv_dim in the compute dtype, conv_dim =
  2 x group_count x state_size + inner_size;
* the recurrent state: time_step_rank x (inner_size / time_step_rank) x state_size in float32
  (mlx-lm's gated_delta_update keeps it in float32 whatever the model computes in).
"""
from __future__ import annotations

from dataclasses import dataclass

from engine.errors import ModelFileError
from engine.model.gguf_schema import check_blocks

HYBRID_ARCHITECTURES = ("qwen35", "qwen35moe")
STATE_DTYPE_BYTES = 4          # the DeltaNet state is float32


@dataclass(frozen=True)
class HybridLayout:
    n_layer: int               # main blocks
    n_attention: int           # of them, full attention (K/V per token)
    n_recurrent: int           # of them, fixed state per sequence
    conv_values: int           # per recurrent layer: convolution state values (compute dtype)
    state_values: int          # per recurrent layer: recurrent state values (float32)

    def state_bytes(self, dtype_bytes: int) -> int:
        """Bytes one sequence's recurrent and convolution states take, whatever its length."""
        return self.n_recurrent * (self.conv_values * dtype_bytes + self.state_values * STATE_DTYPE_BYTES)


def layout(h) -> HybridLayout | None:
    """The layout of header `h` (memory_estimate.GGUFHeader), or None for an architecture that keeps
    K/V in every layer."""
    if h.architecture not in HYBRID_ARCHITECTURES:
        return None
    n_block = check_blocks(h.view())        # bounded by the tensor table, not by the header's word
    n_layer = n_block - h.arch_int("nextn_predict_layers", 0)
    interval = h.arch_int("full_attention_interval", 4)
    n_k, n_v = h.arch_int("ssm.group_count"), h.arch_int("ssm.time_step_rank")
    d_state, d_inner, d_conv = h.arch_int("ssm.state_size"), h.arch_int("ssm.inner_size"), h.arch_int("ssm.conv_kernel")
    if n_layer < 1 or interval < 1 or min(n_k, n_v, d_state, d_inner, d_conv) < 1 or d_inner % n_v:
        raise ModelFileError(f"{h.path.name}: missing or bad '{h.architecture}' layer layout (block_count, "
                             "nextn_predict_layers, full_attention_interval, ssm.*)")
    n_attention = n_layer // interval       # layers interval-1, 2*interval-1, ...
    conv_dim = 2 * n_k * d_state + d_inner
    return HybridLayout(n_layer, n_attention, n_layer - n_attention, (d_conv - 1) * conv_dim,
                        n_v * (d_inner // n_v) * d_state)
