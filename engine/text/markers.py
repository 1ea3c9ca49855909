"""Held-back text while streaming: how much of a text's end could still become a marker. Plain Python:
the decode loop (stop strings) and the tool-call parser (call markers, which the app also imports) share it."""
from __future__ import annotations


def partial_suffix(text: str, markers) -> int:
    """Length of the longest end of `text` that could start one of `markers`: what streaming holds back
    until it is decided (stop strings in engine/generation/generate.py, tool-call markers in engine/frontends/tool_calls.py)."""
    best = 0
    for mk in markers:
        for n in range(min(len(mk) - 1, len(text)), 0, -1):
            if text.endswith(mk[:n]):
                best = max(best, n)
                break
    return best
