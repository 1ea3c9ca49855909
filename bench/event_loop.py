"""The window's event loop while replies stream: a 10 ms QTimer probe in the real MainWindow on the real
engine thread; prints the distribution of its gaps (how long the window could not answer a click or
a key) over each streamed reply. The test suite only counts that the probe keeps firing
(tests/app/test_app_chat.py); the milliseconds are measured here, where a loaded machine is noted
rather than failed.

    python bench/event_loop.py [MODEL.gguf] [--replies 3] [--max-tokens 200]

Without a model it writes the tests' tiny random-weight GGUF (tests/gguf_factory.py) and uses that.
Run it on a quiet machine: another job on the same cores shows up as stalls.
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))
os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

PROBE_MS = 10
PROMPTS = ["Write a long story about a lighthouse keeper", "Tell me about the sea, in detail",
           "Describe a walk through a city at night"]


def _home(model: Path | None, max_tokens: int) -> Path:
    """A throw-away STRATA_HOME whose models folder holds the model and whose settings ask for long,
    greedy replies."""
    home = Path(tempfile.mkdtemp(prefix="strata-bench-loop-"))
    (home / "models").mkdir()
    os.environ["STRATA_HOME"] = str(home)
    if model is None:
        from gguf_factory import write_tiny_gguf
        model = write_tiny_gguf(home / "tiny-llama.gguf", arch="llama", n_layer=2, n_embd=64)
    dest = home / "models" / model.name
    os.symlink(model.resolve(), dest) if model.stat().st_size > 64 << 20 else shutil.copyfile(model, dest)
    from app import settings
    s = settings.Settings()
    s.model = str(dest)
    s.sampling.max_tokens = max_tokens
    s.sampling.temperature = 0.0
    settings.save(s)
    return home


def _wait(app, done, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not done() and time.monotonic() < deadline:
        app.processEvents()
        time.sleep(0.001)
    if not done():
        raise SystemExit(f"gave up after {timeout_s:.0f} s")


def _reply_gaps(app, view, prompt: str, timeout_s: float) -> tuple[list[float], int, float]:
    """Stream one reply with the probe running: the probe's gaps (ms) while it streamed, its tokens, its seconds."""
    from PySide6.QtCore import QTimer
    ticks: list[float] = []
    probe = QTimer(interval=PROBE_MS)
    probe.timeout.connect(lambda: ticks.append(time.perf_counter()))
    got = []
    view.stats.connect(got.append)
    probe.start()
    t0 = time.perf_counter()
    view.input.setPlainText(prompt)
    view.send_input()
    _wait(app, lambda: bool(got), timeout_s)
    t1 = time.perf_counter()
    probe.stop()
    view.stats.disconnect(got.append)
    gaps = [(b - a) * 1e3 for a, b in zip(ticks, ticks[1:])]
    return gaps, got[0].generated_tokens, t1 - t0


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", nargs="?", type=Path)
    ap.add_argument("--replies", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=200)
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds for the load and for each reply")
    a = ap.parse_args()
    home = _home(a.model, a.max_tokens)
    try:
        from app.main import make_app
        app = make_app()
        from app.window import MainWindow
        w = MainWindow(offer_fetch=False)
        loaded = []
        w.library.loaded.connect(loaded.append)
        w.show()
        _wait(app, lambda: bool(loaded), a.timeout)
        print(f"model {Path(loaded[0]).name}; probe every {PROBE_MS} ms; load average "
              f"{os.getloadavg()[0]:.1f} ({os.cpu_count()} cores)")
        print("| reply | tokens | seconds | probe gaps | median ms | p90 ms | p99 ms | max ms |")
        print("|---|---|---|---|---|---|---|---|")
        every: list[float] = []
        view = w.current_view()
        for i in range(a.replies):
            gaps, tokens, secs = _reply_gaps(app, view, PROMPTS[i % len(PROMPTS)], a.timeout)
            every += gaps
            if gaps:
                print(f"| {i + 1} | {tokens} | {secs:.1f} | {len(gaps)} | {statistics.median(gaps):.1f} | "
                      f"{_pct(gaps, 0.9):.1f} | {_pct(gaps, 0.99):.1f} | {max(gaps):.1f} |")
        if every:
            print(f"| all | | | {len(every)} | {statistics.median(every):.1f} | {_pct(every, 0.9):.1f} | "
                  f"{_pct(every, 0.99):.1f} | {max(every):.1f} |")
        print(f"gaps over 50 ms: {sum(g > 50 for g in every)} of {len(every)}; "
              f"over 100 ms: {sum(g > 100 for g in every)}")
        w.close()
    finally:
        shutil.rmtree(home, ignore_errors=True)


if __name__ == "__main__":
    main()
