"""Does keeping freed K/V memory with malloc (engine/memory/allocator.py) make a restore cheaper? (CPU, glibc)

    python bench/allocator_probe.py [--restores 24]

One engine on the default model, a 2,048-token session saved once, then restored again and again,
glibc's mmap threshold switched before each restore between the engine's 32 MiB (freed K/V arrays
stay on the heap and are reused) and 128 KiB (each array its own mmap, returned at free: glibc's
behaviour for these sizes without the setting). Medians of the restore and of its build part.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.harness import Run, add_args   # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--restores", type=int, default=24)
    add_args(ap)
    a = ap.parse_args()
    if a.restores < 2:
        print("need --restores >= 2 (one of each setting at least)", file=sys.stderr)
        return 2
    from bench.cache import fill_live, session_ids
    from engine.memory import allocator
    if allocator._LIBC is None:
        print("glibc's mallopt is not available here: nothing to compare", file=sys.stderr)
        return 2
    from engine.engine import Engine, EngineOptions, RestoreSession, SaveSession, Status
    from engine.model.models import default_model_path
    e = Engine(EngineOptions(model=str(default_model_path()), cache_mib=1024, cache_slots=4)).start()
    assert e.call(Status()).model, "the default model did not load (make model)"
    fill_live(e, session_ids(e.tokenizer, 2048), "random")
    path = Path(tempfile.mkdtemp()) / "s.stratasession"
    e.call(SaveSession(str(path)))
    res: dict[str, list[float]] = {"heap (32 MiB threshold)": [], "mmap (128 KiB threshold)": []}
    build: dict[str, list[float]] = {k: [] for k in res}
    for k in range(a.restores):
        mode = list(res)[k % 2]
        allocator._LIBC.mallopt(allocator._M_MMAP_THRESHOLD, allocator.MMAP_THRESHOLD if k % 2 == 0 else 128 << 10)
        t = time.perf_counter()
        r = e.call(RestoreSession(str(path)))
        res[mode].append((time.perf_counter() - t) * 1e3)
        build[mode].append(r.profile["build_ms"])
    run = Run(out=a.out)
    for m in res:
        run.record(f"{m} restore", statistics.median(res[m]), "ms", spread=res[m], rounds=len(res[m]),
                   line=f"{m}: restore median {statistics.median(res[m]):.1f} ms {[round(x) for x in res[m]]}, "
                        f"build median {statistics.median(build[m]):.1f} ms")
        run.record(f"{m} build", statistics.median(build[m]), "ms", spread=build[m], rounds=len(build[m]))
    path.unlink()
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
