"""The tokenizer a GGUF describes, built with the `tokenizers` library via transformers' GGUF conversion."""
from __future__ import annotations

from dataclasses import dataclass, field

from tokenizers import Regex, Tokenizer, pre_tokenizers
import json

from engine.text import harmony
from engine.errors import ModelFileError
from engine.model.gguf_file import GGUFFile, text_hash
from engine.text.prompt_encoder import PromptEncoder


def _smollm_pre_tokenizer():
    # llama.cpp's LLAMA_VOCAB_PRE_TYPE_SMOLLM: single digits first, then GPT-2's split.
    return pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])


def _gemma4_pre_tokenizer():
    # llama.cpp's LLAMA_VOCAB_PRE_TYPE_GEMMA4: runs of newlines apart from the rest ("[^\n]+|[\n]+"),
    # merges never cross them (transformers' GemmaTokenizer splits nothing)
    return pre_tokenizers.Split(Regex(r"[^\n]+|[\n]+"), behavior="isolated")


# Pre-tokenizers llama.cpp knows by name that transformers' table does not cover.
# llama.cpp gives refact (Granite 3.x) the same two regexes as smollm
_EXTRA_PRE = {"smollm": _smollm_pre_tokenizer, "refact": _smollm_pre_tokenizer}


@dataclass
class GGUFTokenizer:
    backend: Tokenizer
    bos_id: int | None
    eos_ids: set[int]
    add_bos: bool
    fingerprint: str = ""
    rendered: frozenset[int] = frozenset()   # special tokens decoded as text anyway (harmony's markers)
    prompts: object = field(default=None, repr=False, compare=False)   # engine/text/prompt_encoder.py, made on use

    def encode(self, text: str, *, add_bos: bool | None = None) -> list[int]:
        ids = self.backend.encode(text, add_special_tokens=False).ids
        if (self.add_bos if add_bos is None else add_bos) and self.bos_id is not None:
            if not ids or ids[0] != self.bos_id:
                ids = [self.bos_id] + ids
        return ids

    def encode_prompt(self, text: str, *, add_bos: bool | None = None) -> list[int]:
        """encode(text) for a rendered chat: the same ids, tokenizing only what follows the longest
        prefix it shares with a recent prompt, up to a special token (engine/text/prompt_encoder.py)."""
        if self.prompts is None:
            self.prompts = PromptEncoder(self.backend)
        ids = self.prompts.encode(text)
        if (self.add_bos if add_bos is None else add_bos) and self.bos_id is not None:
            if not ids or ids[0] != self.bos_id:
                ids = [self.bos_id] + ids
        return ids

    def cut_ids(self) -> frozenset[int]:
        """The special tokens a text's ids split at exactly (engine/text/prompt_encoder.py): the ids of the
        text from one of them on do not depend on the text before it. Empty for a tokenizer without."""
        if self.prompts is None:
            self.prompts = PromptEncoder(self.backend)
        return self.prompts.cut_ids

    def decode(self, ids: list[int], *, skip_special: bool = True) -> str:
        if not (skip_special and self.rendered and not self.rendered.isdisjoint(ids)):
            return self.backend.decode(ids, skip_special_tokens=skip_special)
        parts, run = [], []
        for i in ids:
            if i in self.rendered:
                parts += [self.backend.decode(run, skip_special_tokens=True), self.backend.id_to_token(i)]
                run = []
            else:
                run.append(i)
        return "".join(parts) + self.backend.decode(run, skip_special_tokens=True)

    def token_text(self, token_id: int) -> str:
        return self.backend.id_to_token(token_id) or ""


def _tokenizer_dict(gguf: GGUFFile) -> dict:
    # The dict transformers' GGUF converter takes (its own reader needs torch, so we read the keys here).
    keys = {"model": "tokenizer_type", "pre": "pre_tokenizer_type", "tokens": "tokens", "scores": "scores",
            "token_type": "token_type", "merges": "merges", "bos_token_id": "bos_token_id",
            "eos_token_id": "eos_token_id", "unknown_token_id": "unk_token_id",
            "padding_token_id": "pad_token_id", "add_space_prefix": "add_prefix_space"}
    out = {}
    for key, name in keys.items():
        value = gguf.get(f"tokenizer.ggml.{key}")
        if value is not None:
            out[name] = value.tolist() if hasattr(value, "tolist") else value
    return out


def _gguf_converter():
    """transformers' GGUF -> `tokenizers` converter. It is a private module that has moved between
    releases, so pyproject pins transformers to the tested version; the older location is a fallback
    and anything else is one clear line rather than an ImportError deep in a load."""
    # lazy: transformers takes seconds to import and only a GGUF tokenizer's conversion needs it
    try:
        from transformers.integrations.gguf.gguf_tokenizer_mapping import convert_gguf_tokenizer
    except ImportError:
        try:
            from transformers.integrations.ggml import convert_gguf_tokenizer
        except ImportError:
            import transformers
            raise ModelFileError(f"transformers {transformers.__version__} has no GGUF tokenizer converter where "
                                 "Strata looks for it; install the version pyproject.toml pins "
                                 "(make setup)") from None
    return convert_gguf_tokenizer


def _phi3_special_rstrip(backend: Tokenizer, model_name: str) -> Tokenizer:
    """llama.cpp's vocabulary loader gives a model whose general.name contains "phi3" or "phi-3" (as Phi-3's
    own tokenizer.json does) special tokens that eat the whitespace after them (RSTRIP), except <unk>, <s>
    and <|endoftext|>: "<|user|>\nHi" is <|user|> then "Hi". The same flags on the added tokens here."""
    if not any(k in model_name.lower() for k in ("phi-3", "phi3")):
        return backend
    spec = json.loads(backend.to_str())
    for t in spec.get("added_tokens", []):      # llama.cpp: every control and user-defined token
        t["rstrip"] = t["content"] not in ("<unk>", "<s>", "<|endoftext|>")
    return Tokenizer.from_str(json.dumps(spec))


def load_tokenizer(gguf: GGUFFile) -> GGUFTokenizer:
    convert_gguf_tokenizer = _gguf_converter()
    if gguf.get("tokenizer.ggml.tokens") is None:
        raise ModelFileError(f"{gguf.path.name}: missing tokenizer metadata 'tokenizer.ggml.tokens'")
    model_type = gguf.get("tokenizer.ggml.model")
    if model_type not in ("gpt2", "llama", "gemma4"):
        raise ModelFileError(f"{gguf.path.name}: tokenizer type {model_type!r} is not supported "
                             "(byte-level BPE 'gpt2', SentencePiece 'llama' and Gemma 4's 'gemma4' are)")
    try:
        backend, _ = convert_gguf_tokenizer(gguf.architecture, _tokenizer_dict(gguf))
    except Exception as e:
        raise ModelFileError(f"{gguf.path.name}: cannot build its tokenizer ({str(e)[:160]})") from None
    pre = gguf.get("tokenizer.ggml.pre")
    if pre in _EXTRA_PRE:
        backend.pre_tokenizer = _EXTRA_PRE[pre]()
    if model_type == "gemma4":
        backend.pre_tokenizer = _gemma4_pre_tokenizer()
    # Post-processors from the HF classes may add BOS/EOS; Strata adds BOS itself, as the GGUF says.
    backend.post_processor = None
    backend = _phi3_special_rstrip(backend, str(gguf.get("general.name", "")))

    token_types = gguf.get("tokenizer.ggml.token_type")
    special = {i for i, t in enumerate(token_types) if t == 3} if token_types is not None else set()
    bos = gguf.get("tokenizer.ggml.bos_token_id")
    eos = gguf.get("tokenizer.ggml.eos_token_id")
    eos_ids = {int(eos)} if eos is not None else set()
    eot = gguf.get("tokenizer.ggml.eot_token_id")
    if eot is not None:
        eos_ids.add(int(eot))
    # Chat models end a turn with their template's end marker even when the GGUF's EOS is another token.
    for marker in ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>", "<turn|>"):
        tid = backend.token_to_id(marker)
        if tid is not None and tid in special:
            eos_ids.add(tid)
    rendered: frozenset[int] = frozenset()
    if harmony.is_harmony_vocab(backend.token_to_id):
        # gpt-oss: a reply ends at <|return|> or <|call|>; <|end|> only closes one channel's message
        # (llama.cpp drops it from the end-of-generation set for this vocabulary too), and the
        # channel markers stay in the text so the reasoning can be told from the reply (engine/text/harmony.py)
        eos_ids.discard(backend.token_to_id("<|end|>"))
        eos_ids.update(backend.token_to_id(t) for t in harmony.STOPS)
        rendered = frozenset(i for i in map(backend.token_to_id, harmony.MARKERS) if i is not None)
    add_bos = gguf.get("tokenizer.ggml.add_bos_token")
    if add_bos is None:
        add_bos = model_type == "llama"
    n_vocab = len(gguf.get("tokenizer.ggml.tokens"))
    fp = text_hash(f"{model_type}|{pre}|{n_vocab}|{bos}|{eos}|" + "".join(gguf.get("tokenizer.ggml.tokens")[:4096]))
    return GGUFTokenizer(backend, int(bos) if bos is not None else None, eos_ids, bool(add_bos),
                         fp, rendered)


class StreamDecoder:
    """Turns a growing token list into text deltas without splitting multi-byte characters."""

    def __init__(self, tokenizer: GGUFTokenizer):
        self.tok = tokenizer
        self.ids: list[int] = []
        self.prefix = 0   # tokens already turned into text, kept for context (leading spaces)
        self.read = 0

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        prefix_text = self.tok.decode(self.ids[self.prefix:self.read])
        full = self.tok.decode(self.ids[self.prefix:])
        if len(full) > len(prefix_text) and not full.endswith("\ufffd"):
            delta = full[len(prefix_text):]
            self.prefix, self.read = self.read, len(self.ids)
            return delta
        return ""

    def flush(self) -> str:
        prefix_text = self.tok.decode(self.ids[self.prefix:self.read])
        full = self.tok.decode(self.ids[self.prefix:])
        self.prefix = self.read = len(self.ids)
        return full[len(prefix_text):]
