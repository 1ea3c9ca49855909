"""Control-vector benchmarks on the default model (SmolLM2-135M-Instruct Q4_1).

Cost (default): what the vector costs when on, against the same engine with it off.

    python bench/cvec.py [--model PATH] [--vector FILE] [--mode project] [--scale 2] [--range A B]
                         [--repeat 3] [--prompt-tokens 128] [--decode-tokens 32]

  One engine, the vector loaded; requests alternate speed_projection off/on (an off request runs the
  stock forward: the wrappers return the block output untouched). Each request starts from an empty
  K/V (parking off, the live entry dropped) so every prefill is a full one. Prefill: a raw prompt of
  --prompt-tokens tokens, max_tokens 1 (the engine's ttft = prefill + first token). Decode: ms per
  generated token after the first (the engine's decode_tps), --decode-tokens tokens. Medians over
  --repeat alternating pairs, after one warm-up pair; ratio on/off, both of the medians and the
  median of the per-pair ratios (robust to load drifting between pairs on a shared machine).
  Forward alone: the model's forward with the switch flipped at every step (decode steps and
  prefill chunks on a fixed-length K/V), median of the adjacent-pair ratios: the cleanest number on a
  shared machine.
  Kernel: ``steer()`` alone (the dispatch the engine uses, on the active backend) for every steered
  layer of one token, evaluated per token, median over many iterations; and for one prefill chunk.

  --steering-op portable: the steering runs as mx.compile'd MLX ops on any backend instead of the
  GPU kernel; compiled-kernel: the kernel's call is traced by mx.compile; residual-add: the steered
  blocks take their fused path but only add (the wrapper's own cost, the floor). --shader FILE: the
  kernel built from another body (A/Bs on one GPU). The forward's table also times its graph building
  alone (host), which is where a custom kernel call's cost shows.

  --random-shape llama1b|smollm2: the model is a random-weight Q8_0 GGUF of that shape
  (bench/shapes.py, EOS ignored); the vector is the shipped SmolLM2 one for smollm2 (same width and
  depth) and, for llama1b, random unit directions for every block 1..15 written to the shape folder.

Effect (--effect): the shipped vector's effect on reply length and wall time.

    python bench/cvec.py --effect [--settings off project:1:4-20 ...] [--max-tokens 96]

  The prompts of resources/prompts/cvec-effect.txt as single user messages, greedy, max_tokens 96;
  every setting runs each prompt (settings interleaved per prompt so machine-load drift hits them
  alike). A setting is ``off`` or ``MODE:SCALE:A-B`` (the vector file loaded with that mode, scale and
  inclusive layer range, swapped in on the engine thread). Reports mean reply tokens, how many
  replies ended by themselves (EOS) before the cap, and mean wall time per request.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from bench.harness import Run, add_args, held  # noqa: E402

DEFAULT_VECTOR = REPO / "resources" / "control-vectors" / "smollm2-135m-concise.gguf"
EFFECT_PROMPTS = REPO / "resources" / "prompts" / "cvec-effect.txt"
# The setting the shipped vector is meant to be used with (see bench/README.md).
SHIPPED = {"mode": "project", "scale": 2.0, "range": (4, 20)}
PREFILL_TEXT = ("The history of the city is long and full of change. It began as a small fishing village "
                "on the banks of a wide river, where families built wooden houses and traded salt, fish and "
                "grain with the farmers of the valley. Over the centuries the village grew into a market "
                "town, then into a city with stone walls, a cathedral, a university and a busy harbour. ")


def machine() -> str:
    import mlx.core as mx
    cpu = platform.processor() or platform.machine()
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return (f"{platform.system()} {platform.release()}, {cpu}, {os.cpu_count()} vCPU, "
            f"mlx {mx.__version__} ({mx.default_device()}), load avg {os.getloadavg()[0]:.1f}")


def default_model() -> str:
    env = os.environ.get("STRATA_TEST_MODEL")
    if env:
        return env
    from engine.model.models import default_model_path
    p = default_model_path()
    if p.exists():
        return str(p)
    alt = Path("/tmp/sh/models/SmolLM2-135M-Instruct.Q4_1.gguf")
    return str(alt if alt.exists() else p)


def start_engine(model: str, vector: str, mode: str, scale: float, rng: tuple[int, int] | None):
    from engine.steer.control_vector import SteeringConfig
    from engine.engine import Engine, EngineOptions, Status
    cfg = SteeringConfig(files=((vector, scale),), mode=mode, layer_range=rng)
    eng = Engine(EngineOptions(model=model, steering=cfg, cache_mib=0)).start()
    st = eng.call(Status())
    if st.model is None:
        raise SystemExit("the model did not load")
    return eng, st


def fresh(eng) -> None:
    """Drop the live K/V so the next request prefills everything."""

    def drop(e):
        e.conversations.live = None
    held(eng, drop)


def gen(eng, *, prompt=None, messages=None, max_tokens=32, on=True) -> tuple[dict, float]:
    from engine.engine import GenerateRequest
    from engine.sampling import SamplingParams
    fresh(eng)
    t0 = time.perf_counter()
    r = eng.call(GenerateRequest(prompt=prompt, messages=messages, speed_projection=on,
                                 sampling=SamplingParams(max_tokens=max_tokens, temperature=0.0)))
    return r, time.perf_counter() - t0


# ------------------------------------------------------------------------------------------ cost
def kernel_time(eng, rows: int, iters: int) -> dict:
    """steer() alone for every steered layer, on the engine thread (its device and stream)."""

    def run(e):
        import mlx.core as mx

        from engine.steer.steering import active_backend, steer
        vec = e.steering.vector
        layers = vec.steered_layers()
        h = mx.random.normal((1, rows, e.info.n_embd)).astype(e.dtype)
        mx.eval(h)
        dirs = [vec.directions[il] for il in layers]
        for _ in range(10):
            mx.eval([steer(h, d, vec.scale, vec.mode) for d in dirs])
        per_all, per_one = [], []
        for _ in range(iters):
            t0 = time.perf_counter()
            mx.eval([steer(h, d, vec.scale, vec.mode) for d in dirs])     # one token: all layers
            per_all.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            mx.eval(steer(h, dirs[0], vec.scale, vec.mode))               # one layer
            per_one.append(time.perf_counter() - t0)
        return {"backend": active_backend(), "layers": len(layers), "rows": rows,
                "all_layers_ms": statistics.median(per_all) * 1e3,
                "one_layer_ms": statistics.median(per_one) * 1e3}
    return held(eng, run)


def step_time(eng, steps: int, chunk: int, chunks: int) -> dict:
    """The model's forward alone, the switch flipped at every step (on the engine thread).

    Decode: one token at a time on a K/V holding a prompt; after each step the cache is trimmed
    back, so every step sees the same length. Prefill: chunks of `chunk` tokens, trimmed back the
    same way. Adjacent on/off steps run ~0.2 s apart, so load drift on a shared machine cancels in
    the per-pair ratios far better than between whole requests."""

    def run(e):
        import mlx.core as mx
        st = e.steering
        ids = e.tokenizer.encode(PREFILL_TEXT, add_bos=False)
        cache = e.handlers.make_cache()
        e.model(mx.array(ids[:48])[None], cache=cache)
        mx.eval([c.state for c in cache])
        tok = mx.array([[ids[48]]])
        block = mx.array([(ids * 4)[:chunk]])
        res = {"decode": {True: [], False: []}, "prefill": {True: [], False: []}}
        host = {"decode": {True: [], False: []}, "prefill": {True: [], False: []}}   # graph building alone
        was = st.speed_projection

        def one(x, on, key):
            st.speed_projection = on
            t0 = time.perf_counter()
            y = e.model(x, cache=cache)
            built = time.perf_counter()
            mx.eval(y)
            res[key][on].append(time.perf_counter() - t0)
            host[key][on].append(built - t0)
            for c in cache:
                c.trim(x.shape[1])
        try:
            for i in range(4):                       # warm-up
                one(tok, bool(i % 2), "decode")
            res["decode"] = {True: [], False: []}
            host["decode"] = {True: [], False: []}
            for i in range(steps):
                order = (False, True) if i % 2 == 0 else (True, False)
                for on in order:
                    one(tok, on, "decode")
            for i in range(chunks):
                order = (False, True) if i % 2 == 0 else (True, False)
                for on in order:
                    one(block, on, "prefill")
        finally:
            st.speed_projection = was
        out = {}
        for k, v in res.items():
            pairs = [a / b for a, b in zip(v[True], v[False])]
            out[k] = {"off_ms": statistics.median(v[False]) * 1e3, "on_ms": statistics.median(v[True]) * 1e3,
                      "host_off_ms": statistics.median(host[k][False]) * 1e3,
                      "host_on_ms": statistics.median(host[k][True]) * 1e3,
                      "paired_ratio": statistics.median(pairs), "n": len(pairs),
                      "rows": 1 if k == "decode" else chunk}
        return out
    return held(eng, run)


def random_vector(folder: Path, n_layer: int, n_embd: int) -> str:
    import numpy as np

    from engine.steer.control_vector import write_control_vector
    path = folder / f"random-cvec-{n_layer}x{n_embd}.gguf"
    if not path.exists():
        rng = np.random.default_rng(0)
        dirs = {il: rng.standard_normal(n_embd).astype(np.float32) for il in range(1, n_layer)}
        write_control_vector(path, {il: d / np.linalg.norm(d) for il, d in dirs.items()}, "random")
    return str(path)


def cost(args) -> dict:
    eng, st = start_engine(args.model, args.vector, args.mode, args.scale, tuple(args.range) if args.range else None)
    if args.random_shape:
        from bench.shapes import ignore_eos
        ignore_eos(eng)
    desc = st.steering
    n_tok = args.prompt_tokens
    text = held(eng, lambda e: e.tokenizer.decode(
        (e.tokenizer.encode(PREFILL_TEXT * 8, add_bos=False))[:n_tok - 1]))
    decode_prompt = "Once upon a time, in a small village by the sea,"
    rows = {"prefill_ms": {True: [], False: []}, "decode_ms_per_tok": {True: [], False: []}}
    print(f"cost: {desc}; {args.repeat} alternating pairs after a warm-up pair", file=sys.stderr)
    for rep in range(args.repeat + 1):
        for on in ((False, True) if rep % 2 == 0 else (True, False)):
            r, _ = gen(eng, prompt=text, max_tokens=1, on=on)
            prefill_ms = r.ttft_ms
            d, _ = gen(eng, prompt=decode_prompt, max_tokens=args.decode_tokens, on=on)
            dec = 1e3 / d.decode_tps if d.decode_tps else float("nan")
            print(f"  {'warm-up ' if rep == 0 else ''}{'on ' if on else 'off'}: prefill {r.prompt_tokens} tok "
                  f"{prefill_ms:.0f} ms, decode {d.generated_tokens} tok {dec:.1f} ms/tok", file=sys.stderr)
            if rep:
                rows["prefill_ms"][on].append(prefill_ms)
                rows["decode_ms_per_tok"][on].append(dec)
    print(f"  step timing: {args.steps} decode pairs, {args.chunks} prefill pairs of {args.chunk} tokens",
          file=sys.stderr)
    steps = step_time(eng, args.steps, args.chunk, args.chunks)
    k1 = kernel_time(eng, 1, args.kernel_iters)
    kp = kernel_time(eng, n_tok, max(10, args.kernel_iters // 10))
    eng.stop()
    out = {"steering": desc, "prompt_tokens": r.prompt_tokens, "decode_tokens": args.decode_tokens,
           "repeat": args.repeat, "kernel_token": k1, "kernel_chunk": kp, "steps": steps}
    for k, v in rows.items():
        off, on = statistics.median(v[False]), statistics.median(v[True])
        # Each repetition is an adjacent on/off pair: the median of the per-pair ratios is less
        # sensitive to the machine's load drifting between pairs than the ratio of the medians.
        paired = statistics.median(a / b for a, b in zip(v[True], v[False]))
        out[k] = {"off": off, "on": on, "ratio": on / off, "paired_ratio": paired,
                  "off_all": v[False], "on_all": v[True]}
    return out


def print_cost(res: dict) -> None:
    p, d, k1, kp = res["prefill_ms"], res["decode_ms_per_tok"], res["kernel_token"], res["kernel_chunk"]
    print(f"\n{res['steering']}; medians of {res['repeat']} alternating on/off pairs\n")
    print("| measure | off (median) | on (median) | on/off (medians) | on/off (median of pairs) |")
    print("|---|---:|---:|---:|---:|")
    print(f"| prefill, {res['prompt_tokens']}-token prompt (ms) | {p['off']:.0f} | {p['on']:.0f} | {p['ratio']:.3f} "
          f"| {p['paired_ratio']:.3f} |")
    print(f"| decode (ms/token, {res['decode_tokens']} tokens) | {d['off']:.1f} | {d['on']:.1f} | {d['ratio']:.3f} "
          f"| {d['paired_ratio']:.3f} |")
    sd, sp = res["steps"]["decode"], res["steps"]["prefill"]
    print(f"| forward alone, decode step (ms; {sd['n']} interleaved pairs) | {sd['off_ms']:.1f} | {sd['on_ms']:.1f} "
          f"| {sd['on_ms'] / sd['off_ms']:.3f} | {sd['paired_ratio']:.3f} |")
    print(f"| forward alone, {sp['rows']}-token prefill chunk (ms; {sp['n']} interleaved pairs) | {sp['off_ms']:.0f} "
          f"| {sp['on_ms']:.0f} | {sp['on_ms'] / sp['off_ms']:.3f} | {sp['paired_ratio']:.3f} |")
    print(f"| of which building the graph (host), decode step (ms) | {sd['host_off_ms']:.2f} | {sd['host_on_ms']:.2f} "
          f"| {sd['host_on_ms'] / sd['host_off_ms']:.3f} | |")
    share = k1["all_layers_ms"] / d["off"] * 100
    print(f"\nsteer() alone ({k1['backend']} path), {k1['layers']} steered layers: "
          f"{k1['all_layers_ms']:.3f} ms per token (all layers, one eval; {k1['one_layer_ms']:.3f} ms for one layer) "
          f"= {share:.1f}% of the off decode time per token; "
          f"{kp['all_layers_ms']:.1f} ms for a {kp['rows']}-row prefill chunk "
          f"(= {kp['all_layers_ms'] / p['off'] * 100:.1f}% of the off prefill).")
    print(f"raw: prefill off {[round(x) for x in p['off_all']]} on {[round(x) for x in p['on_all']]}; "
          f"decode off {[round(x, 1) for x in d['off_all']]} on {[round(x, 1) for x in d['on_all']]}")


def record_cost(run: Run, res: dict) -> None:
    """The cost table's on/off ratios and the kernel's time, one JSON line each (bench/harness.py)."""
    p, d, k1 = res["prefill_ms"], res["decode_ms_per_tok"], res["kernel_token"]
    sd, sp = res["steps"]["decode"], res["steps"]["prefill"]
    setup = dict(steering=str(res["steering"]), rounds=res["repeat"])
    run.record("prefill on / off", p["paired_ratio"], "x", peer="off", prompt_tokens=res["prompt_tokens"], **setup)
    run.record("decode on / off", d["paired_ratio"], "x", peer="off", decode_tokens=res["decode_tokens"], **setup)
    run.record("forward alone, decode step on / off", sd["paired_ratio"], "x", peer="off", pairs=sd["n"], **setup)
    run.record("forward alone, prefill chunk on / off", sp["paired_ratio"], "x", peer="off", pairs=sp["n"],
               chunk=sp["rows"], **setup)
    run.record("steer() per token, all layers", k1["all_layers_ms"], "ms", backend=k1["backend"],
               layers=k1["layers"], **setup)


def record_effect(run: Run, res: dict) -> None:
    for s, v in res["summary"].items():
        run.record(f"mean reply, {s}", v["mean_tokens"], "tokens", prompts=v["n"], eos=v["eos"],
                   max_tokens=res["max_tokens"])
        run.record(f"mean wall, {s}", v["mean_wall_s"], "s", prompts=v["n"], max_tokens=res["max_tokens"])


# ------------------------------------------------------------------------------------------ effect
def parse_setting(s: str):
    if s == "off":
        return None
    try:
        mode, scale, rng = s.split(":")
        a, b = rng.split("-")
        return mode, float(scale), (int(a), int(b))
    except ValueError:
        raise SystemExit(f"setting {s!r} is not 'off' or MODE:SCALE:A-B") from None


def effect(args) -> dict:
    from engine.steer.control_vector import ControlVector, SteeringConfig
    prompts = [ln.strip() for ln in EFFECT_PROMPTS.read_text().splitlines() if ln.strip()]
    if args.limit:
        prompts = prompts[:args.limit]
    settings = args.settings
    eng, st = start_engine(args.model, args.vector, "project", 1.0, None)
    vectors = {}

    def build(e):
        for s in settings:
            p = parse_setting(s)
            if p is not None:
                mode, scale, rng = p
                vectors[s] = ControlVector.load(SteeringConfig(files=((args.vector, scale),), mode=mode,
                                                               layer_range=rng), e.info.n_layer, e.info.n_embd)
    held(eng, build)

    def use(s):
        def f(e):
            if s in vectors:
                e.steering.vector = vectors[s]
        held(eng, f)

    res = {s: [] for s in settings}
    for i, prompt in enumerate(prompts):
        for s in settings:
            use(s)
            r, wall = gen(eng, messages=[{"role": "user", "content": prompt}], max_tokens=args.max_tokens,
                          on=s != "off")
            res[s].append({"prompt": prompt, "tokens": r.generated_tokens, "finish": r.finish_reason,
                           "wall_s": wall, "text": r.text})
            print(f"  [{i + 1}/{len(prompts)}] {s:>18}: {r.generated_tokens:3d} tok, {wall:5.1f} s, "
                  f"{r.finish_reason:6} | {r.text[:70]!r}", file=sys.stderr, flush=True)
    eng.stop()
    summary = {}
    for s, rows in res.items():
        summary[s] = {"mean_tokens": statistics.mean(r["tokens"] for r in rows),
                      "eos": sum(r["finish"] == "stop" for r in rows), "n": len(rows),
                      "mean_wall_s": statistics.mean(r["wall_s"] for r in rows),
                      "rows": rows}
    return {"max_tokens": args.max_tokens, "prompts": prompts, "summary": summary}


def print_effect(res: dict) -> None:
    base = res["summary"].get("off")
    print(f"\n{len(res['prompts'])} prompts, greedy, max_tokens {res['max_tokens']}\n")
    print("| setting | mean reply (tokens) | ended by EOS | mean wall (s) | tokens vs off | wall vs off |")
    print("|---|---:|---:|---:|---:|---:|")
    for s, v in res["summary"].items():
        rel_t = f"{v['mean_tokens'] / base['mean_tokens']:.2f}x" if base else "-"
        rel_w = f"{v['mean_wall_s'] / base['mean_wall_s']:.2f}x" if base else "-"
        print(f"| {s} | {v['mean_tokens']:.1f} | {v['eos']}/{v['n']} | {v['mean_wall_s']:.1f} | {rel_t} | {rel_w} |")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--random-shape", choices=("llama1b", "smollm2"), default=None)
    ap.add_argument("--vector", default=str(DEFAULT_VECTOR))
    ap.add_argument("--mode", default=SHIPPED["mode"])
    ap.add_argument("--scale", type=float, default=SHIPPED["scale"])
    ap.add_argument("--range", nargs=2, type=int, default=list(SHIPPED["range"]))
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument("--kernel-iters", type=int, default=200)
    ap.add_argument("--steps", type=int, default=40, help="interleaved decode-step pairs")
    ap.add_argument("--chunk", type=int, default=32, help="prefill chunk (tokens) of the step timing")
    ap.add_argument("--chunks", type=int, default=8, help="interleaved prefill-chunk pairs")
    ap.add_argument("--effect", action="store_true")
    ap.add_argument("--settings", nargs="+", default=None)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--limit", type=int, default=0, help="--effect: only the first N prompts (exploration)")
    ap.add_argument("--json", default=None, help="also write the raw results here")
    ap.add_argument("--steering-op", choices=("auto", "portable", "compiled-kernel", "residual-add"), default="auto",
                    help="portable: the mx.compile'd MLX ops even on a GPU; compiled-kernel: the GPU kernel's "
                         "call under mx.compile (A/Bs against the plain kernel call); residual-add: a steered "
                         "block does its last residual add and no steering (the wrapper's own cost, a floor)")
    ap.add_argument("--shader", default=None, help="build the GPU kernel from this body instead of shaders/cvec.metal")
    add_args(ap)
    args = ap.parse_args()
    import engine.steer.steering as steering
    if args.steering_op == "portable":
        steering._BACKEND = "portable"
    if args.steering_op == "compiled-kernel":
        import mlx.core as mx
        plain_fused = steering.fused_steerer
        steering.fused_steerer = lambda vec, scale, mode: mx.compile(plain_fused(vec, scale, mode))
    if args.steering_op == "residual-add":
        steering.fused_steerer = lambda vec, scale, mode: (lambda h, res: h + res)
    if args.shader:
        steering.CVEC_METAL_SOURCE = Path(args.shader).read_text(encoding="utf-8")
        steering._kernels.clear()
    if args.random_shape:
        import tempfile

        from bench.shapes import SHAPES, build_random_model
        folder = Path(tempfile.gettempdir()) / "strata-shapes"
        args.model = str(build_random_model(args.random_shape, folder))
        shape = SHAPES[args.random_shape]
        if args.random_shape != "smollm2" and args.vector == str(DEFAULT_VECTOR):
            args.vector = random_vector(folder, shape.n_layer, shape.n_embd)
            args.range = [1, shape.n_layer - 1]
    args.model = args.model or default_model()
    if args.settings is None:
        a, b = SHIPPED["range"]
        args.settings = ["off", f"project:1:{a}-{b}", f"project:2:{a}-{b}"]
    print(f"{time.strftime('%Y-%m-%d %H:%M')} | {machine()}", file=sys.stderr)
    print(f"command: python bench/cvec.py {' '.join(sys.argv[1:])}", file=sys.stderr)
    if args.effect:
        res = effect(args)
        print_effect(res)
        record_effect(Run(out=args.out), res)
    else:
        res = cost(args)
        print_cost(res)
        record_cost(Run(out=args.out), res)
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1, default=str))
    sys.stdout.flush()
    os._exit(0)   # the engine thread never ends (mlx at-exit abort, see engine.run_forever)


if __name__ == "__main__":
    sys.exit(main())
