"""Chat templates from GGUF metadata, rendered in jinja2's immutable sandbox (a GGUF template is untrusted)."""
from __future__ import annotations

import datetime
import json
from functools import lru_cache

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from .errors import RequestError

# Used when a GGUF carries no template: ChatML, which most small instruct models speak.
CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] "
    "+ '<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def _raise(message):
    raise TemplateError(message)


@lru_cache(maxsize=8)
def _compile(source: str):
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = lambda v, indent=None: json.dumps(v, ensure_ascii=False, indent=indent)
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    return env.from_string(source)


def render(source: str | None, messages: list[dict], *, bos_token: str = "", eos_token: str = "",
           add_generation_prompt: bool = True) -> str:
    try:
        return _compile(source or CHATML).render(
            messages=messages, add_generation_prompt=add_generation_prompt,
            bos_token=bos_token, eos_token=eos_token)
    except TemplateError as e:
        raise RequestError(f"chat template failed: {e}") from None
