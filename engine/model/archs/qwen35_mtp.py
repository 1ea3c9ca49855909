"""The NextN / multi-token-prediction head of a Qwen3.5 / Qwen3.6 GGUF. Drafting with it:
engine/generation/mtp_spec.py.

The file counts the head in block_count and says how many with `{arch}.nextn_predict_layers` (llama.cpp
supports one); its tensors sit under blk.{n_layer}: a full-attention Qwen3.5 block (attn_q doubled
for the gate, q/k norms, the dense or MoE FFN of the model) plus

* `nextn.eh_proj`  [2 x n_embd -> n_embd]: projects concat(enorm(embedding of token t+1), hnorm(h_t))
* `nextn.enorm`, `nextn.hnorm`: RMSNorms (stored as 1 + w like the model's)
* `nextn.shared_head_norm` (else the model's output_norm), `nextn.shared_head_head` (else the
  model's output / tied embedding), `nextn.embed_tokens` (else the model's token_embd)

h_t is the main model's last hidden state after its output norm (llama.cpp's `h_nextn`, what
mlx-lm's Qwen3_5TextModel returns). The head predicts token t+2 from h_t and token t+1, and keeps its
own K/V (one KVCache) at the positions of the main model: llama.cpp's graph_mtp for qwen35/qwen35moe.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.qwen3_5 import DecoderLayer, TextModelArgs

from engine.errors import ModelFileError
from engine.model.archs import qwen35
from engine.model.archs.common import add_tensor, common_args, load_checked

_NEXTN_NAMES = {"nextn.eh_proj": "eh_proj", "nextn.enorm": "enorm", "nextn.hnorm": "hnorm",
                "nextn.shared_head_norm": "norm", "nextn.shared_head_head": "lm_head",
                "nextn.embed_tokens": "embed_tokens"}


class _Ref:
    """A plain reference: mlx's Module would take a Module (or a list of them) as a child."""

    def __init__(self, module):
        self.module = module


class MTPHead(nn.Module):
    """One NextN block. `embed_tokens` / `lm_head` / `norm` are the head's own when the file has them,
    else the target model's (shared, not copied)."""

    def __init__(self, text_args, *, own: set[str]):
        super().__init__()
        n = text_args.hidden_size
        self.eh_proj = nn.Linear(2 * n, n, bias=False)
        self.enorm = nn.RMSNorm(n, eps=text_args.rms_norm_eps)
        self.hnorm = nn.RMSNorm(n, eps=text_args.rms_norm_eps)
        # a full-attention block: DecoderLayer picks attention for the interval's last index
        self.layer = DecoderLayer(text_args, text_args.full_attention_interval - 1)
        if "norm" in own:
            self.norm = nn.RMSNorm(n, eps=text_args.rms_norm_eps)
        if "lm_head" in own:
            self.lm_head = nn.Linear(n, text_args.vocab_size, bias=False)
        if "embed_tokens" in own:
            self.embed_tokens = nn.Embedding(text_args.vocab_size, n)
        self._target = None              # the target's TextModel (a _Ref: kept out of this module's parameters)

    def attach(self, target) -> "MTPHead":
        self._target = _Ref(target.language_model)
        return self

    def __call__(self, hidden: mx.array, next_tokens: mx.array, cache: Any = None) -> mx.array:
        """Logits for the token after `next_tokens` (B, L) given the target's normed hidden states
        (B, L, n_embd) at the positions before them."""
        return self.logits(self.features(hidden, next_tokens, cache))

    def features(self, hidden: mx.array, next_tokens: mx.array, cache: Any = None) -> mx.array:
        """The head's own hidden states after its shared-head norm (B, L, n_embd): what a chained
        draft step feeds back as `hidden` (as vLLM's Qwen3.5 MTP does for depth > 1)."""
        lm = self._target.module
        embed = self.embed_tokens if "embed_tokens" in self else lm.model.embed_tokens
        x = mx.concatenate([self.enorm(embed(next_tokens)), self.hnorm(hidden)], axis=-1)
        x = self.eh_proj(x)
        x = self.layer(x, mask=create_attention_mask(x, cache), cache=cache)
        return (self.norm if "norm" in self else lm.model.norm)(x)

    def logits(self, x: mx.array) -> mx.array:
        lm = self._target.module
        if "lm_head" in self:
            return self.lm_head(x)
        return lm.model.embed_tokens.as_linear(x) if lm.args.tie_word_embeddings else lm.lm_head(x)


@dataclass(frozen=True)
class HeadInfo:
    layer: int                   # blk index of the head in the file
    own: tuple[str, ...]         # which of norm / lm_head / embed_tokens the head has of its own
    note: str


def check_matches(head_g, target_g) -> None:
    """A sibling MTP file (mtp-*.gguf) must be the target's architecture, width and vocabulary."""
    def facts(g):
        tokens = g.get("tokenizer.ggml.tokens")
        return (g.architecture, g.arch_key("embedding_length"), len(tokens) if tokens is not None else None)
    h, t = facts(head_g), facts(target_g)
    for what, a, b in zip(("architecture", "width", "vocabulary"), h, t):
        if a is not None and b is not None and a != b:
            raise ModelFileError(f"{head_g.path.name}: its NextN head does not match {target_g.path.name} "
                                 f"({what} {a} vs {b})")


def load_head(g, model, *, dtype=mx.float32, target_g=None) -> tuple[MTPHead, HeadInfo]:
    """The NextN head of GGUF `g` (the model's own file, or a sibling MTP file with `target_g` the
    model's) as an MTPHead attached to the loaded target `model`."""
    if target_g is not None:
        check_matches(g, target_g)
    if g.architecture not in ("qwen35", "qwen35moe"):
        raise ModelFileError(f"{g.path.name}: a NextN head is read for qwen35/qwen35moe files, not "
                             f"'{g.architecture}'")
    common, head_dim = common_args(g)
    _, args = qwen35.model_args(g, common, head_dim)
    s = args.shape
    if s.n_nextn != 1:
        raise ModelFileError(f"{g.path.name}: {g.architecture}.nextn_predict_layers is {s.n_nextn}; "
                             "one NextN head is supported" if s.n_nextn else f"{g.path.name}: no NextN head "
                             f"({g.architecture}.nextn_predict_layers is 0 or missing)")
    layer = s.n_layer
    prefix = f"blk.{layer}."
    weights: dict[str, mx.array] = {}
    qparams: dict[str, dict] = {}
    for t in g.reader.tensors:
        if not t.name.startswith(prefix):
            continue
        base, _, kind = t.name[len(prefix):].rpartition(".")
        if base in _NEXTN_NAMES:
            name = f"{_NEXTN_NAMES[base]}.{kind}"
        elif base in qwen35._LAYER_NAMES:
            name = f"layer.{qwen35._LAYER_NAMES[base]}.{kind}"
        else:
            raise ModelFileError(f"{g.path.name}: unexpected tensor '{t.name}' in the NextN head")
        add_tensor(weights, qparams, name, t, dtype, g.path.name)
    for need in ("eh_proj.weight", "enorm.weight", "hnorm.weight", "layer.self_attn.q_proj.weight"):
        if need not in weights:
            raise ModelFileError(f"{g.path.name}: the NextN head (blk.{layer}) lacks "
                                 f"'{need.replace('layer.', '').split('.')[0]}' tensors")
    qwen35.fix_moe_weights(weights, qparams)
    own = {k.split(".")[0] for k in weights if k.split(".")[0] in ("norm", "lm_head", "embed_tokens")}
    head = MTPHead(TextModelArgs.from_dict(args.text_config), own=own)
    if qparams:
        nn.quantize(head, class_predicate=lambda path, module: qparams.get(path, False))
    load_checked(head, weights, dtype, f"{g.path.name}: the NextN head's tensors do not match")
    head.attach(model)
    note = (f"NextN head from blk.{layer}" + (f" with its own {', '.join(sorted(own))}" if own else
                                               " sharing the model's norm, embedding and output"))
    return head, HeadInfo(layer, tuple(sorted(own)), note)
