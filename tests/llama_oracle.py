"""llama.cpp (llama-cpp-python) in a child process, so a native crash costs one test, not the run.

llama.cpp is compiled C++ with hand-written SIMD; a build that uses an instruction the CPU (or the VM
in front of it) refuses dies with SIGILL, and a bad file can segfault it. Loaded into pytest's own
process that kills the whole suite. Here the parent never loads libllama: every object lives in a
worker, the tests hold proxies, and a dead worker turns into `OracleCrashed` naming the signal (a
failed test); the next call starts a fresh worker.

    llm = oracle.Llama(model_path=..., n_ctx=64, vocab_only=True)   # a proxy
    ids = llm.tokenize(b"Hi", add_bos=False, special=True)           # method calls are forwarded
    llm.scores                                                        # so are attribute reads
    oracle.greedy(llm, ids, 32); oracle.logits(llm, ids)             # worker-side helpers (below)
"""
from __future__ import annotations

import functools
import importlib.util
import os
import signal
import subprocess
import sys
from multiprocessing.connection import Connection
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
CALL_TIMEOUT_S = 600        # a hung llama.cpp call fails its test instead of the run


class OracleCrashed(AssertionError):
    """The llama.cpp worker died (a signal or an exit) while running a call."""


def available() -> bool:
    return importlib.util.find_spec("llama_cpp") is not None


def require() -> None:
    if not available():
        pytest.skip("llama-cpp-python (the llama.cpp oracle) is not installed")


# ----------------------------------------------------------------------------------------- parent
class _Worker:
    started = 0

    def __init__(self):
        _Worker.started += 1
        self.gen = _Worker.started
        p2c_r, p2c_w = os.pipe()
        c2p_r, c2p_w = os.pipe()
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([str(TESTS), str(TESTS.parent)] +
                                            [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
        # Run as the module llama_oracle (not __main__), so handles unpickle to this module's classes.
        code = f"import llama_oracle; llama_oracle._main({p2c_r}, {c2p_w})"
        self.proc = subprocess.Popen([sys.executable, "-c", code],
                                     pass_fds=(p2c_r, c2p_w), env=env, stdin=subprocess.DEVNULL)
        os.close(p2c_r)
        os.close(c2p_w)
        self.tx, self.rx = Connection(p2c_w, readable=False), Connection(c2p_r, writable=False)

    def request(self, *msg):
        try:
            self.tx.send(msg)
            if not self.rx.poll(CALL_TIMEOUT_S):
                self.proc.kill()
                raise OracleCrashed(f"llama.cpp oracle did not answer {msg[0]} within {CALL_TIMEOUT_S} s")
            ok, value = self.rx.recv()
        except (EOFError, BrokenPipeError, ConnectionResetError):
            rc = self.proc.wait(timeout=30)
            why = f"signal {signal.Signals(-rc).name}" if rc < 0 else f"exit status {rc}"
            what = {"call": msg[2] if len(msg) > 2 else "", "fn": msg[1], "getattr": msg[2] if len(msg) > 2 else ""}
            raise OracleCrashed(f"the llama.cpp oracle died with {why} during {msg[0]} "
                                f"{what.get(msg[0], '')}".rstrip()) from None
        if not ok:
            raise value
        return value

    def close(self):
        try:
            self.tx.close()
            self.proc.wait(timeout=10)
        except Exception:
            self.proc.kill()


_worker: _Worker | None = None


def is_live(obj: Remote) -> bool:
    return _worker is not None and _worker.gen == obj._gen and _worker.proc.poll() is None


def _request(*msg):
    global _worker
    require()
    stale = [a for a in (msg[1:2] if msg[0] in ("getattr", "call", "close") else msg[2] if msg[0] == "fn" else ())
             if isinstance(a, Remote) and not is_live(a)]
    if stale:
        raise OracleCrashed("this llama.cpp object died with an earlier oracle worker")
    if _worker is None or _worker.proc.poll() is not None:
        _worker = _Worker()
    try:
        return _worker.request(*msg)
    except OracleCrashed:
        _worker = None
        raise


def shutdown() -> None:
    global _worker
    if _worker is not None:
        _worker.close()
        _worker = None


class Remote:
    """A proxy for an object living in the worker (generation `gen`: a restarted worker has lost it)."""

    def __init__(self, handle: int, gen: int = 0):
        object.__setattr__(self, "_handle", handle)
        object.__setattr__(self, "_gen", gen)

    def __reduce__(self):
        return (Remote, (self._handle, self._gen))

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        kind, value = _request("getattr", self, name)
        if kind == "method":
            return lambda *a, **k: _request("call", self, name, a, k)
        return value

    def close(self):
        if is_live(self):
            _request("close", self)


def Llama(**kwargs) -> Remote:
    handle = _request("new", kwargs)
    return Remote(handle, _worker.gen)


_CACHED: dict = {}


def cached_llama(path) -> Remote:
    """One llama.cpp model with logits for every position, kept in the worker for repeated calls on the
    same file; a new file closes the previous one there (tests compare one file at a time)."""
    if path not in _CACHED or not is_live(_CACHED[path]):
        for old in _CACHED.values():
            old.close()
        _CACHED.clear()
        _CACHED[path] = Llama(model_path=str(path), n_ctx=256, n_batch=256, logits_all=True, verbose=False,
                              n_threads=2)
    return _CACHED[path]


@functools.lru_cache(maxsize=1)
def _strata_model(path):
    from engine.model.gguf_file import open_gguf
    from engine.model.model_loader import load_model
    return load_model(open_gguf(path))[0]


def strata_logits(path, ids: list[int]):
    """The other side of a comparison: Strata's logits (float32, every position) for `ids` from an
    empty cache, the model kept loaded for repeated calls on the same file."""
    import mlx.core as mx
    import numpy as np
    from mlx_lm.models.cache import make_prompt_cache
    model = _strata_model(path)
    return np.array(model(mx.array(ids)[None], cache=make_prompt_cache(model))[0].astype(mx.float32))


def greedy(llm: Remote, ids: list[int], n: int, stop_at_eos: bool = False) -> list[int]:
    return _request("fn", "greedy", (llm, list(ids), n, stop_at_eos), {})


def logits(llm: Remote, ids: list[int]):
    """Logits at every position of `ids`, from a reset context (float32, [len(ids), vocab])."""
    return _request("fn", "logits", (llm, list(ids)), {})


def set_cvec(llm: Remote, buf, n_embd: int, il_start: int = -1, il_end: int = -1) -> int:
    """llama_set_adapter_cvec on the worker's context (buf None clears it)."""
    return _request("fn", "set_cvec", (llm, buf, n_embd, il_start, il_end), {})


def has_cvec() -> bool:
    return _request("fn", "has_cvec", (), {})


def quantize(src, dst, ftype: str, imatrix: dict | None = None, pure: bool = False) -> None:
    _request("fn", "quantize", (str(src), str(dst), ftype), {"imatrix": imatrix, "pure": pure})


def ggml_dequantize(type_id: int, data, n: int):
    """llama.cpp's own decoder (ggml's to_float for the type) on raw block bytes: n float32 values."""
    return _request("fn", "ggml_dequantize", (int(type_id), bytes(data), int(n)), {})


# ----------------------------------------------------------------------------------------- worker
def _serve(rx: Connection, tx: Connection) -> None:
    import ctypes

    import numpy as np
    import llama_cpp

    objects: dict[int, object] = {}
    keep: dict[int, object] = {}       # buffers llama.cpp points into, per handle

    def resolve(v):
        return objects[v._handle] if isinstance(v, Remote) else v

    def greedy(llm, ids, n, stop_at_eos):
        out = []
        llm.reset()
        for tok in llm.generate(ids, temp=0.0, top_k=1, reset=True):
            out.append(int(tok))
            if len(out) == n or (stop_at_eos and tok == llm.token_eos()):
                break
        return out

    def logits(llm, ids):
        llm.reset()
        llm.eval(ids)
        return np.array(llm.scores[: len(ids)], dtype=np.float32)

    def set_cvec(llm, buf, n_embd, il_start, il_end):
        if buf is None:
            return llama_cpp.llama_set_adapter_cvec(llm.ctx, None, 0, n_embd, -1, -1)
        buf = np.ascontiguousarray(buf, dtype=np.float32)
        keep[id(llm)] = buf
        ptr = buf.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
        return llama_cpp.llama_set_adapter_cvec(llm.ctx, ptr, buf.size, n_embd, il_start, il_end)

    def has_cvec():
        return getattr(llama_cpp, "llama_set_adapter_cvec", None) is not None

    def quantize(src, dst, ftype, imatrix=None, pure=False):
        from gguf_factory import quantize_with_llama_in_process
        quantize_with_llama_in_process(src, dst, ftype, imatrix=imatrix, pure=pure)

    def ggml_dequantize(type_id, data, n):
        # ggml_get_type_traits(type)->to_float: the decoder llama.cpp's CPU backend uses
        class Traits(ctypes.Structure):
            _fields_ = [("type_name", ctypes.c_char_p), ("blck_size", ctypes.c_int64),
                        ("blck_size_interleave", ctypes.c_int64), ("type_size", ctypes.c_size_t),
                        ("is_quantized", ctypes.c_bool), ("to_float", ctypes.c_void_p),
                        ("from_float_ref", ctypes.c_void_p)]
        lib_dir = Path(llama_cpp.__file__).parent / "lib"
        lib = ctypes.CDLL(str(sorted(lib_dir.glob("libggml-base.*"))[0]))   # .so here, .dylib on a Mac
        lib.ggml_get_type_traits.restype = ctypes.POINTER(Traits)
        lib.ggml_get_type_traits.argtypes = [ctypes.c_int]
        to_float = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)(
            lib.ggml_get_type_traits(type_id).contents.to_float)
        src = np.frombuffer(data, np.uint8).copy()
        out = np.empty(n, np.float32)
        to_float(src.ctypes.data, out.ctypes.data, n)
        return out

    def die(signum):            # for the test that a native crash fails one test only
        os.kill(os.getpid(), signum)

    fns = {"die": die, "greedy": greedy, "logits": logits, "set_cvec": set_cvec, "has_cvec": has_cvec, "quantize": quantize,
           "ggml_dequantize": ggml_dequantize}
    import mtmd_oracle          # the image half (libmtmd), worker side: loaded in the worker only
    fns.update(mtmd_oracle.WORKER_FNS)
    while True:
        try:
            op, *args = rx.recv()
        except EOFError:
            # Close the models now: left to interpreter teardown, llama-cpp-python's own cleanup runs
            # after its library handles are gone and prints a TypeError traceback.
            for obj in objects.values():
                try:
                    obj.close()
                except Exception:  # noqa: BLE001 - exiting anyway
                    pass
            return
        try:
            if op == "new":
                obj = llama_cpp.Llama(**args[0])
                objects[id(obj)] = obj
                result = id(obj)
            elif op == "getattr":
                v = getattr(resolve(args[0]), args[1])
                result = ("method", None) if callable(v) else ("value", v)
            elif op == "call":
                result = getattr(resolve(args[0]), args[1])(*args[2], **args[3])
            elif op == "close":
                obj = objects.pop(args[0]._handle)
                keep.pop(id(obj), None)
                obj.close()
                result = None
            elif op == "fn":
                name, fargs, fkw = args
                result = fns[name](*[resolve(a) for a in fargs], **fkw)
            else:
                raise ValueError(f"unknown oracle op {op!r}")
            tx.send((True, result))
        except Exception as e:          # the test sees llama.cpp's Python-level errors as raised
            tx.send((False, RuntimeError(f"{type(e).__name__}: {e}")))


def _main(rx_fd: int, tx_fd: int) -> None:
    _serve(Connection(rx_fd, writable=False), Connection(tx_fd, readable=False))
