"""One engine run over several model files, for tests/engine/test_distributed_archs.py: started once as a
single process and once as every rank of a distributed group (tests/dist_harness.py's environment), so
the architectures share one launch each way instead of one per file.

    python tests/dist_arch_driver.py PLAN.json OUT.json

PLAN: a list of steps {"name", "path", "tokens": N, "session": SESSION_PATH or null, "restore": PATH or
null}. Rank 0 (or the single process) loads each file (LoadModel), generates N greedy tokens for one
prompt, and, with "session": saves a short conversation, lets another conversation take the engine
(parking off, so nothing of the first is held), restores the file and continues the conversation; with
"restore", restores that file (a session another launch saved) and continues the same way; with
"parking", runs conversations A, B, A with parking on. OUT gets
one object per step: the ids, or the step's error message (a refused load is an answer, not a crash).
A follower serves rank 0's requests (engine/frontends/launch.follow) until rank 0 stops.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

# Raw prompts, not chat messages: a chat template's render is timed per rank (a slow one on a loaded
# machine fails one rank only), and the template is not what this test is about.
PROMPT = "Hello there, how are you?"
FIRST = "Tell me about the sea."
OTHER = "Something else entirely, about mountains and rivers."
NEXT = " And the sky?"


def _gen(engine, prompt: str, n: int, conversation: str):
    from engine.api import GenerateRequest
    from engine.sampling import SamplingParams
    return engine.submit(GenerateRequest(prompt=prompt, sampling=SamplingParams(max_tokens=n, temperature=0.0),
                                         conversation=conversation)).result()


def _continue(engine, path: str) -> dict:
    """Restore `path`, then the conversation's next turn: its ids and how much of it came from the file."""
    from engine.api import RestoreSession
    engine.submit(RestoreSession(path, conversation="A")).result()
    first = _gen_first_reply[path]
    g = _gen(engine, FIRST + first + NEXT, 8, "A")
    return {"tokens": g.tokens, "cached": g.cached_tokens}


_gen_first_reply: dict = {}

# Long enough to wrap a tiny model's sliding window (32) before the conversation comes back.
CATS = "Tell me about cats: their whiskers, their paws, their long afternoons asleep in the sun, " \
       "and why they knock things off tables."
DOGS = "Tell me about dogs, please."


def _aba(engine) -> list[dict]:
    """Parking on: A, then B (A parks), then A's next turn (A's K/V comes back): ids and reuse."""
    from engine.api import Configure
    engine.submit(Configure(cache_mib=64)).result()
    try:
        a = _gen(engine, CATS, 6, "A")
        b = _gen(engine, DOGS, 6, "B")
        a2 = _gen(engine, CATS + a.text + " And their tails?", 6, "A")
        return [{"tokens": g.tokens, "cached": g.cached_tokens} for g in (a, b, a2)]
    finally:
        engine.submit(Configure(cache_mib=0)).result()


def run(plan: list[dict]) -> list[dict]:
    from engine.api import EngineOptions, LoadModel, SaveSession
    from engine.engine import Engine
    from engine.errors import StrataError
    engine = Engine(EngineOptions(model=None, cache_mib=0)).start()
    out = []
    try:
        for step in plan:
            res: dict = {"name": step["name"]}
            try:
                engine.submit(LoadModel(step["path"])).result()
                res["tokens"] = _gen(engine, PROMPT, step["tokens"], "P").tokens
                if step.get("session"):
                    first = _gen(engine, FIRST, 6, "A")
                    _gen_first_reply[step["session"]] = first.text
                    engine.submit(SaveSession(step["session"], force=True)).result()       # the live conversation: A
                    _gen(engine, OTHER, 2, "B")          # the engine's only K/V is now B's
                    res["session"] = _continue(engine, step["session"])
                if step.get("restore"):
                    _gen_first_reply[step["restore"]] = step["first_reply"]
                    _gen(engine, OTHER, 2, "B")
                    res["restored"] = _continue(engine, step["restore"])
                    res["first_reply"] = step["first_reply"]
                if step.get("session"):
                    res["first_reply"] = _gen_first_reply[step["session"]]
                if step.get("parking"):
                    res["parking"] = _aba(engine)
            except StrataError as e:
                res["error"] = str(e)
            out.append(res)
    finally:
        engine.stop()
    return out


def main() -> int:
    import logging
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    from engine.ranks import distributed
    if distributed.is_follower():
        from engine.api import EngineOptions
        from engine.ranks.distributed import FollowerGuard
        from engine.engine import Engine
        engine = Engine(EngineOptions(model=None, cache_mib=0))
        engine.guard = FollowerGuard(engine.guard)
        engine.run_forever()
        return 0
    plan = json.loads(Path(sys.argv[1]).read_text())
    Path(sys.argv[2]).write_text(json.dumps(run(plan)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
