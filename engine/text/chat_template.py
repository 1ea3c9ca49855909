"""Chat templates from GGUF metadata, rendered in a bounded jinja2 sandbox (a GGUF template is untrusted).

jinja2's immutable sandbox blocks escapes (`__class__`, `__globals__`, ...) but not exhaustion: nested
`range(100000)` loops, `'a' * 10**9` or `tojson(indent=10**8)` run for minutes or take gigabytes. Two
layers bound a render here, in-process on the engine thread:

1. Single operations that could allocate without limit are checked before they run: `*`, `+`, `**`
   and `%` (intercepted binary operators), every call (huge integer arguments such as
   `'a'.ljust(10**9)`, wide format specs), every filter (integer arguments, result size), `tojson`'s
   indent. The output is produced with `generate()` and stops at MAX_OUTPUT characters.
2. Everything else (loops, recursion, repeated concatenation, slow filters) is bounded by a line
   tracer on the render's Python frames (`sys.settrace`, on the engine thread only): it raises once
   the render passes TIME_BUDGET_S or the process's RSS grows by more than MEMORY_BUDGET over its
   start. The check runs between template lines, and layer 1 bounds what one line can allocate.

Why not a worker process with a timeout and an OS memory limit: macOS does not enforce RLIMIT_AS, a
frozen (PyInstaller) app cannot start a plain Python worker, and a process per request adds latency to
every turn. The tracer only runs while a template renders (a few ms for real templates).

Every failure, whatever the exception, is one RequestError line naming the template.
"""
from __future__ import annotations

import datetime
import functools
import json
import re
import sys
import time
from functools import lru_cache

from jinja2 import DictLoader, TemplateError, TemplateNotFound
from jinja2.sandbox import ImmutableSandboxedEnvironment
import psutil

from engine.errors import RequestError

# Used when a GGUF carries no template: ChatML, which most small instruct models speak.
CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] "
    "+ '<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

MAX_OUTPUT = 16 << 20           # characters: far above any context's worth of text
MAX_SOURCE = 256 << 10          # a template's own characters: real ones are 1-20 KB (gpt-oss: 16.7 KB)
MAX_VALUE = 16 << 20            # the longest string or list one operation may build
MAX_INT_ARG = 1 << 20           # widths, counts, repeats passed to calls and filters
MAX_POW_BITS = 4096
MAX_JSON_INDENT = 16
TIME_BUDGET_S = 5.0
MEMORY_BUDGET = 256 << 20       # RSS growth allowed while one template renders
_WIDE_SPEC = re.compile(r"%[-#0 +]*(\*|\d{5,})|\{[^{}]*:[^{}]*(\*|\d{5,})")


class TemplateBudgetError(TemplateError):
    pass


def _size(value) -> int:
    return len(value) if isinstance(value, (str, bytes, list, tuple)) else 0


def _check_ints(args, kwargs, what: str) -> None:
    for a in (*args, *kwargs.values()):
        if isinstance(a, int) and not isinstance(a, bool) and abs(a) > MAX_INT_ARG:
            raise TemplateBudgetError(f"{what}: argument {a} is over the limit of {MAX_INT_ARG}")


def _check_spec(fmt) -> None:
    if isinstance(fmt, str) and _WIDE_SPEC.search(fmt):
        raise TemplateBudgetError("a format width over 4 digits (or '*') is not allowed")


class BoundedSandbox(ImmutableSandboxedEnvironment):
    intercepted_binops = frozenset({"*", "+", "**", "%"})

    def call_binop(self, context, operator, left, right):
        if operator == "*":
            for seq, n in ((left, right), (right, left)):
                if isinstance(seq, (str, list, tuple)) and isinstance(n, int) and len(seq) * max(0, n) > MAX_VALUE:
                    raise TemplateBudgetError(f"repeating a value of length {len(seq)} {n} times is over the limit")
        elif operator == "+":
            if _size(left) + _size(right) > MAX_VALUE:
                raise TemplateBudgetError("concatenation is over the size limit")
        elif operator == "**":
            if isinstance(left, int) and isinstance(right, int) and abs(left) > 1 \
                    and right * max(1, abs(left).bit_length()) > MAX_POW_BITS:
                raise TemplateBudgetError(f"{left} ** {right} is over the size limit")
        elif operator == "%":
            _check_spec(left)
        return super().call_binop(context, operator, left, right)

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (jinja2's own signature)
        _check_ints(args, kwargs, getattr(__obj, "__name__", "call"))
        if getattr(__obj, "__name__", "") in ("format", "format_map"):
            # the sandbox hands out str.format wrapped: the format string is the wrapped method's self
            inner = getattr(__obj, "__wrapped__", __obj)
            _check_spec(getattr(inner, "__self__", None))
        result = super().call(__context, __obj, *args, **kwargs)
        if _size(result) > MAX_VALUE:
            raise TemplateBudgetError(f"{getattr(__obj, '__name__', 'a call')} built a value over the size limit")
        return result


def _guard_filter(name: str, fn):
    @functools.wraps(fn)
    def guarded(*args, **kwargs):
        _check_ints(args, kwargs, f"filter '{name}'")
        if name == "format" and args:
            _check_spec(args[0] if isinstance(args[0], str) else args[1] if len(args) > 1 else None)
        result = fn(*args, **kwargs)
        if _size(result) > MAX_VALUE:
            raise TemplateBudgetError(f"filter '{name}' built a value over the size limit")
        return result
    return guarded


def _tojson(value, indent=None):
    if indent is not None and (not isinstance(indent, int) or isinstance(indent, bool)
                               or not 0 <= indent <= MAX_JSON_INDENT):
        raise TemplateBudgetError(f"tojson indent must be an integer in 0..{MAX_JSON_INDENT}")
    return json.dumps(value, ensure_ascii=False, indent=indent)


def _raise(message):
    raise TemplateError(message)


@lru_cache(maxsize=8)
def _compile(source: str):
    # An empty loader: `{% include %}`/`{% import %}`/`{% extends %}` name nothing that exists.
    env = BoundedSandbox(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"],
                         loader=DictLoader({}))
    env.filters["tojson"] = _tojson
    env.filters = {name: _guard_filter(name, fn) for name, fn in env.filters.items()}
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(str(fmt)[:64])
    return env.from_string(source)


class _Budget:
    """A sys.settrace tracer that raises inside the template's frames once time or memory runs out."""

    def __init__(self):
        self.proc = psutil.Process()
        self.deadline = time.monotonic() + TIME_BUDGET_S
        self.rss_limit = self.proc.memory_info().rss + MEMORY_BUDGET
        self.next_rss = 0.0

    def global_trace(self, frame, event, arg):
        # Every Python frame the render runs (template code, jinja2's runtime, filters such as
        # wordwrap written in Python): a long filter is interrupted as a long loop is.
        return self.local_trace

    def local_trace(self, frame, event, arg):
        if event == "line":
            self.check()
        return self.local_trace

    def check(self) -> None:
        now = time.monotonic()
        if now > self.deadline:
            raise TemplateBudgetError(f"rendering took longer than {TIME_BUDGET_S:.0f} s")
        # RSS every 2 ms at most (a psutil read costs ~10 us): one line allocates at most MAX_VALUE.
        if now >= self.next_rss:
            self.next_rss = now + 0.002
            if self.proc.memory_info().rss > self.rss_limit:
                raise TemplateBudgetError(f"rendering used more than {MEMORY_BUDGET >> 20} MiB")


def render(source: str | None, messages: list[dict], *, bos_token: str = "", eos_token: str = "",
           add_generation_prompt: bool = True, name: str = "", tools: list[dict] | None = None) -> str:
    """The rendered prompt, or RequestError in one line naming the template (`name`). `tools`: the
    template's `tools` variable (OpenAI's [{"type": "function", "function": {...}}]), left undefined
    when None, as Hugging Face's apply_chat_template does (templates test `tools is defined`)."""
    label = name or ("the built-in ChatML template" if not source else "the model's chat template")
    previous = sys.gettrace()
    try:
        if source and len(source) > MAX_SOURCE:
            raise TemplateBudgetError(f"it is {len(source) >> 10} KiB; templates over {MAX_SOURCE >> 10} KiB "
                                      "are refused")
        # Compiled before the tracer starts: jinja2's compiler under the line tracer took 2.3-2.7 s for
        # gpt-oss's 16.7 KB template (0.28 s without), past a distributed rank's patience on a loaded
        # machine; compiling is bounded by the source's size (MAX_SOURCE) and runs none of its code.
        template = _compile(source or CHATML)
        budget = _Budget()
        sys.settrace(budget.global_trace)
        parts, total = [], 0
        extra = {"tools": tools} if tools else {}
        for chunk in template.generate(messages=messages, add_generation_prompt=add_generation_prompt,
                                       bos_token=bos_token, eos_token=eos_token, **extra):
            total += len(chunk)
            if total > MAX_OUTPUT:
                raise TemplateBudgetError(f"the output passed {MAX_OUTPUT >> 20} M characters")
            parts.append(chunk)
            budget.check()
        return "".join(parts)
    except RecursionError:
        raise RequestError(f"{label} failed: recursion too deep") from None
    except MemoryError:
        raise RequestError(f"{label} failed: out of memory") from None
    except TemplateNotFound as e:
        raise RequestError(f"{label} failed: it includes '{_one_line(e)}', and a chat template cannot "
                           "include other templates") from None
    except TemplateError as e:
        raise RequestError(f"{label} failed: {_one_line(e)}") from None
    except Exception as e:  # noqa: BLE001 - an untrusted template must never surface a traceback
        raise RequestError(f"{label} failed: {type(e).__name__}: {_one_line(e)}") from None
    finally:
        sys.settrace(previous)


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split()) or type(e).__name__
    return text[:200]


def generation_prompt(source: str | None) -> str:
    """What a template appends for the reply (rendered for one user message with and without the
    generation prompt), or "" when it cannot say (the engine reports a bad template itself)."""
    one = [{"role": "user", "content": "x"}]
    try:
        full = render(source, one, add_generation_prompt=True)
        head = render(source, one, add_generation_prompt=False)
    except RequestError:
        return ""
    return full[len(head):] if full.startswith(head) else ""
