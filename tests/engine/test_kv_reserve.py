"""engine/cache/kv_reserve.py: one context's K/V touched at load on the CPU stays with malloc (glibc), so a
restore's arrays come from resident memory; the size follows the context, capped, in mlx-lm's steps."""
from __future__ import annotations

import mlx.core as mx
import pytest

from engine.cache import kv_reserve
from engine.memory import allocator

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
from engine.cache import kv_reserve
from engine.memory import allocator
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


def _reserve(nbytes: int = 4 << 20) -> kv_reserve.Reserved:
    return kv_reserve.Reserved(256, nbytes, 0.0, "", shape=(1, 2, 256, 16), count=4, dtype=mx.float32)


def test_a_top_up_is_wanted_once_a_quarter_of_the_reserve_is_held_and_the_guard_agrees():
    asked = []
    guard_says = [True]

    def admit(n):
        asked.append(n)
        return guard_says[0], "the guard's reason"
    t = kv_reserve.TopUp(_reserve(4 << 20), admit=admit)
    assert not t.wanted(0) and not t.wanted((1 << 20) - 1) and asked == []      # under a quarter
    guard_says[0] = False
    assert not t.wanted(3 << 20) and asked == [3 << 20]                        # the guard says no
    guard_says[0] = True
    assert t.wanted(9 << 20) and asked[-1] == 4 << 20                          # never more than the reserve
    while t.step() is None:
        pass
    assert not t.wanted(9 << 20)                 # whole again at 9 MiB held: the growth since is what counts
    assert t.wanted(12 << 20)
    assert not kv_reserve.TopUp(_reserve(), admit=admit).wanted(1 << 19)


def test_k_v_freed_meanwhile_counts_as_reserve():
    t = kv_reserve.TopUp(_reserve(4 << 20))
    assert t.wanted(8 << 20)
    while t.step() is None:
        pass
    assert not t.wanted(2 << 20)                 # 6 MiB freed (evicted, replaced): back with malloc
    assert not t.wanted(2 << 20 | 1 << 19)
    assert t.wanted(3 << 20)                     # 1 MiB held more than the lowest point since


def test_a_top_up_touches_the_reserve_one_array_a_step_and_a_release_frees_what_it_holds():
    t = kv_reserve.TopUp(_reserve())
    assert t.step() is None and t.step() is None and len(t._held) == 2
    t.release()
    assert t._held == []
    lines = [t.step() for _ in range(4)]
    assert lines[:3] == [None] * 3 and "4.0 MiB touched again in idle time" in lines[3] and t._held == []


@glibc_only
@pytest.mark.skipif(mx.cuda.is_available() or mx.metal.is_available(),
                    reason="the top-up is for host memory the CPU backend's K/V comes from (on a GPU the K/V is "
                           "device memory and nothing is touched)")
def test_the_engine_tops_the_reserve_up_in_idle_time_after_a_long_prompt(tiny_gguf, caplog):
    """A prompt that leaves more than a quarter of the touched K/V held: once the reply is done the
    engine touches the reserve again before it waits for the next request, says so, and is idle
    after; the next request is served as before."""
    import logging

    from engine.api import SamplingParams
    from engine.engine import Engine, EngineOptions, GenerateRequest, LoadModel
    caplog.set_level(logging.INFO, logger="strata")
    eng = Engine(EngineOptions(context_length=1024)).start()
    try:
        eng.call(LoadModel(str(tiny_gguf)))
        assert eng.kv_topup.topup is not None and eng.wait_idle(30)
        assert not [m for m in caplog.messages if "touched again" in m]
        prompt = " ".join(f"w{i % 10}" for i in range(300))
        r = eng.call(GenerateRequest(prompt=prompt, sampling=SamplingParams(max_tokens=2, temperature=0.0)))
        assert r.prompt_tokens > 300
        assert eng.wait_idle(60)
        lines = [m for m in caplog.messages if "touched again in idle time" in m]
        assert len(lines) == 1, caplog.messages[-5:]
        again = eng.call(GenerateRequest(prompt=prompt, sampling=SamplingParams(max_tokens=2, temperature=0.0)))
        assert again.text == r.text
    finally:
        eng.stop()


_EXIT_DURING_TOP_UP = r"""
import sys, time
from engine.engine import Engine, EngineOptions, GenerateRequest
from engine.sampling import SamplingParams
engine = Engine(EngineOptions(model=sys.argv[1], cache_mib=0)).start()
engine.startup.result()
tok = engine.tokenizer
ids = tok.encode("The little boat left the harbor early in the morning. " * 20)[:64]
engine.call(GenerateRequest(prompt=tok.decode(ids), sampling=SamplingParams(max_tokens=1)))
deadline = time.monotonic() + 30
while not engine.scheduler.in_idle_work and time.monotonic() < deadline:     # the top-up after the reply
    pass
print("exiting while topping up" if engine.scheduler.in_idle_work else "no top-up seen", flush=True)
sys.exit(0)
"""


@glibc_only
@pytest.mark.skipif(mx.cuda.is_available() or mx.metal.is_available(),
                    reason="the top-up is for host memory the CPU backend's K/V comes from")
def test_a_script_that_exits_during_the_idle_time_top_up_exits_cleanly(big_kv_gguf):
    """A script exits right after its last result, while the engine thread touches 256 MiB of K/V
    memory again: the exit waits for that step to end instead of MLX aborting the process."""
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, "-c", _EXIT_DURING_TOP_UP, str(big_kv_gguf)], capture_output=True,
                          text=True, timeout=240, cwd=root)
    assert "exiting while topping up" in done.stdout, (done.stdout, done.stderr[-2000:])
    assert done.returncode == 0, done.stderr[-2000:]
