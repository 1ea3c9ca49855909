"""engine/kv_reserve.py: one context's K/V touched at load on the CPU stays with malloc (glibc), so a
restore's arrays come from resident memory; the size follows the context, capped, in mlx-lm's steps."""
from __future__ import annotations

import mlx.core as mx
import pytest

from engine import allocator, kv_reserve

glibc_only = pytest.mark.skipif(allocator._LIBC is None, reason="glibc's mallopt/mallinfo2 only (Linux with glibc)")


def test_the_plan_is_the_context_s_k_v_in_whole_steps_capped():
    # SmolLM2-135M: 30 layers x 3 K/V heads x 64, float32: 46,080 B a token
    assert kv_reserve.plan(4096, 30, 3, 64, 4) == (4096, 4096 * 46080)
    assert kv_reserve.plan(1000, 30, 3, 64, 4) == (1024, 1024 * 46080)          # up to mlx-lm's step
    cells, nbytes = kv_reserve.plan(8192, 30, 3, 64, 4, cap=256 << 20)
    assert cells % 256 == 0 and nbytes <= 256 << 20 and nbytes + 256 * 46080 > 256 << 20
    assert kv_reserve.plan(0, 30, 3, 64, 4) == (0, 0)


def test_the_memory_guard_can_say_no():
    allocator.keep_freed_memory()
    r = kv_reserve.touch(512, 2, 2, 16, mx.float32, admit=lambda n: (False, "needs too much"))
    if not allocator.keeps_freed_memory():
        assert r.tokens == 0 and "returns freed memory" in r.note
        return
    assert r.tokens == 0 and r.nbytes == 0 and "the memory guard says no: needs too much" in r.note


_PROBE = r"""
import json, threading
import mlx.core as mx
from engine import allocator, kv_reserve
mx.set_default_device(mx.cpu)           # host memory, where the engine touches it (the CPU backend)
allocator.keep_freed_memory()
out = {}

def engine_thread():
    before = allocator.held_free_bytes()
    r = kv_reserve.touch(1024, 48, 4, 64, mx.float32, admit=lambda n: (True, "ok"))    # 96 MiB
    out.update(tokens=r.tokens, nbytes=r.nbytes, note=r.note, held=allocator.held_free_bytes() - before)
    arrays = [mx.zeros((1, 4, 768, 64), mx.float32) for _ in range(48)]              # 36 MiB, a restore's
    mx.eval(arrays)
    out["after_use"] = allocator.held_free_bytes() - before

t = threading.Thread(target=engine_thread)
t.start()
t.join()
print(json.dumps(out))
"""


@glibc_only
@pytest.mark.skipif(mx.cuda.is_available(), reason="MLX's CUDA build allocates host arrays as CUDA managed memory, "
                    "not with malloc (and the engine touches nothing there: its K/V is in device memory)")
def test_touched_memory_stays_with_malloc_on_a_thread_of_its_own():
    """In a new process (nothing held before), on a thread of its own (the engine's: glibc gives it its
    own arena, whose wholly free 64 MiB heaps it would unmap) the touched bytes are still held free by
    malloc afterwards, and the next arrays of a restore's sizes are carved from them."""
    import json
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=120, cwd=root)
    assert done.returncode == 0, done.stderr[-2000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["tokens"] == 1024 and out["nbytes"] == 96 << 20 and "96.0 MiB touched at load" in out["note"]
    assert out["held"] >= out["nbytes"] * 0.9
    assert out["held"] - out["after_use"] >= (36 << 20) * 0.9      # carved from the touched memory


@glibc_only
def test_a_model_load_touches_its_context_s_k_v_and_says_so(tiny_gguf_wide):
    """A LoadModel on the CPU logs the touched K/V (its context's, capped); a quantized K/V format
    does not touch (its arrays are other sizes), nor does a GPU (the K/V is in device memory)."""
    from engine.engine import Engine, EngineOptions, LoadModel
    from engine.events import Log
    from engine.device import on_gpu
    cpu_want = "the K/V lives in GPU memory" if on_gpu() else "touched at load"
    for bits, want in ((16, cpu_want), (8, "not touched at load")):
        eng = Engine(EngineOptions(context_length=512, kv_bits=bits)).start()
        try:
            h = eng.submit(LoadModel(str(tiny_gguf_wide)))     # head size 32: 8-bit K/V allowed
            lines = [e.line for e in h.events() if isinstance(e, Log) and e.line.startswith("K/V memory:")]
            h.result()
        finally:
            eng.stop()
        assert len(lines) == 1 and want in lines[0], lines
        if bits == 16 and not on_gpu():
            assert "(512 tokens of float32 K/V" in lines[0]
