"""Gemma 4's MTP drafter ("assistant"): a small decoder that reads the target's K/V. Drafting
with it: engine/generation/gemma4_mtp_spec.py.

Google ships one per Gemma 4 model (google/gemma-4-*-it-assistant, transformers'
Gemma4AssistantForCausalLM); llama.cpp converts it to its own GGUF, architecture `gemma4-assistant`
(conversion/gemma.py's Gemma4AssistantModel; run with `--spec-type draft-mtp -md FILE`), found next to
the model as `mtp-*.gguf`. What the file holds (llama.cpp's llama_model_gemma4_assistant, which the
installed llama-cpp-python's libllama has):

* `token_embd` [n_vocab, n]: the drafter's own embedding, used only as its tied output head (n = the
  drafter's width, e.g. 256 for E2B's)
* `nextn.pre_projection` [2 nb -> n], `nextn.post_projection` [n -> nb] (nb = the target's width,
  `{arch}.embedding_length_out`)
* per block: `attn_norm`, `attn_q`, `attn_q_norm`, `attn_output`, `post_attention_norm`, `ffn_norm`,
  `ffn_gate/up/down` (GELU-gated), `post_ffw_norm`, `layer_output_scale`; no K or V projection: every
  block attends over the K/V the target wrote, the target's last sliding layer's for a sliding block,
  its last global layer's for a global one (transformers: "the KV values for the last layer of each
  layer_type"); `rope_freqs` (the global blocks' proportional RoPE, as the target's)
* `output_norm`; metadata as a Gemma 4 file's (per-block sliding pattern, head sizes, RoPE bases),
  plus `embedding_length_out` and `nextn_predict_layers` (= block_count)

One draft step, from the target's final hidden state h_p (after its output norm: transformers' last
hidden state) at position p and the token t chosen after it:
    x = pre_projection(concat(target_embed(t) * sqrt(nb), h_p))
    blocks (Gemma 4's: norm, Q only, Q norm, RoPE at position p + 1 (t's), attention with scale 1 over
    the target's K/V that a query at p + 1 sees, O, post-norm, residual; norm, GELU FFN, post-norm,
    residual; times the layer's output scale)
    y = output_norm(x);  logits = token_embd . y (no soft-capping);  h_next = post_projection(y)
The next step feeds (h_next, the drafted token) at the same position p + 1 over the same K/V: the drafter
keeps no K/V of its own (transformers' SinglePositionMultiTokenCandidateGenerator; vLLM's Gemma 4
proposer: "all draft steps predict from the same position"). The masked-embedding centroids of the
E2B/E4B checkpoints are left out by llama.cpp's converter (the dense tied head computes the same
scores for every token); a file that has them is read without them.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from engine.errors import ModelFileError
from engine.model.gguf_checks import check_schema

ARCH = "gemma4-assistant"

_TOP = {"token_embd": "embed_tokens", "output_norm": "norm", "nextn.pre_projection": "pre_projection",
        "nextn.post_projection": "post_projection"}
_BLOCK = {"attn_norm": "input_layernorm", "attn_q": "q_proj", "attn_q_norm": "q_norm", "attn_output": "o_proj",
          "post_attention_norm": "post_attention_layernorm", "ffn_norm": "pre_feedforward_layernorm",
          "ffn_gate": "gate_proj", "ffn_up": "up_proj", "ffn_down": "down_proj",
          "post_ffw_norm": "post_feedforward_layernorm"}
_IGNORED = ("masked_embd_centroids", "masked_embd_ordering")     # llama.cpp reads them as optional, unused


@dataclass(frozen=True)
class AssistantArgs:
    n_layer: int
    n_embd: int                  # the drafter's width
    n_embd_target: int           # embedding_length_out: the target's width
    n_head: int
    n_ff: tuple[int, ...]
    head_dim: int                # global blocks
    head_dim_swa: int            # sliding blocks
    sliding: tuple[bool, ...]
    window: int
    rope_base: float
    rope_base_swa: float
    n_rot: int
    n_rot_swa: int
    eps: float
    n_vocab: int


class AssistantBlock(nn.Module):
    """One drafter block: a Gemma 4 decoder block whose attention has queries only."""

    def __init__(self, a: AssistantArgs, i: int):
        super().__init__()
        n = a.n_embd
        self.is_sliding = a.sliding[i]
        self.head_dim = a.head_dim_swa if self.is_sliding else a.head_dim
        self.n_head = a.n_head
        self.input_layernorm = nn.RMSNorm(n, eps=a.eps)
        self.q_proj = nn.Linear(n, a.n_head * self.head_dim, bias=False)
        self.q_norm = nn.RMSNorm(self.head_dim, eps=a.eps)
        self.o_proj = nn.Linear(a.n_head * self.head_dim, n, bias=False)
        self.post_attention_layernorm = nn.RMSNorm(n, eps=a.eps)
        self.pre_feedforward_layernorm = nn.RMSNorm(n, eps=a.eps)
        self.gate_proj = nn.Linear(n, a.n_ff[i], bias=False)
        self.up_proj = nn.Linear(n, a.n_ff[i], bias=False)
        self.down_proj = nn.Linear(a.n_ff[i], n, bias=False)
        self.post_feedforward_layernorm = nn.RMSNorm(n, eps=a.eps)
        self.layer_scalar = mx.ones((1,))
        self.rope = None            # set by load_assistant (the file's RoPE for this block's kind)

    def __call__(self, x: mx.array, keys: mx.array, values: mx.array, position: int) -> mx.array:
        B, L, _ = x.shape
        h = self.input_layernorm(x)
        q = self.q_norm(self.q_proj(h).reshape(B, L, self.n_head, self.head_dim)).transpose(0, 2, 1, 3)
        q = self.rope(q, offset=position)
        # `keys`/`values` are exactly what position p sees (the caller cut the window): no mask
        o = mx.fast.scaled_dot_product_attention(q, keys.astype(q.dtype), values.astype(q.dtype), scale=1.0)
        h = x + self.post_attention_layernorm(self.o_proj(o.transpose(0, 2, 1, 3).reshape(B, L, -1)))
        f = self.pre_feedforward_layernorm(h)
        f = self.down_proj(nn.gelu_approx(self.gate_proj(f)) * self.up_proj(f))
        return (h + self.post_feedforward_layernorm(f)) * self.layer_scalar


class Gemma4Assistant(nn.Module):
    def __init__(self, a: AssistantArgs):
        super().__init__()
        self.args = a
        self.embed_tokens = nn.Embedding(a.n_vocab, a.n_embd)
        self.pre_projection = nn.Linear(2 * a.n_embd_target, a.n_embd, bias=False)
        self.post_projection = nn.Linear(a.n_embd, a.n_embd_target, bias=False)
        self.layers = [AssistantBlock(a, i) for i in range(a.n_layer)]
        self.norm = nn.RMSNorm(a.n_embd, eps=a.eps)
        self._target = None         # (the target's Gemma4TextModel,): kept out of this module's parameters

    def attach(self, model) -> "Gemma4Assistant":
        self._target = (model.model,)
        return self

    def step(self, hidden: mx.array, token: mx.array, kv: dict[bool, tuple[mx.array, mx.array]],
             position: int) -> tuple[mx.array, mx.array]:
        """One draft step: (logits (V,), h_next (1, 1, nb)) from the target-width hidden state
        (1, 1, nb), the token after it (1, 1) and the target's K/V by kind (True: sliding) as position
        `position` sees it."""
        inner = self._target[0]
        e = inner.embed_tokens(token) * math.sqrt(self.args.n_embd_target)
        x = self.pre_projection(mx.concatenate([e.astype(hidden.dtype), hidden], axis=-1))
        for layer in self.layers:
            k, v = kv[layer.is_sliding]
            x = layer(x, k, v, position)
        y = self.norm(x)
        return self.embed_tokens.as_linear(y)[0, -1], self.post_projection(y)


def _per_block(g, key: str, n: int, default=None) -> list:
    v = g.arch_key(key, default)
    if v is None:
        raise ModelFileError(f"{g.path.name}: missing metadata '{ARCH}.{key}'")
    if isinstance(v, (list, tuple, np.ndarray)):
        v = [x.item() if hasattr(x, "item") else x for x in v]
        if len(v) != n:
            raise ModelFileError(f"{g.path.name}: '{ARCH}.{key}' has {len(v)} values for {n} blocks")
        return v
    return [v] * n


def assistant_args(g) -> AssistantArgs:
    name = g.path.name
    if g.architecture != ARCH:
        raise ModelFileError(f"{name}: a Gemma 4 MTP drafter is a '{ARCH}' file, not '{g.architecture}'")
    check_schema(g)         # every key below in range, the block count the blocks present
    try:
        n_layer = int(g.arch_key("block_count"))
        n_embd = int(g.arch_key("embedding_length"))
        n_head = int(g.arch_key("attention.head_count"))
        tokens = g.get("tokenizer.ggml.tokens")
        n_vocab = int(g.arch_key("vocab_size", 0) or (len(tokens) if tokens is not None else 0))
    except (TypeError, ValueError):
        raise ModelFileError(f"{name}: missing or bad '{ARCH}.*' hyperparameters") from None
    n_out = g.arch_key("embedding_length_out")
    if n_out is None or int(n_out) == n_embd:
        # llama.cpp: "Gemma 4 assistant requires embedding_length_out to carry the target hidden size"
        raise ModelFileError(f"{name}: no '{ARCH}.embedding_length_out' (the target's width)")
    nextn = int(g.arch_key("nextn_predict_layers", n_layer))
    if nextn != n_layer:
        raise ModelFileError(f"{name}: nextn_predict_layers {nextn} is not block_count {n_layer} "
                             "(every block of the drafter drafts)")
    head_dim = int(g.arch_key("attention.key_length", n_embd // n_head))
    head_swa = int(g.arch_key("attention.key_length_swa", head_dim))
    if int(g.arch_key("attention.value_length", head_dim)) != head_dim or \
            int(g.arch_key("attention.value_length_swa", head_swa)) != head_swa:
        raise ModelFileError(f"{name}: the drafter needs equal key and value head sizes")
    sliding = tuple(bool(x) for x in _per_block(g, "attention.sliding_window_pattern", n_layer))
    window = int(g.arch_key("attention.sliding_window", 0) or 0)
    if any(sliding) and window <= 0:
        raise ModelFileError(f"{name}: sliding blocks but no '{ARCH}.attention.sliding_window'")
    base = float(g.arch_key("rope.freq_base", 10000.0))
    return AssistantArgs(
        n_layer=n_layer, n_embd=n_embd, n_embd_target=int(n_out), n_head=n_head,
        n_ff=tuple(int(x) for x in _per_block(g, "feed_forward_length", n_layer)),
        head_dim=head_dim, head_dim_swa=head_swa, sliding=sliding, window=window, rope_base=base,
        rope_base_swa=float(g.arch_key("rope.freq_base_swa", 10000.0)),
        n_rot=int(g.arch_key("rope.dimension_count", head_dim)),
        n_rot_swa=int(g.arch_key("rope.dimension_count_swa", head_swa)),
        eps=float(g.arch_key("attention.layer_norm_rms_epsilon", 1e-6)), n_vocab=n_vocab)


def check_matches(a: AssistantArgs, g, model, target_g) -> None:
    """Refuse a drafter made for another model, by name: the target must be gemma4 with the drafter's
    target width, vocabulary, head sizes and sliding window; each kind of block needs that kind of
    target layer; query heads must group over the target's K/V heads."""
    name, tname = g.path.name, target_g.path.name
    if target_g.architecture != "gemma4":
        raise ModelFileError(f"{name}: a Gemma 4 MTP drafter needs a gemma4 model, {tname} is "
                             f"'{target_g.architecture}'")
    args = model.args

    def refuse(what, mine, theirs):
        raise ModelFileError(f"{name}: this drafter does not match {tname} ({what} {mine} vs {theirs})")
    if a.n_embd_target != args.hidden_size:
        refuse("target width", a.n_embd_target, args.hidden_size)
    if a.n_vocab != args.vocab_size:
        refuse("vocabulary", a.n_vocab, args.vocab_size)
    layers = model.model.layers
    kinds = {layer.self_attn.is_sliding: layer.self_attn for layer in layers}
    kv = g.arch_key("attention.head_count_kv")
    kv_heads = None
    if kv is not None:      # one count, or one per block: the first block of each kind's
        per = _per_block(g, "attention.head_count_kv", a.n_layer)
        kv_heads = {s: int(per[a.sliding.index(s)]) for s in set(a.sliding)}
    for s in sorted(set(a.sliding)):
        kind = "sliding" if s else "global"
        if s not in kinds:
            raise ModelFileError(f"{name}: the drafter has {kind} blocks, {tname} has no {kind} layer "
                                 "whose K/V they could read")
        attn = kinds[s]
        mine = a.head_dim_swa if s else a.head_dim
        if mine != attn.head_dim:
            refuse(f"{kind} head size", mine, attn.head_dim)
        if a.n_head % attn.n_kv_heads:
            refuse(f"query heads over the {kind} K/V heads", a.n_head, attn.n_kv_heads)
        if kv_heads is not None and kv_heads[s] != attn.n_kv_heads:
            # llama.cpp sizes the drafter's view of the shared cache by the file's count
            refuse(f"{kind} K/V heads", kv_heads[s], attn.n_kv_heads)
    if any(a.sliding) and a.window != args.sliding_window:
        refuse("sliding window", a.window, args.sliding_window)


def load_assistant(g, model, target_g, *, dtype=mx.float32) -> Gemma4Assistant:
    """The drafter in GGUF `g` attached to the loaded gemma4 `model` (from `target_g`)."""
    from engine.model import quants
    from engine.model.archs.common import FactorRoPE
    a = assistant_args(g)
    check_matches(a, g, model, target_g)
    weights: dict[str, mx.array] = {}
    qparams: dict[str, dict] = {}
    factors = None
    for t in g.reader.tensors:
        base, _, kind = t.name.rpartition(".")
        if base == "rope_freqs":
            factors = mx.array(np.asarray(t.data, dtype=np.float32).reshape(-1))
            continue
        if base in _IGNORED:
            continue
        parts = base.split(".", 2)
        if base in _TOP:
            path = _TOP[base]
        elif len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and int(parts[1]) < a.n_layer and \
                (parts[2] in _BLOCK or parts[2] == "layer_output_scale"):
            path = f"layers.{parts[1]}." + ("layer_scalar" if parts[2] == "layer_output_scale" else _BLOCK[parts[2]])
        else:
            raise ModelFileError(f"{g.path.name}: unexpected tensor '{t.name}' in a Gemma 4 MTP drafter")
        try:
            mt = quants.convert_tensor(t, dtype=dtype)
        except quants.UnsupportedTensorType as e:
            raise ModelFileError(f"{g.path.name}: {e}") from None
        if path.endswith("layer_scalar"):
            weights[path] = mt.weight.reshape(1)
            continue
        weights[f"{path}.{kind}"] = mt.weight
        if mt.quantized:
            weights[f"{path}.scales"], weights[f"{path}.biases"] = mt.scales, mt.biases
            qparams[path] = {"group_size": mt.group_size, "bits": mt.bits}
    head = Gemma4Assistant(a)
    if qparams:
        nn.quantize(head, class_predicate=lambda path, module: qparams.get(path, False))
    try:
        head.load_weights(list(weights.items()), strict=True)
    except ValueError as e:
        raise ModelFileError(f"{g.path.name}: the drafter's tensors do not match ({str(e)[:160]})") from None
    head.set_dtype(dtype, lambda x: mx.issubdtype(x, mx.floating))
    for layer in head.layers:
        if layer.is_sliding:
            layer.rope = nn.RoPE(a.n_rot_swa, traditional=False, base=a.rope_base_swa)
        elif factors is not None:
            if factors.size * 2 != layer.head_dim:
                raise ModelFileError(f"{g.path.name}: rope_freqs.weight has {factors.size} factors for a "
                                     f"global head size of {layer.head_dim}")
            layer.rope = FactorRoPE(layer.head_dim, a.rope_base, False, factors)
        else:
            layer.rope = nn.RoPE(a.n_rot, traditional=False, base=a.rope_base)
    mx.eval(head.parameters())
    return head.attach(model)


def assistant_bytes(path) -> int:
    """Bytes of the drafter's tensors as the loader holds them (engine/memory_estimate.tensor_bytes'
    float16 bound for unquantized ones). It keeps no K/V: it reads the target's."""
    from engine.model.memory_estimate import read_header, tensor_bytes
    return sum(tensor_bytes(t, 4) for t in read_header(path).tensors)


def load_sibling(p, model, target_g, *, dtype=mx.float32, admit=None) -> tuple[Gemma4Assistant, str]:
    """The drafter in file `p` for the loaded gemma4 target: refused by name before any byte is
    admitted, then `admit(nbytes)` (the memory guard), then read. (head, a note for the log)"""
    from engine.model.gguf_file import open_gguf
    g = open_gguf(p)
    a = assistant_args(g)
    check_matches(a, g, model, target_g)
    if admit is not None:
        admit(assistant_bytes(p))
    head = load_assistant(g, model, target_g, dtype=dtype)
    kinds = "/".join(k for k, on in (("sliding", any(a.sliding)), ("global", not all(a.sliding))) if on)
    return head, (f"Gemma 4 MTP drafter: {a.n_layer} blocks {a.n_embd} wide reading the target's "
                  f"{kinds} K/V")
