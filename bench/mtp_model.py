"""The expected decode speed-up of MTP drafting from measured pass costs (bench/spec.py --mtp-costs and
bench/gemma4_mtp_costs.py both report it; the formula is bench/spec.py's docstring)."""
from __future__ import annotations


def mtp_speedup(a: float, k: int, t: dict, head: float, snap: float, restore: float) -> float:
    """Expected decode speed-up of depth-k MTP drafting at per-draft acceptance a: t[n] is the target's
    pass over n tokens, `head` one drafter step, `snap`/`restore` the state's copies around a verify."""
    tokens = sum(a ** j for j in range(k + 1))
    cost = t[k + 1] + snap + k * head + sum(a ** j * (1 - a) * (restore + t[j + 1]) for j in range(k))
    return tokens * t[1] / cost
