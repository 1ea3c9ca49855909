"""Does a cache rolled back after a reply equal a fresh read of the prompt, bitwise, and what moves a
float16 reply? (bench/gpu.md, session 13: the H200 answers for bench/edit_replay.py.)

    python bench/rollback_check.py SHAPE [float32|float16]     (default: the engine's compute dtype)

On bench/edit_replay.py's history (the editing trace's prompt folded into the shape's vocabulary):
1. two fresh reads; a plain greedy reply then the rollback (layer_cache.snapshot/rollback, as the
   bench's --reuse does) against a fresh read: the held arrays' max |d| and the next reply;
2. a speculative run (the replayed editing drafts) then the rollback, the same comparisons;
3. speculative and plain replies from fresh reads whose K/V buffers are padded to 1,024 / 2,048
   positions (the capacity a kept cache grows to): does the buffer's capacity change a reply?
"""

import json
import sys
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache
from bench.shapes import build_random_model
from bench.edit_replay import ReplayDrafter
from bench.harness import Run
from engine.cache import layer_cache
from engine.generation import generate, speculative
from engine.device import compute_dtype
from engine.model.gguf_file import open_gguf
from engine.model.model_loader import load_model
from engine.sampling import SamplingParams

shape = sys.argv[1]
dtype = getattr(mx, sys.argv[2]) if len(sys.argv) > 2 else compute_dtype()
trace = json.loads((Path(__file__).resolve().parent / "edit_trace.json").read_text())
model, info = load_model(open_gguf(build_random_model(shape, Path("/tmp/strata-shapes"))), dtype=dtype)
V = model.args.vocab_size
hist = [16 + t % (V - 16) for t in trace["prompt"]]
greedy = SamplingParams(temperature=0.0, max_tokens=160)
RUN = Run()     # figures to $BENCH_RESULTS or bench/results/results.jsonl (no argparse here)
SETUP = dict(shape=shape, dtype=str(dtype).split(".")[-1])


def pre(cap=0):
    c, f = make_prompt_cache(model), []
    generate.prefill(model, c, hist[:-1], f)
    for x in c:
        if cap and getattr(x, "keys", None) is not None and hasattr(x, "offset") and x.keys.shape[2] < cap:
            z = lambda a: mx.concatenate([a, mx.zeros((*a.shape[:2], cap - a.shape[2], a.shape[3]), a.dtype)], axis=2)
            x.keys, x.values = z(x.keys), z(x.values)
    mx.eval(layer_cache.arrays(c))
    return c, f


def spec(c, f, target):
    """A greedy reply drafted as lookup drafted on the editing reply, `target` being the target's own."""
    s = speculative.SpecStats()
    out = list(speculative.decode(model, c, hist[-1], f, history=list(hist), sampling=greedy, processors=[],
                                  max_tokens=160, stats=generate.StepStats(), spec=s,
                                  drafter=ReplayDrafter(trace, len(hist), target, V, 8)))
    return out, s.accepted


def dec(c, f):
    return list(generate.decode(model, c, hist[-1], f, history=list(hist), sampler=greedy.sampler(V), processors=[],
                                max_tokens=160, stats=generate.StepStats()))


def live(c):
    out = []
    for x in c:
        if getattr(x, "keys", None) is not None and hasattr(x, "offset"):
            out += [x.keys[..., :x.offset, :], x.values[..., :x.offset, :]]
        else:
            out += [a for a in layer_cache.snapshot_arrays(x.state) if a is not None]
    return out


def maxd(a, b):
    return max(float(mx.max(mx.abs(x.astype(mx.float32) - y.astype(mx.float32)))) for x, y in zip(live(a), live(b)))


def caps(c):
    return sorted({x.keys.shape[2] for x in c if getattr(x, "keys", None) is not None and hasattr(x, "offset")})


def first(a, b):
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


def rolled_back(run):
    """A fresh read, `run` (a reply) from it, then the bench's rollback: the cache, its held ids, the reply."""
    c, f = pre()
    held = len(f)
    snap = layer_cache.snapshot(c, held)
    out = run(c, f)
    layer_cache.rollback(c, len(f), len(f) - held, snap, lambda k: None)
    del f[held:]
    return c, f, out


# 1. a plain reply, rolled back
A, fa = pre()
B, fb = pre()
print("two fresh reads: max|d|", maxd(A, B), "K/V capacity", caps(A))
R, fr, first_reply = rolled_back(dec)
RUN.record("max |d| after a plain reply's rollback vs a fresh read", maxd(R, A), "", **SETUP,
           line=f"after a plain reply and its rollback vs a fresh read: max|d| {maxd(R, A)} capacity {caps(R)} vs {caps(A)}")
plain = dec(A, fa)
print("plain replies from two fresh reads: first difference", first(first_reply, plain))
print("reply from the rolled-back cache vs from a fresh read: first difference", first(dec(R, fr), plain))

# 2. a speculative reply, rolled back
S, fs, (outS, acc) = rolled_back(lambda c, f: spec(c, f, plain))
RUN.record("speculative reply vs plain: first difference", first(outS, plain), "token", accepted=acc, **SETUP,
           line=f"speculative reply vs plain: first difference {first(outS, plain)} accepted {acc}")
RUN.record("max |d| after a speculative reply's rollback vs a fresh read", maxd(S, B), "", **SETUP,
           line=f"after it and its rollback vs a fresh read: max|d| {maxd(S, B)}")
print("reply from that cache vs from a fresh read: first difference", first(dec(S, fs), plain))

# 3. the K/V buffer's capacity
s768, a768 = spec(*pre(), plain)
s768b, _ = spec(*pre(), plain)
s1024, a1024 = spec(*pre(1024), plain)
s2048, a2048 = spec(*pre(2048), plain)
print("speculative, fresh read: vs plain", first(s768, plain), "accepted", a768, "| run again:", first(s768b, s768))
print("speculative, K/V padded to 1024 vs not:", first(s1024, s768), "accepted", a1024)
print("speculative, K/V padded to 2048 vs not:", first(s2048, s768), "accepted", a2048)
print("plain, K/V padded to 1024 / 2048 vs not:", first(dec(*pre(1024)), plain), first(dec(*pre(2048)), plain))
