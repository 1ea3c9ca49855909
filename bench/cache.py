"""Conversation parking and session files on the real default model, against llama.cpp's seq state files.

    .venv/bin/python bench/cache.py [--model PATH] [--history 2000] [--repeats 3] [--session-tokens 2048]

1. A/B/A: conversation A with --history tokens, then a short chat-title request B (other system
   prompt), then A's next turn. Time to first token of A's turn with parking (cache 1024 MiB) vs
   without (cache 0, so A is read again). Two engines, alternated each repeat; both get A's turns with
   the same messages (the parking engine's replies), so the prompts are the same tokens. Park and
   restore ms are the engine's own log lines. Target: ratio >= 50x at 2,000 tokens of history.
2. Session files for --session-tokens of A's history: Strata's SaveSession/RestoreSession (safetensors,
   fp16 K/V, xxh3 checksum, fsync + rename) vs llama.cpp's llama_state_seq_save_file /
   llama_state_seq_load_file (llama-cpp-python low-level API, same GGUF, same token ids, its default
   f16 K/V, no fsync), alternated, repeated. Targets: within 2x of llama.cpp's time, bytes per token no
   larger. The llama.cpp column is skipped, with the reason, when llama_cpp is not importable.

Medians over the repeats. The slow part is the prefill of A without parking (MLX on a CPU reads
SmolLM2-135M at ~12 tok/s on a 2-vCPU VM, so 2,000 tokens take minutes): lower --history to shorten.
"""
from __future__ import annotations

import argparse
import ctypes
import os
import platform
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

PARAGRAPHS = [
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined "
    "movable metal type, oil-based ink and a wooden screw press into a system that could produce books "
    "faster than any scribe.",
    "Within fifty years presses operated in more than two hundred European cities, and the price of books "
    "fell so sharply that reading spread from monasteries and courts to merchants, artisans and students.",
    "Printers soon learned that pamphlets sold faster than bibles, and the news sheet, the almanac and the "
    "broadside became the first mass media, argued over in taverns and read aloud in market squares.",
    "Paper mills followed the presses along the rivers of Italy, France and the Low Countries, turning "
    "linen rags into the white sheets that every printer needed by the thousand each week.",
]
A_SYSTEM = "You are a careful historian. Answer in detail, and keep to the sources the user gives."
FOLLOW_UPS = ["What changed for students?", "Who paid for the first presses?", "Why did pamphlets sell?",
              "How fast did paper mills spread?", "What did scribes do afterwards?",
              "Which cities printed most?", "Summarize the argument in one line."]
B_MESSAGES = [{"role": "system", "content": "Write a title for the chat. Five words at most."},
              {"role": "user", "content": "The printing press and its first fifty years"}]
PARKED = re.compile(r"^parked (\d+) tokens in ([\d.]+) ms")
RESTORED = re.compile(r"^restored (\d+) tokens \(moved\) in ([\d.]+) ms")


def history_text(tokenizer, n_tokens: int) -> str:
    parts, i = [], 0
    while True:
        parts.append(f"[{i + 1}] {PARAGRAPHS[i % len(PARAGRAPHS)]}")
        i += 1
        if i % 8 == 0 and len(tokenizer.encode(" ".join(parts))) >= n_tokens:
            break
    ids = tokenizer.encode(" ".join(parts))[:n_tokens]
    return tokenizer.decode(ids)


def chat(engine, messages, conversation, max_tokens):
    from engine.engine import GenerateRequest
    from engine.events import Log
    from engine.sampling import SamplingParams
    h = engine.submit(GenerateRequest(messages=list(messages), conversation=conversation,
                                      sampling=SamplingParams(max_tokens=max_tokens, temperature=0.0)))
    logs = [ev.line for ev in h.events() if isinstance(ev, Log)]
    return h.result(), logs


def med(xs):
    return statistics.median(xs) if xs else float("nan")


def fmt(x, unit=""):
    if x != x:  # nan
        return "n/a"
    return f"{x:,.1f}{unit}" if abs(x) < 1000 else f"{x:,.0f}{unit}"


def llama_cpp_or_reason():
    try:
        import llama_cpp  # noqa: F401
        return llama_cpp, None
    except Exception as e:  # noqa: BLE001
        return None, f"llama_cpp is not importable ({type(e).__name__}: {e}); install the 'oracle' extra"


def main() -> int:
    from engine.engine import Call, Engine, EngineOptions, RestoreSession, SaveSession, Status
    from engine.models import default_model_path

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="GGUF (default: the default model)")
    ap.add_argument("--history", type=int, default=2000, help="tokens of A's history before B (default 2000)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--session-tokens", type=int, default=2048)
    ap.add_argument("--reply-tokens", type=int, default=8, help="tokens generated per turn (greedy)")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2, help="llama.cpp threads")
    args = ap.parse_args()
    model = Path(args.model) if args.model else default_model_path()
    if not model.exists():
        print(f"model not found: {model} (run `make model`)", file=sys.stderr)
        return 2
    if args.repeats < 1:
        print("--repeats must be >= 1", file=sys.stderr)
        return 2

    t_bench = time.perf_counter()
    on = Engine(EngineOptions(model=str(model), cache_mib=1024, cache_slots=4)).start()
    off = Engine(EngineOptions(model=str(model), cache_mib=0)).start()
    for e in (on, off):
        if not e.call(Status())["model"]:
            print(f"the model did not load: {model}", file=sys.stderr)
            return 2
    tok = on.tokenizer
    # Enough history that A holds --session-tokens after its turns, for the session part.
    first_user = "Here are my sources. " + history_text(tok, args.history)
    messages = [{"role": "system", "content": A_SYSTEM}, {"role": "user", "content": first_user}]
    print(f"model {model.name}; A's first turn (~{args.history} tokens) on the parking engine ...", file=sys.stderr,
          flush=True)
    r, _ = chat(on, messages, "A", args.reply_tokens)
    messages.append({"role": "assistant", "content": r["text"]})
    history_tokens = r["prompt_tokens"]
    print(f"  prompt {r['prompt_tokens']} tokens, ttft {r['ttft_ms'] / 1e3:.1f} s", file=sys.stderr, flush=True)

    ttft_on, ttft_off, cached_on, cached_off, park_ms, restore_ms, held = [], [], [], [], [], [], []
    for k in range(args.repeats):
        messages.append({"role": "user", "content": FOLLOW_UPS[k % len(FOLLOW_UPS)]})
        # Parking engine: B parks A, A's turn takes it back.
        _, b_logs = chat(on, B_MESSAGES, "B", args.reply_tokens)
        ra, a_logs = chat(on, messages, "A", args.reply_tokens)
        for m in map(PARKED.match, b_logs):
            if m:
                held.append(int(m.group(1)))
                park_ms.append(float(m.group(2)))
        for m in map(RESTORED.match, a_logs):
            if m:
                restore_ms.append(float(m.group(2)))
        ttft_on.append(ra["ttft_ms"])
        cached_on.append(ra["cached_tokens"])
        # No parking: B takes the engine, A's same turn (same messages) is read again.
        chat(off, B_MESSAGES, "B", args.reply_tokens)
        ro, _ = chat(off, messages, "A", args.reply_tokens)
        ttft_off.append(ro["ttft_ms"])
        cached_off.append(ro["cached_tokens"])
        assert ro["prompt_tokens"] == ra["prompt_tokens"], (ro["prompt_tokens"], ra["prompt_tokens"])
        messages.append({"role": "assistant", "content": ra["text"]})
        print(f"  repeat {k + 1}: A's turn {ra['prompt_tokens']} tokens; ttft parked {ra['ttft_ms']:.0f} ms "
              f"(cached {ra['cached_tokens']}), not parked {ro['ttft_ms']:.0f} ms (cached {ro['cached_tokens']})",
              file=sys.stderr, flush=True)
    off.stop()

    # ---- session files: the first --session-tokens tokens of A's conversation ---------------------------
    live_n = on.call(Status())["live_tokens"]
    n = min(args.session_tokens, live_n)

    def truncate(engine):   # keep the first n tokens of the live conversation (as a rewind does)
        live = engine.live
        for c in live.cache:
            if c.offset > n:
                c.trim(c.offset - n)
        live.tokens = live.tokens[:n]
        return list(live.tokens)

    ids = on.call(Call(truncate))["value"]
    tmp = Path(tempfile.mkdtemp(prefix="strata-bench-cache-"))
    s_path, l_path = tmp / "a.stratasession", tmp / "a.llamastate"
    llama_cpp, why_not = llama_cpp_or_reason()
    llm = None
    if llama_cpp is not None:
        llm = llama_cpp.Llama(model_path=str(model), n_ctx=max(n + 64, 512), n_batch=512, n_threads=args.threads,
                              verbose=False)
        print(f"llama.cpp: prefill of the same {n} tokens ...", file=sys.stderr, flush=True)
        llm.eval(ids)
        ctx = llm._ctx.ctx
        tok_arr = (llama_cpp.llama_token * n)(*ids)
    s_save, s_load, l_save, l_load = [], [], [], []
    s_bytes = l_bytes = 0
    for k in range(args.repeats):
        if k:   # the restore made the file's conversation live; save that one again (same tokens)
            assert on.call(Status())["live_tokens"] == n
        t0 = time.perf_counter()
        r = on.call(SaveSession(str(s_path)))
        s_save.append((time.perf_counter() - t0) * 1e3)
        s_bytes = r["session_bytes"]
        t0 = time.perf_counter()
        r = on.call(RestoreSession(str(s_path)))
        s_load.append((time.perf_counter() - t0) * 1e3)
        assert r["restored_tokens"] == n
        if llm is not None:
            t0 = time.perf_counter()
            written = llama_cpp.llama_state_seq_save_file(ctx, str(l_path).encode(), 0, tok_arr, n)
            l_save.append((time.perf_counter() - t0) * 1e3)
            assert written > 0, "llama_state_seq_save_file failed"
            l_bytes = l_path.stat().st_size
            out = (llama_cpp.llama_token * (n + 16))()
            n_out = ctypes.c_size_t(0)
            t0 = time.perf_counter()
            read = llama_cpp.llama_state_seq_load_file(ctx, str(l_path).encode(), 0, out, n + 16, ctypes.byref(n_out))
            l_load.append((time.perf_counter() - t0) * 1e3)
            assert read > 0 and n_out.value == n and list(out[:n]) == ids, "llama_state_seq_load_file failed"
    on.stop()

    # ---- table ------------------------------------------------------------------------------------------
    ratio = med(ttft_off) / med(ttft_on)
    rows = [
        ("A's follow-up ttft, parked (ms)", fmt(med(ttft_on)), "", "", ""),
        ("A's follow-up ttft, not parked (ms)", fmt(med(ttft_off)), "", "", ""),
        ("ttft ratio not parked / parked", f"{ratio:,.0f}x", "", "", ">= 50x " + ("MET" if ratio >= 50 else "MISSED")),
        ("cached tokens parked / not parked", f"{med(cached_on):.0f} / {med(cached_off):.0f}", "", "", ""),
        (f"park (ms, {med(held):.0f} tokens)", fmt(med(park_ms)), "", "", ""),
        ("restore from parking (ms)", fmt(med(restore_ms)), "", "", ""),
    ]
    if llm is not None:
        sr, lr = med(s_save) / med(l_save), med(s_load) / med(l_load)
        bpt_s, bpt_l = s_bytes / n, l_bytes / n
        rows += [
            (f"session save, {n} tokens (ms)", fmt(med(s_save)), fmt(med(l_save)), f"{sr:.2f}x",
             "<= 2x " + ("MET" if sr <= 2 else "MISSED")),
            (f"session restore, {n} tokens (ms)", fmt(med(s_load)), fmt(med(l_load)), f"{lr:.2f}x",
             "<= 2x " + ("MET" if lr <= 2 else "MISSED")),
            ("session file bytes", f"{s_bytes:,}", f"{l_bytes:,}", f"{s_bytes / l_bytes:.3f}x", ""),
            ("session file bytes per token", f"{bpt_s:,.1f}", f"{bpt_l:,.1f}", f"{bpt_s / bpt_l:.3f}x",
             "<= 1x " + ("MET" if bpt_s <= bpt_l else "MISSED")),
        ]
    else:
        rows += [
            (f"session save, {n} tokens (ms)", fmt(med(s_save)), "skipped", "", ""),
            (f"session restore, {n} tokens (ms)", fmt(med(s_load)), "skipped", "", ""),
            ("session file bytes per token", f"{s_bytes / n:,.1f}", "skipped", "", ""),
        ]
    head = ("metric", "Strata (MLX)", "llama.cpp", "ratio", "target")
    print(f"\nmodel {model.name}, history {history_tokens} tokens (A's turns {med([t for t in cached_on]):.0f}+ "
          f"cached), {args.repeats} repeats, medians; {platform.machine()} {platform.system()}, "
          f"{os.cpu_count()} CPUs; total {time.perf_counter() - t_bench:.0f} s")
    if why_not:
        print(f"llama.cpp column skipped: {why_not}")
    print("| " + " | ".join(head) + " |")
    print("|" + "|".join("---" for _ in head) + "|")
    for row in rows:
        print("| " + " | ".join(row) + " |")
    print(f"\nraw: ttft parked {[round(x) for x in ttft_on]}, not parked {[round(x) for x in ttft_off]}, "
          f"park {park_ms}, restore {restore_ms}, save {[round(x, 1) for x in s_save]} vs {[round(x, 1) for x in l_save]}, "
          f"load {[round(x, 1) for x in s_load]} vs {[round(x, 1) for x in l_load]}")
    for p in (s_path, l_path):
        p.unlink(missing_ok=True)
    tmp.rmdir()
    return 0


if __name__ == "__main__":
    sys.exit(main())
