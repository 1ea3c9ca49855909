"""`strata-app --self-test`: the bundle's smoke test. Loads a model through the app's engine thread,
generates a few tokens, saves and restores a session in a temp folder, prints what happened and
returns 0 (all good) or 1. Works offscreen (QT_QPA_PLATFORM=offscreen). With no --model and no default
model yet, it fetches the default model first (as `--fetch-default-model` does).

It also checks the bundled Qt binding: the app's Qt calls 20,000 times (app/binding_check.py) and, with
`--soak-tokens N`, N tokens streamed through the engine thread's signals, losing no reference to
None/True/False (a leaking PySide6 aborted the app)."""
from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path
from PySide6.QtCore import QEventLoop, QTimer
from PySide6.QtWidgets import QApplication
from engine.model.models import default_model_path
from .binding_check import reference_loss
from .engine_thread import EngineClient, EngineThread
from .model_fetch import fetch_headless
from .paths import set_identity


def run_self_test(model: str | None, timeout_s: float = 300.0, soak_tokens: int = 0) -> int:
    os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

    app = QApplication.instance() or QApplication(sys.argv[:1])
    set_identity(app)
    loss = reference_loss(20_000)
    print(f"self-test: Qt binding: {loss.iterations} rounds of the app's Qt calls lost {loss.none} references "
          f"to None, {loss.true} to True, {loss.false} to False")
    if loss.worst > 64:
        print("self-test: FAIL: the Qt binding loses references (the app would abort)")
        return 1
    if model is None:
        model = str(default_model_path())
        if not Path(model).exists():
            print(f"self-test: no model at {model}: fetching the default model")
            if fetch_headless(err=sys.stdout) != 0:
                print("self-test: FAIL: the default model could not be fetched")
                return 1
    if not Path(model).exists():
        print(f"self-test: FAIL: no model at {model} (pass --model PATH or fetch the default model)")
        return 1

    thread = EngineThread(cache_mib=256, cache_slots=2)
    client = EngineClient(thread)
    thread.start()

    def wait(req, what):
        loop = QEventLoop()
        req.finished.connect(loop.quit)
        timer = QTimer(singleShot=True, interval=int(timeout_s * 1000))
        timer.timeout.connect(loop.quit)
        timer.start()
        if req.result is None and req.error is None:
            loop.exec()
        if req.error is not None:
            raise RuntimeError(f"{what}: {req.error}")
        if req.result is None:
            raise RuntimeError(f"{what}: no answer in {timeout_s:.0f} s")
        return req.result

    ok = True
    try:
        t0 = time.perf_counter()
        r = wait(client.load_model(model), "load")
        info = r.info or {}
        print(f"self-test: loaded {Path(model).name} ({info.get('architecture')}, "
              f"{info.get('n_layer')} layers) in {time.perf_counter() - t0:.1f} s")
        streamed = []
        msgs = [{"role": "user", "content": "Say hello."}]
        req = client.generate(msgs, {"max_tokens": 8, "temperature": 0.0}, conversation="self-test")
        req.token.connect(streamed.append)
        r = wait(req, "generate")
        print(f"self-test: generated {r.generated_tokens} tokens ({r.decode_tps:.1f} tok/s): {r.text!r}")
        if r.generated_tokens < 1:
            raise RuntimeError("generate: no tokens")
        with tempfile.TemporaryDirectory(prefix="strata-selftest-") as tmp:
            path = str(Path(tmp) / "self-test.stratasession")
            saved = wait(client.save_session(path, messages=msgs + [{"role": "assistant", "content": r.text}]),
                         "save session")
            print(f"self-test: saved session {saved.session_bytes} bytes in {saved.save_ms:.0f} ms")
            restored = wait(client.restore_session(path), "restore session")
            print(f"self-test: restored {restored.restored_tokens} tokens in "
                  f"{restored.restore_ms:.0f} ms")
            if not restored.restored_tokens:
                raise RuntimeError("restore session: no tokens restored")
        if soak_tokens > 0:
            _soak(client, wait, soak_tokens)
    except Exception as e:  # noqa: BLE001 - the verdict line, not a traceback
        print(f"self-test: FAIL: {e}")
        ok = False
    finally:
        thread.stop()
    print("self-test: OK" if ok else "self-test: FAILED")
    del app
    return 0 if ok else 1


def _soak(client, wait, tokens: int) -> None:
    """Stream `tokens` tokens through the engine thread's signals, in replies of up to 500, and check
    that the interpreter kept its references to None, True and False meanwhile."""
    def refs():
        return sys.getrefcount(None), sys.getrefcount(True), sys.getrefcount(False)
    streamed = [0]
    start, t0 = refs(), time.perf_counter()
    msgs = [{"role": "user", "content": "Tell me a long story."}]
    while streamed[0] < tokens:
        req = client.generate(msgs, {"max_tokens": 500, "temperature": 1.0, "seed": streamed[0]},
                              conversation=f"soak-{streamed[0] % 3}")
        req.token.connect(lambda _t: streamed.__setitem__(0, streamed[0] + 1))
        wait(req, "soak")
    lost = [b - a for b, a in zip(start, refs())]
    print(f"self-test: soak: {streamed[0]} tokens streamed in {time.perf_counter() - t0:.0f} s; references lost "
          f"(None, True, False): {lost}")
    if max(lost) > 256:
        raise RuntimeError(f"soak: the Qt binding lost references {lost}")
