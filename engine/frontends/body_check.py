"""A request body read as JSON whose every value the handlers can use as it is: text that is valid
Unicode (no lone surrogate: it cannot be encoded, tokenized or echoed back), numbers within stated
bounds, nesting within a stated depth. One pass where the body is parsed, so no handler meets a value
that breaks it deep inside (int() of 5,000 digits, a recursion limit, a UnicodeEncodeError while the
400 message is written).

    body = parse_body(raw)        # BodyError(message, param) on the first value refused

Bounds (README, Reliability):
- an integer literal has at most MAX_INT_DIGITS digits; any number literal at most MAX_NUMBER_CHARS
  characters and a finite value (NaN, Infinity and 1e400 refused: no field takes them);
- arrays and objects nest at most MAX_DEPTH levels (the body itself is level 1);
- every string, object keys included, is valid Unicode (NUL is text like any other character).
"""
from __future__ import annotations

import json
import math
import re

MAX_INT_DIGITS = 64
MAX_NUMBER_CHARS = 400
MAX_DEPTH = 64

_PLAIN_KEY = re.compile(r"[A-Za-z_$][A-Za-z0-9_$-]{0,63}")


class BodyError(ValueError):
    """A body refused: `message` one line, `param` the field's path (always ASCII), `code`: invalid_json
    (not JSON, or nested too deeply) or invalid_value (a string or number no field can take)."""

    def __init__(self, message: str, param: str | None = None, code: str = "invalid_value"):
        super().__init__(message)
        self.message, self.param, self.code = message, param, code


class _BadNumber:
    """A number literal the body may not hold, kept as a marker so the walk can name its field."""
    __slots__ = ("reason",)

    def __init__(self, reason: str):
        self.reason = reason


def _parse_int(text: str):
    digits = len(text) - text.startswith("-")
    if digits > MAX_INT_DIGITS:
        return _BadNumber(f"an integer of {digits} digits (at most {MAX_INT_DIGITS})")
    return int(text)


def _parse_float(text: str):
    if len(text) > MAX_NUMBER_CHARS:
        return _BadNumber(f"a number of {len(text)} characters (at most {MAX_NUMBER_CHARS})")
    value = float(text)
    if not math.isfinite(value):
        return _BadNumber(f"a number out of range ({text[:24]})")
    return value


def _parse_constant(text: str):
    return _BadNumber(f"{text}, which is not JSON")


def key_path(parent: str, key) -> str:
    """`parent.key` (`parent[i]` for an index), the key escaped (JSON, ASCII) when it is not plain."""
    if isinstance(key, int):
        return f"{parent}[{key}]"
    name = key if _PLAIN_KEY.fullmatch(key) else json.dumps(key[:40], ensure_ascii=True)
    return f"{parent}.{name}" if parent else name


def _short(path: str) -> str:
    """A path of at most ~100 characters (a deep one's run of [0]s elided)."""
    path = re.sub(r"(\[0\]){4,}", "[0]...[0]", path)
    return path if len(path) <= 100 else path[:60] + "..." + path[-37:]


def _valid_text(s: str) -> bool:
    if s.isascii():
        return True
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _surrogate(where: str) -> BodyError:
    where = _short(where)
    return BodyError(f"{where or 'the body'}: the text holds a lone UTF-16 surrogate (such as \\ud800), "
                     "which is not valid Unicode", where or None)


def check_value(value, root: str = "") -> None:
    """BodyError for the first value in `value` (a parsed body) that breaks the bounds above. Iterative:
    no recursion however the body nests."""
    stack = [(value, root, 1)]
    while stack:
        v, where, depth = stack.pop()
        if isinstance(v, str):
            if not _valid_text(v):
                raise _surrogate(where)
        elif isinstance(v, _BadNumber):
            where = _short(where)
            raise BodyError(f"{where or 'the body'}: {v.reason}", where or None)
        elif isinstance(v, (dict, list)):
            if depth > MAX_DEPTH:
                where = _short(where)
                raise BodyError(f"{where or 'the body'}: arrays and objects nest deeper than {MAX_DEPTH} levels",
                                where or None, "invalid_json")
            if isinstance(v, dict):
                for k, item in v.items():
                    if not _valid_text(k):
                        raise _surrogate(key_path(where, k))
                    stack.append((item, key_path(where, k), depth + 1))
            else:
                stack.extend((item, key_path(where, i), depth + 1) for i, item in enumerate(v))


_TOKEN = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"|[\[\]{},:]')


def _too_deep_path(raw: bytes) -> str:
    """The path of the first container nested past MAX_DEPTH in `raw` (JSON too deep for the parser's
    recursion), from its tokens alone: strings skipped whole, brackets counted, keys and indices kept."""
    text = raw.decode("utf-8", "replace")
    stack: list[list] = []                  # [bracket, current key or index] per open container
    last = '""'
    for m in _TOKEN.finditer(text):
        t = m.group()
        if t[0] == '"':
            last = t
        elif t in "[{":
            if len(stack) >= MAX_DEPTH:
                break
            stack.append([t, 0 if t == "[" else ""])
        elif t in "]}":
            if stack:
                stack.pop()
        elif t == ":" and stack and stack[-1][0] == "{":
            try:
                stack[-1][1] = json.loads(last)
            except ValueError:
                stack[-1][1] = "?"
        elif t == "," and stack and stack[-1][0] == "[":
            stack[-1][1] += 1
    path = ""
    for _, key in stack:
        path = key_path(path, key)
    return path


def parse_body(raw: bytes):
    """`raw` as JSON, checked (check_value). BodyError when it is not JSON or breaks a bound."""
    try:
        value = json.loads(raw, parse_int=_parse_int, parse_float=_parse_float, parse_constant=_parse_constant)
    except RecursionError:
        where = _short(_too_deep_path(raw))
        raise BodyError(f"{where or 'the body'}: arrays and objects nest deeper than {MAX_DEPTH} levels",
                        where or None, "invalid_json") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise BodyError(f"We could not parse the JSON body of your request ({e}). "
                        "Send a JSON object with Content-Type: application/json.", code="invalid_json") from None
    check_value(value)
    return value
