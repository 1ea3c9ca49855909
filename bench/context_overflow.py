"""What each overflow policy costs in K/V reuse: a chat grown past its context, turn by turn.

    python bench/context_overflow.py [--model PATH] [--ctx 1024] [--turns 60] [--max-tokens 8]

Each turn sends the whole history (as the app and the server's clients do) under `stop`,
`truncate_middle` and `rolling` (engine/text/context_policy.py) and reads the reply's prompt and cached
tokens. Per policy: the turns that left messages out, the turns whose cut moved (the history past the
pinned head read again), the prompt tokens read in all (prompt less cached), and, for comparison, what
a cut moved every turn would have read (each dropping turn reading everything past the pinned head).
Without --model a tiny generated llama (tests/gguf_factory.py) is used: the token figures depend on
the context and the turn sizes, not on the model's weights.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
from bench.harness import Run, add_args, held   # noqa: E402
from engine.engine import Engine, EngineOptions, GenerateRequest   # noqa: E402
from engine.errors import EngineError   # noqa: E402
from engine.sampling import SamplingParams   # noqa: E402

SYSTEM = {"role": "system", "content": "You answer in a few words."}


def pinned_tokens(eng: Engine, messages: list[dict]) -> int:
    def fn(e):
        text, add_bos = e.prompts.render_messages(messages, generation_prompt=False)
        return len(e.tokenizer.encode_prompt(text, add_bos=add_bos))
    return held(eng, fn)


def run(eng: Engine, policy: str, turns: int, max_tokens: int) -> dict:
    msgs, rows = [SYSTEM], []
    for t in range(turns):
        msgs.append({"role": "user", "content": f"Question {t}: tell me about the tea harvest number {t} please."})
        try:
            r = eng.call(GenerateRequest(messages=msgs, overflow=policy, conversation=f"bench-{policy}",
                                         sampling=SamplingParams(temperature=0, max_tokens=max_tokens)))
        except EngineError as e:
            return {"rows": rows, "refused_at": t, "why": str(e)}
        rows.append(r)
        msgs.append({"role": "assistant", "content": r.text})
    head = pinned_tokens(eng, msgs[:1] if policy == "rolling" else msgs[:3])
    return {"rows": rows, "head": head}


def report(policy: str, out: dict, rec: Run, settings: dict) -> str:
    rows = out["rows"]
    if "refused_at" in out:
        rec.record(f"{policy}_turns_answered", len(rows), "turns", **settings)
        return f"{policy:16} refused at turn {out['refused_at']} ({out['why'][:60]}), {len(rows)} turns answered"
    dropping = [i for i, r in enumerate(rows) if r.dropped_messages]
    moved = [i for i in dropping if rows[i - 1].dropped_messages != rows[i].dropped_messages]
    read = sum(r.prompt_tokens - r.cached_tokens for r in rows)
    every = sum(rows[i].prompt_tokens - out["head"] for i in dropping) + \
        sum(r.prompt_tokens - r.cached_tokens for i, r in enumerate(rows) if i not in dropping)
    rec.record(f"{policy}_cut_moves", len(moved), "turns", dropping_turns=len(dropping), **settings)
    rec.record(f"{policy}_tokens_read", read, "tokens", peer=every, **settings)
    return (f"{policy:16} {len(dropping):>5} {len(moved):>6} {read:>11,} {every:>16,}"
            f"   (pinned head {out['head']} tokens)")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model")
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--turns", type=int, default=60)
    ap.add_argument("--max-tokens", type=int, default=8)
    add_args(ap)
    a = ap.parse_args()
    rec = Run(out=a.out)
    model = a.model
    if not model:
        from gguf_factory import write_tiny_gguf
        model = str(write_tiny_gguf(Path(tempfile.mkdtemp()) / "tiny-bench.gguf", arch="llama", n_layer=2,
                                    n_embd=64, seed=5, context_length=max(2048, a.ctx)))
    eng = Engine(EngineOptions(model=model, context_length=a.ctx)).start()
    try:
        print(f"context {a.ctx}, {a.turns} turns, max tokens {a.max_tokens}, model {Path(model).name}")
        print(f"{'policy':16} {'drops':>5} {'moved':>6} {'tokens read':>11} {'cut every turn':>16}")
        for policy in ("stop", "truncate_middle", "rolling"):
            settings = {"model": Path(model).name, "context": a.ctx, "turns": a.turns, "max_tokens": a.max_tokens}
            print(report(policy, run(eng, policy, a.turns, a.max_tokens), rec, settings))
    finally:
        eng.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
