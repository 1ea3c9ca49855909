"""Constrained decoding: a grammar's token mask applied to the logits before sampling.

The grammar library is llguidance (pinned in pyproject.toml). Why it, over xgrammar and outlines-core:
its masks are computed on the CPU in Rust (~0.04 ms median per SmolLM2 token for a nested schema here,
a few ms at worst), without the GIL, from JSON schemas (nested objects, arrays with min/maxItems,
enums, const, number bounds, string lengths/patterns, additionalProperties, $ref, anyOf) or Lark
grammars that can embed a schema (`%json {...}`) and name special tokens (`<|im_start|>`, `<[id]>`);
it builds a tokenizer from a `tokenizers` JSON directly (the engine's own tokenizer, no transformers
model), supports rollback (speculative drafts) and EOS only where the grammar accepts; llama.cpp and
vLLM use it. xgrammar targets torch/CUDA masks (its CPU path needs a compiled grammar per tokenizer
info and a torch-like bitmask), outlines-core compiles a regex index ahead (slow to build for large
schemas, no Lark, no rollback).

API (both the response_format half and the tool-call half use it):

    spec = ConstraintSpec.json_object()                       # any JSON object
    spec = ConstraintSpec.json_schema(schema, name="reply")   # JSON matching a schema
    spec = ConstraintSpec.tool_call(tools, name=None, begin="<tool_call>\\n", end="\\n</tool_call>",
                                    arguments_key="arguments", parallel=False)
    spec = ConstraintSpec.lark(grammar)                      # any llguidance Lark grammar
    spec.check()                      # no tokenizer needed: ConstraintError (a RequestError, 400) if bad

    c = compile(spec, tokenizer)      # engine thread; tokenizer = engine.text.tokenizer.GGUFTokenizer
    c.allowed_mask(width) -> np.ndarray[bool] (width,)   # next token's allowed ids (padded with False)
    c.advance(token_id) -> None       # ConstraintError if the grammar refuses it
    c.is_done() / c.is_accepting()    # nothing more can follow but EOS / EOS is allowed now
    c.valid_prefix(tokens) -> int     # how many of `tokens` the grammar takes from here (drafts)
    c.rollback(n)                     # undo the last n advances (rejected drafts)
    c.draft_masks(draft, width)       # (rows, n_kept): masks after each draft prefix (speculation)

`GenerateRequest.constraint` carries a ConstraintSpec; the engine compiles it per request (the
llguidance tokenizer is built once per loaded tokenizer, ~0.6 s for SmolLM2's 49k tokens).

Decode loop (generate.decode with GrammarMasks when a request has a constraint): MLX is lazy, so
step t+1's forward pass is built from the still-lazy token t and submitted (async_eval) before the
host waits for token t; once t is read the grammar takes it and the mask for t+1 is computed on the
CPU while the device runs the forward pass; the mask is applied (disallowed logits -> -inf) and the
sample submitted together with the forward pass of t+2. The device is never left waiting as long as
one mask takes less than one forward pass. EOS is in the mask only where the grammar accepts (and is
the only token once the grammar is complete), so a reply ends with "stop" on a complete value.

Speculation (speculative.decode): drafts are checked against the grammar. A draft is cut after the
first token the grammar refuses; with a draft model's sampled drafts that refused token is kept (it is
rejected by verification with certainty, its masked probability being 0, so rejection sampling stays
exact), otherwise it is dropped. The verify pass's rows get the masks after each draft prefix
(computed while the pass runs, then rolled back) and the grammar takes the accepted tokens. Greedy
output equals non-speculative masked greedy output, token for token.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

import numpy as np

from engine.errors import RequestError

# Compact JSON with the usual single spaces: `{"a": 1, "b": [2, 3]}`. Flexible whitespace lets a small
# model fill its whole budget with newlines inside an object (seen with SmolLM2 and random weights).
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
MAX_SCHEMA_CHARS = 256 * 1024


class ConstraintError(RequestError):
    """A schema/grammar that cannot be compiled, or a token the grammar refuses; `param` names the field."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


@dataclass
class ConstraintSpec:
    """What a reply must match (plain data: the app and the server build it without llguidance)."""
    kind: str                          # "json_object" | "json_schema" | "tool_call" | "lark"
    schema: dict | None = None         # json_schema
    name: str | None = None            # json_schema's name; tool_call: the one function forced
    strict: bool = True                # json_schema: objects without additionalProperties are closed
    tools: list | None = None          # tool_call: OpenAI tools [{"type": "function", "function": {...}}]
    begin: str = ""                    # tool_call: text before each call (a special token by its text)
    end: str = ""                      # tool_call: text after each call
    arguments_key: str = "arguments"   # tool_call: "arguments" (Qwen/Hermes) or "parameters" (Llama 3)
    parallel: bool = False             # tool_call: one or more calls (separated by `sep`)
    sep: str = "\n"
    grammar: str | None = None         # lark
    param: str = "response_format"     # the request field an error names
    _compiled: str | None = field(default=None, repr=False, compare=False)

    @classmethod
    def json_object(cls, param: str = "response_format") -> "ConstraintSpec":
        return cls("json_object", param=param)

    @classmethod
    def json_schema(cls, schema: dict, name: str | None = None, strict: bool = True,
                    param: str = "response_format") -> "ConstraintSpec":
        return cls("json_schema", schema=schema, name=name, strict=strict, param=param)

    @classmethod
    def tool_call(cls, tools: list, name: str | None = None, *, begin: str = "", end: str = "",
                  arguments_key: str = "arguments", parallel: bool = False, sep: str = "\n",
                  param: str = "tool_choice") -> "ConstraintSpec":
        return cls("tool_call", tools=tools, name=name, begin=begin, end=end, arguments_key=arguments_key,
                   parallel=parallel, sep=sep, param=param)

    @classmethod
    def lark(cls, grammar: str, param: str = "grammar") -> "ConstraintSpec":
        return cls("lark", grammar=grammar, param=param)

    # ---- the llguidance grammar ----------------------------------------------------------------
    def grammar_text(self, special: set[str] = frozenset()) -> str:
        """The llguidance grammar (JSON) for this spec. `special`: special-token texts of the
        tokenizer (tool_call's begin/end name them as tokens). ConstraintError on bad input."""
        # lazy: llguidance reads its package metadata on import, which the frozen app lacks
        import llguidance as llg
        try:
            if self.kind == "json_object":
                return llg.LLMatcher.grammar_from_json_schema({"type": "object"}, overrides=JSON_OPTIONS)
            if self.kind == "json_schema":
                refuse_extensions(self.schema, self.param)
                refuse_unproductive(self.schema, self.param)
                schema = closed(self.schema) if self.strict else self.schema
                return llg.LLMatcher.grammar_from_json_schema(_schema_text(schema, self.param),
                                                              overrides=JSON_OPTIONS)
            if self.kind == "lark":
                if not isinstance(self.grammar, str) or not self.grammar.strip():
                    raise ConstraintError("the grammar must be a non-empty string", self.param)
                return llg.LLMatcher.grammar_from_lark(self.grammar)
            if self.kind == "tool_call":
                return llg.LLMatcher.grammar_from_lark(self._tool_lark(special))
        except ConstraintError:
            raise
        except Exception as e:                   # noqa: BLE001 - llguidance's own errors, as a 400
            raise ConstraintError(f"invalid {'JSON schema' if self.param == 'response_format' else 'grammar'}: "
                                  f"{_one_line(e)}", self.param) from None
        raise ConstraintError(f"unknown constraint kind {self.kind!r}", self.param)

    def _tool_lark(self, special) -> str:
        tools = self.tools
        if not isinstance(tools, list) or not tools:
            raise ConstraintError("'tools' must be a non-empty list", "tools")
        choices = []
        for i, t in enumerate(tools):
            fn = t.get("function", t) if isinstance(t, dict) else None
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
                raise ConstraintError(f"tools[{i}] must be a function with a name", f"tools[{i}]")
            if self.name is not None and fn["name"] != self.name:
                continue
            params = fn.get("parameters")
            if params is None:
                params = {"type": "object", "properties": {}, "additionalProperties": False}
            if not isinstance(params, dict):
                raise ConstraintError(f"tools[{i}].function.parameters must be a JSON schema object",
                                      f"tools[{i}].function.parameters")
            refuse_extensions(params, f"tools[{i}].function.parameters")
            refuse_unproductive(params, f"tools[{i}].function.parameters")
            choices.append({"type": "object",
                            "properties": {"name": {"const": fn["name"]}, self.arguments_key: closed(params)},
                            "required": ["name", self.arguments_key], "additionalProperties": False})
        if not choices:
            raise ConstraintError(f"tool_choice names the function {self.name!r}, which is not in 'tools'",
                                  self.param)
        schema = choices[0] if len(choices) == 1 else {"anyOf": choices}
        text = _schema_text({**schema, "x-guidance": {**JSON_OPTIONS, "coerce_one_of": True}}, "tools")
        call = f"{_lark_text(self.begin, special)} call_json {_lark_text(self.end, special)}".strip()
        top = f"start: call ({_lark_text(self.sep, special)} call)*" if self.parallel else "start: call"
        return f"{top}\ncall: {call}\ncall_json: %json {text}\n"

    def check(self) -> None:
        """Compile-check without a tokenizer (the server's 400 before the engine is asked)."""
        if self._compiled is None:
            self._compiled = _validate(self.grammar_text(), None, self.param)


_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties")
_SUBSCHEMA_ONE = ("items", "additionalItems", "not", "if", "then", "else", "contains")


def closed(schema, depth: int = 0):
    """A copy of `schema` whose objects that name properties but say nothing of others are closed
    (`additionalProperties: false`): OpenAI's strict mode and tool arguments. Every reply that matches
    the copy matches the original; a small model cannot wander off into invented keys."""
    if not isinstance(schema, dict) or depth > 64:
        return schema
    out = dict(schema)
    if "properties" in out and "additionalProperties" not in out and "patternProperties" not in out \
            and "unevaluatedProperties" not in out:
        out["additionalProperties"] = False
    for k in _SUBSCHEMA_LISTS:
        if isinstance(out.get(k), list):
            out[k] = [closed(x, depth + 1) for x in out[k]]
    for k in _SUBSCHEMA_MAPS:
        if isinstance(out.get(k), dict):
            out[k] = {n: closed(x, depth + 1) for n, x in out[k].items()}
    for k in _SUBSCHEMA_ONE:
        if isinstance(out.get(k), dict):
            out[k] = closed(out[k], depth + 1)
    return out


def _one_line(e: Exception) -> str:
    text = " ".join((str(e) or type(e).__name__).split())
    return text[:400]


def refuse_extensions(schema, param: str) -> None:
    """ConstraintError naming the first vendor extension (a key starting with "x-", such as llguidance's
    "x-guidance", which changes the grammar: a whitespace pattern can let non-JSON through) where a
    schema keyword stands. Only the JSON-schema keywords themselves shape a reply. Iterative."""
    stack = [(schema, param)]
    while stack:
        node, where = stack.pop()
        if not isinstance(node, dict):
            continue
        for key in node:
            if isinstance(key, str) and key.lower().startswith("x-"):
                raise ConstraintError(f"{where}: the vendor extension {json.dumps(key[:40])} is not supported "
                                      "(JSON-schema keywords only)", param)
        for k in _SUBSCHEMA_LISTS:
            if isinstance(node.get(k), list):
                stack.extend((x, f"{where}.{k}[{j}]") for j, x in enumerate(node[k]))
        for k in _SUBSCHEMA_MAPS:
            if isinstance(node.get(k), dict):
                stack.extend((x, f"{where}.{k}.{n}") for n, x in node[k].items())
        for k in _SUBSCHEMA_ONE + ("additionalProperties", "propertyNames", "unevaluatedProperties",
                                    "unevaluatedItems", "contentSchema"):
            if isinstance(node.get(k), dict):
                stack.append((node[k], f"{where}.{k}"))


class _Productive:
    """Whether some JSON value matches a schema, as far as its local `$ref`s, anyOf/oneOf/allOf, required
    properties and minItems go: a `$ref` loop with nothing between (`{"$ref": "#"}`, a = b = a) matches
    nothing, and llguidance would take it and let an empty reply stop. A loop assumed unproductive
    while it is being followed (the least fixpoint); results that hold are kept; work bounded."""

    MAX_STEPS = 20_000

    def __init__(self, root):
        self.root, self.known, self.visiting, self.steps = root, set(), set(), 0

    def _target(self, ref: str):
        if ref == "#":
            return self.root
        for prefix in ("#/$defs/", "#/definitions/"):
            if ref.startswith(prefix) and isinstance(self.root, dict):
                defs = self.root.get(prefix[2:-1])
                name = ref[len(prefix):]
                if isinstance(defs, dict) and "/" not in name and name in defs:
                    return defs[name]
        return True                                   # not followed here: llguidance judges it

    def __call__(self, node) -> bool:
        self.steps += 1
        if not isinstance(node, dict) or id(node) in self.known or self.steps > self.MAX_STEPS:
            return node is not False
        if id(node) in self.visiting:
            return False
        self.visiting.add(id(node))
        try:
            ok = self._check(node)
        finally:
            self.visiting.discard(id(node))
        if ok:
            self.known.add(id(node))
        return ok

    def _check(self, node: dict) -> bool:
        if isinstance(node.get("$ref"), str) and not self(self._target(node["$ref"])):
            return False
        if isinstance(node.get("allOf"), list) and not all(self(x) for x in node["allOf"]):
            return False
        for key in ("anyOf", "oneOf"):
            if isinstance(node.get(key), list) and node[key] and not any(self(x) for x in node[key]):
                return False
        props = node.get("properties") if isinstance(node.get("properties"), dict) else {}
        required = node.get("required") if isinstance(node.get("required"), list) else []
        if any(isinstance(r, str) and r in props and not self(props[r]) for r in required):
            return False
        min_items = node.get("minItems")
        if isinstance(min_items, int) and min_items > 0 and "items" in node and not self(node["items"]):
            return False
        return True


def refuse_unproductive(schema, param: str) -> None:
    """ConstraintError when no JSON value can match `schema` (a `$ref` loop with nothing between)."""
    if isinstance(schema, dict) and not _Productive(schema)(schema):
        raise ConstraintError(f"{param}: no JSON value matches the schema (a $ref loop with nothing "
                              "between, or a required part that is such a loop)", param)


def _schema_text(schema, param: str) -> str:
    if isinstance(schema, bool):
        schema = {} if schema else {"not": {}}
    if not isinstance(schema, dict):
        raise ConstraintError("the JSON schema must be an object", param)
    try:
        text = json.dumps(schema, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise ConstraintError(f"the JSON schema is not JSON ({e})", param) from None
    if len(text) > MAX_SCHEMA_CHARS:
        raise ConstraintError(f"the JSON schema is over {MAX_SCHEMA_CHARS} characters", param)
    return text


def _lark_text(text: str, special) -> str:
    """A Lark sequence matching `text`, its special-token substrings as tokens (<|im_start|>...)."""
    if not text:
        return ""
    names = sorted((s for s in special if s and s in text), key=len, reverse=True)
    parts = re.split("(" + "|".join(map(re.escape, names)) + ")", text) if names else [text]
    out = []
    for p in parts:
        if not p:
            continue
        if p in names:
            out.append(p if re.fullmatch(r"<\|?[A-Za-z0-9_.:/-]+\|?>", p) else json.dumps(p))
        else:
            out.append(json.dumps(p))
    return " ".join(out)


def _validate(grammar: str, tokenizer, param: str) -> str:
    # lazy: llguidance reads its package metadata on import, which the frozen app lacks
    import llguidance as llg
    try:
        err = llg.LLMatcher.validate_grammar(grammar, tokenizer)
    except Exception as e:                       # noqa: BLE001 - llguidance's own errors, as a 400
        err = str(e) or type(e).__name__
    if err:
        raise ConstraintError(f"invalid {'JSON schema' if param == 'response_format' else 'grammar'}: "
                              f"{_one_line(err)}", param)
    return grammar


# ---- the per-request matcher --------------------------------------------------------------------
def ll_tokenizer(tokenizer):
    """The llguidance tokenizer for a GGUFTokenizer (built once, kept on it)."""
    llt = getattr(tokenizer, "_llg_tokenizer", None)
    if llt is None:
        # lazy: llguidance reads its package metadata on import, which the frozen app lacks
        import llguidance as llg
        llt = llg.LLTokenizer(tokenizer.backend.to_str(), eos_token=sorted(tokenizer.eos_ids) or None)
        tokenizer._llg_tokenizer = llt
    return llt


def _special_texts(tokenizer) -> set[str]:
    try:
        return {t.content for t in tokenizer.backend.get_added_tokens_decoder().values() if t.special}
    except Exception:                            # noqa: BLE001 - a tokenizer without added tokens
        return set()


class Constraint:
    """One request's grammar state (an llguidance LLMatcher) and its masks."""

    def __init__(self, spec: ConstraintSpec, tokenizer):
        # lazy: llguidance reads its package metadata on import, which the frozen app lacks
        import llguidance as llg
        import llguidance.numpy as lnp
        self.spec = spec
        self.llt = ll_tokenizer(tokenizer)
        self.vocab = self.llt.vocab_size
        self.eos = set(self.llt.eos_tokens)
        grammar = _validate(spec.grammar_text(_special_texts(tokenizer)), self.llt, spec.param)
        self.matcher = llg.LLMatcher(self.llt, grammar, log_level=0)
        if self.matcher.is_error():
            raise ConstraintError(f"invalid grammar: {self.matcher.get_error()[:400]}", spec.param)
        self._lnp = lnp
        self._bits = lnp.allocate_token_bitmask(1, self.vocab)
        self.steps = 0

    # ---- masks --------------------------------------------------------------------------------
    def allowed_mask(self, width: int | None = None) -> np.ndarray:
        """The next token's allowed ids as a bool array of `width` (>= the vocabulary; padded False)."""
        self._lnp.fill_next_token_bitmask(self.matcher, self._bits)
        bits = np.unpackbits(self._bits.view(np.uint8), bitorder="little")
        width = width or self.vocab
        if width <= bits.size:
            out = bits[:width].astype(bool)
            out[self.vocab:] = False
            return out
        out = np.zeros(width, dtype=bool)
        out[:self.vocab] = bits[:self.vocab]
        return out

    mask = allowed_mask

    def draft_masks(self, draft: list[int], width: int, keep_refused: bool = False) -> tuple[np.ndarray, int]:
        """Masks for a verify pass over [pending, d1..dk]: row i is the mask after d1..di. The draft is
        cut after its first refused token (kept when `keep_refused`: its row repeats the last mask).
        Returns (rows (n_kept+1, width), n_kept); the grammar state is left as it was."""
        n_ok = self.valid_prefix(draft)
        n_kept = n_ok + 1 if keep_refused and n_ok < len(draft) else n_ok
        rows = np.empty((n_kept + 1, width), dtype=bool)
        for i in range(n_ok + 1):
            rows[i] = self.allowed_mask(width)
            if i < n_ok:
                self._consume(draft[i])
        if n_kept > n_ok:
            rows[n_kept] = rows[n_ok]
        self.rollback(n_ok)
        return rows, n_kept

    # ---- state --------------------------------------------------------------------------------
    def _consume(self, token: int) -> None:
        if not self.matcher.consume_token(int(token)):
            raise ConstraintError(f"token {token} is not allowed by the grammar "
                                  f"({self.matcher.get_error()[:200]})", self.spec.param)
        self.steps += 1

    def advance(self, token: int) -> None:
        self._consume(token)

    def advance_all(self, tokens: list[int]) -> None:
        for t in tokens:
            self._consume(t)

    def valid_prefix(self, tokens: list[int]) -> int:
        return int(self.matcher.validate_tokens([int(t) for t in tokens])) if tokens else 0

    def rollback(self, n: int) -> None:
        if n > 0:
            self.matcher.rollback(n)
            self.steps -= n

    def is_done(self) -> bool:
        return self.matcher.is_stopped()

    def is_accepting(self) -> bool:
        return self.matcher.is_accepting()


def compile(spec: ConstraintSpec, tokenizer) -> Constraint:   # noqa: A001 - the module's verb
    """A ConstraintSpec compiled for the loaded tokenizer (ConstraintError if it cannot be)."""
    if not isinstance(spec, ConstraintSpec):
        raise ConstraintError("constraint must be a ConstraintSpec", "response_format")
    return Constraint(spec, tokenizer)


# ---- the masked decode loop (generate.decode hands over to it) -----------------------------------
class GrammarMasks:
    """The masks of generate.decode's loop under a grammar (module docstring: the order). The
    constraint has taken every reply token delivered before the loop starts."""

    def __init__(self, constraint: Constraint):
        self.constraint = constraint
        self.width = 0

    def first(self, width: int) -> np.ndarray:
        """The first token's mask, `width` logits wide (the vocabulary as the model pads it)."""
        self.width = width
        return self.constraint.allowed_mask(width)

    def advance(self, token: int) -> None:
        self.constraint.advance(token)

    def after(self, token: int) -> np.ndarray | None:
        """The next token's mask once `token` is taken (None after EOS: see or_eos)."""
        return self.constraint.allowed_mask(self.width) if token not in self.constraint.eos else None

    def or_eos(self, allowed: np.ndarray | None) -> np.ndarray:
        """EOS went out and the consumer went on: nothing but EOS follows."""
        if allowed is None:
            allowed = np.zeros(self.width, dtype=bool)
            allowed[list(self.constraint.eos)] = True
        return allowed
