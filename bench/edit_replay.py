"""Prompt lookup on an editing task, on a target whose state cannot trim back (Qwen3.5-like), end to end.

    .venv/bin/python bench/edit_replay.py --record [--model PATH] [--max-tokens 160]
    .venv/bin/python bench/edit_replay.py --shape qwen35-0.8b [--rounds 10]
    .venv/bin/python bench/edit_replay.py --model SmolLM2-...gguf --rounds 10      (the check, below)

Why a replay: a random-weight target never repeats an edited text, so prompt lookup's acceptance on it
means nothing, and no real Qwen3.5 file can be fetched here. What the speed-up follows from is (a) how
often lookup's drafts are right on an editing reply and (b) what a verify pass, the recurrent state's
snapshot, its restore and the re-feed of the accepted tokens cost on the target. (a) comes from a real
model: `--record` runs bench/spec.py's editing prompt (rename a variable in a 60-line function) through
the default model greedily and stores the prompt's and the reply's token ids in bench/edit_trace.json.
(b) is measured here, in the engine's own speculative loop (engine/speculative.decode, with its
snapshot / restore / replay rollback and its never-slower rules) on the target:

  ReplayDrafter: at reply position i it runs the real LookupDrafter (the device's draft length) over
  the recorded text up to i, and compares its draft with the recorded reply: the first n tokens equal,
  the rest not. It proposes as many tokens, the first n being the target's own greedy continuation
  (from a plain run) and the rest wrong. So every verify pass drafts and is accepted exactly as lookup
  was on the real editing reply, and the target pays its real costs for it.

The target's history is the recorded prompt's ids folded into its vocabulary (same length: attention
costs the same). Each round times a plain greedy decode ("off": engine/generate.decode, pipelined) and
the replayed speculation, alternating which goes first, each from the prompt read afresh (untimed); the
table gives medians, the spread of the per-round ratios, and the acceptance obtained.
In float32 speculation's greedy reply must be the plain one (`--exact`). In float16 a verify pass and a
one-token step may pick apart at a near-tie (a random target has many); the drafter then follows
speculation's own greedy reply (found by running it until it repeats), so that acceptance stays the
trace's, and the bench says where the two replies first differ.

The check: on a full-K/V model that the trace came from (`--model` = the recording model), the replay
runs the same drafts lookup itself would, so its speed-up must match bench/spec.py's real lookup run.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.harness import Run, add_args  # noqa: E402
from bench.shapes import CHOICES  # noqa: E402

TRACE = Path(__file__).resolve().parent / "edit_trace.json"


def record(args) -> int:
    from bench.spec import edit_prompt
    from engine.engine import Engine, EngineOptions, GenerateRequest, Status
    from engine.sampling import SamplingParams
    engine = Engine(EngineOptions(model=args.model)).start()
    st = engine.call(Status(), timeout=600)
    assert st.model, "the model did not load"
    req = GenerateRequest(messages=[{"role": "user", "content": edit_prompt()}],
                          sampling=SamplingParams(max_tokens=args.max_tokens))
    prompt = engine.prompts.prompt_tokens(req)
    reply = engine.call(req, timeout=3600)
    engine.stop()
    TRACE.write_text(json.dumps({"model": Path(args.model).name, "prompt": prompt, "reply": reply.tokens,
                                 "text": reply.text}, separators=(",", ":")) + "\n")
    print(f"recorded {len(prompt)} prompt and {len(reply.tokens)} reply tokens of {Path(args.model).name} "
          f"into {TRACE}", file=sys.stderr)
    return 0


class ReplayDrafter:
    """Drafts as prompt lookup drafted on the recorded editing reply (module docstring)."""

    def __init__(self, trace: dict, history_len: int, target_reply: list[int], n_vocab: int, draft_len: int):
        from engine.generation.speculative import LookupDrafter
        self.lookup = LookupDrafter(draft_len=draft_len)
        self.text = trace["prompt"] + trace["reply"]
        self.base = len(trace["prompt"])
        self.history_len = history_len
        self.target = target_reply
        self.n_vocab = n_vocab

    def propose(self, context: list[int], k: int) -> tuple[list[int], None]:
        i = len(context) - self.history_len           # reply tokens delivered so far
        if i >= len(self.target) or self.base + i > len(self.text):
            return [], None
        real, _ = self.lookup.propose(self.text[:self.base + i], k)
        truth = self.text[self.base + i:]
        n = 0
        while n < len(real) and n < len(truth) and real[n] == truth[n]:
            n += 1
        own = self.target[i:i + len(real)]
        return [t if j < n else (t + 1) % self.n_vocab for j, t in enumerate(own)], None


def replay(args) -> int:
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from bench.shapes import build_random_model
    from engine.cache import layer_cache
    from engine.generation import generate, speculative
    from engine.device import compute_dtype, on_gpu
    from engine.model.gguf_file import open_gguf
    from engine.model.model_loader import load_model
    from engine.sampling import SamplingParams
    trace = json.loads(TRACE.read_text())
    path = Path(args.model) if not args.shape else build_random_model(args.shape, Path("/tmp/strata-shapes"))
    dtype = getattr(mx, args.dtype) if args.dtype else compute_dtype()
    model, info = load_model(open_gguf(path), dtype=dtype)
    n_vocab = model.args.vocab_size
    same_vocab = max(trace["prompt"] + trace["reply"]) < n_vocab and not args.shape
    # Folded into a small vocabulary past its control tokens: the length is what attention pays for.
    history = trace["prompt"] if same_vocab else [16 + t % (n_vocab - 16) for t in trace["prompt"]]
    max_tokens = len(trace["reply"])

    def prefilled():
        cache, fed = make_prompt_cache(model), []
        generate.prefill(model, cache, history[:-1], fed)
        mx.eval(layer_cache.arrays(cache))
        return cache, fed

    kept = prefilled() if args.reuse else None
    draft_len = args.draft_len or (speculative.LOOKUP_DRAFT_GPU if on_gpu() else speculative.LOOKUP_DRAFT_CPU)
    greedy = SamplingParams(temperature=0.0, max_tokens=max_tokens)

    def run(mode: str, target: list[int] | None):
        """One reply from the prompt, read again untimed (or, with --reuse, from the kept cache, put back after)."""
        cache, fed = kept or prefilled()
        snap = layer_cache.snapshot(cache, len(fed))
        held = list(fed)
        stats = generate.StepStats()
        t0 = time.perf_counter()
        if mode == "off":
            it = generate.decode(model, cache, history[-1], fed, history=list(history), sampler=greedy.sampler(n_vocab),
                                 processors=[], max_tokens=max_tokens, stats=stats)
            spec = None
        else:
            spec = speculative.SpecStats()
            drafter = ReplayDrafter(trace, len(history), target, n_vocab, draft_len)
            it = speculative.decode(model, cache, history[-1], fed, history=list(history), sampling=greedy,
                                    processors=[], max_tokens=max_tokens, stats=stats, spec=spec, drafter=drafter)
        out = list(it)
        secs = time.perf_counter() - t0
        layer_cache.rollback(cache, len(fed), len(fed) - len(held), snap, lambda k: None)
        del fed[len(held):]
        assert fed == held
        return out, secs, spec

    plain, _, _ = run("off", None)            # the target's own greedy reply (also the warm-up)
    # In float16 a verify pass (several positions in one matmul) and a one-token step can pick different
    # tokens at a near-tie; from there on the plain reply is no guide to what the target says, and every
    # later draft would be wrong for a reason lookup on a real model does not have. So the drafter follows
    # the speculative run's own greedy reply: run it, take its output as the next target, until the output
    # is the target (each pass moves the first disagreement later: the passes before it are unchanged).
    target, settle, out = plain, 0, plain
    while settle < args.settle:
        out, _, _ = run("replay", target)
        settle += 1
        if out == target:
            break
        target = out
    settled = out == target
    split = next((i for i, (a, b) in enumerate(zip(plain, target)) if a != b), None)
    rows: dict = {"off": [], "replay": []}
    accepted = drafted = 0
    same = True
    stopped = set()
    for r in range(args.rounds):
        for mode in (("off", "replay") if r % 2 == 0 else ("replay", "off")):
            out, secs, spec = run(mode, target)
            rows[mode].append(secs)
            same &= out == (plain if mode == "off" else target)
            if spec is not None:
                accepted += spec.accepted
                drafted += spec.drafted
                if spec.stopped:
                    stopped.add(spec.stopped)
        print(f"  round {r}: off {rows['off'][-1]:.3f} s, replay {rows['replay'][-1]:.3f} s", file=sys.stderr,
              flush=True)
    # the acceptance lookup had on the real reply with this draft length (bench/spec.py's simulate)
    from bench.spec import simulate
    passes, t_dr, t_acc = simulate(trace["prompt"], trace["reply"], speculative.NGRAM_MAX, speculative.NGRAM_MIN,
                                   draft_len)
    ratios = sorted(o / s for o, s in zip(rows["off"], rows["replay"]))
    dev = "GPU" if on_gpu() else "CPU"
    tps = lambda s: (max_tokens - 1) / s  # noqa: E731 - whole reply incl. the first token, both modes alike
    print(f"{path.name} ({info.n_layer} layers, {info.n_embd} wide), {dev} {str(dtype).split('.')[-1]}, history "
          f"{len(history)} tokens, reply {max_tokens} tokens, lookup draft length {draft_len}, {args.rounds} rounds; "
          f"trace: {trace['model']}")
    print(f"speculation's greedy reply vs the plain one: "
          + ("identical" if split is None else f"first differs at reply token {split} of {max_tokens} "
             f"(a verify pass and a one-token step part there; the drafter followed speculation's own reply, "
             f"settled in {settle} passes)")
          + ("" if settled else f"; NOT settled after {settle} passes"))
    print("| mode | reply tok/s (median) | speed-up (median [min-max] of rounds) | accepted/drafted | "
          "trace's accepted/drafted | same tokens every round |")
    print("|---|---|---|---|---|---|")
    print(f"| off | {tps(statistics.median(rows['off'])):.1f} | 1.00x | - | - | {'yes' if same else 'NO'} |")
    print(f"| lookup (replayed) | {tps(statistics.median(rows['replay'])):.1f} | "
          f"**{statistics.median(ratios):.2f}x** [{ratios[0]:.2f}-{ratios[-1]:.2f}] | "
          f"{accepted // max(1, args.rounds)}/{drafted // max(1, args.rounds)} per reply | {t_acc}/{t_dr} | "
          f"{'yes' if same else 'NO'} |" + (f" stopped: {'; '.join(sorted(stopped))}" if stopped else ""))
    rec = Run(out=args.out)
    setup = dict(model=path.name, dtype=str(dtype).split('.')[-1], history_tokens=len(history), reply_tokens=max_tokens,
                 draft_len=draft_len, rounds=args.rounds, same_tokens=same)
    rec.record("off reply", tps(statistics.median(rows['off'])), "tok/s", **setup)
    rec.record("lookup (replayed) reply", tps(statistics.median(rows['replay'])), "tok/s", **setup)
    rec.record("lookup (replayed) speed-up", statistics.median(ratios), "x", peer="off", spread=ratios,
               accepted=accepted // max(1, args.rounds), drafted=drafted // max(1, args.rounds), **setup)
    return 0 if same and settled and (split is None or not args.exact) else 1


def main() -> int:
    from engine.model.models import default_model_path
    ap = argparse.ArgumentParser()
    ap.add_argument("--record", action="store_true", help="record the editing trace with --model")
    ap.add_argument("--model", default=str(default_model_path()))
    ap.add_argument("--shape", default=None, choices=CHOICES, help="a random target of bench/shapes.py")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--max-tokens", type=int, default=160, help="--record: the reply's length")
    ap.add_argument("--draft-len", type=int, default=0, help="lookup's draft length (default: the engine's)")
    ap.add_argument("--dtype", choices=("float32", "float16", "bfloat16"), default=None,
                    help="compute dtype (default: the engine's, float16 on a GPU)")
    ap.add_argument("--settle", type=int, default=40, help="passes to find speculation's own greedy reply")
    ap.add_argument("--reuse", action="store_true",
                    help="restore one prefilled cache between runs instead of reading the prompt again (in float16 "
                         "on the H200 replies then varied between rounds: bench/gpu.md, session 13)")
    ap.add_argument("--exact", action="store_true",
                    help="fail unless speculation's greedy reply is the plain one (float32: no near-ties)")
    add_args(ap)
    args = ap.parse_args()
    return record(args) if args.record else replay(args)


if __name__ == "__main__":
    sys.exit(main())
