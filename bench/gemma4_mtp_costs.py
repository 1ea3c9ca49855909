"""`bench/spec.py --mtp-costs` on a gemma4 model: the pass costs Gemma 4's memory-shared MTP drafter's
speed-up follows from (engine/generation/gemma4_mtp_spec.py), outside the engine.

    .venv/bin/python bench/spec.py --mtp-costs --shape gemma4-e2b-half [--context 640] [--reps 21]
    .venv/bin/python bench/spec.py --mtp-costs --model gemma4.gguf      (its mtp-*.gguf beside it)

Measured, interleaved round by round: the target's pass over n = 1..4 tokens through the tap at a
context past the sliding window (T_n), one drafter step (H: reading the shared K/V, the step, the
argmax), and the target windows' snapshot before a verify pass and restore after a rejection
(engine/cache/layer_cache.py; the drafter itself holds nothing to roll back). The speed-up table is
bench/mtp_model.py's (mtp_speedup) from those figures.

`--shape gemma4-e2b-half`: a random Q8_0 gemma4 with E2B's layout at half its widths (35 layers, 20 of
them sharing K/V, sliding window 512 with every 5th layer global, per-layer embeddings, double-wide
FFN where shared) and an F16 drafter of Google's E2B assistant's layout at half its width (4 blocks,
the last global); the tests' 553-token vocabulary (a real 262,144-token one adds its output head to
both T_1 and H).
"""
from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from bench.harness import Run  # noqa: E402

SHAPES = {
    # target (write_tiny_gemma4 keywords), drafter (write_tiny_gemma4_assistant keywords)
    "gemma4-e2b-half": (dict(n_layer=35, n_embd=768, n_head=8, n_head_kv=1, head_dim=128, global_head_dim=256,
                             n_ff=3072, sliding_window=512, pattern=5, shared_kv_layers=20, n_embd_per_layer=128,
                             context_length=16384),
                        dict(n_layer=4, n_embd=128, n_head=4, n_ff=1024, pattern=4, n_embd_target=768, head_dim=128,
                             global_head_dim=256, sliding_window=512)),
}


def build_pair(name: str, folder: Path) -> Path:
    """Write (once) the target of shape `name` and its drafter beside it (mtp-<stem>.gguf); the target."""
    if name not in SHAPES:
        raise SystemExit(f"unknown gemma4 shape {name!r}; choose from {', '.join(SHAPES)}")
    folder.mkdir(parents=True, exist_ok=True)
    target = folder / f"random-{name}-q8_0.gguf"
    drafter = folder / f"mtp-random-{name}-q8_0.gguf"
    tests = str(ROOT / "tests")
    if tests not in sys.path:
        sys.path.insert(0, tests)            # the factories import each other by their own names
    from gguf_factory_gemma import write_gemma4
    from gguf_factory_gemma4_mtp import write_tiny_gemma4_assistant
    t_kw, d_kw = SHAPES[name]
    if not target.exists():
        write_gemma4(target, ftype="Q8_0", seed=11, **t_kw)
    if not drafter.exists():
        write_tiny_gemma4_assistant(drafter, tensor_type="F16", seed=12, **d_kw)
    return target


def gemma4_mtp_costs(args) -> int:
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from bench.mtp_model import mtp_speedup
    from engine.cache import layer_cache
    from engine.generation import generate
    from engine.device import compute_dtype
    from engine.model.gguf_file import open_gguf
    from engine.model.model_loader import load_model
    from engine.generation import mtp_spec
    from engine.generation.mtp_spec import load_mtp
    path = Path(args.model)
    dtype = compute_dtype()
    model, info = load_model(open_gguf(path), dtype=dtype)
    loaded = load_mtp(path, model, dtype)
    d = mtp_spec.drafter_for(loaded.head, model, loaded.path)
    tap = d.target
    rng = __import__("random").Random(0)
    prompt = [rng.randrange(10, 250) for _ in range(args.context)]
    cache, fed = make_prompt_cache(model), []
    generate.prefill(tap, cache, prompt[:-1], fed)
    mx.eval(tap(mx.array(prompt[-1:])[None], cache=cache))
    fed.append(prompt[-1])
    context = prompt + [prompt[0]]          # the target fed `prompt`; its choice: any token
    p = len(prompt) - 1
    h_p = tap.row(p)
    times: dict = {n: [] for n in (1, 2, 3, 4)}
    snaps, restores, heads = [], [], []
    for _ in range(args.reps):
        for n in (1, 2, 3, 4):
            t0 = time.perf_counter()
            snap = layer_cache.snapshot(cache, len(fed))
            mx.eval(list(snap.layers.values()))
            t1 = time.perf_counter()
            mx.eval(tap(mx.array(prompt[:n])[None], cache=cache))
            t2 = time.perf_counter()
            layer_cache.rollback(cache, len(fed) + n, n, snap, lambda k: None)
            mx.eval(layer_cache.arrays(cache))
            t3 = time.perf_counter()
            snaps.append(t1 - t0)
            times[n].append(t2 - t1)
            restores.append(t3 - t2)
        # the pass just undone left its rows in the tap; a verify pass's replay leaves position p's
        tap.pos0, tap.hidden = p, h_p
        t0 = time.perf_counter()
        d.propose(context, 1)
        heads.append(time.perf_counter() - t0)
    t = {n: statistics.median(v) for n, v in times.items()}
    snap_s, restore_s, head_s = (statistics.median(v) for v in (snaps, restores, heads))
    dev = "GPU" if mx.default_device() == mx.gpu else "CPU"
    a = loaded.head.args
    print(f"{path.name} ({info.n_layer} layers, {info.n_embd} wide) + drafter {loaded.path.name} ({a.n_layer} blocks, "
          f"{a.n_embd} wide), {dev} {str(dtype)[-7:]}, context {args.context}, medians of {args.reps}")
    print("| T_1 | T_2 | T_3 | T_4 | drafter step H | H / T_1 | snapshot | restore |")
    print("|---|---|---|---|---|---|---|---|")
    ms = lambda x: f"{x * 1e3:.2f} ms"  # noqa: E731
    print(f"| {ms(t[1])} | {ms(t[2])} | {ms(t[3])} | {ms(t[4])} | {ms(head_s)} | {head_s / t[1]:.2f} | "
          f"{ms(snap_s)} | {ms(restore_s)} |")
    rec = Run(out=args.out)
    setup = dict(model=path.name, drafter=loaded.path.name, context=args.context, rounds=args.reps)
    for n in (1, 2, 3, 4):
        rec.record(f"T_{n}", t[n] * 1e3, "ms", spread=[x * 1e3 for x in times[n]], **setup)
    rec.record("drafter step H", head_s * 1e3, "ms", **setup)
    rec.record("H / T_1", head_s / t[1], "x", peer="T_1", **setup)
    rec.record("snapshot", snap_s * 1e3, "ms", **setup)
    rec.record("restore", restore_s * 1e3, "ms", **setup)
    print()
    print("| acceptance a | bound (1+a)/(2-a) | k=1 | k=2 | k=3 |")
    print("|---|---|---|---|---|")
    for acc in (0.5, 0.6, 0.7, 0.8, 0.9, 0.95):
        cols = " | ".join(f"{mtp_speedup(acc, k, t, head_s, snap_s, restore_s):.2f}x" for k in (1, 2, 3))
        print(f"| {acc:.2f} | {(1 + acc) / (2 - acc):.2f}x | {cols} |")
    return 0
