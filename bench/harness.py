"""One result format for every bench script: each figure one JSON line.

In a script:

    from bench.harness import Run, add_args
    add_args(ap)                                  # --out PATH (the results file)
    run = Run(out=args.out)
    run.record("decode / mlx-lm", statistics.median(ratios), "x", peer="mlx-lm", spread=ratios, rounds=10,
               line="decode / mlx-lm 1.02")      # spread: min/median/max of the list; line: also printed

Each line holds time, machine (hostname, cpu, cores, RAM, load), device (MLX's default device and the GPU's
name when on one), commit (HEAD, "+dirty" when tracked files changed), command, bench (the script),
figure, value, unit, and any optional fields given (peer, spread {min, median, max}, rounds, ...).
Lines are appended to bench/results/results.jsonl, or --out, or $BENCH_RESULTS.

Reading them back:

    python bench/harness.py show [--bench engine] [--commit 268c1b6] [--file PATH] [--all]

Keeping a run's whole output (the raw log) beside the figures, indexed:

    python bench/harness.py log s14-run2-engine-llama1b -- python bench/engine.py --random-shape llama1b

runs the command, writes its output (stdout and stderr) to bench/results/raw/NAME.txt headed by the
command, the commit and the time, and adds the file's line to the index, bench/results/README.md.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import re
import shlex
import socket
import statistics
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence

REPO = Path(__file__).resolve().parent.parent
DEFAULT_RESULTS = REPO / "bench" / "results" / "results.jsonl"
BASE_FIELDS = ("time", "machine", "device", "commit", "command", "bench", "figure", "value", "unit")


def results_path(out: str | os.PathLike | None = None) -> Path:
    """Where figures go: the explicit path, else $BENCH_RESULTS, else bench/results/results.jsonl."""
    return Path(out or os.environ.get("BENCH_RESULTS") or DEFAULT_RESULTS)


def add_args(ap: argparse.ArgumentParser) -> None:
    """The harness's one option for a script's parser."""
    ap.add_argument("--out", default=None, metavar="JSONL",
                    help=f"append figures here (default $BENCH_RESULTS or {DEFAULT_RESULTS.relative_to(REPO)})")


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    if sys.platform == "darwin":
        try:
            return subprocess.run(["sysctl", "-n", "machdep.cpu.brand_string"], capture_output=True,
                                  text=True, timeout=5).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            pass
    return platform.processor() or platform.machine()


def machine() -> dict[str, Any]:
    try:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError, AttributeError):
        ram = None
    try:        # a shared machine's other work moves every figure: the 1-minute load as the run ends
        load = round(os.getloadavg()[0], 2)
    except OSError:
        load = None
    return {"hostname": socket.gethostname(), "os": f"{platform.system()} {platform.machine()}",
            "cpu": _cpu_model(), "cores": os.cpu_count(), "ram_gib": round(ram, 1) if ram else None,
            "load_1m": load}


def _gpu_name(mx) -> str | None:
    try:
        if mx.metal.is_available():
            return mx.metal.device_info().get("device_name")
    except (AttributeError, RuntimeError):
        pass
    try:
        if mx.cuda.is_available():
            out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=10).stdout.strip()
            return out.splitlines()[0] if out else "CUDA"
    except (AttributeError, RuntimeError, OSError, subprocess.SubprocessError):
        pass
    return None


def device() -> str:
    # Imported here, not at the top: `show` and scripts that never touch MLX must not pay for (or need) it.
    try:
        import mlx.core as mx
    except ImportError:
        return "none (no mlx)"
    dev = str(mx.default_device())
    gpu = _gpu_name(mx)
    return f"{dev}, {gpu}, mlx {mx.__version__}" if gpu else f"{dev}, mlx {mx.__version__}"


def commit() -> str:
    """HEAD plus "+dirty" when tracked files changed; $BENCH_COMMIT where the tree has no git (a device copy)."""
    if os.environ.get("BENCH_COMMIT"):
        return os.environ["BENCH_COMMIT"]
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True,
                              timeout=10)
        if head.returncode:
            return "unknown"
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                               capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return head.stdout.strip() + ("+dirty" if dirty else "")


def spread(xs: Iterable[float]) -> dict[str, float]:
    """min / median / max of a list of per-round figures, the optional "spread" field."""
    xs = list(xs)
    return {"min": min(xs), "median": statistics.median(xs), "max": max(xs)}


class Run:
    """One script run: the facts every figure shares (found once), and the file its figures go to."""

    def __init__(self, bench: str | None = None, out: str | os.PathLike | None = None,
                 argv: Sequence[str] | None = None):
        # a wrapper that runs the script in its own process (bench/trace_run.py) names its own line
        wrapper = os.environ.get("BENCH_COMMAND") if argv is None else None
        argv = list(sys.argv if argv is None else argv)
        self.bench = bench or Path(argv[0]).stem
        self.path = results_path(out)
        self.command = wrapper or " ".join(argv)
        self._facts: dict[str, Any] | None = None
        self.recorded = 0

    def facts(self) -> dict[str, Any]:
        if self._facts is None:
            self._facts = {"machine": machine(), "device": device(), "commit": commit()}
        return self._facts

    def record(self, figure: str, value: float | int | str | None, unit: str = "", *, line: str | None = None,
               **extra: Any) -> dict[str, Any]:
        """Append one figure; print `line` (the script's own human-readable line) when given."""
        clash = set(extra) & set(BASE_FIELDS)
        if clash:
            raise ValueError(f"optional fields may not reuse {sorted(clash)}")
        if isinstance(extra.get("spread"), (list, tuple)):
            extra["spread"] = spread(extra["spread"])
        row = {"time": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"), **self.facts(),
               "command": self.command, "bench": self.bench, "figure": figure, "value": value, "unit": unit,
               **{k: v for k, v in extra.items() if v is not None}}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a", encoding="utf-8") as f:
            f.write(json.dumps(row, default=str) + "\n")
        self.recorded += 1
        if line is not None:
            print(line, flush=True)
        return row

    def __enter__(self) -> "Run":
        return self

    def __exit__(self, *exc) -> None:
        if self.recorded:
            print(f"[harness] {self.recorded} figures appended to {self.path}", file=sys.stderr)


# --- the reader ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Figure:
    time: str
    bench: str
    figure: str
    value: Any
    unit: str
    commit: str
    device: str
    host: str
    spread: dict | None


def read(path: Path) -> list[Figure]:
    out = []
    for n, text in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not text.strip():
            continue
        try:
            r = json.loads(text)
        except json.JSONDecodeError as e:
            raise SystemExit(f"{path}:{n}: not a JSON line ({e.msg})")
        out.append(Figure(r.get("time", ""), r.get("bench", ""), r.get("figure", ""), r.get("value"),
                          r.get("unit", ""), r.get("commit", ""), r.get("device", ""),
                          (r.get("machine") or {}).get("hostname", ""), r.get("spread")))
    return out


def latest(figs: list[Figure]) -> list[Figure]:
    """The newest line per (bench, figure, machine, device), in first-seen order."""
    last: dict[tuple, Figure] = {}
    for f in figs:
        last[(f.bench, f.figure, f.host, f.device)] = f
    return list(last.values())


def _fmt(v: Any) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def table(figs: list[Figure]) -> str:
    rows = [("bench", "figure", "value", "unit", "spread", "commit", "device", "time")]
    for f in figs:
        sp = f"{_fmt(f.spread['min'])}-{_fmt(f.spread['max'])}" if f.spread else ""
        rows.append((f.bench, f.figure, _fmt(f.value), f.unit, sp, f.commit[:12] + ("+" if "dirty" in f.commit
                     else ""), f.device, f.time))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


def show(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="harness.py show", description="the latest figures as a table")
    ap.add_argument("--file", default=None, help="results file (default $BENCH_RESULTS or bench/results/results.jsonl)")
    ap.add_argument("--bench", default=None, help="only this script's figures (its name without .py)")
    ap.add_argument("--commit", default=None, help="only figures measured at a commit starting so")
    ap.add_argument("--all", action="store_true", help="every line, not only the latest of each figure")
    a = ap.parse_args(argv)
    path = results_path(a.file)
    if not path.exists():
        print(f"no results file at {path}", file=sys.stderr)
        return 2
    figs = [f for f in read(path) if (a.bench is None or f.bench == a.bench)
            and (a.commit is None or f.commit.startswith(a.commit))]
    if not a.all:
        figs = latest(figs)
    if not figs:
        print("no figures match", file=sys.stderr)
        return 1
    print(table(figs))
    return 0


# --- the runner: one command's raw log, indexed ------------------------------------------------------

RAW_DIR = REPO / "bench" / "results" / "raw"


def index_row(name: str, command: str, rc: int, lines: int) -> str:
    """The index's line for a log: file, session and call (from an sN-runM- name), command, outcome."""
    m = re.match(r"s(\d+)-run(\d+)-", name)
    where = f"{m.group(1)}, {m.group(2)}" if m else "-"
    return f"| [{name}](raw/{name}) | {where} | `{command.replace('|', '/')}` | exit {rc}, {lines} lines |"


def log(argv: Sequence[str]) -> int:
    ap = argparse.ArgumentParser(prog="harness.py log", description="run a command, keep its output indexed")
    ap.add_argument("name", help="the log's name (e.g. s14-run2-engine-llama1b; .txt added)")
    ap.add_argument("--dir", default=str(RAW_DIR), help="where the log goes (its parent's README.md is the index)")
    argv = list(argv)
    if "--" not in argv or argv.index("--") == len(argv) - 1:
        print("usage: harness.py log NAME [--dir DIR] -- COMMAND...", file=sys.stderr)
        return 2
    cut = argv.index("--")
    a, cmd = ap.parse_args(argv[:cut]), argv[cut + 1:]
    if "/" in a.name or not a.name.strip("."):
        print(f"log name {a.name!r}: a file name, no folders", file=sys.stderr)
        return 2
    path = Path(a.dir) / (a.name if a.name.endswith(".txt") else a.name + ".txt")
    if path.exists():
        print(f"{path} exists: raw logs are never overwritten, pick another name", file=sys.stderr)
        return 2
    path.parent.mkdir(parents=True, exist_ok=True)
    command = shlex.join(cmd)
    now = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    try:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    except OSError as e:
        print(f"cannot run {cmd[0]!r}: {e.strerror}", file=sys.stderr)
        return 2
    with path.open("w", encoding="utf-8") as f:
        f.write(f"# {now}, {socket.gethostname()}, code {commit()}: {command}\n")
        n = 0
        for line in proc.stdout:
            sys.stdout.write(line)
            f.write(line)
            n += 1
        rc = proc.wait()
    index = path.parent.parent / "README.md"
    row = index_row(path.name, command, rc, n)
    if index.exists():
        with index.open("a", encoding="utf-8") as f:
            f.write(row + "\n")
    print(f"[harness] log {path}; index {index if index.exists() else '(none: add this line) ' + row}",
          file=sys.stderr)
    return rc


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0
    if argv[0] == "show":
        return show(argv[1:])
    if argv[0] == "log":
        return log(argv[1:])
    print(f"unknown command {argv[0]!r}: use `show` or `log`", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())



def held(engine, fn):
    """fn(engine) on the engine thread between two requests (tests/engine_reads.py): a bench reads the
    engine's objects, or times raw mlx-lm on the engine's model on its own thread."""
    tests = str(Path(__file__).resolve().parent.parent / "tests")
    if tests not in sys.path:
        sys.path.insert(0, tests)
    from engine_reads import while_held       # lazy: the tests folder joins the path only when a bench asks
    return while_held(engine, fn, timeout=3600)
