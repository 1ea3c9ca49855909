"""What tests read about a model beside a running engine, through public parts only: the tokenizer made
from the GGUF as the engine makes it (its own copy, on the test's thread), and a prompt's token ids as a
generate request would feed them (CountTokens)."""
from __future__ import annotations

from pathlib import Path

from engine.api import CountTokens, GenerateRequest
from engine.gguf_file import open_gguf
from engine.tokenizer import GGUFTokenizer, load_tokenizer


def tokenizer_of(path: str | Path) -> GGUFTokenizer:
    return load_tokenizer(open_gguf(Path(path)))


def prompt_ids(engine, req: GenerateRequest, timeout: float = 120) -> list[int]:
    return engine.call(CountTokens(messages=req.messages, prompt=req.prompt, tools=req.tools), timeout).ids


def while_held(engine, fn):
    """fn(engine) on this thread while the engine's own thread is held between two requests
    (Scheduler.hold): the engine touches nothing meanwhile, so what fn reads or sets up is not changing
    under it. An inline engine (Engine.inline) is this thread's already: fn runs at once."""
    if engine.is_inline:
        return fn(engine)
    hold = engine.scheduler.hold()
    try:
        return fn(engine)
    finally:
        hold.release()
