"""Progress and Cancel while a long prompt is read (issue 27, item 8): one request, every Progress timed,
cancelled at the first report after 8 s; prints the reports, the longest gap and how fast the cancel was answered.

    python bench/cancel_probe.py MODEL.gguf
"""
import sys, time, threading
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.harness import Run
from engine.engine import Engine, EngineOptions, GenerateRequest, Status
from engine.events import Progress, Failed
from engine.sampling import SamplingParams
e = Engine(EngineOptions(model=sys.argv[1], cache_mib=0)).start(); e.call(Status(), timeout=300)
text = ("The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined movable "
        "metal type, oil-based ink and a wooden screw press into a system that could produce books faster than any scribe. ") * 14
t0 = time.perf_counter(); times = []; box = {}
def cb(ev):
    now = time.perf_counter()
    if isinstance(ev, Progress):
        times.append((now - t0, ev.done, ev.total))
        if now - t0 > 8 and "c" not in box:
            box["c"] = now; box["h"].cancel()
    elif isinstance(ev, Failed):
        box["f"] = now
box["h"] = h = e.submit(GenerateRequest(messages=[{"role": "user", "content": text}], sampling=SamplingParams(max_tokens=4)), callback=cb)
list(h.events())
gaps = [b[0] - a[0] for a, b in zip(times, times[1:])]
print("reports:", [(round(t, 1), d) for t, d, _ in times])
run = Run()   # results file: $BENCH_RESULTS or bench/results/results.jsonl
run.record("longest gap between reports", max(gaps), "s", prompt_tokens=times[0][2])
run.record("cancel answered", box['f'] - box['c'], "s", prompt_tokens=times[0][2],
           line=f"total {times[0][2]} tokens; longest gap between reports {max(gaps):.2f} s; cancel answered in {box['f'] - box['c']:.2f} s after {box['c'] - t0:.1f} s, {times[-1][1]} tokens read")
