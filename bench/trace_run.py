"""Run a bench script with the engine's log on, a stack dump every N seconds, and chosen GPU-only
engine features turned off, to find where a slow run spends its time (used on the H200).

    python bench/trace_run.py [--every 20] [--no-explicit-attention] [--no-warm-up] [--no-merge] -- bench/turns.py ARGS...
"""
from __future__ import annotations

import argparse
import faulthandler
import logging
import os
import runpy
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--every", type=float, default=20.0, help="seconds between stack dumps")
    ap.add_argument("--no-explicit-attention", action="store_true")
    ap.add_argument("--no-warm-up", action="store_true")
    ap.add_argument("--no-merge", action="store_true", help="prefill a turn's new tokens apart from its first step")
    ap.add_argument("script")
    ap.add_argument("args", nargs=argparse.REMAINDER)
    a = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(relativeCreated)8.0f ms %(name)s: %(message)s")
    from engine.model import attention
    from engine.model import model_loader
    if a.no_explicit_attention:
        attention.needed = lambda: False
    if a.no_merge:
        from engine.generation import generate
        generate.first_step_merge_limit = lambda chunk: 0
    if a.no_warm_up:
        model_loader.warm_up = lambda model: 0.0
    faulthandler.dump_traceback_later(a.every, repeat=True, file=sys.stderr)
    # the figures' "command" (bench/harness.py) is this wrapper's whole line: its switches are part of the A/B
    os.environ["BENCH_COMMAND"] = " ".join(sys.argv)
    sys.argv = [a.script] + [x for x in a.args if x != "--"]
    runpy.run_path(a.script, run_name="__main__")


if __name__ == "__main__":
    main()
