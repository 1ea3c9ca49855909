"""Session format 1 (git revision --old, default cf325b9) vs the current format, same process, alternated.

    PYTHONPATH=$PWD .venv/bin/python bench/session_formats.py [--rounds 6] [--tokens 2048] [--old REV]
        [--dtype float16]

The old engine/session_files/sessions.py is taken from git history into a temporary module. Both save and restore
a SmolLM2-shaped K/V (30 layers x 3 K/V heads x 64, random values) of --tokens tokens in the engine's
compute dtype (float32 on a CPU). Restored entries are kept, as parked conversations are, so neither
format reuses freed memory. Medians of the rounds; the order of the two formats alternates.
"""
from __future__ import annotations

import argparse
import importlib.util
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from bench.harness import Run, add_args  # noqa: E402


def old_module(rev: str, folder: Path):
    # the module's place at `rev`: engine/sessions.py before engine/ was grouped into folders
    for where in ("engine/session_files/sessions.py", "engine/sessions.py"):
        got = subprocess.run(["git", "show", f"{rev}:{where}"], cwd=ROOT, capture_output=True, text=True)
        if got.returncode == 0:
            break
    got.check_returncode()
    src = got.stdout
    src = src.replace("from .errors import", "from engine.errors import").replace(
        "from .parking import", "from engine.cache.parking import")
    path = folder / "sessions_old.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location("sessions_old", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["sessions_old"] = mod        # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--old", default="cf325b9")
    ap.add_argument("--dtype", choices=("float32", "float16"), default=None,
                    help="the cache's dtype (default: the engine's, float32 on a CPU)")
    add_args(ap)
    args = ap.parse_args()
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache

    from engine.session_files import sessions as new
    from engine.cache.parking import KVEntry
    tmp = Path(tempfile.mkdtemp(prefix="strata-bench-formats-"))
    old = old_module(args.old, tmp)
    L, H, D, N = 30, 3, 64, args.tokens
    dtype = {"float32": mx.float32, "float16": mx.float16}.get(
        args.dtype or "", mx.float32 if mx.default_device() == mx.cpu else mx.float16)
    fp = dict(model_hash="m", architecture="llama", n_layer=L, n_kv_heads=H, head_dim=D, tokenizer="t",
              chat_template="c", steering="none")
    cache = []
    for i in range(L):
        c = KVCache()
        k = mx.random.normal((1, H, N, D), key=mx.random.key(i)).astype(dtype)
        c.update_and_fetch(k, k * 0.5)
        cache.append(c)
    mx.eval([c.state for c in cache])
    entry = KVEntry(list(range(N)), cache, "k", messages=[{"role": "user", "content": "(benchmark)"}])
    make = lambda: [KVCache() for _ in range(L)]  # noqa: E731
    res = {k: [] for k in ("old save (fsync)", "new save (fsync)", "new save (no fsync)", "old restore",
                           "new restore")}
    keep = []
    for r in range(args.rounds):
        for which in (("old", "new") if r % 2 == 0 else ("new", "old")):
            p = str(tmp / f"{which}.stratasession")
            t0 = time.perf_counter()
            if which == "old":
                old.save(p, entry, fp)
            else:
                new.save(p, entry, fp, force=True)
            res[f"{which} save (fsync)"].append((time.perf_counter() - t0) * 1e3)
            if which == "new":
                t0 = time.perf_counter()
                new.save(p, entry, fp, sync=False, force=True)
                res["new save (no fsync)"].append((time.perf_counter() - t0) * 1e3)
            t0 = time.perf_counter()
            if which == "old":
                e, _ = old.load(p, fp, make, key="k", dtype=dtype)
            else:
                e, _ = new.load(p, fp, make, key="k", dtype=dtype, n_vocab=1 << 20, n_ctx=1 << 20)
            res[f"{which} restore"].append((time.perf_counter() - t0) * 1e3)
            keep.append(e)
    print(f"{N} tokens, SmolLM2 K/V shape, {str(dtype).removeprefix('mlx.core.')} cache on {mx.default_device()}, "
          f"{args.rounds} rounds, medians (ms):")
    rec = Run(out=args.out)
    setup = dict(tokens=N, dtype=str(dtype).removeprefix('mlx.core.'), old=args.old, rounds=args.rounds)
    for k, v in res.items():
        rec.record(k, statistics.median(v), "ms", spread=v, **setup,
                   line=f"  {k:20s} {statistics.median(v):8.1f}   {[round(x) for x in v]}")
    def ratio(a, b):   # per round (the two formats ran back to back), then the median
        return statistics.median(x / y for x, y in zip(res[a], res[b]))
    rec.record("new / old save", ratio('new save (fsync)', 'old save (fsync)'), "x", peer="old", **setup)
    rec.record("new / old restore", ratio('new restore', 'old restore'), "x", peer="old", **setup,
               line=f"new / old, median of per-round ratios: save {ratio('new save (fsync)', 'old save (fsync)'):.2f}x, "
                    f"restore {ratio('new restore', 'old restore'):.2f}x")
    for f in tmp.iterdir():
        f.unlink()
    tmp.rmdir()
    return 0


if __name__ == "__main__":
    sys.exit(main())
