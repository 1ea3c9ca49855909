"""What tests and benches read about a model beside a running engine, through public parts only: the
tokenizer made from the GGUF as the engine makes it (its own copy, on the caller's thread), a prompt's
token ids as a generate request would feed them (CountTokens), and a white-box look at the engine's
objects run on the engine thread between two requests (a Scheduler.hold that does the work)."""
from __future__ import annotations

import threading
from pathlib import Path

from engine.api import CountTokens, GenerateRequest
from engine.model.gguf_file import open_gguf
from engine.scheduler import HOLD_MAX_S, Hold
from engine.text.tokenizer import GGUFTokenizer, load_tokenizer


def tokenizer_of(path: str | Path) -> GGUFTokenizer:
    return load_tokenizer(open_gguf(Path(path)))


def prompt_ids(engine, req: GenerateRequest, timeout: float = 120) -> list[int]:
    return engine.call(CountTokens(messages=req.messages, prompt=req.prompt, tools=req.tools), timeout).ids


class _RunWhileHeld(Hold):
    """A hold whose time on the engine thread runs `fn` (MLX's streams are the thread's own: arrays the
    engine made are evaluated there), then ends by itself."""

    def __init__(self, fn):
        super().__init__()
        self.fn, self.value, self.error = fn, None, None
        self.done = threading.Event()

    def wait_released(self) -> None:
        try:
            self.value = self.fn()
        except BaseException as e:      # handed to the caller, never to the engine thread
            self.error = e
        finally:
            self.done.set()


def while_held(engine, fn, timeout: float = HOLD_MAX_S):
    """fn(engine) on the engine thread between two requests, its value returned here (an error raised
    here): the engine serves nothing meanwhile, so what fn reads or sets up is not changing under it.
    An inline engine (Engine.inline) is this thread's already: fn runs at once."""
    if engine.is_inline:
        return fn(engine)
    run = _RunWhileHeld(lambda: fn(engine))
    engine.scheduler.put(run)
    if not run.done.wait(timeout):
        raise TimeoutError(f"the engine thread did not run it within {timeout:g} s")
    if run.error is not None:
        raise run.error
    return run.value
