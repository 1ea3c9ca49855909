"""Mixture-of-experts GGUFs on mlx-lm's MoE model classes.

Architectures (GGUF ``general.architecture`` -> mlx-lm module):

* ``qwen3moe``                           -> ``mlx_lm.models.qwen3_moe`` (every block sparse)
* ``qwen2moe``                           -> ``mlx_lm.models.qwen2_moe`` (routed experts + a shared
                                            expert gated by sigmoid(``ffn_gate_inp_shexp`` . x))
* ``llama`` with ``llama.expert_count``  -> ``mlx_lm.models.mixtral`` (Mixtral-style; also the
                                            pre-2024 layout with one tensor per expert, stacked at load)

Tensors: the stacked ``blk.N.ffn_{gate,up,down}_exps.weight`` (GGUF shape [in, out, n_expert], i.e.
MLX (n_expert, out, in)) are exactly ``SwitchLinear``'s layout, so each becomes one
``SwitchLinear`` (dense GGUF types) or ``QuantizedSwitchLinear`` (block-quantized types, converted by
``engine.model.quants`` exactly as the dense path converts 2-D weights: the same affine group-32 triples,
evaluated with ``mx.gather_qmm``; never dequantized whole). ``ffn_gate_inp`` is the router,
``ffn_{gate,up,down}_shexp`` the shared expert, ``ffn_gate_inp_shexp`` its one-output gate.

Routing is llama.cpp's ``build_moe_ffn`` with the flags each architecture's graph passes it (the
same in mlx-lm's blocks, checked by the tests against llama.cpp):

=========  ===============================  ======================  ===================
arch       probabilities                    top-k weights           shared expert
=========  ===============================  ======================  ===================
qwen3moe   softmax over all router logits   renormalised to sum 1   --
qwen2moe   softmax over all router logits   used as they are        + sigmoid-gated
llama      softmax over all router logits   renormalised to sum 1   --
=========  ===============================  ======================  ===================

(mlx-lm's Mixtral block takes a softmax over the top-k logits, which is the same thing as the
renormalised top-k of the full softmax.) llama.cpp hard-codes the normalisation per architecture
for these three and ignores ``{arch}.expert_weights_norm``; so does Strata. A file asking for an
``expert_weights_scale`` other than 1 is refused: none of these models has one and mlx-lm's blocks
do not apply it.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

from mlx_lm.models import mixtral, qwen2_moe, qwen3_moe

from engine.errors import ModelFileError
from engine.model.gguf_file import GGUFFile

MOE_ARCHITECTURES = ("qwen2moe", "qwen3moe")  # plus "llama" with llama.expert_count > 0

# GGUF block tensor -> attribute path under the layer's MoE block (mlx-lm naming)
_MOE_BLOCK_NAMES = {
    "ffn_gate_inp": "gate",
    "ffn_gate_exps": "switch_mlp.gate_proj",
    "ffn_up_exps": "switch_mlp.up_proj",
    "ffn_down_exps": "switch_mlp.down_proj",
    "ffn_gate_shexp": "shared_expert.gate_proj",
    "ffn_up_shexp": "shared_expert.up_proj",
    "ffn_down_shexp": "shared_expert.down_proj",
    "ffn_gate_inp_shexp": "shared_expert_gate",
}
_BLOCK_RE = re.compile(r"blk\.(\d+)\.(\w+)")
_SPLIT_RE = re.compile(r"blk\.(\d+)\.ffn_(gate|up|down)\.(\d+)")   # one expert per tensor (old Mixtral)
_SPLIT_NAMES = {"gate": "w1", "down": "w2", "up": "w3"}               # mlx-lm mixtral's HF names
_SWITCH_NAMES = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}


@dataclass(frozen=True)
class MoeSpec:
    """What the loader needs to know about a MoE file beyond the dense hyperparameters."""
    model_type: str          # mlx-lm module: qwen3_moe, qwen2_moe, mixtral
    n_expert: int
    n_expert_used: int
    n_ff_exp: int
    n_ff_shexp: int          # 0 without a shared expert
    norm_topk: bool          # renormalise the top-k weights (llama.cpp's norm_w)
    block_attr: str          # the layer attribute holding the MoE block: mlp / block_sparse_moe

    def describe(self) -> str:
        shared = f", shared expert {self.n_ff_shexp} wide" if self.n_ff_shexp else ""
        weights = "renormalised" if self.norm_topk else "not renormalised"
        return (f"MoE: {self.n_expert} experts x {self.n_ff_exp}, top-{self.n_expert_used} of softmax "
                f"({weights}){shared}")


def expert_count(g: GGUFFile) -> int:
    try:
        return int(g.arch_key("expert_count", 0) or 0)
    except (TypeError, ValueError, OverflowError):      # OverflowError: inf
        raise ModelFileError(f"{g.path.name}: bad '{g.architecture}.expert_count'") from None


def is_moe(g: GGUFFile) -> bool:
    return g.architecture in MOE_ARCHITECTURES or (g.architecture == "llama" and expert_count(g) > 0)


def _tensor_shape(g: GGUFFile, name: str) -> tuple[int, ...] | None:
    """MLX-order shape of a tensor, or None when the file lacks it."""
    t = g.tensors().get(name)
    return None if t is None else tuple(int(x) for x in reversed(list(t.shape)))


def moe_spec(g: GGUFFile) -> MoeSpec:
    arch, name = g.architecture, g.path.name
    n_expert = expert_count(g)
    try:
        n_used = int(g.arch_key("expert_used_count", 0) or 0)
        scale = float(g.arch_key("expert_weights_scale", 0.0) or 0.0)
    except (TypeError, ValueError, OverflowError):
        raise ModelFileError(f"{name}: bad '{arch}.expert_*' hyperparameters") from None
    if not math.isfinite(scale):
        raise ModelFileError(f"{name}: bad '{arch}.expert_weights_scale' ({scale})")
    if n_expert <= 0 or not 0 < n_used <= n_expert:
        raise ModelFileError(f"{name}: {arch} needs {arch}.expert_count > 0 and 0 < expert_used_count <= "
                             f"expert_count (got {n_expert} and {n_used})")
    if scale not in (0.0, 1.0):
        raise ModelFileError(f"{name}: {arch}.expert_weights_scale = {scale} is not supported")
    tensors = g.tensors()
    split = any(_SPLIT_RE.fullmatch(t.rpartition(".")[0]) for t in tensors)
    if split:
        # Mixtral GGUFs converted before 2024: one 2-D tensor per expert (blk.N.ffn_gate.E.weight).
        # Current llama.cpp no longer loads them (llama-cpp-python 0.3.36 refuses the file); Strata
        # stacks them per layer at load, giving exactly the stacked layout's model (tested).
        up = _tensor_shape(g, "blk.0.ffn_up.0.weight")
        if arch != "llama" or up is None or len(up) != 2:
            raise ModelFileError(f"{name}: per-expert tensors (blk.N.ffn_up.E.weight) are only read for "
                                 f"Mixtral-style llama files (found {arch}, blk.0.ffn_up.0.weight {up})")
        n_ff_exp = up[0]
    else:
        # The expert width from the tensor itself: Mixtral files write it as feed_forward_length,
        # Qwen files as expert_feed_forward_length; the tensor is what gets loaded either way.
        up = _tensor_shape(g, "blk.0.ffn_up_exps.weight")
        if up is None or len(up) != 3 or up[0] != n_expert:
            raise ModelFileError(f"{name}: {arch} with {n_expert} experts needs blk.N.ffn_up_exps.weight "
                                 f"of {n_expert} experts (found {up})")
        n_ff_exp = up[1]
    sh = _tensor_shape(g, "blk.0.ffn_up_shexp.weight")
    if arch == "qwen2moe":
        if sh is None:
            raise ModelFileError(f"{name}: qwen2moe needs the shared expert (blk.N.ffn_up_shexp.weight)")
        return MoeSpec("qwen2_moe", n_expert, n_used, n_ff_exp, sh[0], False, "mlp")
    if sh is not None:
        raise ModelFileError(f"{name}: {arch} with a shared expert (ffn_*_shexp) is not supported")
    if arch == "qwen3moe":
        return MoeSpec("qwen3_moe", n_expert, n_used, n_ff_exp, 0, True, "mlp")
    return MoeSpec("mixtral", n_expert, n_used, n_ff_exp, 0, True, "block_sparse_moe")


def model_args(g: GGUFFile, common: dict, head_dim: int):
    """(mlx-lm Model class, ModelArgs) for a MoE file; ``common`` are the dense hyperparameters."""
    spec = moe_spec(g)
    name = g.path.name
    n_embd, n_head = common["hidden_size"], common["num_attention_heads"]
    if spec.model_type in ("qwen2_moe", "mixtral") and head_dim != n_embd // n_head:
        # these mlx-lm attention classes derive head_dim from the width
        raise ModelFileError(f"{name}: {g.architecture} MoE with head_dim {head_dim} != "
                             f"n_embd / n_head ({n_embd // n_head}) is not supported")
    moe = dict(num_experts_per_tok=spec.n_expert_used, rope_scaling=None)
    if spec.model_type == "qwen3_moe":
        family = qwen3_moe
        args = dict(common, **moe, num_experts=spec.n_expert, moe_intermediate_size=spec.n_ff_exp,
                    decoder_sparse_step=1, mlp_only_layers=[], head_dim=head_dim, norm_topk_prob=True)
    elif spec.model_type == "qwen2_moe":
        family = qwen2_moe
        args = dict(common, **moe, num_experts=spec.n_expert, moe_intermediate_size=spec.n_ff_exp,
                    shared_expert_intermediate_size=spec.n_ff_shexp)
    else:
        family = mixtral
        # GGUF llama Q/K rows are permuted for adjacent-pair RoPE = MLX "traditional" (as for llama)
        args = dict(common, **moe, num_local_experts=spec.n_expert, intermediate_size=spec.n_ff_exp,
                    rope_traditional=True)
    args["model_type"] = spec.model_type
    return family.Model, family.ModelArgs.from_dict(args), spec


def mlx_name(gguf_name: str, spec: MoeSpec) -> str | None:
    """GGUF name of a MoE tensor -> mlx-lm parameter name (None: not a MoE tensor)."""
    base, _, kind = gguf_name.rpartition(".")
    m = _BLOCK_RE.fullmatch(base)
    if m and m.group(2) in _MOE_BLOCK_NAMES:
        return f"model.layers.{m.group(1)}.{spec.block_attr}.{_MOE_BLOCK_NAMES[m.group(2)]}.{kind}"
    m = _SPLIT_RE.fullmatch(base)
    if m and spec.model_type == "mixtral":
        # mlx-lm's Mixtral sanitize() stacks experts.E.w1/w2/w3 (weights, scales, biases) per layer
        return f"model.layers.{m.group(1)}.block_sparse_moe.experts.{m.group(3)}.{_SPLIT_NAMES[m.group(2)]}.{kind}"
    return None


def fix_weights(weights: dict, qparams: dict, spec: MoeSpec) -> None:
    """In place: shapes and ties that differ between GGUF and the mlx-lm classes."""
    # Per-expert tensors: the stacked SwitchLinear is quantized as its experts were (all alike).
    split: dict[str, set] = {}
    for prefix in [k for k in qparams if ".block_sparse_moe.experts." in k]:
        layer, rest = prefix.split(".block_sparse_moe.experts.")
        target = f"{layer}.block_sparse_moe.switch_mlp.{_SWITCH_NAMES[rest.split('.')[1]]}"
        split.setdefault(target, set()).add(tuple(sorted(qparams.pop(prefix).items())))
    for target, kinds in split.items():
        if len(kinds) != 1:
            raise ModelFileError(f"the experts of {target} have different tensor types; they cannot be stacked")
        qparams[target] = dict(next(iter(kinds)))
    for key in [k for k in weights if k.endswith(".shared_expert_gate.weight")]:
        w = weights[key]
        if w.ndim == 1:  # llama.cpp's {n_embd} vector -> nn.Linear(n_embd, 1)
            weights[key] = w.reshape(1, -1)
    if spec.model_type == "qwen2_moe" and "lm_head.weight" not in weights:
        # mlx-lm's qwen2_moe always has an lm_head; a tied file shares the embedding
        for kind in ("weight", "scales", "biases"):
            if f"model.embed_tokens.{kind}" in weights:
                weights[f"lm_head.{kind}"] = weights[f"model.embed_tokens.{kind}"]
        if "model.embed_tokens" in qparams:
            qparams["lm_head"] = qparams["model.embed_tokens"]
