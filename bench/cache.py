"""Conversation parking and session files, against llama.cpp's seq state files.

    .venv/bin/python bench/cache.py [--model PATH] [--history 2000] [--repeats 3] [--session-tokens 2048]
    .venv/bin/python bench/cache.py --session-only [--fill random|prefill] [--random-shape llama1b|smollm2]
                                    [--fresh-names] [--new-process N] [--cache-mib M --cache-slots S]
                                    [--mlx-cache-limit MIB] [--gpu-readers N]

1. A/B/A (skipped with --session-only): conversation A with --history tokens, then a short chat-title
   request B (other system prompt), then A's next turn. Time to first token of A's turn with parking
   (cache 1024 MiB) vs without (cache 0, so A is read again). Two engines, alternated each repeat; both
   get A's turns with the same messages (the parking engine's replies), so the prompts are the same
   tokens. Park and restore ms are the engine's own log lines. Target: ratio >= 50x at 2,000 tokens.
2. Session files for --session-tokens tokens: Strata's SaveSession (without and with fsync) and
   RestoreSession vs llama.cpp's llama_state_seq_save_file / llama_state_seq_load_file (llama-cpp-python
   low-level API, same GGUF, same token ids, its default f16 K/V, no fsync), alternated, repeated, page
   cache warm for both. The K/V saved is A's history (full mode) or, with --session-only, the same
   token ids read by the model (--fill prefill) or random values of the model's K/V shape written
   straight into the engine's cache (--fill random, the default: the bytes moved are the same, and a CPU
   prefill of 2,048 tokens takes minutes). llama.cpp always reads the ids itself. Also printed: the
   engine's own breakdown of each save and restore (cast, checksum, write, fsync, read, build).
   Targets: save (without fsync) and restore within 2x of llama.cpp's time; bytes per token no larger.
   The llama.cpp column is skipped, with the reason, when llama_cpp is not importable.
   --fresh-names: every save (both engines') to a new file name, the last one deleted first (untimed),
   instead of over the same file (on ext4 a rename over an existing file writes the data back first).
   After the rounds, a restore then one decode step on the restored K/V, the step timed on its own
   (what the next turn pays for the restored memory's first use; on a GPU, pages moving to the device),
   and a save then one decode step (what reading the K/V for the file leaves behind).
   --gpu-readers N: a GPU restore's reader threads (an A/B against the default, 4).
   --new-process N: then N rounds of restores each into a new process that has just loaded the model
   (what session files are for), Strata as shipped, Strata without its K/V memory touched at load
   (engine/cache/kv_reserve.py) and llama.cpp (its context created, then its load call), in rotating order.

--random-shape makes (once, reused from the temp folder) a random-weight Q8_0 GGUF of a named shape with
bench/shapes.py (its small BPE vocabulary; nothing downloaded): llama1b = Llama-3.2-1B's 16 layers x 2048, 32/8 heads
(head_dim 64), ff 8192; smollm2 = SmolLM2-135M's 30 x 576, 9/3 heads (head_dim 64), ff 1536. Its EOS is
meaningless, so use it with --session-only (the K/V shape is what a session moves).

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
import shutil
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.harness import Run, add_args, held  # noqa: E402

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


def session_ids(tokenizer, n: int) -> list[int]:
    ids: list[int] = []
    while len(ids) < n:
        ids += tokenizer.encode(history_text(tokenizer, n))
    return ids[:n]


def fill_live(engine, ids: list[int], how: str) -> None:
    """Make `ids` the engine's live conversation: read by the model (prefill) or random K/V of its shape."""
    import mlx.core as mx

    from engine.generation.generate import prefill
    from engine.cache.parking import KVEntry

    def fill(e):
        cache = e.handlers.make_cache()
        if how == "prefill":
            fed: list[int] = []
            prefill(e.model, cache, ids, fed, chunk=e.options.prefill_chunk)
        else:
            shape = (1, e.info.n_head_kv, len(ids), e.info.head_dim)
            for i, c in enumerate(cache):
                k = mx.random.normal(shape, key=mx.random.key(2 * i)).astype(e.dtype)
                v = mx.random.normal(shape, key=mx.random.key(2 * i + 1)).astype(e.dtype)
                c.update_and_fetch(k, v)
            mx.eval([c.state for c in cache])
        e.conversations.live = KVEntry(list(ids), cache, e.handlers.cache_key(),
                                       messages=[{"role": "user", "content": "(benchmark)"}])
        return len(ids)
    held(engine, fill)


def first_step(engine) -> float:
    """ms of one decode step on the live (just restored) K/V, evaluated: what the next turn pays for the
    restored memory's first use (on a GPU, MLX's managed memory moving to the device). The step is
    trimmed off again, so the live conversation is the restored one."""
    import mlx.core as mx


    def step(e):
        cache = e.conversations.live.cache
        t = time.perf_counter()
        mx.eval(e.model(mx.array([[e.conversations.live.tokens[-1]]]), cache=cache))
        ms = (time.perf_counter() - t) * 1e3
        for c in cache:
            c.trim(1)
        return ms
    return held(engine, step)


def session_rounds(engine, model: Path, ids: list[int], repeats: int, threads: int, folder: Path,
                   fresh_names: bool = False, new_process: int = 0) -> dict:
    """Strata's save (no sync, sync) and restore vs llama.cpp's save and load, alternated. fresh_names:
    every save (both engines) goes to a new file name, the last one deleted before, untimed: a new
    session's save, without the file system's work of replacing an existing file."""
    from engine.engine import RestoreSession, SaveSession
    n = len(ids)
    s_path, l_path = folder / "a.stratasession", folder / "a.llamastate"
    names = iter(range(1 << 30))

    def fresh(path: Path) -> Path:
        if not fresh_names:
            return path
        path.unlink(missing_ok=True)
        return path.with_name(f"{next(names)}{path.suffix}")
    llama_cpp, why_not = llama_cpp_or_reason()
    llm = None
    if llama_cpp is not None:
        llm = llama_cpp.Llama(model_path=str(model), n_ctx=max(n + 64, 512), n_batch=512, n_threads=threads,
                              verbose=False)
        print(f"llama.cpp: prefill of the same {n} tokens ...", file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        llm.eval(ids)
        print(f"  {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
        ctx = llm._ctx.ctx
        tok_arr = (llama_cpp.llama_token * n)(*ids)
    out = {k: [] for k in ("save", "save_sync", "load", "l_save", "l_load", "save_prof", "load_prof", "first",
                           "load_own", "settle", "topup")}

    def settle() -> None:
        """Before anything is timed, on either engine: Strata's idle-time work done (on the CPU, after a
        restore, the K/V memory touched again: kv_reserve.TopUp), so that it runs beside nothing timed.
        How long it took is reported: it is this engine's cost, paid between requests."""
        t0 = time.perf_counter()
        if not engine.wait_idle(120):
            raise SystemExit("the engine did not become idle within 120 s")
        out["settle"].append((time.perf_counter() - t0) * 1e3)

    def strata():
        nonlocal s_path
        s_path = fresh(s_path)
        settle()
        t0 = time.perf_counter()
        r = engine.call(SaveSession(str(s_path), sync=False))
        out["save"].append((time.perf_counter() - t0) * 1e3)
        out["bytes"] = r.session_bytes
        s_path = fresh(s_path)
        settle()
        t0 = time.perf_counter()
        r = engine.call(SaveSession(str(s_path), sync=True))
        out["save_sync"].append((time.perf_counter() - t0) * 1e3)
        out["save_prof"].append(r.profile)
        settle()
        t0 = time.perf_counter()
        r = engine.call(RestoreSession(str(s_path)))
        out["load"].append((time.perf_counter() - t0) * 1e3)
        out["load_own"].append(r.restore_ms)    # the engine's own: reading to building, not parking the last one
        out["load_prof"].append(r.profile)
        assert r.restored_tokens == n
        settle()
        out["topup"].append(out["settle"][-1])  # after a restore: the idle-time top-up of K/V memory, if any

    def llama():
        nonlocal l_path
        l_path = fresh(l_path)
        settle()
        t0 = time.perf_counter()
        written = llama_cpp.llama_state_seq_save_file(ctx, str(l_path).encode(), 0, tok_arr, n)
        out["l_save"].append((time.perf_counter() - t0) * 1e3)
        assert written > 0, "llama_state_seq_save_file failed"
        out["l_bytes"] = l_path.stat().st_size
        buf = (llama_cpp.llama_token * (n + 16))()
        n_out = ctypes.c_size_t(0)
        settle()
        t0 = time.perf_counter()
        read = llama_cpp.llama_state_seq_load_file(ctx, str(l_path).encode(), 0, buf, n + 16, ctypes.byref(n_out))
        out["l_load"].append((time.perf_counter() - t0) * 1e3)
        assert read > 0 and n_out.value == n and list(buf[:n]) == ids, "llama_state_seq_load_file failed"

    for k in range(repeats):
        order = (strata, llama) if k % 2 == 0 else (llama, strata)
        for fn in order:
            if fn is llama and llm is None:
                continue
            fn()
        parts = ", ".join(f"{name.removesuffix('_ms')} {v:.1f}" for name, v in out["load_prof"][-1].items()
                          if name.endswith("_ms") and name != "header_ms")
        theirs = f"; llama.cpp save {out['l_save'][-1]:.1f} load {out['l_load'][-1]:.1f} ms" if llm is not None else ""
        print(f"  round {k + 1}: save {out['save'][-1]:.1f} (sync {out['save_sync'][-1]:.1f}) restore "
              f"{out['load'][-1]:.1f} ms (the engine's own {out['load_own'][-1]:.1f}: {parts}; then idle-time work "
              f"{out['topup'][-1]:.0f} ms){theirs}",
              file=sys.stderr, flush=True)
    # Apart from the rounds (a decode step between a restore and the next save would change what the
    # save finds): restore, then one decode step on the restored K/V, timed on its own.
    for k in range(repeats):
        engine.call(RestoreSession(str(s_path)))
        settle()
        out["first"].append(first_step(engine))
    print(f"  a decode step right after a restore: {[round(x, 1) for x in out['first']]} ms", file=sys.stderr)
    # And after a save: what reading the K/V for the file leaves behind (on MLX's CUDA backend a host read
    # of an array moves it into managed memory, device_upload.host_view).
    out["after_save"] = []
    for k in range(repeats):
        s_path = fresh(s_path)
        engine.call(SaveSession(str(s_path), sync=False))
        settle()
        out["after_save"].append(first_step(engine))
    print(f"  a decode step right after a save: {[round(x, 1) for x in out['after_save']]} ms", file=sys.stderr)
    out["why_not"] = why_not
    if new_process:
        out["new"] = new_process_restores(model, s_path, l_path if llm is not None else None, n, new_process,
                                          threads, engine.options)
    for p in (s_path, l_path):
        p.unlink(missing_ok=True)
    return out


def new_process_restores(model: Path, s_path: Path, l_path: Path | None, n: int, repeats: int, threads: int,
                         options) -> dict:
    """The restore a session file is for: into a process that has just loaded the model. Each round
    starts a new process per engine (this script with --child-restore), in rotating order: Strata as
    shipped, Strata without the K/V memory touched at load (engine/cache/kv_reserve.py off), llama.cpp (its
    context made, which allocates and clears its K/V, then llama_state_seq_load_file). Each child
    reports its engine's own restore time (Strata: the RestoreSession result's restore_ms; llama.cpp:
    the load call); loading the model is not timed."""
    import json
    import subprocess
    kinds = ["strata", "strata-untouched"] + (["llama"] if l_path is not None else [])
    out: dict = {k: [] for k in kinds}
    for k in range(repeats):
        for kind in kinds[k % len(kinds):] + kinds[:k % len(kinds)]:
            path = l_path if kind == "llama" else s_path
            cmd = [sys.executable, str(Path(__file__).resolve()), "--child-restore", kind, str(path), "--model",
                   str(model), "--session-tokens", str(n), "--threads", str(threads),
                   "--context", str(options.context_length or 0)]
            if options.dtype:
                cmd += ["--dtype", options.dtype]
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
            line = [x for x in r.stdout.splitlines() if x.startswith("{")]
            if r.returncode != 0 or not line:
                raise RuntimeError(f"--child-restore {kind} failed: {r.stderr.strip()[-400:]}")
            out[kind].append(json.loads(line[-1])["ms"])
        print(f"  new process {k + 1}: " + ", ".join(f"{kind} {out[kind][-1]:.1f}" for kind in kinds) + " ms",
              file=sys.stderr, flush=True)
    return out


def child_restore(kind: str, path: str, model: str, n: int, threads: int, context: int, dtype: str | None) -> int:
    """One restore in this new process (--child-restore); prints {"ms": ...}."""
    import json
    if kind == "llama":
        llama_cpp, why_not = llama_cpp_or_reason()
        if llama_cpp is None:
            print(why_not, file=sys.stderr)
            return 2
        llm = llama_cpp.Llama(model_path=model, n_ctx=max(n + 64, 512), n_batch=512, n_threads=threads, verbose=False)
        buf = (llama_cpp.llama_token * (n + 16))()
        n_out = ctypes.c_size_t(0)
        t0 = time.perf_counter()
        read = llama_cpp.llama_state_seq_load_file(llm._ctx.ctx, path.encode(), 0, buf, n + 16, ctypes.byref(n_out))
        ms = (time.perf_counter() - t0) * 1e3
        if read <= 0 or n_out.value != n:
            print("llama_state_seq_load_file failed", file=sys.stderr)
            return 2
    else:
        from engine.cache import kv_reserve
        from engine.engine import Engine, EngineOptions, RestoreSession, Status
        if kind == "strata-untouched":
            kv_reserve.touch = lambda *a, **k: kv_reserve.Reserved.none("off for this measurement")
        engine = Engine(EngineOptions(model=model, dtype=dtype, context_length=context or None)).start()
        if not engine.call(Status()).model:
            print(f"the model did not load: {model}", file=sys.stderr)
            return 2
        r = engine.call(RestoreSession(path))
        ms = r.restore_ms
        if r.restored_tokens != n:
            print(f"restored {r.restored_tokens} tokens, not {n}", file=sys.stderr)
            return 2
    print(json.dumps({"ms": ms}), flush=True)
    os._exit(0)         # the engine thread never ends (mlx at-exit abort, see engine.run_forever)


def session_rows(n: int, res: dict) -> list[tuple]:
    save, sync, load = med(res["save"]), med(res["save_sync"]), med(res["load"])
    b = res["bytes"]
    rows = []
    if res["l_save"]:
        ls, ll, lb = med(res["l_save"]), med(res["l_load"]), res["l_bytes"]
        rows += [
            (f"session save, {n} tokens, no fsync (ms)", fmt(save), fmt(ls), f"{save / ls:.2f}x",
             "<= 2x " + ("MET" if save / ls <= 2 else "MISSED")),
            (f"session save with fsync (ms)", fmt(sync), "(no fsync)", f"{sync / ls:.2f}x", ""),
            (f"session restore, {n} tokens (ms)", fmt(load), fmt(ll), f"{load / ll:.2f}x",
             "<= 2x " + ("MET" if load / ll <= 2 else "MISSED")),
            own_row(res, b),
            ("idle-time work after a restore (ms: K/V memory touched again)", fmt(med(res["topup"])), "", "", ""),
            ("the restored K/V's first decode step (ms)", fmt(med(res["first"])), "", "", ""),
            ("a decode step right after a save (ms)", fmt(med(res["after_save"])), "", "", ""),
            ("save / restore GB/s", f"{b / save / 1e6:.2f} / {b / load / 1e6:.2f}",
             f"{lb / ls / 1e6:.2f} / {lb / ll / 1e6:.2f}", "", ""),
            *new_process_rows(n, res),
            ("session file bytes", f"{b:,}", f"{lb:,}", f"{b / lb:.3f}x", ""),
            ("session file bytes per token", f"{b / n:,.1f}", f"{lb / n:,.1f}", f"{b / lb:.3f}x",
             "<= 1x " + ("MET" if b <= lb else "MISSED")),
        ]
    else:
        rows += [
            (f"session save, {n} tokens, no fsync (ms)", fmt(save), "skipped", "", ""),
            (f"session save with fsync (ms)", fmt(sync), "skipped", "", ""),
            (f"session restore, {n} tokens (ms)", fmt(load), "skipped", "", ""),
            own_row(res, b),
            ("idle-time work after a restore (ms: K/V memory touched again)", fmt(med(res["topup"])), "", "", ""),
            *new_process_rows(n, res),
            ("the restored K/V's first decode step (ms)", fmt(med(res["first"])), "", "", ""),
            ("a decode step right after a save (ms)", fmt(med(res["after_save"])), "", "", ""),
            ("save / restore GB/s", f"{b / save / 1e6:.2f} / {b / load / 1e6:.2f}", "skipped", "", ""),
            ("session file bytes per token", f"{b / n:,.1f}", "skipped", "", ""),
        ]
    return rows


def record_session(run: Run, n: int, res: dict) -> None:
    """The session part's headline figures, one JSON line each (bench/harness.py)."""
    for key, figure in (("save", "session save"), ("save_sync", "session save with fsync"),
                        ("load", "session restore"), ("load_own", "the engine's own restore")):
        run.record(figure, med(res[key]), "ms", spread=res[key], rounds=len(res[key]), session_tokens=n)
    run.record("session file bytes per token", res["bytes"] / n, "B", session_tokens=n)
    if res["l_save"]:
        for key, lkey, figure in (("save", "l_save", "session save"), ("load", "l_load", "session restore")):
            run.record(f"{figure} / llama.cpp", med(res[key]) / med(res[lkey]), "x", peer="llama.cpp",
                       session_tokens=n)
        run.record("session file bytes / llama.cpp", res["bytes"] / res["l_bytes"], "x", peer="llama.cpp",
                   session_tokens=n)
    for kind, xs in (res.get("new") or {}).items():
        run.record(f"session restore into a new process, {kind}", med(xs), "ms", spread=xs, rounds=len(xs),
                   session_tokens=n)


def own_row(res: dict, nbytes: int) -> tuple:
    """The engine's own restore time (RestoreSession's restore_ms: open to the cache built), without
    the wall time's queue hop and the parking of the conversation the restored one replaces."""
    own = med(res["load_own"])
    return ("the engine's own restore time, ms (GB/s)", f"{fmt(own)} ({nbytes / own / 1e6:.2f})", "", "", "")


def new_process_rows(n: int, res: dict) -> list[tuple]:
    new = res.get("new")
    if not new:
        return []
    ll = med(new["llama"]) if new.get("llama") else None
    rows = []
    for kind, label in (("strata", "as shipped"), ("strata-untouched", "K/V memory not touched at load")):
        ms = med(new[kind])
        rows.append((f"session restore into a new process, {label} (ms)", fmt(ms), fmt(ll) if ll else "skipped",
                     f"{ms / ll:.2f}x" if ll else "", ("<= 2x " + ("MET" if ms / ll <= 2 else "MISSED"))
                     if ll and kind == "strata" else ""))
    return rows


def profile_lines(res: dict) -> list[str]:
    def medians(profs):
        keys = [k for k, v in profs[0].items() if isinstance(v, (int, float))]
        return {k: med([p[k] for p in profs]) for k in keys}
    sp, rp = medians(res["save_prof"]), medians(res["load_prof"])
    cast = res["load_prof"][0].get("cast", "")
    return [
        "save breakdown (ms, medians, the fsynced saves): " + ", ".join(
            f"{k.removesuffix('_ms')} {v:.1f}" for k, v in sp.items() if k.endswith("_ms")) + f"; {sp['writes']:.0f} writes",
        f"restore breakdown (ms, medians; cast {cast}): " + ", ".join(
            f"{k.removesuffix('_ms')} {v:.1f}" for k, v in rp.items() if k.endswith("_ms")) + f"; {rp['reads']:.0f} reads",
    ]


def print_table(rows, head=("metric", "Strata (MLX)", "llama.cpp", "ratio", "target")) -> None:
    print("| " + " | ".join(head) + " |")
    print("|" + "|".join("---" for _ in head) + "|")
    for row in rows:
        print("| " + " | ".join(row) + " |")


def restart_bench(model: Path, sizes: list[int], reply_tokens: int, dtype: str | None, rounds: int = 1,
                  run: Run | None = None) -> int:
    """--restart: returning to a conversation of each size after a restart, the disk tier
    (engine/disk/disk_tier.py) against reading it again, in one run; plus the bytes a turn writes.
    --restart-rounds R: R rounds per size, the two arms alternating (disk first, then re-read first),
    each disk round from a copy of the folder as the two turns left it (so every round finds the
    same files); medians with [min-max]."""
    import time as _time

    from engine.api import Status
    from engine.engine import Engine, EngineOptions
    rows = []
    for n in sizes:
        folder = Path(tempfile.mkdtemp(prefix="strata-bench-disk-"))

        def start(disk_mib: int):
            e = Engine(EngineOptions(model=str(model), disk_mib=disk_mib, disk_dir=str(folder), dtype=dtype)).start()
            e.startup.result()
            return e
        e = start(4096)
        tok = held(e, lambda eng: eng.tokenizer)
        first = [{"role": "user", "content": history_text(tok, n) + "\n\nSummarise this in one line."}]
        r1, _ = chat(e, first, "bench", reply_tokens)
        e.wait_idle(600)
        held(e, lambda eng: eng.disk.flush())
        d1 = e.call(Status()).disk
        follow = first + [{"role": "assistant", "content": r1.text}, {"role": "user", "content": "And in one word?"}]
        r2, _ = chat(e, follow, "bench", reply_tokens)
        e.wait_idle(600)
        held(e, lambda eng: eng.disk.flush())
        d2 = e.call(Status()).disk
        e.stop()
        again = follow + [{"role": "assistant", "content": r2.text}, {"role": "user", "content": "Thanks. Why?"}]
        snap = Path(tempfile.mkdtemp(prefix="strata-bench-disk-snap-")) / "d"
        shutil.copytree(folder, snap)
        got = {"disk": [], "cold": []}
        for r in range(rounds):
            for kind in (("disk", "cold") if r % 2 == 0 else ("cold", "disk")):
                if kind == "disk":                # a restart: the disk tier finds the conversation
                    shutil.rmtree(folder, ignore_errors=True)
                    shutil.copytree(snap, folder)
                e = start(4096 if kind == "disk" else 0)   # 0: the conversation read again
                # A fresh process's first forward pass pays one-time set-up (allocator, kernels, library
                # handles) in both arms alike: a two-token reply of another conversation takes it first,
                # so the timed turn measures the return to the conversation.
                chat(e, [{"role": "user", "content": "Hello."}], "warm-up", 2)
                e.wait_idle(600)
                t = _time.perf_counter()
                res, logs = chat(e, again, "bench", 1)
                wall = _time.perf_counter() - t
                e.stop()
                got[kind].append(res)
                # the engine's own figure for the restore (read, checks, upload), inside the ttft
                restore = next((ln.split(" in ")[-1] for ln in logs if ln.startswith("disk cache: restored")), "-")
                if rounds > 1:
                    print(f"  {n} tokens, round {r + 1} {kind}: ttft {res.ttft_ms:.1f} ms, wall {wall * 1e3:.1f} ms, "
                          f"prompt {res.prompt_tokens}, from disk {res.restored_from_disk}, restore {restore}",
                          flush=True)
        dt = [x.ttft_ms for x in got["disk"]]
        ct = [x.ttft_ms for x in got["cold"]]
        ratios = [c / max(d, 1e-6) for d, c in zip(dt, ct)]
        disk = got["disk"][0]
        rows.append((n, disk.prompt_tokens, min(x.restored_from_disk for x in got["disk"]), dt, ct, ratios,
                     d1["last_write"]["bytes"], d2["last_write"]["bytes"], d2["bytes"],
                     d2["last_write"].get("state_bytes", 0), d2["last_write"].get("segments", 1)))
        shutil.rmtree(folder, ignore_errors=True)
        shutil.rmtree(snap.parent, ignore_errors=True)

    def span(xs, f="{:.1f}"):
        s = f.format(statistics.median(xs))
        return s if len(xs) == 1 else f"{s} [{f.format(min(xs))}-{f.format(max(xs))}]"
    print(f"model {model.name}, dtype {dtype or 'default'}; first token after a restart (ms)"
          + (f"; {rounds} rounds, arms alternating, median [min-max]" if rounds > 1 else ""))
    print("| history | prompt | from disk (tokens, least of the rounds) | disk tier ttft | re-read ttft | speed-up | turn 1 written | "
          "turn 2 written | file |")
    print("|---|---|---|---|---|---|---|---|---|")
    for n, p, rd, dt, ct, x, w1, w2, size, w2_state, w2_segs in rows:
        # a model with windows or a recurrent state (engine/disk/disk_states.py): a segment per message
        # boundary, each with the windows' last tokens and the recurrent state there
        states = f" ({w2_segs} segments, {w2_state / 1e3:.0f} KB windows/states)" if w2_state else ""
        print(f"| {n} | {p} | {rd} | {span(dt)} | {span(ct)} | {span(x)}x | {w1 / 1e6:.2f} MB | {w2 / 1e3:.0f} KB"
              f"{states} | {size / 1e6:.2f} MB |")
        if run is not None:
            run.record(f"ttft after a restart, disk tier, {n} tokens", statistics.median(dt), "ms", spread=dt,
                       rounds=rounds, model=model.name)
            run.record(f"ttft after a restart, re-read, {n} tokens", statistics.median(ct), "ms", spread=ct,
                       rounds=rounds, model=model.name)
            run.record(f"restart speed-up, {n} tokens", statistics.median(x), "x", peer="re-read", spread=x,
                       rounds=rounds, model=model.name)
    return 0


def main() -> int:
    from engine.engine import Engine, EngineOptions, Status
    from engine.model.models import default_model_path

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="GGUF (default: the default model)")
    ap.add_argument("--random-shape", choices=("llama1b", "smollm2"), default=None,
                    help="a random-weight Q8_0 model of this shape instead of --model")
    ap.add_argument("--session-only", action="store_true", help="skip the A/B/A part")
    ap.add_argument("--fill", choices=("random", "prefill"), default="random",
                    help="with --session-only: how the session's K/V is made (default random)")
    ap.add_argument("--dtype", choices=("float32", "float16"), default=None,
                    help="the engine's compute dtype (default: float32 on a CPU, float16 on a GPU); float16 on a "
                         "CPU measures the session path without casts (the K/V a GPU holds)")
    ap.add_argument("--history", type=int, default=2000, help="tokens of A's history before B (default 2000)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--session-tokens", type=int, default=2048)
    ap.add_argument("--reply-tokens", type=int, default=8, help="tokens generated per turn (greedy)")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2, help="llama.cpp threads")
    ap.add_argument("--fresh-names", action="store_true",
                    help="each save (both engines) to a new file name instead of over the last one")
    ap.add_argument("--cache-mib", type=int, default=1024, help="the parking engine's conversation cache (MiB)")
    ap.add_argument("--cache-slots", type=int, default=4, help="... and its number of parked conversations")
    ap.add_argument("--mlx-cache-limit", type=int, default=None, metavar="MIB",
                    help="mx.set_cache_limit before the engine starts (how much freed memory MLX keeps for reuse)")
    ap.add_argument("--gpu-readers", type=int, default=None, metavar="N",
                    help="A/B: reader threads of a GPU restore (sessions.GPU_READERS; its ring grows to N + 2 buffers)")
    ap.add_argument("--new-process", type=int, default=0, metavar="N",
                    help="also N rounds of restores, each into a new process that has just loaded the model")
    ap.add_argument("--child-restore", nargs=2, metavar=("KIND", "PATH"), help=argparse.SUPPRESS)
    ap.add_argument("--context", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--restart", action="store_true",
                    help="returning to a 2,000- and an 8,000-token conversation after a restart: the disk tier "
                         "against reading it again (on a CPU 8,000 only with --restart-sizes)")
    ap.add_argument("--restart-sizes", default=None, metavar="N,N",
                    help="--restart: history sizes (default 2000,8000 on a GPU, 2000 on a CPU)")
    ap.add_argument("--restart-rounds", type=int, default=1, metavar="R",
                    help="--restart: rounds per size, disk tier and re-read alternating (medians [min-max])")
    add_args(ap)
    args = ap.parse_args()
    if args.restart:
        from engine.device import on_gpu
        from engine.model.models import default_model_path as _default
        sizes = [int(x) for x in (args.restart_sizes or ("2000,8000" if on_gpu() else "2000")).split(",")]
        if args.random_shape:
            from bench.shapes import build_random_model
            model = build_random_model(args.random_shape, Path(tempfile.gettempdir()) / "strata-shapes")
        else:
            model = Path(args.model) if args.model else _default()
        return restart_bench(model, sizes, args.reply_tokens, args.dtype, max(1, args.restart_rounds),
                             Run(out=args.out))
    if args.child_restore:
        return child_restore(*args.child_restore, args.model, args.session_tokens, args.threads, args.context,
                             args.dtype)
    if args.repeats < 1 or args.session_tokens < 1:
        print("--repeats and --session-tokens must be >= 1", file=sys.stderr)
        return 2
    if args.gpu_readers is not None and not 1 <= args.gpu_readers <= 64:
        print("--gpu-readers must be 1 to 64", file=sys.stderr)
        return 2
    tmp = Path(tempfile.mkdtemp(prefix="strata-bench-cache-"))
    if args.random_shape:
        from bench.shapes import build_random_model        # written once per machine, then reused
        if args.session_tokens + 1024 > 16384:
            print("--random-shape models hold 16,384 tokens: --session-tokens at most 15360", file=sys.stderr)
            return 2
        model = build_random_model(args.random_shape, Path(tempfile.gettempdir()) / "strata-shapes")
    else:
        model = Path(args.model) if args.model else default_model_path()
    if not model.exists():
        print(f"model not found: {model} (run `make model`)", file=sys.stderr)
        return 2

    t_bench = time.perf_counter()
    if args.gpu_readers:
        import engine.session_files.sessions
        engine.sessions.GPU_READERS = args.gpu_readers
        engine.sessions.GPU_BUFFERS = max(engine.sessions.GPU_BUFFERS, args.gpu_readers + 2)
    if args.mlx_cache_limit is not None:
        import mlx.core as mx
        mx.set_cache_limit(args.mlx_cache_limit << 20)
    on = Engine(EngineOptions(model=str(model), cache_mib=args.cache_mib, cache_slots=args.cache_slots, dtype=args.dtype,
                              context_length=max(4096, args.session_tokens + 1024))).start()
    if not on.call(Status()).model:
        print(f"the model did not load: {model}", file=sys.stderr)
        return 2
    tok = on.tokenizer
    run = Run(out=args.out)
    rows, history_tokens, notes = [], 0, []
    if not args.session_only:
        off = Engine(EngineOptions(model=str(model), cache_mib=0, dtype=args.dtype)).start()
        if not off.call(Status()).model:
            print(f"the model did not load: {model}", file=sys.stderr)
            return 2
        rows, history_tokens, raw = aba(on, off, tok, args, run)
        notes.append(raw)
        off.stop()
        live_n = on.call(Status()).live_tokens
        n = min(args.session_tokens, live_n)

        def truncate(engine):   # keep the first n tokens of the live conversation (as a rewind does)
            live = engine.conversations.live
            for c in live.cache:
                if c.offset > n:
                    c.trim(c.offset - n)
            live.tokens = live.tokens[:n]
            return list(live.tokens)
        ids = held(on, truncate)
        fill = "A's history"
    else:
        ids = session_ids(tok, args.session_tokens)
        print(f"filling {len(ids)} tokens of K/V ({args.fill}) ...", file=sys.stderr, flush=True)
        fill_live(on, ids, args.fill)
        fill = {"random": "random K/V values", "prefill": "read by the model"}[args.fill]
    res = session_rounds(on, model, ids, args.repeats, args.threads, tmp, args.fresh_names, args.new_process)
    compute = str(on.dtype).removeprefix("mlx.core.")
    on.stop()
    rows += session_rows(len(ids), res)
    record_session(run, len(ids), res)

    import mlx.core as mx
    print(f"\nmodel {model.name}{' (random weights)' if args.random_shape else ''}, session {len(ids)} tokens "
          f"({fill}), compute {compute} on {mx.default_device()}"
          + (f", history {history_tokens} tokens" if history_tokens else "")
          + f", {args.repeats} rounds alternated, medians; saves to "
          + ("a new file name each" if args.fresh_names else "the same file name (replacing it)")
          + f"; {platform.machine()} {platform.system()}, "
          f"{os.cpu_count()} CPUs; total {time.perf_counter() - t_bench:.0f} s")
    if res["why_not"]:
        print(f"llama.cpp column skipped: {res['why_not']}")
    print_table(rows)
    print()
    for line in profile_lines(res):
        print(line)
    print(f"\nraw: save {[round(x, 1) for x in res['save']]} (sync {[round(x, 1) for x in res['save_sync']]}) vs "
          f"{[round(x, 1) for x in res['l_save']]}, restore {[round(x, 1) for x in res['load']]} vs "
          f"{[round(x, 1) for x in res['l_load']]}; the engine's own restore {[round(x, 1) for x in res['load_own']]}; idle-time work after each restore "
          f"{[round(x) for x in res['topup']]} ms")
    for kind, xs in (res.get("new") or {}).items():
        print(f"raw, restores into new processes, {kind}: {[round(x, 1) for x in xs]}")
    for line in notes:
        print(line)
    try:
        tmp.rmdir()
    except OSError:
        pass
    return 0


def aba(on, off, tok, args, run: Run) -> tuple[list[tuple], int, str]:
    """The A/B/A part: (table rows, A's first prompt tokens, a raw line)."""
    first_user = "Here are my sources. " + history_text(tok, args.history)
    messages = [{"role": "system", "content": A_SYSTEM}, {"role": "user", "content": first_user}]
    print(f"A's first turn (~{args.history} tokens) on the parking engine ...", file=sys.stderr, flush=True)
    r, _ = chat(on, messages, "A", args.reply_tokens)
    messages.append({"role": "assistant", "content": r.text})
    history_tokens = r.prompt_tokens
    print(f"  prompt {r.prompt_tokens} tokens, ttft {r.ttft_ms / 1e3:.1f} s", file=sys.stderr, flush=True)
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
        ttft_on.append(ra.ttft_ms)
        cached_on.append(ra.cached_tokens)
        # No parking: B takes the engine, A's same turn (same messages) is read again.
        chat(off, B_MESSAGES, "B", args.reply_tokens)
        ro, _ = chat(off, messages, "A", args.reply_tokens)
        ttft_off.append(ro.ttft_ms)
        cached_off.append(ro.cached_tokens)
        assert ro.prompt_tokens == ra.prompt_tokens, (ro.prompt_tokens, ra.prompt_tokens)
        messages.append({"role": "assistant", "content": ra.text})
        print(f"  repeat {k + 1}: A's turn {ra.prompt_tokens} tokens; ttft parked {ra.ttft_ms:.0f} ms "
              f"(cached {ra.cached_tokens}), not parked {ro.ttft_ms:.0f} ms (cached {ro.cached_tokens})",
              file=sys.stderr, flush=True)
    ratio = med(ttft_off) / med(ttft_on)
    run.record("follow-up ttft, parked", med(ttft_on), "ms", spread=ttft_on, history_tokens=history_tokens)
    run.record("follow-up ttft, not parked", med(ttft_off), "ms", spread=ttft_off, history_tokens=history_tokens)
    run.record("ttft not parked / parked", ratio, "x", peer="not parked", history_tokens=history_tokens)
    rows = [
        ("A's follow-up ttft, parked (ms)", fmt(med(ttft_on)), "", "", ""),
        ("A's follow-up ttft, not parked (ms)", fmt(med(ttft_off)), "", "", ""),
        ("ttft ratio not parked / parked", f"{ratio:,.0f}x", "", "", ">= 50x " + ("MET" if ratio >= 50 else "MISSED")),
        ("cached tokens parked / not parked", f"{med(cached_on):.0f} / {med(cached_off):.0f}", "", "", ""),
        (f"park (ms, {med(held):.0f} tokens)", fmt(med(park_ms)), "", "", ""),
        ("restore from parking (ms)", fmt(med(restore_ms)), "", "", ""),
    ]
    raw = (f"raw A/B/A: ttft parked {[round(x) for x in ttft_on]}, not parked {[round(x) for x in ttft_off]}, "
           f"park {park_ms}, restore {restore_ms}")
    return rows, history_tokens, raw


if __name__ == "__main__":
    sys.exit(main())
